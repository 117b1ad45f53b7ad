"""MTP speculative decoding (spec_decode/mtp.py) on tiny DeepSeek-V3 and GLM-4.5-Air checkpoints
built from the published configs with their MTP tensors (real_checkpoints.add_mtp_layers): the MTP
layer loads strictly (only for method='mtp'); its incremental forward equals one pass; greedy
speculative output is token-identical to decoding without speculation; an MTP layer made to
predict what the target predicts is fully accepted; a model without MTP layers is refused with the
names. The layouts (DP, PP, EP) are tested in test_spec_layouts.py."""

import json
import os
import shutil

import pytest
import torch
from checkpoints import prompts_of_lengths
from expect import assert_tokens_equal
from real_checkpoints import Sizes, add_second_shard, published
from safetensors.torch import load_file, save_file

from expertmesh import LLM, SamplingParams

# The families whose MTP layer is built, each at the sizes of its other tests.
FAMILIES = {"deepseek-v3": Sizes(layers=5, experts=32, max_top_k=8), "glm-4.5-air": None}
# MLA with DeepSeek Sparse Attention's indexer (the MTP layer caches the index keys too).
DSA_FAMILIES = {"2026/deepseek-v3.2": None, "2026/glm-5": None}
ALL_FAMILIES = {**FAMILIES, **DSA_FAMILIES}
ENGINE = dict(max_model_len=256, kv_cache_memory_bytes=1 << 22, warmup=False)
MTP = {"method": "deepseek_mtp", "num_speculative_tokens": 1, "disable_by_batch_size": 64}


def _path(real_checkpoint, family: str) -> str:
    return real_checkpoint(family, sizes=ALL_FAMILIES[family])


def _generate(llm: LLM, prompts: list[list[int]], params) -> list:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    llm.llm_engine.check_invariants()
    assert llm.llm_engine.blocks.num_free == llm.llm_engine.blocks.num_blocks
    return outs


def _assert_same(spec_outs, plain_outs, what: str) -> None:
    for i, (a, b) in enumerate(zip(spec_outs, plain_outs, strict=True)):
        x, y = a.outputs[0], b.outputs[0]
        assert_tokens_equal(x.token_ids, y.token_ids, f"{what} request {i}")
        assert x.finish_reason == y.finish_reason, i
        for u, v in zip(x.logprobs or [], y.logprobs or [], strict=True):
            assert u.keys() == v.keys() and all(abs(u[t].logprob - v[t].logprob) < 1e-4 for t in u), i


@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_greedy_mtp_equals_plain_decoding(real_checkpoint, family):
    """Random MTP weights: few drafts are accepted, so both paths (accept, reject + roll back) run;
    an uneven batch, max_tokens 1 (nothing to verify) and k = 1 and 2 (chained)."""
    path = _path(real_checkpoint, family)
    prompts = prompts_of_lengths([5, 9, 3, 14], seed=3)
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2) for n in (24, 1, 17, 30)
    ]
    plain = _generate(LLM(path, **ENGINE), prompts, params)
    for k in (1, 2):
        spec = LLM(path, **ENGINE, speculative_config={**MTP, "num_speculative_tokens": k})
        _assert_same(_generate(spec, prompts, params), plain, f"k={k}")
        s = spec.llm_engine.stats()
        assert s["spec_decode_num_drafts"] > 0, s


def _consistent(outputs: list[list[int]], shortest: int = 4) -> tuple[dict[int, int], dict[int, int]]:
    """{output index: length} of the output prefixes (at least `shortest` tokens) in which each token
    has one successor, and that successor map: one-to-one over all of them, so that a head can
    predict every next token of those prefixes from the current one alone."""
    chosen, successor = {}, {}
    for i, tokens in enumerate(outputs):
        merged, n = dict(successor), 1
        while n < len(tokens):
            u, v = tokens[n - 1], tokens[n]
            if merged.get(u, v) != v or (u not in merged and v in merged.values()):
                break
            merged[u], n = v, n + 1
        if n >= shortest:
            # The last token's successor is never drafted (max_tokens ends the output there).
            chosen[i], successor = n, merged
    return chosen, successor


