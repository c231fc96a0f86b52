"""Views -> HTML for the page's `gr.HTML` components.

`gr.HTML` is not sanitised, and everything shown here comes from a model, a user or a trace file, so
every string passes through `esc` on its way in; numbers are formatted, never interpolated raw. Colours
live in `assets/app.css` as classes (`sg-accepted`, ...) with light and dark variants, so the markup
carries meaning and the stylesheet carries looks.
"""

from __future__ import annotations

import html
import re
import time

from specgui.ui.view import (
    ACCEPTED,
    BONUS,
    CORRECTION,
    KIND_HELP,
    REJECTED,
    Comparison,
    Internals,
    RunView,
    Spread,
    TokenText,
    Why,
    node_verdicts,
)

TINTS = 8  # fractal-layer tints defined in app.css (sg-o0 .. sg-o7)
MAX_TREE_NODES = 96  # larger drafts are summarised in the inspector
PHASES = ("draft", "verify", "overhead")
# Chat and end-of-text special tokens (ChatML, Llama 3, Qwen, Phi: <|name|>; Llama 2: </s>): shown as a small
# stop mark, not as raw markup. Matched on text because a replayed trace carries no tokenizer.
SPECIAL = re.compile(r"<\|[A-Za-z0-9_.:-]{1,40}\|>|</s>")


def esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def status(message: str, kind: str = "info") -> str:
    """One line above the panes: what the app is doing, or what went wrong ("info", "busy", "error")."""
    return f'<div class="sg-status sg-status-{esc(kind)}">{esc(message)}</div>'


def progress_line(message: str, done: int, total: int | None) -> str:
    """A busy status line with a bar of `done` of `total` steps (no bar when the total is not known)."""
    bar = f'<progress class="sg-progress" value="{done}" max="{total}"></progress>' if total else ""
    return f'<div class="sg-status sg-status-busy">{bar}{esc(message)}</div>'


def legend(fractal_layers: list[int] | tuple[int, ...] = (), num_layers: int = 0) -> str:
    """The colour key for token kinds (and fractal tints when a run has them, with the layer numbering)."""
    chips = [f'<span class="sg-tok sg-{kind}" title="{esc(KIND_HELP[kind])}">{esc(label)}</span>'
             for kind, label in ((ACCEPTED, "accepted draft"), (BONUS, "verifier: bonus"),
                                 (CORRECTION, "verifier: correction"), (REJECTED, "rejected draft"))]
    if fractal_layers:
        chips.append(f'<span class="sg-muted">fractal draft from{esc(_numbering(num_layers))}:</span>')
    chips += [f'<span class="sg-tok sg-origin {_tint(layer, fractal_layers)}">{esc(_origin(layer, num_layers))}</span>'
              for layer in fractal_layers]
    return f'<div class="sg-legend">{"".join(chips)}</div>'


def _numbering(num_layers: int) -> str:
    return f" (layers 0–{num_layers - 1})" if num_layers > 0 else ""


def _origin(layer: int, num_layers: int) -> str:
    """Where a fractal draft token settled: a compressed pass before a layer, or the full model's own head."""
    return "the full model's head" if num_layers and layer >= num_layers else f"the pass before layer {layer}"


def _tint(layer: int | None, layers: list[int] | tuple[int, ...]) -> str:
    if layer is None or layer not in layers:
        return ""
    return f"sg-tinted sg-o{list(layers).index(layer) % TINTS}"


def _token(markup: str, classes: str, title: str) -> str:
    """A token chip around already escaped `markup` (see `text`)."""
    return f'<span class="sg-tok {classes}" title="{esc(title)}">{markup}</span>'


def text(piece: str) -> str:
    """Escaped token text with every special token as a small stop mark (its name in the tooltip)."""
    out, end = [], 0
    for found in SPECIAL.finditer(piece):
        out.append(esc(piece[end : found.start()]))
        out.append(f'<span class="sg-special" title="special token {esc(found.group())}"></span>')
        end = found.end()
    return "".join(out) + esc(piece[end:])


def inline(piece: str) -> str:
    """A draft token's text on one line: a newline inside a rejected or inspected draft would break the layout."""
    return piece.replace("\r", "").replace("\n", "↵")


