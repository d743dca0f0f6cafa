"""The ``dalid`` command: ``dalid serve`` runs daemons, ``dalid status`` shows one, ``dalid stop``
asks one to exit, ``dalid ping`` checks that one answers, ``dalid reload`` has one load its
pipeline repository again.

Options are defined once, in :mod:`dalid.server.config`. ``dalid serve`` runs each daemon as the
child of a supervisor that restarts it when it crashes (:mod:`dalid.server.supervisor`);
``--no-supervisor`` runs the daemon in the command's own process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

import zmq

from dalid.protocol import (
    PROTOCOL_VERSION,
    RUNTIME_DIR_ENV,
    SOCKET_ENV,
    Device,
    Error,
    ErrorCode,
    Message,
    Ping,
    Pong,
    ProtocolError,
    ReloadRepository,
    RepositoryReport,
    Shutdown,
    StatusReport,
    StatusRequest,
    daemon_socket,
    device_label,
    endpoint,
    gpu_count,
    runtime_dir,
    slabs,
    socket_path,
    transport,
)
from dalid.protocol.ownership import UnsafePath

from . import crash_report
from .config import CONFIG_ENV, OPTIONS, ConfigError, add_options, resolve
from .daemon import Daemon, DaemonConfig, usable_cores
from .devices import DeviceListError, child_specs, parse_devices
from .lifeline import watch_supervisor
from .pipelines import Sharing
from .quotas import Quotas
from .status_view import legend
from .supervisor import Supervisor

log = logging.getLogger("dalid.server")
# As argparse exits on a bad flag.
EXIT_USAGE = 2
# `dalid reload`: the daemon reloaded, but some files failed to load.
EXIT_LOAD_FAILED = 3
# Options the supervisor sets for each child itself rather than passing on.
PER_CHILD = frozenset({"device", "devices", "socket"})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dalid",
        description="A daemon that runs NVIDIA DALI pipelines for many PyTorch training jobs.",
    )
    parser.add_argument("--version", action="version", version=version_line())
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="run the daemon for a device (or one per device) in the foreground",
        description="Runs the daemon for one device (--devices: one per device) in the "
        "foreground, restarted when it crashes. Each option is taken from its flag, else its "
        "environment variable, else the TOML file (--config or "
        f"${CONFIG_ENV}), else its default.",
    )
    add_options(serve)
    serve.add_argument(
        "--no-supervisor",
        action="store_true",
        help="run the daemon in this process, not in a child restarted when it crashes "
        "(debugging; one device only)",
    )
    for name, text in (
        ("stop", "ask the daemon for a device to exit"),
        ("ping", "exit 0 if the daemon for a device answers (for health checks)"),
        ("status", "show the daemon for a device and its jobs, live"),
        ("reload", "have the daemon for a device load its pipeline repository again"),
    ):
        description = f"{text[0].upper()}{text[1:]}; finds it as serve does."
        if name == "reload":
            description += (
                " New registrations use the pipelines as loaded now; pipelines already running "
                "keep their definitions. A file that fails to load keeps the pipelines of its "
                "last good load; a removed file's pipelines are gone. Prints the pipelines and "
                "the files that failed; exits 0 when every file loaded, "
                f"{EXIT_LOAD_FAILED} when some failed (the others are loaded all the same), "
                "1 when the daemon did not reload. Any process of the user that can open the "
                "daemon's socket may reload it, as it may stop it; SIGHUP to the daemon, or to "
                "`dalid serve`, does the same."
            )
        if name == "status":
            description += f" Columns: {legend()}."
        command = commands.add_parser(name, help=text, description=description)
        add_options(command, [option for option in OPTIONS if option.locates_daemon])
        # Loading imports the repository's files, which may take a while.
        timeout = 60.0 if name == "reload" else 10.0
        command.add_argument(
            "--timeout",
            type=float,
            default=timeout,
            metavar="SECONDS",
            help=f"how long to wait for the daemon's answer (default {timeout:g})",
        )
        if name == "status":
            command.add_argument(
                "--json", action="store_true", help="print one snapshot as JSON and exit"
            )
            command.add_argument(
                "--interval",
                type=float,
                default=1.0,
                metavar="SECONDS",
                help="refresh period of the live table (default 1)",
            )
            command.add_argument("--once", action="store_true", help="print the table once")
    return parser


def version_line() -> str:
    """What ``dalid --version`` prints: this release and the protocol version it speaks."""
    try:
        release = metadata.version("dalid")
    except metadata.PackageNotFoundError:
        release = "(not installed)"
    return f"dalid {release}, protocol version {PROTOCOL_VERSION}"


def _settings(args: argparse.Namespace, serving: bool) -> dict[str, Any]:
    options = OPTIONS if serving else [option for option in OPTIONS if option.locates_daemon]
    return resolve(vars(args), options=options)


def _socket(settings: dict[str, Any]) -> Path:
    return socket_path(settings["device"], settings["socket"], directory=settings["runtime_dir"])


def shm_size() -> int:
    """The size of the shared-memory filesystem, which bounds what CPU outputs can use."""
    info = os.statvfs(slabs.SHM_DIR)
    return info.f_frsize * info.f_blocks


def _daemon_config(settings: dict[str, Any]) -> DaemonConfig:
    pipelines = settings["pipelines"]
    if pipelines is not None and not pipelines.is_dir():
        raise ConfigError(f"pipelines: {pipelines} is not a directory")
    limit = settings["memory_limit"]
    quotas = Quotas(
        max_jobs=settings["max_jobs"],
        max_jobs_per_process=settings["max_jobs_per_process"],
        pool_bytes=settings["pool_bytes"],
        slab_bytes=settings["slab_bytes"],
        memory_limit=limit if limit is not None else shm_size(),
        max_inflight_batches=settings["max_inflight_batches"],
        input_memory=settings["input_memory"],
        max_pipelines=settings["max_pipelines"],
        max_batch_size=settings["max_batch_size"],
        max_image_pixels=settings["max_image_pixels"],
    )
    return DaemonConfig(
        device=settings["device"],
        socket=_socket(settings),
        idle_timeout=settings["idle_timeout"],
        pipelines=pipelines,
        quotas=quotas,
        concurrency=settings["concurrency"] or 0,
        sharing=Sharing(
            enabled=settings["share_pipelines"],
            run_batches=settings["run_batches"],
            threads=settings["threads"] or usable_cores(),
        ),
        gpu_outputs=settings["gpu_outputs"],
        metrics_port=settings["metrics_port"],
        metrics_host=settings["metrics_host"],
        max_connections=settings["max_connections"],
    )


def _child_options(settings: dict[str, Any]) -> list[str]:
    """The resolved options as flags for each child daemon (flags win over all else there)."""
    flags: list[str] = []
    for option in OPTIONS:
        value = settings[option.name]
        if option.name not in PER_CHILD and value is not None:
            flags += [option.flag, str(value)]
    return flags


def _supervise(args: argparse.Namespace, settings: dict[str, Any]) -> int:
    try:
        if settings["devices"] is not None and "device" in vars(args):
            raise DeviceListError("--device and --devices: give one of them")
        devices = (
            [settings["device"]]
            if settings["devices"] is None
            else parse_devices(settings["devices"], gpu_count)
        )
        if args.no_supervisor:
            raise DeviceListError("--no-supervisor runs one daemon: use --device")
        if settings["runtime_dir"] is not None:
            # Children of several devices place their sockets in the runtime directory.
            os.environ[RUNTIME_DIR_ENV] = str(settings["runtime_dir"])
        socket = None if settings["socket"] is None else str(settings["socket"])
        specs = child_specs(devices, socket, _child_options(settings))
        port = settings["metrics_port"]
        if port and len(specs) > 1:
            # One endpoint per daemon: the port given, and the ones after it, in device order.
            specs = [
                dataclasses.replace(spec, command=(*spec.command, "--metrics-port", str(port + i)))
                for i, spec in enumerate(specs)
            ]
    except DeviceListError as error:
        print(f"dalid serve: {error}", file=sys.stderr)
        return EXIT_USAGE
    return Supervisor(specs).run()


class NoAnswer(Exception):
    """The daemon is not there or did not answer; the message says which."""


def start_command(device: Device, path: Path) -> str:
    """The command that starts a daemon for ``device`` on ``path``: with ``--socket`` unless
    ``dalid serve`` would choose that socket by itself."""
    command = f"dalid serve --device {device}"
    chosen = os.environ.get(SOCKET_ENV)
    try:
        default = (
            Path(chosen).absolute()
            if chosen
            else runtime_dir(create=False) / f"{device_label(device)}.sock"
        )
    except OSError:
        return f"{command} --socket {path}"
    return command if path == default else f"{command} --socket {path}"


class DaemonLine:
    """A connection for requests that need no hello (ping, status, shutdown). Closes once.

    ``start`` is the command that starts the daemon, for the message when none answers."""

    def __init__(self, path: Path, timeout: float, start: str) -> None:
        self.path = path
        self.timeout = timeout
        self.start = start
        target = self._verified(path, timeout)
        self._context: zmq.Context[Any] = zmq.Context()
        self._socket = transport.make_socket(
            self._context, zmq.DEALER, endpoint(target), bind=False
        )
        self._request_ids = iter(range(1, 1 << 62))

    def _verified(self, path: Path, timeout: float) -> Path:
        """The socket of the user's own daemon on ``path`` (only it is asked, or told to stop).
        A socket file there that nothing listens on yet (a daemon being restarted) is tried
        again until ``timeout``."""
        absent = f"no dalid daemon listens on {endpoint(path)}: start one with `{self.start}`"
        if not path.exists():
            raise NoAnswer(absent)
        deadline = time.monotonic() + timeout
        while True:
            try:
                return daemon_socket.verified_socket(path, timeout)
            except UnsafePath as error:
                raise NoAnswer(str(error)) from None
            except (FileNotFoundError, ConnectionRefusedError, TimeoutError):
                if time.monotonic() >= deadline:
                    raise NoAnswer(absent) from None
            time.sleep(0.05)

    def ask(self, request: Message) -> Message:
        request_id = next(self._request_ids)
        transport.send(self._socket, request, request_id)
        deadline = time.monotonic() + self.timeout
        while (left := deadline - time.monotonic()) > 0:
            if not self._socket.poll(int(left * 1000) + 1):
                break
            try:
                envelope = transport.recv(self._socket)
            except ProtocolError as error:
                raise NoAnswer(str(error)) from None
            if envelope.request_id != request_id:
                continue  # the answer to an earlier request that timed out
            if isinstance(envelope.message, Error):
                refusal = envelope.message
                if refusal.code is ErrorCode.UNKNOWN_OPERATION:
                    raise NoAnswer(
                        f"the daemon on {endpoint(self.path)} does not know {request.OP!r}: it "
                        "runs an older dalid release (restart it with this one)"
                    )
                raise NoAnswer(refusal.message)
            return envelope.message
        raise NoAnswer(
            f"no dalid daemon answered on {endpoint(self.path)} within {self.timeout:g} s. A "
            "daemon that was killed leaves its socket file behind; a busy one may answer with a "
            f"longer --timeout. `{self.start}` starts one (it replaces a dead daemon's socket)"
        )

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()

    def __enter__(self) -> DaemonLine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _ping(path: Path, timeout: float, start: str) -> int:
    """Exit status 0 when the daemon answers."""
    try:
        with DaemonLine(path, timeout, start) as line:
            reply = line.ask(Ping())
    except NoAnswer as error:
        print(f"dalid ping: {error}", file=sys.stderr)
        return 1
    assert isinstance(reply, Pong)
    print(f"dalid daemon pid {reply.daemon_pid} answers on {endpoint(path)}")
    return 0


def _stop(path: Path, timeout: float, start: str) -> int:
    """Asks the daemon to stop (it tells its jobs) and waits until its socket is gone."""
    try:
        with DaemonLine(path, timeout, start) as line:
            report = line.ask(StatusRequest())
            assert isinstance(report, StatusReport)
            line.ask(Shutdown())
    except NoAnswer as error:
        print(f"dalid stop: {error}", file=sys.stderr)
        return 1
    what = f"the dalid {report.device} daemon pid {report.daemon_pid} on {endpoint(path)}"
    deadline = time.monotonic() + timeout
    while path.exists():
        if time.monotonic() >= deadline:
            print(
                f"dalid stop: asked {what} to stop, and its socket is still there after "
                f"{timeout:g} s: it may still be freeing its jobs' memory (see its log)",
                file=sys.stderr,
            )
            return 1
        time.sleep(0.05)
    jobs = len(report.jobs)
    print(
        f"stopped {what}"
        + (f"; its {jobs} job(s) were told that it was stopped" if jobs else "; it had no jobs")
    )
    return 0


def _reload(path: Path, timeout: float, start: str) -> int:
    """Has the daemon reload its repository; prints what it loaded and what failed."""
    try:
        with DaemonLine(path, timeout, start) as line:
            report = line.ask(ReloadRepository())
    except NoAnswer as error:
        print(f"dalid reload: {error}", file=sys.stderr)
        return 1
    assert isinstance(report, RepositoryReport)
    print(f"reloaded {report.directory}: {', '.join(report.pipelines) or 'no pipelines'}")
    for failure in report.failures:
        kept = (
            f" (still serving {', '.join(failure.kept_pipelines)} from its last good load)"
            if failure.kept_pipelines
            else ""
        )
        print(f"failed: {failure.file}: {failure.message}{kept}", file=sys.stderr)
    return EXIT_LOAD_FAILED if report.failures else 0


def _status(path: Path, args: argparse.Namespace, start: str) -> int:
    """Prints the daemon's status: JSON once, a table once, or a live table until Ctrl-C.

    A daemon that its supervisor reports crash-looping (:mod:`.crash_report`) is said to be
    first, on stderr, whether or not a daemon answers now; with ``--json`` the report is also
    the object's ``crash_loop``.
    """
    from .status_view import as_json, table

    crashes = crash_report.read(path)
    if crashes is not None:
        print(f"dalid status: {crashes.text()}", file=sys.stderr)
    crash_loop = {"crash_loop": dataclasses.asdict(crashes)} if crashes is not None else {}
    try:
        with DaemonLine(path, args.timeout, start) as line:
            where = endpoint(path)
            report = line.ask(StatusRequest())
            assert isinstance(report, StatusReport)
            if args.json:
                print(as_json(report, crash_loop))
                return 0
            from rich.console import Console
            from rich.live import Live

            console = Console()
            if not console.is_terminal:
                # A pipe or a file has no width of its own: do not cut the table at 80 columns.
                console = Console(width=200)
            if args.once or not console.is_terminal:
                console.print(table(report, where, console.width))
                return 0
            with Live(
                table(report, where, console.width), console=console, auto_refresh=False
            ) as live:
                try:
                    while True:
                        time.sleep(args.interval)
                        report = line.ask(StatusRequest())
                        assert isinstance(report, StatusReport)
                        live.update(table(report, where, console.width), refresh=True)
                except KeyboardInterrupt:
                    return 0
    except NoAnswer as error:
        print(f"dalid status: {error}", file=sys.stderr)
        if args.json and crash_loop:
            print(json.dumps(crash_loop, indent=2, sort_keys=True))
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    serving = args.command == "serve"
    try:
        settings = _settings(args, serving)
        supervising = serving and (not args.no_supervisor or settings["devices"] is not None)
        # A socket path too long, or a runtime directory others can enter, is refused here.
        config = _daemon_config(settings) if serving and not supervising else None
        path = config.socket if config is not None else _socket(settings)
    except (ConfigError, OSError, ValueError) as error:
        print(f"dalid {args.command}: {error}", file=sys.stderr)
        return EXIT_USAGE
    if serving:
        logging.basicConfig(
            level=settings["log_level"],
            format="%(asctime)s dalid[%(process)d] %(levelname)s %(message)s",
        )
        log.debug("options: %s", ", ".join(f"{k}={v}" for k, v in sorted(settings.items())))
        if config is None:
            return _supervise(args, settings)
        daemon = Daemon(config)
        # A child of `dalid serve` ends with its supervisor, stuck or not.
        watch_supervisor(daemon.request_stop, daemon.abandon)
        return daemon.serve()
    # These need no hello: whoever can open the socket (mode 0600, its user) may send them.
    start = start_command(settings["device"], path)
    if args.command == "status":
        return _status(path, args, start)
    if args.command == "reload":
        return _reload(path, args.timeout, start)
    if args.command == "stop":
        return _stop(path, args.timeout, start)
    return _ping(path, args.timeout, start)


if __name__ == "__main__":
    sys.exit(main())
