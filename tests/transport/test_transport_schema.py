"""The message schema: every kind's required, unknown and mistyped fields, ids, and the handshake."""

from __future__ import annotations

import copy
import math
import pathlib

import numpy as np
import pytest

from muxworker.transport import (
    MAX_REQUEST_ID,
    MESSAGES,
    PROTOCOL_VERSION,
    Frame,
    FrameDecoder,
    FrameLimits,
    InvalidArgument,
    ProtocolError,
    attach_payload,
    check_hello,
    encode_frame,
    hello_control,
    validate,
)
from muxworker.transport.errors import ERRORS, error_table
from muxworker.transport.sampling import SamplingFields
from muxworker.transport.schema import (
    AnyMap,
    AnyOf,
    Bool,
    Choice,
    Int,
    ListOf,
    Nullable,
    Number,
    OneOfStr,
    PayloadRef,
    Record,
    Spec,
    Str,
    schema_table,
)

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "PROTOCOL.md"


def _tokens(payloads: list, n: int = 3, dtype=np.int32) -> dict:
    return attach_payload(payloads, np.arange(n, dtype=dtype))


def _examples() -> dict[str, tuple[dict, list]]:
    """One valid message of every kind, with every optional field present."""
    ex: dict[str, tuple[dict, list]] = {}
    for kind in ("open", "close", "reset"):
        ex[kind] = ({"kind": kind, "id": 1, "session_id": "chat-1"}, [])
    p: list = []
    ex["generate"] = (
        {
            "kind": "generate",
            "id": 2,
            "session_id": "chat-1",
            "prompt": [{"text": "Hello"}, {"tokens": _tokens(p)}],
            "max_new_tokens": 16,
            "temperature": 0.7,
            "top_p": 1,
            "top_k": 40,
            "seed": 1234,
            "stop": ["\n\n"],
            "stop_token_ids": [2],
            "cache_salt": "tenant-1",
        },
        p,
    )
    ex["cancel"] = ({"kind": "cancel", "id": 2}, [])
    ex["tokenize"] = ({"kind": "tokenize", "id": 3, "text": "hi", "add_special_tokens": False}, [])
    p = []
    ex["detokenize"] = ({"kind": "detokenize", "id": 4, "tokens": _tokens(p, 5, np.int64)}, p)
    ex["chat_template"] = (
        {
            "kind": "chat_template",
            "id": 5,
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                {"role": "assistant", "content": None, "tool_calls": [{"name": "f", "arguments": {}}]},
            ],
            "add_generation_prompt": True,
        },
        [],
    )
    ex["save_file"] = (
        {
            "kind": "save_file",
            "id": 9,
            "session_id": "chat-1",
            "fds": 1,
            "tag": "t2",
            "base": {"tag": "t1", "position": 40},
            "identity": "abc",
            "max_bytes": 1 << 30,
            "position": 40,
        },
        [],
    )
    ex["restore_file"] = (
        {
            "kind": "restore_file",
            "id": 10,
            "session_id": "chat-1",
            "fds": 2,
            "identity": "abc",
            "max_bytes": 1 << 30,
            "tag": "t2",
            "saved_id": "chat-0",
            "segments": [
                {"name": "a.mxseg", "start": 0, "end": 40, "file_length": 9000, "header_crc": 7},
                {"name": "b.mxseg", "start": 40, "end": 52, "file_length": 5000, "header_crc": 8},
            ],
        },
        [],
    )
    ex["info"] = ({"kind": "info", "id": 8}, [])
    ex["fork"] = ({"kind": "fork", "id": 11, "session_id": "chat-1", "target_id": "chat-2", "rows": 40}, [])
    ex["hello"] = (
        hello_control(
            model={"name": "tiny", "vocab_size": 100},
            backend="torch",
            device="cpu",
            dtype="float32",
            limits=FrameLimits().to_dict(),
            readiness="ready",
            weights="quantized",
            files=True,
        ),
        [],
    )
    ex["heartbeat"] = ({"kind": "heartbeat"}, [])
    ex["ok"] = ({"kind": "ok", "id": 1, "value": {"sessions": 3}}, [])
    ex["token"] = ({"kind": "token", "id": 2, "text": " world", "token_ids": [1917]}, [])
    ex["done"] = ({"kind": "done", "id": 2, "result": {"finish_reason": "stop", "tokens": 5}}, [])
    ex["error"] = ({"kind": "error", "id": 0, "code": "internal", "message": "boom", "reason": "disk_full"}, [])
    p = []
    ex["tokens"] = ({"kind": "tokens", "id": 3, "tokens": _tokens(p, 2, np.uint32), "text": "hi"}, p)
    ex["text"] = ({"kind": "text", "id": 4, "text": "hello"}, [])
    return ex


