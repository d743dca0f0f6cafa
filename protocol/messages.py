"""The messages of the dalid protocol, one frozen dataclass each, grouped by family.

Every message class names its wire operation in ``OP``. Field types are the schema: the codec
(:mod:`dalid.protocol.codec`) encodes and validates each field by its annotation, so a field
added here is on the wire with no other change. ``memoryview`` fields travel as raw frames.
Checks that a type cannot express live in ``__post_init__`` and run on both sides, so a bad
message is refused by the sender before it is sent and by the receiver when it arrives.

It holds every message of the protocol, the schema the codec reads, grouped by family.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any, ClassVar

from .errors import ErrorCode

if TYPE_CHECKING:
    import numpy as np

PROTOCOL_VERSION = 8
"""Bumped only when a meaning changes: a change a peer of the previous version would misread.
Quoted in SPEC.md, whose "Versions" section has the rule.

From version 5 on a receiver ignores body fields it does not know (and frames only they
reference), so a field added with a default that older peers may safely ignore needs no bump;
nor does a new operation that changes no existing message (a peer that lacks it answers
``unknown_operation``: so ``reload_repository`` and ``repository_report`` came in version 4).
A new enum value (an error code, a policy), a field older peers must not ignore, or a change
to what a field means does need one.

Version 8 adds the trainer's ``want_batch``: a daemon of this version holds only a few batches
of a job at once and relies on the trainer naming the one it waits for, which a version 7
trainer never does (its job could stall on batches that arrived out of its order).

Version 7 sends each input of a batch as one frame of its samples' bytes and one of their
shapes (``InputBatch.data`` and ``shapes``, with ``size`` and ``ndim``), checked and viewed as
arrays, where version 6 sent a frame per sample and the shapes as msgpack arrays.

Version 6 has the submitter choose a batch's id (``SubmitBatch.batch_id``, from the
connection's ``Welcome.batch_id_base``), so that a worker hands its batch on without waiting for
the daemon: a batch refused after it was sent reaches the trainer as ``batch_failed``.

Version 5 made unknown fields tolerated (version 4 refused them) and checks in ``InputBatch``
itself that each sample's frame holds exactly its shape's bytes.

Version 4 added what lets DataLoader workers rejoin their job after a daemon restart: a
trainer's ``hello`` names its jobs of earlier daemons (``earlier_jobs``), each registration the
ids the pipeline had in them (``earlier_ids``), and the error code ``job_claimed``.

Version 3 added what a job asks for at ``hello`` (``weight``, ``memory_bytes``,
``max_inflight_batches``) and is granted in ``Limits``; the ``status`` request with its
``status_report``; the trainer's ``trainer_progress`` notification; bad samples
(``on_error`` of a registration, ``Limits.max_image_pixels``, ``bad_samples`` in ``BatchReady``
and ``BatchFailed``); ``Welcome.pid_namespace``; and pipelines of the daemon's repository
(``RegisterNamedPipeline``) with what ``PipelineRegistered`` tells of the pipeline built
(``input_names``, ``num_outputs``, ``max_batch_size``).

