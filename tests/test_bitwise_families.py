"""deterministic=True on the families whose blocks test_bitwise_layouts does not reach: every rank's
greedy tokens and logprobs (==, at every generated position) equal one process's, bf16.

- MLA (DeepSeek-V3): latent attention, its o_proj over TP; top-4 routing under EP.
- Gated DeltaNet (Qwen3.5-MoE) and Mamba2 (Nemotron-H): linear-attention heads and their out
  projections over TP; Mamba2's gated norm whose group spans the TP ranks (its squares summed).
- Identity experts (LongCat-Flash): places naming no expert, under EP.
- EP with top-k > 2 (Qwen3-MoE at top-4, DeepSeek-V3): each pick's output comes back to its
  token and the picks are added in the order of their expert ids, whatever rank computed them.
- EPLB: redundant experts (replicas on both ranks) moved between steps; replicas give the same bits.
- Quantized weights: refused, the error naming the option and the format.

The checkpoints are the published configs shrunk (tests/real_configs) but widened (hidden 512)
so that bf16 roundings do tip under float32 reordering (shown for top-4 under EP: the default
path is not bit-equal there, so the check can fail).
"""

from __future__ import annotations

import pytest
import torch
from distributed_utils import run_distributed
from real_checkpoints import Sizes
from test_bitwise_layouts import logprobs, mismatches, prompts

from expertmesh import LLM

WIDE = Sizes(hidden=512, expert_inter=256, dense_inter=512, shared_inter=256)
TOP4 = dict(
    hidden_size=1024,
    intermediate_size=1024,
    num_attention_heads=8,
    num_key_value_heads=2,
    moe_intermediate_size=512,
    num_experts_per_tok=4,
)


def engine(path: str, dp=1, pp=1, tp=1, ep=False, backend="allgather_reducescatter", det=True, **kw) -> LLM:
    """An engine in the given layout, bf16 unless `kw` says otherwise."""
    kw = {"dtype": "bfloat16", "max_model_len": 64, "kv_cache_memory_bytes": 1 << 24, "warmup": False, **kw}
    return LLM(
        path, data_parallel_size=dp, pipeline_parallel_size=pp, tensor_parallel_size=tp,
        enable_expert_parallel=ep, all2all_backend=backend, deterministic=det,
        distributed_executor_backend="external_launcher" if dp * pp * tp > 1 else None, **kw,
    )  # fmt: skip


BF16, FP32 = "bfloat16", "float32"


def _rank_main(rank, world, path, batch, layouts, extra):
    results = []
    for dp, pp, tp, ep, backend, det, dtype in layouts:
        llm = engine(path, dp, pp, tp, ep, backend, det, dtype=dtype, **extra)
        dp_rank = llm.llm_engine.vllm_config.parallel_config.data_parallel_rank
        mine = list(range(len(batch)))[dp_rank::dp]
        got = logprobs(llm, [batch[i] for i in mine])
        results.append(((dp, pp, tp, ep, backend, det, dtype), dict(zip(mine, got, strict=True))))
        del llm
    return results


def run_layouts(path: str, layouts: list[tuple], world: int = 2, n: int = 4, timeout: float = 200, **extra):
    """Layouts (DP, PP, TP, EP, backend, deterministic, dtype): one process's logprobs per
    (deterministic, dtype), and every layout's on every rank, asserted bit-equal to one process
    where deterministic. float32 shows any reordered float32 sum in the logprobs' last bits; bf16
    is the dtype users run. Returns {layout: [got per rank]} and the references."""
    batch = prompts(n)
    refs = {
        key: logprobs(engine(path, det=key[0], dtype=key[1], **extra), batch)
        for key in {la[5:] for la in layouts}
    }
    results = run_distributed(
        _rank_main, world, path, batch, layouts, extra, timeout=timeout, gloo_timeout=120
    )
    out: dict[tuple, list] = {}
    for rank, per_rank in enumerate(results):
        for layout, got in per_rank:
            if layout[5]:
                bad = mismatches(refs[layout[5:]], got)
                assert not bad, f"rank {rank} (DP, PP, TP, EP, backend, det, dtype)={layout}: {bad[:4]}"
            out.setdefault(layout, []).append(got)
    return out, refs


