"""Builders: every object Kubernetes-valid (kubernetes-validate, strict), and each promise of the pod spec kept."""
from __future__ import annotations

import math

import jsonschema
import kubernetes_validate
import pytest
from operator_inferencepool_schema import INFERENCE_POOL_V1
from parallel_helpers import serve_parser

from kubeinfer.operator.builders import (deployment, desired_objects, owner_reference,
                                         pod_disruption_budget, service)
from kubeinfer.operator.config import OperatorConfig
from kubeinfer.operator.names import ADAPTERS_ANNOTATION, ROLE_LABEL, selector_labels
from kubeinfer.operator.sources import SourceError, parse_source
from kubeinfer.operator.spec import SpecError, parse_spec

K8S = kubernetes_validate.utils.latest_version()
OWNER = {"apiVersion": "serving.kubeinfer.io/v1alpha1", "kind": "InferenceModel",
         "metadata": {"name": "llama", "namespace": "ml", "uid": "6f1c2a4e-0000-4000-8000-000000000001"}}
SPECS = {
    "cpu-pvc": {"model": {"uri": "pvc://models/tiny"}},
    "cpu-file": {"model": {"uri": "file:///var/lib/models/tiny"}, "replicas": 0, "minReplicas": 0},
    "gpu-hf-adapters": {
        "model": {"uri": "hf://meta-llama/Llama-3.1-8B@v1"},
        "engine": {"resources": {"gpus": 2, "cpu": "8", "memory": "64Gi", "gpuResourceName": "amd.com/gpu"},
                   "nodeSelector": {"pool": "gpu"}, "priorityClassName": "inference",
                   "tolerations": [{"key": "amd.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                   "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}],
                   "args": ["--max-num-seqs", "128", "--drain-timeout", "90"], "startupTimeoutSeconds": 3600,
                   "maxModelLen": 8192, "dtype": "bfloat16"},
        "replicas": 3, "standby": {"replicas": 2},
        "adapters": [{"name": "sql", "uri": "hf://acme/sql-lora"}, {"name": "de", "uri": "s3://loras/de"},
                     {"name": "fr", "uri": "pvc://loras/fr"}, {"name": "it", "uri": "pvc://loras/it"},
                     {"name": "es", "uri": "file:///srv/loras/es"}],
        "adapterPool": {"maxLorasPerReplica": 3, "maxLoraRank": 32}},
    "s3": {"model": {"uri": "s3://my-bucket/models/qwen"}, "standby": {"replicas": 1}},
}


def built(name: str, config: OperatorConfig | None = None) -> dict[str, dict]:
    spec = parse_spec("llama", SPECS[name])
    return {o["kind"]: o for o in desired_objects(OWNER, spec, config or OperatorConfig(), with_pool=True)}


def pod(name: str) -> dict:
    return built(name)["Deployment"]["spec"]["template"]["spec"]


def engine(name: str) -> dict:
    return pod(name)["containers"][0]


@pytest.mark.parametrize("name", SPECS)
def test_every_object_is_valid_kubernetes(name):
    objects = built(name)
    assert set(objects) == {"Deployment", "Service", "PodDisruptionBudget", "InferencePool", "NetworkPolicy"}
    for kind in ("Deployment", "Service", "PodDisruptionBudget", "NetworkPolicy"):
        kubernetes_validate.validate(objects[kind], K8S, strict=True)
    jsonschema.validate(objects["InferencePool"], INFERENCE_POOL_V1)


def test_pool_is_left_out_without_its_crd():
    spec = parse_spec("llama", SPECS["cpu-pvc"])
    assert [o["kind"] for o in desired_objects(OWNER, spec, OperatorConfig(), False)] == \
        ["NetworkPolicy", "Deployment", "Service", "PodDisruptionBudget"]


def test_engine_command_line_is_what_the_engine_parses():
    """The real `kubeinfer serve` parser reads the operator's command line as intended."""
    parser = serve_parser()
    container = engine("gpu-hf-adapters")
    assert container["command"] == ["kubeinfer"] and container["args"][0] == "serve"
    args = parser.parse_args(container["args"][1:])
    assert (args.model, args.host, args.port, args.grpc_port) == ("/models/model", "0.0.0.0", 8000, 8001)
    assert (args.served_model_name, args.device, args.dtype, args.max_model_len) == ("llama", "cuda", "bfloat16",
                                                                                      8192)
    assert args.enable_lora and (args.max_loras, args.max_lora_rank) == (3, 32)
    assert (args.lora_catalog_dir, args.lora_placement_file) == ("/adapters", "/etc/kubeinfer/placement/adapters")
    assert (args.max_num_seqs, args.drain_timeout) == (128, 90.0)  # spec.engine.args come last
    plain = parser.parse_args(engine("cpu-pvc")["args"][1:])
    assert plain.device == "cpu" and not plain.enable_lora and plain.lora_placement_file is None


