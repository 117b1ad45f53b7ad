"""DeepSeek-V4-Flash (deepseek_v4) from its published config shrunk with every flag kept: 4 layers
whose attention kinds follow the published compress_ratios (sliding, sliding, compressed sparse,
heavily compressed), the first 3 hash-routed (num_hash_layers), hc_mult 4 with 20 Sinkhorn
iterations, 8 output groups, sqrt(softplus) routing, swiglu_limit 10, YaRN on the compressed
layers. Sizes shrunk so that everything happens inside the test prompts: a window of 32, entries
of 4 (CSA) and 16 (HCA) tokens, index_topk 12 (the 150-token prompt has 37 entries to choose from).

The reference is transformers' DeepseekV4ForCausalLM on the same tensors (teacher forced); its own
generate() agrees with it. Chunked prefill with prefix caching, TP2, DP2 x EP alltoall and
DP2 x TP2 naive, PP2 and PP2 x TP2 (the stages hand each other the 4-stream residual) give the
one-process tokens.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from distributed_utils import run_distributed
from expect import kernels_disabled
from layout_cases import rank_main
from safetensors.torch import load_file, save_file
from test_chunked_prefill import assert_same, generate
from test_real_families import assert_bf16_bound, hf_logprobs, logprob_errors

from expertmesh import LLM, SamplingParams
from expertmesh.layers.compressor import Indexer

SOURCE = "2026/deepseek-v4-flash"
# The published HCA rate (128) and output rank (1024) shrunk below the prompts / widths; the head
# to 32 (shrink keeps the published q width : hidden, 8, which would make it 128); the one shared
# K=V head kept (shrink's GQA rule would make it 2; neither transformers nor we read it).
OVERRIDES = dict(
    num_key_value_heads=1,
    o_lora_rank=16,
    head_dim=32,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
)
# Across the window (32), entry boundaries (4, 16) and the indexer's top-k (12 entries = 48 tokens)
LENGTHS = [1, 3, 4, 5, 15, 16, 17, 31, 33, 47, 70, 150]
COMMON = dict(max_model_len=256, kv_cache_memory_bytes=1 << 23)


@pytest.fixture(scope="module")
def v4(real_checkpoint) -> str:
    return real_checkpoint(SOURCE, **OVERRIDES)


def _prompts(lengths=LENGTHS, seed: int = 3) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


def _run(llm: LLM, prompts, new_tokens: int = 12, logprobs: int = 20):
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=logprobs)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)


def _reference(path: str, dtype=torch.float32):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


@pytest.mark.timeout(120)
def test_deepseek_v4_equals_transformers(v4):
    """Greedy tokens and fp32 logprobs (top 20 at every step) equal transformers'; keeping every
    completed entry instead of the indexer's top 12 moves them by > 1e-3 (the selection is exercised)."""
    config = json.loads(Path(v4, "config.json").read_text())
    assert config["compress_ratios"][:4] == [0, 0, 4, 128] and config["num_hash_layers"] == 3
    assert config["hc_mult"] == 4 and config["scoring_func"] == "sqrtsoftplus" and config["index_topk"] == 12
    prompts = _prompts()
    llm = LLM(v4, **COMMON)
    outs = _run(llm, prompts)
    firsts = _run(llm, prompts, new_tokens=1, logprobs=512)  # the whole vocabulary at the first step
    model = _reference(v4)
    refs = []
    for prompt, out, first in zip(prompts, outs, firsts, strict=True):
        ref = hf_logprobs(model, prompt, out.outputs[0].token_ids)
        assert out.outputs[0].token_ids == ref.argmax(-1).tolist(), f"prompt of {len(prompt)} tokens"
        assert logprob_errors(out, ref).max() < 2e-4, f"prompt of {len(prompt)} tokens"
        assert len(first.outputs[0].logprobs[0]) == 512 and logprob_errors(first, ref[:1]).max() < 2e-4
        refs.append(ref)
    # transformers' own cached decoding (its compressor buffers and overlap state) agrees, up to
    # the end-of-sequence token where it stops
    for i in (-2, -1):
        with torch.no_grad():
            gen = model.generate(torch.tensor([prompts[i]]), max_new_tokens=12, do_sample=False)
        gen = gen[0, len(prompts[i]) :].tolist()
        assert len(gen) >= 3 and gen == outs[i].outputs[0].token_ids[: len(gen)]

    original = Indexer.select
    Indexer.select = lambda self, q, w, keys, visible: visible  # every completed entry kept
    try:
        dense = _run(LLM(v4, **COMMON), prompts[-1:])[0]
    finally:
        Indexer.select = original
    ref = refs[-1][: len(dense.outputs[0].logprobs)]
    if dense.outputs[0].token_ids == outs[-1].outputs[0].token_ids:
        assert logprob_errors(dense, ref).max() > 1e-3
    # (else the tokens differ already: the selection decides them)


