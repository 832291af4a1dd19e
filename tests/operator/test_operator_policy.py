"""Issue 34, the operator as a policy point (findings 10-12), pure parts: owned engine flags in any spelling,
the pod policy (host paths, images, priority classes, tolerations, control plane), fetch credentials
only in their init containers, the engine key from a Secret, and the NetworkPolicy per model."""
from __future__ import annotations

import argparse

import aiohttp.web
import kubernetes_validate
import pytest
from parallel_helpers import serve_parser

from kubeinfer.operator.builders import desired_objects
from kubeinfer.operator.cli import add_arguments, config_from
from kubeinfer.operator.config import OperatorConfig
from kubeinfer.operator.loaded import HttpLoadedAdapters
from kubeinfer.operator.owned_args import OWNED_FLAGS, option_of
from kubeinfer.operator.pod_template import engine_args, pod_template
from kubeinfer.operator.pods import PodView
from kubeinfer.operator.policy import PodPolicy, PolicyError, image_repository, violations
from kubeinfer.operator.spec import SpecError, parse_spec

K8S = "1.34.0"
OWNER = {"apiVersion": "serving.kubeinfer.io/v1alpha1", "kind": "InferenceModel",
         "metadata": {"name": "chat", "namespace": "team-a", "uid": "6f1c2a4e-0000-4000-8000-000000000002"}}


def engine_parser(allow_abbrev: bool) -> argparse.ArgumentParser:
    return serve_parser(allow_abbrev)


def refused(spec: dict) -> str:
    with pytest.raises(SpecError) as err:
        parse_spec("chat", spec)
    return str(err.value)


# -- finding 11: flags the operator owns -----------------------------------------------------------------
ABBREVIATED = ["--served-model=x", "--lora-catalog=/", "--ho=127.0.0.1", "--ho", "--served-model",
               "--lora-placement=/etc/passwd", "--api-key=", "--api=k", "--scheduling-policy=fcfs", "--max-lor=9"]


@pytest.mark.parametrize("arg", ABBREVIATED)
def test_owned_flags_are_refused_in_any_spelling(arg):
    message = refused({"model": {"uri": "pvc://m/x"}, "engine": {"args": [arg, "1"] if "=" not in arg else [arg]}})
    assert "spec.engine.args[0] must not set --" in message and option_of(arg) in message


def test_an_abbreviating_parser_reads_them_as_the_owned_flags():
    """The finding itself, on the engine's own flags: argparse with abbreviations expands these prefixes."""
    abbreviating = engine_parser(allow_abbrev=True)
    args = abbreviating.parse_args(["/m", "--served-model=x", "--lora-catalog=/", "--ho=127.0.0.1"])
    assert (args.served_model_name, args.lora_catalog_dir, args.host) == ("x", "/", "127.0.0.1")


def test_the_engine_cli_refuses_abbreviations():
    from kubeinfer.cli import build_parser

    argv = ["serve", "/m", "--served-model=x"]
    with pytest.raises(SystemExit):
        build_parser(argv).parse_args(argv)
    assert build_parser(argv).parse_args(["serve", "/m", "--served-model-name=x"]).served_model_name == "x"


def test_every_engine_flag_the_operator_does_not_own_passes():
    parser = engine_parser(allow_abbrev=False)
    free = [o for action in parser._actions for o in action.option_strings
            if o.startswith("--") and o not in OWNED_FLAGS and o != "--help"]
    assert "--max-num-seqs" in free and "--drain-timeout" in free
    spec = parse_spec("chat", {"model": {"uri": "pvc://m/x"}, "engine": {"args": [f"{o}=1" for o in free]}})
    assert len(spec.engine.args) == len(free)


def test_owned_flags_are_every_flag_the_operator_sets_and_the_engine_knows():
    spec = parse_spec("chat", {"model": {"uri": "pvc://m/x"}, "engine": {"maxModelLen": 64, "dtype": "float16",
                                                                        "resources": {"gpus": 1}},
                               "adapters": [{"name": "a", "uri": "pvc://l/a"}]})
    set_by_operator = {a for a in engine_args(spec) if a.startswith("--")}
    assert set_by_operator <= set(OWNED_FLAGS)
    known = {o for action in engine_parser(False)._actions for o in action.option_strings}
    assert set(OWNED_FLAGS) <= known, "an owned flag the engine no longer has"


