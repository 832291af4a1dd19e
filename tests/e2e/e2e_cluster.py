"""The end-to-end suite's view of a cluster: kubectl and helm against $KUBECONFIG, waits with deadlines, the
gateway reached the README's way (`kubectl port-forward service/kubeinfer-gateway`), and the transcript of timed
steps that `make e2e` prints (step, seconds, result).

Settings (environment; `make e2e` passes them through):
  KUBECONFIG             the cluster (required; the k8s-node kit's env.sh sets it)
  E2E_CONTAINER_ENGINE   `make images` CONTAINER_ENGINE (default: the kit's $K8S_NODE_ENGINE, which also loads the
                         images into its node); E2E_LOAD_IMAGES: a command run after the build with the image names
                         as arguments (e.g. `kind load docker-image`), for engines that do not load them
  E2E_REGISTRY, E2E_TAG  image names (default localhost/kubeinfer, e2e); E2E_SKIP_BUILD=1: use what is loaded
  E2E_NODE_DIR           a directory this machine writes and the node mounts at the same path (hostPath volumes for
                         the models; default $K8S_NODE_DIR/e2e-data: the kit's node is this machine)
  E2E_KEEP=1             leave the release installed after the suite (for inspection)
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
RELEASE = NAMESPACE = "kubeinfer"


class E2EError(AssertionError):
    """A step of the suite did not reach its state in time; the message says what was seen last."""


@dataclass
class Transcript:
    """The suite's steps in order: (step, seconds, result)."""

    rows: list[tuple[str, float, str]] = field(default_factory=list)

    @contextmanager
    def step(self, name: str) -> Iterator[None]:
        start = time.monotonic()
        try:
            yield
        except BaseException as exc:
            self.rows.append((name, time.monotonic() - start, f"FAILED: {str(exc).splitlines()[0][:120]}"))
            raise
        self.rows.append((name, time.monotonic() - start, "ok"))

    def add(self, name: str, seconds: float, result: str) -> None:
        self.rows.append((name, seconds, result))

    def render(self) -> str:
        width = max([len(r[0]) for r in self.rows] + [4])
        lines = [f"{'step':<{width}}  {'seconds':>8}  result"]
        lines += [f"{name:<{width}}  {seconds:>8.1f}  {result}" for name, seconds, result in self.rows]
        return "\n".join(lines)


TRANSCRIPT = Transcript()


def tool(name: str) -> str | None:
    if name == "helm":
        local = ROOT / ".cache" / "bin" / "helm"
        if local.exists():
            return str(local)
    return shutil.which(name)


def run(args: list[str], timeout: float = 120, check: bool = True, input: str | None = None,
        env: dict | None = None) -> subprocess.CompletedProcess:
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, input=input,
                          env={**os.environ, **(env or {})})
    if check and done.returncode != 0:
        raise E2EError(f"{' '.join(args)} failed ({done.returncode}): {(done.stderr or done.stdout).strip()[-800:]}")
    return done


def kubectl(*args: str, timeout: float = 120, check: bool = True, input: str | None = None,
            namespace: str | None = NAMESPACE) -> subprocess.CompletedProcess:
    ns = ["-n", namespace] if namespace else []
    return run([tool("kubectl") or "kubectl", *ns, *args], timeout=timeout, check=check, input=input)


def helm(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return run([tool("helm") or "helm", *args], timeout=timeout)


def apply(*objects: dict, namespace: str | None = NAMESPACE) -> None:
    kubectl("apply", "-f", "-", input=yaml.safe_dump_all(objects), namespace=namespace)


def get(kind: str, name: str = "", namespace: str | None = NAMESPACE, selector: str = "") -> dict:
    args = ["get", kind, *([name] if name else []), *(["-l", selector] if selector else []), "-o", "json"]
    return json.loads(kubectl(*args, namespace=namespace).stdout)


def wait_until(what: str, probe: Callable[[], object], timeout: float, every: float = 1.0,
               seen: Callable[[], str] | None = None) -> object:
    """probe()'s first truthy answer within `timeout` seconds; else E2EError naming `what` and the last state."""
    deadline = time.monotonic() + timeout
    last: object = None
    while True:
        try:
            last = probe()
        except (E2EError, subprocess.TimeoutExpired, OSError, ValueError, KeyError) as exc:
            last = f"{type(exc).__name__}: {exc}"
        else:
            if last:
                return last
        if time.monotonic() > deadline:
            state = seen() if seen else last
            raise E2EError(f"{what}: not within {timeout:.0f} s; last seen: {str(state)[:1500]}")
        time.sleep(every)


def condition(model: dict, kind: str) -> dict:
    return next((c for c in model.get("status", {}).get("conditions", []) if c["type"] == kind), {})


def model_state(name: str) -> str:
    """A model's conditions and pods, one line each: what a failed wait shows."""
    try:
        im = get("inferencemodel", name)
        lines = [f"{c['type']}={c['status']} {c.get('reason')}: {c.get('message', '')[:200]}"
                 for c in im.get("status", {}).get("conditions", [])]
    except E2EError as exc:
        lines = [str(exc)]
    pods = kubectl("get", "pods", "-o", "wide", check=False).stdout
    return "\n".join(lines) + "\n" + pods


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PortForward:
    """`kubectl port-forward service/NAME PORT:TARGET`, as the README reaches the gateway; restarted on demand (a
    port-forward follows one pod and ends with it)."""

    def __init__(self, target: str, remote_port: int):
        self.target, self.remote_port = target, remote_port
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    def start(self) -> str:
        self.stop()
        self.proc = subprocess.Popen([tool("kubectl") or "kubectl", "-n", NAMESPACE, "port-forward", self.target,
                                      f"{self.port}:{self.remote_port}"], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)

        def listening() -> bool:
            with socket.socket() as s:
                s.settimeout(1)
                return s.connect_ex(("127.0.0.1", self.port)) == 0

        wait_until(f"port-forward to {self.target}", listening, 30, every=0.3)
        return self.url

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self.proc = None
