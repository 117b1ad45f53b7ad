"""DeepSeek-V2-Lite, DeepSeek-V2 and DeepSeek-V3 shaped tiny checkpoints built from their published
configs (tests/real_configs; V2 from V2-Lite's keys and V2's values, real_checkpoints.deepseek_v2),
against transformers: greedy tokens and full-vocabulary logprobs (fp32), bf16 logprobs; the latent
KV cache's size; absorbed against expanded decode, with and without the CPU kernels; checkpoint
details (V3's MTP layer, transformers' in-memory tensor names, FP8, moe_layer_freq)."""

import json
import shutil
import statistics
import types

import pytest
import torch
from checkpoints import hf_greedy, hf_last_logits, one_thread, prompts_of_lengths
from expect import assert_tokens_equal
from real_checkpoints import Sizes, deepseek_v2, published, randomize_small, shrink
from transformers import AutoConfig, AutoModelForCausalLM

from expertmesh import LLM, SamplingParams
from expertmesh.config import ModelConfig
from expertmesh.cpu import cpu_kernels
from expertmesh.engine import kv_cache
from expertmesh.layers.mla import MLAAttention, mla_softmax_scale

MODELS = {
    # no q LoRA, 64 experts top-6 as published, 2 shared, 1 dense layer, softmax greedy
    "v2-lite": ("deepseek-v2-lite", Sizes(experts=64, max_top_k=6)),
    # q LoRA, group_limited_greedy (8 groups keep 3), routed_scaling_factor 16
    "v2": (deepseek_v2(), Sizes(experts=32, max_top_k=6)),
    # q LoRA, sigmoid + correction bias, 8 groups keep 4, top-8, 3 dense layers, an MTP layer
    "v3": ("deepseek-v3", Sizes(layers=5, experts=32, max_top_k=8)),
}
LENGTHS = [1, 3, 7, 12, 20, 33, 5, 48]
NEW_TOKENS = 32


def deepseek(real_checkpoint, name: str, **kw) -> str:
    source, sizes = MODELS[name]
    return real_checkpoint(source, sizes=sizes, **kw)


def _config(name: str) -> dict:
    source, sizes = MODELS[name]
    return shrink(published(source) if isinstance(source, str) else source, sizes)


def test_shrunk_configs_keep_what_makes_each_model():
    lite, v2, v3 = _config("v2-lite"), _config("v2"), _config("v3")
    assert lite["q_lora_rank"] is None and lite["topk_method"] == "greedy"
    assert (lite["n_routed_experts"], lite["num_experts_per_tok"], lite["n_shared_experts"]) == (64, 6, 2)
    assert lite["first_k_dense_replace"] == 1 and lite["rope_scaling"]["mscale_all_dim"] == 0.707
    assert v2["q_lora_rank"] and v2["topk_method"] == "group_limited_greedy"
    assert (v2["n_group"], v2["topk_group"], v2["routed_scaling_factor"]) == (8, 3, 16.0)
    assert v3["q_lora_rank"] and v3["scoring_func"] == "sigmoid" and v3["num_nextn_predict_layers"] == 1
    assert (v3["n_group"], v3["topk_group"], v3["num_experts_per_tok"], v3["first_k_dense_replace"]) == (
        8,
        4,
        8,
        3,
    )
    for c in (lite, v2, v3):
        assert c["v_head_dim"] != c["qk_nope_head_dim"] + c["qk_rope_head_dim"]  # values narrower than keys


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_greedy_tokens_and_logprobs_match_transformers(real_checkpoint, name):
    path = deepseek(real_checkpoint, name)
    prompts = prompts_of_lengths(LENGTHS, seed=1)
    llm = LLM(path, max_model_len=256, kv_cache_memory_bytes=1 << 24)
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    for prompt, out, ref in zip(prompts, outs, hf_greedy(path, prompts, NEW_TOKENS), strict=True):
        assert_tokens_equal(
            out.outputs[0].token_ids, ref, f"{name}: the prompt of {len(prompt)} tokens", NEW_TOKENS
        )
    vocab = llm.llm_engine.config.model_config.vocab_size
    one = SamplingParams(temperature=0.0, max_tokens=1, logprobs=vocab)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], one, use_tqdm=False)
    for out, logits in zip(outs, hf_last_logits(path, prompts), strict=True):
        ours = torch.tensor([out.outputs[0].logprobs[0][t].logprob for t in range(vocab)])
        torch.testing.assert_close(ours, logits.log_softmax(-1), atol=2e-4, rtol=1e-4)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", sorted(MODELS))