Version 2 added the fields of GPU outputs (``Welcome.device_uuid``, ``OutputDescriptor.strides``
and ``ipc_handle``, ``BatchReady.event``, ``ReleaseRegions.event`` and ``closed_slabs``,
``Goodbye.kept_slabs``): a version 1 peer refuses a message with fields it does not know, so the
version says so first.
"""

MAX_NAME_LENGTH = 256
MAX_INPUTS = 64
MAX_OUTPUTS = 64
MAX_NDIM = 16
MAX_BATCH_SIZE = 65536
# Each connection's batch ids lie in a range of this many (``Welcome.batch_id_base``).
BATCH_IDS_PER_CONNECTION = 1 << 32
# A trainer names at most this many jobs of earlier daemons (one per restart it outlived).
MAX_EARLIER_JOBS = 256
# A job's share of the daemon is its weight over the sum of the weights of the busy jobs.
MAX_WEIGHT = 1000.0
# cudaIpcMemHandle_t and cudaIpcEventHandle_t are 64 bytes; they travel as hex strings.
CUDA_IPC_HANDLE_BYTES = 64
# Where an output lies: host shared memory, device memory of the daemon's GPU, or (a GPU output
# staged for a trainer that cannot open the daemon's memory) host shared memory it uploads.
OUTPUT_DEVICES = frozenset({"cpu", "cuda", "staged"})
# How a job's GPU outputs reach its trainer (``OutputPath.path``).
OUTPUT_PATHS = frozenset({"cuda_ipc", "staged"})

# Numpy dtype names allowed for sample data and outputs (the types DALI can feed and produce),
# with their sizes in bytes.
ITEMSIZES = {
    "bool": 1,
    "uint8": 1,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
    "int8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "float16": 2,
    "float32": 4,
    "float64": 8,
}
DTYPES = frozenset(ITEMSIZES)


def _check(condition: bool, what: str) -> None:
    if not condition:
        raise ValueError(what)


def _check_name(name: str, what: str) -> None:
    _check(0 < len(name) <= MAX_NAME_LENGTH, f"{what} must have 1 to {MAX_NAME_LENGTH} characters")


def _check_handle(handle: str, what: str, optional: bool = False) -> None:
    """A CUDA IPC handle in hex (empty where ``optional``)."""
    if optional and not handle:
        return
    size = CUDA_IPC_HANDLE_BYTES
    _check(len(handle) == 2 * size, f"{what} must be {size} bytes in hexadecimal")
    try:
        bytes.fromhex(handle)
    except ValueError:
        raise ValueError(f"{what} is not hexadecimal") from None


def _check_shape(shape: tuple[int, ...], what: str) -> None:
    _check(len(shape) <= MAX_NDIM, f"{what} has more than {MAX_NDIM} dimensions")
    _check(all(extent >= 0 for extent in shape), f"{what} has a negative extent: {shape}")


class Message:
    """Base of every message; ``OP`` is the operation name on the wire."""

    OP: ClassVar[str] = ""


class OnError(StrEnum):
    """What the daemon does with a batch that has bad samples (corrupt, unsupported, too large).

    ``raise``: the batch fails, naming them. ``skip``: the batch comes back without them.
    ``replace``: each is replaced by a good sample of the same batch.
    """

    RAISE = "raise"
    SKIP = "skip"
    REPLACE = "replace"


class Role(StrEnum):
    """What a connection is for: the trainer owns a job, workers submit batches to it."""

    TRAINER = "trainer"
    WORKER = "worker"


# --- Session family -----------------------------------------------------------------------------


@dataclass(frozen=True)
class EarlierJob:
    """A job that a trainer had on an earlier daemon of the socket, as its welcome named it."""

    job_id: int
    job_token: str

    def __post_init__(self) -> None:
        _check_name(self.job_token, "an earlier job's token")


@dataclass(frozen=True)
class Hello(Message):
    """First request on every connection. A trainer opens a job; a worker joins one."""

    OP: ClassVar[str] = "hello"
    protocol_version: int
    client_pid: int
    role: Role
    # The pid namespace of the client (inode of /proc/self/ns/pid), so the daemon watches the
    # pid for liveness only where it names the same process.
    pid_namespace: int = 0
    name: str = ""
    job_id: int | None = None
    job_token: str | None = None
    # What a trainer asks for its job (workers leave them be). 0 asks for the daemon's default.
    # weight: the job's share of the daemon when jobs compete, relative to the other jobs'.
    weight: float = 1.0
    # memory_bytes: output memory reserved for the job (shared memory, and as much GPU memory
    # on a GPU daemon); max_inflight_batches: batches the job may have queued or running.
    memory_bytes: int = 0
    max_inflight_batches: int = 0
    # A trainer that reconnects after daemon restarts: the jobs it had on earlier daemons. A
    # worker's hello naming one of them joins this job (see Restarts in SPEC.md).
    earlier_jobs: tuple[EarlierJob, ...] = ()
    # A trainer that takes outputs as private copies when its output memory is all held
    # (``BatchReady.copies``); without it, batches wait for the trainer's releases.
    private_copies: bool = False
    # A trainer that takes a GPU output's private copy as a region of the daemon's copy memory
    # (``OutputDescriptor.copy``), copied on its GPU at once and released: such a copy never
    # leaves the device. Without it, GPU outputs' private copies come as frames too.
    device_copies: bool = False

    def __post_init__(self) -> None:
        _check(len(self.name) <= MAX_NAME_LENGTH, "hello.name is too long")
        _check(
            0 < self.weight <= MAX_WEIGHT,
            f"hello.weight must be above 0 and at most {MAX_WEIGHT:g}",
        )
        _check(self.memory_bytes >= 0, "hello.memory_bytes must not be negative")
        _check(self.max_inflight_batches >= 0, "hello.max_inflight_batches must not be negative")
        if self.role is Role.WORKER:
            _check(
                self.job_id is not None and self.job_token is not None,
                "a worker's hello must name its job_id and job_token",
            )
            _check(not self.earlier_jobs, "only a trainer's hello names earlier jobs")
        _check(
            len(self.earlier_jobs) <= MAX_EARLIER_JOBS,
            f"hello.earlier_jobs names more than {MAX_EARLIER_JOBS} jobs",
        )
        _check(
            len(set(self.earlier_jobs)) == len(self.earlier_jobs),
            "hello.earlier_jobs names a job twice",
        )


@dataclass(frozen=True)
class Limits:
    """What the daemon grants one job.

    ``pool_bytes`` is the job's output memory; ``max_inflight_batches`` the batches it may have
    queued or running (more wait for their ``batch_accepted``); ``weight`` its share when jobs
    compete for the daemon.
    """

    max_batch_size: int
    max_message_bytes: int
    pool_bytes: int
    slab_bytes: int
    max_inflight_batches: int = 16
    weight: float = 1.0
    # An image sample declaring more pixels is a bad sample, refused before decoding; 0: no limit.
    max_image_pixels: int = 0


@dataclass(frozen=True)
class Welcome(Message):
    """Reply to :class:`Hello`: the daemon, the job this connection belongs to, its limits."""

    OP: ClassVar[str] = "welcome"
    protocol_version: int
    daemon_pid: int
    device: str
    dali_version: str
    job_id: int
    job_token: str
    limits: Limits
    # The UUID of the daemon's GPU ("GPU-xxxxxxxx-xxxx-..."), "" for a CPU daemon. The trainer
    # receives GPU outputs only on the device with this UUID, whatever its own ordinals.
    device_uuid: str = ""
    # The inode of the daemon's pid namespace: a client in the same namespace watches
    # ``daemon_pid`` to notice at once that the daemon died (0: unknown).
    pid_namespace: int = 0
    # A GPU daemon's probe of CUDA IPC: hex of the cudaIpcMemHandle of a small buffer of its GPU
    # that holds these same 64 bytes. A trainer tells in ``ipc_probe_result`` whether it could
    # open it and read them back ("" from a CPU daemon, and from a GPU daemon whose GPU cannot
    # export CUDA IPC memory: its trainers answer that they could not).
    ipc_probe: str = ""
    # This connection's batch ids: batch_id_base + 1, + 2, ..., each above the one before and
    # below batch_id_base + BATCH_IDS_PER_CONNECTION. Unique to the connection in the daemon.
    batch_id_base: int = 0
    # The daemon's dalid release and the directory its code runs from (``release.py``): a
    # trainer of another installation says so ("": a daemon that does not say).
    release: str = ""
    installation: str = ""
    # The daemon reads ``ReleaseRegions.want_batch``: a trainer may name the batch it is about to
    # wait for in the release it sends just before, one message where it sent two. False from an
    # older daemon, which would ignore that field: its trainers send ``WantBatch``.
    want_in_release: bool = False
    # The daemon reads ``ReleaseRegions.progress`` too: the trainer's figures for ``dalid status``
    # ride in a release where one goes anyway. False from an older daemon, which would ignore
    # that field: its trainers send ``TrainerProgress``.
    progress_in_release: bool = False
    # The daemon reads ``LoaderWorkers``: the trainer tells it how many DataLoader workers its
    # loaders started, which ``dalid status`` shows before they connect. False from an older
    # daemon, which would answer ``unknown_operation``: its trainers do not send it.
    loader_workers: bool = False

    def __post_init__(self) -> None:
        _check_handle(self.ipc_probe, "welcome.ipc_probe", optional=True)
        _check(self.batch_id_base % BATCH_IDS_PER_CONNECTION == 0, "batch_id_base out of step")


@dataclass(frozen=True)
class IpcProbeResult(Message):
    """A trainer's answer to ``Welcome.ipc_probe`` (sent to every GPU daemon), before anything
    else on its connection: whether it opened the probe handle and read its bytes back, and if
    not, why not."""

    OP: ClassVar[str] = "ipc_probe_result"
    opened: bool
    reason: str = ""

    def __post_init__(self) -> None:
        _check(len(self.reason) <= 4 * MAX_NAME_LENGTH, "ipc_probe_result.reason is too long")


@dataclass(frozen=True)
class OutputPath(Message):
    """Reply to :class:`IpcProbeResult`: how the job's GPU outputs reach the trainer.

    ``cuda_ipc``: in device memory of the daemon's GPU, opened through CUDA IPC (descriptors of
    device ``cuda``). ``staged``: copied by the daemon into shared memory, which the trainer
    uploads to its own device (descriptors of device ``staged``); ``reason`` says why.
    """

    OP: ClassVar[str] = "output_path"
    path: str
    reason: str = ""

    def __post_init__(self) -> None:
        _check(self.path in OUTPUT_PATHS, f"unknown output path {self.path!r}")
        _check(len(self.reason) <= 4 * MAX_NAME_LENGTH, "output_path.reason is too long")


@dataclass(frozen=True)
class Goodbye(Message):
    """A clean close. From a trainer it ends the job and frees everything the job held.

    ``kept_slabs`` names the GPU slabs the trainer still maps because tensors view them: the
    daemon frees them only once the trainer process exits. It has unmapped every other one.
    """

    OP: ClassVar[str] = "goodbye"
    kept_slabs: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in self.kept_slabs:
            _check_name(name, "a kept slab's name")


@dataclass(frozen=True)
class Ping(Message):
    """Liveness check; answered by :class:`Pong`."""

    OP: ClassVar[str] = "ping"


@dataclass(frozen=True)
class Pong(Message):
    OP: ClassVar[str] = "pong"
    daemon_pid: int


@dataclass(frozen=True)
class Shutdown(Message):
    """Asks the daemon to stop, as SIGTERM does. ``end_jobs``: its jobs end with it, those
    with ``reconnect`` too (``dalid stop --end-jobs``); otherwise they wait for a new daemon."""

    OP: ClassVar[str] = "shutdown"
    end_jobs: bool = False


@dataclass(frozen=True)
class Ok(Message):
    """Plain success reply to a request that returns nothing else."""

    OP: ClassVar[str] = "ok"


# --- Pipeline family ----------------------------------------------------------------------------


@dataclass(frozen=True)
class EarlierPipeline:
    """The id a pipeline had in an earlier job of its trainer, named by that job's token."""

    job_token: str
    pipeline_id: int

    def __post_init__(self) -> None:
        _check_name(self.job_token, "an earlier job's token")


