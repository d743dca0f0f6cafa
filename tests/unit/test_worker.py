"""The proxy's call rules, without a daemon (nothing here submits a batch)."""

from __future__ import annotations

import copy
import inspect
import pickle
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from dalid.client.errors import InputError
from dalid.client.refs import (
    DALIOutputBatchRef,
    DALIOutputSampleRef,
    DALIPipelineRunRef,
    Resubmission,
)
from dalid.client.worker.target import ProxyTarget
from dalid.client.worker.worker import Proxy, collate_sample_refs


def _target(
    input_names: tuple[str, ...] = ("images",),
    num_outputs: int = 1,
    max_batch_size: int = 4,
    deterministic: bool = False,
) -> ProxyTarget:
    return ProxyTarget(
        socket=Path("/nonexistent/dalid-unit-test.sock"),
        device="cpu",
        job_id=3,
        job_token="secret-token",
        pipeline_id=5,
        input_names=input_names,
        num_outputs=num_outputs,
        max_batch_size=max_batch_size,
        deterministic=deterministic,
    )


def _proxy(**kwargs: Any) -> Proxy:
    proxy = Proxy(_target(**kwargs))

    def no_submit(run: DALIPipelineRunRef) -> None:
        raise AssertionError("a unit test must not submit a batch")

    proxy._submit = no_submit  # type: ignore[method-assign]
    return proxy


def _sample(value: int = 0) -> np.ndarray:
    return np.full((2, 2), value, dtype=np.uint8)


# --- Call rules ---------------------------------------------------------------------------------


def test_one_input_positional_or_keyword() -> None:
    proxy = _proxy()
    by_position = proxy(_sample(1))
    by_keyword = proxy(images=_sample(2))
    assert isinstance(by_position, DALIOutputSampleRef)
    assert isinstance(by_keyword, DALIOutputSampleRef)
    run = by_position.pipe_run_ref
    assert by_keyword.pipe_run_ref is run
    assert run.batch_size == 2
    assert [sample[0, 0] for sample in run.call_args["images"]] == [1, 2]
    assert (run.pipeline_id, run.job_id, run.deterministic) == (5, 3, False)
    assert run.batch_id is None


def test_several_inputs_are_keyword_only() -> None:
    proxy = _proxy(input_names=("images", "labels"))
    with pytest.raises(InputError) as caught:
        proxy(_sample(), np.int32(1))
    assert "images" in str(caught.value)
    assert "labels" in str(caught.value)
    with pytest.raises(InputError, match="images"):
        proxy(_sample(), labels=np.int32(1))
    ref = proxy(images=_sample(), labels=np.int32(1))
    assert isinstance(ref, DALIOutputSampleRef)
    assert ref.sample_idx == 0  # the failed calls added nothing


def test_unknown_keyword() -> None:
    proxy = _proxy()
    with pytest.raises(InputError, match="colour"):
        proxy(_sample(), colour=_sample())
    with pytest.raises(InputError, match="images"):  # the message shows what the pipeline takes
        proxy(colour=_sample())
    with pytest.raises(InputError, match="colour"):
        _proxy(input_names=("a", "b"))(a=_sample(), b=_sample(), colour=_sample())


def test_a_misspelled_input_is_named_with_the_input_it_was_meant_as() -> None:
    with pytest.raises(InputError) as caught:
        _proxy()(image=_sample())
    assert str(caught.value) == (
        "the pipeline has no input named 'image' (did you mean 'images'?): its inputs, the names "
        "of its external_source operators, are 'images'"
    )
    with pytest.raises(InputError) as caught:
        _proxy(input_names=("images", "labels"))(images=_sample(), lables=np.int32(1))
    assert "'lables' (did you mean 'labels'?)" in str(caught.value)
    assert "are 'images', 'labels'" in str(caught.value)


def test_missing_input() -> None:
    proxy = _proxy(input_names=("images", "labels"))
    with pytest.raises(InputError, match="labels"):
        proxy(images=_sample())
    with pytest.raises(InputError):
        _proxy()()


def test_too_many_positional_arguments() -> None:
    with pytest.raises(InputError):
        _proxy()(_sample(), _sample())


def test_signature_names_the_inputs() -> None:
    single = inspect.signature(_proxy())
    assert list(single.parameters) == ["images"]
    assert single.parameters["images"].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD
    several = inspect.signature(_proxy(input_names=("a", "b", "c")))
    assert list(several.parameters) == ["a", "b", "c"]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in several.parameters.values())


def test_one_output_returns_a_single_ref() -> None:
    ref = _proxy(num_outputs=1)(_sample())
    assert isinstance(ref, DALIOutputSampleRef)
    assert ref.output_idx == 0
    assert ref.sample_idx == 0


