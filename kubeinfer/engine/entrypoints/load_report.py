"""`GET /load`: the few numbers an endpoint picker routes on, as one small JSON object.

`/metrics` stays for Prometheus; a picker polling every engine several times a second should not
render and parse the whole exposition for five numbers (issue #15: 1.6 ms of the gateway's CPU per
scrape). Same meanings as the vllm:* gauges: requests waiting and running, KV-cache usage (0..1), the
running and waiting adapters, the adapter slots, plus whether the pod can serve now (what /health
says) and the models it serves (what /v1/models lists), so one request replaces three. `kv_events` names
the engine's KV-events PUB and replay addresses (docs/kv-events.md), so a picker needs no port convention.
"""
from __future__ import annotations

import json

from fastapi import FastAPI
from fastapi.responses import Response

from .openai.server_state import ServerState


def load_report(state: ServerState) -> dict:
    async_engine, engine = state.async_engine, state.engine
    running, waiting = engine.lora_adapter_names()
    ready = not state.draining and async_engine.death is None and async_engine.is_running
    return {"ready": ready, "waiting": async_engine.num_waiting, "running": async_engine.num_running,
            "kv_usage": engine.block_manager.usage, "running_adapters": list(running),
            "waiting_adapters": list(waiting), "max_loras": engine.config.max_loras if engine.config.enable_lora else 0,
            "max_num_seqs": engine.config.max_num_seqs,
            "models": [state.served_model_name, *(r.lora_name for r in engine.list_loras())],
            # where a picker subscribes to this engine's KV-cache events (null: not published)
            "kv_events": engine.kv_events.report() if engine.kv_events is not None else None}


def add_load_route(app: FastAPI, state: ServerState) -> None:
    @app.get("/load", include_in_schema=False)
    async def load():
        report = load_report(state)
        return Response(json.dumps(report, separators=(",", ":")), status_code=200 if report["ready"] else 503,
                        media_type="application/json")
