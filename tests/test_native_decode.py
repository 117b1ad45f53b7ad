"""Decode steps through whole decoder layers in one native call (cpu/native_decode.py) against
the per-op path they replace (EngineArgs(native_decode=False)), which stays the reference: the
same tokens and logprobs, fp32 and bf16, over uneven batches and prompts crossing KV blocks;
routing ties decided by torch.topk; the expert-load counts; which layers are eligible; and quantized
weights (online schemes) through the gemm_q / moe_q shims."""

from __future__ import annotations

import pytest
from expect import kernels_disabled, no_kernels

from expertmesh import LLM, SamplingParams
from expertmesh.cpu import cpu_kernels
from expertmesh.cpu.native_decode import NativeDecoder, decoders
from expertmesh.cpu.ops import ops_for
from expertmesh.layers.torch_ops import TORCH_OPS
from expertmesh.models.decoder import DecoderLayer

# only a deliberate EXPERTMESH_DISABLE_CPU_KERNELS skips; a build failure fails (the `kernels` fixture)
pytestmark = pytest.mark.skipif(
    kernels_disabled(), reason="CPU kernels switched off by EXPERTMESH_DISABLE_CPU_KERNELS"
)


@pytest.fixture(autouse=True, scope="module")
def _kernels_built():
    """The engine falls back to torch quietly when the kernels do not build: here that fails."""
    if cpu_kernels.load() is None:
        no_kernels()


# Prompt lengths crossing blocks of 4 tokens; each request stops at its own length, so the decode
# batch shrinks from 4 to 1 over the run.
LENGTHS, MAX_TOKENS = [1, 9, 30, 17], [6, 3, 9, 5]


def _prompts() -> list[list[int]]:
    from checkpoints import prompts_of_lengths

    return prompts_of_lengths(LENGTHS, seed=5)


def _llm(path: str, dtype: str, native: bool, **kw) -> LLM:
    return LLM(
        path, dtype=dtype, max_model_len=128, block_size=4, kv_cache_memory_bytes=1 << 22,
        native_decode=native, **kw,
    )  # fmt: skip


class Calls:
    """Counts native calls and torch fallbacks of MoE routing (near-ties)."""

    def __init__(self, monkeypatch, llm: LLM) -> None:
        self.native = self.fallback = self.whole = 0
        for dec in decoders(llm.llm_engine.runner.model):
            fn = dec.fn

            def counted(*args, _fn=fn):
                self.native += 1
                return _fn(*args)

            dec.fn = counted
            if dec.model_fn is not None:  # whole steps (decode_model): each call runs the layers too
                model_fn = dec.model_fn

                def counted_model(*args, _fn=model_fn):
                    self.native += 1
                    self.whole += 1
                    return _fn(*args)

                dec.model_fn = counted_model
        original = DecoderLayer.moe_routing

        def moe_routing(layer, h):
            self.fallback += 1
            return original(layer, h)

        monkeypatch.setattr(DecoderLayer, "moe_routing", moe_routing)


def _generate(llm: LLM, vocab_logprobs: int = 4) -> list[tuple[list[int], list[dict]]]:
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=vocab_logprobs)
        for n in MAX_TOKENS
    ]
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


def _assert_same(ref: list, got: list, atol: float) -> None:
    for (ref_ids, ref_lps), (ids, lps) in zip(ref, got, strict=True):
        assert ids == ref_ids
        for a, b in zip(ref_lps, lps, strict=True):
            assert a.keys() == b.keys()
            for t in a:
                assert abs(a[t].logprob - b[t].logprob) <= atol, (t, a[t].logprob, b[t].logprob)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "family, overrides",
    [
        ("mixtral", {}),
        ("mixtral", {"sliding_window": 6}),  # a window shorter than the longest context
        ("qwen3_moe", {}),  # per-head q/k RMSNorm, renormalised top-k
    ],
    ids=["mixtral", "mixtral-window", "qwen3_moe"],
)
def test_native_decode_matches_per_op_path(checkpoint, monkeypatch, family, overrides, dtype):
    path = checkpoint(family, **overrides)
    ref = _generate(_llm(path, dtype, native=False))
    llm = _llm(path, dtype, native=True)
    calls = Calls(monkeypatch, llm)
    got = _generate(llm)
    assert calls.native >= sum(MAX_TOKENS) // 4 and calls.fallback <= calls.native  # it did run natively
    assert calls.whole == calls.native  # every layer native: whole steps (embedding to logits)
    # Same kernels in the same order: equal up to the router's softmax (expf against torch's exp).
    _assert_same(ref, got, atol=1e-4 if dtype == "float32" else 2e-2)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_whole_step_multipliers(checkpoint, monkeypatch, dtype):
    """Granite's scalars (embedding and residual multipliers, logits scaling) set on a Mixtral:
    the whole-step call (decode_model) scales where the per-op path does."""
    import dataclasses

    path = checkpoint("mixtral")
    outs = []
    for native in (False, True):
        # No warm-up: it would build the whole-step call's form before the scalars below are set.
        llm = _llm(path, dtype, native=native, warmup=False)
        model = llm.llm_engine.runner.model
        model.model.embedding_multiplier = 3.0
        for layer in model.model.layers.values():
            layer.residual_multiplier = 0.75
        model.cfg = dataclasses.replace(model.cfg, logits_scaling=0.5)
        calls = Calls(monkeypatch, llm)
        outs.append(_generate(llm))
        assert (calls.whole > 0) == native
    _assert_same(outs[0], outs[1], atol=1e-4 if dtype == "float32" else 4e-2)


