"""`kubeinfer serve`'s tensor-parallel flags (vLLM's names), and a follower node's whole run (`--headless`):
no API, its ranks follow node 0's (docs/tensor-parallel.md)."""
from __future__ import annotations

import argparse
import logging

logger = logging.getLogger("kubeinfer.serve")


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    """Tensor parallelism over the GPUs of a pod, and over pods (docs/tensor-parallel.md)."""
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                        help="ranks the model is split across, over all nodes as in vLLM (one process per GPU); "
                             "each of the --nnodes nodes runs an equal share")
    parser.add_argument("--nnodes", type=int, default=1, help="nodes (pods) the tensor-parallel group spans")
    parser.add_argument("--node-rank", type=int, default=0, help="this node's rank; nodes other than 0 run --headless")
    parser.add_argument("--master-addr", default="127.0.0.1", help="node 0's address, where the group meets")
    parser.add_argument("--master-port", type=int, default=None,
                        help="node 0's rendezvous port (the step channel uses the next one); default: a free port")
    parser.add_argument("--headless", action="store_true",
                        help="no API: run this node's ranks and follow node 0 (multi-node, --node-rank > 0)")
    parser.add_argument("--distributed-timeout", type=float, default=60.0,
                        help="seconds a rank may stay silent in a step (or the group take to form) before the "
                             "engine dies and the server exits non-zero")


def serve_headless(args: argparse.Namespace, engine_config) -> int:
    """A node other than 0: its ranks follow node 0's; exits non-zero when the group fails. `engine_config`:
    serve's reading of the flags."""
    from ..core.tp_worker import run_headless

    if args.node_rank == 0 or args.nnodes < 2 or args.master_port is None:
        raise SystemExit("kubeinfer serve: --headless is for nodes other than 0 of a multi-node group: give "
                         "--nnodes (2 or more), --node-rank (1 or more), --master-addr and --master-port")
    try:
        config = engine_config(args, [])
    except ValueError as error:
        raise SystemExit(f"kubeinfer serve: {error}") from None
    logger.info("headless node %d of %d: %d ranks following %s:%d", args.node_rank, args.nnodes,
                config.ranks_per_node, args.master_addr, args.master_port)
    try:
        return run_headless(config)
    except ValueError as error:  # e.g. no group secret (distributed/group_auth.py): said before any rank starts
        raise SystemExit(f"kubeinfer serve: {error}") from None
