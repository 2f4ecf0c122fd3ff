"""The layout of benchmark/ and dev/, read from the source with `ast` and from the READMEs:

- no import cycle among their modules, and no module imports the command line (benchmark/run.py); imports inside
  functions count: they close a cycle as surely when they run;
- benchmark/ imports nothing from dev/ (the GPU-lease tools build on the benchmark, not the other way round), and
  its top imports nothing from investigations/;
- every module at the top of benchmark/ is what a user runs (a command the READMEs or docs name) or is used by one
  (imported, or started by its file's name), so that nothing there serves only tests, investigations or dev/;
- every `benchmark/...` or `dev/...` script that a README, a doc, a module or a test names exists, and each folder's
  README lists its files."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCHMARK = ROOT / "benchmark"
DEV = ROOT / "dev"
INVESTIGATIONS = BENCHMARK / "investigations"
ENTRY_POINT = "benchmark.run"
# where commands are documented: what a user reads
DOCUMENTS = (ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), BENCHMARK / "README.md")
# what names a script by its path (commands, module docstrings, tests); committed results are history, left out
PATH_NAMED = re.compile(r"\b((?:benchmark|dev)/[\w./-]+\.(?:py|sh))\b")
COMMAND = re.compile(r"\b(?:python3?|bash)\s+((?:benchmark|dev)/[\w./-]+\.(?:py|sh))\b")


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
    """The benchmark and dev modules that the module `name` at `path` imports, anywhere in its body."""
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
    """Module -> the benchmark and dev modules it imports."""
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


def started_by_name(path: Path) -> set[str]:
    """The file names (`ours_dreamer.py`) that a module's code holds as strings, outside docstrings: the scripts it
    starts in a process of their own (`BENCH_DIR / "ours_dreamer.py"`)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
    }
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            found.update(re.findall(r"([\w-]+\.(?:py|sh))\b", node.value))
    return found


def top_modules() -> dict[str, Path]:
    """The modules at the top of benchmark/ (not its package file), by dotted name."""
    return {
        name: path
        for name, path in module_names().items()
        if path.parent == BENCHMARK and path.name != "__init__.py"
    }


def documented_commands() -> set[Path]:
    """The scripts that the READMEs and docs tell a user to run (`python benchmark/learning_proof.py ...`)."""
    return {ROOT / found for doc in DOCUMENTS for found in COMMAND.findall(doc.read_text())}


def used_from(roots: set[Path]) -> set[Path]:
    """The top modules of benchmark/ that the commands `roots` use: themselves, what they import, what they start by
    its file's name, and so on."""
    top = top_modules()
    graph = import_graph()
    by_name = {name: path for name, path in top.items()}
    by_file = {path.name: path for path in top.values()}
    name_of = {path: name for name, path in top.items()}
    seen, todo = set(), [path for path in roots if path in name_of]
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        seen.add(path)
        todo += [by_name[target] for target in graph[name_of[path]] if target in by_name]
        todo += [by_file[file] for file in started_by_name(path) if file in by_file]
    return seen


def test_the_graph_sees_the_imports_it_must_see():
    # the reader itself: a module-level import, a lazy one inside a function, and `from package import module`
    graph = import_graph()
    assert "benchmark.common" in graph["benchmark.run"]
    assert "benchmark.pong_run" in graph["benchmark.run"]  # imported inside run_pong
    assert "dev.gpu.gpu_stages" in graph["dev.gpu.gpu_lease_note"]
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    # and the files a module starts by name
    assert "ours_dreamer.py" in started_by_name(BENCHMARK / "run.py")


def test_benchmark_modules_import_no_cycle():
    found = cycles(import_graph())
    assert found == [], f"import cycles among benchmark and dev modules: {found}"


def test_no_benchmark_module_imports_the_command_line():
    graph = import_graph()
    importers = sorted(name for name, targets in graph.items() if ENTRY_POINT in targets)
    assert importers == [], f"{ENTRY_POINT} is the command line; these import it: {importers}"


def test_benchmark_imports_nothing_from_dev_and_its_top_nothing_from_investigations():
    graph = import_graph()
    wrong = sorted(
        f"{name} -> {target}"
        for name, targets in graph.items()
        if name.startswith("benchmark")
        for target in targets
        if target.startswith("dev")
        or (target.startswith("benchmark.investigations") and name in top_modules())
    )
    assert wrong == [], f"benchmark/ builds on neither dev/ nor its investigations: {wrong}"


def test_every_module_at_the_top_of_benchmark_is_run_by_a_user_or_used_by_what_is():
    commands = documented_commands()
    assert BENCHMARK / "run.py" in commands and BENCHMARK / "learning_proof.py" in commands
    unused = sorted(path.name for path in set(top_modules().values()) - used_from(commands))
    assert unused == [], (
        f"no documented command uses these, at the top of benchmark/: {unused}. A one-off goes to "
        "benchmark/investigations/, a development tool to dev/; a command of its own gets its line in a README"
    )


def test_every_script_named_by_path_exists():
    texts = [
        path
        for path in [*ROOT.glob("*.md"), *ROOT.glob("*.py"), *(ROOT / "docs").glob("*.md")]
        + [*BENCHMARK.rglob("*"), *DEV.rglob("*"), *(ROOT / "tests").rglob("*.py"), ROOT / ".ci" / "run"]
        if path.is_file()
        and path.suffix in (".md", ".py", ".sh", "")
        and not {"results", "__pycache__"} & set(path.relative_to(ROOT).parts)
        and not any(part.startswith(".") for part in path.relative_to(ROOT).parts[:-1])
    ]
    missing = sorted(
        f"{path.relative_to(ROOT)}: {named}"
        for path in texts
        for named in PATH_NAMED.findall(path.read_text(errors="replace"))
        if not (ROOT / named).is_file()
    )
    assert missing == [], f"these name scripts that do not exist: {missing}"


def test_each_folder_readme_lists_its_files():
    for folder, readme in ((INVESTIGATIONS, "README.md"), (DEV / "gpu", "../README.md")):
        text = (folder / readme).read_text()
        files = sorted(
            p.name for p in folder.iterdir() if p.suffix in (".py", ".sh") and p.name != "__init__.py"
        )
        unlisted = [name for name in files if f"| `{name}` |" not in text]
        assert files and unlisted == [], (
            f"{folder.relative_to(ROOT)}: {unlisted} missing from its README's table"
        )
