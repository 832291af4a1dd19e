"""FP8 checkpoints (`quant_method: fp8`): Qwen3-FP8, DeepSeek-V3/R1 and transformers' FineGrainedFP8Config
write weights as float8 (e4m3) with a float32 scale beside each: `weight_scale_inv` per block of
`weight_block_size` [rows, cols] (or one for the tensor), or `weight_scale` per tensor or per output channel.
The true weight is fp8 * scale (a block's scale covers its rows x cols tile; the last tiles may be partial).

On CUDA the e4m3 weights stay in memory, one byte each (`int_weight`: an IntWeight with fp8 values and one scale
per output row and group of block columns, a block's scale repeated over its rows), and multiply through the
Triton kernel that decodes e4m3 inside it (triton_int_matmul.py; linear_method.py chooses it); under tensor
parallelism each rank keeps its rows or columns with their scales (IntWeight.narrow: a cut inside a block is
regrouped exactly). On the CPU (no fp8 matmul) each weight is multiplied out in float32 and stored in the model
dtype, so the matmuls run as for a float checkpoint; so are e5m2 weights. MoE experts are kept alike (on CUDA
e4m3 through the fused MoE kernel, fused_moe/int_experts.py; dequantized into float stacks on the CPU).
KUBEINFER_QUANT_KERNEL=dequantized dequantizes on CUDA too. The activations are quantized to e4m3 as the format
defines them (activations.py, w8a8.py): `activation_scheme: dynamic` per token and per group of the weight
block's columns (`weight_block_size` [128, 128]: 128 columns, as DeepSeek's `act_quant` and vLLM's
per-token-group quantization; the numbers are compressed-tensors' dynamic `group` scheme, amax / 448 with its
eps for an all-zero group), per token for per-tensor and per-channel weights (one group of all the columns, as
transformers' FineGrainedFP8 runs a weight without blocks); `static`: the checkpoint's one `input_scale` (vLLM)
or `activation_scale` (transformers) per layer.

`--quantization fp8` on a float checkpoint quantizes the decoder's linear weights at load, per output channel
to e4m3 (scale = amax / 448, as transformers' FP8 quantizer computes it), and dequantizes them the same way;
their activations are quantized dynamically per token, as vLLM's online fp8 quantizes them (W8A8): the
outputs are those of the FP8 model; on CUDA the weights are kept as e4m3 with their per-channel scales (a CPU
holds them dequantized: the memory and speed of the float model).
In the MoE families that includes every expert (per expert and output row, the per-channel scales of vLLM's
fp8 MoE method) and the shared expert; the routers stay float, as vLLM and transformers leave them. On CUDA
each per-expert weight is quantized as it is read (`int_weight`) and the layer's experts kept e4m3 through the
fused MoE kernel, their float stacks never allocated (expert_int_weights.py); on the CPU (no fp8 expert
kernel) and for experts stacked in the checkpoint (gpt-oss) they are round-tripped into the float stacks
(`prepare_at_load`'s transform), the same values, and the start-up log says so."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .activations import ActivationScheme
from .errors import QuantizationError

SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale", "input_scale", "activation_scale")


@dataclass(frozen=True)
class Fp8Config:
    method = "fp8"
    block_size: tuple[int, int] | None  # weight_block_size [rows, cols]; None: per tensor or per channel
    at_load: bool = False  # a float checkpoint quantized at load (--quantization fp8)
    activation_scheme: str | None = None  # dynamic | static; None: weight-only (quantized at load)
    input_scale_names = ("input_scale", "activation_scale")

    @classmethod
    def from_dict(cls, qc: dict) -> Fp8Config:
        scheme = str(qc.get("activation_scheme", "dynamic")).lower()
        if scheme not in ("dynamic", "static"):
            raise QuantizationError(f"fp8 checkpoint with activation_scheme {scheme!r}: 'dynamic' and 'static' are "
                                    "served")
        if qc.get("scale_fmt", "float") not in ("float", None):
            raise QuantizationError(f"fp8 checkpoint with scale_fmt {qc['scale_fmt']!r}: only 'float' scales are served")
        block = qc.get("weight_block_size")
        if block is not None and (len(block) != 2 or any(not isinstance(b, int) or b < 1 for b in block)):
            raise QuantizationError(f"fp8 weight_block_size must be two positive integers, got {block!r}")
        return cls(tuple(block) if block is not None else None, activation_scheme=scheme)

    def describe(self) -> str:
        """What the start-up log says of these weights: their method, and that they are held dequantized."""
        source = "quantized at load" if self.at_load else "checkpoint"
        inputs = self.input_activations("")
        return f"{self.method} {source}, weights e4m3 kept on CUDA, else dequantized to the model dtype" + (
            f", activations {inputs.describe()}" if inputs else "")

    def input_activations(self, module: str) -> ActivationScheme | None:
        """How a quantized layer's input is quantized (w8a8.py): e4m3, symmetric."""
        if self.activation_scheme is None:
            return None
        if self.activation_scheme == "static":
            return ActivationScheme("float", "tensor", dynamic=False)
        if self.block_size is None:
            return ActivationScheme("float", "token", dynamic=True)
        return ActivationScheme("float", "group", dynamic=True, group_size=self.block_size[1])

    @staticmethod
    def auxiliary(key: str) -> bool:
        """Tensors read with their weight (scales), not loaded on their own."""
        return is_scale_key(key) or key.endswith((".k_scale", ".v_scale"))

    @staticmethod
    def weight_key(key: str) -> str:
        return key

    def read(self, key: str, tensor: torch.Tensor, get) -> torch.Tensor:
        """The weight as the model uses it: an FP8 weight multiplied out by its scale; `get(key)` reads another
        checkpoint tensor (None when absent)."""
        if not is_fp8(tensor):
            return tensor
        scale = next((s for s in map(get, scale_keys(key)) if s is not None), None)
        if scale is None:
            raise QuantizationError(f"fp8 weight {key!r} has no scale in the checkpoint (expected "
                                    f"{' or '.join(scale_keys(key))}); the checkpoint is incomplete")
        return dequantize(tensor, scale, self, key)

    def int_weight(self, key: str, tensor: torch.Tensor, get):
        """The weight kept as e4m3 (linear_method.IntWeight, fp8) with one scale per output row and group of
        columns; a float weight of --quantization fp8 quantized per channel here. None where it is not an
        e4m3 linear weight (read() dequantizes or passes it)."""
        from .linear_method import IntWeight

        if self.at_load and tensor.is_floating_point() and not is_fp8(tensor) and tensor.dim() == 2:
            values, scale = quantize_per_channel(tensor)
            return IntWeight(values, scale.to(torch.float32), None, values.shape[1], 8, fp8=True)
        if tensor.dtype != torch.float8_e4m3fn or tensor.dim() != 2:
            return None
        scale = next((s for s in map(get, scale_keys(key)) if s is not None), None)
        if scale is None:
            return None  # read() names the missing scale
        grid, group = row_scales(tensor.shape, scale, self, key)
        return IntWeight(tensor.contiguous(), grid.contiguous(), None, group, 8, fp8=True)


FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 weights and their float32 per-row scale ([rows, 1]): weight ~ fp8 * scale."""
    w = weight.to(torch.float32)
    amax = w.abs().amax(dim=1, keepdim=True)
    inverse = torch.where(amax > 0, FP8_MAX / amax, torch.ones_like(amax))  # an all-zero row keeps scale 1
    return (w * inverse).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), 1.0 / inverse


def roundtrip_per_channel(weight: torch.Tensor, config: Fp8Config, name: str) -> torch.Tensor:
    """The float32 weight [..., out, in] as its per-channel e4m3 quantization gives it back (--quantization
    fp8 on a float checkpoint); stacked experts [E, out, in] are scaled per expert and row alike."""
    rows = weight.reshape(-1, weight.shape[-1])
    return dequantize(*quantize_per_channel(rows), config, name).reshape(weight.shape)


def prepare_at_load(model: torch.nn.Module, config: Fp8Config) -> set[str]:
    """--quantization fp8 on a float checkpoint: the decoder's linear weights the loader quantizes (kept e4m3 on
    CUDA, else round-tripped; not the embeddings, lm_head, norms or MoE routers); an MoE model's experts are set
    to round-trip as they load into float stacks (those kept e4m3 never reach them: expert_int_weights.py)."""
    routers = model.router_names() if hasattr(model, "router_names") else set()
    if hasattr(model, "transform_expert_weights"):
        model.transform_expert_weights(lambda weight, name: roundtrip_per_channel(weight, config, name))
    return {f"{name}.weight" for name, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and name != "lm_head" and name not in routers}


def is_scale_key(key: str) -> bool:
    return key.rsplit(".", 1)[-1] in SCALE_SUFFIXES


def scale_keys(weight_key: str) -> tuple[str, str]:
    """Where a weight's scale may be stored: `weight_scale_inv` (block-wise, transformers/DeepSeek) or `weight_scale`."""
    prefix = weight_key.removesuffix(".weight")
    return f"{prefix}.weight_scale_inv", f"{prefix}.weight_scale"


def is_fp8(tensor: torch.Tensor) -> bool:
    return tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, config: Fp8Config, name: str) -> torch.Tensor:
    """The float32 weight fp8 * scale; a scale whose shape fits no layout (truncated, wrong block) is an error."""
    if weight.dim() != 2:
        raise QuantizationError(f"fp8 weight {name} has {weight.dim()} dimensions; only 2-D linear weights are served")
    grid, group = row_scales(weight.shape, scale, config, name)
    return weight.to(torch.float32) * grid.repeat_interleave(group, dim=1)[:, :weight.shape[1]]


def row_scales(shape, scale: torch.Tensor, config: Fp8Config, name: str) -> tuple[torch.Tensor, int]:
    """(float32 scales [rows, groups], group columns): the scale of each output row and group of input columns,
    a block's scale repeated over its rows; per tensor and per channel one group of all the columns. A scale
    whose shape fits no layout (truncated, wrong block) is an error."""
    rows, cols = shape
    s = scale.to(torch.float32)
    if s.numel() == 1:  # per tensor
        return s.reshape(1, 1).expand(rows, 1).contiguous(), cols
    if config.block_size is not None and s.dim() == 2:
        bn, bk = config.block_size
        grid = (-(-rows // bn), -(-cols // bk))
        if tuple(s.shape) != grid:
            raise QuantizationError(f"fp8 scale of {name} has shape {tuple(s.shape)}; a {rows}x{cols} weight in "
                                    f"{bn}x{bk} blocks needs {grid} (truncated or mismatched checkpoint)")
        return s.repeat_interleave(bn, dim=0)[:rows], bk
    if s.numel() == rows and (s.dim() == 1 or tuple(s.shape) == (rows, 1)):  # per output channel
        return s.reshape(rows, 1), cols
    raise QuantizationError(f"fp8 scale of {name} has shape {tuple(s.shape)}, which fits neither one scale, one per "
                            f"output channel ({rows}) nor weight_block_size blocks (truncated or mismatched checkpoint)")
