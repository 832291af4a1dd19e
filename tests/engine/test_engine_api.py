"""The offline API's behaviour: stops, seeds, n, logprobs, priority, abort, validation, chat."""
import json
import shutil

import pytest

from kubeinfer.engine import LLM, SamplingParams
from kubeinfer.engine.core.detokenizer import IncrementalDetokenizer


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(llama_dir, block_size=8)


PROMPT = "The licensee may copy and distribute"


def greedy_text(llm, max_tokens=24, **kwargs):
    return llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs))[0].outputs[0]


def test_max_tokens_finishes_with_length(llm):
    out = greedy_text(llm, max_tokens=7)
    assert len(out.token_ids) == 7 and out.finish_reason == "length"
    assert out.text == llm.get_tokenizer().decode(out.token_ids, skip_special_tokens=True)


def test_stop_string_truncates_text(llm):
    full = greedy_text(llm)
    stop = full.text[len(full.text) // 2: len(full.text) // 2 + 3]
    assert stop.strip(), "the model's output is too short to pick a stop string from"
    cut = greedy_text(llm, stop=[stop])
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    assert cut.text == full.text[:full.text.index(stop)]
    kept = greedy_text(llm, stop=[stop], include_stop_str_in_output=True)
    assert kept.text == full.text[:full.text.index(stop) + len(stop)]


def test_stop_token_id_ends_generation(llm):
    full = greedy_text(llm)
    target = full.token_ids[4]
    out = greedy_text(llm, stop_token_ids=[target])
    first = full.token_ids.index(target)
    assert out.token_ids == full.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == target


def test_eos_from_generation_config(llama_dir, tmp_path):
    base = LLM(llama_dir)
    full = base.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0]
    eos = full.token_ids[5]
    model = tmp_path / "model"
    shutil.copytree(llama_dir, model)
    config = json.loads((model / "generation_config.json").read_text())
    config["eos_token_id"] = eos
    (model / "generation_config.json").write_text(json.dumps(config))
    llm = LLM(str(model))
    stopped = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16))[0].outputs[0]
    assert stopped.token_ids == full.token_ids[:full.token_ids.index(eos) + 1] and stopped.finish_reason == "stop"
    ignored = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0]
    assert ignored.token_ids == full.token_ids and ignored.finish_reason == "length"
    forced = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=16, min_tokens=10))[0].outputs[0]
    assert len(forced.token_ids) >= 10 and eos not in forced.token_ids[:9]


def test_seeded_request_is_reproducible_in_any_batch(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=20, ignore_eos=True)
    alone = llm.generate(PROMPT, params)[0].outputs[0].token_ids
    others = ["Everyone is permitted", "This program is free software", "Copyright"]
    batch = llm.generate(others[:2] + [PROMPT] + others[2:],
                         [SamplingParams(temperature=0.8, max_tokens=30)] * 2 + [params] + [SamplingParams(max_tokens=5)])
    assert batch[2].outputs[0].token_ids == alone
    different_seed = llm.generate(PROMPT, SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=20,
                                                         ignore_eos=True))[0].outputs[0].token_ids
    assert different_seed != alone


def test_n_gives_independent_completions(llm):
    out = llm.generate(PROMPT, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=12, ignore_eos=True))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1


def test_logprobs_include_sampled_and_top_tokens(llm):
    out = greedy_text(llm, max_tokens=5, logprobs=3)
    assert len(out.logprobs) == 5
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and entry[token].rank == 1  # greedy picks the top token
        assert len(entry) == 3 and all(lp.logprob <= 0 for lp in entry.values())
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)))


def test_priority_runs_urgent_requests_first(llama_dir):
    llm = LLM(llama_dir, max_num_seqs=1, scheduling_policy="priority")
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    engine.add_request("late-normal", "one", params, priority=0)
    engine.add_request("urgent", "two", params, priority=-1)
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["urgent", "late-normal"]


