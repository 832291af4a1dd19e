"""Attention over the paged KV cache.

A step's tokens arrive flattened ([T, heads, head_dim]) with their sequences laid end to end, one-token
queries (decodes) first. The backend writes the new K/V into the cache slots the block manager chose,
then attends each query to its sequence's cached context. `AttentionBackend` is the seam where a GPU
kernel backend plugs in; `TorchAttentionBackend` is the portable reference used on the CPU.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import torch.nn.functional as F

from ...device_copy import on_device, to_device
from ...platforms.cpu import cpu_attention, two_cores
from .quantization.kv_cache_dtype import to_cache_dtype

MIN_SHARED_DECODES = 4  # decodes in a CPU small step from which attention runs half on each core (two_cores.py)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] flat cache slot (block_id * block_size + offset) of each new token
    query_start_loc: list[int]  # [B + 1] where each sequence's queries start in the flat batch
    context_lens: list[int]  # [B] tokens in the cache for each sequence after this step's writes
    context_lens_tensor: torch.Tensor  # [B]
    block_tables: torch.Tensor  # [B, max_blocks] padded with 0
    num_decodes: int  # the first num_decodes sequences have exactly one query token
    sliding_window: int | None = None
    query_start_tensor: torch.Tensor | None = None  # [B + 1] int32 query_start_loc on the device (kernels read it)
    max_prefill_len: int = 0  # the longest query among the sequences after the decodes
    decode_mask: torch.Tensor | None = field(default=None, repr=False)  # built by the first layer, shared by all
    # The block tables as host lists (the CPU path reads them to find contexts it can slice instead of gather).
    block_table_lists: list[list[int]] | None = field(default=None, repr=False)
    _runs: dict = field(default_factory=dict, repr=False)  # (seq, blocks) -> first block of a run, or None
    _chunk_masks: dict = field(default_factory=dict, repr=False)  # (seq, dtype) -> its queries' mask
    _windowed: dict = field(default_factory=dict, repr=False)  # window -> this step's metadata for that window

    @property
    def num_seqs(self) -> int:
        return self.context_lens_tensor.shape[0]

    def chunk_mask(self, seq: int, num_queries: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """[num_queries, context] additive mask (0 or -inf) of the positions each query of sequence `seq`
        attends to: its queries are the last num_queries positions of the context (a chunk, or a token and
        its drafts to verify). Built by the first layer, shared by the others; additive because SDPA turns a
        boolean mask into one on every call."""
        key = (seq, dtype)
        if key not in self._chunk_masks:
            context_len = self.context_lens[seq]
            q_pos = torch.arange(context_len - num_queries, context_len, device=device)[:, None]
            k_pos = torch.arange(context_len, device=device)[None, :]
            hidden = k_pos > q_pos
            if self.sliding_window:
                hidden |= k_pos <= q_pos - self.sliding_window
            mask = torch.zeros(hidden.shape, dtype=dtype, device=device)
            self._chunk_masks[key] = mask.masked_fill_(hidden, float("-inf"))
        return self._chunk_masks[key]

    def for_window(self, window: int | None) -> AttentionMetadata:
        """This step's metadata for a layer with its own window (Gemma's local and global layers differ): the
        same tensors, its own masks. Built by the first such layer, shared by the others."""
        if window == self.sliding_window:
            return self
        if window not in self._windowed:
            self._windowed[window] = replace(self, sliding_window=window, decode_mask=None, _chunk_masks={},
                                             _windowed={})
        return self._windowed[window]

    def add_group(self, window: int, slots: list[int], block_tables: torch.Tensor, block_table_lists: list[list[int]],
                  device: torch.device) -> None:
        """The metadata of the layers with `window` when their K/V lives in a pool of its own (core/window_blocks.py):
        the same queries and lengths, that pool's slots and block tables."""
        self._windowed[window] = replace(self, sliding_window=window, decode_mask=None, _chunk_masks={}, _runs={},
                                         _windowed={}, slot_mapping=on_device(slots, torch.long, device),
                                         block_tables=to_device(block_tables, device),
                                         block_table_lists=block_table_lists)

    def first_block_of_run(self, seq: int, num_blocks: int) -> int | None:
        """The first block id when sequence `seq`'s first `num_blocks` blocks are consecutive ids (the block
        manager hands out consecutive blocks where it can), else None; None too without the host lists."""
        if self.block_table_lists is None:
            return None
        key = (seq, num_blocks)
        if key not in self._runs:
            table = self.block_table_lists[seq]
            first = table[0]
            self._runs[key] = first if table[:num_blocks] == list(range(first, first + num_blocks)) else None
        return self._runs[key]

    @classmethod
    def build(cls, slots: list[int], query_start_loc: list[int], context_lens: list[int], block_tables: torch.Tensor,
              num_decodes: int, sliding_window: int | None, device: torch.device,
              block_table_lists: list[list[int]] | None = None) -> AttentionMetadata:
        """A step's metadata from host lists, with the device copies every backend may read."""
        return cls(
            block_table_lists=block_table_lists,
            slot_mapping=on_device(slots, torch.long, device),
            query_start_loc=query_start_loc,
            context_lens=context_lens,
            context_lens_tensor=on_device(context_lens, torch.long, device),
            block_tables=to_device(block_tables, device),
            num_decodes=num_decodes,
            sliding_window=sliding_window,
            query_start_tensor=on_device(query_start_loc, torch.int32, device),
            max_prefill_len=max((query_start_loc[i + 1] - query_start_loc[i]
                                 for i in range(num_decodes, len(context_lens))), default=0),
        )


