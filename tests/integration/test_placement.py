"""connect() without a device: the daemon of this process's GPU (LOCAL_RANK, torch's current
device, visible-device lists, GPU UUID links), else the CPU daemon; explicit choices win."""

from __future__ import annotations

from pathlib import Path

import pytest

import dalid.client as dalid
from dalid.client.link.placement import default_daemon
from dalid.protocol import runtime_dir

from ..daemons import start_daemon

GPU_VARIABLES = ("LOCAL_RANK", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "DALID_SOCKET")


@pytest.fixture
def environ(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in GPU_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_no_rank_and_no_cuda_is_the_cpu_daemon(tmp_path: Path) -> None:
    assert default_daemon({}, tmp_path) == ("cpu", None)


def test_local_rank_is_the_gpu(tmp_path: Path) -> None:
    assert default_daemon({"LOCAL_RANK": "2"}, tmp_path) == (2, None)


def test_visible_ordinals_map_the_rank_to_the_daemons_numbering(tmp_path: Path) -> None:
    environ = {"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "4,5"}
    assert default_daemon(environ, tmp_path) == (5, None)
    # CUDA reads CUDA_VISIBLE_DEVICES, so it wins over the container runtime's list.
    environ["NVIDIA_VISIBLE_DEVICES"] = "6,7"
    assert default_daemon(environ, tmp_path) == (5, None)
    assert default_daemon({"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "all"}, tmp_path) == (1, None)


def test_a_visible_uuid_finds_the_daemon_link_of_that_gpu(tmp_path: Path) -> None:
    environ = {"LOCAL_RANK": "1", "NVIDIA_VISIBLE_DEVICES": "GPU-aaaa,GPU-bbbb"}
    assert default_daemon(environ, tmp_path) == (1, None)  # no such daemon: the ordinal
    (tmp_path / "gpu3.sock").touch()
    (tmp_path / "GPU-bbbb.sock").symlink_to("gpu3.sock")
    assert default_daemon(environ, tmp_path) == (1, tmp_path / "GPU-bbbb.sock")


def test_a_bad_local_rank_is_an_input_error(tmp_path: Path) -> None:
    with pytest.raises(dalid.InputError, match="LOCAL_RANK"):
        default_daemon({"LOCAL_RANK": "first"}, tmp_path)


def test_torch_current_device_when_cuda_is_initialised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # This machine may have no GPU: torch's answers are replaced, the choice above them is real.
    import torch

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert default_daemon({}, tmp_path) == (3, None)
    assert default_daemon({"LOCAL_RANK": "1"}, tmp_path) == (1, None)  # LOCAL_RANK first


def test_connect_without_a_device_uses_the_cpu_daemon_of_the_runtime_dir(
    environ: pytest.MonkeyPatch,
) -> None:
    daemon = start_daemon(runtime_dir(), name="cpu")
    try:
        with dalid.connect(autostart=False) as session:
            assert session.socket == daemon.socket and session.device == "cpu"
        # A GPU rank looks for the daemon of that GPU, not the CPU one.
        environ.setenv("LOCAL_RANK", "0")
        with pytest.raises(dalid.DaemonUnavailable, match=r"gpu0\.sock"):
            dalid.connect(autostart=False)
        # An explicit socket or device wins over the rank, even a rank that is no index.
        environ.setenv("LOCAL_RANK", "x")
        with dalid.connect(socket=daemon.socket, autostart=False) as session:
            assert session.socket == daemon.socket
        with dalid.connect(device="cpu", autostart=False) as session:
            assert session.socket == daemon.socket
        environ.setenv("DALID_SOCKET", str(daemon.socket))
        with dalid.connect(autostart=False) as session:
            assert session.socket == daemon.socket
    finally:
        assert daemon.stop() == 0


def test_connect_through_a_gpu_uuid_link(environ: pytest.MonkeyPatch) -> None:
    # A CPU daemon stands in for a GPU daemon's socket; the link is what a GPU daemon makes.
    daemon = start_daemon(runtime_dir(), name="uuid-target")
    link = runtime_dir() / "GPU-00000000-1111-2222-3333-444444444444.sock"
    link.symlink_to(daemon.socket.name)
    try:
        environ.setenv("LOCAL_RANK", "0")
        environ.setenv("NVIDIA_VISIBLE_DEVICES", link.stem)
        with dalid.connect(autostart=False) as session:
            assert session.socket == link and session.daemon_pid == daemon.pid
    finally:
        link.unlink()
        assert daemon.stop() == 0
