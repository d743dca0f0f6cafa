"""The dalid client library: connect a training job to the daemon of its device.

    import dalid.client as dalid

    with dalid.connect(device="cpu") as session:
        proxy = session.proxy(pipeline)              # picklable; use as a Dataset transform
        loader = dalid.DataLoader(session, dataset, batch_size=32, num_workers=4)
        for images, labels in loader:                # outputs arrive as torch tensors
            ...

``dalid.client.proxy`` is a drop-in for ``nvidia.dali.plugin.pytorch.experimental.proxy``.
"""

from __future__ import annotations

import os

from dalid.protocol import SOCKET_ENV, Device

from .errors import (
    BatchError,
    DaemonUnavailable,
    DalidError,
    DeviceMismatch,
    InputError,
    PipelineError,
    ProtocolMismatch,
    RequestError,
)
from .loader import DataLoader
from .named import RepositoryPipeline, named_pipeline
from .placement import default_daemon
from .refs import DALIOutputBatchRef, DALIOutputSampleRef, DALIPipelineRunRef
from .session import Session
from .transform import Proxy


def connect(
    device: Device | None = None,
    socket: str | os.PathLike[str] | None = None,
    autostart: bool = True,
    name: str | None = None,
) -> Session:
    """A :class:`Session` with the daemon for ``device`` ("cpu" or a GPU ordinal).

    Without ``device``, the daemon of this process's GPU: ``LOCAL_RANK``, else torch's current
    CUDA device when CUDA is initialised, else "cpu" (see :mod:`dalid.client.placement`).
    ``socket`` defaults to ``$DALID_SOCKET`` or the device's socket in the per-user runtime
    directory. With ``autostart``, a daemon is started when none answers; it exits after a
    minute without jobs.
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
    return Session(device, socket=socket, autostart=autostart, name=name)


__all__ = [
    "BatchError",
    "DALIOutputBatchRef",
    "DALIOutputSampleRef",
    "DALIPipelineRunRef",
    "DaemonUnavailable",
    "DalidError",
    "DataLoader",
    "DeviceMismatch",
    "InputError",
    "PipelineError",
    "ProtocolMismatch",
    "Proxy",
    "RepositoryPipeline",
    "RequestError",
    "Session",
    "connect",
    "named_pipeline",
]
