"""Issue #34's findings replayed against real `kubeinfer serve` and `kubeinfer gateway` processes on
loopback (engine key set through KUBEINFER_API_KEY / KUBEINFER_ENGINE_API_KEY, a tenant limited to 2,000
tokens a minute): status, time and the server's RSS for 300 MB bodies, a 15 MB prompt, 5,000 stop strings,
2M allowed token ids, a 400-digit x-request-timeout-ms, n x prompts against the token limit, and 50
half-sent request heads. Prints one line per finding; writes nothing.

    python benchmarks/bench_security_limits.py
"""
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))
from security_helpers import (  # noqa: E402
    announce_huge_body,
    closed_or_answered,
    half_sent_head,
    send_chunked_until_refused,
    status_of,
)

PY = sys.executable
WORK = Path(tempfile.mkdtemp())
def free():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p

def rss(pid):
    return int(open(f"/proc/{pid}/status").read().split("VmRSS:")[1].split()[0]) // 1024

def wait(url):
    for _ in range(600):
        try:
            if httpx.get(url + "/health").status_code == 200: return
        except Exception: pass
        time.sleep(0.1)
    raise SystemExit("not healthy " + url)

from kubeinfer.dev.testing.random_model import build_random_model  # noqa: E402

model = str(build_random_model(WORK / "model"))
ep, gp = free(), free()
env = {**os.environ, "HF_HUB_OFFLINE": "1", "KUBEINFER_API_KEY": "ek", "KUBEINFER_ENGINE_API_KEY": "ek"}
(WORK / "tenants.yaml").open("w").write("tenants:\n  - name: a\n    apiKeys: [ka]\n    tokensPerMinute: 2000\n")
engine = subprocess.Popen([PY, "-m", "kubeinfer.cli", "serve", model, "--port", str(ep), "--served-model-name", "tiny",
                           "--log-level", "warning"], env=env)
gw = subprocess.Popen([PY, "-m", "kubeinfer.cli", "gateway", "--port", str(gp), "--ext-proc-port", "0", "--metrics-port", "0",
                       "--endpoints", f"http://127.0.0.1:{ep}", "--tenants", str(WORK / "tenants.yaml"), "--log-level", "warning"], env=env)
try:
    wait(f"http://127.0.0.1:{ep}"); wait(f"http://127.0.0.1:{gp}")
    E, G = f"http://127.0.0.1:{ep}", f"http://127.0.0.1:{gp}"
    print("engine direct, no key:", httpx.post(E + "/v1/completions", json={"model": "tiny", "prompt": "hi"}).status_code,
          "| /load no key:", httpx.get(E + "/load").status_code, "| /health:", httpx.get(E + "/health").status_code)
    r = httpx.post(G + "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, headers={"authorization": "Bearer ka"})
    print("through gateway with tenant key:", r.status_code, "| gateway /v1/models roots:",
          [c["root"] for c in httpx.get(G + "/v1/models", headers={"authorization": "Bearer ka"}).json()["data"]])
    for name, url, port in (("gateway", G, gp), ("engine", E, ep)):
        pid = (gw if name == "gateway" else engine).pid
        before = rss(pid)
        t = time.perf_counter(); a = announce_huge_body(port, 300 << 20); t1 = time.perf_counter() - t
        peak = [0]; stop = threading.Event()
        def sample():
            while not stop.is_set():
                peak[0] = max(peak[0], rss(pid)); time.sleep(0.01)
        health = []
        def probe():
            while not stop.is_set():
                s = time.perf_counter(); httpx.get(url + "/health"); health.append(time.perf_counter() - s); time.sleep(0.05)
        threads = [threading.Thread(target=sample), threading.Thread(target=probe)]
        [th.start() for th in threads]
        t = time.perf_counter(); b = send_chunked_until_refused(port, 300 << 20, chunk=1 << 20); t2 = time.perf_counter() - t
        stop.set(); [th.join() for th in threads]
        print(f"{name}: 300 MB by Content-Length -> {status_of(a)} in {t1*1000:.1f} ms; 300 MB chunked (unauthenticated) -> "
              f"{status_of(b)} in {t2:.2f} s, RSS {before} -> peak {peak[0]} MiB; /health max {max(health)*1000:.1f} ms over {len(health)} probes")
    big = json.dumps({"model": "tiny", "prompt": "word " * 3_000_000}).encode()  # 15 MB, under the 16 MiB limit
    health = []; stop = threading.Event()
    def probe2():
        while not stop.is_set():
            s = time.perf_counter(); httpx.get(E + "/health"); health.append(time.perf_counter() - s); time.sleep(0.02)
    th = threading.Thread(target=probe2); th.start()
    t = time.perf_counter()
    r = httpx.post(E + "/v1/completions", content=big, headers={"authorization": "Bearer ek", "content-type": "application/json"}, timeout=60)
    t3 = time.perf_counter() - t; stop.set(); th.join()
    print(f"engine: 15 MB prompt -> {r.status_code} ({r.json()['error']['param']}) in {t3*1000:.0f} ms; /health max {max(health)*1000:.1f} ms over {len(health)} probes")
    auth = {"authorization": "Bearer ek"}
    for field, value in (("stop", ["s%d" % i for i in range(5000)]), ("allowed_token_ids", [1] * 2_000_000)):
        t = time.perf_counter(); r = httpx.post(E + "/v1/completions", json={"model": "tiny", "prompt": "hi", field: value}, headers=auth, timeout=60)
        print(f"engine: {field} x{len(value)} -> {r.status_code} param={r.json()['error']['param']} in {(time.perf_counter()-t)*1000:.0f} ms")
    r = httpx.post(E + "/v1/completions", json={"model": "tiny", "prompt": "hi"}, headers={**auth, "x-request-timeout-ms": "9" * 400})
    print("engine: 400-digit x-request-timeout-ms ->", r.status_code, r.json()["error"]["param"])
    # tenant: n x prompts
    r = httpx.post(G + "/v1/completions", json={"model": "tiny", "prompt": ["a", "b", "c"], "n": 8, "max_tokens": 100},
                   headers={"authorization": "Bearer ka"}, timeout=60)
    r2 = httpx.post(G + "/v1/completions", json={"model": "tiny", "prompt": "a", "max_tokens": 100}, headers={"authorization": "Bearer ka"})
    print("tenant 2000 tok/min: 3 prompts x n=8 x 100 ->", r.status_code, "usage", r.json().get("usage", {}).get("total_tokens"),
          "| next request ->", r2.status_code)
    socks = [half_sent_head(ep) for _ in range(50)]
    t = time.perf_counter()
    res = [closed_or_answered(s, 30.0) for s in socks]
    print(f"engine: 50 half-sent heads, all closed: {all(x is not None for x in res)} after {time.perf_counter()-t:.1f} s (--header-read-timeout 10)")
finally:
    gw.terminate(); engine.terminate(); gw.wait(10); engine.wait(30)
