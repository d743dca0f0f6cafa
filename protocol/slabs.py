"""Shared-memory slab names, and who made a slab: one place for the daemon, trainers and tests.

A slab holding CPU outputs is a POSIX shared-memory segment, ``SHM_DIR/<name>``. Every user can
list that directory, so a name says nothing but that it is dalid's: ``dalid-`` and 32 random
hex digits. Nobody can guess a name before the daemon creates it (to take it first and make the
daemon fail), and names tell no one which daemon or job a segment serves.

What a name used to tell is written in the segment itself, after the slab's bytes, where only
the segment's user can read it (mode 0600) and no trainer maps it::

    offset 0            size                 size + RECORD_BYTES
    |  the slab (mapped) |  record: MAGIC, JSON {"pid", "label"}, zero padding  |

``pid`` is the daemon process that made the segment; ``label`` what the daemon calls the slab
(``dalid-<daemon>-j<job>-<n>``). From the record a new daemon removes the segments of dead
ones (:func:`user_segments` with :func:`~dalid.protocol.process_running`), and tests find
the segments of a daemon and of a job.

Both sides map a slab with :func:`map_slab`; see Note [Slab mappings across fork].

Note [Slab mappings across fork]
--------------------------------
A slab mapping is ``MADV_DONTFORK``: a forked child (a DataLoader worker of the trainer, a
Python-operator worker of the daemon) does not get it, but does get the Python objects that own
it, and freeing one there would munmap a range that holds the child's own memory (SIGSEGV). So a
mapping is unmapped only by the process that mapped it: every mapping made here is registered,
a forked child keeps the ones it inherits referenced until it exits, and code that unmaps
explicitly checks :func:`mapped_here` first. docs/design/output-buffers.md
"""

from __future__ import annotations

import json
import mmap
import os
import re
import secrets
import stat
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

SHM_DIR = Path("/dev/shm")
PREFIX = "dalid-"
RECORD_BYTES = 512
MAGIC = b"dalid slab record 1\n"
_NAME = re.compile(r"dalid-[0-9a-f]{32}")
# Names of releases before records, "dalid-<daemon pid>-...", still found so they can be removed.
_OLD_NAME = re.compile(r"dalid-([0-9]+)-.+")


@dataclass(frozen=True)
class SlabRecord:
    """Who made a segment: the daemon's ``pid``, and the daemon's ``label`` for the slab."""

    pid: int
    label: str

    def encode(self) -> bytes:
        data = MAGIC + json.dumps({"pid": self.pid, "label": self.label}).encode()
        if len(data) > RECORD_BYTES:
            raise ValueError(f"slab label too long for its record: {self.label!r}")
        return data.ljust(RECORD_BYTES, b"\0")


def new_name() -> str:
    """A fresh slab name that no one can guess."""
    return PREFIX + secrets.token_hex(16)


def is_slab_name(name: str) -> bool:
    """Whether ``name`` is one :func:`new_name` makes (so nothing else is ever opened)."""
    return _NAME.fullmatch(name) is not None


def write_record(fd: int, size: int, record: SlabRecord) -> None:
    """Makes the segment open on ``fd`` ``size`` bytes of slab followed by ``record``."""
    os.ftruncate(fd, size + RECORD_BYTES)
    os.pwrite(fd, record.encode(), size)


def read_record(path: Path) -> SlabRecord | None:
    """The record of the segment at ``path`` if it is this user's and has one, else None.

    A link or another user's file is never followed or read.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            return None
        if info.st_size >= RECORD_BYTES:
            data = os.pread(fd, RECORD_BYTES, info.st_size - RECORD_BYTES)
            if data.startswith(MAGIC):
                fields = json.loads(data[len(MAGIC) :].rstrip(b"\0"))
                return SlabRecord(int(fields["pid"]), str(fields["label"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    finally:
        os.close(fd)
    old = _OLD_NAME.fullmatch(path.name)
    return SlabRecord(int(old.group(1)), path.name) if old else None


def user_segments() -> Iterator[tuple[Path, SlabRecord]]:
    """This user's dalid segments, each with its record (those without one are skipped)."""
    for path in SHM_DIR.glob(PREFIX + "*"):
        record = read_record(path)
        if record is not None:
            yield path, record


# Every slab mapping of this process, by the process that made it (Note [Slab mappings across
# fork]); and those a forked child inherited, kept referenced there so they are never unmapped.
_mapped: weakref.WeakKeyDictionary[mmap.mmap, int] = weakref.WeakKeyDictionary()
_inherited: list[mmap.mmap] = []


def map_slab(fd: int, size: int) -> mmap.mmap:
    """Maps ``size`` bytes of the segment open on ``fd``, shared, for this process only."""
    mapping = mmap.mmap(fd, size)
    mapping.madvise(mmap.MADV_DONTFORK)
    _mapped[mapping] = os.getpid()
    return mapping


def mapped_here(mapping: mmap.mmap) -> bool:
    """Whether this process made ``mapping`` (and so may unmap it)."""
    return _mapped.get(mapping) == os.getpid()


def _keep_inherited() -> None:
    _inherited.extend(mapping for mapping in _mapped if mapping not in _inherited)


os.register_at_fork(after_in_child=_keep_inherited)
