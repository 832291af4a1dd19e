"""gpt-oss: greedy outputs token-for-token equal to transformers' (eager attention with sinks, eager experts) on
a tiny random model (8 experts, top-2, random router and sinks, alternating 6-token windowed and full layers,
YaRN rotary scaling, a low swiglu_limit so that the clamps bite), with prompts longer than the window, in mixed
batches with the prefix cache on and under preemption; MXFP4 expert weights against transformers' own
dequantization; the Triton attention kernel's sinks against a float64 reference."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_engine_correctness import MAX_TOKENS, PROMPTS
from test_moe_models import hf_references, run
from test_triton_kernels import DEVICES
from test_triton_windows import SEQUENCES, reference

from kubeinfer.engine import LLM

YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 32}
VARIANT = dict(num_layers=2, rope_scaling=YARN, rope_theta=1000.0)


@pytest.fixture(scope="module")
def oss_dir(tmp_path_factory):
    from kubeinfer.dev.testing.random_model import build_random_model

    return str(build_random_model(tmp_path_factory.mktemp("gpt_oss"), "gpt_oss", tokenizer=False, seed=50, **VARIANT))


@pytest.fixture(scope="module")
def oss_reference(oss_dir):
    return hf_references(oss_dir)


def test_greedy_batch_matches_transformers(oss_dir, oss_reference):
    assert max(len(p) for p in PROMPTS) > 6  # longer than the window
    llm = LLM(oss_dir, block_size=4)
    layers = llm.engine.runner.model.model.layers
    assert [layer.self_attn.window for layer in layers] == [6, None]
    assert run(llm) == oss_reference
    assert run(llm) == oss_reference
    assert llm.engine.block_manager.prefix_hits > 0


def test_chunked_prefill_and_preemption_keep_outputs_exact(oss_dir, oss_reference):
    llm = LLM(oss_dir, block_size=4, num_kv_blocks=14, max_num_batched_tokens=16)
    assert run(llm) == oss_reference
    assert llm.engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("switch", [dict(swiglu_limit=100.0), dict(rope_scaling=None), dict(sliding_window=4096)],
                         ids=["no-clamp", "no-yarn", "no-window"])
def test_the_switches_change_the_reference(switch, tmp_path, oss_reference):
    from kubeinfer.dev.testing.random_model import build_random_model

    twin = build_random_model(tmp_path / "twin", "gpt_oss", tokenizer=False, seed=50, **{**VARIANT, **switch})
    assert hf_references(twin, PROMPTS[:3], MAX_TOKENS[:3]) != oss_reference[:3]


def test_zero_sinks_change_the_reference(oss_dir, tmp_path, oss_reference):
    """Sinks at -inf take no share of the softmax: the outputs differ, so the test above checks the sinks."""
    shutil.copytree(oss_dir, tmp_path / "nosink")
    tensors = load_file(f"{oss_dir}/model.safetensors")
    tensors.update({k: torch.full_like(v, -1e9) for k, v in tensors.items() if k.endswith("sinks")})
    save_file(tensors, str(tmp_path / "nosink" / "model.safetensors"), metadata={"format": "pt"})
    assert run(LLM(str(tmp_path / "nosink"), block_size=4), PROMPTS[:3], MAX_TOKENS[:3]) != oss_reference[:3]


def test_yarn_tables_equal_transformers(oss_dir):
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from kubeinfer.engine.config import rope_settings
    from kubeinfer.engine.model_executor.layers.rotary_embedding import _yarn_inv_freq

    config = AutoConfig.from_pretrained(oss_dir)
    want, want_factor = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    theta, scaling = rope_settings(config)
    got, factor = _yarn_inv_freq(config.head_dim, theta, scaling)
    torch.testing.assert_close(got, want)
    assert factor == pytest.approx(want_factor)
    deepseek = {**YARN, "mscale": 1.0, "mscale_all_dim": 0.707}  # DeepSeek's spelling of the attention factor
    config.rope_parameters = {**config.rope_parameters, **deepseek}
    assert _yarn_inv_freq(config.head_dim, theta, deepseek)[1] == pytest.approx(
        ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")[1])


# -- MXFP4 --------------------------------------------------------------------------------------------------
def mxfp4_checkpoint(float_dir, out_dir, seed: int = 0):
    """The float checkpoint with its experts replaced by random MXFP4 blocks and scales (the Hub's layout:
    [E, out, in / 32, 16] and [E, out, in / 32]) and config.json's quantization_config saying so."""
    shutil.copytree(float_dir, out_dir)
    tensors = load_file(f"{float_dir}/model.safetensors")
    g = torch.Generator().manual_seed(seed)
    for key in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, inputs, outputs = tensors.pop(key).shape  # transformers' [E, in, out]
        tensors[f"{key}_blocks"] = torch.randint(0, 256, (experts, outputs, inputs // 32, 16), generator=g,
                                                 dtype=torch.uint8)
        tensors[f"{key}_scales"] = torch.randint(123, 129, (experts, outputs, inputs // 32), generator=g,
                                                 dtype=torch.uint8)
    save_file(tensors, f"{out_dir}/model.safetensors", metadata={"format": "pt"})
    config = json.loads((out_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out_dir / "config.json").write_text(json.dumps(config))
    return out_dir


def test_mxfp4_dequantization_equals_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from kubeinfer.engine.model_executor.layers.quantization.mxfp4 import dequantize

    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 140, (3, 40, 4), generator=g, dtype=torch.uint8)
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]
    assert torch.equal(dequantize(blocks, scales, torch.float32), want.transpose(1, 2))


def test_mxfp4_checkpoint_matches_transformers_dequantized(tmp_path):
    from transformers import Mxfp4Config

    from kubeinfer.dev.testing.random_model import build_random_model

    float_dir = build_random_model(tmp_path / "float", "gpt_oss", tokenizer=False, seed=51, num_layers=2,
                                   intermediate_size=32)  # one 32-value group per down row
    path = mxfp4_checkpoint(float_dir, tmp_path / "mxfp4")
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                              quantization_config=Mxfp4Config(dequantize=True)).eval()
    # transformers < 5.23 dequantizes to bfloat16 whatever the dtype (its experts then refuse float32 inputs);
    # e2m1 values times a power of two are exact in bfloat16, so the cast gives 5.23's float32 weights exactly.
    hf = hf.to(torch.float32)
    hf.set_experts_implementation("eager")
    llm = LLM(str(path), block_size=4)
    ours, theirs = llm.engine.runner.model.model.layers[1].mlp.experts, hf.model.layers[1].mlp.experts
    gate_up = theirs.gate_up_proj.transpose(1, 2)  # [E, 2I, H], gate/up interleaved
    assert torch.equal(ours.gate_up_proj, torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1))
    assert torch.equal(ours.down_proj, theirs.down_proj.transpose(1, 2))
    from test_engine_correctness import hf_greedy
    assert run(llm, PROMPTS[:4], MAX_TOKENS[:4]) == [hf_greedy(hf, p, n) for p, n in zip(PROMPTS[:4], MAX_TOKENS[:4])]


