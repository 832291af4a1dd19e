"""The quantization methods the engine serves, registered by name: a `quantization_config.quant_method` value
-> its config class (imported only when a checkpoint uses it: no torch here), the names vLLM also accepts for
it, and whether every architecture serves it. `SERVED`, the aliases, `config_class()` and the models registry's
`Architecture.quantized` all read this registry, so adding a method is its module plus one `register_method`
line in methods.py. The kernels that multiply a method's layers are registered apart, per product
(kernel_registry.py)."""
from __future__ import annotations

import importlib
from dataclasses import dataclass

from .errors import QuantizationError


@dataclass(frozen=True)
class QuantizationMethod:
    """One checkpoint format. `config`: "module:Class" under this package, a class with `from_dict(qc)`,
    `describe()`, `auxiliary(key)`, `weight_key(key)` and `read(key, tensor, get)` (the loader's interface; a
    format whose weights can stay quantized adds `int_weight` and `checkpoint_slice`). `every_architecture`:
    False for a format only some families store (mxfp4: gpt-oss's experts), which those families name in
    their `Architecture.quantized`. `kernels`: the kernel registries its layers choose from (kernel_registry)."""
    name: str
    config: str
    summary: str
    aliases: tuple[str, ...] = ()
    every_architecture: bool = True
    kernels: tuple[str, ...] = ()

    def config_class(self) -> type:
        module, _, cls = self.config.partition(":")
        return getattr(importlib.import_module(f"{__package__}.{module}"), cls)


_METHODS: dict[str, QuantizationMethod] = {}
_ALIASES: dict[str, str] = {}


def register_method(method: QuantizationMethod) -> QuantizationMethod:
    """Adds `method`; a name or alias already taken is an error (two formats cannot claim one quant_method)."""
    for name in (method.name, *method.aliases):
        if name in _METHODS or name in _ALIASES:
            raise ValueError(f"quantization method name {name!r} is registered twice")
    _METHODS[method.name] = method
    _ALIASES.update({alias: method.name for alias in method.aliases})
    return method


def unregister_method(name: str) -> None:
    """Removes a method and its aliases (tests that register one of their own)."""
    method = _METHODS.pop(name)
    for alias in method.aliases:
        _ALIASES.pop(alias, None)


def registered() -> tuple[str, ...]:
    """The registered methods' names, in registration order."""
    return tuple(_METHODS)


def aliases() -> dict[str, str]:
    """vLLM's other names for a registered method (its kernels' names) -> the method."""
    return dict(_ALIASES)


def method_named(name: str) -> QuantizationMethod:
    """The registered method `name` (canonical, lower case); anything else is an error listing the registered."""
    method = _METHODS.get(name)
    if method is None:
        raise QuantizationError(f"unknown quantization method {name!r}; registered: {', '.join(_METHODS)}")
    return method


def for_every_architecture() -> tuple[str, ...]:
    """The methods any architecture serves (Architecture.quantized's default)."""
    return tuple(m.name for m in _METHODS.values() if m.every_architecture)
