"""pytest plugin for GPU runs (`-p gpu_failure_log`, scripts/gpu-check.sh): writes each failure's short traceback
to $GPU_LOG_DIR/fails.log and each test slower than 8 s to slow.log as it happens, so that a run killed at its
time limit still says what failed. Under xdist only the controller writes: each report once."""
from __future__ import annotations

import os

SLOW_S = 8.0
_state = {"writer": True}


def _path(name: str) -> str:
    return os.path.join(os.environ.get("GPU_LOG_DIR") or os.environ.get("OUT") or ".", name)


def pytest_configure(config):
    _state["writer"] = not hasattr(config, "workerinput")  # an xdist worker: its controller writes


def pytest_runtest_logreport(report):
    if not _state["writer"]:
        return
    if report.failed:
        with open(_path("fails.log"), "a") as f:
            f.write(f"=== {report.nodeid} ({report.when})\n{report.longreprtext[-2500:]}\n")
    if report.when == "call" and report.duration > SLOW_S:
        with open(_path("slow.log"), "a") as f:
            f.write(f"{report.duration:6.1f}s {report.nodeid}\n")
