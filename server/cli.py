"""The ``dalid`` command: ``dalid serve`` runs a daemon, ``dalid status`` shows one, ``dalid stop``
asks one to exit.

``dalid serve`` runs each daemon as the child of a supervisor that restarts it when it crashes
(:mod:`dalid.server.supervisor`); ``--no-supervisor`` runs the daemon in the command's own
process.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections.abc import Sequence
from typing import Any

import zmq

from dalid.protocol import (
    Error,
    Message,
    Ping,
    Pong,
    ProtocolError,
    Shutdown,
    StatusReport,
    StatusRequest,
    endpoint,
    gpu_count,
    parse_device,
    socket_path,
    transport,
)

from .daemon import Daemon, DaemonConfig
from .imagesize import DEFAULT_MAX_IMAGE_PIXELS
from .memory import SHM_DIR
from .quotas import Quotas
from .supervisor import DeviceListError, Supervisor, child_specs, parse_devices

DEFAULT_DEVICE = os.environ.get("DALID_DEVICE", "cpu")
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """``512M``, ``2G``, ``1048576`` or ``64MiB`` as a number of bytes."""
    value = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = value[-1] if value and value[-1] in _UNITS else ""
    number = value[: len(value) - len(unit)]
    try:
        size = int(float(number) * _UNITS[unit])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 512M or 2G)") from None
    if size <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return size


def _device(text: str) -> str | int:
    try:
        return parse_device(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dalid",
        description="A daemon that runs NVIDIA DALI pipelines for many PyTorch training jobs.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser(
        "serve", help="run the daemon for a device (or one per device) in the foreground"
    )
    which = serve.add_mutually_exclusive_group()
    which.add_argument(
        "--device",
        type=_device,
        default=DEFAULT_DEVICE,
        help="'cpu' for CPU pipelines or a GPU ordinal (default: $DALID_DEVICE, else cpu)",
    )
    which.add_argument(
        "--devices",
        metavar="LIST",
        help="one daemon per device: 'all' (every GPU), or a list such as 0,1 or cpu; with "
        "several, each listens on <runtime dir>/<device>.sock and logs to <device>.sock.log",
    )
    serve.add_argument(
        "--no-supervisor",
        action="store_true",
        help="run the daemon in this process, not in a child restarted when it crashes "
        "(debugging; one device only)",
    )
    serve.add_argument(
        "--socket",
        help="socket path (default: $DALID_SOCKET, else <runtime dir>/<device>.sock)",
    )
    serve.add_argument(
        "--idle-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="exit after this long with no connected job (default: never)",
    )
    serve.add_argument(
        "--pool-bytes",
        type=parse_size,
        default="1G",
        help="output memory of a job that asks for none, e.g. 2G (default 1G); on a GPU daemon, "
        "this much host memory and this much device memory",
    )
    serve.add_argument(
        "--memory-limit",
        type=parse_size,
        default=None,
        help="output memory all jobs together may reserve; a job that asks for more than is "
        f"left is refused at connect (default: the size of {SHM_DIR})",
    )
    serve.add_argument(
        "--max-jobs", type=_positive, default=64, help="jobs served at once (default 64)"
    )
    serve.add_argument(
        "--max-inflight-batches",
        type=_positive,
        default=16,
        metavar="N",
        help="batches one job may have queued or running; more wait (default 16, also what a "
        "job that asks for none gets)",
    )
    serve.add_argument(
        "--concurrency",
        type=_positive,
        default=None,
        metavar="N",
        help="batches run at once across all jobs, shared by weight when jobs compete "
        "(default: the number of CPU cores, at least 4)",
    )
    serve.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve Prometheus metrics over HTTP on this port (default: no HTTP listener)",
    )
    serve.add_argument(
        "--metrics-host",
        default="127.0.0.1",
        help="address the metrics endpoint listens on (default 127.0.0.1)",
    )
    serve.add_argument(
        "--slab-bytes",
        type=parse_size,
        default="64M",
        help="size of each slab outputs are carved from, shared memory or GPU memory (default 64M)",
    )
    serve.add_argument(
        "--max-batch-size", type=int, default=4096, help="largest batch a pipeline may declare"
    )
    serve.add_argument(
        "--max-image-pixels",
        type=int,
        default=DEFAULT_MAX_IMAGE_PIXELS,
        metavar="N",
        help="an image sample whose header declares more pixels is a bad sample, refused before "
        f"decoding; 0: no limit (default {DEFAULT_MAX_IMAGE_PIXELS}, as Pillow's)",
    )
    serve.add_argument("--log-level", default=os.environ.get("DALID_LOG_LEVEL", "INFO"))

    for name, text in (
        ("stop", "ask the daemon for a device to exit"),
        ("ping", "exit 0 if the daemon for a device answers (for health checks)"),
        ("status", "show the daemon for a device and its jobs, live"),
    ):
        command = commands.add_parser(name, help=text)
        command.add_argument("--device", type=_device, default=DEFAULT_DEVICE)
        command.add_argument("--socket")
        command.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS")
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
            command.add_argument(
                "--once", action="store_true", help="print the table once and exit"
            )
    return parser


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text!r}")
    return value


def shm_size() -> int:
    """The size of the shared-memory filesystem, which bounds what CPU outputs can use."""
    info = os.statvfs(SHM_DIR)
    return info.f_frsize * info.f_blocks


def _serve(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s dalid[%(process)d] %(levelname)s %(message)s",
    )
    if not args.no_supervisor or args.devices is not None:
        return _supervise(args)
    quotas = Quotas(
        max_jobs=args.max_jobs,
        pool_bytes=args.pool_bytes,
        slab_bytes=args.slab_bytes,
        memory_limit=args.memory_limit if args.memory_limit is not None else shm_size(),
        max_inflight_batches=args.max_inflight_batches,
        max_batch_size=args.max_batch_size,
        max_image_pixels=max(0, args.max_image_pixels),
    )
    if quotas.pool_bytes > quotas.memory_limit:
        print(
            f"dalid: --pool-bytes {args.pool_bytes} is more than --memory-limit "
            f"{quotas.memory_limit}: no job could connect",
            file=sys.stderr,
        )
        return 2
    config = DaemonConfig(
        device=args.device,
        socket=socket_path(args.device, args.socket),
        idle_timeout=args.idle_timeout,
        quotas=quotas,
        concurrency=args.concurrency or 0,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
    )
    return Daemon(config).serve()


class NoAnswer(Exception):
    """The daemon is not there or did not answer; the message says which."""


class DaemonLine:
    """A connection for requests that need no hello (ping, status, shutdown). Closes once."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.path = socket_path(args.device, args.socket)
        self.timeout = args.timeout
        if not self.path.exists():
            raise NoAnswer(f"no daemon listens on {endpoint(self.path)}")
        self._context: zmq.Context[Any] = zmq.Context()
        self._socket = transport.make_socket(
            self._context, zmq.DEALER, endpoint(self.path), bind=False
        )
        self._request_ids = iter(range(1, 1 << 62))

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
                raise NoAnswer(envelope.message.message)
            return envelope.message
        raise NoAnswer(f"the daemon on {endpoint(self.path)} did not answer")

    def close(self) -> None:
        self._socket.close(linger=0)
        self._context.term()

    def __enter__(self) -> DaemonLine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _supervise(args: argparse.Namespace) -> int:
    try:
        devices = [args.device] if args.devices is None else parse_devices(args.devices, gpu_count)
        if args.no_supervisor:
            raise DeviceListError("--no-supervisor runs one daemon: use --device")
        options = [
            *(["--idle-timeout", str(args.idle_timeout)] if args.idle_timeout is not None else []),
            "--pool-bytes", str(args.pool_bytes), "--slab-bytes", str(args.slab_bytes),
            "--max-batch-size", str(args.max_batch_size), "--log-level", args.log_level,
        ]  # fmt: skip
        specs = child_specs(devices, args.socket, options)
    except DeviceListError as error:
        print(f"dalid serve: {error}", file=sys.stderr)
        return 2
    return Supervisor(specs).run()


