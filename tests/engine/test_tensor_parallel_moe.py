"""Mixture-of-experts models under tensor parallelism on the CPU (gloo, 2 ranks): greedy outputs of
LLM(tensor_parallel_size=2) equal to transformers' eager experts for Qwen3-MoE (a dense layer between sparse
ones), Qwen2-MoE (its shared expert and gate), Mixtral and gpt-oss (per-head sinks, expert biases, windows), in
one engine with chunked prefill, forced preemption and the prefix cache; each rank holding every expert's half
of the intermediate dimension; an expert size that does not split refused by name before any rank starts."""
import pytest
from test_gpt_oss import VARIANT as GPT_OSS_VARIANT
from test_moe_models import VARIANTS, hf_references, run
from test_tensor_parallel import assert_two_ranks_equal_transformers

from kubeinfer.engine import LLM

MODELS = {**VARIANTS, "gpt_oss": GPT_OSS_VARIANT}
SEEDS = {"qwen3_moe": 40, "qwen2_moe": 41, "mixtral": 42, "gpt_oss": 50}  # test_moe_models.py's, test_gpt_oss.py's
DEFAULT_SUITE = ("qwen3_moe",)  # the others (about 5 s each here) run with the slow tests


@pytest.fixture(scope="module")
def tp_moe_dirs(tmp_path_factory):
    from kubeinfer.dev.testing.random_model import build_random_model

    root = tmp_path_factory.mktemp("tp_moe")
    cache = {}

    def get(family: str) -> str:
        if family not in cache:
            cache[family] = str(build_random_model(root / family, family, tokenizer=False, seed=SEEDS[family],
                                                   **MODELS[family]))
        return cache[family]
    return get


@pytest.mark.parametrize("family", [f if f in DEFAULT_SUITE else pytest.param(f, marks=pytest.mark.slow)
                                    for f in MODELS])
def test_greedy_outputs_equal_transformers(family, tp_moe_dirs):
    def rank0_holds_half_of_every_expert(llm) -> None:
        experts = next(m for m in llm.engine.runner.model.modules() if type(m).__name__ == "FusedMoE")
        half = _expert_size(llm.engine.runner.model.spec.config, family) // 2
        assert tuple(experts.down_proj.shape[::2]) == (8, half) and experts.gate_up_proj.shape[1] == 2 * half

    assert_two_ranks_equal_transformers(tp_moe_dirs(family), run, hf_references, rank0_holds_half_of_every_expert)


def _expert_size(config, family: str) -> int:
    """Each expert's whole intermediate size, as the checkpoint has it."""
    return config.moe_intermediate_size if family.startswith("qwen") else config.intermediate_size


@pytest.mark.parametrize("field, size", [("moe_intermediate_size", 49), ("shared_expert_intermediate_size", 81)])
def test_an_expert_size_that_does_not_split_is_refused_by_name(field, size, tmp_path):
    from kubeinfer.dev.testing.random_model import build_random_model

    model_dir = build_random_model(tmp_path / "odd", "qwen2_moe", tokenizer=False, num_layers=1, **{field: size})
    with pytest.raises(ValueError, match=rf"{field} \({size}\) is not divisible by the tensor parallel size \(2\)"):
        LLM(str(model_dir), tensor_parallel_size=2)


@pytest.mark.slow  # Triton's CPU interpreter
def test_fused_experts_kernel_on_each_rank_keeps_outputs_exact(tp_moe_dirs):
    """The GPU path (Triton attention and fused-experts kernels; here in Triton's interpreter) on each rank's
    slice of the experts: 24 of each expert's 48 columns, an intermediate size no kernel block divides."""
    model_dir = tp_moe_dirs("qwen3_moe")
    llm = LLM(model_dir, block_size=4, max_num_seqs=8, tensor_parallel_size=2, attention_backend="triton")
    try:
        experts = [m for m in llm.engine.runner.model.modules() if type(m).__name__ == "FusedMoE"]
        assert experts and all(m.fused and m.intermediate_size == 24 for m in experts)
        assert run(llm) == hf_references(model_dir)
    finally:
        llm.shutdown()


@pytest.mark.slow
def test_mxfp4_experts_dequantized_then_cut(tmp_path):
    """gpt-oss's MXFP4 experts (and sinks, through the quantized read) dequantized whole on each rank, then
    cut: rank 0 holds the first half of every expert's columns of the one-rank model, and the outputs agree
    (the one-rank model's are checked against transformers' in test_gpt_oss.py)."""
    import torch
    from test_gpt_oss import mxfp4_checkpoint

    from kubeinfer.dev.testing.random_model import build_random_model

    float_dir = build_random_model(tmp_path / "float", "gpt_oss", tokenizer=False, seed=51, num_layers=2,
                                   intermediate_size=64)  # 32 columns per rank: one MXFP4 group per down row
    path = str(mxfp4_checkpoint(float_dir, tmp_path / "mxfp4"))
    one = LLM(path, block_size=4)
    want = run(one)
    whole = one.engine.runner.model.model.layers[1].mlp.experts
    two = LLM(path, block_size=4, tensor_parallel_size=2)
    try:
        half = two.engine.runner.model.model.layers[1].mlp.experts
        assert torch.equal(half.down_proj, whole.down_proj[..., :32])
        assert torch.equal(half.gate_up_proj, torch.cat([whole.gate_up_proj[:, :32], whole.gate_up_proj[:, 64:96]], 1))
        assert run(two) == want
    finally:
        two.shutdown()
