"""A step's inputs as host lists (StepInputs), built by ModelRunner.prepare; rank 0 of a tensor-parallel
group sends them to the other ranks as they are. BlockTableBuffer lays the block tables out as one tensor."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class StepInputs:
    """One step's tokens laid end to end (decodes first), as host lists."""
    input_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)  # flat KV-cache slot of each token
    query_start_loc: list[int] = field(default_factory=lambda: [0])
    context_lens: list[int] = field(default_factory=list)
    block_tables: list[list[int]] = field(default_factory=list)
    logits_indices: list[int] = field(default_factory=list)  # rows whose logits sample a token
    num_decodes: int = 0
    # Async scheduling: (input row, row of the previous step's sampled ids) for each token not known on the host
    pending: list[tuple[int, int]] = field(default_factory=list)
    # Models with a window pool (core/window_blocks.py): the windowed layers' slots and block tables
    window_slots: list[int] = field(default_factory=list)
    window_tables: list[list[int]] = field(default_factory=list)

    def add(self, tokens: list[int], start: int, block_table: list[int], block_size: int) -> None:
        """One sequence's tokens at positions start.., their slots by its block table."""
        end = start + len(tokens)
        self.input_ids.extend(tokens)
        self.positions.extend(range(start, end))
        self.slots.extend(block_table[p // block_size] * block_size + p % block_size for p in range(start, end))
        self.query_start_loc.append(self.query_start_loc[-1] + len(tokens))
        self.context_lens.append(end)
        self.block_tables.append(block_table)

    def add_as_decodes(self, tokens: list[int], start: int, block_table: list[int], block_size: int,
                       window_table: list[int] | None = None) -> None:
        """A token and its drafts to verify as one-token queries (decodes) over the same block table, each with its
        own context length: every attention backend writes all the step's K/V rows before any query attends, so
        query i sees the cache up to its own position, what the chunk's causal mask shows it. The verify step then
        takes a decode step's path (the native decode attention and decoder layers on the CPU)."""
        for i, token in enumerate(tokens):
            self.add([token], start + i, block_table, block_size)
            if window_table is not None:
                self.add_window(1, start + i, window_table, block_size)
        self.num_decodes += len(tokens)

    def add_window(self, num_tokens: int, start: int, window_table: list[int], block_size: int) -> None:
        """The same tokens' slots in the window pool (after `add`)."""
        self.window_slots.extend(window_table[p // block_size] * block_size + p % block_size
                                 for p in range(start, start + num_tokens))
        self.window_tables.append(window_table)


class BlockTableBuffer:
    """The step's block tables as one zero-padded [sequences, longest table] host tensor, written into memory
    kept from step to step: one numpy row write per sequence where a tensor per sequence cost ~5 us each
    (0.3 ms a step at batch 64). The tensor returned is valid until the next `fill`."""

    def __init__(self) -> None:
        self._memory = np.zeros(0, dtype=np.int64)

    def fill(self, tables: list[list[int]]) -> torch.Tensor:
        rows, width = len(tables), max(len(t) for t in tables)
        if self._memory.size < rows * width:
            self._memory = np.zeros(max(rows * width, 2 * self._memory.size), dtype=np.int64)
        out = self._memory[:rows * width].reshape(rows, width)
        out.fill(0)
        for row, table in zip(out, tables):
            row[:len(table)] = table
        return torch.from_numpy(out)
