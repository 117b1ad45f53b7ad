"""EPLB over compressed experts (issue 14): a rebalance moves quantized experts between EP ranks
as they are held (codes, scales, offsets unless MXFP4's shared zeros, desc_act's input order),
copied in place into the slots' storage, and greedy tokens stay those of one process running the
same quantized model: online w4a8 and int8, MXFP4 held as fp4 (gpt-oss), an fp8 checkpoint held as
stored and GPTQ desc_act held per expert (compressed-tensors int4: tests/test_compressed_tensors.py).
"""

from __future__ import annotations

import pytest
import torch
from checkpoints import prompts_of_lengths
from distributed_utils import run_distributed
from quantized_checkpoints import to_fp8, to_int4_packed, to_mxfp4
from real_checkpoints import Sizes
from test_expert_load import _experts_for

from expertmesh import LLM, SamplingParams
from expertmesh.cpu.expert_forms import QuantizedStacks
from expertmesh.cpu.ops import ops_for
from expertmesh.distributed.eplb import balanced_placement
from expertmesh.distributed.moe_plan import ExpertPlacement
from expertmesh.layers.expert_weights import PerExpertWeights
from expertmesh.layers.fused_moe import FusedExperts
from expertmesh.layers.quantization.packed import QuantizedWeight
from expertmesh.layers.quantization.permuted import PermutedInputs

# ---- moving one layer's compressed experts (2 ranks, no model) ----------------------------------
E, H, INTER = 5, 32, 32
ONLINE = ["int8", "int4-g16", "fp8", "w8a8-g16", "w4a8-g16"]
# (case, our kernels or the torch fallback): fused stacks (QuantizedExperts) with the kernels,
# per-expert QuantizedWeight pairs without; MXFP4's shared zero offsets; desc_act per expert.
CASES = [(k, True) for k in ONLINE] + [(k, False) for k in ONLINE] + [("mxfp4", True), ("desc_act", True)]


