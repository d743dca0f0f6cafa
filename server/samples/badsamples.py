"""Bad samples: which samples make a batch fail, and what the batch becomes without them.

DALI's message does not always name the sample that failed ("nvImageCodec failure: '#4'"
says nothing of where), and after an error the pipeline object is dead. So after a failure the
executor rebuilds the pipeline and bisects: it runs halves of the batch, then halves of a half
that fails, down to single samples, rebuilding after each failed run. A batch with k bad
samples of n costs about 2k·log2(n/k) runs. A batch that fails while no sample fails on its own
(a batch-level error) has no bad samples, and fails as before whatever the policy.

Image samples that declare more than ``max_image_pixels`` pixels are bad before any run
(:mod:`dalid.server.samples.imagesize` says which samples are images).

The policy of the pipeline (:class:`dalid.protocol.OnError`) then decides: ``raise`` fails the
batch naming the bad samples; ``skip`` runs the good samples alone; ``replace`` runs the batch
with each bad sample replaced by a good one of the same batch (the first good one for the first
bad, the second for the second, and so on, round the good ones). A batch with no good sample
fails under every policy: there is nothing to skip to or replace with.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from dalid.protocol import BadSample, ErrorCode, OnError

from .causes import explain
from .imagesize import image_size, pixels

log = logging.getLogger("dalid.server")

# Each input's samples: one array of them (one shape), or a list.
Arrays = Mapping[str, np.ndarray | Sequence[np.ndarray]]
Trial = Callable[[list[int]], Exception | None]
"""Runs the samples at these positions as one batch on a fresh pipeline; the error, or None."""


def oversized_images(
    arrays: Arrays, max_pixels: int, path_inputs: Collection[str] = ()
) -> dict[int, str]:
    """Positions of image samples that declare more than ``max_pixels`` pixels, with why.

    An image sample is a 1-D uint8 sample of any input but ``path_inputs`` whose bytes start
    with a header :func:`~dalid.server.samples.imagesize.image_size` reads. An input's samples share
    one dtype and rank, so an input of anything else is passed over whole. ``max_pixels`` 0
    checks nothing.
    """
    found: dict[int, str] = {}
    if max_pixels <= 0:
        return found
    for name, samples in arrays.items():
        if name in path_inputs or not len(samples):
            continue
        first = samples[0]
        if first.dtype != np.uint8 or first.ndim != 1:
            continue
        for position, sample in enumerate(samples):
            if position in found:
                continue
            size = image_size(sample.data)
            if size is not None and pixels(size) > max_pixels:
                found[position] = (
                    f"input {name!r}: the image declares {size[0]}x{size[1]} pixels, over this "
                    f"daemon's limit of {max_pixels} (dalid serve --max-image-pixels)"
                )
    return found


def select(arrays: Arrays, positions: Sequence[int]) -> dict[str, list[np.ndarray]]:
    """The samples at ``positions`` of every input, in that order (no copies)."""
    return {name: [samples[p] for p in positions] for name, samples in arrays.items()}


def find_bad(candidates: list[int], trial: Trial, whole_failed: Exception | None) -> dict[int, str]:
    """The candidates that fail when run on their own, with DALI's message for each.

    ``whole_failed`` is the error of a run of all candidates that already happened (None: it
    has not been tried yet).
    """
    found: dict[int, str] = {}

    def search(positions: list[int], error: Exception | None) -> None:
        if error is None:
            error = trial(positions)
            if error is None:
                return
        if len(positions) == 1:
            found[positions[0]] = dali_message(error)
            return
        middle = len(positions) // 2
        search(positions[:middle], None)
        search(positions[middle:], None)

    if candidates:
        search(candidates, whole_failed)
    return found


def plan(
    policy: OnError, batch_size: int, bad: Mapping[int, str]
) -> tuple[list[int], list[BadSample]]:
    """The positions to run (empty: the batch fails) and the report of each bad sample."""
    good = [p for p in range(batch_size) if p not in bad]
    if policy is OnError.RAISE or not good:
        return [], [BadSample(p, bad[p]) for p in sorted(bad)]
    if policy is OnError.SKIP:
        return good, [BadSample(p, bad[p]) for p in sorted(bad)]
    positions = list(range(batch_size))
    report = []
    for number, position in enumerate(sorted(bad)):
        positions[position] = good[number % len(good)]
        report.append(BadSample(position, bad[position], replaced_by=positions[position]))
    return positions, report


def summary(bad: Sequence[BadSample], limit: int = 4) -> str:
    """One line naming the bad samples and the first messages."""
    shown = "; ".join(f"sample {s.position}: {s.message}" for s in bad[:limit])
    more = f"; and {len(bad) - limit} more" if len(bad) > limit else ""
    return f"{len(bad)} bad sample(s) at positions {[s.position for s in bad]}: {shown}{more}"


# Lines of DALI's error text that say nothing of this error: its C++ context, where the
# operator was defined in the client's source, and that the pipeline object is now dead.
_BOILERPLATE = (
    "C++ context",
    "Critical error in pipeline",
    "which was used in the pipeline definition",
    "  File ",
    "Current pipeline object is no longer valid",
)


def dali_message(error: BaseException) -> str:
    """DALI's message without the lines that repeat or say nothing of this error."""
    lines: list[str] = []
    source_line = False
    for line in str(error).strip().splitlines():
        if source_line:  # the code line under a traceback's "File ..." line
            source_line = False
            continue
        source_line = line.startswith("  File ")
        if line.strip() and not line.startswith(_BOILERPLATE) and line.strip() not in lines:
            lines.append(line.strip())
    return " ".join(lines) or type(error).__name__


