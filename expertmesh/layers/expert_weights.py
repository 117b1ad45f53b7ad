"""The weights of a stack of routed experts, held in exactly one form that applies itself.

FusedExperts (layers/fused_moe.py) holds one `ExpertsWeight`, chosen once by the model's ops
(layers/ops.py `experts_form` / `quantized_experts_form`): after loading (`use_ops`), or while
loading (`use_quantized` / `hold_quantized`). The block then calls
``experts_form.apply(block, x, topk_ids, topk_weights)`` and never asks which backend runs it.

Here the forms torch runs:

- `DenseExperts`: the block's own [E, 2I, H] / [E, H, I] parameters, per expert through torch;
- `PerExpertWeights`: one (w13, w2) linear weight form a local expert (layers/linear_weight.py:
  packed panels, oneDNN, quantized codes, desc_act's permuted inputs), per expert.

Our fused kernels' forms (`PanelStacks`, `QuantizedStacks`, deterministic mode's `ChunkedStacks`
and `ChunkPanels`) are cpu/expert_forms.py's.

The forms read the block's routing state (its slot table, activation, biases, shard) at each
call, so EPLB's moves and copies into the biases are seen.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from expertmesh.distributed.fixed_sum import tree_sum
from expertmesh.layers.identity_experts import lookup_picks


class ExpertsWeight(Protocol):
    """A stack of local experts' weights in one form."""

    def apply(
        self, block: Any, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """x [n, H], topk [n, k] -> [n, H] float32, this rank's partial sum over its experts."""
        ...

    def pair_sums(
        self, block: Any, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """Deterministic mode: [n, k, H] float32 unweighted outputs per (token, pick) (FusedExperts)."""
        ...

    def native_form(self, block: Any, keep: list) -> dict | None:
        """Its part of a native decode layer's descriptor (cpu/native_decode.py), or None."""
        ...

    def slot_tensors(self, slot: int) -> list[torch.Tensor]:
        """Views of local slot `slot`'s weights as stored: what EPLB copies between ranks in place."""
        ...

    def resident(self) -> list[tuple[torch.Tensor, str]]:
        """The tensors it holds, each with "quantized" or "dense" (quantization/accounting.py)."""
        ...


def _biases(block: Any, e: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Expert e's (gate|up, down) biases; the down bias joins once across the shards of the
    intermediate dim: on shard 0."""
    b13 = None if block.w13_bias is None else block.w13_bias[e]
    b2 = None if block.w2_bias is None or block.shard_rank else block.w2_bias[e]
    return b13, b2


class _ExpertByExpert:
    """Tokens sorted by expert, one pair of matmuls per local expert (`expert`)."""

    def expert(self, block: Any, e: int, x: torch.Tensor) -> torch.Tensor:
        """[m, H] -> [m, H] float32: the down projection's product is not rounded."""
        raise NotImplementedError

    def apply(
        self, block: Any, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        if x.shape[0] == 1:
            return self._one_token(block, x, topk_ids, topk_weights)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        if x.shape[0] == 0:
            return out
        k = topk_ids.shape[1]
        slot = lookup_picks(block.local_index, topk_ids).flatten()  # [n*k], -1: another rank's, or none
        order = torch.argsort(slot, stable=True)
        counts = torch.bincount(slot + 1, minlength=len(block.expert_ids) + 1).tolist()
        order = order[counts[0] :]  # drop (token, expert) pairs owned elsewhere
        token = order // k  # [m] source token of each sorted pair
        xs = x[token]  # [m, H]
        pair_weights = topk_weights.flatten()[order].unsqueeze(1)  # [m, 1]
        if block.weight_on_input:
            xs = xs * pair_weights.to(xs.dtype)
        ys = torch.empty(xs.shape, dtype=torch.float32, device=x.device)
        start = 0
        for e, count in enumerate(counts[1:]):
            if count:
                ys[start : start + count] = self.expert(block, e, xs[start : start + count])
                start += count
        if not block.weight_on_input:
            ys *= pair_weights.float()
        return out.index_add_(0, token, ys)

    def _one_token(
        self, block: Any, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """Decode at batch 1: no sort, gather or scatter, just the chosen local experts in expert order."""
        local = lookup_picks(block.local_index, topk_ids[0]).tolist()
        picks = sorted((slot, j) for j, slot in enumerate(local) if slot >= 0)
        out = None
        for slot, j in picks:
            w = topk_weights[0, j]
            if block.weight_on_input:
                y = self.expert(block, slot, x * w.to(x.dtype))
            else:
                y = self.expert(block, slot, x) * w.float()
            out = y if out is None else out + y
        return torch.zeros(x.shape, dtype=torch.float32, device=x.device) if out is None else out

    def pair_sums(self, block: Any, x, topk_ids, topk_weights) -> torch.Tensor:
        raise ValueError(f"deterministic=True does not serve {type(self).__name__} experts")

    def native_form(self, block: Any, keep: list) -> None:
        return None  # per expert in Python: no native decode experts slot


class DenseExperts(_ExpertByExpert):
    """The block's own dense stacks, per expert through F.linear (no kernel of ours packed them)."""

    def __init__(self, w13: nn.Parameter, w2: nn.Parameter) -> None:
        self.w13, self.w2 = w13, w2  # the Parameters: moves and loads replace their data

    def expert(self, block: Any, e: int, x: torch.Tensor) -> torch.Tensor:
        b13, b2 = _biases(block, e)
        h = F.linear(x, self.w13[e], b13)
        return F.linear(block.act(h).float(), self.w2[e].float(), None if b2 is None else b2.float())

    def _chunk(self, block: Any, j: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Chunk j's [E, 2c, H] gate|up rows and [E, H, c] down columns."""
        return chunk_dense(self.w13.data, self.w2.data, block.inter, block.fixed_chunks, j)

    def pair_sums(
        self, block: Any, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """Per expert and fixed chunk through torch, the chunks added by the fixed tree."""
        chunks = [self._chunk(block, j) for j in range(block.fixed_chunks)]
        return chunk_sums(block, x, topk_ids, topk_weights, lambda e: [(a[e], b[e]) for a, b in chunks])

    def slot_tensors(self, slot: int) -> list[torch.Tensor]:
        return [self.w13.data[slot], self.w2.data[slot]]

    def resident(self) -> list[tuple[torch.Tensor, str]]:
        return [(self.w13.data, "dense"), (self.w2.data, "dense")]


def chunk_sums(
    block: Any, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, chunks_of: Any
) -> torch.Tensor:
    """Deterministic mode, expert by expert: [n, k, H] float32, each (token, pick)'s unweighted output
    over this rank's fixed chunks (`chunks_of(e)`: local expert e's (w13, w2) per chunk, dense
    tensors or our GEMM's panels) added by the fixed tree; zero for picks held elsewhere."""
    n, k = topk_ids.shape
    out = torch.zeros((n, k, x.shape[1]), dtype=torch.float32, device=x.device)
    if n == 0 or not block.expert_ids:
        return out
    slot = lookup_picks(block.local_index, topk_ids)  # [n, k], -1 elsewhere (or an identity expert)
    c, inter = block.inter // block.fixed_chunks, block.inter
    for e in range(len(block.expert_ids)):
        tok, pick = (slot == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        xs = x[tok]
        if block.weight_on_input:
            xs = xs * topk_weights[tok, pick].unsqueeze(1).to(xs.dtype)
        parts = []
        for j, (w13, w2) in enumerate(chunks_of(e)):
            b13 = None
            if block.w13_bias is not None:
                b = block.w13_bias.data[e]
                b13 = torch.cat([b[j * c : (j + 1) * c], b[inter + j * c : inter + (j + 1) * c]])
            if isinstance(w13, torch.Tensor):
                h = block.act(F.linear(xs, w13, b13))
                parts.append(F.linear(h.float(), w2.float()))
            else:  # our GEMM's panels: a row's product whatever the rows
                h = block.act(w13(xs.contiguous(), b13))
                parts.append(w2(h.contiguous(), None, torch.float32))
        out[tok, pick] = tree_sum(parts)
    return out


def chunk_dense(
    w13: torch.Tensor, w2: torch.Tensor, inter: int, chunks: int, j: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed chunk j of the intermediate dim: [E, 2c, H] gate|up rows and [E, H, c] down columns."""
    c = inter // chunks
    cols = slice(j * c, (j + 1) * c)
    gate_up = torch.cat([w13[:, cols], w13[:, inter + j * c : inter + (j + 1) * c]], 1)
    return gate_up.contiguous(), w2[:, :, cols].contiguous()


class PerExpertWeights(_ExpertByExpert):
    """One (w13, w2) pair of linear weight forms a local expert: packed panels, oneDNN, quantized
    codes or desc_act's permuted inputs (one form a slot, so that EPLB can move any expert anywhere)."""

    def __init__(self, pairs: list[tuple[Any, Any]]) -> None:
        self.pairs = pairs

    def expert(self, block: Any, e: int, x: torch.Tensor) -> torch.Tensor:
        b13, b2 = _biases(block, e)
        w13, w2 = self.pairs[e]
        return w2.apply(block.act(w13.apply(x, b13)), b2, out_dtype=torch.float32)

    def slot_tensors(self, slot: int) -> list[torch.Tensor]:
        return [t for w in self.pairs[slot] for t in w.slot_tensors()]

    def resident(self) -> list[tuple[torch.Tensor, str]]:
        return [t for pair in self.pairs for w in pair for t in w.resident()]
