"""The options of ``dalid serve``, each defined once, and where their values come from.

Every option is one row of :data:`OPTIONS`: its name (the TOML key), its flag, its environment
variable, its parser and its default. The command line, the environment and the TOML file are
all read from that table, so an option added there is a flag, a variable and a key at once.

Precedence, highest first: a flag, then a ``DALID_*`` environment variable, then the TOML file
(``--config PATH``, else ``$DALID_CONFIG``; there is no implicit file), then the default.

It holds the table of every option, the parsers its rows name, and the code that reads it.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dalid.protocol import parse_device

from ..intake.heap import DEFAULT_ARENAS
from ..samples.imagesize import DEFAULT_MAX_IMAGE_PIXELS

CONFIG_ENV = "DALID_CONFIG"
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


class ConfigError(ValueError):
    """A value or key that cannot be used; the message names where it came from."""


def parse_size(text: str) -> int:
    """``512M``, ``2G``, ``1048576`` or ``64MiB`` as a number of bytes."""
    value = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = value[-1] if value and value[-1] in _UNITS else ""
    number = value[: len(value) - len(unit)]
    try:
        size = int(float(number) * _UNITS[unit])
    except ValueError:
        raise ValueError(f"not a size: {text!r} (try 512M or 2G)") from None
    if size <= 0:
        raise ValueError(f"size must be positive: {text!r}")
    return size


def parse_seconds(text: str) -> float | None:
    """A positive number of seconds, or ``never`` (None)."""
    if text.strip().lower() in {"never", "none", ""}:
        return None
    try:
        seconds = float(text)
    except ValueError:
        raise ValueError(f"not a number of seconds: {text!r} (or 'never')") from None
    if seconds <= 0:
        raise ValueError(f"must be positive: {text!r} (or 'never')")
    return seconds


def parse_idle_seconds(text: str) -> float:
    """A number of seconds, 0 or more (0: off)."""
    try:
        seconds = float(text)
    except ValueError:
        raise ValueError(f"not a number of seconds: {text!r} (0: off)") from None
    if not seconds >= 0 or seconds == float("inf"):
        raise ValueError(f"must be 0 or a positive number of seconds: {text!r}")
    return seconds


def parse_positive_int(text: str) -> int:
    try:
        number = int(text)
    except ValueError:
        raise ValueError(f"not a whole number: {text!r}") from None
    if number <= 0:
        raise ValueError(f"must be positive: {text!r}")
    return number


def parse_count(text: str) -> int:
    """A whole number, 0 or more."""
    try:
        number = int(text)
    except ValueError:
        raise ValueError(f"not a whole number: {text!r}") from None
    if number < 0:
        raise ValueError(f"must not be negative: {text!r}")
    return number


def parse_switch(text: str) -> bool:
    """yes/no, true/false, on/off or 1/0."""
    value = text.strip().lower()
    if value in ("yes", "true", "on", "1"):
        return True
    if value in ("no", "false", "off", "0"):
        return False
    raise ValueError(f"expected yes or no, got {text!r}")


def parse_port(text: str) -> int:
    number = parse_count(text)
    if number > 65535:
        raise ValueError(f"not a TCP port: {text!r}")
    return number


def parse_device_list(text: str) -> str:
    """``all`` or a comma-separated list of devices; checked for its form here, resolved (GPUs
    counted) by the supervisor."""
    text = text.strip().lower()
    if text != "all":
        for item in text.split(","):
            parse_device(item)
    return text


def parse_gpu_outputs(text: str) -> str:
    """auto, ipc or staged (see ``staged.GPU_OUTPUT_MODES``)."""
    mode = text.strip().lower()
    if mode not in ("auto", "ipc", "staged"):
        raise ValueError(f"expected auto, ipc or staged, got {text!r}")
    return mode


def parse_cpu_executor(text: str) -> str:
    """legacy or client (``runner.CpuExecutor``)."""
    mode = text.strip().lower()
    if mode not in ("legacy", "client"):
        raise ValueError(f"expected legacy or client, got {text!r}")
    return mode


def parse_auto_count(text: str) -> int:
    """``auto`` (0, as the supervisor passes it on) or a positive number: ``--instances``
    (auto: the instance controller decides) and ``--run-batches`` (auto:
    ``sharing.batches_a_run`` chooses by the batch size)."""
    if text.strip().lower() == "auto":
        return 0
    try:
        return parse_count(text)
    except ValueError:
        raise ValueError(f"expected auto or a positive whole number, got {text!r}") from None


def parse_log_level(text: str) -> str:
    level = text.strip().upper()
    if level not in logging.getLevelNamesMapping():
        raise ValueError(f"unknown log level {text!r} (DEBUG, INFO, WARNING or ERROR)")
    return level


def parse_operator_names(text: str) -> str:
    """``any`` or comma-separated DALI operator schema names, kept as text."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if any(not name.replace("_", "").isalnum() for name in names):
        raise ValueError(f"not a list of operator names: {text!r}")
    return ",".join(names)


