"""The one encoder and decoder of dalid messages.

Frame layout of every message (a ZeroMQ multipart message; a ROUTER socket adds the peer's
identity frame in front, which the transport strips before :func:`decode` sees the frames)::

    frame 0      msgpack map, the header
                 {"v":    PROTOCOL_VERSION,        int, always first to be read
                  "op":   "<operation>",           str, Message.OP
                  "rid":  <request id> | nil,      int: a request, echoed by its reply;
                                                   nil: a notification or a push
                  "body": {<field>: <value>, ...}} the message's dataclass fields
    frame 1..n   raw bytes, sent and received without a copy; a ``memoryview`` field of the
                 body holds the number of its frame (1..n). A sender references every frame
                 once; a receiver refuses a frame referenced twice.

A batch's samples of one input are two frames, however many samples it has
(``InputBatch``)::

    body.inputs[i]  {"name": str, "dtype": str, "size": n, "ndim": d,
                     "shapes": k,     frame k: n x d extents, little-endian uint64
                     "data": k + 1}   frame k + 1: the n samples' bytes back to back, in order

Values are encoded by the field's annotation: int, float, str, bool, enums by value, tuples as
arrays, nested dataclasses as maps, ``X | None`` as the value or nil. Decoding checks every
type, every frame index and the message's own ``__post_init__`` checks, and raises
:class:`ProtocolError` with the error code to answer with. It never trusts a size it has not
checked: the header's length and its containers are bounded before they are unpacked.

Each message class gets its encoder and its fast decoder compiled once from its annotations
(:func:`_plan`): a message on the hot path costs a few dictionary lookups per field, not a walk
over its type hints. The fast decoder accepts only values of exactly the annotated types; for
anything else it hands the body to the checking decoder (``_decode_dataclass``), which accepts
the same messages and, for the rest, names the field that is wrong.

Forward compatibility (SPEC.md, "Versions"): a body field the receiver does not know, at any
depth, is ignored, and so is a frame that no field it knows references; a field it knows but
is not sent takes its default. So a field added with a default that older peers may ignore
needs no new protocol version.

It holds the one codec: the frame layout, the checking decoder, and the compiled encoders and
decoders, which accept exactly what the checking decoder accepts.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import msgpack

from .errors import ErrorCode, ProtocolError
from .messages import MESSAGE_TYPES, PROTOCOL_VERSION, Message

MAX_HEADER_BYTES = 1 << 20
MAX_FRAMES = 1 << 17

_MESSAGE_BY_OP: dict[str, type[Message]] = {cls.OP: cls for cls in MESSAGE_TYPES}


@dataclass(frozen=True)
class Envelope:
    """A decoded message and the request id it travelled with (``None`` for a notification)."""

    message: Message
    request_id: int | None


def encode(message: Message, request_id: int | None = None) -> list[Any]:
    """Frames for ``message``: the msgpack header, then each buffer field as its own frame.

    Buffers are returned as given (no copy): send them with ``copy=False``.
    """
    frames: list[Any] = [b""]
    body = _plan(type(message)).encode(message, frames)
    header = {"v": PROTOCOL_VERSION, "op": message.OP, "rid": request_id, "body": body}
    frames[0] = msgpack.packb(header, use_bin_type=True)
    return frames


def decode(frames: Sequence[Any]) -> Envelope:
    """The message in ``frames`` (bytes or buffer objects), fully validated.

    Raises :class:`ProtocolError`; its ``request_id`` and ``op`` are set when the header was
    readable, so the receiver can address its error reply.
    """
    if not frames:
        raise ProtocolError(ErrorCode.MALFORMED_MESSAGE, "empty message")
    if len(frames) > MAX_FRAMES:
        raise ProtocolError(ErrorCode.MALFORMED_MESSAGE, f"more than {MAX_FRAMES} frames")
    header = _unpack_header(memoryview(frames[0]))
    request_id = header.get("rid")
    if not (request_id is None or _is_int(request_id)):
        raise ProtocolError(ErrorCode.MALFORMED_MESSAGE, "header 'rid' must be an int or nil")
    op = header.get("op")
    version = header.get("v")
    if not _is_int(version) or version != PROTOCOL_VERSION:
        raise ProtocolError(
            ErrorCode.PROTOCOL_MISMATCH,
            f"the peer speaks dalid protocol version {version!r}; this side speaks version "
            f"{PROTOCOL_VERSION}: install matching dalid releases on the daemon and the client",
            request_id=request_id,
            op=op if isinstance(op, str) else "",
        )
    if not isinstance(op, str):
        raise ProtocolError(ErrorCode.MALFORMED_MESSAGE, "header 'op' must be a string", request_id)
    cls = _MESSAGE_BY_OP.get(op)
    if cls is None:
        raise ProtocolError(
            ErrorCode.UNKNOWN_OPERATION, f"unknown operation {op[:64]!r}", request_id, op[:64]
        )
    body = header.get("body")
    if not isinstance(body, dict):
        raise ProtocolError(
            ErrorCode.MALFORMED_MESSAGE, f"{op}: 'body' must be a map", request_id, op
        )
    try:
        message = _plan(cls).decode(body, frames, [False] * len(frames))
    except Exception:
        message = None
    if message is None:
        message = _checked_decode(cls, body, frames, request_id, op)
    # Frames that only fields of a later version reference are not ours to read: dropped.
    assert isinstance(message, Message)
    return Envelope(message, request_id)


def _checked_decode(
    cls: type, body: dict[str, Any], frames: Sequence[Any], request_id: Any, op: str
) -> Any:
    """The checking decoder: what the fast one refused, decoded again value by value, so
    that a malformed message is refused naming the value that is wrong."""
    used = [False] * len(frames)
    try:
        return _decode_dataclass(cls, body, frames, used, op)
    except ProtocolError as error:
        error.request_id, error.op = request_id, op
        raise
    except Exception as error:
        # Whatever a decode raises (a RecursionError for deep nesting, an OverflowError, ...)
        # refuses this message: nothing a peer sends may escape to the receiver's loop.
        text = str(error) if isinstance(error, ValueError | TypeError) else type(error).__name__
        raise ProtocolError(
            ErrorCode.MALFORMED_MESSAGE, f"{op}: {text}"[:1024], request_id, op
        ) from None


def _unpack_header(raw: memoryview) -> dict[str, Any]:
    if raw.nbytes > MAX_HEADER_BYTES:
        raise ProtocolError(ErrorCode.MALFORMED_MESSAGE, f"header over {MAX_HEADER_BYTES} bytes")
    try:
        header = msgpack.unpackb(
            raw,
            raw=False,
            strict_map_key=True,
            max_str_len=MAX_HEADER_BYTES,
            max_bin_len=0,
            max_array_len=MAX_FRAMES,
            max_map_len=1024,
            max_ext_len=0,
        )
    except Exception as error:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(
            ErrorCode.MALFORMED_MESSAGE, f"header is not msgpack: {error}"
        ) from None
    if not isinstance(header, dict):
        raise ProtocolError(ErrorCode.MALFORMED_MESSAGE, "header must be a msgpack map")
    return header


# --- Encoding by annotation ---------------------------------------------------------------------


def _encode_dataclass(value: Any, frames: list[Any]) -> dict[str, Any]:
    return {
        name: _encode_value(getattr(value, name), hint, frames)
        for name, hint in _field_hints(type(value)).items()
    }


def _encode_value(value: Any, hint: Any, frames: list[Any]) -> Any:
    if hint is memoryview:
        frames.append(value)
        return len(frames) - 1
    if value is None or isinstance(value, bool | int | float | str):
        return value.value if isinstance(value, enum.Enum) else value
    if dataclasses.is_dataclass(value):
        return _encode_dataclass(value, frames)
    if isinstance(value, tuple):
        item_hints = _tuple_item_hints(_strip_optional(hint), len(value))
        return [_encode_value(item, h, frames) for item, h in zip(value, item_hints, strict=True)]
    raise TypeError(f"cannot encode {type(value).__name__}")


# --- Decoding by annotation ---------------------------------------------------------------------


def _decode_dataclass(
    cls: type, body: Any, frames: Sequence[Any], used: list[bool], path: str
) -> Any:
    if not isinstance(body, dict):
        raise ValueError(f"{path} must be a map")
    hints = _field_hints(cls)
    # Fields the body holds beyond these are a later version's: ignored (forward compatibility).
    values = {}
    for field in dataclasses.fields(cls):
        if field.name in body:
            values[field.name] = _decode_value(
                body[field.name], hints[field.name], frames, used, f"{path}.{field.name}"
            )
        elif field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING:
            raise ValueError(f"{path}: missing field {field.name!r}")
    return cls(**values)


def _decode_value(value: Any, hint: Any, frames: Sequence[Any], used: list[bool], path: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        if value is None and type(None) in typing.get_args(hint):
            return None
        return _decode_value(value, _strip_optional(hint), frames, used, path)
    if hint is memoryview:
        if not _is_int(value) or not 0 < value < len(frames):
            raise ValueError(f"{path}: frame index {value!r} out of range")
        if used[value]:
            raise ValueError(f"{path}: frame {value} referenced twice")
        used[value] = True
        return memoryview(frames[value]).cast("B")
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{path} must be a bool")
        return value
    if hint is int:
        if not _is_int(value):
            raise ValueError(f"{path} must be an int")
        return value
    if hint is float:
        if not isinstance(value, float | int) or isinstance(value, bool):
            raise ValueError(f"{path} must be a number")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ValueError(f"{path} must be a string")
        return value
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        try:
            return hint(value)
        except ValueError:
            raise ValueError(f"{path}: {value!r} is not one of {[m.value for m in hint]}") from None
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return _decode_dataclass(hint, value, frames, used, path)
    if origin is tuple:
        if not isinstance(value, list | tuple):
            raise ValueError(f"{path} must be an array")
        item_hints = _tuple_item_hints(hint, len(value))
        return tuple(
            _decode_value(item, h, frames, used, f"{path}[{i}]")
            for i, (item, h) in enumerate(zip(value, item_hints, strict=True))
        )
    raise TypeError(f"{path}: no decoder for {hint!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _strip_optional(hint: Any) -> Any:
    if typing.get_origin(hint) in (types.UnionType, typing.Union):
        (inner,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        return inner
    return hint


def _tuple_item_hints(hint: Any, length: int) -> list[Any]:
    args = typing.get_args(hint)
    if len(args) == 2 and args[1] is Ellipsis:
        return [args[0]] * length
    if len(args) != length:
        raise ValueError(f"expected {len(args)} items, got {length}")
    return list(args)


_HINTS: dict[type, dict[str, Any]] = {}


def _field_hints(cls: type) -> dict[str, Any]:
    """The annotations of a dataclass's fields, resolved once per class."""
    hints = _HINTS.get(cls)
    if hints is None:
        resolved = typing.get_type_hints(cls)
        hints = {field.name: resolved[field.name] for field in dataclasses.fields(cls)}
        _HINTS[cls] = hints
    return hints


