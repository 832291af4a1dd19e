"""Runs the engine loop on its own thread and streams results to asyncio front ends.

The engine is single-threaded by design: only the loop thread touches the scheduler. Front ends
(HTTP, gRPC) validate and tokenize on their own thread (`LLMEngine.prepare_request`), then hand the
request over through a command queue; outputs come back through each request's asyncio queue. The
loop never waits on a client, so a slow or vanished client cannot stall a batch.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Callable, TypeVar

from ..sampling_params import SamplingParams
from .llm_engine import LLMEngine, Request
from .outputs import RequestOutput

logger = logging.getLogger(__name__)
T = TypeVar("T")


def _settle(future: asyncio.Future, result, error: Exception | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class QueueFullError(RuntimeError):
    """The bounded waiting queue is full; the client should retry later."""


class EngineDeadError(RuntimeError):
    """The engine loop failed; the request cannot complete."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting_requests: int | None = None) -> None:
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._lock = threading.Lock()  # guards _streams and request preparation (the engine's seed RNG)
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        # Called on the engine thread: with each step's outputs, and with the id of each aborted request.
        self.output_observers: list[Callable[[list[RequestOutput]], None]] = []
        self.abort_observers: list[Callable[[str], None]] = []

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="engine-loop", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._commands.put(("wake", None))
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    @property
    def num_running(self) -> int:
        return self.engine.num_running

    @property
    def num_waiting(self) -> int:
        """Requests accepted but not running yet, including those still in the command queue."""
        running_requests = {s.request_id for s in self.engine.scheduler.running}
        return max(0, len(self._streams) - len(running_requests))

    # -- requests -----------------------------------------------------------------------------
    def new_request_id(self, prefix: str = "req") -> str:
        return f"{prefix}-{next(self._ids)}"

    def prepare(self, request_id: str, prompt, params: SamplingParams, priority: int = 0, lora_id: int = 0) -> Request:
        """Validate before any model work: raises ValueError (bad input) or QueueFullError."""
        if self.max_waiting_requests is not None and self.num_waiting >= self.max_waiting_requests:
            raise QueueFullError(f"the waiting queue is full ({self.max_waiting_requests} requests); retry later")
        with self._lock:
            return self.engine.prepare_request(request_id, prompt, params, priority=priority, lora_id=lora_id)

    async def stream(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Submit a prepared request and yield its cumulative outputs until it finishes. Leaving the
        iteration early (client gone, task cancelled) aborts the request and frees its KV blocks."""
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._lock:
            if request.request_id in self._streams:
                raise ValueError(f"request id {request.request_id!r} is already in use")
            self._streams[request.request_id] = stream
        self._commands.put(("add", request))
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request.request_id)

    async def generate(self, prompt, params: SamplingParams, request_id: str | None = None,
                       priority: int = 0, lora_id: int = 0) -> AsyncIterator[RequestOutput]:
        request = self.prepare(request_id or self.new_request_id(), prompt, params, priority, lora_id)
        async for output in self.stream(request):
            yield output

    async def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine thread, between steps, and return its result (or raise its error):
        how front ends change engine state that only the loop may touch, such as the adapter registry."""
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._commands.put(("call", (fn, future)))
        return await future

    def abort(self, request_id: str) -> None:
        with self._lock:
            stream = self._streams.pop(request_id, None)
        self._commands.put(("abort", request_id))
        if stream is not None:  # wake a consumer that is still waiting for output
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, EngineDeadError("request aborted"))

    def abort_all(self) -> None:
        for request_id in list(self._streams):
            self.abort(request_id)

    # -- the loop (engine thread) ---------------------------------------------------------------
    def _apply(self, command: tuple) -> None:
        kind, payload = command
        if kind == "add":
            if payload.request_id in self._streams:  # not aborted while queued
                self.engine.submit(payload)
        elif kind == "abort" and self.engine.abort(payload):
            for observer in self.abort_observers:
                observer(payload)
        elif kind == "call":
            fn, future = payload
            try:
                result, error = fn(), None
            except Exception as exc:  # the caller's error, not the engine's: hand it back
                result, error = None, exc
            future.get_loop().call_soon_threadsafe(_settle, future, result, error)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                if not self.engine.has_unfinished_requests():
                    self._apply(self._commands.get())  # idle: sleep until there is work
                while True:
                    try:
                        self._apply(self._commands.get_nowait())
                    except queue.Empty:
                        break
                outputs = self.engine.step()
            except Exception as error:  # keep serving: fail what was in flight, not the process
                logger.exception("engine step failed; aborting in-flight requests")
                self._fail_all(EngineDeadError(f"engine step failed: {error}"))
                continue
            self._deliver(outputs)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            with self._lock:
                stream = self._streams.get(output.request_id)
                if output.finished:
                    self._streams.pop(output.request_id, None)
            if stream is not None:
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, output)
        for observer in self.output_observers:
            try:
                observer(outputs)
            except Exception:
                logger.exception("output observer failed")

    def _fail_all(self, error: Exception) -> None:
        with self._lock:
            streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            self.engine.abort(request_id)
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, error)
