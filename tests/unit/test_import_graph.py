"""strata's imports: no circles (STYLE 16), no import from a lower layer up to a higher one (the
table below, as docs/ARCHITECTURE.md's "Layers" describes it), and every module imports on its own.

The graph is read from the source with `ast`: every import counts, at module level, inside a
function or under `TYPE_CHECKING`, since a circle hidden in a function is still a circle. Relative
imports are resolved, and `from pkg import name` is an arrow to `pkg.name` when that is a module.
The implicit import of a module's own parent packages is not an arrow.
"""

from __future__ import annotations

import ast
import itertools
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "strata"

# Each part of strata and its layer: a module may import its own layer and the ones below, never
# one above. Keys are the names after "strata." (a package or a module; the longest that matches a
# module wins); "" is strata/__init__.py. A new top-level module or package needs a line here.
LAYERS = {
    # configuration, request and output types, tokenizer, native kernels, leaf utilities
    **dict.fromkeys(
        ("config", "model_config", "rope_config", "moe_config", "mla_config"), 0
    ),
    **dict.fromkeys(("dsv4_config", "engram_config"), 0),
    **dict.fromkeys(("sampling_params", "grammar", "tokenizer"), 0),
    **dict.fromkeys(("redact", "process", "ports", "kernels", "web"), 0),
    "cache": 1,  # KV pools, page allocators, prefix caches, the L2/L3 tiers
    "layers": 2,  # torch modules (latent and DeepSeek-V4 attention read their KV pools)
    "models": 3,  # the families, built of layers, each with its spec
    "weights": 4,  # checkpoints into a family's model (its spec names its weights), GGUF
    "distributed": 5,  # rank 0 and its workers, over models and KV pools; no scheduler
    "engine": 6,  # the scheduler and its parts
    "disagg": 7,  # a scheduler plug-in (engine.hooks.KVTransferPeer) that reads requests
    # `Engine` assembles the scheduler with its PD peer and parallel runtime; `strata.Engine`
    "engine.engine": 8,
    "": 8,
    "server": 9,  # the frontend and the engine process
    "bench": 9,
    "router": 10,  # serves the server's OpenAPI schema, launches its replicas
    "drafting": 10,  # `strata spec train`: engines, the bench's prompt makers, its held-out check
    "plan": 11,
    "offline_batch": 11,  # `strata batch`: a server of its own (bench's process helper, router's flags)  # the router's own policies in simulation, bench's datasets
    "cli": 12,
}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


@cache
def import_graph() -> dict[str, dict[str, str]]:
    """module -> {imported strata module: where (line, and whether inside a function)}."""
    mods = modules()
    graph: dict[str, dict[str, str]] = {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        in_function = {
            id(node)
            for fn in ast.walk(tree)
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
            for node in ast.walk(fn)
        }
        arrows: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([node.module] if node.module else []))
                targets = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base
                    for alias in node.names
                ]
            else:
                continue
            for target in targets:
                while target not in mods and "." in target:
                    target = target.rpartition(".")[0]  # a name inside the module
                if target in mods and target != name and target not in arrows:
                    where = "in a function" if id(node) in in_function else "at import"
                    arrows[target] = f"line {node.lineno}, {where}"
        graph[name] = arrows
    return graph


def circles(graph: dict[str, dict[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def describe_circle(graph: dict[str, dict[str, str]], component: list[str]) -> str:
    """One circle through the component's first module, each arrow with where it is."""
    members = set(component)
    start = component[0]
    paths = {start: [start]}
    queue = [start]
    while queue:
        node = queue.pop(0)
        for child in graph[node]:
            if child == start:
                path = [*paths[node], start]
                return (
                    " -> ".join(
                        f"{a} ({graph[a][b]})" for a, b in itertools.pairwise(path)
                    )
                    + f" -> {start}"
                )
            if child in members and child not in paths:
                paths[child] = [*paths[node], child]
                queue.append(child)
    raise AssertionError(f"no circle through {start}")


def layer(module: str) -> int:
    rest = module.split(".")[1:]
    for n in range(len(rest), -1, -1):
        key = ".".join(rest[:n])
        if key in LAYERS:
            return LAYERS[key]
    raise KeyError(module)


def test_the_graph_sees_every_kind_of_import():
    graph = import_graph()
    assert "strata.engine.engine" in graph["strata"]  # under TYPE_CHECKING
    assert (
        "strata.cache.storage.mooncake" in graph["strata.cache.storage"]
    )  # in a function
    assert (
        "strata.disagg.protocol" in graph["strata.disagg.manager"]
    )  # from pkg import module


def test_no_import_circles():
    graph = import_graph()
    found = [describe_circle(graph, component) for component in circles(graph)]
    assert not found, (
        "import circles (move what both sides need down into a third module):\n"
        + "\n".join(found)
    )


def test_every_module_has_a_layer():
    missing = [m for m in modules() if not _has_layer(m)]
    assert not missing, f"add these to LAYERS: {missing}"


def _has_layer(module: str) -> bool:
    try:
        layer(module)
    except KeyError:
        return False
    return True


def test_no_import_points_up_a_layer():
    graph = import_graph()
    upward = [
        f"{a} (layer {layer(a)}) -> {b} (layer {layer(b)}), {where}"
        for a, arrows in graph.items()
        if _has_layer(a)
        for b, where in arrows.items()
        if _has_layer(b) and layer(b) > layer(a)
    ]
    assert not upward, "imports up a layer:\n" + "\n".join(upward)


# Imports each module named on the command line with no other strata module loaded (the ones
# before it are dropped from sys.modules; third-party modules stay, which keeps this fast). A
# missing third-party module (an optional dependency) skips the module.
_IMPORT_EACH = """
import importlib, sys, traceback
failed = []
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m == "strata" or m.startswith("strata.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name is None or exc.name.split(".")[0] == "strata":
            failed.append(name + ": " + traceback.format_exc(limit=-4))
        else:
            print(f"skipped {name}: needs {exc.name}")
    except Exception:
        failed.append(name + ": " + traceback.format_exc(limit=-4))
print("\\n".join(failed), file=sys.stderr)
sys.exit(1 if failed else 0)
"""


def test_every_module_imports_on_its_own():
    names = list(modules())
    # two processes (each imports torch and the other third-party modules once)
    batches = [names[0::2], names[1::2]]

    def run(batch: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", _IMPORT_EACH, *batch],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=300,
        )

    with ThreadPoolExecutor(len(batches)) as pool:
        results = list(pool.map(run, batches))
    errors = [r.stderr for r in results if r.returncode != 0]
    assert not errors, "modules that do not import on their own:\n" + "\n".join(errors)