def _ask(args: argparse.Namespace, request: Message) -> int:
    """Sends one request that needs no hello and waits for its answer; the exit status."""
    try:
        with DaemonLine(args) as line:
            reply = line.ask(request)
            if isinstance(reply, Pong):
                print(f"dalid daemon pid {reply.daemon_pid} answers on {endpoint(line.path)}")
            deadline = time.monotonic() + args.timeout
            while isinstance(request, Shutdown) and line.path.exists():
                if time.monotonic() >= deadline:
                    break
                time.sleep(0.05)
            return 0
    except NoAnswer as error:
        print(f"dalid: {error}", file=sys.stderr)
        return 1


def _status(args: argparse.Namespace) -> int:
    """Prints the daemon's status: JSON once, a table once, or a live table until Ctrl-C."""
    from .status_view import as_json, table

    try:
        with DaemonLine(args) as line:
            where = endpoint(line.path)
            report = line.ask(StatusRequest())
            assert isinstance(report, StatusReport)
            if args.json:
                print(as_json(report))
                return 0
            from rich.console import Console
            from rich.live import Live

            console = Console()
            if not console.is_terminal:
                # A pipe or a file has no width of its own: do not cut the table at 80 columns.
                console = Console(width=200)
            if args.once or not console.is_terminal:
                console.print(table(report, where))
                return 0
            with Live(table(report, where), console=console, auto_refresh=False) as live:
                try:
                    while True:
                        time.sleep(args.interval)
                        report = line.ask(StatusRequest())
                        assert isinstance(report, StatusReport)
                        live.update(table(report, where), refresh=True)
                except KeyboardInterrupt:
                    return 0
    except NoAnswer as error:
        print(f"dalid: {error}", file=sys.stderr)
        return 1


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    if args.command == "status":
        return _status(args)
    # Shutdown and ping need no hello: whoever can open the socket (mode 0600) may send them.
    return _ask(args, Shutdown() if args.command == "stop" else Ping())


if __name__ == "__main__":
    sys.exit(main())