@pytest.mark.timeout(120)
def test_deepseek_v4_bf16_close_to_transformers(v4):
    """bfloat16 end to end, past the window and the top-k: test_real_families' bound (our bf16
    logprobs no further from transformers' fp32 forward than its bf16 forward, plus 0.1)."""
    prompts = _prompts([70, 150])
    outs = _run(LLM(v4, dtype="bfloat16", **COMMON), prompts)
    fp32, bf16 = _reference(v4), _reference(v4, torch.bfloat16)
    for prompt, out in zip(prompts, outs, strict=True):
        assert_bf16_bound("deepseek-v4", prompt, out, fp32, bf16)


@pytest.mark.timeout(120)
def test_deepseek_v4_chunked_prefill_and_prefix_caching_equal_one_prefill(v4, monkeypatch):
    """Chunks of 21 tokens (not a multiple of any entry size), prefix caching on, and prompts that
    share a 64-token prefix (hits of whole 16-token blocks) give the tokens and logprobs (1e-4) of
    whole prefills without caching: compressed entries and index keys computed across chunk and
    hit boundaries are the ones one prefill computes. The uncached engine runs without our CPU
    kernels (decodes laid out in groups rather than one block-table array) and attends 7 queries
    at a time (blocks across the window and entry boundaries)."""
    from expertmesh.cpu import cpu_kernels
    from expertmesh.layers import compressed_attention

    shared = _prompts([64], seed=11)[0]
    tails = _prompts([1, 9, 30, 86], seed=12)
    prompts = _prompts([150, 5, 47]) + [shared + t for t in tails]
    cached = LLM(v4, max_num_batched_tokens=21, max_num_seqs=4, enable_prefix_caching=True, **COMMON)
    assert cached.llm_engine.runner.kernels is not None or kernels_disabled()
    with monkeypatch.context() as m:
        m.setattr(cpu_kernels, "load", lambda: None)
        whole = LLM(v4, enable_chunked_prefill=False, enable_prefix_caching=False, **COMMON)
    assert whole.llm_engine.runner.kernels is None
    first = generate(cached, prompts[:4])  # the shared prefix enters the cache with the first of them
    rest = generate(cached, prompts[4:])
    monkeypatch.setattr(compressed_attention, "QUERY_BLOCK", 7)
    assert_same(first + rest, generate(whole, prompts), "deepseek-v4 chunked + prefix cached")
    assert sum(o.num_cached_tokens for o in rest) >= 3 * 64
    assert cached.llm_engine.stats()["prefix_cache_hits"] >= 3 * 64


@pytest.mark.timeout(120)
def test_deepseek_v4_preempted_sequences_recompute_their_entries(v4):
    """9 cache blocks of 16 tokens for prompts of 5 + 45 + 70 tokens, each growing by 12: someone is
    preempted and recomputed (its rows, projections and entries written again); the tokens and
    logprobs equal an engine with room for all."""
    prompts = _prompts([5, 45, 70], seed=9)
    roomy = LLM(v4, **COMMON)
    block = roomy.llm_engine.runner.block_bytes()
    tight = LLM(v4, max_model_len=128, kv_cache_memory_bytes=9 * block, max_num_seqs=3)
    assert tight.llm_engine.blocks.num_blocks == 9
    assert_same(generate(tight, prompts, 12), generate(roomy, prompts, 12), "deepseek-v4 preempted")
    assert tight.llm_engine.stats()["preemptions"] > 0


