"""Connects and kills training jobs one after another, as a crash-looping job would.

    python -m tests.integration.cycle_job --socket PATH --cycles N

Each cycle forks a trainer that connects, registers a pipeline, receives a batch and holds its
tensors; the moment it says so it is killed with SIGKILL, and the next cycle starts once the
daemon has let its job go. Forking from this process, which has imported torch and DALI once,
keeps a cycle well under a second. Prints "ok N" at the end.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

import dalid.client as dalid

from ..daemons import daemon_status, wait_for
from .helpers import BATCH, ProxyDataset, sample, two_output_pipeline


def trainer(socket: Path, cycle: int, ready: int) -> None:
    """The forked child: one batch, then hold it until killed."""
    session = dalid.connect(socket=socket, autostart=False, name=f"cycle{cycle}")
    proxy = session.proxy(two_output_pipeline())
    loader = dalid.DataLoader(session, ProxyDataset(proxy, BATCH, offset=cycle), batch_size=BATCH)
    (_, shifted), indices = next(iter(loader))
    np.testing.assert_array_equal(shifted[0].numpy(), sample(int(indices[0]), cycle) + 7)
    os.write(ready, b"x")
    time.sleep(600)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", type=Path, required=True)
    parser.add_argument("--cycles", type=int, required=True)
    args = parser.parse_args()
    for cycle in range(args.cycles):
        # No ZeroMQ context is open here across the fork: daemon_status closes its own.
        ready, told = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(ready)
            try:
                trainer(args.socket, cycle, told)
            finally:
                os._exit(1)
        os.close(told)
        said = os.read(ready, 1)
        os.close(ready)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        if said != b"x":
            print(f"cycle {cycle}: the trainer failed before its first batch", flush=True)
            return 1
        wait_for(lambda: not daemon_status(args.socket).jobs, 5.0, f"cycle {cycle}'s job to go")
    print(f"ok {args.cycles}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