def _check_earlier_ids(earlier_ids: tuple[EarlierPipeline, ...]) -> None:
    _check(
        len(earlier_ids) <= MAX_EARLIER_JOBS,
        f"earlier_ids names more than {MAX_EARLIER_JOBS} earlier jobs",
    )
    tokens = {earlier.job_token for earlier in earlier_ids}
    _check(len(tokens) == len(earlier_ids), "earlier_ids names an earlier job twice")


@dataclass(frozen=True)
class RegisterPipeline(Message):
    """A serialized DALI pipeline (``Pipeline.serialize()``) and how to build it."""

    OP: ClassVar[str] = "register_pipeline"
    serialized: memoryview
    input_names: tuple[str, ...]
    num_outputs: int
    max_batch_size: int
    num_threads: int
    prefetch_queue_depth: int
    seed: int | None = None
    exec_dynamic: bool = True
    name: str = ""
    on_error: OnError = OnError.RAISE
    # The ids this pipeline had in the trainer's earlier jobs (``Hello.earlier_jobs``): a
    # worker that joined as one of them submits under that id.
    earlier_ids: tuple[EarlierPipeline, ...] = ()
    # The trainer fixes the order of the batches (they come deferred): the pipeline is not
    # shared with other jobs, and each batch runs alone.
    deterministic: bool = False
    # Inputs whose samples are file paths (they feed fn.io.file.read): the daemon checks that
    # it can open each before the batch runs (see ``SubmitBatch.unreadable``).
    path_inputs: tuple[str, ...] = ()
    # False: the job's batches never share a DALI run with other jobs' batches (a pipeline of
    # its own, built as registered), so operators that depend on a sample's place in its run
    # give what they give in the trainer's own pipeline.
    share_runs: bool = True
    # The cohort the job joins with this pipeline ("" for none): jobs of one cohort that submit
    # batches of the same inputs get the outputs of one run (see SPEC.md, "Cohorts").
    cohort: str = ""

    def __post_init__(self) -> None:
        _check(0 < len(self.input_names) <= MAX_INPUTS, f"1 to {MAX_INPUTS} input names")
        _check(len(self.cohort) <= MAX_NAME_LENGTH, "cohort name is too long")
        _check(set(self.path_inputs) <= set(self.input_names), "path_inputs must be inputs")
        for input_name in self.input_names:
            _check_name(input_name, "an input name")
        _check(len(set(self.input_names)) == len(self.input_names), "input names must differ")
        _check(0 < self.num_outputs <= MAX_OUTPUTS, f"num_outputs must be 1 to {MAX_OUTPUTS}")
        _check(0 < self.max_batch_size <= MAX_BATCH_SIZE, "max_batch_size out of range")
        _check(0 < self.num_threads <= 1024, "num_threads must be 1 to 1024")
        _check(0 < self.prefetch_queue_depth <= 64, "prefetch_queue_depth must be 1 to 64")
        _check(len(self.name) <= MAX_NAME_LENGTH, "pipeline name is too long")
        _check_earlier_ids(self.earlier_ids)


