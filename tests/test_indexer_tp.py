"""DeepSeek Sparse Attention's lightning indexer under tensor parallelism (layers/sparse_indexer.py;
DeepSeek-V4's, layers/compressor.py, the same way): each TP rank holds its share of the index heads
(wq_b's and weights_proj's rows; the key projection and its norm, or V4's compressor, replicated),
scores with them, and the per-key scores are summed over the group before top-k.

References: one process. float32 without deterministic mode: the same greedy tokens, logprobs
within float32 noise (the partial sums cross an all-reduce); bf16 with deterministic=True: every
logprob bit-equal (the heads' fixed chunks added by the fixed tree). The prompts are longer than
the checkpoints' index_topk (12), so every layer selects from the first prefill on."""

from types import SimpleNamespace

import pytest
import torch
from distributed_utils import run_distributed
from test_bitwise_families import BF16, FP32, WIDE, engine
from test_bitwise_layouts import mismatches
from test_real_families import FAMILIES

from expertmesh import SamplingParams
from expertmesh.distributed.fixed_sum import tree_sum
from expertmesh.layers.sparse_indexer import LightningIndexer

NEW = 6
LENGTHS = [40, 13, 70, 25]
SINGLE = [(1, 1, 2, False, "allgather_reducescatter", False, FP32), (1, 1, 2, False, "naive", True, BF16)]
DATA_PARALLEL = [(2, 1, 2, False, "naive", False, FP32), (2, 1, 2, False, "naive", True, BF16)]


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(9)
    return [torch.randint(3, 500, (n,), generator=g).tolist() for n in LENGTHS]


