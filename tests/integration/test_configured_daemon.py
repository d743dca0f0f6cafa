"""A daemon configured by a TOML file honours it; its environment and flags win over it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import dalid.client as dalid

from ..daemons import DaemonProcess, own_directory, wait_until_answering
from .test_repository import REPOSITORY


def test_a_daemon_started_from_a_toml_file_honours_it() -> None:
    directory = own_directory()
    socket = directory / "configured.sock"
    config = directory / "dalid.toml"
    config.write_text(
        f'socket = "{socket}"\n'
        'pool_bytes = "3M"\n'
        'slab_bytes = "256K"\n'
        "max_batch_size = 16\n"
        f'pipelines = "{REPOSITORY}"\n'
        'repository_operators = "PythonFunction"\n'
        'log_level = "DEBUG"\n'
    )
    log = directory / "configured.log"
    environ = {**os.environ, "DALID_CONFIG": str(config), "DALID_SLAB_BYTES": "512K"}
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "dalid.server", "serve", "--max-batch-size", "32"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=environ,
        )
    daemon = DaemonProcess(socket, process, log)
    try:
        wait_until_answering(socket, process)
        with dalid.connect(socket=socket, autostart=False) as session:
            limits = session.limits
            assert limits.pool_bytes == 3 << 20  # the file
            assert limits.slab_bytes == 512 << 10  # the environment over the file
            assert limits.max_batch_size == 32  # the flag over the file
            # The file's repository is loaded.
            assert session.proxy("scaled").target.input_names == ("data",)
        assert daemon.stop() == 0
        assert " DEBUG " in daemon.log_text()  # the file's log level
        assert not socket.exists()
    finally:
        daemon.stop()
        shutil.rmtree(directory, ignore_errors=True)
