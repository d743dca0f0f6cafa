"""The proxy implementation a conformance case runs on, and the device it runs for.

Every case takes ``dali_proxy`` (the proxy module, as DALI's tests import it) and is run once per
implementation: ``dali`` is DALI's own ``nvidia.dali.plugin.pytorch.experimental.proxy`` (its
pipeline in a thread of this process), ``dalid`` is ``dalid.client.proxy`` finding the test
daemon of the case's device through ``$DALID_SOCKET``, as a user's code would. A case for the
GPU (``device`` "gpu", marked ``gpu``) skips without CUDA; its dalid runs get a daemon of GPU 0.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
import torch

from dalid.client import proxy as dalid_proxy

from .. import foreign
from ..daemons import DaemonProcess, own_directory, start_daemon
from ..integration import dropin_examples
from . import leftovers

DALI_PROXY = "nvidia.dali.plugin.pytorch.experimental.proxy"
IMPLEMENTATIONS = ["dali", "dalid"]


@pytest.fixture
def device() -> str:
    """The device of DALI's test parameters; cases parametrise it, the rest run on the CPU."""
    return "cpu"


@pytest.fixture(scope="module", autouse=True)
def daemons(daemon: DaemonProcess) -> Iterator[dict[str, DaemonProcess]]:
    """The module's daemons by device: the CPU daemon, and one of GPU 0 where CUDA is.

    Started with the module, before the per-test leak checks take their first snapshot, so
    that they are not blamed on the first case that uses them."""
    if not torch.cuda.is_available():
        yield {"cpu": daemon}
        return
    gpu = start_daemon(own_directory(), "--device", "0", name="gpu0")
    try:
        yield {"cpu": daemon, "gpu": gpu}
    finally:
        code = gpu.stop()
        assert code == 0, f"daemon exited with {code}:\n{gpu.log_text()}"
        assert not gpu.segments(), "daemon left shared memory"


@pytest.fixture(params=IMPLEMENTATIONS)
def dali_proxy(
    request: pytest.FixtureRequest,
    device: str,
    daemons: dict[str, DaemonProcess],
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[ModuleType]:
    """The proxy module of the implementation under test, ready for ``device``.

    DALI's own proxy is not dalid's code: what it leaves is put away after its case
    (:mod:`.leftovers`), and a native thread nobody named that its case leaves is its own
    (:mod:`tests.foreign`). dalid's cases get neither: the leak checks judge them in full."""
    if device == "gpu" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU and a CUDA build of torch")
    if request.param == "dalid":
        monkeypatch.setenv("DALID_SOCKET", str(daemons[device].socket))
        yield dalid_proxy
        return
    if not torch.cuda.is_available():
        # DALI's proxy calls NVTX unconditionally, which a CPU-only torch refuses.
        monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda *args, **kwargs: None)
        monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda *args, **kwargs: None)
    request.node.stash[foreign.FOREIGN_CODE] = "DALI's own proxy"
    before = leftovers.made_so_far()
    yield importlib.import_module(DALI_PROXY)
    leftovers.put_away(before)


@pytest.fixture(scope="session")
def jpeg(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DALI's tests read DALI_extra's ``db/single/jpeg``; here, an image folder of 3 classes of
    8 JPEGs each, of varied sizes."""
    root = tmp_path_factory.mktemp("conformance") / "jpeg"
    return dropin_examples.make_image_folder(root, classes=3, per_class=8)