def tokens(view: RunView, *, plain: bool = False) -> str:
    """The streamed output. `plain` (baseline's pane) shows text only; otherwise every token is coloured."""
    if plain:
        return f'<div class="sg-tokens sg-plain">{text("".join(view.pieces))}</div>'
    parts = []
    for mark in view.marks:
        where = "prompt forward" if mark.step == 0 else f"step {mark.step}"
        origin = (f", drafted by {_origin(mark.origin, view.num_layers)}" if mark.origin is not None else "")
        classes = f"sg-{mark.kind} {_tint(mark.origin, view.fractal_layers)}".strip()
        shown = inline(mark.text) if mark.kind == REJECTED else mark.text
        parts.append(_token(text(shown), classes, f"{where}: {KIND_HELP[mark.kind]}{origin}"))
    return f'<div class="sg-tokens">{"".join(parts)}</div>'


def age(stamp: float, now: float | None = None) -> str:
    """How long ago a cached run was recorded, in words a room can read ("40 s ago", "3 min ago")."""
    seconds = max(0.0, (time.time() if now is None else now) - stamp)
    if seconds < 90:
        return f"{seconds:.0f} s ago"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def pane_stats(view: RunView, *, running: bool) -> str:
    """Tokens, decoding time and tokens/s so far (the core's clock: rendering is not counted)."""
    if view.start is None:
        return '<div class="sg-stats">waiting</div>'
    state = "running" if running and not view.done else (f"stop: {view.summary.stop}" if view.done else "")
    cached = (f' <span class="sg-badge sg-cached">cached run, recorded {esc(age(view.cached_at))}</span>'
              if view.cached_at is not None else "")
    return (f'<div class="sg-stats"><b>{view.new_tokens}</b> token{"" if view.new_tokens == 1 else "s"} · '
            f'<b>{view.seconds:.2f}</b> s · '
            f'<b>{view.tokens_per_s:.1f}</b> tok/s · {esc(state)}{cached}</div>')


def pane_title(view: RunView, fallback: str) -> str:
    if view.start is None:
        return f'<div class="sg-pane-title">{esc(fallback)}</div>'
    params = ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in view.start.params.items())
    return (f'<div class="sg-pane-title">{esc(view.start.method)}'
            f'<span class="sg-params">{esc(params)}</span></div>')


def layer_strip(num_layers: int, internals: Internals) -> str:
    """One cell per decoder sub-layer (attention and MLP rows); skipped cells and fractal insertions marked."""
    if num_layers <= 0:
        return ""
    rows = []
    halves = [("attn", "attention", internals.skip_attn, "skipped by the draft"),
              ("mlp", "MLP", internals.skip_mlp, "skipped by the draft")]
    if internals.has_proposal:  # the set a search scored this step, drawn under the one that drafted
        halves += [("try attn", "attention", internals.proposal_attn, "skipped by the set scored this step"),
                   ("try mlp", "MLP", internals.proposal_mlp, "skipped by the set scored this step")]
    for kind, label, skipped, why in halves:
        cells = []
        for layer in range(num_layers):
            skip = layer in skipped
            note = f", prompt attention similarity {internals.acs[layer]:.3f}" if (
                kind == "attn" and layer < len(internals.acs)) else ""
            fractal = _tint(layer, internals.fractal_layers)
            cells.append(f'<span class="sg-cell {"sg-skip" if skip else "sg-ran"} {fractal}" '
                         f'title="layer {layer} {label}: {why if skip else "ran"}{esc(note)}">'
                         f'</span>')
        rows.append(f'<span class="sg-strip-label">{kind}</span>{"".join(cells)}')
    if internals.fractal_layers:
        marks = "".join(
            f'<span class="sg-insert {_tint(layer, internals.fractal_layers)}" '
            f'title="compressed pass spliced in before layer {layer}">◆</span>'
            if layer in internals.fractal_layers else "<span></span>"
            for layer in range(num_layers))
        rows.insert(0, f'<span class="sg-strip-label">fractal</span>{marks}')
    axis = "".join(f"<span>{layer if layer % 5 == 0 else ''}</span>" for layer in range(num_layers))
    rows.append(f'<span class="sg-strip-label">layer</span>{axis}')
    skipped = len(internals.skip_attn) + len(internals.skip_mlp)
    if internals.paused:
        caption = "drafting paused this step (the cost model predicts no draft pays): nothing drafted, nothing skipped"
    elif internals.has_skip:
        caption = f"draft skipped {skipped} of {2 * num_layers} sub-layers"
    else:
        caption = "nothing skipped"
    caption += esc(_numbering(num_layers))
    if internals.reoptimized:
        score = f" (DP score {internals.dp_score:.3f})" if internals.dp_score is not None else ""
        caption += f' · <span class="sg-badge sg-reopt">skip set re-optimised this step{esc(score)}</span>'
    return (f'<div class="sg-strip-wrap"><div class="sg-strip-caption">{caption}</div>'
            f'<div class="sg-strip" style="--layers: {num_layers}">{"".join(rows)}</div></div>')


