"""Drafting methods by name, one module per method in its family's folder, each registering its drafter with
`@register`, beside the parts its family shares:

  * `ngram/`: prompt lookup (`pld`), Self-Draft (`selfdraft`), Lookahead (`lookahead`); the n-gram caches they share
    (`ngram_cache`; the corpus cache is built by `tools.corpus`);
  * `layerskip/`: CLaSp (`clasp`), ASD/ADMG (`admg`), SWIFT (`swift`), Draft & Verify (`dv`); the chain drafting they
    share (`drafting`), CLaSp's dynamic program (`skipdp`), SWIFT's and D&V's search (`skipsearch`, `bayesopt`);
  * `fractal/`: Fractal-LLM (`fractal`) and its compressed copies (`compress`);
  * here: plain decoding (`baseline`), the drafter's contract (`base`), the draft-sizing policy every method shares
    (`policy`), parameters (`params`) and their presets (`presets`, from configs/).
Adding a method takes three things, and nothing in the core or the UI:
  * a module whose drafter class is decorated with `@register` (in its family's folder: `FAMILIES`),
  * its name in `METHODS` below (which also sets the order menus and tables show),
  * `configs/<name>.yaml` with a default for every field of its `Params` (presets per model / device).
The app builds the method's parameter panel from its `Params` and shows payload keys it does not know as
text in the step inspector; keys listed in `specgui.core.events` get their own drawings.

`create` builds a drafter with its preset parameters for a model and device, plus the caller's overrides.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from specgui.core.runner import Runner
from specgui.core.sampling import Sampling
from specgui.errors import SpecGUIError
from specgui.methods.base import REGISTRY, DecodeState, Drafter, register
from specgui.methods.presets import build_params

__all__ = ["FAMILIES", "METHODS", "DecodeState", "Drafter", "create", "fixed", "get", "names", "params_for", "register"]

METHODS = ("baseline", "pld", "clasp", "admg", "selfdraft", "fractal", "swift", "dv", "lookahead")
FAMILIES = {"pld": "ngram", "selfdraft": "ngram", "lookahead": "ngram", "clasp": "layerskip", "admg": "layerskip",
            "swift": "layerskip", "dv": "layerskip", "fractal": "fractal"}  # the folder of each method's module

for _name in METHODS:
    _module = ".".join(filter(None, (__name__, FAMILIES.get(_name), _name)))
    importlib.import_module(_module)
    if _name not in REGISTRY:
        raise ImportError(f"{_module} registers no drafter named {_name!r}")


def names() -> list[str]:
    """Method names, in `METHODS` order (baseline first)."""
    return list(METHODS)


def get(name: str) -> type[Drafter]:
    if name not in REGISTRY:
        raise SpecGUIError(f"unknown method {name!r}: choose from {', '.join(names())}")
    return REGISTRY[name]


def fixed(name: str, overrides: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """`overrides` with the paper's fixed draft sizes unless they say otherwise (`policy: fixed`, where the method
    sizes its drafts by the cost model): for checks whose verdict is about what the verifier makes of drafts (the
    lossless tests, the smoke), so that there are drafts whatever the machine's prices (the cost model may pause
    them)."""
    fields = {f.name for f in dataclasses.fields(get(name).Params)}
    if "policy" not in fields or (overrides and "policy" in overrides):
        return overrides
    return {**(overrides or {}), "policy": "fixed"}


def params_for(name: str, model_name: str, device: str, overrides: dict[str, Any] | None = None) -> Any:
    """The validated parameters a method would run with on this model and device type."""
    return build_params(name, get(name).Params, model_name, device, overrides)


def create(
    name: str, runner: Runner, model_name: str, sampling: Sampling, overrides: dict[str, Any] | None = None
) -> Drafter:
    cls = get(name)
    return cls(runner, params_for(name, model_name, runner.device.type, overrides), sampling)
