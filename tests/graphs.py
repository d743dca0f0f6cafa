"""Serialized DALI graphs edited as an attacker would: DALI's ``PipelineDef`` edited with
``dalid.server.pipelines.wire``, and a seeded generator of hostile graphs for fuzzing the
daemon's graph checker."""

from __future__ import annotations

import random
from collections.abc import Callable

from dalid.server.pipelines.operators import ALLOWED, EXCLUDED
from dalid.server.pipelines.wire import (
    ARG_IS_VECTOR,
    ARG_NAME,
    ARG_TYPE,
    OP_ARG,
    OP_NAME,
    PIPELINE_OPERATOR,
    encode,
    fields,
)

# Argument: its int64 values (wire.py names the fields the daemon reads).
_ARG_INTS = 4

Fields = list[tuple[int, bytes | int]]


def decode(raw: bytes) -> Fields:
    return [(number, value) for number, _, value in fields(raw)]


def int_argument(name: str, value: int) -> bytes:
    """One int64 operator argument, as DALI serializes it."""
    return encode(
        [(ARG_NAME, name.encode()), (ARG_TYPE, b"int64"), (_ARG_INTS, value), (ARG_IS_VECTOR, 0)]
    )


def edit_operators(serialized: bytes, edit: Callable[[int, Fields], Fields]) -> bytes:
    """The graph with each operator's fields replaced by ``edit(index, fields)``."""
    out: Fields = []
    index = 0
    for number, value in decode(serialized):
        if number == PIPELINE_OPERATOR and isinstance(value, bytes):
            out.append((number, encode(edit(index, decode(value)))))
            index += 1
        else:
            out.append((number, value))
    return encode(out)


def renamed(serialized: bytes, old: str, new: str, *arguments: bytes) -> bytes:
    """The graph with operator ``old`` renamed ``new``, given ``arguments`` more."""

    def edit(_: int, fields: Fields) -> Fields:
        if (OP_NAME, old.encode()) not in fields:
            return fields
        kept = [(n, new.encode() if n == OP_NAME else v) for n, v in fields]
        return kept + [(OP_ARG, raw) for raw in arguments]

    return edit_operators(serialized, edit)


def operator_names(serialized: bytes) -> list[str]:
    names: list[str] = []
    for number, value in decode(serialized):
        if number == PIPELINE_OPERATOR and isinstance(value, bytes):
            names.extend(
                v.decode() for n, v in decode(value) if n == OP_NAME and isinstance(v, bytes)
            )
    return names


_KINDS = ["int64", "float", "string", "bool", "TensorList", "", "int32", "\x00\xff"]
_NAMES = sorted(ALLOWED) + sorted(EXCLUDED)


def hostile_graph(rng: random.Random, base: bytes) -> bytes:
    """A graph derived from ``base`` as a fuzzer would: operators renamed (to any DALI
    operator, a near miss of one, or junk), arguments added, changed or dropped, or raw bytes
    flipped, cut or spliced."""
    how = rng.choice(["rename", "arguments", "both", "bytes"])
    if how == "bytes":
        raw = bytearray(base)
        for _ in range(rng.randint(1, 8)):
            choice = rng.random()
            position = rng.randrange(len(raw))
            if choice < 0.6:
                raw[position] = rng.randrange(256)
            elif choice < 0.8:
                del raw[position : position + rng.randint(1, 16)]
            else:
                raw[position:position] = rng.randbytes(rng.randint(1, 16))
        return bytes(raw)

    def name() -> str:
        pick = rng.random()
        if pick < 0.6:
            return rng.choice(_NAMES)
        if pick < 0.8:
            near = rng.choice(_NAMES)
            return near[: rng.randrange(1, len(near) + 1)] + rng.choice(["", "Impl", "_", "x"])
        return rng.randbytes(rng.randint(0, 24)).decode("latin-1")

    def value() -> int | bytes:
        choices: list[int | bytes] = [
            rng.randint(-(2**63), 2**64 - 1),
            rng.randbytes(rng.randint(0, 32)),
            0,
            -1,
            2**31,
        ]
        return rng.choice(choices)

    def edit(_: int, fields: Fields) -> Fields:
        out = list(fields)
        if how in ("rename", "both") and rng.random() < 0.5:
            out = [(n, name().encode("latin-1") if n == OP_NAME else v) for n, v in out]
        if how in ("arguments", "both"):
            for _ in range(rng.randint(0, 3)):
                action = rng.random()
                args = [i for i, (n, _) in enumerate(out) if n == OP_ARG]
                if action < 0.4 or not args:
                    raw = encode(
                        [
                            (1, name().encode("latin-1")),
                            (2, rng.choice(_KINDS).encode("latin-1")),
                            (rng.choice([3, 4, 5, 6, 7]), value()),
                        ]
                    )
                    out.append((OP_ARG, raw))
                elif action < 0.7:
                    del out[rng.choice(args)]
                else:
                    index = rng.choice(args)
                    arg = decode(out[index][1])  # type: ignore[arg-type]
                    arg = [(n, value() if n not in (1, 2) else v) for n, v in arg]
                    out[index] = (OP_ARG, encode(arg))
        return out

    return edit_operators(base, edit)
