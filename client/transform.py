"""The picklable proxy callable that DataLoader workers call from ``Dataset.__getitem__``.

A call adds one sample to the batch this worker is building and returns references; the
collate rule (:mod:`dalid.client.refs`) submits the finished batch to the daemon through this
process's own worker connection and returns at once with the daemon's batch id.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dalid.protocol import BatchAccepted, ErrorCode, InputBatch, Role, SubmitBatch

from .connection import Connection
from .errors import DaemonUnavailable, InputError, ProtocolMismatch, RequestError
from .paths import resolve_paths
from .refs import DALIOutputSampleRef, DALIPipelineRunRef
from .samples import as_sample

log = logging.getLogger("dalid.client")

# A worker whose link to a job's daemon failed tries a new hello at its next batch (the daemon
# may be back already), then, while hellos fail, at most once per REJOIN_EVERY_S; a hello waits
# at most REJOIN_HELLO_TIMEOUT_S, so that its DataLoader never stalls long.
REJOIN_EVERY_S = 0.5
REJOIN_HELLO_TIMEOUT_S = 1.0


@dataclass(frozen=True)
class ProxyTarget:
    """Everything a worker process needs to reach the pipeline; this is what gets pickled."""

    socket: Path
    device: str | int
    job_id: int
    job_token: str
    pipeline_id: int
    input_names: tuple[str, ...]
    num_outputs: int
    max_batch_size: int
    deterministic: bool
    # The trainer's session reconnects to a restarted daemon: see Note [Daemon restarts].
    reconnect: bool = False
    # Inputs whose samples are file paths, made absolute from the trainer's working directory
    # before they leave (dalid.client.paths).
    path_inputs: tuple[str, ...] = ()
    working_directory: str = ""


_LinkKey = tuple[Path, int, str]


class _WorkerLinks:
    """This process's worker connections, one per (socket, job); reset in a forked child.

    A link's key is the job the proxy names; after a daemon restart the link may be welcomed
    into the new job of that job's trainer (Note [Daemon restarts], point 4).
    """

    def __init__(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._links: dict[_LinkKey, Connection] = {}
        # Jobs whose daemon was found gone, with when to try a hello again: until one is
        # welcomed, their batches are left for the trainer to submit.
        self._lost: dict[_LinkKey, float] = {}

    def get(self, target: ProxyTarget) -> Connection | None:
        """This process's link to the target's job; None while a job found unreachable waits
        for its next try (see ``lose``)."""
        with self._lock:
            if self._pid != os.getpid():
                # Inherited across fork: the parent's sockets are not ours to use or close.
                self._links = {}
                self._lost = {}
                self._pid = os.getpid()
            key = (target.socket, target.job_id, target.job_token)
            link = self._links.get(key)
            if link is not None and not link.closed:
                return link
            retry_at = self._lost.get(key)
            if retry_at is not None and time.monotonic() < retry_at:
                return None
            link = Connection(
                target.socket,
                Role.WORKER,
                device=target.device,
                name=f"worker {os.getpid()}",
                job_id=target.job_id,
                job_token=target.job_token,
                hello_timeout=5.0 if retry_at is None else REJOIN_HELLO_TIMEOUT_S,
            )
            self._links[key] = link
            if retry_at is not None:
                del self._lost[key]
                log.info(
                    "rejoined job %d as job %d of the daemon on %s (pid %d); this process "
                    "submits its batches again",
                    target.job_id,
                    link.welcome.job_id,
                    target.socket,
                    link.welcome.daemon_pid,
                )
            return link

    def close_job(self, socket: Path, job_id: int, job_token: str, goodbye: bool = True) -> None:
        """Closes this process's link to a job (``goodbye=False``: its daemon is gone)."""
        with self._lock:
            link = self._links.pop((socket, job_id, job_token), None)
            if link is not None and self._pid == os.getpid():
                link.close(goodbye=goodbye)

    def lose(self, target: ProxyTarget, retry_after: float, goodbye: bool = False) -> bool:
        """Drops the link to a job its daemon cannot take batches for (gone, or restarted and
        not yet joined by the trainer); batches go to the trainer unsent until a hello, tried
        ``retry_after`` seconds from now or later, is welcomed. ``goodbye``: the daemon lives.
        Whether the job was reachable until now."""
        self.close_job(target.socket, target.job_id, target.job_token, goodbye=goodbye)
        key = (target.socket, target.job_id, target.job_token)
        with self._lock:
            known = key in self._lost
            self._lost[key] = time.monotonic() + retry_after
        return not known


