"""The gateway over real engine servers (tiny model, different adapters per pod): proxy mode with the
official openai client, Envoy ext_proc with the generated xds-protos client, and the gateway's metrics."""
from __future__ import annotations

import asyncio
import json
from contextlib import ExitStack

import grpc
import httpx
import openai
import pytest
from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from lora_helpers import MAX_TOKENS, PROMPTS
from server_harness import RunningServer, free_port

from kubeinfer.gateway.app import Gateway, GatewayConfig
from kubeinfer.gateway.scheduling.picker import PickerConfig

GREEDY = {"max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "return_token_ids": True}


@pytest.fixture(scope="module")
def engines(lora_base_dir, lora_adapters):
    """Three pods: one with adapter 'attn', one with 'mlp', one with the base model only."""
    placements = {"pod-attn": ["attn"], "pod-mlp": ["mlp"], "pod-base": []}
    with ExitStack() as stack:
        servers = {name: stack.enter_context(RunningServer(
            lora_base_dir, name="base", enable_lora=True, max_loras=1, max_lora_rank=8, block_size=4,
            lora_modules=[lora_adapters[a][0] for a in adapters])) for name, adapters in placements.items()}
        yield servers


def address(server) -> str:
    return server.url.removeprefix("http://")


async def start_gateway(urls, **picker) -> Gateway:
    gateway = Gateway(GatewayConfig(host="127.0.0.1", port=0, ext_proc_port=0, metrics_port=0, endpoints=urls,
                                    scrape_interval=0.1, picker=PickerConfig(**picker)))
    await gateway.start()
    return gateway


@pytest.fixture
async def gateway(engines):
    gateway = await start_gateway([s.url for s in engines.values()])
    yield gateway
    await gateway.stop()


def proxy_url(gateway) -> str:
    return f"http://127.0.0.1:{gateway.ports['proxy']}"


async def complete(http: httpx.AsyncClient, gateway, model: str, prompt, headers=None, **extra) -> httpx.Response:
    body = {"model": model, "prompt": prompt, **GREEDY, **extra}
    return await http.post(proxy_url(gateway) + "/v1/completions", json=body, headers=headers, timeout=60)


async def test_models_are_the_union_of_the_pods(gateway):
    client = openai.AsyncOpenAI(base_url=proxy_url(gateway) + "/v1", api_key="unused", max_retries=0)
    models = {m.id: m for m in (await client.models.list()).data}
    assert set(models) == {"base", "attn", "mlp"}
    assert models["attn"].parent == "base" and models["base"].parent is None


async def test_adapter_requests_go_to_the_pods_that_have_them(gateway, engines, lora_adapters, lora_base_reference):
    async with httpx.AsyncClient() as http:
        jobs = [(model, p) for p in range(len(PROMPTS)) for model in ("attn", "mlp", "base")]
        responses = await asyncio.gather(*(complete(http, gateway, m, PROMPTS[p]) for m, p in jobs))
    for (model, p), response in zip(jobs, responses):
        assert response.status_code == 200, response.text
        expected = lora_base_reference[p] if model == "base" else lora_adapters[model][1][p]
        assert response.json()["choices"][0]["token_ids"] == expected
        if model != "base":  # only the pod holding the adapter may serve it
            assert response.headers["x-gateway-destination-endpoint"] == address(engines[f"pod-{model}"])


async def test_streaming_through_the_proxy_with_the_openai_client(gateway, llama_dir):
    client = openai.AsyncOpenAI(base_url=proxy_url(gateway) + "/v1", api_key="unused", max_retries=0)
    full = await client.completions.create(model="attn", prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                           extra_body={"ignore_eos": True, "return_token_ids": True})
    stream = await client.completions.create(model="attn", prompt=PROMPTS[0], max_tokens=6, temperature=0,
                                             stream=True, stream_options={"include_usage": True},
                                             extra_body={"ignore_eos": True, "return_token_ids": True})
    chunks = [c async for c in stream]
    assert [t for c in chunks if c.choices for t in c.choices[0].token_ids] == full.choices[0].token_ids
    assert chunks[-1].usage.completion_tokens == 6


async def test_a_burst_spreads_by_queue(gateway, engines):
    async with httpx.AsyncClient() as http:
        prompts = [[10 + i, 20 + i, 30 + i] for i in range(9)]  # no shared prefix: only load decides
        responses = await asyncio.gather(*(complete(http, gateway, "base", p, max_tokens=24) for p in prompts))
    destinations = [r.headers["x-gateway-destination-endpoint"] for r in responses]
    assert all(r.status_code == 200 for r in responses)
    counts = {address(s): destinations.count(address(s)) for s in engines.values()}
    # 3/3/3 between two scrapes; a scrape that reads a pod while a request is on its way there counts it
    # twice until the next scrape, so allow 2..4.
    assert all(2 <= n <= 4 for n in counts.values()), counts


async def test_the_gateway_reads_each_engines_batch_size_from_its_load_report(gateway, engines):
    """The engine's /load names its max_num_seqs: the fair queue's notion of a free place in a batch."""
    for server in engines.values():
        endpoint = gateway.pool.endpoints[address(server)]
        assert endpoint.state.max_running == server.engine.config.max_num_seqs > 0


async def test_a_repeated_long_prompt_returns_to_its_prefix(gateway, engines):
    long_prompt = list(range(40, 240))
    async with httpx.AsyncClient() as http:
        first = await complete(http, gateway, "base", long_prompt + [1])
        home = first.headers["x-gateway-destination-endpoint"]
        server = next(s for s in engines.values() if address(s) == home)
        hits = server.engine.block_manager.prefix_hits
        for i in range(3):
            response = await complete(http, gateway, "base", long_prompt + [2 + i])
            assert response.headers["x-gateway-destination-endpoint"] == home
        assert server.engine.block_manager.prefix_hits >= hits + 3 * 190  # the engine reused its cached blocks


async def test_a_killed_engine_is_routed_around_and_nothing_is_lost(lora_base_dir):
    with RunningServer(lora_base_dir, name="base") as alive, RunningServer(lora_base_dir, name="base") as doomed:
        gateway = await start_gateway([alive.url, doomed.url])
        try:
            doomed.server.should_exit = True  # the pod dies; the gateway has not noticed yet
            await asyncio.to_thread(doomed.thread.join, 10)
            async with httpx.AsyncClient() as http:
                responses = await asyncio.gather(*(complete(http, gateway, "base", [5 + i, 6, 7]) for i in range(6)))
            assert [r.status_code for r in responses] == [200] * 6
            assert {r.headers["x-gateway-destination-endpoint"] for r in responses} == {address(alive)}
            await asyncio.sleep(0.6)  # a few scrapes later it is out of the pool entirely
            assert [e.address for e in gateway.picker.ready_endpoints()] == [address(alive)]
            async with httpx.AsyncClient() as http:  # the gateway runs on this loop: never block it
                metrics = (await http.get(f"http://127.0.0.1:{gateway.ports['metrics']}/metrics")).text
            assert 'inference_pool_ready_pods{name="default"} 1.0' in metrics
        finally:
            await gateway.stop()


async def test_sheddable_requests_get_429_when_the_pool_is_saturated(lora_base_dir):
    """One pod that runs one sequence at a time: a few long requests fill its queue past the threshold."""
    with RunningServer(lora_base_dir, name="base", max_num_seqs=1) as busy:
        gateway = await start_gateway([busy.url], queue_threshold=2)
        gateway.router.trust_priority_headers = True  # the priority header as a trusted hop in front sets it
        try:
            async with httpx.AsyncClient() as http:
                long_jobs = [asyncio.create_task(complete(http, gateway, "base", [9, 9, i], max_tokens=300))
                             for i in range(4)]
                assert await asyncio.to_thread(busy.wait_for, lambda: busy.engine.num_waiting >= 2)
                for _ in range(100):  # until a scrape has seen the queue (0.3 s was too short on a loaded machine)
                    if (gateway.picker.table.queue >= 2).any():
                        break
                    await asyncio.sleep(0.05)
                shed = await complete(http, gateway, "base", [1, 2], headers={"x-gateway-inference-priority": "-1"})
                assert shed.status_code == 429 and shed.headers["retry-after"] == "1"
                assert shed.json()["error"]["type"] == "RateLimitError"
                critical = await complete(http, gateway, "base", [1, 2], max_tokens=2)
                assert critical.status_code == 200  # queued behind the others, not refused
                assert all(r.status_code == 200 for r in await asyncio.gather(*long_jobs))
        finally:
            await gateway.stop()


async def test_proxy_errors(gateway):
    async with httpx.AsyncClient() as http:
        unknown = await complete(http, gateway, "nope", [1, 2])
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == 404
        huge = await complete(http, gateway, "m" * 1_000_000, [1, 2])  # the 404 names the model, cut short
        assert huge.status_code == 404 and len(huge.content) < 2_000 and "mmm..." in huge.json()["error"]["message"]
        bad = await http.post(proxy_url(gateway) + "/v1/completions", content=b"{not json", timeout=10)
        assert bad.status_code == 400 and "JSON" in bad.json()["error"]["message"]
        engine_error = await complete(http, gateway, "base", [1, 2], temperature=-3)
        assert engine_error.status_code == 400  # the engine's own validation, passed through
    dead = await start_gateway([f"http://127.0.0.1:{free_port()}"])
    try:
        async with httpx.AsyncClient() as http:
            response = await complete(http, dead, "base", [1, 2])
        assert response.status_code == 503 and response.json()["error"]["type"] == "ServiceUnavailableError"
    finally:
        await dead.stop()


async def test_the_proxy_reports_each_request_end_to_its_endpoint():
    """In flight while the upstream answers, and not a moment after: without waiting for a scrape."""
    from kubeinfer.gateway.datastore.endpoints import Endpoint, EndpointPool, EngineState
    from kubeinfer.gateway.scheduling.picker import Picker
    from kubeinfer.gateway.handlers.proxy import build_proxy_app
    from kubeinfer.gateway.handlers.routing import Router

    pod = Endpoint("10.0.0.1:8000")
    pod.record_scrape(EngineState(), frozenset({"base"}), frozenset({"base"}))
    pool = EndpointPool()
    pool.set_members([pod])
    seen_in_flight = []

    class Body(httpx.AsyncByteStream):  # a streamed body, as a real engine's response is relayed
        def __init__(self, data: dict) -> None:
            self.data = json.dumps(data).encode()

        async def __aiter__(self):
            yield self.data

    def upstream(request: httpx.Request) -> httpx.Response:
        seen_in_flight.append(pod.num_unseen)
        if request.url.path == "/v1/completions":
            return httpx.Response(200, stream=Body({"choices": [{"text": "hi"}]}))
        return httpx.Response(400, stream=Body({"error": {"message": "bad", "code": 400}}))

    app = build_proxy_app(Router(Picker(pool, PickerConfig())),
                          client=httpx.AsyncClient(transport=httpx.MockTransport(upstream)))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as http:
        ok = await http.post("/v1/completions", json={"model": "base", "prompt": "x"})
        refused = await http.post("/v1/chat/completions", json={"model": "base", "messages": []})
    assert ok.status_code == 200 and refused.status_code == 400
    assert seen_in_flight == [1, 1] and pod.num_unseen == 0  # never scraped again, yet nothing left counted


async def test_client_cancellation_reaches_the_engine(gateway, engines):
    async with httpx.AsyncClient() as http:
        body = {"model": "mlp", "prompt": [3, 4, 5], "max_tokens": 400, "stream": True, "ignore_eos": True}
        async with http.stream("POST", proxy_url(gateway) + "/v1/completions", json=body, timeout=60) as response:
            async for line in response.aiter_lines():
                if line.startswith("data: "):
                    break
    server = engines["pod-mlp"]
    assert await asyncio.to_thread(server.wait_for, lambda: server.engine.num_running == 0)
    assert server.engine.block_manager.usage == 0


# -- Envoy ext_proc ----------------------------------------------------------------------------------
def headers_message(path: str, end_of_stream: bool, extra=()) -> ep.ProcessingRequest:
    values = [(":method", "POST" if not end_of_stream else "GET"), (":path", path), ("content-type", "application/json"),
              *extra]
    return ep.ProcessingRequest(request_headers=ep.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in values]),
        end_of_stream=end_of_stream))


