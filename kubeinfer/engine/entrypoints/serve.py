"""`kubeinfer serve MODEL_DIR`: one engine pod's process (HTTP API, optional gRPC, metrics).

SIGTERM drains: /health turns 503 so the pod leaves its Service, new requests get 503, in-flight
requests get up to --drain-timeout seconds to finish, the rest are aborted, and the process exits 0.

If the engine dies (failed steps in a row, or a device error), /health and gRPC health turn 503 /
NOT_SERVING at once, every request in flight gets the error, and the process exits with code 1 so
that Kubernetes restarts the container: a pod that cannot serve must not look alive.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import signal

import uvicorn

from kubeinfer.common.engine_key import engine_key_from_env
from kubeinfer.common.http_guard import add_http_limit_arguments, guard_from_args
from kubeinfer.common.http_server import server_config

import kubeinfer.engine.envs as envs
from .parallel_args import add_parallel_arguments, serve_headless

logger = logging.getLogger("kubeinfer.serve")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's flag names, so deployment manifests carry over."""
    from ..config import KV_CACHE_DTYPES
    from .openai.reasoning_parsers import REASONING_PARSERS
    from .openai.tool_parsers import PARSERS as TOOL_CALL_PARSERS

    parser.add_argument("model", help="Hugging Face model directory (safetensors)")
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None, help="model name clients send (default: the directory)")
    parser.add_argument("--api-key", default=engine_key_from_env(),
                        help="require 'Authorization: Bearer KEY' on every route but /health, /metrics and /version "
                             "(env KUBEINFER_API_KEY; the gateway presents it with --engine-api-key)")
    parser.add_argument("--grpc-port", type=int, default=None, help="also serve the gRPC API on this port")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", "-q", default=None,
                        help="fp8, compressed-tensors, awq (awq_marlin), gptq (gptq_marlin): must name the checkpoint's "
                             "method (read from config.json when left out); fp8 on a float checkpoint quantizes it at "
                             "load (per channel)")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                        help="KV cache elements: auto (the model dtype), bfloat16 (whatever the model dtype: twice a "
                             "float32 cache's blocks) or 8-bit float with per-tensor scales (the checkpoint's "
                             "k_scale/v_scale, else 1.0): twice a bf16 cache's blocks in the same memory")
    parser.add_argument("--attention-backend", choices=("torch", "triton"), default=None,
                        help="attention kernels (default: triton on CUDA when installed, torch on CPU)")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-kv-blocks", type=int, default=None,
                        help="KV-cache blocks (default: sized from --gpu-memory-utilization on CUDA, 4 GiB on CPU)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                        help="this engine's share of GPU memory for weights, activations and the KV cache")
    parser.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs: every step runs eagerly")
    parser.add_argument("--disable-async-output-proc", dest="async_output_processing", action="store_const",
                        const=False, default=None,
                        help="CUDA: detokenize and deliver each step's outputs before launching the next step "
                             "instead of while the GPU runs it (on by default on CUDA, off on CPU)")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="CUDA: schedule and launch each step before the previous step's token ids reach the "
                             "host, so the GPU does not wait for the host between steps (outputs unchanged)")
    parser.add_argument("--no-enable-prefix-caching", dest="enable_prefix_caching", action="store_false")
    parser.add_argument("--max-waiting-requests", type=int, default=256,
                        help="bound on queued sequences (each prompt of a request times its n); beyond it clients "
                             "get 429 with Retry-After")
    parser.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                        help="fcfs: arrival order; priority: a request's `priority` first (lower runs first), then "
                             "arrival. Under fcfs a request with a priority is refused")
    parser.add_argument("--kv-events-config", default=None, metavar="JSON",
                        help='publish KV-cache events as vLLM does, e.g. \'{"enable_kv_cache_events": true, '
                             '"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\' '
                             '(keys: enable_kv_cache_events, publisher, endpoint, replay_endpoint, topic, '
                             'buffer_steps, hwm, max_queue_size); docs/kv-events.md')
    parser.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                        help='an external KV tier, as vLLM: \'{"kv_connector": "OffloadingConnector", "kv_role": '
                             '"kv_both", "kv_connector_extra_config": {"cpu_bytes_to_use": N}, '
                             '"kv_load_failure_policy": "recompute"}\': evicted KV blocks kept in host memory')
    parser.add_argument("--kv-offloading-size", type=float, default=None, metavar="GIB",
                        help="vLLM's shorthand for that native CPU tier: its GiB of host memory")
    parser.add_argument("--kv-offloading-backend", default=None, help="native (the default; lmcache is not served)")
    parser.add_argument("--kv-events-auth", choices=("auto", "none"), default="auto",
                        help="auto: with --api-key the KV-event sockets the engine binds are ZMQ CURVE servers that "
                             "admit only a subscriber holding the same key (the gateway); none: unauthenticated, "
                             "as vLLM (for a subscriber that cannot do CURVE; keep the ports closed to all else)")
    parser.add_argument("--speculative-config", default=None, metavar="JSON",
                        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
                             '"prompt_lookup_max": 4, "prompt_lookup_min": 2}\', or a draft model with the same '
                             'tokenizer: \'{"model": DIR, "num_speculative_tokens": 4}\' (optional: "disable_by_batch_size")')
    parser.add_argument("--drain-timeout", type=float, default=30.0, help="seconds in-flight work gets after SIGTERM")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--lora-modules", nargs="*", default=[], metavar="NAME=PATH",
                        help="LoRA adapters (PEFT format) to serve from the start; clients select one with model=NAME. "
                             "Implies --enable-lora")
    parser.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (batched, mixed with the base)")
    parser.add_argument("--max-loras", type=int, default=4, help="adapters on the device at once (slots per batch)")
    parser.add_argument("--max-lora-rank", type=int, default=64)
    parser.add_argument("--max-cpu-loras", type=int, default=None,
                        help="adapters cached in host memory, device ones included (default: --max-loras)")
    parser.add_argument("--allowed-lora-dirs", nargs="*", default=envs.ALLOWED_LORA_DIRS.get(),
                        metavar="DIR", help="directories /v1/load_lora_adapter may read adapters from "
                                            "(default: none, runtime loading by path is refused)")
    parser.add_argument("--lora-placement-file", default=None, metavar="FILE",
                        help="file listing the adapters placed on this pod (the downward-API projection of the "
                             "annotation serving.kubeinfer.io/adapters); polled, adapters loaded from "
                             "--lora-catalog-dir/NAME and unloaded to match. Implies --enable-lora")
    parser.add_argument("--lora-catalog-dir", default=None, metavar="DIR",
                        help="directory holding one PEFT adapter per subdirectory, named after the adapter")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help='accepted for vLLM compatibility: tool_choice "auto" is always on (OpenAI\'s default '
                             "with tools), with --tool-call-parser or the format of the model's chat template")
    parser.add_argument("--tool-call-parser", choices=tuple(TOOL_CALL_PARSERS), default=None,
                        help="the model family's tool-call format: hermes (Qwen, Hermes), llama3_json (Llama 3.1+), "
                             "mistral (default: the format the model's chat template writes)")
    parser.add_argument("--reasoning-parser", choices=tuple(REASONING_PARSERS), default=None,
                        help="put a reasoning model's thinking (between its think tags) in message.reasoning, "
                             "the rest in content")
    parser.add_argument("--max-prompt-chars", type=int, default=None,
                        help="characters of prompt text (chat: of all messages) a request may send; longer is a 400 "
                             "before tokenizing (default: 10 per token of --max-model-len)")
    parser.add_argument("--tokenizer-pool-size", type=int, default=4,
                        help="threads that tokenize prompts and render chat templates, off the event loop")
    add_http_limit_arguments(parser, max_concurrent_requests=1024)
    parser.add_argument("--log-level", default="info")
    add_parallel_arguments(parser)


