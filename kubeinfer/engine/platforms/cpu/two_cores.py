"""A small step's torch work on both cores without a second OpenMP pool: kept-int products (2M+ weights) in
two halves of their output rows, and the decode attention of 4+ sequences in two halves of the batch. The
stepping thread computes the first half while a helper thread (one per stepping thread, torch on one thread
in it, asleep on a lock between halves) computes the second; whoever is free first takes a half nobody
started, so where the helper is not scheduled (a loaded machine) the stepping thread does both and the step
is no slower than on one thread. Torch's own two threads (KUBEINFER_CPU_OPENBLAS=0) wait at a barrier for a
descheduled worker: steps ran 20-30x slower in rounds where other jobs held a core (cpu_blas.py).

The halves give the same bits as the whole (tests/engine/test_two_cores.py): torch's int8 and int4 weight-only
kernels compute each output column from its own weight row (cut at a multiple of 64 rows, the int4 packing's
block), and the CPU SDPA computes each (sequence, head) alone over the same keys on one thread.

Measured (2-core VM, W8A16 222M Llama of bench_quantized_decode, same process, interleaved): the products
alone 1.29x (batch 1) and 1.63x (16) faster than one thread at load ~2 (W4A16 1.10x, 1.47x). The whole engine
gained nothing (0.91-1.02x, quiet machine, benchmarks/RESULTS.md cpu-decode-step) while OpenBLAS's worker,
woken by lm_head, spins for its default 2**28 cycles (~0.1 s: the whole next step) on the core the helper
needs; with OPENBLAS_THREAD_TIMEOUT=4 (OpenBLAS reads it at load) W8A16 steps were 1.05-1.16x faster at batch
1 and 1.38x at 16 (load ~1.7). Hence `KUBEINFER_CPU_SHARE_CORES` auto (default): on where that timeout is at
most 10, else off; 1 or 0 forces it. The short timeout did not slow float32 decode (every projection wakes
OpenBLAS's worker; 3 pairs of processes alternated, load ~1.7: 18.6-23.5 against 21.0-22.2 ms a step at batch 1,
70.2-78.5 against 76.4-78.3 at 16), but OpenBLAS reads it when numpy loads, before the engine could set it:
the `kubeinfer` command sets it before importing numpy (kubeinfer/cli.py), as does the CPU image
(docker/engine-cpu.Dockerfile); a program that imports the engine itself sets it before numpy.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable

import torch

from kubeinfer.engine.kernel_config import setting as kernel_setting

MIN_SPLIT_WEIGHTS = 1 << 21
BLOCK = 64  # rows: the int4 CPU packing's block along the output


def _enabled() -> bool:
    """kernels.cpu_share_cores (KUBEINFER_CPU_SHARE_CORES): 1 on, 0 off, auto (default) on where OpenBLAS's idle
    workers sleep within 2**10 cycles (OPENBLAS_THREAD_TIMEOUT <= 10, read by OpenBLAS at load): with its default (2**28 cycles, ~0.1 s)
    the worker lm_head woke spins on the core the helper needs, through the whole next step."""
    setting = kernel_setting("cpu_share_cores")
    if setting != "auto":
        return setting == "1"
    timeout = os.environ.get("OPENBLAS_THREAD_TIMEOUT", "")
    return timeout.isdigit() and int(timeout) <= 10


ENABLED = _enabled()  # the process's answer (at import), which an engine's "auto" takes

_local = threading.local()  # .sharing: this thread is in a small step that shares products; .pair: its helper


class _Half:
    __slots__ = ("run", "taken", "result", "error", "done", "inference")

    def __init__(self, run: Callable[[], torch.Tensor]) -> None:
        self.run, self.taken, self.result, self.error = run, False, None, None
        self.inference = torch.is_inference_mode_enabled()  # the helper runs it in the caller's mode
        self.done = threading.Lock()  # held until the helper has finished it (bare locks: the cheapest hand-off)
        self.done.acquire()


class _Helper:
    """One thread that computes the second half of a product when it gets to it before the caller does."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()  # guards _half and each half's `taken`
        self._wake = threading.Lock()  # released to wake the helper (a spare wake finds nothing to do)
        self._wake.acquire()
        self._half: _Half | None = None
        threading.Thread(target=self._serve, name="kubeinfer-two-cores", daemon=True).start()

    def _serve(self) -> None:
        torch.set_num_threads(1)  # its own OpenMP setting: one thread, no pool of its own
        while True:
            self._wake.acquire()
            with self._mutex:
                half, self._half = self._half, None
                if half is None or half.taken:
                    continue
                half.taken = True
            try:
                with torch.inference_mode() if half.inference else torch.no_grad():
                    half.result = half.run()
            except BaseException as error:  # handed to the caller, which raises it
                half.error = error
            half.done.release()

    def both(self, first: Callable[[], torch.Tensor], second: Callable[[], torch.Tensor]):
        half = _Half(second)
        with self._mutex:
            self._half = half
            if self._wake.locked():
                self._wake.release()
        try:
            a = first()
        finally:  # the second half is withdrawn unless the helper has started it
            with self._mutex:
                mine = not half.taken
                half.taken = True
                if self._half is half:
                    self._half = None
        if mine:
            return a, second()
        half.done.acquire()
        if half.error is not None:
            raise half.error
        return a, half.result


