"""Structured outputs offline (SamplingParams.structured_outputs, llguidance): JSON that validates
with `jsonschema`, regex / choice / grammar outputs that match, greedy and sampled, each ending with
finish_reason "stop"; greedy decoding under a regex equal to a plain-Python reference decoder; bad
constraints rejected before anything runs; unconstrained neighbours bit for bit unchanged."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from expertmesh import LLM, SamplingParams
from expertmesh.structured_outputs import StructuredOutputsParams as SO

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 18, "maximum": 99},
        "color": {"enum": ["red", "green", "blue"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 10}, "zip": {"type": "integer"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "color", "address", "tags"],
    "additionalProperties": False,
}
SCORES = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"id": {"type": "integer", "minimum": -5, "maximum": 5}, "ok": {"type": "boolean"}},
        "required": ["id", "ok"],
        "additionalProperties": False,
    },
    "minItems": 2,
    "maxItems": 4,
}
PROMPTS = ["Describe a person as JSON:", "Hello", "The weather today is", "1, 2, 3,"]


@pytest.fixture(scope="module")
def llm():
    return LLM(None, max_model_len=512, kv_cache_memory_bytes=1 << 23, seed=3)


def _run(llm, prompts, params):
    return [o.outputs for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("schema", [PERSON, SCORES], ids=["person", "scores"])
def test_json_schema_validates_greedy_and_sampled(llm, schema):
    params = [SamplingParams(temperature=0, max_tokens=200, structured_outputs=SO(json=schema))]
    params += [
        SamplingParams(
            temperature=1.0, seed=s, max_tokens=200, structured_outputs=SO(json=json.dumps(schema))
        )
        for s in range(3)
    ]
    for (out,), p in zip(_run(llm, PROMPTS, params), params, strict=True):
        assert out.finish_reason == "stop", (p, out.text)
        jsonschema.validate(json.loads(out.text), schema)
        assert "\n" not in out.text  # whitespace outside strings is bounded (compact JSON)


def test_json_object_regex_choice_grammar(llm):
    gbnf = 'root ::= "(" item ("," item)* ")"\nitem ::= [a-c] | "x" [0-9]'
    lark = 'start: "go " DIR\nDIR: "left" | "right"'
    cases = [
        (SO(json_object=True), lambda t: isinstance(json.loads(t), dict)),
        (SO(regex=r"[0-9]{3}-[a-z]{2,4}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
        (SO(choice=["yes", "no", "maybe so"]), lambda t: t in ("yes", "no", "maybe so")),
        (SO(grammar=gbnf), lambda t: re.fullmatch(r"\((?:[a-c]|x[0-9])(?:,(?:[a-c]|x[0-9]))*\)", t)),
        (SO(grammar=lark), lambda t: t in ("go left", "go right")),
    ]
    for temperature in (0.0, 0.9):
        params = [
            SamplingParams(temperature=temperature, seed=5, max_tokens=80, structured_outputs=c)
            for c, _ in cases
        ]
        outs = _run(llm, [PROMPTS[i % len(PROMPTS)] for i in range(len(cases))], params)
        for (out,), (constraint, ok) in zip(outs, cases, strict=True):
            assert out.finish_reason == "stop" and ok(out.text), (constraint, out.text)


def test_greedy_regex_equals_a_plain_reference_decoder(llm):
    """Reference: at each step the full unconstrained distribution (logprobs over the vocabulary),
    and the best token whose text keeps the output a prefix of some match of [0-9]{3}."""
    tok = llm.get_tokenizer()
    vocab = len(tok)
    prompt = tok("Count: 1, 2,")["input_ids"]
    ids: list[int] = []
    text = ""
    while len(text) < 3:
        (out,) = _run(
            llm,
            [{"prompt_token_ids": prompt + ids}],
            SamplingParams(temperature=0, max_tokens=1, logprobs=vocab),
        )[0:1][0]
        ranked = sorted(out.logprobs[0].items(), key=lambda kv: -kv[1].logprob)
        for token, _ in ranked:
            piece = tok.decode([token])
            if piece and piece.isdigit() and piece.isascii() and len(text + piece) <= 3:
                ids.append(token)
                text += piece
                break
    params = SamplingParams(temperature=0, max_tokens=10, structured_outputs=SO(regex="[0-9]{3}"))
    (got,) = _run(llm, [{"prompt_token_ids": prompt}], params)[0]
    assert got.text == text and got.token_ids[: len(ids)] == ids and got.finish_reason == "stop"


def test_unconstrained_requests_unchanged_by_a_constrained_neighbour(llm):
    plain = [
        SamplingParams(temperature=0, max_tokens=12, logprobs=3),
        SamplingParams(temperature=0.8, seed=9, max_tokens=12),
    ]
    alone = _run(llm, PROMPTS[:2], plain)
    constrained = SamplingParams(temperature=0, max_tokens=200, structured_outputs=SO(json=SCORES))
    mixed = _run(
        llm, [PROMPTS[2], PROMPTS[0], PROMPTS[3], PROMPTS[1]], [constrained, plain[0], constrained, plain[1]]
    )
    for a, b in zip(alone, [mixed[1], mixed[3]], strict=True):
        assert a[0].token_ids == b[0].token_ids and a[0].text == b[0].text
        assert a[0].logprobs == b[0].logprobs
    jsonschema.validate(json.loads(mixed[0][0].text), SCORES)


def test_n_sequences_each_constrained(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=150, structured_outputs=SO(json=PERSON))
    (outs,) = _run(llm, [PROMPTS[0]], params)
    assert len(outs) == 3
    for out in outs:
        assert out.finish_reason == "stop"
        jsonschema.validate(json.loads(out.text), PERSON)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({}, "none is set"),
        ({"json": {"type": "object"}, "regex": "a"}, "json, regex"),
        ({"choice": []}, "choice"),
        ({"json": "{not json"}, "json"),
        ({"json_object": False, "grammar": 3}, "grammar"),
    ],
)
def test_params_name_the_bad_fields(kwargs, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        SO(**kwargs)


def test_bad_constraint_is_a_value_error_before_anything_runs_then_the_next_works(llm):
    for bad, needle in [
        (SO(json={"type": "frobnicate"}), "frobnicate"),
        (SO(regex="a(b"), "regex"),
        (SO(grammar='root ::= "a" undefined_rule'), "grammar"),
        (
            SO(
                structural_tag={
                    "triggers": ["<f"],
                    "structures": [{"begin": "<x>", "schema": {}, "end": "</x>"}],
                }
            ),
            "trigger",
        ),
    ]:
        with pytest.raises(ValueError, match=needle):
            llm.generate(
                ["hi", "there"],
                [SamplingParams(max_tokens=4), SamplingParams(structured_outputs=bad)],
                use_tqdm=False,
            )
    assert llm.llm_engine.requests == {}  # nothing was queued
    with pytest.raises(TypeError, match="structured_outputs"):
        SamplingParams(structured_outputs={"json": {}})
    (out,) = _run(
        llm, ["hi"], SamplingParams(temperature=0, max_tokens=20, structured_outputs=SO(choice=["a", "b"]))
    )[0]
    assert out.text in ("a", "b")


def test_structural_tag_constrains_only_inside_the_tag(llm):
    schema = {
        "type": "object",
        "properties": {"x": {"type": "integer"}},
        "required": ["x"],
        "additionalProperties": False,
    }
    tag = {
        "type": "structural_tag",
        "triggers": ["<f="],
        "structures": [{"begin": "<f=add>", "schema": schema, "end": "</f>"}],
    }
    params = [
        SamplingParams(
            temperature=1.0, seed=s, max_tokens=60, structured_outputs=SO(structural_tag=json.dumps(tag))
        )
        for s in range(4)
    ]
    for (out,) in _run(llm, PROMPTS, params):
        for body in re.findall(r"<f=add>(.*?)</f>", out.text, re.S):
            jsonschema.validate(json.loads(body), schema)
        opened = out.text.count("<f=add>")
        assert out.text.count("</f>") >= opened - (out.finish_reason == "length")


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "layout", [{"data_parallel_size": 2}, {"tensor_parallel_size": 2}], ids=["dp2", "tp2"]
)
def test_constrained_answers_under_mp_layouts_equal_one_process(llm, layout):
    """The mask is applied where the token is sampled and every rank advances its matchers with the
    token it hears of, so the answers are one process's, bit for bit."""
    params = [
        SamplingParams(temperature=0, max_tokens=200, structured_outputs=SO(json=PERSON)),
        SamplingParams(temperature=1.0, seed=1, max_tokens=200, structured_outputs=SO(json=SCORES)),
        SamplingParams(
            temperature=0.9, seed=2, max_tokens=40, structured_outputs=SO(regex=r"[a-z]+ [0-9]{2}")
        ),
        SamplingParams(temperature=0, max_tokens=12),
    ]
    expected = _run(llm, PROMPTS, params)
    multi = LLM(
        None,
        max_model_len=512,
        kv_cache_memory_bytes=1 << 23,
        seed=3,
        distributed_executor_backend="mp",
        **layout,
    )
    try:
        got = _run(multi, PROMPTS, params)
        with pytest.raises(ValueError, match="frobnicate"):
            multi.generate(
                ["x"], SamplingParams(structured_outputs=SO(json={"type": "frobnicate"})), use_tqdm=False
            )
    finally:
        multi.shutdown()
    assert [[(o.token_ids, o.text, o.finish_reason) for o in outs] for outs in got] == [
        [(o.token_ids, o.text, o.finish_reason) for o in outs] for outs in expected
    ]


