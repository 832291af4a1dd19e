"""spec.engine.parallelism: the CRD's schema and CEL rules, the operator's parser, the rendered Deployment
(`--tensor-parallel-size`) and LeaderWorkerSet (against the LWS project's own CRD and Kubernetes' schemas),
the engine's command lines as its parser reads them after the kubelet's $(VAR) expansion, groups as serving
units, and termination messages in conditions."""
from __future__ import annotations

import base64
import copy

import kubernetes_validate
import pytest
import test_operator_crd as crd
from parallel_helpers import expand, group_pods, lws_problems, serve_parser

from kubeinfer.operator.builders import desired_objects, group_network_policies, group_secret
from kubeinfer.operator.config import OperatorConfig
from kubeinfer.operator.groups import serving_units
from kubeinfer.operator.leader_worker import GROUP_INDEX_LABEL, SET_NAME_LABEL, WORKER_INDEX_LABEL
from kubeinfer.operator.names import ROLE_LABEL, selector_labels
from kubeinfer.operator.pods import pod_view
from kubeinfer.operator.roles import assign_roles
from kubeinfer.operator.spec import SpecError, parse_spec
from kubeinfer.operator.status import conditions_for

K8S = kubernetes_validate.utils.latest_version()
OWNER = {"apiVersion": "serving.kubeinfer.io/v1alpha1", "kind": "InferenceModel",
         "metadata": {"name": "llama", "namespace": "ml", "uid": "6f1c2a4e-0000-4000-8000-000000000001"}}
FOUR_GPUS = {"model": {"uri": "hf://meta-llama/Llama-3.1-70B-Instruct"},
             "engine": {"resources": {"gpus": 4, "memory": "320Gi"}, "dtype": "bfloat16"}}
TWO_NODES = {"model": {"uri": "pvc://models/llama-405b"}, "replicas": 2, "standby": {"replicas": 1},
             "engine": {"resources": {"gpus": 8}, "parallelism": {"nodes": 2}, "args": ["--max-num-seqs", "64"]},
             "adapters": [{"name": "sql", "uri": "s3://loras/sql"}]}


def objects(spec: dict, name: str = "llama") -> dict[str, dict]:
    owner = copy.deepcopy(OWNER)
    owner["metadata"]["name"] = name
    return {o["kind"]: o for o in desired_objects(owner, parse_spec(name, spec), OperatorConfig(), with_pool=True)}


def flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


# -- the spec: defaults, ranges, tensor <= gpus ----------------------------------------------------------------
@pytest.mark.parametrize("engine, tensor, nodes", [
    ({}, 1, 1), ({"resources": {"gpus": 4}}, 4, 1), ({"resources": {"gpus": 4}, "parallelism": {"tensor": 2}}, 2, 1),
    ({"parallelism": {"tensor": 2}}, 2, 1), ({"resources": {"gpus": 8}, "parallelism": {"nodes": 2}}, 8, 2)])
def test_tensor_defaults_to_the_pods_gpus(engine, tensor, nodes):
    spec = parse_spec("llama", {"model": {"uri": "pvc://m/x"}, "engine": engine})
    assert (spec.engine.parallelism.tensor, spec.engine.parallelism.nodes) == (tensor, nodes)
    defaulted = crd.apply_defaults(crd.SCHEMA, crd.full({"model": {"uri": "pvc://m/x"}, "engine": engine}))["spec"]
    assert parse_spec("llama", defaulted) == spec  # the CRD's defaults are the operator's


@pytest.mark.parametrize("engine, message", [
    ({"resources": {"gpus": 2}, "parallelism": {"tensor": 4}}, "spec.engine.parallelism.tensor (4) must be at most "
                                                               "spec.engine.resources.gpus (2)"),
    ({"parallelism": {"tensor": 0}}, "spec.engine.parallelism.tensor must be an integer >= 1"),
    ({"parallelism": {"nodes": 0}}, "spec.engine.parallelism.nodes must be an integer >= 1"),
    ({"parallelism": {"tensor": 32}}, "spec.engine.parallelism.tensor must be at most 16"),
    ({"parallelism": {"nodes": 65}}, "spec.engine.parallelism.nodes must be at most 64"),
    ({"args": ["-tp", "2"]}, "spec.engine.args[0] must not set --tensor-parallel-size"),
    ({"args": ["--tensor-parallel=2"]}, "spec.engine.args[0] must not set --tensor-parallel-size"),
    ({"args": ["--headless"]}, "spec.engine.args[0] must not set --headless"),
])
def test_the_operator_refuses_what_cannot_run(engine, message):
    with pytest.raises(SpecError) as err:
        parse_spec("llama", {"model": {"uri": "pvc://m/x"}, "engine": engine})
    assert message in str(err.value)


