"""Checking a draft against the target's logits at each drafted position.

A sequence that drafted d tokens has d + 1 rows of logits: row j scores the token after the draft's
first j tokens. Row j is processed exactly as a non-speculative step would process it had the
first j drafted tokens been sampled (the request's logits processors see them as output), so:

- greedy: draft token j is accepted while it is row j's argmax; the first row whose argmax differs
  gives the correction token, and when every draft token is accepted row d gives a bonus token;
- sampled (standard rejection sampling; a prompt-lookup draft is deterministic, so its proposal q
  is one-hot): draft token x at row j is accepted with probability p(x), p being the row's
  distribution after temperature, top-k / top-p / min-p; on rejection the token is drawn from
  normalize(max(p - q, 0)) = p without x; after a whole accepted draft, the bonus token from row d.
  The output then has the target's distribution exactly, and each seeded request draws only from
  its own generator, so a seeded run reproduces.

Logprobs are the raw logits' at each emitted position, as without speculation.
"""

from __future__ import annotations

import torch

from expertmesh.engine.sampler import Sampler, _filter, apply_logits_processors, top_logprobs
from expertmesh.engine.sequence import Sequence


def _processed(row: torch.Tensor, seq: Sequence, prefix: list[int], eos_ids: frozenset[int]) -> torch.Tensor:
    """Row [1, V] after the request's processors, with `prefix` taken as already sampled."""
    if not seq.params.uses_logits_processors:
        return row
    seq.output_token_ids.extend(prefix)
    try:
        return apply_logits_processors(row, [seq], eos_ids)
    finally:
        del seq.output_token_ids[len(seq.output_token_ids) - len(prefix) :]


def _race(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One draw from the (unnormalised) row `probs` [1, V]: the exponential race the sampler runs."""
    noise = torch.empty_like(probs).exponential_(generator=generator)
    return int((probs / noise).argmax(dim=-1))


def verify_one(
    logits: torch.Tensor, seq: Sequence, draft: list[int], eos_ids: frozenset[int], generator: torch.Generator
) -> list[int]:
    """logits [d + 1, V] float32 of one sequence -> the accepted draft tokens and the one after."""
    p = seq.params
    if p.greedy and not p.uses_logits_processors:  # every row's argmax at once
        best = logits.argmax(dim=-1).tolist()
        out = []
        for j, x in enumerate(draft):
            if best[j] != x:
                break
            out.append(x)
        return out + [best[len(out)]]
    out: list[int] = []
    for j in range(len(draft) + 1):
        row = _processed(logits[j : j + 1], seq, out, eos_ids)
        if p.greedy:
            best = int(row.argmax(dim=-1))
            if j < len(draft) and best == draft[j]:
                out.append(best)
                continue
            return out + [best]
        probs = _filter(row / p.temperature, [seq]).softmax(-1)
        if j == len(draft):
            return out + [_race(probs, generator)]
        x = draft[j]
        if float(torch.rand(1, generator=generator)) < float(probs[0, x]):
            out.append(x)
            continue
        residual = probs.clone()
        residual[0, x] = 0.0
        return out + [_race(residual, generator)]
    raise AssertionError("unreachable: the last row always returns")


def verify(
    logits: torch.Tensor, seqs: list[Sequence], drafts: list[list[int]], sampler: Sampler
) -> tuple[list[list[int]], list[list]]:
    """logits [sum(len(d) + 1), V]: each sequence's rows in order -> per sequence, its new tokens
    and their logprobs entries (None where it asks for none). Sequences without a draft go through
    the sampler as one batch, exactly as in a step without speculation."""
    starts, at = [], 0
    for draft in drafts:
        starts.append(at)
        at += len(draft) + 1
    if at != logits.shape[0]:
        raise AssertionError(f"{logits.shape[0]} rows of logits for {at} scheduled positions")
    tokens: list[list[int]] = [[] for _ in seqs]
    logprobs: list[list] = [[] for _ in seqs]
    plain = [i for i, d in enumerate(drafts) if not d]
    if plain:
        rows = logits[[starts[i] for i in plain]]
        sub = [seqs[i] for i in plain]
        sampled = sampler(rows, sub)
        for i, t, lp in zip(plain, sampled, top_logprobs(rows, sub, sampled), strict=True):
            tokens[i], logprobs[i] = [t], [lp]
    for i, (seq, draft) in enumerate(zip(seqs, drafts, strict=True)):
        if not draft:
            continue
        rows = logits[starts[i] : starts[i] + len(draft) + 1]
        new = verify_one(rows, seq, draft, sampler.eos_ids, seq.generator or sampler.generator)
        tokens[i] = new
        # Row j of the raw logits scores the j-th new token, as a plain step's row would.
        logprobs[i] = [
            top_logprobs(rows[j : j + 1], [seq], [t])[0] if seq.params.logprobs is not None else None
            for j, t in enumerate(new)
        ]
    return tokens, logprobs
