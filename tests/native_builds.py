"""The native CPU library under both of its builds, for the tests that check they give the same bits: the AVX-512
(VNNI) build and its portable C twin (KUBEINFER_CPU_NATIVE_PORTABLE=1)."""
from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from kubeinfer.engine.platforms.cpu.native import ops

T = TypeVar("T")


def outputs_of_both_builds(monkeypatch, compute: Callable[[], T], check_vnni: bool = True) -> tuple[T, T]:
    """compute() with the AVX-512 build loaded, then with the portable twin: (its result, the twin's). `check_vnni`:
    assert each build is the one asked for (ops.has_vnni). The loaded library is dropped after, so the next call
    loads the one the environment asks for."""
    outs = {}
    for portable in ("0", "1"):
        monkeypatch.setenv("KUBEINFER_CPU_NATIVE_PORTABLE", portable)
        ops._state.clear()  # the next call loads the library this env asks for
        if check_vnni:
            assert ops.has_vnni() == (portable == "0")
        outs[portable] = compute()
    ops._state.clear()
    return outs["0"], outs["1"]