def body_messages(body: dict, chunks: int = 2) -> list[ep.ProcessingRequest]:
    raw = json.dumps(body).encode()
    cut = len(raw) // chunks
    parts = [raw[i * cut:(i + 1) * cut if i < chunks - 1 else None] for i in range(chunks)]
    return [ep.ProcessingRequest(request_body=ep.HttpBody(body=p, end_of_stream=i == chunks - 1))
            for i, p in enumerate(parts)]


def ext_proc(gateway, messages: list[ep.ProcessingRequest]) -> list[ep.ProcessingResponse]:
    with grpc.insecure_channel(f"127.0.0.1:{gateway.ports['ext_proc']}") as channel:
        return list(ep_grpc.ExternalProcessorStub(channel).Process(iter(messages)))


def destination(response: ep.ProcessingResponse) -> tuple[str, str]:
    """(header value, dynamic metadata value) of a routing answer."""
    phase = response.WhichOneof("response")
    common = getattr(response, phase).response
    header = {h.header.key: h.header.raw_value.decode() for h in common.header_mutation.set_headers}
    metadata = response.dynamic_metadata.fields["envoy.lb"].struct_value.fields["x-gateway-destination-endpoint"]
    return header["x-gateway-destination-endpoint"], metadata.string_value


async def test_ext_proc_reports_the_end_of_a_response_it_sees():
    from kubeinfer.gateway.datastore.endpoints import Endpoint, EndpointPool, EngineState
    from kubeinfer.gateway.handlers.extproc import ExternalProcessor
    from kubeinfer.gateway.scheduling.picker import Picker
    from kubeinfer.gateway.handlers.routing import Router

    pod = Endpoint("10.0.0.1:8000")
    pod.record_scrape(EngineState(), frozenset({"base"}), frozenset({"base"}))
    pool = EndpointPool()
    pool.set_members([pod])
    processor = ExternalProcessor(Router(Picker(pool, PickerConfig())))

    async def run(messages):
        async def stream():
            for message in messages:
                yield message
        return [reply async for reply in processor.Process(stream(), None)]

    request = [headers_message("/v1/completions", False), *body_messages({"model": "base", "prompt": "x"})]
    response_headers = ep.ProcessingRequest(response_headers=ep.HttpHeaders())
    await run(request)  # Envoy sends no response phases: the request stays counted until a scrape sees it
    assert pod.num_unseen == 1
    await run([*request, response_headers,
               ep.ProcessingRequest(response_body=ep.HttpBody(body=b"{}", end_of_stream=True))])
    assert pod.num_unseen == 1  # that one ended with its body
    await run([*request, response_headers])  # the client went away mid-response: the stream closed
    assert pod.num_unseen == 1


