"""`kubeinfer serve --tensor-parallel-size 2` as a process: the official openai client gets transformers'
greedy tokens, and when rank 1's process is killed mid-request the request fails, /health turns 503 with
the reason, and the server exits non-zero (so that Kubernetes restarts the pod)."""
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from server_harness import free_port

from kubeinfer.dev.local_stack import wait_healthy


def rank_processes(pid: int) -> list[int]:
    """The serving process's ranks, forked or spawned (not multiprocessing's resource tracker)."""
    children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    return [int(c) for c in children if b"resource_tracker" not in Path(f"/proc/{c}/cmdline").read_bytes()]


@pytest.mark.parametrize("family", ["qwen2"])
def test_served_tokens_then_a_killed_rank_fails_the_server(family, model_dirs, hf_models):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "kubeinfer.cli", "serve", model_dirs[family], "--host",
                               "127.0.0.1", "--port", str(port), "--served-model-name", "tiny",
                               "--tensor-parallel-size", "2", "--distributed-timeout", "20"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert wait_healthy(url, server, time.monotonic() + 90), "server never became healthy"
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        prompt = [11, 12, 13, 14, 15, 16, 17]
        completion = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0,
                                               logprobs=0, extra_body={"ignore_eos": True, "return_token_ids": True})
        from test_engine_correctness import hf_greedy
        expected = hf_greedy(hf_models(family), prompt, 10)
        assert completion.choices[0].token_ids == expected

        [rank1] = rank_processes(server.pid)
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 400, "ignore_eos": True, "temperature": 0}
        with ThreadPoolExecutor(1) as pool:
            in_flight = pool.submit(httpx.post, url + "/v1/completions", json=body, timeout=60)
            deadline = time.monotonic() + 30
            while 'vllm:num_requests_running{model_name="tiny"} 1.0' not in httpx.get(url + "/metrics").text:
                assert time.monotonic() < deadline and not in_flight.done()
                time.sleep(0.02)
            os.kill(rank1, signal.SIGKILL)  # while the request runs on both ranks
            failed = in_flight.result()
        assert failed.status_code == 503 and failed.json()["error"]["type"] == "ServiceUnavailableError"
        try:  # the server may already be gone: it exits as soon as the engine dies
            health = httpx.get(url + "/health")
            assert health.status_code == 503 and "tensor-parallel rank 1 is gone" in health.json()["error"]["message"]
        except httpx.TransportError:
            pass
        assert server.wait(timeout=30) != 0
        log = server.stdout.read().decode()
        assert "the engine is dead: " in log and "tensor-parallel rank 1 is gone (exit code -9)" in log
    finally:
        if server.poll() is None:
            server.kill()


@pytest.mark.slow
def test_a_rank_killed_while_idle_turns_health_503_and_ends_the_server(model_dirs):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "kubeinfer.cli", "serve", model_dirs["qwen2"], "--host",
                               "127.0.0.1", "--port", str(port), "--tensor-parallel-size", "2"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        assert wait_healthy(url, server, time.monotonic() + 90), "server never became healthy"
        [rank1] = rank_processes(server.pid)
        os.kill(rank1, signal.SIGKILL)
        deadline, health = time.monotonic() + 10, None
        while time.monotonic() < deadline:  # the failure watch notices at once; the server exits right after
            try:
                health = httpx.get(url + "/health")
            except httpx.TransportError:
                break
            if health.status_code == 503:
                break
            time.sleep(0.01)
        if health is not None and health.status_code == 503:
            assert "tensor-parallel rank 1 is gone (exit code -9)" in health.json()["error"]["message"]
        assert server.wait(timeout=30) == 1
        assert "tensor-parallel rank 1 is gone (exit code -9)" in server.stdout.read().decode()
    finally:
        if server.poll() is None:
            server.kill()
