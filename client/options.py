"""The job options a trainer gives ``connect`` or ``DALIServer``, checked before anything is sent.

A bad value is the caller's mistake: it raises :class:`InputError` naming the argument as the
caller wrote it and what it may be, rather than reaching the daemon as a protocol field.
"""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any

from dalid.protocol import MAX_NAME_LENGTH, MAX_WEIGHT

from .errors import InputError


def check_job_options(
    *,
    name: Any = None,
    weight: Any = 1.0,
    memory_bytes: Any = None,
    max_inflight_batches: Any = None,
    reconnect: Any = False,
    reconnect_timeout: Any = 60.0,
) -> None:
    """Raises InputError for the first option that is not one a daemon could take."""
    if name is not None and not isinstance(name, str):
        raise InputError(f"name must be a str (the job's name in dalid status), got {name!r}")
    if name is not None and len(name) > MAX_NAME_LENGTH:
        raise InputError(f"name has {len(name)} characters; at most {MAX_NAME_LENGTH}")
    if isinstance(weight, bool) or not isinstance(weight, Real):
        raise InputError(f"weight must be a number, got {weight!r}")
    if not (math.isfinite(weight) and 0 < float(weight) <= MAX_WEIGHT):
        raise InputError(
            f"weight={weight!r}: a job's weight is its share of the daemon when jobs compete, "
            f"relative to theirs; give a number above 0 and at most {MAX_WEIGHT:g} (default 1)"
        )
    for option, value, meaning in (
        ("memory_bytes", memory_bytes, "the output memory reserved for the job, in bytes"),
        ("max_inflight_batches", max_inflight_batches, "the batches it may have queued or running"),
    ):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, Integral) or value <= 0:
            raise InputError(
                f"{option}={value!r}: {meaning}; give a positive int, or None for the daemon's "
                "default"
            )
    if not isinstance(reconnect, bool):
        raise InputError(f"reconnect must be True or False, got {reconnect!r}")
    if (
        isinstance(reconnect_timeout, bool)
        or not isinstance(reconnect_timeout, Real)
        or not (math.isfinite(reconnect_timeout) and float(reconnect_timeout) > 0)
    ):
        raise InputError(
            f"reconnect_timeout={reconnect_timeout!r}: how long a job with reconnect=True waits "
            "for a new daemon on its socket, in seconds; give a number above 0 (default 60)"
        )
