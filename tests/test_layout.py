"""The package's layout: every module imports on its own, in a fresh interpreter (no import cycles, no
module that only works after another one happened to be imported first)."""

import ast
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


def import_graph() -> dict[str, set[str]]:
    """specgui's modules and the specgui modules each imports, at module level or inside functions (ast, so an
    import deferred into a function to dodge a circle still counts). `importlib.import_module` in a package's
    `__init__` (the method registry) counts as importing every module of the package."""
    package = ROOT / "specgui"
    names = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {name: set() for name in names}
    for name, path in names.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    here = name.split(".") if is_package else name.split(".")[:-1]
                    base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in names else base for alias in node.names]
            elif (is_package and isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr == "import_module"):
                targets = [other for other in names if other.startswith(name + ".")]
            graph[name] |= {t for t in targets if t in names and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a list of modules (first == last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start)):
            return found
    return None


def test_the_import_graph_has_no_circle():
    graph = import_graph()
    # the walk sees the edges that matter: the loop imports the cost model, the registry its methods
    assert "specgui.costs" in graph["specgui.decode"] and "specgui.methods.pld" in graph["specgui.methods"]
    assert "specgui.costs" in graph["specgui.methods.base"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
