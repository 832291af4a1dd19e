"""Quantized checkpoints of tiny random models, written by the formats' own packages or published definitions,
for the quantization tests: compressed-tensors through the `compressed-tensors` package (its observers'
qparams, its `quantize` and its compressors write the tensors), AWQ and GPTQ by AutoAWQ's and AutoGPTQ's
published layouts (neither package installs without CUDA)."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kubeinfer.dev.file_modes import share_readable
from kubeinfer.engine import LLM, SamplingParams

# A CPU engine with KUBEINFER_QUANT_KERNEL=triton runs the kernels in Triton's interpreter only (the engine refuses
# it otherwise): tests/conftest.py turns the interpreter on where there is no GPU, so on a GPU machine they skip.
triton_on_cpu = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "on", "yes"),
                                   reason="forces the Triton kernels on a CPU engine: Triton's interpreter only")
PROMPTS = [[11, 12, 13, 14, 15, 16, 17], [40, 41, 42], list(range(60, 100)), [7]]
MAX_TOKENS = [12, 16, 9, 20]
# 128 input columns everywhere but down_proj's 256: AWQ's and GPTQ's usual group of 128 fits.
SHAPE = dict(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2, num_layers=2)


def is_decoder_linear(key: str) -> bool:
    """The decoder's projections, MoE experts included (Mixtral's w1/w3/w2); not routers, norms or embeddings."""
    return ".layers." in key and key.endswith(("_proj.weight", ".w1.weight", ".w2.weight", ".w3.weight"))


def write_checkpoint(src: Path, dst: Path, weights: dict, quantization_config: dict | None) -> str:
    shutil.copytree(src, dst)
    (dst / "model.safetensors").unlink()
    save_file({k: v.contiguous() for k, v in weights.items()}, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    config.pop("quantization_config", None)
    if quantization_config is not None:
        config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    return str(share_readable(dst))


def ct_scheme(fmt: str, num_bits: int, kind: str, strategy: str, symmetric: bool, group_size: int | None,
              activations: bool = False, ignore: tuple[str, ...] = ()) -> dict:
    weights = {"num_bits": num_bits, "type": kind, "symmetric": symmetric, "strategy": strategy,
               "group_size": group_size, "dynamic": False, "actorder": None, "observer": "minmax"}
    inputs = {"num_bits": 8, "type": kind, "symmetric": True, "strategy": "token", "dynamic": True,
              "observer": None} if activations else None
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": inputs,
                                          "output_activations": None, "format": fmt}},
            "ignore": ["lm_head", *ignore], "kv_cache_scheme": None}


def ct_compress(weights: dict, config: dict, group: str = "group_0", select=is_decoder_linear) -> dict:
    """The decoder's linear weights (those `select` picks) through the compressed-tensors package, by the config
    group `group`: qparams by its min-max rule (calculate_qparams), then its registered compressor for the
    format (quantize + pack)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = QuantizationScheme.model_validate(config["config_groups"][group])
    args = scheme.weights
    compressor = BaseCompressor.get_value_from_registry(config["format"])
    out = {}
    for key, w in weights.items():
        if not select(key):
            out[key] = w
            continue
        if args.strategy == "group":
            view = w.unflatten(1, (-1, args.group_size))
            lo, hi = view.amin(-1), view.amax(-1)
        elif args.strategy == "channel":
            lo, hi = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
        else:
            lo, hi = w.amin().reshape(1), w.amax().reshape(1)
        scale, zero = calculate_qparams(lo, hi, args)
        state = {"weight": w, "weight_scale": scale.to(w.dtype),
                 "weight_zero_point": zero.to(torch.int8 if args.type == "int" else w.dtype)}
        prefix = key.removesuffix("weight")
        out.update({prefix + name: t for name, t in compressor.compress(state, scheme).items()})
    return out


HEAD_W8A16 = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "group_size": None,
              "dynamic": False, "actorder": None, "observer": "minmax"}


def ct_with_quantized_head(weights: dict, config: dict, head: dict | None = None) -> tuple[dict, dict]:
    """A compressed-tensors checkpoint whose lm_head is quantized too (not in `ignore`): the decoder by the config's
    group_0, lm_head by its own config group `head` (targets ["lm_head"]; default W8A16 per channel, as llama.cpp
    users' Q8_0 output matrix), or by group_0 itself where `head` is None (its `Linear` target covers lm_head)."""
    config = json.loads(json.dumps(config))
    config["ignore"] = [n for n in config["ignore"] if n != "lm_head"]
    out = ct_compress(weights, config)
    group = "group_0"
    if head is not None:
        fmt = config["format"]
        config["config_groups"]["group_1"] = {"targets": ["lm_head"], "weights": head, "input_activations": None,
                                              "output_activations": None, "format": fmt}
        group = "group_1"
    return ct_compress(out, config, group, select=lambda k: k == "lm_head.weight"), config


