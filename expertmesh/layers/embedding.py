"""Vocab-parallel embedding and LM head: the vocabulary is split in contiguous blocks over TP.

Neither rounds differently under TP: the embedding's all-reduce adds to each element one row's
value and zeros (exact in any dtype), and the LM head gathers whole logits, each computed on
one rank as one process computes it. The logits are float32 (the product is not rounded to a
bf16 model's dtype): a bf16 logit near 8 is only good to 1/32, coarser than the differences a
layout's summation order leaves in the hidden state.

A vocabulary TP does not divide (Granite's 49155) is padded: every rank holds ceil(V / TP) rows,
the last ones zero past V, and the gathered logits are cut back to V.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from expertmesh import huge_pages
from expertmesh.layers.linear_weight import DenseWeight, LinearWeight
from expertmesh.layers.ops import Ops
from expertmesh.layers.weights import copy_rows_into, set_loader


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, group: Any, dtype=torch.float32) -> None:
        super().__init__()
        self.group, tp = group, group.world_size
        self.vocab_size = vocab_size
        self.shard = -(-vocab_size // tp)
        self.start = group.rank_in_group * self.shard
        self.rows = max(0, min(self.shard, vocab_size - self.start))  # real rows here; the rest pad
        self.weight = nn.Parameter(huge_pages.zeros((self.shard, hidden), dtype), requires_grad=False)
        set_loader(self.weight, self._load)

    def _load(self, param: nn.Parameter, src: Any, shard_id: Any = None) -> None:
        copy_rows_into(param.data[: self.rows], src, self.start, "vocab shard")

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group.world_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.shard)
        y = F.embedding(local.masked_fill(outside, 0), self.weight)
        y = y.masked_fill(outside.unsqueeze(-1), 0)
        return self.group.all_reduce(y)


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for this rank's vocab block, then an all-gather so every rank sees all of them."""

    def __init__(self, vocab_size: int, hidden: int, bias: bool, group: Any, dtype=torch.float32) -> None:
        super().__init__(vocab_size, hidden, group, dtype)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.shard, dtype=dtype), requires_grad=False)
            set_loader(self.bias, self._load)
        # The one form its weight is held and multiplied in (layers/linear_weight.py).
        self.weight_form: LinearWeight = DenseWeight(self.weight)

    def use_ops(self, ops: Ops) -> None:
        """Packed for our CPU kernels (or oneDNN) where one serves it, float32 products."""
        self.weight_form = ops.linear_form(self.weight, float32_out=True)

    quantizable = True  # by online quantization only when the scheme asks ("+head")

    def use_quantized(self, scheme: Any, ops: Ops) -> None:
        if not getattr(scheme, "lm_head", False):
            return self.use_ops(ops)
        self.weight_form = ops.quantized_form(self.weight, scheme.kind, scheme.group_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, H] -> [n, vocab] float32 logits on every TP rank."""
        logits = self.weight_form.apply(hidden, self.bias, out_dtype=torch.float32)
        if self.group.world_size > 1:
            logits = self.group.all_gather(logits, dim=-1)
        return logits if logits.shape[-1] == self.vocab_size else logits[..., : self.vocab_size]