# --- Compiled per message class -----------------------------------------------------------------

Encoder = Callable[[Any, list[Any]], Any]
# decoder(value, frames, used) -> the field's value; raises on anything not exactly as annotated.
Decoder = Callable[[Any, Sequence[Any], list[bool]], Any]

_PLAIN = frozenset({int, float, str, bool, type(None)})


class _Refused(Exception):
    """A value the fast decoder does not take as it is; the checking decoder looks at it."""


@dataclass(frozen=True)
class _Plan:
    """A dataclass's encoder and fast decoder, made once from its annotations."""

    cls: type
    encoders: tuple[tuple[str, Encoder], ...]
    decoders: tuple[tuple[str, Decoder], ...]
    required: frozenset[str]

    def encode(self, value: Any, frames: list[Any]) -> dict[str, Any]:
        return {name: encoder(getattr(value, name), frames) for name, encoder in self.encoders}

    def decode(self, body: Any, frames: Sequence[Any], used: list[bool]) -> Any:
        if type(body) is not dict:
            raise _Refused
        values = {}
        for name, decoder in self.decoders:
            if name in body:
                values[name] = decoder(body[name], frames, used)
            elif name in self.required:
                raise _Refused
        return self.cls(**values)


_PLANS: dict[type, _Plan] = {}


