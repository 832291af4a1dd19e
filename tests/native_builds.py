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


LEVELS = ("v4", "v3", "portable")  # build.LEVELS, best first


def levels_this_cpu_runs() -> list[str]:
    """The levels whose code this CPU runs (build.py's flags check): an AVX-512 machine runs all three."""
    from kubeinfer.engine.platforms.cpu.native import build
    return [lv for lv in LEVELS if set(build.LEVELS[lv][1]) <= build.cpu_flags()]


def outputs_by_level(monkeypatch, compute: Callable[[], T]) -> dict[str, T]:
    """compute() under each level's library this CPU runs (KUBEINFER_CPU_LEVEL forcing it, ops.level() checking
    the build loaded is that one): {level: result}. The loaded library is dropped after, as above."""
    outs = {}
    monkeypatch.delenv("KUBEINFER_CPU_NATIVE_PORTABLE", raising=False)
    for level in levels_this_cpu_runs():
        monkeypatch.setenv("KUBEINFER_CPU_LEVEL", level)
        ops._state.clear()
        assert ops.available() and ops.level() == level
        outs[level] = compute()
    monkeypatch.delenv("KUBEINFER_CPU_LEVEL")
    ops._state.clear()
    return outs
