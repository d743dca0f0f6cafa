"""Another user's socket, links and directories against real daemons and trainers.

Another user is played by root changing the owner of what it planted, and by a process that
listens as another uid (:class:`tests.impostor.Impostor`); tests that need one skip without root.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import dalid.client as dalid
from dalid.client.worker.links import worker_links
from dalid.protocol import RUNTIME_DIR_ENV
from dalid.protocol.ownership import UnsafePath

from ..daemons import own_directory, start_daemon
from ..impostor import OTHER_UID, Impostor, needs_root
from .helpers import BATCH, ProxyDataset, sample, two_output_pipeline


@needs_root
def test_a_job_token_never_reaches_a_listener_of_another_user(short_tmp: Path) -> None:
    """A trainer's proxy pointed at a socket another user listens on (what a runtime
    directory link re-pointed after the start would do): its DataLoader workers refuse to
    connect, and the impostor receives nothing, job token least of all."""
    daemon = start_daemon(short_tmp)
    impostor = Impostor(short_tmp / "impostor.sock")
    try:
        with dalid.connect(socket=daemon.socket, autostart=False) as session:
            proxy = session.proxy(two_output_pipeline())
            token = proxy.target.job_token
            proxy.retarget(dataclasses.replace(proxy.target, socket=impostor.path))
            loader = dalid.DataLoader(
                session, ProxyDataset(proxy, 2 * BATCH), batch_size=BATCH, num_workers=2
            )
            with pytest.raises(Exception, match=f"runs as uid {OTHER_UID}, not as you"):
                next(iter(loader))
            # The same in this process, as a worker with num_workers=0 would.
            with pytest.raises(UnsafePath, match="refusing to send it anything"):
                worker_links.get(proxy.target)
            # And a trainer connecting there.
            with pytest.raises(UnsafePath, match=f"runs as uid {OTHER_UID}"):
                dalid.connect(socket=impostor.path, autostart=False)
        received = impostor.received()
        assert token.encode() not in received
        assert received == b"", "not a byte goes to a listener that is not the user's daemon"
    finally:
        impostor.kill()
        assert daemon.stop() == 0


@needs_root
def test_dalid_status_and_stop_ask_only_the_users_daemon(short_tmp: Path) -> None:
    impostor = Impostor(short_tmp / "d.sock")
    try:
        for command in ("status", "stop", "ping"):
            result = subprocess.run(
                [sys.executable, "-m", "dalid.server", command, "--socket", str(impostor.path)],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
            )
            assert result.returncode == 1, result
            assert f"runs as uid {OTHER_UID}, not as you" in result.stderr
        assert impostor.received() == b""
    finally:
        impostor.kill()


def test_a_runtime_directory_planted_as_a_link_stops_the_trainer_before_it_connects(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The attack from its start: another user links the default runtime directory's
    name, in a shared sticky directory, to a private directory of the victim's, where the
    victim's daemon really runs; the trainer refuses the runtime directory outright."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    victims = own_directory("dlt-victim-")
    daemon = start_daemon(victims, name="cpu")
    planted = shared / "dalid-rt"
    planted.symlink_to(victims)
    if os.getuid() == 0:
        os.lchown(planted, OTHER_UID, OTHER_UID)
    monkeypatch.setenv(RUNTIME_DIR_ENV, str(planted))
    try:
        with pytest.raises(UnsafePath, match=f"runtime directory {planted} is a symbolic link"):
            dalid.connect(device="cpu", autostart=False)
        # Through the real directory, the daemon is there and answers.
        with dalid.connect(socket=daemon.socket, autostart=False) as session:
            assert session.daemon_pid == daemon.pid
    finally:
        stopped = daemon.stop()
        shutil.rmtree(victims, ignore_errors=True)
    assert stopped == 0


@pytest.mark.parametrize("mode", [0o777, 0o1777, 0o770, 0o755, 0o711])
@pytest.mark.parametrize("where", ["--socket", "--runtime-dir"])
def test_a_daemon_will_not_listen_where_others_can_enter(
    short_tmp: Path, mode: int, where: str
) -> None:
    """One rule for the socket's directory, whether --socket or --runtime-dir names it."""
    open_dir = short_tmp / "open"
    open_dir.mkdir()
    open_dir.chmod(mode)
    socket = open_dir / ("d.sock" if where == "--socket" else "cpu.sock")
    named = str(socket) if where == "--socket" else str(open_dir)
    for supervised in (False, True):
        result = subprocess.run(
            [sys.executable, "-m", "dalid.server", "serve", where, named,
             *([] if supervised else ["--no-supervisor"])],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        # Refused as a bad option, before any daemon or supervisor starts.
        assert result.returncode == 2, result.stderr
        kind = "socket directory" if where == "--socket" else "runtime directory"
        assert result.stderr.strip() == (
            f"dalid serve: {kind} {open_dir} is open to other users (mode {mode:o}): run "
            f"`chmod 700 {open_dir}`"
        )
        assert not socket.exists() and not socket.with_name(socket.name + ".lock").exists()


def test_a_daemon_refuses_a_socket_directory_others_can_enter_however_it_is_started(
    short_tmp: Path,
) -> None:
    """The daemon's claim on its socket holds to the rule too: for a directory opened after the
    command checked it, or a daemon made in-process."""
    from dalid.server.intake.socket_claim import SocketClaim

    open_dir = short_tmp / "open"
    open_dir.mkdir(mode=0o755)
    open_dir.chmod(0o755)
    claim = SocketClaim(open_dir / "d.sock")
    with pytest.raises(PermissionError, match=r"is open to other users \(mode 755\)"):
        claim.acquire()
    claim.close()
    assert list(open_dir.iterdir()) == []


def test_the_uuid_link_of_a_daemon_serves_its_workers(short_tmp: Path) -> None:
    """The one link a client follows: a GPU daemon's own ``<GPU UUID>.sock`` beside its socket
    (made here by hand for a CPU daemon, as the GPU daemon makes it)."""
    daemon = start_daemon(short_tmp, name="gpu0")
    link = short_tmp / "GPU-00000000-1111-2222-3333-444444444444.sock"
    link.symlink_to(daemon.socket.name)
    try:
        with dalid.connect(socket=link, autostart=False) as session:
            proxy = session.proxy(two_output_pipeline())
            loader = dalid.DataLoader(
                session, ProxyDataset(proxy, 4 * BATCH), batch_size=BATCH, num_workers=2
            )
            seen = []
            for (_, shifted), indices in loader:
                for row, index in enumerate(indices.tolist()):
                    np.testing.assert_array_equal(shifted[row].numpy(), sample(index) + 7)
                seen += indices.tolist()
            assert sorted(seen) == list(range(4 * BATCH))
            assert session.daemon_pid == daemon.pid
    finally:
        link.unlink()
        assert daemon.stop() == 0


MARKING_PIPELINE = """
import pathlib
pathlib.Path({mark!r}).touch()
from nvidia.dali import fn, pipeline_def

@pipeline_def(batch_size=4, num_threads=1, device_id=None)
def {name}():
    return fn.external_source(name="data", no_copy=True) * 2
"""


def _pipeline_file(path: Path, mark: Path, name: str, mode: int) -> None:
    path.write_text(MARKING_PIPELINE.format(mark=str(mark), name=name))
    path.chmod(mode)


def test_a_daemon_does_not_run_a_repository_others_can_write(
    short_tmp: Path, tmp_path: Path
) -> None:
    """The case that once ran: a 0666 file in a 0777 directory ran with the daemon's rights."""
    repository = tmp_path / "pipelines"
    repository.mkdir()
    repository.chmod(0o777)
    mark = tmp_path / "ran"
    _pipeline_file(repository / "evil.py", mark, "train", 0o666)
    for supervised in (False, True):
        result = subprocess.run(
            [sys.executable, "-m", "dalid.server", "serve", "--socket", str(short_tmp / "d.sock"),
             "--pipelines", str(repository), *([] if supervised else ["--no-supervisor"])],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert result.returncode == 5, result.stderr  # not restarted by the supervisor
        assert f"pipeline repository {repository} can be written by other users" in result.stderr
        assert f"chmod go-w {repository}" in result.stderr
        assert not mark.exists(), "the file ran"
        assert not (short_tmp / "d.sock").exists()


def test_a_file_others_can_write_is_refused_at_start_and_at_reload(
    short_tmp: Path, tmp_path: Path
) -> None:
    repository = tmp_path / "pipelines"
    repository.mkdir(mode=0o755)
    marks = tmp_path / "marks"
    marks.mkdir()
    _pipeline_file(repository / "good.py", marks / "good", "train", 0o644)
    _pipeline_file(repository / "open.py", marks / "open", "val", 0o646)
    daemon = start_daemon(short_tmp, "--pipelines", str(repository))
    try:
        assert (marks / "good").exists() and not (marks / "open").exists()
        with dalid.connect(socket=daemon.socket, autostart=False) as session:
            with pytest.raises(dalid.PipelineError, match=r"open\.py: UnsafePath.*chmod go-w"):
                session.proxy("val")
            session.proxy("train")
        # Made writable by others while the daemon runs: `dalid reload` refuses it, and says so.
        (marks / "good").unlink()
        (repository / "good.py").chmod(0o666)
        result = subprocess.run(
            [sys.executable, "-m", "dalid.server", "reload", "--socket", str(daemon.socket)],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert result.returncode == 3, result
        assert "failed: good.py: UnsafePath" in result.stderr
        assert "still serving train from its last good load" in result.stderr
        assert not (marks / "good").exists() and not (marks / "open").exists()
    finally:
        assert daemon.stop() == 0