def test_a_bad_constraint_reaching_the_engine_fails_that_request_only(llm):
    engine = llm.llm_engine
    tok = llm.get_tokenizer()
    ids = tok("hello")["input_ids"]
    bad = engine.add_request("bad", ids, SamplingParams(structured_outputs=SO(regex="(")))
    good = engine.add_request("good", ids, SamplingParams(temperature=0, max_tokens=5))
    assert bad.error and "regex" in bad.error and good.error is None
    outs = {o.request_id: o for o in engine.step_until_none_left()}
    assert outs["bad"].error and len(outs["good"].outputs[0].token_ids) == 5
    engine.check_invariants()


# Per DP rank: its prompts and params (constrained and not, greedy and seeded).
_SEEDED = dict(temperature=1.0, seed=4, max_tokens=200)
DP_LOADS = [
    (
        PROMPTS[:2],
        [
            SamplingParams(temperature=0, max_tokens=200, structured_outputs=SO(json=PERSON)),
            SamplingParams(temperature=0, max_tokens=10),
        ],
    ),
    (
        PROMPTS[2:],
        [
            SamplingParams(**_SEEDED, structured_outputs=SO(json=SCORES)),
            SamplingParams(temperature=0.9, seed=5, max_tokens=40, structured_outputs=SO(choice=["x", "yz"])),
        ],
    ),
]