@dataclass(frozen=True)
class RegisterNamedPipeline(Message):
    """A pipeline of the daemon's repository (``dalid serve --pipelines DIR``), by name.

    The daemon calls the ``@pipeline_def`` function ``name`` with its own device_id, the build
    arguments given here (None: the definition's own default) and ``parameters``, a JSON object
    of further keyword arguments.
    """

    OP: ClassVar[str] = "register_named_pipeline"
    name: str
    parameters: str = "{}"
    batch_size: int | None = None
    num_threads: int | None = None
    prefetch_queue_depth: int | None = None
    seed: int | None = None
    on_error: OnError = OnError.RAISE
    # As in RegisterPipeline.
    earlier_ids: tuple[EarlierPipeline, ...] = ()
    deterministic: bool = False
    share_runs: bool = True
    cohort: str = ""

    def __post_init__(self) -> None:
        _check_name(self.name, "a pipeline name")
        _check(len(self.cohort) <= MAX_NAME_LENGTH, "cohort name is too long")
        try:
            parameters = json.loads(self.parameters)
        except ValueError:
            raise ValueError("parameters must be a JSON object") from None
        except RecursionError:
            raise ValueError("parameters nest too deeply to be read") from None
        _check(isinstance(parameters, dict), "parameters must be a JSON object")
        reserved = sorted(set(parameters) & NAMED_PIPELINE_BUILD_ARGUMENTS)
        _check(not reserved, f"parameters may not set {reserved}: they have fields of their own")
        _check(
            self.batch_size is None or 0 < self.batch_size <= MAX_BATCH_SIZE,
            "batch_size out of range",
        )
        _check(
            self.num_threads is None or 0 < self.num_threads <= 1024,
            "num_threads must be 1 to 1024",
        )
        _check(
            self.prefetch_queue_depth is None or 0 < self.prefetch_queue_depth <= 64,
            "prefetch_queue_depth must be 1 to 64",
        )
        _check_earlier_ids(self.earlier_ids)


# Arguments of a named pipeline's build with fields of their own, or that the daemon sets.
NAMED_PIPELINE_BUILD_ARGUMENTS = frozenset(
    {"batch_size", "num_threads", "prefetch_queue_depth", "seed", "device_id"}
)


@dataclass(frozen=True)
class PipelineRegistered(Message):
    """Reply to a registration: the pipeline's id and, as built, its external_source names (in
    definition order), its number of outputs and its batch size."""

    OP: ClassVar[str] = "pipeline_registered"
    pipeline_id: int
    input_names: tuple[str, ...] = ()
    num_outputs: int = 0
    max_batch_size: int = 0
    # The inputs whose samples are file paths (they feed fn.io.file.read).
    path_inputs: tuple[str, ...] = ()


@dataclass(frozen=True)
class CheckpointPipeline(Message):
    """Asks for the DALI checkpoint of a deterministic registration's pipeline (its random
    generators), as it stands between the trainer's batches (SPEC.md, "Checkpoints")."""

    OP: ClassVar[str] = "checkpoint_pipeline"
    pipeline_id: int


@dataclass(frozen=True)
class PipelineCheckpoint(Message):
    """Reply to ``checkpoint_pipeline``: ``checkpoint`` (``Pipeline.checkpoint()``'s bytes),
    taken after ``runs`` runs of the pipeline since it was built or restored; empty, with
    ``unavailable`` saying why, where the pipeline cannot give one (not made with
    ``enable_checkpointing=True``)."""

    OP: ClassVar[str] = "pipeline_checkpoint"
    pipeline_id: int
    checkpoint: memoryview
    runs: int = 0
    unavailable: str = ""

    def __post_init__(self) -> None:
        _check(len(self.unavailable) <= 4096, "unavailable is too long")


@dataclass(frozen=True)
class RestorePipeline(Message):
    """Restores a deterministic registration's pipeline from a ``checkpoint`` that
    ``pipeline_checkpoint`` gave, before its next run; answered ``ok``."""

    OP: ClassVar[str] = "restore_pipeline"
    pipeline_id: int
    checkpoint: memoryview

    def __post_init__(self) -> None:
        _check(len(self.checkpoint) > 0, "a checkpoint to restore must not be empty")


# --- Batch family -------------------------------------------------------------------------------


# A sample's extent at most: far past any buffer, and small enough that the checks' sums and
# products of extents stay exact.
MAX_EXTENT = 1 << 48
# How a batch input's shapes travel: one row of ``ndim`` of these per sample (``<u8``).
SHAPE_ITEMSIZE = 8
# numpy, imported with the first batch (``_import_numpy``), not with the protocol: the commands
# that only ask a daemon (`dalid stop`, `dalid status`) start without it, some 0.1 s sooner.
_numpy_imported = False
_SHAPE_DTYPE: np.dtype[Any]
# The ufuncs themselves: their methods' Python wrappers (``ndarray.max``, ``np.cumsum``) cost
# more than the work on a batch's few hundred extents.
_MAXIMUM: Any
_ACCUMULATE: Any


def _import_numpy() -> None:
    """Binds ``np`` and the batch checks' dtype and ufuncs in this module, once."""
    global np, _SHAPE_DTYPE, _MAXIMUM, _ACCUMULATE, _numpy_imported
    import numpy as np

    _SHAPE_DTYPE = np.dtype("<u8")
    _MAXIMUM = np.maximum.reduce
    _ACCUMULATE = np.add.accumulate
    _numpy_imported = True


