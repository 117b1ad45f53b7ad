"""Chunked prefill: with a budget of 64 tokens a step, prompts of 1 to 3,000 tokens give the tokens
(and fp32 logprobs) of one unchunked prefill, for every family from its published config
(test_real_families.FAMILIES, DeepSeek's MLA from test_deepseek.MODELS), on our CPU kernels and
on the torch path; decodes run in every step while a long prompt prefills."""

import dataclasses

import pytest
from real_checkpoints import Sizes
from sweeps import sweep
from test_deepseek import MODELS
from test_real_families import FAMILIES

from expertmesh import LLM, SamplingParams
from expertmesh.cpu import cpu_kernels

BUDGET = 64
SHORT = [1, 7, 40, 64, 65, 150]  # under, at and over the budget (and the shrunk window of 32)
ALL_FAMILIES = sorted(FAMILIES) + ["deepseek-v2-lite", "deepseek-v3"]


def checkpoint_of(real_checkpoint, family: str, positions: int = 512) -> str:
    if family.startswith("deepseek-"):
        source, sizes = MODELS[family.removeprefix("deepseek-")]
        return real_checkpoint(source, sizes=dataclasses.replace(sizes, positions=positions))
    source, overrides = FAMILIES[family]
    return real_checkpoint(source, sizes=Sizes(positions=positions), **overrides)


def prompts(lengths: list[int], seed: int = 7) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


def generate(llm: LLM, ps: list[list[int]], new_tokens: int = 8):
    sp = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=2)
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], sp, use_tqdm=False)
    llm.llm_engine.check_invariants()
    return outs


def assert_same(chunked, whole, what: str) -> None:
    for a, b in zip(chunked, whole, strict=True):
        n = len(a.prompt_token_ids)
        ta, tb = a.outputs[0].token_ids, b.outputs[0].token_ids
        assert ta == tb, f"{what}: prompt of {n} tokens: {ta} != {tb}"
        assert len(a.outputs[0].logprobs) == len(ta)  # one entry per token: none for partial chunks
        for step_a, step_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            for tok, lp in step_a.items():
                assert abs(lp.logprob - step_b[tok].logprob) < 1e-4, f"{what}: prompt of {n} tokens"


def compare(path: str, lengths: list[int], max_len: int, what: str) -> LLM:
    """Chunked (budget 64, prefix caching on) against unchunked without prefix caching."""
    ps = prompts(lengths)
    common = dict(max_model_len=max_len, kv_cache_memory_bytes=1 << 25)
    whole = LLM(path, enable_chunked_prefill=False, enable_prefix_caching=False, **common)
    chunked = LLM(path, max_num_batched_tokens=BUDGET, max_num_seqs=BUDGET, **common)
    assert_same(generate(chunked, ps), generate(whole, ps), what)
    return chunked


@pytest.mark.timeout(120)
# One family per attention kind by default: sinks + window, chunks + NoPE, a sliding window, MLA,
# plain GQA; the rest with -m slow.
@pytest.mark.parametrize(
    "family", sweep(ALL_FAMILIES, ["gpt-oss", "llama4-text", "phi-mini-moe", "deepseek-v3", "mixtral"])
)
def test_short_prompts_chunked_equal_unchunked(family, real_checkpoint):
    llm = compare(checkpoint_of(real_checkpoint, family), SHORT, 256, family)
    assert llm.llm_engine.stats()["steps"] > 8  # the 150-token prompt took three steps to prefill


LONG = ["phi-mini-moe", "deepseek-v2-lite"]  # a sliding window; MLA's latent cache
LONG_SLOW = ["gpt-oss", "llama4-text", "phi-3.5-moe", "qwen3-yarn"]  # sinks; chunks + NoPE; LongRoPE; YaRN


def _long(real_checkpoint, family):
    path = checkpoint_of(real_checkpoint, family, positions=4096)
    compare(path, [3000, 1, 700, 33], 3100, f"{family}, long prompts")


@pytest.mark.timeout(180)
@pytest.mark.parametrize("family", LONG)
def test_long_prompts_chunked_equal_unchunked(family, real_checkpoint):
    _long(real_checkpoint, family)


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", LONG_SLOW)
def test_long_prompts_chunked_equal_unchunked_more_families(family, real_checkpoint):
    _long(real_checkpoint, family)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", ["gpt-oss", "llama4-text", "phi-mini-moe", "deepseek-v2-lite"])
def test_chunks_on_the_torch_path(family, real_checkpoint, monkeypatch):
    """Without our CPU kernels: decode and chunk attention gather blocks and mask with torch."""
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    compare(checkpoint_of(real_checkpoint, family), SHORT, 256, f"{family} (torch path)")


@pytest.mark.timeout(120)
def test_longrope_chunks_rotate_by_the_whole_prompt(real_checkpoint):
    """Phi-3.5-MoE's LongRoPE switches at original_max_position_embeddings (128 shrunk): every
    chunk of a 300-token prompt rotates with the long factors, as the whole prefill does."""
    path = checkpoint_of(real_checkpoint, "phi-3.5-moe")
    compare(path, [300, 100, 129, 127], 400, "phi-3.5-moe across the LongRoPE switch")


@pytest.mark.timeout(60)
def test_a_decode_runs_in_every_step_while_a_long_prompt_prefills(checkpoint):
    llm = LLM(checkpoint("phimoe"), max_model_len=512, max_num_batched_tokens=64, max_num_seqs=8)
    engine = llm.llm_engine
    steps = []
    schedule = engine.scheduler.schedule

    def recording():
        batch = schedule()
        steps.append(([s.request_id for s in batch.decodes], [s.request_id for s in batch.prefills]))
        return batch

    engine.scheduler.schedule = recording
    greedy = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    engine.add_request("short", prompts([5])[0], greedy)
    engine.step()  # the short prompt's prefill; it decodes from now on
    engine.add_request("long", prompts([450], seed=3)[0], SamplingParams(temperature=0.0, max_tokens=2))
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_invariants()
    prefilling = [d for d, p in steps[1:] if "long" in p]
    assert len(prefilling) == -(-450 // 63)  # 63 tokens a step next to the decode
    assert all(d == ["short"] for d in prefilling)


def test_budget_rules_name_the_values():
    from expertmesh.config import SchedulerConfig

    with pytest.raises(ValueError, match="max_num_batched_tokens=64 is smaller than max_num_seqs=256"):
        SchedulerConfig(4096, max_num_batched_tokens=64)
    with pytest.raises(ValueError, match="enable_chunked_prefill=False"):
        SchedulerConfig(4096, 8, 64, enable_chunked_prefill=False)
    assert SchedulerConfig(4096, 8, 64).max_num_batched_tokens == 64  # chunked: a budget below the length


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["serve"]])
def test_cli_flags_reach_the_llm_keywords(command):
    from expertmesh.entrypoints.cli import _engine_kwargs, build_parser

    args = build_parser().parse_args(
        [*command, "--max-num-batched-tokens", "512", "--no-enable-prefix-caching"]
    )
    kw = _engine_kwargs(args, None)
    assert (kw["max_num_batched_tokens"], kw["enable_chunked_prefill"], kw["enable_prefix_caching"]) == (
        512,
        True,
        False,
    )
    args = build_parser().parse_args([*command, "--no-enable-chunked-prefill"])
    assert _engine_kwargs(args, None)["enable_chunked_prefill"] is False
