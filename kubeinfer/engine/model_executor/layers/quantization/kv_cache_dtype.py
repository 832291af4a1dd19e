"""The KV cache's element type (`--kv-cache-dtype`, vLLM's names): `auto` keeps the model dtype; `bfloat16`
stores bfloat16 whatever the model dtype (rounded to nearest even, as torch's cast: twice a float32 cache's
blocks in the same memory; llama.cpp's default f16 cache is as wide); `fp8` and `fp8_e4m3` store
float8_e4m3fn, `fp8_e5m2` float8_e5m2: one byte per element, so the same memory holds twice the blocks of a
bf16 cache (four times a float32 one's).

Per-tensor scales (8-bit caches only: vLLM reads k_scale / v_scale for fp8 alone), as vLLM applies them: each
layer's K and V are stored as k / k_scale and v / v_scale (saturating at the type's largest value) and read back
times the scale. The scales come from the checkpoint when it has them (`self_attn.k_scale` / `v_scale`, as
llm-compressor's `kv_cache_scheme` and vLLM write them, or `k_proj.output_scale` / `v_proj.output_scale`,
ModelOpt's); otherwise they are 1.0, vLLM's default when it does not calculate them (`calculate_kv_scales` off).
Scales are folded where they cost nothing: k_scale into the attention's score scale, v_scale into its output
(softmax(q.k*s).v*s_v); the backends only see an 8-bit cache, which they widen to the queries' type as they read
it."""
from __future__ import annotations

import re
from pathlib import Path

import torch

KV_CACHE_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                         "fp8_e5m2": torch.float8_e5m2}
SCALE_KEY = re.compile(r"\.layers\.(\d+)\.self_attn\.(?:(k|v)_scale|(k|v)_proj\.output_scale)$")


def cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's torch dtype for a checked `kv_cache_dtype` name (EngineConfig checks the name)."""
    return model_dtype if name == "auto" else KV_CACHE_TORCH_DTYPES[name]


def scaled(dtype: torch.dtype) -> bool:
    """Whether a cache of this type takes the checkpoint's per-tensor K/V scales: the 8-bit ones."""
    return dtype.itemsize == 1


def to_cache_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K or V in the cache's type; an fp8 cache saturates at its largest finite value, as vLLM's does and the
    Triton write kernel does. Clamped here for both 8-bit types: torch's own cast overflows e5m2 to inf, and
    e4m3 to NaN past 464 in older torch (2.11, on the GPU machines' image; 2.13 saturates), on CPU and CUDA."""
    if dtype.itemsize == 1:
        limit = torch.finfo(dtype).max
        x = x.clamp(-limit, limit)
    return x.to(dtype)


def check_kv_cache_dtype(name: str, backend: str, device: torch.device) -> None:
    """Triton has no float8_e4m3 before compute capability 8.9 (Ada, Hopper): refused there, naming the way out."""
    if name in ("fp8", "fp8_e4m3") and backend == "triton" and device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise ValueError(f"kv_cache_dtype {name} (float8 e4m3) needs a GPU of compute capability 8.9 or newer for "
                             f"the triton attention kernels; this one is {major}.{minor}: use --kv-cache-dtype fp8_e5m2")


def checkpoint_kv_scales(weight_files: list[Path]) -> dict[int, tuple[float, float]]:
    """{layer: (k_scale, v_scale)} from the checkpoint's per-layer scale tensors (a missing one is 1.0)."""
    from safetensors import safe_open

    found: dict[int, dict[str, float]] = {}
    for file in weight_files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                match = SCALE_KEY.search(key)
                if match:
                    which = match.group(2) or match.group(3)
                    found.setdefault(int(match.group(1)), {})[which] = float(f.get_tensor(key).float().max())
    return {layer: (s.get("k", 1.0), s.get("v", 1.0)) for layer, s in found.items()}


class ScaledKVBackend:
    """An attention backend whose cache holds K / k_scale and V / v_scale: the scales folded into the
    score scale and the output. Everything else is the wrapped backend's."""

    def __init__(self, inner, k_scale: float, v_scale: float) -> None:
        self.inner, self.k_scale, self.v_scale = inner, k_scale, v_scale

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, softcap=None):
        k, v = k / self.k_scale, v / self.v_scale
        args = (q, k, v, k_cache, v_cache, meta, scale * self.k_scale)
        out = self.inner.forward(*args, softcap) if softcap else self.inner.forward(*args)
        return out * self.v_scale


def install_kv_scales(model: torch.nn.Module, scales: dict[int, tuple[float, float]]) -> int:
    """Wraps the backend of each attention layer whose scales are not 1.0; returns how many were wrapped."""
    wrapped = 0
    for module in model.modules():
        layer = getattr(module, "layer_idx", None)
        if hasattr(module, "backend") and layer in scales and scales[layer] != (1.0, 1.0):
            module.backend = ScaledKVBackend(module.backend, *scales[layer])
            wrapped += 1
    return wrapped
