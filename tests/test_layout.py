"""The package's layout: every module imports on its own, in a fresh interpreter (no import cycles, no
module that only works after another one happened to be imported first)."""

import pkgutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import specgui

ROOT = Path(__file__).resolve().parent.parent


def all_modules() -> list[str]:
    found = ["specgui"]
    for info in pkgutil.walk_packages(specgui.__path__, prefix="specgui."):
        if info.name != "specgui.__main__":  # runs the CLI on import, by design
            found.append(info.name)
    return found


def import_alone(name: str) -> tuple[str, str]:
    done = subprocess.run([sys.executable, "-c", f"import {name}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    return name, done.stderr.strip().splitlines()[-1] if done.returncode else ""


def test_every_module_imports_alone_in_a_fresh_interpreter():
    names = all_modules()
    assert {"specgui.methods.layerskip", "specgui.methods.skipdp", "specgui.methods.compress",
            "specgui.methods.ngram_cache", "specgui.ui.page"} <= set(names)
    with ThreadPoolExecutor(max_workers=2) as pool:
        failures = [f"{name}: {error}" for name, error in pool.map(import_alone, names) if error]
    assert not failures, "\n".join(failures)


def test_the_top_level_holds_the_core_and_front_ends_only():
    """Parts only methods use live in specgui/methods/, beside the methods."""
    top = {p.stem for p in (ROOT / "specgui").glob("*.py")}
    assert not top & {"layerskip", "skipdp", "compress", "ngram_cache"}
