"""Build Self-Draft's corpus cache: frequent n-grams of a model's own outputs, stored per tokenizer.

The paper counts n-grams of a 14M-word general corpus (OANC). No corpus can be fetched here, so the cache
is built from text the project produces itself: the model's greedy answers to a broad prompt set written
for this purpose (`assets/corpus/prompts.jsonl`: code, questions, arithmetic, translation, summaries,
advice, cited answers; deliberately not the benchmark suite's prompts). A model's own phrasing is also
what its verifier accepts, which a general corpus only approximates. Two steps, each resumable:

    python -m specgui.tools.corpus generate --out assets/corpus/smollm2-outputs.jsonl [--budget-s 400]
    python -m specgui.tools.corpus build --texts assets/corpus/smollm2-outputs.jsonl --name smollm2

`generate` decodes greedily in batches with transformers' `generate` (a batch of 8 costs a CPU little more
than one sequence), appends one JSON line per prompt, skips prompts already done and stops after
`--budget-s` seconds, so a long build runs in short chunks. `build` counts, for every key of 1..max_key
tokens, the `gram`-token continuations that follow it, keeps the `per_key` most frequent seen at least
`min_count` times, and writes `assets/corpus/<name>.npz`. For another model, run both with `--model` and
a new name, and point the model's preset in configs/selfdraft.yaml at it (`corpus: <name>`).
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch

from specgui.cli import Parser, add_model_args, load_model
from specgui.errors import SpecGUIError
from specgui.methods.ngram.ngram_cache import CORPUS_DIR, CorpusCache
from specgui.tools.prompts import load_prompts

BATCH = 8


def read_outputs(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def generate(lm, prompts_path: Path, out: Path, max_new_tokens: int, budget_s: float) -> int:
    """Append greedy outputs for the prompts not yet in `out`; return how many were written."""
    done = {row["id"] for row in read_outputs(out)}
    rows = [r for r in load_prompts(prompts_path) if r.id not in done]
    encoded = sorted(((r, r.encode(lm.tokenizer)) for r in rows), key=lambda x: len(x[1]))  # less padding
    pad = lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else min(lm.stop_ids)
    start, written = time.perf_counter(), 0
    for b in range(0, len(encoded), BATCH):
        if time.perf_counter() - start > budget_s:
            break
        batch = encoded[b : b + BATCH]
        width = max(len(ids) for _, ids in batch)
        inputs = torch.tensor([[pad] * (width - len(ids)) + ids for _, ids in batch])  # left padding
        mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for _, ids in batch])
        with torch.inference_mode():
            out_ids = lm.model.generate(inputs.to(lm.device), attention_mask=mask.to(lm.device), do_sample=False,
                                        max_new_tokens=max_new_tokens, pad_token_id=pad,
                                        eos_token_id=sorted(lm.stop_ids))
        with out.open("a", encoding="utf-8") as f:
            for (row, _), seq in zip(batch, out_ids[:, width:].tolist()):
                ids = next((seq[:i] for i, t in enumerate(seq) if t in lm.stop_ids), seq)
                text = lm.tokenizer.decode(ids, skip_special_tokens=True)
                f.write(json.dumps({"id": row.id, "category": row.category, "ids": ids, "text": text},
                                   ensure_ascii=False) + "\n")
                written += 1
        print(f"{len(done) + written}/{len(done) + len(rows)} prompts", file=sys.stderr)
    return written


def count_ngrams(texts: list[list[int]], max_key: int, gram: int) -> dict[tuple[int, ...], Counter]:
    """key (1..max_key tokens) -> Counter of the full `gram`-token continuations that follow it."""
    table: dict[tuple[int, ...], Counter] = defaultdict(Counter)
    for ids in texts:
        for e in range(len(ids) - gram):
            follow = tuple(ids[e + 1 : e + 1 + gram])
            for k in range(1, min(max_key, e + 1) + 1):
                table[tuple(ids[e - k + 1 : e + 1])][follow] += 1
    return table


def build(texts: list[list[int]], meta: dict, per_key: int, min_count: int) -> CorpusCache:
    """The corpus cache: per key the `per_key` most frequent continuations seen `min_count`+ times."""
    table = count_ngrams(texts, int(meta["max_key"]), int(meta["gram"]))
    rows = []
    for key in sorted(table, key=lambda k: (len(k), k)):
        best = [(g, n) for g, n in table[key].most_common(per_key) if n >= min_count]
        rows.extend((key, g) for g, _ in best)
    return CorpusCache({**meta, "per_key": per_key, "min_count": min_count,
                        "tokens": sum(len(t) for t in texts), "texts": len(texts)}, rows)


def main(argv: list[str] | None = None) -> int:
    parser = Parser(prog="python -m specgui.tools.corpus", description="Build a Self-Draft corpus cache.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    gen = sub.add_parser("generate", help="append the model's greedy outputs for a prompt set")
    gen.add_argument("--prompts", default=str(CORPUS_DIR / "prompts.jsonl"))
    gen.add_argument("--out", required=True, metavar="OUTPUTS.jsonl")
    gen.add_argument("--max-new-tokens", type=int, default=160)
    gen.add_argument("--budget-s", type=float, default=400.0, help="stop starting new batches after this long")
    add_model_args(gen)
    make = sub.add_parser("build", help="count n-grams of generated outputs into assets/corpus/<name>.npz")
    make.add_argument("--texts", required=True, metavar="OUTPUTS.jsonl")
    make.add_argument("--name", required=True)
    make.add_argument("--max-key", type=int, default=4)
    make.add_argument("--gram", type=int, default=4)
    make.add_argument("--per-key", type=int, default=4)
    make.add_argument("--min-count", type=int, default=2)
    add_model_args(make)
    try:
        args = parser.parse_args(argv)
        lm = load_model(args)
        if args.command == "generate":
            written = generate(lm, Path(args.prompts), Path(args.out), args.max_new_tokens, args.budget_s)
            print(f"wrote {written} outputs to {args.out}")
            return 0
        texts = [row["ids"] for row in read_outputs(Path(args.texts))]
        if not texts:
            raise SpecGUIError(f"no outputs in {args.texts!r}: run `python -m specgui.tools.corpus generate` "
                               "first")
        meta = {"model": lm.name, "vocab_size": int(lm.model.config.vocab_size), "max_key": args.max_key,
                "gram": args.gram, "source": Path(args.texts).name}
        corpus = build(texts, meta, args.per_key, args.min_count)
        path = CORPUS_DIR / f"{args.name}.npz"
        corpus.save(path)
        print(f"{path}: {len(corpus)} n-grams under {len(corpus.table)} keys from {corpus.meta['tokens']} tokens "
              f"of {len(texts)} outputs, {path.stat().st_size / 1024:.0f} KiB")
    except SpecGUIError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
