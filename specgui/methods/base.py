"""The drafter interface every method implements, and the decorator that registers one.

A drafter is created per generation and lives through three calls, all made by `decode.generate`:

  begin(state)            before the prompt forward; may return an observer for it (ADMG reads the
                          prompt's hidden states there)
  draft(state) -> Draft   propose a token tree; may run its own forwards, but must leave every cache
                          layer holding exactly the committed prefix, as it found it
  observe(state, outcome) learn from the verdict (n-gram caches, skip sets, back-off); also called
                          once after the prompt forward with an empty path. Returns the event payload.

Tunables live in a `Params` dataclass per method, declared with `specgui.params.param` so that presets
(`configs/<method>.yaml`), the CLI and the app's parameter panel all validate the same ranges.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from specgui.draft import Draft, Outcome
from specgui.kvcache import KVCache
from specgui.params import NoParams
from specgui.runner import Observer, Runner
from specgui.sampling import Sampling

REGISTRY: dict[str, type[Drafter]] = {}


@dataclass
class DecodeState:
    """The decoding state a drafter may read. `tokens[-1]` is the pending token (not cached yet)."""

    runner: Runner
    cache: KVCache
    tokens: list[int]
    prompt_len: int
    sampling: Sampling
    generator: torch.Generator | None
    max_new_tokens: int
    step: int = 0
    tokenizer: Any = None  # the model's tokenizer, for drafters that prepare from text of their own (dv)

    @property
    def committed(self) -> int:
        """Positions held by the cache: every token but the pending one."""
        return len(self.tokens) - 1

    @property
    def pending(self) -> int:
        return self.tokens[-1]

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len

    @property
    def max_depth(self) -> int:
        """Deepest useful draft: each step also emits the verifier's own token."""
        return max(0, self.max_new_tokens - self.generated - 1)


class Drafter:
    """Base class: a method that never drafts (which is exactly `baseline`)."""

    name: ClassVar[str]
    title: ClassVar[str]
    summary: ClassVar[str]
    Params: ClassVar[type] = NoParams

    def __init__(self, runner: Runner, params: Any, sampling: Sampling) -> None:
        self.runner = runner
        self.params = params
        self.sampling = sampling

    def begin(self, state: DecodeState) -> Observer | None:
        return None

    def draft(self, state: DecodeState) -> Draft:
        return Draft()

    def observe(self, state: DecodeState, outcome: Outcome) -> dict[str, Any]:
        return {}


def register(cls: type[Drafter]) -> type[Drafter]:
    """Class decorator: make a drafter available by its `name`."""
    if cls.name in REGISTRY:
        raise ValueError(f"method {cls.name!r} registered twice")
    REGISTRY[cls.name] = cls
    return cls
