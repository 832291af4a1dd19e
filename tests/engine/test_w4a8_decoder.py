"""W4A8 layers in the whole-decoder-layer native decode (platforms/cpu/native_decode.py,
platforms/cpu/native/decoder_layer.c calling
ki_w4a8_f32): the fused layers make the per-module path's calls (W4A8Method.apply: the same native call, then the
bias added as torch adds it), so several decode steps' logits and KV caches are the same bits either way
(KUBEINFER_CPU_FUSED_LAYERS=0 the reference), at batch 1, 3 and 16, with a qkv bias (Qwen2) and q/k norms (Qwen3);
test_cpu_native_decoder.py's harness."""
from __future__ import annotations

import pytest
from quant_checkpoints import SHAPE, ct_compress, ct_scheme, float_weights, write_checkpoint
from test_cpu_native_decoder import FAMILIES, assert_fused_layers_give_the_per_module_paths_bits

from kubeinfer.engine import LLM
from kubeinfer.engine.platforms.cpu.native import ops

pytestmark = pytest.mark.skipif(not ops.available(), reason="no C compiler: the native kernels do not build here")


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_fused_w4a8_layers_give_the_per_module_paths_bits(tmp_path, monkeypatch, family):
    from kubeinfer.dev.testing.random_model import build_random_model

    float_dir = build_random_model(tmp_path / "float", family, tokenizer=False, seed=5, vocab_size=96, **SHAPE,
                                   **FAMILIES[family])
    config = ct_scheme("pack-quantized", 4, "int", "group", True, 64, activations=True)
    model_dir = write_checkpoint(float_dir, tmp_path / "w4a8", ct_compress(float_weights(float_dir), config), config)
    llm = LLM(model_dir, max_model_len=128, num_kv_blocks=32)
    model = llm.engine.runner.model
    assert set(model.activation_schemes.values()) == {"int8 dynamic per token (w4a8_vnni)"}
    assert_fused_layers_give_the_per_module_paths_bits(model, monkeypatch)
    llm.shutdown()
