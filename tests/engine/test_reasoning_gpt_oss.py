"""`--reasoning-parser gpt_oss`: gpt-oss's harmony channels, the analysis channel to message.reasoning and the
final channel to content, streamed too (the deltas add up to the whole split), and the reply read with its
special tokens (harmony's headers are special tokens of gpt-oss's tokenizer)."""
from __future__ import annotations

import re
import shutil

import openai
import pytest
from server_harness import RunningServer
from test_reasoning import ASK, steered, streamed

from kubeinfer.engine.entrypoints.openai.reasoning_parsers import REASONING_PARSERS, ReasoningStream

HARMONY = ("<|channel|>analysis<|message|>Two plus three is five.<|end|>"
           "<|start|>assistant<|channel|>final<|message|>5<|return|>")
# gpt-oss's template in miniature: system and user turns as harmony messages, then the assistant's start.
HARMONY_TEMPLATE = ("<|start|>system<|message|>Reasoning: {{ reasoning_effort | default('medium') }}<|end|>"
                    "{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
                    "{% if add_generation_prompt %}<|start|>assistant{% endif %}")
SPECIALS = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>"]


@pytest.mark.parametrize("text, expected", [
    (HARMONY, ("Two plus three is five.", "5")),
    ("<|channel|>analysis<|message|>still thinking", ("still thinking", "")),
    ("<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>commentary<|message|>Let me check.<|end|>"
     "<|start|>assistant<|channel|>final<|message|>b<|return|>", ("a", "Let me check.b")),
    ("<|channel|>commentary to=functions.add <|constrain|>json<|message|>{\"a\": 1}<|call|>", ("", "")),
    ("no harmony at all<|return|>", ("", "no harmony at all")),
    ("<|channel|>analysis<|message|>x < y <| not a tag<|end|><|start|>assistant<|channel|>final<|message|>ok",
     ("x < y <| not a tag", "ok")),
])
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_streamed_splits_add_up_to_the_whole_one(text, expected, step):
    parser = REASONING_PARSERS["gpt_oss"]
    assert parser.split(text, finished=True) == expected
    stream, reasoning, content = ReasoningStream(parser), "", ""
    for end in [*range(step, len(text), step), len(text)]:
        new, content_so_far = stream.update(text[:end], finished=end == len(text))
        assert content_so_far.startswith(content), (text[:end], content_so_far, content)
        reasoning, content = reasoning + new, content_so_far
    assert (reasoning, content) == expected


@pytest.fixture(scope="module")
def harmony_server(llama_dir, tmp_path_factory):
    """The tiny model with a harmony template; its headers are plain text here (the regex that steers the reply
    writes them byte by byte), the tokenizer test below has them as special tokens."""
    from transformers import AutoTokenizer

    model = tmp_path_factory.mktemp("harmony") / "model"
    shutil.copytree(llama_dir, model)
    tokenizer = AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = HARMONY_TEMPLATE
    tokenizer.save_pretrained(model)
    with RunningServer(str(model), name="tiny", block_size=8, reasoning_parser="gpt_oss") as running:
        running.model_dir = model
        yield running


@pytest.fixture(scope="module")
def client(harmony_server):
    return openai.OpenAI(base_url=harmony_server.url + "/v1", api_key="x", max_retries=0, timeout=60)


def test_analysis_goes_to_reasoning_and_final_to_content(client):
    whole = steered(client, HARMONY.removesuffix("<|return|>"), stream=False).choices[0]
    assert whole.message.model_extra["reasoning"] == "Two plus three is five."
    assert whole.message.content == "5"
    parts = streamed(steered(client, HARMONY.removesuffix("<|return|>"), stream=True))
    assert parts["reasoning"] == "Two plus three is five." and parts["content"] == "5"


def test_the_template_renders_harmony_and_headers_survive_decoding(harmony_server, tmp_path):
    """The prompt is the tokenizer's own template; with harmony's headers as special tokens (gpt-oss's), the
    reply must be decoded with them kept: the default drops them."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(harmony_server.model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS})
    prompt = tokenizer.apply_chat_template(ASK, add_generation_prompt=True, tokenize=False)
    assert prompt.endswith("<|start|>assistant") and "<|start|>user<|message|>What is 2 + 3?<|end|>" in prompt
    ids = tokenizer.encode(HARMONY, add_special_tokens=False)
    assert tokenizer.convert_tokens_to_ids("<|channel|>") in ids  # the headers are single special tokens
    assert "<|channel|>" not in tokenizer.decode(ids, skip_special_tokens=True)
    assert REASONING_PARSERS["gpt_oss"].split(tokenizer.decode(ids, skip_special_tokens=False), True) == (
        "Two plus three is five.", "5")
    assert re.search("Reasoning: high", tokenizer.apply_chat_template(
        ASK, add_generation_prompt=True, tokenize=False, reasoning_effort="high"))


def test_the_gpt_oss_parser_keeps_special_tokens_in_the_reply():
    from kubeinfer.engine.entrypoints.openai.protocol import ChatCompletionRequest
    from kubeinfer.engine.entrypoints.openai.serving_chat import tool_plan
    from kubeinfer.engine.sampling_params import SamplingParams

    body = ChatCompletionRequest.model_validate({"model": "m", "messages": ASK})
    for name, kept in (("gpt_oss", True), ("qwen3", False)):
        state = type("State", (), {"reasoning_parser": REASONING_PARSERS[name], "tool_call_parser": None})()
        params = SamplingParams()
        tool_plan(state, body, params)
        assert params.skip_special_tokens is not kept