def sharing(on: bool) -> None:
    """Switch sharing on or off for the calling thread's products (cpu_blas.small_step calls it, in a step of an
    engine whose kernels.cpu_share_cores is 1, or auto and the process's answer is on)."""
    setting = kernel_setting("cpu_share_cores")
    _local.sharing = on and (ENABLED if setting == "auto" else setting == "1")


def active() -> bool:
    """Whether the calling thread is in a small step that shares its work between the cores."""
    return getattr(_local, "sharing", False)


def both(first: Callable[[], object], second: Callable[[], object]) -> tuple:
    """(first(), second()): first here, second on the helper unless this thread gets to it first. Outside a
    sharing step, both here."""
    if not active():
        return first(), second()
    if not hasattr(_local, "pair"):
        _local.pair = _Helper()
    return _local.pair.both(first, second)


def cut(rows: int, cols: int) -> int | None:
    """Where to cut a [rows, cols] weight: a multiple of BLOCK near the middle; None when it is not cut."""
    if not active() or rows * cols < MIN_SPLIT_WEIGHTS:
        return None
    at = rows // 2 // BLOCK * BLOCK
    return at if at and (rows - at) % BLOCK == 0 else None


def product(kernel: Callable[..., torch.Tensor], tokens: int, parts: tuple, cache: dict,
            dtype: torch.dtype) -> torch.Tensor:
    """kernel(*parts) [tokens, rows] in `dtype`, or its two halves on both cores when the calling thread shares
    (see `sharing`), each written into its columns of one output (no concatenation after). `parts`: tensors
    cut along the output rows (dim 0; an int4 packing's scales_and_zeros [groups, rows, 2] along dim 1);
    `cache` keeps their cut halves (the method's own dict: one copy of each small scale tensor)."""
    rows, cols = parts[0].shape[0], parts[0].shape[1]
    at = cut(rows, cols)
    if at is None:
        return kernel(*parts).to(dtype)
    key = (at, *(t.data_ptr() for t in parts))
    if cache.get("key") != key:  # the loader or a .to() may have replaced the tensors
        cache["key"], cache["halves"] = key, _halves(parts, at)
    first, second = cache["halves"]
    out = torch.empty((tokens, rows), dtype=dtype, device=parts[0].device)
    both(lambda: out[:, :at].copy_(kernel(*first)), lambda: out[:, at:].copy_(kernel(*second)))
    return out


def _halves(parts: tuple, at: int) -> tuple[tuple, tuple]:
    def halve(t: torch.Tensor):
        dim = 1 if t.dim() == 3 else 0  # scales_and_zeros: [groups, rows, 2]
        return t.narrow(dim, 0, at).contiguous(), t.narrow(dim, at, t.shape[dim] - at).contiguous()
    pairs = [halve(t) for t in parts]
    return tuple(p[0] for p in pairs), tuple(p[1] for p in pairs)