def test_whole_step_rejects_an_id_outside_the_embedding(checkpoint):
    """The per-op path's embedding raises IndexError on such an id; the whole-step call names it."""
    import torch

    llm = _llm(checkpoint("mixtral"), "float32", native=True)
    engine = llm.llm_engine
    engine.add_request("r", [5, 6, 7], SamplingParams(temperature=0, max_tokens=4))
    engine.step()  # the prefill: the next step is a decode
    ids, pos, ctx, last = engine.runner.prepare(engine.scheduler.schedule(), engine.blocks)
    bad = torch.full_like(ids, 10**6)
    with pytest.raises(IndexError, match="token id 1000000 is outside the embedding"):
        engine.runner.forward(bad, pos, ctx, last)
    assert engine.runner.forward(ids, pos, ctx, last).shape == (1, 512)  # the same step, valid ids


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    "family, scheme",
    [
        ("mixtral", "int8"),
        ("mixtral", "int4-g16"),  # asymmetric nibbles, groups smaller than the tiny widths
        ("qwen3_moe", "w8a8-g16"),  # activations quantized in the kernel too
        ("qwen3_moe", "w4a8"),
        ("mixtral", "fp8-ch"),
        ("mixtral", "int8+head"),  # the LM head quantized: its float32-output shim in whole steps
    ],
)
def test_quantized_native_decode_matches_per_op_path(checkpoint, monkeypatch, family, scheme, dtype):
    """Quantized weights (online schemes) through the gemm_q / moe_q shims: the per-op path's
    conversions and kernels, so its tokens and logprobs (bf16: the shims round where it does)."""
    path = checkpoint(family)
    ref = _generate(_llm(path, dtype, native=False, quantization=scheme))
    llm = _llm(path, dtype, native=True, quantization=scheme)
    assert all(native for native, _ in _plan_after_build(llm)), "every layer quantized and native"
    calls = Calls(monkeypatch, llm)
    got = _generate(llm)
    assert calls.native >= sum(MAX_TOKENS) // 4 and calls.fallback <= calls.native
    assert calls.whole == calls.native  # the head too (quantized by "+head", or packed)
    _assert_same(ref, got, atol=1e-4 if dtype == "float32" else 2e-2)


@pytest.mark.timeout(120)
def test_held_gptq_checkpoint_native_decode_matches_per_op_path(real_checkpoint, tmp_path, monkeypatch):
    """A GPTQ int4 checkpoint held compressed as stored (codes straight into QuantizedWeight /
    QuantizedExperts): native layers, the per-op path's tokens and logprobs."""
    from quantized_checkpoints import to_int4_packed

    src = real_checkpoint("qwen3-30b-a3b")
    path = to_int4_packed(src, str(tmp_path / "gptq"), str(tmp_path / "ref"), "gptq", 16)
    ref = _generate(_llm(path, "float32", native=False))
    llm = _llm(path, "float32", native=True)
    assert all(native for native, _ in _plan_after_build(llm))
    calls = Calls(monkeypatch, llm)
    got = _generate(llm)
    assert calls.native >= sum(MAX_TOKENS) // 4
    _assert_same(ref, got, atol=1e-4)


