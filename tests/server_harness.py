"""Runs a real engine server (uvicorn on a loopback port) inside the test process."""
from __future__ import annotations

import re
import socket
import threading
import time

import httpx
import uvicorn

from kubeinfer.engine.entrypoints.openai.api_server import ServerState, build_app
from kubeinfer.engine.core.async_engine import AsyncEngine
from kubeinfer.engine.config import EngineConfig
from kubeinfer.engine.core.llm_engine import LLMEngine
from kubeinfer.common.http_server import server_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningServer:
    def __init__(self, model_dir: str, name: str = "tiny", api_key: str | None = None,
                 max_waiting_requests: int | None = 64, lora_modules=(), lora_dirs=(), tool_call_parser=None,
                 reasoning_parser=None, port: int | None = None, guard=None, header_read_timeout: float = 10.0,
                 max_prompt_chars=None, tokenizer_pool_size: int = 4, **engine_kwargs) -> None:
        engine = LLMEngine(EngineConfig(model=model_dir, **engine_kwargs))
        for lora in lora_modules:  # LoRARequests, registered before serving as --lora-modules does
            engine.add_lora(lora)
        self.async_engine = AsyncEngine(engine, max_waiting_requests=max_waiting_requests)
        self.state = ServerState(self.async_engine, name, str(model_dir), api_key=api_key, lora_dirs=list(lora_dirs),
                                 tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser,
                                 max_prompt_chars=max_prompt_chars, tokenizer_pool_size=tokenizer_pool_size)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(server_config(build_app(self.state, guard), header_read_timeout,
                                                   host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "RunningServer":
        self.async_engine.start()
        self.thread.start()
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                if httpx.get(self.url + "/health").status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise RuntimeError("server did not become healthy")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.async_engine.shutdown()

    @property
    def engine(self) -> LLMEngine:
        return self.state.engine

    def metric(self, name: str, labels: str = "") -> float:
        """One sample from /metrics, e.g. metric('vllm:num_requests_running')."""
        text = httpx.get(self.url + "/metrics").text
        for line in text.splitlines():
            match = re.match(r"^([^{\s]+)(\{[^}]*\})?\s+(\S+)$", line)
            if match and match.group(1) == name and labels in (match.group(2) or ""):
                return float(match.group(3))
        raise KeyError(name)

    def wait_for(self, condition, timeout: float = 10.0) -> bool:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if condition():
                return True
            time.sleep(0.05)
        return condition()
