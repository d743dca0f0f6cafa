"""The dalid client library: connect a training job to the daemon of its device.

    import dalid.client as dalid

    with dalid.connect(device="cpu") as session:
        proxy = session.proxy(pipeline)              # picklable; use as a Dataset transform
        loader = dalid.DataLoader(session, dataset, batch_size=32, num_workers=4)
        for images, labels in loader:                # outputs arrive as torch tensors
            ...

``dalid.client.proxy`` is a drop-in for ``nvidia.dali.plugin.pytorch.experimental.proxy``.

What a user calls lives here (``proxy``, ``session`` and its ``delivery`` of each batch,
``loader``, the pipelines' registration, bad samples, errors, batch references); the rest in
folders, in the order a batch meets them: ``worker/`` (a DataLoader worker's proxy call and
submission: a batch enters here), ``link/`` (reaching a daemon), ``outputs/`` (results turned
into tensors: a batch leaves here), and ``reconnect/`` (a session carried across daemon
restarts). The top imports them all; ``reconnect/`` imports ``worker/`` and ``outputs/``, which
import ``link/`` and never each other (the layers contract of ``[tool.importlinter]``).
"""

from __future__ import annotations

import os

from dalid.protocol import SOCKET_ENV, Device

from .badsamples import SampleReport
from .errors import (
    BatchError,
    DaemonStopped,
    DaemonUnavailable,
    DalidError,
    DeviceMismatch,
    InputError,
    JobEnded,
    PipelineError,
    ProtocolMismatch,
    RequestError,
)
from .link.launcher import OtherInstallationWarning
from .link.placement import default_daemon
from .loader import DataLoader, DrawsNotSaved
from .named import RepositoryPipeline, named_pipeline
from .refs import DALIOutputBatchRef, DALIOutputSampleRef, DALIPipelineRunRef
from .session import Session
from .worker.worker import Proxy


def connect(
    device: Device | None = None,
    socket: str | os.PathLike[str] | None = None,
    autostart: bool = True,
    name: str | None = None,
    *,
    weight: float = 1.0,
    memory_bytes: int | None = None,
    max_inflight_batches: int | None = None,
    reconnect: bool = False,
    reconnect_timeout: float = 60.0,
    cohort: str = "",
) -> Session:
    """A :class:`Session` with the daemon for ``device`` ("cpu" or a GPU ordinal).

    Without ``device``, the daemon of this process's GPU: ``LOCAL_RANK``, else torch's current
    CUDA device when CUDA is initialised, else "cpu" (see :mod:`dalid.client.link.placement`).
    ``socket`` defaults to ``$DALID_SOCKET`` or the device's socket in the per-user runtime
    directory. With ``autostart``, a daemon is started when none answers on that default
    socket (never on one given); it exits after a minute without jobs.

    What the job asks of a daemon that several jobs share: ``weight``, its share when jobs
    compete (relative to theirs); ``memory_bytes``, output memory reserved for it, and
    ``max_inflight_batches``, batches it may have queued or running (None: the daemon's
    defaults). A daemon that cannot give as much refuses the connection with a
    ``RequestError`` that says what it can give.

    With ``reconnect``, the job carries on across a restart of the daemon, losing no batch: a
    daemon stopped (an upgrade), killed or crashed, waiting up to ``reconnect_timeout`` seconds
    for the next one on the socket (docs/deployment.md, Restarts and upgrades).

    ``cohort``: the cohort the session's pipelines join (see :meth:`Session.proxy`).
    """
    if device is None:
        # An explicit socket wins; the device then only says which daemon autostart starts.
        explicit = socket is not None or bool(os.environ.get(SOCKET_ENV))
        try:
            device, found = default_daemon()
        except InputError:
            if not explicit:
                raise
            device, found = "cpu", None
        if not explicit:
            socket = found
    return Session(
        device,
        socket=socket,
        autostart=autostart,
        name=name,
        weight=weight,
        memory_bytes=memory_bytes,
        max_inflight_batches=max_inflight_batches,
        reconnect=reconnect,
        reconnect_timeout=reconnect_timeout,
        cohort=cohort,
    )


__all__ = [
    "BatchError",
    "DALIOutputBatchRef",
    "DALIOutputSampleRef",
    "DALIPipelineRunRef",
    "DaemonStopped",
    "DaemonUnavailable",
    "DalidError",
    "DataLoader",
    "DeviceMismatch",
    "DrawsNotSaved",
    "InputError",
    "JobEnded",
    "OtherInstallationWarning",
    "PipelineError",
    "ProtocolMismatch",
    "Proxy",
    "RepositoryPipeline",
    "RequestError",
    "SampleReport",
    "Session",
    "connect",
    "named_pipeline",
]
