"""Kernels registered per product, in priority order, and how one is chosen for a layer. A product is one way
a quantized layer multiplies (weight-only integers: linear_kernels.py; W8A8's int8 product and W4A8's int4 x
int8 one: w8a8_kernels.py); the methods name the products their layers use (registry.QuantizationMethod).

Each kernel says whether it `applies` to a layer's target (its weight, device and dtype: can it run it), whether
the measured default takes it (`preferred`, by default where it applies), and what runs when it is forced
(`forced`: itself, then its declared stand-ins, e.g. a native kernel's torch twin where the library does not
build). The choice: a forced kernel must be one of the product's and one of its `forced` names must apply, else
an error naming the product's kernels; unforced, the first registered kernel the default prefers. `ChoiceLog`
says each choice once per method and layer kind at start (INFO: method, layer kind, kernel, why)."""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any

from .errors import QuantizationError

logger = logging.getLogger(__name__)


class KernelError(QuantizationError):
    """A forced kernel that is not the product's, or applies to none of its stand-ins for a layer."""


class Kernel:
    """One kernel of a product; subclasses override what differs. `why`: the reason the default takes it, for
    the start-up log."""
    name: str = ""
    why: str = ""

    def applies(self, target: Any) -> bool:
        return True

    def preferred(self, target: Any) -> bool:
        return self.applies(target)

    def forced(self, target: Any) -> tuple[str, ...]:
        """The kernels tried, in order, when this one is forced; the first that applies runs."""
        return (self.name,)


@dataclass(frozen=True)
class Choice:
    kernel: Kernel
    why: str

    @property
    def name(self) -> str:
        return self.kernel.name


class KernelRegistry:
    """The kernels of one product, in the order registered: the default's priority."""

    def __init__(self, product: str) -> None:
        self.product = product
        self._kernels: dict[str, Kernel] = {}

    def register(self, kernel: Kernel) -> Kernel:
        if not kernel.name or kernel.name in self._kernels:
            raise ValueError(f"{self.product} kernel {kernel.name!r} is registered twice (or has no name)")
        self._kernels[kernel.name] = kernel
        return kernel

    def names(self) -> tuple[str, ...]:
        return tuple(self._kernels)

    def get(self, name: str) -> Kernel:
        kernel = self._kernels.get(name)
        if kernel is None:
            raise KernelError(f"{name!r} is not a {self.product} kernel; its kernels are {', '.join(self._kernels)}")
        return kernel

    def choose(self, target: Any, forced: str | None = None) -> Choice:
        """The kernel for `target`: `forced`'s first applying stand-in (module docstring), else the first
        registered kernel the default prefers."""
        if forced:
            wanted = self.get(forced)
            for name in wanted.forced(target):
                if self.get(name).applies(target):
                    why = f"forced {forced}" + ("" if name == forced else f", which does not apply here: {name}")
                    return Choice(self.get(name), why)
            raise KernelError(f"the forced {self.product} kernel {forced!r} does not apply to {target} (nor do "
                              f"{', '.join(wanted.forced(target)[1:]) or 'no stand-ins'}); its kernels are "
                              f"{', '.join(self._kernels)}")
        for kernel in self._kernels.values():
            if kernel.preferred(target):
                return Choice(kernel, kernel.why or "the first in priority order that applies")
        raise KernelError(f"no {self.product} kernel applies to {target}; its kernels are {', '.join(self._kernels)}")


def layer_kind(name: str) -> str:
    """A layer's name without its indices: model.layers.3.self_attn.qkv_proj -> model.layers.self_attn.qkv_proj."""
    return re.sub(r"\.\d+(?=\.|$)", "", name)


class ChoiceLog:
    """The start-up log of one model's kernel choices: each (method, layer kind, kernel) once, at INFO."""

    def __init__(self, method: str | None) -> None:
        self.method = method or "quantized"
        self.seen: set[tuple[str, str]] = set()

    def note(self, layer: str, choice: Choice, product: str) -> None:
        key = (layer_kind(layer), choice.name)
        if key in self.seen:
            return
        self.seen.add(key)
        logger.info("quantization %s: %s layers (%s) -> kernel %s: %s", self.method, key[0], product, choice.name,
                    choice.why)
