"""The OpenAI-compatible server, driven by the official `openai` client against a real uvicorn server."""
import threading
import time

import httpx
import openai
import pytest
from server_harness import RunningServer

from kubeinfer.engine import LLM, SamplingParams

PROMPT = "The licensee may copy and distribute"
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def offline(llama_dir):
    return LLM(llama_dir, block_size=8)


def offline_text(offline, prompt, max_tokens):
    out = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0]
    return out.outputs[0].text, len(out.prompt_token_ids)


def test_completion_matches_offline_engine_with_exact_usage(client, offline):
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0, extra_body=NO_EOS)
    text, prompt_tokens = offline_text(offline, PROMPT, 12)
    assert response.choices[0].text == text and response.choices[0].finish_reason == "length"
    assert response.usage.prompt_tokens == prompt_tokens
    assert response.usage.completion_tokens == 12 and response.usage.total_tokens == prompt_tokens + 12


def test_streamed_completion_equals_unstreamed(client):
    full = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, extra_body=NO_EOS)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body=NO_EOS))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 16 and chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_batch_prompts_and_n(client):
    response = client.completions.create(model="tiny", prompt=[PROMPT, "Copyright"], n=2, max_tokens=5,
                                         temperature=1.0, seed=3, extra_body=NO_EOS)
    assert sorted(c.index for c in response.choices) == [0, 1, 2, 3]
    assert response.usage.completion_tokens == 20


def test_chat_streamed_and_not(client, llama_dir):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0, extra_body=NO_EOS)
    stream = list(client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=10,
                                                 temperature=0, stream=True, stream_options={"include_usage": True},
                                                 extra_body=NO_EOS))
    assert full.choices[0].message.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == full.choices[0].message.content
    from transformers import AutoTokenizer
    template_ids = AutoTokenizer.from_pretrained(llama_dir).apply_chat_template(messages, add_generation_prompt=True,
                                                                                tokenize=True)
    template_ids = template_ids["input_ids"] if hasattr(template_ids, "keys") else template_ids
    assert full.usage.prompt_tokens == len(template_ids) == stream[-1].usage.prompt_tokens
    assert full.usage.completion_tokens == 10


def test_logprobs_shapes(client):
    completion = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2,
                                           extra_body=NO_EOS)
    lp = completion.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(v <= 0 for v in lp.token_logprobs)
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2, extra_body=NO_EOS)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob == pytest.approx(c.logprob) for c in content)  # greedy: top-1 is chosen


def test_stop_and_sampling_extras(client):
    full = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, extra_body=NO_EOS)
    text = full.choices[0].text
    stop = text[6:9]
    cut = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, stop=[stop],
                                    extra_body=NO_EOS)
    assert cut.choices[0].text == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"
    extras = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0.7, seed=1,
                                       extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.2, "min_tokens": 5,
                                                   "stop_token_ids": [2]})
    again = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0.7, seed=1,
                                      extra_body={"top_k": 5, "min_p": 0.05, "repetition_penalty": 1.2, "min_tokens": 5,
                                                  "stop_token_ids": [2]})
    assert extras.choices[0].text == again.choices[0].text and extras.usage.completion_tokens == 5


def test_concurrent_requests_each_get_their_own_answer(client, offline):
    prompts = [f"{PROMPT} {i}" for i in range(8)]
    results: dict[int, str] = {}

    def call(i: int) -> None:
        results[i] = client.completions.create(model="tiny", prompt=prompts[i], max_tokens=8, temperature=0,
                                               extra_body=NO_EOS).choices[0].text

    threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [results[i] for i in range(8)] == [offline_text(offline, p, 8)[0] for p in prompts]


def test_client_disconnect_aborts_and_frees_kv_blocks(server, client, monkeypatch):
    # Slow steps keep the 400 tokens from finishing (as "length") before the disconnect reaches the engine:
    # the tiny model can generate them in under a second, less than a loaded CI machine may take to get there.
    step = server.engine.step
    monkeypatch.setattr(server.engine, "step", lambda: (time.sleep(0.03), step())[1])
    aborted_before = server.metric("vllm:request_success_total", 'finished_reason="abort"')
    stream = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=400, temperature=0, stream=True,
                                       extra_body=NO_EOS)
    next(iter(stream))
    assert server.wait_for(lambda: server.metric("vllm:num_requests_running") == 1)
    assert server.metric("vllm:kv_cache_usage_perc") > 0
    stream.close()
    assert server.wait_for(lambda: server.metric("vllm:num_requests_running") == 0)
    assert server.metric("vllm:kv_cache_usage_perc") == 0
    assert server.engine.block_manager.num_free_blocks == server.engine.num_kv_blocks
    # Counted by the abort observer on the engine thread, which may run just after the blocks are freed.
    assert server.wait_for(lambda: server.metric("vllm:request_success_total", 'finished_reason="abort"')
                           == aborted_before + 1)