async def test_ext_proc_moves_the_load_to_the_pod_a_retry_landed_on():
    from google.protobuf import struct_pb2

    from kubeinfer.gateway.datastore.endpoints import Endpoint, EndpointPool, EngineState
    from kubeinfer.gateway.handlers.extproc import ExternalProcessor
    from kubeinfer.gateway.scheduling.picker import Picker
    from kubeinfer.gateway.handlers.routing import Router

    pods = [Endpoint(f"10.0.0.{i}:8000") for i in (1, 2)]
    for pod in pods:
        pod.record_scrape(EngineState(), frozenset({"base"}), frozenset({"base"}))
    pool = EndpointPool()
    pool.set_members(pods)
    processor = ExternalProcessor(Router(Picker(pool, PickerConfig())))
    seen = {}

    async def stream():
        yield headers_message("/v1/completions", False)
        for message in body_messages({"model": "base", "prompt": "x"}):
            yield message
        picked = next(p for p in pods if p.num_unseen)
        other = next(p for p in pods if p is not picked)
        served = ep.ProcessingRequest(response_headers=ep.HttpHeaders())
        metadata = struct_pb2.Struct()
        metadata.update({"x-gateway-destination-endpoint-served": other.address})
        served.metadata_context.filter_metadata["envoy.lb"].CopyFrom(metadata)
        yield served
        seen.update(picked=picked.num_unseen, other=other.num_unseen)
        yield ep.ProcessingRequest(response_body=ep.HttpBody(body=b"{}", end_of_stream=True))

    [reply async for reply in processor.Process(stream(), None)]
    assert seen == {"picked": 0, "other": 1}  # the pick failed over: the load is where the request runs
    assert [p.num_unseen for p in pods] == [0, 0]  # and it ended there


