"""A request's time to first token is its first sequence's to produce one, whichever of its n sequences that
is: with the first completion failed before its first token and another one generating, the output's
metrics still carry a first-token time, and the metrics observer (on the engine thread after every step)
counts it instead of raising (None - float took the step loop down before)."""
from __future__ import annotations

import time
import types

import torch

from kubeinfer.engine.core.detokenizer import StopStringMatcher
from kubeinfer.engine.core.request import Completion, Request
from kubeinfer.engine.entrypoints.metrics import EngineMetrics
from kubeinfer.engine.sampling_params import SamplingParams
from kubeinfer.engine.sequence import Sequence


def _metrics() -> EngineMetrics:
    engine = types.SimpleNamespace(speculator=None, block_manager=None)
    fake = types.SimpleNamespace(engine=engine, output_observers=[], abort_observers=[], num_running=0,
                                 num_waiting=0)
    return EngineMetrics(fake, "tiny")


def test_first_token_time_comes_from_whichever_sequence_produced_one():
    params = SamplingParams(n=2, max_tokens=4)
    arrival = time.monotonic() - 0.5
    seqs = [Sequence("r1", [1, 2], params, torch.Generator(), index=i, arrival_time=arrival) for i in range(2)]
    request = Request("r1", None, [1, 2], params, [Completion(s, None, StopStringMatcher(params)) for s in seqs],
                      arrival_time=arrival)
    for token in (5, 6):  # only the second sequence generates; the first has not produced a token
        request.completions[1].add_token_id(token, None, time.monotonic(), max_model_len=64)
    output = request.to_output()
    assert output.metrics["first_token_time"] == seqs[1].first_token_time

    metrics = _metrics()
    metrics.observe([output])  # raised TypeError (None - float) when only the first sequence was read
    observed = {s.name: s.value for s in metrics.ttft._samples()}  # the labelled child's own samples
    assert observed["_count"] == 1.0 and observed["_sum"] >= 0.5  # counted from arrival, once
