"""In a pod the operator reaches the API server at KUBERNETES_SERVICE_HOST:PORT, as the gateway does (no
cluster DNS needed), and its /healthz fails while the API server does not answer (issue #46, defect 13)."""
from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys

import aiohttp
import pytest
import yaml
from operator_harness import Cluster, eventually

from kubeinfer.operator import handlers, in_cluster


@pytest.fixture
def pod_environment(tmp_path, monkeypatch):
    """A service account mounted as the kubelet mounts it, no kubeconfig, no `kubernetes` package."""
    (tmp_path / "token").write_text("sa-token\n")
    (tmp_path / "namespace").write_text("kubeinfer")
    (tmp_path / "ca.crt").write_text("")
    monkeypatch.setattr(in_cluster, "SERVICE_ACCOUNT_DIR", str(tmp_path))
    monkeypatch.setattr(handlers, "SERVICE_ACCOUNT_DIR", str(tmp_path))
    monkeypatch.setitem(sys.modules, "kubernetes", None)
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "absent"))
    return tmp_path


@pytest.mark.parametrize("host,server", [("10.96.0.1", "https://10.96.0.1:443"),
                                         ("fd00:10:96::1", "https://[fd00:10:96::1]:443")])
async def test_in_a_pod_the_operator_logs_in_at_the_service_address(pod_environment, monkeypatch, host, server):
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", host)
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    info = await handlers.connect_default()
    assert info.server == server  # not https://kubernetes.default.svc: no cluster DNS needed
    assert info.as_http_headers()["Authorization"] == "Bearer sa-token"
    assert info.ca_path == str(pod_environment / "ca.crt") and info.default_namespace == "kubeinfer"


async def test_without_the_service_variables_the_dns_name_is_the_fallback(pod_environment, monkeypatch):
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)
    assert (await handlers.connect_default()).server == "https://kubernetes.default.svc"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def healthz(port: int) -> int:
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            async with session.get(f"http://127.0.0.1:{port}/healthz") as response:
                return response.status
    except aiohttp.ClientError:
        return 0


class Outage:
    """A TCP relay in front of the emulated API server that can go dark at once (closing the emulator itself
    waits a minute for kopf's open watches)."""

    def __init__(self, target: str):
        self.host, self.port = target.split("//", 1)[1].rsplit(":", 1)
        self.writers: set[asyncio.StreamWriter] = set()

    async def __aenter__(self) -> Outage:
        self.server = await asyncio.start_server(self._relay, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(self.host, int(self.port))
        self.writers |= {writer, up_writer}

        async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await src.read(65536):
                    dst.write(data)
                    await dst.drain()
            dst.close()
        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))

    async def go_dark(self) -> None:
        self.server.close()
        for writer in self.writers:
            writer.transport.abort()

    async def __aexit__(self, *exc: object) -> None:
        await self.go_dark()


async def test_healthz_fails_while_the_api_server_does_not_answer(tmp_path):
    async with Cluster(operator=False) as cluster, Outage(cluster.url) as relay:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(yaml.safe_dump({
            "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
            "clusters": [{"name": "kmock", "cluster": {"server": relay.url}}],
            "users": [{"name": "nobody", "user": {"token": "unused"}}],
            "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "nobody"}}]}))
        port = free_port()
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kubeinfer.operator.cli", "--health-port", str(port), "--resync-seconds", "1",
            "-q", env={**os.environ, "KUBECONFIG": str(kubeconfig)},
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        try:
            assert await eventually(lambda: healthz(port), timeout=30) == 200
            await relay.go_dark()  # the API server stops answering; the operator keeps running
            # kopf keeps a probe's answer for 10 s: within that and one probe timeout, /healthz says so
            assert await eventually(lambda: _failing(port), timeout=30, interval=0.5)
            assert process.returncode is None
        finally:
            process.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), 20)
            except TimeoutError:
                process.kill()
                await process.wait()


async def _failing(port: int) -> bool:
    return await healthz(port) not in (0, 200)
