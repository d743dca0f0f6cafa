"""The ``dalid`` command: ``dalid serve`` runs a daemon, ``dalid stop`` asks one to exit.

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
    endpoint,
    gpu_count,
    parse_device,
    socket_path,
    transport,
)

from .daemon import Daemon, DaemonConfig
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
        default="2G",
        help="output memory each job may hold, e.g. 2G (default 2G); on a GPU daemon, this much "
        "host memory and this much device memory",
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
    serve.add_argument("--log-level", default=os.environ.get("DALID_LOG_LEVEL", "INFO"))

    for name, text in (
        ("stop", "ask the daemon for a device to exit"),
        ("ping", "exit 0 if the daemon for a device answers (for health checks)"),
    ):
        command = commands.add_parser(name, help=text)
        command.add_argument("--device", type=_device, default=DEFAULT_DEVICE)
        command.add_argument("--socket")
        command.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS")
    return parser


def _serve(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s dalid[%(process)d] %(levelname)s %(message)s",
    )
    if not args.no_supervisor or args.devices is not None:
        return _supervise(args)
    config = DaemonConfig(
        device=args.device,
        socket=socket_path(args.device, args.socket),
        idle_timeout=args.idle_timeout,
        pool_bytes=args.pool_bytes,
        slab_bytes=args.slab_bytes,
        max_batch_size=args.max_batch_size,
    )
    return Daemon(config).serve()


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
    path = socket_path(args.device, args.socket)
    if not path.exists():
        print(f"dalid: no daemon listens on {endpoint(path)}", file=sys.stderr)
        return 1
    context: zmq.Context[Any] = zmq.Context()
    sock = transport.make_socket(context, zmq.DEALER, endpoint(path), bind=False)
    try:
        transport.send(sock, request, 1)
        if not sock.poll(int(args.timeout * 1000)):
            print(f"dalid: the daemon on {endpoint(path)} did not answer", file=sys.stderr)
            return 1
        try:
            reply = transport.recv(sock).message
        except ProtocolError as error:
            print(f"dalid: {error}", file=sys.stderr)
            return 1
        if isinstance(reply, Error):
            print(f"dalid: {reply.message}", file=sys.stderr)
            return 1
        if isinstance(reply, Pong):
            print(f"dalid daemon pid {reply.daemon_pid} answers on {endpoint(path)}")
        deadline = time.monotonic() + args.timeout
        while isinstance(request, Shutdown) and path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return 0
    finally:
        sock.close(linger=0)
        context.term()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args)
    # Shutdown and ping need no hello: whoever can open the socket (mode 0600) may send them.
    return _ask(args, Shutdown() if args.command == "stop" else Ping())


if __name__ == "__main__":
    sys.exit(main())
