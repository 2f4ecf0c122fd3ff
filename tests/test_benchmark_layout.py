"""The imports of benchmark/ and dev/, read from the source with `ast`: no import cycle among their modules, and no
module imports the command line (benchmark/run.py). Imports inside functions count: they close a cycle as surely when they run."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHMARK = ROOT / "benchmark"
DEV = ROOT / "dev"
ENTRY_POINT = "benchmark.run"


def module_names() -> dict[str, Path]:
    """Every module of the benchmark and dev packages by its dotted name (`dev.gpu.gpu_stages`; a package by its
    folder's name), leaving out folders that hold no code of its own (results, the peer's venv, work files)."""
    names = {}
    for path in sorted([*BENCHMARK.rglob("*.py"), *DEV.rglob("*.py")]):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if any(part.startswith(".") or part == "results" for part in parts):
            continue
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imported(name: str, path: Path, modules: set[str]) -> set[str]:
    """The benchmark modules that the module `name` at `path` imports, anywhere in its body."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package, one level up per extra dot
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)  # `from package import module`
    return {target for target in found if target in modules and target != name}


def import_graph() -> dict[str, set[str]]:
    """Module -> the benchmark modules it imports."""
    names = module_names()
    return {name: imported(name, path, set(names)) for name, path in names.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm): each is an import cycle."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_the_imports_it_must_see():
    # the reader itself: a module-level import, a lazy one inside a function, and `from package import module`
    graph = import_graph()
    assert "benchmark.common" in graph["benchmark.run"]
    assert "benchmark.pong_run" in graph["benchmark.run"]  # imported inside run_pong
    assert "dev.gpu.gpu_stages" in graph["dev.gpu.gpu_lease_note"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_benchmark_modules_import_no_cycle():
    found = cycles(import_graph())
    assert found == [], f"import cycles among benchmark modules: {found}"


def test_no_benchmark_module_imports_the_command_line():
    graph = import_graph()
    importers = sorted(name for name, targets in graph.items() if ENTRY_POINT in targets)
    assert importers == [], f"{ENTRY_POINT} is the command line; these import it: {importers}"
