"""One line at an engine's start that says which native CPU paths are on, and why not where they are off (issue #46:
an image without the library said only "int8 kernels unavailable", while the same missing library also turned off
native decode attention, the fused decoder layers and the float32 head)."""
from __future__ import annotations

import logging

from kubeinfer.engine.kernel_config import setting as kernel_setting

from . import f32_ops, ops

logger = logging.getLogger(__name__)


def native_paths() -> str:
    """What the model runner's CPU steps use, as one line."""
    if not ops.available():
        return ("native CPU paths: all off, torch's kernels run for int8/int4 linear, decode attention and norms, "
                f"fused decoder layers and the float32 head ({ops.load_failure()})")
    layers = ops.layers_enabled()

    def on(flag: bool, why_off: str) -> str:
        return "on" if flag else f"off ({why_off})"

    layers_off = "KUBEINFER_CPU_NATIVE_LAYERS=0"
    fused = on(layers and kernel_setting("cpu_fused_layers"), layers_off if not layers else "KUBEINFER_CPU_FUSED_LAYERS=0")
    head = on(layers and f32_ops._kernel() is not None, layers_off if not layers else "no ki_f32_linear")
    return (f"native CPU paths: int8/int4 linear on (VNNI {'yes' if ops.has_vnni() else 'no'}), decode attention "
            f"and norms {on(layers, layers_off)}, fused decoder layers {fused}, float32 head {head}; library "
            f"level {ops.level()} ({ops.library()._name})")


def log_native_paths() -> str:
    line = native_paths()
    logger.info("%s", line)
    return line
