"""Samples that are file paths: the daemon opens the files, so it checks that it sees them.

The daemon, not the trainer, opens the files of a pipeline that reads them. A file the
trainer could not read either is a bad sample; one the trainer reads and the daemon cannot
fails the batch with :class:`FilesUnseen`, which says what to mount.

Note [Checking paths per directory]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
Every batch has the outcome a check of each file would give it, and only a batch that fails
pays for a check of each file's access. Before a run (:func:`check_paths`) empty paths, NUL
bytes and the samples the trainer could not read are bad samples, found as arrays; a path
that is not a regular file
(a FIFO, a device, a directory) is a bad sample too, found by one ``os.stat`` per path in a
loop of C (:func:`stat_paths`: a FIFO would block DALI's ``open`` forever), once per period
for a path found regular (:class:`RegularFiles`). The same stats'
sizes are what DALI will read: a batch whose files come to more than its job may read at
once fails with :class:`FilesTooLarge` before DALI allocates them. Then only the
directory of the first good path is looked at, once per :data:`DIRECTORY_RECHECK_S`
(:class:`DirectoryChecks`). A batch whose run fails is checked file by file
(:func:`unseen_file`) before any bad sample is looked for. Why, what the check leaves open
(a path replaced between the check and DALI's ``open``), and the tests that hold it:
docs/design/checking-paths.md.
"""

from __future__ import annotations

import functools
import itertools
import operator
import os
import stat
import threading
import time
from collections.abc import Collection, Iterable, Sequence
from pathlib import PurePosixPath
from typing import Any, NamedTuple

import numpy as np

from dalid.protocol import InputBatch

from .packed import PackedSamples

# The dtypes DALI's file reader takes a path in.
PATH_DTYPES = frozenset({np.dtype(np.int8), np.dtype(np.uint8)})
PATH_DTYPE_NAMES = frozenset(dtype.name for dtype in PATH_DTYPES)

# A directory the daemon could enter is looked at again after this long. Not 1 s: a dataset's
# directories (ImageNet's 1,000) cost an os.access each per period, and the look decides no
# batch's outcome (Note [Checking paths per directory]); it only finds a dataset the daemon
# does not see before a run fails on it.
DIRECTORY_RECHECK_S = 10.0
# Directories remembered at most; past that the memory starts afresh.
MAX_DIRECTORIES = 1 << 16


class FilesUnseen(Exception):
    """The daemon cannot open a file that the trainer can: it does not see the trainer's
    files. The message says which and what to mount."""


class FilesTooLarge(Exception):
    """A batch's files come to more bytes than its job may have read at once: refused before
    DALI reads them. The message names the largest file, the sizes and what to do."""


class Lately:
    """What was found lately, by key: the memory starts afresh once a period of ``recheck_s``
    has passed, or once it holds ``most`` keys. Thread-safe: the executors of several
    pipelines check their batches at once."""

    def __init__(self, recheck_s: float, most: int) -> None:
        self.recheck_s = recheck_s
        self.most = most
        self._found: dict[Any, Any] = {}
        self._period_start = time.monotonic()
        self._lock = threading.Lock()

    def _look(self, keys: Iterable[Any], missing: Any) -> list[Any]:
        """What was found of each key in this period, ``missing`` for the others (starting the
        next period if due)."""
        now = time.monotonic()
        with self._lock:
            if now - self._period_start >= self.recheck_s or len(self._found) >= self.most:
                self._found = {}
                self._period_start = now
            return list(map(self._found.get, keys, itertools.repeat(missing)))

    def _remember(self, found: Iterable[tuple[Any, Any]]) -> None:
        with self._lock:
            self._found.update(found)


class DirectoryChecks(Lately):
    """The directories the daemon could enter lately (Note [Checking paths per directory]).

    Time runs in periods of ``recheck_s``: a directory is looked at (one ``os.access``) the
    first time it is the directory a batch is checked by in a period, so at least once per
    ``recheck_s`` while batches name it first. A batch whose directory was looked at in this
    period costs one look-up.
    """

    def __init__(self, recheck_s: float = DIRECTORY_RECHECK_S) -> None:
        super().__init__(recheck_s, MAX_DIRECTORIES)
        self.lookups = 0  # os.access calls made, for tests and the curious

    def seen_lately(self, directory: bytes) -> bool:
        """Whether ``directory`` was looked at in this period (starting the next one if due)."""
        return bool(self._look((directory,), False)[0])

    def enterable(self, directory: bytes) -> bool:
        """Whether the daemon may enter ``directory`` (b"" is its working directory); one that
        it may is remembered for the rest of the period."""
        self.lookups += 1
        if not os.access(directory or b".", os.X_OK):
            return False
        self._remember(((directory, True),))
        return True


DIRECTORIES = DirectoryChecks()

