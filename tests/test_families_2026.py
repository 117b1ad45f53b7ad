"""The 2026 families (tests/real_configs/2026, shrunk with every flag kept) beyond the fp32 /
bf16 comparisons of test_real_families and the layout matrix of test_real_layouts: chunked
prefill gives the tokens of one unchunked run (prefix caching: test_prefix_caching's family
cells), and the published checkpoints' extra tensors (MTP modules) are skipped by a named, logged rule."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from distributed_utils import run_distributed
from layout_cases import rank_main
from real_checkpoints import Sizes, published, shrink
from test_chunked_prefill import SHORT, compare
from test_real_families import FAMILIES, hf_logprobs, hf_model, logprob_errors, prompts_for

from expertmesh import LLM, SamplingParams
from expertmesh.distributed.group import Group
from expertmesh.layers.norm import ProjectionRMSNorm

CHUNKED_AND_CACHED = ["minimax-m2.7", "kimi-k2.5", "longcat-flash", "deepseek-v3.2"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", CHUNKED_AND_CACHED)
def test_chunked_prefill_equals_unchunked(family, real_checkpoint):
    source, overrides = FAMILIES[family]
    llm = compare(real_checkpoint(source, **overrides), SHORT, 256, family)
    assert llm.llm_engine.stats()["steps"] > 8  # the 150-token prompt took three steps to prefill


def test_minimax_declares_its_blocks_and_skips_its_mtp_modules(real_checkpoint, engine_log):
    """Whole-width q/k norm, partial rotary from the legacy rotary_dim, the corrected sigmoid
    router; the 3 MTP modules the weights carry are consumed by the named rule, and logged."""
    config = shrink(published("2026/minimax-m2.7"))
    assert config["rotary_dim"] * 2 == config["head_dim"] and config["num_mtp_modules"] == 3
    llm = LLM(real_checkpoint("2026/minimax-m2.7"), max_model_len=128, kv_cache_memory_bytes=1 << 22)
    model = llm.llm_engine.runner.model
    cfg = llm.llm_engine.config.model_config
    assert cfg.rope.rotary_dim == config["rotary_dim"] and cfg.num_nextn_predict_layers == 3
    attn = model.model.layers["0"].self_attn
    assert isinstance(attn.q_norm, ProjectionRMSNorm) and isinstance(attn.k_norm, ProjectionRMSNorm)
    router = model.model.layers["0"].block_sparse_moe.gate
    assert router.rule == "sigmoid_grouped" and torch.count_nonzero(router.e_score_correction_bias)
    assert "by rule 'mtp layers (num_nextn_predict_layers / num_mtp_modules" in engine_log.text


@pytest.mark.timeout(120)
def test_kimi_k2_model_type_is_read_as_deepseek_v3(real_checkpoint, engine_log, tmp_path):
    """Kimi-K2-Instruct's published config says model_type "kimi_k2", which transformers reads only
    with remote code: we read it as DeepSeek-V3 (logged). The reference is transformers on the same
    tensors with model_type deepseek_v3 (its auto_map's DeepseekV3Config); greedy tokens and fp32
    logprobs equal at every step."""
    import transformers

    published_config = shrink(published("2026/kimi-k2-instruct"))
    assert published_config["model_type"] == "kimi_k2"
    reference = real_checkpoint("2026/kimi-k2-instruct", model_type="deepseek_v3")
    kimi = tmp_path / "kimi-k2"
    shutil.copytree(reference, kimi)
    (kimi / "config.json").write_text(json.dumps(published_config, indent=2))
    with pytest.raises((ValueError, OSError)):  # what a user of plain transformers meets offline
        transformers.AutoConfig.from_pretrained(kimi, trust_remote_code=False)
    llm = LLM(str(kimi), max_model_len=128, kv_cache_memory_bytes=1 << 23)
    assert "model_type 'kimi_k2' read as 'deepseek_v3'" in engine_log.text
    prompts = prompts_for(512)[2:5]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=20)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    model = transformers.AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs, strict=True):
        ref = hf_logprobs(model, prompt, out.outputs[0].token_ids)
        assert out.outputs[0].token_ids == ref.argmax(-1).tolist(), f"prompt of {len(prompt)} tokens"
        assert logprob_errors(out, ref).max() < 2e-4
    assert Path(kimi, "config.json").read_text() == json.dumps(published_config, indent=2)


def test_kimi_k25_serves_its_text_tower_and_logs_the_vision_skip(real_checkpoint, engine_log):
    path = real_checkpoint("2026/kimi-k2.5")
    llm = LLM(path, max_model_len=128, kv_cache_memory_bytes=1 << 22)
    cfg = llm.llm_engine.config.model_config
    assert cfg.rope.rope_type == "yarn" and cfg.rope.factor == 64.0 and cfg.rope.beta_fast == 32.0
    assert cfg.mla is not None and cfg.first_k_dense_replace == 1
    assert "by rule 'vision tower and projector (expertmesh serves text)'" in engine_log.text


@pytest.mark.parametrize(
    "name",
    [
        "minimax-m2.5",
        "minimax-m2.7",
        "kimi-k2.5",
        "kimi-k2-instruct",
        "longcat-flash-chat",
        "deepseek-v3.2",
        "glm-5",
    ],
)
def test_published_2026_configs_shrink_with_every_flag_kept(name):
    """Every key survives shrinking; a flag (not a size) keeps its published value; our config
    reading (hf_config.load_hf_config) takes each file, Kimi-K2's kimi_k2 included."""
    from expertmesh.config.hf_config import load_hf_config

    full = published(f"2026/{name}")
    small = shrink(full)
    sizes = {
        "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
        "intermediate_size", "moe_intermediate_size", "num_local_experts", "n_routed_experts",
        "num_experts_per_tok", "vocab_size", "max_position_embeddings", "bos_token_id", "eos_token_id",
        "pad_token_id", "rope_scaling", "initializer_range", "torch_dtype", "dtype", "kv_lora_rank",
        "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "first_k_dense_replace",
        "rotary_dim", "attn_type_list", "quantization_config", "text_config", "vision_config",
        "num_layers", "ffn_hidden_size", "expert_ffn_hidden_size", "moe_topk", "zero_expert_num",
        "index_n_heads", "index_head_dim", "index_topk", "qk_head_dim",
    }  # fmt: skip
    pairs = [(full, small)]
    if "text_config" in full:
        pairs.append((full["text_config"], small["text_config"]))
    for old, new in pairs:
        added = {"initializer_range"}  # set by shrink for clear greedy margins
        assert set(new) - added == set(old) - {"quantization_config"} - added, name
        assert all(new[k] == v for k, v in old.items() if k not in sizes), name
    text = small.get("text_config", small)
    if "rotary_dim" in text:
        assert text["rotary_dim"] / text["head_dim"] == full["rotary_dim"] / full["head_dim"]
    layers = text.get("num_layers") or text["num_hidden_layers"]  # LongCat-Flash says num_layers
    assert text.get("attn_type_list", [1] * layers) == [1] * layers
    if "zero_expert_num" in text:  # identity experts keep their ratio to the real ones
        assert (
            text["zero_expert_num"] * full["n_routed_experts"]
            == full["zero_expert_num"] * text["n_routed_experts"]
        )
    hf = load_hf_config_from(small, load_hf_config)
    assert hf.architectures == full["architectures"]


def load_hf_config_from(config: dict, load) -> object:
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        Path(d, "config.json").write_text(json.dumps(config))
        return load(d)


LONGCAT_CASES = [
    (1, 1, 2, False, "allgather_reducescatter"),
    (2, 1, 1, True, "alltoall"),
]  # (DP, PP, TP, EP, backend)
LONGCAT_ENGINE = dict(max_model_len=128, kv_cache_memory_bytes=1 << 22, debug_nan_recv_buffers=True)


def _longcat_prompts() -> list[list[int]]:
    return prompts_for(512)[1:5]


def _longcat_share(dp_rank: int, dp_size: int) -> list[int]:
    """Every prompt on the first DP replica, none on the second."""
    return list(range(len(_longcat_prompts()))) if dp_rank == 0 else []


def _longcat_counted_run(llm: LLM, idx: list[int]):
    """The tokens of this replica's prompts, and for alltoall what each dispatch sent against what
    the real picks need (identity picks never leave their rank)."""
    from expertmesh.distributed import all2all

    sends = []  # (rows sent, (token, destination) pairs with a real pick, identity picks)
    original = all2all.AllToAllAll2All._dispatch

    def counted(self, x, ids, weights, sizes):
        out = original(self, x, ids, weights, sizes)
        owners = self.expert_owner[ids.clamp(min=0)]
        needed = {(t, int(o)) for t, row in enumerate(owners) for j, o in enumerate(row) if ids[t, j] >= 0}
        sends.append((len(self._route.source_rows), len(needed), int((ids < 0).sum())))
        return out

    all2all.AllToAllAll2All._dispatch = counted
    try:
        prompts = _longcat_prompts()
        outs = llm.generate(
            [{"prompt_token_ids": prompts[i]} for i in idx],
            SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
            use_tqdm=False,
        )
    finally:
        all2all.AllToAllAll2All._dispatch = original
    return [o.outputs[0].token_ids for o in outs], sends


@pytest.mark.timeout(120)
def test_longcat_tp2_and_ep_alltoall_equal_one_process(real_checkpoint):
    """LongCat-Flash with 7 real experts (EP 2 does not divide them) and 3 identity ones: TP2 and
    DP2 x EP alltoall give the one-process tokens on every rank, and every alltoall dispatch sent
    exactly one row per (token, rank owning one of its real picks): identity picks move nothing."""
    source, overrides = FAMILIES["longcat-flash"]
    path = real_checkpoint(source, sizes=Sizes(experts=7), **overrides)
    prompts = _longcat_prompts()
    llm = LLM(path, max_model_len=128, kv_cache_memory_bytes=1 << 22)
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = [
        o.outputs[0].token_ids
        for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    ]
    per_ranks = run_distributed(
        rank_main, 2, path, LONGCAT_CASES, LONGCAT_ENGINE, _longcat_share, _longcat_counted_run, timeout=110
    )
    identity_picks = 0
    for rank, results in enumerate(per_ranks):
        sends = [s for case, _, (_, case_sends) in results if case[4] == "alltoall" for s in case_sends]
        for case, mine, (tokens, _) in results:
            assert tokens == [expected[i] for i in mine], f"rank {rank}, (DP, PP, TP, EP, backend) {case}"
        assert sends and all(sent == needed for sent, needed, _ in sends), sends
        identity_picks += sum(n for _, _, n in sends)
    assert identity_picks > 0  # the identity experts were picked, and their places sent nowhere


def test_longcat_layer_holds_two_cache_slots_and_its_identity_experts(real_checkpoint, tmp_path):
    """Each LongCat layer gives each of its two attention blocks its own latent cache slot (the
    runner's cache list is two a layer, in checkpoint order); the router scores real and identity
    experts together; a zero_expert_type other than identity fails by name."""
    source, overrides = FAMILIES["longcat-flash"]
    path = real_checkpoint(source, **overrides)
    llm = LLM(path, max_model_len=128, kv_cache_memory_bytes=1 << 22)
    model, runner = llm.llm_engine.runner.model, llm.llm_engine.runner
    cfg = llm.llm_engine.config.model_config
    layers = list(model.model.layers.values())
    assert len(runner.attn_layers) == 2 * cfg.num_layers == 2 * len(layers)
    assert runner.attn_layers[:2] == [layers[0].self_attn[0].attn, layers[0].self_attn[1].attn]
    assert len({id(t) for t in runner.kv}) == len(runner.kv) == 2 * cfg.num_layers
    moe = layers[0].mlp
    assert cfg.identity_experts == 4
    assert moe.gate.e_score_correction_bias.numel() == cfg.num_experts + cfg.identity_experts
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    config = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**config, "zero_expert_type": "zero"}))
    with pytest.raises(ValueError, match="zero_expert_type='zero' is not supported"):
        LLM(str(bad), max_model_len=128, kv_cache_memory_bytes=1 << 22)


