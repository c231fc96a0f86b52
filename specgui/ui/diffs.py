"""The edits gradio streams between a generator's outputs, exact for lists nested in lists.

Why: after its first value, a streamed output reaches a client as edits against the value before it
(`gradio.utils.diff` on the server), which the client applies one by one, in order (`gradio_client.utils.apply_diff`,
and the browser's client alike). gradio 6.31's diff shifts each list's delete indices so that they stay right as
earlier deletes shorten the list, but it shifts every delete among that list's edits, including those its items'
own diffs already shifted. A list of containers whose inner lists shrink by two or more, from one value to the next,
got deletes at the wrong index: Self-Draft's step payload, `"candidates": [{"nodes": [...], "key": [...]}, ...]`,
reached gradio_client's callers with wrong events, or with an index past the end, where the client raised inside its
reader thread and a caller iterating the job waited for ever.

`diff` here is gradio's but for that: a list shifts its own deletes only (deleting at the first index past the
common part, as many times as the old list was longer). Every edit it makes is one the clients already apply, in
the same kinds and order, so the stream's other values (the page's HTML, figures) are diffed as before. `install`
puts it where gradio's queue looks it up, once for the process, before anything streams.
"""

from __future__ import annotations

from typing import Any

import gradio.utils

Edit = list[Any]  # [action, path, value]: action "replace" | "append" | "add" | "delete"
GRADIO_DIFF = gradio.utils.diff  # what `install` replaces (a test holds it to the bug, to notice an upgrade's fix)


def diff(old: Any, new: Any) -> list[Edit]:
    """Edits that turn `old` into `new` when applied in order, as gradio's clients apply them."""
    return _edits(old, new, [])


def _edits(old: Any, new: Any, path: list[Any]) -> list[Edit]:
    if old == new:
        return []
    if type(old) is not type(new):
        return [["replace", path, new]]
    if isinstance(old, str) and new.startswith(old):
        return [["append", path, new[len(old):]]]
    if isinstance(old, list):
        common = min(len(old), len(new))
        edits = [edit for i in range(common) for edit in _edits(old[i], new[i], [*path, i])]
        # after the first delete the next surplus item slides into its place: delete there again
        edits += [["delete", [*path, common], None] for _ in range(common, len(old))]
        edits += [["add", [*path, i], new[i]] for i in range(common, len(new))]
        return edits
    if isinstance(old, dict):
        edits = []
        for key in old:
            edits += _edits(old[key], new[key], [*path, key]) if key in new else [["delete", [*path, key], None]]
        return edits + [["add", [*path, key], new[key]] for key in new if key not in old]
    return [["replace", path, new]]


def install() -> None:
    """Make gradio's queue diff streamed values with `diff` (it calls `gradio.utils.diff` by name at each chunk)."""
    gradio.utils.diff = diff
