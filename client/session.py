"""A training job's session with a daemon: register pipelines, receive outputs as tensors.

The trainer's side of a batch: :meth:`Session.produce_data` finds the batch references in what
the DataLoader yields, submits again what a restarted daemon lost (:mod:`dalid.client.reconnect`),
schedules deferred batches, waits for each result and has the output backends turn its regions
into tensors (:mod:`dalid.client.outputs`: views of the daemon's memory, or for staged GPU
outputs copies on this process's GPU); the regions of tensors that died go back to the daemon
while the session waits.

Why one module of some 500 lines: it is the one class a trainer holds, and its registration
options (``deterministic``, ``share_runs``, ``on_error``) read best beside the waits they shape.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import weakref
from collections.abc import Iterable
from typing import Any

import torch

from dalid.protocol import (
    BATCH_IDS_PER_CONNECTION,
    BatchFailed,
    BatchReady,
    Device,
    Envelope,
    ErrorCode,
    Limits,
    ReleaseRegions,
    ScheduleBatch,
    TrainerProgress,
    WantBatch,
    parse_device,
    socket_path,
)

from .badsamples import SampleReport, follow_bad_samples, locate
from .errors import BatchError, InputError
from .link.launcher import JobRequest, trainer_dial
from .options import check_job_options
from .pipelines import registration_request
from .reconnect.generation import Generation
from .reconnect.reconnector import Reconnector
from .refs import DALIPipelineRunRef
from .structure import replace_refs
from .worker.worker import Proxy

log = logging.getLogger("dalid.client")

# How often the trainer tells the daemon how long it has waited for batches (for `dalid status`):
# after its first wait, with the next batch, then every 5 s at most, in the release it sends then
# where there is one (to a daemon that says it reads it there). Each second, and each its own
# message, it was with eight jobs most of the messages the daemon's I/O thread took besides the
# batches' own.
PROGRESS_INTERVAL_S = 5.0
# A wait this long is reported while it lasts; a shorter one with the next batch. With eight jobs
# on a loaded CPU daemon, waits of several seconds were common, and a report from each during
# them was a message of its own.
LONG_WAIT_REPORTED_S = 30.0
# How many batches let go of (their workers left) a session remembers, to answer a late ask.
MAX_DROPPED = 4096

# A batch this late usually means the daemon's output pool is full of buffers the trainer still
# holds through live tensors; say so once.
SLOW_BATCH_WARNING_S = 30.0


class _Progress:
    """How long the trainer has waited for batches, reported to the daemon now and then."""

    def __init__(self) -> None:
        self.waited = 0.0
        self.batches = 0
        self.reported_at = 0.0

    def due(self, waiting_for: float = 0.0) -> TrainerProgress | None:
        """The report to send now, if there is something to tell (the daemon starts from no
        wait) and the last one is old enough (taken as sent); ``waiting_for``: the wait so far."""
        now = time.monotonic()
        if now - self.reported_at < PROGRESS_INTERVAL_S or not self.waited + waiting_for:
            return None
        self.reported_at = now
        return TrainerProgress(self.waited + waiting_for, self.batches)

    def during_wait(self, waiting_for: float) -> TrainerProgress | None:
        """The report to send while a wait of ``waiting_for`` lasts: none until it is long, so
        that `dalid status` shows a trainer stuck waiting; a shorter wait's goes with the next
        batch's releases."""
        return self.due(waiting_for) if waiting_for >= LONG_WAIT_REPORTED_S else None


