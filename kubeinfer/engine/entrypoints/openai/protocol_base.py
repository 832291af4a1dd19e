"""What every request body shares: undeclared fields kept (and named in a warning, as vLLM does), and
declared fields refused with a 400 naming them unless their value asks for nothing.

The warning names at most MAX_LOGGED_FIELDS fields, each cut to MAX_LOGGED_NAME_CHARS and escaped (a name is
the client's text: a 1.7 MB body of field names made a 1.65 MB log line, issue #44); every ignored field is
counted (`kubeinfer:request_fields_ignored`, metrics.py).
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, PrivateAttr, ValidationInfo, field_validator

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
    # FastAPI validates the instance json_body.py made off the loop again, which reruns after-validators:
    # the warning (and its walk over every nested body) is made once.
    _fields_warned: bool = PrivateAttr(default=False)

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


MAX_LOGGED_FIELDS, MAX_LOGGED_NAME_CHARS = 16, 64


class IgnoredFieldCounter:
    """Ignored fields seen by this process (bodies are validated on worker threads too)."""

    def __init__(self) -> None:
        self._lock, self._total = threading.Lock(), 0

    def add(self, count: int) -> None:
        with self._lock:
            self._total += count

    @property
    def total(self) -> int:
        return self._total


IGNORED_FIELDS = IgnoredFieldCounter()


def loggable_names(names: list[str]) -> str:
    """The first names, each cut short, as a list's repr (control characters escaped), and how many more."""
    shown = [name if len(name) <= MAX_LOGGED_NAME_CHARS else name[:MAX_LOGGED_NAME_CHARS] + "..."
             for name in names[:MAX_LOGGED_FIELDS]]
    more = len(names) - len(shown)
    return f"{shown!r} and {more} more" if more else repr(shown)


def warn_about_ignored_fields(body: RequestModel) -> None:
    if body._fields_warned:
        return
    body._fields_warned = True
    if ignored := body.ignored_fields():
        IGNORED_FIELDS.add(len(ignored))
        logger.warning("The following fields were present in the request but ignored: %s", loggable_names(ignored))