def test_bf16_logprobs_close_to_transformers(real_checkpoint, name):
    """bf16 end to end, every generated position's full-vocabulary logprobs (prefill and absorbed
    decode steps) against transformers over the same tokens (teacher forcing): float32 arithmetic
    on the same bf16-rounded weights is the exact answer, and transformers' own bf16 forward the
    yardstick of how far bf16 rounding takes an engine from it."""
    path = deepseek(real_checkpoint, name)
    prompts = prompts_of_lengths([1, 9, 30, 17], seed=3)
    llm = LLM(path, dtype="bfloat16", max_model_len=128, kv_cache_memory_bytes=1 << 22)
    vocab = llm.llm_engine.config.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=vocab)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    hf_bf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    exact = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).float().eval()
    ours_err, hf_err = [], []
    for prompt, out in zip(prompts, outs, strict=True):
        tokens, rows = out.outputs[0].token_ids, slice(len(prompt) - 1, len(prompt) + 5)
        with torch.no_grad(), one_thread():
            ref_bf16, ref = (
                m(torch.tensor([prompt + tokens])).logits[0, rows].float() for m in (hf_bf16, exact)
            )
        ref_bf16, ref = ref_bf16.log_softmax(-1), ref.log_softmax(-1)
        for step, lps in enumerate(out.outputs[0].logprobs):
            ours = torch.tensor([lps[t].logprob for t in range(vocab)])
            ours_err.append((ours - ref[step]).abs().max().item())
            hf_err.append((ref_bf16[step] - ref[step]).abs().max().item())
    # Typical positions: as close to the exact answer as transformers' bf16 is (a few hundredths;
    # V2's routed_scaling_factor 16 amplifies rounding to a few tenths, in both engines). A lost
    # head or a wrong absorption is off by whole units everywhere.
    assert statistics.median(ours_err) <= 1.5 * statistics.median(hf_err) + 0.01, (ours_err, hf_err)
    # The routers pick experts by hard thresholds: one bf16 ulp can swap an expert, in either engine.
    # Measured (24 positions): V3 3 above 0.1 (0.29, 0.22, 0.13), exactly where one expert choice
    # differs from transformers' bf16; V2 one at 1.6; transformers' bf16 has its own (0.22, 0.43).
    assert sum(e > 0.5 for e in ours_err) <= 2 and max(ours_err) < 2.5, (ours_err, hf_err)


@pytest.mark.timeout(90)
def test_v3_with_rope_in_halves(real_checkpoint):
    """rope_interleave false (NeoX halves on the rope dims, transformers' other V3 branch):
    prefill logprobs and greedy tokens against transformers."""
    source, sizes = MODELS["v3"]
    path = real_checkpoint(source, sizes=sizes, rope_interleave=False)
    prompts = prompts_of_lengths([5, 26], seed=8)
    llm = LLM(path, max_model_len=64, kv_cache_memory_bytes=1 << 20)
    assert not llm.llm_engine.runner.model.model.rotary.rope.interleaved
    vocab = llm.llm_engine.config.model_config.vocab_size
    one = SamplingParams(temperature=0.0, max_tokens=1, logprobs=vocab)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], one, use_tqdm=False)
    for out, logits in zip(outs, hf_last_logits(path, prompts), strict=True):
        ours = torch.tensor([out.outputs[0].logprobs[0][t].logprob for t in range(vocab)])
        torch.testing.assert_close(ours, logits.log_softmax(-1), atol=2e-4, rtol=1e-4)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(path, prompts, 12)


