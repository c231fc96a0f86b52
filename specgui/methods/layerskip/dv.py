"""`dv`: Draft & Verify (Zhang et al. 2024, "self-speculative decoding"): one skip set per model, found offline.

Draft & Verify drafts with the target itself, some attention and MLP sub-layers left out; which ones is
decided once per model, before serving, by Bayesian optimisation over 0/1 vectors of all 2L sub-layers
(dilab-zju/self-speculative-decoding, `searching.py`: `bayes_opt` with a GP, noise 1e-2, 1000 iterations
on 8 calibration prompts). Drafts stop by the adaptive draft-exit threshold (section 3.4, shared with
ADMG in `layerskip`), starting at 0.6 as in the code's evaluation.

Here the search runs the first time `dv` meets a model (on a device type and dtype) and its result is
cached on disk under `cache_root()/skipsets/` beside the converted weights, keyed by a fingerprint of the
model's config and weights and by the search settings; later runs read the file. The first run's prompt
forward includes the search (its seconds are in the prefill payload); `python -m specgui dv-search`
runs it ahead of time.

Where this differs from the paper, and why: the code's objective is the measured tokens/s of
self-speculative generation on the calibration prompts (the ASD paper reports about 11 hours per 13B
model). Ours is that speed predicted from two measurements: how often the skipped model, teacher-forced
over text the full model wrote for the calibration prompts, predicts the full model's next token
(acceptance alpha, one forward per prompt), and what each attention and MLP sub-layer and a verify of
n tokens cost on this device (the model's measured cost profile, `specgui.costs`). With K draft tokens a step yields
(1 - alpha^(K+1)) / (1 - alpha) tokens for K drafts plus a verify, and the objective is the best K's
tokens per unit of time against plain decoding. A candidate then costs a few forwards instead of a few
generations, is deterministic (no timing noise for the GP to chase), and a search takes tens of seconds
on a CPU. The Bayesian step is `bayesopt` (our GP and UCB) maximised over sampled 0/1 vectors and
one-flip neighbours of the best, instead of `bayes_opt`'s continuous box rounded at 0.5. Calibration
prompts come from the corpus prompt set (`assets/corpus/prompts.jsonl`), never the benchmark suite.

The set is checked against the cost model at hand before it drafts: its measured acceptance is the cost policy's
prior (`DraftVerify.sizing`), so a set that cannot pay at it pauses from the first step, and one that accepts less
than it claimed (searched under another profile or dtype) pauses as soon as its verdicts say so.
"""

from __future__ import annotations

import hashlib
import json
import time
import weakref
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from specgui import ASSETS_DIR
from specgui.core import progress
from specgui.core.draft import Outcome
from specgui.core.kvcache import KVCache
from specgui.core.runner import Runner, SkipPlan
from specgui.core.text import encode_prompt
from specgui.core.vocab import DraftVocab, head_ms
from specgui.costs import CostProfile
from specgui.errors import SpecGUIError
from specgui.methods.base import DecodeState, register
from specgui.methods.layerskip.bayesopt import BayesOpt, candidate_pool
from specgui.methods.layerskip.drafting import AdaptiveExitParams, ExitThreshold, LayerSkipDrafter, adaptive_exit
from specgui.methods.layerskip.skipsearch import SkipSpace, matchness
from specgui.methods.params import param
from specgui.methods.policy import DraftPolicy
from specgui.methods.presets import build_params
from specgui.model import hosting
from specgui.model.cachedir import cache_root, exclusive
from specgui.tools.prompts import PromptRow, load_prompts

CACHE_FORMAT = "specgui-skipset"
CALIBRATION_PROMPTS = ASSETS_DIR / "corpus" / "prompts.jsonl"  # never the benchmark suite
MAX_CALIBRATION = 16  # calibration prompts a search takes (`calibration_ids`)
# the parameters a searched skip set depends on: its cache key, and what a public deployment keeps as configured
SEARCH_SETTING = ("iterations", "init_points", "calibration", "calibration_tokens", "max_draft", "draft_vocab")
MAX_DENSITY = 0.7  # random vectors skip at most this share of the sub-layers
KAPPA = 2.576  # bayes_opt's default UCB exploration, which the D&V code leaves unchanged


@dataclass(frozen=True)
class DvParams(AdaptiveExitParams):
    iterations: int = param(low=0, high=5000, help="Bayesian-optimisation steps of the offline search (after the "
                                                    "initial points)")
    init_points: int = param(low=1, high=512, help="random skip sets scored before the first Bayesian step")
    calibration: str = param(help="calibration prompts: comma-separated ids of assets/corpus/prompts.jsonl")
    calibration_tokens: int = param(low=2, high=512, help="tokens the full model writes per calibration prompt; "
                                                          "candidates are scored on them")