class Session:
    """A job connected to the daemon for one device. Use as a context manager or ``close()``.

    CPU outputs arrive as CPU tensors that view the daemon's shared memory. GPU outputs (from a
    daemon started with ``--device N``) arrive as CUDA tensors that view the daemon's device
    memory, on this process's device with the daemon GPU's UUID, ready in the order of the
    stream that was current when they were produced (it waits on the daemon, the host does
    not). Each region goes back to the daemon when the last tensor viewing it is
    garbage-collected; a GPU region once the work queued on that stream until then has run.
    Where this process cannot open the daemon's GPU memory (CUDA IPC: another PID namespace, a
    MIG instance, a GPU it does not see), GPU outputs are staged in shared memory instead and
    arrive as copies on this process's GPU, made on the current stream; their regions go back
    once the copies have completed. The rules both sides keep are protocol/SPEC.md, "Outputs".

    With ``reconnect``, a daemon that is killed or restarted does not end the job: the session
    connects to the daemon that comes back on the socket (waiting up to ``connect_timeout``),
    registers its pipelines again and submits again every batch not yet delivered, so none is
    lost or delivered twice (Note [Daemon restarts]). Batches then carry their inputs from the
    DataLoader workers to the trainer, a copy that costs little beside decoding them.
    """

    def __init__(
        self,
        device: Device = "cpu",
        socket: str | os.PathLike[str] | None = None,
        autostart: bool = True,
        name: str | None = None,
        connect_timeout: float = 60.0,
        *,
        weight: float = 1.0,
        memory_bytes: int | None = None,
        max_inflight_batches: int | None = None,
        reconnect: bool = False,
        cohort: str = "",
    ) -> None:
        # The cohort the session's pipelines join unless a registration names another.
        self.cohort = cohort
        check_job_options(
            name=name,
            weight=weight,
            memory_bytes=memory_bytes,
            max_inflight_batches=max_inflight_batches,
            reconnect=reconnect,
        )
        try:
            self.device = parse_device(device)
        except ValueError as error:
            raise InputError(str(error)) from None
        self.socket = socket_path(self.device, socket)
        self.reconnect = reconnect
        self._progress = _Progress()
        # Bad samples skipped or replaced in the batches of the last produce_data call.
        self.last_bad_samples: list[SampleReport] = []
        self._daemon = Reconnector(
            trainer_dial(
                self.socket,
                self.device,
                autostart=autostart,
                name=name or f"pid {os.getpid()}",
                job=JobRequest(weight, memory_bytes or 0, max_inflight_batches or 0),
            ),
            socket=self.socket,
            device=self.device,
            enabled=reconnect,
            connect_timeout=connect_timeout,
        )
        # Closes the job at GC if the session is not closed before: it must not hold the session.
        self._finalizer = weakref.finalize(self, self._daemon.close)

    # --- properties -----------------------------------------------------------------------------

    @property
    def job_id(self) -> int:
        return self._daemon.welcome.job_id

    @property
    def daemon_pid(self) -> int:
        return self._daemon.welcome.daemon_pid

    @property
    def limits(self) -> Limits:
        return self._daemon.welcome.limits

    @property
    def closed(self) -> bool:
        return self._daemon.closed

    @property
    def reconnects(self) -> int:
        """How many times this session reconnected to a new daemon."""
        return self._daemon.reconnects

    @property
    def submitted_by_trainer(self) -> int:
        """Batches of DataLoader workers that this session submitted itself, from the inputs
        their refs carry: those of a daemon that died, and those a worker could not send."""
        return self._daemon.submitted_by_trainer

    @property
    def slabs_opened(self) -> int:
        """How many slabs this session has mapped, CPU and GPU (each is mapped once)."""
        return self._daemon.generation.outputs.opened

    @property
    def events_opened(self) -> int:
        """How many of the daemon's batch events this session has opened (each once)."""
        return self._daemon.generation.outputs.events_opened

    @property
    def live_regions(self) -> int:
        """Output regions that tensors still view, CPU and GPU."""
        return self._daemon.generation.outputs.live_regions

    # --- API ------------------------------------------------------------------------------------

    def proxy(
        self,
        pipeline: Any,
        deterministic: bool = False,
        on_error: str = "raise",
        *,
        share_runs: bool = True,
        proxy: Proxy | None = None,
        cohort: str | None = None,
    ) -> Proxy:
        """Registers ``pipeline`` with the daemon and returns its picklable proxy callable.

        ``pipeline`` is a DALI pipeline, or a pipeline of the daemon's repository: a
        :class:`RepositoryPipeline` (``named_pipeline(name, batch_size=..., **parameters)``),
        or just its name. With ``deterministic`` a batch runs only when the trainer asks for
        its outputs, in the order the trainer asks, so random operators repeat run to run.

        ``on_error`` says what happens to a batch with bad samples (corrupt or unsupported
        data, or images over the daemon's ``--max-image-pixels``): ``"raise"`` raises
        :class:`BatchError` naming them; ``"skip"`` delivers the batch without them, and
        without their rows of every other per-sample field; ``"replace"`` delivers it with each
        replaced by a good sample of the batch. Skipped and replaced samples are logged and
        listed in :attr:`last_bad_samples`; the other per-sample fields of the batch (labels)
        follow, see :meth:`produce_data`.

        ``share_runs``: whether the daemon may run this job's batches in one DALI run with
        other jobs' batches of the same pipeline (they then share one pipeline in the daemon).
        A job alone always gets runs that are exactly its batches; in a shared run, a few
        operators give a sample a value that depends on its place in the run (see
        docs/migration.md, "Shared runs"). ``False``: a pipeline of its own, built as
        registered, whose runs are this job's batches.

        ``proxy``: a proxy made for the same pipeline earlier (by a session since closed), to
        point at this registration instead of making a new one; it is the one returned.

        ``cohort`` (None: the session's, see :func:`dalid.client.connect`): a name shared by
        jobs that read the same data through the same pipeline, such as the runs of a
        hyper-parameter sweep. Batches of the same inputs that members submit run once, and
        every member gets the same outputs, random augmentation included (README, "Cohorts").
        Every member must register the same pipeline; another is refused naming the cohort.
        """
        registration = self._daemon.register(
            registration_request(
                pipeline,
                on_error,
                deterministic=deterministic,
                share_runs=share_runs,
                cohort=self.cohort if cohort is None else cohort,
            ),
            deterministic,
        )
        target = self._daemon.target_of(registration)
        if proxy is None:
            proxy = Proxy(target)
        else:
            proxy.retarget(target)
        # The proxies of a registration are pointed at the pipeline again after a reconnection.
        registration.proxies.add(proxy)
        return proxy

    def produce_data(self, obj: Any) -> Any:
        """``obj`` with every batch reference replaced by its tensor (nested structures too).

        Where bad samples were skipped or replaced (``on_error``), every other per-sample field
        of ``obj`` gets the same treatment (see :func:`follow_bad_samples`), so labels stay aligned
        with outputs: a skipped sample's label is dropped, a replaced one's is the label of the
        sample that replaced it.
        """
        return self.produce(obj)

    def produce(
        self, obj: Any, *, step: int | None = None, indices: list[int] | None = None
    ) -> Any:
        """:meth:`produce_data` for dalid's DataLoader, which names the batch's ``step`` (as
        ``enumerate(loader)`` counts) and the dataset ``indices`` of its samples: bad samples
        and batch errors are then told by those, not by the daemon's batch ids."""
        reports: list[SampleReport] = []
        self.last_bad_samples = []
        resolved: list[tuple[DALIPipelineRunRef, tuple[torch.Tensor, ...]]] = []

        def resolve(runs: list[DALIPipelineRunRef]) -> dict[int, tuple[torch.Tensor, ...]]:
            produced = self._outputs_of(runs, reports)
            resolved.extend((run, produced[id(run)]) for run in runs)
            return produced

        try:
            produced = follow_bad_samples(replace_refs(obj, resolve), resolved, reports)
        except BatchError as error:
            if step is not None or indices is not None:
                error.locate(step, indices)
            raise
        self.last_bad_samples = locate(reports, step, indices)
        for report in self.last_bad_samples:
            log.warning("%s", report)
        return produced

    def outputs(self, run: DALIPipelineRunRef) -> tuple[torch.Tensor, ...]:
        """The outputs of one batch, waiting for them (and scheduling it if deferred)."""
        reports: list[SampleReport] = []
        outputs = self._outputs_of([run], reports)[id(run)]
        for report in reports:
            log.warning("%s", report)
        return outputs

    def close(self) -> None:
        """Ends the job: the daemon frees its pipelines; live tensors stay valid. Idempotent."""
        if not self._daemon.closed:
            self._flush_releases()
        self._finalizer()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"job {self.job_id}"
        return f"<dalid Session {self.socket} {state}>"

    # --- the trainer's side of a batch ----------------------------------------------------------

    def _outputs_of(
        self, runs: Iterable[DALIPipelineRunRef], reports: list[SampleReport]
    ) -> dict[int, tuple[torch.Tensor, ...]]:
        """Tensors for each run (keyed by ``id(run)``), in the order the runs are given; the
        bad samples they were delivered without, or with replaced, go to ``reports``."""
        runs = list(runs)
        for run in runs:
            self._daemon.check(run)
        start = len(reports)

        def attempt() -> dict[int, tuple[torch.Tensor, ...]]:
            del reports[start:]  # an attempt cut short by a reconnection reports nothing
            return self._deliver(runs, reports)

        produced: dict[int, tuple[torch.Tensor, ...]] = self._daemon.call(attempt)
        for run in runs:
            self._daemon.delivered(run)
        return produced

    def _deliver(
        self, runs: list[DALIPipelineRunRef], reports: list[SampleReport]
    ) -> dict[int, tuple[torch.Tensor, ...]]:
        for run in runs:
            self._daemon.submit_if_lost(run)
        link = self._daemon.link
        for run in runs:
            if not run.is_scheduled:
                link.request(ScheduleBatch(run.batch_id))  # type: ignore[arg-type]
                run.is_scheduled = True
        produced: dict[int, tuple[torch.Tensor, ...]] = {}
        for run in runs:
            result = self._wait(run.batch_id)  # type: ignore[arg-type]
            if isinstance(result, BatchFailed) and self._daemon.resubmit_refused(run, result):
                result = self._wait(run.batch_id)  # type: ignore[arg-type]
            if isinstance(result, BatchFailed):
                raise BatchError(
                    result.code,
                    result.message,
                    result.batch_id,
                    result.pipeline_id,
                    result.bad_samples,
                )
            produced[id(run)] = self._tensors(result)
            reports.extend(
                SampleReport(
                    result.batch_id,
                    result.pipeline_id,
                    bad.position,
                    bad.message,
                    None if bad.replaced_by < 0 else bad.replaced_by,
                )
                for bad in result.bad_samples
            )
        return produced

    def _tensors(self, result: BatchReady) -> tuple[torch.Tensor, ...]:
        outputs = self._daemon.generation.outputs
        outputs.retire(result.retired_slabs)
        try:
            return outputs.tensors(result)
        except FileNotFoundError as error:
            # Only a daemon that died, its memory removed by its successor, loses a slab it has
            # just named (protocol/SPEC.md, "Outputs", rule 6).
            raise self._daemon.link.gone_error(
                f"its output memory {error.filename} was removed"
            ) from None

    def _wait(self, batch_id: int) -> BatchReady | BatchFailed:
        progress = self._progress
        progress.batches += 1
        generation = self._daemon.generation
        link = self._daemon.link
        if generation.senders_left:
            self._drop_abandoned(generation, batch_id)
        # The regions of tensors that died go back before each batch, not only while waiting:
        # the daemon holds a few batches of the job at once, released ones included.
        result = generation.results.pop(batch_id, None)
        if result is not None:
            self._flush_releases(progress=progress.due())
            return result
        pipeline_id = generation.dropped.get(batch_id)
        if pipeline_id is not None:
            self._flush_releases()
            return BatchFailed(
                batch_id,
                pipeline_id,
                ErrorCode.UNKNOWN_BATCH,
                f"batch {batch_id} was let go of: the DataLoader worker that sent it left before "
                "the trainer asked for it (its iterator was dropped, or the worker died)",
            )
        # The daemon runs it before the job's other batches (SPEC.md, "Batches in flight").
        self._flush_releases(want=batch_id, progress=progress.due())

        def is_result(envelope: Envelope) -> bool:
            message = envelope.message
            return isinstance(message, BatchReady | BatchFailed) and message.batch_id == batch_id

        started = time.monotonic()
        warned = False

        def idle() -> None:
            nonlocal warned
            self._flush_releases(progress=progress.during_wait(time.monotonic() - started))
            if not warned and time.monotonic() - started > SLOW_BATCH_WARNING_S:
                warned = True
                log.warning(
                    "batch %d has not arrived after %.0f s; this job still holds %d output "
                    "buffers through live tensors. If you keep outputs across steps, keep "
                    "copies (tensor.clone()) so the daemon can reuse its buffers.",
                    batch_id,
                    SLOW_BATCH_WARNING_S,
                    self.live_regions,
                )

        envelope = link.receive_until(is_result, None, idle=idle)
        assert envelope is not None and isinstance(envelope.message, BatchReady | BatchFailed)
        # Reported with the next batch's releases (at most PROGRESS_INTERVAL_S from now).
        progress.waited += time.monotonic() - started
        return envelope.message

    def _drop_abandoned(self, generation: Generation, asked: int) -> None:
        """Lets go of the results that workers which left will never have asked for (SPEC.md,
        "Batches in flight"): a worker leaves once the trainer has asked for every batch it
        sent, unless its iterator was dropped (``for batch in loader: break``) or it died. Each
        result's regions go back as those of any tensors that die; the batch being asked for
        now is kept."""
        left = generation.senders_left
        abandoned = [
            batch_id
            for batch_id in generation.results
            if batch_id != asked and batch_id // BATCH_IDS_PER_CONNECTION in left
        ]
        for batch_id in abandoned:
            result = generation.results.pop(batch_id)
            generation.dropped[batch_id] = result.pipeline_id
            if len(generation.dropped) > MAX_DROPPED:
                del generation.dropped[next(iter(generation.dropped))]
            if isinstance(result, BatchReady):
                generation.outputs.retire(result.retired_slabs)
                # Wrapped and dropped at once: released as any tensors that died.
                self._tensors(result)

    def _flush_releases(
        self, want: int | None = None, progress: TrainerProgress | None = None
    ) -> None:
        """Tells the daemon of the regions whose tensors died (and the slabs unmapped), of the
        batch ``want`` the trainer is about to wait for and of its ``progress``: each in the
        last release, where there is one and the daemon reads it there (a message fewer), else
        on its own after them."""
        link = self._daemon.link
        releases = self._daemon.generation.outputs.releases()
        messages: list[ReleaseRegions | WantBatch | TrainerProgress] = list(releases)
        last = releases[-1] if releases else None
        if want is not None:
            if last is not None and link.welcome.want_in_release:
                last = dataclasses.replace(last, want_batch=want)
            else:
                messages.append(WantBatch(want))
        if progress is not None:
            if last is not None and link.welcome.progress_in_release:
                last = dataclasses.replace(last, progress=progress)
            else:
                messages.append(progress)
        if last is not None:
            messages[len(releases) - 1] = last
        for message in messages:
            link.notify(message)
