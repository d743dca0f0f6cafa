"""The supervisor's logic: device lists, child commands, restarts, with real child processes."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import random
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from dalid.protocol import GpuUnavailable
from dalid.server.operations import crash_report
from dalid.server.operations.crash_report import CrashReport
from dalid.server.operations.devices import DeviceListError, child_specs, parse_devices
from dalid.server.operations.supervisor import (
    ChildSpec,
    RestartPolicy,
    State,
    Supervisor,
    exit_status,
)

QUICK = RestartPolicy(first_delay_s=0.01, max_delay_s=0.05, fast_crash_s=30.0, crash_loop_after=3)


def _gpus(count: int) -> Callable[[], int]:
    return lambda: count


def _no_driver() -> int:
    raise GpuUnavailable("the CUDA driver (libcuda.so.1) cannot be loaded")


@pytest.mark.parametrize(
    ("text", "count", "expected"),
    [
        ("all", 2, [0, 1]),
        ("ALL", 1, [0]),
        ("0,1", 0, [0, 1]),
        ("3", 0, [3]),
        ("cpu", 0, ["cpu"]),
        ("cpu, 1", 0, ["cpu", 1]),
    ],
)
def test_device_lists(text: str, count: int, expected: list[int | str]) -> None:
    assert parse_devices(text, _gpus(count)) == expected


@pytest.mark.parametrize(
    ("text", "gpu_count", "message"),
    [
        ("all", _gpus(0), "reports no GPU"),
        ("all", _no_driver, "no usable GPU"),
        ("0,0", _gpus(2), "gpu0 twice"),
        ("0,x", _gpus(2), "device must be"),
        ("", _gpus(2), "device must be"),
    ],
)
def test_bad_device_lists_are_refused(
    text: str, gpu_count: Callable[[], int], message: str
) -> None:
    with pytest.raises(DeviceListError, match=message):
        parse_devices(text, gpu_count)


def test_one_device_keeps_its_socket_and_the_supervisor_output(tmp_path: Path) -> None:
    (spec,) = child_specs(["cpu"], str(tmp_path / "x.sock"), ["--idle-timeout", "5"])
    assert spec.log is None
    assert spec.command[-6:] == ("--device", "cpu", "--socket", str(tmp_path / "x.sock"),
                                 "--idle-timeout", "5")  # fmt: skip
    assert "--no-supervisor" in spec.command


def test_several_devices_get_a_socket_and_log_each_in_the_runtime_dir(
    private_runtime_dir: Path,
) -> None:
    specs = child_specs([0, 1, "cpu"], None, [])
    assert [spec.name for spec in specs] == ["gpu0", "gpu1", "cpu"]
    for spec in specs:
        socket = private_runtime_dir / f"{spec.name}.sock"
        assert spec.command[spec.command.index("--socket") + 1] == str(socket)
        assert spec.log == private_runtime_dir / f"{spec.name}.sock.log"


def test_several_devices_refuse_one_socket(
    private_runtime_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(DeviceListError, match="a socket each"):
        child_specs([0, 1], "/tmp/one.sock", [])
    monkeypatch.setenv("DALID_SOCKET", "/tmp/one.sock")
    with pytest.raises(DeviceListError, match="a socket each"):
        child_specs([0, 1], None, [])


def test_restart_delay_doubles_up_to_its_limit() -> None:
    policy = RestartPolicy(first_delay_s=0.5, max_delay_s=3.0, jitter=0.0)
    assert [policy.delay(n) for n in (1, 2, 3, 4, 5)] == [0.5, 1.0, 2.0, 3.0, 3.0]


def test_restart_delays_have_a_random_part_and_never_pass_the_cap() -> None:
    policy = RestartPolicy(first_delay_s=0.5, max_delay_s=3.0, jitter=0.25)
    rng = random.Random(7)
    for crashes, ceiling in ((1, 0.5), (3, 2.0), (9, 3.0)):
        delays = [policy.delay(crashes, rng) for _ in range(200)]
        assert all(0.75 * ceiling <= delay <= ceiling for delay in delays)
        assert len(set(delays)) == len(delays)  # daemons crashing together restart apart


def test_exit_status_of_a_killed_child() -> None:
    assert exit_status(-signal.SIGKILL) == 137
    assert exit_status(1) == 1


def _python(code: str) -> tuple[str, ...]:
    return (sys.executable, "-c", code)


def _crashing(count_file: Path, crashes: int, then: str = "") -> tuple[str, ...]:
    """A child that crashes ``crashes`` times, saying so, then runs ``then`` and exits 0."""
    return _python(
        "import pathlib, sys\n"
        f"count = pathlib.Path({str(count_file)!r})\n"
        "n = int(count.read_text()) + 1 if count.exists() else 1\n"
        "count.write_text(str(n))\n"
        f"if n <= {crashes}:\n"
        "    print(f'run {n} starting', flush=True)\n"
        "    print(f'run {n}: out of memory', file=sys.stderr, flush=True)\n"
        "    sys.exit(1)\n" + then
    )


def test_a_child_that_keeps_crashing_is_never_given_up(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Twice as many fast crashes in a row as the supervisor used to give up after.
    supervisor = Supervisor([ChildSpec("crash", _crashing(tmp_path / "n", 12))], QUICK)
    with caplog.at_level(logging.INFO, logger="dalid.supervisor"):
        assert supervisor.run() == 0
    (child,) = supervisor.children
    assert child.state is State.DONE and len(child.pids) == 13
    # From the third crash on, the log says it crash-loops, how it ended and what it said.
    loops = [r.getMessage() for r in caplog.records if "is crash-looping" in r.getMessage()]
    assert len(loops) == 12 - QUICK.crash_loop_after + 1
    assert (
        "12 crashes in a row, each within 30 s of its start; the last one exited with 1"
        in (loops[-1])
    )
    assert "run 12: out of memory" in loops[-1] and "run 12 starting" in loops[-1]


def test_a_crash_loop_is_reported_beside_the_socket_until_the_daemon_runs(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    socket = tmp_path / "d.sock"
    report = crash_report.path_for(socket)
    # The fifth run copies the report it finds, then runs long enough to count as started.
    then = (
        f"report = pathlib.Path({str(report)!r})\n"
        f"pathlib.Path({str(tmp_path / 'seen')!r}).write_text(report.read_text())\n"
        "import time; time.sleep(2.5)\n"
        f"pathlib.Path({str(tmp_path / 'after')!r}).write_text(str(report.exists()))\n"
    )
    policy = dataclasses.replace(QUICK, fast_crash_s=1.0)
    spec = ChildSpec("cpu", _crashing(tmp_path / "n", 4, then), socket=socket)
    supervisor = Supervisor([spec], policy)
    assert supervisor.run() == 0
    seen = CrashReport(**json.loads((tmp_path / "seen").read_text()))
    assert seen.crashes == 4 and seen.last_exit == "exited with 1"
    assert seen.supervisor_pid == os.getpid()
    assert seen.log_lines[-2:] == ["run 4 starting", "run 4: out of memory"]
    assert (tmp_path / "after").read_text() == "False"  # cleared once the daemon ran 1 s
    assert not report.exists()
    # The children's output went on to the supervisor's own streams, each to its own.
    out, err = capfd.readouterr()
    assert "run 4 starting" in out and "run 4: out of memory" not in out
    assert "run 4: out of memory" in err


def test_a_child_killed_by_a_signal_is_restarted(tmp_path: Path) -> None:
    # The first run kills itself; the second finds its mark and stops cleanly.
    mark = tmp_path / "ran"
    code = (
        "import os, pathlib, signal\n"
        f"mark = pathlib.Path({str(mark)!r})\n"
        "if not mark.exists():\n"
        "    mark.touch()\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    supervisor = Supervisor([ChildSpec("once", _python(code))], QUICK)
    assert supervisor.run() == 0
    assert supervisor.children[0].restarts == 1


@pytest.mark.parametrize("status", [2, 3, 4])
def test_a_child_that_cannot_start_is_not_restarted(status: int) -> None:
    supervisor = Supervisor([ChildSpec("no", _python(f"raise SystemExit({status})"))], QUICK)
    assert supervisor.run() == status
    assert len(supervisor.children[0].pids) == 1


def test_the_supervisor_exits_once_every_child_stopped_cleanly(tmp_path: Path) -> None:
    log = tmp_path / "b.log"
    specs = [
        ChildSpec("a", _python("pass")),
        ChildSpec("b", _python("print('hello from b')"), log),
    ]
    supervisor = Supervisor(specs, QUICK)
    assert supervisor.run() == 0
    assert all(child.restarts == 0 for child in supervisor.children)
    assert log.read_text() == "hello from b\n"


def test_nothing_to_supervise_is_an_error() -> None:
    with pytest.raises(ValueError, match="nothing to supervise"):
        Supervisor([])


def test_serve_devices_all_without_a_gpu_is_a_clear_error() -> None:
    from dalid.protocol import gpu_count

    try:
        gpu_count()
        pytest.skip("this machine has a CUDA driver")
    except GpuUnavailable:
        pass
    result = subprocess.run(
        [sys.executable, "-m", "dalid.server", "serve", "--devices", "all"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert "--devices all: this machine has no usable GPU" in result.stderr
    assert "--devices cpu" in result.stderr


def test_a_child_starts_with_sighup_ignored_until_it_handles_it(tmp_path: Path) -> None:
    # SIGHUP's default would end a daemon still starting; ignored, it waits for the handler.
    log = tmp_path / "child.log"
    code = "import signal\nprint(signal.getsignal(signal.SIGHUP) is signal.SIG_IGN)"
    assert Supervisor([ChildSpec("hup", _python(code), log)], QUICK).run() == 0
    assert log.read_text() == "True\n"
