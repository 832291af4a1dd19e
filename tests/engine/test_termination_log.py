"""The engine's fatal start-up error reaches the container's termination message file (what the kubelet puts in
the pod's status), only where such a file is ours to write."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kubeinfer.engine.entrypoints import termination_log
from kubeinfer.engine.entrypoints.termination_log import (MAX_BYTES, PATH_ENV, termination_message_on_failure,
                                                          write_termination_message)


def test_a_failed_start_writes_its_reason(tmp_path):
    """`kubeinfer serve` on a missing model directory: exit code 1, and the reason in the file."""
    log = tmp_path / "termination-log"
    env = {**os.environ, PATH_ENV: str(log)}
    done = subprocess.run([sys.executable, "-m", "kubeinfer.cli", "serve", str(tmp_path / "no-such-model")],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    message = log.read_text()
    assert message.startswith("kubeinfer serve: ") and "no-such-model" in message and "does not exist" in message
    assert message in done.stderr  # the same words as the log: one story, two places


def test_an_unexpected_error_is_named_with_its_type(tmp_path, monkeypatch):
    monkeypatch.setenv(PATH_ENV, str(tmp_path / "log"))
    with pytest.raises(RuntimeError), termination_message_on_failure():
        raise RuntimeError("NCCL error: unhandled system error")
    assert (tmp_path / "log").read_text() == "kubeinfer serve: RuntimeError: NCCL error: unhandled system error"


@pytest.mark.parametrize("error", [SystemExit(0), SystemExit(None), KeyboardInterrupt()])
def test_a_clean_exit_leaves_no_message(tmp_path, monkeypatch, error):
    monkeypatch.setenv(PATH_ENV, str(tmp_path / "log"))
    with pytest.raises(type(error)), termination_message_on_failure():
        raise error
    assert not (tmp_path / "log").exists()


def test_the_message_fits_what_the_kubelet_reads(tmp_path, monkeypatch):
    monkeypatch.setenv(PATH_ENV, str(tmp_path / "log"))
    assert write_termination_message("é" * 5000)
    data = (tmp_path / "log").read_bytes()
    assert len(data) <= MAX_BYTES and data.decode() == "é" * (MAX_BYTES // 2)


def test_the_default_path_is_only_written_when_it_exists_and_is_writable(tmp_path, monkeypatch):
    monkeypatch.delenv(PATH_ENV, raising=False)
    missing = tmp_path / "termination-log"
    monkeypatch.setattr(termination_log, "DEFAULT_PATH", str(missing))
    assert not write_termination_message("x") and not missing.exists(), "outside a container: nothing created"
    missing.write_text("")
    assert write_termination_message("the kubelet's file") and missing.read_text() == "the kubelet's file"
    missing.chmod(0o444)
    if os.geteuid() != 0:  # root writes read-only files anyway
        assert not write_termination_message("y")


def test_an_unwritable_override_does_not_hide_the_error(tmp_path, monkeypatch):
    monkeypatch.setenv(PATH_ENV, str(tmp_path / "no-such-dir" / "log"))
    with pytest.raises(SystemExit, match="kubeinfer serve: bad"), termination_message_on_failure():
        raise SystemExit("kubeinfer serve: bad")


def test_only_the_fatal_error_is_written_never_the_log(tmp_path, monkeypatch, caplog):
    """With terminationMessagePolicy File (the operator's pods) the file is all the kubelet reads: what the engine
    logged while serving (request text among it) never reaches it, and an engine that exits without an exception
    (it died while serving: `serve` returns 1) leaves no message at all."""
    import logging

    monkeypatch.setenv(PATH_ENV, str(tmp_path / "log"))
    with termination_message_on_failure():
        logging.getLogger("kubeinfer.test").warning("a tenant's prompt: the launch codes are 0000")
    assert not (tmp_path / "log").exists()
    with pytest.raises(RuntimeError), termination_message_on_failure():
        logging.getLogger("kubeinfer.test").warning("a tenant's prompt: the launch codes are 0000")
        raise RuntimeError("the engine could not start")
    assert (tmp_path / "log").read_text() == "kubeinfer serve: RuntimeError: the engine could not start"