def test_deepseek_v32_selection_is_what_makes_it_equal_transformers(real_checkpoint, monkeypatch):
    """The indexer's top-12 of the past (the prompts are longer) is not dense attention: with every
    visible key kept instead, the 70-token prompt's logprobs move away from transformers' forward;
    with the selection (decoding in the latent space over the kept rows, or over them expanded),
    logprobs stay within fp32 tolerance. Each layer has its index-key cache slot beside its
    latent rows."""
    from expertmesh.layers import sparse_indexer

    source, overrides = FAMILIES["deepseek-v3.2"]
    path = real_checkpoint(source, **overrides)
    prompt = prompts_for(512)[4]
    sp = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, logprobs=20)
    llm = LLM(path, max_model_len=128, kv_cache_memory_bytes=1 << 22)
    runner = llm.llm_engine.runner
    kinds = [layer.kv_spec.kind for layer in runner.attn_layers]
    assert kinds == ["latent", "index_key"] * llm.llm_engine.config.model_config.num_layers
    assert "index_key (4 layers, 16 values a layer)" in runner.describe_kv()
    model = hf_model(path)
    out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
    assert logprob_errors(out, hf_logprobs(model, prompt, out.outputs[0].token_ids)).max() < 2e-4
    for latent in runner.attn_layers[::2]:  # decode over the expanded kept keys, not the latent rows
        latent.absorbed = False
    out = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
    assert logprob_errors(out, hf_logprobs(model, prompt, out.outputs[0].token_ids)).max() < 2e-4
    monkeypatch.setattr(
        sparse_indexer.IndexerStep,
        "select",
        lambda self, requests: [k[None, :] <= q[:, None] for *_, q, k in requests],
    )
    dense = LLM(path, max_model_len=128, kv_cache_memory_bytes=1 << 22)
    out = dense.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0]
    assert logprob_errors(out, hf_logprobs(model, prompt, out.outputs[0].token_ids)).max() > 1e-2