@dataclass(frozen=True)
class Costs:
    """Times relative to a one-token forward, from the model's cost profile: per layer, its attention and MLP
    sub-layer; verify[n - 1], a verify of n tokens (never less than one forward); the floor of a draft forward."""

    attn: tuple[float, ...]
    mlp: tuple[float, ...]
    verify: tuple[float, ...]
    floor: float = 0.02
    head_saved: float = 0.0  # what a draft vocabulary's head saves against the full head

    @classmethod
    def of(cls, profile: CostProfile, context: int, max_draft: int, head: float | None = None) -> Costs:
        """The objective's costs at `context` cached tokens, drafts of up to `max_draft` tokens, a draft's norm and
        head at `head` ms (a draft vocabulary's; None: the profile's full head)."""
        base = profile.forward_ms(1, profile.contexts[0])  # the sub-layers were timed at this context
        plain = profile.plain_ms(context)
        verify = [max(1.0, profile.verify_ms(n, context) / plain) for n in range(1, max_draft + 2)]
        verify = [min(verify[i:]) for i in range(len(verify))]  # a longer verify never counts as cheaper
        head = profile.head if head is None else head
        return cls(tuple(a / base for a in profile.attn), tuple(m / base for m in profile.mlp), tuple(verify),
                   max(0.02, head / base), (profile.head - head) / base)

    def draft(self, plan: SkipPlan) -> float:
        """A one-token draft forward with `plan` skipped, relative to the full forward."""
        saved = sum(self.attn[layer] for layer in plan.attn) + sum(self.mlp[layer] for layer in plan.mlp)
        return max(self.floor, 1.0 - saved - self.head_saved)


def predicted_speedup(alpha: float, draft_cost: float, costs: Costs) -> tuple[float, int]:
    """Best (speedup, K) over draft lengths K = 1 .. len(costs.verify) - 1, for per-token acceptance alpha."""
    best = (0.0, 1)
    for k in range(1, len(costs.verify)):
        tokens = k + 1 if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
        best = max(best, (tokens / (k * draft_cost + costs.verify[k]), k))
    return best


@dataclass
class Sample:
    """One calibration prompt: its cache (the full model's prompt keys), the full model's continuation and the draft
    vocabulary candidates are scored with (the prompt's and the whole continuation's ids: what a draft late in such
    a text would hold)."""

    cache: KVCache
    prefix: int
    text: list[int]
    vocab: DraftVocab | None = None


def calibration_ids(text: str) -> list[str]:
    """The calibration prompts' ids in `text` (comma-separated), each once, at most MAX_CALIBRATION: every sample keeps
    a prefilled cache (~45 MB on SmolLM2-135M) through the search, and one id repeated 500 times exhausted 23 GB."""
    ids = list(dict.fromkeys(i.strip() for i in text.split(",") if i.strip()))
    if len(ids) > MAX_CALIBRATION:
        raise SpecGUIError(f"dv.calibration names {len(ids)} prompts; a search takes at most {MAX_CALIBRATION}")
    return ids


def calibrate(runner: Runner, tokenizer: Any, ids: list[str], tokens: int, draft_vocab: int = 0) -> list[Sample]:
    """Prefill each calibration prompt and let the full model write `tokens` tokens after it (greedy)."""
    rows = {row.id: row for row in load_prompts(CALIBRATION_PROMPTS)}
    missing = [i for i in ids if i not in rows]
    if missing or not ids:
        raise SpecGUIError(f"dv.calibration names no prompt {', '.join(missing) or '(empty)'} of "
                           f"assets/corpus/prompts.jsonl")
    samples = []
    for row_id in ids:
        prompt = _encode(tokenizer, rows[row_id])
        cache = KVCache()
        logits = runner.forward(torch.tensor(prompt), torch.arange(len(prompt)), cache, logits_rows=slice(-1, None))
        text = [int(logits[-1].argmax())]
        for i in range(tokens - 1):
            logits = runner.forward(torch.tensor(text[-1:]), torch.tensor([len(prompt) + i]), cache)
            text.append(int(logits[-1].argmax()))
        cache.crop(len(prompt))
        samples.append(Sample(cache, len(prompt), text, DraftVocab.of(runner, draft_vocab, prompt + text)))
    return samples


