"""Host-side step inputs that outlive a step: the block-table buffer is reused from step to step, so
each step's tables must be exactly its own (zero-padded), whatever the steps before it held."""
from __future__ import annotations

import random

import torch
from torch.nn.utils.rnn import pad_sequence

from kubeinfer.engine.model_executor.model_runner import BlockTableBuffer


def test_each_fill_holds_exactly_its_own_tables():
    rng = random.Random(0)
    buffer = BlockTableBuffer()
    shapes = [(1, 3), (64, 20), (3, 2), (16, 40), (2, 1), (70, 5)]  # shrinking and growing both ways
    for rows, longest in shapes:
        tables = [rng.sample(range(1, 5000), rng.randint(1, longest)) for _ in range(rows)]
        got = buffer.fill(tables)
        want = pad_sequence([torch.tensor(t) for t in tables], batch_first=True)  # zeros after each table
        assert got.dtype == torch.long and got.is_contiguous()
        assert torch.equal(got, want), (rows, longest)
