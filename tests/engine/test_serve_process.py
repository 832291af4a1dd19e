"""`kubeinfer serve` as a process: it starts, serves HTTP and gRPC, and drains on SIGTERM, exiting 0."""
import json
import os
import signal
import subprocess
import sys
import time

import grpc
import httpx
from grpc_health.v1 import health_pb2, health_pb2_grpc
from server_harness import free_port

from kubeinfer.engine.entrypoints.grpc.proto import engine_pb2, engine_pb2_grpc
from kubeinfer.dev.local_stack import wait_healthy


def test_sigterm_drains_in_flight_work_then_exits_zero(llama_dir):
    port, grpc_port = free_port(), free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen([sys.executable, "-m", "kubeinfer.cli", "serve", llama_dir, "--host", "127.0.0.1",
                                "--port", str(port), "--served-model-name", "tiny", "--drain-timeout", "30",
                                "--grpc-port", str(grpc_port)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        assert wait_healthy(url, process, time.monotonic() + 60), "server never became healthy"
        channel = grpc.insecure_channel(f"127.0.0.1:{grpc_port}")
        health = health_pb2_grpc.HealthStub(channel)
        assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
        reply = list(engine_pb2_grpc.EngineStub(channel).Generate(engine_pb2.GenerateRequest(
            text="Hello", sampling=engine_pb2.SamplingParams(max_tokens=3, ignore_eos=True))))
        assert reply[-1].finish_reason == "length" and reply[-1].usage.completion_tokens == 3

        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 450, "stream": True, "ignore_eos": True,
                "temperature": 0}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            process.send_signal(signal.SIGTERM)
            time.sleep(0.05)
            assert httpx.get(url + "/health").status_code == 503  # leaves the Service while draining
            refused = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "x"})
            assert refused.status_code == 503 and refused.json()["error"]["type"] == "ServiceUnavailableError"
            assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.NOT_SERVING
            events = [first] + [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        finish = [json.loads(e[6:])["choices"][0]["finish_reason"] for e in events[:-1]]
        assert finish[-1] == "length"  # the in-flight request ran to completion
        assert process.wait(timeout=30) == 0
        channel.close()
    finally:
        if process.poll() is None:
            process.kill()