def test_sparse_attention_configs_fail_by_name():
    """GLM's cross-layer top-k sharing is refused by name; an indexed_attention layer needs the
    indexer's sizes; top-k counts the identity experts among those it may pick."""
    from types import SimpleNamespace

    from expertmesh.config.mla_config import MLAConfig
    from expertmesh.config.model_config import ModelConfig

    mla = dict(
        kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, q_lora_rank=8, hidden_size=16
    )
    shared = SimpleNamespace(
        **mla, index_topk=4, index_n_heads=2, index_head_dim=8, indexer_types=["full", "shared"]
    )
    with pytest.raises(
        ValueError, match=r"indexer_types \['shared'\] are not supported; supported: \['full'\]"
    ):
        MLAConfig.from_hf(shared)
    base = dict(
        architecture="DeepseekV32ForCausalLM", vocab_size=32, hidden_size=16, num_layers=2, num_heads=2,
        num_kv_heads=2, head_dim=4, intermediate_size=32, max_position_embeddings=64, norm_eps=1e-6,
    )  # fmt: skip
    with pytest.raises(ValueError, match="indexed_attention layers but the config has no index_topk"):
        ModelConfig(
            **base, layer_types=("indexed_attention",) * 2, mla=MLAConfig.from_hf(SimpleNamespace(**mla))
        )
    with pytest.raises(ValueError, match=r"num_experts_per_tok=7 must be in \[1, 6\]"):
        ModelConfig(**base, num_experts=4, identity_experts=2, top_k=7)


