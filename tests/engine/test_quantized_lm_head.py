"""Checkpoints whose lm_head is quantized (not in compressed-tensors' `ignore`; GPTQ's `lm_head: true`): the head is
kept quantized like the decoder's projections (layers/quantization/linear_method.py; on the CPU's float32 the
exact A16 product), under tensor parallelism each rank holds its vocabulary rows of the integers
(model_executor/int_weights.py), the native float32 logits product does not take it (platforms/cpu/native_lm_head.py),
and the start-up log's weight bytes count its integers. With tied embeddings the head is untied and kept
quantized, the embedding float (model_executor/quantized_head.py). References: transformers loading the same
checkpoint decompressed by the compressed-tensors package (`CompressedTensorsConfig(run_compressed=False)`),
each quantized layer's input rounded to bf16 as the A16 definition says (tests/engine/test_quantized_kept.py)."""
import json
from pathlib import Path

import pytest
import torch
from quant_checkpoints import (
    HEAD_W8A16,
    MAX_TOKENS,
    PROMPTS,
    SHAPE,
    assert_greedy_equal_but_near_ties,
    ct_compress,
    ct_decompressed,
    ct_scheme,
    ct_with_quantized_head,
    engine_greedy,
    float_weights,
    hf_compressed_tensors,
    hf_greedy,
    triton_on_cpu,
    write_checkpoint,
)

from kubeinfer.engine import LLM, SamplingParams
from kubeinfer.engine.core.model_setup import memory_summary
from kubeinfer.engine.platforms.cpu.native import ops as native_ops
from kubeinfer.engine.model_executor.model_files import ModelLoadError

NATIVE = pytest.mark.skipif(not native_ops.available(), reason="no C compiler: the native A16 kernels do not build")
W8 = ("pack-quantized", 8, "int", "channel", True, None)
W4 = ("pack-quantized", 4, "int", "group", False, 32)
LOGPROB_BOUND = 0.25  # as tests/engine/test_quantized_kept.py: top-3 first-token log-probabilities against float32


def set_config(model_dir, **values) -> str:
    path = Path(model_dir) / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **values}))
    return str(model_dir)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from kubeinfer.dev.testing.random_model import build_random_model

    root = tmp_path_factory.mktemp("lm_head")
    float_dir = build_random_model(root / "float", "qwen3", tokenizer=False, seed=29, **SHAPE)
    weights = float_weights(float_dir)
    made = {"w8_head": write_checkpoint(float_dir, root / "w8_head", *ct_with_quantized_head(weights, ct_scheme(*W8))),
            # the benchmark's W4A16 model: int4 groups in the decoder, lm_head int8 per channel (its own config group)
            "w4_head8": write_checkpoint(float_dir, root / "w4_head8",
                                         *ct_with_quantized_head(weights, ct_scheme(*W4), HEAD_W8A16))}
    config = ct_scheme(*W8)
    made["w8"] = write_checkpoint(float_dir, root / "w8", ct_compress(weights, config), config)  # lm_head float
    # tied embeddings: the checkpoint's head quantized from the embedding, which stays float beside it
    tied_src = build_random_model(root / "tied_float", "qwen3", tokenizer=False, seed=30, tie_word_embeddings=True,
                                  **SHAPE)
    tied = float_weights(tied_src)
    tied["lm_head.weight"] = tied["model.embed_tokens.weight"].clone()
    tensors, config = ct_with_quantized_head(tied, ct_scheme(*W8))
    made["tied"] = write_checkpoint(tied_src, root / "tied", tensors, config)
    made["tied_as_untied"] = set_config(write_checkpoint(tied_src, root / "untied", tensors, config),
                                        tie_word_embeddings=False)
    del tensors["model.embed_tokens.weight"]
    made["tied_head_only"] = write_checkpoint(tied_src, root / "tied_head_only", tensors, config)
    return made


