"""Job options are checked in the caller, in the caller's words, before anything is sent."""

from __future__ import annotations

from typing import Any

import pytest
from nvidia.dali import fn

import dalid.client as dalid
from dalid.client import proxy as dalid_proxy
from dalid.client.errors import InputError
from dalid.client.options import check_job_options

from ..dali_typing import pipeline_def


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"weight": 0}, "weight=0"),
        ({"weight": -1.5}, "above 0"),
        ({"weight": 5000}, "at most 1000"),
        ({"weight": float("nan")}, "above 0"),
        ({"weight": "2"}, "number"),
        ({"weight": True}, "number"),
        ({"memory_bytes": 0}, "memory_bytes=0"),
        ({"memory_bytes": -1}, "positive int"),
        ({"memory_bytes": 1.5e9}, "positive int"),
        ({"max_inflight_batches": 0}, "None for the daemon's default"),
        ({"name": 7}, "name must be a str"),
        ({"name": "x" * 300}, "at most 256"),
        ({"reconnect": "yes"}, "True or False"),
    ],
)
def test_bad_options_are_input_errors_in_dalids_words(options: dict[str, Any], words: str) -> None:
    with pytest.raises(InputError, match=words) as caught:
        check_job_options(**options)
    assert "hello" not in str(caught.value)


def test_good_options_pass() -> None:
    check_job_options()
    check_job_options(name="eval", weight=0.25, memory_bytes=1 << 20, max_inflight_batches=2)
    check_job_options(weight=1000, reconnect=True)


def test_connect_refuses_before_it_connects(tmp_path: Any) -> None:
    # No daemon answers on this socket and autostart is off: the refusal comes first.
    socket = tmp_path / "none.sock"
    with pytest.raises(InputError, match="weight=0"):
        dalid.connect("cpu", socket=socket, autostart=False, weight=0)
    with pytest.raises(InputError, match="device must be"):
        dalid.connect("gpu", socket=socket, autostart=False)


@pipeline_def(batch_size=2, num_threads=1, device_id=None)
def _pipe():  # type: ignore[no-untyped-def]
    return fn.external_source(name="x", no_copy=True)


def test_daliserver_takes_the_job_options_and_checks_them() -> None:
    with pytest.raises(InputError, match="weight=0"):
        dalid_proxy.DALIServer(_pipe(), weight=0)
    with pytest.raises(InputError, match="memory_bytes"):
        dalid_proxy.DALIServer(_pipe(), memory_bytes=-5)
    # Nothing connects until the server starts.
    server = dalid_proxy.DALIServer(
        _pipe(), name="eval", weight=2, memory_bytes=64 << 20, max_inflight_batches=4
    )
    server.stop_thread()
