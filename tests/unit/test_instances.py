"""How many DALI instances a shared pipeline gets: the controller's decisions, fed a fake clock
and fake measurements (the real path, a daemon with two instances, is in
tests/integration/test_instances.py)."""

from __future__ import annotations

import time

import pytest

from dalid.server.runs.instances import Change, InstanceController, Load, cpu_start
from dalid.server.runs.meters import CpuMeter, GpuMeter

PERIOD = 5.0
SETTLE = 2.0
HOLD_OFF = 120.0
LOOK = 0.5


class Pipeline:
    """A fake pipeline under the controller: it delivers ``rates[n]`` samples/s on n instances,
    its members' batches wait or not, on a CPU of 2 cores ``cpu_busy`` busy. It carries out
    what the controller asks, as the executor does."""

    def __init__(self, controller: InstanceController, rates: dict[int, float]) -> None:
        self.controller = controller
        self.rates = rates
        self.instances = 1
        self.now = 0.0
        self.samples = 0.0
        self.waiting = True
        self.cpu_busy: float | None = 1.0
        self.gpu_busy: float | None = None
        self.changes: list[tuple[float, Change, int]] = []

    def run(self, seconds: float) -> None:
        end = self.now + seconds
        while self.now < end:
            self.now += LOOK
            self.samples += self.rates[self.instances] * LOOK
            load = Load(int(self.samples), self.waiting, self.cpu_busy, 2, self.gpu_busy)
            change = self.controller.observe(self.now, self.instances, load)
            if change in (Change.START, Change.ADD):
                self.instances += 1
                self.controller.started(self.now)  # built at once
            elif change is Change.DROP:
                self.instances -= 1
            if change is not None:
                self.changes.append((self.now, change, self.instances))


def controller(
    pinned: int | None = None, start: int = 1, max_instances: int = 4
) -> InstanceController:
    return InstanceController(
        pinned=pinned,
        max_instances=max_instances,
        period_s=PERIOD,
        settle_s=SETTLE,
        hold_off_s=HOLD_OFF,
        start=start,
    )


def test_an_instance_that_raises_throughput_stays_and_status_says_by_how_much() -> None:
    pipeline = Pipeline(controller(), {1: 8100.0, 2: 11900.0, 3: 12000.0, 4: 12000.0})
    pipeline.run(3 * PERIOD)
    assert pipeline.instances == 2
    assert pipeline.changes[0][1:] == (Change.ADD, 2)
    reason = pipeline.controller.reason
    # Past the trial of a second instance, a third was tried: it did not pay and went.
    pipeline.run(2 * PERIOD)
    assert [change for _, change, _ in pipeline.changes] == [Change.ADD, Change.ADD, Change.DROP]
    assert pipeline.instances == 2
    assert reason.startswith("2 DALI instances: going from 1 to 2 raised 8,100 to 11,900 samples/s")
    assert "CPU 1.0 of 2 cores busy" in reason
    assert pipeline.controller.reason.startswith(
        "2 DALI instances: going from 2 to 3 gave 12,000 samples/s against 11,900 (under +10%), "
        "so back to 2, next try in 120 s"
    )


def test_an_instance_that_does_not_pay_goes_and_none_is_tried_for_a_while() -> None:
    pipeline = Pipeline(controller(), {1: 10000.0, 2: 10500.0})
    pipeline.run(2 * PERIOD + SETTLE + LOOK)
    assert [(change, n) for _, change, n in pipeline.changes] == [
        (Change.ADD, 2),
        (Change.DROP, 1),
    ]
    dropped_at = pipeline.changes[-1][0]
    pipeline.run(HOLD_OFF - PERIOD)
    assert len(pipeline.changes) == 2, "another instance was tried during the hold-off"
    assert pipeline.controller.reason.startswith(
        "1 DALI instance: going from 1 to 2 gave 10,500 samples/s"
    )
    pipeline.run(2 * PERIOD)
    assert pipeline.changes[2][1] is Change.ADD and pipeline.changes[2][0] >= dropped_at + HOLD_OFF


def test_no_instance_is_added_while_batches_do_not_wait() -> None:
    pipeline = Pipeline(controller(), {1: 5000.0, 2: 9000.0})
    pipeline.waiting = False
    pipeline.run(5 * PERIOD)
    assert pipeline.changes == []
    assert pipeline.controller.reason.startswith(
        "1 DALI instance: batches do not wait for it (5,000 samples/s); CPU 1.0 of 2 cores busy"
    )


@pytest.mark.parametrize(
    ("cpu_busy", "gpu_busy"), [(1.96, None), (0.5, 0.97)], ids=["cpu-busy", "gpu-busy"]
)
def test_no_instance_is_added_on_a_saturated_device(
    cpu_busy: float, gpu_busy: float | None
) -> None:
    pipeline = Pipeline(controller(), {1: 5000.0, 2: 9000.0})
    pipeline.cpu_busy, pipeline.gpu_busy = cpu_busy, gpu_busy
    pipeline.run(5 * PERIOD)
    assert pipeline.changes == []
    assert pipeline.controller.reason.startswith("1 DALI instance: the device is busy")
    if gpu_busy is not None:
        assert "GPU 97% busy" in pipeline.controller.reason


