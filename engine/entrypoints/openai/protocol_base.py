"""What every request body shares: undeclared fields kept (and named in a warning, as vLLM does), and
declared fields refused with a 400 naming them unless their value asks for nothing."""
from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

logger = logging.getLogger(__name__)
# (value, the fields declared before it) -> whether that value asks for nothing
Trivial = Callable[[Any, dict], bool]


def unset(value: Any, _: dict) -> bool:
    return value is None or value is False or value == [] or value == {}


def one_of(*values: Any) -> Trivial:
    return lambda value, _: value is None or any(value == v and type(value) is type(v) for v in values)


NOT_YET = "not supported yet"


class RequestModel(BaseModel):
    """Keeps undeclared fields (to name them in a warning) and refuses the declared fields listed in
    `refused` whose value is not trivial, with a 400 whose `param` is the field."""
    model_config = ConfigDict(extra="allow")
    refused: ClassVar[dict[str, tuple[Trivial, str]]] = {}

    @field_validator("*")
    @classmethod
    def _refuse_unless_trivial(cls, value: Any, info: ValidationInfo) -> Any:
        rule = cls.refused.get(info.field_name)
        if rule is not None and not rule[0](value, info.data):
            raise ValueError(rule[1])
        return value

    def ignored_fields(self) -> list[str]:
        """Paths of the undeclared fields in this body and the bodies nested in it."""
        found = list(self.model_extra or {})
        for name in type(self).model_fields:
            value = getattr(self, name)
            for index, item in enumerate(value if isinstance(value, list) else [value]):
                if isinstance(item, RequestModel):
                    path = f"{name}[{index}]" if isinstance(value, list) else name
                    found += [f"{path}.{field}" for field in item.ignored_fields()]
        return found


def warn_about_ignored_fields(body: RequestModel) -> None:
    if ignored := body.ignored_fields():
        logger.warning("The following fields were present in the request but ignored: %s", ignored)
