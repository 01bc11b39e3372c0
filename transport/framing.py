"""Frames: a fixed binary header, a msgpack control map, and zero or more raw binary payloads.

Wire layout (all integers little-endian, no padding)::

    offset  size        field
    0       4           magic b"MXWF"
    4       1           protocol major (u8)
    5       1           protocol minor (u8)
    6       2           flags (u16, must be 0 in 1.x)
    8       4           control_len (u32, > 0)
    12      4           payload_count (u32)
    16      8*count     payload lengths (u64 each)
    ...     control_len msgpack map (the control map)
    ...     sum(len)    payload bytes, back to back in index order

This module does no I/O. :func:`encode_frame` turns a :class:`Frame` into a list of buffers for a
gather write; :class:`FrameDecoder` is a state machine that tells the I/O layer where to put the
next bytes (its staging buffer, or straight into the frame's preallocated payload buffers) and
hands out complete frames. The blocking fd end (``fdio``) and the trio end (``trio_stream``) are
thin loops around it, so both ends enforce exactly the same rules.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import msgpack
import numpy as np

from .errors import InvalidArgument, ProtocolError

__all__ = [
    "MAGIC",
    "PROTOCOL_VERSION",
    "HEADER_SIZE",
    "KiB",
    "MiB",
    "GiB",
    "DTYPES",
    "FrameLimits",
    "DEFAULT_LIMITS",
    "Frame",
    "FrameDecoder",
    "encode_frame",
    "decode_control",
    "attach_payload",
    "payload_array",
]

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

MAGIC = b"MXWF"
PROTOCOL_VERSION: tuple[int, int] = (1, 1)

_HEADER = struct.Struct("<4sBBHII")
HEADER_SIZE = _HEADER.size  # 16
_LENGTH_SIZE = 8
_U32_MAX = 0xFFFF_FFFF

# Payload element types by wire name. Payloads are always little-endian. numpy has no bfloat16,
# so a "bfloat16" payload is handed out as uint16 (torch: ``torch.from_numpy(a).view(torch.bfloat16)``).
DTYPES: Mapping[str, np.dtype] = MappingProxyType(
    {
        "bool": np.dtype("?"),
        "int8": np.dtype("i1"),
        "uint8": np.dtype("u1"),
        "int16": np.dtype("<i2"),
        "uint16": np.dtype("<u2"),
        "int32": np.dtype("<i4"),
        "uint32": np.dtype("<u4"),
        "int64": np.dtype("<i8"),
        "uint64": np.dtype("<u8"),
        "float16": np.dtype("<f2"),
        "bfloat16": np.dtype("<u2"),
        "float32": np.dtype("<f4"),
        "float64": np.dtype("<f8"),
    }
)
# numpy dtype -> wire name, for attach_payload (bfloat16 is only ever chosen explicitly).
_DTYPE_NAMES: dict[np.dtype, str] = {dt: name for name, dt in DTYPES.items() if name != "bfloat16"}


@dataclass(frozen=True)
class FrameLimits:
    """Bounds on one frame, checked from the header before anything is allocated.

    ``max_payload_bytes`` bounds the payload bytes of an ordinary frame. ``kind_payload_bytes``
    raises (or lowers) that bound for particular message kinds (none by default: checkpoints
    travel as files, transport/fdpass.py, never as frame payloads); the header is
    checked against the largest of these bounds, and the kind's own bound is checked once the
    control map (at most ``max_control_bytes``) is decoded, still before any payload buffer exists.
    """

    max_control_bytes: int = 1 * MiB
    max_payloads: int = 1024
    max_payload_bytes: int = 64 * MiB
    max_depth: int = 32
    kind_payload_bytes: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # max_payloads sizes each reader's staging buffer (8 bytes per length), hence its bound.
        for name, top in (("max_control_bytes", _U32_MAX), ("max_payloads", 1 << 16), ("max_depth", 1000)):
            value = getattr(self, name)
            if type(value) is not int or not 1 <= value <= top:
                raise ValueError(f"FrameLimits.{name} must be an int in 1..{top}, got {value!r}")
        kinds = dict(self.kind_payload_bytes)
        for name, value in [("max_payload_bytes", self.max_payload_bytes), *kinds.items()]:
            if type(value) is not int or value < 0:
                raise ValueError(f"payload byte limit for {name!r} must be an int >= 0, got {value!r}")
        object.__setattr__(self, "kind_payload_bytes", MappingProxyType(kinds))
        object.__setattr__(self, "_ceiling", max([self.max_payload_bytes, *kinds.values()]))

    @property
    def payload_ceiling(self) -> int:
        """The most payload bytes any frame may declare in its header."""
        return self._ceiling  # type: ignore[attr-defined]

    def payload_limit(self, kind: object) -> int:
        """The payload byte bound for a frame whose control map has this ``kind``."""
        if isinstance(kind, str):
            return self.kind_payload_bytes.get(kind, self.max_payload_bytes)
        return self.max_payload_bytes

    def to_dict(self) -> dict[str, Any]:
        """A msgpack-friendly form, e.g. for the ``limits`` map of ``hello``."""
        return {
            "max_control_bytes": self.max_control_bytes,
            "max_payloads": self.max_payloads,
            "max_payload_bytes": self.max_payload_bytes,
            "max_depth": self.max_depth,
            "kind_payload_bytes": dict(self.kind_payload_bytes),
        }


DEFAULT_LIMITS = FrameLimits()


@dataclass
class Frame:
    """One message: its control map and the raw payloads the map refers to by index.

    Received frames hold one writable, byte-formatted ``memoryview`` per payload. Frames to send
    may hold any C-contiguous buffer (bytes, bytearray, memoryview, numpy array, ``tensor.numpy()``).
    """

    control: dict[str, Any]
    payloads: list[Any] = field(default_factory=list)
    # Set by a decoder whose ``screen`` refused the frame from its header and control map: the
    # payloads are skipped unread (``payloads`` stays empty) and this is the request's error.
    refused: Exception | None = None

    @property
    def kind(self) -> object:
        return self.control.get("kind")


# --------------------------------------------------------------------------------------------
# Control maps


_SCALARS = frozenset({str, int, float, bool, bytes, type(None)})


def _check_tree(obj: object, max_depth: int, *, sending: bool) -> None:
    """Reject non-map control, non-str keys, types outside msgpack's plain set, and deep nesting.

    Walks one nesting level at a time; exact type checks keep the common flat map cheap. When
    sending, subclasses (IntEnum, OrderedDict, numpy floats) and tuples are accepted as msgpack does.
    """
    if not isinstance(obj, dict):
        raise ProtocolError(f"control must be a msgpack map, got {type(obj).__name__}")
    level: list[object] = [obj]
    depth = 1
    while level:
        if depth > max_depth:
            raise ProtocolError(f"control map is nested deeper than max_depth={max_depth}")
        deeper: list[object] = []
        for node in level:
            if isinstance(node, dict):
                for key in node:
                    if type(key) is not str:
                        raise ProtocolError(f"control map keys must be strings, got {type(key).__name__} {key!r:.40}")
                values = node.values()
            else:
                values = node  # type: ignore[assignment]
            for value in values:
                kind = type(value)
                if kind in _SCALARS:
                    continue
                if kind is dict or kind is list:
                    deeper.append(value)
                elif sending and isinstance(value, (dict, list, tuple)):
                    deeper.append(value)
                elif not (sending and isinstance(value, (str, int, float, bytes))):
                    raise ProtocolError(
                        f"control map holds a value of type {kind.__name__}, which is not a plain msgpack type"
                    )
        level = deeper
        depth += 1


def decode_control(data: bytes | bytearray | memoryview, limits: FrameLimits = DEFAULT_LIMITS) -> dict[str, Any]:
    """Decode and check one control map (its length has already been checked against the limits)."""
    n = len(data)
    try:
        obj = msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_str_len=n,
            max_bin_len=n,
            max_array_len=n,
            max_map_len=n,
            max_ext_len=0,
        )
    except msgpack.ExtraData:
        raise ProtocolError("control map is followed by trailing bytes inside control_len") from None
    except msgpack.StackError:
        raise ProtocolError(f"control map is nested deeper than max_depth={limits.max_depth}") from None
    except (ValueError, TypeError, OverflowError, msgpack.UnpackException) as exc:
        raise ProtocolError(f"control map is not valid msgpack: {exc or type(exc).__name__}") from None
    _check_tree(obj, limits.max_depth, sending=False)
    return obj


# --------------------------------------------------------------------------------------------
# Payload buffers and references


def _byte_view(buf: object, what: str = "payload") -> memoryview:
    """A flat unsigned-byte view of any C-contiguous buffer, without copying."""
    try:
        mv = memoryview(buf)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"{what} must support the buffer protocol, got {type(buf).__name__}") from None
    if not mv.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous (copy it with numpy.ascontiguousarray first)")
    if mv.nbytes == 0:
        return memoryview(b"")
    if mv.ndim == 1 and mv.format == "B":
        return mv
    return mv.cast("B")


def attach_payload(payloads: list[Any], data: object, *, dtype: str | None = None) -> dict[str, Any]:
    """Append ``data`` to ``payloads`` and return the control-map reference to it.

    ``data`` is a numpy array or scalar (its dtype and shape go into the reference) or any other
    C-contiguous buffer (sent as ``uint8`` of its byte length). ``dtype`` overrides the wire name
    when it has the same item size, e.g. ``dtype="bfloat16"`` for ``tensor.view(torch.int16).numpy()``.
    """
    if isinstance(data, (np.ndarray, np.generic)):
        arr = np.asarray(data)
    else:
        arr = np.frombuffer(_byte_view(data), dtype=np.uint8)
    if not arr.flags.c_contiguous:
        raise ValueError("payload must be C-contiguous (copy it with numpy.ascontiguousarray first)")
    if dtype is None:
        name = _DTYPE_NAMES.get(arr.dtype)
        if name is None:
            raise ValueError(f"no wire dtype for numpy dtype {arr.dtype.str!r}; use one of {sorted(DTYPES)}")
    else:
        name = dtype
        if name not in DTYPES:
            raise ValueError(f"unknown payload dtype {name!r}; expected one of {sorted(DTYPES)}")
        if DTYPES[name].itemsize != arr.dtype.itemsize or arr.dtype.byteorder == ">":
            raise ValueError(f"array of dtype {arr.dtype.str!r} cannot be sent as {name!r}")
    payloads.append(arr)
    return {"payload": len(payloads) - 1, "dtype": name, "shape": list(arr.shape)}


def payload_nbytes(ref: Mapping[str, Any]) -> int:
    """The byte length a (well-typed) payload reference describes."""
    return math.prod(ref["shape"]) * DTYPES[ref["dtype"]].itemsize


def payload_array(frame: Frame, ref: Mapping[str, Any]) -> np.ndarray:
    """The payload ``ref`` names, as a numpy array of its dtype and shape, without copying.

    Raises :class:`InvalidArgument` when the reference is malformed or does not match the frame.
    """
    if not isinstance(ref, Mapping) or set(ref) != {"payload", "dtype", "shape"}:
        raise InvalidArgument(f"a payload reference is a map with exactly payload, dtype, shape; got {ref!r:.200}")
    index, dtype, shape = ref["payload"], ref["dtype"], ref["shape"]
    if type(index) is not int or not 0 <= index < len(frame.payloads):
        raise InvalidArgument(f"payload index {index!r} is not one of the frame's {len(frame.payloads)} payloads")
    if dtype not in DTYPES:
        raise InvalidArgument(f"unknown payload dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise InvalidArgument(f"payload shape must be a list of non-negative ints, got {shape!r:.200}")
    view = _byte_view(frame.payloads[index])
    expected = payload_nbytes(ref)
    if view.nbytes != expected:
        raise InvalidArgument(f"payload {index} has {view.nbytes} bytes but {dtype}{shape} needs {expected}")
    return np.frombuffer(view, dtype=DTYPES[dtype]).reshape(shape)


# --------------------------------------------------------------------------------------------
# Encoding


def _check_sizes(control_len: int, sizes: list[int], limits: FrameLimits, kind: object) -> None:
    if control_len > limits.max_control_bytes:
        raise ProtocolError(f"control map of {control_len} bytes exceeds max_control_bytes={limits.max_control_bytes}")
    if len(sizes) > limits.max_payloads:
        raise ProtocolError(f"frame has {len(sizes)} payloads, over max_payloads={limits.max_payloads}")
    limit = limits.payload_limit(kind)
    total = sum(sizes)
    if total > limit:
        raise ProtocolError(f"{kind!r} frame carries {total} payload bytes, over its limit of {limit}")


def encode_frame(frame: Frame, limits: FrameLimits = DEFAULT_LIMITS) -> list[Any]:
    """The frame as buffers for one gather write: header+lengths+control, then each payload.

    Payloads are not copied. Raises :class:`ProtocolError` (before anything is written) when the
    frame breaks a rule the receiving end would reject it for.
    """
    control = frame.control
    _check_tree(control, limits.max_depth, sending=True)
    try:
        body = msgpack.packb(control, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ProtocolError(f"control map cannot be encoded as msgpack: {exc}") from None
    views = [_byte_view(p, f"payload {i}") for i, p in enumerate(frame.payloads)]
    sizes = [v.nbytes for v in views]
    _check_sizes(len(body), sizes, limits, control.get("kind"))
    major, minor = PROTOCOL_VERSION
    head = b"".join(
        (
            _HEADER.pack(MAGIC, major, minor, 0, len(body), len(sizes)),
            struct.pack(f"<{len(sizes)}Q", *sizes),
            body,
        )
    )
    return [head, *views]


# --------------------------------------------------------------------------------------------
# Decoding

_HEADER_STATE, _LENGTHS_STATE, _CONTROL_STATE, _PAYLOAD_STATE, _SKIP_STATE = range(5)
_STAGING_BYTES = 64 * KiB


def _allocate_numpy(nbytes: int) -> np.ndarray:
    # Uninitialised, and at least 16-byte aligned (malloc), so every wire dtype's view is aligned.
    return np.empty(nbytes, dtype=np.uint8)


class FrameDecoder:
    """Sans-I/O frame parser with bounded, preallocated buffers.

    The I/O loop is::

        while (frame := decoder.next_frame()) is None:
            targets = decoder.read_targets()      # writable memoryviews, in stream order
            n = read_into(targets)                 # e.g. os.readv(fd, targets)
            if n == 0:
                decoder.eof()                      # raises unless at a frame boundary
                return None
            decoder.commit(n)

    Small frames are read into a fixed staging buffer (one read can bring several frames).
    Payload bytes go straight into buffers sized from the header, obtained from ``allocate``
    (default: ``numpy.empty``) only after the header, lengths and control map passed every limit;
    only what was already staged when a payload begins is copied. After a :class:`ProtocolError`
    the decoder is broken and every later call raises.

    ``screen(control, payload_lengths)``, if given, sees every control map that passed the limits
    before any payload buffer exists. When it returns an exception, the frame is handed out at once
    with ``refused`` set and no payloads, and its payload bytes are then read into the staging
    buffer and dropped: a request that is refused anyway costs neither the memory of its payloads
    nor the wait for them (a 64 MiB prompt that cannot fit in a session, say).
    """

    def __init__(
        self,
        limits: FrameLimits = DEFAULT_LIMITS,
        *,
        allocate: Callable[[int], Any] | None = None,
        screen: Callable[[dict[str, Any], tuple[int, ...]], Exception | None] | None = None,
    ):
        self.limits = limits
        self._allocate = allocate if allocate is not None else _allocate_numpy
        self._screen = screen
        self._skip = 0  # payload bytes of a refused frame still to drop
        # Big enough for a header and every length of a maximal frame, so those parse in place.
        self._buf = bytearray(_STAGING_BYTES + HEADER_SIZE + _LENGTH_SIZE * limits.max_payloads)
        self._view = memoryview(self._buf)
        self._start = 0  # staged, unparsed bytes are self._buf[_start:_end]
        self._end = 0
        self._broken: BaseException | None = None
        # Direct read targets handed out by read_targets(), for commit(): (payload index, offset,
        # length), with index -1 for the control buffer.
        self._plan: list[tuple[int, int, int]] = []
        self._reset_frame()

    def _reset_frame(self) -> None:
        self._state = _HEADER_STATE
        self._control_len = 0
        self._count = 0
        self._lengths: tuple[int, ...] = ()
        self._control_buf: memoryview | None = None
        self._control_filled = 0
        self._control: dict[str, Any] | None = None
        self._payloads: list[memoryview] = []
        self._index = 0  # payload being filled
        self._filled = 0  # bytes of it filled
        self._refused: Frame | None = None  # a screened-out frame, handed out before its payloads are skipped

    # -- public ---------------------------------------------------------------------------

    @property
    def at_boundary(self) -> bool:
        """True when no byte of an unfinished frame is held."""
        return self._state == _HEADER_STATE and self._start == self._end

    def next_frame(self) -> Frame | None:
        """The next complete frame from the bytes received so far, or None if more are needed."""
        self._check_usable()
        try:
            return self._advance()
        except BaseException as exc:
            self._broken = exc
            raise

    def read_targets(self, max_buffers: int = 1024) -> list[memoryview]:
        """Where the next received bytes go, in stream order (call after next_frame() gave None)."""
        self._check_usable()
        if max_buffers < 2:
            raise ValueError("max_buffers must be at least 2")
        plan: list[tuple[int, int, int]] = []
        targets: list[memoryview] = []
        if self._start == self._end:
            self._start = self._end = 0
            if self._state == _CONTROL_STATE and self._control_buf is not None:
                plan.append((-1, self._control_filled, self._control_len - self._control_filled))
                targets.append(self._control_buf[self._control_filled :])
            elif self._state == _PAYLOAD_STATE:
                offset = self._filled
                for index in range(self._index, len(self._payloads)):
                    if len(targets) == max_buffers - 1:
                        break
                    size = len(self._payloads[index])
                    if size > offset:
                        plan.append((index, offset, size - offset))
                        targets.append(self._payloads[index][offset:])
                    offset = 0
        elif self._start:
            # Only a partial header or length table is staged here; move it to the front.
            n = self._end - self._start
            self._buf[:n] = self._buf[self._start : self._end]
            self._start, self._end = 0, n
        # Whatever follows the direct targets in the stream lands in the staging buffer.
        targets.append(self._view[self._end :])
        self._plan = plan
        return targets

    def commit(self, n: int) -> None:
        """Record that the first ``n`` bytes of the last read_targets() were filled."""
        self._check_usable()
        for index, offset, length in self._plan:
            take = min(n, length)
            if index < 0:
                self._control_filled = offset + take
            else:
                self._index, self._filled = index, offset + take
            n -= take
            if take < length:
                break
        self._plan = []
        if n > len(self._buf) - self._end:
            raise ValueError("commit() of more bytes than read_targets() offered")
        self._end += n

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        """Copy received bytes into the read targets and commit them (for streams that return bytes).

        ``len(data)`` must not exceed :meth:`space`.
        """
        src = memoryview(data)
        total = len(src)
        pos = 0
        targets = self.read_targets()
        if total > sum(len(t) for t in targets):
            raise ValueError("feed() of more bytes than space() allows")
        for target in targets:
            if pos == total:
                break
            take = min(len(target), total - pos)
            target[:take] = src[pos : pos + take]
            pos += take
        self.commit(total)

    def space(self) -> int:
        """How many bytes the next read may bring (the total size of read_targets())."""
        return sum(len(t) for t in self.read_targets())

    def eof(self) -> None:
        """The stream ended. Fine at a frame boundary; otherwise raises :class:`ProtocolError`."""
        self._check_usable()
        if self.at_boundary:
            return
        exc = ProtocolError(f"truncated frame: end of stream {self._where()}")
        self._broken = exc
        raise exc

    # -- internals ------------------------------------------------------------------------

    def _check_usable(self) -> None:
        if self._broken is not None:
            raise ProtocolError(f"the stream is unusable after an earlier error: {self._broken!r}")

    def _where(self) -> str:
        staged = self._end - self._start
        if self._state == _HEADER_STATE:
            return f"after {staged} of the {HEADER_SIZE} header bytes"
        if self._state == _LENGTHS_STATE:
            return f"after {staged} of the {_LENGTH_SIZE * self._count} payload length bytes"
        if self._state == _CONTROL_STATE:
            return f"after {self._control_filled + staged} of the {self._control_len} control map bytes"
        if self._state == _SKIP_STATE:
            return f"with {self._skip - staged} payload bytes of a refused frame still to come"
        size = len(self._payloads[self._index])
        return f"after {self._filled + staged} of the {size} bytes of payload {self._index}"

    def _advance(self) -> Frame | None:
        buf, view = self._buf, self._view
        while True:
            avail = self._end - self._start
            state = self._state
            if state == _HEADER_STATE:
                if avail < HEADER_SIZE:
                    return None
                magic, major, minor, flags, control_len, count = _HEADER.unpack_from(buf, self._start)
                self._check_header(magic, major, minor, flags, control_len, count)
                self._start += HEADER_SIZE
                self._control_len, self._count = control_len, count
                self._state = _LENGTHS_STATE
            elif state == _LENGTHS_STATE:
                need = _LENGTH_SIZE * self._count
                if avail < need:
                    return None
                lengths = struct.unpack_from(f"<{self._count}Q", buf, self._start)
                self._check_lengths(lengths)
                self._start += need
                self._lengths = lengths
                self._state = _CONTROL_STATE
            elif state == _CONTROL_STATE:
                control_len = self._control_len
                if self._control_buf is None:
                    if avail >= control_len:
                        data = view[self._start : self._start + control_len]
                        self._start += control_len
                        self._finish_control(data)
                        if self._refused is not None:
                            return self._take_refused()
                        continue
                    # Spans reads: collect it in its own buffer (at most max_control_bytes).
                    self._control_buf = memoryview(bytearray(control_len))
                    self._control_filled = 0
                filled = self._control_filled
                take = min(avail, control_len - filled)
                self._control_buf[filled : filled + take] = view[self._start : self._start + take]
                self._start += take
                self._control_filled = filled = filled + take
                if filled < control_len:
                    return None
                control_buf, self._control_buf = self._control_buf, None
                self._finish_control(control_buf)
                if self._refused is not None:
                    return self._take_refused()
            elif state == _SKIP_STATE:
                take = min(avail, self._skip)
                self._start += take
                self._skip -= take
                if self._skip:
                    return None
                self._reset_frame()
            else:
                payloads = self._payloads
                while self._index < len(payloads):
                    target = payloads[self._index]
                    rest = len(target) - self._filled
                    if rest:
                        take = min(rest, avail)
                        if take:
                            target[self._filled : self._filled + take] = view[self._start : self._start + take]
                            self._start += take
                            self._filled += take
                            avail -= take
                        if take < rest:
                            return None
                    self._index += 1
                    self._filled = 0
                assert self._control is not None
                frame = Frame(self._control, payloads)
                self._reset_frame()
                return frame

    def _take_refused(self) -> Frame:
        frame, self._refused = self._refused, None
        assert frame is not None
        if not self._skip:
            self._reset_frame()
        return frame

    def _check_header(self, magic: bytes, major: int, minor: int, flags: int, control_len: int, count: int) -> None:
        limits = self.limits
        if magic != MAGIC:
            raise ProtocolError(
                f"bad magic {magic!r}, expected {MAGIC!r} (not a muxworker frame, or the stream is out of step)"
            )
        if major != PROTOCOL_VERSION[0]:
            raise ProtocolError(f"frame has protocol version {major}.{minor}; this end speaks {PROTOCOL_VERSION[0]}.x")
        if flags:
            raise ProtocolError(f"unknown header flags 0x{flags:04x}; protocol {PROTOCOL_VERSION[0]}.x defines none")
        if control_len == 0:
            raise ProtocolError("control_len is 0; every frame carries a control map")
        if control_len > limits.max_control_bytes:
            raise ProtocolError(
                f"control map of {control_len} bytes exceeds max_control_bytes={limits.max_control_bytes}"
            )
        if count > limits.max_payloads:
            raise ProtocolError(f"frame declares {count} payloads, over max_payloads={limits.max_payloads}")

    def _check_lengths(self, lengths: tuple[int, ...]) -> None:
        ceiling = self.limits.payload_ceiling
        total = 0
        for i, n in enumerate(lengths):
            total += n
            if total > ceiling:
                raise ProtocolError(
                    f"frame declares {total if i else n} payload bytes by payload {i}, "
                    f"over the largest payload limit of {ceiling} bytes"
                )

    def _finish_control(self, data: memoryview) -> None:
        control = decode_control(data, self.limits)
        kind = control.get("kind")
        limit = self.limits.payload_limit(kind)
        total = sum(self._lengths)
        if total > limit:
            raise ProtocolError(f"{kind!r} frame declares {total} payload bytes, over its limit of {limit}")
        if self._screen is not None:
            refusal = self._screen(control, self._lengths)
            if refusal is not None:
                self._refused = Frame(control, [], refused=refusal)
                self._skip = total
                self._state = _SKIP_STATE
                return
        self._payloads = [self._allocate_payload(n) for n in self._lengths]
        self._control = control
        self._index = self._filled = 0
        self._state = _PAYLOAD_STATE

    def _allocate_payload(self, nbytes: int) -> memoryview:
        if nbytes == 0:
            return memoryview(bytearray(0))
        view = _byte_view(self._allocate(nbytes), "allocated payload buffer")
        if view.readonly or view.nbytes < nbytes:
            raise ValueError(f"allocate({nbytes}) must return a writable buffer of at least {nbytes} bytes")
        return view[:nbytes]
