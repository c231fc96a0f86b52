"""Views -> plotly figures: tokens per step, the skip heatmap, time per phase, the race, the Compare chart.

Figures use transparent backgrounds and mid-grey text so one figure reads in the light and the dark
theme, and the token-kind colours of the text panes (accepted green, verifier blue / orange). `gr.Plot`
resends a whole figure on every update, so the page redraws these every few seconds, not every step.
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


def _layout(fig: go.Figure, title: str, x: str, y: str, **extra: Any) -> go.Figure:
    fig.update_layout(
        title={"text": title, "x": 0.01, "font": {"size": 15}}, height=300, margin={"l": 50, "r": 10, "t": 40, "b": 40},
        paper_bgcolor="rgba(0,0,0,0)", plot_bgcolor="rgba(0,0,0,0)", font={"color": "#8a8f98", "size": 13},
        legend={"orientation": "h", "y": 1.02, "x": 1, "xanchor": "right", "yanchor": "bottom"}, **extra,
    )
    grid = {"gridcolor": "rgba(128,128,128,0.25)", "zerolinecolor": "rgba(128,128,128,0.4)"}
    fig.update_xaxes(title_text=x, **grid)
    fig.update_yaxes(title_text=y, **grid)
    return fig


def _empty(title: str, message: str) -> go.Figure:
    fig = _layout(go.Figure(), title, "", "")
    fig.add_annotation(text=message, showarrow=False, x=0.5, y=0.5, xref="paper", yref="paper")
    fig.update_xaxes(visible=False)
    fig.update_yaxes(visible=False)
    return fig


def accepted_per_step(view: RunView) -> go.Figure:
    """Stacked bars: accepted draft tokens, then the verifier's own token; drafted tokens as markers."""
    title = "Tokens per step"
    if not view.steps:
        return _empty(title, "no steps yet")
    x = [s.index for s in view.steps]
    own = [len(s.emitted) - min(s.accepted, len(s.emitted)) for s in view.steps]
    fig = go.Figure([
        go.Bar(x=x, y=[min(s.accepted, len(s.emitted)) for s in view.steps], name="accepted draft",
               marker_color=COLORS["accepted"]),
        go.Bar(x=x, y=[o if not s.corrected else 0 for o, s in zip(own, view.steps)], name="bonus",
               marker_color=COLORS["bonus"]),
        go.Bar(x=x, y=[o if s.corrected else 0 for o, s in zip(own, view.steps)], name="correction",
               marker_color=COLORS["correction"]),
        go.Scatter(x=x, y=[s.drafted for s in view.steps], name="drafted", mode="markers",
                   marker={"color": COLORS["drafted"], "symbol": "line-ew-open", "size": 12, "line": {"width": 2}}),
    ])
    return _layout(fig, title, "step", "tokens", barmode="stack", bargap=0.15)


def skip_heatmap(view: RunView) -> go.Figure:
    """Sub-layers x steps: which sub-layers each draft skipped; re-optimisation steps marked on top."""
    title = "Skipped sub-layers per step"
    layers = view.num_layers
    internals = [view.internals(i) for i in range(len(view.steps))]
    if not layers or not any(i.has_skip for i in internals):
        return _empty(title, f"{view.method or 'this method'} skips no layers")
    x = [s.index for s in view.steps]
    labels = [f"L{layer} {kind}" for layer in range(layers) for kind in ("attn", "mlp")]
    z = [[int(layer in (i.skip_attn if kind == "attn" else i.skip_mlp)) for i in internals]
         for layer in range(layers) for kind in ("attn", "mlp")]
    fig = go.Figure(go.Heatmap(x=x, y=labels, z=z, zmin=0, zmax=1, showscale=False, xgap=1, ygap=0,
                               colorscale=[[0, "rgba(128,128,128,0.12)"], [1, COLORS["skip"]]],
                               hovertemplate="step %{x}<br>%{y}: %{z}<extra>1 = skipped</extra>"))
    reopt = [s for s, i in zip(x, internals) if i.reoptimized]
    if reopt:
        fig.add_trace(go.Scatter(x=reopt, y=[labels[0]] * len(reopt), mode="markers", name="re-optimised",
                                 marker={"symbol": "triangle-down", "size": 10, "color": COLORS["draft"]},
                                 cliponaxis=False))
    fig = _layout(fig, title, "step", "")
    fig.update_yaxes(autorange="reversed", showticklabels=True, tickfont={"size": 9}, nticks=16)
    fig.update_layout(height=360)
    return fig


def phase_times(view: RunView) -> go.Figure:
    """Stacked bars of draft, verify and overhead milliseconds per step."""
    title = "Time per phase per step"
    if not view.steps:
        return _empty(title, "no steps yet")
    x = [s.index for s in view.steps]
    fig = go.Figure([go.Bar(x=x, y=[getattr(s, f"{phase}_ms") for s in view.steps], name=phase,
                            marker_color=COLORS[phase]) for phase in ("draft", "verify", "overhead")])
    return _layout(fig, title, "step", "ms", barmode="stack", bargap=0.15)


def race(method: RunView, baseline: RunView) -> go.Figure:
    """Tokens generated against decoding time, method and baseline on one clock each."""
    title = "Race: tokens vs decoding time"
    fig = go.Figure()
    runs = [(method, method.method or "method", COLORS["method"])]
    if method.method != "baseline":  # else the baseline pane holds the same run again
        runs.append((baseline, "baseline", COLORS["baseline"]))
    for view, name, color in runs:
        if view.start is None:
            continue
        seconds, counts = zip(*view.race)
        fig.add_trace(go.Scatter(x=seconds, y=counts, name=name, mode="lines", line={"shape": "hv", "width": 3,
                                                                                   "color": color}))
    if not fig.data:
        return _empty(title, "no run yet")
    return _layout(fig, title, "seconds", "tokens")


def compare_chart(report: dict[str, Any]) -> go.Figure:
    """Speedup and tau per method and category (a bench report's `categories`), side by side."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("speedup over baseline", "tau (tokens per verify)"))
    categories = list(report["categories"])
    for n, name in enumerate(report["methods"]):
        color = SERIES[n % len(SERIES)]
        speedups = [report["categories"][c][name]["speedup"] for c in categories]
        taus = [report["categories"][c][name]["mean_accepted"] for c in categories]
        fig.add_trace(go.Bar(x=categories, y=speedups, name=name, marker_color=color, legendgroup=name), 1, 1)
        fig.add_trace(go.Bar(x=categories, y=taus, name=name, marker_color=color, legendgroup=name,
                             showlegend=False), 1, 2)
    fig = _layout(fig, "", "", "", barmode="group")
    fig.update_layout(height=380, margin={"t": 60})
    return fig
