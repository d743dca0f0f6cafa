"""tests.host_sync: torch's synchronization debug mode is restored whatever happens, even when
setting it raises (torch warns after setting it, and warnings are errors in the tests).

torch's CPU build has no such mode, so its two calls are stood in for here; the GPU tests
(tests/integration/test_gpu.py, test_gpu_staged.py) use the real ones.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from tests import host_sync


class Mode:
    """torch.cuda's get/set_sync_debug_mode, as torch behaves: set, then warn."""

    def __init__(self) -> None:
        self.value = 0

    def get(self) -> int:
        return self.value

    def set(self, mode: int | str) -> None:
        self.value = mode if isinstance(mode, int) else {"default": 0, "warn": 1, "error": 2}[mode]
        if self.value:
            warnings.warn(
                "Synchronization debug mode is a prototype feature", UserWarning, stacklevel=2
            )


@pytest.fixture
def mode(monkeypatch: pytest.MonkeyPatch) -> Mode:
    stand_in = Mode()
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", stand_in.get)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", stand_in.set)
    return stand_in


def test_the_mode_is_on_inside_and_restored_after(mode: Mode) -> None:
    with host_sync.host_syncs_raise():
        assert mode.value == 2
    assert mode.value == 0


def test_the_mode_is_restored_when_the_block_fails(mode: Mode) -> None:
    with pytest.raises(RuntimeError, match="a host sync"), host_sync.host_syncs_raise():
        raise RuntimeError("a host sync")
    assert mode.value == 0


def test_the_mode_is_restored_when_its_warning_is_an_error(mode: Mode) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(UserWarning, match="prototype"), host_sync.host_syncs_raise():
            pass
    assert mode.value == 0


def test_the_warning_is_filtered_by_its_message_in_the_tests(mode: Mode) -> None:
    # pyproject.toml's filterwarnings, as pytest applies them to this test.
    with host_sync.host_syncs_raise():
        assert mode.value == 2
    assert mode.value == 0


def test_nothing_to_reset_without_cuda() -> None:
    if torch.cuda.is_available():
        pytest.skip("this process has CUDA")
    assert host_sync.reset_if_left_on() == 0