@pytest.mark.parametrize("name", ["KUBEINFER_API_KEY", "VLLM_API_KEY"])
def test_the_engine_key_cannot_be_set_in_spec_env(name):
    message = refused({"model": {"uri": "pvc://m/x"}, "engine": {"env": [{"name": name, "value": ""}]}})
    assert f"spec.engine.env[0].name {name!r}" in message


# -- finding 10: pod policy --------------------------------------------------------------------------------
def problems(engine: dict | None = None, policy: PodPolicy | None = None, uri: str = "pvc://m/x",
             adapters: list | None = None) -> list[str]:
    spec = parse_spec("chat", {"model": {"uri": uri}, "engine": engine or {}, "adapters": adapters or []})
    return violations(spec, policy or PodPolicy(), "ghcr.io/kubeinfer/engine:0.1.0")


@pytest.mark.parametrize("uri", ["file:///var/lib/kubelet", "file:///etc/kubernetes", "file:///srv/models/x"])
def test_file_uris_are_refused_without_an_allowed_host_path(uri):
    (problem,) = problems(uri=uri)
    assert problem.startswith("spec.model.uri file://") and "--allow-host-path" in problem


def test_file_uris_only_under_an_allowed_prefix():
    policy = PodPolicy(host_path_prefixes=("/srv/models",))
    assert problems(uri="file:///srv/models/llama", policy=policy) == []
    assert problems(uri="file:///srv/models-evil/x", policy=policy), "a prefix matches at a path boundary"
    (problem,) = problems(uri="pvc://m/x", policy=policy, adapters=[{"name": "a", "uri": "file:///srv/x"}])
    assert problem.startswith("spec.adapters[0].uri") and "not under an allowed host path" in problem
    with pytest.raises(SpecError, match="must not contain '..'"):
        parse_spec("chat", {"model": {"uri": "file:///srv/models/../../etc"}})


@pytest.mark.parametrize("prefix", ["/", "/var", "/var/lib", "/etc/kubernetes", "relative", "/srv/../etc"])
def test_a_host_path_prefix_covering_the_nodes_state_is_refused_at_start(prefix):
    with pytest.raises(PolicyError):
        PodPolicy(host_path_prefixes=(prefix,))
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(SystemExit, match="--allow-host-path"):
        config_from(parser.parse_args(["--allow-host-path", prefix]))


@pytest.mark.parametrize("image, allowed", [
    ("ghcr.io/kubeinfer/engine:0.2.0-cuda", True), ("ghcr.io/kubeinfer/engine@sha256:" + "a" * 64, True),
    ("ghcr.io/kubeinfer/engine-evil:1", False), ("docker.io/attacker/miner:latest", False), ("busybox", False)])
def test_images_come_from_the_engine_repository_by_default(image, allowed):
    assert (problems({"image": image}) == []) is allowed


def test_allowed_image_prefixes_replace_the_default():
    policy = PodPolicy(image_prefixes=("registry.corp/ml/",))
    assert problems({"image": "registry.corp/ml/engine:1"}, policy) == []
    (problem,) = problems({"image": "ghcr.io/kubeinfer/engine:1"}, policy)
    assert "spec.engine.image" in problem and "registry.corp/ml/" in problem
    assert image_repository("host:5000/a/b:tag@sha256:00") == "host:5000/a/b"


def test_system_priority_classes_are_refused_unless_listed():
    (problem,) = problems({"priorityClassName": "system-node-critical"})
    assert "spec.engine.priorityClassName 'system-node-critical'" in problem
    assert problems({"priorityClassName": "inference"}) == []
    listed = PodPolicy(priority_classes=("inference-high",))
    assert problems({"priorityClassName": "inference-high"}, listed) == []
    assert problems({"priorityClassName": "inference"}, listed)


