"""Structured output: a random-init model, which on its own never writes valid JSON, returns 100%
schema-valid documents over a varied schema set (validated with `jsonschema`, a reference no one here
wrote), inside continuous batching with free requests, n > 1 and preemption; and the API takes
OpenAI's `response_format` (the `openai` client's `parse()` included) and vLLM's fields."""
from __future__ import annotations

import json
import re

import httpx
import jsonschema
import openai
import pydantic
import pytest

from kubeinfer.engine import LLM, SamplingParams
from kubeinfer.engine.sampling_params import StructuredOutputsParams
from kubeinfer.dev.testing.json_schemas import SCHEMAS

PROMPT = "Answer in JSON:"


@pytest.fixture(scope="module")
def llm(model_dirs):
    return LLM(model_dirs["qwen2"], block_size=4)


def constrained(seed: int, max_tokens: int = 300, n: int = 1, **spec) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, n=n, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(**spec))


def test_every_schema_of_the_set_gives_valid_documents_in_one_mixed_batch(llm):
    names = list(SCHEMAS)
    free = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    alone = llm.generate([PROMPT], free)[0].outputs[0].token_ids
    params = [constrained(i, json=SCHEMAS[name], n=2) for i, name in enumerate(names)] + [free]
    outputs = llm.generate([PROMPT] * len(names) + [PROMPT], params)
    for name, output in zip(names, outputs):
        for completion in output.outputs:
            assert completion.finish_reason == "stop", (name, completion.text)
            jsonschema.validate(json.loads(completion.text), SCHEMAS[name])
    assert outputs[-1].outputs[0].token_ids == alone  # the free request in the batch is untouched


def test_without_the_constraint_the_model_writes_no_json(llm):
    text = llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=0, max_tokens=40))[0].outputs[0].text
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_documents_stay_valid_through_preemption(model_dirs):
    """Few KV blocks: sequences are preempted and recomputed; their matchers keep what they consumed."""
    small = LLM(model_dirs["qwen2"], block_size=4, num_kv_blocks=40, max_num_seqs=8)
    schema = SCHEMAS["nested"]
    outputs = small.generate([PROMPT] * 8, [constrained(i, json=schema, max_tokens=100) for i in range(8)])
    assert small.engine.scheduler.num_preemptions > 0
    for output in outputs:
        jsonschema.validate(json.loads(output.outputs[0].text), schema)


@pytest.mark.parametrize("spec,check", [
    (dict(regex=r"[A-Z]{2}-[0-9]{3}"), lambda t: re.fullmatch(r"[A-Z]{2}-[0-9]{3}", t)),
    (dict(choice=("alpha", "beta", "gamma")), lambda t: t in ("alpha", "beta", "gamma")),
    (dict(grammar='start: "yes" | "no"'), lambda t: t in ("yes", "no")),
    (dict(grammar='root ::= "on" | "off"'), lambda t: t in ("on", "off")),  # GBNF, as llama.cpp writes it
    (dict(json_object=True), lambda t: isinstance(json.loads(t), dict)),
])
def test_regex_choice_grammar_and_any_json_object(llm, spec, check):
    for output in llm.generate([PROMPT] * 3, [constrained(i, max_tokens=120, **spec) for i in range(3)]):
        assert check(output.outputs[0].text), output.outputs[0].text


def test_a_bad_grammar_is_refused_before_any_work(llm):
    with pytest.raises(ValueError, match="^guided_regex: "):
        llm.engine.add_request("bad", PROMPT, constrained(0, regex="a(", field="guided_regex"))
    assert not llm.engine.has_unfinished_requests()


class Point(pydantic.BaseModel):
    label: str = pydantic.Field(max_length=8)
    x: int = pydantic.Field(ge=0, le=99)
    tags: list[str] = pydantic.Field(max_length=2)


def test_the_openai_client_parses_into_a_pydantic_model(client):
    completion = client.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": "a point"}],
                                               response_format=Point, max_tokens=300, temperature=1.0, seed=3)
    parsed = completion.choices[0].message.parsed
    assert isinstance(parsed, Point) and 0 <= parsed.x <= 99


def test_json_schema_response_format_on_completions_and_streaming(server, client):
    schema = SCHEMAS["enum"]
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 100, "seed": 1,
            "response_format": {"type": "json_schema", "json_schema": {"name": "e", "schema": schema}}}
    text = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    jsonschema.validate(json.loads(text), schema)
    chunks = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}], stream=True,
                                            max_tokens=100, seed=2, extra_body={"guided_json": schema})
    jsonschema.validate(json.loads("".join(c.choices[0].delta.content or "" for c in chunks if c.choices)), schema)


@pytest.mark.parametrize("extra,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"guided_regex": "a("}, "guided_regex"),
    ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a+"}, "guided_regex"),
])
def test_invalid_constraints_are_a_400_naming_the_field(server, extra, param):
    response = httpx.post(server.url + "/v1/completions",
                          json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2, **extra})
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
