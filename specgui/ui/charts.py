"""Views -> plotly figures: tokens per step, the skip heatmap, time per phase, the race, the Compare chart.

Figures use transparent backgrounds and mid-grey text so one figure reads in the light and the dark
theme, and the token-kind colours of the text panes (accepted green, verifier blue / orange). Text is 16 px
or more, to be read from the back of a room. `gr.Plot` resends a whole figure on every update, so a live
run redraws these every few seconds, not every step (the race replay, which decodes nothing, every frame).
Each figure is built in one piece from a plain layout dict: plotly's `update_layout` and `update_xaxes` parse
and validate every key path again (7 ms a figure against 1 ms for the constructor, measured here), and the
race alone draws four figures a second while a live run decodes on the same cores.
"""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from specgui.ui.view import RunView

COLORS = {"accepted": "#2e9e5b", "bonus": "#3b7dd8", "correction": "#e08a1e", "drafted": "#9aa0a6",
          "draft": "#8e6bd8", "verify": "#3b7dd8", "overhead": "#9aa0a6", "skip": "#d64545", "method": "#2e9e5b",
          "baseline": "#9aa0a6"}
SERIES = ("#2e9e5b", "#3b7dd8", "#e08a1e", "#8e6bd8", "#d64545", "#1fa5a5", "#c2409a", "#7f7f7f")
FONT, TITLE_FONT = 16, 18  # px: readable on a projector
RACE_HEIGHT = 250  # fits under the panes in the stage view at 1280x720


GRID = {"gridcolor": "rgba(128,128,128,0.25)", "zerolinecolor": "rgba(128,128,128,0.4)"}


def _figure(data: list, title: str, x: str, y: str, *, message: str | None = None, base: dict | None = None,
            **layout: Any) -> go.Figure:
    """`data` under the shared look: title, axis titles, grid, transparent background, legend under the axis
    title (never over the chart's title or its bars). `message` replaces an empty chart's axes; `base` is a
    layout to start from (make_subplots' domains); `layout` overrides any part, merged key by key."""
    look = {"title": {"text": title, "x": 0.01, "font": {"size": TITLE_FONT}}, "height": 340,
            "margin": {"l": 60, "r": 10, "t": 40, "b": 110}, "paper_bgcolor": "rgba(0,0,0,0)",
            "plot_bgcolor": "rgba(0,0,0,0)", "font": {"color": "#8a8f98", "size": FONT},
            "legend": {"orientation": "h", "y": -0.28, "x": 0, "xanchor": "left", "yanchor": "top"}}
    merged = _merged(base or {}, look)
    for axis in {"xaxis", "yaxis", *(k for k in merged if k[1:].startswith("axis"))}:
        merged[axis] = _merged(merged.get(axis, {}), {"title": {"text": x if axis[0] == "x" else y}, **GRID})
    if message is not None:
        merged["annotations"] = [{"text": message, "showarrow": False, "x": 0.5, "y": 0.5, "xref": "paper",
                                  "yref": "paper"}]
        merged["xaxis"]["visible"] = merged["yaxis"]["visible"] = False
    return go.Figure(data, layout=_merged(merged, layout))


def _merged(base: dict, over: dict) -> dict:
    """`base` with `over` written on top, nested dicts merged rather than replaced (as `update_layout` does)."""
    out = dict(base)
    for key, value in over.items():
        out[key] = _merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _empty(title: str, message: str, **layout: Any) -> go.Figure:
    return _figure([], title, "", "", message=message, **layout)