def test_several_outputs_return_a_tuple() -> None:
    proxy = _proxy(num_outputs=3)
    refs = proxy(_sample())
    assert isinstance(refs, tuple)
    assert len(refs) == 3
    assert [ref.output_idx for ref in refs] == [0, 1, 2]
    assert all(ref.sample_idx == 0 for ref in refs)
    assert all(ref.pipe_run_ref is refs[0].pipe_run_ref for ref in refs)
    assert all(ref.proxy is proxy for ref in refs)


def test_sample_index_increments() -> None:
    proxy = _proxy(num_outputs=2, max_batch_size=8)
    indices = [proxy(_sample(i))[0].sample_idx for i in range(5)]
    assert indices == [0, 1, 2, 3, 4]
    run = proxy(_sample())[1].pipe_run_ref
    assert run.batch_size == 6
    assert len(run.call_args["images"]) == 6


def test_a_completed_run_starts_a_new_batch() -> None:
    proxy = _proxy()
    first = proxy(_sample())
    first.pipe_run_ref.is_complete = True  # what collation does
    second = proxy(_sample())
    assert second.pipe_run_ref is not first.pipe_run_ref
    assert second.sample_idx == 0


def test_each_thread_builds_its_own_batch() -> None:
    proxy = _proxy()
    mine = proxy(_sample())
    theirs: list[Any] = []
    thread = threading.Thread(target=lambda: theirs.append(proxy(_sample())))
    thread.start()
    thread.join(10)
    assert theirs[0].pipe_run_ref is not mine.pipe_run_ref
    assert theirs[0].sample_idx == 0


def test_more_samples_than_max_batch_size() -> None:
    proxy = _proxy(max_batch_size=3)
    held = [proxy(_sample()) for _ in range(3)]  # what a DataLoader holds until collation
    with pytest.raises(InputError, match="max_batch_size"):
        proxy(_sample())
    run = _run_of_current(proxy)
    assert run.batch_size == 3
    assert len(run.call_args["images"]) == 3
    assert [ref.sample_idx for ref in held] == [0, 1, 2]


def _run_of_current(proxy: Proxy) -> DALIPipelineRunRef:
    run = proxy._local.run
    assert isinstance(run, DALIPipelineRunRef)
    return run


# --- Samples ------------------------------------------------------------------------------------


def test_dtype_mismatch_within_a_batch() -> None:
    proxy = _proxy()
    proxy(np.zeros(3, dtype=np.uint8))
    with pytest.raises(InputError, match="float32") as caught:
        proxy(np.zeros(3, dtype=np.float32))
    assert "uint8" in str(caught.value)
    assert "images" in str(caught.value)
    run = _run_of_current(proxy)
    assert run.batch_size == 1
    assert len(run.call_args["images"]) == 1
    proxy(np.ones(5, dtype=np.uint8))  # shapes may differ, dtypes may not
    assert run.batch_size == 2


def test_str_sample_is_refused_with_a_hint() -> None:
    with pytest.raises(InputError, match=r"np\.frombuffer") as caught:
        _proxy()("/data/image.jpg")
    assert "str" in str(caught.value)


@pytest.mark.parametrize(
    "value",
    [[1, 2, 3], {"a": 1}, object(), None, np.zeros(2, dtype=np.complex64), np.array(["a"])],
    ids=["list", "dict", "object", "None", "complex64", "unicode-array"],
)
def test_unsupported_samples_are_refused(value: Any) -> None:
    with pytest.raises(InputError, match="images"):
        _proxy()(value)


def test_torch_cpu_tensor_is_accepted() -> None:
    proxy = _proxy()
    tensor = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    proxy(tensor)
    proxy(tensor.t())  # non-contiguous
    proxy(torch.ones(2, requires_grad=True))
    samples = _run_of_current(proxy).call_args["images"]
    assert all(isinstance(sample, np.ndarray) for sample in samples)
    assert all(sample.dtype == np.float32 for sample in samples)
    np.testing.assert_array_equal(samples[0], tensor.numpy())
    np.testing.assert_array_equal(samples[1], tensor.t().numpy())
    assert samples[1].flags.c_contiguous


def test_tensor_off_the_cpu_is_refused() -> None:
    # The meta device stands in for CUDA here: any non-CPU tensor must be moved first.
    with pytest.raises(InputError, match="moved to the CPU"):
        _proxy()(torch.zeros(2, device="meta"))


def test_bytes_are_accepted_as_uint8() -> None:
    proxy = _proxy()
    proxy(b"\x01\x02\x03")
    proxy(bytearray(b"\x04"))
    proxy(memoryview(b"\x05\x06"))
    samples = _run_of_current(proxy).call_args["images"]
    assert [sample.dtype for sample in samples] == [np.uint8] * 3
    assert [sample.tolist() for sample in samples] == [[1, 2, 3], [4], [5, 6]]


