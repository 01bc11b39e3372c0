"""The typed contracts of transport/messages.py agree with the schema table, field for field."""

from __future__ import annotations

import dataclasses

import pytest

from muxworker.transport import messages
from muxworker.transport.checkpoint.segments import SegmentRef
from muxworker.transport.errors import ProtocolError
from muxworker.transport.framing import PROTOCOL_VERSION
from muxworker.transport.messages import (
    RESULT_FIELDS,
    GenerateRequest,
    GenerationResult,
    ModelInfo,
    TokenLogprob,
    WorkerInfo,
)
from muxworker.transport.sampling import SAMPLING_FIELD_NAMES, SamplingFields
from muxworker.transport.schema import MESSAGES, hello_control, validate


def _names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_generate_entry_is_the_request_dataclass_and_the_sampling_fields():
    spec = MESSAGES["generate"]
    fields = [f for f in dataclasses.fields(GenerateRequest) if f.name != "sampling"]
    required = {f.name for f in fields if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
    extra = [f.name for f in fields if f.name not in required]  # optional fields that are not sampling ones
    assert set(spec.required) == {"id"} | required
    assert extra == ["cache_salt"]
    # The sampling fields in their order, then the request's own optional fields.
    assert list(spec.optional) == [*SAMPLING_FIELD_NAMES, *extra]
    assert SAMPLING_FIELD_NAMES == tuple(f.name for f in dataclasses.fields(SamplingFields))
    assert not set(extra) & set(SAMPLING_FIELD_NAMES)  # cache_salt is not a sampling field


def test_a_generate_request_builds_a_valid_control_map():
    request = GenerateRequest("s", [{"text": "hi"}], {"temperature": 0.5, "stop": ["\n"]})
    control = {"kind": "generate", "id": 7, **request.fields()}
    validate(control, sender="client")
    params = request.sampling_fields()
    assert params.temperature == 0.5 and params.stop == ["\n"]
    assert params.max_new_tokens == SamplingFields().max_new_tokens  # the default, defined once
    with pytest.raises(ValueError, match="not sampling fields"):
        GenerateRequest("s", [], {"temprature": 0.5})
    with pytest.raises(ValueError, match="not sampling fields"):
        GenerateRequest("s", [], {"cache_salt": "t"})  # its own field, not a sampling one


def test_a_generate_request_sends_cache_salt_only_when_set():
    assert "cache_salt" not in GenerateRequest("s", [{"text": "hi"}]).fields()
    request = GenerateRequest("s", [{"text": "hi"}], {"temperature": 0.5}, cache_salt="tenant-1")
    control = {"kind": "generate", "id": 7, **request.fields()}
    assert control["cache_salt"] == "tenant-1"
    validate(control, sender="client")
    assert request.sampling_fields() == SamplingFields(temperature=0.5)


def test_hello_entry_is_the_worker_info_dataclass():
    spec = MESSAGES["hello"]
    assert set(spec.required) | set(spec.optional) == _names(WorkerInfo)
    assert set(spec.optional) == {
        f.name for f in dataclasses.fields(WorkerInfo) if f.default is not dataclasses.MISSING
    }


def test_a_hello_round_trips_through_worker_info():
    model = {
        "name": "m",
        "architecture": "LlamaForCausalLM",
        "vocab_size": 10,
        "context_length": 64,
        "has_chat_template": False,
        "path": "/m",
        "bos_token_id": 1,
        "eos_token_ids": [2],
        "draft": None,
    }
    hello = hello_control(
        model=model, backend="torch", device="cpu", dtype="float32", limits={"max_sessions": 4}, readiness="ready"
    )
    validate(hello, sender="worker")
    info = WorkerInfo.from_hello(hello)
    assert info.protocol == PROTOCOL_VERSION and info.limits == {"max_sessions": 4}
    assert info.model == ModelInfo("m", "LlamaForCausalLM", 10, 64, False, "/m", 1, (2,))


def test_token_logprobs_round_trip_the_token_frame():
    entries = [TokenLogprob(5, -0.25, ((5, -0.25), (9, -1.5))), TokenLogprob(7, -3.0, ((2, -0.1), (7, -3.0)))]
    control = {"kind": "token", "id": 1, "text": "ab", "token_ids": [5, 7], **TokenLogprob.to_wire(entries)}
    validate(control, sender="worker")
    assert TokenLogprob.from_wire(control) == entries
    assert TokenLogprob.from_wire({"token_ids": [5]}) == []
    with pytest.raises(ValueError, match="do not match"):
        TokenLogprob.from_wire({**control, "token_ids": [5]})


def test_result_fields_are_the_result_dataclass():
    # Every field but logprobs, which the client gathers from the token frames (not a done field).
    assert RESULT_FIELDS == tuple(f.name for f in dataclasses.fields(GenerationResult) if f.name != "logprobs")
    wire = {name: 0 for name in RESULT_FIELDS} | {"finish_reason": "stop", "prefill_time_s": 0.5}
    result = GenerationResult.from_wire(wire, [1, 2])
    assert result.generated_token_ids == [1, 2] and result.prefill_time_s == 0.5 and result.logprobs is None
    with pytest.raises(ValueError, match="draft_accepted_tokens"):
        GenerationResult.from_wire({k: v for k, v in wire.items() if k != "draft_accepted_tokens"}, [])


def test_the_client_reexports_the_same_classes():
    import muxworker.client as client
    from muxworker.client import params

    assert client.GenerationResult is GenerationResult and client.WorkerInfo is WorkerInfo
    assert client.ModelInfo is ModelInfo and params.RESULT_FIELDS is RESULT_FIELDS


# --- every other request kind -------------------------------------------------------------------

EXAMPLES = [
    messages.OpenSession("s"),
    messages.CloseSession("s"),
    messages.ResetSession("s"),
    messages.ForkSession("s", "t", 12),
    messages.CancelRequest(),
    messages.InfoRequest(),
    messages.TokenizeRequest("hi", add_special_tokens=True),
    messages.DetokenizeRequest({"payload": 0, "dtype": "int32", "shape": [2]}),
    messages.ChatTemplateRequest([{"role": "user", "content": "hi"}], add_generation_prompt=False),
    messages.SaveFileRequest("s", "id", 1 << 30, tag="t2", base=messages.SaveBase("t1", 40, 32, 16)),
    messages.SaveFileRequest("s", "", 1 << 30, position=7),  # an export into a memory file
    messages.RestoreFileRequest(
        "s", "id", 1 << 30, (SegmentRef("a.mxseg", 0, 40, 9000, 7), SegmentRef("b.mxseg", 40, 52, 5000, 8)), "t2"
    ),
    messages.RestoreFileRequest("s", "", 1 << 30, (SegmentRef("checkpoint", 0, 5, 4096, 1),)),  # a host checkpoint
]


def test_every_client_kind_has_one_typed_request():
    client_kinds = {kind for kind, spec in MESSAGES.items() if spec.sender == "client"}
    assert set(messages.REQUESTS) | {"generate"} == client_kinds
    assert {type(m).KIND for m in EXAMPLES} == set(messages.REQUESTS)


@pytest.mark.parametrize("kind", sorted(messages.REQUESTS))
def test_a_request_class_names_exactly_its_schema_fields(kind):
    spec, cls = MESSAGES[kind], messages.REQUESTS[kind]
    derived = {"fds"} if kind in ("save_file", "restore_file") else set()  # counted from the files
    assert _names(cls) | derived == (set(spec.required) | set(spec.optional)) - {"id"}
    optional = {f.name for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
    assert optional - {"tag", "base"} <= set(spec.optional)  # save_file always sends tag and base


@pytest.mark.parametrize("request_", EXAMPLES, ids=lambda m: type(m).__name__)
def test_a_request_round_trips_through_a_valid_control_map(request_):
    control = {"kind": request_.KIND, "id": 3, **request_.fields()}
    validate(control, sender="client")
    assert type(request_).from_control(control) == request_


def test_a_save_file_reply_round_trips_and_a_short_one_is_a_protocol_error():
    reply = messages.SaveFileReply(0, 10, 8192, 5, 4000, {"dtype": "float32"}, {"num_layers": 1})
    assert messages.SaveFileReply.from_wire(reply.to_wire()) == reply
    with pytest.raises(ProtocolError, match="lacks 'geometry'"):
        messages.SaveFileReply.from_wire({k: v for k, v in reply.to_wire().items() if k != "geometry"})


def test_bounded_schema_bounds_only_unbounded_integers_everywhere():
    from muxworker.transport.sampling import SAFE_INTEGER, bounded_schema

    schema = {
        "type": "object",
        "properties": {
            "a": {"type": "integer"},
            "b": {"type": "integer", "minimum": 0},
            "c": {"type": "array", "items": {"anyOf": [{"type": ["integer", "null"]}, {"type": "string"}]}},
        },
        "$defs": {"d": {"type": "integer", "exclusiveMaximum": 5}},
    }
    out = bounded_schema(schema)
    assert out["properties"]["a"] == {"type": "integer", "maximum": SAFE_INTEGER, "minimum": -SAFE_INTEGER}
    assert out["properties"]["b"] == {"type": "integer", "minimum": 0, "maximum": SAFE_INTEGER}
    assert out["properties"]["c"]["items"]["anyOf"][0]["maximum"] == SAFE_INTEGER
    assert out["properties"]["c"]["items"]["anyOf"][1] == {"type": "string"}
    assert out["$defs"]["d"] == {"type": "integer", "exclusiveMaximum": 5, "minimum": -SAFE_INTEGER}
    assert schema["properties"]["a"] == {"type": "integer"}  # a copy