@pytest.mark.parametrize(("with_two", "kept"), [(1040.0, True), (1015.0, False)])
def test_on_a_cpu_with_a_few_idle_cores_an_instance_must_fill_half_of_them(
    with_two: float, kept: bool
) -> None:
    """A shared pipeline's DALI workers leave 2 cores 94% busy with batches waiting: room for
    another instance, which must raise samples/s by half of what the idle 0.12 cores could add
    over the busy 1.88 (3.2%), not by the 10% asked where a device has plenty of room."""
    pipeline = Pipeline(controller(), {1: 1000.0, 2: with_two})
    pipeline.cpu_busy = 1.88
    pipeline.run(2 * PERIOD + SETTLE + LOOK)
    assert pipeline.changes[0][1:] == (Change.ADD, 2)
    assert pipeline.instances == (2 if kept else 1)
    reason = pipeline.controller.reason
    if kept:
        assert reason.startswith(
            "2 DALI instances: going from 1 to 2 raised 1,000 to 1,040 samples/s"
        )
    else:
        assert "gave 1,015 samples/s against 1,000 (under +3%), so back to 1" in reason


def test_a_cpu_busy_through_a_period_is_busy_though_its_last_reading_was_not() -> None:
    # The jobs paused at the period's end (an epoch's end): the period's mean says the device
    # was busy; its last reading alone said it had room, and a second instance was tried.
    pipeline = Pipeline(controller(), {1: 1000.0, 2: 1000.0})
    pipeline.cpu_busy = 2.0
    pipeline.run(LOOK)  # the first look starts the first period
    for _ in range(5):
        pipeline.run(PERIOD - LOOK)
        pipeline.cpu_busy = 1.6
        pipeline.run(LOOK)
        pipeline.cpu_busy = 2.0
    assert pipeline.changes == []
    assert pipeline.controller.reason.startswith("1 DALI instance: the device is busy")
    assert "CPU 2.0 of 2 cores busy" in pipeline.controller.reason


def test_a_rise_past_what_the_idle_cores_could_add_is_not_the_new_instances() -> None:
    # 1.9 of 2 cores busy: a second instance adds 5% at most; 20% more samples/s in its period
    # is the jobs' demand changing (DALI's threads already filled the cores), and it goes.
    pipeline = Pipeline(controller(), {1: 1000.0, 2: 1200.0})
    pipeline.cpu_busy = 1.9
    pipeline.run(2 * PERIOD + SETTLE + LOOK)
    assert [(change, n) for _, change, n in pipeline.changes] == [
        (Change.ADD, 2),
        (Change.DROP, 1),
    ]
    assert pipeline.controller.reason.startswith(
        "1 DALI instance: going from 1 to 2 gave 1,200 samples/s against 1,000, more than the "
        "idle cores could add (+5%): demand changed, so back to 1, next try in 10 s"
    )


def test_after_a_change_of_demand_the_next_trial_comes_soon_and_then_later() -> None:
    """A trial that measured demand, not the instance, decided nothing: the next comes after
    10 s, then 20, 40, ... up to the hold-off, not two minutes later; one that decides resets
    the delay."""
    pipeline = Pipeline(controller(), {1: 1000.0, 2: 1200.0})
    pipeline.cpu_busy = 1.9
    pipeline.run(2 * PERIOD + SETTLE + LOOK)
    undecided_at = pipeline.changes[-1][0]
    pipeline.run(10.0 + 2 * PERIOD + SETTLE + LOOK)
    adds = [when for when, change, _ in pipeline.changes if change is Change.ADD]
    assert len(adds) == 2 and adds[1] - undecided_at <= 10.0 + PERIOD + LOOK
    assert "demand changed, so back to 1, next try in 20 s" in pipeline.controller.reason
    # Now the second instance pays within what the idle cores could add: it stays.
    pipeline.rates[2] = 1040.0
    pipeline.rates[3] = 1040.0
    pipeline.run(20.0 + 2 * PERIOD + SETTLE + LOOK)
    assert [(change, n) for _, change, n in pipeline.changes][:6] == [
        (Change.ADD, 2),
        (Change.DROP, 1),
        (Change.ADD, 2),
        (Change.DROP, 1),
        (Change.ADD, 2),
        (Change.ADD, 3),  # kept the second; trying a third
    ]


def test_a_period_is_measured_from_when_batches_began_to_wait() -> None:
    """A pipeline is built when its first job registers, and idles until its jobs start: the
    first trial comes a period after the batches began to wait, not a period later still."""
    pipeline = Pipeline(controller(), {1: 1000.0, 2: 2000.0})
    pipeline.waiting = False
    pipeline.run(PERIOD - 2 * LOOK)
    pipeline.waiting = True
    began = pipeline.now
    pipeline.run(PERIOD + 2 * LOOK)
    assert pipeline.changes and pipeline.changes[0][1] is Change.ADD
    assert pipeline.changes[0][0] <= began + PERIOD + LOOK


