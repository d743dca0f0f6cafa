"""The dalid daemon: hosts DALI pipelines for many training jobs on one device.

Its folders, in the order a batch meets them, each importing only those below it (the layers
contract of pyproject.toml): ``intake/`` (the socket: a batch enters here), ``handling/`` (what
each request does), ``jobs/`` (whose batch it is, and what the job may hold), ``runs/`` (when
and with whom it runs), ``pipelines/`` (the DALI pipeline that runs it), ``samples/`` (what it
carries) and ``outputs/`` (where it leaves), with ``errors.py``, the refusal any stage may raise,
below them all. ``operations/`` is the operator's: the ``dalid`` command, its configuration,
control and supervision, above them all.

:class:`DaemonCore` is the request handling without sockets; :class:`Daemon` wraps it in a
ZeroMQ ROUTER socket; ``dalid serve`` (:mod:`dalid.server.operations.cli`) runs it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .handling.core import DaemonCore
    from .intake.daemon import Daemon, DaemonConfig
    from .outputs.pool import RegionPool
    from .pipelines.runner import PipelineRunner
    from .pipelines.spec import PipelineSpec

__all__ = ["Daemon", "DaemonConfig", "DaemonCore", "PipelineRunner", "PipelineSpec", "RegionPool"]

# Imported when first named: `dalid stop`, `dalid status` and the other commands that only ask
# a running daemon import none of the daemon, which on a machine busy training took seconds.
_WHERE = {
    "DaemonCore": ".handling.core",
    "Daemon": ".intake.daemon",
    "DaemonConfig": ".intake.daemon",
    "RegionPool": ".outputs.pool",
    "PipelineRunner": ".pipelines.runner",
    "PipelineSpec": ".pipelines.runner",
}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name], __name__), name)
