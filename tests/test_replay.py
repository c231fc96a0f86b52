"""`specgui.tools.replay`: prompt lookup's sizing replayed on a greedy output, against the run pld really makes."""

import pytest

from helpers import tiny_model
from specgui import costs, methods
from specgui.core import decode
from specgui.core.sampling import GREEDY
from specgui.costs import CostProfile
from specgui.tools import replay


def test_the_replayed_cost_policy_decides_and_prices_as_the_pld_run_did():
    """The replay's claim: given the greedy output, the cost model's policy replayed off the lookups makes the
    same draft sizes, step for step, as a real pld run under the same profile, and prices them the same."""
    lm = tiny_model(seed=3)
    layers = lm.runner.num_layers
    profile = CostProfile(key=costs.profile_key(lm, False), sizes=list(range(1, 9)), contexts=[128],
                          forward=[[10.0, 10.5, 11.0, 12.0, 13.0, 14.0, 16.0, 18.0]], step=10.0,
                          attn=[0.1] * layers, mlp=[0.1] * layers, head=0.5, mechanisms={"pld.lookup": 0.002})
    prompt = [1, 2, 3, 4, 5, 6, 7, 8] * 3 + [1, 2, 3]
    run = decode.run(lm, prompt, "pld", max_new_tokens=40, fast_path="off", profile=profile)
    assert len(run.summary.token_ids) == 40 and any(s.path for s in run.steps)  # it drafted, and was accepted
    params = methods.create("pld", lm.runner, lm.name, GREEDY, None).params
    prefill = run.events[1]
    output = replay.Output("x", prompt, list(run.summary.token_ids), prefill.ms + prefill.overhead_ms)
    policy, sizes = replay.CostPolicy(profile, params.num_draft, 0.002, replay.REGIMES), []

    def recording(found, accepted, context):
        sizes.append(policy(found, accepted, context))
        return sizes[-1]

    _, replayed = replay.replay(profile, output, recording, params.ngrams, params.num_draft, 0.002)
    assert sizes == [len(s.draft_tokens) for s in run.steps]
    assert replayed / 1000 == pytest.approx(run.summary.predicted_s)


def test_where_every_lookup_is_right_the_oracle_copies_everything_found():
    """An output that repeats its prompt: every token a lookup finds is accepted, so drafting all of them is what
    the oracle does, and drafting one at a time, on a flat curve, is slower."""
    flat = CostProfile(key={"device": "cpu"}, sizes=[1, 64], contexts=[128], forward=[[10.0, 10.0]], step=10.0,
                       attn=[0.1], mlp=[0.1], head=0.5)
    text = list(range(10, 30))
    output = replay.Output("copy", text, text[:16], 50.0)
    table = replay.compare(flat, [output], (1, 3), 8, 0.0)
    oracle = table["oracle (drafts what will be accepted)"]["overall"]
    assert oracle == pytest.approx(table["every token found"]["overall"]) and oracle > 1.5
    assert table["fixed 1"]["overall"] < oracle and table["fixed 8"]["copy"] == pytest.approx(oracle)