def accepted_per_step(view: RunView) -> go.Figure:
    """Stacked bars: accepted draft tokens, then the verifier's own token; drafted tokens as markers."""
    title = "Tokens per step"
    if not view.steps:
        return _empty(title, "no steps yet")
    x = [s.index for s in view.steps]
    own = [len(s.emitted) - min(s.accepted, len(s.emitted)) for s in view.steps]
    return _figure([
        go.Bar(x=x, y=[min(s.accepted, len(s.emitted)) for s in view.steps], name="accepted draft",
               marker_color=COLORS["accepted"]),
        go.Bar(x=x, y=[o if not s.corrected else 0 for o, s in zip(own, view.steps)], name="bonus",
               marker_color=COLORS["bonus"]),
        go.Bar(x=x, y=[o if s.corrected else 0 for o, s in zip(own, view.steps)], name="correction",
               marker_color=COLORS["correction"]),
        go.Scatter(x=x, y=[s.drafted for s in view.steps], name="drafted", mode="markers",
                   marker={"color": COLORS["drafted"], "symbol": "line-ew-open", "size": 12, "line": {"width": 2}}),
    ], title, "step", "tokens", barmode="stack", bargap=0.15)


def skip_heatmap(view: RunView) -> go.Figure:
    """Sub-layers x steps: which sub-layers each draft skipped; paused and re-optimisation steps marked on top."""
    title = "Skipped sub-layers per step"
    layers = view.num_layers
    internals = [view.internals(i) for i in range(len(view.steps))]
    if not layers or not any(i.has_skip for i in internals):
        return _empty(title, f"{view.method or 'this method'} skips no layers")
    x = [s.index for s in view.steps]
    labels = [f"L{layer} {kind}" for layer in range(layers) for kind in ("attn", "mlp")]
    # a paused step drafted nothing: its column stays empty rather than showing a skip set that did not run
    z = [[None if i.paused else int(layer in (i.skip_attn if kind == "attn" else i.skip_mlp)) for i in internals]
         for layer in range(layers) for kind in ("attn", "mlp")]
    data = [go.Heatmap(x=x, y=labels, z=z, zmin=0, zmax=1, showscale=False, xgap=1, ygap=0,
                       colorscale=[[0, "rgba(128,128,128,0.12)"], [1, COLORS["skip"]]],
                       hovertemplate="step %{x}<br>%{y}: %{z}<extra>1 = skipped</extra>")]
    for name, steps, symbol, color in (
            ("re-optimised", [s for s, i in zip(x, internals) if i.reoptimized], "triangle-down", COLORS["draft"]),
            ("paused (nothing drafted)", [s for s, i in zip(x, internals) if i.paused], "line-ew-open",
             COLORS["drafted"])):
        if steps:
            data.append(go.Scatter(x=steps, y=[labels[0]] * len(steps), mode="markers", name=name,
                                   cliponaxis=False,
                                   marker={"symbol": symbol, "size": 12, "color": color, "line": {"width": 2}}))
    # one label every five layers, at a size a room can read (sixty sub-layer rows would be a blur)
    shown = range(0, layers, 5)
    return _figure(data, title, "step", "", height=460,
                   yaxis={"autorange": "reversed", "tickvals": [f"L{layer} attn" for layer in shown],
                          "ticktext": [f"layer {layer}" for layer in shown]})


def phase_times(view: RunView) -> go.Figure:
    """Stacked bars of draft, verify and overhead milliseconds per step."""
    title = "Time per phase per step"
    if not view.steps:
        return _empty(title, "no steps yet")
    x = [s.index for s in view.steps]
    return _figure([go.Bar(x=x, y=[getattr(s, f"{phase}_ms") for s in view.steps], name=phase,
                           marker_color=COLORS[phase]) for phase in ("draft", "verify", "overhead")],
                   title, "step", "ms", barmode="stack", bargap=0.15)


