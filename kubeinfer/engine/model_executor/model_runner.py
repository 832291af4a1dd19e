"""Owns the model weights and the KV cache tensors; turns a scheduled batch into model inputs,
runs one forward pass and samples."""
from __future__ import annotations

import concurrent.futures
from collections.abc import Callable

import torch

from ..device_copy import on_device
from ..kernel_config import KernelConfig, active
from ..lora.layers import LoRAContext
from ..lora.pool import LoRAPool
from ..sequence import PENDING_TOKEN, ScheduledBatch, Sequence
from ..platforms.cuda.cuda_graphs import DecodeGraphs, capture_cuda_graph, capture_sizes
from ..platforms.cpu import cpu_blas
from . import kv_cache_layout
from .layers.attention import AttentionMetadata
from .layers.attention_selector import get_attention_backend
from ..platforms.cpu.native import ops as native_ops
from ..platforms.cpu.native.paths import log_native_paths
from .model_loader import ModelFiles, load_model
from ..platforms.cpu import native_decode
from .models.registry import ARCHITECTURES
from .sampler import SampleResult, grammar_bitmask, sample
from .step_inputs import BlockTableBuffer, StepInputs
from .step_timer import StepTimer

__all__ = ["BlockTableBuffer", "ModelRunner", "StepInputs"]


