"""What the operator remembers about one InferenceModel between passes: only what makes passes cheaper,
coalesced or retried (the world itself is read again by every pass)."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any


@dataclass
class ModelState:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    dirty: bool = False
    autoscale: bool = False  # a resync asked for autoscaling; survives coalescing into a running pass
    applied: int | None = None  # generation whose owned objects were all applied
    observed: dict[str, dict[str, Any] | None] = field(default_factory=dict)  # kind -> last watched (None: deleted)
    suspects: set[str] = field(default_factory=set)  # kinds watched changing since the last pass
    desired: dict[str, dict[str, Any]] = field(default_factory=dict)  # kind -> what the last pass would apply
    invalid_reported: tuple[int, str] | None = None  # (generation, reason) whose refusal Event was recorded
    failure_reported: str | None = None  # the last failure logged: one line per distinct failure, not per pass
    attempts: int = 0  # consecutive retried failures (the backoff exponent)
    later: asyncio.Task[None] | None = None  # a pass scheduled for later (retry, adapter re-check)