def _ids_text(ids: tuple[int, ...], token_text: TokenText | None) -> str:
    if token_text is None:
        return " ".join(f"#{t}" for t in ids)
    return "".join(token_text(t) for t in ids)


def _draft_tree(view: RunView, index: int, internals: Internals) -> str:
    step = view.steps[index]
    nodes = node_verdicts(step, internals.origin)
    chain = list(step.draft_parents) == list(range(-1, step.drafted - 1))
    chips = []
    for n in nodes[:MAX_TREE_NODES]:
        conf = (f" · confidence {internals.confidences[n.node]:.2f}"
                if n.node < len(internals.confidences) else "")
        origin = f" · from {_origin(n.origin, view.num_layers)}" if n.origin is not None else ""
        classes = f"sg-{n.verdict} {_tint(n.origin, view.fractal_layers)}"
        chip = _token(text(inline(n.text)), classes, f"node {n.node}: {n.verdict}{origin}{conf}")
        chips.append(chip if chain else f'<div class="sg-node" style="--depth: {n.depth}">{chip}</div>')
    if len(nodes) > MAX_TREE_NODES:
        chips.append(f'<span class="sg-more">… {len(nodes) - MAX_TREE_NODES} more nodes</span>')
    if not nodes:
        chips.append('<span class="sg-muted">no draft this step </span>')
    if len(step.emitted) > step.accepted:
        kind = CORRECTION if step.corrected else BONUS
        chips.append(_token(text(inline(step.emitted_pieces[-1])), f"sg-{kind}", KIND_HELP[kind]))
    return f'<div class="sg-draft {"sg-chain" if chain else "sg-tree"}">{"".join(chips)}</div>'


def _selfdraft(internals: Internals, view: RunView, index: int, token_text: TokenText | None) -> str:
    parts = []
    if internals.branches:
        rows = "".join(
            f'<tr><th>branch {b}</th>{"".join(f"<td>{esc(_ids_text((t,), token_text))}</td>" for t in branch)}</tr>'
            for b, branch in enumerate(internals.branches))
        parts.append(f'<div class="sg-sub">Draft branches</div><table class="sg-grid">{rows}</table>')
    if internals.candidates:
        pieces = view.steps[index].draft_pieces
        items = []
        for c, cand in enumerate(internals.candidates):
            hit = internals.hit is not None and internals.hit[0] == c
            text = "".join(pieces[n] for n in cand.nodes if 0 <= n < len(pieces))
            kept = f' <span class="sg-badge sg-hit">kept {internals.hit[1]} tokens</span>' if hit else ""
            items.append(f'<li class="{"sg-cand-hit" if hit else ""}"><span class="sg-badge sg-src-{esc(cand.source)}">'
                         f'{esc(cand.source)}</span> <code>{esc(_ids_text(cand.key, token_text))}</code> → '
                         f'<span class="sg-cand">{esc(text)}</span>{kept}</li>')
        parts.append(f'<div class="sg-sub">Candidates</div><ol class="sg-cands" start="0">{"".join(items)}</ol>')
    return "".join(parts)


