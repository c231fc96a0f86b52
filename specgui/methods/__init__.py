"""Drafting methods by name.

Each module in this package registers its drafter with `@register`; importing the package imports them
all, so adding a method is adding a module. `create` builds a drafter with its preset parameters for
a model and device, plus the caller's overrides.
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from specgui.config import build_params
from specgui.errors import SpecGUIError
from specgui.methods.base import REGISTRY, DecodeState, Drafter, register
from specgui.runner import Runner
from specgui.sampling import Sampling

__all__ = ["DecodeState", "Drafter", "create", "get", "names", "params_for", "register"]

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")

ORDER = ("baseline", "pld", "clasp", "admg", "selfdraft", "fractal")


def names() -> list[str]:
    """Registered method names, baseline first."""
    return sorted(REGISTRY, key=lambda n: (ORDER.index(n) if n in ORDER else len(ORDER), n))


def get(name: str) -> type[Drafter]:
    if name not in REGISTRY:
        raise SpecGUIError(f"unknown method {name!r}: choose from {', '.join(names())}")
    return REGISTRY[name]


def params_for(name: str, model_name: str, device: str, overrides: dict[str, Any] | None = None) -> Any:
    """The validated parameters a method would run with on this model and device type."""
    return build_params(name, get(name).Params, model_name, device, overrides)


def create(
    name: str, runner: Runner, model_name: str, sampling: Sampling, overrides: dict[str, Any] | None = None
) -> Drafter:
    cls = get(name)
    return cls(runner, params_for(name, model_name, runner.device.type, overrides), sampling)
