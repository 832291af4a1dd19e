"""The engine's environment variables (KUBEINFER_*), each declared once with its meaning, default and what it
accepts; the shared ones (engine key, tensor-parallel secret) are kubeinfer/common/envs.py's. Product code reads
them only through `VAR.get()` (tests/cli/test_layout.py checks), at call time unless noted.

`python -m kubeinfer.engine.envs --markdown` prints the README's table of all of them (tests/cli/test_envs.py
checks the README holds it).
"""
from __future__ import annotations

import os
import sys

from kubeinfer.common.envs import SHARED, EnvVar, one_of, text_or_none

# The kernels KUBEINFER_QUANT_KERNEL may force (quantization/linear_method.py says what each one is)
QUANT_KERNELS = ("triton", "cpu_int4", "cpu_int8", "cpu_int4_bf16", "cpu_int8_bf16", "cpu_int4_a16", "cpu_int8_a16",
                 "cpu_int8_vnni", "cpu_int4_vnni", "dequantized")
W8A8_KERNELS = ("int8_vnni", "int_mm", "fake_quant")
SANITIZERS = ("address",)


def _switch(text: str) -> bool:
    """0 or 1, nothing else."""
    return one_of(("0", "1"))(text) == "1"


def _positive_int_or_none(text: str) -> int | None:
    if not text:
        return None
    if not text.isdigit() or int(text) < 1:
        raise ValueError(text)
    return int(text)


def _default_cache_dir(text: str) -> str:
    return text or os.path.join(os.path.expanduser("~"), ".cache", "kubeinfer")


QUANT_KERNEL: EnvVar[str | None] = EnvVar(
    "KUBEINFER_QUANT_KERNEL", "forces the quantized layers' kernel where it applies (docs/quantization.md)",
    lambda text: text_or_none(one_of(QUANT_KERNELS, allow_empty=True)(text)),
    accepts="one of " + ", ".join(QUANT_KERNELS),
    shown_default="unset: the measured choice")
W8A8_KERNEL: EnvVar[str] = EnvVar(
    "KUBEINFER_W8A8_KERNEL", "the exact int8 product of W8A8/W4A8 layers on a float32 CPU model; fake_quant "
    "dequantizes instead", one_of(W8A8_KERNELS), default="int8_vnni", accepts="int8_vnni, int_mm or fake_quant",
    empty_is_unset=False)
CPU_NATIVE_LAYERS: EnvVar[bool] = EnvVar(
    "KUBEINFER_CPU_NATIVE_LAYERS", "CPU: a step's non-matmul ops (attention, norms, rotary) and small-step "
    "projections through the native kernels where they build; 0 keeps torch's. Read at each engine step", _switch,
    default="1", accepts="0 or 1", empty_is_unset=False)
CPU_FUSED_LAYERS: EnvVar[bool] = EnvVar(
    "KUBEINFER_CPU_FUSED_LAYERS", "CPU: a decode step's Llama-family decoder layers in one native call; 0: one "
    "call per module (A/B measurements). Read at each engine step", _switch, default="1", accepts="0 or 1",
    empty_is_unset=False)
CPU_SHARE_CORES: EnvVar[str] = EnvVar(
    "KUBEINFER_CPU_SHARE_CORES", "CPU small steps: int products and decode attention in two halves on two cores; "
    "auto: on where OPENBLAS_THREAD_TIMEOUT <= 10. Read at import", one_of(("auto", "0", "1")), default="auto",
    accepts="auto, 0 or 1", empty_is_unset=False)
CPU_OPENBLAS: EnvVar[bool] = EnvVar(
    "KUBEINFER_CPU_OPENBLAS", "CPU, float32: small steps' projections through numpy's OpenBLAS; 0 keeps torch's",
    lambda text: text != "0", default="1", accepts="0 (off) or anything else (on)", empty_is_unset=False)
CPU_OPENBLAS_MAX_CONTEXT: EnvVar[int] = EnvVar(
    "KUBEINFER_CPU_OPENBLAS_MAX_CONTEXT", "the context (tokens) up to which small steps take the OpenBLAS path. "
    "Read at import", int, default="4096", accepts="an integer", empty_is_unset=False)