def reference(model_dir: str):
    """transformers on the checkpoint decompressed by the compressed-tensors package: its dequantizing load, or, where
    lm_head has a config group of its own (which that load decompresses by group_0's scheme), transformers' float
    model on the package's own decompression (quant_checkpoints.ct_decompressed)."""
    groups = json.loads((Path(model_dir) / "config.json").read_text())["quantization_config"]["config_groups"]
    if len(groups) == 1:
        return hf_compressed_tensors(model_dir, weight_only=True)
    from transformers import AutoModelForCausalLM

    float_dir = Path(model_dir).with_name(Path(model_dir).name + "_decompressed")
    if not float_dir.is_dir():
        ct_decompressed(model_dir, float_dir)
    return AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32).eval()


def a16_reference(model_dir: str):
    """reference(), each quantized layer's input (lm_head's too) rounded to bf16."""
    hf = reference(model_dir)
    for name, module in hf.named_modules():
        if isinstance(module, torch.nn.Linear) and (".layers." in name or name == "lm_head"):
            module.register_forward_pre_hook(lambda _, args: (args[0].to(torch.bfloat16).to(args[0].dtype),))
    return hf


def assert_head_kept(model, kernel_suffix: str = "int8") -> None:
    head = model.lm_head
    kernel = model.quant_kernels["lm_head"]
    assert kernel.startswith(f"cpu_{kernel_suffix}") and kernel != "dequantized", kernel
    assert head.weight.device.type == "meta" and not head.qweight.is_floating_point()  # no float copy held
    assert "forward" not in vars(head)  # neither the native float32 logits product nor OpenBLAS took it
    # no float32 linear layer left, and still small steps run torch on one thread beside the native pool
    assert model.openblas_small_steps


@NATIVE
@pytest.mark.parametrize("name", ["w8_head", "w4_head8"])
def test_quantized_head_is_kept_and_gives_the_references_tokens(dirs, monkeypatch, name):
    monkeypatch.delenv("KUBEINFER_QUANT_KERNEL", raising=False)
    llm = LLM(dirs[name], max_model_len=128, num_kv_blocks=64)
    try:
        assert_head_kept(llm.engine.runner.model)
        prompts = [list(range(3 + i, 40 + 3 * i)) for i in range(4)]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                               SamplingParams(temperature=0, max_tokens=1, logprobs=3))
    finally:
        llm.shutdown()
    hf = reference(dirs[name])  # float32 products: the bound the kept tests use
    gaps = []
    for prompt, output in zip(prompts, outputs):
        with torch.inference_mode():
            expected = torch.log_softmax(hf(torch.tensor([prompt])).logits[0, -1].float(), -1)
        for token, logprob in output.outputs[0].logprobs[0].items():
            gaps.append(abs(logprob.logprob - expected[token].item()))
    assert max(gaps) < LOGPROB_BOUND, gaps
    a16 = a16_reference(dirs[name])
    assert_greedy_equal_but_near_ties(engine_greedy(dirs[name]), hf_greedy(a16), a16)


def test_start_up_log_counts_the_quantized_heads_integers(dirs, monkeypatch):
    monkeypatch.delenv("KUBEINFER_QUANT_KERNEL", raising=False)
    held = {}
    for name in ("w8", "w8_head"):
        llm = LLM(dirs[name], max_model_len=64, num_kv_blocks=16)
        runner = llm.engine.runner
        held[name] = sum(p.numel() * p.element_size() for p in runner.model.parameters() if p.device.type != "meta")
        summary = memory_summary(runner, 16)
        llm.shutdown()
        assert summary.startswith(f"weights {held[name] / (1 << 20):.2f} MiB"), summary
    vocab_by_hidden = 512 * SHAPE["hidden_size"]
    # the float32 head (4 bytes a weight) replaced by one byte a weight and a scale per row
    assert held["w8"] - held["w8_head"] >= 2.9 * vocab_by_hidden, held
    assert f"{4 * SHAPE['num_layers'] + 1} linear layers" in summary


