"""Every RoPE type against transformers' own rotary code: cos/sin at every position up to twice
original_max_position_embeddings, for contexts on both sides of the switch of the length-dependent
types; the published rope blocks (unshrunk); NeoX halves, GPT-J pairs and partial rotary applied
to q/k as transformers applies them; our CPU kernel bit-equal to the torch path."""

import pytest
import torch
from real_checkpoints import published
from transformers import Glm4MoeConfig, GptOssConfig, Llama4TextConfig, LlamaConfig, PhimoeConfig
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeRotaryEmbedding
from transformers.models.glm4_moe.modeling_glm4_moe import apply_rotary_pos_emb as glm_apply
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRotaryEmbedding
from transformers.models.gpt_oss.modeling_gpt_oss import apply_rotary_pos_emb as gpt_oss_apply
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb as llama_apply
from transformers.models.llama4.modeling_llama4 import Llama4TextRotaryEmbedding
from transformers.models.llama4.modeling_llama4 import apply_rotary_emb as llama4_apply
from transformers.models.phimoe.modeling_phimoe import PhimoeRotaryEmbedding

from expertmesh.config import RopeConfig
from expertmesh.config.rope_config import ROPE_TYPE_NAMES
from expertmesh.cpu import cpu_kernels
from expertmesh.layers.rotary import ROPE_TYPES, RotaryEmbedding

ORIGINAL = 256  # original_max_position_embeddings of the synthetic blocks; positions go to 2x this
HEAD_DIM = 64


def _llama(rope: dict, head_dim: int = HEAD_DIM, max_pos: int = 4 * ORIGINAL) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim, max_position_embeddings=max_pos,
        rope_parameters={"rope_theta": 10000.0, **rope},
    )  # fmt: skip


def _factors(n: int, low: float, high: float) -> list[float]:
    return torch.linspace(low, high, n).tolist()


