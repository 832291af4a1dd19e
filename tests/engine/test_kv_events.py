"""KV-cache events (--kv-events-config): vLLM's wire format, read from the real ZMQ sockets on loopback and
checked against the block manager's own state."""
from __future__ import annotations

import threading

import httpx
import pytest
from kv_events_helpers import LOCAL, Subscriber, cached_index, decode, replay

from kubeinfer.engine import LLM, SamplingParams
from kubeinfer.engine.core.block_manager import ROOT_KEY, hash_block
from kubeinfer.engine.core.kv_event_publisher import KVEventsConfig

BS = 4


def _params(n: int = 6) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


@pytest.fixture
def subscribed():
    """(llm, subscriber) for an engine with events on; closed after the test."""
    made = []

    def make(model_dir, **kwargs):
        config = {**LOCAL, **kwargs.pop("events", {})}
        llm = LLM(str(model_dir), block_size=BS, kv_events_config=config, **kwargs)
        sub = Subscriber(llm.engine.kv_events.publisher.endpoint, config.get("topic", ""))
        sub.sync(llm)
        made.append((llm, sub))
        return llm, sub
    yield make
    for llm, sub in made:
        sub.close()
        llm.engine.kv_events.shutdown()


def test_request_events_chain_the_blocks_the_block_manager_registered(llama_dir, subscribed):
    llm, sub = subscribed(llama_dir, num_kv_blocks=64, events={"topic": "kv@pod-a"})
    prompt = list(range(10, 28))  # 18 tokens: 4 full blocks of the prompt, more once generated
    out = llm.generate([prompt], _params())[0]
    sub.drain(llm.engine.kv_events.publisher)
    assert {topic for topic, _, _ in sub.messages} == {b"kv@pod-a"}
    seqs = [seq for _, seq, _ in sub.messages]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)
    assert all(decode(p)["rank"] == 0 for _, _, p in sub.messages)
    stored = [e for e in sub.events() if e["type"] == "BlockStored"]
    assert stored and all(e["block_size"] == BS and e["medium"] == "GPU" and e["lora_id"] is None
                          and e["lora_name"] is None for e in stored)
    # Chained by parent: the first block has none, each later one names the hash before it.
    hashes = [h for e in stored for h in e["block_hashes"]]
    assert stored[0]["parent_block_hash"] is None
    for event in stored[1:]:
        assert event["parent_block_hash"] == hashes[hashes.index(event["block_hashes"][0]) - 1]
    # Token ids: the sequence's full blocks, in order; hashes: the block manager's keys for them.
    tokens = prompt + list(out.outputs[0].token_ids)
    full = (len(tokens) - 1) // BS  # the last token is never computed
    assert [t for e in stored for t in e["token_ids"]] == tokens[:full * BS]
    parent, expected = ROOT_KEY, []
    for i in range(full):
        parent = hash_block(parent, tokens[i * BS:(i + 1) * BS])
        expected.append(parent)
    assert hashes == expected
    assert cached_index(sub.events()) == set(llm.engine.block_manager.hash_to_block)