def _plan_after_build(llm: LLM) -> list[tuple[bool, int]]:
    """The plan of a fresh engine, after one short decode builds it."""
    llm.generate(
        [{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False
    )
    return _plan(llm)


def test_quantized_native_forms_only_where_served():
    """A quantized weight has a native form with our kernel and a float32 / bf16 model, never for
    the torch fallback, float16, or a partial (TP / unreduced) product; quantized experts of two
    kinds have none (moe_q takes one)."""
    import torch

    from expertmesh.cpu.quantized import experts_native_form
    from expertmesh.distributed.group import Group
    from expertmesh.layers.linear import RowParallelLinear
    from expertmesh.layers.quantization.packed import QuantizedExperts, QuantizedWeight

    kernels = cpu_kernels.load()
    w = torch.randn(24, 32)
    q = QuantizedWeight.quantize(w, "int8", 16, ops_for(kernels))
    keep: list = []
    assert q.native_form(torch.float32, keep) is not None and q.native_form(torch.bfloat16, keep) is not None
    assert q.native_form(torch.float16, keep) is None
    assert QuantizedWeight.quantize(w, "int8", 16, TORCH_OPS).native_form(torch.float32, keep) is None
    for reduce, native in ((True, True), (False, False)):
        layer = RowParallelLinear(32, 24, False, Group((0,), 0), reduce=reduce)
        layer.hold_quantized(q)
        assert (layer.native_form(keep) is not None) == native
    a = QuantizedExperts.stack([q, q])
    b = QuantizedExperts.stack([QuantizedWeight.quantize(w.T.contiguous(), "int4", 8, ops_for(kernels))] * 2)
    assert experts_native_form(kernels, a, a, torch.float32, keep) is not None
    assert experts_native_form(kernels, a, b, torch.float32, keep) is None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tie,dtype", [("all", "float32"), ("pair", "float32"), ("pair", "bfloat16")])
def test_routing_ties_follow_torch_topk(checkpoint, monkeypatch, tie, dtype):
    """Router rows made equal after packing: every expert ties (all) or experts 0 and 1 do (pair).
    The native call hands those blocks' routing to torch, whose topk orders the ties, and resumes
    at their experts: the same tokens, logprobs and expert-load counts as the per-op path."""
    path = checkpoint("mixtral")
    outs, fallbacks, loads = [], [], []
    for native in (False, True):
        llm = _llm(path, dtype, native=native)
        for layer in llm.llm_engine.runner.model.model.layers.values():
            panels = layer.block_sparse_moe.gate.weight_form.data  # [P, H, lanes]: expert e in lane e
            if tie == "all":
                panels.zero_()
            else:
                panels[0, :, 1] = panels[0, :, 0]
        calls = Calls(monkeypatch, llm)
        outs.append(_generate(llm))
        fallbacks.append(calls.fallback)
        loads.append(llm.expert_load())
    assert fallbacks[1] > 0
    _assert_same(outs[0], outs[1], atol=1e-4 if dtype == "float32" else 2e-2)
    assert loads[0] == loads[1]


def test_expert_load_counted_alike(checkpoint):
    path = checkpoint("mixtral")
    loads = []
    for native in (False, True):
        llm = _llm(path, "float32", native=native)
        _generate(llm)
        loads.append(llm.expert_load())
    assert loads[0] == loads[1]
    # every prompt token and every decode (the last sampled token is never fed back), top-2
    assert sum(loads[1]["layers"][next(iter(loads[1]["layers"]))]) == 2 * (sum(LENGTHS) + sum(MAX_TOKENS) - 4)


def _plan(llm: LLM) -> list[tuple[bool, int]]:
    (dec,) = decoders(llm.llm_engine.runner.model)
    assert isinstance(dec, NativeDecoder) and dec.plan is not None
    return [(descs is not None, len(layers)) for descs, layers in dec.plan]


@pytest.mark.timeout(120)
def test_eligibility_from_blocks(checkpoint):
    """Dense MLP layers (Qwen3-MoE's decoder_sparse_step) run alone on torch between native runs; a
    shared expert (Qwen2-MoE) and LayerNorm + sparsemixer (PhiMoE) have no native form."""
    mixed = checkpoint("qwen3_moe", num_hidden_layers=4, decoder_sparse_step=2)  # layers 1, 3 MoE
    ref = _generate(_llm(mixed, "float32", native=False))
    llm = _llm(mixed, "float32", native=True)
    got = _generate(llm)
    assert _plan(llm) == [(False, 1), (True, 1), (False, 1), (True, 1)]
    _assert_same(ref, got, atol=1e-4)
    for family in ("qwen2_moe", "phimoe"):
        llm = _llm(checkpoint(family), "float32", native=True)
        _generate(llm)
        assert all(not native for native, _ in _plan(llm)), family


def test_switch_off(checkpoint):
    llm = _llm(checkpoint("mixtral"), "float32", native=False)
    assert decoders(llm.llm_engine.runner.model) == []


@pytest.mark.timeout(180)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_mxfp4_gpt_oss_native_decode_matches_per_op_path(real_checkpoint, tmp_path, monkeypatch, dtype):
    """gpt-oss held as MXFP4: attention sinks, the sliding window, q/k/v/o and router biases, softmax
    over the top-k logits (renormalize 2 in the descriptor), biased experts with the clamped SwiGLU
    (moe_q_ex through its shim): every layer native, whole steps, the per-op path's tokens and logprobs."""
    from quantized_checkpoints import to_mxfp4
    from real_checkpoints import Sizes

    path = to_mxfp4(real_checkpoint("gpt-oss-20b", sizes=Sizes(layers=2)), str(tmp_path / "mxfp4"))
    ref = _generate(_llm(path, dtype, native=False))
    llm = _llm(path, dtype, native=True)
    assert all(native for native, _ in _plan_after_build(llm)), "every layer native"
    calls = Calls(monkeypatch, llm)
    got = _generate(llm)
    assert calls.native >= sum(MAX_TOKENS) // 4 and calls.fallback <= calls.native
    assert calls.whole == calls.native
    _assert_same(ref, got, atol=1e-4 if dtype == "float32" else 2e-2)
