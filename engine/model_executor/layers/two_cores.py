"""Kept-int products of small steps on both cores, without a second OpenMP pool: each large product is cut
in two halves of its output rows; the stepping thread computes the first half while a helper thread (one
per stepping thread, torch on one thread in it) computes the second. Whoever is free first takes a half
nobody started, so on a loaded machine, where the helper may not be scheduled, the stepping thread does
both and the step is no slower than on one thread (torch's own two threads, KUBEINFER_CPU_OPENBLAS=0, wait
at a barrier for a descheduled worker: steps ran 30x slower under load 4 on 2 cores).

Why not torch's threads: a small step runs torch on one thread so that OpenBLAS takes the float32
projections (lm_head here) on every core (cpu_blas.py); torch's OpenMP workers spin after each parallel
region and OpenBLAS's after each call, and the two pools on two cores ran 1.35-1.55x slower than one thread
(cpu_blas.py says what else was measured). The helper sleeps on a condition between products, so nothing
spins against OpenBLAS.

The halves give the same bits as the whole: torch's int8 and int4 weight-only kernels compute each output
column from its own row of the weight (tests/test_two_cores.py checks it), so a cut at a multiple of
64 rows (the int4 packing's block) changes nothing. Only products of at least MIN_SPLIT_WEIGHTS weights are
cut: below, the hand-off (~20-40 us) costs more than half the product saves.
`KUBEINFER_CPU_SHARE_CORES=0` turns it off.
"""
from __future__ import annotations

import os
import threading
from collections.abc import Callable

import torch

MIN_SPLIT_WEIGHTS = 1 << 21
BLOCK = 64  # rows: the int4 CPU packing's block along the output
ENABLED = os.environ.get("KUBEINFER_CPU_SHARE_CORES", "1") != "0"

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
    """Switch sharing on or off for the calling thread's products (cpu_blas.small_step calls it)."""
    _local.sharing = on and ENABLED


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
