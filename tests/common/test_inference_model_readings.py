"""What each part reads from an InferenceModel, pinned field by field: the operator's typed spec (its defaults
for a bare spec, every field of a full one) and the gateway's maps (priorities, scale targets, fallbacks),
including the objects the API server never stores but a test or an older object may hold (missing spec,
nulls, adapters without a name). Written against the readings as they were before both parts moved onto
kubeinfer.common.inference_model, so the move changes none of them."""
from __future__ import annotations

from kubeinfer.gateway.flowcontrol.fallback import fallbacks_of
from kubeinfer.gateway.flowcontrol.model_priorities import ScaleTarget, priorities_of, scale_targets_of
from kubeinfer.operator.spec import parse_spec

FULL = {
    "model": {"uri": "hf://meta-llama/Llama-3.1-8B@main", "servedName": "llama-3"},
    "engine": {"image": "reg/engine:1", "args": ["--seed", 3], "env": [{"name": "HF_TOKEN", "value": "x"}],
               "resources": {"gpus": 4, "gpuResourceName": "amd.com/gpu", "cpu": 8, "memory": "48Gi"},
               "nodeSelector": {"zone": "a"}, "tolerations": [{"key": "gpu", "operator": "Exists"}],
               "priorityClassName": "inference", "maxModelLen": 4096, "dtype": "bfloat16",
               "startupTimeoutSeconds": 600, "parallelism": {"tensor": 2, "nodes": 2}},
    "replicas": 3, "minReplicas": 2, "maxReplicas": 6, "standby": {"replicas": 1},
    "adapters": [{"name": "sql", "uri": "s3://loras/sql"}, {"name": "chat", "uri": "pvc://loras/chat"}],
    "adapterPool": {"maxLorasPerReplica": 8, "maxLoraRank": 16, "replicasPerAdapter": 2},
    "routing": {"priority": -2, "fallback": ["small", "", "tiny"], "kvEvents": True},
    "autoscaling": {"targetQueueDepth": 4, "scaleDownDelaySeconds": 60},
}


def operator_reading(name: str, spec: dict) -> dict:
    """Every value the operator's typed spec gives, by the attribute paths the operator uses."""
    s = parse_spec(name, spec)
    e, r, p = s.engine, s.engine.resources, s.engine.parallelism
    return {
        "name": s.name, "served_name": s.served_name, "model": (s.model.uri, s.model.scheme, s.model.location,
                                                                s.model.path, s.model.revision),
        "replicas": s.replicas, "min_replicas": s.min_replicas, "max_replicas": s.max_replicas,
        "standby": s.standby, "pods": s.pods,
        "adapters": [(a.name, a.source.uri, a.source.scheme) for a in s.adapters],
        "adapter_pool": (s.adapter_pool.max_loras_per_replica, s.adapter_pool.max_lora_rank,
                         s.adapter_pool.replicas_per_adapter),
        "autoscaling": None if s.autoscaling is None else (s.autoscaling.target_queue_depth,
                                                           s.autoscaling.scale_down_delay_seconds),
        "kv_events": s.kv_events,
        "engine": (e.image, e.args, e.env, e.node_selector, e.tolerations, e.priority_class_name, e.max_model_len,
                   e.dtype, e.startup_timeout_seconds),
        "resources": (r.gpus, r.gpu_resource_name, r.cpu, r.memory),
        "parallelism": (p.tensor, p.nodes, p.world_size),
    }


def test_the_operator_reads_a_bare_spec_with_its_defaults():
    assert operator_reading("qwen", {"model": {"uri": "pvc://models/qwen"}}) == {
        "name": "qwen", "served_name": "qwen", "model": ("pvc://models/qwen", "pvc", "models", "qwen", None),
        "replicas": 1, "min_replicas": 1, "max_replicas": None, "standby": 0, "pods": 1, "adapters": [],
        "adapter_pool": (4, 64, 1), "autoscaling": None, "kv_events": False,
        "engine": (None, (), (), {}, (), None, None, None, 1800),
        "resources": (0, "nvidia.com/gpu", None, None), "parallelism": (1, 1, 1),
    }