SYNTHETIC = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
    "yarn": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIGINAL},
    "yarn-mscale": {
        "rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": ORIGINAL,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707,
    },
    "yarn-untruncated": {
        "rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": ORIGINAL, "truncate": False,
        "beta_fast": 16.0, "beta_slow": 2.0,
    },
    "yarn-attention-factor": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
        "attention_factor": 1.3,
    },
    "longrope": {
        "rope_type": "longrope", "original_max_position_embeddings": ORIGINAL,
        "short_factor": _factors(HEAD_DIM // 2, 1.0, 1.2), "long_factor": _factors(HEAD_DIM // 2, 1.0, 40.0),
    },
    "llama3": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": ORIGINAL,
    },
    "partial-yarn": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
        "partial_rotary_factor": 0.5,
    },
    "proportional": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "factor": 2.0},
}  # fmt: skip
# Context lengths of one forward: below, at and past the switch of the length-dependent types.
LENGTHS = [1, ORIGINAL // 2, ORIGINAL, ORIGINAL + 1, 2 * ORIGINAL]


def _ours(hf_config, interleaved: bool = False) -> RotaryEmbedding:
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    rope = RopeConfig.from_hf(hf_config, head_dim)
    if interleaved:
        from dataclasses import replace

        rope = replace(rope, interleaved=True)
    return RotaryEmbedding(rope)


def _hf_cos_sin(hf_rotary, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.zeros(1, length, 8)
    cos, sin = hf_rotary(x, torch.arange(length)[None])
    return cos[0], sin[0]


def _our_cos_sin(ours: RotaryEmbedding, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    tables = ours.lookup(torch.arange(length), torch.float32, torch.full((length,), length))
    return tables.cos[:, 0], tables.sin[:, 0]


def test_every_type_transformers_knows_is_registered():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    assert set(ROPE_INIT_FUNCTIONS) | {"default"} == set(ROPE_TYPES)


@pytest.mark.parametrize("name", sorted(SYNTHETIC))
def test_cos_sin_equal_transformers(name):
    # dynamic switches past max_position_embeddings: put that inside the lengths tested
    config = _llama(SYNTHETIC[name], max_pos=ORIGINAL if name == "dynamic" else 4 * ORIGINAL)
    ours = _ours(config)
    for length in LENGTHS:
        hf = LlamaRotaryEmbedding(config)  # fresh: transformers' dynamic/longrope state is per call
        hf_cos, hf_sin = _hf_cos_sin(hf, length)
        cos, sin = _our_cos_sin(ours, length)
        r = cos.shape[-1]
        assert hf.inv_freq.shape[0] * 2 == r, (name, r)
        torch.testing.assert_close(hf.inv_freq, ours.frequencies(length)[0], rtol=0, atol=0)
        torch.testing.assert_close(cos, hf_cos, rtol=1e-6, atol=1e-6, msg=f"{name} L={length}")
        torch.testing.assert_close(sin, hf_sin, rtol=1e-6, atol=1e-6, msg=f"{name} L={length}")


def test_length_dependent_types_switch_where_transformers_does():
    longrope = _ours(_llama(SYNTHETIC["longrope"]))
    short, long = longrope.frequencies(ORIGINAL)[0], longrope.frequencies(ORIGINAL + 1)[0]
    assert not torch.equal(short, long)
    dynamic = _ours(_llama(SYNTHETIC["dynamic"], max_pos=ORIGINAL))
    assert torch.equal(dynamic.frequencies(ORIGINAL)[0], dynamic.inv_freq)
    assert not torch.equal(dynamic.frequencies(ORIGINAL + 1)[0], dynamic.inv_freq)
    # Per token: a batch mixing a short and a long sequence rotates each by its own length.
    positions = torch.tensor([5, 5])
    mixed = longrope.lookup(positions, torch.float32, torch.tensor([ORIGINAL, 2 * ORIGINAL]))
    alone = [
        longrope.lookup(positions[:1], torch.float32, torch.tensor([n])) for n in (ORIGINAL, 2 * ORIGINAL)
    ]
    assert torch.equal(mixed.cos[0], alone[0].cos[0]) and torch.equal(mixed.cos[1], alone[1].cos[0])
    assert not torch.equal(mixed.cos[0], mixed.cos[1])


# ---- the published rope blocks, unshrunk ----------------------------------------------------
def _published_text(name: str) -> dict:
    c = published(name)
    return c.get("text_config", c)


def _positions(rope: dict) -> list[int]:
    """These types do not depend on the length: one forward over [0, 2 x original) covers them."""
    return [2 * rope.get("original_max_position_embeddings", 4096)]


def test_gpt_oss_yarn_untruncated():
    c = _published_text("gpt-oss-20b")
    config = GptOssConfig(
        hidden_size=c["hidden_size"], num_attention_heads=c["num_attention_heads"], head_dim=c["head_dim"],
        max_position_embeddings=c["max_position_embeddings"],
        rope_parameters={"rope_theta": c["rope_theta"], **c["rope_scaling"]},
    )  # fmt: skip
    ours = _ours(config)
    for length in _positions(c["rope_scaling"]):
        hf_cos, hf_sin = _hf_cos_sin(GptOssRotaryEmbedding(config), length)  # half width: not duplicated
        cos, sin = _our_cos_sin(ours, length)
        half = cos.shape[-1] // 2
        torch.testing.assert_close(cos[:, :half], hf_cos, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(sin[:, :half], hf_sin, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ["deepseek-v2-lite", "deepseek-v3", "qwen3-yarn"])
def test_published_yarn_blocks(name):
    if name == "qwen3-yarn":  # the YaRN block Qwen3's model card asks long-context users to add
        rope, head_dim = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 128
        theta, max_pos = 1e6, 131072
    else:
        c = _published_text(name)
        rope, head_dim = dict(c["rope_scaling"]), c["qk_rope_head_dim"]
        rope["rope_type"] = rope.pop("type")
        theta, max_pos = c["rope_theta"], c["max_position_embeddings"]
    config = _llama({**rope, "rope_theta": theta}, head_dim=head_dim, max_pos=max_pos)
    ours = _ours(config)
    for length in _positions(rope):
        hf_cos, hf_sin = _hf_cos_sin(LlamaRotaryEmbedding(config), length)
        cos, sin = _our_cos_sin(ours, length)
        torch.testing.assert_close(cos, hf_cos, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(sin, hf_sin, rtol=1e-6, atol=1e-6)


def test_llama4_llama3_interleaved():
    c = _published_text("llama-4-scout-17b-16e")
    config = Llama4TextConfig(
        hidden_size=c["hidden_size"], num_attention_heads=c["num_attention_heads"], head_dim=c["head_dim"],
        max_position_embeddings=c["max_position_embeddings"],
        rope_parameters={"rope_theta": c["rope_theta"], **c["rope_scaling"]},
    )  # fmt: skip
    ours = _ours(config, interleaved=True)
    for length in _positions(c["rope_scaling"]):
        hf = Llama4TextRotaryEmbedding(config)
        freqs_cis = hf(torch.zeros(1, length, 8), torch.arange(length)[None])[0]
        cos, sin = _our_cos_sin(ours, length)
        torch.testing.assert_close(cos, freqs_cis.real.repeat_interleave(2, -1), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(sin, freqs_cis.imag.repeat_interleave(2, -1), rtol=1e-6, atol=1e-6)


def test_glm_partial_rotary():
    c = _published_text("glm-4.5-air")
    config = Glm4MoeConfig(
        hidden_size=c["hidden_size"], num_attention_heads=c["num_attention_heads"], head_dim=c["head_dim"],
        max_position_embeddings=c["max_position_embeddings"], rope_theta=c["rope_theta"],
        partial_rotary_factor=c["partial_rotary_factor"],
    )  # fmt: skip
    ours = _ours(config)
    assert ours.rope.rotary_dim == c["head_dim"] // 2
    for length in (1, 4096, 8192):
        hf_cos, hf_sin = _hf_cos_sin(Glm4MoeRotaryEmbedding(config), length)
        cos, sin = _our_cos_sin(ours, length)
        torch.testing.assert_close(cos, hf_cos, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(sin, hf_sin, rtol=1e-6, atol=1e-6)


def _phi35() -> PhimoeConfig:
    c = _published_text("phi-3.5-moe")
    rope = dict(c["rope_scaling"])
    head_dim = c["hidden_size"] // c["num_attention_heads"]
    for key in ("short_factor", "long_factor"):  # the published lists are truncated (SOURCES.md)
        rope[key] = (rope[key] * head_dim)[: head_dim // 2]
    return PhimoeConfig(
        hidden_size=c["hidden_size"], num_attention_heads=c["num_attention_heads"],
        max_position_embeddings=c["max_position_embeddings"], rope_theta=c["rope_theta"],
        original_max_position_embeddings=c["original_max_position_embeddings"], rope_scaling=rope,
    )  # fmt: skip


def test_phi35_longrope_short_regime_equals_phimoe():
    """Up to original_max_position_embeddings transformers' PhiMoE and the published semantics
    agree: short factors, short_mscale."""
    config = _phi35()
    ours = _ours(config)
    for length in (1, 2048, 4096):
        hf_cos, hf_sin = _hf_cos_sin(PhimoeRotaryEmbedding(config), length)
        cos, sin = _our_cos_sin(ours, length)
        torch.testing.assert_close(cos, hf_cos, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(sin, hf_sin, rtol=1e-6, atol=1e-6)


def test_phi35_longrope_long_regime_uses_long_factors_and_long_mscale():
    """Past the original window the published semantics (Phi-3's LongRoPE, which transformers' generic
    longrope implements) take the long factors; transformers' PhiMoE keeps the short ones and only
    switches the mscale. We follow the published model: long factors with long_mscale."""
    config = _phi35()
    ours = _ours(config)
    generic = _llama(
        {k: v for k, v in config.rope_parameters.items() if k not in ("short_mscale", "long_mscale")},
        head_dim=128, max_pos=config.max_position_embeddings,
    )  # fmt: skip
    for length in (4097, 8192):
        ref = LlamaRotaryEmbedding(generic)
        ref_cos, ref_sin = _hf_cos_sin(ref, length)
        ratio = config.rope_parameters["long_mscale"] / ref.attention_scaling
        cos, sin = _our_cos_sin(ours, length)
        torch.testing.assert_close(cos, ref_cos * ratio, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(sin, ref_sin * ratio, rtol=1e-5, atol=1e-6)
        phimoe_cos, _ = _hf_cos_sin(PhimoeRotaryEmbedding(config), length)
        assert not torch.allclose(cos, phimoe_cos, atol=1e-3)  # the documented difference


# ---- applying the rotation --------------------------------------------------------------------
def _qk(t: int, head_dim: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t, 4, head_dim, generator=g), torch.randn(t, 2, head_dim, generator=g)


def test_apply_matches_transformers_layouts():
    t, pos = 40, torch.arange(40)
    q, k = _qk(t, HEAD_DIM)
    # NeoX halves (Llama's apply), and GPT-OSS's half-width formulation of the same rotation.
    config = _llama(SYNTHETIC["yarn"])
    tables = _ours(config).lookup(pos, torch.float32)
    cos, sin = LlamaRotaryEmbedding(config)(q, pos[None])
    ref = llama_apply(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    got = tables.apply(q, k)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    half = [t[..., : HEAD_DIM // 2].squeeze(1)[None] for t in (tables.cos, tables.sin)]
    ref = gpt_oss_apply(q.transpose(0, 1)[None], k.transpose(0, 1)[None], *half)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    # Partial rotary (GLM): the first half rotated, the rest passed through.
    glm = Glm4MoeConfig(hidden_size=256, num_attention_heads=4, head_dim=HEAD_DIM, partial_rotary_factor=0.5)
    tables = _ours(glm).lookup(pos, torch.float32)
    cos, sin = Glm4MoeRotaryEmbedding(glm)(q, pos[None])
    ref = glm_apply(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
    for a, b in zip(tables.apply(q, k), ref, strict=True):
        torch.testing.assert_close(a, b[0].transpose(0, 1), rtol=1e-6, atol=1e-6)
    # GPT-J pairs (Llama 4's complex product).
    l4 = Llama4TextConfig(hidden_size=256, num_attention_heads=4, head_dim=HEAD_DIM)
    tables = _ours(l4, interleaved=True).lookup(pos, torch.float32)
    freqs = Llama4TextRotaryEmbedding(l4)(q, pos[None])
    ref = llama4_apply(q[None], k[None], freqs)
    for a, b in zip(tables.apply(q, k), ref, strict=True):
        torch.testing.assert_close(a, b[0], rtol=1e-5, atol=1e-5)


def test_bad_rope_blocks_name_the_problem():
    with pytest.raises(ValueError, match="rope_type='mrope' is not supported; supported: .*yarn"):
        RopeConfig(rope_type="mrope")
    with pytest.raises(ValueError, match="longrope.*needs.*short_factor"):
        RopeConfig(rope_type="longrope", original_max_position_embeddings=16)
    with pytest.raises(ValueError, match="short_factor has 3 entries; rotary_dim=64 needs 32"):
        RopeConfig(
            rope_type="longrope", short_factor=(1.0,) * 3, long_factor=(1.0,) * 32,
            original_max_position_embeddings=16,
        )  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["partial", "interleaved", "interleaved-partial"])
def test_cpu_kernel_rotary_bit_equal_to_torch(dtype, layout):
    kernels = cpu_kernels.load()
    assert kernels is not None
    d, t, bs, blocks = 24, 19, 4, 8
    partial = 0.5 if "partial" in layout else 1.0
    rope = RopeConfig(head_dim=d, partial_rotary_factor=partial, interleaved="interleaved" in layout)
    tables = RotaryEmbedding(rope).lookup(torch.arange(3, 3 + t), dtype)
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(t, 8 * d, generator=g).to(dtype)
    q, k, v = (x.view(t, -1, d) for x in qkv.split([4 * d, 2 * d, 2 * d], dim=-1))
    slots = torch.randperm(blocks * bs, generator=g)[:t]
    caches = [torch.zeros(blocks, bs, 2, d, dtype=dtype) for _ in range(2)]
    q_ref, k_ref = tables.apply(q, k)
    cos, sin = tables.cos, tables.sin
    q_got, k_got, v_got = kernels.rope_cache(q, k, v, cos, sin, slots, *caches, rope.interleaved)
    assert torch.equal(q_got, q_ref) and torch.equal(k_got, k_ref) and torch.equal(v_got, v)
    assert torch.equal(caches[0].view(-1, 2, d)[slots], k_ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_positions_values_do_not_depend_on_its_step(dtype):
    """Fixed-frequency types read one table over [0, n) (grown as positions grow, never past the
    model's positions): a position gets the same cos / sin alone, in a batch, before and after the
    table grows, equal to transformers' for a whole sequence."""
    config = _llama(SYNTHETIC["llama3"], max_pos=4 * ORIGINAL)
    ours = _ours(config)
    hf_cos, hf_sin = _hf_cos_sin(LlamaRotaryEmbedding(config), 4 * ORIGINAL)
    alone = ours.lookup(torch.tensor([7]), dtype)
    batch = ours.lookup(torch.tensor([3, 7, 0, 300]), dtype)  # grows the table past 256
    later = ours.lookup(torch.tensor([4 * ORIGINAL - 1, 7]), dtype)
    assert ours._table[dtype].cos.shape[0] == 4 * ORIGINAL  # capped at max_position_embeddings
    for tables, row in ((alone, 0), (batch, 1), (later, 1)):
        assert torch.equal(tables.cos[row], alone.cos[0]) and torch.equal(tables.sin[row], alone.sin[0])
    positions = torch.tensor([3, 7, 0, 300])
    for ours_t, hf_t in ((batch.cos, hf_cos), (batch.sin, hf_sin)):
        torch.testing.assert_close(ours_t[:, 0].float(), hf_t[positions].to(dtype).float(), rtol=0, atol=1e-6)


def test_the_config_knows_exactly_the_rope_types_the_code_computes():
    """RopeConfig checks rope_type against ROPE_TYPE_NAMES without importing layers/ (no import
    circle); each name has a frequency function here and each function a name there."""
    assert sorted(ROPE_TYPES) == sorted(ROPE_TYPE_NAMES)
    with pytest.raises(ValueError, match="rope_type='spiral' is not supported; supported: \\['default'"):
        RopeConfig(rope_type="spiral")
