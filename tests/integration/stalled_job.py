"""A job whose pipeline gets stuck inside DALI: the repository's ``stalled`` pipeline (see
test_file_inputs.py) opens a FIFO that nobody writes to.

    python -m tests.integration.stalled_job --socket PATH --fifo PATH

Prints "running" once it has registered, then waits for a batch that never comes.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

import dalid.client as dalid


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    parser.add_argument("--fifo", required=True)
    args = parser.parse_args()
    with dalid.connect(socket=args.socket, autostart=False, name="stalled") as session:
        proxy = session.proxy(dalid.named_pipeline("stalled", batch_size=2, fifo=args.fifo))
        samples = [proxy(np.zeros(3, np.float32)) for _ in range(2)]
        batch = torch.utils.data.default_collate(samples)
        print("running", flush=True)
        session.produce_data(batch)
    return 0


if __name__ == "__main__":
    sys.exit(main())
