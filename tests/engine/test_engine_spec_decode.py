"""Speculative decoding inside the engine: greedy outputs token-for-token equal to transformers' greedy
generate (a reference no one here wrote) for every family, with n-gram drafts and with drafts that are
mostly right (an oracle proposer fed transformers' own continuation, some of its drafts spoiled on
purpose), in mixed batches, under chunked prefill and preemption; KV blocks of rejected drafts given back
and never hashed into the prefix cache; stops, max_tokens and logprobs exactly as without speculation;
the adaptive switch; config errors and metrics."""
from __future__ import annotations

import argparse
import math
import types

import pytest
from test_engine_correctness import FAMILIES, MAX_TOKENS, PROMPTS

from kubeinfer.engine import LLM, SamplingParams
from kubeinfer.engine.core.block_manager import ROOT_KEY, hash_block
from kubeinfer.engine.sampling_params import StructuredOutputsParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
# Prompts that repeat spans of themselves, so the n-gram proposer finds matches.
COPY_PROMPTS = [[11, 12, 13, 14, 15, 16, 17] * 3, list(range(60, 80)) * 2 + list(range(60, 66)), [7, 8, 7, 8, 7]]
COPY_MAX_TOKENS = [20, 14, 9]


class OracleProposer:
    """Proposes the reference continuation of the prompts it knows (none for the others, which then run
    without speculation in the same steps). Every third proposal has its last draft spoiled and every fifth
    its first, so full, partial and no acceptance all happen."""

    def __init__(self, prompts: list[list[int]], references: list[list[int]], spoil: bool = True) -> None:
        self.known = list(zip(prompts, references))
        self.spoil = spoil
        self.calls = 0

    def propose(self, token_ids: list[int], num_tokens: int, owner=None) -> list[int]:
        for prompt, reference in self.known:
            done = len(token_ids) - len(prompt)
            if token_ids[:len(prompt)] == prompt and 0 <= done and token_ids[len(prompt):] == reference[:done]:
                drafts = list(reference[done:done + num_tokens])
                break
        else:
            return []
        self.calls += 1
        if drafts and self.spoil and self.calls % 3 == 0:
            drafts[-1] = (drafts[-1] + 1) % 256
        if drafts and self.spoil and self.calls % 5 == 0:
            drafts[0] = (drafts[0] + 1) % 256
        return drafts


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def check_blocks(engine) -> None:
    """No block held past a sequence's computed tokens (none kept for rejected drafts), and every
    prefix-cache key of a sequence is the key of its own tokens (only accepted tokens were hashed)."""
    bm = engine.block_manager
    for seq in engine.scheduler.running:
        assert len(seq.block_table) == -(-seq.num_computed_tokens // bm.block_size)
        assert seq.num_computed_tokens < seq.num_tokens
        parent = ROOT_KEY
        for i, key in enumerate(seq.block_hashes):
            parent = hash_block(parent, seq.token_ids[i * bm.block_size:(i + 1) * bm.block_size],
                                (seq.lora_id, seq.lora_generation))
            assert key == parent


def run_checked(llm: LLM, prompts, params) -> list:
    """generate(), stepping by hand to check the block invariants after every step."""
    engine = llm.engine
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"r{i}", {"prompt_token_ids": prompt}, p)
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        check_blocks(engine)
    assert engine.block_manager.num_free_blocks == engine.num_kv_blocks  # nothing leaked
    return [finished[f"r{i}"].outputs[0] for i in range(len(prompts))]


@pytest.mark.parametrize("family", FAMILIES)
def test_ngram_greedy_matches_transformers(family, model_dirs, references):
    llm = LLM(model_dirs[family], block_size=4, speculative_config=NGRAM)
    prompts, max_tokens = PROMPTS + COPY_PROMPTS, MAX_TOKENS + COPY_MAX_TOKENS
    expected = references(family) + references(family, COPY_PROMPTS, COPY_MAX_TOKENS)
    outputs = run_checked(llm, prompts, [greedy(n) for n in max_tokens])
    assert [o.token_ids for o in outputs] == expected
    assert llm.engine.speculator.num_draft_tokens > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_mostly_right_drafts_keep_greedy_exact_with_mixed_batches(family, model_dirs, references):
    llm = LLM(model_dirs[family], block_size=4, speculative_config=NGRAM)
    speculator = llm.engine.speculator
    # Drafts for four prompts of six: the other two decode without speculation in the same steps.
    speculator.proposer = OracleProposer(PROMPTS[:4], references(family)[:4])
    mixed_steps = []
    verify = llm.engine.runner.verify_drafts

    def spy(logits, seqs, masks):
        mixed_steps.append(any(s.spec_token_ids for s in seqs) and not all(s.spec_token_ids for s in seqs))
        return verify(logits, seqs, masks)
    llm.engine.runner.verify_drafts = spy
    outputs = run_checked(llm, PROMPTS, [greedy(n) for n in MAX_TOKENS])
    assert [o.token_ids for o in outputs] == references(family)
    assert any(mixed_steps)
    assert 0 < speculator.num_accepted_tokens < speculator.num_draft_tokens  # some rejected, most accepted
    assert speculator.num_accepted_tokens > speculator.num_draft_tokens / 2
    assert speculator.accepted_per_position[3] > 0  # whole drafts accepted too


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_chunked_prefill_preemption_and_prefix_cache_with_drafts(family, model_dirs, references):
    # 14 blocks of 4 tokens cannot hold the batch: sequences are preempted (with their drafts) and recomputed.
    llm = LLM(model_dirs[family], block_size=4, num_kv_blocks=14, max_num_batched_tokens=16, speculative_config=NGRAM)
    llm.engine.speculator.proposer = OracleProposer(PROMPTS, references(family))
    for _ in range(2):  # the second pass finds the first pass's blocks in the prefix cache
        outputs = run_checked(llm, PROMPTS, [greedy(n) for n in MAX_TOKENS])
        assert [o.token_ids for o in outputs] == references(family)
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.block_manager.prefix_hits > 0
    assert llm.engine.speculator.num_accepted_tokens > 0


