"""Request bodies parsed and validated off the event loop: a route class whose large JSON bodies are
decoded and validated against the route's model on a worker thread. Parsing megabytes of JSON, or
validating a list of millions of token ids, takes the CPU for up to seconds, and on the event loop that
time is stolen from every stream and from /health (issue #34: a 40 MB body held /health for 5 s). The
body's size is bounded before this (kubeinfer.common.http_guard).

The validated model is handed to FastAPI in place of the parsed JSON: validating an instance of the
model itself is free (pydantic does not revalidate instances), so FastAPI's own step costs nothing.
"""
from __future__ import annotations

import asyncio
import json

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError

OFF_LOOP_BYTES = 64 << 10  # below this, parsing costs less than the hand-off to a thread


def _is_json(request: Request) -> bool:
    content_type = request.headers.get("content-type")
    return content_type is None or "json" in content_type.split(";")[0]


class OffLoopJSONRoute(APIRoute):
    def get_route_handler(self):
        handler = super().get_route_handler()
        model = getattr(self.body_field, "field_info", None) and self.body_field.field_info.annotation
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return handler

        def parse_and_validate(body: bytes) -> BaseModel:
            return model.model_validate(json.loads(body))

        async def off_loop_json(request: Request):
            body = await request.body()
            if len(body) > OFF_LOOP_BYTES and _is_json(request):
                try:
                    request._json = await asyncio.to_thread(parse_and_validate, body)  # what request.json() returns
                except ValidationError as error:
                    raise RequestValidationError([{**e, "loc": ("body", *e["loc"])}
                                                  for e in error.errors(include_url=False)]) from None
                except json.JSONDecodeError as error:  # as FastAPI reports it, without parsing again on the loop
                    raise RequestValidationError([{"type": "json_invalid", "loc": ("body", error.pos),
                                                   "msg": "JSON decode error", "input": {},
                                                   "ctx": {"error": error.msg}}]) from None
                except UnicodeDecodeError:
                    pass  # FastAPI reports it as it always does
            return await handler(request)
        return off_loop_json
