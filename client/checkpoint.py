"""A DataLoader state's dalid part: the session's pipelines, and each deterministic one's
DALI checkpoint (docs/design/checkpoints.md).

:class:`dalid.client.DataLoader`'s ``state_dict()`` is torchdata's ``StatefulDataLoader`` state
(the data position: sampler, workers, batches yielded) with one more key, ``"dalid"``: the dalid
protocol, the dataset's length and, for each pipeline the session registered, in order, a
fingerprint of the pipeline, whether it is deterministic and, for a deterministic one made with
``enable_checkpointing=True``, DALI's checkpoint of it between the batches the loop received
and the next (taken by the daemon: SPEC.md, "Checkpoints"). ``load_state_dict()`` refuses a
state of another protocol, dataset length or pipeline, naming which, and restores each
checkpoint into the pipeline of the same place before its first run.
"""

from __future__ import annotations

import functools
import hashlib
import json
from typing import Any

from dalid.protocol import (
    PROTOCOL_VERSION,
    CheckpointPipeline,
    PipelineCheckpoint,
    RegisterNamedPipeline,
    RegisterPipeline,
    RestorePipeline,
)

from .errors import InputError
from .reconnect.reconnector import Reconnector, Registration

STATE_KEY = "dalid"


def fingerprint(request: RegisterPipeline | RegisterNamedPipeline) -> str:
    """What tells one pipeline from another across processes: its serialized graph (or its
    repository name and parameters), batch size and seed."""
    digest = hashlib.sha256()
    if isinstance(request, RegisterPipeline):
        digest.update(bytes(request.serialized))
        described: list[Any] = [request.max_batch_size, request.seed]
    else:
        described = [request.name, request.parameters, request.batch_size, request.seed]
    digest.update(json.dumps(described).encode())
    return digest.hexdigest()


def _label(request: RegisterPipeline | RegisterNamedPipeline, digest: str) -> str:
    return f"{request.name or 'unnamed'!r} ({digest[:12]})"


def pipeline_states(daemon: Reconnector) -> tuple[list[dict[str, Any]], list[str]]:
    """The state of each pipeline the session registered, and why any deterministic one holds
    no checkpoint (one message each)."""
    states: list[dict[str, Any]] = []
    missing: list[str] = []
    for registration in daemon.registrations:
        digest = fingerprint(registration.request)
        state: dict[str, Any] = {
            "fingerprint": digest,
            "name": registration.request.name,
            "deterministic": registration.deterministic,
            "checkpoint": None,
        }
        if registration.deterministic:
            reply = daemon.call(functools.partial(_checkpoint, daemon, registration))
            if reply.unavailable:
                label = _label(registration.request, digest)
                missing.append(f"pipeline {label}: {reply.unavailable}")
            else:
                state["checkpoint"] = bytes(reply.checkpoint)
        states.append(state)
    return states, missing


def _checkpoint(daemon: Reconnector, registration: Registration) -> PipelineCheckpoint:
    assert registration.registered is not None
    reply = daemon.link.request(CheckpointPipeline(registration.registered.pipeline_id))
    assert isinstance(reply, PipelineCheckpoint)
    return reply


def check_state(state: dict[str, Any], dataset_length: int | None) -> None:
    """Refuses the dalid part of a loader's state taken by another protocol or for a dataset of
    another length."""
    protocol = state.get("protocol")
    if protocol != PROTOCOL_VERSION:
        raise InputError(
            f"this DataLoader state was taken by a dalid speaking protocol {protocol}, and this "
            f"one speaks protocol {PROTOCOL_VERSION}: its pipeline checkpoints may not mean "
            "the same here. Resume with the dalid release that took it, or start the epoch over "
            "(load no state)"
        )
    length = state.get("dataset_length")
    if length != dataset_length:
        raise InputError(
            f"this DataLoader state was taken over a dataset of {length} samples, and this "
            f"loader's dataset has {dataset_length}: its position would name other samples. "
            "Resume with the same dataset"
        )


def restore_pipelines(daemon: Reconnector, states: list[dict[str, Any]]) -> None:
    """Checks that the session registered the pipelines of ``states``, in the same order, and
    restores each deterministic one's checkpoint before its first run."""
    registrations = daemon.registrations
    for place, state in enumerate(states):
        if place >= len(registrations):
            raise InputError(
                f"this DataLoader state was taken with {len(states)} pipelines, and this "
                f"session has registered {len(registrations)}: register the same pipelines, in "
                "the same order, before loading the state"
            )
        registration = registrations[place]
        digest = fingerprint(registration.request)
        if digest != state["fingerprint"]:
            theirs = f"{state['name'] or 'unnamed'!r} ({state['fingerprint'][:12]})"
            raise InputError(
                f"this DataLoader state was taken with another pipeline: its pipeline "
                f"{place} was {theirs}, this session's is {_label(registration.request, digest)} "
                "(another graph, batch size or seed). Resume with the pipeline that took it"
            )
        if registration.deterministic != state["deterministic"]:
            raise InputError(
                f"this DataLoader state's pipeline {place} "
                f"{_label(registration.request, digest)} was registered with "
                f"deterministic={state['deterministic']}, and this session's with "
                f"deterministic={registration.deterministic}: register it as it was"
            )
    for registration, state in zip(registrations, states, strict=False):
        checkpoint = state["checkpoint"]
        if checkpoint is not None:
            daemon.call(functools.partial(_restore, daemon, registration, checkpoint))


def _restore(daemon: Reconnector, registration: Registration, checkpoint: bytes) -> None:
    assert registration.registered is not None
    daemon.link.request(
        RestorePipeline(registration.registered.pipeline_id, memoryview(checkpoint))
    )
