"""Every reference to the design resolves: each ``Note [X]`` cited anywhere is defined in one
place, as a short block that links its page in docs/design/, and each design page cited exists.

A Note is defined in code by its title on a line of its own (a ``#`` comment or a docstring's
line) and an underline of ``-``, ``~`` or ``=`` below it::

    # Note [The loop's timers]
    # ~~~~~~~~~~~~~~~~~~~~~~~~
    # The invariant, in a few lines; the why and the tests are in docs/design/daemon-loop.md.

A ``#`` Note ends with its comment; a docstring's Note with the docstring or at the next
underlined heading. Its body (the lines below the underline) is at most ``MAX_NOTE_LINES``
lines, and names an existing page ``docs/design/<page>.md``. A citation says ``Note [X]`` or
links the page, never a numbered part of a Note (nothing checks what such a number points at).
Each page is in the index (docs/design/README.md), and the tests it names exist.
"""

from __future__ import annotations

import functools
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design"
# Where Notes are defined and cited, and the kinds of files read there.
SCANNED = ("server", "client", "protocol", "tests", "bench", "docs", "README.md")
SUFFIXES = {".py", ".md", ".txt", ".toml", ".cfg", ".sh", ".rst"}
MAX_NOTE_LINES = 15

_CONTINUATION = re.compile(r"[ \t]*\n[ \t]*(?:#[ \t]*)?")
_CITATION = re.compile(r"Note \[([^\]\n]+)\]")
_TITLE = re.compile(r"^[ \t]*(#[ \t]*)?Note \[([^\]]+)\]")
_UNDERLINE = re.compile(r"^[ \t]*(#[ \t]*)?([-~=])\2{3,}[ \t]*$")
_PAGE = re.compile(r"docs/design/[A-Za-z0-9_./-]*?\.md")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_POINT = re.compile(r"\bpoints? \d+")
_TEST_DEF = re.compile(r"def (test_\w+)\(")
_TEST_NAME = re.compile(r"\b(test_\w+)\b(?!\.py)")
_TEST_FILE = re.compile(r"\btests/[\w/]+\.py")


@dataclass(frozen=True)
class NoteBlock:
    """A Note's definition: its title, where it is, and its lines from the title on."""

    name: str
    path: str
    line: int
    lines: tuple[str, ...]

    @property
    def body(self) -> tuple[str, ...]:
        return self.lines[2:]


def scanned_files(root: Path = ROOT) -> dict[str, str]:
    """The text of every scanned file, by its path relative to ``root``."""
    found: dict[str, str] = {}
    for top in SCANNED:
        base = root / top
        paths = [base] if base.is_file() else sorted(base.rglob("*"))
        for path in paths:
            if path.suffix not in SUFFIXES or "__pycache__" in path.parts or not path.is_file():
                continue
            if path == Path(__file__).resolve():
                continue  # its docstring shows a Note as an example
            found[path.relative_to(root).as_posix()] = path.read_text(encoding="utf-8")
    return found


def citations(text: str) -> list[str]:
    """The Notes ``text`` names, a name broken across lines (or ``#`` comment lines) joined."""
    flat = _CONTINUATION.sub(" ", text)
    return [re.sub(r"\s+", " ", name).strip() for name in _CITATION.findall(flat)]


def note_blocks(path: str, text: str) -> list[NoteBlock]:
    """The Notes ``text`` defines."""
    lines = text.splitlines()
    blocks = []
    for i, line in enumerate(lines[:-1]):
        title = _TITLE.match(line)
        if title is None or not _UNDERLINE.match(lines[i + 1]):
            continue
        comment = title.group(1) is not None
        end = i + 2
        while end < len(lines):
            here = lines[end]
            if comment and not here.lstrip().startswith("#"):
                break
            if not comment:
                if '"""' in here:
                    end += 1 if here.strip() != '"""' else 0
                    break
                if end + 1 < len(lines) and here.strip() and _UNDERLINE.match(lines[end + 1]):
                    break  # the next heading
            end += 1
        while end > i + 2 and not lines[end - 1].strip().lstrip("#").strip():
            end -= 1
        blocks.append(NoteBlock(title.group(2), path, i + 1, tuple(lines[i:end])))
    return blocks


