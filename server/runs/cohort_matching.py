"""How a cohort tells batches of the same inputs (``cohorts.py``): a digest of the batch's input
frames finds candidates, an exact comparison of their bytes decides. Per batch, never per
sample: each frame is hashed and compared whole."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from dalid.protocol import InputBatch


def batch_digest(inputs: Sequence[InputBatch], unreadable: Sequence[int] = ()) -> bytes:
    """A digest of a batch's inputs, per batch: each input's frames are hashed whole (hashlib
    lets go of the GIL for buffers this large), never sample by sample."""
    digest = hashlib.blake2b(digest_size=16)
    for item in sorted(inputs, key=lambda item: item.name):
        digest.update(f"{item.name}\0{item.dtype}\0{item.ndim}\0{item.size}\0".encode())
        digest.update(item.shapes)
        digest.update(item.data)
    digest.update(repr(tuple(unreadable)).encode())
    return digest.digest()


def _same_bytes(a: memoryview, b: memoryview) -> bool:
    return a.nbytes == b.nbytes and bool(
        np.array_equal(np.frombuffer(a, np.uint8), np.frombuffer(b, np.uint8))
    )


def same_inputs(
    a: Sequence[InputBatch],
    b: Sequence[InputBatch],
    a_unreadable: Sequence[int] = (),
    b_unreadable: Sequence[int] = (),
) -> bool:
    """Whether two batches feed the pipeline exactly the same samples (compared byte for byte,
    one numpy call per frame): the digest only finds candidates."""
    if tuple(a_unreadable) != tuple(b_unreadable) or len(a) != len(b):
        return False
    by_name = {item.name: item for item in b}
    for item in a:
        other = by_name.get(item.name)
        if (
            other is None
            or (item.dtype, item.ndim, item.size) != (other.dtype, other.ndim, other.size)
            or not _same_bytes(item.shapes, other.shapes)
            or not _same_bytes(item.data, other.data)
        ):
            return False
    return True
