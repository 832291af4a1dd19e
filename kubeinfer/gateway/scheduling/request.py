"""What one routing decision takes and gives: the request as the picker sees it, the decision, and the error
that answers the client when no endpoint can take the request. Shared by the picker, its plugins and the
layers above (flow control, handlers), which import them from picker.py."""
from __future__ import annotations

from dataclasses import dataclass

from ..datastore.endpoints import Endpoint
from .prefix import affinity_key, chunk_hashes


class RoutingError(Exception):
    """No endpoint can take the request; `status` is the HTTP status to answer with."""

    def __init__(self, status: int, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.retry_after = status, message, retry_after


@dataclass
class RoutingRequest:
    model: str  # empty: any endpoint will do (e.g. GET /v1/models)
    prompt: str = ""  # text the prefix scorer hashes (the prompt, or the chat messages)
    sheddable: bool = False
    subset: frozenset[str] | None = None  # the data plane's subset hint: only these addresses may be picked
    priority: int = 0  # the Inference Extension's: higher is more important, below 0 sheddable
    exclude: frozenset[str] = frozenset()  # addresses already tried for this request (a retry picks again)
    hashes: list[int] | None = None  # the prompt's prefix-chunk hashes, computed once per request
    affinity: int | None = None  # prefix.affinity_key of the prompt, computed once per request
    max_tokens: int | None = None  # the completion budget the client asked for (tenant token estimate)
    requested_model: str = ""  # the model the client named, when a fallback serves it instead
    ticket: object | None = None  # the tenant admission (tenant_gate.Ticket), settled when the request ends
    deadline: float | None = None  # monotonic end of the client's time budget (x-request-timeout-ms)
    estimated_tokens: int | None = None  # token_estimate.py: what admission charges the tenant
    add_usage: bool = False  # a stream whose usage the gateway asks for, and strips (engine_body.py)
    body: dict | None = None  # the parsed body, for the precise scorer's tokenizer
    token_ids: list[int] | None = None  # the prompt's token ids ([]: not knowable here), computed once

    def affinity_key(self) -> int:
        if self.affinity is None:
            self.affinity = affinity_key(self.model, self.prompt)
        return self.affinity

    def prefix_hashes(self) -> list[int]:
        if self.hashes is None:
            self.hashes = chunk_hashes(self.model, self.prompt)
        return self.hashes


@dataclass
class Decision:
    endpoint: Endpoint
    fallbacks: list[Endpoint]
    scores: dict[str, float]
    sent: float = 0.0  # the dispatch ticket: hand it to endpoint.record_finish when the request ends

    @property
    def destination(self) -> str:
        """Envoy's x-gateway-destination-endpoint value: the pick, then fallbacks, comma-separated."""
        return ",".join(e.address for e in [self.endpoint, *self.fallbacks])
