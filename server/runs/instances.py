"""How many DALI instances a shared pipeline runs on, decided from what the daemon measures.

One DALI pipeline may not keep a device busy: its runs go one after another, with the
daemon's copy-out and DALI's own scheduling between them. A shared pipeline's executor can run
the same graph on several DALI instances, each with its threads, its slots of the fair
scheduler and its runs in flight, all taking batches from the same members' queues. How many
is decided here, by trying: while the pipeline's members keep batches waiting (demand above
what it delivers) and the device has room (the cores the daemon may use not all busy, with
whatever process: trainers and their workers compete for them too; the GPU's utilisation
below full, as the measuring period's mean), one more instance is started; after a
measuring period its samples/s are held against what one fewer delivered, and it stays only if
it raised them by a margin (on a CPU, half of what its idle cores could add: an instance can
fill no more than those); otherwise it goes, and no other is tried for a while. So does one
whose samples/s rose by far more than the idle cores could add: its jobs' demand changed
meanwhile, which says nothing of the instance, so another is tried soon. An instance also goes
when the members' demand
fits in one fewer (no batch waited, and fewer samples than one fewer delivered). ``dalid
serve --instances N`` pins the number instead.

A pipeline may start on more than one (``start``), started at the first look with no trial;
measurement goes on from there, up to ``max_instances``. A CPU daemon's shared pipeline runs on
two, its threads split between them, and no more (Note [Two instances on a CPU] in
registration.py).

:class:`InstanceController` is the decision alone, fed measurements and the time (tests feed
it both); ``meters.py`` takes the measurements, and each of the decision's rules names the
reading it trusts.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

# The most DALI instances measurement may give one pipeline.
MAX_INSTANCES = 8
# How long one measurement lasts, and how long a new instance runs before its is taken (its
# build, and DALI's first runs, are not what it delivers).
PERIOD_S = 5.0
SETTLE_S = 2.0
# A new instance stays if it raised samples/s by this share; on a CPU with only a few idle cores,
# by half of what those cores could add (idle over busy), at least ``MIN_MARGIN``: a shared
# pipeline whose DALI workers leave 6% of a 2-core machine idle (between runs, at an operator's
# last samples) gains at most that much from a second instance, which fills it.
MARGIN = 0.10
MIN_MARGIN = 0.02
# On a CPU, a new instance can add at most what the idle cores of the period before it could
# (their share of the busy ones); a rise past this many times that is not its doing (the jobs'
# demand changed: on a CPU whose DALI threads fill its cores, a 5 s period that holds an
# epoch's pause more or less than the next moves samples/s by 10 to 20%).
PLAUSIBLE = 2.0
# After an instance that did not pay, how long before another is tried.
HOLD_OFF_S = 120.0
# After a trial that measured a change of demand, not the instance (undecided), the next comes
# this soon, twice as late after each undecided one in a row, HOLD_OFF_S at most: a trial whose
# "before" fell in an epoch's pause (the small profile's 4 jobs: 5,568 samples/s against a steady
# 7,300) would otherwise leave a pipeline on one instance for two minutes that two serve better
# (8,308 against 7,310, pinned).
UNDECIDED_RETRY_S = 2 * PERIOD_S
# The share of a period's looks at the queues that must find batches waiting for demand to
# count as above what the pipeline delivers; below ``IDLE_SHARE`` none waits to speak of.
BUSY_SHARE = 0.5
IDLE_SHARE = 0.05
# The device counts as saturated past these: the CPU's busy cores over those the daemon may use,
# the GPU's utilisation (0 to 1). One shared pipeline's 2 DALI threads keep 2 cores 94% busy with
# batches waiting (the bench at batch 32, 4 jobs); as many jobs in-process, 97.5 to 98.5%.
CPU_SATURATED = 0.97
GPU_SATURATED = 0.95


def cpu_start(threads: int) -> tuple[int, int]:
    """How a CPU daemon's shared pipeline of ``threads`` DALI threads starts under ``auto``: its
    instances, and the threads of each (Note [Two instances on a CPU] in registration.py)."""
    if threads < 2:
        return 1, threads
    return 2, threads // 2


class Change(enum.Enum):
    # One more instance of the pipeline's own start count, within the threads and the place
    # among the daemon's pipelines that the pipeline holds already.
    START = "start"
    # One more instance, tried, which takes threads and a place of its own.
    ADD = "add"
    DROP = "drop"


@dataclass(frozen=True)
class Load:
    """One look at the pipeline and its device: samples the pipeline delivered so far, whether
    its members have batches waiting, the busy CPU cores of the ``cores`` the daemon may use
    (any process's; None: not measured) and the daemon's own share of them, the GPU's
    utilisation 0..1 (None: no GPU, or no NVML)."""

    samples: int
    waiting: bool
    cpu_busy: float | None = None
    cores: int = 0
    gpu_busy: float | None = None
    daemon_cpu: float | None = None


class InstanceController:
    """Decides, look after look, whether a shared pipeline gets one more DALI instance or one
    fewer, and says why (``reason``).

    ``pinned``: the number the operator asked for (None: decided from measurement), at most
    ``max_instances``. The caller carries out each change ``observe`` returns and reports
    ``instances`` (the count now running) on every look.
    """

    def __init__(
        self,
        *,
        pinned: int | None = None,
        max_instances: int = 1,
        period_s: float = PERIOD_S,
        settle_s: float = SETTLE_S,
        margin: float = MARGIN,
        hold_off_s: float = HOLD_OFF_S,
        start: int = 1,
    ) -> None:
        self.max_instances = max(1, max_instances)
        self.pinned = None if pinned is None else min(max(1, pinned), self.max_instances)
        self.start = min(max(1, start), self.max_instances)
        # Instances past the first still to start, each asked for once (one whose build fails
        # is not asked for again at every look).
        self._to_start = self.start - 1 if self.pinned is None else 0
        self.reason = (
            f"{_count(self.pinned)}: pinned by dalid serve --instances {pinned}"
            if self.pinned is not None
            else f"{_count(1)}: measuring whether another would help"
        )
        self._period_s = period_s
        self._settle_s = settle_s
        self._margin = margin
        self._hold_off_s = hold_off_s
        self._window: _Window | None = None
        # A trial: an instance added, measured once it settled, against ``_before``.
        self._trial_from = 0
        self._trial_since: float | None = None
        self._before = 0.0
        # samples/s each count of instances delivered while batches waited (its capacity).
        self._capacity: dict[int, float] = {}
        self._hold_until = 0.0
        self._undecided = 0  # trials in a row that measured a change of demand
        self._changed = False  # whether it has changed the count yet
        # The share the trial's instance must raise samples/s by (``_margin_for``), and on a
        # CPU, the most it could (``_cpu_room``: None where a GPU is measured).
        self._required = margin
        self._most: float | None = None

    def observe(self, now: float, instances: int, load: Load) -> Change | None:
        """One look; the change to make now, if any (``reason`` then says why)."""
        if self.pinned is not None:
            return self._pinned(instances)
        if self._to_start:
            self._to_start -= 1
            if instances < self.start:
                self.reason = f"{_count(self.start)} from the start, its threads split between them"
                return Change.START
        if self._trial_since is not None:
            if instances <= self._trial_from:
                # The new instance did not start (no room for it): no trial to judge.
                self._trial_since = None
                self._hold_until = now + self._hold_off_s
                self.reason = (
                    f"{_count(instances)}: another could not start (no room "
                    "in --max-threads or --max-daemon-pipelines, or its build failed)"
                )
                self._window = None
                return None
            if now - self._trial_since < self._settle_s:
                return None
        window = self._window
        if window is None:
            self._window = _Window(now, load.samples)
            return None
        window.look(load)
        if load.waiting and window.waited == 1 and window.looks > 1:
            # Demand began inside this period (jobs start after their pipeline is built): it
            # is measured from here, so that what a job waits for is not a period of idling.
            self._window = _Window(now, load.samples)
            self._window.look(load)
            return None
        if now - window.start < self._period_s:
            return None
        self._window = _Window(now, load.samples)
        rate = (load.samples - window.samples) / (now - window.start)
        device = _device_text(load, window)
        if self._trial_since is not None:
            return self._judge(now, instances, rate, window, device)
        waiting = window.waiting_share
        if waiting >= BUSY_SHARE:
            self._capacity[instances] = rate
        if (
            waiting >= BUSY_SHARE
            and instances < self.max_instances
            and now >= self._hold_until
            and not window.saturated
        ):
            self._trial_from, self._trial_since, self._before = instances, now, rate
            self._required = self._margin_for(window)
            self._most = _cpu_room(window)
            self._changed = True
            self.reason = (
                f"trying {_count(instances + 1)}: batches waited at {_rate(rate)} samples/s "
                f"with {instances}, and the device had room; {device}"
            )
            return Change.ADD
        fewer = self._capacity.get(instances - 1)
        if (
            instances > 1
            and waiting <= IDLE_SHARE
            and fewer is not None
            and rate < fewer * (1 - self._margin)
        ):
            self.reason = (
                f"{_count(instances - 1)}: down from {instances}, as a demand of {_rate(rate)} "
                f"samples/s fits in what {instances - 1} delivered ({_rate(fewer)}); {device}"
            )
            return Change.DROP
        if instances == 1 and not self._changed:
            # Until a first change, the latest measurement says why there is one; after, the
            # latest change does.
            why = (
                "the device is busy"
                if window.saturated and waiting >= BUSY_SHARE
                else "batches do not wait for it"
            )
            self.reason = f"{_count(1)}: {why} ({_rate(rate)} samples/s); {device}"
        return None

    def started(self, now: float) -> None:
        """The instance of the latest ADD is built and running: its settling starts now."""
        if self._trial_since is not None:
            self._trial_since = now
            self._window = None

    def _margin_for(self, window: _Window) -> float:
        """What a new instance must raise samples/s by: ``margin``, or on a CPU (no GPU measured)
        half of what its idle cores could add, if less (at least MIN_MARGIN)."""
        room = _cpu_room(window)
        if room is None:
            return self._margin
        return min(self._margin, max(MIN_MARGIN, room / 2))

    def _judge(
        self, now: float, instances: int, rate: float, window: _Window, device: str
    ) -> Change | None:
        before, was = self._before, self._trial_from
        self._trial_since = None
        if self._most is not None and rate > before * (1 + PLAUSIBLE * self._most):
            # More than its idle cores could add: what its jobs asked for changed meanwhile
            # (a pause of theirs in the period before, say), so this measured demand, not
            # the instance. It goes, undecided: another is tried soon (UNDECIDED_RETRY_S).
            retry_s = min(self._hold_off_s, UNDECIDED_RETRY_S * 2**self._undecided)
            self._undecided += 1
            self._hold_until = now + retry_s
            self.reason = (
                f"{_count(was)}: going from {was} to {instances} gave {_rate(rate)} samples/s "
                f"against {_rate(before)}, more than the idle cores could add "
                f"(+{self._most:.0%}): demand changed, so back to {was}, next try in "
                f"{retry_s:.0f} s; {device}"
            )
            return Change.DROP
        self._undecided = 0
        if rate >= before * (1 + self._required):
            if window.waiting_share >= BUSY_SHARE:
                self._capacity[instances] = rate
            self.reason = (
                f"{_count(instances)}: going from {was} to {instances} raised {_rate(before)} "
                f"to {_rate(rate)} samples/s; {device}"
            )
            return None
        self._hold_until = now + self._hold_off_s
        self.reason = (
            f"{_count(was)}: going from {was} to {instances} gave {_rate(rate)} samples/s "
            f"against {_rate(before)} (under +{self._required:.0%}), so back to {was}, next try in "
            f"{self._hold_off_s:.0f} s; {device}"
        )
        return Change.DROP

    def _pinned(self, instances: int) -> Change | None:
        assert self.pinned is not None
        if instances < self.pinned:
            return Change.ADD
        if instances > self.pinned:
            return Change.DROP
        return None


class _Window:
    """One measuring period: where it started, and what its looks found; the device's load is
    the mean of the period's readings (each covers the time since the previous one, and looks
    come at a steady pace), not its last: a period whose last quarter of a second fell in a
    pause of its jobs (an epoch's end) read as an idle device."""

    def __init__(self, start: float, samples: int) -> None:
        self.start = start
        self.samples = samples
        self.looks = 0
        self.waited = 0
        self.cores = 0
        self._cpu = _Mean()
        self._gpu = _Mean()
        self._daemon = _Mean()

    def look(self, load: Load) -> None:
        self.looks += 1
        self.waited += load.waiting
        self.cores = load.cores or self.cores
        self._cpu.add(load.cpu_busy)
        self._gpu.add(load.gpu_busy)
        self._daemon.add(load.daemon_cpu)

    @property
    def cpu_busy(self) -> float | None:
        return self._cpu.value

    @property
    def gpu_busy(self) -> float | None:
        return self._gpu.value

    @property
    def daemon_cpu(self) -> float | None:
        return self._daemon.value

    @property
    def waiting_share(self) -> float:
        return self.waited / self.looks if self.looks else 0.0

    @property
    def saturated(self) -> bool:
        if self.cpu_busy is not None and self.cores and self.cpu_busy >= CPU_SATURATED * self.cores:
            return True
        return self.gpu_busy is not None and self.gpu_busy >= GPU_SATURATED


class _Mean:
    """The mean of the readings a meter gave (None: it gave none)."""

    def __init__(self) -> None:
        self.total = 0.0
        self.count = 0

    def add(self, reading: float | None) -> None:
        if reading is not None:
            self.total += reading
            self.count += 1

    @property
    def value(self) -> float | None:
        return self.total / self.count if self.count else None


def _cpu_room(window: _Window) -> float | None:
    """On a CPU (no GPU measured): what the period's idle cores could add to its busy ones,
    as a share of them; None where the CPU was not measured or a GPU was."""
    if window.gpu_busy is not None or window.cpu_busy is None or not window.cores:
        return None
    busy = max(window.cpu_busy, 1e-3)
    return max(window.cores - busy, 0.0) / busy


def _device_text(load: Load, window: _Window) -> str:
    parts = []
    if window.cpu_busy is not None and window.cores:
        daemon = (
            "" if window.daemon_cpu is None else f", {window.daemon_cpu:.1f} of them the daemon's"
        )
        parts.append(f"CPU {window.cpu_busy:.1f} of {window.cores} cores busy{daemon}")
    if window.gpu_busy is not None:
        parts.append(f"GPU {window.gpu_busy:.0%} busy")
    return ", ".join(parts) or "device load not measured"


def _count(instances: int) -> str:
    return f"{instances} DALI instance{_s(instances)}"


def _rate(rate: float) -> str:
    return f"{rate:,.0f}"


def _s(count: int) -> str:
    return "" if count == 1 else "s"
