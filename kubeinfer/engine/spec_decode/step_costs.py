"""The batch-1 switch by measured step costs: speculation pays when a verify step's tokens per second beat a plain
decode step's, `tokens_per_verify / verify_seconds > 1 / plain_seconds`. Neither cost is known in advance (it
depends on the model, the CPU level, whether the verify step takes the native decode path, the load), so both are
measured: the engine reports each batch-1 decode step's wall time (`record`), plain and verifying apart, and the
tokens each verify step produced (accepted drafts + 1).

While speculating, a plain step is rare (only where the proposer finds nothing), so one step in `probe_every`
runs plain on purpose to keep that cost current. Once `min_samples` verify steps are measured and speculation
loses, it is off for `pause` batch-1 steps, doubling each time it loses again (up to MAX_PAUSE), and the verify
cost is measured afresh when it comes back on (the text, the load or the context length may have changed)."""
from __future__ import annotations

import logging
from dataclasses import dataclass

logger = logging.getLogger(__name__)

FIRST_PAUSE = 32  # batch-1 steps without speculation after it first measured as a loss
MAX_PAUSE = 1024


@dataclass
class Average:
    """An exponential moving average (the first sample taken as it is) and how many samples it has seen."""
    weight: float = 0.25
    value: float = 0.0
    count: int = 0

    def add(self, sample: float) -> None:
        self.value = sample if self.count == 0 else self.value + self.weight * (sample - self.value)
        self.count += 1

    def reset(self) -> None:
        self.value, self.count = 0.0, 0


class StepCosts:
    def __init__(self, probe_every: int = 64, min_samples: int = 4) -> None:
        self.probe_every = probe_every
        self.min_samples = min_samples
        self.plain = Average()  # seconds of a plain batch-1 decode step
        self.verify = Average()  # seconds of a batch-1 verify step
        self.tokens = Average()  # tokens a batch-1 verify step produced
        self.steps = 0  # batch-1 decode steps asked about
        self.since_plain = 0  # batch-1 steps since the last plain one measured
        self.off_until = 0  # no speculation at batch 1 before this step
        self.pause = FIRST_PAUSE
        self.times_off = 0  # how often it measured a loss (tests, logs)

    def speculate(self) -> bool:
        """Whether the coming batch-1 decode step may speculate."""
        self.steps += 1
        if self.steps < self.off_until:
            return False
        # A plain step first (no cost to compare with yet), and one every probe_every to keep it current.
        return self.plain.count > 0 and self.since_plain < self.probe_every

    def record(self, seconds: float, tokens: int | None) -> None:
        """A batch-1 decode step's wall time; `tokens`: what it produced when it verified drafts, None when plain."""
        if tokens is None:
            self.plain.add(seconds)
            self.since_plain = 0
            return
        self.since_plain += 1
        self.verify.add(seconds)
        self.tokens.add(tokens)
        if self.verify.count < self.min_samples or self.plain.count == 0:
            return
        gain = self.gain
        if gain >= 1.0:
            self.pause = FIRST_PAUSE
            return
        self.off_until = self.steps + self.pause
        if self.times_off == 0:
            logger.info("speculative decoding off at batch 1 for %d steps: a verify step (%.2f ms, %.2f tokens) "
                        "gives %.2fx the tokens/s of a plain step (%.2f ms); measured again after", self.pause,
                        1e3 * self.verify.value, self.tokens.value, gain, 1e3 * self.plain.value)
        self.times_off += 1
        self.pause = min(2 * self.pause, MAX_PAUSE)
        self.verify.reset()
        self.tokens.reset()

    @property
    def gain(self) -> float:
        """Verify steps' tokens/s over plain steps' (0 until both are measured)."""
        if not (self.verify.count and self.plain.count and self.verify.value > 0):
            return 0.0
        return self.tokens.value * self.plain.value / self.verify.value
