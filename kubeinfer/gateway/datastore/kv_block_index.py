"""Which KV blocks each engine pod holds, followed from its KV events (kv_event_wire.py).

Blocks are keyed by the gateway's own chained hash of their token ids (`block_key`), not by the
engine's hash: engines of different kinds (ours, vLLM with any `prefix_caching_hash_algo`) then agree,
and the picker can hash a request's tokens the same way. Each pod maps its engine hashes to our keys,
which is how a `BlockRemoved` (it carries only the engine's hashes) finds what to drop.
The key of a block includes the adapter that computed it (vLLM's `lora_name`, else its `lora_id`): an
adapter's blocks never match the base model's, as in the engine's own cache.
Holdings are kept per medium: "GPU" (the device tier, whatever the device) above offloaded tiers.

Written by the subscriber thread, read by the picker on the event loop: one lock, held for one event
or one lookup.

Bounds (the events come from engines, or whatever answers at their address): at most `max_blocks` blocks per
pod (a stored block beyond it is not indexed and counted: the index may miss blocks, never invents them), at
most MAX_MEDIA media per pod, and one block size per pod. A pod that breaks the last two raises IndexFault and
the subscriber forgets it. The picker hashes requests with the block size most pods report; a pod with another
is not `tracked` (scored approximately), so one pod cannot change how every request is keyed.
"""
from __future__ import annotations

import threading
from array import array
from collections import Counter

from .kv_event_wire import DEVICE, AllBlocksCleared, BlockRemoved, BlockStored, Event

ROOT = 0
MAX_BLOCKS_PER_POD = 500_000  # about 100 MB of index for one pod; a GPU holds tens of thousands of blocks
MAX_MEDIA = 8  # vLLM's tiers: GPU, CPU, DISK; a few more for new ones


class IndexFault(ValueError):
    """A pod's events contradict themselves: the subscriber forgets the pod."""


def lora_root(lora: str | int | None) -> int:
    """The chain's start for blocks computed with this adapter (None: the base model)."""
    if lora is None:
        return ROOT
    return _digest(b"lora\0" + str(lora).encode())


def _digest(data: bytes) -> int:
    # Python's own bytes hash (SipHash, in C): keys never leave this process (each gateway replica keys the
    # events it receives itself), so its per-process seed does no harm, and it is several times cheaper
    # than a cryptographic digest on a long prompt's hundreds of blocks. Folded to 63 bits, never 0 (ROOT).
    return (hash(data) & 0x7FFF_FFFF_FFFF_FFFF) or 1


def block_key(parent: int, token_ids) -> int:
    return _digest(parent.to_bytes(8, "little") + array("q", token_ids).tobytes())


def chain_keys(token_ids: list[int], block_size: int, lora: str | int | None = None) -> list[int]:
    """Our keys of the full blocks of `token_ids`, in order."""
    keys, parent = [], lora_root(lora)
    data, step = array("q", token_ids).tobytes(), block_size * 8  # as block_key packs them, in one pass
    for start in range(0, len(data) - step + 1, step):
        parent = _digest(parent.to_bytes(8, "little") + data[start:start + step])
        keys.append(parent)
    return keys


class PodBlocks:
    """One pod's holdings: (engine hash, medium) -> our key, and per medium how many engine blocks name each
    key (plain dicts of ints: a pod may hold tens of thousands of blocks, and a pool hundreds of pods)."""

    def __init__(self, block_size: int | None = None) -> None:
        self.to_key: dict[tuple[object, str], int] = {}
        self.held: dict[str, dict[int, int]] = {DEVICE: {}}  # medium -> our key -> engine blocks with it
        self.orphans = 0  # stored blocks whose parent this pod never announced (events missed): not indexed
        self.capped = 0  # stored blocks not indexed: the pod already had max_blocks
        self.block_size = block_size  # from its first BlockStored; kept when its cache is cleared

    def engine_hashes(self, medium: str = DEVICE) -> set:
        return {h for h, m in self.to_key if m == medium}