@pytest.mark.parametrize("name", ["deepseek-v2-lite", "deepseek-v3"])
def test_softmax_scale_has_yarns_mscale_all_dim_correction(name):
    """qk_head_dim^-0.5 x mscale(factor, mscale_all_dim)^2, as transformers' yarn_apply_mscale; none
    without a scaled rope."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    config = {k: v for k, v in published(name).items() if k != "quantization_config"}
    hf = AutoConfig.for_model(**config)
    cfg = ModelConfig.from_hf(hf)
    want = yarn_apply_mscale(hf.rope_parameters, cfg.mla.qk_head_dim**-0.5)
    assert mla_softmax_scale(cfg.rope, cfg.mla.qk_head_dim) == want
    assert want > 1.5 * 192**-0.5  # x1.59 (V2-Lite), x1.87 (V3)
    plain = AutoConfig.for_model(**{**config, "rope_scaling": None})
    assert mla_softmax_scale(ModelConfig.from_hf(plain).rope, 192) == 192**-0.5


def _mla_layers(llm: LLM) -> list:
    return [layer.self_attn.attn for layer in llm.llm_engine.runner.model.model.layers.values()]


@pytest.mark.timeout(120)
def test_absorbed_and_expanded_decode_agree_with_and_without_kernels(real_checkpoint, monkeypatch):
    """Decode in the latent space (absorbed W_UK / W_UV) and decode that expands the cached latents
    into per-head K/V give the same tokens and logprobs, on the CPU kernel's latent path and on
    torch's; the prompts are long enough to span several blocks."""
    path = deepseek(real_checkpoint, "v2")
    prompts = prompts_of_lengths([2, 19, 40], seed=5)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)

    def run(absorbed: bool) -> tuple[list, list]:
        llm = LLM(path, max_model_len=128, kv_cache_memory_bytes=1 << 22)
        for attn in _mla_layers(llm):
            attn.absorbed = absorbed
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        lps = [
            [max(step.values(), key=lambda x: x.logprob).logprob for step in o.outputs[0].logprobs]
            for o in outs
        ]
        return [o.outputs[0].token_ids for o in outs], lps

    runs = {("kernels", absorbed): run(absorbed) for absorbed in (True, False)}
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    runs.update({("torch", absorbed): run(absorbed) for absorbed in (True, False)})
    tokens, lps = runs["kernels", True]
    assert tokens == hf_greedy(path, prompts, 12)
    for key, (t, lp) in runs.items():
        assert t == tokens, key
        torch.testing.assert_close(torch.tensor(lp), torch.tensor(lps), atol=1e-4, rtol=1e-4)


