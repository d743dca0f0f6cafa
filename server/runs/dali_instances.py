"""The DALI instances of one pipeline's graph: each instance's thread and state, their count as
the instance controller (``instances.py``) changes it from the load it is shown, and whether
DALI holds runs on any of them."""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from ..pipelines.runner import PipelineRunner
from .instances import Change, InstanceController, Load
from .meters import CpuMeter, GpuMeter

log = logging.getLogger("dalid.server")

# How often an instance's thread looks at the load for the controller: at the queues and the
# GPU's utilisation every _LOOK_S, at the CPUs every _CPU_METER_S. The CPU meter's readings are
# differences of the kernel's counters, each covering the time since the one before, so a
# period's mean is the same read less often; each read of /proc/stat costs the executor's
# thread 15 µs hot and several times that with DALI's workers filling the caches, at any rate
# of batches. (NVML's utilisation is a recent sample, not a counter: it is read at every look.)
_LOOK_S = 0.25
_CPU_METER_S = 1.0


class InstanceRoom(Protocol):
    """Where another DALI instance of a pipeline takes its threads from: ``take`` gives the
    threads one more instance of pipeline ``instance_id`` may have (0: none fits), ``give``
    returns them."""

    def take(self, instance_id: int) -> int: ...

    def give(self, instance_id: int, threads: int) -> None: ...


class InstanceState(enum.Enum):
    BUILDING = "building"  # its thread builds its DALI pipeline
    RUNNING = "running"  # built, it takes runs
    RETIRING = "retiring"  # dropped by the controller: no more runs; ends once its own are done


class Instance:
    """One DALI instance of a pipeline: its thread, its runner once built, its threads."""

    def __init__(self, threads: int = 0) -> None:
        self.number = 0  # its place among the pipeline's instances (0: the first)
        self.threads = threads  # taken from the InstanceRoom (0: the pipeline's own)
        self.state = InstanceState.BUILDING
        self.runner: PipelineRunner | None = None
        self.thread: threading.Thread | None = None
        self.runs = 0  # runs it collected from DALI, and their samples
        self.samples = 0

    @property
    def retiring(self) -> bool:
        return self.state is InstanceState.RETIRING


