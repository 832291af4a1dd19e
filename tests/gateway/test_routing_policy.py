"""The round-robin routing policy (the routing benchmark's baseline) and the benchmark's pool simulator.

The simulator's pod model is checked against step costs computed by hand from its cost model, so the
simulated comparison in benchmarks/RESULTS.md rests on arithmetic that can be verified, and the
benchmark's own helpers run here on tiny inputs so they cannot rot unnoticed.
"""
from __future__ import annotations

import argparse
import itertools
import math
import random
import sys
from collections import Counter
from pathlib import Path

import pytest

from kubeinfer.gateway import cli
from kubeinfer.gateway.datastore.endpoints import Endpoint, EndpointPool, EngineState
from kubeinfer.gateway.scheduling.picker import Picker, PickerConfig, RoutingError, RoutingRequest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import routing_sim as sim  # noqa: E402


def endpoint(address: str, *, waiting: float = 0, kv: float = 0.0, adapters=()) -> Endpoint:
    e = Endpoint(address=address)
    e.record_scrape(EngineState(waiting=waiting, kv_usage=kv, max_loras=4), frozenset({"base", *adapters}),
                    frozenset({"base"}))
    return e


def picker(*endpoints: Endpoint, **config) -> Picker:
    pool = EndpointPool()
    pool.set_members(list(endpoints))
    return Picker(pool, PickerConfig(**config), rng=random.Random(0))


# -- the round-robin policy ---------------------------------------------------------------------------
def test_round_robin_rotates_per_model_over_the_endpoints_that_serve_it():
    p = picker(endpoint("a:1", adapters=["ad"]), endpoint("b:1"), endpoint("c:1", adapters=["ad"]),
               policy="round-robin")
    picks = [(m, p.pick(RoutingRequest(m, "same long prompt " * 20)).endpoint.address)
             for m in ["base", "ad"] * 6]
    assert [a for m, a in picks if m == "base"] == ["a:1", "b:1", "c:1"] * 2
    assert [a for m, a in picks if m == "ad"] == ["a:1", "c:1"] * 3  # never b:1, which lacks the adapter
    decision = p.pick(RoutingRequest("base"))
    assert decision.destination == "a:1,b:1,c:1"  # fallbacks: the rest of the rotation


def test_round_robin_ignores_load_where_the_picker_does_not():
    busy, idle = endpoint("busy:1", waiting=4, kv=0.7), endpoint("idle:1")
    rr = picker(busy, idle, policy="round-robin")
    assert Counter(rr.pick(RoutingRequest("base")).endpoint.address for _ in range(10)) == {"busy:1": 5, "idle:1": 5}
    scored = picker(endpoint("busy:1", waiting=4, kv=0.7), endpoint("idle:1"))
    assert scored.pick(RoutingRequest("base")).endpoint.address == "idle:1"


def test_round_robin_keeps_admission_rules():
    p = picker(endpoint("a:1", waiting=9), endpoint("b:1", waiting=9), policy="round-robin", queue_threshold=5)
    with pytest.raises(RoutingError) as error:
        p.pick(RoutingRequest("base", sheddable=True))
    assert error.value.status == 429
    assert p.pick(RoutingRequest("base")).endpoint.address in {"a:1", "b:1"}
    with pytest.raises(RoutingError) as error:
        p.pick(RoutingRequest("nope"))
    assert error.value.status == 404


def test_unknown_policy_is_refused_with_the_choices():
    with pytest.raises(ValueError, match="unknown routing policy 'random'; choose one of scored, round-robin"):
        PickerConfig(policy="random")


def test_gateway_cli_routing_flag():
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(["--endpoints", "http://127.0.0.1:1", "--routing", "round-robin"])
    assert cli.config_from_args(args).picker.policy == "round-robin"
    assert cli.config_from_args(parser.parse_args(["--endpoints", "http://127.0.0.1:1"])).picker.policy == "scored"
    with pytest.raises(SystemExit):
        parser.parse_args(["--routing", "fastest"])


