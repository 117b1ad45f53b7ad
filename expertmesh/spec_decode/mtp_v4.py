"""DeepSeek-V4's MTP layer (published as `mtp.0.*`), as DeepSeek's own inference/model.py `MTPBlock`
runs it (vLLM's deepseek_v4_mtp.py reads it alike), over the hyper-connection streams:

    e = enorm(embed(t[i+1]))                                   # the target's embedding
    x = e_proj(e)[:, None] + h_proj(hnorm(S[i]))               # S[i]: [hc_mult, D], per stream
    S' = block(x)                                              # a V4 layer: sliding attention, MoE
    logits = head(norm(hc_head(S')))                           # its own hc_head and norm, the target's head

S[i] is the target's residual streams at position i *before* its hc_head collapse (the runner keeps
them: `rows`), and a chained draft step reads S' (the streams, not the collapsed state), as vLLM
chains it. The block is the layer at index num_hidden_layers: the published compress_ratios' last
entry (0) makes it sliding-window only (no compressor, no indexer), its MoE routed by score (the
hash-routed layers are the first ones). The checkpoint has no copy of the embedding or the head.

Everything else (the per-sequence cache, DP lockstep dummies, layouts) is spec_decode/mtp.py's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import nn

from expertmesh.config import ModelConfig
from expertmesh.config.compressed_attention_config import SLIDING
from expertmesh.layers.embedding import VocabParallelEmbedding
from expertmesh.layers.hyper_connections import HyperHead
from expertmesh.layers.linear import ReplicatedLinear
from expertmesh.layers.norm import Float32RMSNorm
from expertmesh.spec_decode.mtp import MTPLayer
from expertmesh.spec_decode.mtp_families import mtp_family


def _with_mtp_layer(cfg: ModelConfig) -> ModelConfig:
    """`cfg` with the MTP layer's index num_layers in its per-layer lists: sliding attention (the
    published compress_ratios' last entry, 0) and a score-routed MoE."""
    c = cfg.compressed
    return replace(
        cfg,
        num_layers=cfg.num_layers + 1,
        layer_types=(*cfg.layer_types, SLIDING),
        compressed=replace(c, mlp_layer_types=(*c.mlp_layer_types, "moe")),
    )


class DeepseekV4MTPLayer(MTPLayer):
    """Parameters `mtp.*` (enorm, hnorm, e_proj, h_proj, hc_head, shared_head.norm) and `mtp.layer.*`
    (the block); the loader maps the published `mtp.0.*` names onto them (spec_decode/mtp_families.py)."""

    def __init__(self, cfg: ModelConfig, family: Any, env: Any, lm_head: nn.Module | None = None) -> None:
        nn.Module.__init__(self)
        from expertmesh.models.deepseek_v4 import DeepseekV4Layer  # models import spec_decode's config

        h, c, eps = cfg.hidden_size, cfg.compressed, cfg.norm_eps
        self.hc = c.hc_mult
        self.enorm = Float32RMSNorm(h, eps, torch.float32)
        self.hnorm = Float32RMSNorm(h, eps, torch.float32)
        self.e_proj = ReplicatedLinear(h, h, False, cfg.dtype)
        self.h_proj = ReplicatedLinear(h, h, False, cfg.dtype)
        self.layer = DeepseekV4Layer(_with_mtp_layer(cfg), cfg.num_layers, family, env)
        self.hc_head = HyperHead(c.hc_mult, h, c.hc_eps, eps)
        self.shared_head = nn.Module()
        self.shared_head.norm = Float32RMSNorm(h, eps, torch.float32)
        self.head = lm_head  # the target's (the published MTP layer has no head of its own)
        self.normed_output = False
        # A later pipeline stage has no target embedding: the loader fills this one from it.
        tp = env.groups.tp
        self.embed_tokens = (
            None if env.is_first_stage else VocabParallelEmbedding(cfg.vocab_size, h, tp, cfg.dtype)
        )
        self.index = cfg.num_layers
        self.row_width, self.dtype = c.hc_mult * h, cfg.dtype  # the streams, flattened
        self._scratch = None

    def attach(self, model: nn.Module) -> None:
        model.model.keep_streams = True  # the runner reads the streams before hc_head (`rows`)

    def rows(self, model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        return model.model.streams.flatten(1)

    @torch.inference_mode()
    def forward(
        self,
        embed: nn.Module,
        rotary: Any,
        ids: torch.Tensor,
        hidden: torch.Tensor,
        context: int,
        cache: list[torch.Tensor],
        block_size: int,
        counts: list[int] | None = None,
    ) -> torch.Tensor:
        """The block's output streams [m, hc * D] at MTP positions context..context+m-1 (ids[j] =
        t[context+j+1], hidden[j] = the target's streams at context+j, flattened)."""
        m, d = ids.shape[0], hidden.shape[-1] // self.hc
        e = self.e_proj(self.enorm(embed(ids)))
        s = self.h_proj(self.hnorm(hidden.reshape(m * self.hc, d))).view(m, self.hc, d)
        x = (s + e.unsqueeze(1)).contiguous()
        pos, ctx = self._context(cache, x, context, block_size, counts, None)
        ctx.input_ids = ids  # read by hash-routed layers only; set as the target's forward does
        return self.layer(pos, x, ctx).flatten(1)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        streams = h.view(h.shape[0], self.hc, -1)
        return self.head(self.shared_head.norm(self.hc_head(streams))).float()


# The MTP layer classes a family declares by name (spec_decode/mtp_families.py MTPFamily.layer).
MTP_LAYERS: dict[str, type[MTPLayer]] = {"decoder": MTPLayer, "hyper_connections": DeepseekV4MTPLayer}


def mtp_layer_class(architecture: str) -> type[MTPLayer]:
    """The MTP layer class a family declares: DeepSeek-V4's runs over its hyper-connection streams."""
    return MTP_LAYERS[mtp_family(architecture).layer]
