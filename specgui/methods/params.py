"""Method parameters: declared once with their ranges, validated wherever values come from.

Values come from `configs/<method>.yaml`, CLI flags and the app's panel; all of them pass `validate`,
and the app builds its sliders from the same metadata (`specs`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import yaml

from specgui.errors import SpecGUIError

_TYPES = {"int": int, "float": float, "bool": bool, "str": str}


def param(*, low: float | None = None, high: float | None = None, choices: tuple | None = None, help: str) -> Any:
    """Declare a tunable: its range or choices and a one-line help (values come from configs/)."""
    return dataclasses.field(metadata={"low": low, "high": high, "choices": choices, "help": help})


@dataclass(frozen=True)
class NoParams:
    """For methods without tunables."""


def validate(params: Any) -> None:
    """Check every field against its declared type, range and choices."""
    for f in dataclasses.fields(params):
        value, meta = getattr(params, f.name), f.metadata
        kind = field_type(f)
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
            object.__setattr__(params, f.name, value)
        if kind is not None and (not isinstance(value, kind) or (kind is int and isinstance(value, bool))):
            raise SpecGUIError(f"{f.name} must be {kind.__name__}, got {value!r}")
        if kind is float and not math.isfinite(value):  # NaN passes every comparison below
            raise SpecGUIError(f"{f.name} must be a finite number, got {value}")
        if meta.get("choices") and value not in meta["choices"]:
            raise SpecGUIError(f"{f.name} must be one of {', '.join(map(str, meta['choices']))}, got {value!r}")
        if meta.get("low") is not None and value < meta["low"]:
            raise SpecGUIError(f"{f.name} must be >= {meta['low']}, got {value}")
        if meta.get("high") is not None and value > meta["high"]:
            raise SpecGUIError(f"{f.name} must be <= {meta['high']}, got {value}")


def field_type(f: dataclasses.Field) -> type | None:
    """The Python type of a Params field (annotations are strings under `from __future__`)."""
    return f.type if isinstance(f.type, type) else _TYPES.get(str(f.type))


def specs(params_cls: type) -> list[dict[str, Any]]:
    """Name, type, range, choices and help of each field, for building input widgets."""
    return [
        {"name": f.name, "type": field_type(f), **f.metadata}
        for f in dataclasses.fields(params_cls)
    ]


def parse_value(text: str) -> Any:
    """A parameter value typed on a command line (`--param`, a bench entry's `+KEY=VALUE`): a number, true/false or a
    word, read as YAML reads it."""
    value = yaml.safe_load(text)
    if not isinstance(value, (int, float, str, bool)):
        raise SpecGUIError(f"parameter value {text!r} must be a number, true/false or a word")
    return value


def parse_setting(text: str, refusal: str) -> tuple[str, Any]:
    """A KEY=VALUE typed on a command line (`--param`, `--set`, a bench entry's `+KEY=VALUE`), its value read by
    `parse_value`; `refusal` is the one-line error where the text is not of that form."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise SpecGUIError(refusal)
    return key, parse_value(value)