@dataclass(frozen=True)
class InputBatch:
    """The samples of one external_source input, ``size`` of them, of one dtype and rank.

    ``data`` is one frame: the samples' bytes back to back, in order, each C-contiguous.
    ``shapes`` is one frame too: ``size`` rows of ``ndim`` little-endian uint64 extents. The
    checks, and the views a receiver makes (:meth:`arrays`), are numpy operations on the whole
    batch: the daemon's Python works per batch, not per sample (see SPEC.md, "Batches").
    """

    name: str
    dtype: str
    size: int
    ndim: int
    shapes: memoryview
    data: memoryview

    def __post_init__(self) -> None:
        # Every batch of every job passes here on the daemon's I/O thread: the checks are a
        # few numpy calls on the whole batch, and an error's text is made only once it fails.
        if not _numpy_imported:
            _import_numpy()
        name = self.name
        if not 0 < len(name) <= MAX_NAME_LENGTH:
            _check_name(name, "an input name")
        if self.dtype not in DTYPES:
            raise ValueError(f"input {name!r}: unsupported dtype {self.dtype!r}")
        if not 0 <= self.size <= MAX_BATCH_SIZE:
            raise ValueError(f"input {name!r}: size out of range")
        if not 0 <= self.ndim <= MAX_NDIM:
            raise ValueError(f"input {name!r}: ndim must be 0 to {MAX_NDIM}")
        size, ndim = self.size, self.ndim
        rows = size * ndim
        if self.shapes.nbytes != rows * SHAPE_ITEMSIZE:
            raise ValueError(
                f"input {name!r}: {size} shapes of {ndim} extents need "
                f"{rows * SHAPE_ITEMSIZE} bytes, their frame has {self.shapes.nbytes}"
            )
        flat = np.frombuffer(self.shapes, _SHAPE_DTYPE)
        top = int(_MAXIMUM(flat)) if rows else 0
        if top > MAX_EXTENT:
            raise ValueError(f"input {name!r}: an extent is over {MAX_EXTENT}")
        itemsize = ITEMSIZES[self.dtype]
        # In floating point first: a product of extents (none zero) over the frame's size
        # is refused before it is computed exactly, where it could overflow.
        limit = self.data.nbytes // itemsize
        extents = flat.reshape(size, ndim)
        counts: np.ndarray
        if ndim == 1 and top <= limit:
            # One extent a sample (file paths, encoded images), none over the frame: the
            # extents are the counts, with no product to take (and no sum past int64).
            counts = flat
        elif ndim:
            approx = extents.astype(np.float64).prod(axis=1)
            over = np.flatnonzero(approx > limit)
            if len(over):
                index = int(over[0])
                raise ValueError(
                    f"input {name!r} sample {index}: shape {tuple(extents[index].tolist())} "
                    f"of {self.dtype} needs {approx[index] * itemsize:.0f} bytes, the frame has "
                    f"{self.data.nbytes}"
                )
            counts = extents.astype(np.int64).prod(axis=1)
        else:
            counts = np.ones(size, np.int64)
        # Each sample's first element, and the end of the last one, in elements.
        starts = np.empty(size + 1, np.int64)
        starts[0] = 0
        _ACCUMULATE(counts, 0, np.int64, starts[1:])
        # The frame holds exactly the samples: a receiver views each in place by its shape.
        needed = int(starts[size]) * itemsize
        if needed != self.data.nbytes:
            raise ValueError(
                f"input {name!r}: {size} samples of {self.dtype} need {needed} bytes by their "
                f"shapes, the frame has {self.data.nbytes}"
            )
        object.__setattr__(self, "_extents", extents)
        object.__setattr__(self, "_starts", starts)

    @classmethod
    def of(cls, name: str, samples: Sequence[Any]) -> InputBatch:
        """The batch of ``samples``: C-contiguous numpy arrays of one dtype and rank, copied
        once into one frame; raises ValueError for anything else."""
        _check(len(samples) > 0, f"input {name!r}: no samples")
        if not _numpy_imported:
            _import_numpy()
        first = samples[0]
        dtype, ndim = first.dtype, first.ndim
        for index, sample in enumerate(samples):
            if sample.dtype != dtype or sample.ndim != ndim:
                raise ValueError(
                    f"input {name!r}: sample {index} is {sample.dtype} of {sample.ndim} "
                    f"dimension(s), sample 0 {dtype} of {ndim}: every sample of an input needs "
                    "one dtype and one number of dimensions"
                )
        shapes = np.array([sample.shape for sample in samples], _SHAPE_DTYPE).reshape(-1)
        # bytes.join reads each array through its buffer: one copy, in C.
        data = b"".join(samples)
        return cls(name, dtype.name, len(samples), ndim, shapes.data.cast("B"),
                   memoryview(data))  # fmt: skip

    @property
    def nbytes(self) -> int:
        """The samples' bytes, all together."""
        return self.data.nbytes

    def extents(self) -> np.ndarray:
        """The samples' shapes: ``size`` rows of ``ndim`` extents (int64s)."""
        extents: np.ndarray = self._extents  # type: ignore[attr-defined]
        return extents

    def sample_bytes(self) -> np.ndarray:
        """Where each sample starts in ``data`` and where the last one ends: ``size + 1``
        byte offsets (int64s)."""
        starts: np.ndarray = self._starts  # type: ignore[attr-defined]
        return starts * ITEMSIZES[self.dtype]

    def uniform(self) -> bool:
        """Whether every sample has the same shape."""
        extents = self.extents()
        return bool(self.size < 2 or (extents == extents[0]).all())

    def arrays(self) -> np.ndarray | list[np.ndarray]:
        """Numpy views of the samples, in place in ``data`` (read-only, no copy): one array of
        ``size`` rows when every sample has one shape, else a list of arrays."""
        flat = np.frombuffer(self.data, np.dtype(self.dtype))
        if self.uniform():
            shape = tuple(int(n) for n in self.extents()[0]) if self.size else (0,) * self.ndim
            return flat.reshape(self.size, *shape)
        starts = self._starts.tolist()  # type: ignore[attr-defined]
        # The one loop per sample: numpy makes no list of views of unequal sizes in one call
        # (np.split loops in Python too, and slower); each step is one slice, no checks.
        if self.ndim == 1:
            return [flat[a:b] for a, b in itertools.pairwise(starts)]
        shapes = self.extents().tolist()
        return [
            flat[a:b].reshape(shape)
            for a, b, shape in zip(starts[:-1], starts[1:], shapes, strict=True)
        ]


@dataclass(frozen=True)
class SubmitBatch(Message):
    """A batch for a pipeline, under an id its submitter chose (see ``Welcome.batch_id_base``).
    ``deferred`` batches wait for :class:`ScheduleBatch`."""

    OP: ClassVar[str] = "submit_batch"
    pipeline_id: int
    inputs: tuple[InputBatch, ...]
    batch_id: int = 0
    deferred: bool = False
    # Positions of samples whose file path (an input of ``path_inputs``) the submitter itself
    # could not read: missing files, not files the daemon fails to see.
    unreadable: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        inputs = self.inputs
        if not 0 < len(inputs) <= MAX_INPUTS:
            raise ValueError(f"1 to {MAX_INPUTS} inputs")
        size = inputs[0].size
        for batch in inputs:
            if batch.size != size:
                raise ValueError("every input of a batch must have the same number of samples")
        _check(0 < size <= MAX_BATCH_SIZE, "a batch must have at least one sample")
        if self.unreadable:
            _check(all(0 <= p < size for p in self.unreadable), "unreadable: position out of range")

    @property
    def batch_size(self) -> int:
        return self.inputs[0].size

    def without_samples(self) -> SubmitBatch:
        """This submission with none of its samples' bytes: its ids, size and flags, and one
        input of empty samples (what a receiver keeps of a batch whose result has gone)."""
        return dataclasses.replace(
            self, inputs=(_empty_input(self.inputs[0].name, self.batch_size),)
        )