worker_links = _WorkerLinks()


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

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        try:
            bound = self.__signature__.bind(*args, **kwargs)
        except TypeError as error:
            names = self._target.input_names
            if args and len(names) > 1:
                example = ", ".join(f"{name}=..." for name in names)
                raise InputError(
                    f"the pipeline has {len(names)} inputs, passed by keyword only (as with DALI's "
                    f"proxy), named as its external_source operators: proxy({example})"
                ) from None
            raise InputError(
                f"the pipeline takes {self.__signature__} (its external_source names): {error}"
            ) from None
        run = self._current_run()
        if run.batch_size >= self._target.max_batch_size:
            run.drop_abandoned()  # Note [Abandoned samples] in refs.py
        index = run.batch_size
        if index >= self._target.max_batch_size:
            raise InputError(
                f"more than {self._target.max_batch_size} samples in one batch, the pipeline's "
                "max_batch_size: make the DataLoader's batch_size at most that"
            )
        # Check every input before adding any, so a refused call leaves the batch as it was.
        arrays = {name: as_sample(bound.arguments[name], name) for name in self._target.input_names}
        for name, array in arrays.items():
            samples = run.call_args.get(name)
            if samples and samples[0].dtype != array.dtype:
                raise InputError(
                    f"input {name!r}: sample {index} is {array.dtype}, the batch's first sample "
                    f"is {samples[0].dtype}; every sample of an input needs one dtype"
                )
        for name, array in arrays.items():
            run.call_args.setdefault(name, []).append(array)
        refs = tuple(
            DALIOutputSampleRef(self, run, output, index)
            for output in range(self._target.num_outputs)
        )
        run.add_sample(refs)
        return refs[0] if len(refs) == 1 else refs

    def _current_run(self) -> DALIPipelineRunRef:
        run: DALIPipelineRunRef | None = getattr(self._local, "run", None)
        if run is None or run.is_complete:
            target = self._target
            run = DALIPipelineRunRef(
                target.pipeline_id,
                target.job_id,
                target.deterministic,
                job_token=target.job_token,
                keeps_inputs=target.reconnect,
            )
            self._local.run = run
        return run

    def _submit(self, run: DALIPipelineRunRef) -> None:
        """Sends a collated batch to the daemon; it runs at once unless deterministic.

        With ``reconnect``, a daemon found gone is not an error here: the batch reaches the
        trainer unsent, with its inputs, and the trainer submits it (Note [Daemon restarts]).
        """
        target = self._target
        call_args, unreadable = resolve_paths(
            run.call_args, target.path_inputs, target.working_directory
        )
        request = SubmitBatch(
            target.pipeline_id,
            batch_inputs(target.input_names, call_args),
            deferred=run.deterministic,
            unreadable=unreadable,
        )
        link: Connection | None = None
        try:
            link = worker_links.get(target)
            if link is None:
                return  # its daemon was found gone lately: the trainer submits the batch
            reply = link.request(request)
        except (DaemonUnavailable, RequestError) as error:
            rejoined = link is not None and link.welcome.job_token != target.job_token
            if not target.reconnect or not _not_taken_yet(error, rejoined):
                raise
            gone = isinstance(error, DaemonUnavailable)
            # A link that worked until now may find a restarted daemon at the next batch.
            retry_after = 0.0 if gone and link is not None else REJOIN_EVERY_S
            if worker_links.lose(target, retry_after, goodbye=not gone):
                log.info("%s; the trainer submits this process's batches of job %d until this "
                         "process rejoins the job", error, target.job_id)  # fmt: skip
            return
        assert isinstance(reply, BatchAccepted)
        run.batch_id = reply.batch_id
        run.accepted_by = link.welcome.job_token
        run.is_scheduled = not run.deterministic
        if not run.keeps_inputs:
            run.call_args = {}


def _not_taken_yet(error: DaemonUnavailable | RequestError, rejoined: bool) -> bool:
    """Whether a batch refused with ``error`` is the trainer's to submit: its daemon is gone,
    or was restarted and the trainer has not reconnected to it, or (on a link that rejoined
    the trainer's new job) not yet registered the pipeline again."""
    if isinstance(error, ProtocolMismatch):
        return False
    if isinstance(error, DaemonUnavailable):
        return True
    return error.code is ErrorCode.UNKNOWN_JOB or (
        rejoined and error.code is ErrorCode.UNKNOWN_PIPELINE
    )


def batch_inputs(names: tuple[str, ...], call_args: dict[str, list[Any]]) -> tuple[InputBatch, ...]:
    """The gathered samples of a batch as the inputs of a ``SubmitBatch``."""
    return tuple(
        InputBatch(
            name=name,
            dtype=call_args[name][0].dtype.name,
            shapes=tuple(tuple(sample.shape) for sample in call_args[name]),
            samples=tuple(call_args[name]),
        )
        for name in names
    )
