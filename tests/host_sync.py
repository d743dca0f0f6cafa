"""torch's synchronization debug mode for the GPU tests: on for the span that must not wait on
the GPU, and always back to what it was.

``torch.cuda.set_sync_debug_mode("error")`` sets the mode and then warns that it is a prototype
feature; under ``filterwarnings = error`` that warning (filtered by its message in
pyproject.toml) would raise with the mode already set, and every later test would fail on its
first host synchronization. Setting it inside ``try`` and restoring it in ``finally`` keeps one
test's failure its own; the ``sync_debug_mode_restored`` fixture (tests/conftest.py) checks
after every test that the mode is the default again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def host_syncs_raise() -> Iterator[None]:
    """Inside the block, any host synchronization by torch raises."""
    previous = torch.cuda.get_sync_debug_mode()
    try:
        torch.cuda.set_sync_debug_mode("error")
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def reset_if_left_on() -> int:
    """Sets the mode back to the default where it is not (a test left it on); the mode found
    (0: the default, or CUDA never used in this process)."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return 0
    mode = torch.cuda.get_sync_debug_mode()
    if mode != 0:
        torch.cuda.set_sync_debug_mode(0)
    return mode