def _with_successor_head(src: str, dst: str, successor: dict[int, int]) -> str:
    """A copy of checkpoint `src` whose MTP layer predicts successor[t] from the token t it embeds:
    eh_proj = [I | 0] keeps enorm(embed(t)) and drops the hidden state (so a swapped concat order would
    draft from the hidden state and miss), the decoder layer adds nothing (o_proj and every down_proj
    zero), unit norms, and head row successor[u] = embed(u) / |embed(u)| (the logit is then the cosine
    of embed(t) and embed(u), highest at u = t)."""

    shutil.copytree(src, dst)
    file = os.path.join(dst, "model-00002-of-00002.safetensors")
    mtp = load_file(file)
    embed = load_file(os.path.join(dst, "model-00001-of-00002.safetensors"))["model.embed_tokens.weight"]
    n = int(json.load(open(os.path.join(dst, "config.json")))["num_hidden_layers"])
    p = f"model.layers.{n}."
    hidden = embed.shape[1]
    for key, value in mtp.items():
        if key.endswith(("o_proj.weight", "down_proj.weight")):
            mtp[key] = torch.zeros_like(value)
        if key.endswith("norm.weight") and key.startswith((p + "enorm", p + "hnorm", p + "shared_head")):
            mtp[key] = torch.ones_like(value)
    mtp[p + "eh_proj.weight"] = torch.cat([torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
    head = torch.zeros_like(embed)
    for u, v in successor.items():
        head[v] = embed[u] / embed[u].norm()
    mtp[p + "shared_head.head.weight"] = head
    save_file(mtp, file, metadata={"format": "pt"})
    return dst


@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", FAMILIES)
def test_mtp_layer_that_predicts_the_target_is_accepted(real_checkpoint, tmp_path, family):
    """Outputs of the tiny target in which each token has one successor: an MTP layer built to predict
    that successor from the embedded token drafts every token right (chained too, k = 2), verification
    accepts all of them, fewer steps run, and the output stays the target's."""
    path = _path(real_checkpoint, family)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain_llm = LLM(path, **ENGINE)
    candidates = prompts_of_lengths([4, 6, 8, 10, 12, 5, 7, 9], seed=5)
    outputs = [list(o.outputs[0].token_ids) for o in _generate(plain_llm, candidates, params)]
    chosen, successor = _consistent(outputs)
    assert len(chosen) >= 2, outputs
    prompts = [candidates[i] for i in chosen]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in chosen.values()]
    before = plain_llm.llm_engine.stats()["steps"]
    plain = _generate(plain_llm, prompts, params)
    plain_steps = plain_llm.llm_engine.stats()["steps"] - before
    synthetic = _with_successor_head(path, str(tmp_path / "synthetic"), successor)
    for k in (1, 2):
        spec = LLM(synthetic, **ENGINE, speculative_config={**MTP, "num_speculative_tokens": k})
        _assert_same(_generate(spec, prompts, params), plain, f"synthetic k={k}")
        s = spec.llm_engine.stats()
        assert s["spec_decode_num_accepted_tokens"] == s["spec_decode_num_draft_tokens"] > 0, s
        assert s["steps"] < plain_steps, s


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_mtp_layer_loads_only_for_method_mtp_and_strictly(real_checkpoint, tmp_path, family):
    """Without method='mtp' the MTP tensors are skipped (no `mtp` module); with it, every MTP tensor
    fills a parameter, and a checkpoint missing one of them is refused naming the parameter."""
    path = _path(real_checkpoint, family)
    assert getattr(LLM(path, **ENGINE).llm_engine.runner.model, "mtp", None) is None
    engine = LLM(path, **ENGINE, speculative_config=MTP).llm_engine
    model = engine.runner.model
    # The target's MoE layers only in the expert load statistics (the MTP layer's is not counted).
    assert [m.layer_index for m in engine.expert_load.moes] == [
        i for i, layer in model.model.layers.items() if layer.is_moe for i in [int(i)]
    ]
    n = json.load(open(os.path.join(path, "config.json")))["num_hidden_layers"]
    stored = load_file(os.path.join(path, "model-00002-of-00002.safetensors"))
    eh = stored[f"model.layers.{n}.eh_proj.weight"]
    torch.testing.assert_close(model.mtp.eh_proj(torch.eye(eh.shape[1])).T, eh)  # [H, 2H] as stored
    torch.testing.assert_close(model.mtp.enorm.weight, stored[f"model.layers.{n}.enorm.weight"])
    broken = tmp_path / "broken"
    shutil.copytree(path, broken)
    del stored[f"model.layers.{n}.hnorm.weight"]
    save_file(stored, str(broken / "model-00002-of-00002.safetensors"), metadata={"format": "pt"})
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    del index["weight_map"][f"model.layers.{n}.hnorm.weight"]
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(Exception, match="mtp.hnorm.weight"):
        LLM(str(broken), **ENGINE, speculative_config=MTP)


def test_mtp_refusals_name_the_model(tmp_path):
    """No MTP layers: names the method and the architecture; a family whose MTP layer is not built:
    names it and the families that are."""
    with pytest.raises(ValueError, match="method='mtp'.*PhimoeForCausalLM model has none"):
        LLM(speculative_config=MTP, warmup=False)
    config = {k: v for k, v in published("2026/minimax-m2.5").items() if k != "quantization_config"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="MiniMaxM2ForCausalLM model is not implemented yet"):
        LLM(str(tmp_path), speculative_config=MTP)


@pytest.mark.parametrize("family", ALL_FAMILIES)
def test_mtp_layer_incremental_chunks_equal_one_pass(real_checkpoint, family):
    """The drafter computes only the MTP positions added since its last step over the cached ones: in
    chunks of 5, 1, 3 and 3 positions, the outputs equal one pass over all 12 (and a later chunk's
    attention really reads the cached rows: zeroing them changes its output)."""
    from types import SimpleNamespace

    model = LLM(_path(real_checkpoint, family), **ENGINE, speculative_config=MTP).llm_engine.runner.model
    mtp, inner, bs = model.mtp, model.model, 4
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.cfg.vocab_size, (12,), generator=g)
    hidden = torch.randn(12, model.cfg.hidden_size, generator=g).to(model.cfg.dtype)
    one = SimpleNamespace()
    whole = mtp(
        inner.embed_tokens, inner.rotary, ids, hidden, 0, mtp.cache_for(one, 12, bs, hidden.dtype), bs
    )
    seq, parts, start = SimpleNamespace(), [], 0
    for size in (5, 1, 3, 3):
        cache = mtp.cache_for(seq, start + size, bs, hidden.dtype)  # grows (and copies) on the way
        end = start + size
        parts.append(
            mtp(inner.embed_tokens, inner.rotary, ids[start:end], hidden[start:end], start, cache, bs)
        )
        start = end
    torch.testing.assert_close(torch.cat(parts), whole, rtol=2e-2, atol=2e-2)
    for tensor in seq.mtp_kv:
        tensor.zero_()
    later = mtp(inner.embed_tokens, inner.rotary, ids[9:], hidden[9:], 9, seq.mtp_kv, bs)
    assert not torch.allclose(later, whole[9:], rtol=2e-2, atol=2e-2)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", FAMILIES)