CPU_NATIVE_THREADS: EnvVar[int | None] = EnvVar(
    "KUBEINFER_CPU_NATIVE_THREADS", "the native kernels' thread pool size. Read when the library loads",
    _positive_int_or_none, accepts="a positive integer", shown_default="the CPUs this process may run on")
CPU_NATIVE_SPIN_US: EnvVar[int] = EnvVar(
    "KUBEINFER_CPU_NATIVE_SPIN_US", "microseconds the native kernels' workers spin after a call before they sleep. "
    "Read when the library loads", int, default="50", accepts="an integer", empty_is_unset=False)
CPU_NATIVE_PORTABLE: EnvVar[bool] = EnvVar(
    "KUBEINFER_CPU_NATIVE_PORTABLE", "builds the native kernels' portable C on any CPU (tests)",
    lambda text: text not in ("", "0"), default="0", accepts="0 or empty (off) or anything else (on)")
CPU_NATIVE_SANITIZE: EnvVar[str | None] = EnvVar(
    "KUBEINFER_CPU_NATIVE_SANITIZE", "builds the native kernels with a sanitizer (`make test-asan`); a failed "
    "load is then an error", lambda text: text_or_none(one_of(SANITIZERS, allow_empty=True)(text)),
    accepts="one of " + ", ".join(SANITIZERS), shown_default="unset")
CPU_NATIVE_LIBRARY: EnvVar[str | None] = EnvVar(
    "KUBEINFER_CPU_NATIVE_LIBRARY", "a prebuilt native kernels' library (`python -m kubeinfer.engine.model_executor."
    "layers.quantization.cpu_native.build --out DIR`; the CPU engine image sets it), loaded where its sources match "
    "and this CPU has every feature flag of the CPU it was built on; else the library is built here, as unset",
    text_or_none, accepts="a path to libkubeinfer_cpu.so", shown_default="unset")
CACHE_DIR: EnvVar[str] = EnvVar(
    "KUBEINFER_CACHE_DIR", "where the native kernels' built libraries are cached (under cpu_native/)",
    _default_cache_dir, shown_default="~/.cache/kubeinfer")
LOG_LEVEL: EnvVar[str] = EnvVar(
    "KUBEINFER_LOG_LEVEL", "the tensor-parallel ranks' log level (`kubeinfer serve` sets it from --log-level)", str,
    default="INFO", accepts="a logging level name", empty_is_unset=False)
TERMINATION_LOG: EnvVar[str | None] = EnvVar(
    "KUBEINFER_TERMINATION_LOG", "where a fatal error at start-up is written for Kubernetes (the pod's "
    "lastState.terminated.message); the default path only where it exists and is writable", text_or_none,
    shown_default="/dev/termination-log")
ALLOWED_LORA_DIRS: EnvVar[list[str]] = EnvVar(
    "KUBEINFER_ALLOWED_LORA_DIRS", "`--allowed-lora-dirs`' default: directories, split at whitespace, "
    "POST /v1/load_lora_adapter may read adapters from", str.split, shown_default="none: loading by path refused")

ENGINE: tuple[EnvVar, ...] = (
    QUANT_KERNEL, W8A8_KERNEL, CPU_NATIVE_LAYERS, CPU_FUSED_LAYERS, CPU_SHARE_CORES, CPU_OPENBLAS,
    CPU_OPENBLAS_MAX_CONTEXT, CPU_NATIVE_THREADS, CPU_NATIVE_SPIN_US, CPU_NATIVE_PORTABLE, CPU_NATIVE_SANITIZE,
    CPU_NATIVE_LIBRARY, CACHE_DIR, LOG_LEVEL, TERMINATION_LOG, ALLOWED_LORA_DIRS)
ALL: tuple[EnvVar, ...] = SHARED + ENGINE


def markdown_table(variables: tuple[EnvVar, ...] = ALL) -> str:
    """The README's table of environment variables."""
    rows = ["| Variable | Default | Accepts | Read by | Meaning |", "|---|---|---|---|---|"]
    for var in variables:
        default = var.shown_default if var.shown_default is not None else f"`{var.default}`"
        rows.append(f"| `{var.name}` | {default} | {var.accepts} | {var.read_by} | {var.doc} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    if sys.argv[1:] != ["--markdown"]:
        raise SystemExit("usage: python -m kubeinfer.engine.envs --markdown")
    sys.stdout.write(markdown_table())
