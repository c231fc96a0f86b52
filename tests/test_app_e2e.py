"""End to end on the embedded model: the served app's `generate` API through gradio_client (every method, iterated,
awaited and predicted; eight clients at once; eight processes, one dropping its connection; a cancelled run), and
the page's run and replay handlers with their streamed updates and final summary."""

import asyncio
import gc
import html
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
from gradio_client import Client
from ui_helpers import served as serve
from ui_helpers import shown

from helpers import SHORT_PROMPTS
from specgui import methods
from specgui.core import decode
from specgui.core.events import Prefill, dumps_trace, from_json, load_trace, to_json
from specgui.core.text import encode_prompt
from specgui.ui import runs
from specgui.ui.page import App

PROMPT = "List the days of the week, separated by commas, then list them again."
TOKENS = 24
RSS_BOUND_MB = 30  # a round of eight clients, after a warm-up round: what the server may keep


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


def paced_after_prefill(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each run's decode waits out more than a frame after its prompt forward, so the page's first frame holds the
    prompt forward alone on any machine (a fast one decoded the 24 tokens inside one frame). The wait falls while the
    decode's generator is away, which its clock leaves out: the steps' times and what the calibration learns stand."""
    source = runs.decode_source

    def paced(*args, **kwargs):
        events = source(*args, **kwargs)

        def run(should_stop):
            for event in events(should_stop):
                yield event
                if isinstance(event, Prefill):
                    time.sleep(1.5 * runs.FRAME_S)
        return run
    monkeypatch.setattr(runs, "decode_source", paced)


def test_page_run_streams_both_panes_then_the_summary(served, monkeypatch):
    app, _ = served
    paced_after_prefill(monkeypatch)
    label = next(label for label, e in app.examples.items() if e.row.category == "summarization")
    updates = run_page(app, "pld", label, app.examples[label].row.preview)
    method_frames = [u[app.m_tokens] for u in updates[1:] if app.m_tokens in u]
    tokens = [frame.count('<span class="sg-tok') for frame in method_frames]
    assert tokens[0] == 1 and tokens[-1] > TOKENS // 2  # the prompt forward's token first, then the rest
    assert "sg-accepted" in method_frames[-1]
    assert any(app.b_tokens in u for u in updates[1:])
    live = updates[:next(i for i, u in enumerate(updates) if app.speedup in u and "per step" in u[app.speedup])]
    first_baseline = next(i for i, u in enumerate(live) if app.b_stats in u and "tokens" in u[app.b_stats])
    last_method = max(i for i, u in enumerate(live) if app.m_tokens in u)
    assert first_baseline < last_method  # side by side (the eager path): baseline's pane fills beside the method's
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


FIBONACCI = "Write a Python function that returns the n-th Fibonacci number."
API_TOKENS = 48  # Self-Draft's stream broke gradio_client at 48 and at 128 tokens (its nested candidate lists)
LONG = {"selfdraft": 200, "lookahead": 200}  # the methods whose payloads nest lists in lists, at length too


def recorded(monkeypatch) -> list[list[dict]]:
    """Every run the server decodes, as the JSON it sends (one list of events per run, in the order they ran)."""
    runs_seen, original = [], runs.decode_source

    def recording(*args, **kwargs):
        source = original(*args, **kwargs)

        def run(should_stop):
            events = []
            runs_seen.append(events)
            for event in source(should_stop):
                events.append(json.loads(json.dumps(to_json(event))))
                yield event
        return run

    monkeypatch.setattr(runs, "decode_source", recording)
    return runs_seen


def cli_run(lm, prompt: str, method: str, tokens: int):
    """What `python -m specgui generate --method METHOD --prompt PROMPT --max-new-tokens TOKENS` decodes."""
    return decode.run(lm, encode_prompt(lm.tokenizer, prompt), method, max_new_tokens=tokens, prompt_text=prompt)


def same_output(summary: dict, expected) -> None:
    """A streamed summary against a run's: the tokens, the text and what they count."""
    want = expected.summary
    assert summary["token_ids"] == list(want.token_ids) and summary["text"] == want.text
    assert (summary["new_tokens"], summary["stop"]) == (want.new_tokens, want.stop)


@pytest.mark.parametrize("method", methods.names())
def test_every_method_streams_to_gradio_client_exactly_as_sent(served, embedded_lm, monkeypatch, method):
    """Iterated (sync and async) and predicted, each update the client rebuilds is the event the server sent, and
    the final one is the CLI's run: Self-Draft's stream used to raise inside the client, whose iterator then hung."""
    _, url = served
    sent = recorded(monkeypatch)
    client = Client(url, verbose=False)
    tokens = LONG.get(method, API_TOKENS)
    events = list(client.submit(FIBONACCI, method, tokens, 0.0, api_name="/generate"))
    assert events == sent[-1] and events[0]["method"] == method
    summary = events[-1]
    assert summary["type"] == "summary" and summary["steps"] == sum(e["type"] == "step" for e in events)
    assert summary["drafted"] == sum(len(e["draft_tokens"]) for e in events if e["type"] == "step")
    same_output(summary, cli_run(embedded_lm, FIBONACCI, method, tokens))

    async def streamed() -> list[dict]:  # the job's updates: statuses, each streamed value, then the final message
        job = client.submit(FIBONACCI, method, API_TOKENS, 0.0, api_name="/generate")
        return [update.outputs async for update in job if update.type == "output" and not update.final]

    assert asyncio.run(streamed()) == sent[-1]
    last = client.predict(FIBONACCI, method, API_TOKENS, 0.0, api_name="/generate")  # a stream's predict: its last
    assert last == sent[-1][-1] and last["token_ids"] == sent[-2][-1]["token_ids"]


LOAD_PROMPTS = ["Name three colours.", "Count from one to ten in words.", "What is the capital of France?",
                "Write the alphabet in capitals.", "Say hello in German, French and Spanish.", FIBONACCI,
                "Repeat after me: the cat sat on the mat, the cat sat on the mat.", "List four seasons."]
LOAD_METHODS = ["pld", "selfdraft", "lookahead", "fractal", "clasp", "admg", "baseline", "selfdraft"]
LOAD_TOKENS = 24
RSS_BOUND_MB = 30  # a round of eight clients, after a warm-up round: what the server may keep


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


def rss_mb() -> float:
    gc.collect()
    return psutil.Process().memory_info().rss / 2**20


def plain_tokens(lm, prompt: str) -> list[int]:
    return decode.run(lm, encode_prompt(lm.tokenizer, prompt), "baseline", max_new_tokens=LOAD_TOKENS).token_ids


def test_eight_clients_at_once_mixed_methods_each_get_their_own_result_one_at_a_time(served, embedded_lm,
                                                                                      monkeypatch):
    _, url = served
    decodes = count_decodes(monkeypatch)

    def round_of_eight() -> tuple[list[list[dict]], set[int], float]:
        clients = [Client(url, verbose=False) for _ in LOAD_PROMPTS]
        started = time.perf_counter()
        jobs = [c.submit(p, m, LOAD_TOKENS, 0.0, api_name="/generate")
                for c, p, m in zip(clients, LOAD_PROMPTS, LOAD_METHODS)]
        ranks: set[int] = set()
        with ThreadPoolExecutor(len(jobs)) as pool:
            results = [pool.submit(list, job) for job in jobs]
            while not all(r.done() for r in results):
                ranks.update(j.status().rank or 0 for j in jobs)
                time.sleep(0.05)
            return [r.result() for r in results], ranks, time.perf_counter() - started

    round_of_eight()  # warm-up: each method's first-time allocations
    before = rss_mb()
    outputs, ranks, seconds = round_of_eight()
    grown = rss_mb() - before
    print(f"8 clients at once: {seconds:.1f} s; server RSS {before:.0f} MB before, {grown:+.1f} MB after")
    for prompt, method, events in zip(LOAD_PROMPTS, LOAD_METHODS, outputs):
        ids = encode_prompt(embedded_lm.tokenizer, prompt)
        assert events[0]["type"] == "start" and events[-1]["type"] == "summary" and events[0]["method"] == method
        assert list(events[0]["prompt_ids"]) == ids and events[0]["prompt_text"] == prompt
        assert events[-1]["token_ids"] == plain_tokens(embedded_lm, prompt)  # lossless, and nobody else's run
    assert decodes == {"now": 0, "peak": 1, "runs": 2 * len(LOAD_PROMPTS)}  # one device thread: never overlapped
    assert max(ranks) >= 1  # clients were told their place in the queue
    assert grown < RSS_BOUND_MB  # the server's memory returns to where it was


CLIENT_PROCESS = """
import json, sys
from gradio_client import Client
url, prompt, method, tokens = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
for event in Client(url, verbose=False).submit(prompt, method, tokens, 0.0, api_name="/generate"):
    print(json.dumps(event), flush=True)
"""


def test_eight_client_processes_and_one_that_disconnects_mid_stream(served, embedded_lm, monkeypatch):
    """Eight processes with their own connections, the first killed once its run streams: its decode stops, its
    place frees, and every other process gets its own complete result."""
    app, url = served
    sent = recorded(monkeypatch)
    decodes = count_decodes(monkeypatch)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    quitter = subprocess.Popen([sys.executable, "-c", CLIENT_PROCESS, url, FIBONACCI, "baseline", "1000"],
                               stdout=subprocess.PIPE, text=True, env=env)
    assert json.loads(quitter.stdout.readline())["type"] == "start"
    others = [subprocess.Popen([sys.executable, "-c", CLIENT_PROCESS, url, p, m, str(LOAD_TOKENS)],
                               stdout=subprocess.PIPE, text=True, env=env)
              for p, m in zip(LOAD_PROMPTS[1:], LOAD_METHODS[1:])]
    quitter.kill()  # a dropped connection: no cancel is sent
    quitter.wait()
    for process, prompt, method in zip(others, LOAD_PROMPTS[1:], LOAD_METHODS[1:]):
        out, _ = process.communicate(timeout=600)
        assert process.returncode == 0, out[-500:]
        events = [json.loads(line) for line in out.splitlines()]
        assert events[0]["method"] == method and events[-1]["type"] == "summary"
        assert events[-1]["token_ids"] == plain_tokens(embedded_lm, prompt)
    assert decodes["runs"] == len(LOAD_PROMPTS) and decodes["peak"] == 1
    dropped = sent[0][-1]
    assert dropped["stop"] == "cancelled" and dropped["new_tokens"] < 1000  # it stopped when its client went
    assert app.store.busy.acquire(blocking=False)  # nothing holds the model: the dropped run ended too
    app.store.busy.release()


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
    from specgui.tools import papers
    from specgui.tools.prompts import load_prompts
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
