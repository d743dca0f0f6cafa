"""Autostart where the daemon cannot serve: the trainer learns the daemon's own reason at once.

A trainer with autostart starts the default daemon of its device; one that exits before it
answers (a GPU pipeline on a machine whose GPU the daemon cannot use) raises at once, quoting
what the daemon logged of this start only, never earlier starts' lines of the same log.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

import dalid.client as dalid
from dalid.client.link.launcher import log_path
from dalid.protocol import socket_path

EARLIER = "2026-01-01 00:00:00,000 dalid[1] ERROR an earlier start's failure"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine whose GPU 0 is unusable")
def test_a_gpu_daemon_that_cannot_serve_fails_the_connect_at_once_with_its_reason(
    private_runtime_dir: Path,
) -> None:
    log = log_path(socket_path(0))
    log.write_text(EARLIER + "\n")
    try:
        started = time.monotonic()
        with pytest.raises(dalid.DaemonUnavailable) as raised:
            dalid.connect(device=0, autostart=True)
        waited = time.monotonic() - started
        message = str(raised.value)
    finally:
        log.unlink()
    # The daemon exits within a second or two; the old way waited out the 60 s connect timeout.
    assert waited < 20, f"{waited:.1f} s: {message}"
    # The cause first: the daemon's own reason, before any quoted log.
    cause, _, quoted = message.partition("Its log")
    assert "exited before it answered: cannot serve GPU 0" in cause, message
    assert "a restart cannot fix" in cause, message
    # This start's lines only.
    assert "an earlier start's failure" not in message
    assert "cannot serve GPU 0" in quoted
    # Advice that fits a call that had autostart on: what to do instead, not autostart=True.
    assert "autostart=True" not in message
    assert "device_id=None" in message
    assert not socket_path(0).exists()
