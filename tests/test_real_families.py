"""Every family from its published config.json, shrunk (tests/real_configs, real_checkpoints.shrink):
prompts of several lengths (past the shrunk sliding window and attention chunk, decoding past them
too), submitted together, against transformers: fp32 logprobs and greedy tokens, and bf16."""

import pytest
import torch
import transformers
from real_checkpoints import Sizes, published
from sweeps import sweep

from expertmesh import LLM, SamplingParams
from expertmesh.cpu import cpu_kernels

WINDOW = Sizes().window
LENGTHS = [1, 7, WINDOW - 3, WINDOW + 1, 70, 70]  # across the window / chunk of 32
NEW_TOKENS = 20
TOP = 20  # logprobs returned at every step (the whole vocabulary's at the first)


def _text_only(name: str, **changes) -> dict:
    """A text-only checkpoint of a multimodal config: its text_config as a Llama4ForCausalLM."""
    full = published(name)
    return {**full["text_config"], "architectures": ["Llama4ForCausalLM"], **changes}


# name -> (published config or derived dict, overrides applied after shrinking). Derived variants
# say what they change and why (tests/real_configs/README.md).
FAMILIES = {
    "gpt-oss": ("gpt-oss-20b", {}),
    "olmoe": ("olmoe-1b-7b-0924", {}),
    "glm-4.5-air": ("glm-4.5-air", {}),
    # GLM-4.5 / 4.6: the Air layout with per-head q/k norm and a routed scaling factor of 2.5.
    "glm-4.5": ("glm-4.5-air", {"use_qk_norm": True, "routed_scaling_factor": 2.5}),
    "granite": ("granite-3.1-3b-a800m-instruct", {}),
    # Granite-MoE with a shared expert: granitemoeshared's model type on the same config.
    "granite-shared": (
        "granite-3.1-3b-a800m-instruct",
        {
            "architectures": ["GraniteMoeSharedForCausalLM"],
            "model_type": "granitemoeshared",
            "shared_intermediate_size": 48,
        },
    ),  # fmt: skip
    "llama4": ("llama-4-scout-17b-16e", {}),  # the text tower of Llama4ForConditionalGeneration
    "llama4-text": (_text_only("llama-4-scout-17b-16e"), {}),
    # Maverick's layout: dense layers interleaved with MoE ones (interleave_moe_layer_step 2).
    "llama4-interleaved": (
        _text_only("llama-4-scout-17b-16e", interleave_moe_layer_step=2, moe_layers=None),
        {},
    ),
    # Qwen3-MoE with the YaRN block its model card gives for long contexts.
    "qwen3-yarn": (
        "qwen3-30b-a3b",
        {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}},
    ),
    "phi-3.5-moe": ("phi-3.5-moe", {}),
    "phi-mini-moe": ("phi-mini-moe", {}),
    "mixtral": ("mixtral-8x7b-instruct", {}),
    "qwen1.5-moe": ("qwen1.5-moe-a2.7b", {}),
    # 2026 (tests/real_configs/2026/SOURCES.md)
    "minimax-m2.7": ("2026/minimax-m2.7", {}),
    "minimax-m2.5": ("2026/minimax-m2.5", {}),
    "kimi-k2.5": ("2026/kimi-k2.5", {}),  # the DeepSeek-V3 text tower, vision skipped
    # two MLA blocks and two dense MLPs a layer beside the MoE; 8 real + 4 identity experts, top-4
    # transformers takes the rope width from head_dim (its class default 64, the published
    # qk_rope_head_dim): the shrunk file states it at the shrunk qk_rope_head_dim.
    "longcat-flash": ("2026/longcat-flash-chat", {"head_dim": Sizes().qk_rope_head_dim}),
    # MLA with the lightning indexer; index_topk 12 below the longer prompts: selection happens
    "deepseek-v3.2": ("2026/deepseek-v3.2", {}),
    # the same blocks; the indexer's RoPE in pairs; value heads as wide as the q/k heads, as published
    "glm-5": ("2026/glm-5", {"v_head_dim": Sizes().qk_nope_head_dim + Sizes().qk_rope_head_dim}),
}