@functools.lru_cache(maxsize=64)
def _empty_input(name: str, size: int) -> InputBatch:
    """``size`` empty samples of ``name``: immutable, so one serves every batch of that size."""
    return InputBatch(
        name, "uint8", size, 1, memoryview(bytes(size * SHAPE_ITEMSIZE)), memoryview(b"")
    )


@dataclass(frozen=True)
class BatchAccepted(Message):
    """The answer to a submission the daemon took: its result goes to the trainer. Held back
    while the job has its limit of batches in flight (backpressure)."""

    OP: ClassVar[str] = "batch_accepted"
    batch_id: int


@dataclass(frozen=True)
class ScheduleBatch(Message):
    """Runs a deferred batch now (deterministic mode: the trainer fixes the order)."""

    OP: ClassVar[str] = "schedule_batch"
    batch_id: int


@dataclass(frozen=True)
class WantBatch(Message):
    """A notification from the trainer: it is about to wait for ``batch_id``, whose result has
    not come; the daemon runs it before the job's other batches (SPEC.md, "Batches in flight")."""

    OP: ClassVar[str] = "want_batch"
    batch_id: int


@dataclass(frozen=True)
class WorkerLeft(Message):
    """A push to a trainer: the worker connection whose batch ids are ``first_batch_id`` up to
    (not including) ``end_batch_id`` left. The trainer lets go of the results of those batches
    it has not asked for: it will not ask (SPEC.md, "Batches in flight")."""

    OP: ClassVar[str] = "worker_left"
    first_batch_id: int
    end_batch_id: int


@dataclass(frozen=True)
class OutputDescriptor:
    """Where one pipeline output of a batch lies: a region of a slab.

    ``device`` "cpu": the slab is a shared-memory segment named ``slab``. ``device`` "cuda": it is
    device memory of the daemon's GPU, opened through ``ipc_handle`` (hex of a cudaIpcMemHandle,
    the same for every region of the slab); ``slab`` names it for the trainer's cache.
    ``device`` "staged": a GPU output the daemon copied into the shared-memory segment ``slab``,
    for the trainer to upload to its GPU (``OutputPath`` "staged").
    ``strides`` are in bytes; empty means C-contiguous.
    ``copy``: a GPU output's private copy left on the device (a "cuda" region of the job's copy
    memory): the trainer copies it into memory of its own once the batch's event is done, and
    releases the region at once; no tensor views it.
    """

    region_id: int
    slab: str
    slab_size: int
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    layout: str = ""
    device: str = "cpu"
    strides: tuple[int, ...] = ()
    ipc_handle: str = ""
    copy: bool = False

    def __post_init__(self) -> None:
        _check(self.dtype in DTYPES, f"unsupported output dtype {self.dtype!r}")
        _check(
            not self.copy or (self.device == "cuda" and bool(self.slab)),
            "only a region of GPU memory is a copy left on the device",
        )
        _check_shape(self.shape, "an output")
        _check(
            self.offset >= 0 and self.offset + self.nbytes <= self.slab_size, "region outside slab"
        )
        _check(self.device in OUTPUT_DEVICES, f"unknown output device {self.device!r}")
        if self.device == "cuda" and self.slab:
            _check_handle(self.ipc_handle, "a GPU output's ipc_handle")
        else:
            _check(not self.ipc_handle, f"an output on {self.device!r} has no ipc_handle")
        if self.strides:
            _check(len(self.strides) == len(self.shape), "strides and shape differ in length")
            _check(all(stride >= 0 for stride in self.strides), "strides must not be negative")
            # The last byte any index reaches must lie inside the region.
            itemsize = ITEMSIZES[self.dtype]
            if all(self.shape):
                reach = sum((n - 1) * s for n, s in zip(self.shape, self.strides, strict=True))
                _check(reach + itemsize <= self.nbytes, "strides reach outside the region")


@dataclass(frozen=True)
class BadSample:
    """A sample that made its batch fail, by its position in the batch as submitted.

    ``replaced_by`` is the position of the good sample whose outputs took its place (policy
    ``replace``), or -1: it was dropped (``skip``) or the batch failed.
    """

    position: int
    message: str
    replaced_by: int = -1

    def __post_init__(self) -> None:
        _check(0 <= self.position < MAX_BATCH_SIZE, "a bad sample's position is out of range")
        _check(-1 <= self.replaced_by < MAX_BATCH_SIZE, "replaced_by is out of range")


@dataclass(frozen=True)
class BatchReady(Message):
    """Pushed to the job's trainer when a batch has run; one descriptor per pipeline output."""

    OP: ClassVar[str] = "batch_ready"
    batch_id: int
    pipeline_id: int
    outputs: tuple[OutputDescriptor, ...]
    # Slabs the daemon has freed since its last message: the trainer unmaps them.
    retired_slabs: tuple[str, ...] = ()
    # Hex of a cudaIpcEventHandle recorded after this batch's GPU outputs were written; the
    # trainer's stream waits on it before using them. Empty when no output is on the GPU.
    event: str = ""
    # Samples left out (outputs have fewer rows) or replaced, by the pipeline's on_error.
    bad_samples: tuple[BadSample, ...] = ()
    # A batch delivered as private copies (its job's memory was all held): one frame per
    # output, whose descriptor names no slab, or an empty one for an output left on the device
    # (``OutputDescriptor.copy``). Only to a trainer whose hello took copies.
    copies: tuple[memoryview, ...] = ()

    def __post_init__(self) -> None:
        on_gpu = any(output.device == "cuda" and output.slab for output in self.outputs)
        _check_handle(self.event, "batch_ready.event", optional=not on_gpu)
        _check(on_gpu or not self.event, "batch_ready.event without GPU outputs")
        if self.copies:
            _check(len(self.copies) == len(self.outputs), "one copy per output")
            for output, copy in zip(self.outputs, self.copies, strict=True):
                if output.copy:
                    _check(not copy.nbytes, "a copy left on the device has no frame")
                else:
                    _check(not output.slab and copy.nbytes == output.nbytes, "a copy's size")
        else:
            _check(all(output.slab for output in self.outputs), "an output names no slab")

    @property
    def copied(self) -> bool:
        """Whether the batch came as private copies (frames, or regions left on the device)."""
        return bool(self.copies) or any(output.copy for output in self.outputs)


