"""Hybrid families (Gated DeltaNet + gated attention) from their published configs
(tests/real_configs/2026), shrunk with every flag kept, against transformers: greedy tokens and
fp32 logprobs at every step of prompts longer than a prefill chunk, in one process, under chunked
prefill with a budget smaller than the prompt, with prefix caching (recurrent-state snapshots at
block boundaries: hits equal cold runs, a poisoned snapshot shows), under preemption, in DP / TP /
PP / EP layouts; the state cache's bytes per sequence against the formula."""

import json
import os

import pytest
import torch
from real_checkpoints import published
from safetensors.torch import load_file, save_file
from sweeps import sweep
from test_real_families import assert_bf16_bound, hf_logprobs, logprob_errors

from expertmesh import LLM, SamplingParams
from expertmesh.engine.block_manager import BlockManager
from expertmesh.engine.sequence import Sequence
from expertmesh.layers.quantization.packed import QuantizedWeight
from expertmesh.layers.recurrent_mixer import RecurrentMixer

NEW_TOKENS = 12
TOP = 20
# The linear-attention sizes shrink like attention heads: 2 key heads serving 2 value heads each.
LINEAR = dict(
    linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4
)
FAMILIES = {
    "qwen3-next": "2026/qwen3-next-80b-a3b-instruct",
    "qwen3.5-moe": "2026/qwen3.5-35b-a3b",  # a vision-language wrapper: its text_config
    "granite-4.0-h": "2026/granite-4.0-h-tiny",
    "nemotron-h": "2026/nemotron-3-nano-30b-a3b",
}
# Mamba2 sizes shrunk (heads x head_dim = 2 x hidden, as transformers checks: mamba_expand 2), and
# the shrunk 4 layers given the published pattern's two kinds (its first 4 layers are all Mamba).
MAMBA = dict(
    mamba_n_heads=8, mamba_d_head=16, mamba_d_state=8, layer_types=["mamba", "mamba", "attention", "mamba"]
)


# Nemotron-H under its own key names: Mamba2 shrunk alike (its 8 groups of 8 heads to 4 groups of
# 2, so the gated norm still works per group), the shared expert twice an expert's width as
# published, and the 4 shrunk layers given the published pattern's kinds in its order (M, E, *)
# plus a dense MLP block (-, which transformers' NemotronH supports and Nemotron-3-Nano's pattern
# does not use), so every block kind is checked.
NEMOTRON = dict(
    mamba_num_heads=8, mamba_head_dim=16, ssm_state_size=8, n_groups=4,
    moe_shared_expert_intermediate_size=64, hybrid_override_pattern="ME*-",
)  # fmt: skip


def _source(family: str) -> dict:
    """The published config with the linear-attention sizes shrunk where the text model has them."""
    config = published(FAMILIES[family])
    text = config.get("text_config", config)
    if "hybrid_override_pattern" in text:
        text.update(NEMOTRON)
    else:
        text.update(MAMBA if "mamba_n_heads" in text else LINEAR)
    return config


LENGTHS = [5, 45, 70]
NO_MTP = ("granite-4.0-h", "nemotron-h")  # checkpoints without multi-token-prediction tensors


