"""Hash routing (DeepSeek-V4's leading `hash_moe` layers): which experts a token goes to is a fixed
table of its token id (`tid2eid` [vocab, top_k], from the checkpoint), not a top-k of scores; the
router linear still scores every expert (sqrt(softplus) for V4), and the weights are the chosen
experts' scores renormalised to sum 1, times routed_scaling_factor, as for the scored layers.

The MoE block hands the step's token ids (ForwardContext.input_ids, the rows of its tokens) to a
router that says `by_token`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from expertmesh.layers.linear import ReplicatedLinear
from expertmesh.layers.weights import copy_into, read, set_loader

# scoring functions by the config's scoring_func name
SCORES = {
    "sqrtsoftplus": lambda x: F.softplus(x).sqrt(),
    "sigmoid": torch.sigmoid,
    "softmax": lambda x: torch.softmax(x, dim=-1),
}
# router rule (MoESpec.router) -> its scoring function: the hash-routed layers of a family
HASH_RULES = {"hash_sqrtsoftplus": "sqrtsoftplus"}


class HashRouter(ReplicatedLinear):
    """The router linear [E, H] and `tid2eid`: (x [n, H], token ids [n]) -> (weights, ids) [n, k]."""

    quantizable = False
    by_token = True

    def __init__(
        self, hidden: int, num_experts: int, rule: str, top_k: int, vocab: int, scaling: float, dtype=None
    ) -> None:
        super().__init__(hidden, num_experts, False, dtype)
        self.rule, self.top_k, self.scaling, self.num_experts = rule, top_k, scaling, num_experts
        self.score = SCORES[HASH_RULES[rule]]
        self.tid2eid = nn.Parameter(torch.zeros(vocab, top_k, dtype=torch.int64), requires_grad=False)
        set_loader(self.tid2eid, self._load_table)

    def _load_table(self, param: nn.Parameter, src: Any, shard_id: Any = None) -> None:
        table = read(src)
        if table.is_meta:  # the loader's shape check
            return copy_into(param.data, table, "hash routing table tid2eid")
        if table.dtype.is_floating_point:
            raise ValueError(f"tid2eid: expert ids must be integers, not {table.dtype}")
        if table.numel() and not 0 <= int(table.min()) <= int(table.max()) < self.num_experts:
            raise ValueError(f"tid2eid: expert ids must be integers in [0, {self.num_experts})")
        copy_into(param.data, table.long(), "hash routing table tid2eid")

    def native_form(self, keep: list) -> None:
        return None  # not a rule the native decode layer computes

    def forward(
        self, x: torch.Tensor, token_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if token_ids is None:
            raise ValueError("a hash-routed MoE layer needs the step's token ids")
        scores = self.score(super().forward(x).float())
        ids = self.tid2eid[token_ids.long()]
        weights = scores.gather(1, ids)
        return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling, ids
