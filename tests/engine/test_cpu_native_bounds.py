"""The native products check their own arguments against their buffers (issue 44): each C entry point is given
every buffer's length in bytes and refuses, before writing anything, dimensions that reach past one (KI_EBOUNDS;
ops.check raises NativeArgumentError). Each case here is a valid call (which runs) with one dimension made larger
than its buffer: the call raises and the output, guarded by a sentinel tail, is untouched. And the finding itself,
with the loader's shape check switched off: the crafted checkpoint's experts reach ki_a16_linear, which refuses
them instead of writing past the step's buffer (it ended in `free(): invalid size`, rc 134, before)."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kubeinfer.engine.platforms.cpu.cpu_decoder import Layer, Proj, _kernel as decoder_kernel
from kubeinfer.engine.platforms.cpu.native import a16_method, f32_ops, ops, w4a8_ops

pytestmark = pytest.mark.skipif(not ops.available(), reason="no C compiler: the native kernels do not build")
M, K, N = 3, 64, 32
SENTINEL = 12345.0


def _out(rows: int, cols: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A float32 [rows, cols] view at the head of a buffer whose tail (one more row) holds SENTINEL."""
    buffer = torch.full((rows + 1, cols), SENTINEL)
    buffer[:rows] = 0
    return buffer, buffer[:rows]


