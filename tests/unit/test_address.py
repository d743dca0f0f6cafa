"""Devices, the runtime directory and socket paths."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

from dalid.protocol import (
    RUNTIME_DIR_ENV,
    SOCKET_ENV,
    device_label,
    endpoint,
    parse_device,
    runtime_dir,
    socket_path,
)
from dalid.protocol.address import MAX_SOCKET_PATH


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """No address variable leaks in from the caller; XDG points at a private temp dir."""
    for name in (SOCKET_ENV, RUNTIME_DIR_ENV, "XDG_RUNTIME_DIR"):
        monkeypatch.delenv(name, raising=False)
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(xdg))
    return xdg


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


# --- Devices ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("cpu", "cpu"),
        ("CPU", "cpu"),
        (" cpu\n", "cpu"),
        (0, 0),
        (3, 3),
        ("0", 0),
        (" 7 ", 7),
        ("12", 12),
    ],
    ids=repr,
)
def test_parse_device(value: Any, expected: Any) -> None:
    parsed = parse_device(value)
    assert parsed == expected
    assert type(parsed) is type(expected)


@pytest.mark.parametrize(
    "value", [-1, "-1", "gpu0", "cuda:0", "", "1.5", 1.0, True, False, None, [0]], ids=repr
)
def test_parse_device_rejects(value: Any) -> None:
    with pytest.raises(ValueError, match="'cpu' or a GPU ordinal"):
        parse_device(value)


@pytest.mark.parametrize(
    ("value", "label"), [("cpu", "cpu"), ("CPU", "cpu"), (0, "gpu0"), ("3", "gpu3"), (11, "gpu11")]
)
def test_device_label(value: Any, label: str) -> None:
    assert device_label(value) == label


def test_device_label_rejects_bad_devices() -> None:
    with pytest.raises(ValueError):
        device_label("gpu0")


# --- Runtime directory --------------------------------------------------------------------------


def test_runtime_dir_from_dalid_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    wanted = tmp_path / "a" / "b" / "runtime"
    monkeypatch.setenv(RUNTIME_DIR_ENV, str(wanted))
    path = runtime_dir()
    assert path == wanted  # wins over XDG_RUNTIME_DIR
    assert path.is_dir()
    assert _mode(path) == 0o700


def test_runtime_dir_from_xdg(clean_environment: Path) -> None:
    path = runtime_dir()
    assert path == clean_environment / "dalid"
    assert path.is_dir()
    assert _mode(path) == 0o700


def test_runtime_dir_is_private_whatever_the_umask(clean_environment: Path) -> None:
    old = os.umask(0)
    try:
        path = runtime_dir()
    finally:
        os.umask(old)
    assert _mode(path) == 0o700


def test_runtime_dir_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    expected = Path(f"/tmp/dalid-{os.getuid()}")
    existed = expected.exists()
    assert runtime_dir(create=False) == expected
    assert expected.exists() == existed  # create=False creates nothing


def test_runtime_dir_empty_variables_are_ignored(
    monkeypatch: pytest.MonkeyPatch, clean_environment: Path
) -> None:
    monkeypatch.setenv(RUNTIME_DIR_ENV, "")
    assert runtime_dir() == clean_environment / "dalid"


def test_runtime_dir_without_create(clean_environment: Path) -> None:
    path = runtime_dir(create=False)
    assert path == clean_environment / "dalid"
    assert not path.exists()


def test_existing_private_runtime_dir_is_accepted(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    existing = tmp_path / "existing"
    existing.mkdir(mode=0o700)
    (existing / "gpu0.sock").touch()
    monkeypatch.setenv(RUNTIME_DIR_ENV, str(existing))
    assert runtime_dir() == existing
    assert (existing / "gpu0.sock").exists()


@pytest.mark.parametrize("mode", [0o755, 0o750, 0o701, 0o777, 0o710])
def test_runtime_dir_open_to_others_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, mode: int
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(mode)
    monkeypatch.setenv(RUNTIME_DIR_ENV, str(shared))
    for create in (True, False):
        with pytest.raises(PermissionError) as caught:
            runtime_dir(create=create)
        message = str(caught.value)
        assert f"chmod 700 {shared}" in message
        assert f"{mode:o}" in message
    assert _mode(shared) == mode  # refused, not silently changed


def test_socket_path_under_an_insecure_runtime_dir_is_refused(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    monkeypatch.setenv(RUNTIME_DIR_ENV, str(shared))
    with pytest.raises(PermissionError, match="chmod 700"):
        socket_path("cpu")


# --- Socket paths -------------------------------------------------------------------------------


def test_socket_path_default(clean_environment: Path) -> None:
    assert socket_path() == clean_environment / "dalid" / "cpu.sock"
    assert socket_path("cpu") == clean_environment / "dalid" / "cpu.sock"
    assert socket_path(0) == clean_environment / "dalid" / "gpu0.sock"
    assert socket_path("2") == clean_environment / "dalid" / "gpu2.sock"


def test_socket_path_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(SOCKET_ENV, str(tmp_path / "env.sock"))
    assert socket_path("cpu") == tmp_path / "env.sock"
    assert socket_path(1) == tmp_path / "env.sock"  # the variable names the whole path


def test_explicit_socket_path_wins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(SOCKET_ENV, str(tmp_path / "env.sock"))
    assert socket_path("cpu", tmp_path / "explicit.sock") == tmp_path / "explicit.sock"
    assert socket_path(0, str(tmp_path / "explicit.sock")) == tmp_path / "explicit.sock"


def test_explicit_socket_path_does_not_touch_the_runtime_dir(clean_environment: Path) -> None:
    socket_path("cpu", clean_environment / "x.sock")
    assert not (clean_environment / "dalid").exists()


def test_relative_socket_path_is_made_absolute(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    path = socket_path("cpu", "relative.sock")
    assert path.is_absolute()
    assert path == tmp_path / "relative.sock"


def test_socket_path_too_long(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    long = Path("/tmp") / ("x" * 120) / "cpu.sock"
    with pytest.raises(ValueError, match=str(MAX_SOCKET_PATH)) as caught:
        socket_path("cpu", long)
    assert SOCKET_ENV in str(caught.value)
    monkeypatch.setenv(SOCKET_ENV, str(long))
    with pytest.raises(ValueError, match=f"longer than {MAX_SOCKET_PATH} bytes"):
        socket_path("cpu")
    deep = tmp_path / ("d" * 100)
    monkeypatch.delenv(SOCKET_ENV)
    monkeypatch.setenv(RUNTIME_DIR_ENV, str(deep))
    with pytest.raises(ValueError, match="limit of a Unix socket address"):
        socket_path("cpu")


def test_socket_path_limit_is_counted_in_bytes() -> None:
    # Exactly at the limit is fine; one more byte (a two-byte character) is not.
    base = "/tmp/"
    fits = base + "a" * (MAX_SOCKET_PATH - len(base))
    assert len(os.fsencode(fits)) == MAX_SOCKET_PATH
    assert str(socket_path("cpu", fits)) == fits
    over = base + "a" * (MAX_SOCKET_PATH - len(base) - 1) + "é"
    assert len(over) == MAX_SOCKET_PATH
    with pytest.raises(ValueError, match=str(MAX_SOCKET_PATH)):
        socket_path("cpu", over)


def test_endpoint() -> None:
    assert endpoint(Path("/run/user/1/dalid/cpu.sock")) == "ipc:///run/user/1/dalid/cpu.sock"