def test_wildcard_tolerations_and_control_plane_placement_are_refused_unless_allowed():
    engine = {"tolerations": [{"operator": "Exists"},
                              {"key": "node-role.kubernetes.io/control-plane", "operator": "Exists"},
                              {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
              "nodeSelector": {"node-role.kubernetes.io/control-plane": ""}}
    found = problems(engine)
    assert [p.split(" ")[0] for p in found] == ["spec.engine.tolerations[0]", "spec.engine.tolerations[1]",
                                               "spec.engine.nodeSelector"]
    assert problems(engine, PodPolicy(allow_wildcard_tolerations=True, allow_control_plane=True)) == []


def test_policy_flags_reach_the_config():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from(parser.parse_args([
        "--allow-host-path", "/srv/models/", "--allowed-image-prefix", "registry.corp/", "--allowed-priority-class",
        "hi", "--allow-wildcard-tolerations", "--allow-control-plane"]))
    assert config.policy == PodPolicy(("/srv/models",), ("registry.corp/",), ("hi",), True, True)
    assert config_from(parser.parse_args([])).policy == PodPolicy()


# -- finding 12: credentials only where they fetch; the engine key -----------------------------------------
CREDENTIALED = {"model": {"uri": "hf://org/model"}, "adapters": [{"name": "a", "uri": "s3://bucket/a"}],
                "engine": {"env": [
                    {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}},
                    {"name": "AWS_ACCESS_KEY_ID", "valueFrom": {"secretKeyRef": {"name": "s3", "key": "id"}}},
                    {"name": "AWS_SECRET_ACCESS_KEY", "valueFrom": {"secretKeyRef": {"name": "s3", "key": "secret"}}},
                    {"name": "LOG_FORMAT", "value": "json"}]}}


def env_names(container: dict) -> set[str]:
    return {e["name"] for e in container.get("env", [])}


def test_fetch_credentials_reach_only_the_init_container_that_fetches():
    config = OperatorConfig(engine_api_key_secret="engine-key")
    pod = pod_template(parse_spec("chat", CREDENTIALED), config)["spec"]
    inits = {c["name"]: env_names(c) for c in pod["initContainers"]}
    engine = env_names(pod["containers"][0])
    assert "LOG_FORMAT" in engine and not engine & {"HF_TOKEN", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"}
    assert "HF_TOKEN" in inits["fetch-model"] and "AWS_ACCESS_KEY_ID" not in inits["fetch-model"]
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= inits["fetch-adapter-0"]
    assert "HF_TOKEN" not in inits["fetch-adapter-0"]
    assert not any("KUBEINFER_API_KEY" in names for names in inits.values()), "the engine key stays in the engine"


def test_engines_take_their_key_from_the_secret_and_probes_use_the_open_health_route():
    container = pod_template(parse_spec("chat", {"model": {"uri": "pvc://m/x"}}),
                             OperatorConfig(engine_api_key_secret="kubeinfer-engine-api-key",
                                            engine_api_key_secret_key="key"))["spec"]["containers"][0]
    (key,) = [e for e in container["env"] if e["name"] == "KUBEINFER_API_KEY"]
    assert key["valueFrom"] == {"secretKeyRef": {"name": "kubeinfer-engine-api-key", "key": "key"}}
    assert "--api-key" not in container["args"], "never on the command line"
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health", "outside /v1: no key needed"
    plain = pod_template(parse_spec("chat", {"model": {"uri": "pvc://m/x"}}), OperatorConfig())["spec"]
    assert "KUBEINFER_API_KEY" not in env_names(plain["containers"][0])


async def test_the_operator_presents_the_key_when_it_reads_loaded_adapters():
    async def models(request: aiohttp.web.Request) -> aiohttp.web.Response:
        if request.headers.get("Authorization") != "Bearer s3cret":
            return aiohttp.web.json_response({"error": {"message": "unauthorized"}}, status=401)
        return aiohttp.web.json_response({"data": [{"id": "base"}, {"id": "sql", "parent": "base"}]})

    app = aiohttp.web.Application()
    app.router.add_get("/v1/models", models)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    pod = PodView(name="p0", ip="127.0.0.1")
    try:
        keyed = await HttpLoadedAdapters(port=port, api_key="s3cret").observe([pod])
        bare = await HttpLoadedAdapters(port=port).observe([pod])
    finally:
        await runner.cleanup()
    assert keyed.loaded == {"p0": ("sql",)}
    assert "401" in bare.unknown["p0"]


# -- the NetworkPolicy --------------------------------------------------------------------------------------
GATEWAY = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "llm"}},
           "podSelector": {"matchLabels": {"app.kubernetes.io/component": "gateway"}}}