# Paths remembered as regular files at most; past that the memory starts afresh.
MAX_REGULAR_FILES = 1 << 17


class RegularFiles(Lately):
    """The paths found to name regular files lately, by their hash, with their sizes (Note
    [Checking paths per directory]): one found in this period of ``recheck_s`` is not
    ``stat``ed again until the next. An epoch of a dataset that passes within the period pays
    one ``stat`` a file, not one a sample of every epoch; one that does not (ImageNet at any
    rate) pays as before, plus a hash a path.
    """

    def __init__(
        self, recheck_s: float = DIRECTORY_RECHECK_S, most: int = MAX_REGULAR_FILES
    ) -> None:
        super().__init__(recheck_s, most)
        self.stats = 0  # paths stat'ed, for tests and the curious

    def sizes(self, keys: list[int]) -> np.ndarray:
        """The sizes of the files of the paths of these hashes found regular in this period,
        -1 for the others (starting the next period if due)."""
        return np.fromiter(self._look(keys, -1), np.int64, len(keys))

    def found_regular(self, keys: list[int], sizes: list[int]) -> None:
        self._remember(zip(keys, sizes, strict=True))


REGULAR_FILES = RegularFiles()


def check_paths(
    inputs: Sequence[InputBatch],
    path_inputs: Collection[str],
    unreadable: Collection[int],
    directories: DirectoryChecks = DIRECTORIES,
    max_read_bytes: int = 0,
    *,
    regular: RegularFiles = REGULAR_FILES,
) -> dict[int, str]:
    """The bad samples among the path samples of a batch, with why; raises FilesUnseen where
    the directory of the first path that is not bad is one the daemon cannot enter (Note
    [Checking paths per directory]), and FilesTooLarge where the regular files of the batch
    come to more than ``max_read_bytes`` (0: no limit). Per batch, never per sample."""
    bad: dict[int, str] = {}
    read = 0
    largest: tuple[int, str] = (0, "")
    for item in inputs:
        if (
            item.name not in path_inputs
            or item.dtype not in PATH_DTYPE_NAMES
            or item.ndim != 1
            or not item.size
        ):
            continue
        data = np.frombuffer(item.data, np.uint8)
        bounds = item.sample_bytes()
        starts, stops = bounds[:-1], bounds[1:]
        # Sample i holds bytes starts[i] <= b < stops[i]. Most batches hold neither an empty
        # path nor a NUL byte: one count and one comparison say so.
        empty_or_nul = starts == stops
        if np.count_nonzero(data) < data.size or empty_or_nul.any():
            # A NUL byte's sample is the first whose stop lies past it.
            empty_or_nul[np.searchsorted(stops, np.flatnonzero(data == 0), side="right")] = True
            for position in np.flatnonzero(empty_or_nul).tolist():
                shown = os.fsdecode(data[starts[position] : stops[position]].tobytes())
                bad.setdefault(position, f"input {item.name!r}: {shown!r} is not a file path")
        for position in unreadable:
            if position not in bad:
                shown = os.fsdecode(data[starts[position] : stops[position]].tobytes())
                bad[position] = (
                    f"input {item.name!r}: cannot read {shown}, in the trainer either (a "
                    "missing file, or a wrong path)"
                )
        stats = stat_paths(data, starts, stops, bad, regular)
        for position, kind in stats.odd.items():
            shown = os.fsdecode(data[starts[position] : stops[position]].tobytes())
            bad[position] = (
                f"input {item.name!r}: {shown} is not a regular file ({kind}); the daemon reads "
                "only regular files: give the path of a file"
            )
        if stats.sizes.size:
            read += int(stats.sizes.sum())
            at = int(stats.sizes.argmax())
            if int(stats.sizes[at]) > largest[0]:
                shown = os.fsdecode(data[starts[at] : stops[at]].tobytes())
                largest = (int(stats.sizes[at]), f"input {item.name!r}: {shown}")
        # The first sample that is not bad: at most len(bad) + 1 steps.
        first = next((p for p in range(item.size) if p not in bad), None)
        if first is None:
            continue
        path = data[starts[first] : stops[first]].tobytes()
        directory = path[: path.rfind(b"/") + 1]
        if not directories.seen_lately(directory) and not directories.enterable(directory):
            raise FilesUnseen(unseen_message(os.fsdecode(path)))
    if max_read_bytes and read > max_read_bytes:
        raise FilesTooLarge(too_large_message(read, max_read_bytes, *largest))
    return bad


def too_large_message(read: int, limit: int, size: int, largest: str) -> str:
    """Why a batch whose files come to ``read`` bytes is refused, and what to do."""
    return (
        f"the files of this batch come to {size_text(read)}, more than the {size_text(limit)} "
        "one batch of a job may have the daemon read (the job's share of its input memory, "
        f"half of dalid serve --input-memory); the largest is {largest} ({size_text(size)}). "
        "Send smaller files or fewer of them a batch, or start the daemon with a higher "
        "--input-memory"
    )


