"""Draft sizing by the cost model: the acceptance curve, the choice, pauses and probes, and methods obeying it."""

import dataclasses

import pytest

from helpers import baseline_run, tiny_model
from specgui import methods
from specgui.core import decode
from specgui.costs import CostProfile
from specgui.methods.policy import EVIDENCE, MARGIN, PRIOR_ALPHA, RECHECK, DraftPolicy, Sizing

PROMPT = [1, 2, 3, 4, 5, 1, 2, 3, 4, 5, 1, 2, 3]


# The drafting mechanisms tiny_lm's runs here ask the profile for, at what they measured on a quiet machine
# (ms): a hand-made profile prices them too, so that no verdict here rests on a timing taken during the test
# (a CLaSp search measured on a busy machine could cost more than the hand-made forward)
# (either CPU int8 backend: which one "auto" builds is itself measured)
MECHANISMS = {"pld.lookup": 0.002, "selfdraft.retrieve": 0.007, "clasp.search.layer.2": 2.4,
              **{f"fractal.pass.{backend}.rows{rows}.ctx{context}": ms + context / 1024
                 for backend in ("torch-int8", "int8-weight-only")
                 for rows, ms in ((3, 2.2), (4, 2.4), (5, 2.6), (7, 3.0))  # windows of 2 and 3 (the CPU preset's)
                 for context in (128, 512)}}


def profile(forward: list[float], *, layers: int = 4, unit: float = 1.0, step_extra: float = 0.0) -> CostProfile:
    """A hand-made profile: `forward[i]` ms for i + 1 new tokens, at one context; equal sub-layer costs."""
    return CostProfile(key={"model": "hand-made", "device": "cpu", "dtype": "float32", "fast_path": False},
                       sizes=list(range(1, len(forward) + 1)), contexts=[128], forward=[forward],
                       step=forward[0] + step_extra, attn=[unit] * layers, mlp=[unit] * layers, head=0.1,
                       mechanisms=dict(MECHANISMS))


def measured_nothing(*profiles: CostProfile) -> bool:
    """Every mechanism the runs priced came from the hand-made profile, none from a timing taken meanwhile."""
    return all(p.mechanisms == MECHANISMS for p in profiles)


def test_a_plan_cut_to_a_smaller_size_keeps_everything_else():
    plan = Sizing(5, "paused", 0.9, 1.3, 2.5, prior=0.95, alpha=0.6, regime=2)
    assert plan.cut(3) == dataclasses.replace(plan, size=3)


def test_a_verdict_teaches_every_size_up_to_what_it_verified():
    policy = DraftPolicy(range(1, 5))
    for _ in range(40):
        policy.learn(path=[0, 1], verified=4, exhausted=False)  # two of four accepted
    assert policy.expected(1) == pytest.approx(1, abs=0.1)
    assert policy.expected(2) == pytest.approx(2, abs=0.1)
    assert policy.expected(4) == pytest.approx(2, abs=0.1)  # a longer draft would have stopped there too
    fresh = DraftPolicy(range(1, 5))
    fresh.learn(path=[0], verified=1, exhausted=False)
    assert fresh.expected(3) == pytest.approx(sum(PRIOR_ALPHA ** i for i in (1, 2, 3)))  # not verified: the prior
    fresh.learn(path=[0], verified=1, exhausted=True)  # nothing more to draft: larger sizes accept the same
    assert fresh.expected(3) < sum(PRIOR_ALPHA ** i for i in (1, 2, 3))


def test_a_size_not_rechecked_lately_returns_towards_its_prior():
    policy = DraftPolicy([1, 2, 3], regimes=1)  # one curve: the decay alone brings size 2 back
    policy.learn(path=[], verified=2, exhausted=False)  # one bad verdict of size 2 ...
    low = policy.expected(2)
    for _ in range(30):
        policy.learn(path=[0], verified=1, exhausted=False)  # ... then only size 1, always accepted
    assert policy.expected(1) == pytest.approx(1, abs=0.05)
    prior = sum(PRIOR_ALPHA ** i for i in (1, 2))
    assert policy.expected(2) > 2 * low and policy.expected(2) == pytest.approx(prior, abs=0.1)