class KVBlockIndex:
    def __init__(self, max_blocks: int = MAX_BLOCKS_PER_POD) -> None:
        self.lock = threading.Lock()
        self.max_blocks = max_blocks
        self.pods: dict[str, PodBlocks] = {}
        self.block_sizes: Counter = Counter()  # block size -> pods reporting it (none at zero)

    # -- the subscriber's side ----------------------------------------------------------------------------
    def apply(self, pod: str, events: list[Event]) -> None:
        """IndexFault when the pod's events contradict its earlier ones; the pod is then as it was before the
        event that raised (the subscriber drops it)."""
        with self.lock:
            if pod not in self.pods:
                self.pods[pod] = PodBlocks()
        for event in events:
            with self.lock:  # per event: the picker never waits for a whole batch
                state = self.pods.get(pod)
                if state is None:  # dropped meanwhile
                    return
                if isinstance(event, BlockStored):
                    self._stored(state, event)
                elif isinstance(event, BlockRemoved):
                    for engine_hash in event.block_hashes:
                        self._remove(state, (_hashable(engine_hash), event.medium or DEVICE))
                elif isinstance(event, AllBlocksCleared):
                    self.pods[pod] = PodBlocks(state.block_size)

    def _stored(self, state: PodBlocks, event: BlockStored) -> None:
        medium, size = event.medium or DEVICE, event.block_size
        if state.block_size is None:
            state.block_size = size
            self.block_sizes[size] += 1
        elif size != state.block_size:
            raise IndexFault(f"block size {size} after {state.block_size}")
        if medium not in state.held and len(state.held) >= MAX_MEDIA:
            raise IndexFault(f"more than {MAX_MEDIA} media")
        if event.parent_block_hash is None:
            parent = lora_root(event.lora_name if event.lora_name is not None else event.lora_id)
        else:
            parent = (state.to_key.get((_hashable(event.parent_block_hash), medium))
                      or state.to_key.get((_hashable(event.parent_block_hash), DEVICE)))
            if parent is None:
                state.orphans += len(event.block_hashes)
                return
        tokens = event.token_ids
        counts = state.held.setdefault(medium, {})
        for i, engine_hash in enumerate(event.block_hashes):
            parent = block_key(parent, tokens[i * size:(i + 1) * size])
            slot = (_hashable(engine_hash), medium)
            if slot in state.to_key:  # announced twice: keep one count
                continue
            if len(state.to_key) >= self.max_blocks:  # the rest chain on this one: none can be indexed
                state.capped += len(event.block_hashes) - i
                return
            state.to_key[slot] = parent
            counts[parent] = counts.get(parent, 0) + 1

    @staticmethod
    def _remove(state: PodBlocks, slot: tuple) -> None:
        key = state.to_key.pop(slot, None)
        if key is None:
            return
        counts = state.held[slot[1]]
        if counts[key] > 1:
            counts[key] -= 1
        else:
            del counts[key]

    def drop(self, pod: str) -> None:
        """Forget a pod: its stream is lost or faulty, or the engine restarted with an empty cache."""
        with self.lock:
            state = self.pods.pop(pod, None)
            if state is not None and state.block_size is not None:
                self.block_sizes[state.block_size] -= 1
                if self.block_sizes[state.block_size] <= 0:
                    del self.block_sizes[state.block_size]

    def block_size(self) -> int | None:
        """The block size most pods report (on a tie, the one reported first); None before any BlockStored."""
        with self.lock:
            if not self.block_sizes:
                return None
            return max(self.block_sizes, key=self.block_sizes.__getitem__)  # max keeps the first of equals

    def tracks(self, pod: str, block_size: int | None) -> bool:
        """Whether the pod's events are followed and its blocks keyed as requests are (same block size)."""
        state = self.pods.get(pod)
        return state is not None and state.block_size in (None, block_size)

    # -- the picker's side -------------------------------------------------------------------------------
    def leading_runs(self, keys: list[int], pods: list[str]) -> dict[str, tuple[int, int]]:
        """Per pod: (leading blocks held on the device, leading blocks held on any medium)."""
        out = {}
        with self.lock:
            for pod in pods:
                state = self.pods.get(pod)
                if state is None:
                    continue
                on_device = state.held[DEVICE]
                offloaded = [counts for medium, counts in state.held.items() if medium != DEVICE and counts]
                device = anywhere = 0
                for key in keys:
                    if key in on_device:
                        device += device == anywhere
                    elif not any(key in counts for counts in offloaded):
                        break
                    anywhere += 1
                if anywhere:
                    out[pod] = (device, anywhere)
        return out

    def keys_of(self, pod: str, medium: str = DEVICE) -> set[int]:
        with self.lock:
            state = self.pods.get(pod)
            return set(state.held.get(medium, ())) if state else set()


def _hashable(value):
    return tuple(value) if isinstance(value, list) else value
