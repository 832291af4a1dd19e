"""Issue #44, finding 4: KV events carry every tenant's token ids, so where the engine has an API key only the
gateway (holding the same key) may subscribe. ZMQ CURVE on the engine's PUB and replay sockets, keys derived
from the API key (kubeinfer/common/kv_events_curve.py); engines without a key, and vLLM's, work as before."""
from __future__ import annotations

import time

import pytest
import zmq
from kv_events_helpers import LOCAL, WAIT_S
from parallel_helpers import serve_parser

from kubeinfer.engine import LLM, SamplingParams
from kubeinfer.gateway.datastore.kv_block_index import KVBlockIndex
from kubeinfer.gateway.datastore.kv_event_subscriber import EventSource, KVEventSubscriber
from kubeinfer.common.kv_events_curve import CurveKeys

KEY = "engine-api-key-for-tests"
POD = "127.0.0.1:8000"
LISTEN_S = 1.5  # how long a subscriber without the key is given to receive anything (a bound, not a timing)


@pytest.fixture
def keyed(llama_dir):
    """An engine with events on and an API key."""
    llm = LLM(str(llama_dir), block_size=4, num_kv_blocks=64, kv_events_config=dict(LOCAL), kv_events_key=KEY)
    yield llm
    llm.engine.kv_events.shutdown()


