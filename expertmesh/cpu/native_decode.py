"""Decode steps through whole decoder layers in one native call (csrc/cpu_kernels.c, decode_layers).

At batch 1 a step's host cost (Python, torch's dispatcher, ~30 small torch ops and ~8 ctypes calls a
layer) was a large share of the step (docs/benchmarks.md, "Dispatch figures"). For a decode-only
step, a run of consecutive eligible layers goes through one C call that composes the same kernels
the per-op path calls, in the same order and with the same roundings: norm, qkv, q/k norm, rotary +
KV store, paged attention, o_proj, residual; norm, router, softmax/top-k, routed experts, residual.

Eligibility comes from the blocks: each block's `native_form()` returns its part of the
descriptor, or None when it has no native form (LayerNorm, MLA, a projection or L2 q/k norm,
clamped or biased experts held in float panels, oneDNN weights, a shared expert, routing rules
other than softmax-then-top-k and top-k-then-softmax, EP dispatch, TP or SP collectives). A
layer is native when all its blocks are; the others keep their torch path, which stays the
reference (tests/test_native_decode.py). Quantized weights (layers/quantization/packed.py) take
their GEMM and experts slots through C shims over gemm_q / moe_q_ex that convert where
QuantizedWeight / QuantizedMoE do, so they give the per-op path's roundings; quantized experts
bring their biases and clamped SwiGLU (gpt-oss held as MXFP4).

The descriptor (pointers, sizes) is built once, at the first decode step after the KV cache is
bound; per step only the metadata (rotary tables, slots, block tables) is built, once for all
layers. The native path is switched off by ``EngineArgs(native_decode=False)``.

When every layer is native and the model is whole on this rank (one pipeline stage, no TP), a
decode step is one call from token ids to float32 logits (decode_model_*, `NativeDecoder.logits`):
the embedding rows, the layers, the final RMSNorm and the LM head (its float32-output product, as
ParallelLMHead computes it), with the rotary rows read by position from the rotary table; the
per-op ends (embedding, rotary lookup, norm, head: ~20 torch ops and module calls) were a
measurable share of a batch-1 bf16 step (same section).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from expertmesh.cpu.cpu_kernels import CpuKernels
from expertmesh.cpu.native_desc import (  # noqa: F401 -- the descriptors, re-exported for callers
    _D,
    _I,
    _P,
    SHIM_SUFFIX,
    LayerDesc,
    ModelDesc,
    QExpertsDesc,
    QWeightDesc,
    StepMeta,
    c_entry,
    held_struct,
)
from expertmesh.layers.linear_weight import bias_ptr


def gemm_form(weight: Any, dtype: torch.dtype, keep: list, float32_out: bool = False) -> dict | None:
    """fn and weight pointers of a linear weight form our panel GEMM or gemm_q serves (activations
    in `dtype`; the product rounded to it, or left in float32 with `float32_out`), else None: the
    form's own `native_form` (layers/linear_weight.py)."""
    return weight.native_form(dtype, keep, float32_out)


def layer_descriptor(layer: Any, keep: list) -> LayerDesc | None:
    """The descriptor of one decoder layer, or None if one of its blocks has no native form."""
    native_form = getattr(layer, "native_form", None)
    form = native_form(keep) if native_form is not None else None
    if form is None:
        return None
    desc = LayerDesc()
    for name, value in form.items():
        setattr(desc, name, value)
    return desc