def test_a_multi_node_name_must_leave_room_for_group_and_pod_names():
    spec = {**TWO_NODES, "adapters": []}
    parse_spec("a" * 40, spec)
    with pytest.raises(SpecError, match="at most 40 characters"):
        parse_spec("a" * 41, spec)
    assert any("at most 40 characters" in f for f in crd.cel_failures(crd.full(spec, "a" * 41)))
    assert crd.cel_failures(crd.full(spec, "a" * 40)) == []
    assert crd.cel_failures(crd.full({**spec, "engine": {"resources": {"gpus": 8}}}, "a" * 63)) == []


@pytest.mark.parametrize("engine, refused", [
    ({"resources": {"gpus": 4}, "parallelism": {"tensor": 8}}, True),
    ({"resources": {"gpus": 4}, "parallelism": {"tensor": 4}}, False),
    ({"resources": {"gpus": 4}, "parallelism": {"tensor": 2}}, False),
    ({"parallelism": {"tensor": 2}}, False),  # the CPU: ranks are processes, gloo between them
    ({"resources": {"gpus": 4}}, False),
])
def test_cel_rule_refuses_more_ranks_than_gpus(engine, refused):
    failures = crd.cel_failures(crd.full({"model": {"uri": "pvc://m/x"}, "engine": engine}))
    assert any("parallelism.tensor must be at most spec.engine.resources.gpus" in f for f in failures) == refused
    try:
        parse_spec("llama", {"model": {"uri": "pvc://m/x"}, "engine": engine})
        assert not refused
    except SpecError:
        assert refused  # the operator refuses exactly what the API server refuses


@pytest.mark.parametrize("parallelism, expected", [
    ({"tensor": 17}, "greater than the maximum"), ({"nodes": 0}, "less than the minimum"),
    ({"nodes": 65}, "greater than the maximum"), ({"pipeline": 2}, "Additional properties")])
def test_schema_bounds_parallelism(parallelism, expected):
    errors = crd.schema_errors(crd.full({"model": {"uri": "pvc://m/x"}, "engine": {"parallelism": parallelism}}))
    strict = crd_strict_errors({"model": {"uri": "pvc://m/x"}, "engine": {"parallelism": parallelism}})
    assert any(expected in e for e in errors + strict), errors + strict


def crd_strict_errors(spec: dict) -> list[str]:
    import jsonschema

    import crd_schema
    validator = jsonschema.Draft202012Validator(crd_schema.json_schema(crd.SCHEMA))
    return [e.message for e in validator.iter_errors(crd.full(spec))]


def test_chart_crd_is_the_same_file():
    from pathlib import Path

    root = Path(crd.__file__).resolve().parents[2]
    chart = root / "charts" / "kubeinfer" / "crds" / crd.CRD_PATH.name
    assert chart.read_text() == crd.CRD_PATH.read_text()


# -- one node: the Deployment --------------------------------------------------------------------------------
def test_four_gpus_run_four_ranks_without_further_spelling():
    deployment = objects(FOUR_GPUS)["Deployment"]
    kubernetes_validate.validate(deployment, K8S, strict=True)
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    args = serve_parser().parse_args(container["args"][1:])
    assert (args.tensor_parallel_size, args.device, args.nnodes, args.headless) == (4, "cuda", 1, False)
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 4
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert "/dev/shm" in mounts  # NCCL's intra-node transport


def test_one_gpu_and_the_cpu_render_no_parallel_flag():
    for spec in ({"model": {"uri": "pvc://m/x"}}, {"model": {"uri": "pvc://m/x"}, "engine": {"resources": {"gpus": 1}}}):
        args = objects(spec)["Deployment"]["spec"]["template"]["spec"]["containers"][0]["args"]
        assert not {"--tensor-parallel-size", "--nnodes", "--headless"} & set(args)


