"""What the HTTP and gRPC servers of one engine pod share: the engine, the served names, the API key,
the adapter ids handed out while serving, and the drain flag."""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from ...core.async_engine import AsyncEngine
from ..metrics import EngineMetrics
from ..request_limits import max_prompt_chars
from .reasoning_parsers import REASONING_PARSERS, ReasoningParser
from .tool_parsers import parser_for_template

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class ServerState:
    async_engine: AsyncEngine
    served_model_name: str
    model_path: str
    api_key: str | None = None
    lora_dirs: list[str] = field(default_factory=list)  # where /v1/load_lora_adapter may read adapters
    draining: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    metrics: EngineMetrics | None = None
    # tool_choice "auto": --tool-call-parser, else the format the model's chat template writes (None: none)
    tool_call_parser: str | None = None
    reasoning_parser: str | ReasoningParser | None = None  # --reasoning-parser NAME
    max_prompt_chars: int | None = None  # --max-prompt-chars; None: request_limits derives it from the context
    # A few threads for tokenizers and chat templates, off the event loop: a long prompt holds one of them,
    # not every request behind it. They share the tokenizer: encoding only reads it (nothing here changes
    # its truncation or padding, the one thing a fast tokenizer cannot do while another thread encodes).
    tokenizer_pool_size: int = 4

    def __post_init__(self) -> None:
        self.tokenizer_pool = concurrent.futures.ThreadPoolExecutor(max(1, self.tokenizer_pool_size),
                                                                    thread_name_prefix="tokenizer")
        self.metrics = self.metrics or EngineMetrics(self.async_engine, self.served_model_name)
        lora = self.engine.lora
        taken = [*lora.registered, *lora.retiring] if lora else []
        self._lora_ids = itertools.count(max(taken, default=0) + 1)
        if self.tool_call_parser is None:
            self.tool_call_parser = parser_for_template(getattr(self.engine.tokenizer, "chat_template", None))
            logger.info("tool calls: %s", f"the {self.tool_call_parser} format, read from the chat template"
                        if self.tool_call_parser else "this chat template writes none; tool_choice \"auto\" is refused")
        if isinstance(self.reasoning_parser, str):
            self.reasoning_parser = REASONING_PARSERS[self.reasoning_parser]

    def authorized(self, authorization: str) -> bool:
        """Whether an `Authorization` value (HTTP header or gRPC metadata) carries the API key, if one is set."""
        return not self.api_key or secrets.compare_digest(authorization.encode(), f"Bearer {self.api_key}".encode())

    def lora_id_of(self, model: str) -> int | None:
        """The adapter id a `model` name runs (0: the base model); None when this server does not serve it."""
        if model == self.served_model_name:
            return 0
        adapter = self.engine.lora.find(model) if self.engine.lora else None
        return adapter.lora_int_id if adapter else None

    def new_lora_id(self) -> int:
        """A fresh lora_int_id for an adapter loaded while serving (route or placement)."""
        return next(self._lora_ids)

    @property
    def engine(self):
        return self.async_engine.engine

    async def off_loop(self, fn: Callable[[], T]) -> T:
        """Run `fn` (tokenization, a chat template) on a tokenizer thread and await its result."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, fn)

    @property
    def prompt_char_limit(self) -> int:
        return max_prompt_chars(self.engine.max_model_len, self.max_prompt_chars)
