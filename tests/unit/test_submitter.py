"""A link's submitter: ids of its own range, sent without waiting, one acknowledgment open."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from dalid.client.errors import RequestError
from dalid.client.worker.submitter import Submitter
from dalid.protocol import (
    BatchAccepted,
    BatchFailed,
    Error,
    ErrorCode,
    InputBatch,
    Message,
    SubmitBatch,
)

BASE = 7 << 32


@dataclass
class Welcome:
    batch_id_base: int = BASE


@dataclass
class FakeLink:
    """Records what is sent; answers each request from ``answers`` when its reply is asked."""

    answers: dict[int, Message] = field(default_factory=dict)
    sent: list[tuple[int, Message]] = field(default_factory=list)
    waited: list[int] = field(default_factory=list)
    welcome: Welcome = field(default_factory=Welcome)

    def send(self, message: Message) -> int:
        self.sent.append((len(self.sent) + 1, message))
        return len(self.sent)

    def reply(self, request_id: int, op: str, timeout: float | None = None) -> Message:
        self.waited.append(request_id)
        answer = self.answers[request_id]
        if isinstance(answer, Error):
            raise RequestError(answer.code, answer.message)
        return answer


def _request(submitter: Submitter, deferred: bool = False) -> SubmitBatch:
    sample = np.zeros(2, np.float32)
    batch = InputBatch.of("x", [sample])
    return SubmitBatch(1, (batch,), submitter.next_batch_id(), deferred=deferred)


def test_ids_come_from_the_links_range_in_order() -> None:
    submitter = Submitter(FakeLink())  # type: ignore[arg-type]
    assert [submitter.next_batch_id() for _ in range(3)] == [BASE + 1, BASE + 2, BASE + 3]


def test_a_batch_is_sent_at_once_and_acknowledged_before_the_next() -> None:
    link = FakeLink({1: BatchAccepted(BASE + 1), 2: BatchAccepted(BASE + 2)})
    submitter = Submitter(link)  # type: ignore[arg-type]
    first = _request(submitter)
    submitter.submit(first)
    assert link.sent == [(1, first)] and link.waited == []  # handed on without waiting
    submitter.submit(_request(submitter))
    assert link.waited == [1] and len(link.sent) == 2  # the first's answer, then the send
    submitter.settle()
    submitter.settle()  # nothing left to wait for
    assert link.waited == [1, 2]


def test_a_batch_failed_answer_is_the_trainers_to_raise() -> None:
    failed = BatchFailed(BASE + 1, 1, ErrorCode.INVALID_BATCH, "too many samples")
    link = FakeLink({1: failed, 2: BatchAccepted(BASE + 2)})
    submitter = Submitter(link)  # type: ignore[arg-type]
    submitter.submit(_request(submitter))
    submitter.submit(_request(submitter))  # no error here: the trainer gets it for its batch
    assert len(link.sent) == 2


def test_a_refused_submission_is_raised_at_the_next_batch() -> None:
    refused = Error(ErrorCode.INVALID_BATCH, f"batch id {BASE + 1} was taken already")
    link = FakeLink({1: refused})
    submitter = Submitter(link)  # type: ignore[arg-type]
    submitter.submit(_request(submitter))
    with pytest.raises(RequestError, match="was taken already"):
        submitter.submit(_request(submitter))
    assert len(link.sent) == 1  # the next was not sent


def test_a_deferred_batch_waits_for_its_answer() -> None:
    refused = Error(ErrorCode.RESOURCE_EXHAUSTED, "256 deferred batches")
    link = FakeLink({1: BatchAccepted(BASE + 1), 2: refused})
    submitter = Submitter(link)  # type: ignore[arg-type]
    submitter.submit(_request(submitter, deferred=True))
    assert link.waited == [1]
    with pytest.raises(RequestError, match="256 deferred"):
        submitter.submit(_request(submitter, deferred=True))
