"""The gateway's scheduling framework: plugins registered by name, composed into profiles by the flags or an
EndpointPickerConfig file; the default profile picks exactly as the picker did before the framework."""
from __future__ import annotations

import argparse
import random
import textwrap
from pathlib import Path

import numpy as np
import pytest

from kubeinfer.gateway import cli
from kubeinfer.gateway.datastore.endpoints import Endpoint, EndpointPool, EngineState
from kubeinfer.gateway.scheduling.framework import Scorer
from kubeinfer.gateway.scheduling.picker import Picker, PickerConfig, RoutingError, RoutingRequest
from kubeinfer.gateway.scheduling.profiles import read_config
from kubeinfer.gateway.scheduling.registry import register_scorer, registered, unregister


def fixed_pool() -> tuple[EndpointPool, list[Endpoint]]:
    """Twelve endpoints with mixed load and adapters loaded, running, waiting and placed."""
    rng = random.Random(45)
    endpoints = []
    for i in range(12):
        adapters = [f"ad{j}" for j in range(4) if rng.random() < 0.35]
        e = Endpoint(f"10.0.{i}.1:8000", placed_adapters=frozenset([f"ad{i % 4}"] if i % 3 == 0 else []))
        e.record_scrape(EngineState(waiting=rng.randint(0, 7), running=rng.randint(0, 8), kv_usage=rng.random(),
                                    running_adapters=frozenset(adapters[:1]), max_loras=2,
                                    waiting_adapters=frozenset(adapters[1:2])),
                        frozenset(["base", *adapters]), frozenset(["base"]))
        endpoints.append(e)
    pool = EndpointPool()
    pool.set_members(endpoints)
    return pool, endpoints


def picks(seed: int, **config) -> str:
    """The answers to a fixed stream of requests: each the chosen pods then fallbacks (the x in 10.0.x.1),
    or the error status."""
    pool, endpoints = fixed_pool()
    picker = Picker(pool, PickerConfig(**config), rng=random.Random(seed))
    rng = random.Random(seed)
    prompts = [f"system prompt {k} " * 40 for k in range(5)]
    addresses = [e.address for e in endpoints]
    out = []
    for _ in range(60):
        request = RoutingRequest(rng.choice(["base", "base", "ad1", "ad2", "nope"]),
                                 rng.choice(prompts) + "question " * rng.randint(0, 30), sheddable=rng.random() < 0.2,
                                 exclude=frozenset(rng.sample(addresses, 3)) if rng.random() < 0.2 else frozenset())
        try:
            destination = picker.pick(request, free_slot=rng.random() < 0.3).destination
            out.append(",".join(a.split(".")[2] for a in destination.split(",")))
        except RoutingError as error:
            out.append(str(error.status))
    return " ".join(out)


# Recorded with the picker before the framework (picker.py's SCORERS and hard-coded filters).
RECORDED = {
    (0, "default"): "1,11,8 1,5 1,5 404 11,8,10 404 404 8,10,11 11,10,0 404 0,1,8 404 8,10,0 11,10,0 11,10,0 404 404 "
                    "1,5 10,0,1 10,0,8 404 0,8,4 10,8,0 8,0,5 5,1 0,4,1 404 1,4,0 4,0,8 5 8,0,7 404 404 7,0 0 4,9,3 "
                    "429 404 1,11,9 7,8,10 10,8,7 404 429 11,3,8 1,11,8 3,5,6 404 404 5,3,1 404 404 1,3 8,4,9 429 "
                    "429 429 7,8,10 404 404 8,10,7",
    (1, "default"): "11,8,0 1,8,0 404 1,8,10 1,8,11 8,0,11 1,5 1,11,0 404 404 0,11,8 404 404 0,11,8 404 5 11,8,10 404 "
                    "8,0,11 5 429 404 1,3,5 429 10,8,11 5,3,1 8,11,0 404 11,10,0 404 404 0,11,4 429 11,10,4 404 404 "
                    "8,0,4 404 10,4,7 4,10,0 404 404 3,1,5 3,1,5 11,4,9 10,7,0 7,0 0 429 10,7,8 11,0,1 8,4,9 1,5,6 "
                    "429 0,4,9 404 4,1,7 3,6,1 429 429",
    (0, "round-robin"): "0,1,2 1,3,5 3,5,6 404 0,1,2 404 404 1,2,3 2,3,4 404 1,2,3 404 3,4,5 4,5,6 7,9,10 404 404 "
                        "5,6,1 9,10,11 7,8,9 404 8,9,10 9,10,11 2,5,6 6,1,3 11,0,1 404 4,5,6 2,3,4 1,3,5 1,2,3 404 "
                        "404 2,3,4 3,4,5 4,5,8 3,4,5 404 5,8,9 4,5,6 5,6,7 404 8,9,11 6,7,8 1,2,5 3,5,6 404 404 "
                        "5,6,1 404 404 3,1 8,9,10 429 429 9,10,11 10,11,0 404 404 11,0,1",
    (2, "weights"): "8,5,1 404 404 1,5,11 404 10,1,8 11,8,7 5,1 1,0,5 404 0,8,4 10,0,8 404 7,11,1 5,1 404 404 1,8,0 "
                    "1,8,4 8,10,1 0,8,4 11,8,10 404 8,11,0 0,11,8 8,11,4 1 11,0,4 11,0,10 404 0,4,10 4,10 9,3,8 10 "
                    "429 4,1,8 429 8,11,3 11,2,9 0,1,5 5,8,4 3,7,1 1,2,9 1,8,2 7,3,9 10,11,0 429 8,5,7 5,3 429 429 "
                    "404 5,3,6 4,2,8 10,2,0 9,2,3 3,7,11 2,1,11 7,0,10 404",
}
CONFIGS = {"default": {}, "round-robin": {"policy": "round-robin"},
           "weights": {"weights": {"queue": 1.0, "lora": 3.0, "affinity": 2.0}}}