def test_metrics_count_what_the_server_did(server, client):
    before = {name: server.metric(name) for name in ("vllm:generation_tokens_total", "vllm:prompt_tokens_total",
                                                     "vllm:request_generation_tokens_count")}
    length_before = server.metric("vllm:request_success_total", 'finished_reason="length"')
    responses = [client.completions.create(model="tiny", prompt=f"{PROMPT} {i}", max_tokens=3 + i, temperature=0,
                                           extra_body=NO_EOS) for i in range(3)]
    assert server.metric("vllm:generation_tokens_total") - before["vllm:generation_tokens_total"] == 3 + 4 + 5
    assert server.metric("vllm:prompt_tokens_total") - before["vllm:prompt_tokens_total"] == \
        sum(r.usage.prompt_tokens for r in responses)
    assert server.metric("vllm:request_generation_tokens_count") - before["vllm:request_generation_tokens_count"] == 3
    assert server.metric("vllm:request_success_total", 'finished_reason="length"') == length_before + 3
    assert server.metric("vllm:time_to_first_token_seconds_count") >= 3
    assert server.metric("vllm:cache_config_info", 'block_size="8"') == 1
    assert server.metric("vllm:cache_config_info", 'cache_dtype="auto"') == 1


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "x", "temperature": 5}, "temperature"),
    ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": "x", "top_k": -5}, "top_k"),
    ({"prompt": ""}, None),
    ({"prompt": []}, None),
    ({"prompt": "x", "logprobs": 99}, "logprobs"),
    ({"prompt": "x", "stop": 5}, "stop"),
    ({"prompt": "x", "min_tokens": 10, "max_tokens": 2}, "min_tokens"),
    ({"prompt": "x", "max_tokens": 100000}, "max_tokens"),
    ({}, "prompt"),
])
def test_invalid_completion_requests_are_400_naming_the_field(server, body, param):
    response = httpx.post(server.url + "/v1/completions", json={"model": "tiny", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == 400 and error["type"] == "BadRequestError" and error["message"]
    if param:
        assert error["param"] and error["param"].startswith(param), error


def test_context_overflow_message(server):
    response = httpx.post(server.url + "/v1/completions",
                          json={"model": "tiny", "prompt": "x", "max_tokens": server.engine.max_model_len})
    assert response.status_code == 400 and "context" in response.json()["error"]["message"]


def test_malformed_json_and_unknown_model(server, client):
    response = httpx.post(server.url + "/v1/completions", content=b'{"model": "tiny", "prompt": ',
                          headers={"content-type": "application/json"})
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError) as error:
        client.completions.create(model="nope", prompt="x")
    assert error.value.status_code == 404
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[])


def test_models_version_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(server.url + "/version").json()["version"]
    assert httpx.get(server.url + "/health").status_code == 200
    spec = httpx.get(server.url + "/openapi.json").json()
    assert "/v1/completions" in spec["paths"] and "/v1/chat/completions" in spec["paths"]


def test_api_key_required_when_set(llama_dir):
    with RunningServer(llama_dir, name="tiny", api_key="s3cret") as server:
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=server.url + "/v1", api_key="s3cret", max_retries=0)
        assert good.completions.create(model="tiny", prompt="x", max_tokens=2).usage.completion_tokens >= 1
        assert httpx.get(server.url + "/health").status_code == 200  # probes need no key


def test_full_queue_gives_429_with_retry_after(llama_dir):
    with RunningServer(llama_dir, name="tiny", max_waiting_requests=1, max_num_seqs=1) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        running = client.completions.create(model="tiny", prompt="a", max_tokens=400, stream=True, extra_body=NO_EOS)
        next(iter(running))
        waiting = client.completions.create(model="tiny", prompt="b", max_tokens=400, stream=True, extra_body=NO_EOS)
        assert server.wait_for(lambda: server.metric("vllm:num_requests_waiting") == 1)
        response = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "c"})
        assert response.status_code == 429 and response.headers["retry-after"]
        assert response.json()["error"]["type"] == "RateLimitError"
        running.close()
        waiting.close()
        assert server.wait_for(lambda: server.async_engine.num_unfinished == 0)
