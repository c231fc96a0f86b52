"""End to end on the embedded model: the served app's `generate` API through gradio_client (one client, then
several at once, then a cancelled one), and the page's run and replay handlers with their streamed updates
and final summary."""

import html
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from gradio_client import Client
from ui_helpers import served as serve
from ui_helpers import shown

from helpers import SHORT_PROMPTS
from specgui import decode
from specgui.events import dumps_trace, from_json, load_trace
from specgui.text import encode_prompt
from specgui.ui import runs
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


def run_page(app: App, method: str, example: str | None = None, prompt: str = PROMPT, reuse: bool = False):
    values = app.panel.presets("SmolLM2-135M-Instruct", app.device)
    return list(app.run("embedded", method, "greedy", 0.7, 1.0, None, TOKENS, example, prompt, 1, reuse, 8.0, "auto",
                        "auto", *values))


def test_page_run_streams_both_panes_then_the_summary(served):
    app, _ = served
    label = next(label for label, e in app.examples.items() if e.row.category == "summarization")
    updates = run_page(app, "pld", label, app.examples[label].row.preview)
    method_frames = [u[app.m_tokens] for u in updates[1:] if app.m_tokens in u]
    assert len(method_frames) >= 2 and method_frames[-1].count("sg-tok") > method_frames[0].count("sg-tok")
    assert "sg-accepted" in method_frames[-1]
    assert any(app.b_tokens in u for u in updates[1:])
    live = updates[:next(i for i, u in enumerate(updates) if app.speedup in u and "per step" in u[app.speedup])]
    first_baseline = next(i for i, u in enumerate(live) if app.b_stats in u and "tokens" in u[app.b_stats])
    last_method = max(i for i, u in enumerate(live) if app.m_tokens in u)
    assert last_method < first_baseline  # the method finished before baseline began (the race comes after)
    final = shown(updates)
    assert "break-even tau" in final[app.speedup] and "identical to baseline" in final[app.speedup]
    assert final[app.status].endswith("done</div>") and final[app.step]["maximum"] >= 2
    assert f"{TOKENS}</b> tokens" in final[app.m_stats] and "sg-cell" in final[app.inspector]
    traces = [load_trace(path) for path in final[app.trace_out]]
    assert [t[0].method for t in traces] == ["pld", "baseline"]

    again = shown(run_page(app, "pld", label, app.examples[label].row.preview, reuse=True))
    assert "cached run, recorded" in again[app.b_stats] and "baseline: cached run" in again[app.speedup]

    replayed = shown(list(app.replay(final[app.trace_out], 8.0)))
    assert "replay of a trace recorded with SmolLM2-135M-Instruct" in replayed[app.status]
    assert "identical to baseline" in replayed[app.speedup]


def test_compare_and_replay_through_the_documented_api(served):
    _, url = served
    client = Client(url, verbose=False)
    report = client.predict(methods=["pld"], category="translation", prompts_per_category=1, max_new_tokens=8,
                            repeats=1, api_name="/compare")
    assert list(report["methods"]) == ["baseline", "pld"] and report["prompts"] == 1
    assert report["methods"]["pld"]["identical"] == 1
    events = list(client.submit(PROMPT, "pld", 8, 0.0, api_name="/generate"))
    trace = dumps_trace([from_json(e) for e in events])
    replayed = list(client.submit(trace=trace, speed=8.0, api_name="/replay"))
    assert [e["type"] for e in replayed] == [e["type"] for e in events]
    assert replayed[-1]["token_ids"] == events[-1]["token_ids"]


def test_page_reports_bad_input_in_the_status_line(served):
    app, _ = served
    assert "empty" in run_page(app, "pld", prompt="   ")[-1][app.status]
    assert "sg-status-error" in list(app.replay(None, 1.0))[-1][app.status]


LOAD_PROMPTS = ["Name three colours.", "Count from one to ten in words.", "What is the capital of France?",
                "Write the alphabet in capitals.", "Say hello in German, French and Spanish."]
LOAD_TOKENS = 16