def test_a_pick_reads_each_endpoints_queue_a_bounded_number_of_times(monkeypatch):
    """The queue scorer normalises over all candidates; doing that per endpoint made a pick quadratic."""
    reads = Counter()
    original = Endpoint.queue

    def counted(self):
        reads["queue"] += 1
        return original.fget(self)
    monkeypatch.setattr(Endpoint, "queue", property(counted))
    for n in (50, 200):
        p = picker(*(endpoint(f"e{i}:1", waiting=i % 3) for i in range(n)))
        reads.clear()
        p.pick(RoutingRequest("base", "prompt"))
        assert reads["queue"] <= 4 * n


# -- the pool simulator -------------------------------------------------------------------------------
_ids = itertools.count()


def one_request(prompt: int, output: int, *, system: int = 0, shared_blocks: int = 0, model: str = "base",
                arrival: float = 0.0) -> sim.SimRequest:
    return sim.SimRequest(next(_ids), arrival, model, system, shared_blocks, prompt, output, text="")


def run_alone(pod: sim.Pod, request: sim.SimRequest, now: float = 0.0) -> float:
    """Drive one pod until it is idle; returns the time it gets there."""
    pod.waiting.append(request)
    while (planned := pod.start_step()) is not None:
        now += planned[0]
        pod.finish_step(now, planned[1])
    return now


def test_pod_step_costs_match_the_cost_model():
    spec = sim.PodSpec(max_batched_tokens=4096)
    pod = sim.Pod(spec, [])
    first = one_request(5000, 3, shared_blocks=250)  # 4000 shared tokens: one system prompt
    end = run_alone(pod, first)
    chunk1 = spec.step_overhead_s + 4096 * spec.prefill_s_per_token
    chunk2 = spec.step_overhead_s + 904 * spec.prefill_s_per_token
    decode = spec.step_overhead_s + spec.decode_s_per_seq  # one sequence decoding
    assert first.first_token_at == pytest.approx(chunk1 + chunk2)
    assert end == first.finished_at == pytest.approx(chunk1 + chunk2 + 2 * decode)
    # The same system prompt again: its 250 blocks are cached, only the 1000 other tokens are prefilled.
    second = one_request(5000, 1, shared_blocks=250, arrival=end)
    run_alone(pod, second, end)
    assert second.cached_tokens == 4000
    assert second.first_token_at - end == pytest.approx(spec.step_overhead_s + 1000 * spec.prefill_s_per_token)
    assert pod.prefix_hits == 4000 and pod.prefix_queries == 10000


def test_pod_evicts_the_least_recently_used_system_prompt():
    pod = sim.Pod(sim.PodSpec(kv_blocks=300), [])
    for system in (0, 1, 0):  # 100 + 100 shared blocks fit; each request's own blocks come and go
        run_alone(pod, one_request(1600 + 160, 16, system=system, shared_blocks=100))
    assert pod.prefix_hits == 1600  # the third found system prompt 0
    # Prompt 2 needs 200 shared + 31 own blocks: all of prompt 1 (least recently used) goes, then the tail
    # of prompt 0, whose first 300 - 231 = 69 blocks stay.
    run_alone(pod, one_request(3200 + 480, 16, system=2, shared_blocks=200))
    assert ("base", 1) not in pod.cached and pod.cached[("base", 0)] == 69
    hits = pod.prefix_hits
    run_alone(pod, one_request(1600 + 160, 16, system=0, shared_blocks=100))
    assert pod.prefix_hits - hits == 69 * 16
    assert pod.cached_blocks + pod.private_blocks <= 300


def test_adapter_slots_load_on_switch_and_wait_when_all_are_busy():
    spec = sim.PodSpec(max_loras=1)
    pod = sim.Pod(spec, ["x", "y"])
    for model in ("x", "x", "y", "x"):
        run_alone(pod, one_request(32, 4, model=model))
    assert pod.adapter_loads == 3  # x, then y replaces it, then x again
    # Two adapters at once with one slot: y waits until x's request is done.
    a, b = one_request(32, 4, model="y"), one_request(32, 4, model="x")
    pod.waiting.extend([a, b])
    now = 0.0
    while (planned := pod.start_step()) is not None:
        now += planned[0]
        pod.finish_step(now, planned[1])
    assert b.first_token_at > a.finished_at