def _with_mtp(path: str) -> str:
    """The published checkpoints carry one multi-token-prediction layer as `mtp.*` tensors
    (transformers drops them): added in a second file listed by a safetensors index."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        return path
    main = load_file(os.path.join(path, "model.safetensors"))
    hidden = next(v for k, v in main.items() if k.endswith("embed_tokens.weight")).shape[1]
    extra = {"mtp.fc.weight": torch.randn(hidden, 2 * hidden), "mtp.norm.weight": torch.randn(hidden)}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "layers.0.input_layernorm"):
        extra[f"mtp.{name}.weight"] = torch.randn(hidden)
    save_file(extra, os.path.join(path, "model-mtp.safetensors"), metadata={"format": "pt"})
    weight_map = {k: "model.safetensors" for k in main} | {k: "model-mtp.safetensors" for k in extra}
    with open(index, "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return path


def prompts_for(seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in LENGTHS]


def _run(path: str, prompts, **engine) -> list:
    llm = LLM(path, dtype="float32", max_model_len=128, kv_cache_memory_bytes=1 << 23, **engine)
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOP)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    llm.llm_engine.check_invariants()
    return llm, outs


def _reference(path: str, dtype: torch.dtype = torch.float32):
    import transformers

    try:
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    except ValueError:  # a vision-language wrapper: the whole model, fed text only
        return transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).eval()


def _assert_matches(model, prompts, outs, what: str) -> None:
    for prompt, out in zip(prompts, outs, strict=True):
        tokens = out.outputs[0].token_ids
        ref = hf_logprobs(model, prompt, tokens)
        err = logprob_errors(out, ref)
        assert tokens == ref.argmax(-1).tolist(), f"{what}: prompt of {len(prompt)}: greedy tokens differ"
        assert err.max() < 2e-4, f"{what}: prompt of {len(prompt)}: |logprob error| per step {err.tolist()}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_hybrid_matches_transformers(family, real_checkpoint, engine_log):
    """One process, whole prompts and then chunked prefill (a budget of 16 tokens, prompts up to
    70), with prefix caching on (state snapshots: prefills stop at the last full block), then
    preemption (a cache of a few blocks for three sequences): every step's top-20 logprobs within
    fp32 tolerance of transformers' forward over the same tokens, and greedy tokens its argmax."""
    path = real_checkpoint(_source(family))
    path = path if family in NO_MTP else _with_mtp(path)
    prompts = prompts_for()
    model = _reference(path)
    llm, outs = _run(path, prompts, enable_prefix_caching=True)
    assert "prefix caching with recurrent layers" in engine_log.text
    assert " bytes per sequence" in engine_log.text
    if family not in NO_MTP:
        assert "multi-token prediction" in engine_log.text  # the mtp.* tensors: skipped by a named rule
    if family == "qwen3.5-moe":
        assert "vision tower" in engine_log.text
    assert llm.llm_engine.blocks.enable_prefix_caching and llm.llm_engine.runner.snapshots is not None
    ours = llm.llm_engine.runner.model
    mixers = [m for m in ours.modules() if isinstance(m, RecurrentMixer)]
    # decodes on the compiled recurrent kernels wherever the library is (tests/test_hybrid_kernels.py)
    assert mixers and all((m.recurrent_steps is not None) == (ours.cpu_kernels is not None) for m in mixers)
    _assert_matches(model, prompts, outs, family)
    del llm
    llm, chunked = _run(path, prompts, enable_chunked_prefill=True, max_num_batched_tokens=16, max_num_seqs=4)
    _assert_matches(model, prompts, chunked, f"{family} chunked")
    assert [o.outputs[0].token_ids for o in chunked] == [o.outputs[0].token_ids for o in outs]
    del llm
    # 12 blocks of 16 tokens for prompts of 45 + 70 + 5 tokens growing by 12: someone is preempted.
    engine = _run_preempting(path, prompts)
    llm, preempted = engine
    assert llm.llm_engine.scheduler.num_preemptions > 0
    _assert_matches(model, prompts, preempted, f"{family} preempted")


def _run_preempting(path: str, prompts):
    """9 KV blocks of 16 tokens (and 3 state slots) for prompts of 5 + 45 + 70 tokens, each growing
    by 12: someone is preempted."""
    probe = LLM(path, dtype="float32", max_model_len=128, kv_cache_memory_bytes=1 << 23)
    runner = probe.llm_engine.runner
    # each state slot with its prefix-cache snapshot: twice the state bytes
    budget = 9 * runner.block_bytes() + 3 * 2 * sum(s.bytes_per_seq for s in runner.state_specs())
    del probe
    llm = LLM(path, dtype="float32", max_model_len=128, kv_cache_memory_bytes=budget, max_num_seqs=3)
    assert llm.llm_engine.blocks.num_blocks == 9 and llm.llm_engine.blocks.state_slots == 3
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOP)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    llm.llm_engine.check_invariants()
    return llm, outs


def test_state_bytes_per_sequence_match_the_formula(real_checkpoint):
    """Per Gated DeltaNet layer: the conv state (2 key dims + value dim channels x kernel - 1) and
    the recurrent state (value heads x key head dim x value head dim), float32; attention layers
    none. Every sequence's slot is returned when it finishes."""
    path = real_checkpoint(_source("qwen3-next"))
    llm = LLM(path, dtype="float32", max_model_len=128, kv_cache_memory_bytes=1 << 23)
    c = llm.llm_engine.config.model_config
    lin = c.linear_attn
    linear_layers = sum(t == "linear_attention" for t in c.layer_types)
    conv = (2 * lin.key_dim + lin.value_dim) * (lin.conv_kernel - 1)
    rec = lin.num_value_heads * lin.key_head_dim * lin.value_head_dim
    runner = llm.llm_engine.runner
    assert sum(s.bytes_per_seq for s in runner.state_specs()) == linear_layers * (conv + rec) * 4
    assert len(runner.kv_specs()) == c.num_layers - linear_layers
    blocks = llm.llm_engine.blocks
    assert 1 <= blocks.state_slots <= llm.llm_engine.config.scheduler_config.max_num_seqs
    llm.generate([{"prompt_token_ids": [5, 6, 7]}] * 3, SamplingParams(max_tokens=2), use_tqdm=False)
    assert sorted(blocks.free_slots) == list(range(blocks.state_slots))


