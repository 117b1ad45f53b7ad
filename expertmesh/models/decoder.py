"""The decoder-only transformer every registered family is built from.

A family class declares its building blocks (models/family.py: norm kind, q/k norm, router,
expert activation, shared expert, attention sinks, rotary layout, checkpoint names); the
config decides sizes, per-layer attention (sliding, chunked, with or without RoPE), dense
leading layers and scalar multipliers. The parallel layers do the sharding.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, ClassVar

import torch
from torch import nn

from expertmesh.config import ModelConfig
from expertmesh.forward_context import ForwardContext
from expertmesh.layers.compressed_attention import CompressedAttention
from expertmesh.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from expertmesh.layers.gated_deltanet import GatedDeltaNet, SplitGatedDeltaNet
from expertmesh.layers.mamba2 import Mamba2Mixer
from expertmesh.layers.mla import MLAAttention
from expertmesh.layers.mlp import GatedMLP, UngatedMLP
from expertmesh.layers.moe import MoE, MoESpec
from expertmesh.layers.norm import NORMS
from expertmesh.layers.ops import NativeDecode, Ops
from expertmesh.layers.rotary import RotaryEmbedding
from expertmesh.models.decoder_attention import DecoderAttention, GatedDecoderAttention
from expertmesh.models.family import Family
from expertmesh.registries import lookup


def _kv_layers(attention: nn.Module) -> list[Any]:
    """An attention block's cache slots: its `.attn`, or what it lists (MLA with DSA's indexer)."""
    listed = getattr(attention, "kv_layers", None)
    return listed() if listed is not None else [attention.attn]


# Attention kinds a family picks by name; each owns its projections and its KV-cache kind
# (`.attn.kv_spec`): per-head K/V for GQA/MHA, one latent row per token for MLA; "compressed":
# DeepSeek-V4's shared K=V head over a window plus compressed entries (its own cache rows).
ATTENTION_KINDS = {
    "gqa": DecoderAttention,
    "mla": MLAAttention,
    "gated_gqa": GatedDecoderAttention,
    "compressed": CompressedAttention,
}


def _gated_deltanet(cfg: ModelConfig, index: int, family: Family, tp: Any) -> nn.Module:
    return GatedDeltaNet(cfg.linear_attn, cfg.hidden_size, cfg.norm_eps, tp, cfg.dtype)


def _gated_deltanet_split(cfg: ModelConfig, index: int, family: Family, tp: Any) -> nn.Module:
    return SplitGatedDeltaNet(cfg.linear_attn, cfg.hidden_size, cfg.norm_eps, tp, cfg.dtype)


def _mamba2(cfg: ModelConfig, index: int, family: Family, tp: Any) -> nn.Module:
    return Mamba2Mixer(cfg.mamba, cfg.hidden_size, cfg.norm_eps, tp, cfg.dtype)


# Recurrent token mixers of hybrid families' "linear_attention" layers, by name; each declares its
# per-sequence state (`.state_spec`, engine/state_cache.py) and takes it with `bind_state`.
# "gated_deltanet": fused in_proj_qkvz / in_proj_ba (Qwen3-Next); "_split": Qwen3.5's four.
LINEAR_MIXERS = {
    "gated_deltanet": _gated_deltanet,
    "gated_deltanet_split": _gated_deltanet_split,
    "mamba2": _mamba2,
}


def moe_spec(cfg: ModelConfig, family: Family) -> MoESpec:
    width = (
        cfg.moe_intermediate_size
        if family.shared_expert_width == "routed"
        else cfg.shared_expert_intermediate_size
    )
    return MoESpec(
        router=family.router_for(cfg.topk_method), router_bias=family.router_bias,
        activation=family.expert_activation, expert_bias=family.expert_bias,
        weights_input=family.router_weights_input,
        shared_expert=family.shared_expert, shared_width=width,
    )  # fmt: skip


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, family: Family, env: Any) -> None:
        super().__init__()
        norm = lookup(NORMS, family.norm, "norm")
        self.input_layernorm = norm(cfg.hidden_size, cfg.norm_eps, cfg.dtype)
        self.is_linear = cfg.layer_type(index) == "linear_attention"
        if self.is_linear:  # a hybrid family's recurrent layer: its mixer in place of attention
            if family.linear_attention is None:
                raise ValueError(
                    f"layer_types ['linear_attention'] are not supported by {cfg.architecture}; its family "
                    "declares no recurrent mixer (hybrid families: Qwen3-Next, Qwen3.5-MoE, Granite-4.0-H)"
                )
            mixer = lookup(LINEAR_MIXERS, family.linear_attention, "linear attention kind")
            self.linear_attn = mixer(cfg, index, family, env.groups.tp)
        else:
            self.self_attn = lookup(ATTENTION_KINDS, family.attention, "attention kind")(
                cfg, index, family, env.groups.tp
            )
        self.post_attention_layernorm = norm(cfg.hidden_size, cfg.norm_eps, cfg.dtype)
        self.is_moe = cfg.is_moe_layer(index)
        if self.is_moe:
            dispatcher = env.make_dispatcher(cfg.num_experts)
            placement = env.placement_for(index, cfg.num_experts)
            mlp = MoE(cfg, moe_spec(cfg, family), env.moe_plan, env.groups, dispatcher, placement, index)
        else:
            mlp = GatedMLP(
                cfg.hidden_size, cfg.dense_intermediate_size, cfg.hidden_act, env.groups.tp, dtype=cfg.dtype
            )
        setattr(self, family.mlp_name, mlp)
        self.mlp_name = family.mlp_name
        self.residual_multiplier = cfg.residual_multiplier

    def native_form(self, keep: list) -> dict | None:
        """The whole layer's descriptor fields (cpu/native_decode.py) when every block has a
        native form: RMSNorms, GQA attention, a MoE block (dense MLP layers have none yet)."""
        if self.is_linear:
            return None
        blocks = (self.input_layernorm, self.post_attention_layernorm, self.self_attn)
        if not self.is_moe or not all(hasattr(b, "native_form") for b in blocks):
            return None
        norm_in, norm_post = self.input_layernorm.native_form(), self.post_attention_layernorm.native_form()
        attn = self.self_attn.native_form(keep)
        moe = getattr(self, self.mlp_name).native_form(keep)
        if norm_in is None or norm_post is None or attn is None or moe is None or norm_in[1] != norm_post[1]:
            return None
        return dict(
            hidden=self.input_layernorm.weight.shape[0], eps=norm_in[1], input_norm=norm_in[0],
            post_norm=norm_post[0], residual_multiplier=self.residual_multiplier, **attn, **moe,
        )  # fmt: skip

    def native_now(self, ctx: ForwardContext) -> bool:
        return self._modules[self.mlp_name].native_now(ctx)  # every step: not Module.__getattr__

    def moe_routing(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The MoE block's routing of its normed input h by torch (the native path's fallback at a
        routing near-tie): local expert slots [n, k] int32 and weights [n, k] float32."""
        return self._modules[self.mlp_name].native_routing(h)

    def kv_layers(self) -> list[Any]:
        """This layer's modules owning a KV cache slot (`kv_spec`, `bind_kv_cache`), in order."""
        return [] if self.is_linear else _kv_layers(self.self_attn)

    def state_module(self) -> Any:
        """The module owning this layer's per-sequence recurrent state, or None."""
        return self.linear_attn if self.is_linear else None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        mixer = self.linear_attn if self.is_linear else self.self_attn
        y = mixer(positions, self.input_layernorm(x), ctx)
        x = x + (y if self.residual_multiplier == 1.0 else y * self.residual_multiplier)
        mlp = getattr(self, self.mlp_name)
        h = self.post_attention_layernorm(x)
        y = mlp(h, ctx) if self.is_moe else mlp(h)
        return x + (y if self.residual_multiplier == 1.0 else y * self.residual_multiplier)


