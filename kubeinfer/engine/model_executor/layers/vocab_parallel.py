"""The embedding and the LM head split by vocabulary across a tensor-parallel group: each rank holds the
rows of ceil(vocab / size) tokens (the last rank's tail padded). A rank embeds the tokens it holds, zero
for the others, and one all-reduce sums the ranks' rows; the LM head's logits are each rank's tokens,
gathered on rank 0, which samples. In a group of one both are the plain modules."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...distributed.parallel_state import all_reduce, gather_last_dim


def vocab_rows(vocab_size: int, tp_size: int) -> int:
    return -(-vocab_size // tp_size)


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, vocab_size: int, hidden_size: int, tp_rank: int, tp_size: int) -> None:
        rows = vocab_rows(vocab_size, tp_size)
        super().__init__(rows, hidden_size)
        self.vocab_size, self.tp_size, self.start = vocab_size, tp_size, tp_rank * rows

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return super().forward(input_ids)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0))

    def weight_pieces(self, param: torch.Tensor, source, shard: int | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return vocab_pieces(param, source, self.start, self.vocab_size)


class ParallelLMHead(nn.Linear):
    """A quantized head (a checkpoint that quantizes lm_head: layers/quantization/linear_method.py) keeps this
    forward: the local product is its quant method's, the vocabulary's slices gathered after it."""
    calls_quant_method = True

    def __init__(self, hidden_size: int, vocab_size: int, tp_rank: int, tp_size: int) -> None:
        rows = vocab_rows(vocab_size, tp_size)
        super().__init__(hidden_size, rows, bias=False)
        self.vocab_size, self.tp_size, self.start = vocab_size, tp_size, tp_rank * rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0: the logits of the whole vocabulary; other ranks: their own slice (unused)."""
        method = getattr(self, "quant_method", None)
        local = method.apply(self, x) if method is not None else F.linear(x, self.weight, self.bias)
        if self.tp_size == 1:
            return local
        return gather_last_dim(local)[..., :self.vocab_size]

    def weight_pieces(self, param: torch.Tensor, source, shard: int | None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return vocab_pieces(param, source, self.start, self.vocab_size)


def vocab_pieces(param: torch.Tensor, source, start: int, vocab_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's rows of the checkpoint's [vocab, hidden] tensor; the padding rows past the vocabulary are zero."""
    held = max(0, min(param.shape[0], vocab_size - start))
    with torch.no_grad():
        param[held:].zero_()
    return [(param.narrow(0, 0, held), source.narrow(0, start, held))]
