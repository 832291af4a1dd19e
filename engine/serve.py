"""`kubeinfer serve MODEL_DIR`: one engine pod's process (HTTP API, optional gRPC, metrics).

SIGTERM drains: /health turns 503 so the pod leaves its Service, new requests get 503, in-flight
requests get up to --drain-timeout seconds to finish, the rest are aborted, and the process exits 0.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal

import uvicorn

logger = logging.getLogger("kubeinfer.serve")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's flag names, so deployment manifests carry over."""
    parser.add_argument("model", help="Hugging Face model directory (safetensors)")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None, help="model name clients send (default: the directory)")
    parser.add_argument("--api-key", default=os.environ.get("KUBEINFER_API_KEY") or os.environ.get("VLLM_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 (env KUBEINFER_API_KEY)")
    parser.add_argument("--grpc-port", type=int, default=None, help="also serve the gRPC API on this port")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=None)
    parser.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    parser.add_argument("--max-waiting-requests", type=int, default=256,
                        help="bound on queued requests; beyond it clients get 429 with Retry-After")
    parser.add_argument("--drain-timeout", type=float, default=30.0, help="seconds in-flight work gets after SIGTERM")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lora-modules", nargs="*", default=[], metavar="NAME=PATH")
    parser.add_argument("--enable-lora", action="store_true")
    parser.add_argument("--max-loras", type=int, default=4)
    parser.add_argument("--max-lora-rank", type=int, default=64)
    parser.add_argument("--max-cpu-loras", type=int, default=None)
    parser.add_argument("--log-level", default="info")


def build_state(args: argparse.Namespace):
    from .api_server import ServerState
    from .async_engine import AsyncEngine
    from .config import EngineConfig
    from .llm_engine import LLMEngine

    if args.lora_modules or args.enable_lora:
        raise SystemExit("kubeinfer serve: LoRA serving is not built yet (issue #4)")
    config = EngineConfig(model=args.model, device=args.device, dtype=None if args.dtype == "auto" else args.dtype,
                          max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
                          num_kv_blocks=args.num_kv_blocks, enable_prefix_caching=args.enable_prefix_caching,
                          seed=args.seed)
    engine = AsyncEngine(LLMEngine(config), max_waiting_requests=args.max_waiting_requests)
    return ServerState(engine, args.served_model_name or args.model, args.model, api_key=args.api_key)


class _DrainFirstServer(uvicorn.Server):
    """uvicorn alone would stop at once on SIGTERM and re-raise the signal (exit code -15); we drain
    first and then set should_exit ourselves."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def serve(args: argparse.Namespace) -> int:
    from .api_server import build_app

    state = build_state(args)
    state.async_engine.start()
    app = build_app(state)
    server = _DrainFirstServer(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                              timeout_graceful_shutdown=int(args.drain_timeout) + 5))
    grpc_server = None
    if args.grpc_port is not None:
        from .grpc_server import start_grpc_server
        grpc_server = await start_grpc_server(state, args.host, args.grpc_port)

    loop = asyncio.get_running_loop()
    draining = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, draining.set)

    async def drain_on_signal() -> None:
        await draining.wait()
        state.draining = True
        logger.info("draining: %d requests in flight, up to %.0fs", state.async_engine.num_unfinished, args.drain_timeout)
        deadline = loop.time() + args.drain_timeout
        while state.async_engine.num_unfinished and loop.time() < deadline:
            await asyncio.sleep(0.1)
        state.async_engine.abort_all()
        if grpc_server is not None:
            await grpc_server.stop(grace=1)
        server.should_exit = True

    drainer = asyncio.create_task(drain_on_signal())
    try:
        await server.serve()
    finally:
        drainer.cancel()
        state.async_engine.shutdown()
    return 0


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(serve(args))
