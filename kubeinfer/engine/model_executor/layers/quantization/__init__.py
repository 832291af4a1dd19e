"""Quantized checkpoints: which `quantization_config.quant_method` a checkpoint declares, whether the engine
serves it, and how `--quantization NAME` (vLLM's flag) is checked against it. Plain names, no torch: the
formats are registered by name (registry.py; the registrations in methods.py), their weight handling in one
module each (fp8.py, compressed_tensors.py, awq.py, gptq.py, mxfp4.py), each a config class with
`auxiliary(key)`, `weight_key(key)` and `read(key, tensor, get)` for the loader;
linear_method.py holds the per-layer quant methods (kept-quantized products) and kv_cache_dtype.py the
KV cache's types (--kv-cache-dtype: bfloat16, fp8) and the fp8 caches' scales."""
from __future__ import annotations

from . import methods  # noqa: F401  (registers the served methods)
from .errors import QuantizationError
from .registry import aliases, method_named, registered

SERVED = registered()  # as registered at import (methods.py); the checks below read the registry itself
# Names vLLM accepts for a served format (its kernels' names): they load the same checkpoints.
ALIASES = aliases()
# vLLM's other method names (and the common quant_method values of Hugging Face configs): known, not served yet.
NOT_YET_SERVED = ("bitsandbytes", "gguf", "fbgemm_fp8", "modelopt", "modelopt_fp4", "torchao", "hqq",
                  "aqlm", "quark", "experts_int8", "ptpc_fp8", "eetq", "higgs", "bitnet", "fp_quant", "auto-round",
                  "vptq", "spqr", "quanto", "gptq_bitblas", "awq_triton", "marlin")


def checkpoint_quantization(config) -> dict | None:
    """config.json's `quantization_config` (a dict), or None for a float checkpoint."""
    qc = getattr(config, "quantization_config", None)
    if qc is None:
        return None
    return dict(qc) if isinstance(qc, dict) else qc.to_dict()


def canonical(name: str | None) -> str | None:
    return None if name is None else aliases().get(name.lower(), name.lower())


def check_method_name(requested: str | None) -> None:
    """`--quantization` is checked before any model work: an unknown or unserved name is a start-up error."""
    method, served = canonical(requested), registered()
    if method is None or method in served:
        return
    if method in NOT_YET_SERVED:
        raise QuantizationError(f"quantization: {requested!r} is not served yet; kubeinfer serves {', '.join(served)}")
    raise QuantizationError(f"quantization: unknown method {requested!r}; kubeinfer serves {', '.join(served)}")


def resolve_quantization(config, requested: str | None):
    """The checkpoint's quantization as the loader applies it (a format's config class), or None for float
    weights. `requested` (--quantization) must name the checkpoint's own method; on a float checkpoint, fp8
    quantizes the weights at load (the only method that can: the others need calibration)."""
    check_method_name(requested)
    wanted = canonical(requested)
    qc = checkpoint_quantization(config)
    method = None if qc is None else canonical(str(qc.get("quant_method", "")) or None)
    if qc is not None and method not in registered():
        raise QuantizationError(f"this checkpoint is quantized with {method or '(no quant_method)'!r} "
                                f"(config.json quantization_config), which kubeinfer does not serve yet; it serves "
                                f"{', '.join(registered())} (see `kubeinfer models`)")
    if method == "mxfp4" or wanted == "mxfp4":
        return _mxfp4(qc, method)
    if wanted is not None and method is None:
        if wanted != "fp8":
            raise QuantizationError(f"quantization: {requested!r} needs a checkpoint quantized with it (config.json "
                                    f"quantization_config); this one is float, and only fp8 quantizes at load")
        return config_class("fp8")(block_size=None, at_load=True, activation_scheme="dynamic")  # vLLM's online fp8: W8A8
    if wanted is not None and wanted != method:
        raise QuantizationError(f"quantization: {requested!r} does not match the checkpoint's method {method!r} "
                                "(config.json quantization_config); leave --quantization out or name that method")
    return None if method is None else config_class(method).from_dict(qc)


def config_class(method: str) -> type:
    """The registered method's config class (imported now); an unknown name is a QuantizationError listing the
    registered ones."""
    return method_named(method).config_class()


def _mxfp4(qc: dict | None, method: str | None):
    """MXFP4 checkpoints (gpt-oss) are dequantized at load; there is no MXFP4 quantization of float weights."""
    if method != "mxfp4":
        raise QuantizationError(f"quantization: 'mxfp4' names checkpoints stored in MXFP4 (gpt-oss's); this one is "
                                f"{method or 'not quantized'}; leave --quantization out")
    return config_class("mxfp4").from_dict(qc)
