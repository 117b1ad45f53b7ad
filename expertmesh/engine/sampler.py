"""Sampling from last-position logits, as one pipeline of steps on the rank that samples:

1. `apply_logits_processors`, only on the rows whose params ask for one (the others keep their
   logits bit for bit): logit_bias, allowed_token_ids, bad_words, min_tokens (EOS and stop ids
   masked), then the penalties (repetition over prompt + output, frequency and presence over the
   output), with vLLM's semantics;
2. greedy rows by argmax, the others by temperature, top-k, top-p and min-p, then an exponential
   race so each seeded row draws only from its own generator.

Logprobs are reported from the raw logits (vLLM's default), before step 1.
"""

from __future__ import annotations

from array import array

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


NEG_INF = float("-inf")


def _bad_word_bans(seq: Sequence) -> list[int]:
    """Token ids the bad words forbid next: a one-token word always, a longer word's last token
    when the output so far ends with the word's other tokens (vLLM's rule)."""
    out, bans = seq.output_token_ids, []
    for word in seq.params.bad_words_token_ids:
        prefix = word[:-1]
        if not prefix or (len(out) >= len(prefix) and out[len(out) - len(prefix) :] == prefix):
            bans.append(word[-1])
    return bans


def _process_row(row: torch.Tensor, seq: Sequence, eos_ids: frozenset[int]) -> torch.Tensor:
    """One row's logits [V] after the request's logits processors, in the pipeline's order."""
    p, vocab = seq.params, row.shape[0]
    if p.logit_bias:
        ids = [t for t in p.logit_bias if t < vocab]
        row[ids] += torch.tensor([p.logit_bias[t] for t in ids], dtype=row.dtype)
    if p.allowed_token_ids is not None:
        keep = torch.zeros(vocab, dtype=torch.bool)
        keep[[t for t in p.allowed_token_ids if t < vocab]] = True
        row.masked_fill_(~keep, NEG_INF)
    bans = _bad_word_bans(seq) if p.bad_words_token_ids else []
    if len(seq.output_token_ids) < p.min_tokens:
        bans += list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(eos_ids))
    bans = [t for t in bans if t < vocab]
    if bans:
        before = row[bans].clone()
        row[bans] = NEG_INF
        if not torch.isfinite(row).any():  # a grammar that allows only these ids here: the grammar wins
            row[bans] = before
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(seq.prompt_token_ids) | set(seq.output_token_ids)), dtype=torch.long)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
    if (p.frequency_penalty or p.presence_penalty) and seq.output_token_ids:
        counts = torch.bincount(torch.tensor(seq.output_token_ids), minlength=vocab)[:vocab].to(row.dtype)
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return row


def apply_logits_processors_per_row(
    logits: torch.Tensor, seqs: list[Sequence], eos_ids: frozenset[int] = frozenset()
) -> torch.Tensor:
    """The pipeline one row at a time: the definition `apply_logits_processors` must equal bit for
    bit (tests compare them on random batches)."""
    rows = [i for i, s in enumerate(seqs) if s.params.uses_logits_processors]
    if not rows:
        return logits
    logits = logits.clone()
    for i in rows:
        logits[i] = _process_row(logits[i], seqs[i], eos_ids)
    return logits


def _long(values: list[int]) -> torch.Tensor:
    """int64 tensor of a Python list; through a buffer, several times faster than torch.tensor on
    the thousands of ids a batch's penalties list."""
    if len(values) < 64:
        return torch.tensor(values, dtype=torch.long)
    return torch.frombuffer(array("q", values), dtype=torch.int64)


def _float_column(values: list[float], dtype: torch.dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype).unsqueeze(1)


