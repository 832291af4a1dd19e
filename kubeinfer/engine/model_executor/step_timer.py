"""Where a step's wall time goes: scheduling, input preparation, forward, sampling, the previous step's deferred
text, output processing, delivery.

The engine and the model runner call `mark(phase)` as each phase ends; the time since the previous mark
is charged to it. Off by default, a mark is one attribute test. When on, a mark on a GPU waits for the
device first, so that asynchronous kernels are charged to the phase that launched them (this changes
the timing it measures: use it to see the split, not the step rate). `StepProfileLog` turns the records
into one debug log line every `interval` steps.
"""
from __future__ import annotations

import logging
import time

import torch

# "text": the previous step's deferred text work and its hand-off, done inside this step (output_processor.py)
PHASES = ("schedule", "prepare", "forward", "sample", "text", "outputs", "deliver")


class StepTimer:
    def __init__(self, device: torch.device | None = None) -> None:
        self.enabled = False
        self._sync = device is not None and device.type == "cuda"
        self._last = 0.0
        self.current: dict[str, float] = {}  # this step's seconds per phase
        self.num_seqs = 0  # sequences in this step's batch
        self.all_decode = False  # every sequence of this step ran exactly one token
        self.records: list[tuple[int, bool, dict[str, float]]] = []  # finished steps, when keep_records
        self.keep_records = False
        self.log: StepProfileLog | None = None

    def start(self) -> None:
        """Opens a step (closing the previous one: the loop may still mark its delivery before this)."""
        if self.enabled:
            self.finish()
            self.current = {}
            self.num_seqs, self.all_decode = 0, False
            self._last = time.perf_counter()

    def mark(self, phase: str) -> None:
        if not self.enabled:
            return
        if self._sync:
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.current[phase] = self.current.get(phase, 0.0) + now - self._last
        self._last = now

    def finish(self) -> None:
        """Closes the open step, if one ran a batch, and hands it to the log and the records."""
        if not self.enabled or not self.num_seqs or not self.current:  # (num_seqs is set even when off)
            return
        if self.keep_records:
            self.records.append((self.num_seqs, self.all_decode, self.current))
        if self.log is not None:
            self.log.add(self.current, self.num_seqs)
        self.num_seqs = 0


class StepProfileLog:
    """Sums the timer's steps and logs their mean split every `interval` steps (at DEBUG)."""

    def __init__(self, logger: logging.Logger, interval: int = 100) -> None:
        self.logger, self.interval = logger, interval
        self._sums: dict[str, float] = {}
        self._steps = self._seqs = 0

    def add(self, phases: dict[str, float], num_seqs: int) -> None:
        for phase, seconds in phases.items():
            self._sums[phase] = self._sums.get(phase, 0.0) + seconds
        self._steps += 1
        self._seqs += num_seqs
        if self._steps >= self.interval:
            self.logger.debug("step profile: %s", format_split(self._sums, self._steps, self._seqs))
            self._sums, self._steps, self._seqs = {}, 0, 0


def format_split(sums: dict[str, float], steps: int, seqs: int) -> str:
    total = sum(sums.values())
    parts = ", ".join(f"{p} {1000 * sums.get(p, 0.0) / steps:.3f} ms" for p in PHASES)
    return (f"{steps} steps, mean batch {seqs / steps:.1f}, {1000 * total / steps:.3f} ms/step: {parts}; "
            f"host (not forward) {1 - sums.get('forward', 0.0) / total:.0%}" if total else "no time recorded")