def build_state(args: argparse.Namespace):
    from ..core.async_engine import AsyncEngine
    from ..core.llm_engine import LLMEngine
    from ..lora.request import LoRARequest
    from .openai.api_server import ServerState

    lora_modules = parse_lora_modules(args.lora_modules)
    if bool(args.lora_placement_file) != bool(args.lora_catalog_dir):
        raise SystemExit("kubeinfer serve: --lora-placement-file and --lora-catalog-dir go together")
    try:  # a bad flag, model directory or GPU memory budget: one line that says what to change
        engine = LLMEngine(engine_config(args, lora_modules))
    except ValueError as error:
        raise SystemExit(f"kubeinfer serve: {error}") from None
    for lora_id, (name, path) in enumerate(lora_modules, start=1):
        try:
            engine.add_lora(LoRARequest(name, lora_id, path))
        except ValueError as error:  # LoRALoadError included: say which module and what to fix
            engine.shutdown()
            raise SystemExit(f"kubeinfer serve: --lora-modules {name}={path}: {error}") from None
    async_engine = AsyncEngine(engine, max_waiting_requests=args.max_waiting_requests)
    if engine.ranks is not None:  # a rank that dies while the server idles kills the engine at once
        engine.ranks.watch.on_failure.append(async_engine.fail)
    return ServerState(async_engine,
                       args.served_model_name or args.model, args.model, api_key=args.api_key,
                       lora_dirs=list(args.allowed_lora_dirs), tool_call_parser=args.tool_call_parser,
                       reasoning_parser=args.reasoning_parser, max_prompt_chars=args.max_prompt_chars,
                       tokenizer_pool_size=args.tokenizer_pool_size)


