"""--prefix-routing precise: the picker scores prefixes by the KV blocks each pod holds (its events),
falls back to the approximate index where it cannot, and tokenizes prompts as the engine does."""
from __future__ import annotations

import random

import pytest
from test_gateway_picker import endpoint

from kubeinfer.gateway import cli
from kubeinfer.gateway.datastore.endpoints import EndpointPool
from kubeinfer.gateway.datastore.kv_block_index import KVBlockIndex
from kubeinfer.gateway.datastore.kv_event_wire import BlockRemoved, BlockStored
from kubeinfer.gateway.scheduling.picker import Picker, PickerConfig, RoutingRequest
from kubeinfer.gateway.scheduling.precise_prefix import PrecisePrefixScorer
from kubeinfer.gateway.scheduling.prompt_tokens import PromptTokenizer, Tokenizers

BS = 4


class FixedTokens(Tokenizers):
    """A prompt's text is its token ids, space-separated: the picker's logic without a tokenizer."""

    def prompt_ids(self, model, body):
        return [int(t) for t in body["prompt"].split()]


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def setup(*addresses, clock=None, **config):
    index = KVBlockIndex()
    clock = clock or Clock()
    pool = EndpointPool()
    pool.set_members([endpoint(a) for a in addresses])
    scorer = PrecisePrefixScorer(index, FixedTokens(), clock=clock)
    return Picker(pool, PickerConfig(**config), rng=random.Random(0), precise=scorer), index, clock


def request(tokens: list[int], model: str = "base") -> RoutingRequest:
    text = " ".join(map(str, tokens))
    return RoutingRequest(model, text, body={"model": model, "prompt": text})


