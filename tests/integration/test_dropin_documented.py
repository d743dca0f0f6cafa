"""The examples of DALI's proxy tutorial, each run twice: with DALI's proxy, then with dalid's.

Each test runs one body of :mod:`dropin_examples` with the proxy module as its argument, once
with ``nvidia.dali.plugin.pytorch.experimental.proxy`` (in this process, its pipeline in a
thread) and once with ``dalid.client.proxy`` (the test daemon found through ``$DALID_SOCKET``),
and requires the same outputs. The pipelines have no random operator, so equal means equal.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from dalid.client import proxy as dalid_proxy

from ..daemons import DaemonProcess
from . import dropin_examples as examples
from .test_dropin import CLASSES, IMAGES_PER_CLASS, dalis_own_proxy


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return examples.make_image_folder(
        tmp_path_factory.mktemp("documented") / "images",
        classes=CLASSES,
        per_class=IMAGES_PER_CLASS,
    )


@pytest.fixture
def both(daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> tuple[ModuleType, ModuleType]:
    """(DALI's proxy module, dalid's), dalid's finding the test daemon by environment."""
    monkeypatch.setenv("DALID_SOCKET", str(daemon.socket))
    return dalis_own_proxy(monkeypatch), dalid_proxy


def assert_same_batches(theirs: list[Any], ours: list[Any]) -> None:
    assert len(ours) == len(theirs) > 0
    for their_batch, our_batch in zip(theirs, ours, strict=True):
        assert len(our_batch) == len(their_batch)
        for expected, got in zip(their_batch, our_batch, strict=True):
            if isinstance(expected, torch.Tensor):
                assert isinstance(got, torch.Tensor)
                assert got.dtype == expected.dtype and got.shape == expected.shape
                assert torch.equal(got, expected)
            else:
                assert got == expected


def test_nutshell_image_folder_with_its_default_pil_loader(
    both: tuple[ModuleType, ModuleType], root: Path
) -> None:
    dali, dalid = both
    theirs = examples.nutshell(dali, root)
    ours = examples.nutshell(dalid, root)
    assert_same_batches(theirs, ours)
    data, _ = ours[0]
    assert data.shape == (8, 3, 96, 96) and data.std() > 0.1


def test_two_inputs_by_keyword_and_by_position(both: tuple[ModuleType, ModuleType]) -> None:
    dali, dalid = both
    their_inputs, theirs = examples.two_inputs(dali)
    our_inputs, ours = examples.two_inputs(dalid)
    for (a, b), (our_a, our_b) in zip(their_inputs, our_inputs, strict=True):
        assert (a == our_a).all() and (b == our_b).all()
    assert_same_batches([theirs], [ours])
    all_a = torch.stack([torch.from_numpy(a) for a, _ in our_inputs])
    all_b = torch.stack([torch.from_numpy(b) for _, b in our_inputs])
    assert torch.equal(ours[0], all_a + all_b) and torch.equal(ours[1], all_b - all_a)
    # Several inputs go by keyword only, in both: the tutorial's proxy(a, b) is refused.
    their_error = examples.positional_two_inputs(dali)
    our_error = examples.positional_two_inputs(dalid)
    assert isinstance(their_error, ValueError)
    assert isinstance(our_error, ValueError)
    assert "by keyword" in str(our_error) and "a=" in str(our_error)
    # DALI's own words are in dalid's message, for code that matches them.
    assert "too many positional arguments" in str(their_error)
    assert "too many positional arguments" in str(our_error)


def test_produce_data_on_nested_structures(both: tuple[ModuleType, ModuleType], root: Path) -> None:
    dali, dalid = both
    theirs = examples.nested_structures(dali, root)
    ours = examples.nested_structures(dalid, root)
    assert [len(label) for _, label, _ in ours] == [5, 5, 5, 5, 4]
    assert_same_batches(theirs, ours)


def test_explicit_start_thread_and_stop_thread(
    both: tuple[ModuleType, ModuleType], root: Path
) -> None:
    dali, dalid = both
    theirs = examples.explicit_threads(dali, root)
    ours = examples.explicit_threads(dalid, root)
    assert_same_batches(theirs, ours)


def test_custom_dataloader_with_produce_data(
    both: tuple[ModuleType, ModuleType], root: Path
) -> None:
    dali, dalid = both
    theirs = examples.custom_loader(dali, root)
    ours = examples.custom_loader(dalid, root)
    assert [count for _, _, count in ours] == [8, 8, 8]
    assert_same_batches(theirs, ours)
