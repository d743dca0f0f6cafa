"""A training job's session with a daemon: register pipelines, receive outputs as tensors.

:class:`Session` is the one object a trainer holds: it connects (and with ``reconnect``,
connects again to a restarted daemon: :mod:`dalid.client.reconnect`), registers pipelines and
makes their proxies, and turns what the DataLoader yields into tensors. How one batch is waited
for and delivered is :mod:`dalid.client.delivery`.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Any

import torch

from dalid.protocol import Device, Limits, LoaderWorkers, parse_device, socket_path

from . import checkpoint
from .badsamples import SampleReport, follow_bad_samples, locate
from .delivery import Delivery
from .errors import BatchError, InputError
from .link.launcher import JobRequest, trainer_dial
from .options import check_job_options
from .pipelines import registration_request
from .reconnect.reconnector import Reconnector
from .refs import DALIPipelineRunRef
from .started_workers import StartedWorkers
from .structure import replace_refs
from .worker.worker import Proxy

log = logging.getLogger("dalid.client")


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

    With ``reconnect``, a daemon that is stopped, killed or restarted does not end the job: the
    session connects to the daemon that comes back on the socket (waiting up to
    ``reconnect_timeout`` seconds, after one warning that says why the daemon went),
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
        reconnect_timeout: float = 60.0,
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
            reconnect_timeout=reconnect_timeout,
        )
        try:
            self.device = parse_device(device)
        except ValueError as error:
            raise InputError(str(error)) from None
        self.socket = socket_path(self.device, socket)
        self.reconnect = reconnect
        # Bad samples skipped or replaced in the batches of the last produce_data call.
        self.last_bad_samples: list[SampleReport] = []
        self._daemon = Reconnector(
            trainer_dial(
                self.socket,
                self.device,
                autostart=autostart,
                name=name or f"pid {os.getpid()}",
                job=JobRequest(weight, memory_bytes or 0, max_inflight_batches or 0),
                reconnect=reconnect,
            ),
            socket=self.socket,
            device=self.device,
            enabled=reconnect,
            connect_timeout=connect_timeout,
            reconnect_timeout=reconnect_timeout,
        )
        self._delivery = Delivery(self._daemon)
        self._workers = StartedWorkers()
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
        self.tell_workers()
        reports: list[SampleReport] = []
        self.last_bad_samples = []
        resolved: list[tuple[DALIPipelineRunRef, tuple[torch.Tensor, ...]]] = []

        def resolve(runs: list[DALIPipelineRunRef]) -> dict[int, tuple[torch.Tensor, ...]]:
            produced = self._delivery.outputs_of(runs, reports)
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
        outputs = self._delivery.outputs_of([run], reports)[id(run)]
        for report in reports:
            log.warning("%s", report)
        return outputs

    @property
    def started_workers(self) -> StartedWorkers:
        """The DataLoader workers this session's loaders have started and not stopped; a loader
        counts its iterators' workers here, and :meth:`tell_workers` tells the daemon."""
        return self._workers

    def tell_workers(self) -> None:
        """Tells the daemon how many DataLoader workers the session's loaders run, where that
        changed since it was last told (or the daemon is a new one), so that `dalid status`
        counts them before they connect. A daemon that does not read it is not told."""
        if not self._daemon.closed:
            self._daemon.call(self._tell_workers_now)

    def _tell_workers_now(self) -> None:
        link = self._daemon.link
        welcome = link.welcome
        if not welcome.loader_workers:
            return
        count = self._workers.due(welcome.job_token)
        if count is not None:
            link.request(LoaderWorkers(count))
            self._workers.told(welcome.job_token, count)

    def pipeline_states(self) -> tuple[list[dict[str, Any]], list[str]]:
        """For a DataLoader's ``state_dict()``: the state of each pipeline this session
        registered (a deterministic one's DALI checkpoint, taken between the batches delivered
        and the next), and why any deterministic one holds no checkpoint (``checkpoint.py``)."""
        return checkpoint.pipeline_states(self._daemon)

    def restore_pipelines(self, states: list[dict[str, Any]]) -> None:
        """For a DataLoader's ``load_state_dict()``: refuses states of other pipelines, and
        restores each deterministic pipeline's checkpoint before its next run."""
        checkpoint.restore_pipelines(self._daemon, states)

    def close(self) -> None:
        """Ends the job: the daemon frees its pipelines; live tensors stay valid. Idempotent."""
        if not self._daemon.closed:
            self._delivery.flush_releases()
        self._finalizer()

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"job {self.job_id}"
        return f"<dalid Session {self.socket} {state}>"