def test_block_manager_hands_out_one_state_slot_per_sequence():
    """Slots go with the first blocks and come back with them (finish, abort, preemption); a
    sequence waits while every slot is held; an attention-only manager hands out none."""
    bm = BlockManager(8, 4, enable_prefix_caching=False, state_slots=2)
    seqs = [Sequence(str(i), 0, [1, 2, 3], SamplingParams(), 64) for i in range(3)]
    for s in seqs[:2]:
        assert bm.can_allocate(s, [], 3)
        bm.allocate(s, [], 3)
    assert {s.state_slot for s in seqs[:2]} == {0, 1}
    assert not bm.can_allocate(seqs[2], [], 3)  # blocks are free, slots are not
    bm.free(seqs[0])
    assert seqs[0].state_slot is None and bm.can_allocate(seqs[2], [], 3)
    bm.allocate(seqs[2], [], 3)
    assert bm.slot_problems([seqs[1].state_slot, seqs[2].state_slot]) == []
    assert bm.slot_problems([seqs[1].state_slot]) != []  # a lost slot is reported
    plain = BlockManager(8, 4, enable_prefix_caching=False)
    plain.allocate(seqs[0], [], 3)
    assert seqs[0].state_slot is None and plain.can_allocate(seqs[1], [], 3)


# (DP, PP, TP, backend) per family. Mamba2 under TP2: Nemotron-H's shrunk 4 groups split 2 a rank,
# Granite-4.0-H's one group spans both ranks (its gated norm sums squares over TP).
LAYOUTS = {
    "qwen3.5-moe": [(2, 1, 2, "naive"), (2, 2, 1, "alltoall"), (1, 2, 2, "allgather_reducescatter")],
    "qwen3-next": [(2, 1, 2, "naive"), (2, 2, 1, "alltoall"), (1, 2, 2, "allgather_reducescatter")],
    "granite-4.0-h": [(2, 1, 2, "naive"), (2, 2, 1, "alltoall"), (1, 2, 2, "allgather_reducescatter")],
    # under PP2 the pattern ME*- leaves the second stage without a recurrent layer (its state-slot
    # agreement and prefix-caching decision are made over the whole model)
    "nemotron-h": [(2, 1, 2, "naive"), (2, 2, 1, "alltoall"), (1, 2, 2, "allgather_reducescatter")],
}


def _layout_rank(rank, world, path, prompts, family):
    results = []
    for dp, pp, tp, backend in LAYOUTS[family]:
        llm = LLM(
            path, data_parallel_size=dp, pipeline_parallel_size=pp, tensor_parallel_size=tp,
            all2all_backend=backend, enable_expert_parallel=backend == "alltoall",
            distributed_executor_backend="external_launcher", max_model_len=128,
            kv_cache_memory_bytes=1 << 22, enable_chunked_prefill=True, max_num_batched_tokens=32,
            max_num_seqs=8,
        )  # fmt: skip
        dp_rank = llm.llm_engine.vllm_config.parallel_config.data_parallel_rank
        idx = list(range(len(prompts))) if dp == 1 or dp_rank == 0 else []  # DP rank 1 idles (dummies)
        sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": prompts[i]} for i in idx], sp, use_tqdm=False)
        results.append(((dp, pp, tp, backend), idx, [o.outputs[0].token_ids for o in outs]))
    return results


@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", sweep(sorted(LAYOUTS), ["qwen3.5-moe", "nemotron-h"]))
def test_hybrid_layouts_equal_one_process(family, real_checkpoint):
    """DP2 x TP2 (`naive`, one DP rank idle: its lockstep dummies touch no state) and PP2 x TP2:
    the linear-attention heads, their projections, convolution channels and states split over
    TP like attention heads (Qwen3.5's split projections by default, Qwen3-Next's fused ones with
    -m slow), and DP2 x PP2 with EP `alltoall` (experts split, the recurrent layers replicated);
    Mamba2 heads and groups likewise (Nemotron-H by default, in DP2 x TP2, PP2 x TP2 and DP2 x PP2
    with EP `alltoall`; Granite-4.0-H's one group spanning the TP ranks, and PP2 x TP2, with -m
    slow). On every rank the tokens equal the one-process run."""
    from distributed_utils import run_distributed

    path = real_checkpoint(_source(family))
    prompts = prompts_for()
    _, outs = _run(path, prompts)
    expected = [o.outputs[0].token_ids for o in outs]
    for rank, per_rank in enumerate(run_distributed(_layout_rank, 4, path, prompts, family, timeout=230)):
        for layout, idx, tokens in per_rank:
            assert tokens == [expected[i] for i in idx], f"{family}: rank {rank}, (DP,PP,TP,backend)={layout}"