def ct_decompressed(model_dir, dst: Path) -> str:
    """The checkpoint decompressed to float by the compressed-tensors package: each module's scheme picked by its own
    target matching (exact name, then `re:`, then class), its compressor's `decompress`. For configs transformers'
    dequantizing load misreads (a config group of its own for lm_head: transformers decompresses it by group_0's)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.utils.match import match_targets

    config = json.loads((Path(model_dir) / "config.json").read_text())["quantization_config"]
    groups = {t: QuantizationScheme.model_validate(g) for g in config["config_groups"].values() for t in g["targets"]}
    compressor = BaseCompressor.get_value_from_registry(config["format"])
    weights, out = float_weights(model_dir), {}
    for key in [k for k in weights if k.endswith(".weight_packed")]:
        prefix = key.removesuffix("weight_packed")
        local = {k.removeprefix(prefix): weights.pop(k) for k in list(weights) if k.startswith(prefix)}
        scheme = groups[match_targets(prefix[:-1], torch.nn.Linear(1, 1), groups)[0]]
        out[prefix + "weight"] = compressor.decompress(local, scheme)["weight"].to(torch.float32)
    return write_checkpoint(Path(model_dir), dst, {**weights, **out}, None)


def hf_greedy(model) -> list[list[int]]:
    out = []
    for prompt, n in zip(PROMPTS, MAX_TOKENS):
        ids = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=0, do_sample=False, eos_token_id=[], pad_token_id=0)
        out.append(ids[0, len(prompt):].tolist())
    return out


def hf_compressed_tensors(model_dir, weight_only: bool):
    """transformers' own load, decompressed by the compressed-tensors package: `dequantize=True` for the
    weight-only formats (what `run_compressed=False` sets); for W8A8 the default `CompressedTensorsConfig()`,
    whose forward wrapper decompresses the weights on the first call and fake-quantizes each quantized
    layer's input (`dequantize=True` would leave the activations unquantized: test_quantized_w8a8.py)."""
    from transformers import AutoModelForCausalLM, CompressedTensorsConfig

    config = CompressedTensorsConfig(dequantize=True) if weight_only else CompressedTensorsConfig()
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, quantization_config=config).eval()


def engine_greedy(model_dir, **kwargs) -> list[list[int]]:
    llm = LLM(model_dir, max_model_len=128, num_kv_blocks=64, **kwargs)
    try:
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
    finally:
        llm.shutdown()  # a tensor-parallel engine's ranks end with it (one such engine per process)


def float_weights(model_dir: Path) -> dict:
    return load_file(str(Path(model_dir) / "model.safetensors"))


def minmax_int(w: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min-max quantization of w [out, in] per group of `group` input columns, as AutoAWQ and
    AutoGPTQ (sym=False) compute it: unsigned q [out, in], zero [out, groups] (integers), scale [out, groups]."""
    top = (1 << bits) - 1
    view = w.unflatten(1, (-1, group))
    lo, hi = view.amin(-1).clamp(max=0), view.amax(-1).clamp(min=0)
    scale = ((hi - lo) / top).clamp(min=1e-5).to(torch.float16).to(torch.float32)  # scales are stored in fp16
    zero = torch.round(-lo / scale).clamp(0, top)
    q = torch.clamp(torch.round(view / scale[..., None]) + zero[..., None], 0, top).flatten(1)
    return q.to(torch.int32), zero.to(torch.int32), scale


def pack_words(values: torch.Tensor, bits: int, order=None) -> torch.Tensor:
    """[rows, cols] unsigned values -> [rows, cols * bits / 32] int32: value j of a word at bits j * bits; with
    `order`, word position j holds column order[j] of its block (AWQ)."""
    per = 32 // bits
    blocks = values.view(values.shape[0], -1, per).to(torch.int64)
    if order is not None:
        blocks = blocks[:, :, list(order)]
    words = sum(blocks[:, :, j] << (bits * j) for j in range(per))
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)  # the same 32 bits, signed


AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's GEMM packing order (awq/modules/linear/gemm.py)


def awq_pack(weights: dict, group: int = 128) -> tuple[dict, dict]:
    """AutoAWQ's GEMM checkpoint: qweight [in, out/8], qzeros [in/group, out/8], scales [in/group, out] fp16."""
    out = {}
    for key, w in weights.items():
        if not is_decoder_linear(key):
            out[key] = w
            continue
        q, zero, scale = minmax_int(w, 4, group)
        prefix = key.removesuffix("weight")
        out[prefix + "qweight"] = pack_words(q.t().contiguous(), 4, AWQ_ORDER)
        out[prefix + "qzeros"] = pack_words(zero.t().contiguous(), 4, AWQ_ORDER)
        out[prefix + "scales"] = scale.t().contiguous().to(torch.float16)
    config = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm",
              "modules_to_not_convert": None}
    return out, config