def test_the_operator_reads_every_field_of_a_full_spec():
    reading = operator_reading("llama", FULL)
    assert reading == {
        "name": "llama", "served_name": "llama-3",
        "model": ("hf://meta-llama/Llama-3.1-8B@main", "hf", "meta-llama/Llama-3.1-8B", "", "main"),
        "replicas": 3, "min_replicas": 2, "max_replicas": 6, "standby": 1, "pods": 4,
        "adapters": [("sql", "s3://loras/sql", "s3"), ("chat", "pvc://loras/chat", "pvc")],
        "adapter_pool": (8, 16, 2), "autoscaling": (4.0, 60), "kv_events": True,
        "engine": ("reg/engine:1", ("--seed", "3"), ({"name": "HF_TOKEN", "value": "x"},), {"zone": "a"},
                   ({"key": "gpu", "operator": "Exists"},), "inference", 4096, "bfloat16", 600),
        "resources": (4, "amd.com/gpu", "8", "48Gi"), "parallelism": (2, 2, 4),
    }
    assert isinstance(parse_spec("llama", FULL).autoscaling.target_queue_depth, float)


def test_the_operator_defaults_tensor_to_the_gpus_and_empty_values_to_unset():
    spec = parse_spec("m", {"model": {"uri": "pvc://m/x", "servedName": ""},
                            "engine": {"image": "", "priorityClassName": "", "resources": {"gpus": 2,
                                                                                           "gpuResourceName": ""}},
                            "routing": None, "standby": None, "adapterPool": None})
    assert (spec.served_name, spec.engine.image, spec.engine.priority_class_name) == ("m", None, None)
    assert (spec.engine.parallelism.tensor, spec.engine.resources.gpu_resource_name) == (2, "nvidia.com/gpu")
    assert (spec.standby, spec.kv_events, spec.adapter_pool.max_loras_per_replica) == (0, False, 4)


def test_the_gateway_reads_priorities_of_models_and_their_adapters():
    models = [{"metadata": {"name": "llama", "namespace": "ns"}, "spec": FULL},
              {"metadata": {"name": "bare"}},  # no spec at all: the name, priority 0
              {"metadata": {"name": "nulls"}, "spec": {"model": None, "routing": {"priority": None},
                                                       "adapters": [None, {"uri": "pvc://x/y"}, {"name": "a1"}]}},
              {"metadata": {}, "spec": {"model": {"uri": "pvc://x/y"}}},  # no name anywhere: left out
              {"metadata": {}, "spec": {"model": {"servedName": "by-served"}, "routing": {"priority": 5}}}]
    assert priorities_of(models) == {"llama-3": -2, "sql": -2, "chat": -2, "bare": 0, "nulls": 0, "a1": 0,
                                     "by-served": 5}


def test_the_gateway_reads_scale_targets():
    models = [{"metadata": {"name": "llama", "namespace": "ns"}, "spec": FULL},
              {"metadata": {"name": "bare", "namespace": "ns"}},
              {"metadata": {"name": "zero", "namespace": "ns"}, "spec": {"minReplicas": 0, "autoscaling": {}}},
              {"metadata": {"name": "nulls", "namespace": "ns"}, "spec": {"minReplicas": None, "maxReplicas": None,
                                                                          "autoscaling": None}},
              {"metadata": {"name": "no-namespace"}, "spec": {}}]
    llama = ScaleTarget("ns", "llama", 2, 6, 4)
    assert scale_targets_of(models) == {
        "llama-3": llama, "sql": llama, "chat": llama, "bare": ScaleTarget("ns", "bare", 1),
        "zero": ScaleTarget("ns", "zero", 0), "nulls": ScaleTarget("ns", "nulls", 0)}


def test_the_gateway_reads_fallbacks():
    models = [{"metadata": {"name": "llama"}, "spec": FULL},
              {"metadata": {"name": "plain"}, "spec": {"routing": {"fallback": []}}},
              {"metadata": {"name": "bare"}},
              {"metadata": {"name": "nulls"}, "spec": {"routing": {"fallback": None}}},
              {"metadata": {"name": "by-name"}, "spec": {"routing": {"fallback": ["other"]}}}]
    assert fallbacks_of(models) == {"llama-3": ["small", "tiny"], "by-name": ["other"]}


def test_an_adapter_that_is_not_an_object_is_a_named_problem_not_a_crash():
    """Before the shared reading, `spec.adapters: [null]` raised AttributeError inside the pass (a bug to the
    operator: a traceback per pass); now it is refused as InvalidSpec naming the field, and the gateway skips it."""
    import pytest

    from kubeinfer.operator.spec import SpecError

    with pytest.raises(SpecError, match=r"spec\.adapters\[0\] must be an object"):
        parse_spec("m", {"model": {"uri": "pvc://m/x"}, "adapters": [None]})