def _plan(cls: type) -> _Plan:
    plan = _PLANS.get(cls)
    if plan is None:
        hints = _field_hints(cls)
        fields = dataclasses.fields(cls)
        plan = _Plan(
            cls,
            tuple((name, _encoder(hint)) for name, hint in hints.items()),
            tuple((name, _decoder(hint)) for name, hint in hints.items()),
            frozenset(
                field.name
                for field in fields
                if field.default is dataclasses.MISSING
                and field.default_factory is dataclasses.MISSING
            ),
        )
        _PLANS[cls] = plan
    return plan


def _encoder(hint: Any) -> Encoder:
    """How to encode a value annotated ``hint``; a value of another type than expected takes
    the generic path (``_encode_value``), so encoding never depends on the plan being right."""
    if hint is memoryview:

        def frame(value: Any, frames: list[Any]) -> int:
            frames.append(value)
            return len(frames) - 1

        return frame
    inner = _strip_optional(hint)
    if inner in _PLAIN:
        return lambda value, frames: (
            value if type(value) in _PLAIN else _encode_value(value, hint, frames)
        )
    if isinstance(inner, type) and issubclass(inner, enum.Enum):
        return lambda value, frames: (
            value.value if type(value) is inner else _encode_value(value, hint, frames)
        )
    if isinstance(inner, type) and dataclasses.is_dataclass(inner):
        return lambda value, frames: (
            _plan(inner).encode(value, frames)
            if type(value) is inner
            else _encode_value(value, hint, frames)
        )
    args = typing.get_args(inner)
    if typing.get_origin(inner) is tuple and len(args) == 2 and args[1] is Ellipsis:
        item = _encoder(args[0])
        return lambda value, frames: (
            [item(v, frames) for v in value]
            if type(value) is tuple
            else _encode_value(value, hint, frames)
        )
    return lambda value, frames: _encode_value(value, hint, frames)