def test_mtp_with_preemption_and_prefix_cache_hits(real_checkpoint, family):
    """A small KV cache: sequences are preempted mid-output and recomputed (their kept hidden states
    and MTP rows are rewritten); then prompts extending earlier prompts + outputs hit the prefix
    cache (the cached blocks bring their hidden states). Output equals decoding without speculation
    throughout."""
    path = _path(real_checkpoint, family)
    plain = LLM(path, **ENGINE, enable_prefix_caching=False)
    # A block of the MTP engine also holds its tokens' hidden states (the runner's HiddenStore).
    per_block = LLM(path, **ENGINE, speculative_config=MTP).llm_engine.runner.block_bytes()
    assert per_block > plain.llm_engine.runner.block_bytes()
    tight = dict(ENGINE, kv_cache_memory_bytes=12 * per_block, max_num_seqs=8)
    spec = LLM(path, **tight, speculative_config=MTP)
    prompts = prompts_of_lengths([6, 11, 4, 9, 7, 5], seed=30)
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    first = _generate(spec, prompts, sp)
    _assert_same(first, _generate(plain, prompts, sp), "preempted")
    s = spec.llm_engine.stats()
    assert s["preemptions"] > 0 and s["spec_decode_num_drafts"] > 0, s
    cut = [25, 20, 28, 17, 30, 22]
    longer = [p + list(o.outputs[0].token_ids[:m]) for p, o, m in zip(prompts, first, cut, strict=True)]
    again = _generate(spec, longer, sp)
    _assert_same(again, _generate(plain, longer, sp), "cached")
    assert sum(o.num_cached_tokens for o in again) >= 16, [o.num_cached_tokens for o in again]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", FAMILIES)
