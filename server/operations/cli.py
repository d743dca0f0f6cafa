"""The ``dalid`` command: ``dalid serve`` runs daemons, ``dalid status`` shows one, ``dalid stop``
asks one to exit, ``dalid ping`` checks that one answers, ``dalid reload`` has one load its
pipeline repository again.

This module parses the command line and runs ``dalid serve``; the commands that ask a running
daemon are in :mod:`dalid.server.operations.control`. Options are defined once, in
:mod:`dalid.server.operations.config`. ``dalid serve`` runs each daemon as the child of a
supervisor that restarts it when it crashes (:mod:`dalid.server.operations.supervisor`);
``--no-supervisor`` runs the daemon in the command's own process.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dalid.protocol import (
    PROTOCOL_VERSION,
    RUNTIME_DIR_ENV,
    check_socket_directory,
    gpu_count,
    socket_path,
)

from .config import CONFIG_ENV, OPTIONS, ConfigError, add_options, resolve
from .control import EXIT_LOAD_FAILED, ping, reload, start_command, status, stop
from .status_view import legend

if TYPE_CHECKING:
    from ..intake.daemon import DaemonConfig

# What `dalid serve` alone needs (the daemon, its supervisor) is imported by it, not here: the
# commands that ask a running daemon start in a fraction of the time on a machine that trains.

log = logging.getLogger("dalid.server")
# As argparse exits on a bad flag.
EXIT_USAGE = 2
# Options the supervisor sets for each child itself rather than passing on.
PER_CHILD = frozenset({"device", "devices", "socket"})


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dalid",
        description="A daemon that runs NVIDIA DALI pipelines for many PyTorch training jobs.",
    )
    parser.add_argument("--version", action=_Version)
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
        formatter: type[argparse.HelpFormatter] = argparse.HelpFormatter
        if name == "status":
            # A table of the columns, printed as written.
            description = f"{textwrap.fill(description, 80)}\n\n{legend()}"
            formatter = argparse.RawDescriptionHelpFormatter
        command = commands.add_parser(
            name, help=text, description=description, formatter_class=formatter
        )
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
        if name == "stop":
            command.add_argument(
                "--end-jobs",
                action="store_true",
                help="end the daemon's jobs with it, those connected with reconnect=True too "
                "(without it, such jobs wait for the next daemon on the socket, as across an "
                "upgrade; the others end)",
            )
    return parser


class _Version(argparse.Action):
    """``--version``: prints :func:`version_line` and exits. Read only when asked: the installed
    release's metadata takes a while to find, which every other command would wait for."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS) -> None:
        super().__init__(
            option_strings,
            dest=dest,
            default=argparse.SUPPRESS,
            nargs=0,
            help="show dalid's release and protocol version and exit",
        )

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        print(version_line())
        parser.exit()


def version_line() -> str:
    """What ``dalid --version`` prints: this release and the protocol version it speaks."""
    from importlib import metadata

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
    from dalid.protocol import slabs

    info = os.statvfs(slabs.SHM_DIR)
    return info.f_frsize * info.f_blocks


def _daemon_config(settings: dict[str, Any]) -> DaemonConfig:
    from ..handling.registration import Sharing
    from ..intake.daemon import DaemonConfig, usable_cores
    from ..jobs.quotas import Quotas, per_user_jobs
    from ..pipelines.operators import OperatorPolicy
    from ..pipelines.spec import CpuExecutor

    pipelines = settings["pipelines"]
    if pipelines is not None and not pipelines.is_dir():
        raise ConfigError(f"pipelines: {pipelines} is not a directory")
    limit = settings["memory_limit"]
    quotas = Quotas(
        max_jobs=settings["max_jobs"],
        max_jobs_per_process=settings["max_jobs_per_process"],
        max_jobs_per_user=per_user_jobs(settings["max_jobs"], settings["max_jobs_per_user"]),
        reclaim_idle_s=settings["reclaim_idle_s"],
        pool_bytes=settings["pool_bytes"],
        slab_bytes=settings["slab_bytes"],
        memory_limit=limit if limit is not None else shm_size(),
        max_inflight_batches=settings["max_inflight_batches"],
        input_memory=settings["input_memory"],
        max_pipelines=settings["max_pipelines"],
        max_batch_size=settings["max_batch_size"],
        max_image_pixels=settings["max_image_pixels"],
        max_threads=settings["max_threads"] or 0,
        max_daemon_pipelines=settings["max_daemon_pipelines"],
        cohort_bytes=settings["cohort_memory"] or 0,
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
            instances=settings["instances"],
        ),
        cpu_executor=CpuExecutor(settings["cpu_executor"]),
        gpu_outputs=settings["gpu_outputs"],
        metrics_port=settings["metrics_port"],
        metrics_host=settings["metrics_host"],
        max_connections=settings["max_connections"],
        operators=OperatorPolicy.parse(settings["repository_operators"]),
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
    from .devices import DeviceListError, child_specs, parse_devices
    from .supervisor import Supervisor

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


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    serving = args.command == "serve"
    try:
        settings = _settings(args, serving)
        supervising = serving and (not args.no_supervisor or settings["devices"] is not None)
        # A socket path too long, or a runtime directory others can enter, is refused here,
        # and so is a --socket in a directory others can enter: the same rule.
        config = _daemon_config(settings) if serving and not supervising else None
        path = config.socket if config is not None else _socket(settings)
        if serving:
            check_socket_directory(path)
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
        from ..intake.daemon import Daemon
        from ..intake.heap import host_buffers_from_malloc, host_buffers_kept, limit_malloc_arenas
        from ..pipelines.spec import CpuExecutor
        from ..runs import stopping
        from .lifeline import supervisor_pid, watch_supervisor

        # Before the daemon makes any thread: arenas once made are kept.
        limit_malloc_arenas(settings["malloc_arenas"])
        # DALI's host buffers come from malloc, which gives them back, unless the daemon is
        # to keep DALI's pool (heap.py).
        if not settings["dali_host_pool"]:
            host_buffers_from_malloc()
        if config.device == "cpu" and config.cpu_executor is CpuExecutor.LEGACY:
            host_buffers_kept()  # a legacy executor's buffers stay at their largest run's size
        supervisor = supervisor_pid()
        daemon = Daemon(dataclasses.replace(config, supervisor=supervisor))
        if supervisor is not None:
            # A child of `dalid serve` ends with its supervisor, stuck or not.
            watch_supervisor(supervisor, daemon.supervisor_gone, daemon.abandon)
        code = daemon.serve()
        if stopping.any_under_way():
            # A pipeline's thread is inside a DALI call that may never return: the interpreter
            # would wait for it at exit (Note [A pipeline stuck inside DALI]). Everything the
            # daemon owns outside this process is gone already.
            log.warning("exiting without waiting for a DALI call that has not returned")
            logging.shutdown()
            sys.stdout.flush()
            os._exit(code)
        return code
    # These need no hello: whoever can open the socket (mode 0600, its user) may send them.
    start = start_command(settings["device"], path)
    if args.command == "status":
        return status(path, args, start)
    if args.command == "reload":
        return reload(path, args.timeout, start)
    if args.command == "stop":
        return stop(path, args.timeout, start, end_jobs=args.end_jobs)
    return ping(path, args.timeout, start)


if __name__ == "__main__":
    sys.exit(main())
