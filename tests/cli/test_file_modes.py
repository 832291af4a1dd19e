"""Model directories written by `kubeinfer demo-model`, `kubeinfer random-model` and the test builders are
readable by another uid (issue #46, defect 6): the engine runs as uid 1000 and reads them through a volume."""
from __future__ import annotations

import os
import shutil
import stat
import subprocess
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
from quant_checkpoints import write_checkpoint
from safetensors.torch import load_file

from kubeinfer.dev.demo_model import DemoRecipe, build_demo_model
from kubeinfer.dev.testing.random_model import build_random_adapter, build_random_model

MICRO = replace(DemoRecipe(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=64,
                           vocab_size=300, max_position_embeddings=64, context=16, batch_size=4, lora_rank=2,
                           lora_alpha=4.0, draft_hidden_size=16),
                base_steps=1, adapter_steps=1, draft_steps=1, max_chars_per_style=3_000)
NOBODY = 65534


def modes(root: Path) -> dict[str, str]:
    """Every path under root (root included) whose mode is not 0644 (files) or 0755 (directories)."""
    wrong = {}
    for path in [root, *root.rglob("*")]:
        mode = stat.S_IMODE(path.lstat().st_mode)
        if not path.is_symlink() and mode != (0o755 if path.is_dir() else 0o644):
            wrong[str(path.relative_to(root))] = oct(mode)
    return wrong


def test_random_model_and_adapter_are_world_readable(tmp_path):
    model = build_random_model(tmp_path / "model")
    adapter = build_random_adapter(tmp_path / "adapter", model)
    assert (model / "model.safetensors").exists()
    assert modes(model) == {} and modes(adapter) == {}


def test_sharded_random_model_is_world_readable(tmp_path):
    model = build_random_model(tmp_path / "model", hidden_size=128, intermediate_size=256, max_shard_size="100KB")
    assert len(list(model.glob("*.safetensors"))) > 1
    assert modes(model) == {}


def test_demo_model_is_world_readable(tmp_path):
    out = build_demo_model(tmp_path / "demo", recipe=MICRO, progress=False)
    assert (out / "base" / "model.safetensors").exists() and (out / "adapters").is_dir()
    assert modes(out) == {}


def test_test_checkpoints_are_world_readable(tmp_path):
    model = build_random_model(tmp_path / "model")
    copy = Path(write_checkpoint(model, tmp_path / "copy", load_file(model / "model.safetensors"), None))
    assert modes(copy) == {}


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="switching uid needs root")
def test_another_uid_reads_the_weights():
    parent = Path(tempfile.mkdtemp(prefix="kubeinfer-modes-"))
    try:
        parent.chmod(0o755)  # the test's own folder; what the builder writes inside is what is checked
        model = build_random_model(parent / "model")
        read = subprocess.run([shutil.which("head") or "/usr/bin/head", "-c", "8", str(model / "model.safetensors")],
                              user=NOBODY, capture_output=True, timeout=60)
        assert read.returncode == 0, read.stderr
    finally:
        shutil.rmtree(parent)
