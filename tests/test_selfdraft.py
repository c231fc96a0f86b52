"""Self-Draft: branches see what the paper's mask allows, caches feed the candidates, ablations switch them off.

Losslessness with the presets (greedy on tiny and embedded models, sampling) is in test_lossless.py; here
the parts are held to their definitions.
"""

import pytest
import torch

from helpers import assert_greedy_identical, assert_sampling_lossless, tiny_model
from specgui import methods
from specgui.core import decode
from specgui.core.sampling import GREEDY
from specgui.errors import SpecGUIError
from specgui.methods.ngram.ngram_cache import CorpusCache
from specgui.tools import corpus, grid
from specgui.tools.prompts import PromptRow

PROMPT = [1, 2, 3, 4, 5, 1, 2, 3, 4, 6, 7, 8, 9, 10]
BRANCHY = {"branches": 3, "branch_len": 4, "gram": 3, "budget": 6, "max_forward": 0, "use_corpus": False,
           "policy": "fixed"}


@pytest.fixture(scope="module")
def peaky_lm():
    """Peaky weights keep argmax decisions far from ties, so a plain forward must agree exactly."""
    return tiny_model(init=0.5, seed=3)


def test_greedy_identical_with_branches_and_every_cache_setting(tiny_lm):
    prompts = [PROMPT, [7, 8, 9, 10, 11, 12, 13, 14], [20, 21, 20, 21, 20, 21, 22]]
    for extra in ({}, {"branches": 0}, {"max_key": 1, "lru": 1}, {"budget": 1}, {"branch_len": 1}):
        assert_greedy_identical(tiny_lm, "selfdraft", prompts, max_new_tokens=40, params={**BRANCHY, **extra})


def test_branches_advance_by_the_targets_own_next_token(peaky_lm):
    """Branch tokens sit after the pending token and see only the text and their own branch: the token a
    branch grows by must be what a plain forward over [text, pending, branch] predicts."""
    result = decode.run(peaky_lm, PROMPT, "selfdraft", max_new_tokens=20, params=BRANCHY)
    text = [*PROMPT, result.events[1].token]
    checked = 0
    for step, after in zip(result.steps, result.steps[1:]):
        for fed, grown in zip(step.payload["branches"], after.payload["branches"]):
            with torch.no_grad():
                logits = peaky_lm.model(torch.tensor([text + fed])).logits[0, -1]
            assert grown[-1] == int(logits.argmax())
            assert grown == (fed + grown[-1:])[-BRANCHY["branch_len"] :]
            checked += 1
        text += list(step.emitted)
    assert checked >= 20


def test_extras_mask_is_block_diagonal_and_blind_to_candidates(tiny_lm):
    drafter = methods.create("selfdraft", tiny_lm.runner, tiny_lm.name, GREEDY, {**BRANCHY, "branches": 2})
    drafter.fed = {0: [5, 6, 7], 1: [8, 9]}
    extras = drafter._extras(committed=10, nodes=4)
    assert extras.tokens == [5, 6, 7, 8, 9] and extras.positions == [11, 12, 13, 11, 12]
    v = extras.visibility.astype(int).tolist()  # columns: pending, 4 candidate nodes, 5 branch tokens
    assert v == [
        [1, 0, 0, 0, 0, 1, 0, 0, 0, 0],
        [1, 0, 0, 0, 0, 1, 1, 0, 0, 0],
        [1, 0, 0, 0, 0, 1, 1, 1, 0, 0],
        [1, 0, 0, 0, 0, 0, 0, 0, 1, 0],
        [1, 0, 0, 0, 0, 0, 0, 0, 1, 1],
    ]


def test_max_forward_lets_branches_take_turns_in_the_room_candidates_leave(tiny_lm):
    params = {**BRANCHY, "branch_len": 2, "max_forward": 6}
    result = assert_greedy_identical(tiny_lm, "selfdraft", [PROMPT], 40, params=params)[0]
    fed_counts = [len(s.payload["branches"]) for s in result.steps]
    assert all(s.forward_tokens <= 6 for s in result.steps)
    assert max(fed_counts) >= 1 and min(fed_counts[:-1]) < 3  # some forwards had no room for every branch
    grown = [b for s in result.steps for b in s.payload["branches"] if len(b) == 2]
    assert grown  # branches still advance to full length while taking turns