class Runner(Protocol):
    """What recovery does with a pipeline (``runner.PipelineRunner``)."""

    def schedule(self, inputs: Arrays) -> None: ...

    def collect(self, cuda_stream: int | None = None) -> tuple[Any, ...]: ...

    def release(self) -> None: ...

    def rebuild(self) -> None: ...


@dataclass
class Recovered:
    """What becomes of a batch that failed: ``outputs`` of its good samples, to deliver and
    then ``release`` on the runner (None: the batch fails with ``code`` and ``message``), and
    the report of its bad samples."""

    outputs: tuple[Any, ...] | None
    report: list[BadSample] = field(default_factory=list)
    code: ErrorCode = ErrorCode.BAD_SAMPLES
    message: str = ""


def recover(
    runner: Runner,
    arrays: Arrays,
    *,
    size: int,
    policy: OnError,
    failure: tuple[ErrorCode, Exception | None],
    bad: dict[int, str],
    stream: int | None = None,
    path_inputs: Collection[str] = (),
) -> Recovered:
    """Finds the samples of a batch that fail on their own and applies ``policy``, on the idle
    ``runner``, which it leaves idle and working.

    ``failure`` is the code and error of the batch's run (no error: it did not run, its ``bad``
    samples were found before); ``stream`` is where the good samples' outputs are handed over;
    ``path_inputs`` the inputs whose samples are file paths (their causes read differently).
    """
    code, error = failure
    # Whether the pipeline has run since it was last built: a batch that fails then gets a
    # fresh one, as after any failure, so the trials leave no trace (the dimensionality
    # external_source remembers, say).
    ran = False

    def trial(positions: list[int]) -> Exception | None:
        nonlocal ran
        try:
            runner.schedule(select(arrays, positions))
            runner.collect()
        except Exception as failed:
            runner.rebuild()
            ran = False
            return failed
        runner.release()
        ran = True
        return None

    def failed(code: ErrorCode, message: str, report: list[BadSample] | None = None) -> Recovered:
        if ran:
            runner.rebuild()
        return Recovered(None, report or [], code, message)

    candidates = [position for position in range(size) if position not in bad]
    if arrays:
        found = find_bad(candidates, trial, whole_failed=None if bad else error)
        bad.update(explain(found, arrays, path_inputs))
    if not bad:
        assert error is not None
        return failed(code, dali_message(error))
    positions, report = plan(policy, size, bad)
    if not positions:
        every = "" if policy is OnError.RAISE else "every sample of the batch is bad: "
        return failed(ErrorCode.BAD_SAMPLES, every + summary(report), report)
    try:
        runner.schedule(select(arrays, positions))
        outputs = runner.collect(stream)
    except Exception as error_of_good:
        runner.rebuild()
        return Recovered(None, report, ErrorCode.PIPELINE_ERROR, dali_message(error_of_good))
    return Recovered(outputs, report)