def _dense_mlp(cfg: ModelConfig, family: Family, tp: Any) -> nn.Module:
    mlp = lookup({"gated": GatedMLP, "ungated": UngatedMLP}, family.dense_mlp, "dense MLP kind")
    return mlp(cfg.hidden_size, cfg.dense_intermediate_size, cfg.hidden_act, tp, dtype=cfg.dtype)


class BlockLayer(nn.Module):
    """One block a layer (Nemotron-H): a norm, then the one block the config's layer_types names
    for this layer (a recurrent mixer, attention, the MoE or a dense MLP), then the residual; the
    block lives at `mixer` as in the checkpoint."""

    def __init__(self, cfg: ModelConfig, index: int, family: Family, env: Any) -> None:
        super().__init__()
        self.norm = lookup(NORMS, family.norm, "norm")(cfg.hidden_size, cfg.norm_eps, cfg.dtype)
        self.kind = kind = cfg.layer_type(index)
        self.is_linear, self.is_moe = kind == "linear_attention", kind == "moe"
        self.is_attention = not self.is_linear and kind not in ("moe", "mlp")
        tp = env.groups.tp
        if self.is_linear:
            if family.linear_attention is None:
                raise ValueError(
                    f"layer_types ['linear_attention']: {cfg.architecture} declares no recurrent mixer"
                )
            self.mixer = lookup(LINEAR_MIXERS, family.linear_attention, "linear attention kind")(
                cfg, index, family, tp
            )
        elif self.is_moe:
            if not cfg.is_moe:
                raise ValueError(f"layer {index} is an MoE layer but the config has no experts")
            dispatcher = env.make_dispatcher(cfg.num_experts)
            placement = env.placement_for(index, cfg.num_experts)
            self.mixer = MoE(
                cfg, moe_spec(cfg, family), env.moe_plan, env.groups, dispatcher, placement, index
            )
        elif kind == "mlp":
            self.mixer = _dense_mlp(cfg, family, tp)
        else:
            self.mixer = lookup(ATTENTION_KINDS, family.attention, "attention kind")(cfg, index, family, tp)

    def kv_layers(self) -> list[Any]:
        return _kv_layers(self.mixer) if self.is_attention else []

    def state_module(self) -> Any:
        return self.mixer if self.is_linear else None

    def native_form(self, keep: list) -> dict | None:
        return None  # a native decode layer is attention + MoE; these blocks run in torch

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = self.norm(x)
        if self.is_moe:
            return x + self.mixer(h, ctx)
        if self.kind == "mlp":
            return x + self.mixer(h)
        return x + self.mixer(positions, h, ctx)


