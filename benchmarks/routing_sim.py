"""A discrete-event simulation of a pool of engine pods, routed by the gateway's real `Picker`.

Each simulated pod is a vLLM-style engine in miniature: continuous batching in steps (chunked prefill
under a token budget, plus one decode token per running sequence), a step time that grows with the
uncached prompt tokens prefilled and with the batch size, a KV cache of fixed blocks whose shared
system-prompt blocks stay cached after use and are evicted least recently used first, and `max_loras`
adapter slots where activating an adapter costs a load. Routing goes through the same `Picker` the
gateway runs: every `scrape_interval` the pods' gauges are written into `Endpoint` objects with
`record_scrape`, as the gateway's scraper does, and between scrapes the picker only knows what it
dispatched itself (and, with `report_ends`, which of those requests have ended). The round-robin baseline is the same `Picker` with `policy="round-robin"`.

With `gateways` > 1, that many independent pickers (gateway replicas behind one Service, which spreads
requests over them at random) each scrape every pod on their own staggered schedule, and each knows
only its own dispatches and its own prefix index, as the real replicas do. The gateway's own cost:
the CPU time of every real `pick` is measured (reported as cores per replica), and `pick_delay_s` (a
fixed figure, e.g. the measured median, so that runs stay deterministic) delays each dispatch.

With `precise`, the pods publish KV events as the engines do (`BlockStored` when a system prompt's blocks
are computed, `BlockRemoved` for each block evicted), delivered `event_delay_s` later to each replica's
`KVBlockIndex`, and the picker scores prefixes with `PrecisePrefixScorer` on the request's token ids
(synthetic: a family's blocks have token ids of their own, a question's are unique).

Deterministic: the workload, the placement and the picker's tie-breaking are all seeded.
"""
from __future__ import annotations

import heapq
import math
import random
import statistics
import time
import zlib
from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace

from kubeinfer.gateway.datastore.endpoints import Endpoint, EndpointPool, EngineState
from kubeinfer.gateway.datastore.kv_block_index import KVBlockIndex
from kubeinfer.gateway.datastore.kv_event_wire import BlockRemoved, BlockStored
from kubeinfer.gateway.scheduling.picker import Picker, PickerConfig, RoutingRequest
from kubeinfer.gateway.scheduling.precise_prefix import PrecisePrefixScorer
from kubeinfer.gateway.scheduling.prompt_tokens import Tokenizers

BASE = "base"
CHARS_PER_TOKEN = 4  # the gateway hashes 64-character chunks, about one 16-token KV block
SCRAPE_INTERVAL_S = 0.25  # the gateway's default --scrape-interval


@dataclass(frozen=True)
class PodSpec:
    """Cost model of one pod: roughly an 8B model in bf16 on one A100-40GB-class GPU (about 100k tokens of
    KV cache). Only ratios between policies are reported, so the absolute numbers matter little."""
    kv_blocks: int = 6250
    block_size: int = 16
    max_num_seqs: int = 128
    max_batched_tokens: int = 4096  # chunked-prefill budget per step
    step_overhead_s: float = 0.010  # a decode step with an empty batch: reading the weights once
    prefill_s_per_token: float = 0.00006
    decode_s_per_seq: float = 0.0001  # each running sequence's KV is read every step
    max_loras: int = 4
    adapter_load_s: float = 0.02  # host memory -> GPU slot


@dataclass(frozen=True)
class Workload:
    """Chat traffic: each request is a system prompt shared with others (the base model has many, each
    adapter its own), then a question of its own. Requests arrive in bursts (Poisson burst times,
    geometric burst sizes); popularity of prompts and adapters is Zipf-like."""
    requests: int
    rate: float  # requests per second, over the whole pool
    burst_mean: float = 6.0
    base_system_prompts: int = 100
    adapters: int = 50
    replicas_per_adapter: int = 16
    adapter_share: float = 0.5
    system_tokens: tuple[int, int] = (1000, 4000)
    question_tokens: tuple[int, int] = (50, 400)
    output_tokens: tuple[int, int] = (50, 300)
    zipf: float = 0.8
    seed: int = 0


@dataclass
class SimRequest:
    id: int
    arrival: float
    model: str
    system_id: int
    shared_blocks: int  # full KV blocks of the system prompt: what another request can share
    prompt_tokens: int
    output_tokens: int
    text: str  # what the picker hashes
    pod: int | None = None  # where it was routed
    gateway: int = 0  # which gateway replica routed it
    sent: float = 0.0  # the picker's dispatch ticket
    first_token_at: float | None = None
    finished_at: float | None = None
    cached_tokens: int = 0
    # engine-side progress
    to_prefill: int = 0
    private_blocks: int = 0