def engine_config(args: argparse.Namespace, lora_modules: list[tuple[str, str]]):
    """The EngineConfig the flags describe (ValueError on a bad one)."""
    from ..config import EngineConfig

    return EngineConfig(model=args.model, device=args.device, dtype=None if args.dtype == "auto" else args.dtype,
                        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
                        num_kv_blocks=args.num_kv_blocks, enable_prefix_caching=args.enable_prefix_caching,
                        seed=args.seed, enable_lora=args.enable_lora or bool(lora_modules or args.lora_placement_file),
                        max_loras=args.max_loras,
                        max_lora_rank=args.max_lora_rank, max_cpu_loras=args.max_cpu_loras,
                        attention_backend=args.attention_backend,
                        gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
                        scheduling_policy=args.scheduling_policy, speculative_config=args.speculative_config,
                        kv_events_config=args.kv_events_config,
                        kv_transfer_config=args.kv_transfer_config, kv_offloading_size=args.kv_offloading_size,
                        kv_offloading_backend=args.kv_offloading_backend,
                        kv_events_key=args.api_key if args.kv_events_auth == "auto" else None,
                        async_output_processing=args.async_output_processing,
                        async_scheduling=args.async_scheduling, quantization=args.quantization,
                        tensor_parallel_size=args.tensor_parallel_size, nnodes=args.nnodes,
                        node_rank=args.node_rank, master_addr=args.master_addr, master_port=args.master_port,
                        distributed_timeout=args.distributed_timeout, kv_cache_dtype=args.kv_cache_dtype)


def parse_lora_modules(values: list[str]) -> list[tuple[str, str]]:
    """vLLM's two spellings: NAME=PATH, or JSON {"name": ..., "path": ...}."""
    modules = []
    for value in values:
        if value.lstrip().startswith("{"):
            try:
                item = json.loads(value)
                modules.append((item["name"], item["path"]))
            except (json.JSONDecodeError, KeyError, TypeError):
                raise SystemExit(f'kubeinfer serve: --lora-modules {value!r}: expected {{"name": ..., "path": ...}}') from None
            continue
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"kubeinfer serve: --lora-modules {value!r}: expected NAME=PATH")
        modules.append((name, path))
    names = [name for name, _ in modules]
    if len(set(names)) != len(names):
        raise SystemExit(f"kubeinfer serve: --lora-modules names must be unique, got {', '.join(names)}")
    return modules


class _DrainFirstServer(uvicorn.Server):
    """uvicorn alone would stop at once on SIGTERM and re-raise the signal (exit code -15); we drain
    first and then set should_exit ourselves."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def serve(args: argparse.Namespace) -> int:
    from .openai.api_server import build_app

    state = build_state(args)
    state.async_engine.start()
    app = build_app(state, guard_from_args(args))
    server = _DrainFirstServer(server_config(app, args.header_read_timeout, host=args.host, port=args.port,
                                             log_level=args.log_level,
                                             timeout_graceful_shutdown=int(args.drain_timeout) + 5))
    grpc_server = None
    if args.grpc_port is not None:
        from .grpc.server import start_grpc_server
        grpc_server = await start_grpc_server(state, args.host, args.grpc_port)

    placement = None
    if args.lora_placement_file:
        from ..lora.placement import PlacementWatcher
        watcher = PlacementWatcher(state, args.lora_placement_file, args.lora_catalog_dir)
        await watcher.sync()  # placed adapters are loaded before /health turns ready
        placement = asyncio.create_task(watcher.run())

    loop = asyncio.get_running_loop()
    draining = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, draining.set)
    died = asyncio.Event()
    state.async_engine.on_death.append(lambda _: loop.call_soon_threadsafe(died.set))

    async def exit_on_death() -> None:
        await died.wait()
        if grpc_server is not None:
            await grpc_server.start_draining()  # NOT_SERVING
            await grpc_server.stop(grace=1)
        server.should_exit = True

    async def drain_on_signal() -> None:
        await draining.wait()
        state.draining = True
        if grpc_server is not None:
            await grpc_server.start_draining()
        logger.info("draining: %d requests in flight, up to %.0fs", state.async_engine.num_unfinished, args.drain_timeout)
        deadline = loop.time() + args.drain_timeout
        while state.async_engine.num_unfinished and loop.time() < deadline:
            await asyncio.sleep(0.1)
        state.async_engine.abort_all()
        if grpc_server is not None:
            await grpc_server.stop(grace=1)
        server.should_exit = True

    drainer = asyncio.create_task(drain_on_signal())
    reaper = asyncio.create_task(exit_on_death())
    try:
        await server.serve()
    finally:
        drainer.cancel()
        reaper.cancel()
        if placement is not None:
            placement.cancel()
        state.async_engine.shutdown()
        state.async_engine.engine.shutdown()  # the other tensor-parallel ranks: exit 0, or non-zero after a failure
    if state.async_engine.death is not None:
        logger.critical("exiting: the engine died (%s)", state.async_engine.death)
        return 1
    return 0


def main(args: argparse.Namespace) -> int:
    from .termination_log import termination_message_on_failure

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault(envs.LOG_LEVEL.name, args.log_level.upper())  # the tensor-parallel ranks' level
    with termination_message_on_failure():  # a failed start's reason reaches the pod's status
        if args.headless:
            return serve_headless(args, engine_config)
        if args.node_rank > 0:
            raise SystemExit("kubeinfer serve: --node-rank > 0 runs a follower node: add --headless")
        return asyncio.run(serve(args))