def cited_pages(path: str, text: str, root: Path = ROOT) -> list[str]:
    """The design pages ``text`` names (relative to ``root``): each ``docs/design/....md``, and
    in a markdown file each relative link that leads into docs/design/, or out of a page of it."""
    pages = set(_PAGE.findall(text))
    if path.endswith(".md"):
        here = (root / path).parent
        in_design = (root / path).resolve().is_relative_to((root / "docs" / "design").resolve())
        for link in _LINK.findall(text):
            target = link.split("#", 1)[0]
            if not target or "://" in target or target.startswith("mailto:"):
                continue
            resolved = (here / target).resolve()
            design = resolved.is_relative_to((root / "docs" / "design").resolve())
            if design or in_design:
                try:
                    pages.add(resolved.relative_to(root.resolve()).as_posix())
                except ValueError:
                    pages.add(target)  # outside the repository: it cannot exist here
    return sorted(pages)


def problems(files: dict[str, str], root: Path = ROOT) -> dict[str, list[str]]:
    """What does not resolve, by kind: ``notes`` (a cited Note defined nowhere, or twice),
    ``blocks`` (a Note too long or without an existing page), ``pages`` (a cited page or
    link that does not exist) and ``points`` (a numbered reference into a Note)."""
    found: dict[str, list[str]] = defaultdict(list)
    defined: dict[str, list[NoteBlock]] = defaultdict(list)
    cited: dict[str, list[str]] = defaultdict(list)
    for path, text in files.items():
        if path.endswith(".py"):
            for block in note_blocks(path, text):
                defined[block.name].append(block)
        for name in citations(text):
            cited[name].append(path)
        for page in cited_pages(path, text, root):
            if not (root / page).exists():
                found["pages"].append(f"{path}: {page} does not exist")
        for number, line in enumerate(text.splitlines(), 1):
            if _POINT.search(line):
                found["points"].append(f"{path}:{number}: {line.strip()}")
    for name, where in sorted(cited.items()):
        blocks = defined.get(name, [])
        if len(blocks) != 1:
            at = ", ".join(f"{b.path}:{b.line}" for b in blocks) or "nowhere"
            found["notes"].append(
                f"Note [{name}] (cited in {', '.join(sorted(set(where)))}) is defined {at}"
            )
    for name, blocks in sorted(defined.items()):
        for block in blocks:
            at = f"Note [{name}] at {block.path}:{block.line}"
            if len(block.body) > MAX_NOTE_LINES:
                found["blocks"].append(
                    f"{at} is {len(block.body)} lines below its title, over {MAX_NOTE_LINES}: "
                    "keep the invariant and link its page in docs/design/"
                )
            pages = sorted(set(_PAGE.findall("\n".join(block.lines))))
            if not pages:
                found["blocks"].append(f"{at} links no page of docs/design/")
            for page in pages:
                if not (root / page).is_file():
                    found["blocks"].append(f"{at} links {page}, which does not exist")
    return found


@functools.cache
def _repository_problems() -> dict[str, list[str]]:
    return problems(scanned_files())


def report(kind: str) -> str:
    """The repository's problems of ``kind``, one a line."""
    return "\n".join(_repository_problems().get(kind, []))


# --- the repository ------------------------------------------------------------------------------


def test_every_cited_note_is_defined_once() -> None:
    assert not report("notes"), report("notes")


def test_every_note_is_short_and_links_an_existing_design_page() -> None:
    assert not report("blocks"), report("blocks")


def test_every_cited_design_page_exists() -> None:
    assert not report("pages"), report("pages")


def test_no_reference_names_a_numbered_point_of_a_note() -> None:
    assert not report("points"), report("points")


def test_every_design_page_is_in_the_index() -> None:
    index = (DESIGN / "README.md").read_text(encoding="utf-8")
    linked = {page.split("#", 1)[0] for page in _LINK.findall(index)}
    missing = [p.name for p in sorted(DESIGN.glob("*.md")) if p.name not in linked | {"README.md"}]
    assert not missing, f"docs/design/README.md does not link {missing}"


