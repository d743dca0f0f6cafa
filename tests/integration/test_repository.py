"""The daemon's pipeline repository (`dalid serve --pipelines DIR`), with a real daemon."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

import dalid.client as dalid

from ..daemons import DaemonProcess, own_directory, start_daemon
from .helpers import BATCH, ProxyDataset, sample

REPOSITORY = Path(__file__).with_name("repository")


@pytest.fixture(scope="module")
def repository_daemon() -> Iterator[DaemonProcess]:
    directory = own_directory()
    running = start_daemon(
        directory, "--pipelines", str(REPOSITORY), "--repository-operators", "PythonFunction"
    )
    try:
        yield running
    finally:
        code = running.stop()
        log = running.log_text()
        shutil.rmtree(directory, ignore_errors=True)
        assert code == 0, log


@pytest.fixture
def session(repository_daemon: DaemonProcess) -> Iterator[dalid.Session]:
    with dalid.connect(socket=repository_daemon.socket, autostart=False) as session:
        yield session


def test_a_python_operator_pipeline_runs_by_name_with_its_parameters(
    session: dalid.Session,
) -> None:
    proxy = session.proxy(dalid.named_pipeline("scaled", batch_size=BATCH, factor=3))
    loader = dalid.DataLoader(session, ProxyDataset(proxy, 20), batch_size=BATCH, num_workers=2)
    seen = []
    for (tripled, offset), indices in loader:
        expected = np.stack([sample(int(i)) for i in indices])
        np.testing.assert_array_equal(tripled.numpy(), expected * 3)
        np.testing.assert_array_equal(offset.numpy(), expected + 1000)
        seen.extend(indices.tolist())
    assert sorted(seen) == list(range(20))


def test_the_daemon_tells_the_client_the_inputs_and_batch_size(session: dalid.Session) -> None:
    proxy = session.proxy(dalid.named_pipeline("rotated", batch_size=4, fill=255.0))
    assert proxy.target.input_names == ("images", "angles")
    assert proxy.target.max_batch_size == 4
    images = np.zeros((4, 6, 6, 3), np.uint8)
    images[:, :, :3] = 200  # left half bright
    refs = [
        proxy(images=image, angles=np.float32(angle))
        for image, angle in zip(images, (0, 180, 0, 180), strict=True)
    ]
    (rotated,) = session.produce_data([torch.utils.data.default_collate(refs)])
    out = rotated.numpy()
    assert out.shape == (4, 6, 6, 3)
    # Turned half a turn, the bright half is on the right.
    assert out[0, 3, 0, 0] == 200 and out[0, 3, 5, 0] == 0
    assert out[1, 3, 5, 0] == 200 and out[1, 3, 0, 0] == 0


def test_a_name_alone_uses_the_definition_defaults(session: dalid.Session) -> None:
    proxy = session.proxy("scaled")
    assert proxy.target.max_batch_size == 8 and proxy.target.num_outputs == 2


def test_an_unknown_name_lists_the_pipelines_and_the_files_that_failed(
    session: dalid.Session,
) -> None:
    with pytest.raises(dalid.PipelineError) as raised:
        session.proxy(dalid.named_pipeline("resnet_train", batch_size=4))
    message = str(raised.value)
    assert "'resnet_train'" in message
    assert "available: rotated, scaled, strict" in message
    assert "broken.py: RuntimeError: this file is broken on purpose" in message


def test_a_definition_that_raises_is_a_pipeline_error_with_its_message(
    session: dalid.Session,
) -> None:
    with pytest.raises(dalid.PipelineError, match="mode must be 'fast' or 'exact'"):
        session.proxy(dalid.named_pipeline("strict", mode="slow"))
    # The session is still good.
    assert session.proxy(dalid.named_pipeline("strict", mode="exact")).target.num_outputs == 1


def test_an_unknown_parameter_is_a_pipeline_error(session: dalid.Session) -> None:
    with pytest.raises(dalid.PipelineError, match="colour"):
        session.proxy(dalid.named_pipeline("scaled", colour="red"))


def test_arguments_are_checked_before_anything_is_sent(session: dalid.Session) -> None:
    with pytest.raises(dalid.InputError, match="JSON"):
        session.proxy(dalid.named_pipeline("scaled", factor=object()))
    with pytest.raises(dalid.InputError, match="device_id"):
        session.proxy(dalid.RepositoryPipeline("scaled", parameters={"device_id": 0}))
    with pytest.raises(dalid.InputError, match="batch_size"):
        session.proxy(dalid.named_pipeline("scaled", batch_size=0))


def test_a_daemon_without_a_repository_says_how_to_give_it_one(daemon: DaemonProcess) -> None:
    with (
        dalid.connect(socket=daemon.socket, autostart=False) as session,
        pytest.raises(dalid.PipelineError, match="--pipelines DIR"),
    ):
        session.proxy("scaled")


def test_a_pipeline_that_cannot_be_shared_is_logged_in_dalids_words(short_tmp: Path) -> None:
    """The INFO line says what it means for the user (the pipeline runs, for its job alone);
    DALI's own text, an assert on an operator's schema, is only at DEBUG."""
    daemon = start_daemon(
        short_tmp,
        *("--pipelines", str(REPOSITORY), "--repository-operators", "PythonFunction"),
        *("--log-level", "DEBUG"),
    )
    try:
        with dalid.connect(socket=daemon.socket, autostart=False) as session:
            proxy = session.proxy(dalid.named_pipeline("scaled", batch_size=BATCH, factor=3))
            assert proxy.target.num_outputs == 2  # it runs
    finally:
        assert daemon.stop() == 0
    lines = daemon.log_text().splitlines()
    (info,) = [line for line in lines if " INFO " in line and "not shared" in line]
    assert "'scaled' runs for its job alone, not shared with other jobs: DALI cannot serialize" in (
        info
    )
    assert "IsSerializable" not in info
    (debug,) = [line for line in lines if "cannot be serialized:" in line]
    assert " DEBUG " in debug
