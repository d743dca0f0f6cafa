"""A training job with GPU outputs, run as its own process by tests/integration/test_gpu.py.

    python -m tests.integration.gpu_job --socket PATH --offset K [--hold]

Consumes ``gpu_pipeline`` on a stream of its own, checks that every batch holds its own samples
(offset K), prints "ok N" at the end, and with --hold prints "holding" after the first batch and
sleeps with its tensors alive, to be killed. A process without CUDA fails on the first GPU
output, and prints the error's class and message.
"""

from __future__ import annotations

import contextlib
import sys
import time

import numpy as np
import torch

import dalid.client as dalid

from .helpers import BATCH, ProxyDataset, gpu_pipeline, job_arguments, sample


def main() -> int:
    args = job_arguments(default_length=96)
    with dalid.connect(socket=args.socket, autostart=False, name=f"gpu{args.offset}") as session:
        proxy = session.proxy(gpu_pipeline())
        dataset = ProxyDataset(proxy, args.length, offset=args.offset)
        loader = dalid.DataLoader(session, dataset, batch_size=BATCH, num_workers=args.workers)
        stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        held = []
        seen = 0
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                for (scaled, shifted), indices in loader:
                    assert scaled.is_cuda and not shifted.is_cuda
                    host = scaled.cpu()  # ordered after the daemon's copy by the stream's wait
                    for row, index in enumerate(indices.tolist()):
                        expected = sample(index, args.offset)
                        np.testing.assert_array_equal(shifted[row].numpy(), expected + 7)
                        np.testing.assert_array_equal(host[row].numpy(), expected * 0.5 + 1.0)
                    seen += len(indices)
                    if args.hold:
                        held.append((scaled, shifted))
                        print("holding", flush=True)
                        time.sleep(600)
        except dalid.DalidError as error:
            print(f"{type(error).__name__}: {error}", flush=True)
            return 3
        print(f"ok {seen} slabs {session.slabs_opened} events {session.events_opened}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
