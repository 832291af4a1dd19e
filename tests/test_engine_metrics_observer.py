"""The engine's metrics observer runs on the engine thread after every step: an output it cannot read must not
take the step loop down. A request whose first sequence was never stamped with a first-token time (n > 1 with
the first completion failed before its first token) still has tokens from the others."""
from __future__ import annotations

import time
import types

from kubeinfer.engine.core.outputs import CompletionOutput, RequestOutput
from kubeinfer.engine.entrypoints.metrics import EngineMetrics


def _metrics() -> EngineMetrics:
    engine = types.SimpleNamespace(speculator=None, block_manager=None)
    fake = types.SimpleNamespace(engine=engine, output_observers=[], abort_observers=[], num_running=0,
                                 num_waiting=0)
    return EngineMetrics(fake, "tiny")


def test_tokens_without_a_first_token_time_are_observed_not_raised():
    metrics = _metrics()
    arrival = time.monotonic() - 0.5
    completions = [CompletionOutput(0, "", []), CompletionOutput(1, "ab", [5, 6])]
    output = RequestOutput("r1", "hi", [1, 2], completions, finished=False, metrics={"arrival_time": arrival, "first_scheduled_time": arrival,
                                                    "first_token_time": None})
    metrics.observe([output])  # raised TypeError (None - float) before
    observed = {s.name: s.value for s in metrics.ttft._samples()}  # the labelled child's own samples
    assert observed["_count"] == 1.0 and observed["_sum"] >= 0.5  # counted from arrival, once