@dataclass(frozen=True)
class BatchFailed(Message):
    """Pushed to the job's trainer when a batch could not run, or was refused once sent: then
    it is also the answer to the ``submit_batch`` (see SPEC.md, "Submitting a batch")."""

    OP: ClassVar[str] = "batch_failed"
    batch_id: int
    pipeline_id: int
    code: ErrorCode
    message: str
    # The samples found to fail on their own (code ``bad_samples``), each with DALI's message.
    bad_samples: tuple[BadSample, ...] = ()


# --- Buffer family ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ReleaseRegions(Message):
    """A notification (no reply): the trainer no longer views these regions."""

    OP: ClassVar[str] = "release_regions"
    region_ids: tuple[int, ...] = field(default_factory=tuple)
    # GPU regions: hex of a cudaIpcEventHandle the trainer recorded after its last use of them;
    # the daemon writes them again only after it. Empty for CPU regions.
    event: str = ""
    # Retired GPU slabs the trainer has unmapped (or never mapped): the daemon may now free
    # them. CUDA forbids freeing memory another process still maps.
    closed_slabs: tuple[str, ...] = ()
    # The batch the trainer is about to wait for, as a ``WantBatch`` of it sent after this
    # release would name it (None: none). Only to a daemon whose welcome says
    # ``want_in_release``: an older one ignores it, and the trainer would wait behind batches it
    # takes later.
    want_batch: int | None = None
    # The trainer's progress report, as a ``TrainerProgress`` sent after this release would
    # carry it (None: none). Only to a daemon whose welcome says ``progress_in_release``.
    progress: TrainerProgress | None = None

    def __post_init__(self) -> None:
        _check_handle(self.event, "release_regions.event", optional=True)
        for name in self.closed_slabs:
            _check_name(name, "a closed slab's name")


# --- Status family ------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainerProgress(Message):
    """A notification from the trainer: how long it has waited for batches, in total."""

    OP: ClassVar[str] = "trainer_progress"
    waited_seconds: float
    batches_received: int

    def __post_init__(self) -> None:
        # Not infinite: the figure is summed into `dalid status` and the metrics (NaN fails
        # the comparison too).
        _check(
            math.isfinite(self.waited_seconds) and self.waited_seconds >= 0,
            "waited_seconds must be a finite number, not negative",
        )
        _check(self.batches_received >= 0, "batches_received must not be negative")


# The most DataLoader workers a trainer says it runs (``LoaderWorkers``), far past any loader's.
MAX_LOADER_WORKERS = 1 << 16


@dataclass(frozen=True)
class LoaderWorkers(Message):
    """A request from the trainer: its DataLoaders have ``workers`` worker processes started and
    not stopped, all loaders together. Sent when a loader's iterator starts its workers and when
    they stop, so that ``dalid status`` shows them before they connect (at their first sample);
    answered ``ok``, so a status asked after it counts them. Only to a daemon whose welcome says
    ``loader_workers``."""

    OP: ClassVar[str] = "loader_workers"
    workers: int

    def __post_init__(self) -> None:
        _check(
            0 <= self.workers <= MAX_LOADER_WORKERS,
            f"loader_workers.workers must be 0 to {MAX_LOADER_WORKERS}",
        )


@dataclass(frozen=True)
class StatusRequest(Message):
    """Asks for a :class:`StatusReport`; needs no hello (like ``ping``)."""

    OP: ClassVar[str] = "status"


@dataclass(frozen=True)
class JobStatus:
    """One job as the daemon sees it. Rates are over the last few seconds; totals since start.

    ``queued`` batches wait for their pipeline, ``running`` are inside DALI, ``waiting`` were
    received over the job's in-flight limit and wait for their ``batch_accepted``, ``deferred``
    wait for ``schedule_batch``. ``slot_wait_seconds`` is the time batches waited for the daemon
    while other jobs ran; ``passed_over`` counts the batches of other jobs started meanwhile;
    ``run_seconds`` is the daemon's time the job's batches took inside their pipelines, what
    the job's weight shares out.
    """

    job_id: int
    name: str
    pid: int
    weight: float
    workers: int
    pipelines: int
    batches_done: int
    samples_done: int
    batches_failed: int
    batches_per_second: float
    samples_per_second: float
    queued: int
    running: int
    waiting: int
    deferred: int
    max_inflight_batches: int
    slot_wait_seconds: float
    passed_over: int
    run_seconds: float
    trainer_wait_seconds: float
    regions_held: int
    bytes_held: int
    slabs: int
    memory_bytes: int
    connected_seconds: float
    # Batches delivered as private copies, their job's output memory being all held; of them,
    # those whose GPU outputs stayed on the device (``OutputDescriptor.copy``).
    batches_copied: int = 0
    batches_copied_on_device: int = 0
    # How its outputs reach the trainer: "shm" (CPU outputs only), "cuda_ipc" or "staged" for
    # GPU outputs (see OutputPath).
    output_path: str = ""
    # The bytes of its output memory's slabs now, and the most they have been at once (every
    # kind of memory together).
    slab_bytes: int = 0
    peak_slab_bytes: int = 0
    # Of ``slab_bytes``, those of its copy memory (private copies left on the device).
    copy_slab_bytes: int = 0
    # The DataLoader workers its trainer says its loaders started (``LoaderWorkers``), connected
    # or not yet; None from a trainer that does not say (``workers`` counts those connected).
    workers_started: int | None = None


@dataclass(frozen=True)
class PipelineStatus:
    """One pipeline in the daemon, as the daemon runs it (jobs that registered the same graph
    share one): the jobs it serves and how full its runs are.

    ``run_size`` is the most samples one run holds; ``mean_fill`` the samples of its runs so far
    over that many; ``mixed_runs`` the runs that held batches of two jobs or more. A pipeline
    that is not ``shared`` says why in ``private_reason``.
    """

    pipeline: int
    name: str
    shared: bool
    jobs: tuple[int, ...]
    run_size: int
    threads: int
    runs: int
    samples: int
    mean_fill: float
    mixed_runs: int
    private_reason: str = ""
    # The DALI threads its registration asked for, where the daemon gave fewer (0: as asked).
    threads_asked: int = 0
    # DALI instances of the graph running side by side (each with ``threads``), and why that
    # many: what the daemon measured, or the operator's setting ("" for a pipeline of its own).
    instances: int = 1
    instances_reason: str = ""
    # The runs each of them ran so far, the first instance first.
    instance_runs: tuple[int, ...] = ()