EXAMPLES = _examples()
KINDS = sorted(MESSAGES)
OTHER = {"client": "worker", "worker": "client"}


def expected_error(kind: str, control: dict) -> type[Exception]:
    """A client message with a valid id is answered (InvalidArgument); anything else is fatal."""
    rid = control.get("id")
    answerable = MESSAGES[kind].sender == "client" and type(rid) is int and 1 <= rid <= MAX_REQUEST_ID
    return InvalidArgument if answerable else ProtocolError


def wrong_values(spec: Spec) -> list[object]:
    """Values of the wrong type (or out of range) for a field spec."""
    if isinstance(spec, Nullable):
        return [v for v in wrong_values(spec.inner) if v is not None]
    if isinstance(spec, Int):
        return ["1", 1.0, True, None, spec.lo - 1, spec.hi + 1]
    if isinstance(spec, Number):
        return ["0.5", True, None, math.nan, math.inf, [1.0]]
    if isinstance(spec, Bool):
        return [1, 0, "true", None]
    if isinstance(spec, Str):
        too_long = ["x" * (spec.max_bytes + 1)] if spec.max_bytes is not None else []
        return [1, b"bytes", None, ["x"]] + ([""] if spec.nonempty else []) + too_long
    if isinstance(spec, OneOfStr):
        return ["no-such-value", 1, None, ["x"]]
    if isinstance(spec, ListOf):
        inner = wrong_values(spec.item)
        return ["x", {"0": 1}, None, [inner[0]]]
    if isinstance(spec, (AnyMap, Record)):
        return [[], "x", 1, None]
    if isinstance(spec, Choice):
        return [1, "x", {"no_such_key": 1}]
    if isinstance(spec, AnyOf):
        return [1, True, {"a": 1}]
    if isinstance(spec, PayloadRef):
        return [
            [0, "int32", [3]],
            {"payload": "0", "dtype": "int32", "shape": [3]},
            {"payload": 0, "dtype": "complex64", "shape": [3]},
            {"payload": 0, "dtype": "int32", "shape": [-3]},
            {"payload": 0, "dtype": "int32"},
            {"payload": 0, "dtype": "int32", "shape": [3], "extra": 1},
        ]
    raise AssertionError(f"no wrong values for {spec!r}; extend wrong_values() for the new spec type")


def field_spec(kind: str, name: str) -> Spec:
    spec = MESSAGES[kind]
    return spec.required.get(name) or spec.optional[name]


# --- the table and the examples ---------------------------------------------------------------


def test_every_kind_has_an_example():
    assert set(EXAMPLES) == set(MESSAGES)


def test_message_kinds_are_the_documented_set():
    client = {k for k, s in MESSAGES.items() if s.sender == "client"}
    worker = {k for k, s in MESSAGES.items() if s.sender == "worker"}
    assert client == {
        "open",
        "close",
        "reset",
        "fork",
        "generate",
        "cancel",
        "tokenize",
        "detokenize",
        "chat_template",
        "save_file",
        "restore_file",
        "info",
    }
    assert worker == {"hello", "heartbeat", "ok", "token", "done", "error", "tokens", "text"}


@pytest.mark.parametrize("kind", KINDS)
def test_example_is_valid_after_the_wire(kind):
    control, payloads = EXAMPLES[kind]
    sender = MESSAGES[kind].sender
    validate(control, sender=sender, payloads=payloads)
    decoder = FrameDecoder()
    decoder.feed(b"".join(memoryview(b).tobytes() for b in encode_frame(Frame(control, payloads))))
    frame = decoder.next_frame()
    validate(frame.control, sender=sender, payloads=frame.payloads)