async def test_ext_proc_sets_destination_header_and_metadata(gateway, engines):
    body = {"model": "mlp", "prompt": PROMPTS[0], "max_tokens": 4}
    messages = [headers_message("/v1/completions", False), *body_messages(body, chunks=3),
                ep.ProcessingRequest(response_headers=ep.HttpHeaders()),
                ep.ProcessingRequest(response_body=ep.HttpBody(body=b"{}", end_of_stream=True))]
    responses = await asyncio.to_thread(ext_proc, gateway, messages)
    kinds = [r.WhichOneof("response") for r in responses]
    assert kinds == ["request_headers", "request_body", "request_body", "request_body", "response_headers",
                     "response_body"]
    header, metadata = destination(responses[3])
    assert header == metadata and header.split(",")[0] == address(engines["pod-mlp"])
    assert responses[3].request_body.response.clear_route_cache
    # Base-model requests may go anywhere, with the other pods as fallbacks after a comma.
    responses = await asyncio.to_thread(ext_proc, gateway, [headers_message("/v1/completions", False),
                                                            *body_messages({"model": "base", "prompt": "hi"}, 1)])
    header, _ = destination(responses[-1])
    assert sorted(header.split(",")) == sorted(address(s) for s in engines.values())


async def test_ext_proc_immediate_responses(gateway, engines):
    responses = await asyncio.to_thread(ext_proc, gateway, [headers_message("/v1/completions", False),
                                                            *body_messages({"model": "nope", "prompt": "x"}, 1)])
    immediate = responses[-1].immediate_response
    assert immediate.status.code == 404 and json.loads(immediate.body)["error"]["code"] == 404
    # GET /v1/models has no body: routed on its headers alone.
    header, _ = destination((await asyncio.to_thread(ext_proc, gateway, [headers_message("/v1/models", True)]))[0])
    assert header.split(",")[0] in {address(s) for s in engines.values()}
    dead = await start_gateway([f"http://127.0.0.1:{free_port()}"])
    try:
        responses = await asyncio.to_thread(ext_proc, dead, [headers_message("/v1/completions", False),
                                                             *body_messages({"model": "base", "prompt": "x"}, 1)])
        assert responses[-1].immediate_response.status.code == 503
    finally:
        await dead.stop()