def _search(internals: Internals) -> str:
    """The skip-set search in words: SWIFT's proposal of this step, or Draft & Verify's offline search."""
    f = dict(internals.search)
    if not f:
        return ""

    def num(key: str, fmt: str = ".3f") -> str:
        return format(f[key], fmt) if isinstance(f.get(key), (int, float)) and not isinstance(f[key], bool) else "?"

    if "objective" in f or "cached" in f:  # an offline search, stated once per run
        source = "read from the cache" if f.get("cached") is True else "searched for this model now"
        text = (f"Skip set searched offline by Bayesian optimisation ({source}): {num('iterations', 'd')} sets "
                f"scored in {num('seconds', '.1f')} s; predicted speedup {num('objective', '.2f')}× at "
                f"{num('draft_len', 'd')} draft tokens, matchness {num('matchness')}, draft forward "
                f"{num('draft_cost', '.2f')} of a full one")
    else:
        phase = "optimisation phase" if f.get("phase") == "optimizing" else "optimisation done, skip set fixed"
        text = f"Skip-set search: {phase}, {num('iteration', 'd')} proposals, best matchness {num('best')}"
        if "score" in f:
            kind = "Bayesian" if f.get("kind") == "bayes" else "random"
            verdict = "kept: drafts use it from now" if f.get("kept") is True else "worse than the best: dropped"
            text += f"; this step scored a {kind} proposal at {num('score')} → {verdict}"
    return f'<div class="sg-sub">Skip-set search</div><div class="sg-muted">{esc(text)}</div>'


def _window(internals: Internals, token_text: TokenText | None) -> str:
    """Lookahead's 2-D window: one row per level, level l's column j under position pending + l + j."""
    if not internals.window:
        return ""
    width = max(len(level) for level in internals.window)
    span = width + len(internals.window) - 1
    rows = []
    for level in reversed(range(len(internals.window))):  # the newest guesses on top, as in the paper's figure
        cells = ["<td></td>"] * span
        for j, token in enumerate(internals.window[level]):
            if level + j < span:
                mark = ' class="sg-hit"' if level == 0 and j == 0 else ""
                cells[level + j] = f"<td{mark}>{esc(_ids_text((token,), token_text))}</td>"
        rows.append(f'<tr><th>level {level}</th>{"".join(cells)}</tr>')
    head = "".join(f"<th>+{i}</th>" for i in range(span))
    note = ("each column j is one Jacobi trajectory: level 0 up to column j, then column j of every level; its "
            "next-token guess completes an n-gram for the pool")
    return (f'<div class="sg-sub">Lookahead window (columns: positions after the pending token, +0)</div>'
            f'<table class="sg-grid"><tr><th></th>{head}</tr>{"".join(rows)}</table>'
            f'<div class="sg-muted">{esc(note)}</div>')


def _facts(internals: Internals) -> str:
    facts = [(f"cache {name}", str(size)) for name, size in internals.cache_sizes]
    if internals.harvested is not None:
        facts.append(("n-grams harvested", str(internals.harvested)))
    if internals.exit_reason or internals.exit_threshold is not None:
        threshold = f" at threshold {internals.exit_threshold:.3g}" if internals.exit_threshold is not None else ""
        facts.append(("draft exit", f"{internals.exit_reason or '?'}{threshold}"))
    if internals.draft_len is not None:
        facts.append(("draft length limit", str(internals.draft_len)))
    if internals.vocab is not None:
        size, low, outside, so_far = internals.vocab
        facts.append(("draft vocabulary", f"{size} ids ({low} lowest + {size - low} of the prompt and output)"))
        facts.append(("rejected token outside it", f"{'yes' if outside else 'no'} ({so_far} in the run so far)"))
    if internals.ngram:
        facts.append(("matched n-gram", str(internals.ngram)))
    facts += [(key, f"{ms:.2f} ms") for key, ms in internals.timings]
    facts += list(internals.other)
    if not facts:
        return ""
    items = "".join(f"<div><dt>{esc(k)}</dt><dd>{esc(v)}</dd></div>" for k, v in facts)
    return f'<dl class="sg-facts">{items}</dl>'


def step_detail(view: RunView, index: int, token_text: TokenText | None = None) -> str:
    """The inspector for one step (0-based): draft with verdicts, layer strip, the method's internals."""
    if not view.steps:
        return '<div class="sg-inspector sg-muted">No steps yet.</div>'
    index = max(0, min(index, len(view.steps) - 1))
    step = view.steps[index]
    internals = view.internals(index)
    own = "none (budget reached)" if len(step.emitted) == step.accepted else (
        "correction" if step.corrected else "bonus")
    times = " · ".join(f"{phase} {getattr(step, phase + '_ms'):.1f} ms" for phase in PHASES)
    head = (f'<div class="sg-step-head"><b>Step {step.index}</b> of {len(view.steps)} · drafted {step.drafted} · '
            f'accepted {step.accepted} · verifier token: {own} · forward over {step.forward_tokens} tokens · '
            f'{times}</div>')
    return (f'<div class="sg-inspector">{head}{_draft_tree(view, index, internals)}'
            f'{layer_strip(view.num_layers, internals)}{_search(internals)}{_window(internals, token_text)}'
            f'{_selfdraft(internals, view, index, token_text)}{_facts(internals)}</div>')


