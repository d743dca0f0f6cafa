"""The worker side of a batch: the proxy call, collation and submission to the daemon.

DataLoader workers call the picklable :class:`Proxy` from ``Dataset.__getitem__``: a call adds
one sample to the batch this worker is building and returns references. Collating those
references (torch's default collate does; importing this module registers the rule) ends the
batch and submits it to the daemon through this process's own worker connection, under an id
this process chose, returning once it is sent (Note [Submitting without waiting] in
``submitter.py``); the trainer then turns the batch references into tensors.
"""

from __future__ import annotations

import difflib
import inspect
import threading
from itertools import pairwise
from typing import Any

from torch.utils.data._utils.collate import default_collate_fn_map

from ..errors import DaemonUnavailable, InputError, RequestError
from ..link.link import Link
from ..refs import DALIOutputBatchRef, DALIOutputSampleRef, DALIPipelineRunRef, Resubmission
from .links import left_to_trainer, worker_links
from .samples import as_sample
from .target import ProxyTarget


class Proxy:
    """Callable with DALI's proxy rules: one input positional or keyword, several keyword-only.

    Returns one :class:`DALIOutputSampleRef` per pipeline output (the ref itself when there is
    one output). Picklable: a worker process opens its own connection on first use.
    """

    def __init__(self, target: ProxyTarget) -> None:
        self._target = target
        self._init_local()

    def _init_local(self) -> None:
        kind = (
            inspect.Parameter.POSITIONAL_OR_KEYWORD
            if len(self._target.input_names) == 1
            else inspect.Parameter.KEYWORD_ONLY
        )
        self.__signature__ = inspect.Signature(
            [inspect.Parameter(name, kind) for name in self._target.input_names]
        )
        self._local = threading.local()

    @property
    def target(self) -> ProxyTarget:
        return self._target

    def retarget(self, target: ProxyTarget) -> None:
        """Points this proxy at another registration of the same pipeline (a new job)."""
        if target.input_names != self._target.input_names:
            raise InputError("a proxy can only be pointed at the same pipeline again")
        self._target = target
        self._init_local()

    def __getstate__(self) -> dict[str, Any]:
        return {"target": self._target}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._target = state["target"]
        self._init_local()

    def __repr__(self) -> str:
        names = ", ".join(self._target.input_names)
        return f"<dalid Proxy pipeline={self._target.pipeline_id} inputs=({names})>"

    def _arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The samples by input name, as the signature binds them."""
        names = self._target.input_names
        if len(args) == 1 and not kwargs and len(names) == 1:
            return {names[0]: args[0]}  # the usual call, bound without inspect
        unknown = [name for name in kwargs if name not in names]
        if unknown:
            raise InputError(_unknown_inputs_message(unknown, names)) from None
        try:
            return self.__signature__.bind(*args, **kwargs).arguments
        except TypeError as error:
            if args and len(names) > 1:
                example = ", ".join(f"{name}=..." for name in names)
                # DALI's proxy says "too many positional arguments" here (a ValueError): code
                # that matches its words finds them in ours too.
                raise InputError(
                    f"too many positional arguments: the pipeline has {len(names)} inputs, passed "
                    "by keyword only (as with DALI's proxy), named as its external_source "
                    f"operators: proxy({example})"
                ) from None
            raise InputError(
                f"the pipeline takes {self.__signature__} (its external_source names): {error}"
            ) from None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # Runs once per sample in every DataLoader worker. The common call (one input, one
        # output, one positional sample) takes the fewest steps: each step below is one the
        # batch needs, with no dict of arguments or tuple of references made for it.
        target = self._target
        names = target.input_names
        if len(args) == 1 and not kwargs and len(names) == 1 and target.num_outputs == 1:
            name = names[0]
            array = as_sample(args[0], name)
            run = self._current_run()
            index = self._next_index(run)
            samples = run.call_args.get(name)
            if samples is None:
                run.call_args[name] = [array]
            else:  # empty once every sample before was abandoned (Note [Abandoned samples])
                if samples and samples[0].dtype != array.dtype:
                    raise InputError(_dtype_message(name, index, array, samples[0]))
                samples.append(array)
            ref = DALIOutputSampleRef(self, run, 0, index)
            run.add_one(ref)
            return ref
        if len(args) == 1 and not kwargs and len(names) == 1:
            arrays = {names[0]: as_sample(args[0], names[0])}
            run = self._current_run()
        else:
            arguments = self._arguments(args, kwargs)
            run = self._current_run()
            # Check every input before adding any, so a refused call leaves the batch as it was.
            arrays = {name: as_sample(arguments[name], name) for name in names}
        index = self._next_index(run)
        call_args = run.call_args
        for name, array in arrays.items():
            samples = call_args.get(name)
            if samples and samples[0].dtype != array.dtype:
                raise InputError(_dtype_message(name, index, array, samples[0]))
        for name, array in arrays.items():
            samples = call_args.get(name)
            if samples is None:
                call_args[name] = [array]
            else:
                samples.append(array)
        if target.num_outputs == 1:
            ref = DALIOutputSampleRef(self, run, 0, index)
            run.add_one(ref)
            return ref
        refs = tuple(
            DALIOutputSampleRef(self, run, output, index) for output in range(target.num_outputs)
        )
        run.add_sample(refs)
        return refs

    def _next_index(self, run: DALIPipelineRunRef) -> int:
        """The index the next sample of ``run`` gets; raises when the run is full."""
        index = run.batch_size
        max_batch_size = self._target.max_batch_size
        if index >= max_batch_size:
            run.drop_abandoned()  # Note [Abandoned samples] in refs.py
            index = run.batch_size
            if index >= max_batch_size:
                raise InputError(
                    f"more than {max_batch_size} samples in one batch, the pipeline's "
                    "max_batch_size: make the DataLoader's batch_size at most that"
                )
        return index

    def _current_run(self) -> DALIPipelineRunRef:
        run: DALIPipelineRunRef | None = getattr(self._local, "run", None)
        if run is None or run.is_complete:
            target = self._target
            run = DALIPipelineRunRef(
                target.pipeline_id,
                target.job_id,
                target.deterministic,
                job_token=target.job_token,
                resubmission=Resubmission() if target.reconnect else None,
            )
            self._local.run = run
        return run

    def _submit(self, run: DALIPipelineRunRef) -> None:
        """Sends a collated batch to the daemon; it runs at once unless deterministic.

        With ``reconnect``, a daemon found gone is not an error here: the batch reaches the
        trainer unsent, with its inputs, and the trainer submits it (Note [Daemon restarts]).
        """
        target = self._target
        link: Link | None = None
        accepted_by = ""
        try:
            # This process's link to the job; None while its daemon was found gone lately.
            submitter = worker_links.get(target)
            if submitter is None:
                target.submission(run.call_args, run.deterministic)  # raises what it refuses
            else:
                link = submitter.link
                batch_id = submitter.next_batch_id()
                # Returns once sent (Note [Submitting without waiting] in submitter.py).
                submitter.submit(target.submission(run.call_args, run.deterministic, batch_id))
                run.batch_id = batch_id
                run.is_scheduled = not run.deterministic
                accepted_by = link.welcome.job_token
        except (DaemonUnavailable, RequestError) as error:
            if not left_to_trainer(target, error, link):
                raise
        inputs, run.call_args = run.call_args, {}
        if run.resubmission is not None:
            run.resubmission.accepted(accepted_by, inputs)


def _dtype_message(name: str, index: int, array: Any, first: Any) -> str:
    return (
        f"input {name!r}: sample {index} is {array.dtype}, the batch's first sample is "
        f"{first.dtype}; every sample of an input needs one dtype"
    )


def _unknown_inputs_message(unknown: list[str], names: tuple[str, ...]) -> str:
    """What a call with keywords the pipeline has no input for says: each wrong keyword, the
    input it was likely meant as, and the inputs the pipeline takes."""
    wrong = []
    for name in unknown:
        close = difflib.get_close_matches(name, names, n=1)
        wrong.append(f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    takes = ", ".join(repr(name) for name in names)
    return (
        f"the pipeline has no input named {' or '.join(wrong)}: its inputs, the names of its "
        f"external_source operators, are {takes}"
    )


def collate_sample_refs(
    samples: list[DALIOutputSampleRef], *, collate_fn_map: Any = None
) -> DALIOutputBatchRef:
    """Collate rule: the sample refs of one output become a batch ref; the first submits."""
    if not samples:
        raise ValueError("cannot collate an empty batch of dalid sample references")
    first = samples[0]
    run = first.pipe_run_ref
    output_idx = first.output_idx
    # The usual batch: every sample of the run, in order, in one pass; anything else is looked
    # at below to say what is wrong with it, or to keep only the samples it has.
    in_order = len(samples) == run.batch_size
    for position, sample in enumerate(samples):
        if sample.pipe_run_ref is not run or sample.output_idx != output_idx:
            raise RuntimeError(
                "all samples of a batch must come from one proxy run: a batch mixes samples "
                "of several pipelines or workers"
            )
        if sample.sample_idx != position:
            in_order = False
    first_output = not run.is_complete
    if in_order:
        run.is_complete = True
        if first_output:
            first.proxy._submit(run)
        return DALIOutputBatchRef(run, output_idx)
    indices = [sample.sample_idx for sample in samples]
    # Whatever happens below, this worker's next proxy call starts a new batch.
    run.is_complete = True
    if first_output:
        for earlier, later in pairwise(indices):
            if later <= earlier:
                raise RuntimeError(
                    f"unexpected sample order: sample {later} after sample {earlier} (was the "
                    "batch shuffled after the proxy call?)"
                )
        if indices[-1] >= run.batch_size:
            raise RuntimeError(
                f"sample {indices[-1]} is not in its batch any more: a copy of a dalid "
                "reference outlived the one the proxy returned"
            )
        if indices != list(range(run.batch_size)):
            run.keep_samples(indices)  # Note [Abandoned samples] in refs.py
        first.proxy._submit(run)
    elif indices != list(range(run.batch_size)):
        raise RuntimeError(
            f"output {first.output_idx} of the batch has samples {indices}, but its other "
            f"outputs had {run.batch_size} samples in order: every output of a sample must "
            "stay in the batch"
        )
    return DALIOutputBatchRef(run, first.output_idx)


default_collate_fn_map[DALIOutputSampleRef] = collate_sample_refs
