"""Structured output when the tokenizer and the model disagree on the vocabulary: special tokens added
beyond the trained vocabulary, a model whose logits are wider than the tokenizer (padded vocab_size, as
most checkpoints have) or narrower (tokens added to the tokenizer, the embedding never resized).

The reference is llguidance's own matcher (`validate_tokens`, `consume_token`): the mask may allow only
tokens the matcher accepts, and columns the grammar has no bit for are never allowed (what
`llguidance.torch.apply_token_bitmask_inplace` documents: logits past the mask get -inf)."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from kubeinfer.engine import LLM, SamplingParams
from kubeinfer.engine.model_executor.sampler import GrammarMasks, process_logits
from kubeinfer.engine.sampling_params import StructuredOutputsParams
from kubeinfer.dev.testing.random_model import build_random_model

ADDED_SPECIALS = ["<tool_call>", "</tool_call>", "<|extra|>"]  # ids 512, 513, 514 after the trained 512
PROMPT = "Answer:"


def _model(root, vocab_size: int) -> str:
    """A llama whose tokenizer (512 trained tokens) gained three special tokens after the model was built."""
    path = build_random_model(root, "llama", vocab_size=vocab_size, seed=7)
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.add_tokens(ADDED_SPECIALS, special_tokens=True)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def wide(tmp_path_factory) -> LLM:
    """Logits of 576 columns, tokenizer of 515: ids 515..575 are padding no text maps to."""
    return LLM(_model(tmp_path_factory.mktemp("wide"), 576), block_size=4)


@pytest.fixture(scope="module")
def narrow(tmp_path_factory) -> LLM:
    """Logits of 512 columns, tokenizer of 515: the added specials have no logit at all."""
    return LLM(_model(tmp_path_factory.mktemp("narrow"), 512), block_size=4)


def constrained(bias: dict[int, float] | None = None, **spec) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=40, logit_bias=bias, structured_outputs=StructuredOutputsParams(**spec))


def test_the_fixture_has_the_shapes_it_claims(wide, narrow):
    assert len(wide.engine.tokenizer) == len(narrow.engine.tokenizer) == 515
    assert wide.engine.tokenizer.convert_tokens_to_ids("<tool_call>") == 512
    assert (wide.engine.spec.vocab_size, narrow.engine.spec.vocab_size) == (576, 512)


@pytest.mark.parametrize("spec,text", [
    ({"choice": ["<tool_call>"]}, "<tool_call>"),
    ({"regex": r"a<tool_call>b"}, "a<tool_call>b"),
    ({"json": {"const": "</tool_call>"}}, '"</tool_call>"'),
])
def test_a_special_token_spelling_the_forced_text_is_never_sampled(wide, spec, text):
    """The grammar forces the text "<tool_call>"; llguidance's mask allowed the special token 512 that reads
    the same (its forced-bytes shortcut tokenizes the text), and then its own matcher refused it: the request
    died with "token 512 breaks the grammar". A +100 bias makes the model want the specials above all."""
    output = wide.generate([PROMPT], constrained({512: 100, 513: 100, 514: 100}, **spec))[0]
    completion = output.outputs[0]
    assert output.error is None, output.error
    assert completion.finish_reason == "stop" and not {512, 513, 514} & set(completion.token_ids)
    assert completion.text == text


def test_padding_ids_past_the_tokenizer_are_never_allowed(wide):
    """Ids 515..575 have logits but no text: a grammar never allows them, however much the model wants them."""
    bias = {t: 100 for t in range(515, 576)}
    output = wide.generate([PROMPT], constrained(bias, json_object=True))[0]
    assert output.error is None, output.error
    assert max(output.outputs[0].token_ids) < 515
    assert isinstance(json.loads(output.outputs[0].text), dict)


def test_a_tokenizer_longer_than_the_logits_still_gets_structured_output(narrow):
    """llguidance refused n_vocab=512 for a 515-token tokenizer ("vocab size too small"), so every
    constrained request on such a model was refused; the ids past the logits simply cannot be sampled."""
    output = narrow.generate([PROMPT], constrained(regex=r"[a-z]{3}-<tool_call>"))[0]
    assert output.error is None, output.error
    assert output.outputs[0].finish_reason == "stop"
    assert output.outputs[0].text.endswith("-<tool_call>") and max(output.outputs[0].token_ids) < 512


def test_a_text_prompt_with_an_id_past_the_logits_is_refused(narrow):
    """"<tool_call>" tokenizes to 512, which has no embedding row in a 512-token model."""
    with pytest.raises(ValueError, match="outside the model's vocabulary of 512"):
        narrow.engine.add_request("past", "x <tool_call> y", SamplingParams(max_tokens=2))
    assert not narrow.engine.has_unfinished_requests()


@pytest.mark.parametrize("mask_columns", [16, 64])
def test_a_mask_narrower_or_wider_than_the_logits(mask_columns):
    """Bits for 512 or 2048 tokens over 1024 logits columns: a column past the mask is banned, bits past the
    logits are ignored (before: a shape error that failed the whole batch)."""
    logits = torch.zeros(2, 1024)
    bitmask = torch.full((1, mask_columns), -1, dtype=torch.int32)  # every token the mask covers is allowed
    processed = process_logits(logits, [_free_seq(), _free_seq()], GrammarMasks([1], bitmask))
    covered = min(1024, 32 * mask_columns)
    assert torch.isfinite(processed[1, :covered]).all() and torch.isinf(processed[1, covered:]).all()
    assert torch.isfinite(processed[0]).all()  # the row without a grammar is untouched


def _free_seq():
    from kubeinfer.engine.sequence import Sequence

    return Sequence("r", [1, 2], SamplingParams(max_tokens=4), torch.Generator())


def test_a_grammar_that_fails_ends_its_request_alone(wide):
    """A matcher that raises while its mask is computed ends that request with the error; the request beside
    it in the same step finishes normally."""
    engine = wide.engine
    engine.add_request("bad", PROMPT, constrained(json_object=True))
    engine.add_request("good", PROMPT, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    bad_seq = engine.requests["bad"].completions[0].seq

    def broken(bitmask, row):
        raise RuntimeError("matcher exploded")  # any failure inside the grammar library
    bad_seq.grammar.fill_bitmask = broken
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert "matcher exploded" in (finished["bad"].error or "")
    assert finished["good"].error is None and len(finished["good"].outputs[0].token_ids) == 6


@pytest.mark.parametrize("engine_args", [{"async_scheduling": True},
                                         {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3,
                                                                 "prompt_lookup_max": 2, "prompt_lookup_min": 1}}],
                         ids=["async_scheduling", "ngram"])
def test_the_special_token_fix_holds_beside_async_and_speculating_requests(wide, engine_args):
    """The same forced text with a free request in the batch: async scheduling falls back to synchronous
    steps for the grammar, and with drafts the masks reach the verification of the batch (rejection_sampler)."""
    llm = LLM(wide.engine.config.model, block_size=4, **engine_args)
    masked_verifications = []
    if "speculative_config" in engine_args:
        verify = llm.engine.runner.verify_drafts
        llm.engine.runner.verify_drafts = lambda logits, seqs, masks: (
            masked_verifications.append(masks is not None), verify(logits, seqs, masks))[1]
    # The free request writes 6 again and again (its bias), which the n-gram speculator finds in its prompt.
    outputs = llm.generate([PROMPT, {"prompt_token_ids": [5, 6, 7, 8] * 3}],
                           [constrained({512: 100}, choice=["<tool_call>"]),
                            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias={6: 100})])
    assert outputs[0].error is None and outputs[0].outputs[0].text == "<tool_call>", outputs[0].error
    assert outputs[1].error is None and len(outputs[1].outputs[0].token_ids) == 12
    if "speculative_config" in engine_args:
        assert llm.engine.speculator.num_drafts > 0 and any(masked_verifications)