def _encode(tokenizer: Any, row: PromptRow) -> list[int]:
    if tokenizer is None:
        raise SpecGUIError("dv needs the model's tokenizer to encode its calibration prompts")
    if getattr(tokenizer, "chat_template", None):
        return row.encode(tokenizer)
    return encode_prompt(tokenizer, row.preview, chat=False)


@dataclass
class SkipSetResult:
    """A searched skip set and what the search knew about it."""

    attn: list[int]
    mlp: list[int]
    objective: float  # predicted speedup over plain decoding
    matchness: float  # teacher-forced acceptance on the calibration text
    draft_cost: float  # a draft forward relative to a full one
    draft_len: int  # the K that objective assumes
    iterations: int
    seconds: float
    trace: list[float]  # best objective after each scored set

    @property
    def plan(self) -> SkipPlan:
        return SkipPlan(attn=frozenset(self.attn), mlp=frozenset(self.mlp))


def search(runner: Runner, samples: list[Sample], params: DvParams, costs: Costs, *, seed: int = 1) -> SkipSetResult:
    """Draft & Verify's offline search: Bayesian optimisation of the predicted speedup over skip sets."""
    start = time.perf_counter()
    space = SkipSpace.of(range(runner.num_layers))
    rng = np.random.default_rng(seed)
    opt = BayesOpt(len(space), kappa=KAPPA, noise=1e-2)
    details: dict[bytes, tuple[float, float, int]] = {}
    trace: list[float] = []

    def score(x: np.ndarray) -> None:
        plan = space.plan(x)
        right = total = 0
        for s in samples:
            r, t = matchness(runner, s.cache, s.prefix, s.text, plan, s.vocab)
            right, total = right + r, total + t
        alpha = right / max(1, total)
        cost = costs.draft(plan)
        speedup, k = predicted_speedup(alpha, cost, costs) if len(plan) else (0.0, 1)  # skip nothing: no draft
        opt.register(x, speedup)
        details[x.astype(np.uint8).tobytes()] = (alpha, cost, k)
        trace.append(max(trace[-1] if trace else 0.0, speedup))

    def sample(n: int) -> np.ndarray:
        return space.random_vectors(rng, n, MAX_DENSITY)

    for x in [*_probes(space, runner.num_layers), *sample(params.init_points)]:
        if not opt.evaluated(x):
            score(x)
    for _ in range(params.iterations):
        pool = candidate_pool(opt, sample, rng, random_count=256, around_best=4, per_best=32, keep_size=False)
        x = opt.suggest(pool)
        score(x if x is not None else sample(1)[0])
    best = opt.best(1)[0]
    alpha, cost, k = details[best.astype(np.uint8).tobytes()]
    plan = space.plan(best)
    return SkipSetResult(sorted(plan.attn), sorted(plan.mlp), max(opt.ys), alpha, cost, k, len(opt),
                         time.perf_counter() - start, trace)


def _probes(space: SkipSpace, layers: int) -> list[np.ndarray]:
    """Starting points, like the code's hand-given probes: every 2nd and every 4th layer whole, every 2nd
    attention alone."""
    def plan(attn: set[int], mlp: set[int]) -> np.ndarray:
        return space.vector(SkipPlan(attn=frozenset(attn), mlp=frozenset(mlp)))

    odd, fourth = set(range(1, layers - 1, 2)), set(range(1, layers - 1, 4))
    return [plan(odd, odd), plan(fourth, fourth), plan(odd, set())]


_FINGERPRINTS: weakref.WeakKeyDictionary[Runner, str] = weakref.WeakKeyDictionary()


def fingerprint(runner: Runner) -> str:
    """Identity of a model's weights and shape: its config and a sample of its embedding and head weights. Kept per
    runner: the sample is read off the device, which every run's setup would otherwise pay."""
    if runner not in _FINGERPRINTS:
        _FINGERPRINTS[runner] = _fingerprint(runner)
    return _FINGERPRINTS[runner]


def _fingerprint(runner: Runner) -> str:
    digest = hashlib.sha256()
    config = {k: v for k, v in runner.config.to_dict().items() if not k.startswith("_")}
    digest.update(json.dumps(config, sort_keys=True, default=str).encode())
    for weight in (runner.embed.weight, runner.lm_head.weight):
        if weight.device.type != "meta":
            digest.update(weight.detach().flatten()[:4096].float().cpu().numpy().tobytes())
    digest.update(str(runner.dtype).encode())
    return digest.hexdigest()[:16]


