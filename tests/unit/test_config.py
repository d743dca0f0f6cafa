"""`dalid serve` options: one table, flag > environment > TOML file > default, clear errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dalid.protocol import RUNTIME_DIR_ENV, SOCKET_ENV
from dalid.server.intake.daemon import DaemonConfig
from dalid.server.operations.cli import build_parser
from dalid.server.operations.config import (
    CONFIG_ENV,
    OPTIONS,
    OPTIONS_BY_NAME,
    ConfigError,
    read_toml,
    resolve,
)


def _serve(*argv: str, environ: dict[str, str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(["serve", *argv])
    return resolve(vars(args), environ=environ or {})


def _toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "dalid.toml"
    path.write_text(text)
    return path


def test_defaults_without_flags_environment_or_file() -> None:
    settings = _serve()
    assert settings == {option.name: option.default for option in OPTIONS}
    assert settings["pool_bytes"] == 1 << 30 and settings["idle_timeout"] is None


def test_the_table_defaults_agree_with_the_daemon_config() -> None:
    config = DaemonConfig(device="cpu", socket=Path("/x"))
    for name in ("idle_timeout", "pipelines", "metrics_port", "metrics_host"):
        assert OPTIONS_BY_NAME[name].default == getattr(config, name), name
    quotas = config.quotas
    for name in (
        "pool_bytes",
        "slab_bytes",
        "max_batch_size",
        "max_jobs",
        "max_inflight_batches",
        "max_image_pixels",
    ):
        assert OPTIONS_BY_NAME[name].default == getattr(quotas, name), name


def test_the_socket_and_runtime_dir_variables_are_the_clients() -> None:
    assert OPTIONS_BY_NAME["socket"].env == SOCKET_ENV
    assert OPTIONS_BY_NAME["runtime_dir"].env == RUNTIME_DIR_ENV


def test_flag_beats_environment_beats_file_beats_default(tmp_path: Path) -> None:
    config = _toml(tmp_path, 'pool_bytes = "1G"\nslab_bytes = "8M"\nmax_batch_size = 64\n')
    environ = {CONFIG_ENV: str(config), "DALID_POOL_BYTES": "3G", "DALID_SLAB_BYTES": "16M"}
    settings = _serve("--pool-bytes", "512M", environ=environ)
    assert settings["pool_bytes"] == 512 << 20  # flag
    assert settings["slab_bytes"] == 16 << 20  # environment
    assert settings["max_batch_size"] == 64  # file
    assert settings["log_level"] == "INFO"  # default


def test_config_flag_beats_the_config_variable(tmp_path: Path) -> None:
    chosen = _toml(tmp_path, "max_batch_size = 12\n")
    other = tmp_path / "other.toml"
    other.write_text("max_batch_size = 99\n")
    settings = _serve("--config", str(chosen), environ={CONFIG_ENV: str(other)})
    assert settings["max_batch_size"] == 12


def test_file_values_may_be_numbers_or_strings(tmp_path: Path) -> None:
    config = _toml(
        tmp_path,
        'device = 1\npool_bytes = 1048576\nidle_timeout = 2.5\nlog_level = "debug"\n'
        'pipelines = "~/pipes"\nsocket = "/run/dalid/gpu1.sock"\n',
    )
    settings = _serve("--config", str(config))
    assert settings["device"] == 1
    assert settings["pool_bytes"] == 1 << 20
    assert settings["idle_timeout"] == 2.5
    assert settings["log_level"] == "DEBUG"
    assert settings["pipelines"] == Path("~/pipes").expanduser()
    assert settings["socket"] == Path("/run/dalid/gpu1.sock")


def test_an_empty_variable_counts_as_unset() -> None:
    assert _serve(environ={"DALID_DEVICE": ""})["device"] == "cpu"


def test_unknown_key_names_the_key_and_file_and_suggests(tmp_path: Path) -> None:
    config = _toml(tmp_path, 'pool-bytes = "1G"\n')
    with pytest.raises(ConfigError) as raised:
        read_toml(config)
    message = str(raised.value)
    assert str(config) in message and "'pool-bytes'" in message and "'pool_bytes'" in message


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('pool_bytes = "lots"', "pool_bytes: not a size"),
        ("pool_bytes = -5", "pool_bytes: size must be positive"),
        ('device = "gpu"', "device: device must be 'cpu' or a GPU ordinal"),
        ("max_batch_size = 0", "max_batch_size: must be positive"),
        ("idle_timeout = true", "idle_timeout: expected a string or a number"),
        ('log_level = "LOUD"', "log_level: unknown log level"),
        ("pipelines = [1]", "pipelines: expected a string or a number"),
        ("pool_bytes = ", "is not valid TOML"),
    ],
)
def test_bad_file_values_name_the_file_and_key(tmp_path: Path, text: str, expected: str) -> None:
    config = _toml(tmp_path, text + "\n")
    with pytest.raises(ConfigError, match=expected) as raised:
        _serve("--config", str(config))
    assert str(config) in str(raised.value)


def test_a_missing_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        _serve(environ={CONFIG_ENV: str(tmp_path / "nope.toml")})


def test_bad_environment_value_names_the_variable() -> None:
    with pytest.raises(ConfigError, match=r"\$DALID_SLAB_BYTES: not a size"):
        _serve(environ={"DALID_SLAB_BYTES": "big"})


def test_bad_flag_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as raised:
        build_parser().parse_args(["serve", "--pool-bytes", "big"])
    assert raised.value.code == 2
    assert "--pool-bytes" in capsys.readouterr().err


def test_ping_and_stop_find_the_daemon_with_the_daemons_own_file(tmp_path: Path) -> None:
    config = _toml(tmp_path, 'device = 3\nsocket = "/run/d.sock"\npool_bytes = "1G"\n')
    args = build_parser().parse_args(["ping", "--config", str(config)])
    locating = [option for option in OPTIONS if option.locates_daemon]
    settings = resolve(vars(args), environ={}, options=locating)
    assert settings == {"device": 3, "runtime_dir": None, "socket": Path("/run/d.sock")}
    config.write_text("device = 3\npool = 1\n")
    with pytest.raises(ConfigError, match="unknown key 'pool'"):
        resolve(vars(args), environ={}, options=locating)


def test_help_names_every_flag_variable_and_default() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "dalid.server", "serve", "--help"],
        capture_output=True,
        text=True,
        check=True,
        env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"},
    )
    text = " ".join(result.stdout.split())
    assert "--config PATH" in text and CONFIG_ENV in text
    for option in OPTIONS:
        assert option.flag in text and option.env in text, option.name
    assert "default 1G" in text and "default INFO" in text and "default never" in text


def test_a_bad_config_file_stops_serve_with_a_message(tmp_path: Path) -> None:
    config = _toml(tmp_path, "max_batch = 4\n")
    result = subprocess.run(
        [sys.executable, "-m", "dalid.server", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 2
    assert "unknown key 'max_batch'" in result.stderr and "max_batch_size" in result.stderr


def test_a_supervised_child_gets_every_option_the_supervisor_resolved(tmp_path: Path) -> None:
    from dalid.server.operations.cli import PER_CHILD, _child_options

    config = _toml(tmp_path, 'memory_limit = "3G"\nmax_jobs = 5\n')
    settings = _serve(
        "--concurrency", "2", "--metrics-port", "9400", "--pool-bytes", "256M",
        environ={CONFIG_ENV: str(config), "DALID_MAX_INFLIGHT_BATCHES": "7"},
    )  # fmt: skip
    child_args = build_parser().parse_args(["serve", *_child_options(settings)])
    # The child reads no file and no environment of its own for these: its flags say it all.
    child = resolve(vars(child_args), environ={})
    for name, value in settings.items():
        if name not in PER_CHILD:
            assert child[name] == value, name
    assert child["memory_limit"] == 3 << 30 and child["max_inflight_batches"] == 7


def test_instances_are_auto_by_default_or_a_number() -> None:
    assert _serve()["instances"] == 0  # auto: decided from measurement
    assert _serve("--instances", "auto")["instances"] == 0
    assert _serve("--instances", "3")["instances"] == 3
    assert _serve(environ={"DALID_INSTANCES": "2"})["instances"] == 2
    with pytest.raises(ConfigError, match=r"\$DALID_INSTANCES: expected auto or a positive"):
        _serve(environ={"DALID_INSTANCES": "many"})


def test_run_batches_are_auto_by_default_or_a_number() -> None:
    assert _serve()["run_batches"] == 0  # auto: as many batches as fit 256 samples
    assert _serve("--run-batches", "auto")["run_batches"] == 0
    assert _serve("--run-batches", "4")["run_batches"] == 4
    assert _serve(environ={"DALID_RUN_BATCHES": "1"})["run_batches"] == 1
    with pytest.raises(ConfigError, match=r"\$DALID_RUN_BATCHES: expected auto or a positive"):
        _serve(environ={"DALID_RUN_BATCHES": "many"})
