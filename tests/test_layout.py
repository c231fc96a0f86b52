"""The package's layout: every module imports on its own, in a fresh interpreter (no import cycles, no
module that only works after another one happened to be imported first)."""

import ast
import importlib.util
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import specgui

ROOT = Path(__file__).resolve().parent.parent


def all_modules() -> list[str]:
    found = ["specgui"]
    for info in pkgutil.walk_packages(specgui.__path__, prefix="specgui."):
        if info.name != "specgui.__main__":  # runs the CLI on import, by design
            found.append(info.name)
    return found


# Runs in one fresh interpreter: imports what specgui's modules import from third-party packages (never a specgui
# module), then forks a child per specgui module that imports just that one and reports the last line of any error.
IMPORT_EACH = """
import importlib, json, os, sys, traceback
names, third_party = json.loads(sys.argv[1]), json.loads(sys.argv[2])
for module, attributes in third_party:
    try:  # a failure here is the child's to report, with the specgui module that met it
        loaded = importlib.import_module(module)
        for attribute in attributes:
            getattr(loaded, attribute, None)  # a lazy package (transformers) imports the submodule behind a name
    except Exception:
        pass
assert not [m for m in sys.modules if m == "specgui" or m.startswith("specgui.")]
results = {}
for name in names:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            importlib.import_module(name)
            message = ""
        except BaseException:
            message = traceback.format_exc().strip().splitlines()[-1]
        os.write(write, message.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        message = pipe.read().decode()
    _, status = os.waitpid(pid, 0)
    results[name] = message or ("" if status == 0 else f"child exited with status {status}")
print(json.dumps(results))
"""


def third_party_imports() -> list[tuple[str, list[str]]]:
    """What specgui's modules import from outside specgui and the standard library: [(module, names taken from
    it)], e.g. ("transformers.integrations.sdpa_attention", ["sdpa_attention_forward"]). The test's parent
    loads all of it, submodules and lazy names included: importing only the top-level packages left each child
    ~1 s of transformers' lazily loaded submodules, 50 s in all."""
    found: dict[str, set[str]] = {}
    for path in (ROOT / "specgui").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    found.setdefault(alias.name, set())
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                found.setdefault(node.module, set()).update(alias.name for alias in node.names)
    return sorted((module, sorted(names)) for module, names in found.items()
                  if _top(module) not in {"specgui", "__future__", *sys.stdlib_module_names}
                  and importlib.util.find_spec(_top(module)) is not None)


def _top(module: str) -> str:
    return module.partition(".")[0]


def test_every_module_imports_alone_in_a_fresh_interpreter():
    """Each specgui module imports with no other specgui module loaded before it (no import circle, no module
    that works only after another happened to be imported first).

    One fresh interpreter imports what specgui takes from third-party packages first and forks a child per
    module: importing torch, transformers and gradio once instead of ~45 times takes the test to seconds. That
    preload cannot hide what the test looks for: the order of specgui's own imports, which every child starts
    without (the parent asserts no specgui module is loaded before it forks)."""
    names = all_modules()
    assert {"specgui.methods.layerskip.drafting", "specgui.methods.layerskip.skipdp",
            "specgui.methods.fractal.compress", "specgui.methods.ngram.ngram_cache", "specgui.ui.page"} <= set(names)
    third_party = third_party_imports()
    assert {"torch", "transformers", "gradio"} <= {_top(module) for module, _ in third_party}
    done = subprocess.run([sys.executable, "-c", IMPORT_EACH, json.dumps(names), json.dumps(third_party)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    assert list(results) == names
    failures = [f"{name}: {error}" for name, error in results.items() if error]
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
    assert "specgui.costs" in graph["specgui.core.decode"] and "specgui.methods.ngram.pld" in graph["specgui.methods"]
    assert "specgui.costs" in graph["specgui.methods.base"]
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


def test_the_cycle_finder_finds_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
