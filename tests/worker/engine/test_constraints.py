"""Constrained decoding in the engine (worker/engine/constraints.py, llguidance) on a tiny random
model: whatever the model would say, every output matches its constraint (a JSON schema, any JSON
object, a regex, a Lark or GBNF grammar), greedy and sampled; a finished grammar ends the turn with
``stop``; one the model cannot finish in max_new_tokens ends with ``length``; bad constraints are
refused before any work, and ``GrammarCompiler.check`` (the HTTP server's, before admission) also
refuses schemas that compile but have no value or no end; constrained and free requests share
forward passes, and n-gram drafting leaves constrained requests alone."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from helpers.engine import make, prompt_ids, run

from muxworker.transport.errors import InvalidArgument
from muxworker.transport.sampling import JSON_LAYOUT, MAX_CONSTRAINT_BYTES
from muxworker.worker.engine.sampling import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "n": {"type": "integer", "minimum": 0, "maximum": 9},
        "tag": {"enum": ["red", "green"]},
    },
    "required": ["ok", "n", "tag"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return make(tiny_llama_dir, max_sessions=8)


def _generate(engine, constraint, *, n=48, temperature=0.0, seed=None, sid="c", prompt=None) -> tuple[str, dict]:
    engine.open_session(sid)
    try:
        params = SamplingParams(
            max_new_tokens=n, temperature=temperature, seed=seed, stop_token_ids=[], constraint=constraint
        )
        engine.submit(1, sid, prompt if prompt is not None else prompt_ids(12, seed=3), params)
        return run(engine)[1]
    finally:
        engine.close_session(sid)


def test_json_schema_outputs_validate_greedy_and_sampled(engine):
    for seed in range(6):
        text, result = _generate(
            engine, {"json_schema": SCHEMA}, n=96, temperature=0.0 if seed == 0 else 1.0, seed=seed
        )
        assert result["finish_reason"] == "stop", (text, result)
        jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize(
    ("constraint", "check"),
    [
        ({"regex": r"[a-c]{2}-[0-9]{3}"}, lambda t: re.fullmatch(r"[a-c]{2}-[0-9]{3}", t)),
        ({"lark": 'start: "yes" | "no" | "maybe"'}, lambda t: t in ("yes", "no", "maybe")),
        ({"gbnf": 'root ::= "x" [0-9] [0-9]'}, lambda t: re.fullmatch(r"x[0-9]{2}", t)),
        ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
    ],
)
def test_each_constraint_kind_holds(engine, constraint, check):
    for seed in range(3):
        text, result = _generate(engine, constraint, n=200, temperature=1.0, seed=seed)
        if "json_object" in constraint and result["finish_reason"] == "length":
            continue  # an object may go on for ever; what was produced is still a JSON prefix
        assert result["finish_reason"] == "stop" and check(text), (constraint, text, result)


def test_a_grammar_the_budget_cannot_finish_ends_with_length(engine):
    text, result = _generate(engine, {"regex": "z{50}"}, n=5)
    assert result["finish_reason"] == "length"
    assert text == "z" * len(text) and len(text) >= 5


def test_bad_constraints_are_refused_before_any_work(engine):
    engine.open_session("bad")
    try:
        for constraint, words in [
            ({"json_schema": {"type": "nonsense"}}, "json_schema"),
            ({"regex": "(("}, "regex"),
            ({"lark": "start: undefined_rule"}, "lark"),
            ({"gbnf": "root ::= ("}, "gbnf"),
            ({"json_schema": {}, "regex": "a"}, "exactly one"),
            ({"yaml": "a"}, "exactly one"),
            ({"json_object": False}, "must be true"),
            ({"regex": ""}, "non-empty"),
            ({"lark": "x" * (MAX_CONSTRAINT_BYTES + 1)}, "at most"),
        ]:
            with pytest.raises(InvalidArgument, match=words):
                engine.submit(7, "bad", [5, 6], SamplingParams(max_new_tokens=4, constraint=constraint))
            assert not engine.has_work() and engine.session_tokens("bad") == []
    finally:
        engine.close_session("bad")


def test_constrained_and_free_requests_share_forward_passes(engine):
    batches: list[list[str]] = []
    engine.on_forward = batches.append
    try:
        free = SamplingParams(max_new_tokens=6, temperature=0, stop_token_ids=[])
        guided = SamplingParams(max_new_tokens=40, temperature=0, stop_token_ids=[], constraint={"regex": "[0-9]{6}"})
        for sid in ("free", "guided"):
            engine.open_session(sid)
        engine.submit(1, "free", prompt_ids(8, seed=1), free)
        engine.submit(2, "guided", prompt_ids(8, seed=2), guided)
        out = run(engine)
    finally:
        engine.on_forward = None
        for sid in ("free", "guided"):
            engine.close_session(sid)
    assert re.fullmatch("[0-9]{6}", out[2][0]) and out[2][1]["finish_reason"] == "stop"
    assert out[1][1]["finish_reason"] == "length"
    assert any(set(b) == {"free", "guided"} for b in batches)
    # The same free request alone gives the same tokens: the masks touch only their own rows.
    text, _ = _generate(engine, None, n=6, prompt=prompt_ids(8, seed=1), sid="alone")
    assert text == out[1][0]


def test_the_session_commits_the_constrained_turn_and_continues(engine):
    engine.open_session("s")
    try:
        ids = prompt_ids(10, seed=4)
        params = SamplingParams(max_new_tokens=20, temperature=0, stop_token_ids=[], constraint={"regex": "ab?c"})
        engine.submit(1, "s", ids, params)
        text, result = run(engine)[1]
        assert result["finish_reason"] == "stop" and re.fullmatch("ab?c", text)
        history = engine.session_tokens("s")
        assert history[: len(ids)] == ids and len(history) == len(ids) + result["completion_tokens"]
        engine.submit(2, "s", history + [7, 8], SamplingParams(max_new_tokens=2, temperature=0, stop_token_ids=[]))
        _, second = run(engine)[2]
        assert second["reused_prompt_tokens"] == len(history) - 1
    finally:
        engine.close_session("s")


def test_ngram_drafting_leaves_constrained_requests_alone(tiny_llama_dir):
    engine = make(tiny_llama_dir, max_sessions=2, speculative="ngram", n_draft=4)
    pattern = "(ab){12}"
    engine.open_session("g")
    engine.submit(
        1,
        "g",
        engine.tokenizer.encode("ab" * 30),
        SamplingParams(max_new_tokens=60, temperature=0, stop_token_ids=[], constraint={"regex": pattern}),
    )
    text, result = run(engine)[1]
    assert re.fullmatch(pattern, text) and result["finish_reason"] == "stop"
    assert result["draft_proposed_tokens"] == 0


def test_an_unbounded_integer_is_held_to_sixteen_digits(engine):
    """A random model would write digits for ever; the schema as given still validates the output."""
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
        "additionalProperties": False,
    }
    for seed in range(3):
        text, result = _generate(engine, {"json_schema": schema}, n=60, temperature=1.0, seed=seed)
        assert result["finish_reason"] == "stop", text
        value = json.loads(text)["n"]
        jsonschema.validate({"n": value}, schema)
        assert abs(value) <= 2**53 - 1


_ENDLESS = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}  # {"a": {"a": ... forced


@pytest.mark.parametrize(
    "constraint, words",
    [
        ({"json_schema": {"$ref": "#"}}, "cannot be followed"),  # compiles, allows no value
        ({"json_schema": _ENDLESS}, "forces"),
        # A tool call's grammar embeds its schema in the one layout (client/serve/tools.py).
        ({"lark": 'start: "<call>" %json ' + json.dumps({**_ENDLESS, "x-guidance": JSON_LAYOUT})}, "forces"),
        ({"json_schema": {"type": "nonsense"}}, "json_schema is not valid"),  # what compile() refuses too
    ],
)
def test_check_refuses_what_the_engine_could_not_follow(engine, constraint, words):
    """What the HTTP server runs before admitting a request (``ModelService.check_constraint``)."""
    with pytest.raises(InvalidArgument, match=words):
        engine.grammars.check(constraint)


def test_check_passes_recursive_and_long_schemas_that_end(engine):
    tree = {
        "type": "object",
        "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}}},
        "required": ["v", "kids"],
    }
    for constraint in ({"json_schema": tree}, {"json_schema": {"const": "x" * 5000}}, {"json_schema": SCHEMA}):
        engine.grammars.check(constraint)
    text, result = _generate(engine, {"json_schema": tree}, n=24)  # and the engine follows them
    if result["finish_reason"] == "stop":
        jsonschema.validate(json.loads(text), tree)


def test_a_grammar_that_cannot_go_on_mid_output_is_the_requests_invalid_argument(engine):
    """Two endless branches: the start is a choice (so ``check`` passes it); once the model picks
    one, llguidance gives up at its limits. The request's own constraint is at fault: an
    InvalidArgument (the HTTP server's 400 or last error event), not an internal error."""
    later = {
        "anyOf": [{"$ref": "#/$defs/a"}, {"$ref": "#/$defs/b"}],
        "$defs": {
            "a": {"type": "object", "properties": {"a": {"$ref": "#/$defs/a"}}, "required": ["a"]},
            "b": {"type": "object", "properties": {"b": {"$ref": "#/$defs/b"}}, "required": ["b"]},
        },
    }
    engine.grammars.check({"json_schema": later})
    engine.open_session("later")
    try:
        params = SamplingParams(max_new_tokens=64, temperature=0, stop_token_ids=[], constraint={"json_schema": later})
        engine.submit(1, "later", prompt_ids(8), params)
        errors = []
        while engine.has_work():
            errors += [out.error for out in engine.step() if out.result is not None]
        assert len(errors) == 1 and isinstance(errors[0], InvalidArgument), errors
        assert "cannot be followed" in str(errors[0])
    finally:
        engine.close_session("later")
    text, result = _generate(engine, {"regex": "ab?c"}, n=8)  # the engine carries on
    assert result["finish_reason"] == "stop"