def test_eviction_under_kv_pressure_and_reset(llama_dir, subscribed):
    llm, sub = subscribed(llama_dir, num_kv_blocks=10, max_num_seqs=2)
    prompts = [[100 + 7 * i + j for j in range(14)] for i in range(6)]  # distinct: each evicts older blocks
    for prompt in prompts:
        llm.generate([prompt], _params(4))
    sub.drain(llm.engine.kv_events.publisher)
    events = sub.events()
    removed = [h for e in events if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
    assert removed and all(e["medium"] == "GPU" for e in events if e["type"] == "BlockRemoved")
    # What a subscriber holds is exactly what the engine still has cached: no phantom, none missing.
    bm = llm.engine.block_manager
    assert cached_index(events) == set(bm.hash_to_block) and bm.hash_to_block
    assert not set(removed) & set(bm.hash_to_block)

    sub.messages.clear()
    llm.reset_prefix_cache()
    sub.drain(llm.engine.kv_events.publisher)
    assert [e["type"] for e in sub.events()] == ["AllBlocksCleared"] and not bm.hash_to_block


def test_adapter_blocks_carry_lora_id_and_name(lora_base_dir, lora_adapters, subscribed):
    llm, sub = subscribed(lora_base_dir, enable_lora=True, max_loras=1, max_lora_rank=8)
    lora = lora_adapters["attn"][0]
    llm.generate([list(range(20, 33))], _params(3), lora_request=lora)
    sub.drain(llm.engine.kv_events.publisher)
    stored = [e for e in sub.events() if e["type"] == "BlockStored"]
    assert stored and all(e["lora_id"] == lora.lora_int_id and e["lora_name"] == lora.lora_name for e in stored)
    assert cached_index(sub.events()) == set(llm.engine.block_manager.hash_to_block)


def test_windowed_models_report_the_full_attention_pool(tmp_path, subscribed):
    from kubeinfer.dev.testing.random_model import build_random_model

    layers = ["sliding_attention", "full_attention", "sliding_attention"]
    gemma = build_random_model(tmp_path / "gemma3", "gemma3", tokenizer=False, seed=12, num_layers=3,
                               sliding_window=8, layer_types=layers)
    llm, sub = subscribed(gemma, max_num_batched_tokens=16)
    llm.generate([list(range(20, 60))], _params(4))
    sub.drain(llm.engine.kv_events.publisher)
    bm = llm.engine.block_manager
    assert bm.windowed.hash_to_block  # the window pool caches too, but is not what subscribers index
    assert cached_index(sub.events()) == set(bm.full.hash_to_block)
    assert len([h for e in sub.events() if e["type"] == "BlockStored" for h in e["block_hashes"]]) == 10


def test_replay_returns_the_missed_batches_from_a_bounded_buffer(llama_dir, subscribed):
    llm, sub = subscribed(llama_dir, num_kv_blocks=64, events={"buffer_steps": 4})
    for i in range(4):
        llm.generate([[30 + i] * 9], _params(4))
    sub.drain(llm.engine.kv_events.publisher)
    live = [(seq, payload) for _, seq, payload in sub.messages]
    assert len(live) > 4
    replay_endpoint = llm.engine.kv_events.publisher.replay_endpoint
    missed_from = live[-3][0]  # a subscriber that saw everything before this sequence number
    assert replay(replay_endpoint, missed_from) == live[-3:]
    assert replay(replay_endpoint, 0) == live[-4:]  # older batches are gone from the 4-step buffer
    assert replay(replay_endpoint, live[-1][0] + 1) == []


def test_a_stalled_socket_drops_and_counts_but_never_blocks_a_step(llama_dir, subscribed):
    llm, sub = subscribed(llama_dir, num_kv_blocks=64, events={"max_queue_size": 2})
    publisher = llm.engine.kv_events.publisher
    stall, stalled, send = threading.Event(), threading.Event(), publisher._send

    def stuck_send(payload):  # the fault: the publisher thread hangs on its socket
        stalled.set()
        stall.wait(30)
        send(payload)
    publisher._send = stuck_send
    try:
        out = llm.generate([list(range(40, 90))], _params(24))[0]
        assert len(out.outputs[0].token_ids) == 24  # every step ran though nothing was sent
        assert stalled.is_set() and publisher.dropped > 0
    finally:
        stall.set()


def test_served_engine_names_its_events_address_and_counts(llama_dir):
    from server_harness import RunningServer

    with RunningServer(llama_dir, block_size=BS, kv_events_config=LOCAL) as server:
        load = httpx.get(server.url + "/load").json()
        publisher = server.async_engine.engine.kv_events.publisher
        assert load["kv_events"] == {"endpoint": publisher.endpoint, "replay_endpoint": publisher.replay_endpoint,
                                     "topic": ""}
        assert load["kv_events"]["endpoint"].startswith("tcp://127.0.0.1:")
        httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "hello there", "max_tokens": 2},
                   timeout=60).raise_for_status()
        metrics = httpx.get(server.url + "/metrics").text
        assert 'kubeinfer:kv_events_dropped_total{model_name="tiny"} 0.0' in metrics
        assert "kubeinfer:kv_events_published_total" in metrics
        assert 'kubeinfer:kv_events_replays_refused_total{model_name="tiny"} 0.0' in metrics
        assert "kv_events_subscribers_refused" not in metrics  # no key: no CURVE
    with RunningServer(llama_dir, block_size=BS) as server:
        assert httpx.get(server.url + "/load").json()["kv_events"] is None
        assert "kv_events" not in httpx.get(server.url + "/metrics").text


@pytest.mark.parametrize("config, named", [
    ('{"enable_kv_cache_events": true, "endpont": "tcp://*:5557"}', "endpont"),
    ({"enable_kv_cache_events": True, "publisher": "kafka"}, "kafka"),
    ("{not json", "not valid JSON"),
    ({"enable_kv_cache_events": True, "buffer_steps": 0}, "buffer_steps"),
])
def test_bad_config_is_a_startup_error_naming_it(config, named):
    with pytest.raises(ValueError, match=named):
        KVEventsConfig.parse(config)


def test_config_defaults_are_vllms():
    assert KVEventsConfig.parse(None) is None
    assert KVEventsConfig.parse('{"enable_kv_cache_events": false, "publisher": "zmq"}') is None
    config = KVEventsConfig.parse('{"enable_kv_cache_events": true}')
    assert (config.publisher, config.endpoint, config.replay_endpoint, config.topic) == ("zmq", "tcp://*:5557",
                                                                                        None, "")


def test_serve_refuses_an_unknown_key_before_loading(llama_dir, capsys):
    from kubeinfer.cli import main

    with pytest.raises(SystemExit) as exit_info:
        main(["serve", llama_dir, "--kv-events-config", '{"enable_kv_cache_events": true, "hwm_x": 1}'])
    assert "hwm_x" in str(exit_info.value)


def test_a_send_that_would_block_is_dropped_counted_and_leaves_a_gap():
    import time

    import zmq

    from kubeinfer.engine.core.kv_event_publisher import ZmqEventPublisher
    from kubeinfer.engine.core.kv_events import AllBlocksCleared, KVEventBatch

    publisher = ZmqEventPublisher(KVEventsConfig.parse({**LOCAL, "replay_endpoint": None}))
    real, calls = publisher._pub, []

    class WouldBlock:  # the fault: the socket refuses without waiting (zmq.NOBLOCK's EAGAIN)
        def send_multipart(self, frames, flags=0):
            calls.append(flags)
            if len(calls) == 1:
                raise zmq.Again()
            return real.send_multipart(frames, flags=flags)
    publisher._pub = WouldBlock()
    try:
        for _ in range(2):
            publisher.publish(KVEventBatch(ts=0.0, events=[AllBlocksCleared()]))
        deadline = time.time() + 10
        while publisher._next_seq < 2 and time.time() < deadline:
            time.sleep(0.01)
        assert publisher.dropped == 1 and publisher.published == 1 and calls == [zmq.NOBLOCK] * 2
        assert [seq for seq, _ in publisher._buffer] == [1]  # seq 0 is the gap a subscriber sees
    finally:
        publisher._pub = real
        publisher.shutdown()
