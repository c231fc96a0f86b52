"""UI test helpers: hand-built core events (any payload a method might send, without running that method),
and the app served on a free port."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from specgui.core.events import Event, Prefill, Start, Step, summarize
from specgui.model.loading import LoadedModel, check, load
from specgui.ui.page import App, served_locally
from specgui.ui.runs import ModelStore


def start(method: str = "pld", *, layers: int = 4, temperature: float = 0.0, prompt: tuple[int, ...] = (1, 2, 3),
          max_new: int = 16, model: str = "tiny", params: dict[str, Any] | None = None) -> Start:
    return Start(method=method, model=model, device="cpu", num_layers=layers, params=params or {},
                 sampling={"temperature": temperature, "top_p": 1.0, "top_k": 0, "seed": None},
                 max_new_tokens=max_new, prompt_ids=prompt, prompt_text="")


def prefill(token: int = 10, piece: str = "A", *, payload: dict[str, Any] | None = None, ms: float = 20.0) -> Prefill:
    return Prefill(prompt_tokens=3, token=token, piece=piece, margin=2.0, ms=ms, overhead_ms=1.0,
                   payload=payload or {})


def piece(token: int) -> str:
    return f"<{token}>"


def step(index: int, draft: list[int], path: list[int], token: int, *, parents: list[int] | None = None,
         emitted: list[int] | None = None, corrected: bool | None = None, payload: dict[str, Any] | None = None,
         pieces: dict[int, str] | None = None, ms: tuple[float, float, float] = (1.0, 50.0, 0.5),
         margins: list[float] | None = None) -> Step:
    """A step; by default a chain draft whose path is accepted and whose next node (if any) was rejected."""
    parents = parents if parents is not None else list(range(-1, len(draft) - 1))
    if emitted is None:
        emitted = [draft[i] for i in path] + [token]
    if corrected is None:
        tip = path[-1] if path else -1
        corrected = any(p == tip for p in parents)
    text = {**{t: piece(t) for t in [*draft, *emitted]}, **(pieces or {})}
    return Step(index=index, draft_tokens=tuple(draft), draft_parents=tuple(parents),
                draft_pieces=tuple(text[t] for t in draft), path=tuple(path), token=token, corrected=corrected,
                emitted=tuple(emitted), emitted_pieces=tuple(text[t] for t in emitted),
                margins=tuple(margins if margins is not None else [1.0] * len(emitted)),
                forward_tokens=1 + len(draft), draft_ms=ms[0], verify_ms=ms[1], overhead_ms=ms[2],
                payload=payload or {})


def run(*events: Event, stop: str = "length") -> list[Event]:
    """`events` (a Start, a Prefill, Steps) closed with the Summary the core would send."""
    first = next(e for e in events if isinstance(e, Prefill))
    steps = [e for e in events if isinstance(e, Step)]
    tokens = (first.token, *(t for s in steps for t in s.emitted))
    wall = (first.ms + first.overhead_ms + sum(s.draft_ms + s.verify_ms + s.overhead_ms for s in steps)) / 1000
    text = first.piece + "".join(p for s in steps for p in s.emitted_pieces)
    return [*events, summarize(steps, first, wall_s=wall, stop=stop, token_ids=tokens, text=text)]


def shown(updates: list[dict]) -> dict:
    """What each component shows once a handler's stream of updates has ended (later updates win)."""
    return {component: value for update in updates for component, value in update.items()}


def holding(lm: LoadedModel) -> ModelStore:
    """A model store that already holds `lm` (an in-process model no loader could load by name); any other
    name goes through the real config check and loader."""
    store = ModelStore(loader=lambda spec: lm if spec.name == lm.spec.name else load(spec),
                       check=lambda spec: None if spec.name == lm.spec.name else check(spec))
    store.get(lm.spec.name)
    return store


@contextmanager
def served(lm: LoadedModel) -> Iterator[tuple[App, str]]:
    """The page sharing `lm`, launched on a free port: (app, url)."""
    app = App(holding(lm))
    with served_locally(app) as url:
        yield app, url


def slowed(lm: LoadedModel, monkeypatch: Any, seconds: float = 0.002) -> None:
    """Every forward of `lm` at least `seconds` long, so that a run of many tokens outlasts the page's first frame on
    any machine (a tiny model on a fast one decoded 1000 tokens inside it, and a stop came after the end)."""
    forward = lm.runner.forward

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(seconds)
        return forward(*args, **kwargs)

    monkeypatch.setattr(lm.runner, "forward", slow)
