"""Compile every Triton kernel of the engine to GPU machine code without a GPU (triton ships ptxas).

The interpreter checks what the kernels compute, not whether they lower: dot shapes below 16, type
mismatches or unsupported ops only fail in the compiler. Run as a script, in a process without
TRITON_INTERPRET (an interpreted kernel cannot be compiled):

    python tests/triton_compile_check.py 80 90      # NVIDIA compute capabilities
"""
from __future__ import annotations

import os
import sys

# Pointer arguments that are not activations (which are bf16, the GPU default dtype).
POINTER_TYPES = {"block_tables_ptr": "*i64", "context_lens_ptr": "*i64", "slot_ptr": "*i64", "query_start_ptr": "*i32",
                 "tokens_ptr": "*i32", "seg_start_ptr": "*i32", "seg_slot_ptr": "*i64", "seg_rank_ptr": "*i32",
                 "s_ptr": "*fp32", "pos_ptr": "*i64", "cos_ptr": "*fp32", "sin_ptr": "*fp32"}
SCALAR_TYPES = {"scale_log2": "fp32", "eps": "fp32", "softcap": "fp32"}


def variants():
    """(kernel, constexprs) pairs: the shapes the engine launches for Llama-3-8B-like models (GQA 4, head_dim
    128), a group that is no power of two, MHA with an odd head_dim, and the fp32 (upcast) path."""
    from kubeinfer.engine.lora import triton_ops as tlo
    from kubeinfer.engine.platforms.cuda import triton_attention as ta
    from kubeinfer.engine.platforms.cuda import triton_norm as tn
    from kubeinfer.engine.model_executor.layers.fused_moe import triton_moe as tm
    from kubeinfer.engine.model_executor.layers.quantization import triton_int_matmul as qm
    from kubeinfer.engine.triton_utils import group_tile

    attn = dict(GROUP=4, GROUP_PAD=4, BLOCK_N=64, HEAD_DIM=128, DIM_PAD=128, BLOCK_SIZE=16, UPCAST=False,
                SOFTCAP=False, SINKS=False)
    write = dict(NUM_KV_HEADS=8, HEAD_DIM=128, HEADS_PAD=8, DIM_PAD=128, BLOCK_SIZE=16)
    return [
        (ta._write_kv_kernel, dict(write, FP8_MAX=0.0, TO_BF16=False)),
        (ta._paged_attention_kernel, dict(attn, BLOCK_M=16, BLOCK_Q=4)),  # decode
        (ta._paged_attention_kernel, dict(attn, BLOCK_M=64, BLOCK_Q=16)),  # prefill
        (ta._paged_attention_kernel, dict(attn, GROUP=7, GROUP_PAD=8, BLOCK_M=64, BLOCK_Q=8)),
        (ta._paged_attention_kernel, dict(attn, GROUP=1, GROUP_PAD=1, BLOCK_M=16, BLOCK_Q=16, HEAD_DIM=80)),
        (ta._paged_attention_kernel, dict(attn, BLOCK_M=64, BLOCK_Q=16, UPCAST=True)),
        (ta._paged_attention_kernel, dict(attn, BLOCK_M=64, BLOCK_Q=32, GROUP=2, GROUP_PAD=2, HEAD_DIM=256,
                                          DIM_PAD=256, SOFTCAP=True)),  # Gemma 2: capped scores, 256-wide heads
        (ta._paged_attention_kernel, dict(attn, BLOCK_M=16, BLOCK_Q=2, GROUP=8, GROUP_PAD=8, HEAD_DIM=64, DIM_PAD=64,
                                          SINKS=True)),  # gpt-oss: a sink logit per head
        (tlo._shrink_kernel, dict(BLOCK_T=16, BLOCK_R=16, BLOCK_K=64, UPCAST=False)),
        (tlo._expand_kernel, dict(BLOCK_T=16, BLOCK_O=64, BLOCK_R=16, UPCAST=False)),
        (tn._rms_norm_kernel, dict(N=4096, BLOCK=4096, HAS_RESIDUAL=True)),
        (tn._rms_norm_kernel, dict(N=2048, BLOCK=2048, HAS_RESIDUAL=False)),
        (tn._rotary_kernel, dict(NUM_HEADS=32, NUM_KV_HEADS=8, HEADS_PAD=32, KV_HEADS_PAD=8, HALF=64, HALF_PAD=64)),
        (tn._rotary_kernel, dict(NUM_HEADS=28, NUM_KV_HEADS=4, HEADS_PAD=32, KV_HEADS_PAD=4, HALF=40, HALF_PAD=64)),
        # --kv-cache-dtype fp8 / fp8_e5m2: 8-bit caches written (saturating) and read by the attention kernels
        *[(kernel, constexprs, {"k_cache_ptr": fp8, "v_cache_ptr": fp8})
          for fp8, limit in (("*fp8e4nv", 448.0), ("*fp8e5", 57344.0))
          for kernel, constexprs in ((ta._write_kv_kernel, dict(write, FP8_MAX=limit, TO_BF16=False)),
                                     (ta._paged_attention_kernel, dict(attn, BLOCK_M=16, BLOCK_Q=4)))],
        # --kv-cache-dtype bfloat16 under a float16 or float32 model: rounded by _bf16_bits, widened as it is read
        *[(kernel, constexprs, {**pointers, "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16"})
          for model in ("*fp16", "*fp32")
          for kernel, constexprs, pointers in (
              (ta._write_kv_kernel, dict(write, FP8_MAX=0.0, TO_BF16=True), {"k_ptr": model, "v_ptr": model}),
              (ta._paged_attention_kernel, dict(attn, BLOCK_M=16, BLOCK_Q=4, UPCAST=model == "*fp32"),
               {"q_ptr": model, "out_ptr": model}))],
        # kept-quantized int8 / int4 weights (layers/quantization/triton_int_matmul.py)
        # kept-quantized int8 / int4 / fp8 (e4m3 bits as bytes) weights (layers/quantization/triton_int_matmul.py)
        # (ONE_GROUP: the tile inside one group, the exact integers multiplied and the sums scaled; groups of 8 span
        # tiles: the weight scaled before the dot)
        *[(qm._int_matmul_kernel, dict(GROUP=group, INT4=int4, FP8=fp8, HAS_ZERO=zero, HAS_BIAS=False, UPCAST=False,
                                       BLOCK_M=16, BLOCK_N=64, BLOCK_K=group_tile(group, 4096)[0],
                                       ONE_GROUP=group_tile(group, 4096)[1]),  # K = 4096
           {"q_ptr": "*u8" if int4 or fp8 else "*i8", "scale_ptr": "*fp32", "zero_ptr": "*i8"})
          for int4, fp8, group, zero in ((False, False, 4096, False), (True, False, 128, True),
                                         (True, False, 64, False), (False, True, 128, False), (False, False, 8, True))],
        (qm._decode_e4m3_kernel, dict(BLOCK=256), {"bits_ptr": "*u8", "out_ptr": "*fp32"}),
        # the fused MoE GEMMs (fused_moe/triton_moe.py): the first reads each token top_k times, the second weighs
        # each pair; float stacks (gpt-oss: with biases) and kept int8 / int4 / fp8 experts
        *[(tm._grouped_gemm_kernel, dict(MOE, A_ROWS_PER_TOKEN=rows, MUL_WEIGHT=rows == 1, HAS_BIAS=bias, **quant),
           {**MOE_POINTERS, **({"b_ptr": "*u8" if quant["INT4"] or quant["FP8"] else "*i8", "scale_ptr": "*bf16",
                                "zero_ptr": "*bf16"} if quant["QUANT"] else {})})
          for rows in (8, 1) for bias, quant in (
              (False, dict(QUANT=False, INT4=False, FP8=False, HAS_ZERO=False, GROUP=1, ONE_GROUP=False)),
              (True, dict(QUANT=False, INT4=False, FP8=False, HAS_ZERO=False, GROUP=1, ONE_GROUP=False)),
              (False, moe_quant(INT4=False, FP8=False, HAS_ZERO=False, GROUP=2048)),
              (False, moe_quant(INT4=True, FP8=False, HAS_ZERO=True, GROUP=128)),
              (False, moe_quant(INT4=False, FP8=True, HAS_ZERO=False, GROUP=128)),
              (False, moe_quant(INT4=False, FP8=False, HAS_ZERO=True, GROUP=8)))],
    ]