@pytest.mark.timeout(120)
def test_deepseek_v4_ngram_speculation_equals_plain_decoding(v4):
    """n-gram drafts are decode rows of one sequence at consecutive positions: a draft token that
    completes a window writes its entry, read by the drafts after it; a rejected one is rewritten
    by the next step. The tokens equal plain greedy decoding, with drafts accepted and rejected."""
    g = torch.Generator().manual_seed(3)
    base = torch.randint(3, 512, (20,), generator=g).tolist()
    prompts = [base * 4, base * 3 + [7, 8], torch.randint(3, 512, (70,), generator=g).tolist()]
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    plain = _run(LLM(v4, **COMMON), prompts, new_tokens=24, logprobs=1)
    spec_llm = LLM(v4, speculative_config=ngram, **COMMON)
    spec = _run(spec_llm, prompts, new_tokens=24, logprobs=1)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    stats = spec_llm.llm_engine.stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]


def test_deepseek_v4_declares_its_blocks_and_cache_per_token(v4, engine_log):
    """Each layer's attention kind, cache kind and row width (K=V row; compressor projections,
    twice as wide with overlap, and entry; the indexer's), hash routers on the first three layers,
    the MTP layer skipped by its named rule."""
    llm = LLM(v4, **COMMON)
    runner = llm.llm_engine.runner
    layers = runner.model.model.layers
    d, di = 32, 16
    widths = {"sliding_attention": d, "compressed_sparse_attention": d + 4 * d + d + 4 * di + di}
    widths["heavily_compressed_attention"] = d + 2 * d + d
    kinds = []
    for i, layer in layers.items():
        attn = layer.attn
        kinds.append(attn.kind)
        assert attn.kv_spec.width == widths[attn.kind] and attn.kv_spec.heads == 1
        assert attn.kv_spec.kind == ("shared_kv" if attn.kind == "sliding_attention" else "compressed_kv")
        assert (attn.indexer is not None) == (attn.kind == "compressed_sparse_attention")
        assert getattr(layer.ffn.gate, "by_token", False) == (int(i) < 3)
    assert kinds == ["sliding_attention", "sliding_attention"] + [
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    ]
    assert runner.attn_layers == [layer.attn for layer in layers.values()]
    assert runner.bytes_per_token() == sum(widths[k] for k in kinds) * 4  # float32
    line = runner.describe_kv()
    assert (
        "compressed_kv (2 layers, 272 / 128 values a layer)" in line
        and "shared_kv (2 layers, 32 values" in line
    )
    assert "by rule 'mtp layers" in engine_log.text


def published_names(path: str, out: Path) -> str:
    """A copy of a checkpoint saved by transformers with the published tensor names: no `model.`
    (embed.weight, layers.<i>.*, norm.weight, hc_head_fn / _base / _scale), the MTP layer as mtp.0.*
    (transformers' own conversion table for deepseek_v4 reads these)."""
    top = {
        "model.embed_tokens.weight": "embed.weight", "model.norm.weight": "norm.weight",
        "model.hc_head.hc_fn": "hc_head_fn", "model.hc_head.hc_base": "hc_head_base",
        "model.hc_head.hc_scale": "hc_head_scale",
    }  # fmt: skip
    mtp = f"model.layers.{json.loads(Path(path, 'config.json').read_text())['num_hidden_layers']}."

    def name(key: str) -> str:
        if key in top:
            return top[key]
        return "mtp.0." + key[len(mtp) :] if key.startswith(mtp) else key.removeprefix("model.")

    shutil.copytree(path, out)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    for file in sorted(set(index["weight_map"].values())):
        tensors = load_file(out / file)
        save_file({name(k): v for k, v in tensors.items()}, out / file, metadata={"format": "pt"})
    index["weight_map"] = {name(k): v for k, v in index["weight_map"].items()}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    return str(out)


