"""The README and the operator's docs say what the daemon does: every option of `dalid serve`
is in their configuration tables, and what they say of shared pipelines and the GPU is what
the code does."""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dalid.server.operations.cli import build_parser
from dalid.server.operations.config import OPTIONS
from dalid.server.operations.status_view import COLUMNS
from dalid.server.pipelines.operators import ALLOWED

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DEPLOYMENT = ROOT / "docs" / "deployment.md"
MIGRATION = ROOT / "docs" / "migration.md"


def table_rows(text: str, heading: str) -> list[str]:
    """The rows of the first table after ``heading``."""
    after = text[text.index(heading) :]
    rows = []
    for line in after.splitlines():
        if line.startswith("|"):
            rows.append(line)
        elif rows:
            break
    return rows


@pytest.mark.parametrize(
    ("doc", "heading"), [(README, "## Configuration"), (DEPLOYMENT, "## Configuration")]
)
def test_every_serve_option_has_a_row_of_the_configuration_table(doc: Path, heading: str) -> None:
    rows = "\n".join(table_rows(doc.read_text(), heading))
    missing = [
        option.flag
        for option in OPTIONS
        if not re.search(rf"`{re.escape(option.flag)}[ `]", rows) or option.env not in rows
    ]
    assert missing == [], f"{doc.name} has no row for {missing}"


def test_the_configuration_tables_name_no_flag_that_serve_lacks() -> None:
    (commands,) = (
        action
        for action in build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    )
    serve = commands.choices["serve"]
    flags = {flag for action in serve._actions for flag in action.option_strings}
    for doc in (README, DEPLOYMENT):
        rows = "\n".join(table_rows(doc.read_text(), "## Configuration"))
        named = set(re.findall(r"`(--[a-z-]+)", rows))
        assert named <= flags, f"{doc.name} names {named - flags}"


def test_no_doc_says_pipelines_are_private_to_each_job() -> None:
    stale = (
        "one DALI pipeline per registered job pipeline",
        "jobs share the daemon, not pipelines",
        "each job's pipelines are its own",
        "have not yet run on a GPU",
        "has not yet run on a",
    )
    for doc in (README, DEPLOYMENT, MIGRATION):
        text = " ".join(doc.read_text().split())
        said = [phrase for phrase in stale if phrase in text]
        assert said == [], f"{doc.name} still says {said}"
    for doc in (README, DEPLOYMENT, MIGRATION):
        assert "share one DALI pipeline" in " ".join(doc.read_text().split()), doc.name


def test_the_readme_leads_with_the_commands_and_the_import_before_the_internals() -> None:
    headings = [line for line in README.read_text().splitlines() if line.startswith("## ")]
    order = [
        "## Quick start",
        "## From DALI's proxy: one import",
        "## Using it",
        "## Running it for real: a daemon per GPU",
        "## On a GPU",
        "## How it fits together",
    ]
    assert [h for h in headings if h in order] == order


def _help(*command: str) -> str:
    result = subprocess.run(
        [sys.executable, "-m", "dalid.server", *command, "--help"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "COLUMNS": "100"},
    )
    return " ".join(result.stdout.split())


@pytest.mark.parametrize("command", ["serve", "status", "stop", "ping", "reload"])
def test_help_speaks_to_users_not_of_modules(command: str) -> None:
    text = _help(command)
    assert not re.search(r"\b\w+\.py\b", text), text
    assert "dalid.server" not in text and "dalid.client" not in text


def test_status_help_says_what_the_columns_the_pipeline_lines_and_outputs_mean() -> None:
    text = _help("status")
    for column in COLUMNS:
        assert f"{column.header}: " in text, column.header
    for value in ("shm", "cuda ipc", "staged"):
        assert value in text
    assert "a line per DALI pipeline" in text and "mixed batches of two jobs or more" in text


def test_the_readme_says_what_status_shows() -> None:
    text = " ".join(README.read_text().split())
    for said in (
        "runs of up to",
        "full on average",
        "runs mixed their batches",
        "alone for now",
        "`outputs`",
        "`shm`",
        "docs/status-80.txt",
        "docs/status-120.txt",
    ):
        assert said in text, said


def test_the_readmes_commands_run_through_dev_run() -> None:
    """A newcomer's shell has neither `dalid` nor the environment's python on its PATH: every
    command the README shows goes through `./dev`."""
    text = README.read_text()
    blocks = re.findall(r"```sh\n(.*?)```", text, re.DOTALL)
    assert blocks
    commands = [line for block in blocks for line in block.splitlines() if line.strip()]
    assert all(line.startswith("./dev ") for line in commands), commands
    inline = re.findall(r"`((?:python|dalid) [^`]*)`", text)
    runnable = [c for c in inline if c.startswith(("python -m", "python train.py"))]
    assert runnable == [], runnable


DOCS = sorted((ROOT / "docs").glob("*.md"))


def _passages(text: str) -> list[str]:
    """A doc's paragraphs, list items and table rows, each on one line (code left out)."""
    passages: list[str] = []
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    for block in re.split(r"\n\s*\n", text):
        current: list[str] = []
        for line in block.splitlines():
            if re.match(r"\s*([-*] |\d+\. |\|)", line) and current:
                passages.append(" ".join(current))
                current = []
            current.append(line.strip())
        if current:
            passages.append(" ".join(current))
    return passages


def _reader_schemas(passage: str) -> set[str]:
    """The DALI schemas of the readers a passage names (``fn.readers.file``: readers__File;
    ``readers.*``: every reader DALI registers)."""
    importlib.import_module("nvidia.dali.ops")  # registers the operators of its plugins
    backend: Any = importlib.import_module("nvidia.dali.backend")
    listings = (backend.RegisteredCPUOps, backend.RegisteredGPUOps, backend.RegisteredMixedOps)
    registered = {name for listing in listings for name in listing(True) if "readers__" in name}
    named = set()
    for reader in re.findall(r"readers\.(\*|[a-z_]+)", passage):
        if reader == "*":
            named |= registered
        else:
            key = reader.replace("_", "")
            named |= {
                name
                for name in registered
                if name.split("readers__")[-1].replace("_", "").lower() == key
            }
    return named


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda path: path.name)
def test_what_the_docs_say_of_readers_is_what_the_operator_list_does(doc: Path) -> None:
    """A passage that names a DALI reader says it is refused exactly when the daemon's
    allow-list leaves it out (a doc that said `fn.readers.file(file_root=...)` is opened by the
    daemon as written, when the daemon refuses every reader, fails here)."""
    wrong = []
    for passage in _passages(doc.read_text()):
        schemas = _reader_schemas(passage)
        if not schemas:
            continue
        refused = any(schema not in ALLOWED for schema in schemas)
        says_refused = bool(re.search(r"refuse|not run|does not run", passage))
        if refused != says_refused:
            wrong.append(passage[:160])
    assert wrong == [], f"{doc.name} says of readers what the daemon does not do: {wrong}"


def test_a_reader_claim_against_the_allow_list_is_caught() -> None:
    """The check above, on the sentence that misled users, and on its correction."""
    stale = (
        "File names given to a reader inside the pipeline definition "
        "(`fn.readers.file(file_root=...)`) are opened by the daemon as written."
    )
    assert _reader_schemas(stale) == {"readers__File"}
    assert "readers__File" not in ALLOWED
    assert not re.search(r"refuse|not run|does not run", stale)
    assert _reader_schemas("The daemon refuses DALI's file readers (`fn.readers.*`)") >= {
        "readers__File",
        "readers__Numpy",
    }
