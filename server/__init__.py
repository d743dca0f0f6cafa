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

from .handling.core import DaemonCore
from .intake.daemon import Daemon, DaemonConfig
from .outputs.pool import RegionPool
from .pipelines.runner import PipelineRunner, PipelineSpec

__all__ = ["Daemon", "DaemonConfig", "DaemonCore", "PipelineRunner", "PipelineSpec", "RegionPool"]