@pytest.mark.timeout(120)
def test_deepseek_v4_reads_the_published_tensor_names(v4, tmp_path, engine_log):
    """The published files' names (top level without `model.`, the MTP layer under mtp.*): the
    tokens and logprobs of transformers' save, and transformers reads the copy to the same logits
    (so the copy is what its conversion table expects)."""
    published = published_names(v4, tmp_path / "published")
    assert (
        "embed.weight"
        in json.loads(Path(published, "model.safetensors.index.json").read_text())["weight_map"]
    )
    ids = torch.tensor([_prompts([40])[0]])
    with torch.no_grad():
        assert torch.equal(_reference(published)(ids).logits, _reference(v4)(ids).logits)
    prompts = _prompts([3, 40, 70])
    assert_same(
        _run(LLM(published, **COMMON), prompts, 8, 2), _run(LLM(v4, **COMMON), prompts, 8, 2), "names"
    )
    assert "by rule 'mtp layer (published as mtp.*" in engine_log.text


def _fake_env():
    class Env:
        is_first_stage = is_last_stage = True

    return Env()


def test_deepseek_v4_refuses_what_it_cannot_serve(v4, tmp_path):
    """Another scoring_func is refused by name; MTP drafting over MTP tensors that are not V4's
    (the test writer's DeepSeek-V3-shaped layer: a compressor the sliding-only MTP layer lacks)
    fails the load naming the tensor (V4's own mtp.0.* layer: tests/test_spec_mtp_2026.py); a hash
    table naming an expert that does not exist fails the load naming the tensor."""
    from dataclasses import replace

    from expertmesh.config import ModelConfig
    from expertmesh.config.hf_config import load_hf_config
    from expertmesh.models.deepseek_v4 import DeepseekV4ForCausalLM

    cfg = ModelConfig.from_hf(load_hf_config(v4))
    softmax = replace(cfg, compressed=replace(cfg.compressed, scoring_func="softmax"))
    with pytest.raises(ValueError, match="scoring_func='softmax' is not supported"):
        DeepseekV4ForCausalLM(softmax, _fake_env())

    with pytest.raises(ValueError, match="checkpoint key 'model.layers.4.attn.compressor.ape' matches no"):
        LLM(v4, speculative_config={"method": "mtp", "num_speculative_tokens": 1}, **COMMON)

    bad = tmp_path / "bad-table"
    shutil.copytree(v4, bad)
    shard = next(bad.glob("model-00001-*.safetensors"))
    tensors = load_file(shard)
    tensors["model.layers.1.ffn.gate.tid2eid"][5, 0] = 8  # 8 experts: ids 0..7
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"tid2eid.*expert ids must be integers in \[0, 8\)"):
        LLM(str(bad), **COMMON)


@pytest.mark.parametrize("name", ["deepseek-v4-flash", "deepseek-v4-pro"])
def test_published_configs_read_whole_and_shrink_with_every_flag_kept(name, tmp_path):
    """Both published files read as published (43 / 61 layers: the first two sliding, then CSA and
    HCA alternating as compress_ratios says, its MTP entry dropped; 3 hash layers; YaRN x16 on the
    compressed layers only; 512-wide K=V rows), and shrink keeps every key and every flag."""
    from real_checkpoints import published, shrink

    from expertmesh.config import ModelConfig
    from expertmesh.config.compressed_attention_config import CSA, HCA, SLIDING
    from expertmesh.config.hf_config import load_hf_config

    full = published(f"2026/{name}")
    (tmp_path / "config.json").write_text(json.dumps(full))
    cfg = ModelConfig.from_hf(load_hf_config(str(tmp_path)))
    c, n = cfg.compressed, full["num_hidden_layers"]
    kinds = {0: SLIDING, 4: CSA, 128: HCA}
    assert cfg.layer_types == tuple(kinds[r] for r in full["compress_ratios"][:n])
    assert dict(c.compress_rates) == {CSA: 4, HCA: 128} and c.mlp_layer_types == ("hash_moe",) * 3 + (
        "moe",
    ) * (n - 3)
    assert (c.hc_mult, c.hc_sinkhorn_iters, c.o_groups, c.o_lora_rank) == (4, 20, full["o_groups"], 1024)
    assert c.main_rope.rope_type == "default" and c.main_rope.theta == 10000.0
    rope = c.compress_rope
    assert (rope.rope_type, rope.theta, rope.factor, rope.attention_factor) == ("yarn", 160000.0, 16.0, 1.0)
    assert rope.rotary_dim == c.rope_dim == 64 and cfg.head_dim == 512 and cfg.num_kv_heads == 1
    assert cfg.num_nextn_predict_layers == 1 and cfg.sliding_window == 128

    small = shrink(full, **OVERRIDES)
    assert set(small) - {"compress_rates"} == set(full) - {"quantization_config"}  # compress_rates: added
    sizes = {
        "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "moe_intermediate_size",
        "n_routed_experts", "num_experts_per_tok", "vocab_size", "max_position_embeddings", "bos_token_id",
        "eos_token_id", "rope_scaling", "initializer_range", "torch_dtype", "q_lora_rank", "qk_rope_head_dim",
        "index_n_heads", "index_head_dim", "index_topk", "sliding_window", "o_lora_rank",
        "quantization_config",
    }  # fmt: skip
    assert {k: v for k, v in full.items() if k not in sizes} == {k: small[k] for k in full if k not in sizes}


