"""End to end on a real engine: the gateway forwards what is left of `x-request-timeout-ms`, the engine
ends the request when it is spent (finish_reason "timeout") and still reports usage, which the gateway
counts for the tenant."""
from __future__ import annotations

import json

import httpx
from server_harness import RunningServer
from test_gateway_tenants import metrics_text, start_gateway, write_tenants

from kubeinfer.dev.testing.random_model import build_random_model


async def test_a_spent_budget_ends_the_request_with_usage_counted_for_the_tenant(tmp_path):
    # A model that needs well over the 300 ms budget for 400 tokens (the suite's tiny one decodes them in ~130 ms
    # on this CPU since the native decode ops: it finished before the budget was spent), yet gives its first
    # token well within it.
    model_dir = build_random_model(tmp_path / "model", "llama", hidden_size=512, num_layers=8, num_heads=8,
                                   num_kv_heads=4, intermediate_size=1536)
    with RunningServer(str(model_dir), name="base") as server:
        gateway = await start_gateway([server], tenants_file=write_tenants(tmp_path))
        try:
            async with httpx.AsyncClient(timeout=60) as http:
                body = {"model": "base", "prompt": "hello", "max_tokens": 400, "ignore_eos": True, "stream": True,
                        "stream_options": {"include_usage": True}}
                response = await http.post(f"http://127.0.0.1:{gateway.ports['proxy']}/v1/completions", json=body,
                                           headers={"authorization": "Bearer key-a", "x-request-timeout-ms": "300"})
            text = await metrics_text(gateway)
        finally:
            await gateway.stop()
    events = [json.loads(line[6:]) for line in response.text.splitlines()
              if line.startswith("data: {")]
    finish = [c["finish_reason"] for e in events for c in e["choices"] if c.get("finish_reason")]
    usage = events[-1]["usage"]
    assert finish == ["timeout"] and 0 < usage["completion_tokens"] < 400
    assert (f'kubeinfer_gateway_tenant_completion_tokens_total{{model_name="base",tenant="team-a"}} '
            f'{float(usage["completion_tokens"])}') in text
