"""Start-up of the model side: load the weights into a ModelRunner, size the KV cache (the user's block
count, else what GPU memory allows after a profiled worst-case step, else the CPU budget), allocate it,
and capture CUDA graphs for decode steps. Running out of GPU memory at any point is a one-line error
naming the flag to change. A draft model (speculative decoding) is loaded beside the target, and its
KV cache has as many blocks as the target's (it is paged by the same block tables). On a model mixing
sliding-window and full layers, the windowed layers get a pool of their own (core/window_blocks.py)."""
from __future__ import annotations

import logging
import time
from collections import Counter

import torch

from ..config import EngineConfig, ModelSpec
from ..lora.pool import LoRAPool
from ..model_executor.layers.attention_selector import check_attention_backend
from ..model_executor.layers.quantization.kv_cache_dtype import (
    cache_dtype,
    check_kv_cache_dtype,
    checkpoint_kv_scales,
    install_kv_scales,
    scaled,
)
from ..model_executor.model_loader import ModelFiles, inspect_model_dir
from ..model_executor.model_runner import ModelRunner
from .block_manager import BlockManager
from .kv_cache_sizing import GiB, kv_cache_bytes, measure_gpu, num_kv_blocks, out_of_memory_says
from .tensor_parallel import TensorParallelGroup
from .window_blocks import HybridBlockManager

logger = logging.getLogger(__name__)


def draft_files(model_dir: str, max_model_len: int, target_tokenizer) -> ModelFiles:
    """The draft model's files, checked against the target before any weight is read."""
    from .detokenizer import load_tokenizer

    try:
        files = inspect_model_dir(model_dir)
    except ValueError as error:
        raise ValueError(f"speculative_config model: {error}") from None
    spec = ModelSpec(files.config, files.architecture)
    if spec.max_position_embeddings < max_model_len:
        raise ValueError(f"speculative_config model: the draft's max_position_embeddings ({spec.max_position_embeddings}) "
                         f"is below max_model_len ({max_model_len}); lower --max-model-len or use another draft")
    tokenizer = load_tokenizer(model_dir)
    if tokenizer is not None and target_tokenizer is not None and tokenizer.get_vocab() != target_tokenizer.get_vocab():
        raise ValueError(f"speculative_config model: {model_dir} has another tokenizer than the target; a draft model "
                         "must share the target's tokenizer")
    return files


