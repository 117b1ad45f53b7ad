"""Every family, one process: greedy tokens equal transformers' generate; logits close in fp32."""

import pytest
import torch
from checkpoints import FAMILIES, hf_greedy, hf_last_logits, prompts_of_lengths
from expect import assert_tokens_equal

from expertmesh import LLM, SamplingParams

LENGTHS = [1, 3, 7, 12, 20, 33, 5, 48]  # 8 prompts of different lengths, submitted together
NEW_TOKENS = 32


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_tokens_and_logits_match_transformers(family, checkpoint):
    path = checkpoint(family)
    prompts = prompts_of_lengths(LENGTHS, seed=1)
    llm = LLM(path, max_model_len=256, kv_cache_memory_bytes=1 << 24)
    greedy = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    expected = hf_greedy(path, prompts, NEW_TOKENS)
    for prompt, out, ref in zip(prompts, outs, expected, strict=True):
        assert out.prompt_token_ids == prompt
        what = f"{family}: prompt of {len(prompt)} tokens"
        assert_tokens_equal(out.outputs[0].token_ids, ref, what, length=NEW_TOKENS)
        assert out.outputs[0].finish_reason == "length"

    # Full-vocabulary logprobs of the first generated token == transformers' last-position logits.
    vocab = llm.llm_engine.config.model_config.vocab_size
    one = SamplingParams(temperature=0.0, max_tokens=1, logprobs=vocab)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], one, use_tqdm=False)
    for out, logits in zip(outs, hf_last_logits(path, prompts), strict=True):
        assert len(out.outputs[0].logprobs) == 1 and len(out.outputs[0].token_ids) == 1
        ours = torch.full((vocab,), float("nan"))
        for token, lp in out.outputs[0].logprobs[0].items():
            ours[token] = lp.logprob
        torch.testing.assert_close(ours, logits.log_softmax(-1), atol=2e-4, rtol=1e-4)


@pytest.mark.timeout(60)
def test_text_prompts_and_output_fields(checkpoint):
    path = checkpoint("mixtral")
    llm = LLM(path, max_model_len=128, kv_cache_memory_bytes=1 << 22)
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    outs = llm.generate(["Hello, my name is", "The", "return statement"], sp)
    tok = llm.get_tokenizer()
    assert [o.prompt for o in outs] == ["Hello, my name is", "The", "return statement"]
    for out in outs:
        assert out.prompt_token_ids == tok(out.prompt)["input_ids"]
        assert len(out.outputs[0].token_ids) == 5
        assert out.outputs[0].text == tok.decode(out.outputs[0].token_ids, skip_special_tokens=True)
    # A single string gives a one-element list; the engine config carries vLLM's alias.
    assert len(llm.generate("Hello", sp, use_tqdm=False)) == 1
    pc = llm.llm_engine.vllm_config.parallel_config
    assert (pc.data_parallel_rank, pc.data_parallel_size) == (0, 1)
