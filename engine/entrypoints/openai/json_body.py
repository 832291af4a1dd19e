"""Request bodies parsed off the event loop: a route class whose requests decode large JSON bodies on a
worker thread. Parsing megabytes of JSON takes the CPU for tens of milliseconds or more, and on the
event loop that time is stolen from every stream and from /health (issue #34: a 40 MB body held
/health for 5 s). The body's size is bounded before this (kubeinfer.http_guard)."""
from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import Request
from fastapi.routing import APIRoute

OFF_LOOP_BYTES = 64 << 10  # below this, parsing costs less than the hand-off to a thread


class OffLoopJSONRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            self._json = await asyncio.to_thread(json.loads, body) if len(body) > OFF_LOOP_BYTES else json.loads(body)
        return self._json


class OffLoopJSONRoute(APIRoute):
    def get_route_handler(self):
        handler = super().get_route_handler()

        async def off_loop_json(request: Request):
            return await handler(OffLoopJSONRequest(request.scope, request.receive))
        return off_loop_json