def test_numbers_are_accepted() -> None:
    proxy = _proxy(input_names=("a", "b", "c", "d"), max_batch_size=8)
    proxy(a=np.int32(3), b=2.5, c=True, d=7)
    args = _run_of_current(proxy).call_args
    assert args["a"][0].dtype == np.int32
    assert args["b"][0].dtype == np.float64
    assert args["c"][0].dtype == np.bool_
    assert args["d"][0].dtype == np.int64
    assert [args[name][0].item() for name in "abcd"] == [3, 2.5, True, 7]


@pytest.mark.parametrize(
    "value", [np.int32(3), 2.5, True, 7, np.asarray(4, dtype=np.int64)], ids=repr
)
def test_scalar_samples_keep_their_shape(value: Any) -> None:
    proxy = _proxy()
    proxy(value)
    (sample,) = _run_of_current(proxy).call_args["images"]
    assert sample.shape == ()
    assert sample.ndim == 0


def test_non_contiguous_arrays_are_made_contiguous() -> None:
    proxy = _proxy()
    array = np.arange(12, dtype=np.int16).reshape(3, 4)[:, ::2]
    proxy(array)
    (sample,) = _run_of_current(proxy).call_args["images"]
    assert sample.flags.c_contiguous
    np.testing.assert_array_equal(sample, array)


def test_a_refused_call_leaves_the_batch_unchanged() -> None:
    proxy = _proxy(input_names=("images", "labels"), max_batch_size=8)
    proxy(images=_sample(), labels=np.int32(0))
    with pytest.raises(InputError):
        proxy(images=_sample(), labels="not a label")
    with pytest.raises(InputError):
        proxy(images=_sample(), labels=np.float64(1.0))  # dtype mismatch in the second input
    proxy(images=_sample(), labels=np.int32(1))
    args = _run_of_current(proxy).call_args
    assert _run_of_current(proxy).batch_size == 2
    assert len(args["images"]) == len(args["labels"]) == 2


# --- Abandoned samples (Note [Abandoned samples]) -----------------------------------------------


def _recording_proxy(**kwargs: Any) -> tuple[Proxy, list[DALIPipelineRunRef]]:
    proxy = Proxy(_target(**kwargs))
    submitted: list[DALIPipelineRunRef] = []
    proxy._submit = submitted.append  # type: ignore[method-assign,assignment]
    return proxy, submitted


def _values(run: DALIPipelineRunRef) -> list[int]:
    return [int(sample[0, 0]) for sample in run.call_args["images"]]


def test_a_full_batch_drops_the_samples_whose_getitem_raised() -> None:
    proxy, submitted = _recording_proxy(max_batch_size=3)
    proxy(_sample(99))  # its __getitem__ raised after the call: nothing holds the ref
    batch = [proxy(_sample(value)) for value in (1, 2)]
    batch.append(proxy(_sample(3)))  # the run was full; the abandoned sample made room
    assert [ref.sample_idx for ref in batch] == [0, 1, 2]
    collate_sample_refs(batch)
    assert len(submitted) == 1
    assert _values(submitted[0]) == [1, 2, 3]


def test_a_full_batch_of_abandoned_samples_starts_again_from_its_next_sample() -> None:
    proxy, submitted = _recording_proxy(max_batch_size=2)
    proxy(_sample(98))  # both __getitem__ raised after their calls: no ref is held
    proxy(_sample(99))
    ref = proxy(_sample(1))  # the full run drops both, and this sample is its first
    assert ref.sample_idx == 0
    collate_sample_refs([ref])
    assert _values(submitted[0]) == [1]


def test_a_batch_that_is_not_full_keeps_only_the_samples_collated() -> None:
    proxy, submitted = _recording_proxy(num_outputs=2, max_batch_size=8)
    first = proxy(_sample(1))
    proxy(_sample(99))  # abandoned, or filtered out by a collate_fn
    last = proxy(_sample(3))
    images = collate_sample_refs([first[0], last[0]])
    labels = collate_sample_refs([first[1], last[1]])  # the second output agrees
    assert images.pipe_run_ref is labels.pipe_run_ref is submitted[0]
    assert _values(submitted[0]) == [1, 3]
    assert submitted[0].batch_size == 2
    assert [first[1].sample_idx, last[1].sample_idx] == [0, 1]


def test_outputs_that_disagree_on_the_samples_are_refused() -> None:
    proxy, _ = _recording_proxy(num_outputs=2, max_batch_size=8)
    refs = [proxy(_sample(value)) for value in range(3)]
    collate_sample_refs([ref[0] for ref in refs])
    with pytest.raises(RuntimeError, match="every output of a sample"):
        collate_sample_refs([refs[0][1], refs[2][1]])