@dataclass(frozen=True)
class CohortStatus:
    """One cohort: jobs that registered the same graph under one name, whose batches of the
    same inputs run once (see SPEC.md, "Cohorts").

    ``runs`` counts the batches of its members that ran, ``hits`` those served from another
    member's run without one; ``hit_rate`` is ``hits`` over both. ``lag_batches``: how many
    more batches its leading member has been served than its trailing one. ``held_bytes``: the
    output memory held for trailing members (outputs some member has not had yet and none
    holds), at most ``window_bytes``; ``leased_bytes``: what members' tensors view now;
    ``dropped``: outputs dropped unserved to stay within the window.
    """

    name: str
    jobs: tuple[int, ...]
    runs: int
    hits: int
    hit_rate: float
    lag_batches: int
    held_bytes: int
    window_bytes: int
    leased_bytes: int = 0
    dropped: int = 0
    # Batches run once and then copied into each member's own memory (outputs the cohort's
    # memory cannot hold, it being full; or GPU outputs for a member whose trainer cannot map
    # the cohort's GPU memory by CUDA IPC, which are staged for it).
    copied: int = 0
    # The cohort's GPU output memory now (a GPU daemon's), at most --cohort-memory: every
    # member maps its regions by CUDA IPC.
    device_bytes: int = 0
    # Members trailing past the window, whose batches run for them alone behind the cohort's
    # shared runs, and how many batches ran so.
    behind: tuple[int, ...] = ()
    behind_runs: int = 0


@dataclass(frozen=True)
class StatusReport(Message):
    """The daemon and its jobs, at one moment."""

    OP: ClassVar[str] = "status_report"
    daemon_pid: int
    device: str
    device_uuid: str
    dali_version: str
    protocol_version: int
    uptime_seconds: float
    max_jobs: int
    concurrency: int
    memory_limit: int
    memory_reserved: int
    jobs: tuple[JobStatus, ...]
    # The pipelines the jobs' registrations run on (several jobs may share one).
    pipelines: tuple[PipelineStatus, ...] = ()
    # The cohorts of jobs whose batches of the same inputs run once.
    cohorts: tuple[CohortStatus, ...] = ()


# --- Repository family --------------------------------------------------------------------------


@dataclass(frozen=True)
class ReloadRepository(Message):
    """Asks the daemon to load its pipeline repository again (``dalid reload``, as SIGHUP
    does); answered by :class:`RepositoryReport` once loaded. Needs no hello (like ``status``)."""

    OP: ClassVar[str] = "reload_repository"


@dataclass(frozen=True)
class RepositoryFailure:
    """A file of the repository that failed to load, with its error on one line.

    ``kept_pipelines``: the pipelines it still serves from its last good load.
    """

    file: str
    message: str
    kept_pipelines: tuple[str, ...] = ()


@dataclass(frozen=True)
class RepositoryReport(Message):
    """The repository as loaded: its directory, the names clients may select, the failures."""

    OP: ClassVar[str] = "repository_report"
    directory: str
    pipelines: tuple[str, ...]
    failures: tuple[RepositoryFailure, ...] = ()


# --- Errors -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Error(Message):
    """Reply to a request that failed, or a notification that could not be applied."""

    OP: ClassVar[str] = "error"
    code: ErrorCode
    message: str
    traceback: str = ""
    op: str = ""
    # With ``shutting_down``, on a notice (no request id): the daemon ended its jobs on purpose,
    # so a job that would wait for a new daemon (``reconnect``) ends too. With ``unknown_job``:
    # the daemon, which runs on, ended this connection's job (an idle one, to make room for a
    # new job), told as a notice, or as the reply to a worker's hello that names the job later;
    # the message says why.
    ends_jobs: bool = False


MESSAGE_TYPES: tuple[type[Message], ...] = (
    Hello,
    Welcome,
    IpcProbeResult,
    OutputPath,
    Goodbye,
    Ping,
    Pong,
    Shutdown,
    Ok,
    RegisterPipeline,
    RegisterNamedPipeline,
    PipelineRegistered,
    CheckpointPipeline,
    PipelineCheckpoint,
    RestorePipeline,
    SubmitBatch,
    BatchAccepted,
    ScheduleBatch,
    WantBatch,
    WorkerLeft,
    BatchReady,
    BatchFailed,
    ReleaseRegions,
    TrainerProgress,
    LoaderWorkers,
    StatusRequest,
    StatusReport,
    ReloadRepository,
    RepositoryReport,
    Error,
)

__all__ = [
    "BATCH_IDS_PER_CONNECTION",
    "CUDA_IPC_HANDLE_BYTES",
    "DTYPES",
    "MAX_EARLIER_JOBS",
    "MAX_LOADER_WORKERS",
    "MESSAGE_TYPES",
    "PROTOCOL_VERSION",
    "BadSample",
    "BatchAccepted",
    "BatchFailed",
    "BatchReady",
    "CheckpointPipeline",
    "CohortStatus",
    "EarlierJob",
    "EarlierPipeline",
    "Error",
    "ErrorCode",
    "Goodbye",
    "Hello",
    "InputBatch",
    "IpcProbeResult",
    "JobStatus",
    "Limits",
    "LoaderWorkers",
    "Message",
    "Ok",
    "OnError",
    "OutputDescriptor",
    "OutputPath",
    "Ping",
    "PipelineCheckpoint",
    "PipelineRegistered",
    "PipelineStatus",
    "Pong",
    "RegisterNamedPipeline",
    "RegisterPipeline",
    "ReleaseRegions",
    "ReloadRepository",
    "RepositoryFailure",
    "RepositoryReport",
    "RestorePipeline",
    "Role",
    "ScheduleBatch",
    "Shutdown",
    "StatusReport",
    "StatusRequest",
    "SubmitBatch",
    "TrainerProgress",
    "WantBatch",
    "Welcome",
    "WorkerLeft",
]