def apply_logits_processors(
    logits: torch.Tensor, seqs: list[Sequence], eos_ids: frozenset[int] = frozenset()
) -> torch.Tensor:
    """logits [B, V] float32 -> the same, or a copy whose processed rows changed (others untouched).

    The same steps as `_process_row`, each as one tensor operation over all processed rows (a
    per-row loop of small tensor ops cost more than the model's step at large batches); only the
    token-id bookkeeping (which ids a row bans, counts or biases) is gathered in Python."""
    rows = [i for i, s in enumerate(seqs) if s.params.uses_logits_processors]
    if not rows:
        return logits
    vocab, dtype = logits.shape[1], logits.dtype
    sub_seqs = [seqs[i] for i in rows]
    sub = logits[rows]  # a copy
    n = len(rows)

    # logit_bias: one scatter-add (a row's ids are dict keys, so never repeated within the row).
    br, bt, bv = [], [], []
    for j, s in enumerate(sub_seqs):
        for t, v in (s.params.logit_bias or {}).items():
            if t < vocab:
                br.append(j)
                bt.append(t)
                bv.append(v)
    if br:
        sub.index_put_((_long(br), _long(bt)), torch.tensor(bv, dtype=dtype), accumulate=True)

    # allowed_token_ids: one masked fill over the rows that restrict.
    ar, at = [], []
    restrict = [j for j, s in enumerate(sub_seqs) if s.params.allowed_token_ids is not None]
    if restrict:
        for j in restrict:
            ids = [t for t in sub_seqs[j].params.allowed_token_ids if t < vocab]
            ar += [j] * len(ids)
            at += ids
        keep = torch.ones(n, vocab, dtype=torch.bool)
        keep[restrict] = False
        keep[_long(ar), _long(at)] = True
        sub.masked_fill_(~keep, NEG_INF)

    # Bans (bad words, and EOS / stop ids under min_tokens): masked, except on a row they would
    # leave with nothing finite (a grammar that allows only these ids here: the grammar wins).
    zr, zt = [], []
    for j, s in enumerate(sub_seqs):
        p = s.params
        bans = _bad_word_bans(s) if p.bad_words_token_ids else []
        if len(s.output_token_ids) < p.min_tokens:
            bans += list(p.stop_token_ids) + ([] if p.ignore_eos else sorted(eos_ids))
        bans = [t for t in bans if t < vocab]
        zr += [j] * len(bans)
        zt += bans
    if zr:
        ban = torch.zeros(n, vocab, dtype=torch.bool)
        ban[_long(zr), _long(zt)] = True
        banned = sub.masked_fill(ban, NEG_INF)
        alive = torch.isfinite(banned).any(-1, keepdim=True)
        sub = torch.where(alive, banned, sub)

    # Repetition penalty over prompt + output ids: one scatter for the seen mask.
    rep = [j for j, s in enumerate(sub_seqs) if s.params.repetition_penalty != 1.0]
    if rep:
        sr, st = [], []
        for j in rep:
            s = sub_seqs[j]
            ids = s.prompt_token_ids + s.output_token_ids
            sr += [j] * len(ids)
            st += ids
        seen = torch.zeros(n, vocab, dtype=torch.bool)
        seen[_long(sr), _long(st)] = True
        pen = _float_column([s.params.repetition_penalty for s in sub_seqs], dtype)
        sub = torch.where(seen, torch.where(sub > 0, sub / pen, sub * pen), sub)

    # Frequency and presence penalties over output ids: one bincount for the whole batch.
    fp = [j for j, s in enumerate(sub_seqs) if (s.params.frequency_penalty or s.params.presence_penalty)]
    fp = [j for j in fp if sub_seqs[j].output_token_ids]
    if fp:
        flat = [j * vocab + t for j in fp for t in sub_seqs[j].output_token_ids]
        counts = torch.bincount(_long(flat), minlength=n * vocab).view(n, vocab).to(dtype)
        freq = _float_column([s.params.frequency_penalty for s in sub_seqs], dtype)
        pres = _float_column([s.params.presence_penalty for s in sub_seqs], dtype)
        active = torch.zeros(n, 1, dtype=torch.bool)
        active[fp] = True
        sub = torch.where(active, sub - (freq * counts + pres * (counts > 0).to(dtype)), sub)

    logits = logits.clone()
    logits[rows] = sub
    return logits


class Sampler:
    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.eos_ids: frozenset[int] = frozenset()  # the engine's EOS ids: min_tokens masks them

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """logits: [B, V] float32 -> one token id per sequence."""
        apply_grammar_masks(logits, seqs)  # structured outputs hook: constrained rows only, in place
        logits = apply_logits_processors(logits, seqs, self.eos_ids)
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


def prompt_logprobs(logits: torch.Tensor, prompt: list) -> list[list[dict[int, Logprob]]]:
    """logits [R, V] of the rows `prompt` lists ((seq, rows, first token index) each, in order) ->
    per entry, each scored prompt token's logprob and the top `prompt_logprobs`, as vLLM gives."""
    out, at = [], 0
    for seq, rows, first in prompt:
        logp = logits[at : at + len(rows)].log_softmax(-1)
        at += len(rows)
        n = seq.params.prompt_logprobs
        entries = []
        for j, row in enumerate(logp):
            tok = seq.prompt_token_ids[first + j]
            entry: dict[int, Logprob] = {}
            if n:
                values, ids = row.topk(n)
                entry = {
                    int(t): Logprob(float(v), r + 1) for r, (v, t) in enumerate(zip(values, ids, strict=True))
                }
            if tok not in entry:
                entry[tok] = Logprob(float(row[tok]), int((row > row[tok]).sum()) + 1)
            entries.append(entry)
        out.append(entries)
    return out


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
            entry = {
                int(t): Logprob(float(v), r + 1) for r, (v, t) in enumerate(zip(values, ids, strict=True))
            }
        tok = tokens[i]
        if tok not in entry:
            entry[tok] = Logprob(float(row[tok]), int((row > row[tok]).sum()) + 1)
        result.append(entry)
    return result