def both(*layout) -> list[tuple]:
    """A deterministic layout in float32 and in bf16."""
    return [(*layout, True, FP32), (*layout, True, BF16)]


@pytest.mark.timeout(300)
def test_mla_deepseek_v3_bitwise(real_checkpoint):
    """DeepSeek-V3 (MLA, 16 routed experts in groups, a shared expert, top-4): TP2 and DP2 + EP."""
    path = real_checkpoint("deepseek-v3", sizes=WIDE)
    run_layouts(path, both(1, 1, 2, False, "allgather_reducescatter") + both(2, 1, 1, True, "alltoall"))


@pytest.mark.timeout(300)
def test_ep_top4_bitwise(checkpoint):
    """Qwen3-MoE at top-4 (8 experts, 4 a rank): DP2 + EP over alltoall (and, float32, over
    allgather_reducescatter), TP2 with whole experts a rank (EP at DP 1: the TP all-reduce);
    without the option DP2 + EP is not bit-equal in float32 (so the check can fail)."""
    path = checkpoint("qwen3_moe", **TOP4)
    plain = (2, 1, 1, True, "alltoall", False, FP32)
    out, refs = run_layouts(
        path,
        both(2, 1, 1, True, "alltoall")
        + [
            (2, 1, 1, True, "allgather_reducescatter", True, FP32),
            (1, 1, 2, True, "naive", True, FP32),
            plain,
        ],
    )
    assert any(mismatches(refs[plain[5:]], got) for got in out[plain]), (
        "top-4 EP without the option was bit-equal"
    )


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "family",
    [
        "qwen3.5-moe",
        pytest.param("nemotron-h", marks=pytest.mark.slow),
        pytest.param("granite-4.0-h", marks=pytest.mark.slow),
    ],
)
def test_hybrid_bitwise(family, real_checkpoint):
    """Gated DeltaNet (Qwen3.5-MoE) and Mamba2 (Nemotron-H: its groups split over TP; Granite-4.0-H:
    one group spanning the TP ranks, its gated norm's squares summed over TP): TP2 and DP2 + EP."""
    from test_hybrid_families import _source

    source = _source(family)
    if family == "granite-4.0-h":  # transformers checks heads x head_dim = 2 x hidden
        source.update(mamba_n_heads=16, mamba_d_head=64)
    path = real_checkpoint(source, sizes=WIDE)
    run_layouts(path, both(1, 1, 2, False, "allgather_reducescatter") + both(2, 1, 1, True, "alltoall"))


@pytest.mark.timeout(300)
def test_identity_experts_longcat_bitwise(real_checkpoint):
    """LongCat-Flash (8 real + 4 identity experts, top-4; two MLA blocks a layer): identity
    places are never sent and add x itself; TP2 and DP2 + EP (alltoall)."""
    path = real_checkpoint("2026/longcat-flash-chat", sizes=WIDE, head_dim=WIDE.qk_rope_head_dim)
    run_layouts(path, both(1, 1, 2, False, "allgather_reducescatter") + both(2, 1, 1, True, "alltoall"))


EPLB = dict(enable_eplb=True, eplb_config={"num_redundant_experts": 2, "step_interval": 2})


