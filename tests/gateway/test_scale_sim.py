"""The idle-and-wake simulation (benchmarks/scale_sim.py) drives the operator's real Autoscaler and
the gateway's real Picker: the model must reach zero when idle, and come back through a held request
that waits for a promotion (standby) or a cold start (none)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import scale_sim  # noqa: E402

SMALL = scale_sim.WakeScenario(pods=8, rate_per_pod=0.5, busy_s=30.0, idle_s=340.0, scale_down_delay_s=300,
                               cold_start_s=40.0)


def test_an_idle_model_goes_to_zero_and_a_request_brings_it_back():
    cold = scale_sim.simulate_wake(SMALL, standby=0)
    replicas = [n for _, n in cold.replicas_trace]
    assert 0 in replicas, "no scale to zero after scaleDownDelaySeconds without a request"
    woke = replicas.index(0) + 1
    assert replicas[woke] == 1, "the gateway's ask brings back max(1, minReplicas)"
    assert cold.max_held > 0
    assert 0.8 * SMALL.cold_start_s <= cold.first_wake_ttft <= 1.2 * SMALL.cold_start_s + 1.0


def test_a_warm_standby_answers_the_first_request_after_a_promotion():
    warm = scale_sim.simulate_wake(SMALL, standby=1)
    assert SMALL.promote_s <= warm.first_wake_ttft < 2.0
    on = scale_sim.simulate_wake(SMALL, standby=0, scale_to_zero=False)
    assert [n for _, n in on.replicas_trace] == [SMALL.pods] and on.max_held == 0
    assert scale_sim.simulate_wake(SMALL, standby=0).pod_seconds < on.pod_seconds


def test_the_ask_is_sized_by_the_held_requests():
    """While nothing is ready, a growing hold asks for more (up to maxReplicas) instead of the one pod that
    would take every held request on its own."""
    def asked_during_the_first_cold_start(run) -> int:
        wake_at = run.horizon_s - SMALL.busy_s
        return max(n for t, n in run.replicas_trace if wake_at <= t <= wake_at + 0.8 * SMALL.cold_start_s)

    assert asked_during_the_first_cold_start(scale_sim.simulate_wake(SMALL, standby=0)) == SMALL.pods
    assert asked_during_the_first_cold_start(scale_sim.simulate_wake(SMALL, standby=0, sized_ask=False)) == 1
