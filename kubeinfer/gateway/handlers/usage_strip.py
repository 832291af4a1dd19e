"""Removes, from a stream relayed to a client, the usage event the gateway asked for on its behalf
(engine_body.py): the client did not ask for `stream_options.include_usage`, so it gets the stream it
would have had. The usage has been read before this (the tenant ticket sees every byte first).

Events end with a blank line; bytes after the last complete event wait for the next chunk, and only
events that mention "usage" are parsed, so the cost is a search per chunk. A held tail is bounded:
past MAX_HELD bytes it is passed on as it is (it cannot be the small usage event).
"""
from __future__ import annotations

import json

MAX_HELD = 1 << 20


def is_usage_only(event: bytes) -> bool:
    """An event that carries usage and no choices: the one `include_usage` adds at the end."""
    if b'"usage"' not in event:
        return False
    data = event.strip()
    if not data.startswith(b"data:"):
        return False
    try:
        document = json.loads(data[5:])
    except (ValueError, UnicodeDecodeError):
        return False
    return isinstance(document, dict) and document.get("choices") == [] and "usage" in document


class UsageEventStripper:
    def __init__(self) -> None:
        self._held = b""

    def feed(self, chunk: bytes) -> bytes:
        """The bytes of `chunk` (and of earlier held ones) to pass on now."""
        data = self._held + chunk
        end = data.rfind(b"\n\n")
        if end < 0:
            if len(data) > MAX_HELD:
                self._held = b""
                return data
            self._held = data
            return b""
        complete, self._held = data[:end + 2], data[end + 2:]
        if b'"usage"' not in complete:
            return complete
        return b"".join(e + b"\n\n" for e in complete[:-2].split(b"\n\n") if not is_usage_only(e))

    def flush(self) -> bytes:
        held, self._held = self._held, b""
        return held
