"""A storm of connections past ``--max-connections`` writes a few log lines a second, not one
a connection: each is still cut, the lines left out are counted, and once the storm is over a
new job is welcomed within a second (a storm of 5 processes of 450 connections each once wrote
32,005 lines)."""

from __future__ import annotations

import math
import re
import shutil
import time

from dalid.server.intake.intake import per_process_connections
from dalid.server.intake.log_damper import LINES_PER_SECOND

from ..daemons import own_directory, start_daemon, wait_for
from .test_flood import HELLO_S, end, hello_seconds, start_flooder


def test_a_storm_of_connections_is_cut_in_a_few_log_lines_that_count_the_rest() -> None:
    directory = own_directory()
    daemon = start_daemon(directory, "--max-connections", "8")
    flooder = None
    try:
        started = time.monotonic()
        # 300 connections, each cut past the 8th and reconnected by ZeroMQ every 0.1 s, 3 s long.
        flooder = start_flooder(daemon.socket, "connections", "--count", "300")
        flooder.communicate(timeout=60)

        def told() -> bool:
            return "more lines like the last were not logged" in daemon.log_text()

        wait_for(told, 10, "the daemon to count the cut lines it left out")
        lasted = time.monotonic() - started
        log = daemon.log_text()
        logged = log.count("cut at once")
        left_out = sum(
            int(n) for n in re.findall(r"\(and (\d+) more like it not logged\)", log)
        ) + sum(int(n) for n in re.findall(r"(\d+) more lines like the last were not logged", log))
        assert logged <= LINES_PER_SECOND * math.ceil(lasted + 1), logged
        assert left_out >= 292 - logged, (logged, left_out)  # every connection past 8 is cut
        assert hello_seconds(daemon.socket) < HELLO_S  # they are gone: room again
    finally:
        if flooder is not None:
            end(flooder)
        code = daemon.stop()
        shutil.rmtree(directory, ignore_errors=True)
    assert code == 0


def test_a_new_job_is_welcomed_within_a_second_while_one_process_storms_the_daemon() -> None:
    directory = own_directory()
    # Room for 256 connections, one process at most 64 of them: a storm of 300 connections
    # of one process (cut past its share, and reconnected by its ZeroMQ every 0.1 s) leaves
    # room for a new job of another process.
    daemon = start_daemon(directory, "--max-connections", "256")
    flooder = None
    try:
        flooder = start_flooder(daemon.socket, "connections", "--count", "300")
        time.sleep(1.0)  # its connections are open, past its share cut and reconnecting
        assert flooder.poll() is None, "the storm ended before the new job came"
        assert hello_seconds(daemon.socket) < HELLO_S
        printed = flooder.communicate(timeout=60)[0]
        assert int(printed.split()[-1]) <= per_process_connections(256), printed
        assert "the most of one process" in daemon.log_text()
    finally:
        if flooder is not None:
            end(flooder)
        code = daemon.stop()
        shutil.rmtree(directory, ignore_errors=True)
    assert code == 0
