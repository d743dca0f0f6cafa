"""File paths given to a pipeline that reads files: the daemon opens them, as the trainer would.

With DALI's proxy the pipeline runs in the trainer, so ``fn.io.file.read`` opens a relative
path from the trainer's working directory. The daemon runs elsewhere, so before a batch leaves
this process every path sample of an input that feeds ``fn.io.file.read`` (which inputs those
are: ``dalid.protocol.file_inputs``, as the daemon decides it) is made absolute from
the trainer's working directory (its directory when the proxy was made, carried to the
DataLoader workers in the pickled proxy), and the samples whose file this process cannot read
are named in the submission (``SubmitBatch.unreadable``). The daemon then tells a missing file
(a bad sample) from a file it cannot see (``dalid.server.samples.paths``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import numpy as np

# The dtypes DALI's file reader takes a path in.
PATH_DTYPES = frozenset({np.dtype(np.int8), np.dtype(np.uint8)})
_SLASH = ord("/")


def resolve_paths(
    call_args: Mapping[str, Sequence[np.ndarray]], names: Sequence[str], directory: str
) -> tuple[Mapping[str, Sequence[np.ndarray]], tuple[int, ...]]:
    """``call_args`` with the path samples of inputs ``names`` made absolute from
    ``directory``, and the positions of those whose file this process cannot read."""
    if not names:
        return call_args, ()
    resolved = dict(call_args)
    unreadable: set[int] = set()
    base = os.fsencode(directory)
    # One pass per input, a few operations per path: this runs for every sample a worker sends.
    access, join, readable = os.access, os.path.join, os.R_OK
    for name in names:
        samples = list(call_args.get(name, ()))
        for position, sample in enumerate(samples):
            if sample.dtype not in PATH_DTYPES or sample.ndim != 1:
                continue
            path = sample.tobytes()
            if not path or b"\0" in path:
                continue  # not a path; the daemon says so
            if path[0] != _SLASH and base:
                path = join(base, path)
                samples[position] = np.frombuffer(path, dtype=sample.dtype)
            if not access(path, readable):
                unreadable.add(position)
        resolved[name] = samples
    return resolved, tuple(sorted(unreadable))
