"""The distribution installs as a wheel with the three packages and the spec inside."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_wheel_install_imports_every_package(tmp_path: Path) -> None:
    build = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "-w", str(tmp_path / "dist"), str(ROOT)],
        capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr
    # The metadata is of the current form: setuptools warns of nothing (a license as a TOML
    # table, say), and the license is an SPDX expression.
    assert "deprecated" not in build.stdout + build.stderr, build.stdout + build.stderr
    # Every folder of a package is listed as a package itself (setuptools would ship one left
    # out as data, with a warning).
    assert "absent from the `packages` configuration" not in build.stderr, build.stderr
    (wheel,) = (tmp_path / "dist").glob("dalid-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    (metadata,) = (name for name in names if name.endswith(".dist-info/METADATA"))
    assert "License-Expression: Apache-2.0" in zipfile.ZipFile(wheel).read(metadata).decode()
    for package in ("protocol", "server", "client"):
        assert f"dalid/{package}/__init__.py" in names
        # Every module of its folders too.
        modules = {
            f"dalid/{p.relative_to(ROOT).as_posix()}" for p in (ROOT / package).rglob("*.py")
        }
        assert modules - set(names) == set()
    assert "dalid/protocol/SPEC.md" in names
    assert not any(name.startswith(("tests/", "bench/", "dalid/tests")) for name in names)

    target = tmp_path / "site"
    install = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
         str(wheel)],
        capture_output=True, text=True, check=False, timeout=300,
    )  # fmt: skip
    assert install.returncode == 0, install.stderr
    code = (
        "import dalid.client, dalid.server, dalid.protocol, dalid.client.proxy\n"
        "print(dalid.client.__file__, dalid.server.__file__, dalid.protocol.__file__)"
    )
    imported = subprocess.run(
        [sys.executable, "-c", code],
        cwd="/",
        env={**os.environ, "PYTHONPATH": str(target)},
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert imported.returncode == 0, imported.stderr
    assert all(path.startswith(str(target)) for path in imported.stdout.split())
    assert (target / "bin" / "dalid").exists()