def test_mamba2_heads_or_groups_that_do_not_split_over_tp_are_refused_by_name():
    """8 heads split over 3 ranks, or 4 groups over 8 ranks when neither count divides the
    other (here 6 groups of 2 heads over 4): the error names both counts."""
    from types import SimpleNamespace

    from expertmesh.config.linear_attention_config import Mamba2Config
    from expertmesh.layers.mamba2 import Mamba2Mixer

    for heads, groups, tp in ((8, 1, 3), (12, 6, 4)):
        m = Mamba2Config(num_heads=heads, head_dim=16, state_size=8, n_groups=groups, conv_kernel=4)
        with pytest.raises(
            ValueError, match=f"tensor_parallel_size={tp}: Mamba2 layers split their {heads} heads"
        ):
            Mamba2Mixer(m, 64, 1e-5, SimpleNamespace(world_size=tp, rank_in_group=0), torch.float32)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", sweep(sorted(FAMILIES), ["qwen3.5-moe", "granite-4.0-h"]))
def test_hybrid_bf16_close_to_transformers(family, real_checkpoint):
    """bfloat16 end to end, with test_real_families' bound: at all but one in five steps our bf16
    logprobs are no further from transformers' fp32 forward than transformers' bf16 forward is,
    plus 0.1, and so on average (the recurrent states stay float32 in both)."""
    path = real_checkpoint(_source(family))
    prompts = prompts_for()[1:]
    llm = LLM(path, dtype="bfloat16", max_model_len=128, kv_cache_memory_bytes=1 << 23)
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOP)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    fp32 = _reference(path)
    bf16 = _reference(path, torch.bfloat16)
    for prompt, out in zip(prompts, outs, strict=True):
        assert_bf16_bound(family, prompt, out, fp32, bf16)


def test_chunked_delta_rule_equals_the_recurrent_form():
    """The prefill's chunked form against the decode's token-by-token rule, in float64, from a
    non-zero state, over lengths across the chunk (1, 63, 64, 65, 150 with chunks of 64)."""
    from expertmesh.layers.gated_deltanet import delta_rule_chunked, delta_rule_step, l2norm

    g = torch.Generator().manual_seed(0)
    for n in (1, 63, 64, 65, 150):
        h, dk, dv = 3, 8, 5
        q = l2norm(torch.randn(n, h, dk, generator=g, dtype=torch.float64)) * dk**-0.5
        k = l2norm(torch.randn(n, h, dk, generator=g, dtype=torch.float64))
        v = torch.randn(n, h, dv, generator=g, dtype=torch.float64)
        decay = -torch.rand(n, h, generator=g, dtype=torch.float64)
        beta = torch.rand(n, h, generator=g, dtype=torch.float64)
        s0 = torch.randn(1, h, dk, dv, generator=g, dtype=torch.float64)
        s_ref, s_chunk = s0.clone(), s0.clone()
        ref = torch.cat([delta_rule_step(s_ref, q[i : i + 1], k[i : i + 1], v[i : i + 1],
                                         decay[i : i + 1], beta[i : i + 1]) for i in range(n)])  # fmt: skip
        out = delta_rule_chunked(s_chunk, q, k, v, decay, beta)
        assert torch.allclose(out, ref, atol=1e-10), n
        assert torch.allclose(s_chunk, s_ref, atol=1e-10), n


def test_recurrent_layers_a_family_does_not_declare_are_named(real_checkpoint, tmp_path):
    """Qwen3-Next's config under an attention-only architecture: the error names the layer kind
    and the families that have one; the next engine on the real file works."""
    import shutil

    path = real_checkpoint(_source("qwen3-next"))
    bad = tmp_path / "as-qwen3-moe"
    shutil.copytree(path, bad)
    config = json.loads((bad / "config.json").read_text())
    config["architectures"] = ["Qwen3MoeForCausalLM"]
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"layer_types \['linear_attention'\] are not supported by Qwen3Moe"):
        LLM(str(bad), kv_cache_memory_bytes=1 << 22)
    llm = LLM(path, kv_cache_memory_bytes=1 << 22)
    assert llm.generate([{"prompt_token_ids": [5, 6]}], SamplingParams(max_tokens=2), use_tqdm=False)


