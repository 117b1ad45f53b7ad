"""Why a request cannot run, checked before it reaches the scheduler: the one rule every entry point
applies (offline, the server, the mp driver), each failure a message naming the bad field; and
bad words as the token ids the sampler bans."""

from __future__ import annotations

from numbers import Integral
from typing import Any

from expertmesh.sampling_params import SamplingParams


def validate_prompt(ids: list[int], max_model_len: int, capacity: int, vocab_size: int) -> str | None:
    """Why a prompt cannot run (too long, empty, ids outside the vocabulary), or None."""
    if not ids:
        return "the prompt is empty"
    if len(ids) > max_model_len:
        return f"the prompt has {len(ids)} tokens, longer than max_model_len={max_model_len}"
    if len(ids) > capacity:
        return f"the prompt has {len(ids)} tokens, more than the KV cache holds ({capacity})"
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        return f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab_size})"
    return None


def as_token_ids(ids: Any) -> tuple[list[int], str | None]:
    """`ids` as a list of Python ints, or why it is not one (floats, bools, strings, not a list)."""
    if isinstance(ids, (str, bytes, dict)) or not hasattr(ids, "__iter__"):
        return [], f"prompt_token_ids must be a list of integers, got {type(ids).__name__}"
    ids = list(ids)
    bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, Integral)]
    if bad:
        return [], f"prompt_token_ids must be integers; got {bad[:3]!r} ({type(bad[0]).__name__})"
    return [int(t) for t in ids], None


def validate_request(ids: Any, params: Any, max_model_len: int, capacity: int, vocab_size: int) -> str | None:
    """Why a request cannot run, checked before it reaches the scheduler (the one rule every
    entry point applies: offline, the server, the mp driver), or None."""
    if not isinstance(params, SamplingParams):
        return f"sampling params must be a SamplingParams, got {type(params).__name__}"
    ids, error = as_token_ids(ids)
    if error:
        return error
    for name in ("logprobs", "prompt_logprobs"):
        if getattr(params, name) is not None and getattr(params, name) > vocab_size:
            return f"SamplingParams.{name}={getattr(params, name)} exceeds the vocabulary size {vocab_size}"
    for name in ("allowed_token_ids", "logit_bias"):
        outside = [t for t in getattr(params, name) or () if t >= vocab_size]
        if outside:
            return (
                f"SamplingParams.{name}: token ids {outside[:5]} are outside the vocabulary [0, {vocab_size})"
            )
    return validate_prompt(ids, max_model_len, capacity, vocab_size)


def bad_words_token_ids(tokenizer, words: list[str]) -> list[list[int]]:
    """Each bad word as vLLM tokenizes it: as written (leading space stripped) and with one leading
    space, the second kept when it differs in its first token and has the same length."""
    if tokenizer is None:
        raise ValueError("SamplingParams.bad_words needs a tokenizer (the engine has none)")
    out: list[list[int]] = []
    for word in words:
        plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        out += [ids for ids in (plain,) if ids]
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            out.append(spaced)
    return out
