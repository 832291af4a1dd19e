"""The quantization methods' registry (layers/quantization/registry.py): one registration per format, every list
of served names derived from it, and an unknown name an error that lists what is registered."""
from __future__ import annotations

import pytest

from kubeinfer.engine.model_executor.layers import quantization
from kubeinfer.engine.model_executor.layers.quantization import QuantizationError, config_class


def test_an_unknown_method_is_an_error_listing_the_registered_ones():
    """Before the registry the if-chain's last branch returned GptqConfig for any name it did not know."""
    with pytest.raises(QuantizationError, match="unknown quantization method 'bitsandbytes'; registered: fp8, "
                                                "compressed-tensors, awq, gptq, mxfp4"):
        config_class("bitsandbytes")


def test_each_served_method_names_its_own_config_class():
    for name in ("fp8", "compressed-tensors", "awq", "gptq", "mxfp4"):
        assert config_class(name).method == name


def test_a_registered_method_is_served_and_its_names_derive_from_the_registry():
    """One registration: the --quantization check, the aliases and config_class() see it at once."""
    from kubeinfer.engine.model_executor.layers.quantization import check_method_name, registry

    method = registry.QuantizationMethod("toy-int4", "awq:AwqConfig", "a test's method", aliases=("toy_int4",))
    with pytest.raises(QuantizationError, match="unknown method 'toy_int4'"):
        check_method_name("toy_int4")
    registry.register_method(method)
    try:
        check_method_name("toy_int4")  # the alias, canonical now
        assert quantization.canonical("TOY_INT4") == "toy-int4"
        assert config_class("toy-int4").method == "awq"
        assert "toy-int4" in registry.for_every_architecture()
        with pytest.raises(ValueError, match="registered twice"):
            registry.register_method(registry.QuantizationMethod("other", "awq:AwqConfig", "", aliases=("toy-int4",)))
    finally:
        registry.unregister_method("toy-int4")
    assert "toy-int4" not in quantization.registry.registered()


def test_the_architectures_serve_the_registered_methods():
    """Every family serves the methods registered for every architecture; gpt-oss names its own mxfp4."""
    from kubeinfer.engine.model_executor.layers.quantization.registry import for_every_architecture
    from kubeinfer.engine.model_executor.models.registry import ARCHITECTURES

    assert for_every_architecture() == ("fp8", "compressed-tensors", "awq", "gptq")
    assert ARCHITECTURES["LlamaForCausalLM"].quantized == "fp8, compressed-tensors, awq, gptq"
    assert ARCHITECTURES["GptOssForCausalLM"].quantized == "fp8, mxfp4"
    assert quantization.SERVED == ("fp8", "compressed-tensors", "awq", "gptq", "mxfp4")
    assert quantization.ALIASES == {"compressed_tensors": "compressed-tensors", "awq_marlin": "awq",
                                    "gptq_marlin": "gptq"}
