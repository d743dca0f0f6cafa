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

from dalid.protocol import Device

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
from .refs import DALIOutputBatchRef, DALIOutputSampleRef, DALIPipelineRunRef
from .session import Session
from .transform import Proxy


def connect(
    device: Device = "cpu",
    socket: str | os.PathLike[str] | None = None,
    autostart: bool = True,
    name: str | None = None,
) -> Session:
    """A :class:`Session` with the daemon for ``device`` ("cpu" or a GPU ordinal).

    ``socket`` defaults to ``$DALID_SOCKET`` or the per-user runtime directory. With
    ``autostart``, a daemon is started when none answers; it exits after a minute without jobs.
    """
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
