"""What the daemon grants a job at connect: output memory, batches in flight, its weight.

A job asks in its ``hello``; :func:`grant` answers with its :class:`Limits` or refuses with a
message that says what the daemon can give. Memory is reserved, not allocated: slabs are made as
outputs need them, but a job can always grow to its reservation, so one job cannot take what
another was promised.
"""

from __future__ import annotations

from dataclasses import dataclass

from dalid.protocol import Hello, Limits

from .imagesize import DEFAULT_MAX_IMAGE_PIXELS

GiB = 1 << 30
MiB = 1 << 20


@dataclass(frozen=True)
class Quotas:
    """The daemon's limits.

    ``pool_bytes``: a job's output memory when it asks for none. ``memory_limit``: the output
    memory all jobs together may reserve (0: no limit). ``max_inflight_batches``: the most
    batches one job may have queued or running, and what a job that asks for none gets.
    ``max_waiting_batches``: batches a job may have waiting over that limit before more are
    refused (each holds its samples in the daemon's memory). ``max_image_pixels``: an image
    sample declaring more is a bad sample (0: no limit).
    """

    max_jobs: int = 64
    pool_bytes: int = 1 * GiB
    slab_bytes: int = 64 * MiB
    memory_limit: int = 0
    max_inflight_batches: int = 16
    max_waiting_batches: int = 256
    max_batch_size: int = 4096
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS


class QuotaRefused(Exception):
    """A job asked for more than the daemon can give; the message says what it can."""


def grant(
    hello: Hello, quotas: Quotas, *, jobs: int, reserved: int, max_message_bytes: int
) -> Limits:
    """The limits of a new job, given the ``jobs`` already open and the memory they reserved."""
    if jobs >= quotas.max_jobs:
        raise QuotaRefused(
            f"this daemon already serves {jobs} jobs, its limit (dalid serve --max-jobs "
            f"{quotas.max_jobs}): wait for one to end, or start the daemon with a higher limit"
        )
    memory = hello.memory_bytes or quotas.pool_bytes
    if quotas.memory_limit:
        left = quotas.memory_limit - reserved
        if memory > left:
            raise QuotaRefused(
                f"the job asks for {_size(memory)} of output memory and this daemon has "
                f"{_size(max(left, 0))} left of its --memory-limit {_size(quotas.memory_limit)} "
                f"({jobs} jobs hold {_size(reserved)}): ask for less (memory_bytes=) or start "
                "the daemon with a higher --memory-limit"
            )
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


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes} B"