def awq_to_compressed_tensors(weights: dict, config: dict) -> tuple[dict, dict]:
    """The AWQ checkpoint as compressed-tensors' own AutoAWQ converter rewrites it (pack-quantized W4A16)."""
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    converter = AutoAWQConverter.from_autoawq_config(config)
    converted = converter.process(dict(weights))
    ct_config = converter.update_config(None).model_dump(exclude_none=True)
    ct_config["quant_method"] = "compressed-tensors"
    return converted, ct_config


def gptq_pack(weights: dict, bits: int, group: int, act_order: bool = False, seed: int = 0
              ) -> tuple[dict, dict, dict]:
    """AutoGPTQ's checkpoint (checkpoint_format gptq, v1): qweight [in*bits/32, out] packed along the input rows,
    qzeros [groups, out*bits/32] holding zero - 1, scales [groups, out] fp16, g_idx [in]. With `act_order`
    the rows' groups are a random permutation's (as desc_act leaves them). Returns the checkpoint, its config
    and the float weights it means ((q - zero) * scale, written out here from the unpacked integers)."""
    generator = torch.Generator().manual_seed(seed)
    out, dense = {}, {}
    for key, w in weights.items():
        if not is_decoder_linear(key):
            out[key] = dense[key] = w
            continue
        rows = w.shape[1]
        perm = torch.randperm(rows, generator=generator) if act_order else torch.arange(rows)
        q, zero, scale = minmax_int(w[:, perm], bits, group)  # groups over the permuted columns
        assert int(zero.min()) >= 1, "v1 stores zero - 1: a zero of 0 would wrap (AutoGPTQ's known quirk)"
        inverse = torch.argsort(perm)
        q = q[:, inverse]  # back to the checkpoint's column order; each column remembers its group
        g_idx = (inverse // group).to(torch.int32)
        prefix = key.removesuffix("weight")
        out[prefix + "qweight"] = pack_words(q.contiguous(), bits).t().contiguous()  # rows packed: pack q^T's cols
        out[prefix + "qzeros"] = pack_words((zero - 1).t().contiguous() & ((1 << bits) - 1), bits)
        out[prefix + "scales"] = scale.t().contiguous().to(torch.float16)
        out[prefix + "g_idx"] = g_idx
        dense[key] = (q.to(torch.float32) - zero.to(torch.float32)[:, g_idx.long()]) * scale[:, g_idx.long()]
    config = {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": act_order, "sym": False,
              "checkpoint_format": "gptq", "true_sequential": True}
    return out, config, dense


# --- W8A8 references: activations fake-quantized by the compressed-tensors package's own functions ---

def ct_activation_args(**kwargs):
    """compressed-tensors QuantizationArgs of an input-activation scheme (e.g. type='float', strategy='group')."""
    from compressed_tensors.quantization import QuantizationArgs

    return QuantizationArgs(**{"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token",
                               "dynamic": True, **kwargs})


def ct_fake_quantize(x: torch.Tensor, args, scale=None, zero=None) -> torch.Tensor:
    """x as the compressed-tensors forward wrapper passes it to a linear layer (forward.forward_quantize):
    dynamic scales from compute_dynamic_scales_and_zp (x as [batch, tokens, hidden]), else the given ones."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    if args.dynamic:
        scale, zero = compute_dynamic_scales_and_zp(value=x, args=args, module=None)
    return fake_quantize(x=x, scale=scale, zero_point=zero, args=args)


def fake_quantize_inputs(model, args_of) -> None:
    """Forward pre-hooks on the decoder's linear layers (transformers' q/k/v/o/gate/up/down_proj): their input
    fake-quantized as `args_of(module_name)` -> (QuantizationArgs, scale, zero) says; for references that load
    dequantized weights (FineGrainedFP8Config(dequantize=True)). A PEFT adapter wrapped around a layer later
    still reads the unquantized input: the hook is on the base layer."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in name and name.endswith("_proj"):
            args, scale, zero = args_of(name)
            module.register_forward_pre_hook(
                lambda m, inp, a=args, s=scale, z=zero: (ct_fake_quantize(inp[0], a, s, z),))


def assert_greedy_equal_but_near_ties(ours: list[list[int]], ref: list[list[int]], model, tie: float = 0.05,
                                      min_equal: int = 2) -> None:
    """Activation quantization turns a last-bit difference of float sums into a whole quantization step now and
    then, so greedy tokens may part at a near tie: each sequence equals the reference's up to its first
    difference, where the reference's own logits (full forward of the common prefix) put the two tokens
    within `tie`; at least `min_equal` of the sequences equal it throughout."""
    equal = 0
    for prompt, mine, theirs in zip(PROMPTS, ours, ref):
        if mine == theirs:
            equal += 1
            continue
        i = next(k for k, (a, b) in enumerate(zip(mine, theirs)) if a != b)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + theirs[:i]])).logits[0, -1].float()
        gap = abs(logits[mine[i]] - logits[theirs[i]]).item()
        assert gap < tie, f"prompt {prompt[:4]}...: token {i} is {mine[i]}, the reference's {theirs[i]} by {gap:.3f}"
    assert equal >= min_equal, f"only {equal} of {len(ref)} sequences equal the reference's"