def parse_path(text: str) -> Path:
    if not text.strip():
        raise ValueError("an empty path")
    return Path(text).expanduser()


@dataclass(frozen=True)
class Option:
    """One option: ``name`` is its TOML key; the flag and variable are derived from it."""

    name: str
    parse: Callable[[str], Any]
    default: Any
    help: str
    metavar: str
    # Also an option of `dalid stop` and `dalid ping`, which find the daemon as serve does.
    locates_daemon: bool = False
    # Shown in --help instead of the default value, where the default is computed.
    default_text: str | None = None

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return "DALID_" + self.name.upper()

    def read(self, value: Any, source: str) -> Any:
        """``value`` (a string, or a TOML number) parsed; errors name ``source``."""
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            raise ConfigError(f"{source}: expected a string or a number, got {value!r}")
        try:
            return self.parse(str(value))
        except ValueError as error:
            raise ConfigError(f"{source}: {error}") from None


OPTIONS: tuple[Option, ...] = (
    Option(
        "device",
        parse_device,
        "cpu",
        "'cpu' for CPU pipelines, or the ordinal of the GPU to serve",
        "cpu|N",
        locates_daemon=True,
    ),
    Option(
        "runtime_dir",
        parse_path,
        None,
        "directory of the sockets (mode 0700, made if missing)",
        "DIR",
        locates_daemon=True,
        default_text="$XDG_RUNTIME_DIR/dalid, else /tmp/dalid-$UID",
    ),
    Option(
        "socket",
        parse_path,
        None,
        "socket path, which clients must use too",
        "PATH",
        locates_daemon=True,
        default_text="<runtime dir>/cpu.sock, gpu0.sock, ...",
    ),
    Option(
        "pipelines",
        parse_path,
        None,
        "a pipeline repository: Python files whose @pipeline_def functions clients select by "
        "name (the daemon runs that code: give it a directory only you can write)",
        "DIR",
        default_text="none",
    ),
    Option(
        "repository_operators",
        parse_operator_names,
        "",
        "DALI operators the repository's pipelines may use beyond the daemon's allow-list "
        "(docs/security.md lists it; fn.python_function is PythonFunction), comma-separated, "
        "or 'any'",
        "NAMES|any",
        default_text="none: the allow-list",
    ),
    Option(
        "devices",
        parse_device_list,
        None,
        "one daemon per device, each in a child process of its own: 'all' (every GPU), or a "
        "list such as 0,1 or cpu; with several, each listens on <runtime dir>/<device>.sock and "
        "logs to <device>.sock.log (instead of --device)",
        "LIST",
        default_text="--device only",
    ),
    Option(
        "pool_bytes",
        parse_size,
        parse_size("1G"),
        "the most output memory of a job that asks for none (it reserves what its outputs need, "
        "up to this); on a GPU daemon, this much host memory and this much device memory",
        "SIZE",
        default_text="1G",
    ),
    Option(
        "memory_limit",
        parse_size,
        None,
        "output memory all jobs together may reserve; a job that asks for more than is left is "
        "refused at connect, and one whose outputs need more than is left fails its batch",
        "SIZE",
        default_text="the size of /dev/shm",
    ),
    Option(
        "cohort_memory",
        parse_size,
        None,
        "output memory of one cohort (jobs that share the runs of batches of the same inputs), "
        "of each kind: shared memory, counted in --memory-limit, and on a GPU daemon as much GPU "
        "memory, whose buffers every member maps by CUDA IPC; half of it may hold outputs for "
        "its trailing members",
        "SIZE",
        default_text="--pool-bytes",
    ),
    Option("max_jobs", parse_positive_int, 64, "jobs served at once", "N"),
    Option(
        "max_jobs_per_process",
        parse_count,
        8,
        "jobs whose trainer is one process (0: no limit besides --max-jobs)",
        "N",
    ),
    Option(
        "max_jobs_per_user",
        parse_count,
        None,
        "jobs whose trainers are processes of one uid, so that the other uid the daemon serves "
        "(its own, or root) finds room; also the share of one uid of --max-daemon-pipelines "
        "and --max-threads is as much as this of --max-jobs (0: no per-user limit)",
        "N",
        default_text="half of --max-jobs",
    ),
    Option(
        "reclaim_idle_s",
        parse_idle_seconds,
        300.0,
        "when a new job would be refused because --max-jobs or its user's share is full, or a "
        "new pipeline because --max-daemon-pipelines, --max-threads or its user's share of "
        "them is, end the job idle longest (no batch for this many seconds) among those it "
        "competes with, telling its trainer why, and welcome the new job or start the pipeline "
        "(0: never end idle jobs)",
        "SECONDS",
        default_text="300",
    ),
    Option(
        "input_memory",
        parse_size,
        parse_size("2G"),
        "batch samples the daemon holds for all jobs (queued, running, waiting, deferred); one "
        "job holds at most half, and a batch over either is refused",
        "SIZE",
        default_text="2G",
    ),
    Option("max_pipelines", parse_positive_int, 32, "pipelines one job may register", "N"),
    Option(
        "max_daemon_pipelines",
        parse_positive_int,
        128,
        "DALI pipelines the daemon runs at once, for all jobs (one that jobs share counts once)",
        "N",
    ),
    Option(
        "max_threads",
        parse_count,
        None,
        "DALI threads of all pipelines together; a pipeline that asks for more than its share "
        "(the cores the daemon may use, and what is left) gets its share",
        "N",
        default_text="eight per core, at least 128",
    ),
    Option(
        "max_connections",
        parse_positive_int,
        2048,
        "client connections open at once, one process at most an eighth of them (at least 64); "
        "more are closed as they come",
        "N",
    ),
    Option(
        "max_inflight_batches",
        parse_positive_int,
        16,
        "batches one job may have queued or running, more wait (also what a job that asks for "
        "none gets)",
        "N",
    ),
    Option(
        "concurrency",
        parse_positive_int,
        None,
        "batches run at once across all jobs, shared by weight when jobs compete",
        "N",
        default_text="the number of CPU cores, at least 4",
    ),
    Option(
        "share_pipelines",
        parse_switch,
        True,
        "jobs that register the same pipeline share one DALI pipeline, whose runs mix their "
        "batches (a deterministic pipeline, or one whose operators look across the batch, "
        "always gets its own)",
        "yes|no",
        default_text="yes",
    ),
    Option(
        "run_batches",
        parse_auto_count,
        0,
        "the samples of this many batches at most in one run of a shared pipeline, one batch of "
        "each job: 'auto' takes as many as fit 256 samples, 1 to 4 (DALI keeps buffers for the "
        "largest run, so larger runs cost memory for every stage), and one batch for a pipeline "
        "a cohort member starts (its members' batches run once for all)",
        "N|auto",
        default_text="auto",
    ),
    Option(
        "threads",
        parse_positive_int,
        None,
        "DALI threads of each shared pipeline (a pipeline of its own keeps the job's), split "
        "between the two instances a CPU daemon runs it on under --instances auto; any "
        "pipeline gets at most as many as the CPU cores the daemon may use, since threads past "
        "them only wait",
        "N",
        default_text="the CPU cores the daemon may use",
    ),
    Option(
        "instances",
        parse_auto_count,
        0,
        "DALI instances of each shared pipeline, running its runs side by side: 'auto' runs "
        "a CPU daemon's on two that split --threads; on a GPU it tries one more while its jobs' "
        "batches wait and the device has room, and keeps it only if samples/s rose; N pins the "
        "number, each with --threads (within --max-threads and --max-daemon-pipelines)",
        "N|auto",
        default_text="auto",
    ),
    Option(
        "malloc_arenas",
        parse_count,
        DEFAULT_ARENAS,
        "glibc malloc arenas of the daemon, 0 for glibc's default (one per thread, up to 8 a "
        "core): fewer keep less of the memory DALI's runs freed resident in the daemon",
        "N",
    ),
    Option(
        "dali_host_pool",
        parse_switch,
        False,
        "DALI keeps its large host buffers in a pool of its own: runs reuse them without page "
        "faults (5 to 13 points faster where runs make large buffers), but the pool grows "
        "with what the daemon serves and outlives its pipelines; no: they come from malloc, "
        "and the daemon gives them back (DALI_MALLOC_POOL_THRESHOLD=0)",
        "yes|no",
        default_text="no",
    ),
    Option(
        "cpu_executor",
        parse_cpu_executor,
        "legacy",
        "the DALI executor of a CPU daemon's pipelines: 'legacy' keeps each run's buffers for "
        "the next runs (the daemon copies outputs out before it releases them); 'client' runs "
        "the executor the pipeline asked for, DALI's default making fresh buffers at each run, "
        "which cost page faults or a pool that grows (see --dali-host-pool). A GPU daemon "
        "always runs the pipeline's own",
        "legacy|client",
    ),
    Option(
        "gpu_outputs",
        parse_gpu_outputs,
        "auto",
        "how GPU outputs reach a trainer: 'auto' by CUDA IPC where the trainer can open the "
        "daemon's memory, else staged through shared memory (a copy each way); 'ipc' by CUDA IPC "
        "only, refusing a trainer that cannot; 'staged' always staged",
        "auto|ipc|staged",
    ),
    Option(
        "max_image_pixels",
        parse_count,
        DEFAULT_MAX_IMAGE_PIXELS,
        "an image sample whose header declares more pixels is a bad sample, refused before "
        "decoding; 0: no limit",
        "N",
        default_text=f"{DEFAULT_MAX_IMAGE_PIXELS}, as Pillow's",
    ),
    Option(
        "metrics_port",
        parse_port,
        None,
        "serve Prometheus metrics over HTTP on this port (with --devices, one port per daemon "
        "from this one on, in device order)",
        "PORT",
        default_text="no HTTP listener",
    ),
    Option("metrics_host", str, "127.0.0.1", "address the metrics endpoint listens on", "HOST"),
    Option(
        "slab_bytes",
        parse_size,
        parse_size("64M"),
        "size of each slab outputs are carved from (shared memory or GPU memory)",
        "SIZE",
        default_text="64M",
    ),
    Option("max_batch_size", parse_positive_int, 4096, "largest batch a pipeline may declare", "N"),
    Option(
        "idle_timeout",
        parse_seconds,
        None,
        "exit after this long with no connected job",
        "SECONDS",
        default_text="never",
    ),
    Option("log_level", parse_log_level, "INFO", "DEBUG, INFO, WARNING or ERROR", "LEVEL"),
)
OPTIONS_BY_NAME = {option.name: option for option in OPTIONS}