def store(index, pod, tokens, lora_name=None):
    index.apply(pod, [BlockStored([f"{pod}-{i}" for i in range(len(tokens) // BS)], None, tokens, BS,
                                  lora_name=lora_name)])


def test_the_pod_that_holds_the_prefix_wins_where_the_approximate_guess_is_elsewhere():
    picker, index, clock = setup("a:1", "b:1", "c:1")
    prefix = list(range(64))
    for pod in ("a:1", "b:1", "c:1"):
        index.apply(pod, [])  # followed, nothing cached
    first = picker.pick(request(prefix)).endpoint.address
    clock.now += 10  # the in-flight entry has expired; the engine has since evicted the prefix ...
    other = next(p for p in ("a:1", "b:1", "c:1") if p != first)
    store(index, other, prefix)  # ... and another pod computed it
    assert picker.pick(request(prefix + [1, 2, 3, 4])).endpoint.address == other
    index.apply(other, [BlockRemoved([f"{other}-0"])])  # its first block evicted: nothing leads any more
    clock.now += 10
    decision = picker.pick(request(prefix))
    assert decision.scores["prefix"] == 0.0


def test_a_prefix_just_routed_sticks_before_its_events_arrive():
    picker, index, clock = setup("a:1", "b:1", "c:1", "d:1", weights={"prefix": 4.0})  # the prefix alone
    for pod in ("a:1", "b:1", "c:1", "d:1"):
        index.apply(pod, [])
    index.block_sizes[BS] += 1
    group = list(range(500, 564))
    home = picker.pick(request(group + [1])).endpoint.address
    picks = {picker.pick(request(group + [k, k, k, k])).endpoint.address for k in range(2, 5)}  # below saturation
    assert picks == {home}
    clock.now += 60  # entries are short-lived: with no event confirming them, they count no more
    assert picker.pick(request(group)).scores["prefix"] == 0.0


def test_device_blocks_outrank_offloaded_ones():
    picker, index, _ = setup("a:1", "b:1")
    tokens = list(range(32))
    index.apply("a:1", [BlockStored([f"a{i}" for i in range(8)], None, tokens, BS, medium="CPU")])
    store(index, "b:1", tokens)
    decision = picker.pick(request(tokens))
    assert decision.endpoint.address == "b:1" and decision.scores["prefix"] == 1.0


def test_adapter_requests_match_only_their_adapters_blocks():
    picker, index, _ = setup("a:1", "b:1")
    for e in picker.pool:
        object.__setattr__(e, "models", frozenset({"base", "sql"}))
    tokens = list(range(32))
    store(index, "a:1", tokens)  # the base model's blocks
    store(index, "b:1", tokens, lora_name="sql")
    assert picker.pick(request(tokens, "sql")).endpoint.address == "b:1"
    assert picker.pick(request(tokens, "base")).endpoint.address == "a:1"


def test_pods_without_events_and_requests_without_tokens_are_scored_approximately(caplog):
    picker, index, _ = setup("a:1", "b:1")
    assert picker.pick(request(list(range(64)))).scores["prefix"] == 0.0
    assert "no engine publishes KV events" in caplog.text  # said once, then approximate
    text = "word " * 400
    first = picker.pick(RoutingRequest("base", text)).endpoint.address  # no body: approximate
    assert picker.pick(RoutingRequest("base", text)).endpoint.address == first


def test_events_off_routes_exactly_as_before():
    """With --prefix-routing approximate (the default) the picker has no precise scorer: the same requests
    give the same picks as a picker built the way it was before."""
    def run(p):
        return [p.pick(RoutingRequest("base", f"group {i % 3} " * 100)).endpoint.address for i in range(30)]
    pools = []
    for _ in range(2):
        pool = EndpointPool()
        pool.set_members([endpoint(a) for a in ("a:1", "b:1", "c:1")])
        pools.append(pool)
    assert run(Picker(pools[0], PickerConfig(), rng=random.Random(5))) == \
        run(Picker(pools[1], PickerConfig(), rng=random.Random(5), precise=None))


def test_prompts_are_tokenized_as_transformers_does(llama_dir):
    from transformers import AutoTokenizer

    reference, ours = AutoTokenizer.from_pretrained(llama_dir), PromptTokenizer(llama_dir)
    messages = [{"role": "system", "content": "Tu es précis."},
                {"role": "user", "content": [{"type": "text", "text": "How many blocks? "}, {"type": "text", "text": "Two."}]}]
    flat = [messages[0], {"role": "user", "content": "How many blocks? Two."}]
    text = reference.apply_chat_template(flat, add_generation_prompt=True, tokenize=False)
    assert ours.prompt_ids({"messages": messages}) == reference.encode(text, add_special_tokens=False)
    assert ours.prompt_ids({"prompt": "plain text"}) == reference("plain text").input_ids
    assert ours.prompt_ids({"prompt": [5, 6, 7]}) == [5, 6, 7]
    tokenizers = Tokenizers([llama_dir])
    assert tokenizers.prompt_ids("any", {"messages": [{"role": "user", "content": 3}]}) is None  # template fails: None
    assert tokenizers.prompt_ids("any", {"messages": "not a list"}) is None


def test_precise_routing_needs_a_readable_tokenizer(tmp_path, capsys):
    parser = cli.argparse.ArgumentParser()
    cli.add_arguments(parser)
    with pytest.raises(SystemExit, match="--tokenizer"):
        cli.config_from_args(parser.parse_args(["--endpoints", "a:1", "--prefix-routing", "precise"]))
    with pytest.raises(SystemExit, match="no tokenizer.json"):
        cli.config_from_args(parser.parse_args(["--endpoints", "a:1", "--prefix-routing", "precise",
                                                "--tokenizer", str(tmp_path)]))
    args = parser.parse_args(["--endpoints", "a:1"])
    assert (args.prefix_routing, args.kv_events_port, args.tokenizer) == ("approximate", 5557, [])


async def test_the_router_tokenizes_admitted_requests_and_keeps_no_body_when_approximate():
    from kubeinfer.gateway.handlers.routing import Router

    picker, index, _ = setup("a:1", "b:1")
    index.apply("a:1", [BlockStored(["a-0", "a-1"], None, list(range(8)), BS)])
    body = b'{"model": "base", "prompt": "0 1 2 3 4 5 6 7 9"}'
    request, decision = await Router(picker).route_or_hold(body, {})
    assert request.token_ids == [0, 1, 2, 3, 4, 5, 6, 7, 9] and request.body is None
    assert decision.endpoint.address == "a:1" and decision.scores["prefix"] == 2 / 2
    plain = Picker(picker.pool, PickerConfig(), rng=random.Random(0))
    request, _ = await Router(plain).route_or_hold(body, {})
    assert request.body is None and request.token_ids is None
