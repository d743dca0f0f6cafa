"""Why a daemon stops, what it tells its peers, and the bound on its stop (farewell.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dalid.client.errors import DaemonStopped, stopped_error
from dalid.protocol import ErrorCode
from dalid.server.intake.farewell import Stop, StopKind


def test_a_signal_is_the_supervisors_death_only_when_this_process_has_another_parent() -> None:
    parent = os.getppid()
    assert Stop.from_signal(signal.SIGTERM, None).kind is StopKind.SIGNAL
    assert Stop.from_signal(signal.SIGTERM, parent).kind is StopKind.SIGNAL
    gone = Stop.from_signal(signal.SIGTERM, parent + 100_000)
    assert gone.kind is StopKind.SUPERVISOR_GONE
    assert gone.reason == f"its supervisor `dalid serve` (pid {parent + 100_000}) died"


def test_only_end_jobs_tells_jobs_to_end(tmp_path: Path) -> None:
    socket = tmp_path / "d.sock"
    for stop in (
        Stop(StopKind.SIGNAL, signal.SIGTERM),
        Stop(StopKind.REQUEST),
        Stop(StopKind.SUPERVISOR_GONE, supervisor=1234),
    ):
        notice = stop.notice(socket)
        assert notice.code is ErrorCode.SHUTTING_DOWN and not notice.ends_jobs
        assert f"(pid {os.getpid()}) was stopped ({stop.reason})" in notice.message
        error = stopped_error(notice)
        assert isinstance(error, DaemonStopped) and not error.ends_jobs
        assert error.notice == notice.message
        assert "which ends a job without reconnect=True" in str(error)
    ended = stopped_error(Stop(StopKind.END_JOBS).notice(socket))
    assert ended.ends_jobs
    assert "`dalid stop --end-jobs` asked it to, ending its jobs), and ended this job" in str(ended)


_BOUNDED = """
import sys, threading, time
from pathlib import Path
from dalid.server.intake.farewell import bound_the_stop
asked, stopped = threading.Event(), threading.Event()
bound_the_stop(lambda: Path(sys.argv[1]).touch(), asked, stopped, bound_s=0.3)
time.sleep(0.5)  # not asked yet: nothing happens
asked.set()
if sys.argv[2] == "stops":
    stopped.set()
    time.sleep(1.0)
    sys.exit(7)
time.sleep(30)  # a stop stuck where nothing sees it
"""


def test_a_stop_that_overruns_its_bound_cleans_up_and_exits(tmp_path: Path) -> None:
    abandoned = tmp_path / "abandoned"
    started = time.monotonic()
    stuck = subprocess.run(
        [sys.executable, "-c", _BOUNDED, str(abandoned), "stuck"], timeout=20, check=False
    )
    assert stuck.returncode == 0 and abandoned.exists()
    assert time.monotonic() - started < 20
    abandoned.unlink()
    stops = subprocess.run(
        [sys.executable, "-c", _BOUNDED, str(abandoned), "stops"], timeout=20, check=False
    )
    assert stops.returncode == 7 and not abandoned.exists()
