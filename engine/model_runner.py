"""Owns the model weights and the KV cache tensors; turns a scheduled batch into model inputs,
runs one forward pass and samples."""
from __future__ import annotations

import torch

from .attention import AttentionMetadata, get_attention_backend
from .lora_layers import LoRAContext
from .lora_pool import LoRAPool
from .model_loader import ModelFiles, load_model
from .sampler import SampleResult, sample
from .scheduler import ScheduledBatch, Scheduler
from .sequence import Sequence


class ModelRunner:
    def __init__(self, files: ModelFiles, *, device: torch.device, dtype: torch.dtype, max_model_len: int,
                 block_size: int, num_kv_blocks: int, attention_backend: str = "torch",
                 lora_pool: LoRAPool | None = None) -> None:
        self.device = device
        self.lora_pool = lora_pool
        self.dtype = dtype
        self.block_size = block_size
        self.backend = get_attention_backend(attention_backend)
        self.model = load_model(files, self.backend, max_model_len, device, dtype)
        spec = self.model.spec
        self.sliding_window = spec.sliding_window
        shape = (num_kv_blocks, block_size, spec.num_kv_heads, spec.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
                          for _ in range(spec.num_layers)]

    @staticmethod
    def kv_bytes_per_block(spec, block_size: int, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim * element

    def prepare(self, batch: ScheduledBatch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, list[Sequence]]:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        context_lens: list[int] = []
        logits_indices: list[int] = []
        sampling_seqs: list[Sequence] = []
        bs = self.block_size
        num_decodes = 0
        for seq, num_new in batch.entries:
            start = seq.num_computed_tokens
            end = start + num_new
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_start_loc.append(query_start_loc[-1] + num_new)
            context_lens.append(end)
            if Scheduler.is_decode(seq, num_new):
                num_decodes += 1
            if end == seq.num_tokens:  # the last known token is computed: its logits give the next token
                logits_indices.append(query_start_loc[-1] - 1)
                sampling_seqs.append(seq)
        max_blocks = max(len(seq.block_table) for seq, _ in batch.entries)
        block_tables = torch.zeros((len(batch.entries), max_blocks), dtype=torch.long)
        for i, (seq, _) in enumerate(batch.entries):
            block_tables[i, :len(seq.block_table)] = torch.tensor(seq.block_table, dtype=torch.long)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_start_loc=query_start_loc,
            context_lens=context_lens,
            context_lens_tensor=torch.tensor(context_lens, dtype=torch.long, device=dev),
            block_tables=block_tables.to(dev),
            num_decodes=num_decodes,
            sliding_window=self.sliding_window,
        )
        return (torch.tensor(input_ids, dtype=torch.long, device=dev), torch.tensor(positions, dtype=torch.long, device=dev),
                meta, torch.tensor(logits_indices, dtype=torch.long, device=dev), sampling_seqs)

    def lora_context(self, batch: ScheduledBatch) -> LoRAContext | None:
        """Each token's adapter slot, grouped; None when no sequence in the step uses an adapter."""
        if self.lora_pool is None or not any(seq.lora_id for seq, _ in batch.entries):
            return None
        token_slots: list[int] = []
        for seq, num_new in batch.entries:
            token_slots.extend([self.lora_pool.slot_of(seq.lora_id)] * num_new)
        return LoRAContext.build(self.lora_pool, token_slots)

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[list[Sequence], SampleResult]:
        input_ids, positions, meta, logits_indices, sampling_seqs = self.prepare(batch)
        logits = self.model(input_ids, positions, self.kv_caches, meta, logits_indices, self.lora_context(batch))
        if not sampling_seqs:
            return [], SampleResult([], [])
        return sampling_seqs, sample(logits.cpu(), sampling_seqs)