def test_chunked_ssd_scan_equals_the_recurrent_form():
    """Mamba2's prefill scan against the decode's token-by-token update, in float64, from a
    non-zero state, over lengths across the chunk of 64."""
    from expertmesh.layers.mamba2 import ssd_chunked

    g = torch.Generator().manual_seed(0)
    for n in (1, 63, 64, 65, 150):
        h, p, s = 3, 4, 5
        x = torch.randn(n, h, p, generator=g, dtype=torch.float64)
        dt = torch.rand(n, h, generator=g, dtype=torch.float64)
        a = -torch.rand(h, generator=g, dtype=torch.float64) * 2
        b, c = (torch.randn(n, h, s, generator=g, dtype=torch.float64) for _ in range(2))
        s0 = torch.randn(h, p, s, generator=g, dtype=torch.float64)
        state, ref = s0.clone(), []
        for i in range(n):
            state = (
                state * (dt[i] * a).exp()[:, None, None]
                + dt[i][:, None, None] * x[i][:, :, None] * b[i][:, None, :]
            )
            ref.append((state * c[i][:, None, :]).sum(-1))
        chunked = s0.clone()
        out = ssd_chunked(chunked, x, dt, a, b, c)
        assert torch.allclose(out, torch.stack(ref), atol=1e-10), n
        assert torch.allclose(chunked, state, atol=1e-10), n


@pytest.mark.parametrize("family", ["qwen3-next", "nemotron-h"])
def test_abort_and_a_failed_step_return_the_state_slot(family, real_checkpoint, monkeypatch):
    """An aborted sequence mid-decode and the sequences of a step that raised give their slots
    back at once; the next request starts from a zero state (its tokens equal a fresh engine's)."""
    path = real_checkpoint(_source(family))
    llm = LLM(path, dtype="float32", max_model_len=128, kv_cache_memory_bytes=1 << 23, max_num_seqs=2)
    engine = llm.llm_engine
    blocks = engine.blocks
    prompt = prompts_for()[1]
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    engine.add_request("a", prompt, sp)
    engine.step()
    engine.step()
    assert len(blocks.free_slots) == blocks.state_slots - 1
    engine.abort_request("a")
    assert sorted(blocks.free_slots) == list(range(blocks.state_slots))
    failed = engine.add_request("b", prompt[:9], sp)
    real_forward = engine.runner.forward
    monkeypatch.setattr(engine.runner, "forward", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    engine.step()
    assert "boom" in failed.error and sorted(blocks.free_slots) == list(range(blocks.state_slots))
    monkeypatch.setattr(engine.runner, "forward", real_forward)
    engine.check_invariants()
    after = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0].outputs[0].token_ids
    fresh = LLM(path, dtype="float32", max_model_len=128, kv_cache_memory_bytes=1 << 23, max_num_seqs=2)
    expected = fresh.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert after == expected


def _shared_prefix(prefix_len: int, suffixes: list[int], seed: int = 5) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, 512, (prefix_len,), generator=g).tolist()
    return [prefix + torch.randint(3, 512, (n,), generator=g).tolist() for n in suffixes]


def _logprob_rows(out) -> list[dict]:
    return [{t: lp.logprob for t, lp in step.items()} for step in out.outputs[0].logprobs]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("family", sweep(sorted(FAMILIES), ["nemotron-h", "qwen3.5-moe"]))