class AttentionBackend:
    name = "base"
    # Whether a decode step can be captured in a CUDA graph: no host reads of the metadata's lists, no
    # host-to-device copies, shapes fixed by the batch size alone.
    supports_cuda_graphs = False

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D]. Returns [T, H, D].
        `softcap`: scores become softcap * tanh(scores / softcap) before the softmax (Gemma 2).
        `sinks` [H]: a learned logit per head joins the softmax's denominator, attending to nothing (gpt-oss)."""
        raise NotImplementedError


def write_kv_cache(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    num_kv_heads, head_dim = k_cache.shape[-2:]
    if k.dtype != k_cache.dtype:  # (a no-op .to() still costs a call; a decode step makes hundreds)
        k, v = to_cache_dtype(k, k_cache.dtype), to_cache_dtype(v, v_cache.dtype)
    if k_cache.element_size() == 1:  # an fp8 cache: the CPU's index_copy_ has no fp8 kernel, and bytes are bytes
        k, v, k_cache, v_cache = (t.view(torch.uint8) for t in (k, v, k_cache, v_cache))
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def sequence_context(cache: torch.Tensor, meta: AttentionMetadata, seq: int, length: int) -> torch.Tensor:
    """[1, Hkv, length, D] keys or values of one sequence: a slice of the cache when its blocks are
    consecutive (no copy: at batch 1 the gathers were the largest of a step's small ops), else gathered."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    first = meta.first_block_of_run(seq, num_blocks)
    if first is None:
        return gather_context(cache, meta.block_tables[seq:seq + 1], length)
    _, _, num_kv_heads, head_dim = cache.shape
    token_stride = num_kv_heads * head_dim  # one call where slicing, viewing and transposing took four
    return cache.as_strided((1, num_kv_heads, length, head_dim), (0, head_dim, token_stride, 1),
                            cache.storage_offset() + first * block_size * token_stride)


def gather_context(cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """[B, max_blocks] block tables -> [B, Hkv, length, D] contiguous keys or values."""
    # index_select, not cache[block_tables]: advanced indexing costs ~10x more per call on the CPU.
    batch, max_blocks = block_tables.shape
    blocks = cache.index_select(0, block_tables.reshape(-1))  # [B * max_blocks, block_size, Hkv, D]
    gathered = blocks.view(batch, max_blocks * cache.shape[1], *cache.shape[2:])[:, :length]  # [B, L, Hkv, D]
    return gathered.transpose(1, 2)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(self, q, k, v, k_cache, v_cache, meta, scale, softcap=None, sinks=None):
        native = cpu_attention.usable(q, k_cache, meta, softcap, sinks)  # decode rows in C (cpu_attention.py)
        if native and meta.num_decodes == meta.num_seqs:  # a decode step: the K/V write in the same call
            return cpu_attention.decode(q, k_cache, v_cache, meta, scale, new_kv=(k, v))
        write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
        if softcap or sinks is not None:  # SDPA cannot cap scores or add sinks: every sequence through the eager path
            return self._eager(q, k_cache, v_cache, meta, scale, softcap, sinks)
        nd = meta.num_decodes
        if nd == meta.num_seqs:  # decodes only: their output is the whole output
            return self._decode(q, k_cache, v_cache, meta, scale)
        if nd == 0 and meta.num_seqs == 1:  # one prompt, chunk or verification: its output is the output
            return self._prefill(q, k_cache, v_cache, meta, 0, scale)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = (cpu_attention.decode if native else self._decode)(q[:nd], k_cache, v_cache, meta, scale)
        for i in range(nd, meta.num_seqs):
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            out[start:end] = self._prefill(q[start:end], k_cache, v_cache, meta, i, scale)
        return out

    @staticmethod
    def _decode(q, k_cache, v_cache, meta, scale):
        nd = q.shape[0]
        lengths, max_len = meta.context_lens[:nd], max(meta.context_lens[:nd])
        # Every position attended (one sequence, or all as long, inside any window): no mask, a faster kernel.
        attends_all = min(lengths) == max_len and not (meta.sliding_window and max_len > meta.sliding_window)
        grouped = _slow_masked_sdpa(q)
        if meta.decode_mask is None and (grouped or not attends_all):
            meta.decode_mask = _decode_mask(meta.context_lens_tensor[:nd], max_len, meta.sliding_window)
        mask = None if attends_all and not grouped else meta.decode_mask
        if nd == 1:
            return _attend_decodes(q, sequence_context(k_cache, meta, 0, max_len),
                                   sequence_context(v_cache, meta, 0, max_len), mask, scale, grouped)

        def rows(lo: int, hi: int) -> torch.Tensor:
            keys = gather_context(k_cache, meta.block_tables[lo:hi], max_len)
            values = gather_context(v_cache, meta.block_tables[lo:hi], max_len)
            return _attend_decodes(q[lo:hi], keys, values, None if mask is None else mask[lo:hi], scale, grouped)
        if nd < MIN_SHARED_DECODES or not two_cores.active():
            return rows(0, nd)
        # A small step on the CPU: half the sequences on each core (each (sequence, head) is computed alone, over
        # the same max_len keys, so the halves give the bits of the whole).
        out, half = torch.empty_like(q), nd // 2
        two_cores.both(lambda: out[:half].copy_(rows(0, half)), lambda: out[half:].copy_(rows(half, nd)))
        return out

    @staticmethod
    def _prefill(q, k_cache, v_cache, meta, seq, scale):
        num_queries, context_len, sliding_window = q.shape[0], meta.context_lens[seq], meta.sliding_window
        keys = sequence_context(k_cache, meta, seq, context_len)
        values = sequence_context(v_cache, meta, seq, context_len)
        query = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if num_queries == context_len and not sliding_window:
            if keys.dtype != q.dtype:
                keys, values = keys.to(q.dtype), values.to(q.dtype)
            out = F.scaled_dot_product_attention(query, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        else:
            # Queries are the last num_queries positions of the context: causal with an offset.
            dtype = query.dtype
            if _slow_masked_sdpa(query):
                query = query.float()
            if keys.dtype != query.dtype:
                keys, values = keys.to(query.dtype), values.to(query.dtype)
            mask = meta.chunk_mask(seq, num_queries, query.dtype, q.device)
            out = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
            if out.dtype != dtype:
                out = out.to(dtype)
        return out.squeeze(0).transpose(0, 1)

    @staticmethod
    def _eager(q, k_cache, v_cache, meta, scale, softcap, sinks):
        """Attention with capped scores or sinks, one sequence at a time, in the order of operations transformers'
        eager attention uses (scores * scale, capped, masked, softmax in fp32 over the scores and the sink)."""
        out = torch.empty_like(q)
        for seq in range(meta.num_seqs):
            start, end = meta.query_start_loc[seq], meta.query_start_loc[seq + 1]
            context_len, num_queries = meta.context_lens[seq], end - start
            keys = sequence_context(k_cache, meta, seq, context_len).to(q.dtype)
            values = sequence_context(v_cache, meta, seq, context_len).to(q.dtype)
            group = q.shape[1] // keys.shape[1]
            keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
            query = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            scores = torch.matmul(query, keys.transpose(2, 3)) * scale
            if softcap:
                scores = torch.tanh(scores / softcap) * softcap
            scores = scores + meta.chunk_mask(seq, num_queries, scores.dtype, q.device)
            if sinks is None:
                probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            else:
                sink = sinks.float().view(1, -1, 1, 1).expand(1, -1, num_queries, 1)
                probs = torch.softmax(torch.cat([scores.float(), sink], dim=-1), dim=-1)[..., :-1].to(q.dtype)
            out[start:end] = torch.matmul(probs, values).squeeze(0).transpose(0, 1)
        return out


def _decode_mask(lens: torch.Tensor, max_len: int, sliding_window: int | None) -> torch.Tensor:
    """[B, max_len]: which cached positions each decode attends to."""
    positions = torch.arange(max_len, device=lens.device)
    mask = positions[None, :] < lens[:, None]
    if sliding_window:
        mask &= positions[None, :] >= (lens[:, None] - sliding_window)
    return mask


def _attend_decodes(q, keys, values, mask, scale: float, grouped: bool) -> torch.Tensor:
    """[B, H, D] one query per sequence over its [B, Hkv, L, D] keys and values; mask [B, L] or None (all)."""
    if keys.dtype != q.dtype:  # an fp8 cache (or a cache kept in another type) widens to the queries'
        keys, values = keys.to(q.dtype), values.to(q.dtype)
    if grouped:
        return _grouped_decode(q, keys, values, mask, scale)
    mask = None if mask is None else mask[:, None, None, :]
    out = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(2)


def _grouped_decode(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """Decode attention as two batched matmuls per KV head group, softmax in fp32. On the CPU, torch's
    masked SDPA is slow in half precision; its matmuls are not (bf16 GEMMs run about 3x fp32's speed)."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = keys.shape[1]
    grouped = q.view(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).float() * scale  # [B, Hkv, group, L]
    scores.masked_fill_(~mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, values).reshape(batch, num_heads, head_dim)


def _slow_masked_sdpa(q: torch.Tensor) -> bool:
    """Half precision on the CPU: there torch's masked SDPA is about twice as slow as the same attention
    widened to fp32 (and less exact), so decodes take _grouped_decode and masked chunks widen to fp32."""
    return q.device.type == "cpu" and q.dtype in (torch.bfloat16, torch.float16)