def _mxfp4(w: torch.Tensor, seed: int, zeros: dict, kernels) -> QuantizedWeight:
    """fp4 codes and power-of-two block scales held as the MXFP4 loader holds them (held._weight:
    one zero offsets tensor for every expert)."""
    from expertmesh.layers.quantization.held import HeldParam, _weight

    o, i = w.shape
    g = torch.Generator().manual_seed(seed)
    h = HeldParam("experts", "fp4", 32, (o, i), local_group=min(32, i), exponents=True)
    h.scales = torch.ldexp(
        torch.ones(o, i // h.local_group), torch.randint(-3, 2, (o, i // h.local_group), generator=g)
    )
    h.offsets = torch.zeros(o, i // h.local_group)
    codes = torch.randint(0, 16, (o, i), dtype=torch.uint8, generator=g)
    return _weight(codes, h, ops_for(kernels), None, zeros)


def _experts(case: str, fast: bool, placement: ExpertPlacement, rank: int) -> FusedExperts:
    """FusedExperts holding `rank`'s slots of `placement` compressed, expert e drawn from seed e."""
    from expertmesh.cpu import cpu_kernels
    from expertmesh.layers.quantization.online import OnlineScheme

    kernels = cpu_kernels.load() if fast else None
    mine = placement.local_experts(rank)
    fe = _experts_for(placement, rank, packed=False, shape=(E, H, INTER))
    if case in ONLINE:
        fe.use_quantized(OnlineScheme.parse(case), ops_for(kernels))
        return fe
    zeros: dict = {}
    pairs = []
    for i, e in enumerate(mine):
        ws = (fe.w13.data[i], fe.w2.data[i])
        if case == "mxfp4":
            pairs.append(tuple(_mxfp4(w, 10 * e + j, zeros, kernels) for j, w in enumerate(ws)))
            continue
        q = [QuantizedWeight.quantize(w, "int4", 8, ops_for(kernels)) for w in ws]
        g = torch.Generator().manual_seed(7 + e)  # expert 0's groups in order: plain, the others permuted
        pairs.append(
            tuple(w if e == 0 else PermutedInputs(w, torch.randperm(w.in_features, generator=g)) for w in q)
        )
    fe.hold_quantized(pairs, ops_for(kernels))
    return fe


def _move_rank(rank, world, cases):
    from expertmesh.distributed.eplb import move_expert_weights
    from expertmesh.distributed.group import Group

    group = Group(tuple(range(world)), rank, name="ep")
    old = balanced_placement([9, 1, 1, 1, 8], world, 8)
    new = balanced_placement([1, 1, 9, 8, 1], world, 8)
    out = {}
    for case, fast in cases:
        fe = _experts(case, fast, old, rank)
        form = fe.experts_form
        stacks = (form.w13, form.w2) if isinstance(form, QuantizedStacks) else ()
        with_shared = [s for s in stacks if s.shared_offsets]
        shared = [s.offsets for s in with_shared]
        n = len(fe.slot_tensors(0))
        sent = move_expert_weights(fe, old, new, group, rank)
        fe.set_slots(new.local_experts(rank), new.slot_map(rank))
        want = _experts(case, fast, new, rank)
        same = all(
            torch.equal(a, b)
            for i in range(4)
            for a, b in zip(fe.slot_tensors(i), want.slot_tensors(i), strict=True)
        )
        x = torch.randn(3, H, generator=torch.Generator().manual_seed(1))
        slots = torch.tensor([[s, (s + 1) % 8] for s in new.local_slots(rank)[:3]])
        w = torch.full((3, 2), 0.5)
        kept = all(o is s.offsets and not o.any() for o, s in zip(shared, with_shared, strict=True))
        form = "fused" if isinstance(form, QuantizedStacks) else type(form.pairs[0][0]).__name__
        out[(case, fast)] = (
            same,
            torch.equal(fe(x, slots, w), want(x, slots, w)),
            sent,
            n,
            len(shared),
            kept,
            form,
        )
    return old.local_experts(rank), new.local_experts(rank), out


@pytest.mark.timeout(60)
def test_moving_compressed_experts_fills_every_slot_with_its_expert():
    """Every online kind fused and per expert, MXFP4 (its shared zero offsets not moved, still the
    one zero tensor) and desc_act (each expert's input order moves with it; an expert whose groups
    are in order is held permuted by the identity, so every slot holds the same tensors)."""
    per_rank = run_distributed(_move_rank, 2, CASES, timeout=55)
    assert [r[0] for r in per_rank] != [r[1] for r in per_rank]  # the placement changed
    for rank, (_, _, out) in enumerate(per_rank):
        for (case, fast), (same, forward, sent, n, shared, kept, form) in out.items():
            where = f"rank {rank}, {case}, {'kernels' if fast else 'torch fallback'}"
            assert same and forward and sent > 0, where
            # tensors a slot: codes, scales (+ offsets) of w13 and w2 (+ desc_act's orders)
            want = {"mxfp4": 4, "desc_act": 8}.get(case, 6)
            assert n == want and kept, where
            assert shared == (2 if case == "mxfp4" else 0), where
            assert form == (
                "fused"
                if fast and case != "desc_act"
                else {"desc_act": "PermutedInputs"}.get(case, "QuantizedWeight")
            ), where


# ---- a model rebalanced during generate (2 ranks) --------------------------------------------------
PROMPTS = prompts_of_lengths([5, 11, 1, 8], seed=7)
KW = dict(max_model_len=64, kv_cache_memory_bytes=1 << 21)
EPLB = dict(
    enable_expert_parallel=True,
    enable_eplb=True,
    eplb_config={"num_redundant_experts": 2, "step_interval": 2},
)


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int = 6) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _compressed(llm: LLM) -> list[str]:
    """How each MoE layer's experts are held: QuantizedExperts (fused), or per expert."""
    out = []
    for m in llm.llm_engine.runner.model.modules():
        if isinstance(m, FusedExperts):
            form = m.experts_form
            held = form.w13 if isinstance(form, QuantizedStacks) else form.pairs[0][0]
            out.append(type(held).__name__)
    return out


def _pointers(llm: LLM) -> list[int]:
    experts = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, FusedExperts)]
    return [t.data_ptr() for m in experts for i in range(len(m.expert_ids)) for t in m.slot_tensors(i)]


def _eplb_rank(rank, world, path, quantization):
    llm = LLM(path, data_parallel_size=2, quantization=quantization, **EPLB, **KW)
    before, pointers = llm.expert_load()["placement"], _pointers(llm)
    tokens = _greedy(llm, PROMPTS[rank::2])
    return tokens, before, llm.expert_load(), _compressed(llm), pointers == _pointers(llm)


