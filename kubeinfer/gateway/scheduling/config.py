"""The picker's settings, from the gateway's flags: scorer weights, saturation thresholds, staleness, fallbacks,
the routing policy, and optionally an EndpointPickerConfig document that replaces the default profile."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .framework import PluginHandle
from .profiles import configured_profiles
from .registry import registered

# prefix outweighs queue + active together, so a long shared prompt goes home even when home has one
# more request in flight than its peers (measured in benchmarks/routing_sim.py: no cost in TTFT there).
# affinity only nudges: it matters for a prompt no pod has seen, and there it makes independent gateway
# replicas agree (routing_sim.py, 4 replicas at 100 pods: TTFT p95 359 -> 246 ms; one replica unchanged).
DEFAULT_WEIGHTS = {"queue": 2.0, "active": 1.0, "kv_cache": 1.0, "lora": 2.0, "prefix": 4.0, "affinity": 1.0}
POLICIES = ("scored", "round-robin")


@dataclass
class PickerConfig:
    weights: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_WEIGHTS))
    queue_threshold: float = 5.0  # waiting requests at which an endpoint is saturated
    kv_threshold: float = 0.8  # KV-cache usage at which an endpoint is saturated
    stale_after: float = 5.0  # seconds after which a scrape is no longer trusted
    max_failures: int = 3  # consecutive failed scrapes that take an endpoint out
    fallbacks: int = 2
    policy: str = "scored"  # or "round-robin": the load-blind baseline
    scheduler: dict[str, Any] | None = None  # --scheduler-config: profiles in place of weights and policy

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown routing policy {self.policy!r}; choose one of {', '.join(POLICIES)}")
        known = registered("scorer")
        unknown = set(self.weights) - set(known)
        if unknown:
            raise ValueError(f"unknown scorer(s) {', '.join(sorted(unknown))}; known: {', '.join(known)}")
        if any(w < 0 for w in self.weights.values()):
            raise ValueError("scorer weights must be >= 0")
        if self.scheduler is not None:
            configured_profiles(self.scheduler, PluginHandle())  # fails now, with its reason, not at a pick
