"""`--speculative-config JSON` / `LLM(speculative_config={...})`, under vLLM's keys, checked with errors that say
what to change. Two keys are ours: `min_acceptance_rate` and `acceptance_window` (see speculator)."""
from __future__ import annotations

import json
from dataclasses import dataclass, fields

METHODS = ("ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    num_speculative_tokens: int
    method: str = "ngram"
    model: str | None = None  # the draft model's directory (method "draft_model")
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    disable_by_batch_size: int | None = None  # no speculation once this many requests are running or waiting
    # A request whose drafts are accepted less often pauses speculating; 0: never paused, neither for its acceptance
    # nor by the batch-1 switch on measured step costs (step_costs.py): speculation whatever it measures.
    min_acceptance_rate: float = 0.2
    acceptance_window: int = 16  # draft tokens between two looks at a request's acceptance rate

    @classmethod
    def parse(cls, value: str | dict | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """From a JSON string or a dict; None (or {}) means no speculation. Raises ValueError."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"speculative_config: not valid JSON ({error}); expected e.g. "
                                 '{"method": "ngram", "num_speculative_tokens": 4}') from None
        if not isinstance(value, dict):
            # ValueError, not TypeError: callers report every ValueError as a bad setting
            raise ValueError(f"speculative_config must be a JSON object, got {type(value).__name__}")  # noqa: TRY004
        if not value:
            return None
        value = dict(value)
        if value.get("model") in ("ngram", "[ngram]"):  # "[ngram]": vLLM's older spelling of method "ngram"
            del value["model"]
            value.setdefault("method", "ngram")
        elif "model" in value:
            value.setdefault("method", "draft_model")  # as vLLM: a model means a draft model
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config: num_speculative_tokens is required (how many tokens to propose "
                             "per step, e.g. 4)")
        # As in vLLM: one of the lookup bounds given sets the other too.
        if "prompt_lookup_max" in value and "prompt_lookup_min" not in value:
            value["prompt_lookup_min"] = min(value["prompt_lookup_max"], cls.prompt_lookup_min)
        if "prompt_lookup_min" in value and "prompt_lookup_max" not in value:
            value["prompt_lookup_max"] = max(value["prompt_lookup_min"], cls.prompt_lookup_max)
        return cls(**value)

    def __post_init__(self) -> None:
        def integer(name: str, low: int) -> None:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ValueError(f"speculative_config: {name} must be an integer >= {low}, got {v!r}")

        if self.method not in METHODS:
            hint = " (not supported yet)" if self.method in ("eagle", "eagle3", "medusa", "mtp") else ""
            raise ValueError(f"speculative_config: method must be one of {', '.join(METHODS)}, got "
                             f"{self.method!r}{hint}")
        if self.method == "draft_model" and not (isinstance(self.model, str) and self.model):
            raise ValueError('speculative_config: method "draft_model" needs "model": the draft model\'s directory '
                             "(a smaller model with the same tokenizer)")
        if self.method == "ngram" and self.model is not None:
            raise ValueError(f"speculative_config: n-gram speculation takes no model (got {self.model!r}); for a "
                             'draft model use {"model": DIR, "num_speculative_tokens": 4}')
        integer("num_speculative_tokens", 1)
        integer("prompt_lookup_min", 1)
        integer("prompt_lookup_max", 1)
        integer("acceptance_window", 1)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative_config: prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.disable_by_batch_size is not None:
            integer("disable_by_batch_size", 2)
        rate = self.min_acceptance_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate <= 1:
            raise ValueError(f"speculative_config: min_acceptance_rate must be in [0, 1], got {rate!r}")