def test_an_instance_goes_once_the_demand_fits_in_one_fewer() -> None:
    pipeline = Pipeline(controller(), {1: 8000.0, 2: 14000.0, 3: 14000.0, 4: 14000.0})
    pipeline.run(2 * PERIOD + SETTLE + LOOK)  # up to the end of the second's trial
    assert pipeline.instances == 2
    # A job left: the rest ask for less than one instance delivered, and nothing waits.
    pipeline.waiting = False
    pipeline.rates[1] = pipeline.rates[2] = 3000.0
    pipeline.run(3 * PERIOD)
    assert pipeline.instances == 1
    assert pipeline.changes[-1][1] is Change.DROP
    assert pipeline.controller.reason.startswith(
        "1 DALI instance: down from 2, as a demand of 3,000 samples/s fits in what 1 delivered "
        "(8,000)"
    )


def test_a_pinned_count_is_reached_and_kept_whatever_is_measured() -> None:
    pinned = controller(pinned=3)
    pipeline = Pipeline(pinned, {1: 100.0, 2: 100.0, 3: 100.0})
    pipeline.waiting = False
    pipeline.run(4 * PERIOD)
    assert pipeline.instances == 3
    assert pinned.reason == "3 DALI instances: pinned by dalid serve --instances 3"
    assert [n for _, _, n in pipeline.changes] == [2, 3]


def test_an_instance_that_cannot_start_is_no_trial_and_says_so() -> None:
    pipeline = Pipeline(controller(), {1: 8000.0, 2: 16000.0})
    decisions = []  # the executor found no threads for another: the count stays 1
    for step in range(int(3 * PERIOD / LOOK)):
        now = (step + 1) * LOOK
        change = pipeline.controller.observe(now, 1, Load(int(8000 * now), True, 1.0, 2))
        decisions.append(change)
    assert decisions.count(Change.ADD) == 1
    assert "another could not start" in pipeline.controller.reason


def test_a_cpu_pipeline_splits_its_threads_between_two_instances() -> None:
    # Note [Two instances on a CPU]: as many DALI threads as before, over two instances.
    assert cpu_start(1) == (1, 1)
    assert cpu_start(2) == (2, 1)
    assert cpu_start(3) == (2, 1)
    assert cpu_start(16) == (2, 8)


def test_a_pipeline_that_starts_on_two_gets_the_second_at_its_first_look_then_measures() -> None:
    pipeline = Pipeline(controller(start=2), {1: 8000.0, 2: 11000.0, 3: 11100.0})
    pipeline.run(LOOK)
    assert pipeline.changes == [(LOOK, Change.START, 2)]
    assert pipeline.controller.reason == (
        "2 DALI instances from the start, its threads split between them"
    )
    # From there the controller measures as ever: a third is tried, does not pay, and goes.
    pipeline.run(3 * PERIOD)
    assert [(change, n) for _, change, n in pipeline.changes] == [
        (Change.START, 2),
        (Change.ADD, 3),
        (Change.DROP, 2),
    ]
    assert "going from 2 to 3 gave 11,100 samples/s against 11,000" in pipeline.controller.reason


def test_a_cpu_pipeline_on_its_two_instances_tries_no_third() -> None:
    # Note [Two instances on a CPU]: as registration.py makes it, two at most.
    pipeline = Pipeline(controller(start=2, max_instances=2), {1: 8000.0, 2: 11000.0})
    pipeline.run(10 * PERIOD)  # batches wait throughout, and the CPU has room
    assert pipeline.changes == [(LOOK, Change.START, 2)]


def test_a_second_instance_that_cannot_start_is_not_asked_for_again() -> None:
    pipeline = Pipeline(controller(start=2), {1: 8000.0})
    pipeline.waiting = False  # no trials either
    changes = [
        pipeline.controller.observe(step * LOOK, 1, Load(int(8000 * step * LOOK), False, 1.0, 2))
        for step in range(1, int(2 * PERIOD / LOOK))
    ]
    assert changes.count(Change.START) == 1 and Change.ADD not in changes


def test_a_pinned_count_wins_over_where_a_pipeline_starts() -> None:
    pipeline = Pipeline(controller(pinned=1, start=2), {1: 8000.0, 2: 16000.0})
    pipeline.run(2 * PERIOD)
    assert pipeline.instances == 1 and not pipeline.changes


def test_meters_read_this_process_and_no_gpu_without_nvml() -> None:
    cpu = CpuMeter()
    assert cpu.cores >= 1
    assert sum(range(3_000_000)) > 0  # some CPU time
    # Busy cores over at least 0.2 s of wall time (a shorter wait says nothing).
    time.sleep(0.25)
    read = cpu.read()
    assert read is not None
    busy, own = read
    assert 0.0 < own <= busy <= cpu.cores
    assert cpu.read() is None  # right after a reading: too short a time to say
    assert GpuMeter(None).read() is None
    assert GpuMeter(0).read() is None or 0.0 <= (GpuMeter(0).read() or 0.0) <= 1.0