def test_an_urgent_request_takes_the_place_of_a_running_one_in_a_full_batch(llama_dir):
    """vLLM's priority preemption: with every place of the batch taken, a waiting request of strictly
    higher priority preempts the lowest-priority running one (recompute), which then finishes with the
    same greedy tokens it would have produced alone. Equal priorities never preempt."""
    llm = LLM(llama_dir, max_num_seqs=2, scheduling_policy="priority")
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = {p: llm.generate(p, params)[0].outputs[0].token_ids for p in ("one", "two", "three", "four")}
    engine.add_request("a", "one", params, priority=0)
    engine.add_request("b", "two", params, priority=0)
    for _ in range(3):
        engine.step()
    engine.add_request("same", "four", params, priority=0)
    engine.step()
    assert engine.scheduler.num_preemptions == 0, "an equal priority waits for a place"
    engine.add_request("urgent", "three", params, priority=-1)
    outputs = {}
    first_step = engine.step()
    assert engine.scheduler.num_preemptions == 1
    assert "urgent" in {s.request_id for s in engine.scheduler.running}
    for out in first_step:
        outputs[out.request_id] = out
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    assert {r: outputs[r].outputs[0].token_ids for r in ("a", "b", "urgent", "same")} == {
        "a": alone["one"], "b": alone["two"], "urgent": alone["three"], "same": alone["four"]}


def test_priority_is_refused_under_first_come_first_served(llama_dir):
    """vLLM's rule: a request priority means nothing under --scheduling-policy fcfs (the default), so it
    is an error, not a silently ignored field."""
    engine = LLM(llama_dir, max_num_seqs=1).engine
    with pytest.raises(ValueError, match="^priority: .*--scheduling-policy priority"):
        engine.add_request("urgent", "two", SamplingParams(max_tokens=2), priority=-1)
    engine.add_request("a", "one", SamplingParams(max_tokens=2, ignore_eos=True))
    engine.add_request("b", "two", SamplingParams(max_tokens=2, ignore_eos=True))
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["a", "b"]


def test_abort_frees_blocks_at_any_time(llama_dir):
    llm = LLM(llama_dir, block_size=4, enable_prefix_caching=False)
    engine = llm.engine
    total = engine.block_manager.num_free_blocks
    engine.add_request("a", PROMPT, SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", PROMPT + " more", SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    engine.step()
    assert engine.num_running == 2 and engine.block_manager.num_free_blocks < total
    assert engine.abort("a") and engine.abort("b")
    assert engine.num_running == 0 and engine.block_manager.num_free_blocks == total
    assert not engine.has_unfinished_requests() and not engine.abort("a")


def test_invalid_prompts_are_rejected_before_any_work(llm):
    engine = llm.engine
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", SamplingParams())
    with pytest.raises(ValueError, match="token ids"):
        llm.generate({"prompt_token_ids": [1, 10**9]})
    with pytest.raises(ValueError, match="max_model_len|context"):
        llm.generate({"prompt_token_ids": [1] * engine.max_model_len})
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate({"prompt_token_ids": [1, 2]}, SamplingParams(max_tokens=engine.max_model_len))
    assert not engine.has_unfinished_requests()


def test_chat_applies_the_template(llm):
    out = llm.chat([{"role": "user", "content": "Hello"}], SamplingParams(temperature=0, max_tokens=4))[0]
    expected = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "Hello"}],
                                                       add_generation_prompt=True, tokenize=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert out.prompt_token_ids == expected


class _SlowTokenizer:
    """The same tokenizer seen without its Rust core: the detokenizer's windowed path."""

    def __init__(self, tokenizer) -> None:
        self.decode = tokenizer.decode


@pytest.mark.parametrize("path", ["DecodeStream", "window"])
def test_incremental_detokenizer_never_splits_characters(llm, path):
    tokenizer = llm.get_tokenizer()
    text = "naïve café — 日本語のテキスト 🙂👍🏽 ĳ ok"
    ids = tokenizer.encode(text, add_special_tokens=False)
    # The byte-level vocabulary must split some character across tokens, or this test proves nothing.
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)
    detok = IncrementalDetokenizer(tokenizer if path == "DecodeStream" else _SlowTokenizer(tokenizer),
                                   prompt_token_ids=tokenizer.encode("Say:"))
    assert (detok._stream is not None) == (path == "DecodeStream")
    deltas = [detok.add_token(t) for t in ids]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == text


@pytest.mark.parametrize("path", ["DecodeStream", "window"])
def test_a_sequence_cut_inside_a_character_ends_with_what_decode_shows(llm, path):
    """A length stop can land between the bytes of one character: the held-back bytes still come out at
    the end, as the full decode shows them (U+FFFD), not dropped."""
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode("ok 🙂👍🏽", add_special_tokens=False)
    cut = next(i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith("\ufffd"))
    detok = IncrementalDetokenizer(tokenizer if path == "DecodeStream" else _SlowTokenizer(tokenizer), [])
    streamed = "".join(detok.add_token(t) for t in ids[:cut])
    assert "\ufffd" not in streamed
    assert streamed + detok.flush() == detok.text == tokenizer.decode(ids[:cut])