def test_hybrid_prefix_caching_restores_state_snapshots(family, real_checkpoint, engine_log):
    """Prompts sharing a 70-token prefix: the first computes it (its prefill stops at the last
    full block, 64, where the recurrent state is snapshotted), the rest start there (4 blocks of
    KV hit and the snapshot restored) and give the tokens of an engine without prefix caching,
    logprobs within fp32 tolerance. The same engine with the snapshots poisoned after the first
    prompt gives other outputs (the restored state is used); invariants hold throughout and the
    snapshots count in the state memory (one per sequence slot)."""
    path = real_checkpoint(_source(family))
    ps = _shared_prefix(70, [3, 20, 1, 40])
    kw = dict(dtype="float32", max_model_len=128, kv_cache_memory_bytes=1 << 23, max_num_seqs=8)
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOP)
    off = LLM(path, enable_prefix_caching=False, **kw)
    cold = off.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
    assert off.llm_engine.runner.snapshots is None

    def warm(poison: bool):
        on = LLM(path, **kw)
        engine = on.llm_engine
        assert engine.blocks.enable_prefix_caching and "state after a cached prompt" in engine_log.text
        runner = engine.runner
        rows = runner.num_state_slots + runner.snapshots.count + 1  # slots, snapshots, scratch
        assert all(t.shape[0] == rows for tensors in runner.states for t in tensors)
        assert runner.snapshots.count == runner.num_state_slots
        first = on.generate([{"prompt_token_ids": ps[0]}], sp, use_tqdm=False)
        assert len(engine.blocks.snapshot_of) >= 1
        if poison:
            g = torch.Generator().manual_seed(0)
            for tensors in runner.states:
                for t in tensors:
                    snaps = t[runner.num_state_slots : runner.num_state_slots + runner.snapshots.count]
                    snaps.copy_(torch.randn(snaps.shape, generator=g) * 100)
        rest = on.generate([{"prompt_token_ids": p} for p in ps[1:]], sp, use_tqdm=False)
        engine.check_invariants()
        assert [o.num_cached_tokens for o in rest] == [64, 64, 64]
        return first + rest

    outs = warm(poison=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in cold]
    for a, b in zip(outs, cold, strict=True):
        for x, y in zip(_logprob_rows(a), _logprob_rows(b), strict=True):
            assert all(abs(lp - y[t]) < 1e-4 for t, lp in x.items() if t in y)
    poisoned = warm(poison=True)
    worst = max(
        abs(lp - y[t])
        for a, b in zip(poisoned[1:], cold[1:], strict=True)
        for x, y in zip(_logprob_rows(a), _logprob_rows(b), strict=True)
        for t, lp in x.items()
        if t in y
    )
    assert worst > 1e-2, "a poisoned snapshot changed nothing: the restored state is not used"


def test_state_snapshots_follow_their_blocks():
    """Block-manager accounting of snapshots (no model): taken when a sequence's computed tokens
    end a cached block, the least recently used one gives way when none is free, an evicted
    block takes its snapshot with it, a hit ends at the last block with a snapshot and restores
    it into the new sequence's slot; a prefill chunk stops at the last full block."""
    from expertmesh.engine.state_cache import StateSnapshots

    states = [(torch.zeros(2 + 2 + 1, 3),)]  # 2 slots, 2 snapshots, scratch
    snaps = StateSnapshots(states, slots=2, count=2)
    bm = BlockManager(6, 4, enable_prefix_caching=True, state_slots=2, snapshots=snaps)
    a = Sequence("a", 0, list(range(1, 11)), SamplingParams(), 64)  # 10 tokens: last full block ends at 8
    assert bm.chunk_end(a, 0, 10) == 8 and bm.chunk_end(a, 8, 2) == 2 and bm.chunk_end(a, 0, 5) == 5
    bm.allocate(a, [], 8)
    states[0][0][a.state_slot] = 7.0  # "the state after 8 tokens"
    a.num_computed_tokens = 8
    bm.cache_full_blocks(a)
    assert len(bm.snapshot_of) == 1 and states[0][0][2 + bm.snapshot_of[a.block_keys[1]]].eq(7.0).all()
    assert bm.problems([a.block_table]) == []
    bm.free(a)
    b = Sequence("b", 0, list(range(1, 11)) + [50, 51], SamplingParams(), 64)  # shares a's 10 tokens
    hits = bm.cached_prefix(b)
    assert len(hits) == 2  # both of a's full blocks; the snapshot is at the second's end
    bm.allocate(b, hits, 12)
    assert b.num_computed_tokens == 8 and states[0][0][b.state_slot].eq(7.0).all()  # restored
    bm.free(b)
    c = Sequence("c", 0, list(range(1, 6)) + [9] * 7, SamplingParams(), 64)  # shares a's first block only
    assert bm.cached_prefix(c) == []  # its first block has no snapshot: no hit
    # Fill the cache with keyless blocks until a's cached blocks are evicted: their snapshot goes.
    d = Sequence("d", 0, [99] * 24, SamplingParams(), 64)
    bm.allocate(d, [], 24)
    assert bm.snapshot_of == {} and sorted(bm.free_snapshots) == [0, 1]
    assert bm.problems([d.block_table]) == [] and bm.cached_prefix(b) == []