# The default profile written out as an EndpointPickerConfig: it must pick as the flags' default does.
DEFAULT_AS_CONFIG = """
apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: single-profile-handler
- {type: ready}
- {type: subset}
- {type: exclude}
- {type: serves-model}
- {type: saturation}
- {type: free-slot}
- {type: queue}
- {type: active}
- {type: kv_cache}
- {type: lora}
- {type: prefix}
- {type: affinity}
- {type: max-score}
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: ready}
  - {pluginRef: subset}
  - {pluginRef: exclude}
  - {pluginRef: serves-model}
  - {pluginRef: saturation}
  - {pluginRef: free-slot}
  - {pluginRef: queue, weight: 2}
  - {pluginRef: active, weight: 1}
  - {pluginRef: kv_cache, weight: 1}
  - {pluginRef: lora, weight: 2}
  - {pluginRef: prefix, weight: 4}
  - {pluginRef: affinity, weight: 1}
  - {pluginRef: max-score}
"""


@pytest.mark.parametrize("seed,name", sorted(RECORDED), ids=str)
def test_default_profiles_pick_as_before_the_framework(seed, name):
    assert picks(seed, **CONFIGS[name]) == RECORDED[seed, name]


def test_the_default_profile_as_a_config_file_picks_the_same(tmp_path):
    path = tmp_path / "epp.yaml"
    path.write_text(DEFAULT_AS_CONFIG)
    for seed in (0, 1):
        assert picks(seed, scheduler=read_config(path)) == RECORDED[seed, "default"]


def test_the_shipped_plugins_are_registered_by_name():
    assert registered("scorer")[:6] == ["queue", "active", "kv_cache", "lora", "prefix", "affinity"]
    assert set(registered("filter")) >= {"ready", "subset", "exclude", "serves-model", "saturation", "free-slot"}
    assert set(registered("picker")) >= {"max-score", "round-robin"}
    assert "single-profile-handler" in registered("profile-handler")


class PrefersPodSeven(Scorer):
    def score(self, ctx, rows):
        return np.array([1.0 if ctx.table.endpoints[r].address == "10.0.7.1:8000" else 0.0 for r in rows])


@pytest.fixture
def pod_seven_scorer():
    register_scorer("test-pod-seven", PrefersPodSeven)
    yield
    unregister("test-pod-seven")


def test_a_registered_scorer_changes_the_picks(pod_seven_scorer):
    pool, _ = fixed_pool()
    weights = {"queue": 2.0, "test-pod-seven": 100.0}
    picker = Picker(pool, PickerConfig(weights=weights), rng=random.Random(0))
    decision = picker.pick(RoutingRequest("base"))
    assert decision.endpoint.address == "10.0.7.1:8000" and decision.scores["test-pod-seven"] == 1.0
    assert Picker(pool, PickerConfig(weights={"queue": 2.0}), rng=random.Random(0)).pick(
        RoutingRequest("base")).endpoint.address != "10.0.7.1:8000"


def test_a_type_is_registered_once(pod_seven_scorer):
    with pytest.raises(ValueError, match="already registered"):
        register_scorer("test-pod-seven", PrefersPodSeven)


