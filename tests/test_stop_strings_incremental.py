"""Stop strings are found incrementally (engine/detokenizer.py check_stop): the same stop, at the same
token, with the same cut text as searching the whole output's decode after every token (the
definition), while each token decodes only a few tokens (constant work a token)."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from expertmesh.engine.detokenizer import Detokenizer
from expertmesh.engine.sequence import Sequence
from expertmesh.sampling_params import SamplingParams

TEXT = (
    "The quick brown fox jumps over the lazy dog. Caf\u00e9 na\u00efve \u2014 \u65e5\u672c\u8a9e "
    "emoji \U0001f600 and more words, stop here; then STOP again. END of the text.\n\nNew lines too."
)


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def whole_decode_stop(tok, ids: list[int], params: SamplingParams) -> tuple[int, str, str] | None:
    """The definition: after each token, the first stop (in list order) anywhere in the decode."""
    for n in range(1, len(ids) + 1):
        if n < params.min_tokens:
            continue
        text = tok.decode(ids[:n], skip_special_tokens=params.skip_special_tokens)
        for stop in params.stop_strings:
            at = text.find(stop)
            if at >= 0:
                cut = text[: at + len(stop)] if params.include_stop_str_in_output else text[:at]
                return n, stop, cut
    return None


def run_check_stop(tok, ids: list[int], params: SamplingParams) -> tuple[tuple[int, str, str] | None, int]:
    sizes: list[int] = []
    detok = Detokenizer(tok, ())

    def decode(part: list[int], skip: bool = True) -> str:
        sizes.append(len(part))
        return tok.decode(part, skip_special_tokens=skip)

    detok.decode = decode
    seq = Sequence("r", 0, [1], params, max_len=10_000)
    for n, t in enumerate(ids, 1):
        seq.output_token_ids.append(t)
        reason = detok.check_stop(seq)
        if reason is not None:
            assert reason[0] == "stop"
            return (n, reason[1], seq.text), max(sizes)
    return None, max(sizes, default=0)


@pytest.mark.parametrize("seed", range(6))
def test_incremental_stop_equals_whole_decode(tok, seed: int) -> None:
    rng = random.Random(seed)
    ids = tok.encode(TEXT, add_special_tokens=False)
    words = TEXT.split()
    # Stop strings taken from the text (some spanning tokens, one never present), or a random slice.
    stops = rng.sample(words, 2) + ["never-in-the-text"]
    if seed % 2:
        i = rng.randrange(len(TEXT) - 6)
        stops = [TEXT[i : i + rng.randint(1, 6)]]
    params = SamplingParams(
        max_tokens=500,
        stop=stops,
        include_stop_str_in_output=bool(seed % 3 == 0),
        min_tokens=rng.choice([0, 0, 5, 20]),
    )
    want = whole_decode_stop(tok, ids, params)
    got, largest = run_check_stop(tok, ids, params)
    assert got == want
    # Constant work: no step decodes more than a handful of tokens, whatever the position
    # (min_tokens defers the first scan, which then decodes the deferred tokens once).
    assert largest <= max(8, params.min_tokens + 2)


def test_long_output_without_stop_decodes_a_few_tokens_a_step(tok) -> None:
    ids = tok.encode(TEXT * 20, add_special_tokens=False)
    params = SamplingParams(max_tokens=10_000, stop=["not there"])
    got, largest = run_check_stop(tok, ids, params)
    assert got is None and len(ids) > 300
    assert largest <= 8