def cache_path(runner: Runner, params: DvParams) -> Path:
    """Where the skip set for this model, device type and search setting lives."""
    setting = {k: getattr(params, k) for k in SEARCH_SETTING}
    setting["calibration"] = ",".join(calibration_ids(params.calibration))
    tag = hashlib.sha256(json.dumps(setting, sort_keys=True).encode()).hexdigest()[:8]
    return cache_root() / "skipsets" / f"dv-{fingerprint(runner)}-{runner.device.type}-{tag}.json"


def load_or_search(runner: Runner, tokenizer: Any, params: DvParams, profile: CostProfile,
                   may_search: bool = True) -> tuple[SkipSetResult, bool]:
    """The cached skip set for this model and setting, or a new search priced by `profile` (then cached); and
    whether it was cached. Where not `may_search` (a public deployment, another setting than it configures), a
    setting with no cached set is refused in one line: a visitor's search can hold the one device for hours."""
    path = cache_path(runner, params)
    found = _read_skipset(path)
    if found is not None:
        return found, True
    if not may_search:
        raise SpecGUIError("this deployment searches dv's skip set only with its configured setting (configs/dv.yaml): "
                           f"{', '.join(SEARCH_SETTING)} stay as configured here")
    with exclusive(path):  # processes sharing the cache search once: a waiting one reads what the first found
        found = _read_skipset(path)
        if found is not None:
            return found, True
        ids = calibration_ids(params.calibration)
        with progress.phase("searching dv's skip set for this model (once; cached beside the weights)",
                            total=2) as phase, torch.inference_mode():
            samples = calibrate(runner, tokenizer, ids, params.calibration_tokens, params.draft_vocab)
            progress.advance(phase, "samples decoded")
            head = head_ms(profile, runner, params.draft_vocab) if samples[0].vocab is not None else None
            result = search(runner, samples, params, Costs.of(profile, samples[0].prefix, params.max_draft, head))
            progress.advance(phase, "searched")
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"format": CACHE_FORMAT, **asdict(result)}), encoding="utf-8")
        tmp.replace(path)
    return result, False


def _read_skipset(path: Path) -> SkipSetResult | None:
    """The skip set saved at `path`; None if there is none (or it is damaged or of another format: searched again
    and overwritten)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.pop("format", None) == CACHE_FORMAT:
            return SkipSetResult(**data)
    except (OSError, ValueError, TypeError):
        pass
    return None


@register
class DraftVerify(LayerSkipDrafter):
    name = "dv"
    title = "Draft & Verify"
    summary = "Skips one set of sub-layers per model, found offline by Bayesian optimisation; adaptive draft exit."
    Params = DvParams

    def setup(self, state: DecodeState) -> None:
        super().setup(state)
        if state.profile is None:
            raise SpecGUIError("dv prices its skip-set search with the model's cost profile; none is at hand")
        self.found, self.cached = load_or_search(self.runner, state.tokenizer, self.params, state.profile,
                                                 may_search=self._may_search(state))

    def _may_search(self, state: DecodeState) -> bool:
        """Whether this run may search a skip set not cached yet: anywhere but on a public deployment, and there
        with the setting configs/ give this model and device (the one a deployment searches ahead of time)."""
        if not hosting.is_public():
            return True
        configured = build_params(self.name, DvParams, state.model, self.runner.device.type)
        return all(getattr(self.params, k) == getattr(configured, k) for k in SEARCH_SETTING)

    def sizing(self, state: DecodeState, sizes: Iterable[int]) -> DraftPolicy:
        """The policy's prior is the searched set's own acceptance (its matchness on the calibration text), not the
        paper's: so a set that could not pay at what it was measured to accept, priced by the cost model at hand (a
        set found under another profile, or the search's best that still predicted a loss), pauses for good from the
        first step instead of drafting on the paper's hope until its verdicts overrule it."""
        policy = super().sizing(state, sizes)
        policy.alpha = self.found.matchness
        return policy

    def begin(self, state: DecodeState) -> None:
        super().begin(state)
        self.plan = self.found.plan
        state.adopt(self.plan)
        return None

    def make_exit(self) -> ExitThreshold:
        return adaptive_exit(self.params)

    def learn(self, state: DecodeState, outcome: Outcome) -> dict[str, Any]:
        if not outcome.prefill:
            return {}
        f = self.found
        search = {"cached": self.cached, "iterations": f.iterations, "seconds": f.seconds, "objective": f.objective,
                  "matchness": f.matchness, "draft_cost": f.draft_cost, "draft_len": f.draft_len}
        return {"skip": self.plan.to_dict(), "search": search}
