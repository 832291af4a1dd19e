"""`kubeinfer operator`: run the InferenceModel operator in-cluster or against KUBECONFIG."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
from typing import Any

from kubeinfer.common.engine_key import GATEWAY_KEY_ENV, gateway_key_from_env
from kubeinfer.operator.config import OperatorConfig
from kubeinfer.operator.policy import PodPolicy, PolicyError

# The key the operator presents to engines (GET /v1/models): from the environment, never a flag (ps shows flags).
API_KEY_ENV = GATEWAY_KEY_ENV
PEER_FIELDS = {"podSelector", "namespaceSelector", "ipBlock"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = OperatorConfig()
    parser.add_argument("--namespace", action="append", default=[], metavar="NS",
                        help="watch only this namespace (repeat for more); default: all namespaces")
    parser.add_argument("--peering", default=None, metavar="NAME",
                        help="kopf peering object for running several replicas (one is active); "
                             "default: standalone, one replica")
    parser.add_argument("--priority", type=int, default=0, help="this replica's peering priority")
    parser.add_argument("--engine-image", default=defaults.engine_image,
                        help="engine image for models without spec.engine.image")
    parser.add_argument("--hf-fetcher-image", default=defaults.hf_fetcher_image,
                        help="image with the `hf` CLI for hf:// sources (default: the engine image)")
    parser.add_argument("--s3-fetcher-image", default=defaults.s3_fetcher_image,
                        help="image with the `aws` CLI for s3:// sources")
    parser.add_argument("--endpoint-picker-service", default=defaults.endpoint_picker_service,
                        help="the gateway's Service that InferencePools point at")
    parser.add_argument("--endpoint-picker-port", type=int, default=defaults.endpoint_picker_port)
    parser.add_argument("--resync-seconds", type=float, default=defaults.resync_seconds,
                        help="seconds between periodic passes over every model (status, autoscaling)")
    parser.add_argument("--health-port", type=int, default=8080,
                        help="serve kopf's liveness probe on http://0.0.0.0:PORT/healthz (0: off)")
    policy = parser.add_argument_group("policy: what InferenceModels may ask of the node (docs/security.md)")
    policy.add_argument("--allow-host-path", action="append", default=[], metavar="PREFIX",
                        help="allow file:// models and adapters under this node directory (repeat for more); "
                             "default: none, file:// is refused. Never under /etc, /var/lib/kubelet, /proc ...")
    policy.add_argument("--allowed-image-prefix", action="append", default=[], metavar="PREFIX",
                        help="allow spec.engine.image from this registry or repository prefix (repeat for more); "
                             "default: the repository of --engine-image only")
    policy.add_argument("--allowed-priority-class", action="append", default=[], metavar="NAME",
                        help="allow this spec.engine.priorityClassName (repeat for more); default: any but system-*")
    policy.add_argument("--allow-wildcard-tolerations", action="store_true",
                        help="allow tolerations with operator Exists and no key (they tolerate every taint)")
    policy.add_argument("--allow-control-plane", action="store_true",
                        help="allow nodeSelectors and tolerations naming node-role.kubernetes.io/control-plane "
                             "or master")
    access = parser.add_argument_group("engine access: the key and the NetworkPolicy")
    access.add_argument("--engine-api-key-secret", default="", metavar="NAME",
                        help="Secret in each model's namespace holding the key engines require on /v1 (the one "
                             "the gateway presents); the operator's own reads use env KUBEINFER_ENGINE_API_KEY. "
                             "Default: engines take requests without a key")
    access.add_argument("--engine-api-key-secret-key", default=defaults.engine_api_key_secret_key, metavar="KEY",
                        help="the key inside that Secret")
    access.add_argument("--network-policy", action=argparse.BooleanOptionalAction, default=defaults.network_policy,
                        help="build a NetworkPolicy per model (needs a CNI that enforces NetworkPolicy)")
    access.add_argument("--network-policy-api-peers", type=_peers, default=(), metavar="JSON",
                        help="NetworkPolicyPeer list allowed to the engine API ports (8000, 8001); default: pods "
                             "labelled app.kubernetes.io/component=gateway or operator in the model's namespace")
    access.add_argument("--network-policy-metrics-peers", type=_peers, default=(), metavar="JSON",
                        help="NetworkPolicyPeer list allowed to scrape /metrics on port 8000; default: none")
    access.add_argument("--network-policy-kv-events-peers", type=_peers, default=(), metavar="JSON",
                        help="NetworkPolicyPeer list allowed to the KV-event ports (5557, 5558) of models with "
                             "spec.routing.kvEvents; default: pods labelled app.kubernetes.io/component=gateway "
                             "in the model's namespace (never the API peers: the events carry prompts' token ids)")
    parser.add_argument("-v", "--verbose", action="count", default=0, help="-v: info, -vv: debug")
    parser.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")


def _peers(text: str) -> tuple[dict[str, Any], ...]:
    """A JSON list of NetworkPolicyPeer objects ({podSelector, namespaceSelector, ipBlock})."""
    try:
        peers = json.loads(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(f"not JSON: {err}") from None
    if not isinstance(peers, list) or not all(isinstance(p, dict) and p and set(p) <= PEER_FIELDS for p in peers):
        raise argparse.ArgumentTypeError(f"must be a JSON list of NetworkPolicyPeer objects (fields "
                                         f"{', '.join(sorted(PEER_FIELDS))}), got {text!r}")
    return tuple(peers)


def config_from(args: argparse.Namespace) -> OperatorConfig:
    try:
        policy = PodPolicy(host_path_prefixes=tuple(args.allow_host_path),
                           image_prefixes=tuple(args.allowed_image_prefix),
                           priority_classes=tuple(args.allowed_priority_class),
                           allow_wildcard_tolerations=args.allow_wildcard_tolerations,
                           allow_control_plane=args.allow_control_plane)
    except PolicyError as err:
        raise SystemExit(f"kubeinfer operator: {err}") from None
    return dataclasses.replace(
        OperatorConfig(), engine_image=args.engine_image, hf_fetcher_image=args.hf_fetcher_image,
        s3_fetcher_image=args.s3_fetcher_image, endpoint_picker_service=args.endpoint_picker_service,
        endpoint_picker_port=args.endpoint_picker_port, resync_seconds=args.resync_seconds, policy=policy,
        engine_api_key_secret=args.engine_api_key_secret, engine_api_key_secret_key=args.engine_api_key_secret_key,
        engine_api_key=gateway_key_from_env() or "", network_policy=args.network_policy,
        api_peers=args.network_policy_api_peers, metrics_peers=args.network_policy_metrics_peers,
        kv_events_peers=args.network_policy_kv_events_peers)


def run(args: argparse.Namespace) -> int:
    import kopf

    from kubeinfer.operator.handlers import connect_default, register
    from kubeinfer.operator.kube import KubeClient
    from kubeinfer.operator.reconcile import Reconciler

    kopf.configure(verbose=args.verbose > 0, debug=args.verbose > 1, quiet=args.quiet)
    registry = kopf.OperatorRegistry()
    register(registry, Reconciler(KubeClient(connect_default), config_from(args)))
    liveness = f"http://0.0.0.0:{args.health_port}/healthz" if args.health_port else None
    try:
        asyncio.run(kopf.operator(
            registry=registry, clusterwide=not args.namespace, namespaces=args.namespace,
            standalone=args.peering is None, peering_name=args.peering, priority=args.priority,
            liveness_endpoint=liveness))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":  # `python -m kubeinfer.operator.cli` until `kubeinfer operator` is wired
    import sys

    _parser = argparse.ArgumentParser(prog="kubeinfer operator", description=__doc__, allow_abbrev=False)
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