def test_mtp_drafts_after_a_prefix_cache_hit(real_checkpoint, family):
    """A prompt whose first blocks an earlier prompt left in the prefix cache drafts from its first
    decode step on, reading the hidden states the cached blocks keep: the hidden states its first
    draft reads and its drafts, step by step, equal those of an engine without prefix caching
    (which computed every position), and its tokens equal decoding without speculation."""
    from test_spec_layouts import record_drafts

    def first_read(llm: LLM) -> list:
        """The hidden rows of positions 0.. that the MTP layer reads first (its catch-up)."""
        store, rows = llm.llm_engine.runner.hidden, []
        read = store.read

        def recording(seq, start, end):
            out = read(seq, start, end)
            if start == 0 and not rows:
                rows.append(out)
            return out

        store.read = recording
        return rows

    path = _path(real_checkpoint, family)
    base, tail = prompts_of_lengths([40, 7], seed=9)
    prompt = base + tail
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    cached = LLM(path, **ENGINE, speculative_config=MTP)
    _generate(cached, [base], sp)
    drafts, rows = record_drafts(cached), first_read(cached)
    hit = _generate(cached, [prompt], sp)
    assert hit[0].num_cached_tokens == 32, hit[0].num_cached_tokens
    fresh = LLM(path, **ENGINE, speculative_config=MTP, enable_prefix_caching=False)
    expected, expected_rows = record_drafts(fresh), first_read(fresh)
    _assert_same(_generate(fresh, [prompt], sp), hit, "fresh")
    assert rows[0].shape[0] == expected_rows[0].shape[0] == len(prompt)
    torch.testing.assert_close(rows[0], expected_rows[0], rtol=1e-4, atol=1e-4)
    assert drafts[tuple(prompt)] == expected[tuple(prompt)]
    assert len(drafts[tuple(prompt)]) >= 2, drafts
    _assert_same(hit, _generate(LLM(path, **ENGINE), [prompt], sp), "plain")


@pytest.mark.timeout(240)
def test_mtp_sampled_runs_reproduce_and_warmup_works(real_checkpoint):
    """Sampling with MTP drafts (the rejection sampler: greedy drafts are one-hot proposals): a seeded
    request gives the same tokens on a second engine; the engine warms up with MTP on."""
    path = _path(real_checkpoint, "deepseek-v3")
    prompts = prompts_of_lengths([7, 12], seed=8)
    sp = [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24, seed=s, ignore_eos=True) for s in (1, 2)]
    warm = LLM(path, **{**ENGINE, "warmup": True}, speculative_config=MTP)
    a = _generate(warm, prompts, sp)
    assert warm.llm_engine.stats()["spec_decode_num_drafts"] > 0
    b = _generate(LLM(path, **ENGINE, speculative_config=MTP), prompts, sp)
    for x, y in zip(a, b, strict=True):
        assert list(x.outputs[0].token_ids) == list(y.outputs[0].token_ids)
        assert len(x.outputs[0].token_ids) == 24


def _tp_rank(rank, world, path, prompts, lens, ep):
    llm = LLM(path, tensor_parallel_size=world, enable_expert_parallel=ep, speculative_config=MTP,
              distributed_executor_backend="external_launcher", **ENGINE)  # fmt: skip
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
    outs = _generate(llm, prompts, params)
    stats = {k: v for k, v in llm.llm_engine.stats().items() if k.startswith("spec_decode")}
    return [list(o.outputs[0].token_ids) for o in outs], stats


