"""The commands that ask a running daemon (`dalid stop`, `status`, `ping`, `reload`) start
without importing the daemon, numpy or the installed release's metadata: on a machine whose
cores a training job keeps busy, every module the command imports is time the user waits for
`dalid stop` (numpy and the metadata were 0.1 s of its 0.26 s of CPU on an idle machine)."""

from __future__ import annotations

import subprocess
import sys


def test_the_dalid_command_imports_no_daemon_until_it_serves() -> None:
    probe = (
        "import sys\n"
        "from dalid.server.operations import cli\n"
        "cli.build_parser()\n"
        "print(sorted(m for m in sys.modules if m.startswith(("
        "'dalid.server.intake.daemon', 'dalid.server.handling', 'dalid.server.runs', "
        "'dalid.server.pipelines', 'dalid.server.outputs', 'nvidia', 'torch', 'numpy', "
        "'importlib.metadata'))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]", out.stdout


def test_the_server_package_still_offers_its_names() -> None:
    from dalid import server

    assert server.Daemon.__name__ == "Daemon"
    assert server.DaemonCore.__name__ == "DaemonCore"
