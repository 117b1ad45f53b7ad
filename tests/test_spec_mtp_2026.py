"""MTP speculative decoding for the 2026 families that publish MTP layers (spec_decode/mtp.py):
LongCat-Flash's `model.mtp.*` (vLLM's longcat_flash_mtp.py: one MLA block and one dense MLP, its
own embedding copy, `model.mtp.norm` after the residual, the target's lm_head) on a tiny checkpoint
built from the published config with those tensors: loaded strictly for method='mtp', greedy
tokens and logprobs equal decoding without speculation, and every first draft equals a reference
built on transformers' own LongCat modules. DeepSeek-V4's `mtp.0.*` (DeepSeek's MTPBlock over the
hyper-connection streams) the same way. The families still refused say why."""

import functools
import json
import os
import re
import shutil

import pytest
import torch
from checkpoints import prompts_of_lengths
from real_checkpoints import add_second_shard, published
from safetensors.torch import load_file, save_file
from test_real_families import FAMILIES as REAL
from test_spec_mtp import _assert_same, _generate

from expertmesh import LLM, SamplingParams

ENGINE = dict(max_model_len=256, kv_cache_memory_bytes=1 << 22, warmup=False)
LONGCAT_SCALE = -1.25  # the MTP block's tensors: the last layer's first sublayer's, times this
LONGCAT_SPEC = {"method": "longcat_flash_mtp", "num_speculative_tokens": 2, "disable_by_batch_size": 64}


def with_longcat_mtp(src: str, dst: str, seed: int = 0) -> str:
    """A copy of a LongCat-Flash checkpoint with the MTP tensors the published one carries
    (transformers drops them), under vLLM's longcat_flash_mtp.py names: the block (`model.mtp.
    layers.0.{input_layernorm, self_attn, post_attention_layernorm}` and `transformer_layer.mlp`) =
    the last layer's first attention sublayer and dense MLP times LONGCAT_SCALE; `eh_proj` over
    [embedding; hidden]; the `enorm.m` / `hnorm.m` norms and the final `model.mtp.norm`; its own
    embedding copy (a permutation of the target's rows times 0.5, so that embedding with the
    target's instead shows), in a second file listed by a safetensors index."""
    shutil.copytree(src, dst)
    config = json.load(open(os.path.join(dst, "config.json")))
    main = load_file(os.path.join(dst, "model.safetensors"))
    last = f"model.layers.{config['num_layers'] - 1}."
    hidden = config["hidden_size"]
    g = torch.Generator().manual_seed(seed)
    extra = {}
    for key, value in main.items():
        if not key.startswith(last):
            continue
        rest = key[len(last) :]
        for old, new in (
            ("input_layernorm.0.", "input_layernorm."),
            ("post_attention_layernorm.0.", "post_attention_layernorm."),
            ("self_attn.0.", "self_attn."),
            ("mlps.0.", "transformer_layer.mlp."),
        ):
            if rest.startswith(old):
                extra["model.mtp.layers.0." + new + rest[len(old) :]] = value * LONGCAT_SCALE
    extra["model.mtp.layers.0.eh_proj.weight"] = (
        torch.randn(hidden, 2 * hidden, generator=g) / (2 * hidden) ** 0.5
    )
    for name in ("model.mtp.layers.0.enorm.m", "model.mtp.layers.0.hnorm.m", "model.mtp.norm"):
        extra[f"{name}.weight"] = 1 + 0.3 * torch.randn(hidden, generator=g)
    embed = main["model.embed_tokens.weight"]
    extra["model.mtp.embed_tokens.weight"] = embed[torch.randperm(embed.shape[0], generator=g)] * 0.5
    add_second_shard(dst, main, extra)
    return dst


