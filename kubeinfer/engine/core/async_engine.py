"""Runs the engine loop on its own thread and streams results to asyncio front ends.

The engine is single-threaded by design: only the loop thread touches the scheduler. Front ends
(HTTP, gRPC) validate and tokenize off the event loop (`prepare`), `admit` a body's requests all at
once (or none, when their sequences would overflow the waiting queue), and read each request's
outputs from its `OutputSlot`. The loop never waits on a client: a slot keeps only the latest
cumulative output, so a slow reader costs no memory and no engine time.

Health is a promise that the engine can serve. A step that fails ends the requests of its batch with
the error and the loop goes on; `max_consecutive_failures` failed steps in a row, or one error that
leaves the device unusable (a CUDA error), kill the engine: every request in flight fails, `healthy`
turns False, and `on_death` callbacks run (the server exits non-zero so that Kubernetes restarts it).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Iterable
from typing import Callable, TypeVar

from ..sampling_params import SamplingParams
from .adapter_reader import AdapterReader
from .errors import EngineDeadError, QueueFullError, RequestFailedError, StepFailedError, is_unrecoverable
from .llm_engine import LLMEngine, Request
from .output_slot import OutputSlot
from .outputs import RequestOutput

logger = logging.getLogger(__name__)
T = TypeVar("T")
MAX_CONSECUTIVE_FAILURES = 3


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting_requests: int | None = None,
                 max_consecutive_failures: int = MAX_CONSECUTIVE_FAILURES) -> None:
        self.engine = engine
        self.max_waiting_requests = max_waiting_requests  # bound on waiting sequences (prompts x n)
        self.max_consecutive_failures = max_consecutive_failures
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._slots: dict[str, OutputSlot] = {}
        self._sequences: dict[str, int] = {}  # admitted request -> its sequence count (n)
        self._lock = threading.RLock()  # guards _slots and _sequences (admit checks capacity under it)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._consecutive_failures = 0
        self._ids = itertools.count()
        self.death: str | None = None  # why the engine died; None while it can serve
        self.on_death: list[Callable[[str], None]] = []  # called once, on the engine thread
        # Called on the engine thread: with each step's outputs, and with the id of each aborted request.
        self.output_observers: list[Callable[[list[RequestOutput]], None]] = []
        self.abort_observers: list[Callable[[str], None]] = []
        engine.deliver_early = self._deliver  # deferred outputs reach their slots while the next step runs
        self._adapter_reader: AdapterReader | None = None
        if engine.lora is not None:
            self._adapter_reader = AdapterReader(engine.lora, post=lambda result: self._commands.put(("adapter", result)))
            engine.scheduler.on_adapter_missing = self._adapter_reader.start

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
        if self._adapter_reader is not None:
            self._adapter_reader.shutdown()
        if self.engine.kv_events is not None:  # after the loop: its last step's events go out
            self.engine.kv_events.shutdown()

    def fail(self, reason: str) -> None:
        """Kill the engine from another thread (a tensor-parallel rank died): the loop dies on its next command."""
        self._commands.put(("die", reason))

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def healthy(self) -> bool:
        """The loop runs and the engine has not died: a request sent now can be served."""
        return self.is_running and self.death is None

    @property
    def num_unfinished(self) -> int:
        return len(self._slots)

    @property
    def num_running(self) -> int:
        """Requests with a sequence in the running batch."""
        return len({s.request_id for s in list(self.engine.scheduler.running)})

    @property
    def num_waiting(self) -> int:
        """Requests admitted but not running yet, including those still on their way to the loop."""
        return max(0, self.num_unfinished - self.num_running)

    def num_waiting_sequences(self) -> int:
        with self._lock:
            admitted = sum(self._sequences.values())
        return max(0, admitted - len(self.engine.scheduler.running))

    # -- requests -----------------------------------------------------------------------------
    def check_capacity(self, num_sequences: int) -> None:
        """QueueFullError when `num_sequences` more would overflow the waiting queue; EngineDeadError when
        the engine cannot serve. Cheap: front ends call it before tokenizing, and `admit` again after."""
        if self.death is not None:
            raise EngineDeadError(f"the engine is dead ({self.death}); this replica is restarting")
        limit = self.max_waiting_requests
        if limit is not None and self.num_waiting_sequences() + num_sequences > limit:
            raise QueueFullError(f"the waiting queue is full ({limit} sequences; this request adds {num_sequences}); "
                                 "retry later")

    def prepare(self, request_id: str, prompt, params: SamplingParams, priority: int = 0, lora_id: int = 0) -> Request:
        """Tokenize and validate before any model work (ValueError on bad input). Thread-safe: servers
        call it off the event loop."""
        return self.engine.prepare_request(request_id, prompt, params, priority=priority, lora_id=lora_id)

    def admit(self, requests: Iterable[Request]) -> list[OutputSlot]:
        """Hand prepared requests to the loop, all or none (QueueFullError, EngineDeadError); their output
        slots, in order. Call it on the event loop that will read them."""
        requests = list(requests)
        loop = asyncio.get_running_loop()
        with self._lock:
            self.check_capacity(sum(r.params.n for r in requests))
            taken = [r.request_id for r in requests if r.request_id in self._slots]
            if taken or len({r.request_id for r in requests}) < len(requests):
                raise ValueError(f"request id {(taken or [requests[0].request_id])[0]!r} is already in use")
            slots = [OutputSlot(loop) for _ in requests]
            for request, slot in zip(requests, slots):
                self._slots[request.request_id] = slot
                self._sequences[request.request_id] = request.params.n
        for request in requests:
            self._commands.put(("add", request))
        return slots

    async def stream(self, request: Request, slot: OutputSlot | None = None) -> AsyncIterator[RequestOutput]:
        """Yield a request's cumulative outputs until it finishes, from the slot `admit` gave (admitting it
        here when none is given). Leaving the iteration early (client gone, task cancelled) aborts it and
        frees its KV blocks. Outputs a slow consumer did not take in time are merged into the latest one."""
        slot = slot or self.admit([request])[0]
        finished = False
        try:
            while True:
                output = await slot.get()
                yield output
                if output.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort(request.request_id)

    async def generate(self, prompt, params: SamplingParams, request_id: str | None = None,
                       priority: int = 0, lora_id: int = 0) -> AsyncIterator[RequestOutput]:
        request = await asyncio.to_thread(self.prepare, request_id or f"req-{next(self._ids)}", prompt, params,
                                          priority, lora_id)
        async for output in self.stream(request):
            yield output

    async def call(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine thread, between steps, and return its result (or raise its error):
        how front ends change engine state that only the loop may touch, such as the adapter registry."""
        if self.death is not None:
            raise EngineDeadError(f"the engine is dead ({self.death})")
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        self._commands.put(("call", (fn, future)))
        return await future

    def abort(self, request_id: str) -> None:
        slot = self._forget(request_id)
        self._commands.put(("abort", request_id))
        if slot is not None:  # wake a consumer that is still waiting for output
            slot.fail(EngineDeadError("request aborted"))

    def abort_all(self) -> None:
        for request_id in list(self._slots):
            self.abort(request_id)

    def _forget(self, request_id: str) -> OutputSlot | None:
        with self._lock:
            self._sequences.pop(request_id, None)
            return self._slots.pop(request_id, None)

    # -- the loop (engine thread) ---------------------------------------------------------------
    def _apply(self, command: tuple) -> None:
        kind, payload = command
        if kind == "add":
            if payload.request_id in self._slots:  # not aborted while queued
                self.engine.submit(payload)
        elif kind == "abort" and self.engine.abort(payload):
            for observer in self.abort_observers:
                observer(payload)
        elif kind == "die" and self.death is None:
            self._die(payload)
        elif kind == "adapter":
            lora_id = payload[0]
            error = self._adapter_reader.finish(*payload)
            if error is not None:
                failed = self.engine.scheduler.fail_adapter(lora_id, f"adapter {lora_id} could not be read: {error}")
                self._deliver(self.engine.fail_requests({s.request_id for s in failed}, {}))
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
                if not self.engine.has_unfinished_requests():
                    continue  # an abort emptied it: an empty step would prove nothing about health
                outputs = self.engine.step()
            except StepFailedError as failure:
                logger.error("engine step failed: %s", failure, exc_info=failure.cause)
                if not self._step_failed(failure.cause):  # a fatal failure fails its batch with the death
                    self._deliver(failure.outputs)
                continue
            except Exception as error:  # outside any one request's work: nothing in flight can be trusted
                logger.exception("engine loop failed; failing every request in flight")
                if not self._step_failed(error):
                    self._fail_all(EngineDeadError(f"engine step failed: {error}"))
                continue
            self._consecutive_failures = 0
            self._deliver(outputs)
            self.engine.step_timer.mark("deliver")  # charged to the step just run (off: one attribute test)

    def _step_failed(self, error: BaseException) -> bool:
        """Count a failed step; True when it killed the engine."""
        self._consecutive_failures += 1
        if is_unrecoverable(error):
            self._die(f"unrecoverable device error: {type(error).__name__}: {error}")
        elif self._consecutive_failures >= self.max_consecutive_failures:
            self._die(f"{self._consecutive_failures} engine steps failed in a row; last: {type(error).__name__}: {error}")
        return self.death is not None

    def _die(self, reason: str) -> None:
        logger.critical("the engine is dead: %s", reason)
        self.death = reason
        self._stop.set()
        self._fail_all(EngineDeadError(f"the engine is dead ({reason})"))
        for callback in self.on_death:
            try:
                callback(reason)
            except Exception:
                logger.exception("on_death callback failed")

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            with self._lock:
                slot = self._slots.get(output.request_id)
            if output.finished:
                self._forget(output.request_id)
            if slot is not None:
                slot.put(output if output.error is None else RequestFailedError(output.error))
        for observer in self.output_observers:
            try:
                observer(outputs)
            except Exception:
                logger.exception("output observer failed")

    def _fail_all(self, error: Exception) -> None:
        with self._lock:
            slots, self._slots, self._sequences = self._slots, {}, {}
        for request_id, slot in slots.items():
            try:
                self.engine.abort(request_id)
            except Exception:  # noqa: BLE001 - the engine may be broken; the client must still hear
                logger.exception("aborting %s failed", request_id)
            slot.fail(error)


def _settle(future: asyncio.Future, result, error: Exception | None) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