def add_options(parser: argparse.ArgumentParser, options: Iterable[Option] = OPTIONS) -> None:
    """Adds ``--config`` and a flag per option. Flags have no argparse default, so that only
    the flags given appear in the namespace (the rest come from env, file or default)."""
    parser.add_argument(
        "--config",
        type=Path,
        default=argparse.SUPPRESS,
        metavar="PATH",
        help=f'TOML file of options (keys as below, e.g. pool_bytes = "4G"); env {CONFIG_ENV}',
    )
    for option in options:
        default = option.default_text if option.default_text is not None else option.default
        parser.add_argument(
            option.flag,
            dest=option.name,
            type=_argparse_type(option),
            default=argparse.SUPPRESS,
            metavar=option.metavar,
            help=f"{option.help} (env {option.env}; default {default})",
        )


def _argparse_type(option: Option) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            return option.parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None

    parse.__name__ = option.name  # argparse names the type in some messages
    return parse


def read_toml(path: Path) -> dict[str, Any]:
    """The options set in the TOML file at ``path``. Unknown keys and bad values raise."""
    # Imported here, as only a configured daemon reads a file: not with every command.
    import difflib
    import tomllib

    try:
        with path.open("rb") as file:
            table = tomllib.load(file)
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist") from None
    except OSError as error:
        raise ConfigError(f"config file {path} cannot be read: {error}") from None
    except tomllib.TOMLDecodeError as error:
        raise ConfigError(f"config file {path} is not valid TOML: {error}") from None
    known = OPTIONS_BY_NAME
    values: dict[str, Any] = {}
    for key, value in table.items():
        option = known.get(key)
        if option is None:
            close = difflib.get_close_matches(key.replace("-", "_"), list(known), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(
                f"config file {path}: unknown key {key!r}{hint}; known keys: {', '.join(known)}"
            )
        values[key] = option.read(value, f"config file {path}: {key}")
    return values


def resolve(
    flags: Mapping[str, Any],
    environ: Mapping[str, str] | None = None,
    options: Sequence[Option] = OPTIONS,
) -> dict[str, Any]:
    """The value of each of ``options``: flag > environment > TOML file > default.

    ``flags`` holds the parsed flags that were given (and ``config`` if ``--config`` was).
    """
    environ = os.environ if environ is None else environ
    config_path = flags.get("config")
    if config_path is None and environ.get(CONFIG_ENV):
        config_path = Path(environ[CONFIG_ENV])
    # Every key of the table is valid in the file, so `dalid ping` reads the daemon's own file.
    from_file = read_toml(Path(config_path)) if config_path is not None else {}
    values: dict[str, Any] = {}
    for option in options:
        if option.name in flags:
            values[option.name] = flags[option.name]
        elif environ.get(option.env):
            values[option.name] = option.read(environ[option.env], f"${option.env}")
        elif option.name in from_file:
            values[option.name] = from_file[option.name]
        else:
            values[option.name] = option.default
    return values
