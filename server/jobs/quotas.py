"""What the daemon grants a job at connect: output memory, batches in flight, its weight.

A job asks in its ``hello``; :func:`grant` answers with its :class:`Limits` or refuses with a
message that says what the daemon can give. Output memory is reserved as the job's outputs need
it, or at connect when the job asks for an amount (:mod:`dalid.server.jobs.reservations`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from dalid.protocol import Hello, Limits

from ..samples.imagesize import DEFAULT_MAX_IMAGE_PIXELS

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class Quotas:
    """The daemon's limits.

    ``pool_bytes``: the most output memory of a job that asks for none (it reserves what its
    outputs need, up to that). ``memory_limit``: the output memory all jobs together may
    reserve (0: no limit). ``max_inflight_batches``: the most batches one job may have queued
    or running, and what a job that asks for none gets. ``max_waiting_batches``: batches a job
    may have waiting over that limit or deferred before more are refused. ``input_memory``: the
    batch samples the daemon holds for all jobs (one job at most half). ``max_jobs_per_process``:
    jobs whose trainer is one process (0: no limit). ``max_jobs_per_user``: jobs whose trainers
    are processes of one uid, so that another served uid finds room (0: no limit).
    ``max_pipelines``: pipelines one job may
    have. ``max_image_pixels``: an image sample declaring more is a bad sample (0: no limit).
    ``max_threads``: DALI threads of all pipelines together, each pipeline's at most the cores
    the daemon may use (0: eight per core, at least 128). ``max_daemon_pipelines``: pipelines the
    daemon runs at once (one that jobs share counts once).
    """

    max_jobs: int = 64
    max_jobs_per_process: int = 8
    max_jobs_per_user: int = 32
    reclaim_idle_s: float = 300.0
    pool_bytes: int = 1 * GiB
    slab_bytes: int = 64 * MiB
    memory_limit: int = 0
    max_inflight_batches: int = 16
    max_waiting_batches: int = 256
    input_memory: int = 2 * GiB
    max_pipelines: int = 32
    max_batch_size: int = 4096
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_threads: int = 0
    max_daemon_pipelines: int = 128
    # The output memory of one cohort (0: the pool bytes of the job that starts it), half of
    # which may hold outputs for its trailing members (cohorts.py).
    cohort_bytes: int = 0

    @property
    def user_share(self) -> float:
        """The part of the daemon's pipelines and DALI threads one uid may hold: as much as its
        jobs' of ``max_jobs`` (0: no per-user limit)."""
        if not self.max_jobs_per_user:
            return 0.0
        return min(1.0, self.max_jobs_per_user / self.max_jobs)


def per_user_jobs(max_jobs: int, asked: int | None) -> int:
    """``--max-jobs-per-user``: as ``asked``, else half of ``max_jobs`` (at least 1)."""
    return asked if asked is not None else max(1, max_jobs // 2)


class Full(enum.Enum):
    """Which limit refused a hello or a new pipeline, where ending an idle job could make room
    (reclaim.py): the daemon's, or the share of the newcomer's uid."""

    DAEMON = enum.auto()  # --max-jobs; for pipelines --max-daemon-pipelines, --max-threads
    USER = enum.auto()  # --max-jobs-per-user; for pipelines the uid's part of those two


class QuotaRefused(Exception):
    """A job asked for more than the daemon can give; the message says what it can. ``full``:
    the limit of jobs that is full, where another job's end would make room (None: another
    refusal, the per-process limit's among them: a process may not end others' jobs to pass
    its own limit); ``what``: what is full, in words, where ``full`` is set."""

    def __init__(self, message: str, full: Full | None = None, what: str = "") -> None:
        super().__init__(message)
        self.full = full
        self.what = what


def grant(
    hello: Hello,
    quotas: Quotas,
    *,
    jobs: int,
    max_message_bytes: int,
    pid: int = 0,
    jobs_of_process: int = 0,
    uid: int = -1,
    jobs_of_user: int = 0,
) -> Limits:
    """The limits of a new job, given the ``jobs`` already open, ``jobs_of_process`` of them
    with a trainer of process ``pid`` (0: a process the daemon cannot see) and ``jobs_of_user``
    with a trainer of uid ``uid`` (-1: unknown)."""
    # The per-process limit first: no other job's end makes room under it.
    per_process = quotas.max_jobs_per_process
    if pid and per_process and jobs_of_process >= per_process:
        raise QuotaRefused(
            f"process {pid} already has {jobs_of_process} jobs on this daemon, the limit of one "
            f"process (dalid serve --max-jobs-per-process {per_process}): close a session "
            "first, or start the daemon with a higher limit"
        )
    # The uid's share before the daemon's limit: ending one of the uid's jobs frees both.
    per_user = quotas.max_jobs_per_user
    if uid >= 0 and per_user and jobs_of_user >= per_user:
        what = (
            f"uid {uid} already has {jobs_of_user} jobs on this daemon, the share of one user "
            f"(dalid serve --max-jobs-per-user {per_user}), kept so that other users find room"
        )
        raise QuotaRefused(
            f"{what}: close a job of yours first, or start the daemon with a higher limit "
            "(0: none)",
            Full.USER,
            what,
        )
    if jobs >= quotas.max_jobs:
        what = (
            f"this daemon already serves {jobs} jobs, its limit (dalid serve --max-jobs "
            f"{quotas.max_jobs})"
        )
        raise QuotaRefused(
            f"{what}: wait for one to end, or start the daemon with a higher limit",
            Full.DAEMON,
            what,
        )
    memory = hello.memory_bytes or quotas.pool_bytes
    inflight = hello.max_inflight_batches or quotas.max_inflight_batches
    if inflight > quotas.max_inflight_batches:
        raise QuotaRefused(
            f"the job asks for {inflight} batches in flight and this daemon allows at most "
            f"{quotas.max_inflight_batches} per job (dalid serve --max-inflight-batches)"
        )
    return Limits(
        max_batch_size=quotas.max_batch_size,
        max_message_bytes=max_message_bytes,
        pool_bytes=memory,
        slab_bytes=quotas.slab_bytes,
        max_inflight_batches=inflight,
        weight=hello.weight,
        max_image_pixels=quotas.max_image_pixels,
    )
