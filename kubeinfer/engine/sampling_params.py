"""Per-request sampling parameters, named and defaulted as in vLLM so users know them."""
from __future__ import annotations

from dataclasses import dataclass, field

# Below this a temperature is treated as greedy: dividing logits by it would overflow.
GREEDY_EPSILON = 1e-5
# What torch.Generator.manual_seed takes: any signed or unsigned 64-bit integer.
SEED_RANGE = (-2**63, 2**64)
# OpenAI's bound on a logit bias: +-100 is already "always" / "never".
MAX_LOGIT_BIAS = 100.0


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Output constrained to a grammar, named as in vLLM: exactly one of `json` (a JSON Schema, as a dict or
    a string), `json_object` (any JSON object), `regex`, `choice` (one of these strings) or `grammar`
    (Lark, or GBNF as llama.cpp writes it). `field` is the request field it came from, for error messages."""
    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    field: str = "structured_outputs"

    def __post_init__(self) -> None:
        given = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None] + \
            (["json_object"] if self.json_object else [])
        if len(given) != 1:
            raise ValueError(f"{self.field} needs exactly one of json, json_object, regex, choice or grammar; "
                             f"got {given or 'none'}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"{self.field}: choice must be a non-empty list of non-empty strings")

    @property
    def kind(self) -> str:
        return "json_object" if self.json_object else next(
            k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    logprobs: int | None = None  # top-N logprobs per generated token (the sampled one is always included)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling (OpenAI's)
    allowed_token_ids: list[int] | None = None  # only these may be sampled (vLLM's)
    structured_outputs: StructuredOutputsParams | None = None  # output constrained to a grammar
    # Filled by the engine, not by users: ids that end generation (EOS from generation_config).
    eos_token_ids: frozenset[int] = field(default_factory=frozenset, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias) if self.logit_bias else None
        if self.allowed_token_ids is not None:  # None: no restriction; [] is refused, not read as "none"
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def check(ok: bool, name: str, message: str) -> None:
            if not ok:
                raise ValueError(f"{name} {message}")

        def is_int(value: object) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        check(is_int(self.n) and self.n >= 1, "n", f"must be an integer >= 1, got {self.n!r}")
        check(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        check(0 < self.top_p <= 1, "top_p", f"must be in (0, 1], got {self.top_p}")
        check(is_int(self.top_k) and self.top_k >= 0, "top_k", f"must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}")
        check(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        check(self.repetition_penalty > 0, "repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        check(-2 <= self.frequency_penalty <= 2, "frequency_penalty", f"must be in [-2, 2], got {self.frequency_penalty}")
        check(-2 <= self.presence_penalty <= 2, "presence_penalty", f"must be in [-2, 2], got {self.presence_penalty}")
        check(self.seed is None or (is_int(self.seed) and SEED_RANGE[0] <= self.seed < SEED_RANGE[1]), "seed",
              f"must be an integer in [-2**63, 2**64), got {self.seed!r}")
        check(self.max_tokens is None or (is_int(self.max_tokens) and self.max_tokens >= 1), "max_tokens",
              f"must be an integer >= 1, got {self.max_tokens!r}")
        check(is_int(self.min_tokens) and self.min_tokens >= 0, "min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
              f"must be <= max_tokens={self.max_tokens}, got {self.min_tokens}")
        check(self.logprobs is None or (is_int(self.logprobs) and self.logprobs >= 0), "logprobs",
              f"must be an integer >= 0, got {self.logprobs!r}")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings")
        check(all(is_int(t) and t >= 0 for t in self.stop_token_ids), "stop_token_ids", "must be non-negative integers")
        bias = self.logit_bias or {}
        check(all(is_int(t) and t >= 0 for t in bias), "logit_bias", "keys must be token ids (non-negative integers)")
        out_of_range = [(t, v) for t, v in bias.items()
                        if isinstance(v, bool) or not isinstance(v, (int, float)) or not abs(v) <= MAX_LOGIT_BIAS]
        check(not out_of_range, "logit_bias", f"values must be numbers in [-100, 100], got {dict(out_of_range[:1])}")
        allowed = self.allowed_token_ids
        check(allowed is None or len(allowed) > 0, "allowed_token_ids", "must not be empty (null: no restriction)")
        check(all(is_int(t) and t >= 0 for t in allowed or ()), "allowed_token_ids",
              "must be token ids (non-negative integers)")

    def check_token_ids(self, vocab_size: int) -> None:
        """Refuse token ids the model does not have; run by whoever knows the vocabulary (the engine)."""
        for name, ids in (("logit_bias", self.logit_bias or {}), ("allowed_token_ids", self.allowed_token_ids or ())):
            outside = sorted(t for t in ids if t >= vocab_size)
            if outside:
                raise ValueError(f"{name} has token id {outside[0]}, outside the model's vocabulary of {vocab_size}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPSILON

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def uses_filters(self) -> bool:
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0
