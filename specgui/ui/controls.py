"""Input widgets built from metadata: a parameter panel per method, decoding settings, example prompts.

Presets (`configs/demos.yaml`) set method, prompt and budget in one choice, for a stage demo.
Each method's panel comes from `specgui.methods.params.specs(cls.Params)` (type, range, choices, help) with
values from `methods.params_for` (the `configs/` preset for the model and device), so a method that
lands with a new `Params` gets its panel without a line of UI code. All panels exist at once and only
the chosen method's is visible: gradio's layout is fixed when the page is built.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gradio as gr
import yaml

from specgui import methods
from specgui.core.sampling import Sampling
from specgui.core.text import Messages
from specgui.errors import SpecGUIError
from specgui.methods.params import specs
from specgui.methods.presets import CONFIG_DIR, decoding_defaults
from specgui.tools.prompts import PromptRow, load_prompts

SLIDER_STEPS = 100  # float sliders move in 1/100 of their range


def _widget(spec: dict[str, Any], value: Any) -> gr.components.Component:
    label, info = spec["name"], spec["help"]
    kind, low, high = spec["type"], spec.get("low"), spec.get("high")
    if spec.get("choices"):
        return gr.Dropdown(list(spec["choices"]), value=value, label=label, info=info)
    if kind is bool:
        return gr.Checkbox(value=value, label=label, info=info)
    if kind in (int, float) and low is not None and high is not None:
        step = 1 if kind is int else (high - low) / SLIDER_STEPS
        return gr.Slider(low, high, value=value, step=step, label=label, info=info)
    if kind in (int, float):
        return gr.Number(value=value, precision=0 if kind is int else None, label=label, info=info)
    return gr.Textbox(value=str(value), label=label, info=info)


def _cast(spec: dict[str, Any], value: Any) -> Any:
    """A widget's value as the parameter's type (sliders and numbers hand back floats)."""
    kind = spec["type"]
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    return value


@dataclass
class ParamPanel:
    """Every method's parameter widgets; `keys[i]` = (method, parameter) of `components[i]`."""

    groups: dict[str, gr.Group]
    components: list[gr.components.Component]
    keys: list[tuple[str, str]]
    specs: list[dict[str, Any]]

    def overrides(self, method: str, values: list[Any]) -> dict[str, Any]:
        """The chosen method's parameters from the panel's values (all widgets, in `components` order)."""
        return {name: _cast(spec, value) for (m, name), spec, value in zip(self.keys, self.specs, values)
                if m == method}

    def show(self, method: str) -> list[dict[str, Any]]:
        """Visibility updates for the groups, in `groups` order."""
        return [gr.update(visible=name == method) for name in self.groups]

    def presets(self, model_name: str, device: str, method: str = "",
                overrides: dict[str, Any] | None = None) -> list[Any]:
        """Every widget's preset value for a model and device (a model change re-reads configs/), with
        `overrides` applied to `method`'s widgets (a demo preset's own settings)."""
        values = []
        for name in dict.fromkeys(m for m, _ in self.keys):
            defaults = {**preset(name, model_name, device), **((overrides or {}) if name == method else {})}
            values += [defaults[p] for m, p in self.keys if m == name]
        return values


def preset(method: str, model_name: str, device: str) -> dict[str, Any]:
    params = methods.params_for(method, model_name, device)
    return dataclasses.asdict(params) if dataclasses.is_dataclass(params) else {}


def param_panel(model_name: str, device: str, shown: str) -> ParamPanel:
    """Build (inside a gradio context) one group of widgets per registered method, only `shown`'s visible."""
    groups, components, keys, all_specs = {}, [], [], []
    for name in methods.names():
        cls = methods.get(name)
        method_specs = specs(cls.Params)
        with gr.Group(visible=name == shown) as group:
            if not method_specs:
                gr.Markdown(f"`{name}` has no parameters.")
            values = preset(name, model_name, device)
            for spec in method_specs:
                components.append(_widget(spec, values[spec["name"]]))
                keys.append((name, spec["name"]))
                all_specs.append(spec)
        groups[name] = group
    return ParamPanel(groups, components, keys, all_specs)


def method_help() -> str:
    """A markdown table of the registered methods and what they draft."""
    rows = [f"| `{n}` | {methods.get(n).summary} |" for n in methods.names()]
    return "| method | how it drafts |\n|---|---|\n" + "\n".join(rows)


def max_new_tokens_cap() -> int:
    return int(decoding_defaults()["max_new_tokens_cap"])


