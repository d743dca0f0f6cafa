"""DALI's serialized pipeline, a ``PipelineDef`` protocol buffer (``dali/pipeline/proto/
dali.proto``), read and written in the wire format: no protobuf package, and what cannot be
read is refused (:class:`UnreadablePipeline`). Stateless.
"""

from __future__ import annotations

from collections.abc import Iterator

# PipelineDef: operators (5), legacy external inputs (6) and outputs (7) are the graph; the
# other fields belong to one build (thread count 1, batch size 2, executor flags 3 and 4,
# device 8, seed 9, and those later DALI releases add).
PIPELINE_OPERATOR = 5
GRAPH_FIELDS = frozenset({5, 6, 7})
# OpDef: its schema name, inputs, outputs and arguments; InputOutput: the tensor's name and,
# for an argument input, the argument's.
OP_NAME, OP_INPUT, OP_OUTPUT, OP_ARG = 1, 2, 3, 4
IO_NAME, IO_ARGUMENT = 1, 4
# Argument: name, type, repeated strings, bools and elements (a list's), whether a list.
ARG_NAME, ARG_TYPE, ARG_STRINGS, ARG_BOOLS, ARG_ELEMENTS, ARG_IS_VECTOR = 1, 2, 5, 6, 7, 8


class UnreadablePipeline(ValueError):
    """Bytes that are not a serialized DALI pipeline this module can read."""


def spans(raw: bytes) -> Iterator[tuple[int, int, bytes | int, int, int]]:
    """(field number, wire type, value, start, end) of each field of a protocol buffer
    message: varints as ints, length-delimited and fixed-size fields as bytes; ``raw[start:end]``
    is the whole field, its key included."""
    position, end = 0, len(raw)
    while position < end:
        start = position
        key, position = varint_at(raw, position)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, position = varint_at(raw, position)
            yield number, wire, value, start, position
            continue
        if wire == 2:
            size, position = varint_at(raw, position)
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
        else:
            raise UnreadablePipeline(f"unsupported protocol buffer wire type {wire}")
        if position + size > end:
            raise UnreadablePipeline("the serialized pipeline is truncated")
        yield number, wire, raw[position : position + size], start, position + size
        position += size


def fields(raw: bytes) -> Iterator[tuple[int, int, bytes | int]]:
    """(field number, wire type, value) of each field of a protocol buffer message: varints as
    ints, length-delimited and fixed-size fields as bytes."""
    for number, wire, value, _, _ in spans(raw):
        yield number, wire, value


def string_field(raw: bytes, number: int) -> bytes:
    """The first length-delimited field ``number`` of a message (b"" if none)."""
    for field, _, value in fields(raw):
        if field == number and isinstance(value, bytes):
            return value
    return b""


def varint_at(raw: bytes, position: int) -> tuple[int, int]:
    """The varint at ``position`` of ``raw``, and the position after it."""
    value = shift = 0
    while True:
        if position >= len(raw) or shift > 63:
            raise UnreadablePipeline("the serialized pipeline is truncated")
        byte = raw[position]
        position += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, position


def varint(number: int) -> bytes:
    """``number`` as a varint (a negative one as its 64-bit two's complement, as int64s are)."""
    number &= (1 << 64) - 1
    out = bytearray()
    while True:
        byte = number & 0x7F
        number >>= 7
        if not number:
            out.append(byte)
            return bytes(out)
        out.append(byte | 0x80)


def encode(message: list[tuple[int, bytes | int]]) -> bytes:
    """A message of (field number, value) pairs: ints as varints, bytes length-delimited."""
    out = bytearray()
    for number, value in message:
        if isinstance(value, int):
            out += varint(number << 3) + varint(value)
        else:
            out += varint(number << 3 | 2) + varint(len(value)) + value
    return bytes(out)


def true_argument(argument: bytes) -> bool:
    """Whether a boolean operator argument (an ``Argument``) is given as true."""
    return any(number == ARG_BOOLS and value == 1 for number, _, value in fields(argument))


def bool_argument(name: str, value: bool) -> bytes:
    """One boolean operator argument, as DALI serializes it."""
    return encode(
        [(ARG_NAME, name.encode()), (ARG_TYPE, b"bool"), (ARG_BOOLS, int(value)),
         (ARG_IS_VECTOR, 0)]
    )  # fmt: skip