def test_blocks_equal_transformers_modules():
    """The hyper-connection, its head, the sqrt(softplus) router and the hash router against
    transformers' own modules on random inputs (float32)."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as ref
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config

    from expertmesh.layers.hash_routing import HashRouter
    from expertmesh.layers.hyper_connections import HyperConnection, HyperHead
    from expertmesh.layers.routing import ROUTERS

    torch.manual_seed(0)
    cfg = DeepseekV4Config(
        hidden_size=16,
        hc_mult=4,
        vocab_size=32,
        n_routed_experts=8,
        num_experts_per_tok=3,
        num_hidden_layers=2,
    )
    hc_ref = ref.DeepseekV4HyperConnection(cfg)
    for p in hc_ref.parameters():
        torch.nn.init.normal_(p, std=0.5)
    ours = HyperConnection(4, 16, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)
    ours.load_state_dict(hc_ref.state_dict())
    x = torch.randn(5, 4, 16)
    for a, b in zip(ours(x), hc_ref(x.unsqueeze(0)), strict=True):
        torch.testing.assert_close(a, b[0], rtol=0, atol=1e-6)
    head_ref, head = ref.DeepseekV4HyperHead(cfg), HyperHead(4, 16, cfg.hc_eps, cfg.rms_norm_eps)
    for p in head_ref.parameters():
        torch.nn.init.normal_(p, std=0.5)
    head.load_state_dict(head_ref.state_dict())
    torch.testing.assert_close(head(x), head_ref(x.unsqueeze(0))[0], rtol=0, atol=1e-6)

    router = ref.DeepseekV4TopKRouter(cfg)
    torch.nn.init.normal_(router.weight)
    router.e_score_correction_bias.normal_()
    h = torch.randn(7, 16)
    _, w_ref, ids_ref = router(h)
    w, ids = ROUTERS["sqrtsoftplus"](
        h @ router.weight.t(),
        3,
        correction_bias=router.e_score_correction_bias,
        scaling=cfg.routed_scaling_factor,
    )
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=0, atol=1e-6)

    hashed = ref.DeepseekV4HashRouter(cfg)
    torch.nn.init.normal_(hashed.weight)
    hashed.tid2eid.copy_(torch.stack([torch.randperm(8)[:3] for _ in range(32)]))
    ours = HashRouter(16, 8, "hash_sqrtsoftplus", 3, 32, cfg.routed_scaling_factor, torch.float32)
    ours.weight.data.copy_(hashed.weight)
    ours.tid2eid.data.copy_(hashed.tid2eid)
    tokens = torch.randint(0, 32, (7,))
    _, w_ref, ids_ref = hashed(h, tokens)
    w, ids = ours(h, tokens)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=0, atol=1e-6)


# ---- layouts -------------------------------------------------------------------------------------
LAYOUT_LENGTHS = [4, 40, 9, 70, 2, 33]
MAX_TOKENS = [3, 10, 6, 12, 3, 8]


def _mine(dp_rank: int, dp_size: int) -> list[int]:
    """Uneven loads: the first DP rank takes prompts 0, 2, 4; the last one none at all."""
    if dp_size == 1:
        return list(range(len(LAYOUT_LENGTHS)))
    return [] if dp_rank == dp_size - 1 else list(range(len(LAYOUT_LENGTHS)))[::2]


ENGINE = dict(max_model_len=128, kv_cache_memory_bytes=1 << 22, debug_nan_recv_buffers=True)


def _layout_share(llm, idx):
    """This replica's share of the layout prompts: its tokens, and the MoE plan mode that ran."""
    prompts = _prompts(LAYOUT_LENGTHS, seed=5)
    outs = llm.generate(
        [{"prompt_token_ids": prompts[i]} for i in idx],
        [SamplingParams(temperature=0, max_tokens=MAX_TOKENS[i], ignore_eos=True) for i in idx],
        use_tqdm=False,
    )
    layers = llm.llm_engine.runner.model.model.layers
    return [o.outputs[0].token_ids for o in outs], next(iter(layers.values())).ffn.plan.mode


