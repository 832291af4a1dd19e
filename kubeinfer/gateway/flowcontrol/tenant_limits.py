"""Per-tenant limits: a token bucket of requests, one of tokens, and a concurrency count.

Requests: `requestsPerSecond` refills a bucket that holds one second's worth (at least 1): short
bursts up to the rate pass, a sustained rate above it is refused.
Tokens: `tokensPerMinute` refills a bucket holding a minute's worth. A request is charged at admission
with an estimate (token_estimate.py: its prompts plus prompts x n x `max_tokens`), and the charge is
corrected to the engine's reported `usage` when the response ends (streams included: the gateway asks
for their usage, engine_body.py); the
bucket may go below zero then, which delays the tenant's next requests by its debt. Without a usage
report the estimate stands. A request larger than the whole bucket is admitted when the bucket is full
(else it could never run) and leaves the bucket in debt.
Concurrency: requests admitted and not yet ended, at most `maxConcurrency`.

Several gateway replicas each keep their own buckets: with `scope="replica"` (the default) a limit is
per replica, so a tenant spread over N replicas may get up to N times it; `scope="divided"` gives each
replica 1/N of every limit (`replicas=N`), exact when a Service spreads requests evenly.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from ..scheduling.picker import RoutingError
from .tenants import Tenant
from .token_estimate import DEFAULT_COMPLETION_ESTIMATE

SCOPES = ("replica", "divided")


class TokenBucket:
    def __init__(self, rate: float, capacity: float, clock=time.monotonic) -> None:
        self.rate, self.capacity, self.clock = rate, capacity, clock
        self.level, self._at = capacity, clock()

    def _refill(self) -> None:
        now = self.clock()
        self.level = min(self.capacity, self.level + (now - self._at) * self.rate)
        self._at = now

    def wait_for(self, amount: float) -> float:
        """Seconds until `amount` could be taken (0: now). Asks at most a full bucket."""
        self._refill()
        missing = min(amount, self.capacity) - self.level
        return max(0.0, missing / self.rate)

    def take(self, amount: float) -> None:
        self._refill()
        self.level -= amount

    def give_back(self, amount: float) -> None:
        self._refill()
        self.level = min(self.capacity, self.level + amount)


def estimate_tokens(prompt: str, max_tokens: int | None) -> int:
    """About four characters a token for English text: the correction at the end makes it exact."""
    return len(prompt) // 4 + 1 + (max_tokens or DEFAULT_COMPLETION_ESTIMATE)


@dataclass
class TenantState:
    tenant: Tenant
    requests: TokenBucket | None
    tokens: TokenBucket | None
    max_concurrency: int | None


@dataclass
class Charge:
    """What one admitted request holds: its tenant's concurrency slot and its token estimate."""
    state: TenantState
    tokens: int
    settled: bool = field(default=False)


class TenantLimits:
    def __init__(self, scope: str = "replica", replicas: int = 1, clock=time.monotonic) -> None:
        if scope not in SCOPES:
            raise ValueError(f"tenant limit scope is one of {', '.join(SCOPES)}, got {scope!r}")
        self.share = 1.0 / max(1, replicas) if scope == "divided" else 1.0
        self.clock = clock
        self._states: dict[str, TenantState] = {}
        self.in_flight: dict[str, int] = {}  # by tenant name: it outlives a reload that changes the limits

    def state(self, tenant: Tenant) -> TenantState:
        """Buckets live across reloads while a tenant's limits stay the same; new limits start full."""
        state = self._states.get(tenant.name)
        if state is None or state.tenant != tenant:
            rps = tenant.requests_per_second and tenant.requests_per_second * self.share
            tpm = tenant.tokens_per_minute and tenant.tokens_per_minute * self.share
            state = TenantState(
                tenant,
                TokenBucket(rps, max(1.0, rps), self.clock) if rps else None,
                TokenBucket(tpm / 60.0, tpm, self.clock) if tpm else None,
                max(1, math.floor(tenant.max_concurrency * self.share)) if tenant.max_concurrency else None)
            self._states[tenant.name] = state
        return state

    def admit(self, tenant: Tenant, tokens: int) -> Charge:
        """Takes a request slot, the token estimate and a concurrency slot, or raises RoutingError(429)
        naming the limit, with the seconds to wait as retry_after."""
        state = self.state(tenant)
        in_flight = self.in_flight.get(tenant.name, 0)
        if state.max_concurrency is not None and in_flight >= state.max_concurrency:
            raise RoutingError(429, f"tenant {tenant.name!r} has {in_flight} requests in flight, its "
                                    f"maxConcurrency limit of {state.max_concurrency}", retry_after=1)
        if state.requests is not None:
            wait = state.requests.wait_for(1)
            if wait > 0:
                raise RoutingError(429, f"tenant {tenant.name!r} is over its requestsPerSecond limit of "
                                        f"{state.requests.rate:g}", retry_after=math.ceil(wait))
        if state.tokens is not None:
            wait = state.tokens.wait_for(tokens)
            if wait > 0:
                raise RoutingError(429, f"tenant {tenant.name!r} is over its tokensPerMinute limit of "
                                        f"{state.tokens.capacity:g} (this request is estimated at {tokens} tokens)",
                                   retry_after=math.ceil(wait))
        if state.requests is not None:
            state.requests.take(1)
        if state.tokens is not None:
            state.tokens.take(tokens)
        self.in_flight[tenant.name] = in_flight + 1
        return Charge(state, tokens)

    def settle(self, charge: Charge, used_tokens: int | None) -> None:
        """The request ended: its concurrency slot is free, and its token charge becomes what it used
        (`used_tokens`; None: the estimate stands). Idempotent."""
        if charge.settled:
            return
        charge.settled = True
        self.in_flight[charge.state.tenant.name] -= 1
        bucket = charge.state.tokens
        if bucket is not None and used_tokens is not None:
            difference = used_tokens - charge.tokens
            if difference > 0:
                bucket.take(difference)
            else:
                bucket.give_back(-difference)
