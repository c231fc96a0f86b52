"""Prompt lookup's draft sizing, replayed exactly on greedy outputs and priced by the cost profile.

A greedy output does not depend on how it was drafted: once `baseline` has produced it, what a pld draft of
any size would have had accepted at any position is known (the common prefix of the lookup's continuation
and the output there). So any sizing policy can be replayed step by step with no timing noise, each step
priced as the cost model prices it (the lookup plus a verify of 1 + k rows at the step's context, the prompt
forward as measured), against plain steps over the same output. An oracle drafts exactly what will be accepted
(no rejected token is ever verified): about what any sizing of these lookups can win. The cost model's policy is
replayed with one acceptance curve and with a curve per regime (`specgui.methods.policy`), step for step the
decisions a pld run makes with the same profile (`tests/test_replay.py`):

    python -m specgui.tools.replay --prompts assets/heldout.jsonl --limit 2 --max-new-tokens 64
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

from specgui import costs, methods
from specgui.cli import Parser, add_model_args, load_model
from specgui.core import decode
from specgui.core.sampling import GREEDY
from specgui.costs import CostProfile
from specgui.errors import SpecGUIError
from specgui.methods.ngram.pld import NgramIndex
from specgui.methods.policy import REGIMES, DraftPolicy
from specgui.tools.prompts import load_prompts, select

# One step's choice: (tokens found, tokens of them that will be accepted, context) -> tokens to draft. Built fresh
# per prompt; one that learns (`CostPolicy`) reads the step's verdict off the accepted count it is handed.
Sizer = Callable[[list[int], int, int], int]


@dataclass(frozen=True)
class Output:
    """A greedy run to replay on: its prompt, its output and what its prompt forward took (as a run's summary
    counts it: the forward and the drafter's look at it)."""

    category: str
    prompt: list[int]
    tokens: list[int]
    prompt_ms: float


class CostPolicy:
    """The cost model's sizing as pld runs it, with `regimes` acceptance curves."""

    def __init__(self, profile: CostProfile, num_draft: int, lookup_ms: float, regimes: int) -> None:
        self.profile, self.lookup_ms = profile, lookup_ms
        self.policy = DraftPolicy(range(1, num_draft + 1), regimes=regimes)

    def __call__(self, found: list[int], accepted: int, context: int) -> int:
        if not found:
            self.policy.learn([], 0, False)
            return 0
        price = lambda k: self.lookup_ms + self.profile.verify_ms(1 + k, context)  # noqa: E731
        k = self.policy.choose(price, self.profile.plain_ms(context), len(found)).size
        self.policy.learn(list(range(min(accepted, k))), k, k == len(found))
        return k


def policies(profile: CostProfile, num_draft: int, lookup_ms: float,
             fixed: tuple[int, ...] = (1, 2, 3, 4, 6, 8)) -> dict[str, Callable[[], Sizer]]:
    """The policies compared, each a factory of a fresh sizer per prompt."""
    out: dict[str, Callable[[], Sizer]] = {
        "cost model, a curve per regime": lambda: CostPolicy(profile, num_draft, lookup_ms, REGIMES),
        "cost model, one curve": lambda: CostPolicy(profile, num_draft, lookup_ms, 1),
        "oracle (drafts what will be accepted)": lambda: lambda found, accepted, context: accepted,
        "every token found": lambda: lambda found, accepted, context: len(found),
    }
    for k in fixed:
        out[f"fixed {k}"] = lambda k=k: lambda found, accepted, context: k
    return out


def replay(profile: CostProfile, output: Output, sizer: Sizer, ngrams: tuple[int, int], num_draft: int,
           lookup_ms: float) -> tuple[float, float]:
    """(plain ms, replayed ms) of one output: prefill plus every step, priced by `profile`."""
    n = len(output.prompt)
    plain = output.prompt_ms + sum(profile.plain_ms(n + i) for i in range(1, len(output.tokens)))
    tokens = [*output.prompt, output.tokens[0]]
    index = NgramIndex(*ngrams)
    index.update(tokens)
    replayed = output.prompt_ms
    done = 1
    while done < len(output.tokens):
        context = len(tokens) - 1
        future = output.tokens[done:]
        found, _ = index.lookup(tokens, min(num_draft, len(future) - 1))
        accepted = next((i for i, (a, b) in enumerate(zip(found, future)) if a != b), min(len(found), len(future)))
        k = min(max(0, sizer(found, accepted, context)), len(found))
        replayed += lookup_ms + profile.verify_ms(1 + k, context)
        step = future[: min(accepted, k) + 1]
        tokens += step
        done += len(step)
        index.update(tokens)
    return plain, replayed


def compare(profile: CostProfile, outputs: list[Output], ngrams: tuple[int, int], num_draft: int,
            lookup_ms: float) -> dict[str, dict[str, float]]:
    """Predicted speedup of every policy over plain decoding: overall and per category."""
    table: dict[str, dict[str, float]] = {}
    for name, make in policies(profile, num_draft, lookup_ms).items():
        sums: dict[str, list[float]] = {}
        for output in outputs:
            plain, replayed = replay(profile, output, make(), ngrams, num_draft, lookup_ms)
            for key in ("overall", output.category):
                total = sums.setdefault(key, [0.0, 0.0])
                total[0] += plain
                total[1] += replayed
        table[name] = {key: plain / replayed for key, (plain, replayed) in sums.items()}
    return table


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m specgui.tools.replay", description="Replay prompt lookup's draft sizing on greedy "
                    "outputs, priced by the cost profile.")
    parser.add_argument("--prompts", default="suite", help="JSONL file, or 'suite' for the built-in suite")
    parser.add_argument("--categories", default=None)
    parser.add_argument("--limit", type=int, default=2, help="prompts per category (0: all)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    add_model_args(parser)
    try:
        args = parser.parse_args(argv)
        rows = select(load_prompts(args.prompts), args.categories.split(",") if args.categories else None,
                      args.limit or None)
        lm = load_model(args)
        profile = costs.profile_for(lm, False)
        pld = methods.create("pld", lm.runner, lm.name, GREEDY, None)
        outputs = []
        for row in rows:
            ids = row.encode(lm.tokenizer)
            run = decode.run(lm, ids, "baseline", max_new_tokens=args.max_new_tokens, fast_path="off",
                             profile=profile)
            prefill = run.events[1]
            outputs.append(Output(row.category, ids, list(run.summary.token_ids), prefill.ms + prefill.overhead_ms))
    except SpecGUIError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    p = pld.params
    lookup_ms = profile.mechanisms.get("pld.lookup", 0.0)
    table = compare(profile, outputs, p.ngrams, p.num_draft, lookup_ms)
    categories = list(dict.fromkeys(o.category for o in outputs))
    print(f"pld on {lm.name}: {len(outputs)} prompts, {args.max_new_tokens} new tokens, priced by the cost profile "
          f"{profile.origin()}")
    print(f"{'policy':40s} {'overall':>8s} " + " ".join(f"{c[:9]:>9s}" for c in categories))
    for name, speedups in table.items():
        print(f"{name:40s} {speedups['overall']:7.2f}x " + " ".join(f"{speedups[c]:8.2f}x" for c in categories))
    return 0


if __name__ == "__main__":
    sys.exit(main())
