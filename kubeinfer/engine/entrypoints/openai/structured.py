"""The request fields that constrain output, read into one StructuredOutputsParams: OpenAI's
`response_format` (`json_object`, `json_schema`), vLLM's `structured_outputs` (`json`, `regex`,
`choice`, `grammar`, `json_object`) and its older `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar`. At most one may be set; a malformed one is a ValueError that starts with its name
(a 400 naming it). Whether the grammar itself compiles is checked when the request is prepared."""
from __future__ import annotations

from typing import Any

from ...sampling_params import StructuredOutputsParams

FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
SPEC_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def structured_outputs_of(body: Any) -> StructuredOutputsParams | None:
    given = [name for name in FIELDS if _asks_for_something(name, getattr(body, name, None))]
    if len(given) > 1:
        raise ValueError(f"{given[1]}: only one way to constrain the output may be used; {given[0]} is set too")
    if not given:
        return None
    name = given[0]
    value = getattr(body, name)
    if name == "response_format":
        return _response_format(value)
    if name == "structured_outputs":
        if not isinstance(value, dict) or set(value) - set(SPEC_KEYS):
            raise ValueError(f"structured_outputs must be an object with one of {', '.join(SPEC_KEYS)}")
        return _spec(name, **{k: v for k, v in value.items() if v is not None and v is not False})
    key = name.removeprefix("guided_")
    return _spec(name, **{key: value})


def _asks_for_something(name: str, value: Any) -> bool:
    if name == "response_format":
        return value is not None and value != {"type": "text"}
    return value is not None


def _response_format(value: Any) -> StructuredOutputsParams:
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_object":
        return _spec("response_format", json_object=True)
    if kind == "json_schema":
        inner = value.get("json_schema")
        schema = inner.get("schema") if isinstance(inner, dict) else None
        if not isinstance(schema, dict):
            raise ValueError("response_format: json_schema.schema must be a JSON Schema object")
        return _spec("response_format", json=schema)
    raise ValueError('response_format: type must be "text", "json_object" or "json_schema" '
                     f"(with json_schema.schema), got {kind!r}")


def _spec(field: str, **kwargs) -> StructuredOutputsParams:
    if "choice" in kwargs and isinstance(kwargs["choice"], list):
        kwargs["choice"] = tuple(kwargs["choice"])
    if "json" in kwargs and not isinstance(kwargs["json"], (dict, str)):
        raise ValueError(f"{field}: the JSON Schema must be an object (or a string holding one)")
    for key in ("regex", "grammar"):
        if key in kwargs and not isinstance(kwargs[key], str):
            raise ValueError(f"{field}: {key} must be a string")
    if "choice" in kwargs and not isinstance(kwargs["choice"], tuple):
        raise ValueError(f"{field}: choice must be a list of strings")
    try:
        return StructuredOutputsParams(field=field, **kwargs)
    except TypeError as error:
        raise ValueError(f"{field}: {error}") from None
