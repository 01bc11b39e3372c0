"""The JSON Schema helpers of transport/sampling.py that the grammar builders rely on."""

from __future__ import annotations

import pytest

from muxworker.transport.sampling import rebased_schema, ref_cycle

NODE = {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/Node"}}}}


def test_a_rebased_schema_points_where_it_now_lies_and_leaves_values_alone():
    schema = {
        "$defs": {"Node": NODE},
        "properties": {"root": {"$ref": "#/$defs/Node"}, "me": {"$ref": "#"}, "tag": {"const": {"$ref": "#"}}},
        "anyOf": [{"$ref": "#/properties/root"}],
        "default": {"$ref": "#"},
    }
    out = rebased_schema(schema, "#/$defs/t3")
    assert out["$defs"]["Node"]["properties"]["kids"]["items"] == {"$ref": "#/$defs/t3/$defs/Node"}
    assert out["properties"]["root"] == {"$ref": "#/$defs/t3/$defs/Node"}
    assert out["properties"]["me"] == {"$ref": "#/$defs/t3"}
    assert out["anyOf"] == [{"$ref": "#/$defs/t3/properties/root"}]
    assert out["properties"]["tag"] == {"const": {"$ref": "#"}} and out["default"] == {"$ref": "#"}
    assert schema["properties"]["me"] == {"$ref": "#"}  # a copy


@pytest.mark.parametrize(
    ("schema", "cycle"),
    [
        ({"$ref": "#"}, "#"),
        (
            {
                "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                "properties": {"x": {"$ref": "#/$defs/a"}},
            },
            "#/$defs/a",
        ),
        ({"type": "object", "properties": {"a": {"$ref": "#"}}}, None),  # a real recursion
        ({"$defs": {"Node": NODE}, "$ref": "#/$defs/Node"}, None),
        ({"const": {"$ref": "#"}}, None),  # a value, not a schema
        ({"$ref": "#/$defs/missing"}, None),  # the compiler says what is missing
    ],
)
def test_a_reference_that_only_leads_back_to_itself_is_found(schema, cycle):
    assert ref_cycle(schema) == cycle
