"""CUDA graphs for decode steps.

A decode step at small batch is launch-bound: for a 1B model in eager mode the CPU spends longer
queueing a few hundred small kernels than the GPU spends reading the weights. A CUDA graph records
the whole forward pass once and replays it with one launch.

A graph replays fixed shapes on fixed addresses, so `DecodeGraphs` owns static input buffers sized for
the largest captured batch, and captures one graph per batch size of a ladder (1, 2, 4, 8, 16, 24, ...).
A pure-decode step of n sequences is padded to the next captured size b: rows n..b-1 are padding
with `slot_mapping = -1` (the KV write skips them) and a one-token context, so they cost a little
compute and touch no sequence's cache. Logits go to one static output buffer; the first n rows are
the step's. Mixed prefill/decode steps and batches larger than the largest graph run eagerly.

With LoRA a second graph per size serves decode steps that use adapters: each token's slot goes into a
static buffer (0 for base-model tokens and padding), and the Triton LoRA kernels run one segment per
token (`triton_lora.TokenPlan`), looking ranks up on the device, so nothing in the launch depends on
which adapters the step has. Steps without adapters keep the plain graphs, which skip LoRA entirely.

The capture itself is a parameter (`capture_cuda_graph` by default), so the whole padding path can be
checked on the CPU with `replay_eagerly`, which records nothing and simply re-runs the step.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

import torch

from ...model_executor.layers.attention import AttentionMetadata

MAX_CAPTURED_BATCH = 512  # beyond this a decode step is compute-bound and a graph saves nothing that matters
# The static per-row inputs, in their rows' order (input ids, positions, KV slots, context lengths, adapter
# slots, KV slots in the sliding-window layers' own pool), and what a padding row holds in each.
ROW_DEFAULTS = (0, 0, -1, 1, 0, -1)


def capture_sizes(max_num_seqs: int, limit: int = MAX_CAPTURED_BATCH) -> list[int]:
    """The batch sizes that get a graph: 1, 2, 4, then steps of 8, ending at max_num_seqs (capped)."""
    top = min(max_num_seqs, limit)
    ladder = [1, 2, 4, *range(8, top, 8)]
    return [size for size in ladder if size < top] + [top]


def capture_cuda_graph(step: Callable[[], None], pool=None) -> tuple[Callable[[], None], object]:
    """Records `step` into a CUDA graph; returns (replay, memory pool to share with the next capture)."""
    # Warm up off the capture first: Triton compiles its kernels and cuBLAS picks algorithms and
    # allocates workspaces on the first calls, none of which may happen inside a capture.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        step()
    return graph.replay, graph.pool()


def replay_eagerly(step: Callable[[], None], pool=None) -> tuple[Callable[[], None], object]:
    """A stand-in for capture_cuda_graph off the GPU: 'replaying' runs the step again on the same buffers."""
    return step, pool


class DecodeGraphs:
    """Static buffers and one captured forward pass per batch size, for decode-only steps."""

    def __init__(self, forward: Callable[..., torch.Tensor], kv_caches, *, sizes: Sequence[int],
                 max_blocks_per_seq: int, vocab_size: int, device: torch.device,
                 sliding_window: int | None, lora_pool=None, window_group: int | None = None) -> None:
        """`lora_pool`: also capture graphs for decode steps with adapters (needs triton). `window_group`: the
        window of the layers whose K/V lives in a pool of its own (core/window_blocks.py), if any."""
        self.forward = forward
        self.lora_pool = lora_pool
        self.kv_caches = kv_caches
        self.sizes = sorted(sizes)
        self.sliding_window = sliding_window
        self.window_group = window_group
        max_batch = self.sizes[-1]
        # The per-row inputs are the rows of one device tensor, written each step by one copy from host memory
        # kept across steps (pinned on CUDA, so the copies queue behind the previous step without a host wait).
        pinned = device.type == "cuda"
        self._rows = torch.zeros((len(ROW_DEFAULTS), max_batch), dtype=torch.long, device=device)
        self._host_rows = torch.zeros(self._rows.shape, dtype=torch.long, pin_memory=pinned)
        for row, default in enumerate(ROW_DEFAULTS):
            self._rows[row].fill_(default)
            self._host_rows[row].fill_(default)
        (self.input_ids, self.positions, self.slot_mapping, self.context_lens, self.lora_slots,
         self.window_slots) = self._rows.unbind()
        self.block_tables = torch.zeros((max_batch, max_blocks_per_seq), dtype=torch.long, device=device)
        self._host_tables = torch.zeros(max_batch * max_blocks_per_seq, dtype=torch.long, pin_memory=pinned)
        self.window_tables = torch.zeros((max_batch, max_blocks_per_seq), dtype=torch.long, device=device)
        self._host_window_tables = torch.zeros(max_batch * max_blocks_per_seq, dtype=torch.long, pin_memory=pinned)
        # Recorded after each step's copies: host memory is rewritten only once they are done (the engine
        # waits for each step's tokens anyway, so this wait is normally already over).
        self._copied = torch.cuda.Event() if pinned else None
        self.query_start = torch.arange(max_batch + 1, dtype=torch.int32, device=device)  # one query per row, always
        self.logits_indices = torch.arange(max_batch, dtype=torch.long, device=device)
        self.logits = torch.zeros((max_batch, vocab_size), dtype=torch.float32, device=device)
        self.replays: dict[int, Callable[[], None]] = {}
        self.lora_replays: dict[int, Callable[[], None]] = {}
        self.num_replays = 0  # steps served by a graph (tests and logs read it)
        self.num_lora_replays = 0  # of which with adapters

    def capture(self, capture: Callable = capture_cuda_graph) -> None:
        """Captures every size, largest first: smaller graphs then fit in the memory pool the largest made."""
        pool = None
        for size in reversed(self.sizes):
            self.replays[size], pool = capture(self._step_for(size), pool)
        if self.lora_pool is not None:
            for size in reversed(self.sizes):
                self.lora_replays[size], pool = capture(self._lora_step_for(size), pool)

    def _lora_step_for(self, size: int) -> Callable[[], None]:
        from ...lora.layers import LoRAContext
        from ...lora.triton_ops import TokenPlan

        plan = TokenPlan(self.lora_pool, self.lora_slots[:size])
        step = self._step_for(size, LoRAContext(self.lora_pool, [], kernel_plan=plan))

        def lora_step() -> None:
            plan.refresh()  # ranks of this step's slots, read on the device
            step()
        return lora_step

    def _step_for(self, size: int, lora=None) -> Callable[[], None]:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:size], query_start_loc=[], context_lens=[],
            context_lens_tensor=self.context_lens[:size], block_tables=self.block_tables[:size], num_decodes=size,
            sliding_window=self.sliding_window, query_start_tensor=self.query_start[:size + 1], max_prefill_len=0)
        if self.window_group is not None:
            meta._windowed[self.window_group] = replace(meta, sliding_window=self.window_group, _windowed={},
                                                        slot_mapping=self.window_slots[:size],
                                                        block_tables=self.window_tables[:size])
        inputs = (self.input_ids[:size], self.positions[:size], self.kv_caches, meta, self.logits_indices[:size], lora)

        def step() -> None:
            self.logits[:size].copy_(self.forward(*inputs))
        return step

    @staticmethod
    def _copy_tables(block_tables: list[list[int]], host_memory: torch.Tensor, static: torch.Tensor) -> None:
        # Only the columns this step uses: later columns of a row are never read, since no key
        # lies beyond its context, and a padding row reads one key of whatever block its column 0 names.
        n, width = len(block_tables), max(len(table) for table in block_tables)
        host = host_memory[:n * width].view(n, width)
        tables = host.numpy()
        tables.fill(0)
        for row, table in zip(tables, block_tables):
            row[:len(table)] = table
        static[:n, :width].copy_(host, non_blocking=True)

    def padded_size(self, num_seqs: int) -> int | None:
        """The smallest captured size that holds num_seqs sequences; None when none does."""
        return next((size for size in self.sizes if size >= num_seqs), None)

    def run(self, input_ids: list[int], positions: list[int], slots: list[int], context_lens: list[int],
            block_tables: list[list[int]], lora_slots: list[int] | None = None,
            fill: Callable[[torch.Tensor], None] | None = None, window_slots: list[int] | None = None,
            window_tables: list[list[int]] | None = None) -> torch.Tensor:
        """One decode step of len(input_ids) sequences through its graph; returns their logits [n, vocab]
        (a view of the static buffer: read it before the next step). `lora_slots`: each sequence's
        adapter slot, when the step uses adapters (then `lora_replays` must hold its size). `fill(input_ids)`
        writes on the device what the host does not know yet (async scheduling's pending tokens)."""
        n = len(input_ids)
        size = self.padded_size(n)
        if self._copied is not None:
            self._copied.synchronize()
        rows = self._host_rows.numpy()
        for row, values in enumerate((input_ids, positions, slots, context_lens, lora_slots, window_slots)):
            if values is not None:  # (without adapters the lora row is not read: the plain graphs skip LoRA)
                rows[row, :n] = values
                rows[row, n:size] = ROW_DEFAULTS[row]  # padding: no KV write (slot -1), a one-token context
        self._rows.copy_(self._host_rows, non_blocking=True)
        self._copy_tables(block_tables, self._host_tables, self.block_tables)
        if window_tables is not None:
            self._copy_tables(window_tables, self._host_window_tables, self.window_tables)
        if self._copied is not None:
            self._copied.record()
        if fill is not None:
            fill(self.input_ids[:n])
        if lora_slots is None:
            self.replays[size]()
        else:
            self.lora_replays[size]()
            self.num_lora_replays += 1
        self.num_replays += 1
        return self.logits[:n]
