"""Continuous batching and preemption: a tiny KV budget changes scheduling, never tokens."""

import pytest
from checkpoints import prompts_of_lengths

from expertmesh import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _run(llm, prompts, sp=GREEDY):
    return [
        o.outputs[0].token_ids
        for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
    ]


@pytest.mark.timeout(90)
def test_preemption_gives_identical_tokens_and_frees_every_block(checkpoint):
    path = checkpoint("phimoe")
    prompts = prompts_of_lengths([5, 17, 30, 9, 41, 2, 26, 13], seed=3)
    roomy = LLM(path, max_model_len=128, kv_cache_memory_bytes=1 << 24)
    expected = _run(roomy, prompts)

    # 80 tokens of KV in all: 8 sequences of up to 65 tokens must take turns and be preempted.
    per_block = roomy.llm_engine.runner.block_bytes()
    tight = LLM(path, max_model_len=128, kv_cache_memory_bytes=per_block * 5, block_size=16)
    engine = tight.llm_engine
    assert engine.blocks.num_blocks == 5
    got = _run(tight, prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert engine.scheduler.num_preemptions > 0
    assert got == expected
    assert engine.blocks.num_free == engine.blocks.num_blocks
    assert not engine.scheduler.running and not engine.scheduler.waiting


@pytest.mark.timeout(60)
def test_batch_limits_do_not_change_tokens(checkpoint):
    path = checkpoint("qwen3_moe")
    prompts = prompts_of_lengths([3, 8, 15, 4, 22], seed=4)
    base = _run(LLM(path, max_model_len=64, kv_cache_memory_bytes=1 << 22), prompts)
    narrow = LLM(
        path, max_model_len=64, kv_cache_memory_bytes=1 << 22, max_num_seqs=2, max_num_batched_tokens=64
    )
    assert _run(narrow, prompts) == base
    assert narrow.llm_engine.stats()["steps"] > 24  # only two at a time: many more steps


@pytest.mark.timeout(60)
def test_outputs_stop_at_max_model_len(checkpoint):
    path = checkpoint("mixtral")
    llm = LLM(path, max_model_len=32, kv_cache_memory_bytes=1 << 22)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts_of_lengths([30, 10], seed=5)], GREEDY, use_tqdm=False
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 22]
    assert all(o.outputs[0].finish_reason == "length" for o in outs)
