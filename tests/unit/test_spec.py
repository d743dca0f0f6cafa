"""protocol/SPEC.md agrees with the code: version, operations and error codes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import dalid.protocol
from dalid.protocol import PROTOCOL_VERSION, ErrorCode
from dalid.protocol.messages import MESSAGE_TYPES

SPEC = Path(dalid.protocol.__file__).with_name("SPEC.md")


@pytest.fixture(scope="module")
def spec_text() -> str:
    return SPEC.read_text(encoding="utf-8")


def test_spec_states_the_protocol_version(spec_text: str) -> None:
    versions = re.findall(r"^\*\*Protocol version: (\d+)\*\*", spec_text, flags=re.MULTILINE)
    assert versions, f"{SPEC} has no line starting with **Protocol version: N**"
    assert [int(version) for version in versions] == [PROTOCOL_VERSION]
    assert dalid.protocol.PROTOCOL_VERSION == PROTOCOL_VERSION


def test_spec_frame_example_uses_the_current_version(spec_text: str) -> None:
    for version in re.findall(r'"v": (\d+)', spec_text):
        assert int(version) == PROTOCOL_VERSION


@pytest.mark.parametrize("op", [cls.OP for cls in MESSAGE_TYPES])
def test_spec_documents_every_operation(spec_text: str, op: str) -> None:
    assert f"`{op}`" in spec_text, f"operation {op!r} is missing from {SPEC.name}"


@pytest.mark.parametrize("code", list(ErrorCode), ids=str)
def test_spec_documents_every_error_code(spec_text: str, code: ErrorCode) -> None:
    assert f"`{code.value}`" in spec_text, f"error code {code.value!r} is missing from {SPEC.name}"
