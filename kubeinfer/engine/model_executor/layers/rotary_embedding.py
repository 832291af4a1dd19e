"""Rotary position embeddings with the scaling variants found in Hugging Face configs."""
from __future__ import annotations

import math

import torch

from ...platforms.cpu import cpu_fused_ops


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are interpolated, short ones kept, the band between blended smoothly.
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


def _yarn_inv_freq(dim: int, theta: float, s: dict) -> tuple[torch.Tensor, float]:
    factor = s["factor"]
    old_len = s.get("original_max_position_embeddings")
    beta_fast, beta_slow = s.get("beta_fast", 32), s.get("beta_slow", 1)
    attention_factor = s.get("attention_factor")
    if attention_factor is None:  # DeepSeek-style configs give mscale and mscale_all_dim; the paper's default otherwise
        def mscale(weight: float = 1.0) -> float:
            return 0.1 * weight * math.log(factor) + 1.0 if factor > 1 else 1.0
        both = s.get("mscale") and s.get("mscale_all_dim")
        attention_factor = mscale(s["mscale"]) / mscale(s["mscale_all_dim"]) if both else mscale()

    def correction_dim(num_rotations: float) -> float:
        return dim * math.log(old_len / (num_rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq = (1 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (1 / pos_freqs) * extrapolation_weight
    return inv_freq, attention_factor


def _longrope_inv_freq(dim: int, theta: float, s: dict, max_positions: int) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3): per-frequency factors, long ones when the served context exceeds the trained one."""
    original = s["original_max_position_embeddings"]
    factor = s.get("factor") or s["max_position_embeddings"] / original
    attention_factor = s.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    ext = torch.tensor(s["long_factor"] if max_positions > original else s["short_factor"], dtype=torch.float32,
                       device="cpu")
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim
    return 1.0 / (ext * theta ** exponents), attention_factor


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin for every position up to max_positions; applied in the rotate-half layout
    that Hugging Face checkpoints of these families use."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict) -> None:
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        self.fused = False  # rotate in place with one Triton kernel (set by use_triton_kernels)
        self.build(torch.device("cpu"))

    def build(self, device: torch.device) -> None:
        """(Re)compute the tables; called again after the model is materialized from the meta device."""
        scaling, head_dim, theta = self.scaling, self.head_dim, self.theta
        rope_type = scaling.get("rope_type", "default")
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim))
        attention_factor = 1.0
        if rope_type == "default":
            pass
        elif rope_type == "linear":
            inv_freq = inv_freq / scaling["factor"]
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, scaling)
        elif rope_type == "yarn":
            inv_freq, attention_factor = _yarn_inv_freq(head_dim, theta, scaling)
        elif rope_type == "longrope":
            inv_freq, attention_factor = _longrope_inv_freq(head_dim, theta, scaling, self.max_positions)
        else:
            raise ValueError(f"unsupported rope scaling type {rope_type!r}; "
                             "supported: default, linear, llama3, yarn, longrope")
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32, device="cpu"), inv_freq)
        cos, sin = freqs.cos() * attention_factor, freqs.sin() * attention_factor
        self.register_buffer("cos", cos.to(device), persistent=False)  # [max_positions, D / 2]
        self.register_buffer("sin", sin.to(device), persistent=False)
        self.begin_step()

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H, D], k: [T, Hkv, D], positions: [T]."""
        if self.fused:
            from ...platforms.cuda.triton_norm import apply_rotary
            return apply_rotary(q, k, positions, self.cos, self.sin)
        return self.rotate_scratch(positions, q), self.rotate_scratch(positions, k)

    def rotate_scratch(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """`rotate`, but x may be overwritten (the caller owns it, as forward's callers own q and k): on the CPU
        the native kernel rotates it in place where it applies (float32; cpu_fused_ops), torch elsewhere."""
        tables = self._buffers  # not Module.__getattr__ (~0.4 us a name): every layer of a decode step comes here
        if x.is_cpu and cpu_fused_ops.rotate_(x, positions, tables["cos"], tables["sin"]) is not None:
            return x
        return self.rotate(positions, x)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x: [T, heads, D] (any heads, so q and k may go through together) -> rotated, a new tensor.
        Computed in fp32, as Hugging Face's models do, with the same products and sums."""
        cos, sin = self._tables(positions)
        xf = x.float()
        x1, x2 = xf.chunk(2, dim=-1)
        out = xf * cos
        out.add_(torch.cat((x2, x1), dim=-1).mul_(sin))
        return out.to(x.dtype)

    def begin_step(self) -> None:
        """Forget the last step's tables (called at the top of each forward pass, so that a CUDA graph
        captures the lookup instead of reusing a warm-up's)."""
        self._step_positions, self._step_tables = None, None

    def _tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, 1, D] whole-width cos and signed sin (x * cos + swap_halves(x) * sin is the rotation) of the
        step's positions: built by the first layer, reused by the others (every layer of a step passes the
        same positions tensor). Per step rather than per position: whole-width tables for every position
        would double the tables' memory, which long contexts feel on a GPU."""
        if positions is not self._step_positions:
            cos, sin = self.cos[positions], self.sin[positions]
            self._step_positions = positions
            self._step_tables = torch.cat((cos, cos), -1).unsqueeze(1), torch.cat((-sin, sin), -1).unsqueeze(1)
        return self._step_tables
