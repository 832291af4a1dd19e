"""Reads the picker's four series out of an engine's Prometheus text exposition, and nothing else.

Why not a full parser: a vLLM engine's /metrics is hundreds of lines (histograms per model) of which
the picker needs four names; prometheus_client's parser builds an object per sample, which at a 250 ms
interval cost the gateway 0.6 of a core per 100 engines. Here `bytes.find` jumps to the lines that
start with a wanted name (in C), and only those are split. Semantics follow endpoints.parse_engine_metrics
(the reference the tests compare against): waiting and running summed over the pod's models, KV usage
the largest, and of `vllm:lora_requests_info` the latest sample (its value is the time it was set:
vLLM keeps one sample per label set it has ever had).
"""
from __future__ import annotations

import re

from .endpoints import EngineState, read_lora_info

WAITING, RUNNING = b"vllm:num_requests_waiting", b"vllm:num_requests_running"
KV_USAGE, LORA_INFO = b"vllm:kv_cache_usage_perc", b"vllm:lora_requests_info"
_LABEL = re.compile(rb'([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"')
_ESCAPES = {b"\\\\": b"\\", b'\\"': b'"', b"\\n": b"\n"}


def samples(body: bytes, name: bytes):
    """(labels text, value) of each sample of `name`: lines that start with exactly that name."""
    start = 0 if body.startswith(name) else _line_of(body, name, 0)
    while start != -1:
        end = body.find(b"\n", start)
        rest = body[start + len(name):end if end != -1 else len(body)].rstrip(b"\r")
        if rest[:1] == b"{":  # labels; their values may hold anything but an unescaped quote
            close = rest.rfind(b"}")
            if close != -1:
                yield rest[1:close], _value(rest[close + 1:])
        elif rest[:1] in (b" ", b"\t"):  # no labels (a longer name that starts with this one is skipped)
            yield b"", _value(rest)
        if end == -1:
            return
        start = _line_of(body, name, end)


def _line_of(body: bytes, name: bytes, position: int) -> int:
    """Where the next line starting with `name` begins, from `position` on; -1 when none does."""
    found = body.find(b"\n" + name, position)
    return found + 1 if found != -1 else -1


def _value(text: bytes) -> float:
    """The sample's value (a timestamp may follow it)."""
    parts = text.split()
    return float(parts[0]) if parts else 0.0


def labels_of(text: bytes) -> dict[str, str]:
    return {k.decode(): re.sub(rb'\\[\\"n]', lambda m: _ESCAPES[m.group()], v).decode("utf-8", "replace")
            for k, v in _LABEL.findall(text)}


def read_engine_metrics(body: bytes) -> EngineState:
    state = EngineState()
    state.waiting = sum(value for _, value in samples(body, WAITING))
    state.running = sum(value for _, value in samples(body, RUNNING))
    state.kv_usage = max((value for _, value in samples(body, KV_USAGE)), default=0.0)
    latest = None
    for sample in samples(body, LORA_INFO):
        if latest is None or sample[1] >= latest[1]:
            latest = sample
    if latest is not None:
        read_lora_info(state, labels_of(latest[0]))
    return state
