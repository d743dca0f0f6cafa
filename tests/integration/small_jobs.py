"""Several small jobs in one process, each with its pipeline, holding on until told to end.

    python -m tests.integration.small_jobs --socket PATH --jobs N

Each job connects, registers a pipeline and runs one batch; then the process prints ``ready``
and waits for a line on stdin, closes every job and prints ``ok``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

import dalid.client as dalid

from .helpers import BATCH, ProxyDataset, sample, two_output_pipeline


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", type=Path, required=True)
    parser.add_argument("--jobs", type=int, required=True)
    args = parser.parse_args()
    sessions = []
    try:
        for number in range(args.jobs):
            session = dalid.connect(socket=args.socket, autostart=False, name=f"small{number}")
            sessions.append(session)
            proxy = session.proxy(two_output_pipeline())
            loader = dalid.DataLoader(session, ProxyDataset(proxy, BATCH), batch_size=BATCH)
            ((_, shifted), indices) = next(iter(loader))
            np.testing.assert_array_equal(shifted[0].numpy(), sample(int(indices[0])) + 7)
        print("ready", flush=True)
        sys.stdin.readline()
    finally:
        for session in sessions:
            session.close()
    print("ok", flush=True)


if __name__ == "__main__":
    main()
