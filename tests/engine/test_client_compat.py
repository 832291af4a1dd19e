"""Real client libraries nobody here wrote, against a real engine server started without any flag:
LangChain's ChatOpenAI (invoke, stream, a tool round trip with bind_tools, structured output by
function calling and by json_schema, the Responses API) and guidellm's load generator (slow: it
needs its own virtual environment, `make clients-venv`)."""
from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from pydantic import BaseModel
from server_harness import RunningServer

langchain_openai = pytest.importorskip("langchain_openai")
from langchain_core.messages import HumanMessage, ToolMessage  # noqa: E402
from langchain_core.tools import tool  # noqa: E402

GUIDELLM = Path(__file__).resolve().parents[2] / ".venv-clients" / "bin" / "guidellm"


@pytest.fixture(scope="module")
def server(long_context_dir):
    with RunningServer(long_context_dir, name="tiny", block_size=8) as running:
        yield running


def chat_model(server, **kwargs):
    return langchain_openai.ChatOpenAI(base_url=server.url + "/v1", api_key="x", model="tiny", max_retries=0,
                                       timeout=60, **kwargs)


@tool
def add(a: int, b: int) -> int:
    """Add two numbers."""
    return a + b


def steer(written: str) -> dict:
    """A regex constraint that makes the model write `written` (vLLM's guided_regex)."""
    return {"guided_regex": re.escape(written)}


def test_invoke_and_stream_agree(server):
    llm = chat_model(server, temperature=0, max_tokens=8)
    whole = llm.invoke("Hello")
    assert whole.content and whole.usage_metadata["output_tokens"] == 8
    assert "".join(chunk.content for chunk in llm.stream("Hello")) == whole.content


def test_a_tool_round_trip_without_any_server_flag(server):
    """An agent's turn: the model calls a tool (no tool_choice: OpenAI's "auto"), the tool's result goes
    back, and the model answers; the server reads the call format from the model's chat template."""
    call = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 40}}</tool_call>'
    llm = chat_model(server, max_tokens=100, extra_body=steer(call)).bind_tools([add])
    question = HumanMessage("What is 2 + 40?")
    asked = llm.invoke([question])
    assert [(c["name"], c["args"]) for c in asked.tool_calls] == [("add", {"a": 2, "b": 40})]
    result = ToolMessage(str(add.invoke(asked.tool_calls[0]["args"])), tool_call_id=asked.tool_calls[0]["id"])
    answer = chat_model(server, max_tokens=100, extra_body=steer("It is 42.")).bind_tools([add]).invoke(
        [question, asked, result])
    assert answer.content == "It is 42." and not answer.tool_calls
    streamed = list(llm.stream([question]))
    merged = streamed[0]
    for chunk in streamed[1:]:
        merged += chunk
    assert [(c["name"], c["args"]) for c in merged.tool_calls] == [("add", {"a": 2, "b": 40})]


class Sum(BaseModel):
    a: int
    b: int


@pytest.mark.parametrize("method", ["function_calling", "json_schema"])
def test_structured_output(server, method):
    llm = chat_model(server, temperature=0, max_tokens=200).with_structured_output(Sum, method=method)
    assert isinstance(llm.invoke("Two numbers, please"), Sum)


def test_the_responses_api_through_langchain(server):
    llm = chat_model(server, max_tokens=50, use_responses_api=True, extra_body=steer("Hi there."))
    reply = llm.invoke("Hello")
    assert reply.text == "Hi there."
    assert "".join(chunk.text for chunk in llm.stream("Hello")) == "Hi there."


@pytest.mark.slow
@pytest.mark.skipif(not GUIDELLM.exists(), reason="guidellm is not installed: `make clients-venv`")
def test_guidellm_runs_without_errors(server, long_context_dir, tmp_path):
    """guidellm 0.8.1 streams with continuous_usage_stats and sends ignore_eos: every request succeeds."""
    out = tmp_path / "guidellm.json"
    command = [str(GUIDELLM), "run", "--backend", f"kind=openai_http,target={server.url},model=tiny",
               "--profile", "kind=concurrent,streams=4", "--constraint", "kind=max_requests,count=24",
               "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=16",
               "--tokenizer", f"kind=huggingface_auto,model={long_context_dir}", "--output", f"kind=json,path={out}",
               "--disable-console-interactive"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "GUIDELLM__LOGGING__CONSOLE_LOG_LEVEL": "WARNING"}
    # In a folder of its own, not the repository root (whose folders must not shadow the clients' modules).
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    totals = report["benchmarks"][0]["metrics"]["request_totals"]
    assert totals["errored"] == 0 and totals["successful"] >= 24, totals
