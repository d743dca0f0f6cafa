"""The in-process link itself (client/link/inproc.py), against a small recording daemon.

A session driven through it against a real daemon core is in test_session.py.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from dalid.client.errors import DaemonStopped, DaemonUnavailable, JobEnded, RequestError
from dalid.client.link.inproc import InprocDaemon, InprocLink
from dalid.client.link.link import answering, dial
from dalid.protocol import (
    PROTOCOL_VERSION,
    BatchAccepted,
    Error,
    ErrorCode,
    Goodbye,
    Hello,
    InputBatch,
    Limits,
    Message,
    Ok,
    Ping,
    Role,
    SubmitBatch,
    Welcome,
)


class Recorder:
    """A daemon side that welcomes everyone, accepts every batch and records what it got."""

    def __init__(self) -> None:
        self.received: list[tuple[bytes, Message, int | None]] = []
        self.disconnected: list[bytes] = []

    def handle(self, identity: bytes, message: Message, request_id: int | None) -> Message | None:
        self.received.append((identity, message, request_id))
        if isinstance(message, Hello):
            limits = Limits(max_batch_size=8, max_message_bytes=1 << 20, pool_bytes=0, slab_bytes=0)
            return Welcome(PROTOCOL_VERSION, os.getpid(), "cpu", "test", 1, "token", limits)
        if isinstance(message, SubmitBatch):
            return BatchAccepted(len(self.received))
        if isinstance(message, Goodbye):
            return Ok()
        return Error(ErrorCode.UNKNOWN_OPERATION, f"{message.OP} is not handled here")


@pytest.fixture
def served() -> Iterator[tuple[InprocDaemon, Recorder]]:
    recorder = Recorder()
    daemon = InprocDaemon(Path(f"/tmp/dalid-inproc-{uuid.uuid4().hex[:8]}.sock"))
    daemon.serve(recorder.handle, recorder.disconnected.append)
    yield daemon, recorder
    daemon.close()


def _submit(sample: np.ndarray) -> SubmitBatch:
    batch = InputBatch.of("x", [sample])
    return SubmitBatch(1, (batch,))


def test_dial_finds_a_daemon_served_in_this_process(served: tuple[InprocDaemon, Recorder]) -> None:
    daemon, recorder = served
    assert answering(daemon.path) and not daemon.path.exists()
    link = dial(daemon.path, Role.WORKER, job_id=1, job_token="token")
    assert isinstance(link, InprocLink) and link.welcome.job_token == "token"
    link.close()
    (identity, hello, _), (_, goodbye, _) = recorder.received
    assert isinstance(hello, Hello) and hello.role is Role.WORKER
    assert isinstance(goodbye, Goodbye)
    assert recorder.disconnected == [identity]  # as the socket monitor reports a closed peer
    daemon.close()
    assert not answering(daemon.path)


def test_messages_cross_through_the_codec_as_copies(served: tuple[InprocDaemon, Recorder]) -> None:
    daemon, recorder = served
    link = dial(daemon.path, Role.TRAINER)
    sample = np.arange(4, dtype=np.float32)
    reply = link.request(_submit(sample))
    assert isinstance(reply, BatchAccepted)
    sample[:] = -1  # after the send: the daemon's copy is its own
    _, received, request_id = recorder.received[-1]
    assert isinstance(received, SubmitBatch) and request_id is not None
    assert np.frombuffer(received.inputs[0].data, dtype=np.float32).tolist() == [0, 1, 2, 3]
    with pytest.raises(RequestError, match="ping is not handled"):
        link.request(Ping())  # an error reply raises, as over a socket
    link.close()


def test_a_stopped_daemon_is_gone_for_its_links(served: tuple[InprocDaemon, Recorder]) -> None:
    daemon, _ = served
    link = dial(daemon.path, Role.TRAINER)
    daemon.close()
    with pytest.raises(DaemonUnavailable, match="is gone: it was stopped"):
        link.request(_submit(np.zeros(2, dtype=np.float32)))
    link.close()  # no goodbye is waited for
    assert link.closed


def test_a_job_the_daemon_ended_says_no_goodbye(served: tuple[InprocDaemon, Recorder]) -> None:
    daemon, recorder = served
    link = dial(daemon.path, Role.TRAINER)
    identity = recorder.received[-1][0]
    daemon.push(identity, Error(ErrorCode.UNKNOWN_JOB, "it was idle", ends_jobs=True))
    with pytest.raises(JobEnded, match="ended this job: it was idle"):
        link.request(_submit(np.zeros(2, dtype=np.float32)))
    received = len(recorder.received)
    link.close()  # the daemon knows this job no more: no goodbye, as over a socket
    assert len(recorder.received) == received and link.closed


@pytest.mark.parametrize("ends_jobs", [False, True], ids=["stops", "ends-jobs"])
def test_a_daemon_that_stops_says_so_as_over_a_socket(
    served: tuple[InprocDaemon, Recorder], ends_jobs: bool
) -> None:
    # The notice a stopping daemon sends its peers (farewell.py) is DaemonStopped here too,
    # with what to do next, not a job the daemon ended.
    daemon, recorder = served
    link = dial(daemon.path, Role.TRAINER)
    identity = recorder.received[-1][0]
    notice = "the dalid daemon (pid 1) was stopped (SIGTERM)"
    daemon.push(identity, Error(ErrorCode.SHUTTING_DOWN, notice, ends_jobs=ends_jobs))
    with pytest.raises(DaemonStopped, match="was stopped") as stopped:
        link.request(_submit(np.zeros(2, dtype=np.float32)))
    assert stopped.value.notice == notice and stopped.value.ends_jobs is ends_jobs
    received = len(recorder.received)
    link.close()  # the daemon is going: no goodbye is waited for
    assert len(recorder.received) == received and link.closed


def test_only_the_serving_process_reaches_the_daemon(
    served: tuple[InprocDaemon, Recorder],
) -> None:
    daemon, _ = served
    daemon.pid += 1  # as a forked DataLoader worker sees the daemon its parent serves
    with pytest.raises(DaemonUnavailable, match="only that process can reach it"):
        dial(daemon.path, Role.TRAINER)
