"""`python -m specgui.gpuprobe OUT.json embedded llama-3b llama-8b`: what the fast path costs on this device.

Per model (the embedded one, or `random:SHAPE`): baseline ms per token on the fast path against its graph
floor (the bucket-1 whole-forward graph replayed alone), the eager step, a few methods' ms per token and
whether they match baseline, host syncs per token (`torch.cuda.set_sync_debug_mode`), runtime calls per
token (the profiler), the fast path's programs, capture time and graph memory, the SDPA backends, and
whether dropping the model frees it and its memory. Run on a GPU (README, *GPU*); on a CPU the CUDA-only
figures are None. Written after each model, so a run cut short keeps what it measured.
"""

import gc
import json
import statistics
import sys
import time
import warnings
import weakref

import torch

from specgui import decode, fastpath
from specgui.loading import ModelSpec, load

dev = "cuda" if torch.cuda.is_available() else "cpu"
cuda = dev == "cuda"
out = {}
PROMPT = ("<|im_start|>user\nWrite a Python function that returns the n-th Fibonacci number, with a docstring."
          "<|im_end|>\n<|im_start|>assistant\n")


def mem():
    if cuda:
        torch.cuda.synchronize()
        gc.collect()
        torch.cuda.empty_cache()
        return torch.cuda.memory_allocated()
    return 0


def step_ms(lm, ids, method="baseline", n=64, **kw):
    meds = []
    for _ in range(3):
        r = decode.run(lm, ids, method, max_new_tokens=n, fast_path="on", **kw)
        meds.append(statistics.median(s.draft_ms + s.verify_ms + s.overhead_ms for s in r.steps))
    return min(meds), r


def floor_ms(lm, ids):
    cache = fastpath.cache_for(lm.runner, len(ids) + 80)
    with torch.inference_mode():
        lm.runner.forward(torch.tensor(ids), torch.arange(len(ids)), cache)
        inputs = cache.inputs_for(1)
        prog = cache.whole(inputs)
        step = lm.runner.new_pass(torch.tensor([len(ids)]), cache.view(len(ids)))
        step._load()
        for _ in range(5):
            prog()
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(50):
                prog()
            b.record()
            b.synchronize()
            return a.elapsed_time(b) / 50
        t = time.perf_counter()
        for _ in range(5):
            prog()
        return (time.perf_counter() - t) * 200


def syncs_per_token(lm, ids, method):
    if not cuda:
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            r = decode.run(lm, ids, method, max_new_tokens=32, fast_path="on")
        finally:
            torch.cuda.set_sync_debug_mode("default")
    n = sum("synchroniz" in str(w.message) for w in caught)
    kinds = {}
    for w in caught:
        k = str(w.message).splitlines()[0][:80]
        kinds[k] = kinds.get(k, 0) + 1
    return {"per_token": n / max(1, len(r.token_ids)), "total": n, "tokens": len(r.token_ids), "kinds": kinds}


def launches_per_token(lm, ids, method):
    if not cuda:
        return None
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        r = decode.run(lm, ids, method, max_new_tokens=32, fast_path="on")
    counts = {}
    for e in prof.events():
        if e.name.startswith("cuda") and ("Launch" in e.name or "Memcpy" in e.name or "Synchronize" in e.name):
            counts[e.name] = counts.get(e.name, 0) + 1
    return {k: v / max(1, len(r.token_ids)) for k, v in counts.items()}


def sdpa_backends(lm, ids):
    if not cuda:
        return None
    from torch.nn.attention import SDPBackend, sdpa_kernel
    res = {}
    for name in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "CUDNN_ATTENTION", "MATH"):
        try:
            with sdpa_kernel(getattr(SDPBackend, name)):
                lm.runner.static_cache = None  # new captures under this backend
                ms, _ = step_ms(lm, ids, n=32)
            res[name] = ms
        except Exception as e:
            res[name] = repr(e).splitlines()[0][:160]
    lm.runner.static_cache = None
    return res


def main() -> None:
    for name in sys.argv[2:]:
        out[name] = probe(name)
        print(name, json.dumps(out[name], default=str), flush=True)
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=1, default=str)


def probe(name: str) -> dict:
    before = mem()
    t0 = time.time()
    model = "embedded" if name == "embedded" else f"random:{name}"
    lm = load(ModelSpec(name=model, dtype="bfloat16" if cuda else "float32", device=dev))
    ids = list(lm.tokenizer(PROMPT)["input_ids"])
    r = {"load_s": time.time() - t0, "prompt_tokens": len(ids)}
    t0 = time.time()
    decode.run(lm, ids, "baseline", max_new_tokens=8, fast_path="on")
    r["first_run_s"] = time.time() - t0
    r["stats_after_first"] = fastpath.stats(lm.runner)
    r["baseline_step_ms"], base = step_ms(lm, ids)
    r["floor_ms"] = floor_ms(lm, ids)
    r["ratio_to_floor"] = r["baseline_step_ms"] / r["floor_ms"]
    eager = [decode.run(lm, ids, "baseline", max_new_tokens=32, fast_path="off") for _ in range(2)]
    r["eager_step_ms"] = min(statistics.median(s.draft_ms + s.verify_ms + s.overhead_ms for s in e.steps)
                             for e in eager)
    for m in ("pld", "selfdraft", "fractal") if name == "embedded" else ("pld",):
        try:
            _ms, res = step_ms(lm, ids, m)
            tok = [1000 * x.summary.wall_s / len(x.token_ids) for x in [res]]
            r[m] = {"tok_ms": tok[0], "tau": len(res.token_ids) / max(1, len(res.steps)),
                    "identical": res.token_ids == base.token_ids}
        except Exception as e:
            r[m] = repr(e)[:300]
    r["syncs"] = {m: syncs_per_token(lm, ids, m) for m in ("baseline", "pld")}
    r["launches"] = {m: launches_per_token(lm, ids, m) for m in ("baseline", "pld")}
    r["stats"] = fastpath.stats(lm.runner)
    if name == "embedded":
        r["sdpa"] = sdpa_backends(lm, ids)
    ref = weakref.ref(lm.model)
    del lm, base
    gc.collect()
    r["model_freed"] = ref() is None
    r["mem_before_mb"], r["mem_after_drop_mb"] = before / 2**20, mem() / 2**20
    return r


if __name__ == "__main__":
    main()