def test_each_regime_learns_its_own_curve_and_prices_the_step_after_it():
    """Streaks: after a verdict that accepted 2 or more, drafts are accepted whole; after a rejection, not at all.
    One curve would average them; a curve per regime drafts long in a streak and pauses after a miss."""
    policy = DraftPolicy(range(1, 5))
    for _ in range(30):
        policy.learn(path=[0, 1, 2, 3], verified=4, exhausted=False)  # in a streak: everything accepted
    for _ in range(30):
        policy.learn(path=[], verified=4, exhausted=False)  # after a miss: nothing (the first miss is regime 2's)
    assert policy.regime == 0 and policy.expected(4) == pytest.approx(0, abs=0.05)
    assert policy.choose(lambda n: 10.0 + n, plain_ms=10.0).mode == "paused"
    policy.learn(path=[0, 1], verified=4, exhausted=False)  # a regime-0 verdict accepting two: regime 2 next
    assert policy.regime == 2 and policy.expected(4) > 3
    plan = policy.choose(lambda n: 10.0 + n, plain_ms=10.0)
    assert (plan.size, plan.mode, plan.to_dict()["regime"]) == (4, "draft", 2)
    policy.learn(path=[], verified=0, exhausted=False)  # a step that drafted nothing: back to regime 0
    assert policy.regime == 0
    single = DraftPolicy(range(1, 5), regimes=1)
    for _ in range(30):
        single.learn(path=[0, 1, 2, 3], verified=4, exhausted=False)
        single.learn(path=[], verified=4, exhausted=False)
    assert 1 < single.expected(4) < 3  # one curve: the average of both


def test_a_verdict_learnt_later_is_folded_in_with_its_own_plan_before_the_next_choice():
    """`learn(later=True)` (on the device's path, from `observe`) folds a verdict in only when the next plan is chosen
    (`plan_ahead`, beside the next forward), after the next draft took its plan: with the plan it was drafted under
    (its regime), so that the plans chosen and the curves learnt are those of folding every verdict in at once. Over
    streaks and misses, whose verdicts move the regime from step to step."""
    cost = lambda n: 10.0 + n  # noqa: E731

    def run(later: bool) -> tuple[list[tuple[int, str, int]], list[dict[int, float]]]:
        policy, plans = DraftPolicy(range(1, 5)), []
        for step in range(40):
            plan = policy.take(lambda: (cost, 10.0), 4)  # the draft takes the plan chosen ahead
            plans.append((plan.size, plan.mode, plan.regime))
            policy.plan_ahead(cost, 10.0, 4)  # beside the forward: a verdict learnt later is folded in first
            accepted = plan.size if step % 5 < 3 else step % 2  # streaks, then misses
            policy.learn(list(range(accepted)), plan.size, False, later=later)  # observe
        policy.plan_ahead(cost, 10.0, 4)  # the next step's turn: the last verdict in too
        return plans, policy.sums

    plans, sums = run(later=True)
    assert (plans, sums) == run(later=False)
    assert len({regime for _, _, regime in plans}) > 1 and any(mode == "draft" for _, mode, _ in plans)


def test_untried_sizes_are_capped_by_the_slope_below_them():
    policy = DraftPolicy([1, 2, 4])
    for _ in range(40):
        policy.learn(path=[0], verified=2, exhausted=False)  # the first token always, the second never
    assert policy.expected(2) == pytest.approx(1, abs=0.05)
    assert policy.expected(4) < 1.25  # the prior alone would credit 2.36


def test_tree_paths_count_the_nodes_a_smaller_verify_would_have_kept():
    policy = DraftPolicy([2, 5])
    for _ in range(40):
        policy.learn(path=[1, 4], verified=6, exhausted=False)  # node 4 lies beyond a 2-node verify
    assert policy.expected(2) == pytest.approx(1, abs=0.1) and policy.expected(5) == pytest.approx(2, abs=0.1)


def test_the_choice_follows_what_extra_rows_cost():
    accepting = DraftPolicy(range(1, 9))
    for _ in range(40):
        accepting.learn(path=list(range(6)), verified=8, exhausted=False)
    flat = accepting.choose(lambda n: 10.0 + 0.1 * n, plain_ms=10.0)  # a GPU: extra rows nearly free
    steep = accepting.choose(lambda n: 10.0 * (1 + n), plain_ms=10.0)  # every row costs a forward: never pays
    assert flat.mode == "draft" and flat.size == 6
    assert flat.predicted == pytest.approx((1 + accepting.expected(6)) * 10 / 10.6)
    assert steep.mode == "paused" and steep.size == 0