def sampling_from(mode: str, temperature: float, top_p: float, seed: float | None) -> Sampling:
    """Decoding settings from the panel: greedy ignores temperature; an empty seed means fresh entropy."""
    if mode == "greedy":
        return Sampling()
    temperature = number(temperature, "temperature")
    if temperature <= 0:
        raise SpecGUIError("sampling needs a temperature above 0 (or choose greedy)")
    if seed is None or seed == "":
        return Sampling(temperature=temperature, top_p=number(top_p, "top-p"))
    whole = number(seed, "seed")
    if not 0 <= whole < 2**63:  # what torch's generator takes
        raise SpecGUIError(f"the seed must be a whole number from 0 to 2^63 - 1, got {whole:.3g}")
    return Sampling(temperature=temperature, top_p=number(top_p, "top-p"), seed=int(whole))


def number(value: Any, what: str) -> float:
    """A finite number from a widget or an API caller (who may send anything), or a one-line error."""
    try:
        x = float(value)
    except (TypeError, ValueError, OverflowError):
        raise SpecGUIError(f"{what} must be a number, got {str(value)[:40]!r}") from None
    if not math.isfinite(x):
        raise SpecGUIError(f"{what} must be a finite number, got {x}")
    return x


def clamp_tokens(value: Any) -> tuple[int, str]:
    """Max new tokens as an int within the app's cap, and a note when the request was capped."""
    cap = max_new_tokens_cap()
    n = int(min(number(value, "max new tokens"), cap + 1))
    if n < 1:
        raise SpecGUIError(f"max new tokens must be at least 1, got {n}")
    return (cap, f"max new tokens capped at {cap} in the app") if n > cap else (n, "")


@dataclass(frozen=True)
class Example:
    """A suite prompt offered in the examples list."""

    label: str
    row: PromptRow


def examples() -> list[Example]:
    """One entry per suite prompt, labelled 'category · id: start of the last user turn'."""
    out = []
    for row in load_prompts():
        preview = " ".join(row.preview.split())
        out.append(Example(f"{row.category} · {row.id}: {preview[:60]}{'…' if len(preview) > 60 else ''}", row))
    return out


def prompt_for(text: str, example: Example | None) -> str | Messages:
    """What to encode: the example's whole conversation while its last turn is unedited, else the text."""
    if example is not None and example.row.messages is not None and text.strip() == example.row.preview.strip():
        return example.row.messages
    return text


DEMOS_FILE = CONFIG_DIR / "demos.yaml"
DEMOS_ENV = "SPECGUI_DEMOS"  # a file of demo presets in place of configs/demos.yaml: a deployment's own choice


def demos_file() -> Path:
    """Where the demo presets are: SPECGUI_DEMOS where set (a deployment's own presets, or a short list for a quick
    start), else `configs/demos.yaml`."""
    chosen = os.environ.get(DEMOS_ENV, "").strip()
    return Path(chosen) if chosen else DEMOS_FILE


@dataclass(frozen=True)
class Preset:
    """One click's worth of settings: a method on a suite prompt where it shows something, with a budget, and
    the method parameters it sets beyond the configs/ presets (e.g. the paper's fixed schedule, to show a
    mechanism that the cost model would pause on this device)."""

    name: str
    method: str
    example: Example
    max_new_tokens: int
    params: dict[str, Any] = field(default_factory=dict)


def presets(examples: list[Example], path: Path | None = None) -> list[Preset]:
    """The presets in `path` (default: `demos_file()`), each checked against the methods, the suite and the token
    cap."""
    path = path or demos_file()
    by_id = {e.row.id: e for e in examples}
    rows = yaml.safe_load(path.read_text(encoding="utf-8")) if path.is_file() else None
    if not isinstance(rows, list) or not rows:
        raise SpecGUIError(f"{path} must hold a list of presets")
    out = []
    for n, row in enumerate(rows, start=1):
        where = f"{path.name}, preset {n}"
        if not isinstance(row, dict) or not all(isinstance(row.get(k), str) for k in ("name", "method", "prompt")):
            raise SpecGUIError(f"{where}: needs text fields name, method and prompt")
        if row["method"] not in methods.names():
            raise SpecGUIError(f"{where}: unknown method {row['method']!r}")
        if row["prompt"] not in by_id:
            raise SpecGUIError(f"{where}: no suite prompt with id {row['prompt']!r}")
        tokens = row.get("max_new_tokens")
        if not isinstance(tokens, int) or not 1 <= tokens <= max_new_tokens_cap():
            raise SpecGUIError(f"{where}: max_new_tokens must be an integer from 1 to {max_new_tokens_cap()}")
        params = row.get("params", {})
        if not isinstance(params, dict):
            raise SpecGUIError(f"{where}: params must be a mapping of parameter names to values")
        try:
            methods.params_for(row["method"], "", "cpu", params)
        except SpecGUIError as exc:
            raise SpecGUIError(f"{where}: {exc}") from None
        out.append(Preset(row["name"], row["method"], by_id[row["prompt"]], tokens, params))
    return out
