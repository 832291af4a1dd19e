"""Which kernels an engine's layers use: the quantized layers' kernel, the W8A8 product and the CPU switches, one
object an engine carries (EngineConfig's kernel fields, `EngineConfig.kernels`), so two engines in one process may
differ. The KUBEINFER_* variables only fill their defaults (`variable_default`, read once when the EngineConfig is
built: here, nowhere else).

The layers read `current()`: the config its ModelRunner made active on this thread while it loads the model
and runs a step (`active`); outside any engine (a bare model in a test, a benchmark's one product) it is built
from the variables at that call, as they were read before engines carried one. No torch here."""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, fields

import kubeinfer.engine.envs as envs

SHARE_CORES = ("auto", "0", "1")


@dataclass
class KernelConfig:
    """`quant_kernel`: forces the quantized layers' kernel where it applies (one of envs.QUANT_KERNELS; None: the
    measured choice, quantization/linear_kernels.py). `w8a8_kernel`: the exact product of W8A8 / W4A8 layers
    (envs.W8A8_KERNELS). `cpu_native_layers`: a CPU step's non-matmul ops and small projections through the
    native kernels where they build. `cpu_fused_layers`: a decode step's Llama-family decoder layers in one
    native call. `cpu_share_cores`: small steps' int products and decode attention in halves on two cores (auto:
    where OPENBLAS_THREAD_TIMEOUT <= 10, platforms/cpu/two_cores.py). `cpu_openblas`: float32 small steps' projections
    through numpy's OpenBLAS."""
    quant_kernel: str | None = None
    w8a8_kernel: str = "int8_vnni"
    cpu_native_layers: bool = True
    cpu_fused_layers: bool = True
    cpu_share_cores: str = "auto"
    cpu_openblas: bool = True

    def __post_init__(self) -> None:
        choices = {"quant_kernel": (None, *envs.QUANT_KERNELS), "w8a8_kernel": envs.W8A8_KERNELS,
                   "cpu_share_cores": SHARE_CORES}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"kernels.{name} must be one of {', '.join(str(a) for a in allowed)}; "
                                 f"got {getattr(self, name)!r}")
        for name in ("cpu_native_layers", "cpu_fused_layers", "cpu_openblas"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"kernels.{name} must be True or False, got {getattr(self, name)!r}")

    @classmethod
    def from_env(cls) -> KernelConfig:
        """The defaults the KUBEINFER_* variables give (envs.py declares and checks each)."""
        return cls(**{name: VARIABLES[name].get() for name in cls.field_names()})

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


# Each field's variable, which fills its default
VARIABLES: dict[str, envs.EnvVar] = {
    "quant_kernel": envs.QUANT_KERNEL, "w8a8_kernel": envs.W8A8_KERNEL,
    "cpu_native_layers": envs.CPU_NATIVE_LAYERS, "cpu_fused_layers": envs.CPU_FUSED_LAYERS,
    "cpu_share_cores": envs.CPU_SHARE_CORES, "cpu_openblas": envs.CPU_OPENBLAS}


_local = threading.local()  # .config: the KernelConfig of the engine loading or stepping on this thread


def variable_default(name: str) -> Callable[[], object]:
    """A default_factory for EngineConfig's field `name`: its variable's value when the config is built."""
    return VARIABLES[name].get


def current() -> KernelConfig:
    """The active engine's kernel config on this thread, else one from the variables as they are now."""
    config = getattr(_local, "config", None)
    return config if config is not None else KernelConfig.from_env()


def setting(name: str):
    """One field of `current()`: outside an engine only its own variable is read (a layer asks for one)."""
    config = getattr(_local, "config", None)
    return getattr(config, name) if config is not None else VARIABLES[name].get()


@contextmanager
def active(config: KernelConfig) -> Iterator[KernelConfig]:
    """Within (on this thread): the layers read `config` (ModelRunner: its model's load and each step)."""
    previous = getattr(_local, "config", None)
    _local.config = config
    try:
        yield config
    finally:
        _local.config = previous
