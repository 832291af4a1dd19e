"""What can go wrong in the engine, as the front ends see it, and which errors end the engine."""
from __future__ import annotations


class QueueFullError(RuntimeError):
    """The bounded waiting queue is full; the client should retry later."""


class EngineDeadError(RuntimeError):
    """The engine cannot serve: it died, or the request was aborted under it."""


class RequestFailedError(RuntimeError):
    """The engine ended this request early with an error (its adapter could not be read, its step failed)."""


def is_unrecoverable(error: BaseException) -> bool:
    """Errors after which the device (and so every later step) is unusable: CUDA errors are sticky."""
    import torch

    if getattr(error, "unrecoverable", False):  # e.g. a tensor-parallel rank died (distributed/failure_watch.py)
        return True
    accelerator_error = getattr(torch, "AcceleratorError", None)  # torch >= 2.8 raises it for CUDA errors
    if accelerator_error is not None and isinstance(error, accelerator_error):
        return True
    text = str(error)
    return any(sign in text for sign in ("CUDA error", "device-side assert", "illegal memory access", "NCCL error"))


class StepFailedError(RuntimeError):
    """The model step raised. The requests of its batch were ended (`outputs`, each with `error` set);
    the others are untouched and the engine can step again."""

    def __init__(self, cause: BaseException, outputs: list) -> None:
        super().__init__(f"{type(cause).__name__}: {cause}")
        self.cause, self.outputs = cause, outputs