def test_payload_reports_branches_candidates_hits_and_warmup(tiny_lm):
    result = decode.run(tiny_lm, PROMPT, "selfdraft", max_new_tokens=30, params=BRANCHY)
    steps = result.steps
    assert steps[0].payload["warmup"] and not steps[-2].payload["warmup"]
    assert [len(b) for b in steps[0].payload["branches"]] == [1, 1, 1]
    hits = 0
    for s in steps:
        p = s.payload
        assert s.forward_tokens == 1 + s.drafted + sum(len(b) for b in p["branches"])
        assert len(s.draft_tokens) <= BRANCHY["budget"] and p["cache_sizes"]["context"] > 0
        for c in p["candidates"]:
            assert c["source"] == "context" and c["nodes"] == _path(s, c["nodes"][-1])
        if s.accepted:
            hit = p["hit"]
            assert hit["tokens"] == s.accepted and p["candidates"][hit["candidate"]]["nodes"][: s.accepted] == list(
                s.path)
            hits += 1
        else:
            assert "hit" not in p
    assert hits > 0


def _path(step, node):
    path = []
    while node >= 0:
        path.append(node)
        node = step.draft_parents[node]
    return path[::-1]


def test_corpus_candidates_follow_context_ones(tiny_lm, tmp_path):
    base = decode.run(tiny_lm, PROMPT, "baseline", max_new_tokens=30).token_ids
    texts = [list(base) * 2]  # a "corpus" that knows the output: its candidates must get accepted
    path = tmp_path / "tiny.npz"
    corpus.build(texts, {"max_key": 2, "gram": 3, "vocab_size": 48}, per_key=2, min_count=1).save(path)
    params = {**BRANCHY, "corpus": str(path), "use_corpus": True}
    only_corpus = {**params, "use_context": False}
    result = assert_greedy_identical(tiny_lm, "selfdraft", [PROMPT], 30, params=only_corpus, min_accepted=10)[0]
    assert all(s.payload["branches"] == [] for s in result.steps)
    assert {c["source"] for s in result.steps for c in s.payload["candidates"]} == {"corpus"}
    both = decode.run(tiny_lm, PROMPT, "selfdraft", max_new_tokens=30, params=params)
    for s in both.steps:
        sources = [c["source"] for c in s.payload["candidates"]]
        assert sources == sorted(sources, key=["context", "corpus"].index)


def test_no_context_and_no_corpus_is_plain_decoding(tiny_lm):
    params = {**BRANCHY, "use_context": False, "use_corpus": False}
    result = decode.run(tiny_lm, PROMPT, "selfdraft", max_new_tokens=12, params=params)
    assert result.summary.drafted == 0 and all(s.forward_tokens == 1 for s in result.steps)


def test_corpus_for_another_vocabulary_is_refused(tiny_lm, tmp_path):
    path = tmp_path / "big.npz"
    CorpusCache({"max_key": 1, "gram": 2, "per_key": 1, "vocab_size": 49152}, [((1,), (2, 3))]).save(path)
    with pytest.raises(SpecGUIError, match="vocabulary"):
        decode.run(tiny_lm, PROMPT, "selfdraft", max_new_tokens=4, params={"corpus": str(path)})


def test_sampling_with_branches_keeps_the_target_distribution():
    lm = tiny_model(vocab=12, layers=3, hidden=32, init=0.5, seed=1)
    prompt = [5, 3, 8, 1, 0, 11, 7, 2, 9, 4, 6, 10, 5, 3, 8, 1]
    assert_sampling_lossless(lm, "selfdraft", prompt, runs=1500, params={**BRANCHY, "budget": 3})


def test_presets_point_smollm2_at_its_corpus_and_keep_the_cpu_forward_small():
    cpu = methods.params_for("selfdraft", "SmolLM2-135M-Instruct", "cpu")
    assert cpu.corpus == "smollm2" and cpu.use_corpus and cpu.use_context
    assert (cpu.max_forward or 1 + cpu.budget + cpu.branches * cpu.branch_len) <= 16
    assert methods.params_for("selfdraft", "tiny-llama", "cpu").corpus == ""


def test_grid_settings_and_measurement(tiny_lm):
    combos = grid.settings(["branches=0,2", "budget=2,4"], ["gram=3"])
    assert len(combos) == 4 and {"branches": 2, "budget": 4, "gram": 3} in combos
    with pytest.raises(SpecGUIError):
        grid.settings(["branches"], [])
    rows = [PromptRow("a", "x", prompt="bcdebcdebcd"), PromptRow("b", "y", prompt="klmnklmnk")]
    results = grid.measure(tiny_lm, rows, "selfdraft", grid.settings(["branches=0,2"], ["use_corpus=false"]), 12)
    assert len(results) == 2 and all(r["identical"] == 2 == r["total"] for r in results)
    assert results[0]["speedup"] >= results[1]["speedup"] and set(results[0]["categories"]) == {"x", "y"}
    assert "speedup" in grid.format_table(results)
    calls = {1: 0, 2: 0}
    for repeats in calls:
        def count(entry, row, repeats=repeats):
            calls[repeats] += 1
        grid.measure(tiny_lm, rows[:1], "selfdraft", [{"use_corpus": False}], 6, progress=count, repeats=repeats)
    assert calls[2] > calls[1] > 0  # every (prompt, setting) pair runs again
