"""Each family's router against transformers' own routing code, on random and tied logits."""

import pytest
import torch
from transformers.models.phimoe.modeling_phimoe import sparsemixer as hf_sparsemixer

from expertmesh.layers.routing import ROUTERS


def _logits(n: int, e: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, e, generator=g)
    x[: n // 4] = x[: n // 4].round(decimals=1)  # ties and near-ties
    return x


@pytest.mark.parametrize("jitter", [0.01, 0.1, 0.5])
def test_sparsemixer_equals_phimoe(jitter):
    logits = _logits(64, 8, seed=1)
    ours_w, ours_ids = ROUTERS["sparsemixer"](logits, top_k=2, jitter_eps=jitter)
    ref_w, ref_ids = hf_sparsemixer(logits, jitter_eps=jitter, training=False, top_k=2)
    assert torch.equal(ours_ids, ref_ids)
    torch.testing.assert_close(ours_w, ref_w, rtol=0, atol=0)


def test_sparsemixer_is_top2_only():
    with pytest.raises(ValueError, match="top-2 only"):
        ROUTERS["sparsemixer"](_logits(4, 8, 2), top_k=3, jitter_eps=0.01)


@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_topk_equals_mixtral_and_qwen(renormalize):
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    hidden = torch.randn(32, 16, generator=torch.Generator().manual_seed(3))
    if renormalize:
        router = MixtralTopKRouter(MixtralConfig(hidden_size=16, num_local_experts=8, num_experts_per_tok=2))
    else:
        cfg = Qwen3MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=3, norm_topk_prob=False)
        router = Qwen3MoeTopKRouter(cfg)
    torch.nn.init.normal_(router.weight, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        logits, ref_w, ref_ids = router(hidden)
        ours_w, ours_ids = ROUTERS["softmax_topk"](logits, top_k=router.top_k, renormalize=renormalize)
    assert torch.equal(ours_ids, ref_ids)
    torch.testing.assert_close(ours_w, ref_w.float(), rtol=0, atol=0)
