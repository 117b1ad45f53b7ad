"""Whole offline calls on one rank's engine: prompts in, every request run to its end, outputs
out in input order. `LLM.generate` and the mp workers' `generate` calls both run this."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from tqdm import tqdm

from expertmesh.distributed import watchdog
from expertmesh.distributed.launcher import check_same_inputs
from expertmesh.engine.llm_engine import LLMEngine
from expertmesh.outputs import RequestOutput
from expertmesh.sampling_params import SamplingParams

PromptType = str | dict[str, Any]


def is_replica_leader(engine: LLMEngine) -> bool:
    """The rank that speaks for its DP replica (first pipeline stage, TP rank 0)."""
    groups = engine.groups
    return groups.tp.rank_in_group == 0 and groups.pp.rank_in_group == 0


def generate(
    engine: LLMEngine,
    prompts: list[Any],
    params: list[SamplingParams],
    ids: Iterator[int],
    use_tqdm: bool = False,
) -> list[RequestOutput]:
    """Run `prompts` to completion; whatever stops the call (an error, Ctrl-C) aborts its requests."""
    order: list[str] = []
    done: dict[str, RequestOutput] = {}
    watchdog.set_doing("in generate")
    try:
        for prompt, sp in zip(prompts, params, strict=True):
            order.append(_add(engine, str(next(ids)), prompt, sp))
        check_same_inputs(engine.groups, [engine.requests[r] for r in order], params)
        bar = tqdm(total=len(order), desc="Processed prompts", disable=not use_tqdm, dynamic_ncols=True)
        for out in engine.step_until_none_left():
            done[out.request_id] = out
            bar.update(1)
        bar.close()
    except BaseException:
        for rid in order:
            engine.abort_request(rid)
        raise
    finally:
        watchdog.set_doing("outside generate (in the user's script)")
    return [done[r] for r in order]


def _add(engine: LLMEngine, rid: str, prompt: Any, params: SamplingParams) -> str:
    """Tokenize and queue one prompt; one that cannot be tokenized fails alone, with its error."""
    try:
        text, token_ids = tokenize_prompt(engine.tokenizer, prompt)
    except Exception as exc:  # a bad prompt (or one the tokenizer chokes on) fails alone
        engine.add_failed_request(rid, prompt if isinstance(prompt, str) else None, str(exc))
        return rid
    engine.add_request(rid, token_ids, params, text)
    return rid


def tokenize_prompt(tokenizer: Any, prompt: PromptType) -> tuple[str | None, Any]:
    """(text, token ids) of a str prompt or a vLLM dict prompt; ids are checked by the engine."""
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            return prompt.get("prompt"), prompt["prompt_token_ids"]
        if "prompt" not in prompt:
            raise ValueError(
                f"a dict prompt needs 'prompt' or 'prompt_token_ids'; got keys {sorted(map(str, prompt))}"
            )
        prompt = prompt["prompt"]
    if not isinstance(prompt, str):
        raise TypeError(f"a prompt must be a str or a dict, got {type(prompt).__name__}")
    if tokenizer is None:
        raise ValueError("this model has no tokenizer; pass prompts as {'prompt_token_ids': [...]}")
    return prompt, tokenizer(prompt)["input_ids"]