def test_every_container_reports_its_failure_in_its_termination_message():
    deployment = objects({"model": {"uri": "hf://org/model"}, "adapters": [{"name": "a", "uri": "s3://loras/a"}]})[
        "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    assert len(pod["initContainers"]) == 2
    for container in pod["containers"]:  # the engine's own fatal error only, never its log's tail (issue #44)
        assert container["terminationMessagePolicy"] == "File", container["name"]
    for container in pod["initContainers"]:  # hf / aws: no termination file of their own, no requests seen
        assert container["terminationMessagePolicy"] == "FallbackToLogsOnError", container["name"]
    kubernetes_validate.validate(deployment, K8S, strict=True)


# -- several nodes: the LeaderWorkerSet ------------------------------------------------------------------------
def test_nodes_render_a_leader_worker_set_the_lws_crd_accepts():
    built = objects(TWO_NODES)
    assert set(built) == {"LeaderWorkerSet", "Service", "PodDisruptionBudget", "InferencePool", "NetworkPolicy"}
    lws = built["LeaderWorkerSet"]
    assert lws_problems(lws) == []
    assert (lws["apiVersion"], lws["metadata"]["name"]) == ("leaderworkerset.x-k8s.io/v1", "llama-lws")
    assert lws["spec"]["replicas"] == 3  # replicas + standby groups
    group = lws["spec"]["leaderWorkerTemplate"]
    assert (group["size"], group["restartPolicy"]) == (2, "RecreateGroupOnPodRestart")
    for template in (group["leaderTemplate"], group["workerTemplate"]):  # and each pod as Kubernetes sees it
        kubernetes_validate.validate({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", **template[
            "metadata"]}, "spec": template["spec"]}, K8S, strict=True)
    for kind in ("Service", "PodDisruptionBudget", "NetworkPolicy"):
        kubernetes_validate.validate(built[kind], K8S, strict=True)


def test_the_lws_crd_check_can_fail():
    lws = objects(TWO_NODES)["LeaderWorkerSet"]
    lws["spec"]["leaderWorkerTemplate"]["size"] = "2"
    lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["argz"] = []
    problems = lws_problems(lws)
    assert any("size" in p for p in problems) and any("argz" in p for p in problems)


def test_leader_serves_and_workers_follow_it_as_their_ranks():
    lws = objects(TWO_NODES)["LeaderWorkerSet"]
    pods = group_pods(lws, "ml", lambda: "2026-01-01T00:00:00Z")
    parser = serve_parser()
    ranks = {}
    for pod in pods[:2]:  # group 0: its leader and its worker, as the LWS controller makes them
        container = pod["spec"]["containers"][0]
        env = {e["name"]: e["value"] for e in container["env"] if "value" in e}
        args = parser.parse_args(expand(container["args"], env)[1:])
        assert "$(" not in " ".join(expand(container["args"], env)), "every $(VAR) is one the pod has"
        assert (args.tensor_parallel_size, args.nnodes, args.master_port) == (16, 2, 29500)
        assert args.master_addr == "llama-lws-0.llama-lws.ml"
        assert args.max_num_seqs == 64 and args.enable_lora  # every rank builds the same model
        ranks[pod["metadata"]["name"]] = (args.node_rank, args.headless, args.lora_placement_file)
        assert (container.get("readinessProbe") is None) == args.headless  # a headless rank has no /health
    assert ranks == {"llama-lws-0": (0, False, "/etc/kubeinfer/placement/adapters"),
                     "llama-lws-0-1": (1, True, None)}


