"""The kernels registered per product (quantization/kernel_registry.py) and the engine's kernel config that
chooses among them (kernel_config.py): priority order, forced kernels and their errors, the start-up log once
per layer kind, and two engines in one process with different choices."""
from __future__ import annotations

import logging

import pytest
import torch
from quant_checkpoints import SHAPE, ct_compress, ct_scheme, float_weights, write_checkpoint
from torch import nn

from kubeinfer.engine import LLM, envs
from kubeinfer.engine.config import EngineConfig
from kubeinfer.engine.kernel_config import KernelConfig, active, current
from kubeinfer.engine.model_executor.layers.quantization import linear_method, w8a8_kernels
from kubeinfer.engine.model_executor.layers.quantization.kernel_registry import (
    ChoiceLog,
    Kernel,
    KernelError,
    KernelRegistry,
    layer_kind,
)


class Toy(Kernel):
    def __init__(self, name: str, fits: int, stand_ins: tuple[str, ...] = ()) -> None:
        self.name, self.why, self.fits, self.stand_ins = name, f"{name} is fast", fits, stand_ins

    def applies(self, target: int) -> bool:
        return target % self.fits == 0

    def forced(self, target: int) -> tuple[str, ...]:
        return (self.name, *self.stand_ins)


def toy_registry() -> KernelRegistry:
    registry = KernelRegistry("toy")
    for kernel in (Toy("by6", 6), Toy("by2", 2, ("by1",)), Toy("by3", 3), Toy("by1", 1)):
        registry.register(kernel)
    return registry


def test_the_first_registered_kernel_that_applies_is_chosen():
    registry = toy_registry()
    assert registry.names() == ("by6", "by2", "by3", "by1")
    assert [registry.choose(n).name for n in (12, 4, 9, 7)] == ["by6", "by2", "by3", "by1"]
    assert registry.choose(12).why == "by6 is fast"


def test_a_forced_kernel_runs_where_it_applies_else_its_stand_ins_else_an_error_naming_the_kernels():
    registry = toy_registry()
    assert registry.choose(12, "by3").name == "by3" and registry.choose(12, "by3").why == "forced by3"
    assert registry.choose(7, "by2").name == "by1"  # its declared stand-in
    assert "does not apply here: by1" in registry.choose(7, "by2").why
    with pytest.raises(KernelError, match="the forced toy kernel 'by3' does not apply to 7 .* its kernels are "
                                          "by6, by2, by3, by1"):
        registry.choose(7, "by3")
    with pytest.raises(KernelError, match="'int_mm' is not a toy kernel; its kernels are by6, by2, by3, by1"):
        registry.choose(12, "int_mm")
    with pytest.raises(ValueError, match="registered twice"):
        registry.register(Toy("by2", 2))


def test_the_products_registries_hold_every_kernel_name_in_priority_order():
    """The names the variables accept, the docs and the metrics use: each registered once, none renamed."""
    assert linear_method.KERNELS == ("triton", "cpu_int4_a16", "cpu_int8_a16", "cpu_int4_bf16", "cpu_int8_bf16",
                                     "cpu_int4", "cpu_int8", "cpu_int8_vnni", "cpu_int4_vnni", "dequantized")
    assert set(linear_method.KERNELS) == set(envs.QUANT_KERNELS)
    assert linear_method.NATIVE == {"cpu_int4_a16": "cpu_int4_bf16", "cpu_int8_a16": "cpu_int8_bf16",
                                    "cpu_int8_vnni": "cpu_int8_bf16", "cpu_int4_vnni": "cpu_int4_bf16"}
    assert linear_method.SIBLING == {"cpu_int4_a16": "cpu_int8_a16", "cpu_int8_a16": "cpu_int4_a16",
                                     "cpu_int8_vnni": "cpu_int4_vnni", "cpu_int4_vnni": "cpu_int8_vnni"}
    assert w8a8_kernels.W8A8.names() == envs.W8A8_KERNELS
    assert w8a8_kernels.W4A8.names() == ("w4a8_vnni", "w4a8_int_mm")


def int8_weight(rows: int = 32, cols: int = 64) -> linear_method.IntWeight:
    values = torch.randint(-127, 128, (rows, cols), dtype=torch.int8)
    return linear_method.IntWeight(values, torch.rand(rows, 1) + 0.5, None, cols, 8)


def test_the_choice_is_logged_once_per_layer_kind(caplog):
    model = nn.ModuleDict({"layers": nn.ModuleList(nn.ModuleDict({"proj": nn.Linear(64, 32, bias=False)})
                                                   for _ in range(3))})
    weights = {f"layers.{i}.proj.weight": int8_weight() for i in range(3)}
    with caplog.at_level(logging.INFO), active(KernelConfig(quant_kernel="cpu_int8")):
        chosen = linear_method.install(model, weights, torch.float32, log=ChoiceLog("gptq"))
    assert set(chosen.values()) == {"cpu_int8"} and len(chosen) == 3
    said = [r.getMessage() for r in caplog.records if "-> kernel" in r.getMessage()]
    assert said == ["quantization gptq: layers.proj layers (weight-only) -> kernel cpu_int8: forced cpu_int8"]
    assert layer_kind("model.layers.11.mlp.experts.3.down_proj") == "model.layers.mlp.experts.down_proj"


