"""Presets: method parameters per model and device, from YAML files under `configs/`.

`configs/<method>.yaml` holds `defaults` (every parameter) and an ordered list of `presets`, each with a
case-insensitive `match` on the model name and an optional `device` ("cpu", "cuda", "mps"); matching
presets apply in order, then the caller's overrides. Values live here, not in code, so that tuning a
method for a new model is a YAML edit.
"""

from __future__ import annotations

import dataclasses
import os
from functools import cache
from pathlib import Path
from typing import Any

import yaml

from specgui import REPO_DIR
from specgui.errors import SpecGUIError
from specgui.methods.params import NoParams, validate

CONFIG_DIR = Path(os.environ.get("SPECGUI_CONFIGS", REPO_DIR / "configs"))


@cache
def _read(name: str) -> dict[str, Any]:
    path = CONFIG_DIR / f"{name}.yaml"
    if not path.is_file():
        return {}
    data = yaml.safe_load(path.read_text(encoding="utf-8")) or {}
    if not isinstance(data, dict):
        raise SpecGUIError(f"{path} must hold a mapping")
    return data


def preset_values(method: str, model_name: str, device: str) -> dict[str, Any]:
    """Merged parameter values for a method on a model and device type (before user overrides)."""
    data = _read(method)
    values = dict(data.get("defaults") or {})
    for preset in data.get("presets") or []:
        if preset.get("match", "").lower() not in model_name.lower():
            continue
        if preset.get("device") not in (None, device):
            continue
        values.update(preset.get("params") or {})
    return values


DECODING_KEYS = ("max_new_tokens", "temperature", "top_p", "top_k", "max_new_tokens_cap")


def decoding_defaults() -> dict[str, Any]:
    """Front-end defaults (max new tokens, temperature, ...) from configs/decoding.yaml, every key present."""
    values = dict(_read("decoding"))
    missing = [k for k in DECODING_KEYS if k not in values]
    if missing:
        raise SpecGUIError(f"{CONFIG_DIR / 'decoding.yaml'} lacks {', '.join(missing)}")
    return values


def build_params(method: str, params_cls: type, model_name: str, device: str, overrides: dict | None = None) -> Any:
    """Instantiate and validate a method's Params from presets plus overrides."""
    if params_cls is NoParams:
        if overrides:
            raise SpecGUIError(f"method {method} takes no parameters (got {', '.join(overrides)})")
        return NoParams()
    values = preset_values(method, model_name, device)
    names = {f.name for f in dataclasses.fields(params_cls)}
    for key in overrides or {}:
        if key not in names:
            raise SpecGUIError(f"unknown parameter {key!r} for {method}: known are {', '.join(sorted(names))}")
    values.update(overrides or {})
    missing = names - set(values)
    if missing:
        raise SpecGUIError(f"configs/{method}.yaml lacks defaults for {', '.join(sorted(missing))}")
    unknown = set(values) - names
    if unknown:
        raise SpecGUIError(f"configs/{method}.yaml sets unknown parameters {', '.join(sorted(unknown))}")
    params = params_cls(**values)
    validate(params)
    return params
