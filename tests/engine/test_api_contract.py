"""Small promises of the engine's HTTP API: every model is retrievable by id, unknown routes and methods
answer in OpenAI's error shape, a priority is honoured only where a policy gives it a meaning, and a
device that is not there is a one-line error, not a traceback."""
from __future__ import annotations

import httpx
import openai
import pytest
from server_harness import RunningServer

from kubeinfer.engine import LLM


def test_models_are_retrievable_by_id(client):
    model = client.models.retrieve("tiny")
    assert model.id == "tiny" and model.object == "model" and model.created > 0 and model.owned_by == "kubeinfer"
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("nope")
    assert missing.value.body["param"] == "model"


@pytest.mark.parametrize("method,path,status", [("GET", "/v1/nowhere", 404), ("GET", "/v1/completions", 405),
                                                ("DELETE", "/v1/models", 405)])
def test_unknown_routes_and_methods_answer_in_openai_shape(server, method, path, status):
    response = httpx.request(method, server.url + path)
    error = response.json()["error"]
    assert response.status_code == status and error["code"] == status and error["message"]
    assert set(error) == {"message", "type", "param", "code"}


def test_a_priority_under_fcfs_is_refused_naming_it(server):
    response = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "priority": -5})
    assert response.status_code == 400 and response.json()["error"]["param"] == "priority"
    assert "--scheduling-policy priority" in response.json()["error"]["message"]


def test_priority_scheduling_honours_the_field(llama_dir):
    with RunningServer(llama_dir, block_size=8, scheduling_policy="priority") as running:
        response = httpx.post(running.url + "/v1/completions", timeout=60,
                              json={"model": "tiny", "prompt": "x", "priority": -5, "max_tokens": 2})
        assert response.status_code == 200


def test_cuda_without_a_gpu_is_a_one_line_error(llama_dir):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="^device: cuda asked for, but this torch .* sees no CUDA device"):
        LLM(llama_dir, device="cuda")
