"""What the operator needs to know about one engine pod, read from the pod object."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from kubeinfer.operator.names import ADAPTERS_ANNOTATION, ROLE_LABEL, TEMPLATE_ANNOTATION

# Waiting reasons after which a container does not start by itself.
STUCK_REASONS = ("CrashLoopBackOff", "ImagePullBackOff", "ErrImagePull", "CreateContainerConfigError",
                 "InvalidImageName", "CreateContainerError")
# How much of a container's termination message a condition carries: the engine's own start-up error fits
# whole; a fetch container's log tail (terminationMessagePolicy FallbackToLogsOnError) keeps its first and
# last lines.
MESSAGE_HEAD, MESSAGE_TAIL = 300, 700
# A termination message is a container's text, copied into conditions every reader of the namespace sees and
# prints: the characters a terminal acts on (escape sequences, carriage returns, backspaces, C1 controls, bidi
# overrides) are dropped, whole escape sequences first (a coloured log keeps its words). Newlines and tabs stay:
# a message's lines still read as lines.
_ESCAPE_SEQUENCE = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)?|[@-Z\\-_])")
_TERMINAL_CONTROLS = dict.fromkeys([*range(0x00, 0x09), *range(0x0b, 0x20), *range(0x7f, 0xa0),
                                    *range(0x202a, 0x202f), *range(0x2066, 0x206a)])


@dataclass(frozen=True)
class PodView:
    name: str
    role: str | None = None
    ready: bool = False
    deleting: bool = False
    created: str = ""  # RFC 3339 sorts as text
    adapters: tuple[str, ...] = ()
    ip: str | None = None
    unschedulable: str | None = None  # the scheduler's message
    stuck: str | None = None  # "<container>: <reason>: <message>"
    failed: bool = False
    trouble_of: str | None = None  # the pod unschedulable / stuck describe, when not this one (a group's worker)
    template: str | None = None  # the hash of the template it was made from (template_hash.py), when stamped


def parse_adapters(value: str | None) -> tuple[str, ...]:
    return tuple(name.strip() for name in (value or "").split(",") if name.strip())


def _condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c.get("type") == kind), {})


def printable(text: str) -> str:
    return _ESCAPE_SEQUENCE.sub("", text).translate(_TERMINAL_CONTROLS)


def excerpt(text: str, head: int = MESSAGE_HEAD, tail: int = MESSAGE_TAIL) -> str:
    """`text` cut to head + tail characters around an ellipsis: a traceback's last line is its point."""
    text = text.strip()
    return text if len(text) <= head + tail + 5 else f"{text[:head].rstrip()} ... {text[-tail:].lstrip()}"


def last_words(item: dict[str, Any]) -> str | None:
    """A container's failed exit, from its current or last termination: exit code and termination message."""
    for key in ("state", "lastState"):
        ended = (item.get(key) or {}).get("terminated") or {}
        if ended and ended.get("exitCode") != 0:
            said = excerpt(printable(ended.get("message") or ""))
            why = said or ended.get("reason") or "no message"
            return f"exit code {ended.get('exitCode')}: {why}"
    return None


def _stuck(status: dict[str, Any]) -> str | None:
    for item in (status.get("initContainerStatuses") or []) + (status.get("containerStatuses") or []):
        state = item.get("state") or {}
        waiting = state.get("waiting") or {}
        if waiting.get("reason") in STUCK_REASONS:
            said = excerpt(printable(waiting.get("message") or ""))  # the runtime's words can quote the container's
            stuck = f"{item.get('name')}: {waiting['reason']}: {said}".rstrip(": ")
            words = last_words(item)  # CrashLoopBackOff alone says nothing of why: the last exit does
            return f"{stuck}; last {words}" if words else stuck
        if (state.get("terminated") or {}).get("exitCode", 0) != 0:  # crashed, not yet backing off
            return f"{item.get('name')}: Terminated: {last_words(item)}"
    return None


def pod_view(pod: dict[str, Any]) -> PodView:
    meta, status = pod.get("metadata") or {}, pod.get("status") or {}
    scheduled = _condition(status, "PodScheduled")
    unschedulable = None
    if scheduled.get("status") == "False" and scheduled.get("reason") == "Unschedulable":
        unschedulable = scheduled.get("message") or "Unschedulable"
    return PodView(
        name=meta["name"], role=(meta.get("labels") or {}).get(ROLE_LABEL),
        ready=_condition(status, "Ready").get("status") == "True" and not meta.get("deletionTimestamp"),
        deleting=bool(meta.get("deletionTimestamp")), created=meta.get("creationTimestamp") or "",
        adapters=parse_adapters((meta.get("annotations") or {}).get(ADAPTERS_ANNOTATION)),
        ip=status.get("podIP"), unschedulable=unschedulable, stuck=_stuck(status),
        failed=status.get("phase") in ("Failed", "Succeeded"),
        template=(meta.get("annotations") or {}).get(TEMPLATE_ANNOTATION))
