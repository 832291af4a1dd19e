"""The engine's last words for Kubernetes: a fatal error goes to the container's termination message.

When a container exits, the kubelet reads its terminationMessagePath (`/dev/termination-log`) into the pod's
status (`state.terminated.message`, then `lastState.terminated.message`), where `kubectl describe` and the
operator read it: an InferenceModel's conditions then say why the engine would not start (a model whose heads do
not divide by the tensor-parallel size, a missing model directory) instead of a bare CrashLoopBackOff.
`KUBEINFER_TERMINATION_LOG` names another file (tests, other runtimes). The default path is only written when it
already exists and is writable: the kubelet creates it in a container, and outside one it is not ours to create.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import kubeinfer.engine.envs as envs

PATH_ENV = envs.TERMINATION_LOG.name
DEFAULT_PATH = "/dev/termination-log"
MAX_BYTES = 4096  # the kubelet reads no more than this of the file


def termination_log_path() -> str | None:
    override = envs.TERMINATION_LOG.get()
    if override:
        return override
    return DEFAULT_PATH if os.path.isfile(DEFAULT_PATH) and os.access(DEFAULT_PATH, os.W_OK) else None


def describe(error: BaseException) -> str | None:
    """What to tell Kubernetes about the error that ends the process; None when it is no failure."""
    if isinstance(error, SystemExit):  # our own refusals: "kubeinfer serve: ..." says what to change
        return error.code if isinstance(error.code, str) and error.code else None
    if isinstance(error, KeyboardInterrupt):
        return None
    return f"kubeinfer serve: {type(error).__name__}: {error}"


def write_termination_message(message: str) -> bool:
    """Write `message` (at most MAX_BYTES of UTF-8) where the kubelet reads it; False when there is no such file."""
    path = termination_log_path()
    if path is None:
        return False
    text = message.strip().encode()[:MAX_BYTES].decode(errors="ignore")
    try:
        with open(path, "w", encoding="utf-8") as out:
            out.write(text)
    except OSError:
        return False
    return True


@contextlib.contextmanager
def termination_message_on_failure() -> Iterator[None]:
    """Record the error that escapes the block (a failed start-up, above all), then let it end the process."""
    try:
        yield
    except BaseException as error:
        message = describe(error)
        if message:
            write_termination_message(message)
        raise