def size_text(nbytes: int) -> str:
    """``nbytes`` for people: 1.5 GiB, 64 MiB, 12 KiB, 300 B."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):.3g} {unit}"
    return f"{nbytes} B"


# What a path that is not a regular file names, by its st_mode's type bits.
KINDS = {
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a directory",
}
TYPE_BITS = 0o170000
# Filesystems whose files the kernel makes as they are read: regular by their mode, but of no
# size (/proc/self/mem, /proc/PID/...) or endless; by the device of their mount points here.
KERNEL_FILESYSTEMS = ("/proc", "/sys")
KERNEL_FILE = "a file the kernel makes as it is read (/proc, /sys)"
_MODE = operator.attrgetter("st_mode")
_DEVICE = operator.attrgetter("st_dev")
_SIZE = operator.attrgetter("st_size")


class Stats(NamedTuple):
    """What one ``os.stat`` a path found: the paths that name something other than a regular
    file, by position, with what they name; and each path's size in bytes (0 for those, for
    bad samples and for paths that could not be stat'ed)."""

    odd: dict[int, str]
    sizes: np.ndarray


def stat_paths(
    data: np.ndarray,
    starts: np.ndarray,
    stops: np.ndarray,
    bad: Collection[int],
    regular: RegularFiles | None = None,
) -> Stats:
    """The :class:`Stats` of the paths (sample i: ``data[starts[i]:stops[i]]``, those in ``bad``
    left out).

    One ``os.stat`` a path not found regular in ``regular``'s period, made and read in loops
    of C (``map``), and the modes and sizes judged as arrays: no Python runs per sample. A
    path whose ``stat`` fails (a missing file, or one the daemon does not see) is left to the
    read and the checks after a failure, as before."""
    sizes = np.zeros(len(starts), np.int64)
    keep = np.ones(len(starts), bool)
    keep[list(bad)] = False
    positions = np.flatnonzero(keep)
    if not positions.size:
        return Stats({}, sizes)
    raw = data.tobytes()
    paths = list(map(raw.__getitem__, map(slice, starts[positions].tolist(),
                                         stops[positions].tolist())))  # fmt: skip
    keys: list[int] = []
    if regular is not None:
        keys = list(map(hash, paths))
        known = regular.sizes(keys)
        hits = known >= 0
        sizes[positions[hits]] = known[hits]
        if hits.all():
            return Stats({}, sizes)
        if hits.any():
            chosen = np.flatnonzero(~hits).tolist()
            positions = positions[chosen]
            paths = list(map(paths.__getitem__, chosen))
            keys = list(map(keys.__getitem__, chosen))
        regular.stats += len(paths)
    try:
        stats = list(map(os.stat, paths))
    except (OSError, ValueError):
        # A path that cannot be stat'ed: this batch pays for a loop in Python.
        looked = [_stat_or_none(path) for path in paths]
        seen = [i for i, info in enumerate(looked) if info is not None]
        positions = positions[seen]
        keys = list(map(keys.__getitem__, seen)) if keys else keys
        stats = [info for info in looked if info is not None]
    modes = np.fromiter(map(_MODE, stats), np.int64, len(stats)) & TYPE_BITS
    devices = np.fromiter(map(_DEVICE, stats), np.uint64, len(stats))
    odd = modes != stat.S_IFREG
    kernel = np.zeros(len(stats), bool)
    for device in kernel_devices():
        kernel |= devices == device
    found = {
        int(positions[i]): KINDS.get(int(modes[i]), f"of type {int(modes[i]):o}")
        for i in np.flatnonzero(odd).tolist()
    }
    for i in np.flatnonzero(kernel & ~odd).tolist():
        found[int(positions[i])] = KERNEL_FILE
    fine = ~odd & ~kernel
    file_sizes = np.fromiter(map(_SIZE, stats), np.int64, len(stats))[fine]
    sizes[positions[fine]] = file_sizes
    if regular is not None:
        remembered = np.flatnonzero(fine).tolist()
        regular.found_regular(list(map(keys.__getitem__, remembered)), file_sizes.tolist())
    return Stats(found, sizes)


def _stat_or_none(path: bytes | str) -> os.stat_result | None:
    try:
        return os.stat(path)
    except (OSError, ValueError):
        return None


@functools.cache
def kernel_devices() -> tuple[int, ...]:
    """The devices of :data:`KERNEL_FILESYSTEMS` where the daemon runs (those it has)."""
    found = [_stat_or_none(path) for path in KERNEL_FILESYSTEMS]
    return tuple(info.st_dev for info in found if info is not None)