def _sub(ctx: zmq.Context, endpoint: str, keys: tuple[bytes, bytes, bytes] | None = None,
         kind: int = zmq.SUB) -> zmq.Socket:
    """A socket to the engine; `keys`: (server public, client public, client secret) for CURVE."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if keys is not None:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = keys
    if kind == zmq.SUB:
        sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(endpoint)
    return sock


def _gateway_keys(key: str = KEY) -> tuple[bytes, bytes, bytes]:
    keys = CurveKeys.from_api_key(key)
    return keys.server_public, keys.client_public, keys.client_secret


def test_an_engine_with_a_key_announces_curve(keyed):
    publisher = keyed.engine.kv_events.publisher
    assert keyed.engine.kv_events.report() == {"endpoint": publisher.endpoint, "topic": "", "auth": "curve",
                                               "replay_endpoint": publisher.replay_endpoint}


def test_a_subscriber_without_the_key_gets_nothing(keyed):
    endpoint = keyed.engine.kv_events.publisher.endpoint
    ctx = zmq.Context()
    stranger_public, stranger_secret = zmq.curve_keypair()
    others = {"plain": _sub(ctx, endpoint),
              "another key": _sub(ctx, endpoint, _gateway_keys("another key")),
              # knows the server's public key (were it ever leaked), not the gateway's client key: ZAP refuses
              "the server key only": _sub(ctx, endpoint, (_gateway_keys()[0], stranger_public, stranger_secret))}
    gateway = _sub(ctx, endpoint, _gateway_keys())
    try:
        got, deadline = {name: 0 for name in others}, time.time() + LISTEN_S
        gateway_got = 0
        while time.time() < deadline:
            keyed.reset_prefix_cache()  # publishes AllBlocksCleared
            if gateway.poll(20):
                gateway.recv_multipart()
                gateway_got += 1
            for name, sock in others.items():
                while sock.poll(0):
                    sock.recv_multipart()
                    got[name] += 1
        assert gateway_got > 0  # the engine was publishing all along: the control
        assert got == {name: 0 for name in others}
        assert keyed.engine.kv_events.publisher.zap.refused >= 1 and keyed.engine.kv_events.publisher.zap.admitted >= 1
    finally:
        for sock in (*others.values(), gateway):
            sock.close(0)
        ctx.term()


def test_the_replay_socket_answers_only_the_gateway(keyed):
    keyed.generate([list(range(10, 20))], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    endpoint = keyed.engine.kv_events.publisher.replay_endpoint
    ctx = zmq.Context()
    plain, gateway = _sub(ctx, endpoint, kind=zmq.DEALER), _sub(ctx, endpoint, _gateway_keys(), kind=zmq.DEALER)
    try:
        for sock in (plain, gateway):
            sock.send_multipart([b"", (0).to_bytes(8, "big")])
        assert gateway.poll(int(WAIT_S * 1000))
        frames = []
        while not frames or frames[-1][1] != (-1).to_bytes(8, "big", signed=True):
            assert gateway.poll(int(WAIT_S * 1000))
            frames.append(gateway.recv_multipart())
        assert len(frames) > 1  # batches, then the end marker
        assert not plain.poll(int(LISTEN_S * 1000))
    finally:
        plain.close(0)
        gateway.close(0)
        ctx.term()


def _follow(llm, curve_key: str | None, auth: str | None):
    publisher = llm.engine.kv_events.publisher
    index = KVBlockIndex()
    source = EventSource(publisher.endpoint, publisher.replay_endpoint, "", auth)
    return index, KVEventSubscriber(index, lambda: {POD: source}, lost_after=WAIT_S, curve_key=curve_key)


def _catch_up(llm, index, sub) -> None:
    """Until the subscriber's index holds exactly the engine's cached blocks (each new request publishes)."""
    publisher, deadline, i = llm.engine.kv_events.publisher, time.time() + WAIT_S, 0
    while time.time() < deadline:
        sub.step(20)
        stream = sub.streams.get(POD)
        sent = publisher._next_seq >= publisher.enqueued
        if (stream is not None and sent and stream.last_seq == publisher._next_seq - 1 and POD in index.pods
                and index.pods[POD].engine_hashes() == set(llm.engine.block_manager.hash_to_block)):
            return
        if stream is None or stream.last_seq is None:  # not connected yet: ZMQ drops what it sent before
            llm.generate([[300 + i, 1, 2, 3, 4]], SamplingParams(max_tokens=1, temperature=0.0))
            i += 1
    raise AssertionError("the gateway's index did not reach the engine's cache")


def test_the_gateway_with_the_key_follows_a_keyed_engine_and_its_replay(keyed):
    keyed.generate([list(range(40, 57))], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    index, sub = _follow(keyed, KEY, "curve")
    try:
        _catch_up(keyed, index, sub)  # batches sent before it subscribed came from the (CURVE) replay socket
        assert sub.streams[POD].stats["replayed"] >= 1 and index.keys_of(POD)
    finally:
        sub.stop()


def test_a_keyless_engine_works_with_a_gateway_with_or_without_a_key(llama_dir):
    llm = LLM(str(llama_dir), block_size=4, num_kv_blocks=64, kv_events_config=dict(LOCAL))
    assert "auth" not in llm.engine.kv_events.report() and llm.engine.kv_events.publisher.zap is None
    try:
        for key in (None, KEY):  # the key does not matter to an engine that does not announce CURVE (vLLM's too)
            index, sub = _follow(llm, key, None)
            try:
                llm.generate([list(range(60, 75))], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
                _catch_up(llm, index, sub)
                assert index.keys_of(POD)
            finally:
                sub.stop()
    finally:
        llm.engine.kv_events.shutdown()


def test_a_gateway_without_the_key_leaves_a_curve_engine_alone():
    index = KVBlockIndex()
    sub = KVEventSubscriber(index, lambda: {POD: EventSource("tcp://127.0.0.1:1", auth="curve")})
    try:
        sub.step(0)
        assert POD in sub.unfollowed and POD not in sub.streams and POD not in index.pods
    finally:
        sub.stop()


@pytest.mark.parametrize("argv, key", [(["--api-key", "s3cr3t"], "s3cr3t"),
                                       (["--api-key", "s3cr3t", "--kv-events-auth", "none"], None), ([], None)])
def test_serve_keys_the_kv_event_sockets_with_its_api_key(argv, key, monkeypatch):
    from kubeinfer.engine.entrypoints.serve import engine_config

    for name in ("KUBEINFER_API_KEY", "VLLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    args = serve_parser().parse_args(["model", *argv])
    assert engine_config(args, []).kv_events_key == key
    assert "s3cr3t" not in repr(engine_config(args, []))  # the key never reaches a log line


def test_keys_are_derived_from_the_api_key_alone():
    a, again, b = CurveKeys.from_api_key("a"), CurveKeys.from_api_key("a"), CurveKeys.from_api_key("b")
    assert a == again and a.server_public != b.server_public and a.client_public != b.client_public
    assert a.server_public != a.client_public
    assert zmq.curve_public(a.server_secret) == a.server_public and zmq.curve_public(a.client_secret) == a.client_public
    assert a.server_secret.decode() not in repr(a) and a.client_secret.decode() not in repr(a)
    with pytest.raises(ValueError):
        CurveKeys.from_api_key("")


@pytest.mark.parametrize("key", [KEY, None])
def test_the_gateways_engine_key_keys_its_subscriber(key):
    from kubeinfer.gateway.app import Gateway, GatewayConfig

    gateway = Gateway(GatewayConfig(endpoints=["http://127.0.0.1:1"], prefix_routing="precise", engine_api_key=key))
    try:
        assert gateway.kv_subscriber.curve == (CurveKeys.from_api_key(key) if key else None)
    finally:
        gateway.kv_subscriber.stop()


def test_a_served_engine_announces_curve_behind_its_key(llama_dir):
    import httpx
    from server_harness import RunningServer

    with RunningServer(llama_dir, api_key=KEY, block_size=4, kv_events_config=dict(LOCAL), kv_events_key=KEY) as server:
        assert httpx.get(server.url + "/load").status_code == 401  # where to subscribe is the key holder's to know
        load = httpx.get(server.url + "/load", headers={"authorization": f"Bearer {KEY}"}).json()
        assert load["kv_events"]["auth"] == "curve"
        metrics = httpx.get(server.url + "/metrics").text
        assert 'kubeinfer:kv_events_subscribers_refused_total{model_name="tiny"} 0.0' in metrics


def test_without_its_zap_handler_a_curve_server_admits_nobody():
    """ZAP_ENFORCE_DOMAIN: were the engine's handler gone, libzmq would admit any CURVE client with the server
    key; with it, none (the gateway's own key included)."""
    keys, ctx = CurveKeys.from_api_key(KEY), zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    keys.serve(pub)
    endpoint = f"tcp://127.0.0.1:{pub.bind_to_random_port('tcp://127.0.0.1')}"
    sub = _sub(ctx, endpoint, _gateway_keys())
    try:
        deadline, got = time.time() + 1.0, False
        while time.time() < deadline and not got:
            pub.send_multipart([b"", b"x"])
            got = bool(sub.poll(20))
        assert not got
    finally:
        sub.close(0)
        pub.close(0)
        ctx.term()