class NativeDecoder:
    """Runs decode-only steps of a DecoderModel's layers through decode_layers_<dtype>."""

    def __init__(self, kernels: CpuKernels, dtype: torch.dtype) -> None:
        self.kernels, self.dtype = kernels, dtype
        name = "decode_layers_f32" if dtype == torch.float32 else "decode_layers_bf16"
        self.fn = getattr(kernels.lib, name)
        self.fn.restype = ctypes.c_int64
        self.fn.argtypes = [_P, _I, _P, _P, _P, _P, _P, ctypes.c_int]
        self.plan: list[tuple[Any, Any]] | None = None  # [(descriptor array or None, layers)]
        self.keep: list = []
        name = "decode_model_f32" if dtype == torch.float32 else "decode_model_bf16"
        self.model_fn = getattr(kernels.lib, name, None)  # None: an older build
        if self.model_fn is not None:
            self.model_fn.restype = ctypes.c_int64
            self.model_fn.argtypes = [_P, _I, _P, _P, _P, _P, _P, _P, _P, ctypes.c_int]
        self.model: ModelDesc | None | bool = None  # the whole-model descriptor; False: not eligible

    def reset(self) -> None:
        """Forget the descriptors (the KV cache was re-bound, weights moved): rebuilt next step."""
        self.plan, self.keep, self.model = None, [], None

    def build(self, layers: list) -> list[tuple[Any, Any]]:
        """Consecutive native layers grouped into one descriptor array each; the others alone."""
        plan: list[tuple[Any, Any]] = []
        keep: list = []
        run: list = []
        for layer in layers:
            desc = layer_descriptor(layer, keep)
            if desc is not None:
                run.append((desc, layer))
                continue
            if run:
                plan.append(self._group(run))
                run = []
            plan.append((None, [layer]))
        if run:
            plan.append(self._group(run))
        self.plan, self.keep = plan, keep
        return plan

    @staticmethod
    def _group(run: list) -> tuple[Any, list]:
        arr = (LayerDesc * len(run))(*(d for d, _ in run))
        return arr, [layer for _, layer in run]

    @staticmethod
    def serves(ctx: Any) -> bool:
        """A decode-only step with the paged-decode tables (our kernels' metadata)."""
        meta = ctx.attn
        return not meta.prefills and meta.num_decodes > 0 and meta.decode_block_tables is not None

    def step_meta(
        self, ctx: Any, tokens: int, table: Any = None, positions: torch.Tensor | None = None
    ) -> tuple[StepMeta, list]:
        """The step's metadata; the rotary rows are ctx.rope's, or with `positions` read by
        position from `table`, a whole table (RotaryEmbedding.table)."""
        meta, rope = ctx.attn, (ctx.rope if positions is None else table)
        held = [meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens]
        m = StepMeta(tokens=tokens, width=meta.decode_block_tables.shape[1], count_load=int(ctx.count_load))
        if rope is not None and positions is not None:
            held += [rope, positions]
            m.cos, m.sin, m.rotary = rope.cos.data_ptr(), rope.sin.data_ptr(), rope.cos.shape[-1]
            m.interleaved, m.positions = int(rope.interleaved), positions.data_ptr()
        elif rope is not None:
            cos, sin = (t.reshape(tokens, -1).to(self.dtype).contiguous() for t in (rope.cos, rope.sin))
            held += [cos, sin]
            m.cos, m.sin, m.rotary = cos.data_ptr(), sin.data_ptr(), cos.shape[1]
            m.interleaved = int(rope.interleaved)
        m.slots = meta.slot_mapping.data_ptr()
        m.block_tables = meta.decode_block_tables.data_ptr()
        m.context_lens = meta.decode_context_lens.data_ptr()
        return m, held

    def run(self, layers: list, positions: torch.Tensor, x: torch.Tensor, ctx: Any) -> torch.Tensor:
        """x [B, hidden] (updated in place) through every layer; torch for the non-native ones and
        for the routing of a MoE block that hit a (near-)tie (torch.topk decides its order)."""
        plan = self.plan if self.plan is not None else self.build(layers)
        m, held = self.step_meta(ctx, x.shape[0])
        h = torch.empty_like(x)
        threads, mp, xp, hp = torch.get_num_threads(), ctypes.addressof(m), x.data_ptr(), h.data_ptr()
        for descs, group in plan:
            if descs is None or not all(layer.native_now(ctx) for layer in group):
                for layer in group:
                    x = layer(positions, x, ctx)
                xp = x.data_ptr()
                continue
            start, n, route = 0, len(group), (None, None)
            while start < n:
                addr = ctypes.addressof(descs) + start * ctypes.sizeof(LayerDesc)
                done = start + self.fn(addr, n - start, mp, xp, hp, *route, threads)
                if done == n:
                    break
                routing = group[done].moe_routing(h)  # torch's router and topk for this layer's block
                start, route = done, tuple(t.data_ptr() for t in routing)
        del held
        return x

    def build_model(self, model: Any, head: Any) -> ModelDesc | bool:
        """The whole-model descriptor of a DecoderModel and its LM head when one native call can
        run a decode step end to end: one pipeline stage, no TP, every layer native, an RMSNorm
        and a head our kernels serve with float32 output; False otherwise."""
        layers = list(model.layers.values())
        plan = self.plan if self.plan is not None else self.build(layers)
        embed = model.embed_tokens
        whole = (
            model.first and model.last and head is not None and len(plan) == 1 and plan[0][0] is not None
            and embed.group.world_size == 1 and head.group.world_size == 1 and head.shard == head.vocab_size
            and embed.weight.dtype == self.dtype and embed.weight.is_contiguous()
        )  # fmt: skip
        norm = model.norm.native_form() if whole and hasattr(model.norm, "native_form") else None
        form = None if norm is None else head.weight_form.native_form(self.dtype, self.keep, float32_out=True)
        if form is None:
            return False
        descs = plan[0][0]
        return ModelDesc(
            hidden=embed.weight.shape[1], embed=embed.weight.data_ptr(), embed_rows=embed.weight.shape[0],
            embed_multiplier=model.embedding_multiplier, layers=ctypes.addressof(descs), n_layers=len(descs),
            norm=norm[0], norm_eps=norm[1], head_fn=form["fn"], head_w=form["w"],
            head_bias=bias_ptr(head.bias, self.keep), vocab=head.vocab_size,
        )  # fmt: skip

    def logits(self, model: Any, head: Any, ids: torch.Tensor, positions: torch.Tensor, ctx: Any):
        """float32 logits [B, vocab] of a decode-only step, every row, in one native call (with a
        torch routing between calls where a layer's routing hit a near-tie); None where it does not serve:
        then the caller runs the model's forward."""
        if self.model_fn is None or not self.serves(ctx):
            return None
        if self.model is None:
            self.model = self.build_model(model, head)
        layers = self.plan[0][1] if self.model else None
        if not self.model or not all(layer.native_now(ctx) for layer in layers):
            return None
        rotary, tokens = model.rotary, ids.shape[0]
        ids, positions = ids.contiguous(), positions.contiguous()
        if rotary.length_dependent:
            ctx.rope = rotary.lookup(positions, self.dtype, ctx.attn.token_context_lens(positions))
            m, held = self.step_meta(ctx, tokens)
        else:
            table = rotary.table(int(positions.max()) + 1, self.dtype, positions.device)
            m, held = self.step_meta(ctx, tokens, table, positions)
        x = torch.empty(tokens, self.model.hidden, dtype=self.dtype)
        h = torch.empty_like(x)
        out = torch.empty(tokens, self.model.vocab, dtype=torch.float32)
        args = (ctypes.addressof(m), ids.data_ptr(), x.data_ptr(), h.data_ptr(), out.data_ptr())
        addr, start, threads = ctypes.addressof(self.model), 0, torch.get_num_threads()
        routing, route = None, (None, None)
        while (done := self.model_fn(addr, start, *args[:4], *route, args[4], threads)) != len(layers):
            if done < 0:
                bad, rows = int(ids[-1 - done]), self.model.embed_rows
                raise IndexError(f"token id {bad} is outside the embedding [0, {rows})")
            routing = layers[done].moe_routing(h)  # torch's router and topk for this layer's block
            start, route = done, tuple(t.data_ptr() for t in routing)
        del held, routing
        return out


def decoders(model: torch.nn.Module) -> list[NativeDecoder]:
    """The native decoders of a model's modules (one per DecoderModel)."""
    return [m.native for m in model.modules() if isinstance(getattr(m, "native", None), NativeDecoder)]


def set_native_decode(model: torch.nn.Module, enabled: bool) -> None:
    """EngineArgs.native_decode: False keeps every step on the per-op path (A/B, debugging)."""
    if not enabled:
        for module in model.modules():
            if isinstance(getattr(module, "native", None), NativeDecoder):
                module.native = None