def test_indexer_selection_in_query_slices_equals_one_pass(monkeypatch):
    """A long prefill scores its queries in slices (SCORE_VALUES at a time): the kept keys equal one
    pass over every query, each query keeps index_topk visible keys (all of them while it sees
    fewer), and a context no longer than index_topk keeps every visible key."""
    from expertmesh.layers import sparse_indexer

    g = torch.Generator().manual_seed(0)
    indexer = sparse_indexer.LightningIndexer(
        16, 8, heads=4, head_dim=8, rope_dim=4, topk=5, dtype=torch.float32, group=Group((0,), 0)
    )
    t = 23
    q, k, w = (torch.randn(*s, generator=g) for s in ((t, 4, 8), (t, 8), (t, 4)))
    step = sparse_indexer.IndexerStep(indexer, q, k, w)
    pos = torch.arange(t)
    whole = step.keep(slice(0, t), k, pos, pos)
    monkeypatch.setattr(sparse_indexer, "SCORE_VALUES", 4 * t * 3)  # three queries a slice
    assert torch.equal(step.keep(slice(0, t), k, pos, pos), whole)
    assert whole.sum(-1).tolist() == [min(i + 1, 5) for i in range(t)]
    assert not (whole & (pos[None, :] > pos[:, None])).any()
    short = step.keep(slice(0, 5), k[:5], pos[:5], pos[:5])
    assert torch.equal(short, pos[None, :5] <= pos[:5, None])