def _check_eplb(path: str, quantization: str | None, held: str) -> None:
    per_rank = run_distributed(_eplb_rank, 2, path, quantization, timeout=55)
    reference = _greedy(LLM(path, quantization=quantization, **KW), PROMPTS)
    for rank, (tokens, before, load, forms, in_place) in enumerate(per_rank):
        assert forms and set(forms) == {held}, (rank, forms)
        assert in_place, rank  # copied into the slots' storage: the kernels' pointers stay valid
        assert load["rebalances"] >= 2 and load["eplb_bytes_sent"] > 0, rank
        assert load["placement"] != before, rank  # compressed experts moved between the ranks
        assert tokens == reference[rank::2], rank


@pytest.mark.timeout(60)
@pytest.mark.parametrize("quantization", ["w4a8-g16", "int8"])
def test_eplb_moves_online_quantized_experts_and_keeps_every_token(checkpoint, quantization):
    _check_eplb(checkpoint("mixtral"), quantization, "QuantizedExperts")


@pytest.mark.timeout(60)
def test_eplb_moves_mxfp4_experts_held_as_fp4_and_keeps_every_token(real_checkpoint, tmp_path):
    path = to_mxfp4(real_checkpoint("gpt-oss-20b", sizes=Sizes(layers=2)), str(tmp_path / "mxfp4"))
    _check_eplb(path, None, "QuantizedExperts")


@pytest.mark.timeout(60)
def test_eplb_moves_fp8_experts_held_as_stored_and_keeps_every_token(real_checkpoint, tmp_path):
    """Blocks of 16 x 16 (held with groups of 16): 128 x 128 blocks give each tiny expert one scale,
    close enough across experts that a move skipping the scales kept every token."""
    path = to_fp8(real_checkpoint("qwen3-30b-a3b", sizes=Sizes(layers=2)), str(tmp_path / "fp8"), (16, 16))
    _check_eplb(path, "fp8-g16", "QuantizedExperts")


@pytest.mark.timeout(60)
def test_eplb_moves_gptq_desc_act_experts_and_keeps_every_token(real_checkpoint, tmp_path):
    """desc_act: held per expert, each expert's input order moving with its codes."""
    src = real_checkpoint("qwen3-30b-a3b", sizes=Sizes(layers=2))
    path = to_int4_packed(src, str(tmp_path / "gptq"), str(tmp_path / "ref"), "gptq", 8, "per-rank")
    _check_eplb(path, None, "PermutedInputs")


# ---- what cannot be moved fails at start-up, naming the layer -------------------------------------
class _Slots:
    """slot_tensors of a layer's 2 local slots: `sizes[i]` floats in slot i."""

    def __init__(self, *sizes: int) -> None:
        self.expert_ids, self.sizes = list(range(len(sizes))), sizes

    def slot_tensors(self, i: int) -> list[torch.Tensor]:
        return [torch.zeros(self.sizes[i])]


class _Group:
    """An EP group of 2 whose other rank holds its slots as 3 floats."""

    rank_in_group = 0

    def all_gather_object(self, obj):
        return [obj, [[((3,), "torch.float32")]]]


def test_experts_eplb_cannot_move_are_an_error_naming_the_layer():
    from types import SimpleNamespace

    from expertmesh.distributed.eplb import check_movable, slot_form

    with pytest.raises(ValueError, match=r"experts of MoE layer 3: local slots 0 and 1 hold different forms"):
        slot_form(_Slots(2, 3), "MoE layer 3")
    moe = SimpleNamespace(layer_index=1, experts=_Slots(2, 2))
    with pytest.raises(ValueError, match=r"MoE layer 1: EP rank 1 holds them as \[\(\(3,\), 'torch"):
        check_movable([moe], _Group())
    fe = FusedExperts(E, [0, 1], H, INTER, 0, 1, "silu")
    fe.experts_form = PerExpertWeights([(object(), object())] * 2)  # a form slot_tensors does not know
    with pytest.raises(ValueError, match=r"EPLB cannot move the experts of MoE layer 0: 'object' object"):
        slot_form(fe, "MoE layer 0")