def test_pauses_double_between_probes_and_drafting_resumes_when_it_pays():
    policy = DraftPolicy([1, 2], max_pause=8)
    for _ in range(40):
        policy.learn(path=[], verified=2, exhausted=False)  # nothing accepted lately
    losing = lambda n: 15.0  # noqa: E731  (at this acceptance no draft pays; a fully accepted one would)
    modes = [policy.choose(losing, 10.0).mode for _ in range(17)]
    assert modes == ["paused", "probe", "paused", "paused", "probe", *["paused"] * 4, "probe", *["paused"] * 7]
    policy.learn(path=[0, 1], verified=2, exhausted=False)  # a probe accepted everything: a streak follows
    assert policy.choose(losing, 10.0).mode == "draft"  # its curve says drafting pays: at once, pauses reset
    assert policy.pause == 1


def test_drafting_that_yields_less_than_plain_decoding_pauses_whole_and_chains():
    """Where pauses chain (`whole_pauses`), steps outside a pause are settled as a whole: steps that bring 2 tokens at
    2.5 chained plain steps' price each (the prices it drafted by said they paid) lose, so after EVIDENCE of them the
    method pauses whole, known ahead, for a pause that doubles each time; where the steps pay, no pause."""
    policy = DraftPolicy([1, 2, 4], whole_pauses=True, max_pause=8)
    cheap = lambda n: 10.0  # noqa: E731  (every size priced to pay: the per-step choice always drafts)
    lengths = []
    for _ in range(3):
        settled = 0
        while not policy.paused_ahead():
            plan = policy.choose(cheap, 10.0)
            assert plan.mode == "draft"
            policy.learn(path=[0], verified=plan.size, exhausted=False, emitted=2, priced=2.5)
            settled += 1
        assert settled == EVIDENCE
        held = 0
        while policy.paused_ahead():
            plan = policy.choose(cheap, 10.0)
            assert plan.size == 0 and plan.prior is not None and policy.held
            policy.learn(path=[], verified=0, exhausted=True, emitted=1, priced=1.0)  # not settled: paused
            held += 1
        lengths.append(held)
    assert lengths == [1, 2, 4]
    paying = DraftPolicy([1, 2, 4], whole_pauses=True)
    for _ in range(20):
        paying.learn(path=[0], verified=1, exhausted=False, emitted=2, priced=1.2)
    assert not paying.paused_ahead()
    unchained = DraftPolicy([1, 2, 4])  # pauses that do not chain: a paused step costs what a drafting one does
    for _ in range(20):
        unchained.learn(path=[], verified=1, exhausted=False, emitted=1, priced=1.2)
    assert not unchained.paused_ahead() and unchained.left == 0


def test_a_draft_that_never_lands_pauses_within_five_steps_whatever_the_prior():
    """A GPU's prices: a verify of two rows costs one, a deeply skipped draft token 1% of a step, so a one-token draft
    pays above ~3% acceptance. Drafts that accept nothing pause it by the fifth step, however hopeful the prior (at a
    fixed weight the prior kept E[accepted | 1] at alpha / 11 for good, and that alone predicted a gain)."""
    gpu = lambda n: 10.0 + 0.1 * n  # noqa: E731
    for alpha in (0.5, PRIOR_ALPHA, 1.0):
        policy = DraftPolicy(range(1, 9), alpha=alpha)
        modes = []
        for _ in range(20):
            plan = policy.choose(gpu, plain_ms=10.0)
            modes.append(plan.mode)
            policy.learn(path=[], verified=plan.size, exhausted=False)  # nothing accepted
        assert modes[0] == "draft" and "draft" not in modes[4:], (alpha, modes)
        assert policy.expected(1) < 0.03


def test_no_probes_where_even_the_priors_acceptance_would_lose():
    policy = DraftPolicy([1, 2])
    for _ in range(40):
        policy.learn(path=[], verified=2, exhausted=False)  # nothing accepted lately
    plans = [policy.choose(lambda n: 30.0, 10.0) for _ in range(20)]  # 30 ms a step: pays only above 2 tokens
    assert {p.mode for p in plans} == {"paused"}
    assert plans[0].prior == pytest.approx((1 + PRIOR_ALPHA + PRIOR_ALPHA**2) * 10 / 30)
    assert "probe" in {policy.choose(lambda n: 12.0, 10.0).mode for _ in range(20)}  # cheaper: worth probing


