"""What a failed batch's error says: the batch as the user knows it (loader step, dataset
indices) and as the daemon's log names it (pipeline, batch id)."""

from __future__ import annotations

from dalid.client.errors import BatchError
from dalid.protocol import ErrorCode


def test_a_failed_batch_is_named_by_loader_step_and_dataset_indices_where_known() -> None:
    error = BatchError(ErrorCode.PIPELINE_ERROR, "DALI says: no", batch_id=77, pipeline_id=3)
    # DALI's proxy raises DALI's own error, which starts with these words; dalid's account follows.
    assert str(error) == "Critical error in pipeline: pipeline 3 batch 77 failed: DALI says: no"
    error.locate(4, [40, 41, 42])
    assert str(error) == (
        "Critical error in pipeline: loader step 4 (pipeline 3 batch 77 in the daemon's log), "
        "dataset indices 40, 41, 42, failed: DALI says: no"
    )
    error.locate(5, list(range(100, 132)))
    assert "dataset indices 100, 101, 102, 103, 104, 105, 106, 107, ... (32 samples)," in str(error)
