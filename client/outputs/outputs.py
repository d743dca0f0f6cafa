"""How the trainer receives outputs: one interface, one backend per kind of output memory.

The daemon writes each output into a region of a slab it exports once; the trainer maps the
slab once and wraps the region as a torch tensor without a copy; the region returns to the
daemon when its last tensor is collected. How a slab is mapped, when a tensor may be read and
what a release must carry differ by memory, so each kind has its backend:

- shared memory (``device="cpu"`` descriptors):
  :class:`~dalid.client.outputs.shm.SharedMemoryOutputs`;
- CUDA IPC (``device="cuda"``, from a daemon on a GPU):
  :class:`~dalid.client.outputs.cuda.CudaOutputs`;
- GPU outputs staged in shared memory (``device="staged"``, from a daemon on a GPU whose memory
  this process cannot open): :class:`~dalid.client.outputs.cuda_staged.StagedOutputs`.

:class:`Outputs` holds the backends of one daemon and hands each descriptor to the backend of
its device; which GPU backend a job gets, the handshake with a GPU daemon decides
(:func:`~dalid.client.outputs.cuda_staged.output_path`). The contract the backends keep is
protocol/SPEC.md, "Outputs": rules 1 to 6 for every kind of memory, 7 to 13 for CUDA IPC, 14
to 17 for staged GPU outputs.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from dalid.protocol import BatchReady, OutputDescriptor, ReleaseRegions

from ..errors import DeviceMismatch
from .cuda import CudaOutputs
from .cuda_staged import StagedOutputs, output_path
from .shm import SharedMemoryOutputs

if TYPE_CHECKING:
    from ..link.link import Link


class OutputBackend(Protocol):
    """The trainer's side of one kind of output memory, for one daemon.

    Used from the session's thread, in this order: ``wrap`` and ``retire`` as batches arrive,
    ``releases`` whenever the session may talk to the daemon, then ``unmap`` before the goodbye
    and ``close`` after it.
    """

    opened: int
    """Slabs mapped so far, each once."""
    events_opened: int
    """Batch events opened so far, each once (0 where outputs are complete on arrival)."""

    @property
    def live_regions(self) -> int:
        """Regions handed out as tensors whose release is not yet due."""
        ...

    def wrap(self, outputs: Sequence[OutputDescriptor], event: str) -> list[torch.Tensor]:
        """Tensors viewing the regions of one batch's ``outputs`` in this memory, in order,
        mapping the slabs not mapped yet. ``event``: the batch's event handle (hex), for memory
        that the daemon writes asynchronously. Raises FileNotFoundError for a slab that no
        longer exists."""
        ...

    def copy(self, output: OutputDescriptor, frame: memoryview) -> torch.Tensor:
        """A tensor of the trainer's own holding a private copy of an output (protocol/SPEC.md,
        "Outputs", rule 4): nothing to release, on this memory's device."""
        ...

    def retire(self, slabs: Sequence[str]) -> None:
        """The daemon has let go of these slabs (of any memory): unmap those mapped here once
        no tensor views them."""
        ...

    def releases(self) -> list[ReleaseRegions]:
        """What the daemon must hear now: regions whose last tensor died, and slabs unmapped
        that it waits for."""
        ...

    def unmap(self) -> tuple[str, ...]:
        """Before the goodbye (or when the daemon is gone): unmaps every slab no tensor views;
        the slabs that tensors still view and the daemon must not free (``kept_slabs``)."""
        ...

    def close(self) -> None:
        """After the goodbye: lets go of what the daemon may have used until then. Idempotent."""
        ...


class Outputs:
    """The output backends for one daemon, keyed by the output device they serve."""

    def __init__(self, backends: Mapping[str, OutputBackend]) -> None:
        self._backends = dict(backends)

    @classmethod
    def for_daemon(cls, link: Link) -> Outputs:
        """Shared memory for every daemon; for one on a GPU (its welcome names the GPU), CUDA IPC
        or, where this process cannot open the daemon's memory, staged GPU outputs, as the
        handshake on ``link`` decides. Raises :class:`DeviceMismatch` when this process cannot
        use the daemon's GPU outputs."""
        welcome = link.welcome
        backends: dict[str, OutputBackend] = {"cpu": SharedMemoryOutputs()}
        if welcome.device_uuid:
            path = output_path(link)
            if path.path == "staged":
                backends["staged"] = StagedOutputs.for_daemon(welcome.device_uuid, path.reason)
            else:
                backends["cuda"] = CudaOutputs.for_daemon(welcome.device_uuid)
        return cls(backends)

    def tensors(self, result: BatchReady) -> tuple[torch.Tensor, ...]:
        """The batch's outputs as tensors, in order; each backend wraps its outputs at once."""
        if result.copied:  # the job's memory was all held: the batch came as copies
            return self._copies(result)
        outputs = result.outputs
        device = outputs[0].device if outputs else "cpu"
        if all(output.device == device for output in outputs):  # the usual batch: one backend
            return tuple(self._backend(device).wrap(outputs, result.event))
        positions: dict[str, list[int]] = {}
        for position, output in enumerate(outputs):
            positions.setdefault(output.device, []).append(position)
        tensors: list[torch.Tensor | None] = [None] * len(result.outputs)
        for device, indices in positions.items():
            backend = self._backend(device)
            wrapped = backend.wrap([result.outputs[i] for i in indices], result.event)
            for position, tensor in zip(indices, wrapped, strict=True):
                tensors[position] = tensor
        return tuple(tensor for tensor in tensors if tensor is not None)

    def _copies(self, result: BatchReady) -> tuple[torch.Tensor, ...]:
        """A batch of private copies as tensors of this process's own: frames copied into them,
        and copies left on the device copied from the daemon's copy memory on this GPU."""
        outputs = result.outputs
        on_device = [output for output in outputs if output.copy]
        kept: Iterator[torch.Tensor] = iter(())
        if on_device:
            backend = self._backend("cuda")
            if not isinstance(backend, CudaOutputs):
                raise DeviceMismatch("the daemon sent a GPU output's copy to a staged trainer")
            kept = iter(backend.take_copies(on_device, result.event))
        frames = result.copies or (memoryview(b""),) * len(outputs)
        return tuple(
            next(kept) if output.copy else self._backend(output.device).copy(output, frame)
            for output, frame in zip(outputs, frames, strict=True)
        )

    def _backend(self, device: str) -> OutputBackend:
        backend = self._backends.get(device)
        if backend is None:
            raise DeviceMismatch(
                f"the daemon sent an output on {device!r} but named no such device in its welcome"
            )
        return backend

    def retire(self, slabs: Sequence[str]) -> None:
        """Slabs the daemon retired (``BatchReady.retired_slabs``): each backend takes its own."""
        if slabs:
            for backend in self._backends.values():
                backend.retire(slabs)

    def releases(self) -> list[ReleaseRegions]:
        return [message for backend in self._backends.values() for message in backend.releases()]

    def unmap(self) -> tuple[str, ...]:
        return tuple(slab for backend in self._backends.values() for slab in backend.unmap())

    def close(self) -> None:
        for backend in self._backends.values():
            backend.close()

    @property
    def opened(self) -> int:
        return sum(backend.opened for backend in self._backends.values())

    @property
    def events_opened(self) -> int:
        return sum(backend.events_opened for backend in self._backends.values())

    @property
    def live_regions(self) -> int:
        return sum(backend.live_regions for backend in self._backends.values())
