"""Drop-in replacement for ``nvidia.dali.plugin.pytorch.experimental.proxy``.

Change ``from nvidia.dali.plugin.pytorch.experimental import proxy as dali_proxy`` to
``from dalid.client import proxy as dali_proxy`` and the same code runs its pipeline in the
dalid daemon of the pipeline's device (started on demand) instead of a thread of the trainer.
"""

from __future__ import annotations

import os
import weakref
from typing import Any

from .errors import InputError
from .loader import DataLoader as _DataLoader
from .options import check_job_options
from .pipelines import check_pipeline, external_source_names, no_inputs_hint, pipeline_device
from .refs import DALIOutputBatchRef, DALIOutputSampleRef, DALIPipelineRunRef
from .session import Session
from .started_workers import StartedWorkers
from .worker.worker import Proxy, collate_sample_refs

__all__ = [
    "DALIOutputBatchRef",
    "DALIOutputSampleRef",
    "DALIPipelineRunRef",
    "DALIServer",
    "DataLoader",
]


# DALI's name for its collate rule, which its documentation calls in a custom collate function.
_collate_dali_output_sample_ref_fn = collate_sample_refs


class DALIServer:
    """DALI's ``DALIServer`` API, backed by the daemon for ``pipeline``'s device.

    The pipeline is registered with the daemon when ``proxy`` is first used or the server
    starts; leaving the ``with`` block (or ``stop_thread()``) ends the job at once, unless a
    DataLoader of this server keeps persistent workers (see :meth:`stop_thread`).

    Beyond DALI's arguments (``proxy`` is a property there, so it takes none), keyword-only:
    ``on_error`` (``"raise"``, ``"skip"`` or ``"replace"``), ``share_runs`` (False: this
    job's batches never share a DALI run with other jobs') and ``cohort`` (jobs of one cohort
    that submit the same inputs get the outputs of one run), see :meth:`Session.proxy`,
    ``socket`` and ``autostart``, and the job options of :func:`dalid.client.connect`:
    ``name``, ``weight``, ``memory_bytes``, ``max_inflight_batches``, ``reconnect`` (the job
    carries on across a restart of the daemon, see ``Session``) and ``reconnect_timeout``.
    """

    def __init__(
        self,
        pipeline: Any,
        deterministic: bool = False,
        *,
        on_error: str = "raise",
        share_runs: bool = True,
        cohort: str = "",
        socket: str | os.PathLike[str] | None = None,
        autostart: bool = True,
        name: str | None = None,
        weight: float = 1.0,
        memory_bytes: int | None = None,
        max_inflight_batches: int | None = None,
        reconnect: bool = False,
        reconnect_timeout: float = 60.0,
    ) -> None:
        try:
            check_pipeline(pipeline)
        except InputError as error:
            raise TypeError(str(error)) from None
        self._job: dict[str, Any] = {
            "name": name,
            "weight": weight,
            "memory_bytes": memory_bytes,
            "max_inflight_batches": max_inflight_batches,
            "reconnect": reconnect,
            "reconnect_timeout": reconnect_timeout,
        }
        check_job_options(**self._job)
        if not external_source_names(pipeline):
            # DALI's words first, as its proxy says them, then what to do.
            raise RuntimeError(
                f"The provided pipeline doesn't have any inputs: {no_inputs_hint(pipeline)}"
            )
        self._pipeline = pipeline
        self._deterministic = deterministic
        self._on_error = on_error
        self._share_runs = share_runs
        self._cohort = cohort
        self._socket = socket
        self._autostart = autostart
        self._session: Session | None = None
        self._proxy: Proxy | None = None
        self._registered = False
        # DataLoaders of this server with persistent workers, and whether a stop left the job
        # open for them (Note [Persistent workers across a stop]).
        self._persistent_loaders: weakref.WeakSet[DataLoader] = weakref.WeakSet()
        self._paused = False

    @property
    def session(self) -> Session:
        """The dalid session behind this server, connected on first use."""
        if self._session is None or self._session.closed:
            self._session = Session(
                pipeline_device(self._pipeline),
                socket=self._socket,
                autostart=self._autostart,
                **self._job,
            )
            self._registered = False
        return self._session

    @property
    def proxy(self) -> Proxy:
        """The proxy callable; one object for the server's life, as with DALI's.

        After a stop and a start the pipeline is registered again with a new job, and the same
        proxy object is pointed at it, so a dataset built with it keeps working (workers
        forked or spawned from then on carry the new target).
        """
        session = self.session
        if not self._registered:
            # The session points this proxy at each new registration (after a reconnection too).
            self._proxy = session.proxy(
                self._pipeline,
                self._deterministic,
                self._on_error,
                share_runs=self._share_runs,
                proxy=self._proxy,
                cohort=self._cohort,
            )
            self._registered = True
        assert self._proxy is not None
        return self._proxy

    def produce_data(self, obj: Any) -> Any:
        return self.session.produce_data(obj)

    def produce(
        self, obj: Any, *, step: int | None = None, indices: list[int] | None = None
    ) -> Any:
        """:meth:`Session.produce`, for the DataLoader: names batches by the loader's step."""
        return self.session.produce(obj, step=step, indices=indices)

    def pipeline_states(self) -> tuple[list[dict[str, Any]], list[str]]:
        """:meth:`Session.pipeline_states`, for a DataLoader's ``state_dict()``: none while the
        server is stopped (its next start registers a new pipeline, built afresh)."""
        if self._session is None or self._session.closed or not self._registered:
            return [], []
        return self._session.pipeline_states()

    def restore_pipelines(self, states: list[dict[str, Any]]) -> None:
        """:meth:`Session.restore_pipelines`, for a DataLoader's ``load_state_dict()``: starts
        the server (registers the pipeline) first, as iterating the loader would."""
        if states:
            self.start_thread()
            self.session.restore_pipelines(states)

    @property
    def started_workers(self) -> StartedWorkers:
        """:attr:`Session.started_workers`, for the DataLoader: the workers of its loaders."""
        return self.session.started_workers

    def tell_workers(self) -> None:
        """:meth:`Session.tell_workers`, for the DataLoader; nothing while the server is
        stopped (its next start tells the new job)."""
        if self._session is not None and not self._session.closed:
            self._session.tell_workers()

    @property
    def last_bad_samples(self) -> list[Any]:
        """Bad samples skipped or replaced in the last ``produce_data`` call."""
        return self.session.last_bad_samples if self._session is not None else []

    def start_thread(self) -> None:
        """Connects to the daemon and registers the pipeline (DALI starts a thread here)."""
        self._paused = False
        _ = self.proxy

    def stop_thread(self) -> None:
        """Ends the job with the daemon; returns at once. Idempotent.

        While a DataLoader of this server has persistent workers running, which carry this
        job's target, the job stays open instead, until the server starts again (the workers
        go on submitting to it) or those workers end (Note [Persistent workers across a
        stop])."""
        if self._session is None:
            return
        if self._workers_carry_job():
            self._paused = True
            return
        self._end_job()

    def _end_job(self) -> None:
        self._paused = False
        if self._session is not None:
            self._session.close()
        self._session = None
        self._registered = False

    def _workers_carry_job(self) -> bool:
        return any(loader.workers_running() for loader in self._persistent_loaders)

    def _loader_gone(self) -> None:
        # A persistent loader's workers ended: a job left open for them has no one left.
        if self._paused and not self._workers_carry_job():
            self._end_job()

    def __enter__(self) -> DALIServer:
        self.start_thread()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_thread()

    def __del__(self) -> None:
        # The session's own finalizer also closes it; this just makes it prompt.
        if getattr(self, "_session", None) is not None:
            self._end_job()


