"""End to end on the embedded model: the served app's `generate` API through gradio_client, and the page's
run and replay handlers with their streamed updates and final summary."""

import pytest
from gradio_client import Client
from ui_helpers import served as serve

from specgui import decode
from specgui.events import load_trace
from specgui.text import encode_prompt
from specgui.ui.page import App

PROMPT = "List the days of the week, separated by commas, then list them again."
TOKENS = 24


@pytest.fixture(scope="module")
def served(embedded_lm):
    with serve(embedded_lm) as app_and_url:
        yield app_and_url


def test_generate_endpoint_streams_the_core_events_as_json(served, embedded_lm):
    _, url = served
    client = Client(url, verbose=False)
    job = client.submit(PROMPT, "pld", TOKENS, 0.0, api_name="/generate")
    events = list(job)
    kinds = [e["type"] for e in events]
    assert kinds[0] == "start" and kinds[1] == "prefill" and kinds[-1] == "summary"
    assert set(kinds[2:-1]) == {"step"} and len(kinds) == 3 + events[-1]["steps"]
    assert events[0]["method"] == "pld" and events[0]["num_layers"] == 30
    summary = events[-1]
    assert summary["new_tokens"] == TOKENS and summary["stop"] == "length"
    baseline = decode.run(embedded_lm, encode_prompt(embedded_lm.tokenizer, PROMPT), "baseline", max_new_tokens=TOKENS)
    assert summary["token_ids"] == baseline.token_ids  # lossless through the API too
    with pytest.raises(Exception, match="unknown method"):
        client.predict(PROMPT, "nope", 8, 0.0, api_name="/generate")


def run_page(app: App, method: str, example: str | None = None, prompt: str = PROMPT):
    values = app.panel.presets("SmolLM2-135M-Instruct", app.device)
    return list(app.run("embedded", method, "greedy", 0.7, 1.0, None, TOKENS, example, prompt, *values))


def test_page_run_streams_both_panes_then_the_summary(served):
    app, _ = served
    label = next(label for label, e in app.examples.items() if e.row.category == "summarization")
    updates = run_page(app, "pld", label, app.examples[label].row.preview)
    method_frames = [u[app.m_tokens] for u in updates[1:] if app.m_tokens in u]
    assert len(method_frames) >= 2 and method_frames[-1].count("sg-tok") > method_frames[0].count("sg-tok")
    assert "sg-accepted" in method_frames[-1]
    assert any(app.b_tokens in u for u in updates[1:])
    first_baseline = next(i for i, u in enumerate(updates) if app.b_stats in u and "tokens" in u[app.b_stats])
    last_method = max(i for i, u in enumerate(updates[:-1]) if app.m_tokens in u)
    assert last_method < first_baseline  # the method finished before baseline began
    final = updates[-1]
    assert "speedup" in final[app.summary] and "identical to baseline" in final[app.summary]
    assert final[app.status].endswith("done</div>") and final[app.step]["maximum"] >= 2
    assert f"{TOKENS}</b> tokens" in final[app.m_stats] and "sg-cell" in final[app.inspector]
    traces = [load_trace(path) for path in final[app.trace_out]]
    assert [t[0].method for t in traces] == ["pld", "baseline"]

    again = run_page(app, "pld", label, app.examples[label].row.preview)[-1]
    assert "reused from cache" in again[app.b_stats] and "reused from the cache" in again[app.summary]

    replayed = list(app.replay(final[app.trace_out], 8.0))
    assert "replay of a trace recorded with SmolLM2-135M-Instruct" in replayed[-1][app.status]
    assert "identical to baseline" in replayed[-1][app.summary]


def test_page_reports_bad_input_in_the_status_line(served):
    app, _ = served
    assert "empty" in run_page(app, "pld", prompt="   ")[-1][app.status]
    assert "sg-status-error" in list(app.replay(None, 1.0))[-1][app.status]
