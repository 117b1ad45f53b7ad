"""Per-sequence matcher state during decoding: fill the token bitmask of constrained rows and
mask their logits before sampling; advance the matcher with the sampled token after it.

A sequence is constrained when `seq.grammar` holds a GrammarState (set by the engine when
the request is added). Unconstrained rows are never touched, so a constrained request batched
with others leaves their tokens bit for bit what they would be alone.
"""

from __future__ import annotations

import logging
import os
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

log = logging.getLogger("expertmesh")


class GrammarState:
    """A sequence's matcher, the width of its vocabulary (llguidance does not expose it), and its
    next mask: computed on a helper thread as soon as the last token is consumed, so it overlaps
    the next forward pass (llguidance releases the GIL), and waited for only when sampling."""

    __slots__ = ("matcher", "vocab_size", "words", "buffer", "future")

    def __init__(self, matcher: Any, vocab_size: int) -> None:
        self.matcher, self.vocab_size = matcher, vocab_size
        self.words = (vocab_size + 31) // 32
        self.buffer = torch.zeros(self.words, dtype=torch.int32)
        self.future: Future | None = None
        self.prefetch()

    def _fill(self) -> None:
        self.matcher.unsafe_compute_mask_ptr(self.buffer.data_ptr(), self.words * 4)

    def prefetch(self) -> None:
        self.future = _pool().submit(self._fill)

    def mask(self) -> torch.Tensor:
        """The allowed-token bitmask for the matcher's current state."""
        if self.future is None:
            self._fill()
        else:
            self.future.result()
            self.future = None
        return self.buffer


def apply_grammar_masks(logits: torch.Tensor, seqs: list[Any]) -> None:
    """Set to -inf, in place, every logit a constrained sequence's grammar forbids next.
    logits: [B, V] float32, row i belonging to seqs[i]."""
    rows = [i for i, s in enumerate(seqs) if getattr(s, "grammar", None) is not None]
    if not rows:
        return
    batch, vocab = logits.shape
    states = [seqs[i].grammar for i in rows]
    words = max((vocab + 31) // 32, *(s.words for s in states))
    if all(s.words == words for s in states):
        mask = torch.stack([s.mask() for s in states])
    else:  # ids past a grammar's vocabulary: never
        mask = torch.zeros(len(rows), words, dtype=torch.int32)
        for j, s in enumerate(states):
            mask[j, : s.words] = s.mask()
    # Bit k of 32-bit word w allows token 32w + k: on a little-endian host, byte j of the mask
    # holds tokens 8j..8j+7, so one lookup of each byte's 8 bits unpacks the whole mask.
    forbidden = _FORBIDDEN[mask.view(torch.uint8).long()].view(len(rows), words * 32)[:, :vocab]
    forbidden = forbidden.to(logits.device)  # masks are built on the CPU; logits may be elsewhere
    with torch.inference_mode():  # the model's logits are inference tensors
        if len(rows) == batch:
            logits.masked_fill_(forbidden, float("-inf"))
        else:
            index = torch.tensor(rows, device=logits.device)
            logits[index] = logits[index].masked_fill(forbidden, float("-inf"))


_executor: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _executor
    if _executor is None:
        _executor = ThreadPoolExecutor(1, thread_name_prefix="expertmesh-grammar")
    return _executor


def _forget_pool() -> None:
    global _executor
    _executor = None  # a forked child has the pool object but not its thread


os.register_at_fork(after_in_child=_forget_pool)


def _byte_table() -> torch.Tensor:
    byte = torch.arange(256, dtype=torch.int32).unsqueeze(1)
    return ((byte >> torch.arange(8, dtype=torch.int32)) & 1) == 0  # [256, 8]: True = forbidden


_FORBIDDEN = _byte_table()
assert sys.byteorder == "little", "the bitmask unpacking assumes a little-endian host"


def advance(seq: Any, token: int) -> str | None:
    """Feed the sampled token to the sequence's matcher; the finish reason once the grammar is
    complete ("stop"), or None to go on. A token the grammar rejects (it cannot be sampled from a
    masked row) ends the sequence as an error rather than producing unconstrained text."""
    state = getattr(seq, "grammar", None)
    if state is None:
        return None
    matcher = state.matcher
    if state.future is not None:  # a mask computed for a step that did not sample this sequence
        state.future.result()
        state.future = None
    if not matcher.consume_token(token) or matcher.is_error():
        log.warning("sequence %s: the grammar rejected token %d: %s", seq.seq_id, token, matcher.get_error())
        return "error"
    if matcher.is_stopped():
        return "stop"
    state.prefetch()  # the next mask, while the next forward runs
    return None


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
            from expertmesh.structured_outputs.compiler import get_compiler  # llguidance: on first use

            try:
                get_compiler(tokenizer, vocab_size).compile(p.structured_outputs)
            except ValueError as exc:
                raise ValueError(f"SamplingParams.structured_outputs of prompt {i}: {exc}") from exc
