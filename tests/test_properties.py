"""Property tests (hypothesis): no value makes SamplingParams fail other than with a TypeError or
ValueError naming its field, and no prompt input makes the engine unusable afterwards."""

import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from expertmesh import LLM, SamplingParams

FIELDS = [
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "min_tokens", "stop",
    "stop_token_ids", "ignore_eos", "logprobs", "skip_special_tokens", "include_stop_str_in_output",
]  # fmt: skip
ANY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True, allow_subnormal=True),
    st.text(max_size=4),
    st.lists(st.one_of(st.integers(-5, 600), st.text(max_size=3), st.floats()), max_size=4),
)
BOUNDED = settings(
    max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow]
)


@BOUNDED
@given(st.dictionaries(st.sampled_from(FIELDS), ANY, max_size=5))
def test_sampling_params_accept_or_name_the_field(kwargs):
    try:
        sp = SamplingParams(**kwargs)
    except (TypeError, ValueError) as exc:
        field = re.match(r"SamplingParams\.(\w+)=", str(exc))
        assert field and field.group(1) in kwargs, str(exc)
        return
    # Accepted: every value is usable by the engine as it stands.
    assert isinstance(sp.n, int) and sp.n >= 1 and isinstance(sp.temperature, float)
    assert sp.temperature >= 0 and sp.temperature == sp.temperature  # finite, not NaN
    assert sp.seed is None or 0 <= sp.seed < 2**63
    assert all(isinstance(s, str) and s for s in sp.stop_strings)
    assert all(isinstance(t, int) for t in sp.stop_token_ids)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(checkpoint("llama"), max_model_len=32, kv_cache_memory_bytes=1 << 20)


TOKEN = st.one_of(
    st.integers(-3, 515),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True),
    st.booleans(),
    st.text(max_size=2),
    st.none(),
)
# Token-id prompts that every engine must serve: ids below the smallest vocab of the test models
# (512), short enough for max_model_len=32 with room to generate.
VALID = st.fixed_dictionaries({"prompt_token_ids": st.lists(st.integers(0, 511), min_size=1, max_size=16)})
PROMPT = st.one_of(
    VALID,
    st.text(max_size=80),
    st.fixed_dictionaries({"prompt_token_ids": st.lists(TOKEN, max_size=40)}),
    st.fixed_dictionaries({"prompt_token_ids": st.one_of(st.integers(), st.text(max_size=5), st.none())}),
    st.fixed_dictionaries({"prompt": st.one_of(st.text(max_size=40), st.integers(), st.none())}),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
    st.integers(),
    st.none(),
)
PARAMS = st.builds(
    SamplingParams,
    n=st.integers(1, 3),
    temperature=st.sampled_from([0.0, 1e-300, 0.7, 5.0]),
    max_tokens=st.integers(1, 40),
    logprobs=st.one_of(st.none(), st.integers(0, 1000)),
    stop=st.one_of(st.none(), st.sampled_from(["a", ["the", "x"]])),
    seed=st.one_of(st.none(), st.integers(0, 2**62)),
)


def _surely_valid(prompt: object, vocab: int) -> bool:
    """A prompt the engine must serve, decided here without the engine: a dict holding only a
    non-empty list of at most 16 plain ints, each a valid id."""
    if not isinstance(prompt, dict) or set(prompt) != {"prompt_token_ids"}:
        return False
    ids = prompt["prompt_token_ids"]
    return (
        isinstance(ids, list) and 1 <= len(ids) <= 16 and all(type(t) is int and 0 <= t < vocab for t in ids)  # noqa: E721 - bool is not a token id
    )


@settings(
    max_examples=60, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(st.tuples(PROMPT, PARAMS), min_size=1, max_size=5))
def test_no_prompt_input_leaves_the_engine_unusable(llm, batch):
    outs = llm.generate([p for p, _ in batch], [sp for _, sp in batch], use_tqdm=False)
    assert len(outs) == len(batch)
    vocab = llm.llm_engine.config.model_config.vocab_size
    for out, (prompt, sp) in zip(outs, batch, strict=True):
        too_many_logprobs = sp.logprobs is not None and sp.logprobs > vocab  # an error by the rules
        if _surely_valid(prompt, vocab) and not too_many_logprobs:  # rejecting everything must not pass
            assert out.error is None, (prompt, out.error)
        if too_many_logprobs:
            assert out.error is not None  # (the prompt's own error, if it has one, comes first)
        if out.error is None:
            assert len(out.outputs) == sp.n and all(
                1 <= len(c.token_ids) <= sp.max_tokens for c in out.outputs
            )
        else:
            assert out.outputs == [] or all(c.finish_reason == "error" for c in out.outputs)
    engine = llm.llm_engine
    engine.check_invariants()
    assert engine.requests == {} and engine.blocks.num_free == engine.blocks.num_blocks