def test_only_leaders_can_be_endpoints():
    built = objects(TWO_NODES)
    group = built["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    assert ROLE_LABEL not in group["leaderTemplate"]["metadata"]["labels"]  # the operator sets active / standby
    assert group["workerTemplate"]["metadata"]["labels"][ROLE_LABEL] == "worker"
    assert "ports" not in group["workerTemplate"]["spec"]["containers"][0]
    for selector in (built["Service"]["spec"]["selector"], built["InferencePool"]["spec"]["selector"]["matchLabels"]):
        assert selector[ROLE_LABEL] == "active"


def admitted(policies: list[dict], source: dict, target: dict, port: int) -> bool:
    """NetworkPolicy's rule for pods in one namespace (podSelector matchLabels only, as ours use): the target is
    reachable when no policy selects it, or some policy selecting it has an ingress rule matching source and port."""
    def matches(selector: dict, pod: dict) -> bool:
        return selector.get("matchLabels", {}).items() <= pod["metadata"]["labels"].items()
    selecting = [p["spec"] for p in policies if matches(p["spec"]["podSelector"], target)]
    return not selecting or any(
        any(matches(peer.get("podSelector", {}), source) for peer in rule.get("from", []))
        and ("ports" not in rule or any(p["port"] == port for p in rule["ports"]))
        for spec in selecting for rule in spec.get("ingress", []))


def test_a_groups_ports_admit_only_its_own_pods():
    """Each group's ranks reach each other on any port (rendezvous, step channel, NCCL's own); another group,
    a standby group, the gateway, or a pod that only wears the model's labels reach none of them."""
    owner, spec = copy.deepcopy(OWNER), parse_spec("llama", TWO_NODES)
    built = desired_objects(owner, spec, OperatorConfig(), with_pool=True)
    groups = group_network_policies(owner, spec)
    assert [g["metadata"]["name"] for g in groups] == [f"llama.group-{i}" for i in range(4)]  # 3 groups + surge
    policies = [o for o in built if o["kind"] == "NetworkPolicy"] + groups
    for policy in policies:
        kubernetes_validate.validate(policy, K8S, strict=True)
    assert all("ports" in rule for rule in policies[0]["spec"]["ingress"]), "the model's policy: API ports only"
    lws = next(o for o in built if o["kind"] == "LeaderWorkerSet")
    pods = {p["metadata"]["name"]: p for p in group_pods(lws, "ml", lambda: "2026-01-01T00:00:00Z")}
    leader, worker, other_group, standby = (pods["llama-lws-0"], pods["llama-lws-0-1"], pods["llama-lws-1-1"],
                                            pods["llama-lws-2"])
    for port in (29500, 29501, 41234):
        assert admitted(policies, worker, leader, port) and admitted(policies, leader, worker, port)
        for stranger in (other_group, standby):
            assert not admitted(policies, stranger, leader, port) and not admitted(policies, stranger, worker, port)
    gateway = {"metadata": {"labels": {"app.kubernetes.io/part-of": "kubeinfer",
                                       "app.kubernetes.io/component": "gateway"}}}
    labelled = {"metadata": {"labels": dict(selector_labels("llama"))}}  # a namespace user's pod, labelled so
    assert admitted(policies, gateway, leader, 8000) and not admitted(policies, gateway, leader, 29501)
    assert not any(admitted(policies, labelled, leader, port) for port in (8000, 29500, 29501))
    assert group_network_policies(owner, parse_spec("llama", FOUR_GPUS)) == []
    single = objects(FOUR_GPUS)["NetworkPolicy"]["spec"]["ingress"]
    assert all("ports" in rule for rule in single), "one node: API ports only, as before"


def test_every_rank_reads_the_models_group_secret():
    owner, spec = copy.deepcopy(OWNER), parse_spec("llama", TWO_NODES)
    group = objects(TWO_NODES)["LeaderWorkerSet"]["spec"]["leaderWorkerTemplate"]
    wanted = {"name": "KUBEINFER_TP_SECRET",
              "valueFrom": {"secretKeyRef": {"name": "llama-tp-secret", "key": "secret"}}}
    for template in ("leaderTemplate", "workerTemplate"):
        assert wanted in group[template]["spec"]["containers"][0]["env"]
    secret = group_secret(owner, spec)
    kubernetes_validate.validate(secret, K8S, strict=True)
    assert secret["metadata"]["name"] == "llama-tp-secret"
    assert secret["metadata"]["ownerReferences"][0]["uid"] == OWNER["metadata"]["uid"]
    value = base64.b64decode(secret["data"]["secret"])
    assert len(value) >= 32 and value != base64.b64decode(group_secret(owner, spec)["data"]["secret"])
    assert "Secret" not in objects(TWO_NODES)  # created once by the reconciler, never applied over
    one_node = objects(FOUR_GPUS)["Deployment"]["spec"]["template"]["spec"]["containers"][0]
    assert all(e["name"] != "KUBEINFER_TP_SECRET" for e in one_node["env"])  # one node draws its own
    with pytest.raises(SpecError, match="spec.engine.env\\[0\\].name 'KUBEINFER_TP_SECRET' is the tensor-parallel"):
        parse_spec("llama", {**TWO_NODES, "engine": {**TWO_NODES["engine"],
                                                     "env": [{"name": "KUBEINFER_TP_SECRET", "value": "x" * 32}]}})


def test_a_group_is_disrupted_one_at_a_time():
    assert objects(TWO_NODES)["PodDisruptionBudget"]["spec"]["maxUnavailable"] == 1


# -- groups as serving units -----------------------------------------------------------------------------------
def _pods(nodes_spec: dict, ready: set[str], status: dict[str, dict] | None = None) -> list[dict]:
    lws = objects(nodes_spec)["LeaderWorkerSet"]
    pods = group_pods(lws, "ml", iter(f"2026-01-01T00:00:0{i}Z" for i in range(10)).__next__)
    for pod in pods:
        name = pod["metadata"]["name"]
        pod["status"] = {"phase": "Running", "podIP": f"10.0.0.{len(name)}",
                         "conditions": [{"type": "Ready", "status": "True" if name in ready else "False"}],
                         **(status or {}).get(name, {})}
    return pods


def test_a_group_serves_only_when_every_rank_is_ready():
    pods = _pods(TWO_NODES, ready={"llama-lws-0", "llama-lws-0-1", "llama-lws-1", "llama-lws-2-1"})
    units = {u.name: u.ready for u in serving_units(pods, nodes=2)}
    assert units == {"llama-lws-0": True, "llama-lws-1": False, "llama-lws-2": False}
    plan = assign_roles(serving_units(pods, 2), 2)
    assert set(plan.roles) == {"llama-lws-0", "llama-lws-1", "llama-lws-2"}, "workers never get a role"


def test_pods_of_the_other_shape_are_no_units():
    pods = _pods(TWO_NODES, ready=set())
    deployment_pod = {"metadata": {"name": "llama-abc", "labels": selector_labels("llama")}, "status": {}}
    assert [u.name for u in serving_units(pods + [deployment_pod], 1)] == ["llama-abc"]
    assert "llama-abc" not in {u.name for u in serving_units(pods + [deployment_pod], 2)}
    assert all(SET_NAME_LABEL in p["metadata"]["labels"] and GROUP_INDEX_LABEL in p["metadata"]["labels"]
               and WORKER_INDEX_LABEL in p["metadata"]["labels"] for p in pods)


def test_a_workers_trouble_is_its_groups_and_named():
    crash = {"containerStatuses": [{"name": "engine", "ready": False, "restartCount": 4,
                                    "state": {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}},
                                    "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message":
                                                  "kubeinfer serve: rank 1 could not reach llama-lws-0:29500"}}}]}
    pods = _pods(TWO_NODES, ready=set(), status={"llama-lws-0-1": crash})
    spec = parse_spec("llama", TWO_NODES)
    units = serving_units(pods, 2)
    ready = {c.type: c for c in conditions_for(spec, units, assign_roles(units, 2), None)}["Ready"]
    assert ready.reason == "EngineCrashLoop"
    assert ready.message.startswith("pod llama-lws-0-1: engine: CrashLoopBackOff")
    assert "could not reach llama-lws-0:29500" in ready.message


