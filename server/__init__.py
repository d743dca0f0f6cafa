"""The dalid daemon: hosts DALI pipelines for many training jobs on one device.

:class:`DaemonCore` is the request handling without sockets; :class:`Daemon` wraps it in a
ZeroMQ ROUTER socket; ``dalid serve`` (:mod:`dalid.server.cli`) runs it.
"""

from .core import DaemonCore
from .daemon import Daemon, DaemonConfig
from .pool import RegionPool
from .runner import PipelineRunner, PipelineSpec

__all__ = ["Daemon", "DaemonConfig", "DaemonCore", "PipelineRunner", "PipelineSpec", "RegionPool"]
