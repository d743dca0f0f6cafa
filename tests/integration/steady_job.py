"""A job that runs beside an attack until told to stop, checking every batch it gets.

    python -m tests.integration.steady_job --socket PATH [--name N] [--reconnect]

Sends one batch at a time (load_job's blur of small uniform images, each output checked) and
prints "running" after its first batch. A line on stdin stops it after the batch in hand:
it prints "ok N", N the batches it got, all right. Any failed batch ends it with an error.
With ``--reconnect`` its session carries on across daemon restarts.
"""

from __future__ import annotations

import argparse
import select
import sys

import torch

import dalid.client as dalid

from .load_job import Images, heavy_pipeline


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    parser.add_argument("--name", default="steady")
    parser.add_argument("--reconnect", action="store_true")
    args = parser.parse_args()
    with dalid.connect(
        socket=args.socket, autostart=False, name=args.name, reconnect=args.reconnect
    ) as session:
        proxy = session.proxy(heavy_pipeline(4, 3))
        loader = dalid.DataLoader(session, Images(proxy, 4 * 1_000_000), batch_size=4)
        done = 0
        for done, ((blurred, original), indices) in enumerate(loader, start=1):
            expected = (indices % 251).to(torch.uint8).view(-1, 1, 1, 1)
            assert torch.equal(original, expected.expand_as(original)), "wrong input came back"
            assert torch.equal(blurred, expected.expand_as(blurred)), "wrong output came back"
            if done == 1:
                print("running", flush=True)
            if select.select([sys.stdin], [], [], 0)[0]:
                break
        print(f"ok {done}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