def _weights(bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    lo, hi = (-8, 7) if bits == 4 else (-128, 127)
    g = torch.Generator().manual_seed(0)
    return torch.randint(lo, hi + 1, (N, K), generator=g, dtype=torch.int8), torch.rand(N, 2, generator=g) * 0.01


def _a16(bits: int, n: int):
    values, scale = _weights(bits)
    packed = a16_method.pack(values, bits)
    zero = a16_method.pack_zero(torch.zeros_like(scale, dtype=torch.int8), bits)
    return lambda x, out: a16_method.a16_linear(x, packed, bits, ops.pack_groups(scale, torch.float32), zero, K // 2, n)


def _q8_0(bits: int, n: int):
    values, scale = _weights(bits)
    packed = ops.pack_int8(values) if bits == 8 else ops.pack_int4(values)
    offset = ops.pack_groups(torch.full(scale.shape, 128 if bits == 8 else 8, dtype=torch.int32), torch.int32)
    return lambda x, out: ops.q8_0_linear(x, packed, bits, ops.pack_groups(scale, torch.float32), offset, K // 2, n)


def _through_packed_linear(product):
    """The product's own call, then its output copied into `out` (packed_linear allocates it from `n`: a larger n
    must be refused by the kernel's check of the weight's buffers, not only of the output)."""
    def run(x, out):
        out.copy_(product(x, out)[:, :out.shape[1]])
    return run


def _w8a8(n: int):
    values, scale = _weights(8)
    packed, row_scale = ops.pack_int8(values), scale[:, 0].contiguous()

    def run(x, out):
        q, sx = torch.empty(M, K, dtype=torch.int8), torch.empty(M)
        ops.quantize_token_int8(x, q, sx)
        ops.w8a8_into(q, sx, packed.data_ptr(), packed.nbytes, row_scale.data_ptr(), row_scale.nbytes,
                      out if n == N else torch.empty(M, n)[:, :n])
    return run


def _w8a8_into_short_output():
    """The A8 experts' int8 path (a8_experts._int8_into): N taken from an output view narrower than the weight
    is fine; an output buffer shorter than M x N is refused."""
    values, scale = _weights(8)
    packed, row_scale = ops.pack_int8(values), scale[:, 0].contiguous()

    def run(x, out):
        q, sx = torch.empty(M, K, dtype=torch.int8), torch.empty(M)
        ops.quantize_token_int8(x, q, sx)
        short = out.flatten()[: M * N - 1]
        lib = ops.kernel("ki_w8a8")
        ops.check(lib(q.data_ptr(), q.nbytes, sx.data_ptr(), sx.nbytes, M, K, packed.data_ptr(),
                      packed.nbytes, row_scale.data_ptr(), row_scale.nbytes, N, short.data_ptr(),
                      short.nbytes), "W8A8")
    return run


def _w8a8_weight_short():
    """N larger than the packed weight's rows (a smaller checkpoint than the config: the A8 experts' read)."""
    values, scale = _weights(8)
    packed, row_scale = ops.pack_int8(values), scale[:, 0].contiguous()

    def run(x, out):
        q, sx = torch.empty(M, K, dtype=torch.int8), torch.empty(M)
        ops.quantize_token_int8(x, q, sx)
        wide = torch.zeros(M, 2 * N)
        ops.w8a8_into(q, sx, packed.data_ptr(), packed.nbytes, row_scale.data_ptr(), row_scale.nbytes, wide)
        out.copy_(wide[:, :N])
    return run


def _w4a8(n: int, scale_short: bool = False):
    values, scale = _weights(4)
    packed, packed_scale = w4a8_ops.pack(values, scale)
    if scale_short:
        packed_scale = packed_scale[:, :1].contiguous()

    def run(x, out):
        target = out if n == N else torch.empty(M, n)
        w4a8_ops.linear_into(x, packed.data_ptr(), packed.nbytes, packed_scale.data_ptr(),
                             packed_scale.nbytes, 2, K // 2, target)
        out.copy_(target[:, :N])
    return run


def _f32(n: int):
    weight = torch.randn(N, K)

    def run(x, out):
        lib = f32_ops._kernel()
        target = out if n == N else torch.empty(M, n)
        ops.check(lib(x.data_ptr(), x.nbytes, M, K, weight.data_ptr(), weight.nbytes, n, target.data_ptr(),
                      target.nbytes, 1), "float32 linear")
        out.copy_(target[:, :N])
    return run


def _quantize_short():
    def run(x, out):
        q, sx = torch.empty(M, K - 1, dtype=torch.int8), torch.empty(M)
        ops.quantize_token_int8(x, q, sx)
    return run


CASES = {  # name: (a valid call, the same call with one dimension past a buffer)
    "a16_int8_rows": (_a16(8, N), _through_packed_linear(_a16(8, 2 * N))),
    "a16_int4_rows": (_a16(4, N), _through_packed_linear(_a16(4, N + 16))),
    "q8_0_int8_rows": (_q8_0(8, N), _through_packed_linear(_q8_0(8, 2 * N))),
    "q8_0_int4_rows": (_q8_0(4, N), _through_packed_linear(_q8_0(4, N + 16))),
    "w8a8_rows": (_w8a8(N), _w8a8_weight_short()),
    "w8a8_output": (_w8a8(N), _w8a8_into_short_output()),
    "quantize_token_int8": (_w8a8(N), _quantize_short()),
    "w4a8_rows": (_w4a8(N), _w4a8(2 * N)),
    "w4a8_scale_groups": (_w4a8(N), _w4a8(N, scale_short=True)),
    "f32_rows": (_f32(N), _f32(2 * N)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_each_entry_point_refuses_dimensions_past_its_buffers(case):
    valid, broken = CASES[case]
    x = torch.randn(M, K)
    buffer, out = _out(M, N)
    valid(x, out)
    assert torch.isfinite(out).all() and bool((buffer[M] == SENTINEL).all())
    buffer, out = _out(M, N)
    with pytest.raises(ops.NativeArgumentError):
        broken(x, out)
    assert bool((out == 0).all()) and bool((buffer[M] == SENTINEL).all())  # nothing written


def test_a16_refuses_an_output_shorter_than_its_rows():
    """The finding's very call: the experts' N (the checkpoint's rows) larger than the step's output buffer."""
    values, scale = _weights(8)
    packed, zero = a16_method.pack(values, 8), a16_method.pack_zero(torch.zeros_like(scale, dtype=torch.int8), 8)
    scales = ops.pack_groups(scale, torch.float32)
    x = torch.randn(M, K)
    buffer, out = _out(M, N // 2)  # sized from a config of N / 2 rows
    status = a16_method.kernel()(x.data_ptr(), x.nbytes, M, K, packed.data_ptr(), packed.nbytes, 8,
                                 scales.data_ptr(), scales.nbytes, zero.data_ptr(), zero.nbytes, 2, K // 2, N,
                                 out.data_ptr(), out.nbytes)
    assert status == ops.EBOUNDS
    assert bool((out == 0).all()) and bool((buffer[M] == SENTINEL).all())


def test_decoder_layers_refuse_projections_and_scratch_that_do_not_fit():
    """ki_decoder_layers checks every layer's projections against its dimensions, and the scratch and [T, hidden]
    buffers, before touching any pointer (none is given here)."""
    hidden, heads, kv_heads, dim, inter = 64, 4, 2, 16, 64

    def layer(qkv_rows: int) -> Layer:
        def proj(n: int, k: int) -> Proj:
            return Proj(None, None, None, None, 8, 1, k, n, k, 0, 0, 0, 0, 0)
        return Layer(proj(qkv_rows, hidden), proj(hidden, heads * dim), proj(2 * inter, hidden), proj(hidden, inter),
                     H=heads, Hkv=kv_heads, D=dim, hidden=hidden, inter=inter, max_positions=64, view=0)

    run = decoder_kernel("ki_decoder_layers")
    good, bad = layer((heads + 2 * kv_heads) * dim), layer((heads + 2 * kv_heads) * dim + 16)
    scratch_floats = decoder_kernel("ki_decoder_scratch_floats")(ctypes.byref(good))
    tokens = 2
    args = lambda layers, scratch, io: (layers, 1, None, None, 16, 0, None, None, None, None, tokens, None, scratch,
                                        None, None, io)
    enough, io = 4 * tokens * scratch_floats, 4 * tokens * hidden
    assert run(*args(ctypes.byref(bad), enough, io)) == ops.EBOUNDS
    assert run(*args(ctypes.byref(good), enough - 4, io)) == ops.EBOUNDS
    assert run(*args(ctypes.byref(good), enough, io - 4)) == ops.EBOUNDS


REPRO = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    from pathlib import Path
    from quant_checkpoints import ct_compress, ct_scheme, float_weights, write_checkpoint
    from kubeinfer.dev.testing.random_model import build_random_model
    from kubeinfer.engine import LLM, SamplingParams
    from kubeinfer.engine.model_executor import checkpoint_shapes, expert_int_weights
    root = Path({root!r})
    fd = build_random_model(root / "f", "qwen3_moe", tokenizer=False, seed=29, hidden_size=64, intermediate_size=64,
                            num_heads=4, num_kv_heads=2, num_layers=1, moe_intermediate_size=64)
    config = ct_scheme("pack-quantized", 8, "int", "channel", True, None, ignore=("re:.*mlp.gate$",))
    w = float_weights(fd)
    for k in list(w):
        if k.endswith("down_proj.weight") and ".experts." in k:
            w[k] = torch.randn(128, 64) * 0.3
    md = write_checkpoint(fd, root / "ct", ct_compress(w, config), config)
    if {bypass}:  # the loader's check off: what reaches the kernel is what reached it before
        expert_int_weights.check_experts = lambda *args: None
    try:
        llm = LLM(md, max_model_len=64, num_kv_blocks=16)
    except Exception as error:
        print("LOAD", type(error).__name__, error, flush=True)
        raise SystemExit(0)
    try:
        llm.generate([{{"prompt_token_ids": list(range(1, 9))}}], [SamplingParams(temperature=0, max_tokens=8)])
    except Exception as error:
        print("STEP", type(error).__name__, error, flush=True)
        raise SystemExit(0)
    print("GENERATED", flush=True)
""")


@pytest.mark.skipif(not a16_method.fast(), reason="the A16 expert kernel needs the AVX-512 BF16 build")
@pytest.mark.parametrize("bypass", [False, True])
def test_the_crafted_moe_checkpoint_never_corrupts_the_heap(tmp_path, bypass):
    """Issue 44's reproduction in a child process (a crash must not take pytest with it): the loader refuses the
    checkpoint by name; with that check switched off, ki_a16_linear refuses the call (NativeArgumentError) where it
    used to write 128 rows a token into a buffer of 64 (rc 134)."""
    env = {**os.environ, "KUBEINFER_QUANT_KERNEL": "cpu_int8_a16"}
    script = REPRO.format(tests=str(Path(__file__).parents[1]), root=str(tmp_path), bypass=bypass)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    if bypass:
        assert "NativeArgumentError: native A16 kernel" in done.stdout, done.stdout + done.stderr[-2000:]
    else:
        assert "LOAD ModelLoadError" in done.stdout and "experts.0.down_proj" in done.stdout, done.stdout
