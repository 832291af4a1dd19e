"""Async scheduling (vLLM's `--async-scheduling`, SGLang's overlap scheduler): step N+1 is scheduled,
prepared and launched before step N's token ids reach the host, so a GPU goes from one step to the next
without waiting for the host in between.

Each launched step leaves a `PENDING_TOKEN` at the end of every sequence it samples for: the scheduler
counts it like any token (one more to compute, its KV slot allocated), and the model runner fills its
input row on the device from the step's sampled ids (`ModelRunner.execute(previous_ids=...)`). Once step
N+1 is launched, step N's ids are read: the pending tokens are replaced by them and processed as in a
synchronous step (stops, text, outputs). What the host learns late costs compute, never output:
a sequence that ended at step N (EOS, a stop string, its length) ran once more in step N+1, and that
token is dropped. Blocks it gives back are only handed out by a later schedule, whose launch the device
runs after step N+1. Prefix-cache blocks are registered only once their token ids are all known.

A step that needs the token values on the host before it runs goes back to the synchronous path: every
scheduled sequence must be `pipeline_safe` (no penalties, which count the output tokens, and no grammar,
whose mask follows them), and there must be no speculative decoding (drafts are built from them).
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from ..model_executor.sampler import SampleResult
from ..sequence import PENDING_TOKEN, Sequence
from .outputs import RequestOutput


@dataclass
class LaunchedStep:
    sampled_seqs: list[Sequence]
    result: SampleResult


def pipeline_safe(seq: Sequence) -> bool:
    """Whether the next step may be prepared before this sequence's newest token is known on the host."""
    return seq.grammar is None and not seq.params.uses_penalties


class StepPipeline:
    """Drives LLMEngine one launched step ahead of the host (see the module docstring)."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.launched: LaunchedStep | None = None  # the step whose ids have not been read yet

    def step(self) -> list[RequestOutput]:
        engine, scheduler = self.engine, self.engine.scheduler
        if not self._can_run_ahead():
            launched, self.launched = self.launched, None
            return (self._read(launched) if launched else []) + engine.synchronous_step()
        engine.step_timer.start()
        batch, outputs = engine.schedule()
        previous, self.launched = self.launched, None
        if not batch:
            return outputs + (self._read(previous) if previous else []) + engine.outputs.finish({})
        try:
            sampled_seqs, result = engine.runner.execute(batch, previous.result.device_ids if previous else None)
        except Exception as error:
            outputs += self._read(previous) if previous else []  # its tokens are good
            raise engine.step_failed(error, batch, outputs) from error
        scheduler.advance(batch)
        for row, seq in enumerate(sampled_seqs):
            seq.append_token(PENDING_TOKEN)
            seq.pending_row = row
        self.launched = LaunchedStep(sampled_seqs, result)
        if previous is not None:  # the device runs this step meanwhile
            outputs += self._read(previous)
        scheduler.commit(batch)  # its inputs' ids are all known now
        engine.step_timer.mark("deliver")
        return outputs

    def _can_run_ahead(self) -> bool:
        engine = self.engine
        scheduler = engine.scheduler
        return engine.speculator is None and all(pipeline_safe(s) for s in scheduler.running + scheduler.waiting)

    def _read(self, step: LaunchedStep) -> list[RequestOutput]:
        """Step `step`'s ids to the host: its pending tokens become real ones, with stops, text and outputs."""
        step.result.wait()
        newer = self.launched.sampled_seqs if self.launched is not None else []
        for seq in (*step.sampled_seqs, *newer):  # no output may show a pending token
            while seq.token_ids and seq.token_ids[-1] == PENDING_TOKEN:
                seq.token_ids.pop()
        outputs = self.engine.outputs.add_step(step.sampled_seqs, step.result, time.monotonic(),
                                               mark=self.engine.step_timer.mark)
        for seq in newer:  # the launched step still samples for them
            if not seq.is_finished:
                seq.append_token(PENDING_TOKEN)
        return outputs

    @property
    def busy(self) -> bool:
        return self.launched is not None
