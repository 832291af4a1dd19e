"""Usage accounting: what each response reports it used, as Prometheus counters per tenant and model,
and as one JSON line per request in `--usage-log FILE` (for chargeback).

The engines report `usage` ({prompt_tokens, completion_tokens, prompt_tokens_details.cached_tokens}) in
every non-streamed response, and in the last event of a stream when the client asked for
`stream_options.include_usage`, which the gateway asks for on every stream it forwards (engine_body.py);
a response of the Responses API reports {input_tokens, output_tokens, input_tokens_details.cached_tokens},
streamed in its `response.completed` event. UsageScanner reads it from the response bytes as they pass,
keeping only a bounded buffer: of a large JSON body only its tail, where the engines write `usage`; of a
stream, one event at a time, an overlong event skipped. A response without usage (another engine, an
ext_proc stream whose body could not be rewritten) still counts its request, and the token limit keeps
the admission estimate.

The `tenant` label takes only names from the tenants file, so clients cannot grow the series.
"""
from __future__ import annotations

import json
import logging
import threading
import time

logger = logging.getLogger(__name__)
MAX_JSON_BODY = 4 << 20  # a non-streamed body larger than this is read for usage from its tail only
JSON_TAIL = 64 << 10  # usage is the last member the engines write: it sits in the tail
MAX_SSE_LINE = 1 << 20  # a longer event (a huge chunk of text) is skipped, not the events after it


class UsageScanner:
    """Fed the response body chunk by chunk; `usage` is the last usage object seen (None if none)."""

    def __init__(self) -> None:
        self.usage: dict | None = None
        self.model: str | None = None
        self._buffer = bytearray()
        self._sse: bool | None = None  # decided by the first bytes: `data:` lines, or one JSON document
        self._overflow = False  # JSON: only the tail is kept; SSE: the current line is being skipped

    def feed(self, chunk: bytes) -> None:
        if not chunk:
            return
        if self._sse and self._overflow:  # skipping an overlong line: resume after its end
            end = chunk.find(b"\n")
            if end < 0:
                return
            chunk, self._overflow = chunk[end + 1:], False
        self._buffer += chunk
        if self._sse is None:
            head = self._buffer.lstrip()
            if not head:
                return
            self._sse = head[:1] != b"{"
        if self._sse:
            *lines, rest = self._buffer.split(b"\n")
            self._buffer = bytearray(rest)
            for line in lines:
                self._line(line.strip())
            if len(self._buffer) > MAX_SSE_LINE:
                self._overflow = True
                self._buffer.clear()
        elif self._overflow or len(self._buffer) > MAX_JSON_BODY:
            self._overflow = True
            del self._buffer[:-JSON_TAIL]

    def _line(self, line: bytes) -> None:
        if line.startswith(b"data:") and b'"usage"' in line:
            self._document(line[5:].strip())

    def _document(self, raw: bytes) -> None:
        try:
            document = json.loads(raw)
        except (ValueError, UnicodeDecodeError):
            return
        if isinstance(document, dict):
            if isinstance(document.get("response"), dict):  # a Responses API stream event
                document = document["response"]
            if isinstance(document.get("usage"), dict):
                self.usage = document["usage"]
            if isinstance(document.get("model"), str):
                self.model = document["model"]

    def finish(self) -> dict | None:
        if self._sse is False and not self._overflow:
            self._document(bytes(self._buffer))
        elif self._sse is False:
            self._usage_in_tail(bytes(self._buffer))
        elif self._sse and not self._overflow:
            self._line(bytes(self._buffer).strip())
        self._buffer.clear()
        return self.usage

    def _usage_in_tail(self, tail: bytes) -> None:
        """The `usage` object of a body too large to parse whole, read from its last bytes."""
        at = tail.rfind(b'"usage"')
        start = tail.find(b"{", at) if at >= 0 else -1
        if start < 0:
            return
        try:
            usage, _ = json.JSONDecoder().raw_decode(tail[start:].decode("utf-8", "replace"))
        except ValueError:
            return
        if isinstance(usage, dict):
            self.usage = usage


def token_counts(usage: dict | None) -> tuple[int, int, int] | None:
    """(prompt, cached prompt, completion) tokens of a usage report; None without one."""
    if not usage:
        return None

    def number(value) -> int:
        return value if isinstance(value, int) and value >= 0 else 0
    if "input_tokens" in usage:  # the Responses API's names
        details = usage.get("input_tokens_details") or {}
        prompt, completion = usage.get("input_tokens"), usage.get("output_tokens")
    else:
        details = usage.get("prompt_tokens_details") or {}
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
    return (number(prompt), number(details.get("cached_tokens") if isinstance(details, dict) else 0),
            number(completion))


class UsageRecorder:
    """Feeds the tenant counters of GatewayMetrics and, with `log_path`, the JSON-lines usage log."""

    def __init__(self, metrics, log_path: str | None = None) -> None:
        self.requests, self.prompt_tokens = metrics.tenant_requests, metrics.tenant_prompt_tokens
        self.cached_tokens, self.completion_tokens = metrics.tenant_cached_tokens, metrics.tenant_completion_tokens
        self.engine_seconds = metrics.tenant_engine_seconds
        self._log = open(log_path, "a", buffering=1) if log_path else None  # noqa: SIM115 - lives with the gateway
        self._lock = threading.Lock()

    def record(self, *, tenant: str | None, model: str, status: int | None, usage: dict | None,
               seconds: float | None, requested_model: str | None = None, endpoint: str | None = None) -> None:
        counts = token_counts(usage)
        code = str(status) if status else "unknown"
        if tenant is not None:
            self.requests.labels(tenant, model, code).inc()
            if counts:
                self.prompt_tokens.labels(tenant, model).inc(counts[0])
                self.cached_tokens.labels(tenant, model).inc(counts[1])
                self.completion_tokens.labels(tenant, model).inc(counts[2])
            if seconds is not None:
                self.engine_seconds.labels(tenant, model).inc(seconds)
        if self._log is not None:
            line = {"time": round(time.time(), 3), "tenant": tenant, "model": model, "status": status,
                    "prompt_tokens": counts[0] if counts else None, "cached_tokens": counts[1] if counts else None,
                    "completion_tokens": counts[2] if counts else None,
                    "seconds": round(seconds, 4) if seconds is not None else None}
            if requested_model and requested_model != model:
                line["requested_model"] = requested_model
            if endpoint:
                line["endpoint"] = endpoint
            with self._lock:
                self._log.write(json.dumps(line) + "\n")

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