def test_a_pause_for_good_stands_unpriced_for_a_while():
    """A hopeless pause is priced again only every RECHECK steps (what a paused step costs is its method's loss)."""
    policy = DraftPolicy([1, 2])
    for _ in range(40):
        policy.learn(path=[], verified=2, exhausted=False)
    priced: list[int] = []
    plans = [policy.choose(lambda n: priced.append(n) or 30.0, 10.0) for _ in range(2 * RECHECK + 1)]
    assert all(p.hopeless for p in plans)
    assert priced == [1, 2] * 3  # at steps 0, RECHECK and 2 RECHECK


def test_swift_searches_only_where_a_draft_could_pay():
    """SWIFT's proposals each cost a scoring forward: where no draft could pay even at the prior's acceptance
    (a dear profile) none is scored; where drafts may pay (a cheap one) the search runs as before."""
    lm = tiny_model(layers=8, init=0.3, seed=5)
    search = {"context_window": 4, "opt_interval": 1, "persist": False, "skip_ratio": 0.45, "max_score": 1.0}
    dear = profile([10.0 * (1 + 0.5 * i) for i in range(8)], layers=8, unit=0.0)
    cheap = profile([10.0] * 8, layers=8, unit=1.2)
    runs = {name: decode.run(lm, PROMPT, "swift", max_new_tokens=30, profile=prof, params=search)
            for name, prof in (("dear", dear), ("cheap", cheap))}
    scored = {name: sum("score" in s.payload["search"] for s in run.steps) for name, run in runs.items()}
    assert all(s.payload["plan"]["mode"] == "paused" for s in runs["dear"].steps)
    assert scored == {"dear": 0, "cheap": scored["cheap"]} and scored["cheap"] > 5
    assert runs["dear"].token_ids == runs["cheap"].token_ids == baseline_run(lm, PROMPT, 30).token_ids


def test_fixed_policy_always_drafts_the_largest_size():
    policy = DraftPolicy(range(1, 5), fixed=True)
    plan = policy.choose(lambda n: 1000.0, plain_ms=10.0, limit=3)
    assert (plan.size, plan.mode) == (3, "fixed") and plan.predicted < 1 - MARGIN


def test_layer_skip_pauses_where_a_draft_token_costs_a_forward(tiny_lm):
    """A profile where skipping saves nothing and verifying grows: CLaSp stops drafting, and loses nothing."""
    dear = profile([10.0 * (1 + 0.5 * i) for i in range(8)], unit=0.0)
    result = decode.run(tiny_lm, PROMPT, "clasp", max_new_tokens=40, profile=dear)
    modes = [s.payload["plan"]["mode"] for s in result.steps if "plan" in s.payload]
    assert modes.count("paused") > len(modes) // 2 and "draft" not in modes
    assert all(s.predicted_ms > 0 for s in result.steps)
    # no draft could pay even at the prior's acceptance: no probe, so no skip-set search at all
    assert set(modes) == {"paused"} and not any(e.payload.get("reoptimized") for e in result.events[1:-1])
    cheap = profile([10.0] * 8, unit=1.2)  # a GPU: verifying 8 costs one, a draft token skips half the layers
    again = decode.run(tiny_lm, PROMPT, "clasp", max_new_tokens=40, profile=cheap, params={"det": 0.0})
    assert again.token_ids == result.token_ids == baseline_run(tiny_lm, PROMPT, 40).token_ids
    assert sum(s.drafted for s in again.steps) > sum(s.drafted for s in result.steps)
    assert measured_nothing(dear, cheap)


def test_a_hopeless_clasp_records_no_states(tiny_lm, monkeypatch):
    """Paused for good (no draft could pay at the prior's acceptance), CLaSp's verify forwards carry no recorder, so
    they run the layers without an observer (one C call each on a CPU); the prompt's forward still records."""
    observers: list[tuple[int, bool]] = []
    forward = tiny_lm.runner.forward

    def spy(tokens, positions, cache, **kwargs):
        observers.append((int(positions[0]), kwargs.get("observer") is not None))
        return forward(tokens, positions, cache, **kwargs)

    monkeypatch.setattr(tiny_lm.runner, "forward", spy)
    dear = profile([10.0 * (1 + 0.5 * i) for i in range(8)], unit=0.0)
    result = decode.run(tiny_lm, PROMPT, "clasp", max_new_tokens=12, profile=dear)
    assert {s.payload["plan"]["mode"] for s in result.steps} == {"paused"}
    recorded = [on for start, on in observers if start >= len(PROMPT)]
    hopeless = [s.payload["plan"].get("prior", 1.0) < 1 for s in result.steps]  # the last: the budget's end
    assert len(recorded) == len(hopeless) and sum(hopeless) == len(hopeless) - 1
    assert not any(on for on, paused_for_good in zip(recorded, hopeless) if paused_for_good)
    assert (0, True) in observers  # the prefill recorded (a first search would read it)
    assert result.token_ids == baseline_run(tiny_lm, PROMPT, 12).token_ids


