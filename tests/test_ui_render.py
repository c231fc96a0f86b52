"""Views -> HTML: what each component shows, and that no model, user or trace text becomes markup."""

from html.parser import HTMLParser

from ui_helpers import prefill, run, start, step

from specgui.ui import render
from specgui.ui.view import RunView, compare, parse_internals, spread, why

HOSTILE = ['<script>alert(1)</script>', '<img src=x onerror=alert(1)>', '" onmouseover="alert(1)', "</div><b>x"]
ALLOWED_TAGS = {"div", "span", "b", "code", "table", "tr", "th", "td", "ol", "li", "dl", "dt", "dd"}


class Tags(HTMLParser):
    """Collects every tag and attribute name the browser would build from a string."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.tags: list[str] = []
        self.attrs: set[str] = set()
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.attrs.update(name for name, _ in attrs)


def assert_inert(markup: str) -> None:
    parsed = Tags(markup)
    assert set(parsed.tags) <= ALLOWED_TAGS, set(parsed.tags) - ALLOWED_TAGS
    assert parsed.attrs <= {"class", "title", "style", "start"}, parsed.attrs


def view_of(events) -> RunView:
    view = RunView()
    view.extend(events)
    return view


def hostile_run(method: str = "pld") -> RunView:
    pieces = {11: HOSTILE[0], 12: HOSTILE[1], 13: HOSTILE[2], 14: HOSTILE[3]}
    payload = {"branches": [[11, 12]], "candidates": [{"nodes": [0], "source": HOSTILE[1], "key": [13]}],
               "hit": {"candidate": 0, "tokens": 1}, "cache_sizes": {HOSTILE[0]: 3}, HOSTILE[1]: HOSTILE[0],
               "exit": {"reason": HOSTILE[2], "threshold": 0.5}}
    return view_of(run(start(method, params={"note": HOSTILE[0]}), prefill(10, HOSTILE[3]),
                       step(1, [11, 12, 13], [0], 14, pieces=pieces, payload=payload)))


def test_hostile_text_everywhere_stays_text():
    view = hostile_run()
    base = view_of(run(start("baseline"), prefill(10, HOSTILE[0]), step(1, [], [], 12, pieces={12: HOSTILE[1]})))
    token_text = {11: HOSTILE[0], 12: HOSTILE[1], 13: HOSTILE[2]}.get
    for markup in (render.tokens(view), render.tokens(base, plain=True), render.pane_title(view, "m"),
                   render.pane_stats(view, running=True), render.step_detail(view, 0),
                   render.step_detail(view, 0, token_text), render.summary(view, base),
                   render.speedup(view, base, spread([1.0]), why(view, base), compare(view, base)),
                   render.speedup_pending(HOSTILE[0]), render.legend([2, 4], 4), render.status(HOSTILE[0], HOSTILE[1])):
        assert_inert(markup)
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in render.tokens(view)


def test_method_pane_colours_each_token_by_kind():
    view = view_of([start(), prefill(10, "A"), step(1, [11, 12, 13], [0, 1], 14), step(2, [15], [0], 16)])
    markup = render.tokens(view)
    for kind, count in (("accepted", 3), ("rejected", 1), ("correction", 1), ("bonus", 2)):
        assert markup.count(f"sg-{kind}") == count, kind
    assert 'title="step 1: rejected draft token' in markup
    assert "sg-accepted" not in render.tokens(view, plain=True)  # baseline's pane is plain text


def test_layer_strip_has_a_cell_per_sublayer_and_marks_skips():
    internals = parse_internals({"skip": {"attn": [0, 2], "mlp": [3]}, "reoptimized": True, "dp_score": 0.9})
    markup = render.layer_strip(4, internals)
    assert markup.count('class="sg-cell') == 8
    assert markup.count("sg-cell sg-skip") == 3
    assert 'title="layer 2 attention: skipped by the draft"' in markup
    assert 'title="layer 3 MLP: skipped by the draft"' in markup
    assert "skipped 3 of 8 sub-layers" in markup and "re-optimised this step (DP score 0.900)" in markup
    assert "nothing skipped" in render.layer_strip(4, parse_internals({}))


def test_fractal_insertions_on_the_strip_and_tints_on_tokens_match():
    view = view_of([start(layers=6), prefill(payload={"fractal_layers": [2, 4]}),
                    step(1, [11, 12], [0], 13, payload={"origin": [2, 4]})])
    strip = render.step_detail(view, 0)
    assert strip.count("◆") == 2 and 'title="compressed pass spliced in before layer 4"' in strip
    tokens = render.tokens(view)
    assert "sg-accepted sg-tinted sg-o0" in tokens and "sg-rejected sg-tinted sg-o1" in tokens
    legend = render.legend(view.fractal_layers, view.num_layers)
    assert "the pass before layer 2" in legend and "(layers 0–5)" in legend


def test_fractal_tokens_from_the_full_models_head_are_not_given_a_layer_past_the_last():
    view = view_of([start(layers=30), prefill(payload={"fractal_layers": [0, 15]}),
                    step(1, [11, 12], [0, 1], 13, payload={"origin": [15, 30]})])
    legend = render.legend(view.fractal_layers, view.num_layers)
    assert "layer 30" not in legend and "the full model&#x27;s head" in legend and "(layers 0–29)" in legend
    assert "drafted by the full model&#x27;s head" in render.tokens(view)
    assert "layers 0–29" in render.step_detail(view, 0)


def test_inspector_shows_branches_candidates_and_the_hit():
    payload = {"branches": [[5, 6], [7]], "candidates": [{"nodes": [0], "source": "context", "key": [3]},
                                                          {"nodes": [1], "source": "corpus", "key": [4]}],
               "hit": {"candidate": 1, "tokens": 1}, "cache_sizes": {"context": 12}}
    view = view_of([start(), prefill(), step(1, [11, 12], [1], 13, parents=[-1, -1], payload=payload)])
    markup = render.step_detail(view, 0)
    assert markup.count("<tr>") == 2 and "#5" in markup  # no tokenizer: ids
    assert render.step_detail(view, 0, lambda t: f"w{t}").count("w5") == 1
    hit = markup.split('<li class="sg-cand-hit">')[1].split("</li>")[0]
    assert "corpus" in hit and "kept 1 tokens" in hit
    assert "<dt>cache context</dt><dd>12</dd>" in markup


def test_inspector_chain_chips_and_clamped_index():
    view = view_of([start(), prefill(), step(1, [11, 12, 13], [0], 14), step(2, [], [], 15)])
    first = render.step_detail(view, 0)
    assert "Step 1</b> of 2" in first and "accepted 1" in first and "verifier token: correction" in first
    assert first.count("sg-rejected") == 1 and first.count("sg-discarded") == 1
    assert "Step 2</b>" in render.step_detail(view, 99) and "no draft this step" in render.step_detail(view, 1)


def test_summary_shows_tau_acceptance_and_both_runs_totals():
    method = view_of(run(start(), prefill(), step(1, [11, 12], [0, 1], 13)))
    same = view_of(run(start("baseline"), prefill(), *[step(i + 1, [], [], t) for i, t in enumerate((11, 12, 13))]))
    markup = render.summary(method, same)
    assert "3.00" in markup and "100%" in markup and "4 tokens in" in markup  # tau, acceptance, totals


def _pair():
    method = view_of(run(start(), prefill(), step(1, [11, 12], [0, 1], 13)))
    same = view_of(run(start("baseline"), prefill(), *[step(i + 1, [], [], t) for i, t in enumerate((11, 12, 13))]))
    return method, same


def test_speedup_is_large_with_its_range_the_why_line_and_identity():
    method, same = _pair()
    one = render.speedup(method, same, spread([1.234]), why(method, same), compare(method, same))
    assert '<span class="sg-speedup-figure">1.23×</span>' in one and "sg-speedup-range" not in one
    assert "one run: no noise range" in one and "identical to baseline" in one and "baseline: fresh run" in one
    assert "× per step: tau 3.00; a step costs" in one
    three = render.speedup(method, same, spread([1.5, 1.2, 1.4]), why(method, same), compare(method, same))
    assert '<span class="sg-speedup-figure">1.40×</span>' in three and "range 1.20–1.50×" in three
    assert "median of 3 runs in turn" in three and "The median run: " in three


def test_speedup_names_a_noise_check_a_divergence_and_a_cached_baseline():
    method, _ = _pair()
    other = view_of(run(start("baseline"), prefill(), step(1, [], [], 11), step(2, [], [], 99)))
    markup = render.speedup(method, other, spread([1.1]), None, compare(method, other))
    assert "first divergence at token 2" in markup and "&#x27;&lt;99&gt;&#x27;" in markup
    other.cached_at = 1000.0
    cached = render.speedup(method, other, spread([1.1]), None, compare(method, other))
    assert "baseline: cached run, recorded" in cached
    noise = view_of(run(start("baseline"), prefill(), step(1, [], [], 11), step(2, [], [], 99)))
    assert "noise check" in render.speedup(noise, other, spread([0.98]), None, compare(noise, other))
    assert "sg-lose" in render.speedup(noise, other, spread([0.98]), None, compare(noise, other))


def test_cached_age_in_words():
    assert render.age(100.0, now=130.0) == "30 s ago"
    assert render.age(0.0, now=600.0) == "10 min ago"
    assert render.age(0.0, now=3 * 3600.0) == "3.0 h ago"


def test_special_tokens_are_stop_marks_not_raw_markup():
    pieces = {11: "done.", 12: "<|im_end|>", 13: "\n<|im_start|>assistant"}
    view = view_of([start(), prefill(10, "A"), step(1, [11, 12], [0, 1], 13, pieces=pieces)])
    for markup in (render.tokens(view), render.tokens(view, plain=True), render.step_detail(view, 0)):
        assert "&lt;|im_end|&gt;" not in markup.replace('title="special token &lt;|im_end|&gt;"', "")
        assert markup.count('class="sg-special"') == 2
    assert "assistant" in render.tokens(view)
    assert render.text("a</s>b") == 'a<span class="sg-special" title="special token &lt;/s&gt;"></span>b'


def test_rejected_drafts_with_newlines_stay_on_one_line():
    pieces = {11: "x", 12: "\n    return", 13: "y"}
    view = view_of([start(), prefill(10, "A"), step(1, [11, 12], [0], 13, pieces=pieces),
                    step(2, [14], [0], 15, pieces={14: "\n"})])
    markup = render.tokens(view)
    rejected = markup.split("sg-rejected")[1].split("</span>")[0]
    assert "↵    return" in rejected and "\n" not in rejected
    assert "\n" in markup  # an accepted newline still breaks the line
    assert "↵    return" in render.step_detail(view, 0)


def test_paused_steps_say_so_and_floats_are_rounded():
    paused = parse_internals({"skip": {"attn": [], "mlp": []}, "exit": {"reason": "paused", "threshold": 0.83333}})
    strip = render.layer_strip(4, paused)
    assert "drafting paused this step" in strip and "sg-cell sg-skip" not in strip
    view = view_of(run(start(params={"threshold": 0.8333333, "k": 3}), prefill(),
                       step(1, [], [], 11, payload={"exit": {"reason": "paused", "threshold": 0.8333333},
                                                    "gain": 0.4166666})))
    assert "threshold=0.833, k=3" in render.pane_title(view, "m")
    detail = render.step_detail(view, 0)
    assert "0.8333" not in detail and "at threshold 0.833" in detail and "0.417" in detail