@pytest.mark.parametrize("kind", KINDS)
def test_optional_fields_may_be_left_out(kind):
    control, payloads = EXAMPLES[kind]
    spec = MESSAGES[kind]
    minimal = {k: v for k, v in control.items() if k not in spec.optional}
    validate(minimal, sender=spec.sender, payloads=payloads)


@pytest.mark.parametrize("kind", KINDS)
def test_missing_required_fields(kind):
    control, payloads = EXAMPLES[kind]
    spec = MESSAGES[kind]
    for name in spec.required:
        broken = {k: v for k, v in control.items() if k != name}
        with pytest.raises(expected_error(kind, broken), match=f"{kind}: missing required field.*{name}"):
            validate(broken, sender=spec.sender, payloads=payloads)


@pytest.mark.parametrize("kind", KINDS)
def test_unknown_fields_are_rejected(kind):
    control, payloads = EXAMPLES[kind]
    broken = {**control, "temprature": 0.5}
    with pytest.raises(expected_error(kind, broken), match=f"{kind}: unknown field.*'temprature'"):
        validate(broken, sender=MESSAGES[kind].sender, payloads=payloads)


@pytest.mark.parametrize("kind", KINDS)
def test_mistyped_fields_are_rejected(kind):
    control, payloads = EXAMPLES[kind]
    sender = MESSAGES[kind].sender
    checked = 0
    for name in control:
        if name == "kind":
            continue
        for wrong in wrong_values(field_spec(kind, name)):
            broken = {**copy.deepcopy(control), name: wrong}
            with pytest.raises(expected_error(kind, broken), match=f"{kind}: field {name}\\b"):
                validate(broken, sender=sender, payloads=payloads)
            checked += 1
    assert checked >= 4 * (len(control) - 1)


@pytest.mark.parametrize("kind", KINDS)
def test_each_kind_comes_from_one_side_only(kind):
    control, payloads = EXAMPLES[kind]
    other = OTHER[MESSAGES[kind].sender]
    error = InvalidArgument if other == "client" and "id" in control and control["id"] >= 1 else ProtocolError
    with pytest.raises(error, match=f"sent by the {MESSAGES[kind].sender}, not by the {other}"):
        validate(control, sender=other, payloads=payloads)


# --- ids -----------------------------------------------------------------------------------


@pytest.mark.parametrize("rid", [1, 2, 2**32, MAX_REQUEST_ID])
def test_request_id_range_accepts(rid):
    assert MAX_REQUEST_ID == 2**63 - 1
    validate({"kind": "info", "id": rid}, sender="client")
    validate({"kind": "ok", "id": rid}, sender="worker")


@pytest.mark.parametrize("rid", [0, -1, 2**63, 2**64 - 1, True, 1.0, "1", None])
def test_request_id_range_rejects(rid):
    # A request without a valid id cannot be answered: the connection is broken.
    with pytest.raises(ProtocolError, match="field id must be int in 1..2\\*\\*63-1"):
        validate({"kind": "info", "id": rid}, sender="client")
    with pytest.raises(ProtocolError, match="field id"):
        validate({"kind": "ok", "id": rid}, sender="worker")


def test_error_id_zero_means_not_tied_to_a_request():
    validate({"kind": "error", "id": 0, "code": "internal", "message": ""}, sender="worker")
    with pytest.raises(ProtocolError, match="field id"):
        validate({"kind": "error", "id": -1, "code": "internal", "message": ""}, sender="worker")


@pytest.mark.parametrize(
    "sid, ok",
    [
        ("a", True),
        ("a" * 1024, True),
        ("a" * 1025, False),
        ("é" * 512, True),  # 1024 UTF-8 bytes
        ("é" * 513, False),  # 513 characters but 1026 bytes
        ("😀" * 256, True),
        ("😀" * 257, False),
        ("", False),
        (12, False),
        (b"bytes", False),
        (None, False),
    ],
)
def test_session_ids(sid, ok):
    control = {"kind": "open", "id": 1, "session_id": sid}
    if ok:
        validate(control, sender="client")
    else:
        with pytest.raises(InvalidArgument, match="field session_id must be non-empty str of at most 1024 UTF-8 bytes"):
            validate(control, sender="client")