def _decoder(hint: Any) -> Decoder:
    """How to decode a value annotated ``hint``: exactly what ``_decode_value`` accepts of
    well-formed input, or narrower (it raises for the rest)."""
    origin = typing.get_origin(hint)
    if origin in (types.UnionType, typing.Union):
        inner = _decoder(_strip_optional(hint))
        if type(None) not in typing.get_args(hint):
            return inner
        return lambda value, frames, used: None if value is None else inner(value, frames, used)
    if hint is memoryview:

        def frame(value: Any, frames: Sequence[Any], used: list[bool]) -> memoryview:
            if type(value) is not int or not 0 < value < len(frames) or used[value]:
                raise _Refused
            used[value] = True
            return memoryview(frames[value]).cast("B")

        return frame
    if hint in (bool, int, str):

        def plain(value: Any, frames: Sequence[Any], used: list[bool]) -> Any:
            if type(value) is not hint:
                raise _Refused
            return value

        return plain
    if hint is float:

        def number(value: Any, frames: Sequence[Any], used: list[bool]) -> float:
            if type(value) is not float and type(value) is not int:
                raise _Refused
            return float(value)

        return number
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return lambda value, frames, used: hint(value)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return lambda value, frames, used: _plan(hint).decode(value, frames, used)
    if origin is tuple:
        args = typing.get_args(hint)
        if len(args) == 2 and args[1] is Ellipsis and args[0] in (bool, int, str):
            kind = args[0]

            def plain_items(value: Any, frames: Sequence[Any], used: list[bool]) -> tuple[Any, ...]:
                if type(value) is not list and type(value) is not tuple:
                    raise _Refused
                for v in value:
                    if type(v) is not kind:
                        raise _Refused
                return tuple(value)

            return plain_items
        if len(args) == 2 and args[1] is Ellipsis:
            item = _decoder(args[0])

            def items(value: Any, frames: Sequence[Any], used: list[bool]) -> tuple[Any, ...]:
                if type(value) is not list and type(value) is not tuple:
                    raise _Refused
                return tuple([item(v, frames, used) for v in value])

            return items
        each = [_decoder(arg) for arg in args]

        def fixed(value: Any, frames: Sequence[Any], used: list[bool]) -> tuple[Any, ...]:
            if (type(value) is not list and type(value) is not tuple) or len(value) != len(each):
                raise _Refused
            return tuple([d(v, frames, used) for d, v in zip(each, value, strict=True)])

        return fixed

    def unknown(value: Any, frames: Sequence[Any], used: list[bool]) -> Any:
        raise _Refused

    return unknown
