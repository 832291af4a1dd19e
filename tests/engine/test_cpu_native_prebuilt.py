"""Native libraries built ahead of time (platforms/cpu/native/prebuilt.py): a serving node without a C compiler
loads the prebuilt library of its level, a source changed since the prebuild makes it stale (the runtime build
takes over), and a sanitized build never takes it."""
from __future__ import annotations

import platform

import pytest

from kubeinfer.engine.platforms.cpu.native import build, prebuilt

pytestmark = pytest.mark.skipif(platform.machine() not in build.X86 or build.compiler() is None,
                                reason="prebuilt levels are x86-64 builds, made here with a C compiler")


@pytest.fixture
def prebuilt_portable(tmp_path, monkeypatch):
    """The portable level prebuilt into a folder of its own, and a node without a compiler or a cache."""
    where = tmp_path / "prebuilt"
    monkeypatch.setenv("KUBEINFER_CACHE_DIR", str(tmp_path / "build-cache"))
    build.prebuild(where, ["portable"])
    monkeypatch.setattr(prebuilt, "PREBUILT", where)
    monkeypatch.setenv("KUBEINFER_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    return where


def test_a_node_without_a_compiler_loads_the_prebuilt_level(prebuilt_portable):
    lib, why = build.load(level="portable")
    assert lib is not None, why
    assert lib._name == str(prebuilt_portable / "libkubeinfer_cpu_portable.so")
    assert lib.ki_level() == 0


def test_a_stale_stamp_is_not_used(prebuilt_portable):
    (prebuilt_portable / prebuilt.STAMP).write_text("0" * 64 + "\n")  # as after a source edit
    lib, why = build.load(level="portable")
    assert lib is None and "no-such-compiler" in why


def test_a_level_not_prebuilt_is_compiled_not_taken(prebuilt_portable):
    lib, why = build.load(level="v3")
    assert lib is None and "no-such-compiler" in why


def test_a_sanitized_build_never_takes_the_prebuilt_library(prebuilt_portable, monkeypatch):
    monkeypatch.setenv("KUBEINFER_CPU_NATIVE_SANITIZE", "address")
    lib, why = build.load(level="portable")
    assert lib is None and "no-such-compiler" in why


def test_the_start_line_names_the_native_paths_and_the_level(caplog):
    from kubeinfer.engine.platforms.cpu.native import ops, paths

    with caplog.at_level("INFO", logger=paths.__name__):
        line = paths.log_native_paths()
    assert line in caplog.text
    assert line.startswith("native CPU paths: int8/int4 linear on") and f"level {ops.level()}" in line


def test_the_start_line_says_all_off_and_why_without_the_library(monkeypatch):
    from kubeinfer.engine.platforms.cpu.native import ops, paths

    monkeypatch.setattr(ops, "_state", {"lib": None, "why": "no C compiler (gcc or cc on PATH, or $CC)"})
    line = paths.native_paths()
    assert line.startswith("native CPU paths: all off") and "no C compiler" in line
