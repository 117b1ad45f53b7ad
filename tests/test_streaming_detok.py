"""Incremental detokenization (engine/incremental_text.IncrementalText.decoded, the server's and the
stop strings'): the streamed text equals the tokenizer's decode of the whole output at every step,
while each step decodes only a few tokens (constant work a token, not the whole output again)."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from expertmesh.engine.incremental_text import IncrementalText

TEXTS = [
    "Hello world, this is a test of streaming text.",
    "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u2014 \u65e5\u672c\u8a9e\u306e\u6587"
    " and emoji \U0001f600\U0001f680 end",
    "  leading spaces\n\nnew lines\ttabs   and    runs",
]


@pytest.fixture(scope="module")
def tok(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def _stream(tok, ids: list[int], skip: bool) -> tuple[list[str], list[int]]:
    """Feed `ids` one token a step: the text after each step and the tokens each step decoded."""
    sizes: list[int] = []

    def decode(part: list[int]) -> str:
        sizes.append(len(part))
        return tok.decode(part, skip_special_tokens=skip)

    inc, texts, tokens = IncrementalText(0), [], []
    for t in ids:
        tokens.append(t)
        before = len(sizes)
        texts.append(inc.decoded(tokens, decode))
        sizes[before:] = [sum(sizes[before:])]  # one number a step
    return texts, sizes


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_the_whole_decode_at_every_step(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    texts, sizes = _stream(tok, ids, True)
    assert texts[-1] == tok.decode(ids, skip_special_tokens=True) == text
    for k, got in enumerate(texts):
        whole = tok.decode(ids[: k + 1], skip_special_tokens=True)
        assert whole.startswith(got), (k, got, whole)  # never text the whole decode would not have
        assert len(whole.rstrip("\ufffd")) - len(got) <= 8  # only an unfinished character held back
    assert max(sizes) <= 12, sizes  # a few tokens a step, however long the output


def test_random_ids_and_special_tokens_stay_a_prefix_of_the_whole_decode(tok):
    rng = random.Random(0)
    ids = [rng.randrange(tok.vocab_size) for _ in range(400)]
    for skip in (True, False):
        texts, sizes = _stream(tok, ids, skip)
        final = tok.decode(ids, skip_special_tokens=skip)
        assert final.startswith(texts[-1]) and len(final) - len(texts[-1]) <= 8
        # What the server sends at the end: the rest of the engine's whole decode.
        inc = IncrementalText(0)
        sent = inc.delta(texts[len(texts) // 2], False)
        assert sent + inc.delta(final, True) == final
        assert max(sizes) <= 40, max(sizes)  # bounded by a run of bytes that make no character