def test_a_prompt_with_its_own_output_hits_only_blocks_of_accepted_tokens(llama_dir, references):
    """Blocks computed with rejected drafts in them must never serve a later request: a prompt made of a
    first request's prompt and output reuses its cached blocks and still continues exactly."""
    llm = LLM(llama_dir, block_size=4, speculative_config=NGRAM)
    ref = references("llama")
    llm.engine.speculator.proposer = OracleProposer(PROMPTS[2:3], ref[2:3])
    first = llm.generate([{"prompt_token_ids": PROMPTS[2]}], greedy(MAX_TOKENS[2]))[0].outputs[0].token_ids
    assert first == ref[2]
    hits = llm.engine.block_manager.prefix_hits
    longer = PROMPTS[2] + first
    plain = LLM(llama_dir, block_size=4).generate([{"prompt_token_ids": longer}], greedy(8))[0].outputs[0].token_ids
    again = llm.generate([{"prompt_token_ids": longer}], greedy(8))[0].outputs[0].token_ids
    assert again == plain
    assert llm.engine.block_manager.prefix_hits - hits >= len(longer) // 4 * 4 - 4


def test_stop_token_and_max_tokens_are_never_overshot(llama_dir, references):
    ref = references("llama")[1]  # 20 tokens
    stop_at = next(i for i in range(4, len(ref)) if ref[i] not in ref[:i])
    llm = LLM(llama_dir, block_size=4, speculative_config=NGRAM)
    llm.engine.speculator.proposer = OracleProposer([PROMPTS[1]], [ref], spoil=False)  # drafts run past the stop
    out = llm.generate([{"prompt_token_ids": PROMPTS[1]}] * 2,
                       [greedy(20, stop_token_ids=[ref[stop_at]]), greedy(7)])
    assert out[0].outputs[0].token_ids == ref[:stop_at + 1] and out[0].outputs[0].finish_reason == "stop"
    assert out[1].outputs[0].token_ids == ref[:7] and out[1].outputs[0].finish_reason == "length"
    assert llm.engine.speculator.num_accepted_tokens > 0


def test_stop_strings_and_logprobs_as_without_speculation(llama_dir):
    prompt = "The server reads the next batch quickly. The server reads the"
    plain = LLM(llama_dir, block_size=4)
    spec = LLM(llama_dir, block_size=4, speculative_config=NGRAM)
    full = plain.generate([prompt], greedy(30))[0].outputs[0]
    prompt_ids = plain.get_tokenizer().encode(prompt)
    spec.engine.speculator.proposer = OracleProposer([prompt_ids], [full.token_ids], spoil=False)
    stop = full.text[len(full.text) // 2:len(full.text) // 2 + 3]
    assert stop.strip()
    for params in (greedy(30, stop=[stop]), greedy(30, logprobs=3)):
        want, got = plain.generate([prompt], params)[0].outputs[0], spec.generate([prompt], params)[0].outputs[0]
        assert (got.text, got.token_ids, got.finish_reason) == (want.text, want.token_ids, want.finish_reason)
        if params.logprobs:
            for w, g in zip(want.logprobs, got.logprobs):
                assert set(w) == set(g)
                assert all(math.isclose(w[t].logprob, g[t].logprob, abs_tol=1e-4) and w[t].rank == g[t].rank for t in w)
    assert spec.engine.speculator.num_accepted_tokens > 0


def test_seeded_sampling_with_drafts_is_reproducible(llama_dir, references):
    params = [SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=s, max_tokens=16, ignore_eos=True,
                             presence_penalty=0.3) for s in (1, 2)]
    runs = []
    for _ in range(2):
        llm = LLM(llama_dir, block_size=4, speculative_config=NGRAM)
        llm.engine.speculator.proposer = OracleProposer(PROMPTS[:2], references("llama")[:2], spoil=False)
        runs.append([o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]],
                                                                  params)])
        assert llm.engine.speculator.num_draft_tokens > 0
    assert runs[0] == runs[1]


