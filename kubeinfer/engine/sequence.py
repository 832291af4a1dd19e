"""One generation stream (its tokens, progress through the KV cache and stop state), and a step's batch
of them: what the scheduler hands the model runner."""
from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

import torch

from .sampling_params import SamplingParams

_arrival_counter = itertools.count()
# Async scheduling: the token a launched step will sample, in token_ids until its id reaches the host
# (core/async_scheduling.py); its input row is filled on the device from that step's sampled ids.
PENDING_TOKEN = -1


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class OutputTokens:
    """The generated part of a token list, for whatever has `token_ids` and `num_prompt_tokens`: a
    sequence, or the speculative sampler's view of one with some drafts accepted."""
    token_ids: list[int]
    num_prompt_tokens: int

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


class Sequence(OutputTokens):
    """A prompt and the tokens generated after it.

    `num_computed_tokens` counts tokens whose K/V are in the cache; the scheduler moves it forward
    chunk by chunk, and a preemption (recompute) resets it to 0.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 generator: torch.Generator, *, priority: int = 0, lora_id: int = 0, lora_generation: int = 0,
                 index: int = 0, arrival_time: float | None = None) -> None:
        self.request_id = request_id
        self.index = index  # which of the request's n completions this is
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.params = params
        self.generator = generator
        self.priority = priority
        self.lora_id = lora_id
        # Which registration of adapter `lora_id` this runs: ids may be reused after an unload, generations
        # never are, so the prefix cache keys on both (see LoRAManager.generation).
        self.lora_generation = lora_generation
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.arrival_order = next(_arrival_counter)
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache on first schedule
        self.block_table: list[int] = []
        self.num_hashed_blocks = 0  # leading blocks of block_table registered in the prefix cache
        self.block_hashes: list[bytes] = []  # prefix-cache keys of those blocks
        # On models mixing sliding-window and full layers: the windowed layers' own blocks (core/window_blocks.py)
        self.window_blocks = None
        self.num_preemptions = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.error: str | None = None  # why the engine gave up on it (finish_reason "abort")
        self.logprobs: list[dict] | None = [] if params.logprobs is not None else None
        # Structured output: the grammar matcher that says which tokens may come next (engine.structured_output).
        self.grammar = None
        # Speculative decoding: guessed tokens after the last one, verified by the next forward pass (spec_decode).
        # Never part of token_ids; the scheduler computes them as extra query tokens, then they are dropped.
        self.spec_token_ids: list[int] = []
        # A draft model's distributions q of sampled drafts ([drafts, vocab], each row sums to 1), for the
        # acceptance rule min(1, p / q); None when the drafts are point guesses (greedy, n-gram).
        self.spec_draft_probs: torch.Tensor | None = None
        self.cumulative_logprob = 0.0
        self.pending_row = 0  # async scheduling: this sequence's row in the launched step's sampled ids
        # timing, for metrics
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    @property
    def schedule_key(self) -> tuple[int, int]:
        """Lower runs first: priority (lower value = more urgent, as in vLLM), then arrival."""
        return (self.priority, self.arrival_order)

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)


@dataclass
class ScheduledBatch:
    # (sequence, number of tokens to compute this step), one-token queries first
    entries: list[tuple[Sequence, int]] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[Sequence] = field(default_factory=list)  # finished unrun: their adapter could not be loaded

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.entries)

    def __bool__(self) -> bool:
        return bool(self.entries)

    @staticmethod
    def is_decode(seq: Sequence, num_new: int) -> bool:
        """A one-token query (a decode, or a prompt's last token) takes the batched decode path."""
        return num_new == 1