def test_the_tests_a_design_page_names_exist() -> None:
    """A page says which tests hold its contract: each test and test file it names exists."""
    defined: set[str] = set()
    for path in (ROOT / "tests").rglob("*.py"):
        defined |= set(_TEST_DEF.findall(path.read_text(encoding="utf-8")))
    missing = []
    for page in sorted(DESIGN.glob("*.md")):
        text = page.read_text(encoding="utf-8")
        missing += [
            f"{page.name}: {name}" for name in _TEST_NAME.findall(text) if name not in defined
        ]
        missing += [
            f"{page.name}: {f}" for f in _TEST_FILE.findall(text) if not (ROOT / f).is_file()
        ]
    assert not missing, "\n".join(missing)


# --- the checks themselves, on made-up files -----------------------------------------------------


def test_a_note_is_found_in_a_comment_and_in_a_docstring() -> None:
    comment = (
        "x = 1\n# Note [In a comment]\n# ~~~~~~~~~~~~~~~~~~~\n# Holds. docs/design/a.md\n"
        "#\ny = 2\n# Note [In a comment], said again, is no definition\n"
    )
    docstring = '"""Module.\n\nNote [In a docstring]\n---------------------\nHolds.\n"""\n'
    (a,) = note_blocks("a.py", comment)
    (b,) = note_blocks("b.py", docstring)
    assert (a.name, a.line, a.body) == ("In a comment", 2, ("# Holds. docs/design/a.md",))
    assert (b.name, b.line, b.body) == ("In a docstring", 3, ("Holds.",))


def test_a_docstring_note_ends_at_the_next_heading() -> None:
    text = '"""M.\n\nNote [First]\n~~~~~~~~~~~~\nOne.\n\nNote [Second]\n~~~~~~~~~~~~~\nTwo."""\n'
    first, second = note_blocks("m.py", text)
    assert first.body == ("One.",) and second.body == ('Two."""',)


def test_a_name_broken_across_comment_lines_is_one_citation() -> None:
    text = "# see Note\n# [A name broken across\n#   lines] and Note [Another]"
    assert citations(text) == ["A name broken across lines", "Another"]


def test_each_way_a_reference_can_fail_is_reported(tmp_path: Path) -> None:
    (tmp_path / "docs" / "design").mkdir(parents=True)
    (tmp_path / "docs" / "design" / "here.md").write_text("# Here\n")
    long_body = "".join(f"# line {n}\n" for n in range(MAX_NOTE_LINES + 1))
    files = {
        "m.py": (
            "# Note [Good]\n# ~~~~~~~~~~~~\n# Holds: docs/design/here.md\n\n"
            "# Note [Too long]\n# ~~~~~~~~~~~~~~~~\n# docs/design/here.md\n" + long_body + "\n"
            "# Note [No page]\n# ~~~~~~~~~~~~~~~\n# Holds.\n\n"
            "# Note [Gone page]\n# ~~~~~~~~~~~~~~~~~\n# docs/design/gone.md\n\n"
            "# Note [Twice]\n# ~~~~~~~~~~~~~\n# docs/design/here.md\n\n"
        ),
        "n.py": "# Note [Twice]\n# ~~~~~~~~~~~~~\n# docs/design/here.md\n",
        "c.py": "# Note [Good] holds; Note [Nowhere] does not; see Note [Good], point 3.\n",
        "docs/x.md": "[here](design/here.md), [gone](design/gone.md#part), [web](https://x/y.md)\n",
    }
    found = problems(files, tmp_path)
    assert found["notes"] == [
        "Note [Nowhere] (cited in c.py) is defined nowhere",
        "Note [Twice] (cited in m.py, n.py) is defined m.py:33, n.py:1",
    ]
    assert len(found["blocks"]) == 3
    assert "Note [Gone page]" in found["blocks"][0] and "gone.md" in found["blocks"][0]
    assert "Note [No page]" in found["blocks"][1]
    assert "Note [Too long]" in found["blocks"][2]
    assert sorted(found["pages"]) == [
        "docs/x.md: docs/design/gone.md does not exist",
        "m.py: docs/design/gone.md does not exist",
    ]
    assert found["points"] == [
        "c.py:1: # Note [Good] holds; Note [Nowhere] does not; see Note [Good], point 3."
    ]