def test_grammar_sequences_do_not_speculate_and_stay_valid(model_dirs):
    llm = LLM(model_dirs["qwen2"], block_size=4, speculative_config=NGRAM)
    seen = []
    verify = llm.engine.runner.verify_drafts
    llm.engine.runner.verify_drafts = lambda logits, seqs, masks: (
        seen.extend(s for s in seqs if s.grammar is not None and s.spec_token_ids), verify(logits, seqs, masks))[1]
    choices = ("alpha beta alpha beta", "gamma")
    constrained = SamplingParams(temperature=1.0, seed=3, max_tokens=30,
                                 structured_outputs=StructuredOutputsParams(choice=choices))
    outputs = llm.generate(["alpha beta alpha beta alpha", {"prompt_token_ids": COPY_PROMPTS[0]}],
                           [constrained, greedy(20)])
    assert outputs[0].outputs[0].text in choices
    assert not seen and llm.engine.speculator.num_drafts > 0


def test_no_speculation_at_or_above_disable_by_batch_size(llama_dir):
    counts = []
    for limit in (2, 3):
        llm = LLM(llama_dir, block_size=4, speculative_config={**NGRAM, "disable_by_batch_size": limit})
        llm.generate([{"prompt_token_ids": p} for p in COPY_PROMPTS[:2]], [greedy(12)] * 2)
        counts.append(llm.engine.speculator.num_drafts)
    assert counts[0] == 0 < counts[1]


def test_a_request_whose_drafts_keep_failing_pauses_speculation(llama_dir, references):
    ref = references("llama")[5]  # 24 tokens

    never = next(t for t in range(256) if t not in ref)

    class Wrong:
        def propose(self, token_ids, num_tokens, owner=None):
            return [never] * num_tokens

    drafted = []
    for rate in (0.0, 0.5):
        llm = LLM(llama_dir, block_size=4, speculative_config={**NGRAM, "min_acceptance_rate": rate,
                                                               "acceptance_window": 4})
        llm.engine.speculator.proposer = Wrong()
        assert llm.generate([{"prompt_token_ids": PROMPTS[5]}], greedy(24))[0].outputs[0].token_ids == ref
        drafted.append(llm.engine.speculator.num_drafts)
    assert drafted[0] >= 20 and drafted[1] <= 4


@pytest.mark.parametrize("value, message", [
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"method": "eagle", "num_speculative_tokens": 4}, "not supported yet"),
    ({"method": "medusa2", "num_speculative_tokens": 4}, "method must be one of ngram, draft_model"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3}, "must be <="),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown key(s) lookahead"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1}, "disable_by_batch_size"),
    ("{not json", "not valid JSON"),
])
def test_bad_speculative_configs_are_refused_before_loading_the_model(value, message):
    with pytest.raises(ValueError) as error:
        LLM("/nonexistent/model", speculative_config=value)
    assert message in str(error.value)


def test_serve_takes_speculative_config_json(tmp_path):
    from kubeinfer.engine.entrypoints.serve import add_serve_arguments, build_state
    from kubeinfer.engine.spec_decode.config import SpeculativeConfig

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    args = parser.parse_args([str(tmp_path), "--speculative-config", '{"method": "draft_model", "num_speculative_tokens": 4}'])
    with pytest.raises(SystemExit, match='kubeinfer serve: speculative_config: method "draft_model" needs "model"'):
        build_state(args)
    value = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
    config = SpeculativeConfig.parse(parser.parse_args([str(tmp_path), "--speculative-config", value]).speculative_config)
    assert (config.num_speculative_tokens, config.prompt_lookup_max, config.prompt_lookup_min) == (4, 4, 2)


def test_metrics_use_vllm_names(llama_dir):
    from prometheus_client import generate_latest

    from kubeinfer.engine.entrypoints.metrics import EngineMetrics

    llm = LLM(llama_dir, block_size=4, speculative_config=NGRAM)
    llm.generate([{"prompt_token_ids": p} for p in COPY_PROMPTS], [greedy(n) for n in COPY_MAX_TOKENS])
    fake = types.SimpleNamespace(engine=llm.engine, output_observers=[], abort_observers=[], num_running=0,
                                 num_waiting=0)
    text = generate_latest(EngineMetrics(fake, "tiny").registry).decode()
    s = llm.engine.speculator
    assert f'vllm:spec_decode_num_drafts_total{{model_name="tiny"}} {float(s.num_drafts)}' in text
    assert f'vllm:spec_decode_num_draft_tokens_total{{model_name="tiny"}} {float(s.num_draft_tokens)}' in text
    assert f'vllm:spec_decode_num_accepted_tokens_total{{model_name="tiny"}} {float(s.num_accepted_tokens)}' in text
    assert 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"}' in text
    assert s.num_draft_tokens > 0
