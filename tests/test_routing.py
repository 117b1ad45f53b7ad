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


def _hidden(n: int, h: int, seed: int) -> torch.Tensor:
    return torch.randn(n, h, generator=torch.Generator().manual_seed(seed))


def _by_expert(ids: torch.Tensor, weights: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[n, E] dense weights: compares routings whose top-k order differs (sorted=False)."""
    return torch.zeros(ids.shape[0], num_experts).scatter(1, ids, weights.float())


def _router(rule: str, hf_module, num_experts: int, top_k: int, bias: bool = False, **params):
    from expertmesh.layers.routing import Router

    ours = Router(hf_module.weight.shape[1], num_experts, rule, top_k, params, bias, torch.float32)
    with torch.no_grad():
        ours.weight.copy_(hf_module.weight)
        if bias:
            ours.bias.copy_(hf_module.bias)
        if ours.e_score_correction_bias is not None:
            ours.e_score_correction_bias.copy_(hf_module.e_score_correction_bias)
    return ours


@pytest.mark.parametrize("groups", [(1, 1), (4, 2)])
def test_sigmoid_grouped_equals_glm4_moe(groups):
    """GLM-4.5 (one group) and the DeepSeek-V3 shape (groups, topk_group): the correction bias
    picks experts and never weighs them; renormalised and scaled by routed_scaling_factor."""
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    n_group, topk_group = groups
    cfg = Glm4MoeConfig(
        hidden_size=16, n_routed_experts=16, num_experts_per_tok=4, n_group=n_group, topk_group=topk_group,
        routed_scaling_factor=2.5, norm_topk_prob=True,
    )  # fmt: skip
    hf = Glm4MoeTopkRouter(cfg)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        hf.weight.normal_(generator=g)
        hf.e_score_correction_bias.copy_(torch.randn(16, generator=g) * 0.5)
    ours = _router(
        "sigmoid_grouped", hf, 16, 4, n_group=n_group, topk_group=topk_group, scaling=2.5, renormalize=True
    )
    x = _hidden(48, 16, 8)
    with torch.no_grad():
        _, ref_w, ref_ids = hf(x)
        w, ids = ours(x)
    torch.testing.assert_close(_by_expert(ids, w, 16), _by_expert(ref_ids, ref_w, 16), rtol=1e-6, atol=1e-6)
    # The bias changed the choice somewhere, yet the weights are the unbiased scores.
    plain, _ = torch.sigmoid(x @ hf.weight.t()).topk(4)
    assert not torch.equal(torch.sort(ids).values, torch.sort(plain).values) or n_group > 1


def test_topk_softmax_equals_gpt_oss_and_granite():
    from transformers import GptOssConfig, GraniteMoeConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
    from transformers.models.granitemoe.modeling_granitemoe import GraniteMoeTopKRouter

    x = _hidden(40, 16, 9)
    gpt = GptOssTopKRouter(GptOssConfig(hidden_size=16, num_local_experts=8, num_experts_per_tok=4))
    granite_cfg = GraniteMoeConfig(hidden_size=16, num_local_experts=8, num_experts_per_tok=3)
    granite = GraniteMoeTopKRouter(granite_cfg)
    g = torch.Generator().manual_seed(10)
    with torch.no_grad():
        for m in (gpt, granite):
            m.weight.normal_(generator=g)
        gpt.bias.normal_(generator=g)
    for hf, bias, k in ((gpt, True, 4), (granite, False, 3)):
        ours = _router("topk_softmax", hf, 8, k, bias)
        with torch.no_grad():
            ref = hf(x)
            w, ids = ours(x)
        ref_w, ref_ids = ref[1], ref[2]
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(w, ref_w.float(), rtol=1e-6, atol=1e-6)


def test_topk_sigmoid_equals_llama4():
    from transformers import Llama4TextConfig
    from transformers.models.llama4.modeling_llama4 import Llama4Router

    hf = Llama4Router(Llama4TextConfig(hidden_size=16, num_local_experts=8, num_experts_per_tok=1))
    torch.nn.init.normal_(hf.weight, generator=torch.Generator().manual_seed(11))
    ours = _router("topk_sigmoid", hf, 8, 1)
    x = _hidden(40, 16, 12)
    with torch.no_grad():
        scores, _ = hf(x)  # [n, E]: sigmoid of the chosen logit, 0 elsewhere
        w, ids = ours(x)
    torch.testing.assert_close(_by_expert(ids, w, 8), scores, rtol=1e-6, atol=1e-6)


def test_unknown_router_names_the_known_ones():
    from expertmesh.layers.routing import Router

    with pytest.raises(ValueError, match="router 'expert_choice' is not known; known: .*sigmoid_grouped"):
        Router(16, 8, "expert_choice", 2, {}, dtype=torch.float32)


# ---- DeepSeek ---------------------------------------------------------------------------------
def _tied_hidden(n: int, h: int, seed: int) -> torch.Tensor:
    """Hidden states whose router logits tie: repeated rows, and every fourth row all zeros (every
    expert scores alike, so each group ties too)."""
    x = _hidden(n, h, seed)
    x[1::5] = x[0::5][: x[1::5].shape[0]]
    x[::4] = 0.0
    return x


def _deepseek_v2_router(method: str, experts: int, top_k: int, n_group=None, topk_group=None, scaling=1.0):
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    cfg = DeepseekV2Config(
        hidden_size=16, num_attention_heads=4, n_routed_experts=experts, num_experts_per_tok=top_k,
        topk_method=method,
        n_group=n_group, topk_group=topk_group, routed_scaling_factor=scaling,
    )  # fmt: skip
    hf = DeepseekV2TopkRouter(cfg)
    torch.nn.init.normal_(hf.weight, generator=torch.Generator().manual_seed(13))
    return hf


@pytest.mark.parametrize("scaling", [1.0, 16.0])
@pytest.mark.parametrize(
    "method,rule,groups",
    [("greedy", "softmax_greedy", (1, 1)), ("group_limited_greedy", "softmax_group_limited", (8, 3))],
)
def test_deepseek_v2_routing_equals_transformers(method, rule, groups, scaling):
    """DeepSeek-V2's greedy and group_limited_greedy against transformers' router, on random and
    tied logits: the same experts (tie-breaks included) and weights, times routed_scaling_factor."""
    n_group, topk_group = groups
    hf = _deepseek_v2_router(method, 32, 6, n_group, topk_group, scaling)
    params = dict(n_group=n_group, topk_group=topk_group, scaling=scaling, renormalize=False)
    ours = _router(rule, hf, 32, 6, **params)
    for x in (_hidden(48, 16, 14), _tied_hidden(40, 16, 15)):
        with torch.no_grad():
            _, ref_w, ref_ids = hf(x)
            w, ids = ours(x)
        assert torch.equal(ids, ref_ids)  # same ops in the same order: the same tie-breaks
        torch.testing.assert_close(w, ref_w, rtol=0, atol=0)
    if n_group > 1:  # the groups mattered: plain top-6 picks experts outside the kept groups
        scores = torch.softmax(_hidden(48, 16, 14) @ hf.weight.t(), dim=-1)
        assert not torch.equal(
            scores.topk(6).indices.sort().values, ours(_hidden(48, 16, 14))[1].sort().values
        )


def test_deepseek_v2_norm_topk_prob_renormalises_instead_of_scaling():
    """With norm_topk_prob DeepSeek's own code renormalises the chosen weights and skips
    routed_scaling_factor; transformers' port always scales (no published V2 config sets it)."""
    hf = _deepseek_v2_router("greedy", 16, 4, scaling=2.0)
    ours = _router("softmax_greedy", hf, 16, 4, renormalize=True, scaling=2.0)
    x = _hidden(24, 16, 16)
    with torch.no_grad():
        _, ref_w, ref_ids = hf(x)
        w, ids = ours(x)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w / ref_w.sum(-1, keepdim=True), rtol=1e-6, atol=1e-7)
    one = _router(
        "softmax_greedy", _deepseek_v2_router("greedy", 16, 1, scaling=2.0), 16, 1, renormalize=True
    )
    assert torch.all(one(x)[0] < 1.0)  # top-1 is never renormalised to 1