def cost_profile(view: RunView) -> go.Figure:
    """The cost model's measured forward curve (ms against tokens per forward, per context) and the plain step,
    with this run's verify forwards as measured: where the run's steps sit on the curve it was sized by."""
    title = "Cost profile: ms per forward"
    curve = view.start.costs if view.start is not None else {}
    sizes, forward = curve.get("sizes"), curve.get("forward")
    if not (isinstance(sizes, list) and isinstance(forward, list) and sizes and forward):
        return _empty(title, "no cost profile in this run")
    data = [go.Scatter(x=sizes, y=row, name=f"forward, {context} cached", mode="lines+markers")
            for context, row in zip(curve.get("contexts", []), forward)
            if isinstance(row, list) and len(row) == len(sizes)]
    if view.steps:
        data.append(go.Scatter(x=[s.forward_tokens for s in view.steps], y=[s.verify_ms for s in view.steps],
                               name="this run's verifies", mode="markers",
                               marker={"color": COLORS["method"], "size": 9, "opacity": 0.6}))
    step = curve.get("step")
    marks: dict[str, Any] = {}
    if isinstance(step, (int, float)) and step > 0:  # the plain step: a dashed line across, labelled at its left
        marks = {"shapes": [{"type": "line", "xref": "x domain", "x0": 0, "x1": 1, "yref": "y", "y0": step, "y1": step,
                             "line": {"dash": "dash", "color": COLORS["baseline"]}}],
                 "annotations": [{"text": f"plain step {step:.1f} ms", "showarrow": False, "xref": "x domain", "x": 0,
                                  "xanchor": "left", "yref": "y", "y": step, "yanchor": "bottom"}]}
    return _figure(data, title, "tokens per forward", "ms", xaxis={"type": "log"}, **marks)


def race_span(method: RunView, baseline: RunView) -> tuple[float, int]:
    """The race's axes (seconds, tokens): fixed while it replays, so the lines grow across a still frame."""
    return (max(method.seconds, baseline.seconds, 0.1), max(method.new_tokens, baseline.new_tokens, 1))


def race(method: RunView, baseline: RunView, span: tuple[float, int] | None = None) -> go.Figure:
    """Tokens generated against decoding time, method and baseline on one clock each."""
    title = "Race: tokens vs decoding time"
    name = method.method or "method"
    runs = [(method, f"{name} (noise check)" if name == "baseline" else name, COLORS["method"]),
            (baseline, "baseline", COLORS["baseline"])]
    data = []
    for view, label, color in runs:
        if view.start is not None:
            seconds, counts = zip(*view.race)
            data.append(go.Scatter(x=seconds, y=counts, name=label, mode="lines",
                                   line={"shape": "hv", "width": 4, "color": color}))
    # two short names: the legend fits beside the title, which keeps the race short enough for the stage view
    layout: dict[str, Any] = {"height": RACE_HEIGHT, "margin": {"t": 40, "b": 45},
                              "legend": {"orientation": "h", "y": 1.02, "x": 1, "xanchor": "right",
                                         "yanchor": "bottom"}}
    if not data and span is None:
        return _empty(title, "no run yet", **layout)
    if span is not None:
        layout |= {"xaxis": {"range": [0, span[0] * 1.02]}, "yaxis": {"range": [0, span[1] * 1.05]}}
    return _figure(data, title, "seconds", "tokens", **layout)


def compare_chart(report: dict[str, Any]) -> go.Figure:
    """Speedup and tau per method and category (a bench report's `categories`), side by side."""
    grid = make_subplots(rows=1, cols=2, subplot_titles=("speedup over baseline", "tau (tokens per verify)"))
    data = []
    categories = list(report["categories"])
    for n, name in enumerate(report["methods"]):
        color = SERIES[n % len(SERIES)]
        speedups = [report["categories"][c][name]["speedup"] for c in categories]
        taus = [report["categories"][c][name]["mean_accepted"] for c in categories]
        data.append(go.Bar(x=categories, y=speedups, name=name, marker_color=color, legendgroup=name, xaxis="x",
                           yaxis="y"))
        data.append(go.Bar(x=categories, y=taus, name=name, marker_color=color, legendgroup=name, showlegend=False,
                           xaxis="x2", yaxis="y2"))
    # the legend to the right: above, it ran into the subplot titles; below, into the slanted category names
    return _figure(data, "", "", "", base=grid.layout.to_plotly_json(), barmode="group", height=420,
                   margin={"t": 40, "b": 90},
                   legend={"orientation": "v", "y": 1, "x": 1.01, "xanchor": "left", "yanchor": "top"})