class ShortcutMoELayer(nn.Module):
    """LongCat-Flash's layer: two (attention, dense MLP) sublayers, each pre-normed with a residual,
    and one MoE branch beside them: the MoE takes the first sublayer's normed MLP input and its
    output joins the second MLP's residual sum. Each attention block has its own KV cache slot
    (`kv_layers`), so a layer holds two (its index in the checkpoint: self_attn.0 / self_attn.1)."""

    is_linear, native_form = False, None  # no native decode form

    def __init__(self, cfg: ModelConfig, index: int, family: Family, env: Any) -> None:
        super().__init__()
        if not cfg.is_moe_layer(index):
            raise ValueError(f"{cfg.architecture}: layer {index} has no MoE branch; a shortcut layer has one")
        norm, tp = lookup(NORMS, family.norm, "norm"), env.groups.tp
        attention = lookup(ATTENTION_KINDS, family.attention, "attention kind")
        self.input_layernorm = nn.ModuleList(norm(cfg.hidden_size, cfg.norm_eps, cfg.dtype) for _ in range(2))
        self.post_attention_layernorm = nn.ModuleList(
            norm(cfg.hidden_size, cfg.norm_eps, cfg.dtype) for _ in range(2)
        )
        self.self_attn = nn.ModuleList(attention(cfg, index, family, tp) for _ in range(2))
        self.mlps = nn.ModuleList(
            GatedMLP(cfg.hidden_size, cfg.dense_intermediate_size, cfg.hidden_act, tp, dtype=cfg.dtype)
            for _ in range(2)
        )
        dispatcher = env.make_dispatcher(cfg.num_experts)
        placement = env.placement_for(index, cfg.num_experts)
        mlp = MoE(cfg, moe_spec(cfg, family), env.moe_plan, env.groups, dispatcher, placement, index)
        setattr(self, family.mlp_name, mlp)
        self.mlp_name = family.mlp_name

    def kv_layers(self) -> list[Any]:
        return [layer for attn in self.self_attn for layer in _kv_layers(attn)]

    def state_module(self) -> None:
        return None

    def forward(self, positions: torch.Tensor, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        x = x + self.self_attn[0](positions, self.input_layernorm[0](x), ctx)
        h = self.post_attention_layernorm[0](x)
        shortcut = self._modules[self.mlp_name](h, ctx)
        x = x + self.mlps[0](h)
        x = x + self.self_attn[1](positions, self.input_layernorm[1](x), ctx)
        return x + self.mlps[1](self.post_attention_layernorm[1](x)) + shortcut


# How a family's layers are built (Family.layer).
LAYER_KINDS = {"decoder": DecoderLayer, "block": BlockLayer, "shortcut_moe": ShortcutMoELayer}


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, family: Family, env: Any) -> None:
        super().__init__()
        tp = env.groups.tp
        self.layer_range = env.layer_range
        self.first, self.last = env.is_first_stage, env.is_last_stage
        self.rotary = RotaryEmbedding(
            replace(cfg.rope, interleaved=cfg.rope.interleaved or family.rope_interleaved)
        )
        self.embed_tokens = (
            VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, cfg.dtype) if self.first else None
        )
        self.embedding_multiplier = cfg.embedding_multiplier
        self.dtype = cfg.dtype
        # Layers of other pipeline stages are absent; a ModuleDict keeps checkpoint indices.
        layer = lookup(LAYER_KINDS, family.layer, "decoder layer kind")
        self.layers = nn.ModuleDict({str(i): layer(cfg, i, family, env) for i in self.layer_range})
        norm = lookup(NORMS, family.norm, "norm")
        self.norm = norm(cfg.hidden_size, cfg.norm_eps, cfg.dtype) if self.last else None
        self.native: NativeDecode | None = None  # decode steps in one native call, see use_ops

    def use_ops(self, ops: Ops) -> None:
        """Where the ops have one (our kernels), decode-only steps run runs of eligible layers in one
        call (cpu/native_decode.py; off with EngineArgs(native_decode=False))."""
        if len(self.layers):
            self.native = ops.native_decoder(self.dtype)

    def forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, hidden: torch.Tensor | None, ctx
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids) if self.first else hidden
        if self.first and self.embedding_multiplier != 1.0:
            x = x * self.embedding_multiplier
        lens = ctx.attn.token_context_lens(positions) if self.rotary.length_dependent else None
        ctx.rope = self.rotary.lookup(positions, x.dtype, lens)
        if self.native is not None and self.native.serves(ctx) and x.dtype == self.native.dtype:
            x = self.native.run(list(self.layers.values()), positions, x.contiguous().clone(), ctx)
            return self.norm(x) if self.last else x
        for layer in self.layers.values():
            x = layer(positions, x, ctx)
        return self.norm(x) if self.last else x