def test_served_name_defaults_to_the_model_name():
    spec = parse_spec("llama", {"model": {"uri": "pvc://m/x", "servedName": "team/llama"}})
    args = deployment(OWNER, spec, OperatorConfig())["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[args.index("--served-model-name") + 1] == "team/llama"


def test_replicas_and_standby_share_one_deployment_whose_selector_has_no_role():
    d = built("gpu-hf-adapters")["Deployment"]
    assert d["spec"]["replicas"] == 5
    assert d["spec"]["selector"]["matchLabels"] == selector_labels("llama")
    assert ROLE_LABEL not in d["spec"]["template"]["metadata"]["labels"]  # the operator owns roles
    assert d["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 1}
    assert built("cpu-pvc")["Deployment"]["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


def test_service_and_pool_select_only_active_pods():
    objects = built("cpu-pvc")
    assert objects["Service"]["spec"]["selector"][ROLE_LABEL] == "active"
    pool = objects["InferencePool"]["spec"]
    assert pool["selector"]["matchLabels"] == objects["Service"]["spec"]["selector"]
    assert pool["targetPorts"] == [{"number": 8000}]
    assert pool["endpointPickerRef"]["name"] == "kubeinfer-gateway" and pool["endpointPickerRef"]["port"] == \
        {"number": 9002}
    custom = built("cpu-pvc", OperatorConfig(endpoint_picker_service="epp", endpoint_picker_port=9010))
    assert custom["InferencePool"]["spec"]["endpointPickerRef"]["name"] == "epp"


def test_gpus_are_requested_and_limited_with_the_chosen_resource_name():
    res = engine("gpu-hf-adapters")["resources"]
    assert res["requests"]["amd.com/gpu"] == res["limits"]["amd.com/gpu"] == 2
    assert res["requests"]["memory"] == res["limits"]["memory"] == "64Gi" and res["requests"]["cpu"] == "8"
    assert "nvidia.com/gpu" not in str(res)
    default_gpu = parse_spec("x", {"model": {"uri": "pvc://m/x"}, "engine": {"resources": {"gpus": 1}}})
    res = deployment(OWNER, default_gpu, OperatorConfig())["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert res["limits"] == {"nvidia.com/gpu": 1}
    assert engine("cpu-pvc").get("resources") == {}


def test_scheduling_fields_are_copied():
    spec = pod("gpu-hf-adapters")
    assert spec["nodeSelector"] == {"pool": "gpu"} and spec["priorityClassName"] == "inference"
    assert spec["tolerations"] == SPECS["gpu-hf-adapters"]["engine"]["tolerations"]
    assert "nodeSelector" not in pod("cpu-pvc") and "tolerations" not in pod("cpu-pvc")


def test_probes_give_a_slow_model_load_time_and_watch_health():
    c = engine("gpu-hf-adapters")
    startup = c["startupProbe"]
    assert startup["httpGet"] == {"path": "/health", "port": "http"}
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 3600
    assert c["readinessProbe"]["httpGet"]["path"] == c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert engine("cpu-pvc")["startupProbe"]["periodSeconds"] * engine("cpu-pvc")["startupProbe"][
        "failureThreshold"] >= 1800


def test_grace_period_outlasts_the_drain():
    assert pod("gpu-hf-adapters")["terminationGracePeriodSeconds"] > 90 + 5  # --drain-timeout 90 + preStop
    assert pod("cpu-pvc")["terminationGracePeriodSeconds"] > 30 + 5
    assert engine("cpu-pvc")["lifecycle"]["preStop"]["sleep"]["seconds"] == 5


@pytest.mark.parametrize("name", SPECS)
def test_pods_run_locked_down(name):
    spec = pod(name)
    assert spec["securityContext"]["runAsNonRoot"] and spec["securityContext"]["seccompProfile"]["type"] == \
        "RuntimeDefault"
    assert spec["automountServiceAccountToken"] is False
    for container in spec["containers"] + spec.get("initContainers", []):
        sc = container["securityContext"]
        assert sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"]
        assert sc["capabilities"]["drop"] == ["ALL"]
        assert any(m["mountPath"] == "/tmp" for m in container["volumeMounts"])  # somewhere to write


def mounts(container: dict) -> dict[str, dict]:
    return {m["mountPath"]: m for m in container["volumeMounts"]}


def volumes(name: str) -> dict[str, dict]:
    return {v["name"]: v for v in pod(name)["volumes"]}


def test_pvc_model_is_mounted_read_only_without_copying():
    model = mounts(engine("cpu-pvc"))["/models/model"]
    assert model["readOnly"] and model["subPath"] == "tiny"
    assert volumes("cpu-pvc")[model["name"]]["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    assert "initContainers" not in pod("cpu-pvc")


def test_hf_model_is_fetched_by_an_init_container_into_a_cache():
    init = {c["name"]: c for c in pod("gpu-hf-adapters")["initContainers"]}
    fetch = init["fetch-model"]
    assert fetch["command"] == ["hf", "download", "meta-llama/Llama-3.1-8B", "--local-dir", "/models/model",
                                "--revision", "v1"]
    assert fetch["image"] == engine("gpu-hf-adapters")["image"]  # the engine image has the hf CLI
    assert {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}} in fetch["env"]
    cache = mounts(fetch)["/models"]["name"]
    assert "emptyDir" in volumes("gpu-hf-adapters")[cache]
    assert mounts(engine("gpu-hf-adapters"))["/models"] == {"name": cache, "mountPath": "/models", "readOnly": True}
    assert {"name": "HF_HUB_OFFLINE", "value": "1"} in engine("gpu-hf-adapters")["env"]  # never fetch at run time


def test_s3_model_is_synced_by_the_aws_cli():
    fetch, = pod("s3")["initContainers"]
    assert fetch["command"][:5] == ["aws", "s3", "sync", "s3://my-bucket/models/qwen", "/models/model"]
    assert fetch["image"] == OperatorConfig().s3_fetcher_image


def test_file_model_is_a_read_only_host_directory():
    v = volumes("cpu-file")["model"]
    assert v["hostPath"] == {"path": "/var/lib/models/tiny", "type": "Directory"}
    assert mounts(engine("cpu-file"))["/models/model"]["readOnly"]


def test_every_adapter_appears_under_the_catalog_dir():
    c = engine("gpu-hf-adapters")
    init = {c["name"]: c for c in pod("gpu-hf-adapters")["initContainers"]}
    assert init["fetch-adapter-0"]["command"][:3] == ["hf", "download", "acme/sql-lora"]
    assert init["fetch-adapter-1"]["command"][3:5] == ["s3://loras/de", "/adapters/de"]
    m = mounts(c)
    # fetched adapters: each a read-only subPath of the cache, never a mount inside a read-only /adapters (#46)
    assert m["/adapters/sql"]["readOnly"] and "emptyDir" in volumes("gpu-hf-adapters")[m["/adapters/sql"]["name"]]
    assert "/adapters" not in m
    assert m["/adapters/fr"]["subPath"] == "fr" and m["/adapters/it"]["subPath"] == "it"
    assert m["/adapters/fr"]["name"] == m["/adapters/it"]["name"]  # one volume per claim
    assert volumes("gpu-hf-adapters")[m["/adapters/es"]["name"]]["hostPath"]["path"] == "/srv/loras/es"


def test_placement_file_is_the_pod_annotation_through_the_downward_api():
    placement = mounts(engine("gpu-hf-adapters"))["/etc/kubeinfer/placement"]
    item, = volumes("gpu-hf-adapters")[placement["name"]]["downwardAPI"]["items"]
    assert item == {"path": "adapters",
                    "fieldRef": {"fieldPath": f"metadata.annotations['{ADAPTERS_ANNOTATION}']"}}
    assert "/etc/kubeinfer/placement" not in mounts(engine("cpu-pvc"))


def test_gpu_pods_get_a_shared_memory_volume():
    assert mounts(engine("gpu-hf-adapters"))["/dev/shm"]
    assert "/dev/shm" not in mounts(engine("cpu-pvc"))


def test_pdb_keeps_serving_capacity_without_blocking_drains():
    spec = parse_spec("llama", SPECS["gpu-hf-adapters"])
    with_standby = pod_disruption_budget(OWNER, spec)["spec"]
    assert with_standby["minAvailable"] == 3 and "maxUnavailable" not in with_standby
    assert with_standby["unhealthyPodEvictionPolicy"] == "AlwaysAllow"
    without = pod_disruption_budget(OWNER, parse_spec("llama", SPECS["cpu-pvc"]))["spec"]
    assert without["maxUnavailable"] == 1 and "minAvailable" not in without


def test_everything_is_owned_by_the_model():
    for obj in built("cpu-pvc").values():
        assert obj["metadata"]["ownerReferences"] == [owner_reference(OWNER)]
        assert obj["metadata"]["namespace"] == "ml"
    ref = owner_reference(OWNER)
    assert ref["controller"] and ref["blockOwnerDeletion"] and ref["uid"] == OWNER["metadata"]["uid"]
    with pytest.raises(ValueError, match="uid"):
        service({"metadata": {"name": "x", "namespace": "ml"}}, parse_spec("x", SPECS["cpu-pvc"]))


def test_engine_image_comes_from_spec_or_operator():
    assert engine("cpu-pvc")["image"] == OperatorConfig().engine_image
    spec = parse_spec("x", {"model": {"uri": "pvc://m/x"}, "engine": {"image": "registry.local/engine:dev"}})
    assert deployment(OWNER, spec, OperatorConfig())["spec"]["template"]["spec"]["containers"][0]["image"] == \
        "registry.local/engine:dev"


@pytest.mark.parametrize("uri, scheme, location, path, revision", [
    ("pvc://models/llama/3.1", "pvc", "models", "llama/3.1", None),
    ("pvc://models", "pvc", "models", "", None),
    ("hf://Qwen/Qwen2.5-0.5B-Instruct", "hf", "Qwen/Qwen2.5-0.5B-Instruct", "", None),
    ("hf://gpt2@6c0e6080953db56375760c0471a8c5f2929baf11", "hf", "gpt2", "",
     "6c0e6080953db56375760c0471a8c5f2929baf11"),
    ("s3://bucket.example/a/b/", "s3", "bucket.example", "a/b", None),
    ("file:///srv/models/x", "file", "/srv/models/x", "", None),
])
def test_sources_parse(uri, scheme, location, path, revision):
    s = parse_source(uri)
    assert (s.scheme, s.location, s.path, s.revision) == (scheme, location, path, revision)


@pytest.mark.parametrize("uri, says", [
    ("gs://bucket/x", "not supported"), ("pvc://Models/x", "PersistentVolumeClaim"),
    ("pvc://models/../etc", "'..'"), ("hf://a/b/c", "hf://ORG/NAME"), ("hf://org/name@bad rev", "revision"),
    ("s3://B/x", "bucket"), ("file://relative/x", "file:///"), ("file:///", "file:///"), ("models/x", "not a URI"),
    (None, "not a URI"),
])
def test_bad_sources_say_what_is_expected(uri, says):
    with pytest.raises(SourceError, match=says.replace("(", r"\(").replace(".", r"\.")):
        parse_source(uri)


def test_spec_problems_are_reported_together_with_their_fields():
    with pytest.raises(SpecError) as err:
        parse_spec("llama", {"model": {"uri": "gs://x/y"}, "replicas": 5, "maxReplicas": 2,
                             "engine": {"args": ["--port=9000", "--max-loras", "2"],
                                        "resources": {"memory": "lots"}},
                             "adapters": [{"name": "a", "uri": "pvc://l/a"}, {"name": "a", "uri": "pvc://l/b"}]})
    text = str(err.value)
    for needle in ("spec.model.uri", "spec.replicas (5)", "--port", "--max-loras", "spec.engine.resources.memory",
                   "used twice"):
        assert needle in text, needle
    assert len(err.value.problems) == 6


@pytest.mark.parametrize("quantity, ok", [("4", True), ("500m", True), ("32Gi", True), ("1.5", True),
                                          ("2e3", True), ("32GB", False), ("lots", False), ("-1", False)])
def test_quantities_follow_kubernetes(quantity, ok):
    spec = {"model": {"uri": "pvc://m/x"}, "engine": {"resources": {"memory": quantity}}}
    if ok:
        parse_spec("x", spec)
        obj = deployment(OWNER, parse_spec("x", spec), OperatorConfig())
        kubernetes_validate.validate(obj, K8S, strict=True)
    else:
        with pytest.raises(SpecError, match="quantity"):
            parse_spec("x", spec)


def test_startup_probe_rounds_up():
    spec = parse_spec("x", {"model": {"uri": "pvc://m/x"}, "engine": {"startupTimeoutSeconds": 95}})
    probe = deployment(OWNER, spec, OperatorConfig())["spec"]["template"]["spec"]["containers"][0]["startupProbe"]
    assert probe["failureThreshold"] == math.ceil(95 / 10)