def system_text(model: str, system_id: int, tokens: int) -> str:
    head = f"<system {model}/{system_id}> "
    return (head + "You are a careful assistant. " * (tokens * CHARS_PER_TOKEN // 29 + 1))[:tokens * CHARS_PER_TOKEN]


def family_block_tokens(family: tuple[str, int], j: int, block_size: int) -> list[int]:
    """Token ids of block `j` of a system prompt: the same for every request of the family, unlike any other's."""
    fid = (zlib.crc32(family[0].encode()) & 0xFFFF) * 1_000_003 + family[1]
    return [(fid << 24) + j * block_size + k for k in range(block_size)]


_FAMILY_TOKENS: dict = {}


def request_token_ids(r: SimRequest, block_size: int) -> list[int]:
    key = (r.model, r.system_id, r.shared_blocks, block_size)
    if key not in _FAMILY_TOKENS:
        _FAMILY_TOKENS[key] = [t for j in range(r.shared_blocks)
                               for t in family_block_tokens((r.model, r.system_id), j, block_size)]
    shared = _FAMILY_TOKENS[key]
    return shared + [-(r.id * 100_000 + k) - 1 for k in range(r.prompt_tokens - len(shared))]


class SimTokens(Tokenizers):
    """The simulated request's token ids are in its body."""

    def prompt_ids(self, model, body):
        return body["ids"]


def zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (k + 1) ** s for k in range(n)]


def build_workload(w: Workload, block_size: int = 16) -> list[SimRequest]:
    rng = random.Random(w.seed)
    prompts: dict[tuple[str, int], tuple[int, str]] = {}

    def system_prompt(model: str, system_id: int) -> tuple[int, str]:
        if (model, system_id) not in prompts:
            tokens = rng.randint(*w.system_tokens)
            prompts[model, system_id] = tokens, system_text(model, system_id, tokens)
        return prompts[model, system_id]

    base_weights, adapter_weights = zipf_weights(w.base_system_prompts, w.zipf), zipf_weights(w.adapters, w.zipf)
    requests, now = [], 0.0
    while len(requests) < w.requests:
        now += rng.expovariate(w.rate / w.burst_mean)
        burst = 1 + int(math.log(1 - rng.random()) / math.log(1 - 1 / w.burst_mean))  # geometric, mean burst_mean
        for _ in range(min(burst, w.requests - len(requests))):
            if w.adapters and rng.random() < w.adapter_share:
                model, system_id = f"adapter-{rng.choices(range(w.adapters), adapter_weights)[0]}", 0
            else:
                model, system_id = BASE, rng.choices(range(w.base_system_prompts), base_weights)[0]
            sys_tokens, sys_text = system_prompt(model, system_id)
            question = rng.randint(*w.question_tokens)
            text = sys_text + f"[question {len(requests)}]".ljust(question * CHARS_PER_TOKEN, ".")
            requests.append(SimRequest(len(requests), now, model, system_id, sys_tokens // block_size,
                                       sys_tokens + question, rng.randint(*w.output_tokens), text))
    return requests


def place_adapters(pods: int, adapters: int, replicas: int) -> list[list[str]]:
    """Each adapter on `replicas` consecutive pods of a cycle: pods hold equal numbers, give or take one."""
    placed: list[list[str]] = [[] for _ in range(pods)]
    for a in range(adapters):
        for r in range(min(replicas, pods)):
            placed[(a * replicas + r) % pods].append(f"adapter-{a}")
    return placed


class Pod:
    def __init__(self, spec: PodSpec, adapters: list[str]) -> None:
        self.spec = spec
        self.models = frozenset([BASE, *adapters])
        self.waiting: deque[SimRequest] = deque()
        self.prefilling: list[SimRequest] = []
        self.decoding: list[tuple[int, int, SimRequest]] = []  # heap by finish step
        # Prefix cache, per system prompt ("family"): its leading blocks cached. Blocks are freed tail first
        # (as vLLM frees a sequence's blocks in reverse), so what stays of a family is always a prefix.
        self.cached: dict[tuple[str, int], int] = {}  # family -> leading blocks cached
        self.cached_blocks = 0
        self.refs: dict[tuple[str, int], int] = {}  # family -> running requests using it
        self.evictable: OrderedDict[tuple[str, int], None] = OrderedDict()  # unreferenced families, LRU first
        self.evictable_blocks = 0
        self.private_blocks = 0  # each request's own blocks: its question and its output
        self.slots: OrderedDict[str, None] = OrderedDict()  # adapters on the GPU, LRU first
        self.adapter_running: dict[str, int] = {}
        self.steps = 0
        self.busy = False
        self.pending_load_s = 0.0
        self.prefix_queries = self.prefix_hits = self.adapter_loads = 0
        self.events: list | None = None  # KV events since the last flush (precise routing), else None

    def _stored(self, family: tuple[str, int], start: int, end: int) -> None:
        if self.events is not None and end > start:
            bs = self.spec.block_size
            tokens = [t for j in range(start, end) for t in family_block_tokens(family, j, bs)]
            self.events.append(BlockStored([(family, j) for j in range(start, end)],
                                           (family, start - 1) if start else None, tokens, bs,
                                           lora_name=family[0] if family[0] != BASE else None))

    def _removed(self, family: tuple[str, int], start: int, end: int) -> None:
        if self.events is not None and end > start:
            self.events.append(BlockRemoved([(family, j) for j in range(start, end)]))

    @property
    def running(self) -> int:
        return len(self.prefilling) + len(self.decoding)

    def state(self) -> EngineState:
        """What this pod's /metrics would say, parsed as `parse_engine_metrics` does."""
        used = self.cached_blocks - self.evictable_blocks + self.private_blocks
        return EngineState(waiting=len(self.waiting), running=self.running, kv_usage=used / self.spec.kv_blocks,
                           running_adapters=frozenset(a for a, n in self.adapter_running.items() if n),
                           waiting_adapters=frozenset(r.model for r in self.waiting if r.model != BASE),
                           max_loras=self.spec.max_loras)

    # -- scheduling ------------------------------------------------------------------------------
    def _activate(self, adapter: str) -> bool:
        if adapter == BASE or adapter in self.slots:
            if adapter in self.slots:
                self.slots.move_to_end(adapter)
            return True
        if len(self.slots) >= self.spec.max_loras:
            idle = next((a for a in self.slots if not self.adapter_running.get(a)), None)
            if idle is None:
                return False  # every slot serves running requests: wait, as vLLM does
            del self.slots[idle]
        self.slots[adapter] = None
        self.pending_load_s += self.spec.adapter_load_s
        self.adapter_loads += 1
        return True

    def _admit(self, r: SimRequest) -> bool:
        """Reserve the request's KV blocks (prompt and output, so no preemption), reusing cached ones."""
        family = (r.model, r.system_id)
        hits = self.cached.get(family, 0)
        private = -(-(r.prompt_tokens + r.output_tokens) // self.spec.block_size) - r.shared_blocks
        need = r.shared_blocks - hits + private
        free = self.spec.kv_blocks - self.cached_blocks - self.private_blocks
        pinned_now = hits if family in self.evictable else 0
        if free + self.evictable_blocks - pinned_now < need:
            return False
        if family in self.evictable:
            del self.evictable[family]
            self.evictable_blocks -= hits
        self.refs[family] = self.refs.get(family, 0) + 1
        while free < need:  # evict from the least recently used family, its tail blocks first
            victim = next(iter(self.evictable))
            take = min(self.cached[victim], need - free)
            self._removed(victim, self.cached[victim] - take, self.cached[victim])
            self.cached[victim] -= take
            self.cached_blocks -= take
            self.evictable_blocks -= take
            free += take
            if not self.cached[victim]:
                del self.cached[victim], self.evictable[victim]
        self._stored(family, hits, r.shared_blocks)
        self.cached[family] = r.shared_blocks
        self.cached_blocks += r.shared_blocks - hits
        self.private_blocks += private
        r.private_blocks = private
        r.cached_tokens = hits * self.spec.block_size
        r.to_prefill = r.prompt_tokens - r.cached_tokens
        self.prefix_queries += r.prompt_tokens
        self.prefix_hits += r.cached_tokens
        return True

    def _release(self, r: SimRequest) -> None:
        family = (r.model, r.system_id)
        self.refs[family] -= 1
        if not self.refs[family]:
            self.evictable[family] = None  # most recently used end
            self.evictable_blocks += self.cached[family]
        self.private_blocks -= r.private_blocks
        if r.model != BASE:
            self.adapter_running[r.model] -= 1

    def _schedule(self) -> None:
        kept: deque[SimRequest] = deque()
        while self.waiting and self.running < self.spec.max_num_seqs:
            r = self.waiting.popleft()
            if not self._activate(r.model):
                kept.append(r)  # no adapter slot: let later requests go first
                continue
            if not self._admit(r):
                self.waiting.appendleft(r)  # out of KV: first come, first served
                break
            if r.model != BASE:
                self.adapter_running[r.model] = self.adapter_running.get(r.model, 0) + 1
            self.prefilling.append(r)
        kept.extend(self.waiting)
        self.waiting = kept

    def start_step(self) -> tuple[float, list[tuple[SimRequest, int]]] | None:
        """Plan one engine step; returns its duration and the prefill chunks it runs, or None when idle."""
        self._schedule()
        budget = self.spec.max_batched_tokens - len(self.decoding)
        chunks = []
        for r in self.prefilling:
            if budget <= 0:
                break
            chunk = min(r.to_prefill, budget)
            chunks.append((r, chunk))
            budget -= chunk
        if not chunks and not self.decoding:
            self.pending_load_s = 0.0
            return None
        s = self.spec
        prefill_tokens = sum(c for _, c in chunks)
        duration = (s.step_overhead_s + prefill_tokens * s.prefill_s_per_token + len(self.decoding) * s.decode_s_per_seq
                    + self.pending_load_s)
        self.pending_load_s = 0.0
        return duration, chunks

    def finish_step(self, now: float, chunks: list[tuple[SimRequest, int]]) -> list[SimRequest]:
        """Apply a step's work at its end: first tokens for completed prefills, one token per decoder."""
        self.steps += 1
        done = []
        while self.decoding and self.decoding[0][0] <= self.steps:
            r = heapq.heappop(self.decoding)[2]
            r.finished_at = now
            self._release(r)
            done.append(r)
        for r, chunk in chunks:
            r.to_prefill -= chunk
            if r.to_prefill == 0:
                self.prefilling.remove(r)
                r.first_token_at = now  # the last prefill chunk samples the first token
                if r.output_tokens <= 1:
                    r.finished_at = now
                    self._release(r)
                    done.append(r)
                else:
                    heapq.heappush(self.decoding, (self.steps + r.output_tokens - 1, r.id, r))
        return done


@dataclass
class SimResult:
    policy: str
    requests: list[SimRequest]
    prefix_hit_rate: float
    adapter_loads: int
    requests_per_pod: list[int] = field(default_factory=list)
    pick_cpu_s: float = 0.0  # real CPU time of all picks, every gateway replica together
    gateways: int = 1

    def pick_cores(self) -> float:
        """Cores one gateway replica spends picking at this request rate (real CPU over simulated time)."""
        return self.pick_cpu_s / self.makespan / self.gateways

    @property
    def makespan(self) -> float:
        return max(r.finished_at for r in self.requests) - min(r.arrival for r in self.requests)

    @property
    def throughput(self) -> float:
        """Output tokens per second over the whole run, first arrival to last completion."""
        return sum(r.output_tokens for r in self.requests) / self.makespan

    def ttft(self, q: int) -> float:
        return percentile([r.first_token_at - r.arrival for r in self.requests], q)


def per_pod(requests: list[SimRequest], pods: int) -> list[int]:
    counts = [0] * pods
    for r in requests:
        counts[r.pod] += 1
    return counts


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1] if len(values) > 1 else values[0]


def simulate(pods: int, workload: Workload, policy: str, spec: PodSpec = PodSpec(),
             scrape_interval: float = SCRAPE_INTERVAL_S, picker_config: PickerConfig | None = None,
             progress=None, report_ends: bool = False, gateways: int = 1, pick_delay_s: float = 0.0,
             precise: bool = False, event_delay_s: float = 0.05) -> SimResult:
    """Run the workload through `pods` simulated engines, routed by the real picker under `policy`.
    `report_ends`: the gateway hears when each request ends (proxy mode, or ext_proc with response
    phases); otherwise its own dispatches count until a scrape sees them (ext_proc without).
    `gateways`: independent picker replicas, each request sent to one of them at random; `pick_delay_s`:
    how long a decision takes before the pod hears of the request. `precise`: the pods publish KV events,
    each replica's picker follows them (--prefix-routing precise), `event_delay_s` after the change."""
    placement = place_adapters(pods, workload.adapters, workload.replicas_per_adapter)
    sim_pods = [Pod(spec, adapters) for adapters in placement]
    # Staleness is a wall-clock guard for a live gateway; here scrapes run on the simulated clock.
    config = replace(picker_config or PickerConfig(), policy=policy, stale_after=math.inf)
    clock = [0.0]  # the simulated time: it stamps dispatches and scrapes alike
    views: list[tuple[list[Endpoint], Picker]] = []  # each gateway replica's endpoints and picker
    for g in range(gateways):
        endpoints = [Endpoint(f"10.{i // 250}.{i % 250}.1:8000", name=f"pod-{i}") for i in range(pods)]
        pool = EndpointPool()
        pool.set_members(endpoints)
        scorer = PrecisePrefixScorer(KVBlockIndex(), SimTokens(), clock=lambda: clock[0]) if precise else None
        views.append((endpoints, Picker(pool, config, rng=random.Random(workload.seed + 7919 * g),
                                        clock=lambda: clock[0], precise=scorer)))
    index_of = {e.address: i for i, e in enumerate(views[0][0])}
    front = random.Random(workload.seed + 1)  # the Service in front of the gateway replicas
    requests = build_workload(workload, spec.block_size)
    if precise:
        for pod in sim_pods:
            pod.events = []
    largest = max(r.prompt_tokens + r.output_tokens for r in requests)
    if largest > spec.kv_blocks * spec.block_size:
        raise ValueError(f"a request of {largest} tokens can never fit in {spec.kv_blocks} KV blocks of "
                         f"{spec.block_size}: raise PodSpec.kv_blocks or shorten Workload.system_tokens")

    def scrape(gateway: int) -> None:
        for endpoint, pod in zip(views[gateway][0], sim_pods):
            endpoint.record_scrape(pod.state(), pod.models, frozenset([BASE]), started=clock[0])

    events: list[tuple[float, int, str, object]] = []  # (time, tie-break, kind, payload)
    counter = 0

    def push(t: float, kind: str, payload: object) -> None:
        nonlocal counter
        counter += 1
        heapq.heappush(events, (t, counter, kind, payload))

    def start(pod: Pod, now: float) -> None:
        planned = pod.start_step()
        if pod.events:  # what this step's scheduling stored and evicted reaches the gateways a little later
            push(now + event_delay_s, "kv", (pod, pod.events))
            pod.events = []
        pod.busy = planned is not None
        if planned:
            push(now + planned[0], "step", (pod, planned[1]))

    for r in requests:
        push(r.arrival, "arrival", r)
    for g in range(gateways):
        scrape(g)
        push(scrape_interval * (1 + g / gateways), "scrape", g)  # replicas scrape out of step
    finished, pick_cpu = 0, 0.0
    while finished < len(requests):
        now, _, kind, payload = heapq.heappop(events)
        clock[0] = now
        if kind == "arrival":
            payload.gateway = front.randrange(gateways) if gateways > 1 else 0
            cpu = time.thread_time()
            body = {"ids": request_token_ids(payload, spec.block_size)} if precise else None
            decision = views[payload.gateway][1].pick(RoutingRequest(payload.model, payload.text, body=body))
            pick_cpu += time.thread_time() - cpu
            payload.pod, payload.sent = index_of[decision.endpoint.address], decision.sent
            push(now + pick_delay_s, "dispatch", payload)  # the pod hears of it once the gateway has decided
        elif kind == "dispatch":
            pod = sim_pods[payload.pod]
            pod.waiting.append(payload)
            if not pod.busy:
                start(pod, now)
        elif kind == "step":
            pod, chunks = payload
            done = pod.finish_step(now, chunks)
            finished += len(done)
            if report_ends:
                for request in done:
                    views[request.gateway][0][request.pod].record_finish(request.sent)
            if progress is not None and done:
                progress.update(len(done))
            start(pod, now)
        elif kind == "kv":
            pod, batch = payload
            address = views[0][0][sim_pods.index(pod)].address
            for _, picker in views:
                picker.precise.index.apply(address, batch)
        else:
            scrape(payload)
            push(now + scrape_interval, "scrape", payload)
    queries = sum(p.prefix_queries for p in sim_pods)
    return SimResult(policy, requests, sum(p.prefix_hits for p in sim_pods) / queries,
                     sum(p.adapter_loads for p in sim_pods), per_pod(requests, pods), pick_cpu, gateways)