@pytest.mark.parametrize("norm", [True, False])
def test_deepseek_v3_routing_equals_transformers(norm):
    """DeepSeek-V3 (8 groups keep 4, top-8 of 64): sigmoid scores, the correction bias for the
    choice only, groups ranked by the sum of their two best; random and tied logits."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(
        hidden_size=16, n_routed_experts=64, num_experts_per_tok=8, n_group=8, topk_group=4,
        routed_scaling_factor=2.5, norm_topk_prob=norm,
    )  # fmt: skip
    hf = DeepseekV3TopkRouter(cfg)
    g = torch.Generator().manual_seed(17)
    with torch.no_grad():
        hf.weight.normal_(generator=g)
        hf.e_score_correction_bias.copy_(torch.randn(64, generator=g) * 0.3)
        hf.e_score_correction_bias[8:16] = hf.e_score_correction_bias[0:8]  # two groups tie exactly
    params = dict(n_group=8, topk_group=4, scaling=2.5, renormalize=norm)
    ours = _router("sigmoid_grouped", hf, 64, 8, **params)
    for x in (_hidden(48, 16, 18), _tied_hidden(40, 16, 19)):
        with torch.no_grad():
            _, ref_w, ref_ids = hf(x)
            w, ids = ours(x)
        assert torch.equal(ids, ref_ids)
        torch.testing.assert_close(w, ref_w, rtol=0, atol=0)