class DaliInstances:
    """The instances of pipeline ``instance_id`` (``name``), under a lock of their own.
    ``resize(running)`` is told, under that lock, how many are not retiring after each change;
    ``controller`` (None: one instance, always) changes the count from the load, taking
    threads from ``room``; ``on_run`` hears whether DALI holds runs on any instance."""

    def __init__(
        self,
        instance_id: int,
        name: str,
        resize: Callable[[int], None],
        *,
        controller: InstanceController | None = None,
        room: InstanceRoom | None = None,
        device_id: int | None = None,
        on_run: Callable[[bool], None] | None = None,
    ) -> None:
        self.instance_id = instance_id
        self.name = name
        self.controller = controller
        self._room = room
        self._resize = resize
        self._on_run = on_run
        self._lock = threading.Lock()
        self._instances: list[Instance] = []
        self._next_number = 0
        self._holding: set[int] = set()  # the instances whose DALI holds runs
        # The load the controller looks at; nothing to read for a pipeline without one.
        self._cpu = CpuMeter() if controller is not None else None
        self._gpu = GpuMeter(device_id) if controller is not None else None
        self._looking = threading.Lock()
        self._next_look = 0.0
        self._next_cpu_meter = 0.0

    def running(self) -> int:
        """The instances not retiring."""
        with self._lock:
            return self._running()

    def _running(self) -> int:
        return sum(not instance.retiring for instance in self._instances)

    def runs(self) -> tuple[int, ...]:
        """The runs of each instance not retiring."""
        with self._lock:
            return tuple(i.runs for i in self._instances if not i.retiring)

    def threads(self) -> list[threading.Thread]:
        with self._lock:
            return [i.thread for i in self._instances if i.thread is not None]

    def others_running(self, instance: Instance, built: bool = False) -> bool:
        """Whether an instance besides ``instance`` goes on (``built``: and is built: one still
        building may yet fail too)."""
        with self._lock:
            return any(
                i is not instance
                and not i.retiring
                and (not built or i.state is InstanceState.RUNNING)
                for i in self._instances
            )

    def resized(self) -> None:
        """Tells ``resize`` the count again (something else it depends on changed)."""
        with self._lock:
            self._resize(self._running())

    def start(self, instance: Instance, target: Callable[[Instance], None]) -> None:
        """Starts ``instance``'s thread, running ``target``."""
        with self._lock:
            instance.number = self._next_number
            self._next_number += 1
            suffix = f".{instance.number}" if instance.number else ""
            instance.thread = threading.Thread(
                target=target,
                args=(instance,),
                name=f"dalid-pipeline-{self.instance_id}{suffix}",
                daemon=True,
            )
            self._instances.append(instance)
            self._resize(self._running())
        instance.thread.start()

    def ended(self, instance: Instance) -> bool:
        """``instance``'s thread ends: its threads go back; whether it was the last."""
        with self._lock:
            if instance in self._instances:
                self._instances.remove(instance)
            last = not self._instances
            self._resize(self._running())
        if instance.threads and self._room is not None:
            self._room.give(self.instance_id, instance.threads)
        return last

    def built(self, instance: Instance, runner: PipelineRunner) -> None:
        """``instance`` has built its DALI pipeline: it runs, unless dropped meanwhile."""
        with self._lock:
            instance.runner = runner
            if instance.state is InstanceState.BUILDING:
                instance.state = InstanceState.RUNNING

    def retire(self, instance: Instance) -> None:
        with self._lock:
            instance.state = InstanceState.RETIRING

    def holds_runs(self, instance: Instance, running: bool) -> None:
        """From an instance's runner: its DALI holds runs, or none. The pipeline holds runs
        while any instance's does (flight.py attributes a crash to it)."""
        if self._on_run is None:
            return
        with self._lock:
            if running:
                self._holding.add(instance.number)
            else:
                self._holding.discard(instance.number)
            holding = bool(self._holding)
        if running or not holding:
            self._on_run(holding)

    def look(
        self,
        samples_run: int,
        waiting: Callable[[], bool],
        stopping: threading.Event,
        add: Callable[[Instance], None],
        wake: Callable[[], None],
    ) -> None:
        """From any instance's thread, now and then: the controller's look at the load (the
        pipeline's ``samples_run``, whether batches are ``waiting``), and the change it asks
        for: ``add`` starts one more instance, ``wake`` has a dropped one see it is."""
        controller = self.controller
        now = time.monotonic()
        if (
            controller is None
            or self._cpu is None
            or now < self._next_look
            or not self._looking.acquire(False)
        ):
            return
        try:
            self._next_look = now + _LOOK_S
            queued = waiting()
            count = self.running()
            cpu = None
            if now >= self._next_cpu_meter:
                self._next_cpu_meter = now + _CPU_METER_S
                cpu = self._cpu.read()
            load = Load(
                samples_run,
                queued,
                cpu_busy=cpu[0] if cpu is not None else None,
                cores=self._cpu.cores if cpu is not None else 0,
                gpu_busy=self._gpu.read() if self._gpu is not None else None,
                daemon_cpu=cpu[1] if cpu is not None else None,
            )
            change = controller.observe(now, count, load)
            if change is Change.START and not stopping.is_set():
                # Its threads are the pipeline's own (split between its instances), and it
                # counts as the pipeline does among the daemon's: nothing taken from the room.
                self._log("one of the instances it starts on", controller)
                add(Instance())
            elif change is Change.ADD and not stopping.is_set() and self._room is not None:
                threads = self._room.take(self.instance_id)
                if threads:
                    self._log("one more instance", controller)
                    add(Instance(threads))
            elif change is Change.DROP:
                with self._lock:
                    extra = [i for i in self._instances if i.number and not i.retiring]
                    if extra:
                        extra[-1].state = InstanceState.RETIRING
                        self._resize(self._running())
                if extra:
                    self._log("one instance fewer", controller)
                    wake()
        finally:
            self._looking.release()

    def _log(self, what: str, controller: InstanceController) -> None:
        log.info(
            "DALI pipeline %d %r: %s (%s)", self.instance_id, self.name, what, controller.reason
        )