SCRAPERS = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}


def policy_of(config: OperatorConfig) -> dict | None:
    spec = parse_spec("chat", {"model": {"uri": "pvc://m/x"}, "standby": {"replicas": 1}})
    return next((o for o in desired_objects(OWNER, spec, config, with_pool=False) if o["kind"] == "NetworkPolicy"),
                None)


def test_network_policy_admits_the_gateway_operator_and_scrapers_only():
    netpol = policy_of(OperatorConfig(api_peers=(GATEWAY,), metrics_peers=(SCRAPERS,)))
    kubernetes_validate.validate(netpol, K8S, strict=True)
    spec = netpol["spec"]
    template = desired_objects(OWNER, parse_spec("chat", {"model": {"uri": "pvc://m/x"}}), OperatorConfig(),
                               False)[1]["spec"]["template"]["metadata"]["labels"]
    assert spec["podSelector"]["matchLabels"].items() <= template.items(), "every pod of the model, standby too"
    assert spec["policyTypes"] == ["Ingress"]
    api, metrics = spec["ingress"]
    assert api == {"from": [GATEWAY], "ports": [{"protocol": "TCP", "port": 8000}, {"protocol": "TCP", "port": 8001}]}
    assert metrics == {"from": [SCRAPERS], "ports": [{"protocol": "TCP", "port": 8000}]}
    assert netpol["metadata"]["ownerReferences"][0]["uid"] == OWNER["metadata"]["uid"]


def test_network_policy_defaults_to_the_gateway_and_operator_in_the_models_namespace():
    netpol = policy_of(OperatorConfig())
    kubernetes_validate.validate(netpol, K8S, strict=True)
    (api,) = netpol["spec"]["ingress"]
    components = [p["podSelector"]["matchLabels"]["app.kubernetes.io/component"] for p in api["from"]]
    assert components == ["gateway", "operator"] and all("namespaceSelector" not in p for p in api["from"])


def test_network_policy_can_be_switched_off_and_peers_come_from_flags():
    assert policy_of(OperatorConfig(network_policy=False)) is None
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    config = config_from(parser.parse_args(["--no-network-policy", "--network-policy-metrics-peers",
                                            '[{"namespaceSelector": {}}]']))
    assert config.network_policy is False and config.metrics_peers == ({"namespaceSelector": {}},)
    assert config_from(parser.parse_args([])).network_policy is True
    for bad in ('{"podSelector": {}}', "[{}]", '[{"podSelecter": {}}]', "nope"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--network-policy-api-peers", bad])


def test_a_missing_key_secret_shows_in_the_models_status():
    """The pod cannot start without the Secret: the kubelet's CreateContainerConfigError reaches Ready."""
    from kubeinfer.operator.pods import pod_view
    from kubeinfer.operator.roles import assign_roles
    from kubeinfer.operator.status import conditions_for

    message = 'secret "kubeinfer-engine-api-key" not found'
    pod = pod_view({"metadata": {"name": "chat-0", "creationTimestamp": "2026-01-01T00:00:00Z"},
                    "status": {"phase": "Pending", "containerStatuses": [{"name": "engine", "state": {
                        "waiting": {"reason": "CreateContainerConfigError", "message": message}}}]}})
    spec = parse_spec("chat", {"model": {"uri": "pvc://m/x"}})
    ready = conditions_for(spec, [pod], assign_roles([pod], 1), None)[0]
    assert (ready.status, ready.reason) == (False, "ContainerNotStarting") and message in ready.message


def test_the_reconciler_gives_the_key_to_both_readers_of_engines():
    from kubeinfer.operator.reconcile import Reconciler

    reconciler = Reconciler(client=None, config=OperatorConfig(engine_api_key="s3cret"))
    assert reconciler.engines.headers == reconciler.metrics.headers == {"Authorization": "Bearer s3cret"}
    assert "s3cret" not in repr(reconciler.config), "the key stays out of logs"