MOE = dict(UPCAST=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=64)


def moe_quant(GROUP: int, **flags) -> dict:  # noqa: N803 (the kernel's constexpr names)
    """Kept experts' constexprs, the K tile as triton_moe._gemm picks it for K = 2048."""
    from kubeinfer.engine.triton_utils import group_tile

    block_k, one_group = group_tile(GROUP, 2048)
    return dict(QUANT=True, GROUP=GROUP, BLOCK_K=block_k, ONE_GROUP=one_group, **flags)
MOE_POINTERS = {"sorted_ids_ptr": "*i32", "expert_ids_ptr": "*i32", "num_padded_ptr": "*i32", "weights_ptr": "*fp32"}


def signature(kernel, constexprs: dict, pointers: dict | None = None) -> dict[str, str]:
    fp32 = constexprs.get("UPCAST") is True and kernel.__name__ == "_paged_attention_kernel"
    activation = "*fp32" if fp32 else "*bf16"
    sig = {}
    missing = [p.name for p in kernel.params if p.is_constexpr and p.name not in constexprs]
    if missing:  # a constexpr left out would compile as a runtime integer: a kernel the engine never launches
        raise ValueError(f"{kernel.__name__}: give every constexpr; missing {missing}")
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = (pointers or {}).get(name) or POINTER_TYPES.get(name, activation)
        else:
            sig[name] = SCALAR_TYPES.get(name, "i32")
    return sig


def main(capabilities: list[int]) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("unset TRITON_INTERPRET: interpreted kernels cannot be compiled")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    failures = 0
    for capability in capabilities:
        target = GPUTarget("cuda", capability, 32)
        for kernel, constexprs, *pointers in variants():
            if capability < 89 and "*fp8e4nv" in str(pointers):
                continue  # Triton has no e4m3 before sm_89: the engine refuses fp8_e4m3 there (kv_cache_dtype.py)
            try:
                triton.compile(ASTSource(fn=kernel, signature=signature(kernel, constexprs, *pointers),
                                         constexprs=constexprs), target=target)
                print(f"ok   sm_{capability} {kernel.__name__} {constexprs}")
            except Exception as error:  # report every failing variant, not only the first
                failures += 1
                print(f"FAIL sm_{capability} {kernel.__name__} {constexprs}: {type(error).__name__}: {error}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main([int(c) for c in sys.argv[1:]] or [80, 90]))
