"""Sampling from last-position logits: greedy rows by argmax, the others by temperature, top-k,
top-p and min-p, then an exponential race so each seeded row draws only from its own generator.
"""

from __future__ import annotations

import torch

from expertmesh.engine.sequence import Sequence
from expertmesh.outputs import Logprob
from expertmesh.structured_outputs.runtime import apply_grammar_masks


def _filter(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits: [B, V] float32, already divided by temperature; masked entries become -inf."""
    top_k = [s.params.top_k for s in seqs]
    if any(top_k):
        k = torch.tensor([t if t > 0 else logits.shape[1] for t in top_k]).clamp(max=logits.shape[1])
        kth = logits.sort(dim=-1, descending=True).values.gather(1, (k - 1).unsqueeze(1))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    top_p = torch.tensor([s.params.top_p for s in seqs])
    if (top_p < 1).any():
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token once the mass before it already reaches top_p (keeps at least one).
        drop = (sorted_probs.cumsum(-1) - sorted_probs) >= top_p.unsqueeze(1)
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
    min_p = torch.tensor([s.params.min_p for s in seqs])
    if (min_p > 0).any():
        probs = logits.softmax(-1)
        logits = logits.masked_fill(
            probs < min_p.unsqueeze(1) * probs.max(-1, keepdim=True).values, float("-inf")
        )
    return logits


class Sampler:
    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """logits: [B, V] float32 -> one token id per sequence."""
        apply_grammar_masks(logits, seqs)  # structured outputs hook: constrained rows only, in place
        tokens = logits.argmax(dim=-1)
        rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if rows:
            sub = [seqs[i] for i in rows]
            temps = torch.tensor([s.params.temperature for s in sub]).unsqueeze(1)
            probs = _filter(logits[rows] / temps, sub).softmax(-1)
            noise = torch.empty_like(probs)
            for j, s in enumerate(sub):
                noise[j].exponential_(generator=s.generator or self.generator)
            tokens[rows] = (probs / noise).argmax(dim=-1)
        return tokens.tolist()


def top_logprobs(
    logits: torch.Tensor, seqs: list[Sequence], tokens: list[int]
) -> list[dict[int, Logprob] | None]:
    """Per sequence asking for logprobs: the sampled token's and the top-N, from raw logits."""
    want = [s.params.logprobs for s in seqs]
    if all(w is None for w in want):
        return [None] * len(seqs)
    logp = logits.log_softmax(-1)
    result: list[dict[int, Logprob] | None] = []
    for i, n in enumerate(want):
        if n is None:
            result.append(None)
            continue
        row = logp[i]
        entry: dict[int, Logprob] = {}
        if n:
            values, ids = row.topk(n)
            entry = {int(t): Logprob(float(v), r + 1) for r, (v, t) in enumerate(zip(values, ids))}
        tok = tokens[i]
        if tok not in entry:
            entry[tok] = Logprob(float(row[tok]), int((row > row[tok]).sum()) + 1)
        result.append(entry)
    return result