def hf_model(path: str, dtype=torch.float32):
    if transformers.AutoConfig.from_pretrained(path).model_type == "kimi_k25":
        # Its auto_map names remote code for AutoModelForCausalLM; the native class, text-only input.
        return transformers.AutoModelForImageTextToText.from_pretrained(path, dtype=dtype).eval()
    try:
        loaded = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except ValueError:  # a multimodal checkpoint: its text tower is the reference
        loaded = transformers.Llama4ForConditionalGeneration.from_pretrained(path, dtype=dtype).language_model
    return loaded.eval()


def hf_generate(model, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """transformers' greedy generate; prompts of one length go as one batch (no padding)."""
    with torch.no_grad():
        y = model.generate(
            torch.tensor(prompts),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            use_mtp=False,
        )  # fmt: skip  (MiniMax's `use_mtp: true` would turn on transformers' MTP drafting)
    return y[:, len(prompts[0]) :].tolist()


def hf_logprobs(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """[len(tokens), V]: transformers' log-softmax at each generated position, teacher forced."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0].float()
    return logits[len(prompt) - 1 : len(prompt) - 1 + len(tokens)].log_softmax(-1)


def logprob_errors(out, ref: torch.Tensor) -> torch.Tensor:
    """[steps]: the largest |our logprob - reference| over the tokens we returned at each step."""
    errors = []
    for step, row in zip(out.outputs[0].logprobs, ref, strict=True):
        ids = torch.tensor(list(step))
        ours = torch.tensor([lp.logprob for lp in step.values()])
        assert torch.isfinite(ours).all()
        errors.append((ours - row[ids]).abs().max())
    return torch.stack(errors)


def prompts_for(vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, min(vocab, 512), (n,), generator=g).tolist() for n in LENGTHS]


def _check(family: str, path: str, dtype: str, prompts: list[list[int]]):
    """Our greedy run, with the top-20 logprobs at every step and the full vocabulary's at the first
    -> (tokens, errors per step, transformers' argmax per step) against transformers'
    teacher-forced forward over the same tokens."""
    llm = LLM(path, dtype=dtype, max_model_len=128, kv_cache_memory_bytes=1 << 23)
    vocab = llm.llm_engine.config.model_config.vocab_size
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOP)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    first = SamplingParams(temperature=0.0, max_tokens=1, logprobs=vocab)
    firsts = llm.generate([{"prompt_token_ids": p} for p in prompts], first, use_tqdm=False)
    model = hf_model(path, getattr(torch, dtype))
    tokens, errors = [], []
    for prompt, out, whole in zip(prompts, outs, firsts, strict=True):
        ref = hf_logprobs(model, prompt, out.outputs[0].token_ids)
        assert len(whole.outputs[0].logprobs[0]) == vocab
        err = torch.maximum(logprob_errors(out, ref), logprob_errors(whole, ref[:1]).max())
        tokens.append(out.outputs[0].token_ids)
        errors.append((err, ref.argmax(-1).tolist(), ref))
    return tokens, errors, model


def _fp32_check(family: str, path: str):
    prompts = prompts_for(512)
    tokens, errors, model = _check(family, path, "float32", prompts)
    for prompt, toks, (err, argmax, _) in zip(prompts, tokens, errors, strict=True):
        assert toks == argmax, f"{family}: prompt of {len(prompt)} tokens, greedy tokens differ"
        assert err.max() < 2e-4, f"{family}: prompt of {len(prompt)}: |logprob error| per step {err.tolist()}"
    return prompts, tokens, model


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_matches_transformers(family, real_checkpoint):
    """fp32: every step's full-vocabulary logprobs within fp32 tolerance of transformers' forward
    over the same tokens (so every greedy token is transformers' argmax), and transformers'
    `generate` gives the same tokens for the longest prompts (past the window and the chunk,
    decoding further past them)."""
    source, overrides = FAMILIES[family]
    prompts, tokens, model = _fp32_check(family, real_checkpoint(source, **overrides))
    longest = [i for i, p in enumerate(prompts) if len(p) == max(LENGTHS)]
    generated = hf_generate(model, [prompts[i] for i in longest], NEW_TOKENS)
    assert generated == [tokens[i] for i in longest], f"{family}: transformers' generate differs"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", ["gpt-oss", "phi-mini-moe", "llama4-text"])
def test_windows_chunks_and_sinks_on_the_torch_path(family, real_checkpoint, monkeypatch):
    """The same fp32 check without our CPU kernels: decode attention gathers blocks and masks with
    torch (sliding window and sinks: GPT-OSS; a uniform odd window: Phi-mini-MoE; chunks and
    NoPE layers: Llama 4)."""
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    source, overrides = FAMILIES[family]
    _fp32_check(family, real_checkpoint(source, **overrides))


# A family per feature bf16 rounds differently in: sinks, LongRoPE, dense + MoE layers, YaRN, a
# shared expert; the rest with -m slow.
BF16_DEFAULT = ["gpt-oss", "phi-3.5-moe", "llama4-interleaved", "qwen3-yarn", "granite-shared"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", sweep(sorted(FAMILIES), BF16_DEFAULT))
def test_family_bf16_close_to_transformers(family, real_checkpoint):
    """bfloat16 end to end (the top-20 logprobs at every step). These shrunk MoEs are sensitive in
    bf16 (a near-tie in the router moves a token to another expert), so transformers' own bf16
    forward is up to ~0.6 in logprob from its fp32 one here. The check, per prompt: at (all but one
    in five of) the steps our bf16 logprobs are no further from transformers' fp32 forward (same
    tokens, teacher forced) than transformers' bf16 forward is, plus the bf16 tolerance of
    test_cpu_kernels (0.1), and so on average."""
    source, overrides = FAMILIES[family]
    path = real_checkpoint(source, **overrides)
    prompts = prompts_for(512)[3:5]  # past the window and the chunk
    llm = LLM(path, dtype="bfloat16", max_model_len=128, kv_cache_memory_bytes=1 << 23)
    sp = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOP)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    fp32, bf16 = hf_model(path), hf_model(path, torch.bfloat16)
    for prompt, out in zip(prompts, outs, strict=True):
        assert_bf16_bound(family, prompt, out, fp32, bf16)


def assert_bf16_bound(family: str, prompt: list[int], out, fp32, bf16) -> None:
    """Our bf16 logprobs against transformers' fp32 forward over the same tokens, no worse than
    transformers' own bf16 forward plus 0.1 at all but one in five steps and on average."""
    tokens = out.outputs[0].token_ids
    exact = hf_logprobs(fp32, prompt, tokens)
    ours = logprob_errors(out, exact)
    ids = [torch.tensor(list(step)) for step in out.outputs[0].logprobs]  # the same tokens
    theirs_all = (hf_logprobs(bf16, prompt, tokens) - exact).abs()
    theirs = torch.stack([row[i].max() for row, i in zip(theirs_all, ids, strict=True)])
    # A router near-tie can flip a step (either engine's: both show isolated jumps of ~0.5-0.8
    # here), and a flip early in a sequence shifts the later steps of both; a wrong kernel, a
    # lost bias or head is off at most steps and on average. Measured on phi-3.5-moe, 8 prompts
    # x 20 steps: mean error ours 0.105, transformers' bf16 0.116 (float32 partial sums).
    worse = int((ours > theirs + 0.1).sum())
    assert (
        worse <= len(tokens) // 5
        and ours.mean() <= theirs.mean() + 0.1
        and ours.max() < max(1.0, theirs.max() + 0.1)
    ), f"{family} bf16, prompt of {len(prompt)}: ours {ours.tolist()} vs transformers' {theirs.tolist()}"
