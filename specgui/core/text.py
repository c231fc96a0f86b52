"""Tokens <-> text: prompt encoding (chat template or raw) and streaming detokenization.

Pieces are computed incrementally with a small look-back window, the way streaming servers do it: a
token that ends inside a multi-byte character yields "" and the next one carries the whole character,
so the pieces of a run concatenate to its decoded text.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from specgui.errors import SpecGUIError

Messages = list[dict[str, str]]


# Characters a prompt may have, checked before the tokenizer sees it: a 10 MB prompt took 6 s and 1.6 GB to tokenize
# only to be refused by the context check; this is ~4 characters a token of a 250k-token context.
MAX_PROMPT_CHARS = 1_000_000


def encode_prompt(tokenizer: Any, prompt: str | Messages, *, chat: bool = True) -> list[int]:
    """Token ids for a prompt: messages (or a plain string, with `chat`) go through the chat template."""
    size = _chars(prompt)
    if size > MAX_PROMPT_CHARS:
        raise SpecGUIError(f"the prompt has {size:,} characters, more than the {MAX_PROMPT_CHARS:,} taken")
    if isinstance(prompt, str):
        if not prompt.strip():
            raise SpecGUIError("the prompt is empty: type some text")
        if not chat or not getattr(tokenizer, "chat_template", None):
            return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
        prompt = [{"role": "user", "content": prompt}]
    check_messages(prompt)
    ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def _chars(prompt: Any) -> int:
    """A prompt's characters: a string's, or the text contents of a list of messages (anything else: 0, for
    `check_messages` to refuse)."""
    if isinstance(prompt, str):
        return len(prompt)
    if not isinstance(prompt, list):
        return 0
    return sum(len(m["content"]) for m in prompt if isinstance(m, dict) and isinstance(m.get("content"), str))


def check_messages(messages: Any) -> None:
    """Refuse anything that is not a non-empty list of {role, content} dicts ending with a user turn."""
    if not isinstance(messages, list) or not messages:
        raise SpecGUIError("messages must be a non-empty list of {role, content} objects")
    for m in messages:
        if not isinstance(m, dict) or set(m) != {"role", "content"} or not isinstance(m["content"], str):
            raise SpecGUIError(f"bad message {str(m)[:60]!r}: expected {{'role': ..., 'content': '...'}}")
        if m["role"] not in ("system", "user", "assistant"):
            raise SpecGUIError(f"bad message role {m['role']!r}: use system, user or assistant")
    if messages[-1]["role"] != "user" or not messages[-1]["content"].strip():
        raise SpecGUIError("the conversation must end with a non-empty user message")


class Detokenizer:
    """Turns a stream of token ids into text pieces that concatenate to the decoded text."""

    def __init__(self, tokenizer: Any, context: Sequence[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.ids = list(context[-4:])
        self.prefix = 0
        self.read = len(self.ids)

    def push(self, token: int) -> str:
        self.ids.append(int(token))
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return after[len(before) :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def pieces_in_context(tokenizer: Any, items: Sequence[tuple[Sequence[int], int]]) -> list[str]:
    """Each (context, token)'s text: the token as it would read after the context (for showing drafts, accepted or
    not). Decoded together where the tokenizer can (`batch_decode`: one call for a step's draft, not two a token)."""
    if not items:  # (a tokenizer's batch of nothing need not be empty)
        return []
    kw = {"skip_special_tokens": False, "clean_up_tokenization_spaces": False}
    texts = [ids for context, token in items for ids in (list(context[-3:]), [*context[-3:], int(token)])]
    batch = getattr(tokenizer, "batch_decode", None)
    decoded = batch(texts, **kw) if batch is not None else [tokenizer.decode(ids, **kw) for ids in texts]
    return [full[len(head) :] if full.startswith(head) else tokenizer.decode([int(token)], **kw)
            for (_, token), head, full in zip(items, decoded[::2], decoded[1::2], strict=True)]