@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", FAMILIES)
def test_mtp_under_tensor_parallel(real_checkpoint, family):
    """TP2 (the MTP layer sliced per rank like the target's), with and without EP over the TP ranks:
    greedy output on every rank equals one process without speculation, and both ranks count the
    same drafts (they take rank 0's)."""
    from distributed_utils import run_distributed

    path = _path(real_checkpoint, family)
    prompts, lens = prompts_of_lengths([5, 9, 3], seed=3), [20, 12, 16]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lens]
    expected = [list(o.outputs[0].token_ids) for o in _generate(LLM(path, **ENGINE), prompts, params)]
    for ep in (False, True):
        per_rank = run_distributed(_tp_rank, 2, path, prompts, lens, ep, timeout=200)
        for rank, (tokens, stats) in enumerate(per_rank):
            assert tokens == expected, (ep, rank)
            assert stats == per_rank[0][1] and stats["spec_decode_num_drafts"] > 0, (ep, rank, stats)


# ---- Qwen3-Next / Qwen3.5: the hybrids' MTP layer (mtp.*) ---------------------------------------
QWEN_SCALE = -1.25  # the MTP layer's tensors: the last full-attention layer's, times this


def _full_attention_layers(text: dict) -> list[int]:
    kinds = text.get("layer_types") or [
        "full_attention" if (i + 1) % text["full_attention_interval"] == 0 else "linear_attention"
        for i in range(text["num_hidden_layers"])
    ]
    return [i for i, kind in enumerate(kinds) if kind == "full_attention"]