def _logprobs(llm, batch: list[list[int]]) -> list[list[dict[int, float]]]:
    params = SamplingParams(temperature=0, max_tokens=NEW, logprobs=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
    return [[{t: lp.logprob for t, lp in pos.items()} for pos in o.outputs[0].logprobs] for o in outs]


def _indexers(llm) -> list:
    return [m for name, m in llm.llm_engine.runner.model.named_modules() if name.endswith(".indexer")]


def _probe(llm) -> tuple[list[tuple[int, ...]], list[list[torch.Tensor]]]:
    """Per layer: the indexer's (heads held, wq_b rows, weights_proj rows, key projection rows) and its
    [wq_b, weights_proj] outputs on fixed inputs."""
    g = torch.Generator().manual_seed(1)
    shapes, outputs = [], []
    for ix in _indexers(llm):
        key = ix.wk.out_features if hasattr(ix, "wk") else ix.compressor.wkv.out_features  # replicated
        shapes.append((ix.local_heads, ix.wq_b.out_features, ix.weights_proj.out_features, key))
        x_q = torch.randn(3, ix.wq_b.in_features, generator=g).to(llm.llm_engine.config.model_config.dtype)
        x = torch.randn(3, ix.weights_proj.in_features, generator=g).to(x_q.dtype)
        outputs.append([ix.wq_b(x_q).float(), ix.weights_proj(x).float()])
    return shapes, outputs


def _rank_main(rank, world, path, layouts):
    batch, results = _prompts(), []
    for dp, pp, tp, ep, backend, det, dtype in layouts:
        llm = engine(path, dp, pp, tp, ep, backend, det, dtype=dtype, max_model_len=128)
        dp_rank = llm.llm_engine.vllm_config.parallel_config.data_parallel_rank
        mine = list(range(len(batch)))[dp_rank::dp]
        got = _logprobs(llm, [batch[i] for i in mine])
        tp_rank = llm.llm_engine.runner.groups.tp.rank_in_group
        results.append(
            ((dp, pp, tp, ep, backend, det, dtype), tp_rank, dict(zip(mine, got, strict=True)), _probe(llm))
        )
        del llm
    return results


def _check(path: str, layouts: list[tuple], world: int) -> None:
    batch = _prompts()
    refs = {}
    for det, dtype in {la[5:] for la in layouts}:
        llm = engine(path, det=det, dtype=dtype, max_model_len=128)
        refs[det, dtype] = (_logprobs(llm, batch), _probe(llm))
        del llm
    per_rank = run_distributed(_rank_main, world, path, layouts, timeout=280, gloo_timeout=120)
    for rank, results in enumerate(per_rank):
        for layout, tp_rank, got, (shapes, outputs) in results:
            ref, (ref_shapes, ref_outputs) = refs[layout[5:]]
            where = f"rank {rank}, (DP, PP, TP, EP, backend, det, dtype)={layout}"
            # This rank's heads alone (half of wq_b's and weights_proj's rows, their rows of the
            # outputs); the key projection whole.
            assert shapes and shapes == [(h // 2, q // 2, w // 2, k) for h, q, w, k in ref_shapes], where
            for mine, whole in zip(outputs, ref_outputs, strict=True):
                for out, full in zip(mine, whole, strict=True):
                    assert torch.equal(out, full.chunk(2, dim=-1)[tp_rank]), where
            if layout[5]:
                bad = mismatches(ref, got)
                assert not bad, f"{where}: {bad[:4]}"
                continue
            for i, per_pos in got.items():
                assert [max(p, key=p.get) for p in per_pos] == [max(p, key=p.get) for p in ref[i]], where
                worst = max(abs(p[t] - v) for p, r in zip(per_pos, ref[i], strict=True) for t, v in r.items())
                assert worst < 1e-4, f"{where}: request {i} logprobs {worst:.3g} off"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["deepseek-v3.2", pytest.param("glm-5", marks=pytest.mark.slow)])
def test_indexer_heads_split_over_tp2(family, real_checkpoint):
    """TP2: each rank holds half the index heads and equals one process (float32 within noise,
    bf16 deterministic bit-equal)."""
    source, overrides = FAMILIES[family]
    _check(real_checkpoint(source, sizes=WIDE, **overrides), SINGLE, 2)


@pytest.mark.timeout(300)
def test_deepseek_v4_indexer_heads_split_over_tp2(real_checkpoint):
    """DeepSeek-V4's compressed sparse layer's indexer (layers/compressor.py) splits its heads the
    same way; its compressor stays whole on each rank."""
    from test_deepseek_v4 import OVERRIDES, SOURCE

    _check(real_checkpoint(SOURCE, **OVERRIDES), SINGLE, 2)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_indexer_heads_split_over_dp2_tp2(real_checkpoint):
    """DP2 x TP2 (`naive`): each replica's TP ranks split the heads, and equal one process."""
    source, overrides = FAMILIES["deepseek-v3.2"]
    _check(real_checkpoint(source, sizes=WIDE, **overrides), DATA_PARALLEL, 4)


def _indexer(world: int, rank: int, fixed: int) -> LightningIndexer:
    group = SimpleNamespace(
        world_size=world, rank_in_group=rank, fixed_chunks=fixed, reduce_dtype=torch.float32
    )
    return LightningIndexer(
        64, 32, heads=64, head_dim=128, rope_dim=64, topk=8, dtype=torch.float32, group=group
    )


@pytest.mark.parametrize("world", [2, 4, 8])
def test_deterministic_scores_of_split_heads_are_one_process_bits(world):
    """DeepSeek-V3.2's 64 index heads x 128: in deterministic mode each rank of TP 2 / 4 / 8 scores
    its heads in its fixed chunks, and the ranks' sums added by the fixed tree (what
    Group.ordered_sum does) are one process's scores, bit for bit; a rank's chunk count follows
    the layout; a head count TP does not divide, or whose chunks it cannot split, fails by name."""
    g = torch.Generator().manual_seed(0)
    q, w, keys_t = (
        torch.randn(5, 64, 128, generator=g),
        torch.randn(5, 64, generator=g),
        torch.randn(128, 300, generator=g),
    )
    whole = _indexer(1, 0, 8)
    assert whole.chunks == 8
    ref = whole.partial_scores(q, w, keys_t)
    share = 64 // world
    ranks = [_indexer(world, r, 8) for r in range(world)]
    assert [ix.chunks for ix in ranks] == [8 // world] * world
    parts = [ix.partial_scores(q[:, r * share : (r + 1) * share], w[:, r * share : (r + 1) * share], keys_t)
             for r, ix in enumerate(ranks)]  # fmt: skip
    assert torch.equal(tree_sum(parts), ref)
    plain = _indexer(1, 0, 0)  # no fixed chunks: one product over the heads, close to the same sums
    torch.testing.assert_close(plain.partial_scores(q, w, keys_t), ref, rtol=1e-5, atol=1e-4)
    with pytest.raises(ValueError, match="index_n_heads=64 is not divisible by tensor_parallel_size=3"):
        _indexer(3, 0, 0)
    with pytest.raises(ValueError, match="the indexer's heads of 64 sums in 8 fixed chunks"):
        _indexer(16, 0, 8)