def test_mamba2_state_bytes_match_the_formula(real_checkpoint):
    """Nemotron-H, per Mamba2 layer, float32: the conv (heads x head dim + 2 x groups x state size
    channels x kernel - 1) and the SSM state (heads x head dim x state size); its attention layer
    the only KV one. With prefix caching each slot has one snapshot beside it: the state tensors
    hold twice the slots plus the scratch row."""
    path = real_checkpoint(_source("nemotron-h"))
    llm = LLM(path, dtype="float32", max_model_len=128, kv_cache_memory_bytes=1 << 23)
    c = llm.llm_engine.config.model_config
    layers = sum(t == "linear_attention" for t in c.layer_types)
    m = c.mamba
    conv = (m.num_heads * m.head_dim + 2 * m.n_groups * m.state_size) * (m.conv_kernel - 1)
    rec = m.num_heads * m.head_dim * m.state_size
    runner = llm.llm_engine.runner
    assert len(runner.kv_specs()) == sum(t == "full_attention" for t in c.layer_types) == 1
    assert sum(s.bytes_per_seq for s in runner.state_specs()) == layers * (conv + rec) * 4
    slots = runner.num_state_slots
    assert all(t.shape[0] == 2 * slots + 1 for tensors in runner.states for t in tensors)


def _prefix_layout_rank(rank, world, path, prompts, layouts):
    results = []
    for dp, pp, tp, backend in layouts:
        llm = LLM(
            path, data_parallel_size=dp, pipeline_parallel_size=pp, tensor_parallel_size=tp,
            all2all_backend=backend, enable_expert_parallel=backend == "alltoall",
            distributed_executor_backend="external_launcher", max_model_len=128,
            kv_cache_memory_bytes=1 << 22, max_num_seqs=8,
        )  # fmt: skip
        dp_rank = llm.llm_engine.vllm_config.parallel_config.data_parallel_rank
        mine = dp == 1 or dp_rank == 0  # DP rank 1 idles (dummies)
        sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
        first = llm.generate([{"prompt_token_ids": prompts[0]}] if mine else [], sp, use_tqdm=False)
        rest = llm.generate(
            [{"prompt_token_ids": p} for p in prompts[1:]] if mine else [], sp, use_tqdm=False
        )
        outs = first + rest
        results.append(
            (
                (dp, pp, tp, backend),
                mine,
                [o.outputs[0].token_ids for o in outs],
                [o.num_cached_tokens for o in rest],
            )
        )
    return results


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["nemotron-h", "qwen3.5-moe"])
def test_hybrid_prefix_caching_in_layouts(family, real_checkpoint):
    """Shared-prefix prompts under DP2 x TP2 and PP2 x TP2: each rank snapshots and restores its
    own part of the recurrent state (its heads, its stage's layers), the later prompts hit 64
    tokens, and the tokens equal one process without prefix caching."""
    from distributed_utils import run_distributed

    path = real_checkpoint(_source(family))
    ps = _shared_prefix(70, [3, 20, 1])
    one = LLM(
        path, dtype="float32", max_model_len=128, kv_cache_memory_bytes=1 << 23, enable_prefix_caching=False
    )
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    expected = [
        o.outputs[0].token_ids
        for o in one.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
    ]
    layouts = [(2, 1, 2, "naive"), (1, 2, 2, "allgather_reducescatter")]
    for rank, per_rank in enumerate(run_distributed(_prefix_layout_rank, 4, path, ps, layouts, timeout=280)):
        for layout, mine, tokens, cached in per_rank:
            if mine:
                assert tokens == expected, f"{family}: rank {rank}, (DP,PP,TP,backend)={layout}"
                assert cached == [64, 64], f"{family}: rank {rank}, {layout}: cached {cached}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("scheme, kind, group", [("int8-g32", "int8", 32), ("int4-g16", "int4", 16)])