def test_a_shuffled_batch_is_refused_and_the_next_batch_starts_afresh() -> None:
    proxy, submitted = _recording_proxy(max_batch_size=4)
    refs = [proxy(_sample(value)) for value in range(3)]
    with pytest.raises(RuntimeError, match="shuffled"):
        collate_sample_refs([refs[1], refs[0], refs[2]])
    assert not submitted
    fresh = [proxy(_sample(value)) for value in (7, 8, 9, 10)]
    assert [ref.sample_idx for ref in fresh] == [0, 1, 2, 3]
    collate_sample_refs(fresh)
    assert _values(submitted[0]) == [7, 8, 9, 10]


def test_a_copied_sample_keeps_its_place_in_the_batch() -> None:
    proxy, submitted = _recording_proxy(max_batch_size=3)
    first = copy.deepcopy({"image": proxy(_sample(1)), "label": 1})["image"]
    second = copy.copy(proxy(_sample(2)))
    third = proxy(_sample(3))
    assert [first.sample_idx, second.sample_idx, third.sample_idx] == [0, 1, 2]
    collate_sample_refs([first, second, third])
    assert _values(submitted[0]) == [1, 2, 3]


def test_a_run_pickles_without_its_sample_references() -> None:
    proxy, _ = _recording_proxy()
    ref = proxy(_sample())
    copy = pickle.loads(pickle.dumps(ref.pipe_run_ref))
    assert copy.batch_size == 1
    assert copy._sample_refs == []


def test_a_batch_reaches_the_trainer_as_one_run_with_every_field() -> None:
    run = DALIPipelineRunRef(5, 3, False, job_token="secret-token")
    run.batch_id, run.batch_size, run.is_scheduled, run.is_complete = 77, 32, True, True
    run.call_args = {"images": [_sample(1)]}
    batch = [DALIOutputBatchRef(run, 0), DALIOutputBatchRef(run, 1), torch.arange(3)]
    images, labels, values = pickle.loads(pickle.dumps(batch))
    copied = images.pipe_run_ref
    assert labels.pipe_run_ref is copied  # one run for every output of the batch
    assert (images.output_idx, labels.output_idx) == (0, 1)
    assert {name: getattr(copied, name) for name in ["pipeline_id", "job_id", "job_token",
            "deterministic", "batch_id", "batch_size", "is_scheduled", "is_complete"]} == {
        "pipeline_id": 5, "job_id": 3, "job_token": "secret-token", "deterministic": False,
        "batch_id": 77, "batch_size": 32, "is_scheduled": True, "is_complete": True,
    }  # fmt: skip
    # The inputs stay in the worker, unless the trainer may have to submit them again.
    assert copied.call_args == {} and copied.resubmission is None
    run.resubmission = Resubmission("token", {"images": [_sample(4)]})
    again = pickle.loads(pickle.dumps(DALIOutputBatchRef(run, 0))).pipe_run_ref
    assert again.resubmission.accepted_by == "token"
    assert again.call_args["images"][0][0, 0] == 1
    assert values.tolist() == [0, 1, 2]


# --- Pickling -----------------------------------------------------------------------------------


def test_proxy_pickles_without_per_process_state() -> None:
    proxy = _proxy(input_names=("images", "labels"), num_outputs=2, deterministic=True)
    proxy(images=_sample(), labels=np.int32(1))  # a batch in progress in this process
    copy = pickle.loads(pickle.dumps(proxy))
    assert isinstance(copy, Proxy)
    assert copy.target == proxy.target
    assert inspect.signature(copy) == inspect.signature(proxy)
    assert getattr(copy._local, "run", None) is None
    assert "_submit" not in vars(copy)  # nothing of this test's instance travelled
    refs = copy(images=_sample(), labels=np.int32(2))
    assert refs[0].sample_idx == 0  # the copy starts its own batch
    assert refs[0].pipe_run_ref.deterministic is True
    assert refs[0].pipe_run_ref is not _run_of_current(proxy)


def test_pickled_state_is_only_the_target() -> None:
    proxy = _proxy()
    proxy(_sample())
    assert proxy.__getstate__() == {"target": proxy.target}
    payload = pickle.dumps(proxy)
    assert b"secret-token" in payload  # a worker needs the job token to join the job
    assert len(payload) < 2000  # no samples in it


def test_proxy_target_pickles() -> None:
    target = _target()
    assert pickle.loads(pickle.dumps(target)) == target


def test_repr_names_pipeline_and_inputs() -> None:
    text = repr(_proxy(input_names=("images", "labels")))
    assert "pipeline=5" in text
    assert "images, labels" in text