def test_predicted_speedup_of_a_run_prices_its_steps():
    lm = tiny_model(seed=2)
    flat = profile([10.0] * 16)
    result = decode.run(lm, PROMPT, "pld", max_new_tokens=30, profile=flat)
    summary = result.summary
    prompt_s = (result.events[1].ms + result.events[1].overhead_ms) / 1000
    assert summary.predicted_s == pytest.approx(prompt_s + 0.010 * summary.steps, rel=0.01)  # + the lookups
    assert summary.plain_s == pytest.approx(prompt_s + 0.010 * (summary.new_tokens - 1))
    assert summary.predicted_speedup > 1  # pld repeats the prompt; on a flat profile every match pays
    assert measured_nothing(flat)


SIZED = [n for n in methods.names() if "policy" in {f.name for f in dataclasses.fields(methods.get(n).Params)}]
# quick searches, and no draft exit: this random model is rarely sure of a draft token
QUICK = {"dv": {"iterations": 4, "init_points": 2, "calibration": "chat-001", "calibration_tokens": 8},
         "swift": {"context_window": 4, "opt_interval": 1, "exit_threshold": 0.0},
         "admg": {"exit_threshold": 0.0, "exit_step": 0.0, "alpha": 0.0, "keep_last": 0}, "clasp": {"det": 0.0}}


@pytest.mark.parametrize("method", SIZED)
def test_every_sized_method_obeys_the_profile_and_stays_lossless(tiny_lm, method, tmp_path, monkeypatch):
    """Where verifying more rows costs nothing the policy drafts; where every row costs a forward it pauses.
    Either way the output is plain decoding's."""
    monkeypatch.setenv("SPECGUI_CACHE", str(tmp_path))  # dv's searched skip set stays in the test's folder
    cheap = profile([10.0] * 64, unit=4.0)  # a draft token that skips one sub-layer costs 0.6 of a forward
    dear = profile([10.0 * (1 + i) for i in range(64)], unit=0.0)
    params = QUICK.get(method, {})
    base = baseline_run(tiny_lm, PROMPT, 40).token_ids
    runs = {name: decode.run(tiny_lm, PROMPT, method, max_new_tokens=40, profile=p, params=params)
            for name, p in (("cheap", cheap), ("dear", dear))}
    for name, result in runs.items():
        assert result.token_ids == base, name
        assert all("plan" in s.payload for s in result.steps if s.drafted)
    modes = [s.payload["plan"]["mode"] for s in runs["dear"].steps if "plan" in s.payload]
    assert "draft" not in modes and modes.count("paused") >= len(modes) // 2
    assert sum(s.drafted for s in runs["cheap"].steps) > sum(s.drafted for s in runs["dear"].steps)
    assert measured_nothing(cheap, dear)


def test_whole_acceptance_is_the_curves_last_step():
    """P(a draft of n is accepted whole): what Fractal charges a chain's restart by."""
    policy = DraftPolicy([1, 2, 3, 4])
    for _ in range(40):
        policy.learn([0], 4, False)  # the first token always accepted, the second never
    curve, whole = policy.curve(), policy.whole()
    assert whole[1] == pytest.approx(curve[1]) and whole[1] > 0.9
    assert all(whole[n] == pytest.approx(max(0.0, curve[n] - curve[n - 1])) for n in (2, 3, 4))  # never below 0
    assert whole[2] < 0.2 and all(0.0 <= p <= 1.0 for p in whole.values())
    gaps = DraftPolicy([1, 2, 4])
    assert gaps.whole()[4] == pytest.approx((gaps.curve()[4] - gaps.curve()[2]) / 2)  # the slope over the gap
