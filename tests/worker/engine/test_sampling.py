"""Sampling: the one definition of the fields, the temperature floor, penalties and min-p, and that no
parameter value can take the engine down (other sessions decode exactly as alone)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from helpers.engine import greedy, make, prompt_ids, run
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from muxworker.client.params import GenerationParams
from muxworker.transport.errors import ContextOverflow, InvalidArgument
from muxworker.transport.sampling import SAMPLING_FIELD_NAMES, TEMPERATURE_FLOOR, SamplingFields
from muxworker.transport.schema import MESSAGES
from muxworker.worker.engine.sampling import Penalties, SamplingError, SamplingParams, processed_probs, sample


def test_one_definition_of_the_sampling_fields():
    """The worker's SamplingParams, the client's GenerationParams and the schema's generate entry
    name the same fields with the same defaults."""
    assert SamplingParams is SamplingFields
    # cache_salt rides beside the sampling fields: it scopes prefix-cache reuse, it samples nothing.
    assert set(MESSAGES["generate"].optional) == set(SAMPLING_FIELD_NAMES) | {"cache_salt"}
    client = {f.name: f for f in dataclasses.fields(GenerationParams)}
    assert set(client) - {"session_id", "cache_salt"} == set(SAMPLING_FIELD_NAMES)
    defaults = SamplingFields()
    for name in SAMPLING_FIELD_NAMES:
        got = GenerationParams("s").__getattribute__(name)
        want = getattr(defaults, name)
        assert (list(got) if name == "stop" else got) == want, name


@pytest.mark.parametrize("t", [0.0, 1e-300, 1e-46, 5e-324, TEMPERATURE_FLOOR / 2])
def test_a_temperature_below_the_floor_is_greedy(t):
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    params = SamplingFields(temperature=t)
    params.validate()
    assert params.greedy
    assert sample(logits, params, torch.Generator().manual_seed(1)) == int(torch.argmax(logits))


def test_a_temperature_at_the_floor_samples_a_finite_distribution():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(0)) * 30
    p = processed_probs(logits, SamplingFields(temperature=TEMPERATURE_FLOOR))
    assert torch.isfinite(p).all() and math.isclose(float(p.sum()), 1.0, rel_tol=1e-5)


def test_min_p_keeps_tokens_near_the_top():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = processed_probs(logits, SamplingFields(temperature=1.0, min_p=0.5))
    assert (p[2:] == 0).all() and torch.allclose(p[:2], torch.tensor([0.625, 0.375]))


def test_penalties_follow_the_hf_and_openai_conventions():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    params = SamplingFields(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    pen = Penalties(params, prompt=[0, 1], vocab_size=4)
    out = pen.apply(logits)
    assert out.tolist() == [1.0, -4.0, 1.0, 0.5]  # repetition: divide positives, multiply negatives
    pen.push(2)
    pen.push(2)
    out = pen.apply(logits)
    # token 2: seen (1.0 / 2) minus presence 0.5 minus frequency 0.25 * 2
    assert out.tolist() == [1.0, -4.0, 0.5 - 0.5 - 0.5, 0.5]


def test_repetition_penalty_changes_greedy_output(tiny_llama_dir):
    """A penalty reaches the engine: greedy decoding with it differs from without (a loop on the tiny model)."""
    outs = []
    for rp in (1.0, 5.0):
        eng = make(tiny_llama_dir)
        eng.open_session("s")
        eng.submit(
            1, "s", prompt_ids(12, 3), SamplingParams(max_new_tokens=24, stop_token_ids=[], repetition_penalty=rp)
        )
        outs.append(run(eng)[1][1]["generated_token_ids"])
    assert outs[0] != outs[1]
    seen = set(prompt_ids(12, 3))
    assert sum(t in seen for t in outs[1]) < sum(t in seen for t in outs[0])


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", -1.0),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("min_p", -0.1),
        ("min_p", 2.0),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 1e9),
        ("presence_penalty", 3.0),
        ("frequency_penalty", -2.5),
        ("top_k", -1),
        ("max_new_tokens", 0),
        ("seed", -1),
        ("stop", [""]),
        ("stop", ["x"] * 65),
        ("stop_token_ids", [True]),
    ],
)
def test_out_of_range_fields_are_refused_by_name(field, value):
    with pytest.raises(InvalidArgument, match=field):
        SamplingFields(**{field: value}).validate(vocab_size=100)


_NUMBERS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=-1e-300, max_value=1e-300),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 0.0, -0.0, 5e-324, 1e-46, 1e-300, 1e308, 2**63, 2**64]),
)
_VALUES = {
    "max_new_tokens": st.one_of(_NUMBERS, st.integers(min_value=1, max_value=8)),
    "temperature": _NUMBERS,
    "top_p": _NUMBERS,
    "top_k": st.one_of(_NUMBERS, st.integers(min_value=0, max_value=10**6)),
    "min_p": _NUMBERS,
    "repetition_penalty": _NUMBERS,
    "presence_penalty": _NUMBERS,
    "frequency_penalty": _NUMBERS,
    "seed": st.one_of(st.none(), _NUMBERS),
    "stop_token_ids": st.one_of(st.none(), st.lists(st.integers(min_value=-5, max_value=10**6), max_size=3)),
}


@pytest.fixture(scope="module")
def neighbour(tiny_model_factory):
    """The greedy tokens of a session decoding alone, to compare with it decoding beside anything."""
    model = tiny_model_factory("llama")
    eng = make(model, max_sessions=2)
    eng.open_session("n")
    eng.submit(1, "n", prompt_ids(10, 4), greedy(6))
    return model, run(eng)[1][1]["generated_token_ids"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.fixed_dictionaries({}, optional=_VALUES))
def test_no_sampling_value_takes_the_engine_down(neighbour, fields):
    model, alone = neighbour
    eng = _engine(model)
    eng.open_session("n")
    eng.open_session("x")
    eng.submit(1, "n", prompt_ids(10, 4), greedy(6))
    eng.step()
    try:
        params = SamplingParams(**{"max_new_tokens": 4, **fields})
        eng.submit(2, "x", prompt_ids(8, 5), params)
    except (InvalidArgument, ContextOverflow):
        pass  # refused by name; nothing was accepted
    res = run(eng)
    assert res[1][1]["generated_token_ids"] == alone
    if 2 in res:
        assert res[2][1]["finish_reason"] in ("length", "stop", "error")


_ENGINES: dict = {}


def _engine(model):
    """One engine per model for the hypothesis examples (sessions are closed after each)."""
    eng = _ENGINES.get(model)
    if eng is None:
        eng = _ENGINES[model] = make(model, max_sessions=2)
    for sid in eng.session_ids():
        eng.close_session(sid)
    return eng


@pytest.mark.parametrize(
    "fields",
    [
        {"repetition_penalty": 5e-324},  # the seen tokens' positive logits / 5e-324: inf in float32
        {"repetition_penalty": 5e-324, "presence_penalty": -2.0, "frequency_penalty": -2.0},
        {"repetition_penalty": 100.0, "presence_penalty": 2.0},
        {"temperature": 1.0001e-5, "repetition_penalty": 1e-30},
        {"temperature": 1e300},
        {"temperature": 1.0, "top_p": 5e-324},  # rounds to 0 in float32: the top token must stay
    ],
)
def test_extreme_valid_penalties_and_temperatures_still_give_a_distribution(fields):
    # Valid but absurd values push tokens to the top or bottom; they never make the logits NaN
    # (an inf penalty times a zero count) or inf (which softmax turns into NaN).
    params = SamplingParams(**{"temperature": 0.7, **fields})
    params.validate(50)
    logits = torch.linspace(-3, 3, 50)
    penalties = Penalties(params, [1, 2, 45, 46], 50)  # seen tokens with negative and positive logits
    penalties.push(7)
    penalties.push(48)
    token = sample(logits, params, torch.Generator().manual_seed(0), penalties)
    assert 0 <= token < 50
    with pytest.raises(SamplingError):  # the model's own NaN logits are still refused
        sample(torch.full((50,), float("nan")), params, torch.Generator().manual_seed(0), penalties)