def with_qwen_mtp(src: str, dst: str, seed: int = 0) -> str:
    """A copy of a Qwen3-Next / Qwen3.5 checkpoint with the MTP tensors the published ones carry
    (transformers drops them): `mtp.layers.0.*` = the last full-attention layer's tensors times
    QWEN_SCALE (elementwise, so transformers' fused in-memory experts scale alike), `mtp.fc` over
    [embedding; hidden], the two pre-fc norms and the final norm (Qwen's (1 + w) norms), in a second
    file listed by a safetensors index."""
    shutil.copytree(src, dst)
    config = json.load(open(os.path.join(dst, "config.json")))
    text = config.get("text_config", config)
    main = load_file(os.path.join(dst, "model.safetensors"))
    prefix = next(
        p for p in ("model.language_model.", "model.") if f"{p}layers.0.input_layernorm.weight" in main
    )
    last = f"{prefix}layers.{_full_attention_layers(text)[-1]}."
    hidden = text["hidden_size"]
    g = torch.Generator().manual_seed(seed)
    extra = {"mtp.layers.0." + k[len(last) :]: v * QWEN_SCALE for k, v in main.items() if k.startswith(last)}
    extra["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden, generator=g) / (2 * hidden) ** 0.5
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        extra[f"mtp.{name}.weight"] = torch.randn(hidden, generator=g)  # (1 + w): far from a plain RMSNorm
    add_second_shard(dst, main, extra)
    return dst


def _qwen_mtp_path(real_checkpoint, tmp_path, family: str) -> str:
    from test_hybrid_families import _source

    return with_qwen_mtp(real_checkpoint(_source(family)), str(tmp_path / f"{family}-mtp"))


def _qwen_reference_drafts(path: str, prompt: list[int], first: int, k: int) -> list[int]:
    """The first MTP draft of a sequence (its prompt and first sampled token `first`) by vLLM's
    qwen3_next_mtp.py data flow on transformers' own modules: h = fc([pre_fc_norm_embedding(
    embed(t[i+1])); pre_fc_norm_hidden(h_target[i])]), a full-attention decoder layer (causal,
    RoPE at the target positions), norm, the target's lm_head; chained k times, each step's input
    the previous step's normed output and drafted token."""
    import copy

    import transformers
    from transformers.models.qwen3_next import modeling_qwen3_next as q

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    cfg = model.config
    stored = load_file(os.path.join(path, "model-00002-of-00002.safetensors"))
    layer_cfg = copy.deepcopy(cfg)
    layer_cfg.layer_types = [*cfg.layer_types, "full_attention"]
    layer_cfg.num_hidden_layers += 1
    layer = q.Qwen3NextDecoderLayer(layer_cfg, cfg.num_hidden_layers).eval()
    source = model.model.layers[_full_attention_layers(cfg.to_dict())[-1]]
    layer.load_state_dict({k: v * QWEN_SCALE for k, v in source.state_dict().items()})
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = q.Qwen3NextRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        norms[name].weight.data.copy_(stored[f"mtp.{name}.weight"])
    fc = stored["mtp.fc.weight"]
    with torch.no_grad():
        ids = torch.tensor(prompt + [first])
        hidden = model.model(input_ids=ids[None, :-1]).last_hidden_state[0]  # normed, positions 0..n-2
        tokens, drafts = ids[1:], []
        for _ in range(k):
            x = torch.cat([norms["pre_fc_norm_embedding"](model.model.embed_tokens(tokens)),
                           norms["pre_fc_norm_hidden"](hidden)], dim=-1) @ fc.T  # fmt: skip
            n = x.shape[0]
            pos = torch.arange(n)[None]
            mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
            out = layer(x[None], model.model.rotary_emb(x[None], pos), attention_mask=mask, position_ids=pos)
            out = norms["norm"](out[0] if isinstance(out, tuple) else out)[0]
            drafts.append(int(model.lm_head(out[-1]).argmax()))
            tokens = torch.cat([tokens, torch.tensor(drafts[-1:])])
            hidden = torch.cat([hidden, out[-1:]])
    return drafts


@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", ["qwen3-next", "qwen3.5-moe"])
def test_qwen_mtp_equals_plain_decoding_and_its_reference(real_checkpoint, tmp_path, family):
    """The hybrids' MTP layer (`mtp.*`, mapped onto the MTP layer DeepSeek's checkpoints store as
    model.layers.{n}.*; the target's lm_head): loaded strictly for method='mtp' (qwen3_next_mtp,
    vLLM's alias), skipped by its named rule without; greedy tokens and logprobs equal decoding
    without speculation at k = 2 (chained drafts, the recurrent state rolled back); and (Qwen3-Next)
    each sequence's first drafts equal the reference computed on transformers' modules."""
    from test_spec_layouts import record_drafts

    path = _qwen_mtp_path(real_checkpoint, tmp_path, family)
    prompts = prompts_of_lengths([5, 9, 3, 14], seed=3)
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=2) for n in (12, 1, 9, 14)
    ]
    plain_llm = LLM(path, **ENGINE)
    assert getattr(plain_llm.llm_engine.runner.model, "mtp", None) is None
    plain = _generate(plain_llm, prompts, params)
    spec = LLM(path, **ENGINE, speculative_config={"method": "qwen3_next_mtp", "num_speculative_tokens": 2,
                                                   "disable_by_batch_size": 64})  # fmt: skip
    model = spec.llm_engine.runner.model
    assert model.mtp.shared_head.head is model.lm_head and model.mtp.normed_output
    stored = load_file(os.path.join(path, "model-00002-of-00002.safetensors"))
    fc = stored["mtp.fc.weight"]
    torch.testing.assert_close(model.mtp.eh_proj(torch.eye(fc.shape[1])).T, fc)
    torch.testing.assert_close(model.mtp.hnorm.weight, stored["mtp.pre_fc_norm_hidden.weight"])
    drafts = record_drafts(spec)
    _assert_same(_generate(spec, prompts, params), plain, family)
    s = spec.llm_engine.stats()
    assert s["spec_decode_num_drafts"] > 0, s
    if family == "qwen3-next":  # transformers' Qwen3.5 is a vision-language wrapper: one family suffices
        checked = 0
        for prompt, out in zip(prompts, plain, strict=True):
            if len(out.outputs[0].token_ids) > 1:
                want = _qwen_reference_drafts(path, prompt, out.outputs[0].token_ids[0], 2)
                assert drafts[tuple(prompt)][0] == want, (prompt, drafts[tuple(prompt)], want)
                checked += 1
        assert checked == 3