def test_two_ranks_hold_their_vocabulary_rows_of_the_integers(dirs, monkeypatch):
    """Each rank's head holds its half of the vocabulary's rows of the one-rank model's kept tensors (the integers
    and their per-row or per-group scales and zeros), not a dequantized float slice."""
    from test_quantized_tp import rank_model

    monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", "triton")  # the loaded layout only: nothing is multiplied
    for name in ("w8_head", "w4_head8"):
        one = rank_model(dirs[name], 0, 1).lm_head
        for rank in (0, 1):
            model = rank_model(dirs[name], rank, 2)
            head = model.lm_head
            assert model.quant_kernels["lm_head"] == "triton" and head.weight.device.type == "meta"
            rows = head.weight.shape[0]
            for tensor in head.quant_method.names:
                assert torch.equal(getattr(head, tensor), getattr(one, tensor)[rank * rows:(rank + 1) * rows])


def test_two_ranks_give_the_references_tokens(dirs, monkeypatch):
    """Two ranks (gloo), torch's int8 product with float32 activations (the head's rows split): transformers' tokens."""
    monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", "cpu_int8")
    hf = hf_compressed_tensors(dirs["w8_head"], weight_only=True)
    assert_greedy_equal_but_near_ties(engine_greedy(dirs["w8_head"], tensor_parallel_size=2), hf_greedy(hf), hf)


@NATIVE
def test_tied_embeddings_keep_the_embedding_float_and_the_head_quantized(dirs, monkeypatch):
    monkeypatch.delenv("KUBEINFER_QUANT_KERNEL", raising=False)
    llm = LLM(dirs["tied"], max_model_len=64, num_kv_blocks=16)
    model = llm.engine.runner.model
    try:
        assert_head_kept(model)
        embed = model.model.embed_tokens.weight
        assert embed.dtype == torch.float32 and embed.device.type == "cpu" and embed is not model.lm_head.weight
    finally:
        llm.shutdown()
    a16 = a16_reference(dirs["tied_as_untied"])  # the same tensors, the head read as its own
    assert_greedy_equal_but_near_ties(engine_greedy(dirs["tied"]), hf_greedy(a16), a16)


def test_tied_embeddings_with_only_a_quantized_copy_are_refused(dirs):
    with pytest.raises(ModelLoadError, match="only a quantized lm_head"):
        LLM(dirs["tied_head_only"], max_model_len=64, num_kv_blocks=16)


@NATIVE
def test_gptq_with_a_quantized_head(dirs, tmp_path, monkeypatch):
    """GPTQ's `lm_head: true` (as GPTQModel writes it and vLLM reads it): the head's qweight kept; tokens are
    transformers' on the float weights the integers mean (tests/engine/test_quantized_int.py), inputs rounded to
    bf16."""
    import quant_checkpoints
    from quant_checkpoints import gptq_pack
    from transformers import AutoModelForCausalLM

    float_dir = Path(dirs["w8"]).parent / "float"
    decoder = quant_checkpoints.is_decoder_linear
    monkeypatch.setattr(quant_checkpoints, "is_decoder_linear", lambda k: decoder(k) or k == "lm_head.weight")
    weights, config, dense = gptq_pack(float_weights(float_dir), 8, 128)
    monkeypatch.undo()
    model_dir = write_checkpoint(float_dir, tmp_path / "gptq", weights, {**config, "lm_head": True})
    dense_dir = write_checkpoint(float_dir, tmp_path / "dense", dense, None)
    llm = LLM(model_dir, max_model_len=64, num_kv_blocks=16)
    try:
        assert_head_kept(llm.engine.runner.model)
    finally:
        llm.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32).eval()
    for name, module in hf.named_modules():
        if isinstance(module, torch.nn.Linear):
            module.register_forward_pre_hook(lambda _, args: (args[0].to(torch.bfloat16).to(args[0].dtype),))
    assert_greedy_equal_but_near_ties(engine_greedy(model_dir), hf_greedy(hf), hf)
    assert len(PROMPTS) == len(MAX_TOKENS)


