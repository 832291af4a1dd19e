"""What the picker needs from an OpenAI request: the model, the prompt text, and whether it may be shed.

A request is sheddable when its priority is below zero. The priority comes from, first to last: the
`x-gateway-inference-priority` header; the InferenceObjective the `x-gateway-inference-objective` header
names (the Inference Extension's convention); the model's configured priority (the InferenceModel's
`spec.routing.priority`); else 0. The two headers count only from a trusted hop (`--trust-priority-headers`:
a proxy in front that sets them itself); otherwise a client could make its own requests urgent. Every
priority is held to PRIORITY_RANGE.

The engines order their queues by the same priority, in vLLM's convention (lower runs first) where
the Inference Extension's is the opposite (higher is more important). `engine_priority` is the one
place the two meet; engine_body.py writes it into the body the engine receives. Engines honour it
under `--scheduling-policy priority` (the operator's pods and the local stack run so); the gateway
writes it, 0 included, with `--forward-priority` (the chart and the local stack set it), and otherwise
removes any priority a client wrote.
"""
from __future__ import annotations

import json
import re
from collections.abc import Mapping

from ..flowcontrol.deadline import deadline_of
from ..flowcontrol.token_estimate import completion_budget, estimate_request_tokens
from ..scheduling.picker import RoutingError, RoutingRequest
from .engine_body import wants_usage_added

PRIORITY_HEADER = "x-gateway-inference-priority"
OBJECTIVE_HEADER = "x-gateway-inference-objective"
PRIORITY_RANGE = (-1_000_000, 1_000_000)  # the engines' scheduler compares them; no client needs more


def prompt_text(body: dict) -> str:
    """The text prefix affinity hashes: a completion's prompt, a chat's messages in order, or a
    response's instructions and input (a string, or items shaped like messages)."""
    if "input" in body and "messages" not in body:  # the Responses API
        given = body.get("input")
        items = [{"role": "user", "content": given}] if isinstance(given, str) else given
        instructions = body.get("instructions")
        head = [{"role": "system", "content": instructions}] if isinstance(instructions, str) else []
        return prompt_text({"messages": head + (items if isinstance(items, list) else [])})
    if "messages" in body:
        parts = []
        for message in body.get("messages") or []:
            if not isinstance(message, dict):
                continue
            content = message.get("content")
            if isinstance(content, list):  # content parts
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(f"<{message.get('role', '')}>{content or ''}")
        return "".join(parts)
    prompt = body.get("prompt", "")
    if isinstance(prompt, list):
        if prompt and isinstance(prompt[0], str):
            return prompt[0]  # a batch: its first prompt decides affinity
        return " ".join(map(str, prompt[0] if prompt and isinstance(prompt[0], list) else prompt))
    return prompt if isinstance(prompt, str) else ""


def clamp_priority(priority: int) -> int:
    return max(PRIORITY_RANGE[0], min(PRIORITY_RANGE[1], priority))


def parse_request(raw_body: bytes, headers: Mapping[str, str], model_priorities: Mapping[str, int] | None = None,
                  objective_priorities: Mapping[str, int] | None = None,
                  trust_headers: bool = False, keep_body: bool = False) -> RoutingRequest:
    """Raises RoutingError(400) for a body the engines would reject anyway, before any routing.
    A request without a body (GET /v1/models, /health) may go to any endpoint. `keep_body`: the parsed body
    stays on the request (the precise prefix scorer tokenizes it); otherwise it is not kept alive."""
    if not raw_body:
        return RoutingRequest(model="")
    try:
        body = json.loads(raw_body)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise RoutingError(400, f"request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise RoutingError(400, "request body must be a JSON object")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RoutingError(400, "model: a model name is required")
    priority = (model_priorities or {}).get(model, 0)
    objective = headers.get(OBJECTIVE_HEADER) if trust_headers else None
    if objective is not None:  # an objective this gateway does not know has the default priority
        priority = (objective_priorities or {}).get(objective, 0)
    header = headers.get(PRIORITY_HEADER) if trust_headers else None
    if header is not None:
        if not re.fullmatch(r"\s*-?[0-9]{1,12}\s*", header):
            raise RoutingError(400, f"{PRIORITY_HEADER} must be an integer, got {header[:32]!r}")
        priority = int(header)
    priority = clamp_priority(priority)
    return RoutingRequest(model=model, prompt=prompt_text(body), sheddable=priority < 0, priority=priority,
                          max_tokens=completion_budget(body),
                          deadline=deadline_of(headers), estimated_tokens=estimate_request_tokens(body),
                          add_usage=wants_usage_added(body),
                          body=body if keep_body else None)


def engine_priority(gateway_priority: int) -> int:
    """The Inference Extension's priority (higher is more important, below 0 sheddable) as the engine's
    `priority` field (vLLM's: lower runs first)."""
    return -gateway_priority


