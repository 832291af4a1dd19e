"""The body an engine receives for a client's request, written by the gateway in one pass.

  * `priority`: always the gateway's decision, 0 included, when it forwards priorities (the engines run
    `--scheduling-policy priority`); without --forward-priority a client's own `priority` is removed, so
    that no client orders an engine's queue by itself (issue #34: a client's −100 preempted others).
  * `model`: the fallback's name when a fallback serves the request.
  * `stream_options.include_usage`: added to a stream that did not ask for it, so that the engine reports
    what the request used and the tenant's token charge is corrected (the extra usage chunk is removed
    from what the client receives: usage_strip.py).
A body that needs none of these is forwarded byte for byte.
"""
from __future__ import annotations

import json


def wants_usage_added(body: dict) -> bool:
    """A stream whose client did not ask for its usage: the gateway asks for it, and strips it. (A stream
    of the Responses API, whose body has `input`, always ends with its usage in response.completed.)"""
    options = body.get("stream_options")
    asked = isinstance(options, dict) and options.get("include_usage") is True
    return body.get("stream") is True and not asked and "input" not in body


def engine_body(raw: bytes, *, priority: int | None, model: str | None = None, add_usage: bool = False) -> bytes:
    """`priority`: the engine's priority to write; None: remove any the client wrote. `model`: the model to
    name instead of the client's. `add_usage`: ask a stream for its usage."""
    if not raw:
        return raw
    body = json.loads(raw)  # parse_request has already checked it is a JSON object
    changed = False
    if priority is not None:
        changed = body.get("priority") != priority or "priority" not in body
        body["priority"] = priority
    elif "priority" in body:
        del body["priority"]
        changed = True
    if model is not None and body.get("model") != model:
        body["model"], changed = model, True
    if add_usage and wants_usage_added(body):
        options = body.get("stream_options") if isinstance(body.get("stream_options"), dict) else {}
        # Per-chunk usage is only given with include_usage: the client asked for none, so it gets none.
        body["stream_options"] = {**options, "include_usage": True,
                                  **({"continuous_usage_stats": False} if "continuous_usage_stats" in options else {})}
        changed = True
    return json.dumps(body).encode() if changed else raw
