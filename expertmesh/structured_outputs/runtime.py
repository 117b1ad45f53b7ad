"""Per-sequence matcher state during decoding: fill the token bitmask of constrained rows and
mask their logits before sampling; advance the matcher with the sampled token after it.

A sequence is constrained when `seq.grammar` holds an llguidance matcher (set by the engine when
the request is added). Unconstrained rows are never touched, so a constrained request batched
with others leaves their tokens bit for bit what they would be alone.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger("expertmesh")
_SHIFTS = torch.arange(32, dtype=torch.int32)


class GrammarState:
    """A sequence's matcher and the width of its vocabulary (llguidance does not expose it)."""

    __slots__ = ("matcher", "vocab_size")

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self.matcher, self.vocab_size = matcher, vocab_size


def apply_grammar_masks(logits: torch.Tensor, seqs: list[Any]) -> None:
    """Set to -inf, in place, every logit a constrained sequence's grammar forbids next.
    logits: [B, V] float32, row i belonging to seqs[i]."""
    rows = [i for i, s in enumerate(seqs) if getattr(s, "grammar", None) is not None]
    if not rows:
        return
    vocab = logits.shape[1]
    states = [seqs[i].grammar for i in rows]
    widths = [(s.vocab_size + 31) // 32 for s in states]
    words = max((vocab + 31) // 32, *widths)
    mask = torch.zeros(len(rows), words, dtype=torch.int32)  # ids past a grammar's vocabulary: never
    for j, (state, width) in enumerate(zip(states, widths)):
        state.matcher.unsafe_compute_mask_ptr(mask[j].data_ptr(), width * 4)
    allowed = ((mask.unsqueeze(-1) >> _SHIFTS) & 1).view(len(rows), words * 32)[:, :vocab].bool()
    index = torch.tensor(rows)
    with torch.inference_mode():  # the model's logits are inference tensors
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))


def advance(seq: Any, token: int) -> str | None:
    """Feed the sampled token to the sequence's matcher; the finish reason once the grammar is
    complete ("stop"), or None to go on. A token the grammar rejects (it cannot be sampled from a
    masked row) ends the sequence as an error rather than producing unconstrained text."""
    state = getattr(seq, "grammar", None)
    if state is None:
        return None
    matcher = state.matcher
    if not matcher.consume_token(token) or matcher.is_error():
        log.warning("sequence %s: the grammar rejected token %d: %s", seq.seq_id, token, matcher.get_error())
        return "error"
    return "stop" if matcher.is_stopped() else None


def start(params: Any, tokenizer: Any, vocab_size: int) -> GrammarState | None:
    """A new sequence's grammar state, or None when its request is unconstrained; ValueError if
    the constraint does not compile."""
    if params.structured_outputs is None:
        return None
    from expertmesh.structured_outputs.compiler import get_compiler  # llguidance only when used

    compiler = get_compiler(tokenizer, vocab_size)
    return GrammarState(compiler.matcher(params.structured_outputs), compiler.vocab_size)


def check_params(params: list[Any], tokenizer: Any, vocab_size: int) -> None:
    """Compile every constraint in `params` before anything runs (offline): ValueError naming the
    prompt whose schema, regex or grammar is invalid."""
    for i, p in enumerate(params):
        if getattr(p, "structured_outputs", None) is not None:
            try:
                start(p, tokenizer, vocab_size)
            except ValueError as exc:
                raise ValueError(f"SamplingParams.structured_outputs of prompt {i}: {exc}") from exc
