"""A varied set of JSON Schemas for structured-output tests and benchmarks: nested objects, bounded
arrays, enums, numeric ranges, required and optional fields, string patterns and formats, anyOf.

Every string and number is bounded, so that even a random-init model (whose every next token is as
likely as any other the grammar allows) finishes a document within a few hundred tokens."""
from __future__ import annotations

SCHEMAS: dict[str, dict] = {
    "flat": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
             "required": ["name", "age"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 9999}, "tags": {
            "type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3}},
            "required": ["id", "tags"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "bounded_array": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9},
                      "minItems": 2, "maxItems": 4},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                              "size": {"type": "string", "enum": ["S", "M", "L"]}},
             "required": ["color", "size"], "additionalProperties": False},
    "ranges": {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 1},
                                                "count": {"type": "integer", "minimum": 10, "maximum": 99}},
               "required": ["score", "count"], "additionalProperties": False},
    "optional": {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"type": "string", "maxLength": 5},
                                                  "c": {"type": "null"}},
                 "required": ["a"], "additionalProperties": False},
    "pattern": {"type": "object", "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
                "required": ["code"], "additionalProperties": False},
    "format": {"type": "object", "properties": {"day": {"type": "string", "format": "date"},
                                                "contact": {"type": "string", "format": "email", "maxLength": 24}},
               "required": ["day", "contact"], "additionalProperties": False},
    "any_of": {"type": "object", "properties": {"value": {"anyOf": [{"type": "integer", "minimum": -50, "maximum": 50}, {"type": "string",
                                                                                          "maxLength": 4}]}},
               "required": ["value"], "additionalProperties": False},
    "array_of_objects": {"type": "array", "maxItems": 2, "items": {
        "type": "object", "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 99},
                                      "y": {"type": "integer", "minimum": 0, "maximum": 99}},
        "required": ["x", "y"], "additionalProperties": False}},
    "const_and_bool": {"type": "object", "properties": {"kind": {"const": "point"}, "ok": {"type": "boolean"}},
                       "required": ["kind", "ok"], "additionalProperties": False},
    "defs": {"$defs": {"item": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                                "required": ["n"],
                                "additionalProperties": False}},
             "type": "object", "properties": {"first": {"$ref": "#/$defs/item"},
                                              "rest": {"type": "array", "items": {"$ref": "#/$defs/item"},
                                                       "maxItems": 2}},
             "required": ["first", "rest"], "additionalProperties": False},
}
