"""Session manifests (file version 3): a saved session is one small manifest naming its segments.

A session the store saves is one **session manifest** (``<hash>.mxckpt``) that names an ordered list
of immutable segment files (segments.py): contiguous position ranges from 0 to the session's
position. Replacing the manifest (written whole, renamed over the old one) is what publishes a save.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointCorrupt, CheckpointIncompatible
from .container import _TRAILER, FILE_VERSION, _check_trailer, _head, _read_manifest, _trailer, fstat_regular
from .identity import IdentityInputs
from .segments import _MAX_POSITION, SegmentHeader, SegmentRef, _checked_format_geometry, _int, _text, _time
from .state import same_layout

__all__ = ["MAX_SEGMENTS", "SessionManifest", "encode_session_manifest", "read_session_manifest", "check_chain"]

#: Most segments one session manifest may name (a store compacts well before: client/stores/binding.py).
MAX_SEGMENTS = 256
_SESSION_KEYS = {
    "kind",
    "session_id",
    "identity",
    "identity_inputs",
    "format",
    "geometry",
    "position",
    "tag",
    "created",
    "saved",
    "segments",
    "file_length",
}


@dataclass
class SessionManifest:
    """A saved session: its identity, shape, position and the segments that hold it.

    ``tag`` names this save (random, new for every save): a worker that exported it, or restored
    from it, knows which rows are already in the store and writes only the rest next time.
    ``created`` is when the session was first saved, ``saved`` when this manifest was written
    (seconds since the epoch).
    """

    session_id: str
    identity: str
    format: dict
    geometry: dict
    position: int
    tag: str
    created: float
    saved: float
    segments: list[SegmentRef] = field(default_factory=list)
    identity_inputs: IdentityInputs | None = None

    @property
    def nbytes(self) -> int:
        """Bytes of all its segments (the manifest itself is a few hundred bytes)."""
        return sum(s.file_length for s in self.segments)

    def validate(self, where: str) -> None:
        if not self.segments or len(self.segments) > MAX_SEGMENTS:
            raise CheckpointCorrupt(f"{where}: a session names 1 to {MAX_SEGMENTS} segments")
        if self.segments[0].start != 0:
            raise CheckpointCorrupt(f"{where}: the first segment must start at position 0")
        for a, b in zip(self.segments, self.segments[1:]):
            if b.start != a.end:
                raise CheckpointCorrupt(
                    f"{where}: segments [{a.start}, {a.end}) and [{b.start}, {b.end}) are not contiguous"
                )
        if self.segments[-1].end != self.position:
            raise CheckpointCorrupt(
                f"{where}: the segments end at {self.segments[-1].end}, not at position {self.position}"
            )
        if len({s.name for s in self.segments}) != len(self.segments):
            raise CheckpointCorrupt(f"{where}: a segment is named twice")


def encode_session_manifest(m: SessionManifest) -> bytes:
    """The bytes of a session manifest file (header, manifest, header CRC, trailer; no payloads)."""
    m.validate("session manifest")
    fields: dict[str, Any] = {
        "kind": "session",
        "session_id": m.session_id,
        "identity": m.identity,
        "identity_inputs": None if m.identity_inputs is None else m.identity_inputs.to_wire(),
        "format": m.format,
        "geometry": m.geometry,
        "position": m.position,
        "tag": m.tag,
        "created": m.created,
        "saved": m.saved,
        "segments": [s.to_wire() for s in m.segments],
        "file_length": 0,
    }
    # file_length is a fixed-size field only once its value is known: iterate to the fixed point.
    length = 0
    while True:
        fields["file_length"] = length
        head, head_crc = _head(fields)
        if len(head) + _TRAILER.size == length:
            return head + _trailer(length, head_crc)
        length = len(head) + _TRAILER.size


def read_session_manifest(fd: int, path: str) -> SessionManifest:
    """The verified session manifest open as ``fd`` (a version 3 file of kind ``session``)."""
    st = fstat_regular(fd, path)
    manifest, head_crc, head_end = _read_manifest(fd, st, path, {FILE_VERSION: _SESSION_KEYS})
    if manifest["kind"] != "session":
        raise CheckpointCorrupt(f"{path!r} is a {manifest['kind']!r} file, not a session manifest")
    if manifest["file_length"] != st.st_size or head_end + _TRAILER.size != st.st_size:
        raise CheckpointCorrupt(f"{path!r} is {st.st_size} bytes but its manifest says {manifest['file_length']}")
    _check_trailer(fd, st.st_size, head_crc, path)
    fmt, geometry = _checked_format_geometry(manifest["format"], manifest["geometry"], path)
    inputs = manifest["identity_inputs"]  # parsed by the container reader
    assert inputs is None or isinstance(inputs, IdentityInputs)
    refs = manifest["segments"]
    if not isinstance(refs, list):
        raise CheckpointCorrupt(f"{path!r}: segments must be a list")
    m = SessionManifest(
        session_id=_text(manifest["session_id"], f"{path!r}: session_id", 1 << 16),
        identity=_text(manifest["identity"], f"{path!r}: identity", 256),
        format=fmt,
        geometry=geometry,
        position=_int(manifest["position"], f"{path!r}: position", 1, _MAX_POSITION),
        tag=_text(manifest["tag"], f"{path!r}: tag", 64),
        created=_time(manifest["created"], f"{path!r}: created"),
        saved=_time(manifest["saved"], f"{path!r}: saved"),
        segments=[SegmentRef.from_wire(r, f"{path!r}: segment {i}") for i, r in enumerate(refs)],
        identity_inputs=inputs,
    )
    m.validate(repr(path))
    return m


def check_chain(m: SessionManifest, headers: Sequence[SegmentHeader], path: str) -> None:
    """Each segment belongs to this session, identity and shape (the refs already matched)."""
    for ref, h in zip(m.segments, headers):
        if h.session_id != m.session_id and not ref.shared:
            raise CheckpointCorrupt(
                f"segment {ref.name} of {path!r} holds session {h.session_id!r}, not {m.session_id!r}"
            )
        if h.identity != m.identity:
            raise CheckpointIncompatible(f"segment {ref.name} of {path!r} was saved under another identity")
        if not same_layout(h.format, m.format) or h.geometry != m.geometry:
            raise CheckpointCorrupt(f"segment {ref.name} of {path!r} has another format or geometry than its session")