class DataLoader(_DataLoader):
    """DALI's proxy ``DataLoader``: a torch DataLoader taking the DALIServer first.

    Note [Persistent workers across a stop]
    ---------------------------------------
    While persistent workers that carry a job's target run, stopping the server leaves that job
    open (the server is only marked stopped), and the next start carries on with it: DALI's
    documented loop stops the server after each epoch, and those workers keep the target they
    were started with. The job ends when the server stops with none of them left, when their
    loader is collected after a stop, or when the server is. Why, and the tests:
    docs/design/worker-submission.md.
    """

    def __init__(self, dali_server: DALIServer, *args: Any, **kwargs: Any) -> None:
        super().__init__(dali_server, *args, **kwargs)
        self.dali_server = dali_server
        if self.persistent_workers:
            dali_server._persistent_loaders.add(self)
            weakref.finalize(self, _loader_collected, weakref.ref(dali_server))

    def workers_running(self) -> bool:
        """Whether this loader keeps worker processes between epochs, started already."""
        return bool(self.persistent_workers and self.num_workers and self._iterator is not None)

    def __iter__(self) -> Any:
        # DALI's loader starts a stopped server when it is iterated (the documented use stops
        # it after each epoch). Here that registers the pipeline again and points the proxy at
        # the new job: it must happen before torch starts this epoch's workers, which carry the
        # proxy's target from then on (persistent ones keep the job open across a stop, above).
        self.dali_server.start_thread()
        return super().__iter__()


def _loader_collected(server: weakref.ref[DALIServer]) -> None:
    found = server()
    if found is not None:
        found._loader_gone()
