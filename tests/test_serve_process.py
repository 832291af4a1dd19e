"""`kubeinfer serve` as a process: it starts, serves, and drains on SIGTERM, exiting 0."""
import json
import os
import signal
import subprocess
import sys
import time

import httpx
from server_harness import free_port


def test_sigterm_drains_in_flight_work_then_exits_zero(llama_dir):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen([sys.executable, "-m", "kubeinfer.cli", "serve", llama_dir, "--host", "127.0.0.1",
                                "--port", str(port), "--served-model-name", "tiny", "--drain-timeout", "30"],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if httpx.get(url + "/health").status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        else:
            raise AssertionError("server never became healthy")

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
            events = [first] + [line for line in lines if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        finish = [json.loads(e[6:])["choices"][0]["finish_reason"] for e in events[:-1]]
        assert finish[-1] == "length"  # the in-flight request ran to completion
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
