"""How the daemon's DALI reads the files its jobs name: ``fn.io.file.read`` with plain reads,
never a memory map (Note [Plain file reads]).

Note [Plain file reads]
~~~~~~~~~~~~~~~~~~~~~~~
Every ``fn.io.file.read`` of a pipeline the daemon builds from its serialized form reads with
``read(2)``, as ``dont_use_mmap=True`` asks, whatever the client's graph says: the operator
copies a file's bytes into its output either way, so its outputs are the same. A map costs
the pool's threads a map, its page faults and an unmap each file, DALI keeps every path it ever
mapped in a process-wide table that nothing empties, and a file cut short while mapped
would kill the daemon with SIGBUS. An operator that asks for ``use_o_direct`` is left as it is.
Measured, why, and the tests: docs/design/checking-paths.md, "How DALI reads the files".
"""

from __future__ import annotations

from dalid.protocol.file_inputs import FILE_READER

from .wire import (
    ARG_NAME,
    OP_ARG,
    OP_NAME,
    PIPELINE_OPERATOR,
    bool_argument,
    encode,
    spans,
    string_field,
    true_argument,
)

DONT_USE_MMAP = b"dont_use_mmap"
USE_O_DIRECT = b"use_o_direct"
# The argument added, as an OpDef field.
_PLAIN = encode([(OP_ARG, bool_argument(DONT_USE_MMAP.decode(), True))])


def read_plainly(serialized: bytes) -> bytes:
    """``serialized`` (a ``PipelineDef``) with every ``fn.io.file.read`` set to read with
    ``read(2)`` (``dont_use_mmap=True``) but one asked for ``use_o_direct``; the same bytes if
    it changes nothing (Note [Plain file reads])."""
    out = bytearray()
    changed = False
    for number, _, value, start, end in spans(serialized):
        if number == PIPELINE_OPERATOR and isinstance(value, bytes):
            plain = _plain(value)
            if plain is not None:
                out += encode([(number, plain)])
                changed = True
                continue
        out += serialized[start:end]
    return bytes(out) if changed else serialized


def _plain(operator: bytes) -> bytes | None:
    """The operator (an ``OpDef``) set to read plainly, or None where it is left as it is: it
    is not a file read, asks for direct I/O, or reads plainly already."""
    if string_field(operator, OP_NAME) != FILE_READER.encode():
        return None
    out = bytearray()
    for number, _, value, start, end in spans(operator):
        if number == OP_ARG and isinstance(value, bytes):
            name = string_field(value, ARG_NAME)
            if name == USE_O_DIRECT and true_argument(value):
                return None
            if name == DONT_USE_MMAP:
                if true_argument(value):
                    return None
                continue
        out += operator[start:end]
    return bytes(out) + _PLAIN