def _check_layouts(path: str, world: int, layouts: list, timeout: float, pp: int = 1) -> set[str]:
    """Every layout's tokens on every rank equal one process's (`pp` pipeline stages); the MoE plan
    modes that ran."""
    prompts = _prompts(LAYOUT_LENGTHS, seed=5)
    llm = LLM(path, max_model_len=128, kv_cache_memory_bytes=1 << 22)
    expected = [
        o.outputs[0].token_ids
        for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS],
            use_tqdm=False,
        )
    ]
    cases = [(dp, pp, tp, ep, backend) for dp, tp, ep, backend in layouts]
    modes = set()
    per_ranks = run_distributed(rank_main, world, path, cases, ENGINE, _mine, _layout_share, timeout=timeout)
    for rank, results in enumerate(per_ranks):
        for case, idx, (tokens, mode) in results:
            assert tokens == [expected[i] for i in idx], f"rank {rank}, (DP, PP, TP, EP, backend) {case}"
            modes.add(mode)
    return modes


@pytest.mark.timeout(240)
def test_deepseek_v4_tp2_and_dp2_ep_alltoall_equal_one_process(real_checkpoint):
    """TP2 (query heads, sinks, output groups and the indexer's heads split; K=V rows and
    compressors replicated), DP2 with EP over alltoall (7 experts over 2 ranks; hash-routed picks dispatched
    like scored ones) and TP2 with EP (each rank its experts, every token): every rank's tokens
    equal the one-process run."""
    from real_checkpoints import Sizes

    path = real_checkpoint(SOURCE, sizes=Sizes(experts=7), **OVERRIDES)
    layouts = [(1, 2, False, "naive"), (2, 1, True, "alltoall"), (1, 2, True, "alltoall")]
    assert _check_layouts(path, 2, layouts, timeout=200) == {"tp", "ep"}


@pytest.mark.timeout(300)
def test_deepseek_v4_dp2_tp2_naive_and_ep_alltoall_equal_one_process(v4):
    """DP2 x TP2 with the naive backend, and with EP over alltoall (each TP rank routes its slice
    of the tokens: the hash router takes that slice's token ids), uneven loads (one DP rank idle):
    the one-process tokens on every rank."""
    modes = _check_layouts(v4, 4, [(2, 2, False, "naive"), (2, 2, True, "alltoall")], timeout=280)
    assert modes == {"dp_tp", "ep_sp"}


@pytest.mark.timeout(120)
def test_deepseek_v4_pp2_equals_one_process(v4):
    """Pipeline stages hand each other the 4-stream residual ([T, 4, hidden]): with PP2 the first
    stage runs the two sliding layers, the second the compressed sparse and heavily compressed ones
    (the hash-routed layers on both); every rank returns the one-process tokens."""
    _check_layouts(v4, 2, [(1, 1, False, "naive")], timeout=100, pp=2)


@pytest.mark.timeout(150)
def test_deepseek_v4_pp2_tp2_equals_one_process(v4):
    """PP2 x TP2, with and without EP over alltoall: the one-process tokens on every rank."""
    layouts = [(1, 2, False, "naive"), (1, 2, True, "alltoall")]
    assert _check_layouts(v4, 4, layouts, timeout=130, pp=2) == {"tp", "ep"}