def test_mxfp4_without_its_scales_is_refused(tmp_path, oss_dir):
    from kubeinfer.engine.model_executor.model_loader import ModelLoadError

    path = mxfp4_checkpoint(oss_dir, tmp_path / "mx")
    tensors = load_file(f"{path}/model.safetensors")
    del tensors["model.layers.0.mlp.experts.down_proj_scales"]
    save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="down_proj_scales"):
        LLM(str(path), block_size=4)


def test_mxfp4_flag_on_a_float_checkpoint_is_refused(oss_dir):
    with pytest.raises(ValueError, match="'mxfp4' names checkpoints stored in MXFP4"):
        LLM(oss_dir, quantization="mxfp4")


# -- sinks in the Triton kernel ------------------------------------------------------------------------------
def reference_with_sinks(q, k_cache, v_cache, tables, starts, window, scale, sinks):
    """The windowed reference with each head's sink in the denominator: out * sum(e^s) / (sum(e^s) + e^sink)."""
    out = torch.empty(q.shape, dtype=torch.float64)
    group = q.shape[1] // k_cache.shape[2]
    for i, (ctx, new) in enumerate(SEQUENCES):
        keys = k_cache[tables[i]].flatten(0, 1)[:ctx].transpose(0, 1).double().repeat_interleave(group, 0)
        values = v_cache[tables[i]].flatten(0, 1)[:ctx].transpose(0, 1).double().repeat_interleave(group, 0)
        query = q[starts[i]:starts[i + 1]].transpose(0, 1).double()
        scores = query @ keys.transpose(1, 2) * scale
        q_pos, k_pos = torch.arange(ctx - new, ctx)[:, None], torch.arange(ctx)[None, :]
        visible = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
        scores = scores.masked_fill(~visible, float("-inf"))
        sink = sinks.double().view(-1, 1, 1).expand(-1, new, 1)
        probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
        out[starts[i]:starts[i + 1]] = (probs @ values).transpose(0, 1)
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window", [None, 6])
def test_paged_attention_sinks_match_torch(window, device):
    from kubeinfer.engine.platforms.cuda.triton_attention import paged_attention

    gen = torch.Generator().manual_seed(4)
    heads, kv_heads, head_dim, block_size = 4, 2, 16, 4
    tables = torch.randperm(64, generator=gen)[:60].view(6, 10)
    k_cache = torch.randn(64, block_size, kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(64, block_size, kv_heads, head_dim, generator=gen)
    starts = [0]
    for _, new in SEQUENCES:
        starts.append(starts[-1] + new)
    q = torch.randn(starts[-1], heads, head_dim, generator=gen)
    sinks = torch.tensor([-2.0, 0.5, 3.0, 8.0])  # one head's sink dwarfs its scores
    args = (q.to(device), k_cache.to(device), v_cache.to(device), tables.to(device),
            torch.tensor(starts, dtype=torch.int32, device=device),
            torch.tensor([ctx for ctx, _ in SEQUENCES], device=device))
    common = dict(scale=0.25, sliding_window=window, sinks=sinks.to(device), block_m=16, block_n=16)
    out = paged_attention(*args, first_seq=0, num_seqs=3, max_query_len=1, **common)
    paged_attention(*args, first_seq=3, num_seqs=3, max_query_len=max(n for _, n in SEQUENCES), out=out, **common)
    want = reference_with_sinks(q, k_cache, v_cache, tables, starts, window, 0.25, sinks)
    torch.testing.assert_close(out.cpu().double(), want, atol=2e-5, rtol=1e-5)
    assert not torch.allclose(want, reference(q, k_cache, v_cache, tables, starts, window, 0.25, None), atol=1e-3)


@pytest.mark.slow  # about 30 s in the interpreter; the kernels' own tests above run by default
@pytest.mark.parametrize("device", DEVICES)
def test_engine_on_triton_matches_transformers(device, oss_dir, oss_reference):
    """Sinks in the attention kernel and the fused-experts kernel, chunks and preemption, in one run."""
    llm = LLM(oss_dir, device=device, dtype="float32", attention_backend="triton", block_size=4,
              num_kv_blocks=14, max_num_batched_tokens=16)
    assert all(layer.mlp.experts.fused for layer in llm.engine.runner.model.model.layers)
    assert run(llm, PROMPTS[:3], MAX_TOKENS[:3]) == oss_reference[:3]  # three prompts: the interpreter is slow
    assert llm.engine.scheduler.num_preemptions > 0