def unseen_file(
    inputs: Sequence[InputBatch], path_inputs: Collection[str], unreadable: Collection[int]
) -> str:
    """The message of the first file of a batch that the trainer read and the daemon may not
    (a :class:`FilesUnseen` message), or "": the check per file, for a batch that failed."""
    for item in inputs:
        if item.name not in path_inputs or item.dtype not in PATH_DTYPE_NAMES or item.ndim != 1:
            continue
        data = item.data.tobytes()
        bounds = item.sample_bytes().tolist()
        for position, (start, stop) in enumerate(itertools.pairwise(bounds)):
            path = data[start:stop]
            if not path or b"\0" in path or position in unreadable:
                continue  # bad samples, found before the batch ran
            if not os.access(path, os.R_OK):
                return unseen_message(os.fsdecode(path))
    return ""


def unseen_message(path: str) -> str:
    """Why the daemon cannot open ``path``, which the trainer reads, and what to do."""
    where = f"the dalid daemon (pid {os.getpid()}, uid {os.getuid()})"
    if os.path.exists(path):
        return (
            f"{where} may not read {path}, which the trainer reads: the daemon opens the files "
            "itself, so run it as the trainer's user, or let its user read the dataset"
        )
    missing = first_missing(path)
    return (
        f"{where} cannot open {path}, which the trainer reads: the daemon opens the files "
        f"itself, and it does not see the trainer's files ({missing} does not exist where the "
        "daemon runs: another container, or another mount namespace). Mount the dataset's "
        f"directory ({missing}, or one above it) into the daemon's container at the same path "
        "as in the trainer's (see docs/deployment.md, Files)"
    )


def first_missing(path: str) -> str:
    """The outermost directory (or file) of ``path`` that does not exist here."""
    pure = PurePosixPath(path)
    for ancestor in [*reversed(pure.parents), pure]:
        if not os.path.exists(ancestor):
            return str(ancestor)
    return path


SLASH = ord("/")


# The longest path Linux opens, its NUL included (PATH_MAX).
PATH_MAX = 4096
# Padded paths take at most this many times the bytes of the paths as they came.
PADDED_GROWTH = 4


def padded_paths(samples: Sequence[np.ndarray]) -> np.ndarray | None:
    """Absolute paths of several lengths as one dense array, each left-padded to the longest
    with ``/``, which names the same file (a path's leading slashes are one root, as POSIX
    leaves only exactly two to the system and Linux reads two as one too); None unless every
    sample is a non-empty 1-D path that starts with ``/``, and the padding costs at most
    :data:`PADDED_GROWTH` times the paths' bytes.

    Why: DALI takes a dense batch in one step, where a ``TensorListCPU`` of 256 paths of
    several lengths (a dataset's, ImageNet's say) costs it about 1.1 µs a sample, a third of the
    executor's Python for a batch of paths. Only for inputs that nothing but
    ``fn.io.file.read`` reads (``PipelineRunner.padded_paths``): what it reads is the same file,
    and no other operator or output sees the padding. Made in a few numpy steps over the
    batch's bytes, none per sample in Python; from :class:`PackedSamples`, without even a
    view of each sample."""
    if isinstance(samples, PackedSamples):
        # Left packed in their frame (packed.py): the bytes and offsets are there already.
        if not len(samples) or samples.flat.ndim != 1 or samples.flat.dtype.itemsize != 1:
            return None
        dtype = samples.flat.dtype
        data = samples.flat[: samples.bounds[-1]].view(np.uint8)
        starts = samples.bounds[:-1]
        lengths = np.diff(samples.bounds)
    else:
        # An input's samples have one rank and one dtype: the first one's are every one's.
        if not samples or samples[0].ndim != 1 or samples[0].dtype.itemsize != 1:
            return None
        dtype = samples[0].dtype
        data = np.frombuffer(b"".join(samples), np.uint8)  # type: ignore[arg-type]  # buffers
        lengths = np.fromiter(map(len, samples), np.int64, len(samples))
        starts = np.cumsum(lengths) - lengths
    if int(lengths.min()) == 0:
        return None
    width = int(lengths.max())
    if width > PATH_MAX or len(samples) * width > PADDED_GROWTH * data.size:
        # A path no system call takes, or a long one among short ones: the padded array
        # could be many times the batch (a hostile submitter's 256 x its longest sample).
        return None
    if (data[starts] != SLASH).any():
        return None  # a relative path would name another file once padded
    padded = np.full((len(samples), width), SLASH, np.uint8)
    # Each row's last ``length`` bytes are its path's: a mask fills them in row-major order,
    # the order of the paths' bytes in ``data``.
    padded[np.arange(width) >= (width - lengths)[:, None]] = data
    return padded.view(dtype)