class CausalLM(nn.Module):
    """Base of every family: `model` (embed, layers, norm) and `lm_head`, HF parameter names."""

    family: ClassVar[Family] = Family()

    def __init__(self, cfg: ModelConfig, env: Any) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = DecoderModel(cfg, self.family, env)
        self.lm_head = None
        if env.is_last_stage:
            self.lm_head = ParallelLMHead(
                cfg.vocab_size, cfg.hidden_size, cfg.lm_head_bias, env.groups.tp, cfg.dtype
            )

    @property
    def stage_shape(self) -> tuple[int, ...]:
        """What a pipeline stage hands the next for each token: the hidden state (a family whose
        residual is wider, DeepSeek-V4's hc_mult streams, says so)."""
        return (self.cfg.hidden_size,)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        ctx: ForwardContext,
        hidden: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, hidden, ctx)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        return logits if self.cfg.logits_scaling == 1.0 else logits / self.cfg.logits_scaling

    def decode_logits(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor | None:
        """A decode-only step's float32 logits, every row, through one native call (embedding,
        layers, norm, head: cpu/native_decode.py), or None where that path does not serve."""
        native = self.model.native
        if native is None:
            return None
        logits = native.logits(self.model, self.lm_head, input_ids, positions, ctx)
        if logits is None or self.cfg.logits_scaling == 1.0:
            return logits
        return logits / self.cfg.logits_scaling

    def attention_layers(self) -> list[Any]:
        """The modules that own a KV cache slot (`kv_spec`, `bind_kv_cache`), in layer order: one per
        attention layer, two per LongCat-Flash layer."""
        return [attn for layer in self.model.layers.values() for attn in layer.kv_layers()]

    def state_layers(self) -> list[Any]:
        """The modules that own a per-sequence recurrent state (`state_spec`, `bind_state`)."""
        return [m for m in (layer.state_module() for layer in self.model.layers.values()) if m is not None]
