"""A prebuilt native library (KUBEINFER_CPU_NATIVE_LIBRARY, what the CPU engine image ships: its serving stage has
no compiler) is loaded where it fits, refused with the reason where it does not, and the engine says at start which
native paths are on (issue #46: the image ran none of them and said only "int8 kernels unavailable")."""
from __future__ import annotations

import json
import logging

import pytest

from kubeinfer.engine.model_executor.layers.quantization.cpu_native import build, ops, paths


@pytest.fixture
def exported(tmp_path, monkeypatch):
    """A library exported as the image's build stage does, then no compiler (as in the serving image)."""
    if build.compiler() is None:
        pytest.skip("no C compiler here to export a library")
    monkeypatch.delenv("KUBEINFER_CPU_NATIVE_PORTABLE", raising=False)
    monkeypatch.delenv("KUBEINFER_CPU_NATIVE_SANITIZE", raising=False)
    library = build.export(tmp_path / "native")
    monkeypatch.setenv("KUBEINFER_CPU_NATIVE_LIBRARY", str(library))
    monkeypatch.setattr(build, "compiler", lambda: None)
    monkeypatch.setattr(ops, "_state", {})
    monkeypatch.setattr(build, "origin", {})
    return library


def test_the_prebuilt_library_loads_without_a_compiler(exported):
    manifest = json.loads(build.manifest_path(exported).read_text())
    assert manifest["sources"] == build.sources_digest() and manifest["cpu_flags"]
    lib, why = build.load()
    assert lib is not None, why
    assert build.origin["library"] == f"prebuilt {exported}"


def test_a_library_for_another_cpu_is_refused_with_the_reason(exported):
    manifest = json.loads(build.manifest_path(exported).read_text())
    manifest["cpu_flags"] += " amx_fp8_from_the_future"
    build.manifest_path(exported).write_text(json.dumps(manifest))
    lib, why = build.load()
    assert lib is None
    assert "needs CPU features this CPU lacks: amx_fp8_from_the_future" in why and "no C compiler" in why


def test_a_library_from_other_sources_is_refused(exported):
    manifest = json.loads(build.manifest_path(exported).read_text())
    manifest["sources"] = "0" * 64
    build.manifest_path(exported).write_text(json.dumps(manifest))
    assert build.prebuilt(False) == (None, f"prebuilt library {exported} was built from other sources than "
                                     "this package's")


def test_the_start_line_names_every_native_path_on(exported, caplog):
    with caplog.at_level(logging.INFO, logger=paths.__name__):
        line = paths.log_native_paths()
    assert line.startswith("native CPU paths: int8/int4 linear on")
    for part in ("decode attention and norms on", "fused decoder layers on", "float32 head on",
                 f"library prebuilt {exported}"):
        assert part in line, line
    assert line in caplog.text


def test_the_start_line_says_why_all_are_off(monkeypatch):
    monkeypatch.setattr(ops, "_state", {})
    monkeypatch.setattr(ops, "load", lambda portable=None: (None, "no C compiler (gcc or cc on PATH, or $CC)"))
    line = paths.native_paths()
    assert line.startswith("native CPU paths: all off")
    assert "fused decoder layers and the float32 head (no C compiler" in line


def test_the_start_line_says_which_switch_is_off(exported, monkeypatch):
    monkeypatch.setenv("KUBEINFER_CPU_FUSED_LAYERS", "0")
    line = paths.native_paths()
    assert "fused decoder layers off (KUBEINFER_CPU_FUSED_LAYERS=0)" in line and "float32 head on" in line
    monkeypatch.setenv("KUBEINFER_CPU_NATIVE_LAYERS", "0")
    assert "decode attention and norms off (KUBEINFER_CPU_NATIVE_LAYERS=0)" in paths.native_paths()


def test_an_engine_start_logs_the_line(tmp_path, caplog):
    from kubeinfer.dev.testing.random_model import build_random_model
    from kubeinfer.engine import LLM

    model = build_random_model(tmp_path / "m", "llama", seed=1, hidden_size=32, num_layers=1, num_heads=2,
                               num_kv_heads=1, intermediate_size=64)
    with caplog.at_level(logging.INFO, logger=paths.__name__):
        llm = LLM(str(model), max_model_len=32, num_kv_blocks=8)
        llm.shutdown()
    assert "native CPU paths: " in caplog.text