def _eplb_rank(rank, world, path, batch, dtype):
    llm = engine(path, 2, 1, 1, True, "alltoall", True, dtype=dtype, **EPLB)
    before = llm.expert_load()["placement"]
    mine = list(range(len(batch)))[rank::2]
    got = logprobs(llm, [batch[i] for i in mine])
    load = llm.expert_load()
    return dict(zip(mine, got, strict=True)), before, load["placement"], load["rebalances"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("dtype", [FP32, pytest.param(BF16, marks=pytest.mark.slow)])
def test_eplb_bitwise(checkpoint, dtype):
    """EPLB, DP2 + EP (alltoall) at top-4 with 2 redundant experts, rebalanced every 2 steps while
    generating: replicas on both ranks and experts moved between them give one process's bits
    (each pick's term is the same whichever replica computed it; picks added by logical id)."""
    path = checkpoint("qwen3_moe", **TOP4)
    batch = prompts(4)
    ref = logprobs(engine(path, dtype=dtype), batch)
    for rank, (got, before, after, rebalances) in enumerate(
        run_distributed(_eplb_rank, 2, path, batch, dtype, timeout=200, gloo_timeout=120)
    ):
        assert rebalances >= 1 and after != before, f"rank {rank}: no expert moved ({rebalances} rebalances)"
        bad = mismatches(ref, got)
        assert not bad, f"rank {rank}, EPLB: {bad[:4]}"


def _family_path(real_checkpoint, family: str) -> str:
    from test_hybrid_families import _source

    if family == "deepseek-v3":
        return real_checkpoint("deepseek-v3", sizes=WIDE)
    if family == "longcat-flash":
        return real_checkpoint("2026/longcat-flash-chat", sizes=WIDE, head_dim=WIDE.qk_rope_head_dim)
    return real_checkpoint(_source(family), sizes=WIDE)


RECURRENT = ("qwen3.5-moe", "nemotron-h")


@pytest.mark.timeout(200)
@pytest.mark.parametrize("family", ["qwen3.5-moe", "nemotron-h", "deepseek-v3", "longcat-flash"])
def test_batch_invariant_families(real_checkpoint, family):
    """One process, float32 (any reordered sum shows): a request's logprobs alone, and inside a
    batch of 7 mixed-length requests, are bit-equal (linear-attention gates and recurrent steps,
    MLA, sigmoid routers, identity experts). Attention families prefill in chunks of a 24-token
    budget that fall differently in the batch; recurrent ones prefill whole prompts (a chunked
    scan's rounding follows where its chunks start: docs/layouts.md)."""
    path = _family_path(real_checkpoint, family)
    chunked = {} if family in RECURRENT else dict(max_num_batched_tokens=24, enable_chunked_prefill=True)
    llm = engine(path, dtype=FP32, max_num_seqs=8, **chunked)
    target = prompts(1, seed=5)[0]
    alone = logprobs(llm, [target])[0]
    others = prompts(6, seed=11)
    got = logprobs(llm, others[:3] + [target] + others[3:])[3]
    assert got == alone, f"{family}: a batch of 7 changed the request's logprobs"


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("family", ["deepseek-v3", "qwen3.5-moe", "nemotron-h", "longcat-flash"])
def test_world4_bitwise(real_checkpoint, family):
    """World 4, float32: PP2 x TP2 and DP2 x TP2 with `naive` and with EP over `alltoall`."""
    path = _family_path(real_checkpoint, family)
    layouts = [(1, 2, 2, False, "naive"), (2, 1, 2, False, "naive"), (2, 1, 2, True, "alltoall")]
    run_layouts(path, [(*layout, True, FP32) for layout in layouts], world=4, timeout=500)


def test_pointwise_bits_do_not_follow_the_size():
    """fixed_sum.pointwise: an element's sigmoid / softplus / SiLU / exp is the same bits alone, in
    a batch, in a rank's half of the heads, and inside a tensor big enough for torch to split over
    threads; torch's own sigmoid differs row by row here (its vector body and scalar tail)."""
    import torch.nn.functional as F

    from expertmesh.distributed.fixed_sum import pointwise

    x = torch.randn(69, 4, generator=torch.Generator().manual_seed(0))
    big = torch.randn(70001, generator=torch.Generator().manual_seed(1))
    for fn in (torch.sigmoid, F.softplus, F.silu, torch.exp):
        whole = pointwise(fn, x)
        assert torch.equal(whole, torch.cat([pointwise(fn, x[i : i + 1]) for i in range(69)])), fn
        assert torch.equal(whole, torch.cat([pointwise(fn, x[:, :2]), pointwise(fn, x[:, 2:])], 1)), fn
        assert torch.equal(pointwise(fn, big)[-5:], pointwise(fn, big[-5:])), fn
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        rows = torch.cat([torch.sigmoid(x[i : i + 1]) for i in range(69)])
        assert not torch.equal(torch.sigmoid(x), rows), "torch's sigmoid no longer follows the size"
