"""`kubeinfer operator`: run the InferenceModel operator in-cluster or against KUBECONFIG."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses

from kubeinfer.operator.config import OperatorConfig


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
    parser.add_argument("-v", "--verbose", action="count", default=0, help="-v: info, -vv: debug")
    parser.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only")


def config_from(args: argparse.Namespace) -> OperatorConfig:
    return dataclasses.replace(
        OperatorConfig(), engine_image=args.engine_image, hf_fetcher_image=args.hf_fetcher_image,
        s3_fetcher_image=args.s3_fetcher_image, endpoint_picker_service=args.endpoint_picker_service,
        endpoint_picker_port=args.endpoint_picker_port, resync_seconds=args.resync_seconds)


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

    _parser = argparse.ArgumentParser(prog="kubeinfer operator", description=__doc__)
    add_arguments(_parser)
    sys.exit(run(_parser.parse_args()))