# -- a failed start, in the model's conditions ----------------------------------------------------------------
HEADS = "kubeinfer serve: the model has 14 attention heads, which --tensor-parallel-size 4 does not divide"


def _crashing(last: dict, state: dict | None = None) -> dict:
    return {"metadata": {"name": "llama-0", "creationTimestamp": "2026-01-01T00:00:00Z"},
            "status": {"phase": "Running", "containerStatuses": [{
                "name": "engine", "ready": False, "restartCount": 3,
                "state": state or {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 20s restarting"}},
                "lastState": {"terminated": {"exitCode": 1, "reason": "Error", **last}}}]}}


def _degraded(pod: dict) -> tuple[str, str]:
    spec = parse_spec("llama", FOUR_GPUS)
    view = pod_view(pod)
    got = {c.type: c for c in conditions_for(spec, [view], assign_roles([view], 1), None)}
    assert got["Ready"].message.split("; ")[0] in got["Degraded"].message
    return got["Degraded"].reason, got["Degraded"].message


def test_the_engines_last_words_are_in_the_condition():
    reason, message = _degraded(_crashing({"message": HEADS}))
    assert reason == "EngineCrashLoop"
    assert message.startswith("pod llama-0: engine: CrashLoopBackOff: back-off 20s restarting; last exit code 1: "
                              + HEADS)


def test_a_container_that_just_died_is_reported_before_its_back_off():
    pod = _crashing({}, state={"terminated": {"exitCode": 1, "reason": "Error", "message": HEADS}})
    pod["status"]["containerStatuses"][0]["lastState"] = {}
    reason, message = _degraded(pod)
    assert reason == "EngineCrashLoop" and message.startswith(f"pod llama-0: engine: Terminated: exit code 1: {HEADS}")


def test_a_log_tail_is_cut_to_its_first_and_last_lines():
    log = "\n".join(f"2026-01-01 INFO line {i}" for i in range(80)) + "\nRuntimeError: CUDA error: out of memory"
    _, message = _degraded(_crashing({"message": log}))
    assert "line 0" in message and "RuntimeError: CUDA error: out of memory" in message
    assert "line 40" not in message and " ... " in message
    assert len(message) < 1300


def test_a_crash_without_a_message_still_says_how_it_ended():
    _, message = _degraded(_crashing({"reason": "OOMKilled", "exitCode": 137}))
    assert "last exit code 137: OOMKilled" in message


def test_engine_text_mentioning_images_is_not_an_image_pull_failure():
    reason, _ = _degraded(_crashing({"message": "kubeinfer serve: Image processor config missing"}))
    assert reason == "EngineCrashLoop"


# -- the examples in manifests/ --------------------------------------------------------------------------------
def _example(name: str) -> dict:
    import yaml

    import crd_schema
    path = crd.CRD_PATH.parents[1] / "manifests" / "examples" / name
    obj = crd_schema.apply_defaults(crd.SCHEMA, yaml.safe_load(path.read_text()))
    return objects(obj["spec"], obj["metadata"]["name"])


def test_the_multi_gpu_example_runs_four_ranks():
    args = _example("llama-70b-4gpu.yaml")["Deployment"]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert flag(args, "--tensor-parallel-size") == "4"


def test_the_multi_node_example_is_a_valid_leader_worker_set():
    lws = _example("llama-405b-2nodes.yaml")["LeaderWorkerSet"]
    assert lws_problems(lws) == [] and lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    args = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]["args"]
    assert (flag(args, "--tensor-parallel-size"), flag(args, "--nnodes")) == ("16", "2")


def test_ranks_on_the_cpu_get_shared_memory_too():
    pod = objects({"model": {"uri": "pvc://m/x"}, "engine": {"parallelism": {"tensor": 2}}})["Deployment"]["spec"][
        "template"]["spec"]
    assert {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}} in pod["volumes"]
    single = objects({"model": {"uri": "pvc://m/x"}})["Deployment"]["spec"]["template"]["spec"]
    assert all(v["name"] != "shm" for v in single["volumes"]), "one CPU rank: as before"


def test_the_gateway_never_routes_to_a_worker():
    """The gateway's own discovery, even by a bare model selector without the role label."""
    from kubeinfer.gateway.datastore.discovery import endpoint_of

    pods = _pods(TWO_NODES, ready={"llama-lws-0", "llama-lws-0-1"})
    leader, worker = pods[0], pods[1]
    leader["metadata"]["labels"][ROLE_LABEL] = "active"  # as the operator labels it
    assert endpoint_of(leader, selector_labels("llama"), 8000) is not None
    assert endpoint_of(worker, selector_labels("llama"), 8000) is None
