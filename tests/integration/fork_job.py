"""The pattern of a DataLoader worker's segfault, repeated: two jobs in one trainer process.

    python -m tests.integration.fork_job --socket PATH --rounds N

Each round, two threads each open a session and iterate a DataLoader of 2 forked workers over
JPEG images. One job's samples include corrupt ones (``on_error="raise"``): it keeps the
``BatchError`` it expects, whose traceback holds the job's frame and with it the outputs of its
last good batch, views of the trainer's slab mappings. That is garbage the trainer has not
collected yet when the other job forks its next workers (here its collector is paused, as
training loops that pause it do, so that every round has such garbage). Each of those workers
maps memory of its own the size of a slab, where the kernel likes to put it: in the address
range of a trainer mapping that the worker did not inherit (Note [Slab mappings across fork]);
then it collects garbage, as its allocations would make it do sooner or later, and uses that
memory. Had the collection unmapped the trainer's mapping there, the memory would be gone and
the worker would die of SIGSEGV. Prints ``ok N`` after N rounds without a failure.
"""

from __future__ import annotations

import argparse
import gc
import mmap
import sys
import threading
import traceback

import dalid.client as dalid
from dalid.server.jobs.quotas import Quotas

from .test_bad_samples import BAD, ImageDataset, decode_pipeline, photo_tiles

SLAB_BYTES = Quotas().slab_bytes
_own_memory: list[mmap.mmap] = []


def _map_then_collect(_worker_id: int) -> None:
    memory = mmap.mmap(-1, SLAB_BYTES)
    _own_memory.append(memory)
    gc.collect()
    for offset in range(0, SLAB_BYTES, 1 << 20):
        memory[offset] = 1  # SIGSEGV, were this range unmapped by the collection


def _bad_job(socket: str, done: threading.Event, failures: list[str]) -> None:
    try:
        with dalid.connect(socket=socket, autostart=False, name="corrupt") as session:
            proxy = session.proxy(decode_pipeline(), on_error="raise")
            dataset = ImageDataset(proxy, list(range(16)))  # batch 0 good, batch 1 not
            loader = dalid.DataLoader(session, dataset, batch_size=8, num_workers=2)
            try:
                for images, _, _ in loader:
                    assert images.shape == (8, 32, 32, 3)
            except dalid.BatchError as error:
                expected = error  # noqa: F841 - kept, as a test keeps what it expects
            else:
                failures.append("the corrupt job's batch did not fail")
    except BaseException:
        failures.append(traceback.format_exc())
    finally:
        done.set()


def _good_job(socket: str, bad_done: threading.Event, failures: list[str]) -> None:
    try:
        with dalid.connect(socket=socket, autostart=False, name="good") as session:
            proxy = session.proxy(decode_pipeline(), on_error="raise")
            dataset = ImageDataset(proxy, [i for i in range(24) if i not in BAD])
            loader = dalid.DataLoader(
                session,
                dataset,
                batch_size=8,
                num_workers=2,
                worker_init_fn=_map_then_collect,
            )
            for epoch in range(2):
                if epoch == 1:
                    bad_done.wait(120)  # its garbage exists: these workers inherit it
                seen = 0
                for images, labels, _ in loader:
                    assert images.shape[1:] == (32, 32, 3)
                    seen += len(labels)
                assert seen == len(dataset), seen
    except BaseException:
        failures.append(traceback.format_exc())


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--socket", required=True)
    parser.add_argument("--rounds", type=int, default=16)
    args = parser.parse_args()
    photo_tiles()  # decoded once here, not in every worker
    gc.disable()
    for round_number in range(args.rounds):
        failures: list[str] = []
        bad_done = threading.Event()
        bad = threading.Thread(target=_bad_job, args=(args.socket, bad_done, failures))
        good = threading.Thread(target=_good_job, args=(args.socket, bad_done, failures))
        for thread in (bad, good):
            thread.start()
        for thread in (bad, good):
            thread.join()
        if failures:
            print(f"round {round_number} failed:\n" + "\n".join(failures), flush=True)
            return 1
        gc.collect()  # each round starts with none of the last one's garbage
    print(f"ok {args.rounds}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