def count_decodes(monkeypatch) -> dict[str, int]:
    """Count, in the server, the decodes running at once ("now") and the most ever seen ("peak"). Timestamps
    taken in the clients cannot tell: a client's thread may note its run's end after the next run's first
    event reached another client (CI saw exactly that)."""
    counts, lock, original = {"now": 0, "peak": 0, "runs": 0}, threading.Lock(), runs.decode_source

    def counted(*args, **kwargs):
        source = original(*args, **kwargs)

        def run(should_stop):
            with lock:
                counts["now"] += 1
                counts["peak"], counts["runs"] = max(counts["peak"], counts["now"]), counts["runs"] + 1
            try:
                yield from source(should_stop)
            finally:
                with lock:
                    counts["now"] -= 1
        return run

    monkeypatch.setattr(runs, "decode_source", counted)
    return counts


def test_concurrent_api_clients_each_get_their_own_complete_result_one_at_a_time(served, embedded_lm, monkeypatch):
    _, url = served
    decodes = count_decodes(monkeypatch)
    clients = [Client(url, verbose=False) for _ in LOAD_PROMPTS]
    jobs = [c.submit(p, "pld", LOAD_TOKENS, 0.0, api_name="/generate") for c, p in zip(clients, LOAD_PROMPTS)]
    ranks: set[int] = set()
    with ThreadPoolExecutor(len(jobs)) as pool:
        results = [pool.submit(list, job) for job in jobs]
        while not all(r.done() for r in results):
            ranks.update(j.status().rank or 0 for j in jobs)
            time.sleep(0.05)
        outputs = [r.result() for r in results]
    for prompt, events in zip(LOAD_PROMPTS, outputs):
        ids = encode_prompt(embedded_lm.tokenizer, prompt)
        assert events[0]["type"] == "start" and events[-1]["type"] == "summary"
        assert list(events[0]["prompt_ids"]) == ids and events[0]["prompt_text"] == prompt
        baseline = decode.run(embedded_lm, ids, "baseline", max_new_tokens=LOAD_TOKENS)
        assert events[-1]["token_ids"] == baseline.token_ids and events[-1]["text"] == baseline.summary.text
    assert decodes == {"now": 0, "peak": 1, "runs": len(jobs)}  # one device thread: the decodes never overlapped
    assert max(ranks) >= 1  # clients were told their place in the queue


def test_a_cancelled_api_run_frees_the_queue_for_the_next(served):
    app, url = served
    client = Client(url, verbose=False)
    job = client.submit(PROMPT, "baseline", 1000, 0.0, api_name="/generate")
    while len(job.outputs()) < 3:
        time.sleep(0.05)
    job.cancel()
    deadline = time.monotonic() + 5  # the rest of the 1000 tokens would take half a minute or more
    while not app.store.busy.acquire(blocking=False):
        assert time.monotonic() < deadline, "the cancelled run still holds the model"
        time.sleep(0.05)
    app.store.busy.release()
    last = client.predict(PROMPT, "pld", 8, 0.0, api_name="/generate")  # a stream's predict: its last event
    assert last["type"] == "summary" and last["new_tokens"] == 8


@pytest.mark.parametrize("preset", ["clasp-paper", "selfdraft-paper", "asd-paper"])
def test_compare_tab_runs_a_paper_preset_as_the_paper_lays_it_out(served, preset, monkeypatch):
    """On short prompts, one per category: the layout is checked here, the suite's prompts in `bench`."""
    from specgui import papers
    from specgui.prompts import load_prompts
    from specgui.ui import compare, page

    monkeypatch.setattr(page, "load_prompts", lambda: load_prompts(SHORT_PROMPTS))
    app, _ = served
    paper = papers.load(preset)
    status, table, _, note = app.run_compare([], compare.ALL, 1, 8, 1, preset)
    assert f"{len(paper.categories)} prompts × {len(paper.methods)} methods" in status, status
    assert len(table["headers"]) == len(table["data"][0]) and table["headers"][1] in ("method", "benchmark")
    sources = [row[0] for row in table["data"]]
    assert sources.count("ours") >= 2 and sources.count("paper") >= 2
    note = html.unescape(note)
    assert paper.title in note and "runs identical to baseline" in note and paper.setting in note