class ModelRunner:
    """Set up in order: __init__ loads the weights, `profile_run` (optional) measures a worst-case step,
    `allocate_kv_cache` sizes the cache, `capture_decode_graphs` (optional, CUDA) records decode steps."""

    def __init__(self, files: ModelFiles, *, device: torch.device, dtype: torch.dtype, max_model_len: int,
                 block_size: int, attention_backend: str = "torch", lora_pool: LoRAPool | None = None,
                 tp_rank: int = 0, tp_size: int = 1, kernels: KernelConfig | None = None) -> None:
        """`tp_rank` of `tp_size`: which slice of the model this process holds (tensor parallelism); `kernels`: the
        engine's kernel choice (EngineConfig.kernels; None: the KUBEINFER_* variables'), active on this thread
        while the model loads and in each step (kernel_config.active)."""
        if lora_pool is not None and not ARCHITECTURES[files.architecture].lora:
            with_lora = ", ".join(a.name for a in ARCHITECTURES.values() if a.lora)
            raise ValueError(f"LoRA adapters are not supported on {files.architecture} yet (`kubeinfer models` lists "
                             f"the features of each architecture); LoRA runs on {with_lora}")
        self.device = device
        self.lora_pool = lora_pool
        self.dtype = self.cache_dtype = dtype  # the KV cache's may be bf16 or 8 bits (set before allocate_kv_cache)
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.backend = get_attention_backend(attention_backend)
        self.kernels = kernels if kernels is not None else KernelConfig.from_env()
        with active(self.kernels):
            self.model = load_model(files, self.backend, max_model_len, device, dtype, tp_rank, tp_size)
            if device.type == "cpu":  # the native library loads at start, not at the first step
                native_ops.layers_enabled(), native_decode.switched_on()
                if tp_rank == 0:
                    log_native_paths()
        self.spec = self.model.spec
        self.sliding_window = self.spec.sliding_window
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.graphs: DecodeGraphs | None = None
        self._mask_thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        # Speculative decoding (set by the engine): samples a step whose sequences carry draft tokens, from
        # their 1 + drafts logits rows each: verify_drafts(logits, seqs, grammar_masks) -> SampleResult.
        self.verify_drafts: Callable | None = None
        # ... and, for a draft model, writes the drafts into the scheduled sequences: fill_drafts(batch).
        self.fill_drafts: Callable | None = None
        self.native_verify = True  # verify_as_decodes' switch
        self.timer = StepTimer(device)  # the engine switches it on; prepare / forward / sample are marked here
        self._block_table_buffer = BlockTableBuffer()
        self._window_table_buffer = BlockTableBuffer()
        self.window_pool = False  # whether the windowed layers have a pool of their own (allocate_kv_cache)
        # The engine sets it with deferred text: `execute` may return before the sampled ids are on the host.
        self.defer_token_copy = False
        self._previous_ids: torch.Tensor | None = None  # the step's `previous_ids` (async scheduling)
        # Rank 0 of a tensor-parallel group (core/tensor_parallel.py): `send(message)` hands each step's inputs
        # to the other ranks before this one runs it; `step_failed(error)` is what a failed step raises.
        self.ranks = None

    kv_bytes_per_block = staticmethod(kv_cache_layout.kv_bytes_per_block)
    window_group = staticmethod(kv_cache_layout.window_group)

    def _new_kv_cache(self, num_blocks: int, num_window_blocks: int | None = None
                      ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return kv_cache_layout.new_kv_cache(self.spec, self.block_size, self.cache_dtype, self.device, num_blocks,
                                            num_window_blocks)

    def allocate_kv_cache(self, num_blocks: int, num_window_blocks: int | None = None) -> None:
        """`num_window_blocks`: the windowed layers' pool (plus its null block), on models with one."""
        self.kv_caches = self._new_kv_cache(num_blocks, num_window_blocks)
        self.window_pool = num_window_blocks is not None

    @torch.inference_mode()
    def profile_run(self, num_tokens: int, max_num_seqs: int) -> None:
        """One forward pass of the largest step the scheduler can build (num_tokens prompt tokens over as
        many sequences as may sample, each sampling), on a scratch KV cache, so a caller can read the
        activation peak. LoRA deltas are left out: their rank-sized activations are small beside it."""
        num_seqs = max(1, min(max_num_seqs, num_tokens))
        lengths = [min(self.max_model_len, num_tokens // num_seqs + (i < num_tokens % num_seqs)) for i in range(num_seqs)]
        bs = self.block_size
        tables = torch.zeros((num_seqs, -(-max(lengths) // bs)), dtype=torch.long)
        slots: list[int] = []
        starts = [0]
        next_block = 0
        for i, length in enumerate(lengths):
            blocks = -(-length // bs)
            tables[i, :blocks] = torch.arange(next_block, next_block + blocks)
            slots.extend(next_block * bs + p for p in range(length))
            next_block += blocks
            starts.append(starts[-1] + length)
        meta = AttentionMetadata.build(slots, starts, lengths, tables, 0, self.sliding_window, self.device)
        positions = torch.cat([torch.arange(length) for length in lengths]).to(self.device)
        input_ids = torch.zeros_like(positions)
        logits_indices = torch.tensor(starts[1:], device=self.device) - 1
        with active(self.kernels):
            self.model(input_ids, positions, self._new_kv_cache(next_block), meta, logits_indices, None)

    def capture_decode_graphs(self, max_num_seqs: int, capture: Callable = capture_cuda_graph) -> None:
        """Records decode steps of every size up to max_num_seqs (see cuda_graphs); needs the KV cache."""
        if not self.kv_caches:
            raise RuntimeError("allocate the KV cache before capturing decode graphs")
        if not self.backend.supports_cuda_graphs:
            raise ValueError(f"the {self.backend.name} attention backend cannot run in CUDA graphs; use "
                             "attention_backend='triton', or enforce_eager=True")
        graphs = DecodeGraphs(self.model, self.kv_caches, sizes=capture_sizes(max_num_seqs),
                              max_blocks_per_seq=-(-self.max_model_len // self.block_size),
                              vocab_size=self._logits_width(), device=self.device, sliding_window=self.sliding_window,
                              lora_pool=self.lora_pool,
                              window_group=self.window_group(self.spec) if self.window_pool else None)
        with torch.inference_mode():
            graphs.capture(capture)
        self.graphs = graphs

    def _logits_width(self) -> int:
        """Columns of the logits the model returns: the vocabulary, or on a tensor-parallel rank other than 0 its
        own slice of it (only rank 0 gathers the whole)."""
        if self.spec.tp_rank == 0:
            return self.spec.vocab_size
        return min(self.model.lm_head.out_features, self.spec.vocab_size)

    def prepare(self, batch: ScheduledBatch) -> tuple[StepInputs, list[Sequence]]:
        """Host lists for the step's tokens, and the sequences that sample a token after it."""
        inputs = StepInputs()
        sampling_seqs: list[Sequence] = []
        as_decodes = None  # verify_as_decodes, asked once a step
        for seq, num_new in batch.entries:
            start = seq.num_computed_tokens
            end = start + num_new
            drafts = seq.spec_token_ids  # speculative decoding: guesses after the last token, checked in this pass
            tokens = seq.token_ids[start:end - len(drafts)] + drafts
            if tokens[-1] == PENDING_TOKEN:  # its id is still on the device (async scheduling): filled in there
                inputs.pending.append((len(inputs.input_ids) + len(tokens) - 1, seq.pending_row))
            window = seq.window_blocks.block_table if seq.window_blocks is not None else None
            if drafts and inputs.num_decodes == len(inputs.context_lens) and (
                    as_decodes := self.verify_as_decodes() if as_decodes is None else as_decodes):
                inputs.add_as_decodes(tokens, start, seq.block_table, self.block_size, window)
            else:
                inputs.add(tokens, start, seq.block_table, self.block_size)
                if window is not None:
                    inputs.add_window(len(tokens), start, window, self.block_size)
                inputs.num_decodes += ScheduledBatch.is_decode(seq, num_new)
            if end - len(drafts) == seq.num_tokens:  # the last known token is computed: its logits give the next
                last = inputs.query_start_loc[-1]  # (and each draft's logits judge the draft after it)
                inputs.logits_indices.extend(range(last - 1 - len(drafts), last))
                sampling_seqs.append(seq)
        return inputs, sampling_seqs

    def verify_as_decodes(self) -> bool:
        """Whether a verify step's 1 + k tokens a sequence run as one-token queries (StepInputs.add_as_decodes): on
        the CPU where a decode step's attention runs in C in every layer, so the step takes the native decode path
        (decode attention, and the fused decoder layers where the model has them) instead of a chunk's SDPA with a
        mask. `native_verify` False keeps the chunk (A/B measurements)."""
        return self.native_verify and self.device.type == "cpu" and native_decode.decode_attention_native(self.model)

    def _adapter_slots(self, batch: ScheduledBatch) -> list[int] | None:
        """Each scheduled sequence's adapter slot (0: base model); None when no sequence uses an adapter."""
        if self.lora_pool is None or not any(seq.lora_id for seq, _ in batch.entries):
            return None
        return [self.lora_pool.slot_of(seq.lora_id) for seq, _ in batch.entries]

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch, previous_ids: torch.Tensor | None = None
                ) -> tuple[list[Sequence], SampleResult]:
        """`previous_ids`: the sampled ids of the step launched before this one, where the logits were; async
        scheduling launches this step before they reach the host, and its pending tokens are read from them."""
        if self.fill_drafts is not None:  # the draft model's passes count as this step's `prepare`
            self.fill_drafts(batch)
        inputs, sampling_seqs = self.prepare(batch)
        self._previous_ids = previous_ids
        if inputs.pending and previous_ids is None:
            raise RuntimeError("a scheduled token is pending but no previous step's ids were given")
        timer = self.timer
        timer.num_seqs, timer.all_decode = len(batch.entries), inputs.num_decodes == len(batch.entries)
        kernels = getattr(self.model, "quant_kernels", {}).values()  # kept-int models share the cores (two_cores.py)
        with (active(self.kernels),  # this engine's kernel choice, for the layers that read one in a step
              cpu_blas.small_step(self._openblas_step(inputs), any(k.startswith("cpu_int") for k in kernels)),
              native_ops.layers_switch_held()):  # the native-layers switch read once a step, not once a layer
            return self._forward_and_sample(batch, inputs, sampling_seqs)

    def _openblas_step(self, inputs: StepInputs) -> bool:
        """A small step on the CPU in float32 (decodes, drafts to verify, a short prompt chunk) whose attention
        is small too, or runs in C (a decode step whose every layer's attention is native: torch has nothing large
        left, and on two threads it spun against the native pool, argmax 6 ms a step at batch 16 and 512 tokens;
        a float32 model's batch-16 step at 256-token prompts took 2x as long): projections through OpenBLAS and
        torch on one thread (platforms/cpu/cpu_blas.py)."""
        return (getattr(self.model, "openblas_small_steps", False)
                and len(inputs.input_ids) <= cpu_blas.MAX_STEP_TOKENS
                and (sum(inputs.context_lens) <= cpu_blas.MAX_CONTEXT_TOKENS
                     or (inputs.num_decodes == len(inputs.context_lens)
                         and native_decode.decode_attention_native(self.model))))

    def _forward_and_sample(self, batch: ScheduledBatch, inputs: StepInputs, sampling_seqs: list[Sequence]
                            ) -> tuple[list[Sequence], SampleResult]:
        timer = self.timer
        # Structured output: the grammars' masks are host work; compute them while the forward pass runs.
        masks = (self._mask_thread.submit(grammar_bitmask, sampling_seqs)
                 if any(seq.grammar is not None for seq in sampling_seqs) else None)
        lora_slots = self._adapter_slots(batch)
        logits = self.run_model(inputs, None if lora_slots is None else _per_token(lora_slots, batch))
        timer.mark("forward")
        if not sampling_seqs:
            return [], SampleResult([], [])
        masks = masks.result() if masks else None
        if self.verify_drafts is not None and any(seq.spec_token_ids for seq in sampling_seqs):
            result = self.verify_drafts(logits, sampling_seqs, masks)
        else:
            result = sample(logits, sampling_seqs, masks, defer_copy=self.defer_token_copy)
        timer.mark("sample")
        return sampling_seqs, result

    def run_model(self, inputs: StepInputs, token_slots: list[int] | None) -> torch.Tensor:
        """The logits of the rows that sample; `token_slots`: each token's adapter slot (None: no adapters).
        The other ranks of a tensor-parallel group run the same call on the inputs rank 0 sends them."""
        if self.ranks is None:
            return self._run_model(inputs, token_slots)
        self.ranks.send(("step", inputs, token_slots))
        try:
            return self._run_model(inputs, token_slots)
        except Exception as error:  # the ranks are out of step now: the group cannot go on
            raise self.ranks.step_failed(error) from error

    def _run_model(self, inputs: StepInputs, token_slots: list[int] | None) -> torch.Tensor:
        with active(self.kernels):  # a follower rank's step comes here straight from run_model
            return self._run_model_active(inputs, token_slots)

    def _run_model_active(self, inputs: StepInputs, token_slots: list[int] | None) -> torch.Tensor:
        if self._graph_can_run(inputs, token_slots):  # decodes only: one token per sequence
            self.timer.mark("prepare")  # the graph's own copies into its static inputs count as forward
            fill = (lambda ids: self._fill_pending(ids, inputs)) if inputs.pending else None
            rows = self.graphs.run(inputs.input_ids, inputs.positions, inputs.slots, inputs.context_lens,
                                   inputs.block_tables, token_slots, fill, inputs.window_slots or None,
                                   inputs.window_tables or None)
            # Every row samples in the usual decode step (no index tensor to copy to the device then); a
            # prompt's one-token middle chunk computes but does not sample.
            return rows if len(inputs.logits_indices) == rows.shape[0] else rows[inputs.logits_indices]
        lora = None if token_slots is None else LoRAContext.build(self.lora_pool, token_slots)
        return self._run_eager(inputs, lora)

    def _graph_can_run(self, inputs: StepInputs, lora_slots: list[int] | None) -> bool:
        """Decode-only steps no larger than the largest graph, with adapters only where graphs for them exist."""
        return (self.graphs is not None and inputs.num_decodes == len(inputs.context_lens)
                and self.graphs.padded_size(inputs.num_decodes) is not None
                and (lora_slots is None or bool(self.graphs.lora_replays)))

    def forward(self, inputs: StepInputs) -> torch.Tensor:
        """The logits of `inputs.logits_indices` after one eager pass over the inputs (a draft model's)."""
        with active(self.kernels), cpu_blas.small_step(self._openblas_step(inputs)):
            return self._run_eager(inputs, None)

    def _run_eager(self, inputs: StepInputs, lora: LoRAContext | None) -> torch.Tensor:
        dev = self.device
        tables = inputs.block_tables
        block_tables = self._block_table_buffer.fill(tables)
        meta = AttentionMetadata.build(inputs.slots, inputs.query_start_loc, inputs.context_lens, block_tables,
                                       inputs.num_decodes, self.sliding_window, dev, block_table_lists=tables)
        if inputs.window_tables:  # the windowed layers read and write their own pool
            window_tables = self._window_table_buffer.fill(inputs.window_tables)
            meta.add_group(self.window_group(self.spec), inputs.window_slots, window_tables, inputs.window_tables, dev)
        input_ids = on_device(inputs.input_ids, torch.long, dev)
        self._fill_pending(input_ids, inputs)
        positions = on_device(inputs.positions, torch.long, dev)
        logits_indices = on_device(inputs.logits_indices, torch.long, dev)
        self.timer.mark("prepare")
        return self.model(input_ids, positions, self.kv_caches, meta, logits_indices, lora)

    def _fill_pending(self, input_ids: torch.Tensor, inputs: StepInputs) -> None:
        """Async scheduling: the input rows whose token the previous step sampled take it on the device."""
        if inputs.pending:
            rows = on_device([row for row, _ in inputs.pending], torch.long, input_ids.device)
            sampled = on_device([prev for _, prev in inputs.pending], torch.long, input_ids.device)
            input_ids[rows] = self._previous_ids[sampled]


def _per_token(per_sequence: list[int], batch: ScheduledBatch) -> list[int]:
    """Each sequence's value repeated for each of its tokens in the step."""
    return [value for value, (_, num_new) in zip(per_sequence, batch.entries) for _ in range(num_new)]