# ---- the latent KV cache ----------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_latent_cache_bytes_per_token_reported_and_sizing_the_budget(real_checkpoint, engine_log):
    path = deepseek(real_checkpoint, "v3")
    budget = 1 << 20
    llm = LLM(path, max_model_len=64, kv_cache_memory_bytes=budget)
    cfg = llm.llm_engine.config.model_config
    m, layers = cfg.mla, cfg.num_layers
    latent = (m.kv_lora_rank + m.qk_rope_head_dim) * layers * 4  # float32
    per_head = cfg.num_heads * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) * layers * 4
    assert llm.llm_engine.runner.bytes_per_token() == latent
    assert f"KV cache: {latent} bytes per token" in engine_log.text
    assert f"per-head K/V would need {per_head} bytes" in engine_log.text
    assert llm.llm_engine.blocks.num_blocks == budget // (latent * 16)
    caches = llm.llm_engine.runner.kv
    assert len(caches) == layers and caches[0].shape == (1, budget // (latent * 16) + 1, 16, 1, 40)


@pytest.mark.parametrize("tp", [1, 8])
def test_published_deepseek_v3_latent_row_is_576_values(tp):
    """At DeepSeek-V3's published sizes one token takes kv_lora_rank + qk_rope_head_dim = 576
    values a layer, for all 128 heads, against 128 x (192 + 128) for per-head K and V; under TP
    each rank keeps the whole latent row, while per-head K/V would split."""
    hf = AutoConfig.for_model(
        **{k: v for k, v in published("deepseek-v3").items() if k != "quantization_config"}
    )
    cfg = ModelConfig.from_hf(hf)
    group = types.SimpleNamespace(world_size=tp, rank_in_group=tp - 1)
    with torch.device("meta"):
        spec = MLAAttention(cfg, 0, None, group).attn.kv_spec
    assert (spec.kind, spec.values_per_token) == ("latent", 576)
    assert spec.expanded == 128 // tp * (192 + 128)
    if tp == 1:  # the start-up line docs/deepseek.md shows
        line = kv_cache.describe([spec] * cfg.num_layers, torch.bfloat16)
        assert line == (
            "KV cache: 70272 bytes per token (torch.bfloat16): latent (61 layers, 576 values a layer); "
            "per-head K/V would need 4997120 bytes (40960 values a layer)"
        )


# ---- checkpoint details -----------------------------------------------------------------------
@pytest.mark.timeout(60)
def test_v3_mtp_layer_is_skipped_by_a_named_logged_rule(real_checkpoint, engine_log):
    path = deepseek(real_checkpoint, "v3")
    n = _config("v3")["num_hidden_layers"]
    with open(f"{path}/model.safetensors.index.json") as f:
        mtp = [k for k in json.load(f)["weight_map"] if k.startswith(f"model.layers.{n}.")]
    assert any("eh_proj" in k for k in mtp) and any(".mlp.experts." in k for k in mtp)
    LLM(path, max_model_len=32, kv_cache_memory_bytes=1 << 20)
    assert f"skipped {len(mtp)} checkpoint tensors by rule 'mtp layers" in engine_log.text


@pytest.mark.timeout(90)
def test_transformers_in_memory_tensor_names_load_alike(real_checkpoint):
    """save_pretrained(save_original_format=False) writes fused 3-D experts
    (mlp.experts.gate_up_proj / down_proj): the same weights, the same tokens."""
    hub = deepseek(real_checkpoint, "v2-lite")
    fused = deepseek(real_checkpoint, "v2-lite", original_format=False)
    from safetensors import safe_open

    with safe_open(f"{fused}/model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert (
        "model.layers.1.mlp.experts.gate_up_proj" in keys
        and "model.layers.1.mlp.experts.0.up_proj.weight" not in keys
    )
    prompts = prompts_of_lengths([4, 11], seed=6)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    runs = [
        [o.outputs[0].token_ids for o in LLM(p, max_model_len=64, kv_cache_memory_bytes=1 << 20).generate(
            [{"prompt_token_ids": q} for q in prompts], params, use_tqdm=False)]
        for p in (hub, fused)
    ]  # fmt: skip
    assert runs[0] == runs[1] == hf_greedy(hub, prompts, 8)


def test_fp8_config_over_unquantized_weights_loads_them_as_stored_with_a_warning(
    real_checkpoint, tmp_path, engine_log
):
    """DeepSeek's fp8_cast_bf16.py leaves the quantization_config in config.json: the weights are
    read as stored (FP8 checkpoints themselves: tests/test_quantization.py)."""
    path = deepseek(real_checkpoint, "v3")
    fp8 = tmp_path / "fp8"
    shutil.copytree(path, fp8)
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"] = published("deepseek-v3")["quantization_config"]
    (fp8 / "config.json").write_text(json.dumps(config))
    prompts = prompts_of_lengths([3, 9], seed=2)
    greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    runs = [
        [o.outputs[0].token_ids for o in LLM(p, max_model_len=32, kv_cache_memory_bytes=1 << 20).generate(
            [{"prompt_token_ids": q} for q in prompts], greedy, use_tqdm=False)]
        for p in (str(fp8), path)
    ]  # fmt: skip
    assert runs[0] == runs[1]
    assert "says fp8, but no checkpoint tensor is e4m3" in engine_log.text


def test_unknown_topk_method_names_the_known_ones():
    from expertmesh.models.deepseek import DeepseekV2ForCausalLM

    with pytest.raises(ValueError, match=r"topk_method 'noaux_tc' is not known; known: \['greedy', 'group"):
        DeepseekV2ForCausalLM.family.router_for("noaux_tc")


@pytest.mark.timeout(90)
def test_moe_layer_freq_follows_deepseeks_rule(tokenizer_dir, tmp_path):
    """moe_layer_freq 2: MoE where layer >= first_k_dense_replace and layer % 2 == 0 (DeepSeek's
    rule; transformers' port ignores the key), dense MLPs elsewhere. The reference is transformers'
    own model with those layers' MLPs swapped for its dense DeepseekV2MLP."""
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2ForCausalLM, DeepseekV2MLP

    config = shrink(published("deepseek-v2-lite"), Sizes(layers=5), moe_layer_freq=2)
    (tmp_path / "config.json").write_text(json.dumps(config))
    torch.manual_seed(0)
    hf = DeepseekV2ForCausalLM._from_config(AutoConfig.from_pretrained(tmp_path)).float().eval()
    for i, layer in enumerate(hf.model.layers):
        if i >= config["first_k_dense_replace"] and i % 2:
            layer.mlp = DeepseekV2MLP(hf.config)
    randomize_small(hf, 0)
    hf.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tokenizer_dir}/{name}", tmp_path / name)
    llm = LLM(str(tmp_path), max_model_len=64, kv_cache_memory_bytes=1 << 20)
    moe = [layer.is_moe for layer in llm.llm_engine.runner.model.model.layers.values()]
    assert moe == [False, False, True, False, True]
    prompts = prompts_of_lengths([3, 14], seed=7)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
        use_tqdm=False,
    )
    hf.generation_config.eos_token_id = None
    for prompt, out in zip(prompts, outs, strict=True):
        with one_thread():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, pad_token_id=0)
        assert out.outputs[0].token_ids == ref[0, len(prompt) :].tolist()
