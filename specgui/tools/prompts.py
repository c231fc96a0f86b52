"""Prompt suites: JSONL rows `{"id", "category", "prompt"}` or `{"id", "category", "messages": [...]}`.

A `prompt` row is used as raw text (no chat template); a `messages` row goes through the model's chat
template. The built-in suite (`assets/prompts.jsonl`) covers the six Spec-Bench categories plus code.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specgui import ASSETS_DIR
from specgui.core.text import Messages, check_messages, encode_prompt
from specgui.errors import SpecGUIError

BUILTIN_SUITE = ASSETS_DIR / "prompts.jsonl"
MAX_SUITE_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class PromptRow:
    id: str
    category: str
    prompt: str | None = None
    messages: Messages | None = None

    def encode(self, tokenizer: Any) -> list[int]:
        if self.messages is not None:
            return encode_prompt(tokenizer, self.messages)
        return encode_prompt(tokenizer, self.prompt, chat=False)

    @property
    def preview(self) -> str:
        """The last user turn (or the raw prompt), for showing in lists."""
        return self.messages[-1]["content"] if self.messages is not None else self.prompt


def load_prompts(path: str | Path = BUILTIN_SUITE) -> list[PromptRow]:
    """Read and validate a JSONL suite ("suite": the built-in one); every problem names its line."""
    path = BUILTIN_SUITE if str(path) == "suite" else Path(path)
    if not path.is_file():
        raise SpecGUIError(f"prompt file {str(path)!r} not found")
    if path.stat().st_size > MAX_SUITE_BYTES:
        raise SpecGUIError(f"prompt file {str(path)!r} is larger than {MAX_SUITE_BYTES // 2**20} MiB")
    rows: list[PromptRow] = []
    seen: set[str] = set()
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        rows.append(_parse_row(line, f"{path.name}:{number}"))
        if rows[-1].id in seen:
            raise SpecGUIError(f"{path.name}:{number}: duplicate id {rows[-1].id!r}")
        seen.add(rows[-1].id)
    if not rows:
        raise SpecGUIError(f"prompt file {str(path)!r} has no rows")
    return rows


def select(rows: list[PromptRow], categories: Iterable[str] | None = None,
           per_category: int | None = None) -> list[PromptRow]:
    """The first `per_category` rows (None: all) of each of `categories` (None: every category), in file order.

    The CLI's `--categories/--limit`, the grid and the Compare tab all choose prompts this way, so a
    table made in one can be made again in another.
    """
    if per_category is not None and per_category < 1:
        raise SpecGUIError(f"prompts per category must be at least 1, got {per_category}")
    known = list(dict.fromkeys(r.category for r in rows))
    wanted = known if categories is None else list(dict.fromkeys(c.strip() for c in categories if c.strip()))
    unknown = [c for c in wanted if c not in known]
    if unknown:
        raise SpecGUIError(f"no prompts in category {', '.join(map(repr, unknown))}: the categories are "
                           f"{', '.join(known)}")
    taken: dict[str, int] = {}
    out = []
    for row in rows:
        if row.category in wanted and taken.get(row.category, 0) < (per_category or len(rows)):
            taken[row.category] = taken.get(row.category, 0) + 1
            out.append(row)
    if not out:
        raise SpecGUIError("no prompts selected")
    return out


def _parse_row(line: str, where: str) -> PromptRow:
    try:
        data = json.loads(line)
    except ValueError as exc:
        raise SpecGUIError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(data, dict):
        raise SpecGUIError(f"{where}: each line must be a JSON object")
    for key in ("id", "category"):
        if not isinstance(data.get(key), str) or not data[key].strip():
            raise SpecGUIError(f"{where}: needs a non-empty string {key!r}")
    if ("prompt" in data) == ("messages" in data):
        raise SpecGUIError(f"{where}: needs exactly one of 'prompt' or 'messages'")
    if "prompt" in data:
        if not isinstance(data["prompt"], str) or not data["prompt"].strip():
            raise SpecGUIError(f"{where}: 'prompt' must be a non-empty string")
        return PromptRow(data["id"], data["category"], prompt=data["prompt"])
    try:
        check_messages(data["messages"])
    except SpecGUIError as exc:
        raise SpecGUIError(f"{where}: {exc}") from None
    return PromptRow(data["id"], data["category"], messages=data["messages"])