def test_nemotron_h_held_int8_int4_match_the_same_weights_dequantized(
    real_checkpoint, tmp_path, scheme, kind, group
):
    """Nemotron-H with its projections held as int8 / int4 codes (Mamba2 in/out, attention, the
    ungated routed and shared experts, the dense MLP; not the router, conv or norms) against
    transformers on the same weights quantized and dequantized in the checkpoint: the bound of
    test_quantization's family tests (greedy tokens equal, one divergence allowed per prompt where
    the reference's top-2 logit margin is below its MARGIN: equal weights, other summation orders)."""
    from checkpoints import prompts_of_lengths
    from quantized_checkpoints import fake_quantized
    from test_quantization import LENGTHS as Q_LENGTHS
    from test_quantization import _greedy, assert_greedy_matches

    path = real_checkpoint(_source("nemotron-h"))

    def quantized(key: str, t: torch.Tensor) -> bool:
        return key.endswith("_proj.weight") and t.dim() == 2

    ref_path = fake_quantized(path, str(tmp_path / "ref"), kind, group, quantized)
    llm = LLM(path, quantization=scheme, max_model_len=128, kv_cache_memory_bytes=1 << 22)
    held = llm.llm_engine.runner.model
    modules = held.named_modules()
    projections = {n.rsplit(".", 1)[-1]: m.weight_form for n, m in modules if n.endswith("_proj")}
    assert sorted(projections) == ["down_proj", "in_proj", "o_proj", "out_proj", "qkv_proj", "up_proj"]
    (experts,) = [m.experts_form.pairs for n, m in held.named_modules() if n.endswith("mixer.experts")]
    # every projection and routed expert (up, down) held as codes; float32 parameters only for what
    # stays unquantized (the router's weight is packed as float)
    assert all(isinstance(p, QuantizedWeight) for p in projections.values())
    assert len(experts) == 8 and all(isinstance(w, QuantizedWeight) for pair in experts for w in pair)
    assert all(w.kind == kind for pair in experts for w in pair)
    assert [n for n, p in held.named_parameters() if p.dim() == 2 and p.numel()] == [
        "model.embed_tokens.weight", "model.layers.0.mixer.conv_weight"
    ]  # fmt: skip
    ref = _reference(ref_path)
    prompts = prompts_of_lengths(Q_LENGTHS, seed=5)
    assert assert_greedy_matches(_greedy(llm, prompts), ref, prompts) <= 1


def _qwen35_fp8(src: str, dst: str, block: tuple[int, int]) -> str:
    """Qwen3.5-MoE as its FP8 release stores it: block e4m3 codes with `weight_scale_inv` for every
    projection (the DeltaNet's in_proj_qkv, in_proj_z and out_proj, attention, routed and shared
    experts), the DeltaNet's small in_proj_b / in_proj_a, the routers, conv, norms, embeddings and
    head left as they were (the release's `modules_to_not_convert`)."""
    from quantized_checkpoints import _rewrite

    from expertmesh.layers.quantization.fp8 import quantize_blocks

    names = ("_proj.weight", "in_proj_qkv.weight", "in_proj_z.weight")

    def convert(key: str, t: torch.Tensor) -> dict:
        if key.endswith(names) and t.dim() == 2 and "visual" not in key:
            q, scale = quantize_blocks(t, block)
            return {key: q, key + "_scale_inv": scale}
        return {key: t}

    config = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
              "weight_block_size": list(block)}  # fmt: skip
    _rewrite(src, dst, convert, config)
    return dst


@pytest.mark.timeout(240)
@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_qwen35_fp8_block_checkpoint_matches_its_dequantized_weights(
    real_checkpoint, tmp_path, engine_log, tp
):
    """Qwen3.5-MoE saved as block FP8 (_qwen35_fp8; 8 x 16 blocks, partial last blocks where a
    dimension does not divide) held as stored, in one process and under TP2 (the DeltaNet's
    in_proj_qkv rows taken per part [q | k | v] with their block scales), against transformers on
    the same checkpoint dequantized by the format's definition, under test_quantization's bound."""
    from checkpoints import prompts_of_lengths
    from quantized_checkpoints import from_fp8
    from test_quantization import LENGTHS as Q_LENGTHS
    from test_quantization import _greedy, assert_greedy_matches

    block = (8, 16)
    path = _qwen35_fp8(real_checkpoint(_source("qwen3.5-moe")), str(tmp_path / "fp8"), block)
    ref = _reference(from_fp8(path, str(tmp_path / "ref"), block))
    prompts = prompts_of_lengths(Q_LENGTHS, seed=3)
    if tp == 2:
        from distributed_utils import run_distributed

        for tokens in run_distributed(_fp8_rank, 2, path, prompts, timeout=200):
            assert assert_greedy_matches(tokens, ref, prompts) <= 1
        return
    llm = LLM(path, max_model_len=128, kv_cache_memory_bytes=1 << 22)
    assert "weights: fp8 e4m3 (8x16 blocks)" in engine_log.text
    # 3 DeltaNet layers x (in_proj_qkv, in_proj_z, out_proj), 1 attention x (qkv, o), 4 MoE layers
    # x (experts' w13 and w2, shared expert's gate_up and down); in_proj_qkv's rows read per part
    assert "weights held compressed as stored: 27 parameters" in engine_log.text
    assert "not held compressed" not in engine_log.text
    assert assert_greedy_matches(_greedy(llm, prompts), ref, prompts) <= 1


def _fp8_rank(rank, world, path, prompts):
    from test_quantization import _greedy

    llm = LLM(path, tensor_parallel_size=2, distributed_executor_backend="external_launcher",
              max_model_len=128, kv_cache_memory_bytes=1 << 22)  # fmt: skip
    return _greedy(llm, prompts)
