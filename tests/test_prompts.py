"""The built-in suite and the JSONL format's validation."""

import json
from collections import Counter

import pytest

from specgui.errors import SpecGUIError
from specgui.tools.prompts import PromptRow, load_prompts, select

CATEGORIES = {"multi-turn", "translation", "summarization", "qa", "math", "rag", "code"}


def test_builtin_suite_covers_every_category(suite, embedded_lm):
    counts = Counter(row.category for row in suite)
    assert set(counts) == CATEGORIES and min(counts.values()) >= 5
    assert any(len(row.messages) > 1 for row in suite if row.category == "multi-turn")
    for row in suite:
        ids = row.encode(embedded_lm.tokenizer)
        assert 10 < len(ids) < 1500


def _write(tmp_path, lines):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


@pytest.mark.parametrize("line, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "JSON object"),
    (json.dumps({"id": "a", "category": "x"}), "exactly one of"),
    (json.dumps({"id": "a", "category": "x", "prompt": "hi", "messages": []}), "exactly one of"),
    (json.dumps({"id": "", "category": "x", "prompt": "hi"}), "'id'"),
    (json.dumps({"id": "a", "category": "x", "prompt": "   "}), "non-empty"),
    (json.dumps({"id": "a", "category": "x", "messages": [{"role": "bot", "content": "hi"}]}), "role"),
    (json.dumps({"id": "a", "category": "x", "messages": [{"role": "assistant", "content": "hi"}]}), "end with"),
])
def test_malformed_rows_name_their_line(tmp_path, line, message):
    good = json.dumps({"id": "ok", "category": "x", "prompt": "fine"})
    with pytest.raises(SpecGUIError, match=f"p.jsonl:2: .*{message}"):
        load_prompts(_write(tmp_path, [good, line]))


def test_duplicates_missing_and_empty_files(tmp_path):
    row = json.dumps({"id": "a", "category": "x", "prompt": "hi"})
    with pytest.raises(SpecGUIError, match="duplicate id"):
        load_prompts(_write(tmp_path, [row, row]))
    with pytest.raises(SpecGUIError, match="not found"):
        load_prompts(tmp_path / "missing.jsonl")
    with pytest.raises(SpecGUIError, match="no rows"):
        load_prompts(_write(tmp_path, ["", "  "]))


def test_select_takes_the_first_rows_of_each_chosen_category_in_file_order():
    rows = [PromptRow(f"{c}{i}", c, prompt="x") for i in range(3) for c in ("a", "b", "c")]
    assert [r.id for r in select(rows)] == [r.id for r in rows]
    assert [r.id for r in select(rows, per_category=1)] == ["a0", "b0", "c0"]
    assert [r.id for r in select(rows, ["c", " a"], 2)] == ["a0", "c0", "a1", "c1"]
    assert select(load_prompts("suite"), per_category=1)[0].category == load_prompts()[0].category
    with pytest.raises(SpecGUIError, match="no prompts in category 'poetry'"):
        select(rows, ["a", "poetry"])
    with pytest.raises(SpecGUIError, match="at least 1"):
        select(rows, per_category=0)