def test_simulation_is_deterministic_and_the_picker_beats_round_robin_on_shared_prefixes():
    # More system prompts than one pod's KV cache holds, more adapters per pod (6) than slots (4).
    workload = sim.Workload(requests=400, rate=48.0, base_system_prompts=60, adapters=12, replicas_per_adapter=6,
                            seed=7)
    rr = sim.simulate(12, workload, "round-robin")
    picked = sim.simulate(12, workload, "scored")
    again = sim.simulate(12, workload, "scored")
    assert [r.first_token_at for r in again.requests] == [r.first_token_at for r in picked.requests]
    placement = sim.place_adapters(12, 12, 6)
    for result in (rr, picked):
        assert all(r.arrival <= r.first_token_at <= r.finished_at for r in result.requests)
        assert all(r.model == "base" or r.model in placement[r.pod] for r in result.requests)
        assert sum(result.requests_per_pod) == 400
    assert picked.prefix_hit_rate > rr.prefix_hit_rate + 0.2
    assert picked.ttft(50) < rr.ttft(50) / 2 and picked.ttft(95) < rr.ttft(95) / 2
    assert picked.adapter_loads < rr.adapter_loads / 2  # LoRA affinity: fewer slot swaps
    # Hearing each request end (proxy mode) changes what the picker knows between scrapes, not the outcome class.
    exact = sim.simulate(12, workload, "scored", report_ends=True)
    assert [r.first_token_at for r in sim.simulate(12, workload, "scored", report_ends=True).requests] == \
        [r.first_token_at for r in exact.requests]
    assert exact.ttft(50) < rr.ttft(50) / 2 and exact.prefix_hit_rate > rr.prefix_hit_rate + 0.2


def test_a_request_that_can_never_fit_is_refused_up_front():
    with pytest.raises(ValueError, match="can never fit in 100 KV blocks"):
        sim.simulate(2, sim.Workload(requests=5, rate=1.0, adapters=0), "scored", sim.PodSpec(kv_blocks=100))


def test_placement_and_workload_shape():
    placement = sim.place_adapters(10, 5, 4)
    assert [len(p) for p in placement] == [2] * 10
    assert Counter(a for p in placement for a in p) == {f"adapter-{i}": 4 for i in range(5)}
    requests = sim.build_workload(sim.Workload(requests=2000, rate=10.0, seed=1))
    arrivals = [r.arrival for r in requests]
    assert arrivals == sorted(arrivals) and len(requests) == 2000
    assert 0.45 < sum(r.model == "base" for r in requests) / 2000 < 0.55
    assert len(set(arrivals)) < 2000 / 3  # bursts: many requests share an arrival instant
    assert math.isclose(2000 / arrivals[-1], 10.0, rel_tol=0.2)
    by_family = {}
    for r in requests:  # one system prompt per family: same text prefix, same shared blocks
        by_family.setdefault((r.model, r.system_id), set()).add((r.shared_blocks, r.text[:r.shared_blocks * 64]))
    assert all(len(v) == 1 for v in by_family.values())


def test_benchmark_helpers_run():
    import bench_routing

    times = bench_routing.decision_times(10, "scored", 20, seed=0)
    assert len(times) == 20 and all(t >= 0 for t in times)
    jobs = bench_routing.real_workload(24, 3.0, 4.0, seed=0)
    assert len(jobs) == 24 and jobs == bench_routing.real_workload(24, 3.0, 4.0, seed=0)
    assert {j.model for j in jobs} <= {"base", *bench_routing.ADAPTERS}
    served = [{"base", *placed} for placed in bench_routing.PLACEMENT]
    assert all(any(j.model in s for s in served) for j in jobs)
