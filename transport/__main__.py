"""``python -m muxworker.transport`` prints the message table embedded in docs/PROTOCOL.md."""

from .schema import schema_table

print(schema_table(), end="")