def test_weights_come_from_the_config(tmp_path, pod_seven_scorer):
    def pick_with(weight: float) -> str:
        path = tmp_path / "epp.yaml"
        path.write_text("plugins:\n- type: ready\n- type: kv_cache\n- {type: test-pod-seven, name: seven}\n"
                        "schedulingProfiles:\n- name: only\n  plugins:\n  - pluginRef: ready\n"
                        f"  - {{pluginRef: kv_cache, weight: 1}}\n  - {{pluginRef: seven, weight: {weight}}}\n")
        pool, _ = fixed_pool()
        decision = Picker(pool, PickerConfig(scheduler=read_config(path)), rng=random.Random(0)).pick(
            RoutingRequest("base"))
        assert set(decision.scores) == ({"kv_cache", "seven", "total"} if weight else {"kv_cache", "total"})
        return decision.endpoint.address

    _, endpoints = fixed_pool()
    most_free_kv = min(endpoints, key=lambda e: e.state.kv_usage).address
    assert pick_with(0) == most_free_kv != "10.0.7.1:8000"
    assert pick_with(5) == "10.0.7.1:8000"


def test_an_unknown_plugin_type_is_refused_with_the_registered_ones(tmp_path):
    config = {"plugins": [{"type": "no-such-scorer"}], "schedulingProfiles": [{"name": "x", "plugins": []}]}
    with pytest.raises(ValueError, match="unknown scheduling plugin type 'no-such-scorer'; registered: .*queue"):
        PickerConfig(scheduler=config)
    path = tmp_path / "epp.yaml"
    path.write_text("plugins:\n- type: no-such-scorer\nschedulingProfiles:\n- name: x\n")
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    with pytest.raises(SystemExit, match="no-such-scorer.*registered: .*prefix"):
        cli.config_from_args(parser.parse_args(["--endpoints", "a:1", "--scheduler-config", str(path)]))
    path.write_text("plugins:\n- type: queue\nschedulingProfiles:\n- {name: p, plugins: [{pluginRef: queue}]}\n")
    config = cli.config_from_args(parser.parse_args(["--endpoints", "a:1", "--scheduler-config", str(path)]))
    assert config.picker.scheduler["plugins"] == [{"type": "queue"}]


@pytest.mark.parametrize("config,error", [
    ({"plugins": [{"type": "queue"}], "schedulingProfiles": [{"name": "p", "plugins": [{"pluginRef": "kv"}]}]},
     "refers to no plugin `kv`"),
    ({"plugins": [{"type": "queue"}]}, "no `schedulingProfiles`"),
    ({"plugins": [{"type": "max-score"}, {"type": "round-robin"}], "schedulingProfiles": [
        {"name": "p", "plugins": [{"pluginRef": "max-score"}, {"pluginRef": "round-robin"}]}]}, "one picker"),
    ({"plugins": [{"type": "queue"}, {"type": "queue"}], "schedulingProfiles": []}, "two plugins named"),
    ("not a mapping", "must be a mapping"),
])
def test_a_broken_config_is_refused_at_start(config, error):
    with pytest.raises(ValueError, match=error):
        PickerConfig(scheduler=config)


def test_the_docs_recipe_for_a_scorer_works():
    """docs/gateway-plugins.md's example scorer, run as the module it tells you to write."""
    doc = (Path(__file__).parents[2] / "docs" / "gateway-plugins.md").read_text()
    source = textwrap.dedent(doc.split("```python\n", 1)[1].split("```", 1)[0])
    module = {"__name__": "kubeinfer.gateway.scheduling.plugins.prefill_cost",
              "__package__": "kubeinfer.gateway.scheduling.plugins"}
    exec(compile(source, "gateway-plugins.md", "exec"), module)
    try:
        parser = argparse.ArgumentParser()
        cli.add_arguments(parser)
        args = parser.parse_args(["--endpoints", "a:1", "--scorer-weights", "queue=0,prefill-cost=100"])
        config = cli.config_from_args(args).picker
        pool, endpoints = fixed_pool()
        decision = Picker(pool, config, rng=random.Random(0)).pick(RoutingRequest("base"))
        assert 0.0 <= decision.scores["prefill-cost"] <= 1.0 and decision.scores["prefill-cost"] > 0
    finally:
        unregister("prefill-cost")


def test_the_docs_config_example_builds(tmp_path):
    doc = (Path(__file__).parents[2] / "docs" / "gateway-plugins.md").read_text()
    path = tmp_path / "epp.yaml"
    path.write_text(doc.split("```yaml\n", 1)[1].split("```", 1)[0])
    pool, _ = fixed_pool()
    picker = Picker(pool, PickerConfig(scheduler=read_config(path)), rng=random.Random(0))
    decision = picker.pick(RoutingRequest("base"))
    assert set(decision.scores) == {"queue", "prefix", "total"}
