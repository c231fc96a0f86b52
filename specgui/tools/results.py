"""Measured results as data: every figure the docs show is a JSON file under `results/<machine>/`, written by the
command that measured it, with its provenance.

Why: a figure typed into a README drifts from the code, loses the machine it was measured on, and cannot be checked.
Here a measuring command (`bench --save`, `presets --save`, `profile --save`, `gpucheck --save`, `suite-time --save`)
writes `results/<machine>/<kind>.json` holding `"provenance"` (the command, commit, date, device, library versions)
beside its data; `python -m specgui report` renders the tables into README.md and docs/ from those files
(`specgui/tools/report.py`), and `report --check` fails when a rendered table no longer matches its file.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

from specgui import REPO_DIR
from specgui.errors import SpecGUIError

RESULTS_DIR = REPO_DIR / "results"
KINDS = ("heldout", "presets", "profile", "gpucheck", "floors", "dispatch", "suite", "startup")
TEST_COMMAND = re.compile(r"<!-- test-command -->\s*```[^\n]*\n(?P<command>.*?)\n```", re.S)


def _git(*args: str, root: Path = REPO_DIR) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip()


def commit(root: Path = REPO_DIR) -> str | None:
    """HEAD's hash, with "-dirty" when tracked files that can move a figure differ from it (the figures then belong
    to no commit exactly); None outside a git checkout. Saved results and the Markdown they render into move none:
    a second measurement before the first is committed still belongs to HEAD. (README's test command, which
    `suite-time` runs, is Markdown too: the suite's result records the command it ran.)"""
    head = _git("rev-parse", "HEAD", root=root)
    if head is None:
        return None
    dirty = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)results", ":(exclude)*.md",
                 root=root)
    return head + ("-dirty" if dirty else "")


def device_name(device: str = "cpu") -> str:
    """What the figures were measured on, e.g. 'Intel(R) Xeon(R) Processor, 2 cores' or 'NVIDIA H100 80GB HBM3'."""
    if device.startswith("cuda"):
        import torch

        return torch.cuda.get_device_name(torch.device(device))
    from specgui.cpu.kernels import cpu_name

    return f"{cpu_name()}, {os.cpu_count()} cores"


def machine_slug(device: str = "cpu") -> str:
    """The folder a machine's results go to: 'cpu-' or 'gpu-' and the device's name in lower-case words, e.g.
    'cpu-intel-xeon-processor-2c' (a machine of another model or core count gets a folder of its own)."""
    name = device_name(device)
    words = re.sub(r"\((r|tm)\)|cpu|@.*|\d+ cores", " ", name.lower())
    slug = "-".join(re.findall(r"[a-z0-9]+", words))[:40].strip("-")
    if device.startswith("cuda"):
        return f"gpu-{slug}"
    forced = simd_forced()
    return f"cpu-{slug}-{os.cpu_count()}c" + (f"-{forced}" if forced else "")


def simd_forced() -> str | None:
    """The skinny kernels' vector form where `SPECGUI_SIMD` forces one this CPU does not pick by itself (e.g. "avx2"
    on an AVX-512 machine), else None. Such a run measures another machine's kernels: its results go to a folder of
    their own (`machine_slug`: 'cpu-intel-xeon-processor-2c-avx2') and never stand for the machine's own figures."""
    from specgui.cpu import kernels

    form = kernels.simd()
    return form if form is not None and form != kernels.best_simd() else None


def provenance(device: str = "cpu", argv: list[str] | None = None) -> dict[str, Any]:
    """Where a result comes from: the command as typed, the commit, the UTC date, the device, the versions."""
    import torch
    import transformers

    args = sys.argv[1:] if argv is None else argv
    forced = None if device.startswith("cuda") else simd_forced()
    return {
        "command": ("" if forced is None else f"SPECGUI_SIMD={forced} ") + "python -m specgui " + " ".join(args),
        "commit": commit(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": device_name(device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        **({} if device.startswith("cuda") else {"simd": simd_label(), "simd_forced": forced is not None}),
    }


def simd_label() -> str:
    """The skinny kernels' form a CPU result was measured with ("avx2+fma", "avx512", or why none ran)."""
    from specgui.cpu import kernels

    return kernels.simd_label()


def measured_at(data: dict[str, Any]) -> datetime.datetime:
    """When a result was measured, from its provenance: an ISO date (older files wrote '2026-11-26 19:27 UTC');
    the earliest date possible where none is given, so that any dated result is newer."""
    text = data.get("provenance", {}).get("date") or ""
    try:
        return datetime.datetime.fromisoformat(text.replace(" UTC", "+00:00"))
    except ValueError:
        return datetime.datetime.min.replace(tzinfo=datetime.UTC)


def writable(json_path: str | None) -> None:
    """Refuse a `--json` path whose folder is missing before anything is measured (not after an hour's bench)."""
    if json_path and not Path(json_path).resolve().parent.is_dir():
        raise SpecGUIError(f"cannot write results: folder {str(Path(json_path).resolve().parent)!r} does not exist")


def write(kind: str, data: dict[str, Any], device: str, json_path: str | None, standard: bool) -> None:
    """A measuring command's output: `data` to `json_path` (its `--json`) and, with `standard` (its `--save`), to
    this machine's `results/<machine>/<kind>.json`, where `python -m specgui report` finds it."""
    if json_path:
        _dump(Path(json_path), data)
    if standard:
        print(f"saved {save(kind, data, device)}")


def path_for(kind: str, device: str = "cpu") -> Path:
    """`results/<machine>/<kind>.json` for this machine."""
    if kind not in KINDS:
        raise ValueError(f"unknown result kind {kind!r}")
    return RESULTS_DIR / machine_slug(device) / f"{kind}.json"


def save(kind: str, data: dict[str, Any], device: str = "cpu") -> Path:
    """Write `data` (which holds its "provenance") as this machine's result of `kind`; returns the path."""
    if "provenance" not in data:
        raise ValueError("a result needs its provenance")
    path = path_for(kind, device)
    path.parent.mkdir(parents=True, exist_ok=True)
    _dump(path, data)
    return path


def _dump(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=1, default=str) + "\n", encoding="utf-8")


def suite_command(readme: Path = REPO_DIR / "README.md") -> list[str]:
    """The pytest part of README's test command (the block after `<!-- test-command -->` that `.ci/run` runs), with
    this interpreter: the suite time recorded is that of the command CI runs, not of a variant of it."""
    found = TEST_COMMAND.search(readme.read_text(encoding="utf-8")) if readme.is_file() else None
    steps = found["command"].replace("\\\n", " ").split("&&") if found else []
    pytest = next((shlex.split(step) for step in steps if "-m pytest" in step), None)
    if pytest is None:
        raise SpecGUIError(f"{readme} has no pytest command in the block after <!-- test-command -->")
    return [sys.executable, *pytest[1:]]


def suite_counts(output: str) -> dict[str, int]:
    """passed/failed/skipped/errors from pytest's closing line (e.g. '650 passed, 19 skipped in 402.57s')."""
    closing = output.strip().splitlines()[-1] if output.strip() else ""
    found = {word.rstrip("s"): int(n) for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)", closing)}
    return {"passed": found.get("passed", 0), "failed": found.get("failed", 0), "skipped": found.get("skipped", 0),
            "errors": found.get("error", 0)}