def verdict(comparison: Comparison) -> str:
    """Identical to baseline, the first divergence (with baseline's margin there), or why identity does not apply."""
    if comparison.identical:
        return '<span class="sg-badge sg-identical">✓ identical to baseline</span>'
    if comparison.divergence is not None:
        d = comparison.divergence
        margin = f", baseline top-2 margin {d.baseline_margin:.3g}" if d.baseline_margin is not None else ""
        kind = "a numerical near-tie" if d.near_tie else "not a near-tie"
        return (f'<span class="sg-badge sg-diverged">✗ first divergence at token {d.position}</span> '
                f'baseline <code>{esc(repr(comparison.texts[1]))}</code> vs method '
                f'<code>{esc(repr(comparison.texts[0]))}</code>{esc(margin)} ({kind})')
    return f'<span class="sg-badge sg-na">{esc(comparison.note)}</span>'


READY = "Press Run: the method and plain decoding take turns on the same prompt, then race side by side."


def speedup_pending(message: str = READY) -> str:
    """The headline's place before there is a speedup to show."""
    return (f'<div class="sg-speedup sg-speedup-pending"><div class="sg-speedup-head">'
            f'<span class="sg-speedup-figure">–</span></div><div class="sg-why">{esc(message)}</div></div>')


def speedup(method: RunView, baseline: RunView, middle: Spread | None, reason: Why | None,
            comparison: Comparison) -> str:
    """The headline: the speedup (median over the repeats) large, its range, the why line, identity, baseline's age."""
    if middle is None:
        return speedup_pending(comparison.note or "no speedup: a run did not finish")
    what = "noise check: baseline vs itself" if method.method == "baseline" else f"{method.method} vs baseline"
    if middle.n > 1:
        noise = (f'<span class="sg-speedup-range">range {middle.low:.2f}–{middle.high:.2f}×</span>'
                 f'<span class="sg-speedup-label">{esc(what)} · median of {middle.n} runs in turn</span>')
    else:
        noise = f'<span class="sg-speedup-label">{esc(what)} · one run: no noise range (set Repeats)</span>'
    fresh = (f"baseline: cached run, recorded {age(baseline.cached_at)}" if baseline.cached_at is not None
             else "baseline: fresh run")
    why_line = esc(("The median run: " if middle.n > 1 else "") + reason.sentence()) if reason else ""
    tone = "sg-win" if middle.median >= 1 else "sg-lose"
    return (f'<div class="sg-speedup {tone}"><div class="sg-speedup-head">'
            f'<span class="sg-speedup-figure">{middle.median:.2f}×</span>{noise}</div>'
            f'<div class="sg-why">{why_line}</div>'
            f'<div class="sg-speedup-foot">{verdict(comparison)} <span class="sg-muted">{esc(fresh)}</span></div>'
            '</div>')


def summary(method: RunView, baseline: RunView) -> str:
    """Totals after both runs: tau, acceptance, steps, and each run's tokens, time and tokens/s."""
    cards = [("tau", f"{method.tau:.2f}"), ("acceptance", f"{method.acceptance_rate:.0%}"),
             ("steps", str(len(method.steps)))]
    body = "".join(f'<div class="sg-card"><div class="sg-card-value">{esc(v)}</div>'
                   f'<div class="sg-card-label">{esc(k)}</div></div>' for k, v in cards)
    line = (f"{esc(method.method)}: {method.new_tokens} tokens in {method.seconds:.2f} s "
            f"({method.tokens_per_s:.1f} tok/s) · baseline: {baseline.new_tokens} tokens in "
            f"{baseline.seconds:.2f} s ({baseline.tokens_per_s:.1f} tok/s).")
    return f'<div class="sg-summary"><div class="sg-cards">{body}</div><div class="sg-muted">{line}</div></div>'
