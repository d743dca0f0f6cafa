"""The ``dalid`` command: ``dalid serve`` runs a daemon, ``dalid stop`` asks one to exit,
``dalid ping`` checks that one answers. Options are defined in :mod:`dalid.server.config`."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
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
    socket_path,
    transport,
)

from .config import CONFIG_ENV, OPTIONS, ConfigError, add_options, resolve
from .daemon import Daemon, DaemonConfig

log = logging.getLogger("dalid.server")
# As argparse exits on a bad flag.
EXIT_USAGE = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dalid",
        description="A daemon that runs NVIDIA DALI pipelines for many PyTorch training jobs.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    serve = commands.add_parser(
        "serve",
        help="run the daemon for one device in the foreground",
        description="Runs the daemon for one device in the foreground. Each option is taken "
        "from its flag, else its environment variable, else the TOML file (--config or "
        f"${CONFIG_ENV}), else its default.",
    )
    add_options(serve)
    for name, text in (
        ("stop", "ask the daemon for a device to exit"),
        ("ping", "exit 0 if the daemon for a device answers (for health checks)"),
    ):
        command = commands.add_parser(
            name, help=text, description=f"{text[0].upper()}{text[1:]}; finds it as serve does."
        )
        add_options(command, [option for option in OPTIONS if option.locates_daemon])
        command.add_argument("--timeout", type=float, default=10.0, metavar="SECONDS")
    return parser


def _settings(args: argparse.Namespace, serving: bool) -> dict[str, Any]:
    options = OPTIONS if serving else [option for option in OPTIONS if option.locates_daemon]
    return resolve(vars(args), options=options)


def _socket(settings: dict[str, Any]) -> Path:
    return socket_path(settings["device"], settings["socket"], directory=settings["runtime_dir"])


def _daemon_config(settings: dict[str, Any]) -> DaemonConfig:
    pipelines = settings["pipelines"]
    if pipelines is not None and not pipelines.is_dir():
        raise ConfigError(f"pipelines: {pipelines} is not a directory")
    return DaemonConfig(
        device=settings["device"],
        socket=_socket(settings),
        idle_timeout=settings["idle_timeout"],
        pool_bytes=settings["pool_bytes"],
        slab_bytes=settings["slab_bytes"],
        max_batch_size=settings["max_batch_size"],
        pipelines=pipelines,
    )


def _ask(path: Path, timeout: float, request: Message) -> int:
    """Sends one request that needs no hello and waits for its answer; the exit status."""
    if not path.exists():
        print(f"dalid: no daemon listens on {endpoint(path)}", file=sys.stderr)
        return 1
    context: zmq.Context[Any] = zmq.Context()
    sock = transport.make_socket(context, zmq.DEALER, endpoint(path), bind=False)
    try:
        transport.send(sock, request, 1)
        if not sock.poll(int(timeout * 1000)):
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
        deadline = time.monotonic() + timeout
        while isinstance(request, Shutdown) and path.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return 0
    finally:
        sock.close(linger=0)
        context.term()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    serving = args.command == "serve"
    try:
        settings = _settings(args, serving)
        # A socket path too long, or a runtime directory others can enter, is refused here.
        config = _daemon_config(settings) if serving else None
        path = config.socket if config is not None else _socket(settings)
    except (ConfigError, OSError, ValueError) as error:
        print(f"dalid {args.command}: {error}", file=sys.stderr)
        return EXIT_USAGE
    if config is not None:
        logging.basicConfig(
            level=settings["log_level"],
            format="%(asctime)s dalid[%(process)d] %(levelname)s %(message)s",
        )
        log.debug("options: %s", ", ".join(f"{k}={v}" for k, v in sorted(settings.items())))
        return Daemon(config).serve()
    # Shutdown and ping need no hello: whoever can open the socket (mode 0600) may send them.
    return _ask(path, args.timeout, Shutdown() if args.command == "stop" else Ping())


if __name__ == "__main__":
    sys.exit(main())
