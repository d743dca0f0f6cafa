"""One trainer process: ``python -m bench.trainer KIND SETTINGS_JSON RESULT_PATH READY_FD``.

It sets up one contender (or the transport probes), writes a byte to ``READY_FD``, waits for a
line on stdin (the orchestrator starts concurrent trainers together that way), runs, and
writes its result, or the error that stopped it, as JSON to ``RESULT_PATH``. A dalid trainer
also reads the daemon's pipelines and jobs as its timed window ends, while its job is still
there, and counts the slabs and events its session opened by the end of each epoch.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .config import Settings
from .contenders import CONTENDERS
from .measure import timed_loop


def _ready_then_wait(ready_fd: int) -> int:
    os.write(ready_fd, b"R")
    os.close(ready_fd)
    sys.stdin.readline()
    return time.monotonic_ns()


def _write(path: Path, data: dict[str, Any]) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data))
    partial.replace(path)


def run(kind: str, settings: Settings, ready_fd: int) -> dict[str, Any]:
    """Sets up ``kind``, waits for the start signal, runs it and returns its result."""
    if kind == "transport":
        # Only this trainer loads DALI and dalid up front (peak memory is measured).
        from .transport import transport_probes

        with transport_probes(settings) as probes:
            _ready_then_wait(ready_fd)
            return {"transport": probes()}
    contender = CONTENDERS[kind]
    with contender.run(settings) as epochs:
        go_ns = _ready_then_wait(ready_fd)
        result: dict[str, Any] = {
            "loop": timed_loop(kind, epochs, settings, go_ns).to_dict(),
            "weight": settings.job_weight,
        }
        handles = getattr(epochs, "handles", None)
        if handles is not None:
            result["handles"] = handles()
        if contender.needs_daemon:
            result["pipelines"] = _daemon_pipelines(settings)
        return result


def _daemon_pipelines(settings: Settings) -> dict[str, Any]:
    """The daemon's pipelines and jobs now (see :mod:`bench.fill`), or why they could not be
    read: a run's throughput does not depend on them."""
    import zmq

    from dalid.protocol import ProtocolError

    from .daemon import DaemonFailed, status_reading

    t_ns = time.monotonic_ns()
    try:
        return {"t_ns": t_ns, **status_reading(Path(settings.socket))}
    except (DaemonFailed, ProtocolError, zmq.ZMQError, OSError) as error:
        return {"t_ns": t_ns, "error": f"{type(error).__name__}: {error}"}


def main(argv: Sequence[str]) -> int:
    kind, settings_json, result_path, ready_fd = argv
    result = Path(result_path)
    try:
        data = run(kind, Settings.from_json(settings_json), int(ready_fd))
    except BaseException as error:
        _write(
            result,
            {"error": f"{type(error).__name__}: {error}", "traceback": traceback.format_exc()},
        )
        return 1
    _write(result, data)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
