"""The daemon loop's timed chores (dalid.server.intake.chores), on a real CPU core: the idle
timeout, the metrics' snapshots and when the loop must wake for them."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from dalid.protocol import PROTOCOL_VERSION, Hello, Role, StatusReport, Welcome
from dalid.server.handling.core import DaemonCore
from dalid.server.intake.chores import REAP_INTERVAL_S, SNAPSHOT_INTERVAL_S, Chores
from dalid.server.intake.intake import Intake, IntakeLimits
from dalid.server.jobs.quotas import Quotas
from dalid.server.outputs.shm import host_outputs

TRAINER = b"trainer"


@pytest.fixture
def core() -> Iterator[DaemonCore]:
    core = DaemonCore(
        "cpu",
        host_outputs(),
        lambda peer, message, rid: None,
        Quotas(max_batch_size=64, pool_bytes=1 << 20, slab_bytes=1 << 16),
        instance=f"unittest-{uuid.uuid4().hex[:8]}",
    )
    yield core
    core.close()


def test_without_jobs_for_its_timeout_the_daemon_exits_and_a_job_holds_it(
    core: DaemonCore,
) -> None:
    chores = Chores(core, Intake(IntakeLimits()), 100.0, idle_timeout=5.0, publish=None)
    # Asleep until the reap at most; the idle deadline is later.
    assert chores.sleep_ms(100.0, None) == int(REAP_INTERVAL_S * 1000) + 1
    assert not chores.run(104.5)
    assert chores.sleep_ms(104.5, None) == 501  # woken at the idle deadline, not the reap
    assert chores.run(105.0)
    welcome = core.handle(TRAINER, Hello(PROTOCOL_VERSION, os.getpid(), Role.TRAINER), 1)
    assert isinstance(welcome, Welcome)
    assert not chores.run(200.0), "a daemon with a job is not idle"
    core.close_job(core.jobs[welcome.job_id])
    assert not chores.run(201.0), "idle again from its job's end, not from before"
    assert chores.run(206.0)


def test_snapshots_are_made_each_interval_while_they_are_published(core: DaemonCore) -> None:
    published: list[StatusReport] = []
    chores = Chores(
        core, Intake(IntakeLimits()), 100.0, idle_timeout=None, publish=published.append
    )
    assert chores.sleep_ms(100.0, None) == int(SNAPSHOT_INTERVAL_S * 1000) + 1
    assert chores.sleep_ms(100.0, 0.25) == 251  # a cut connection's grace, sooner
    chores.run(100.5)
    assert published == []
    chores.run(100.0 + SNAPSHOT_INTERVAL_S)
    assert len(published) == 1 and published[0].jobs == ()
    chores.run(100.0 + SNAPSHOT_INTERVAL_S + 0.5)
    assert len(published) == 1
    silent = Chores(core, Intake(IntakeLimits()), 100.0, idle_timeout=None, publish=None)
    silent.run(150.0)
    assert silent.sleep_ms(150.0, None) == int(REAP_INTERVAL_S * 1000) + 1