@pytest.mark.parametrize("tied", [False, True])
def test_the_heads_float_weight_is_never_allocated(tmp_path, monkeypatch, tied):
    """A kept head never allocates its float weight at load (layers/deferred_weight.py), untied or untied from a
    tied embedding (a vocabulary of 4096 makes the head 2 MiB in float32, the decoder's projections 0.4 MiB). The
    load's peak over the bytes held is the head's integers in transit as they are unpacked (measured 1.91x the float
    head's bytes); before, the float head allocated by `to_empty` (or when untied) and freed when kept added its
    1.0x on top (measured 2.91x, both cases)."""
    from load_peak import LiveBytes, held_bytes

    from kubeinfer.dev.testing.random_model import build_random_model

    monkeypatch.delenv("KUBEINFER_QUANT_KERNEL", raising=False)
    shape = {**SHAPE, "num_layers": 1, "vocab_size": 4096}
    float_dir = build_random_model(tmp_path / "float", "llama", tokenizer=False, seed=3, tie_word_embeddings=tied,
                                   **shape)
    weights = float_weights(float_dir)
    weights.setdefault("lm_head.weight", weights["model.embed_tokens.weight"].clone())
    model_dir = write_checkpoint(float_dir, tmp_path / "w8", *ct_with_quantized_head(weights, ct_scheme(*W8)))
    with LiveBytes() as live:
        model = LLM(model_dir, max_model_len=64, num_kv_blocks=16).engine.runner.model
    assert model.quant_kernels["lm_head"] != "dequantized" and model.lm_head.weight.device.type == "meta"
    head_float = 4096 * SHAPE["hidden_size"] * 4
    assert live.peak - held_bytes(model) < 2.4 * head_float, (live.peak, held_bytes(model), head_float)


@NATIVE
@pytest.mark.parametrize("forced, head", [("cpu_int4_vnni", "cpu_int8_vnni"), ("cpu_int4_a16", "cpu_int8_a16")])
def test_a_forced_native_kernel_takes_the_int8_head_at_its_own_width(dirs, monkeypatch, forced, head):
    """KUBEINFER_QUANT_KERNEL names a native kernel's arithmetic: the int8 head of an int4 model runs that
    arithmetic's int8 kernel (before: dequantized, the head float32 again)."""
    monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", forced)
    llm = LLM(dirs["w4_head8"], max_model_len=64, num_kv_blocks=16)
    kernels = llm.engine.runner.model.quant_kernels
    llm.shutdown()
    assert kernels.pop("lm_head") == head and set(kernels.values()) == {forced}


def test_the_last_ranks_padding_rows_are_zero_weights(tmp_path, monkeypatch):
    """A vocabulary of 509 over two ranks: 255 rows each, the last rank's final row past the vocabulary is padding
    (zero integers; its logit is dropped by the gather). Its 254 real rows are the one-rank model's."""
    from test_quantized_tp import rank_model

    from kubeinfer.dev.testing.random_model import build_random_model

    monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", "triton")  # the loaded layout only: nothing is multiplied
    float_dir = build_random_model(tmp_path / "float", "llama", tokenizer=False, seed=4,
                                   **{**SHAPE, "num_layers": 1, "vocab_size": 509})
    model_dir = write_checkpoint(float_dir, tmp_path / "w8", *ct_with_quantized_head(float_weights(float_dir),
                                                                                     ct_scheme(*W8)))
    one, last = rank_model(model_dir, 0, 1).lm_head, rank_model(model_dir, 1, 2).lm_head
    assert last.qweight.shape[0] == 255
    assert torch.equal(last.qweight[:254], one.qweight[255:]) and not last.qweight[254].any()
    assert torch.equal(last.weight_scale[:254], one.weight_scale[255:])


@triton_on_cpu
def test_the_triton_kernel_multiplies_the_quantized_head(dirs, monkeypatch):
    """The GPU's kernel (triton_int_matmul.py, here in Triton's interpreter) for every layer, the head included:
    first-token greedy tokens of transformers on the decompressed checkpoint (float32 activations)."""
    monkeypatch.setenv("KUBEINFER_QUANT_KERNEL", "triton")
    llm = LLM(dirs["w8_head"], max_model_len=64, num_kv_blocks=16)
    try:
        assert llm.engine.runner.model.quant_kernels["lm_head"] == "triton"
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                               SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    finally:
        llm.shutdown()
    hf = reference(dirs["w8_head"])
    expected = [tokens[:2] for tokens in hf_greedy(hf)]
    assert_greedy_equal_but_near_ties([o.outputs[0].token_ids for o in outputs], expected, hf)