async def test_ext_proc_health(gateway):
    """The services the Inference Extension's protocol names: liveness, readiness and ext_proc itself."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    def check(service):
        with grpc.insecure_channel(f"127.0.0.1:{gateway.ports['ext_proc']}") as channel:
            return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service)).status
    for service in ("", "liveness", "readiness", "envoy.service.ext_proc.v3.ExternalProcessor"):
        assert await asyncio.to_thread(check, service) == health_pb2.HealthCheckResponse.SERVING, service


def full_duplex(message: ep.ProcessingRequest) -> ep.ProcessingRequest:
    """The first message as Envoy 1.34+ sends it for FULL_DUPLEX_STREAMED request and response bodies."""
    from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2

    mode = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
    message.protocol_config.CopyFrom(ep.ProtocolConfiguration(request_body_mode=mode, response_body_mode=mode))
    return message


async def test_ext_proc_full_duplex_answers_headers_after_the_body_and_returns_every_byte(gateway, engines):
    """In FULL_DUPLEX_STREAMED Envoy forwards only what the server sends back: the headers' answer (with the
    destination and the new Content-Length) must wait for the whole body, and the body must come back whole."""
    body = {"model": "attn", "prompt": PROMPTS[1], "max_tokens": 4}
    raw = json.dumps(body).encode()
    chunks = [b"data: one\n\n", b"data: [DONE]\n\n"]
    messages = [full_duplex(headers_message("/v1/completions", False)), *body_messages(body, chunks=3),
                ep.ProcessingRequest(response_headers=ep.HttpHeaders()),
                *(ep.ProcessingRequest(response_body=ep.HttpBody(body=c, end_of_stream=i == len(chunks) - 1))
                  for i, c in enumerate(chunks))]
    responses = await asyncio.to_thread(ext_proc, gateway, messages)
    assert [r.WhichOneof("response") for r in responses] == ["request_headers", "request_body", "response_headers",
                                                             "response_body", "response_body"]
    header, metadata = destination(responses[0])
    assert header == metadata and header.split(",")[0] == address(engines["pod-attn"])
    headers = {h.header.key: h.header.raw_value for h in responses[0].request_headers.response.header_mutation.set_headers}
    assert headers["content-length"] == str(len(raw)).encode()
    returned = responses[1].request_body.response.body_mutation.streamed_response
    assert returned.body == raw and returned.end_of_stream
    echoed = [r.response_body.response.body_mutation.streamed_response for r in responses[3:]]
    assert [e.body for e in echoed] == chunks and [e.end_of_stream for e in echoed] == [False, True]
    # A refusal is one immediate response, whatever the mode.
    refused = await asyncio.to_thread(ext_proc, gateway, [full_duplex(headers_message("/v1/completions", False)),
                                                          *body_messages({"model": "nope", "prompt": "x"}, 2)])
    assert [r.WhichOneof("response") for r in refused] == ["immediate_response"]


async def test_ext_proc_picks_only_from_the_subset_hint(gateway, engines):
    from google.protobuf import struct_pb2

    def with_subset(addresses):
        message = headers_message("/v1/completions", False)
        hint = struct_pb2.Struct()
        hint.update({"x-gateway-destination-endpoint-subset": addresses})
        message.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
        return message

    only = address(engines["pod-base"])
    for _ in range(3):  # without the hint, load and chance would spread these over all three pods
        responses = await asyncio.to_thread(ext_proc, gateway, [with_subset([only]),
                                                                *body_messages({"model": "base", "prompt": "hi"}, 1)])
        assert destination(responses[-1])[0] == only
    responses = await asyncio.to_thread(ext_proc, gateway, [with_subset(["10.9.9.9:8000"]),
                                                            *body_messages({"model": "base", "prompt": "hi"}, 1)])
    assert responses[-1].immediate_response.status.code == 503


async def test_an_endpoint_that_fails_mid_request_gives_502_not_a_resend():
    """An engine that accepts the request and then drops the connection, with no other pod to move it to:
    502 naming the cause, and never resent to the same pod (test_gateway_faults.py: with another pod)."""
    models = json.dumps({"object": "list", "data": [{"id": "base", "parent": None}]}).encode()
    posts = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        method, path = head.split(b" ")[:2]
        if method == b"POST":
            posts.append(path)
            writer.close()  # took the request, then died
            return
        body = models if path == b"/v1/models" else b""
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\ncontent-type: application/json\r\n\r\n%s"
                     % (len(body), body))
        await writer.drain()
        writer.close()

    flaky = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = flaky.sockets[0].getsockname()[1]
    gateway = await start_gateway([f"http://127.0.0.1:{port}"])
    try:
        async with httpx.AsyncClient() as http:
            response = await complete(http, gateway, "base", [1, 2])
        assert response.status_code == 502 and "RemoteProtocolError" in response.json()["error"]["message"]
        assert posts == [b"/v1/completions"]  # sent once, not resent
    finally:
        await gateway.stop()
        flaky.close()


async def test_the_scraper_reads_models_less_often_than_load():
    """/metrics every scrape; /v1/models on the first, then on its own interval, or when the metrics name an
    adapter the gateway has not seen on that pod (one just loaded)."""
    from collections import Counter

    from kubeinfer.gateway.datastore.endpoints import Endpoint
    from kubeinfer.gateway.datastore.scraper import Scraper

    calls, running = Counter(), {"adapters": ""}

    def pod(request: httpx.Request) -> httpx.Response:
        calls[request.url.path] += 1
        if request.url.path == "/metrics":
            return httpx.Response(200, text=f'vllm:num_requests_waiting{{model_name="base"}} 0\n'
                                            f'vllm:lora_requests_info{{max_lora="2",running_lora_adapters='
                                            f'"{running["adapters"]}",waiting_lora_adapters=""}} 1.7e9\n')
        if request.url.path == "/v1/models":
            names = ["base", *filter(None, running["adapters"].split(","))]
            return httpx.Response(200, json={"data": [{"id": n, "parent": None if n == "base" else "base"}
                                                      for n in names]})
        return httpx.Response(200)

    endpoint = Endpoint("10.0.0.1:8000")
    scraper = Scraper(None, client=httpx.AsyncClient(transport=httpx.MockTransport(pod)), models_interval=3600)
    for _ in range(5):
        assert await scraper.scrape(endpoint)
    assert (calls["/metrics"], calls["/v1/models"]) == (5, 1) and endpoint.models == {"base"}
    running["adapters"] = "fresh"
    assert await scraper.scrape(endpoint)
    assert calls["/v1/models"] == 2 and "fresh" in endpoint.models and endpoint.base_models == {"base"}
    await scraper.close()
