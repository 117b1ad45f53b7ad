"""Tiny random checkpoints made with transformers' own config classes, and its reference outputs."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MixtralConfig,
    PhimoeConfig,
    PreTrainedTokenizerFast,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

VOCAB = 512
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=1,
    eos_token_id=2,
    initializer_range=0.1,  # larger than default: clearer top-1 margins in greedy comparisons
)
MOE = dict(num_experts_per_tok=2)
FAMILIES = {  # family -> (config class, its settings on top of COMMON)
    "phimoe": (PhimoeConfig, dict(MOE, num_local_experts=8, attention_bias=True, lm_head_bias=True)),
    "mixtral": (MixtralConfig, dict(MOE, num_local_experts=8)),
    "qwen2_moe": (
        Qwen2MoeConfig,
        dict(MOE, num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=48),
    ),
    "qwen3_moe": (Qwen3MoeConfig, dict(MOE, num_experts=8, moe_intermediate_size=32, norm_topk_prob=True)),
    "llama": (LlamaConfig, {}),
}


def train_tokenizer(path: str) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained in seconds on English text that ships with CPython."""
    from pydoc_data.topics import topics

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=["<unk>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(topics.values())[:200], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(path)
    return fast


def randomize_1d(model: torch.nn.Module, seed: int) -> None:
    """Norm weights and biases start at 1/0: shake them so a dropped one shows."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)


def make_checkpoint(family: str, path: str, tokenizer_dir: str, seed: int = 0, **overrides) -> str:
    torch.manual_seed(seed)
    cls, settings = FAMILIES[family]
    config = cls(**{**COMMON, **settings, **overrides})
    model = AutoModelForCausalLM.from_config(config).eval()
    randomize_1d(model, seed)
    model.save_pretrained(path)
    for name in os.listdir(tokenizer_dir):
        with (
            open(os.path.join(tokenizer_dir, name), "rb") as src,
            open(os.path.join(path, name), "wb") as dst,
        ):
            dst.write(src.read())
    return path


@contextmanager
def one_thread() -> Iterator[None]:
    """transformers' reference on one thread: its many tiny matmuls ran 13x slower on two threads
    than on one when the two cores were shared with other jobs (measured: a 32-token generate of a
    tiny DeepSeek-V2, 6.1 s against 0.47 s)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy tokens, EOS generated and gone past like the engine's ignore_eos (a
    min_new_tokens would instead forbid EOS, and pick the runner-up where EOS is the argmax)."""
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    model.generation_config.eos_token_id = None
    outs = []
    with one_thread():
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
            outs.append(y[0, len(ids) :].tolist())
    return outs


def hf_last_logits(path: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    with torch.no_grad(), one_thread():
        return [model(torch.tensor([ids])).logits[0, -1].float() for ids in prompts]


def prompts_of_lengths(lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]
