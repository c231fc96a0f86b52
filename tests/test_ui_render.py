"""Views -> HTML: what each component shows, and that no model, user or trace text becomes markup."""

from html.parser import HTMLParser

from ui_helpers import prefill, run, start, step

from specgui.ui import render
from specgui.ui.view import RunView, compare, parse_internals

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
                   render.step_detail(view, 0, token_text), render.summary(view, base, compare(view, base)),
                   render.status(HOSTILE[0], HOSTILE[1])):
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
    assert "drafted at layer 2" in render.legend(view.fractal_layers)


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


def test_summary_shows_speedup_tau_and_identity_or_divergence():
    method = view_of(run(start(), prefill(), step(1, [11, 12], [0, 1], 13)))
    same = view_of(run(start("baseline"), prefill(), *[step(i + 1, [], [], t) for i, t in enumerate((11, 12, 13))]))
    markup = render.summary(method, same, compare(method, same))
    assert "identical to baseline" in markup and "3.00" in markup  # tau
    other = view_of(run(start("baseline"), prefill(), step(1, [], [], 11), step(2, [], [], 99)))
    markup = render.summary(method, other, compare(method, other))
    assert "first divergence at token 2" in markup and "&#x27;&lt;99&gt;&#x27;" in markup
    other.cached_at = 0.0
    assert "reused from the cache" in render.summary(method, other, compare(method, other))
