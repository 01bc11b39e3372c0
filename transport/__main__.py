"""``python -m muxworker.transport`` prints the message table embedded in docs/PROTOCOL.md;
``python -m muxworker.transport errors`` the error-code table."""

import sys

from .errors import error_table
from .schema import schema_table

print(error_table() if sys.argv[1:] == ["errors"] else schema_table(), end="")