def _dp2_tp2_rank(rank, world):
    llm = LLM(
        None, tensor_parallel_size=2, data_parallel_size=2, distributed_executor_backend="external_launcher",
        max_model_len=512, kv_cache_memory_bytes=1 << 23, seed=3,
    )  # fmt: skip
    dp = llm.llm_engine.vllm_config.parallel_config.data_parallel_rank
    prompts, params = DP_LOADS[dp]
    outs = llm.generate(prompts, params, use_tqdm=False)
    return dp, [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in outs]


@pytest.mark.timeout(300)
def test_constrained_answers_under_gloo_dp2_tp2_equal_one_process(llm):
    from distributed_utils import run_distributed

    expected = [
        [(o[0].token_ids, o[0].finish_reason) for o in _run(llm, prompts, params)]
        for prompts, params in DP_LOADS
    ]
    for dp, got in run_distributed(_dp2_tp2_rank, 4, timeout=280):
        assert got == expected[dp], dp


def test_structural_tag_admits_valid_tags_only(llm):
    """The compiled structural tag on text tokenized by the model's tokenizer: free text and a
    valid tag body pass; a body against its schema is refused at the offending token."""
    from expertmesh.structured_outputs.compiler import get_compiler

    schema = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    tag = {"triggers": ["<f="], "structures": [{"begin": "<f=add>", "schema": schema, "end": "</f>"}]}
    tok = llm.get_tokenizer()
    compiler = get_compiler(tok, llm.llm_engine.config.model_config.vocab_size)
    so = SO(structural_tag=tag)
    for text, ok in [
        ('Sure: <f=add>{"x":12}</f> done.', True),
        ("No tags at all.", True),
        ('Bad: <f=add>{"y":1}</f>', False),
        ('Bad: <f=add>{"x":"one"}</f>', False),
    ]:
        matcher = compiler.matcher(so)
        accepted = matcher.consume_tokens(tok(text, add_special_tokens=False)["input_ids"])
        assert accepted == ok and matcher.is_error() != ok, text


def test_unbounded_integers_end_and_literals_are_kept(llm):
    """An integer without bounds is held to +-(2**53 - 1) so a small model's digits end; `const`
    and `enum` values are data, never rewritten (an object literal gets no additionalProperties)."""
    literal = {"type": "object", "kind": "x"}
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer"},
            "m": {"type": ["integer", "null"]},
            "lit": {"const": literal},
            "pick": {"enum": [{"type": "integer"}, 3]},
        },
        "required": ["n", "m", "lit", "pick"],
    }
    params = [
        SamplingParams(
            temperature=t,
            seed=s,
            max_tokens=120,
            structured_outputs=SO(json=schema, disable_additional_properties=True),
        )
        for t, s in ((0, None), (1.0, 1), (1.0, 2), (1.0, 3))
    ]
    for (out,) in _run(llm, PROMPTS, params):
        assert out.finish_reason == "stop", out.text
        value = json.loads(out.text)
        jsonschema.validate(value, {**schema, "additionalProperties": False})
        assert value["lit"] == literal and abs(value["n"]) < 2**53
