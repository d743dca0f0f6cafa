"""DALI's pipeline checkpoints, for a deterministic job's resume (docs/design/checkpoints.md).

A pipeline made with ``enable_checkpointing=True`` gives ``Pipeline.checkpoint()``: the state of
its random generators and operators, as bytes. The runner (``runner.py``) takes one between two
runs, and restores one before the next, under its lock; what DALI is asked is here.
"""

from __future__ import annotations

from typing import Any


class CheckpointUnavailable(Exception):
    """The pipeline cannot take or restore a checkpoint now; the message says why."""


def _check_enabled(pipeline: Any, name: str) -> None:
    if not getattr(pipeline, "_enable_checkpointing", False):
        raise CheckpointUnavailable(
            f"pipeline {name!r} was not made with enable_checkpointing=True, so DALI keeps no "
            "state of its random operators: make it with "
            "@pipeline_def(..., enable_checkpointing=True)"
        )


def take(pipeline: Any, name: str) -> bytes:
    """``pipeline``'s checkpoint; no run of it may be inside DALI."""
    _check_enabled(pipeline, name)
    return bytes(pipeline.checkpoint())


def restore(pipeline: Any, name: str, checkpoint: bytes) -> None:
    """Puts ``pipeline`` in the state ``checkpoint`` saved, before its next run.

    DALI 2.4's ``Pipeline.deserialize`` drops its ``checkpoint`` argument, so this does what a
    pipeline built with one does once built (``_restore_state_from_checkpoint``); it restores a
    pipeline that has run as well."""
    _check_enabled(pipeline, name)
    pipeline._checkpoint = checkpoint
    try:
        pipeline._restore_state_from_checkpoint()
    except Exception as error:
        raise CheckpointUnavailable(
            f"DALI could not restore pipeline {name!r} from the checkpoint: {str(error).strip()}"
        ) from None
    finally:
        pipeline._checkpoint = None