@functools.lru_cache(maxsize=2)
def _float_model(path: str):
    """transformers' model of `path` in float32 (loaded once per checkpoint: the references of
    several prompts and their mutations read it)."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _longcat_path(real_checkpoint, tmp_path) -> str:
    source, overrides = REAL["longcat-flash"]
    return with_longcat_mtp(real_checkpoint(source, **overrides), str(tmp_path / "longcat-mtp"))


def longcat_reference_drafts(
    path: str, prompt: list[int], first: int, k: int, swap: bool = False
) -> list[int]:
    """The first MTP drafts of a sequence (its prompt, then its first sampled token `first`) by
    vLLM's longcat_flash_mtp.py data flow on transformers' LongCat modules (float32): h =
    eh_proj([enorm(E_mtp(t[i+1])); hnorm(h_target[i])]); x = h + MLA(input_layernorm(h)) (causal,
    RoPE at the target positions); x = x + MLP(post_attention_layernorm(x)); out = norm(x); the
    target's lm_head; chained k times, each step's input the previous normed output and drafted
    token. `swap`: the concat order reversed (a mutation the engine must not match)."""
    from transformers.models.longcat_flash import modeling_longcat_flash as lc

    model = _float_model(path)
    cfg = model.config
    stored = load_file(os.path.join(path, "model-00002-of-00002.safetensors"))
    source = model.model.layers[cfg.num_layers - 1]
    attn = lc.LongcatFlashMLA(cfg, 2 * cfg.num_layers).eval()
    attn.load_state_dict({k: v * LONGCAT_SCALE for k, v in source.self_attn[0].state_dict().items()})
    mlp = lc.LongcatFlashMLP(cfg).eval()
    mlp.load_state_dict({k: v * LONGCAT_SCALE for k, v in source.mlps[0].state_dict().items()})
    norms = {}
    for name, key in (
        ("input", "model.mtp.layers.0.input_layernorm"),
        ("post", "model.mtp.layers.0.post_attention_layernorm"),
        ("e", "model.mtp.layers.0.enorm.m"),
        ("h", "model.mtp.layers.0.hnorm.m"),
        ("final", "model.mtp.norm"),
    ):
        norms[name] = lc.LongcatFlashRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        norms[name].weight.data.copy_(stored[f"{key}.weight"].float())
    eh, embed = (
        stored["model.mtp.layers.0.eh_proj.weight"].float(),
        stored["model.mtp.embed_tokens.weight"].float(),
    )
    with torch.no_grad():
        ids = torch.tensor(prompt + [first])
        hidden = model.model(input_ids=ids[None, :-1]).last_hidden_state[0]  # normed, positions 0..n-2
        tokens, drafts = ids[1:], []
        for _ in range(k):
            parts = [norms["e"](embed[tokens]), norms["h"](hidden)]
            x = torch.cat(parts[::-1] if swap else parts, dim=-1) @ eh.T
            n = x.shape[0]
            pos = torch.arange(n)[None]
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            rope = model.model.rotary_emb(x[None], pos)
            x = x + attn(norms["input"](x)[None], position_embeddings=rope, attention_mask=mask)[0][0]
            out = norms["final"](x + mlp(norms["post"](x)))
            drafts.append(int(model.lm_head(out[-1]).argmax()))
            tokens = torch.cat([tokens, torch.tensor(drafts[-1:])])
            hidden = torch.cat([hidden, out[-1:]])
    return drafts


def _plain_run(path: str) -> tuple[list, list, list]:
    """Four uneven greedy requests (one of a single token) decoded without speculation, which
    leaves the MTP layer unbuilt."""
    prompts = prompts_of_lengths([5, 9, 3, 14], seed=3)
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2) for n in (12, 1, 9, 14)
    ]
    plain_llm = LLM(path, **ENGINE)
    assert getattr(plain_llm.llm_engine.runner.model, "mtp", None) is None
    return prompts, params, _generate(plain_llm, prompts, params)


def _assert_drafts_are_the_reference(spec, path, prompts, params, plain, reference, what: str) -> None:
    """`spec`'s greedy tokens and logprobs equal `plain`'s; each sequence's first drafts (k = 2)
    equal `reference(path, prompt, first, 2)` and not the swapped-order mutation's (`swap=True`),
    checked until one prompt tells the two apart."""
    from test_spec_layouts import record_drafts

    drafts = record_drafts(spec)
    _assert_same(_generate(spec, prompts, params), plain, what)
    s = spec.llm_engine.stats()
    assert s["spec_decode_num_drafts"] > 0, s
    checked = swapped_differ = 0
    for prompt, out in zip(prompts, plain, strict=True):
        if len(out.outputs[0].token_ids) > 1:
            first = out.outputs[0].token_ids[0]
            want = reference(path, prompt, first, 2)
            assert drafts[tuple(prompt)][0] == want, (prompt, drafts[tuple(prompt)], want)
            if not swapped_differ:  # the mutation, until one prompt tells it apart
                swapped_differ += reference(path, prompt, first, 2, swap=True) != want
            checked += 1
    assert checked == 3 and swapped_differ > 0


@pytest.mark.timeout(240)
def test_longcat_mtp_equals_plain_decoding_and_its_reference(real_checkpoint, tmp_path):
    """LongCat-Flash's MTP layer loads strictly for method='mtp' (its vLLM alias) and is skipped by
    the family's named rule without; greedy tokens and logprobs equal decoding without speculation
    at k = 2 (chained drafts); each sequence's first drafts equal the transformers-built reference,
    and not the reference with the concat order swapped."""
    path = _longcat_path(real_checkpoint, tmp_path)
    prompts, params, plain = _plain_run(path)
    spec = LLM(path, **ENGINE, speculative_config=LONGCAT_SPEC)
    model = spec.llm_engine.runner.model
    mtp = model.mtp
    assert mtp.shared_head.head is model.lm_head and mtp.normed_output and not mtp.layer.is_moe
    stored = load_file(os.path.join(path, "model-00002-of-00002.safetensors"))
    eh = stored["model.mtp.layers.0.eh_proj.weight"]
    torch.testing.assert_close(mtp.eh_proj(torch.eye(eh.shape[1])).T, eh)
    torch.testing.assert_close(mtp.hnorm.weight, stored["model.mtp.layers.0.hnorm.m.weight"])
    torch.testing.assert_close(mtp.shared_head.norm.weight, stored["model.mtp.norm.weight"])
    torch.testing.assert_close(mtp.embed_tokens.weight, stored["model.mtp.embed_tokens.weight"])
    _assert_drafts_are_the_reference(spec, path, prompts, params, plain, longcat_reference_drafts, "longcat")


def test_longcat_mtp_missing_tensor_is_named(real_checkpoint, tmp_path):
    """A LongCat checkpoint missing one MTP tensor is refused for method='mtp', naming the parameter;
    it loads without speculation (the family's rule skips model.mtp.*)."""
    path = _longcat_path(real_checkpoint, tmp_path)
    stored = load_file(os.path.join(path, "model-00002-of-00002.safetensors"))
    del stored["model.mtp.layers.0.hnorm.m.weight"]
    save_file(stored, os.path.join(path, "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    index = json.loads(open(os.path.join(path, "model.safetensors.index.json")).read())
    del index["weight_map"]["model.mtp.layers.0.hnorm.m.weight"]
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump(index, f)
    with pytest.raises(Exception, match="mtp.hnorm.weight"):
        LLM(path, **ENGINE, speculative_config=LONGCAT_SPEC)


@pytest.mark.parametrize(
    "source, message",
    [
        (
            "2026/minimax-m2.5",
            "MiniMaxM2ForCausalLM model is not implemented yet: no public reference fixes its MTP modules",
        ),
        ("2026/nemotron-3-nano-30b-a3b", "NemotronHForCausalLM model has none"),
    ],
)
def test_mtp_refusals_say_why(tmp_path, source, message):
    """MiniMax-M2.5 ships 3 MTP modules that no public reference describes; Nemotron-3-Nano's
    published config declares none: both refused by name, with the reason, before any weight."""
    config = {k: v for k, v in published(source).items() if k != "quantization_config"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        LLM(str(tmp_path), speculative_config={"method": "mtp", "num_speculative_tokens": 1})


# ---- DeepSeek-V4: mtp.0.* over the hyper-connection streams -------------------------------------
V4_SCALE = 1.25  # the MTP block's tensors: the last layer's (its compressor dropped), times this
V4_SPEC = {"method": "deepseek_mtp", "num_speculative_tokens": 2, "disable_by_batch_size": 64}


def with_v4_mtp(src: str, dst: str, seed: int = 0) -> str:
    """A copy of a DeepSeek-V4 checkpoint whose second file holds the MTP layer as published
    (`mtp.0.*`, DeepSeek's MTPBlock names) in place of the DeepSeek-V3-shaped one the test writer
    adds: the block = the last layer's tensors times V4_SCALE without its compressor (the MTP
    layer is sliding-window only), e_proj / h_proj, enorm / hnorm, the final norm and the layer's
    own hc_head_fn / _base / _scale; no embedding or head copy."""
    shutil.copytree(src, dst)
    config = json.load(open(os.path.join(dst, "config.json")))
    index = json.load(open(os.path.join(dst, "model.safetensors.index.json")))
    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    main = load_file(os.path.join(dst, first))
    last = f"model.layers.{config['num_hidden_layers'] - 1}."
    hidden, hc = config["hidden_size"], config["hc_mult"]
    g = torch.Generator().manual_seed(seed)
    extra = {
        "mtp.0." + k[len(last) :]: v * V4_SCALE
        for k, v in main.items()
        if k.startswith(last) and ".compressor." not in k and ".indexer." not in k
    }
    for name in ("e_proj", "h_proj"):
        extra[f"mtp.0.{name}.weight"] = torch.randn(hidden, hidden, generator=g) / hidden**0.5
    for name in ("enorm", "hnorm", "norm"):
        extra[f"mtp.0.{name}.weight"] = 1 + 0.3 * torch.randn(hidden, generator=g)
    extra["mtp.0.hc_head_fn"] = torch.randn(hc, hc * hidden, generator=g) * 0.5
    extra["mtp.0.hc_head_base"] = torch.randn(hc, generator=g)
    extra["mtp.0.hc_head_scale"] = torch.rand(1, generator=g) + 0.5
    save_file(extra, os.path.join(dst, second), metadata={"format": "pt"})
    weight_map = {k: f for k, f in index["weight_map"].items() if f == first} | {k: second for k in extra}
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return dst


def _v4_path(real_checkpoint, tmp_path) -> str:
    from test_deepseek_v4 import OVERRIDES, SOURCE

    return with_v4_mtp(real_checkpoint(SOURCE, **OVERRIDES), str(tmp_path / "v4-mtp"))


def v4_reference_drafts(path: str, prompt: list[int], first: int, k: int, swap: bool = False) -> list[int]:
    """The first MTP drafts of a sequence by DeepSeek's MTPBlock data flow on transformers' V4
    modules (float32): S = the target's streams before its hc_head (captured there), e =
    enorm(embed(t[i+1])), x = e_proj(e)[:, None] + h_proj(hnorm(S[i])); a DeepseekV4DecoderLayer
    at index num_hidden_layers (sliding attention, score-routed MoE) with the MTP tensors; logits =
    lm_head(norm(hc_head(x))) with the layer's own hc_head; chained k times on the layer's output
    streams. `swap`: e_proj and h_proj exchanged (a mutation the engine must not match)."""
    import copy

    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as v4

    model = _float_model(path)
    cfg = model.config
    n = cfg.num_hidden_layers
    stored = load_file(os.path.join(path, "model-00002-of-00002.safetensors"))
    layer_cfg = copy.deepcopy(cfg)
    layer_cfg.layer_types = [*cfg.layer_types[:n], "sliding_attention"]
    layer_cfg.mlp_layer_types = [*cfg.mlp_layer_types[:n], "moe"]
    layer_cfg.num_hidden_layers = n + 1
    layer = v4.DeepseekV4DecoderLayer(layer_cfg, n).eval()
    source = model.model.layers[n - 1].state_dict()
    kept = {k: v * V4_SCALE for k, v in source.items() if "compressor" not in k and "indexer" not in k}
    layer.load_state_dict(kept)
    norms = {}
    for name in ("enorm", "hnorm", "norm"):
        norms[name] = v4.DeepseekV4RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        norms[name].weight.data.copy_(stored[f"mtp.0.{name}.weight"])
    head = v4.DeepseekV4HyperHead(cfg)
    for name in ("fn", "base", "scale"):
        getattr(head, f"hc_{name}").data.copy_(stored[f"mtp.0.hc_head_{name}"])
    e_proj, h_proj = stored["mtp.0.e_proj.weight"], stored["mtp.0.h_proj.weight"]
    if swap:
        e_proj, h_proj = h_proj, e_proj
    captured = []
    hook = model.model.hc_head.register_forward_pre_hook(lambda mod, args: captured.append(args[0][0]))
    with torch.no_grad():
        ids = torch.tensor(prompt + [first])
        model.model(input_ids=ids[None, :-1])
        hook.remove()
        streams = captured[0]  # [positions 0..n-2, hc, D]
        tokens, drafts = ids[1:], []
        for _ in range(k):
            e = norms["enorm"](model.model.embed_tokens(tokens)) @ e_proj.T
            x = (norms["hnorm"](streams) @ h_proj.T + e[:, None]).contiguous()
            m = x.shape[0]
            pos = torch.arange(m)[None]
            mask = torch.full((m, m), float("-inf")).triu(1)
            window = torch.ones(m, m, dtype=torch.bool).tril(-cfg.sliding_window)
            mask = mask.masked_fill(window, float("-inf"))[None, None]
            rope = {kind: model.model.rotary_emb(x[None, :, 0], position_ids=pos, layer_type=kind)
                    for kind in ("main", "compress")}  # fmt: skip
            out = layer(x[None], position_embeddings=rope, position_ids=pos, attention_mask=mask,
                        input_ids=tokens[None])[0]  # fmt: skip
            drafts.append(int(model.lm_head(norms["norm"](head(out[None]))[0, -1]).argmax()))
            tokens = torch.cat([tokens, torch.tensor(drafts[-1:])])
            streams = torch.cat([streams, out[-1:]])
    return drafts


@pytest.mark.timeout(240)
def test_v4_mtp_equals_plain_decoding_and_its_reference(real_checkpoint, tmp_path):
    """DeepSeek-V4's MTP layer (mtp.0.*) loads strictly for method='mtp' and is skipped by the
    family's rule without; greedy tokens and logprobs equal decoding without speculation at k = 2
    (chained on the output streams); each sequence's first drafts equal the transformers-built
    reference of DeepSeek's MTPBlock, and not the one with e_proj and h_proj exchanged."""
    path = _v4_path(real_checkpoint, tmp_path)
    prompts, params, plain = _plain_run(path)
    spec = LLM(path, **ENGINE, speculative_config=V4_SPEC)
    model = spec.llm_engine.runner.model
    mtp = model.mtp
    assert mtp.head is model.lm_head and mtp.layer.attn.compressor is None and mtp.layer.attn.indexer is None
    stored = load_file(os.path.join(path, "model-00002-of-00002.safetensors"))
    eye = torch.eye(stored["mtp.0.e_proj.weight"].shape[1])
    torch.testing.assert_close(mtp.e_proj(eye).T, stored["mtp.0.e_proj.weight"])
    torch.testing.assert_close(mtp.hc_head.hc_fn, stored["mtp.0.hc_head_fn"])
    torch.testing.assert_close(mtp.shared_head.norm.weight, stored["mtp.0.norm.weight"])
    _assert_drafts_are_the_reference(spec, path, prompts, params, plain, v4_reference_drafts, "deepseek-v4")


@pytest.mark.timeout(240)
def test_v4_mtp_in_the_published_fp8_and_fp4_formats(real_checkpoint, tmp_path):
    """The V4 checkpoint with its MTP layer written in the published formats (attention, shared
    expert, e_proj and h_proj in block FP8 with e8m0 `X.scale`, routed experts FP4, published
    names): greedy tokens equal decoding without speculation, and every draft equals the drafts of
    the same weights dequantized to float32 (test_published_formats' reference writer)."""
    from quantized_checkpoints import to_block_fp8
    from test_deepseek_v4 import published_names
    from test_published_formats import V4_FP4, V4_FP8
    from test_spec_layouts import record_drafts

    src = published_names(_v4_path(real_checkpoint, tmp_path), tmp_path / "published")
    fp8 = re.compile(V4_FP8.pattern + r"|^mtp\.0\.[eh]_proj\.weight$")
    config = published("2026/deepseek-v4-flash")["quantization_config"]
    path = to_block_fp8(
        src, str(tmp_path / "fp8"), str(tmp_path / "ref"), config,
        lambda k, t: fp8.search(k) is not None, torch.float8_e8m0fnu, ".scale",
        fp4=lambda k, t: V4_FP4.search(k) is not None,
    )  # fmt: skip
    stored = load_file(os.path.join(path, "model-00002-of-00002.safetensors"))
    assert stored["mtp.0.e_proj.weight"].dtype == torch.float8_e4m3fn and "mtp.0.e_proj.scale" in stored
    assert stored["mtp.0.ffn.experts.0.w1.weight"].dtype == torch.int8
    prompts = prompts_of_lengths([5, 9, 3, 14], seed=3)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (12, 1, 9, 14)]
    plain = _generate(LLM(path, **ENGINE), prompts, params)
    runs = {}
    for name, p in (("fp8", path), ("ref", str(tmp_path / "ref"))):
        spec = LLM(p, **ENGINE, speculative_config=V4_SPEC)
        drafts = record_drafts(spec)
        runs[name] = (_generate(spec, prompts, params), drafts)
    _assert_same(runs["fp8"][0], plain, "deepseek-v4 fp8")
    assert runs["fp8"][1] == runs["ref"][1] and any(runs["fp8"][1].values())