@pytest.mark.parametrize(
    "salt, ok",
    [
        ("t", True),
        ("a" * 256, True),
        ("é" * 128, True),  # 256 UTF-8 bytes
        ("a" * 257, False),
        ("é" * 129, False),  # 129 characters but 258 bytes
        ("", False),
        (7, False),
        (b"tenant", False),
        (["t"], False),
    ],
)
def test_cache_salts(salt, ok):
    control = {"kind": "generate", "id": 1, "session_id": "s", "prompt": [{"text": "hi"}], "cache_salt": salt}
    if ok:
        validate(control, sender="client")
    else:
        with pytest.raises(
            InvalidArgument, match="generate: field cache_salt must be non-empty str of at most 256 UTF-8 bytes"
        ):
            validate(control, sender="client")


# --- attribution ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "control, error, match",
    [
        ([1, 2], ProtocolError, "must be a map"),
        ({"id": 1}, InvalidArgument, "needs a 'kind' string"),
        ({"kind": 5, "id": 1}, InvalidArgument, "needs a 'kind' string"),
        ({"kind": "summon", "id": 1}, InvalidArgument, "unknown message kind 'summon'"),
        ({"kind": "summon"}, ProtocolError, "unknown message kind 'summon'"),
        ({"kind": "summon", "id": 0}, ProtocolError, "unknown message kind"),
        ({"kind": "hello", "id": 1}, InvalidArgument, "sent by the worker"),
    ],
)
def test_who_can_be_answered(control, error, match):
    with pytest.raises(error, match=match):
        validate(control, sender="client")


def test_worker_messages_never_raise_invalid_argument():
    with pytest.raises(ProtocolError, match="unknown message kind"):
        validate({"kind": "summon", "id": 1}, sender="worker")


def test_sender_must_be_named():
    with pytest.raises(ValueError, match="sender"):
        validate({"kind": "info", "id": 1}, sender="server")  # type: ignore[arg-type]


# --- nested fields --------------------------------------------------------------------------


def generate(prompt, payloads=None) -> None:
    validate({"kind": "generate", "id": 3, "session_id": "s", "prompt": prompt}, sender="client", payloads=payloads)


def test_prompt_segments():
    generate([])
    generate([{"text": ""}, {"text": "more"}])
    payloads: list = []
    ref = _tokens(payloads, 4)
    generate([{"tokens": ref}], payloads)
    with pytest.raises(InvalidArgument, match=r"prompt\[0\].text must be str"):
        generate([{"text": 1}])
    with pytest.raises(InvalidArgument, match=r"prompt\[0\] must be \{text: str, special\?: bool\} or \{tokens"):
        generate([{"txt": "a"}])
    generate([{"text": "<|im_start|>", "special": True}, {"text": "x", "special": False}])
    with pytest.raises(InvalidArgument, match=r"prompt\[0\].special must be bool"):
        generate([{"text": "a", "special": 1}])
    with pytest.raises(InvalidArgument, match=r"prompt\[0\].tokens must be absent \(unknown field"):
        generate([{"text": "a", "tokens": ref}], payloads)
    with pytest.raises(InvalidArgument, match=r"prompt\[1\] must be"):
        generate([{"text": "a"}, "b"])


def test_token_payload_refs_are_checked_against_the_frame():
    payloads: list = []
    ref = _tokens(payloads, 4)
    with pytest.raises(InvalidArgument, match=r"prompt\[0\].tokens.payload must be the index of one of the frame's 1"):
        generate([{"tokens": {**ref, "payload": 1}}], payloads)
    with pytest.raises(InvalidArgument, match="a reference to 20 bytes \\(payload 0 has 16\\)"):
        generate([{"tokens": {**ref, "shape": [5]}}], payloads)
    with pytest.raises(InvalidArgument, match=r"tokens.dtype must be one of 'int32', 'int64', 'uint32'"):
        generate([{"tokens": {**ref, "dtype": "float32"}}], payloads)
    with pytest.raises(InvalidArgument, match=r"tokens.shape must be"):
        generate([{"tokens": {**ref, "shape": [2, 2]}}], payloads)
    generate([{"tokens": {**ref, "payload": 1}}])  # without the payloads only the form is checked