def build_runner(config: EngineConfig, files: ModelFiles, spec: ModelSpec, device: torch.device, dtype: torch.dtype,
                 max_model_len: int, pool: LoRAPool | None, step_tokens: int, draft: ModelFiles | None = None,
                 ranks: TensorParallelGroup | None = None) -> tuple[ModelRunner, int, ModelRunner | None]:
    """The loaded runner, its KV cache allocated (and decode graphs captured), its block count, and the
    draft model's runner (with its KV cache) when `draft` is given. With tensor parallelism (`ranks`) this is
    rank 0's slice; the other ranks do each step of the set-up when told, and take rank 0's block count."""
    backend = check_attention_backend(config.attention_backend, device)
    draft_runner = None
    send = ranks.send if ranks is not None else (lambda message: None)

    check_kv_cache_dtype(config.kv_cache_dtype, backend, device)
    if config.kernels.quant_kernel == "triton":  # forced (quantization/linear_kernels.py)
        from ..triton_utils import check_device

        check_device(device, "KUBEINFER_QUANT_KERNEL=triton", "the CPU's kernels (unset KUBEINFER_QUANT_KERNEL)")
    kv_dtype = cache_dtype(config.kv_cache_dtype, dtype)

    def load() -> ModelRunner:
        nonlocal draft_runner
        runner = ModelRunner(files, device=device, dtype=dtype, max_model_len=max_model_len,
                             block_size=config.block_size, attention_backend=backend, lora_pool=pool,
                             tp_size=config.world_size, kernels=config.kernels)
        runner.ranks = ranks
        if draft is not None:
            draft_runner = ModelRunner(draft, device=device, dtype=dtype, max_model_len=max_model_len,
                                       block_size=config.block_size, attention_backend=backend,
                                       kernels=config.kernels)
        for built, source in ((runner, files), (draft_runner, draft)):
            if built is not None and kv_dtype != dtype:  # bf16, or 8 bits with the checkpoint's scales if any
                built.cache_dtype = kv_dtype
                if scaled(kv_dtype):
                    install_kv_scales(built.model, checkpoint_kv_scales(source.weight_files))
        return runner

    spec = spec.for_rank(0, config.world_size)  # a rank's KV cache holds its own KV heads
    window = ModelRunner.window_group(spec)
    num_windowed = sum(w is not None for w in spec.layer_windows) if window else 0
    per_block = ModelRunner.kv_bytes_per_block(spec, config.block_size, kv_dtype, spec.num_layers - num_windowed)
    per_window_block = ModelRunner.kv_bytes_per_block(spec, config.block_size, kv_dtype, num_windowed)
    if draft is not None:
        per_block += ModelRunner.kv_bytes_per_block(ModelSpec(draft.config, draft.architecture), config.block_size,
                                                    kv_dtype)
    enough = config.max_num_seqs * -(-max_model_len // config.block_size)
    window_blocks = None
    if config.num_kv_blocks:
        runner, blocks = load(), config.num_kv_blocks
        window_blocks = blocks if window else None  # as many as the full layers': never the tighter pool
    else:
        if device.type != "cuda":
            runner, kv_bytes = load(), config.kv_cache_memory_bytes
        else:
            def load_and_profile() -> ModelRunner:
                runner = load()
                with out_of_memory_says("the profiling step", "lower --max-num-batched-tokens or --max-num-seqs"):
                    send(("profile", step_tokens, config.max_num_seqs))
                    runner.profile_run(step_tokens, config.max_num_seqs)
                return runner

            profile, runner = measure_gpu(device, load_and_profile)
            kv_bytes = kv_cache_bytes(profile, config.gpu_memory_utilization)
            logger.info("GPU memory: %.2f GiB total, %.2f GiB for weights and the profiled step, %.2f GiB other; "
                        "KV cache %.2f GiB (gpu_memory_utilization %.2f)", profile.total / GiB, profile.torch_peak / GiB,
                        profile.non_torch_growth / GiB, kv_bytes / GiB, config.gpu_memory_utilization)
        if window:
            window_blocks = window_pool_blocks(window, config, step_tokens, enough, kv_bytes // 2 // per_window_block)
            kv_bytes -= window_blocks * per_window_block
        if device.type != "cuda":
            blocks = max(1, min(enough, kv_bytes // per_block))
        else:
            blocks = num_kv_blocks(kv_bytes, per_block, block_size=config.block_size, max_model_len=max_model_len)
    runner.num_window_blocks = window_blocks
    send(("kv_cache", blocks, window_blocks))  # the same block count on every rank: rank 0's
    with out_of_memory_says("allocating the KV cache", "lower --gpu-memory-utilization or --num-kv-blocks"):
        runner.allocate_kv_cache(blocks, window_blocks)
        if draft_runner is not None:
            draft_runner.allocate_kv_cache(blocks)
    with out_of_memory_says("capturing CUDA graphs", "pass --enforce-eager, or lower --max-num-seqs"):
        _capture_decode_graphs(runner, config, device, send)
    return runner, blocks, draft_runner


def memory_summary(runner: ModelRunner, num_blocks: int) -> str:
    """What the start-up log says of memory, true for every weight format and cache type: the weights' bytes as
    held (the parameters, tied ones once: a checkpoint dequantized at load counts at the model dtype, a kept-
    quantized layer or MoE layer its integers and scales), which linear and expert layers are kept quantized or
    quantize their activations (W8A8: the scheme and kernel), the KV cache's bytes per token over all layers, and
    its blocks; with tensor parallelism, rank 0's (every rank holds as much)."""
    weights = sum(p.numel() * p.element_size() for p in runner.model.parameters() if p.device.type != "meta")
    per_token = sum(k.element_size() * k[0, 0].numel() + v.element_size() * v[0, 0].numel() for k, v in runner.kv_caches)
    kernels = Counter(getattr(runner.model, "quant_kernels", {}).values())
    kept = "".join(f", {n} linear layers {kernel}" for kernel, n in sorted(kernels.items()) if kernel != "dequantized")
    experts = Counter(getattr(runner.model, "expert_kernels", {}).values())  # layers/fused_moe/int_experts.py
    kept += "".join(f", {n} MoE expert layers {kernel}" for kernel, n in sorted(experts.items())
                    if kernel != "dequantized")
    w8a8 = Counter(getattr(runner.model, "activation_schemes", {}).values())  # layers/quantization/w8a8.py
    kept += "".join(f", {n} {'MoE expert' if scheme.endswith('(fused experts)') else 'linear'} layers with "
                    f"activations {scheme.removesuffix(' (fused experts)')}" for scheme, n in sorted(w8a8.items()))
    ranks = runner.model.spec.tp_size
    kept += f" (per rank, of {ranks})" if ranks > 1 else ""  # rank 0's slice: weights, KV heads and blocks alike
    return (f"weights {weights / (1 << 20):.2f} MiB{kept}, KV cache {str(runner.cache_dtype).removeprefix('torch.')} "
            f"{per_token} bytes per token, {num_blocks} blocks")


def window_pool_blocks(window: int, config: EngineConfig, step_tokens: int, enough: int, at_most: int) -> int:
    """The sliding-window layers' pool: what max_num_seqs sequences hold at once (each the blocks of its
    last window and the next one, plus a step's new tokens), at most half the KV memory, but never less
    than one sequence's full step needs (or no sequence could ever be scheduled)."""
    bs = config.block_size
    one = -(-(window - 1 + step_tokens) // bs) + 2
    wanted = min(enough, config.max_num_seqs * (-(-(window - 1) // bs) + 2) + -(-step_tokens // bs))
    return max(one, min(wanted, at_most))


def build_block_manager(config: EngineConfig, spec: ModelSpec, runner: ModelRunner, num_blocks: int):
    """A BlockManager; on a model whose windowed layers have their own pool, the pair (core/window_blocks.py)."""
    if not runner.window_pool:
        return BlockManager(num_blocks, config.block_size, config.enable_prefix_caching)
    return HybridBlockManager(num_blocks, runner.num_window_blocks, config.block_size, ModelRunner.window_group(spec),
                              config.enable_prefix_caching)


def _capture_decode_graphs(runner: ModelRunner, config: EngineConfig, device: torch.device, send) -> None:
    if device.type != "cuda" or config.enforce_eager:
        return
    if not runner.backend.supports_cuda_graphs:
        logger.info("CUDA graphs off: the %s attention backend runs eagerly", runner.backend.name)
        return
    started = time.monotonic()
    send(("graphs", config.max_num_seqs, False))  # every rank records its own graphs, collectives included
    runner.capture_decode_graphs(config.max_num_seqs)
    logger.info("captured CUDA graphs for decode batch sizes %s in %.1f s", runner.graphs.sizes,
                time.monotonic() - started)
