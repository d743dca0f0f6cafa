"""The client's exceptions: catchable as what DALI's proxy raises in the same situation, and
still dalid's own hierarchy."""

from __future__ import annotations

import pytest

from dalid.client import errors
from dalid.protocol import BadSample, Error, ErrorCode


@pytest.mark.parametrize("code", list(ErrorCode))
def test_every_error_reply_is_a_runtime_error_and_a_dalid_error(code: ErrorCode) -> None:
    # DALI's proxy raises RuntimeError for a pipeline that cannot be built or run: whatever the
    # daemon answers, a loop written for DALI's proxy catches it.
    raised = errors.error_from_reply(Error(code, "the daemon's words"))
    assert isinstance(raised, RuntimeError)
    assert isinstance(raised, errors.DalidError)
    assert "the daemon's words" in str(raised)


def test_the_families_stay_apart() -> None:
    batch = errors.BatchError(ErrorCode.PIPELINE_ERROR, "Critical error in pipeline", 3, 1)
    assert isinstance(batch, errors.RequestError) and isinstance(batch, RuntimeError)
    assert not isinstance(batch, errors.DaemonUnavailable)
    gone = errors.DaemonStopped("stopped")
    assert isinstance(gone, errors.DaemonUnavailable) and isinstance(gone, RuntimeError)
    assert not isinstance(gone, errors.RequestError)
    assert isinstance(errors.DeviceMismatch("no CUDA"), RuntimeError)
    # Bad arguments are ValueErrors, as DALI's proxy raises them, and not RuntimeErrors.
    bad = errors.InputError("too many positional arguments")
    assert isinstance(bad, ValueError) and not isinstance(bad, RuntimeError)


def test_a_batch_error_keeps_dalis_message_and_its_data() -> None:
    bad = (BadSample(1, "Anchor for dimension 1 (-10) is out of range"),)
    error = errors.BatchError(ErrorCode.BAD_SAMPLES, "every sample is bad", 7, 2, bad)
    error.locate(4, [10, 11, 12])
    try:
        raise error
    except RuntimeError as caught:  # as a DALI proxy user catches it
        assert "Anchor for dimension 1 (-10) is out of range" in str(caught)
        assert "loader step 4" in str(caught) and "dataset index 11" in str(caught)
    assert error.positions == [1] and error.batch_id == 7 and error.pipeline_id == 2