def test_chat_messages():
    def chat(messages) -> None:
        validate({"kind": "chat_template", "id": 1, "messages": messages}, sender="client")

    chat([])
    chat([{"role": "user", "content": "hi", "name": "bob"}])
    with pytest.raises(InvalidArgument, match=r"messages\[0\].role is missing"):
        chat([{"content": "hi"}])
    with pytest.raises(InvalidArgument, match=r"messages\[0\].role must be non-empty str"):
        chat([{"role": "", "content": "hi"}])
    with pytest.raises(InvalidArgument, match=r"messages\[0\].content must be str or \[map\] or nil"):
        chat([{"role": "user", "content": 5}])


def test_an_export_is_a_save_file_without_tag_or_base():
    export = {"kind": "save_file", "id": 1, "session_id": "s", "fds": 1, "tag": None, "base": None}
    validate({**export, "identity": "", "max_bytes": 1 << 30, "position": 3}, sender="client")
    with pytest.raises(InvalidArgument, match="field position must be int >= 0"):
        validate({**export, "identity": "", "max_bytes": 1 << 30, "position": -1}, sender="client")


# --- handshake ------------------------------------------------------------------------------


def test_hello_from_this_version():
    control, _ = EXAMPLES["hello"]
    assert control["protocol"] == list(PROTOCOL_VERSION) == [1, 1]
    assert check_hello(control) == (1, 1)


def test_newer_minor_version_is_accepted():
    control = {**EXAMPLES["hello"][0], "protocol": [1, 7]}
    assert check_hello(control) == (1, 7)


@pytest.mark.parametrize("major", [0, 2, 3])
def test_other_major_version_is_refused_clearly(major):
    # A future major version may change anything else in the hello too; the version is checked first.
    control = {"kind": "hello", "protocol": [major, 0], "entirely": "different"}
    with pytest.raises(
        ProtocolError,
        match=f"worker speaks protocol {major}.0 but this client speaks 1.1; the major versions must match",
    ):
        check_hello(control)


@pytest.mark.parametrize(
    "control, match",
    [
        ({"kind": "ok", "id": 1}, "expected the worker's hello as its first frame, got 'ok'"),
        ([1], "expected the worker's hello"),
        ({"kind": "hello", "protocol": [1, 0]}, "hello: missing required field"),
        ({**_examples()["hello"][0], "protocol": "1.0"}, "field protocol must be"),
        ({**_examples()["hello"][0], "protocol": [1, 0, 0]}, "field protocol must be"),
    ],
)
def test_bad_hellos(control, match):
    with pytest.raises(ProtocolError, match=match):
        check_hello(control)


# --- docs -----------------------------------------------------------------------------------


def test_protocol_doc_has_the_current_message_table():
    """docs/PROTOCOL.md embeds the output of `python -m muxworker.transport`; paste it again on change."""
    assert schema_table() in DOCS.read_text(encoding="utf-8")


def test_protocol_doc_has_the_current_error_table():
    """docs/PROTOCOL.md embeds the output of `python -m muxworker.transport errors`; paste it again on change."""
    table = error_table()
    assert table in DOCS.read_text(encoding="utf-8")
    rows = table.splitlines()[2:]
    assert [row.split(" | ")[0] for row in rows] == [f"| `{row.code}`" for row in ERRORS]


def test_the_seed_range_is_the_one_sampling_checks():
    """The schema bounds `seed` as SamplingFields does (the doc's table is generated from it)."""
    base = {"kind": "generate", "id": 1, "session_id": "s", "prompt": [{"text": "hi"}]}
    top = 2**63 - 1
    validate({**base, "seed": top}, sender="client")
    SamplingFields(seed=top).validate()
    with pytest.raises(InvalidArgument, match="seed"):
        validate({**base, "seed": top + 1}, sender="client")
    with pytest.raises(InvalidArgument, match="seed"):
        SamplingFields(seed=top + 1).validate()