def test_the_kernel_choice_is_the_active_configs_not_the_variables(monkeypatch):
    """Layers read the active engine's config; outside any engine the variables as they are at the call."""
    weight, cpu = int8_weight(), torch.device("cpu")
    monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", "dequantized")
    assert current().quant_kernel == "dequantized"
    assert linear_method.choose_kernel(weight, cpu, torch.float32) == "dequantized"
    with active(KernelConfig(quant_kernel="cpu_int8")):
        assert linear_method.choose_kernel(weight, cpu, torch.float32) == "cpu_int8"
        with active(KernelConfig(quant_kernel="cpu_int8_bf16")):
            assert linear_method.choose_kernel(weight, cpu, torch.float32) == "cpu_int8_bf16"
        assert linear_method.choose_kernel(weight, cpu, torch.float32) == "cpu_int8"


def test_the_variables_fill_the_configs_defaults_once(monkeypatch):
    monkeypatch.setenv("KUBEINFER_W8A8_KERNEL", "int_mm")
    monkeypatch.setenv("KUBEINFER_CPU_FUSED_LAYERS", "0")
    config = EngineConfig(model="m")
    monkeypatch.setenv("KUBEINFER_W8A8_KERNEL", "fake_quant")  # after the build: not this config's
    assert (config.kernels.w8a8_kernel, config.kernels.cpu_fused_layers) == ("int_mm", False)
    given = EngineConfig(model="m", quant_kernel="cpu_int4", cpu_openblas=False, w8a8_kernel="int8_vnni",
                         cpu_fused_layers=True)
    assert given.kernels == KernelConfig(quant_kernel="cpu_int4", cpu_openblas=False)
    with pytest.raises(ValueError, match="kernels.w8a8_kernel must be one of int8_vnni, int_mm, fake_quant"):
        EngineConfig(model="m", w8a8_kernel="vnni")
    with pytest.raises(ValueError, match="kernels.quant_kernel must be one of None, triton, "):
        KernelConfig(quant_kernel="int_mm")


def test_two_engines_in_one_process_keep_their_own_kernels(tmp_path, monkeypatch):
    from kubeinfer.dev.testing.random_model import build_random_model

    monkeypatch.delenv("KUBEINFER_QUANT_KERNEL", raising=False)
    float_dir = build_random_model(tmp_path / "float", "llama", tokenizer=False, seed=3, **SHAPE)
    config = ct_scheme("pack-quantized", 8, "int", "channel", True, None)
    model_dir = write_checkpoint(float_dir, tmp_path / "w8", ct_compress(float_weights(float_dir), config), config)
    engines = {kernel: LLM(model_dir, max_model_len=64, num_kv_blocks=16, quant_kernel=kernel)
               for kernel in ("cpu_int8", "cpu_int8_bf16")}
    for kernel, llm in engines.items():
        assert set(llm.engine.runner.model.quant_kernels.values()) == {kernel}
    prompt = [{"prompt_token_ids": list(range(5, 15))}]
    from kubeinfer.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    tokens = [llm.generate(prompt, params)[0].outputs[0].token_ids for llm in engines.values()]
    assert len(tokens[0]) == len(tokens[1]) == 4  # both engines step, each with its own kernels
    for kernel, llm in engines.items():  # torch's int8 product in float32, and with bf16 activations
        act_dtype = llm.engine.runner.model.model.layers[0].mlp.down_proj.quant_method.act_dtype
        assert act_dtype == (torch.bfloat16 if kernel.endswith("_bf16") else torch.float32)
    assert current().quant_kernel is None  # nothing left active on this thread after their steps


def test_the_kernel_choice_travels_to_the_other_ranks():
    """Followers build from rank 0's EngineConfig (core/tp_messages.py): its kernels go with it."""
    from kubeinfer.engine.core import tp_messages  # noqa: F401  (registers the config's types)
    from kubeinfer.engine.distributed import wire

    config = EngineConfig(model="m", quant_kernel="cpu_int4", w8a8_kernel="int_mm")
    kind, received = wire.decode(wire.encode(("config", config)))
    assert kind == "config" and received.kernels == config.kernels


def test_w8a8s_default_order_is_forcing_int8_vnni():
    """int8_vnni (the variable's default) is W8A8's priority order: the same kernel as forcing it, for any layer;
    int_mm forces W4A8's int_mm twin."""
    from kubeinfer.engine.model_executor.layers.quantization.w8a8_kernels import (
        W4A8,
        W8A8,
        ExactTarget,
        w4a8_forced,
        w8a8_forced,
    )

    targets = [ExactTarget("x", True, True, 64), ExactTarget("x", False), ExactTarget("x", True, False),
               ExactTarget("x", True, True, 1 << 40)]
    for target in targets:
        assert W8A8.choose(target, w8a8_forced("int8_vnni")).name == W8A8.choose(target, "int8_vnni").name
    assert [W8A8.choose(t, "int_mm").name for t in targets] == ["int_mm", "fake_quant", "fake_quant", "int_mm"]
    assert W8A8.choose(targets[3]).name == "int_mm"  # too many inputs for the native kernel's int32 sums
    assert W4A8.choose(ExactTarget("x", True), w4a8_forced("int_mm")).name == "w4a8_int_mm"
