"""The e2e suite's hub stand-in (tests/e2e/hub_standin.py) speaks enough of the Hugging Face Hub's file API for the
real client: huggingface_hub's snapshot_download (what `hf download`, the operator's fetch container, runs) gets
every file byte for byte, and a missing repository file is the client's own 404 error."""
from __future__ import annotations

import threading

import pytest
from hub_standin import serve

from kubeinfer.dev.testing.random_model import build_random_model


@pytest.fixture
def hub(tmp_path):
    model = build_random_model(tmp_path / "model", "llama", hidden_size=32, num_layers=1, num_heads=2,
                               num_kv_heads=1, intermediate_size=64)
    server = serve(model, 0, host="127.0.0.1")
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield model, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_snapshot_download_gets_every_file(hub, tmp_path, monkeypatch):
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import EntryNotFoundError

    model, endpoint = hub
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # the suite's conftest turns the hub off at import
    out = tmp_path / "fetched"
    snapshot_download("org/tiny", local_dir=out, endpoint=endpoint, cache_dir=tmp_path / "cache")
    files = sorted(p.name for p in model.iterdir() if p.is_file())
    assert sorted(p.name for p in out.iterdir() if p.is_file()) == files and "model.safetensors" in files
    assert all((out / f).read_bytes() == (model / f).read_bytes() for f in files)
    with pytest.raises(EntryNotFoundError):
        hf_hub_download("org/tiny", "missing.bin", local_dir=tmp_path / "x", endpoint=endpoint,
                        cache_dir=tmp_path / "cache")
