"""dqn_starcraft_split.py reads top to bottom as a CleanRL script does, in three parts, each opened by a banner that
names it: the algorithm (the settings, the environment, the replay, the networks, the TD target and the update,
acting, the loop; after them what each setting allows and, in a section of their own, the minigames), speed, and the
run. Part 1 names nothing a later part defines, no function is longer than 80 lines, the map defaults are filled in
one place, and Part 1 is what trains: a change to its `update` takes effect with --amp off and --amp bf16, the paths
a CPU runs (tests/test_dqn_cuda.py runs the same check with fp16 on CUDA)."""

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

import dqn_starcraft_split as dqn
from dqn_tiny import run_with_a_changed_update, updates_of_a_run

SOURCE = Path(dqn.__file__).read_text()
PART_BANNERS = ("# Part 1: the algorithm", "# Part 2: speed", "# Part 3: the run")
# Every section banner of the file, in reading order: Part 1's sections (the DQN first, then what a reader needs only
# to change a setting's rule or a map), then Part 2 and Part 3.
SECTIONS = (
    "# Part 1: the algorithm",
    "# Environment: what the agent sees",
    "# Replay buffer",
    "# Networks",
    "# The TD target, the loss, the update",
    "# Acting:",
    "# The training loop",
    "# What each setting allows",
    "# The minigames:",
    "# Part 2: speed",
    "# Part 3: the run",
)
# Where the definitions a reader looks for stand: the section whose banner comes last above them.
HOMES = {
    "Args": "# Part 1: the algorithm",
    "MAP_DEFAULTS": "# Part 1: the algorithm",
    "with_map_defaults": "# Part 1: the algorithm",
    "HEADS": "# Environment: what the agent sees",
    "make_env": "# Environment: what the agent sees",
    "SplitReplayBuffer": "# Replay buffer",
    "SplitQNetwork": "# Networks",
    "td_target": "# The TD target, the loss, the update",
    "update": "# The TD target, the loss, the update",
    "select_action": "# Acting:",
    "build_agent": "# The training loop",
    "train_one_seed": "# The training loop",
    "RULES": "# What each setting allows",
    "BuiltinMiniGame": "# The minigames:",
    "Pysc2MiniGame": "# The minigames:",
    "speed_up": "# Part 2: speed",
    "main": "# Part 3: the run",
}
MAX_FUNCTION_LINES = 80


def section_starts(source: str) -> dict[str, int]:
    """The line (0-based) of each banner of SECTIONS; fails unless each stands once, at the start of a line."""
    lines = source.splitlines()
    starts = {}
    for banner in SECTIONS:
        found = [i for i, line in enumerate(lines) if line.startswith(banner)]
        assert len(found) == 1, f"the banner {banner!r} stands {len(found)} times, not once"
        starts[banner] = found[0]
    return starts


def parts(source: str) -> list[str]:
    """The text of Part 1 (from its banner), Part 2 and Part 3, each from its banner to the next."""
    lines = source.splitlines(keepends=True)
    starts = [section_starts(source)[banner] for banner in PART_BANNERS]
    return ["".join(lines[a:b]) for a, b in zip(starts, [*starts[1:], len(lines)], strict=True)]


def names_of(node: ast.stmt) -> set[str]:
    """The names one module-level statement defines: a function, a class, an assignment's targets, imports."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {node.name}
    if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        return {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    return set()


def defined_names(part: str) -> set[str]:
    """The names a part defines at module level."""
    return {name for node in ast.parse(part).body for name in names_of(node)}


def names_in_prose(text: str) -> set[str]:
    """The names a comment or docstring gives: in backticks, and words that can only be identifiers (with an
    underscore, ALL CAPS, or CamelCase), so that an English word such as "close" is not read as a name."""
    quoted = {word for span in re.findall(r"`([^`]*)`", text) for word in re.findall(r"[A-Za-z_]\w*", span)}
    words = set(re.findall(r"[A-Za-z_]\w*", text))
    identifiers = {
        w for w in words if "_" in w or (len(w) > 1 and w.isupper()) or re.search(r"[a-z][A-Z]", w)
    }
    return quoted | identifiers


def named_in(part: str) -> set[str]:
    """Every name a part's code refers to (not attributes: `run.evaluate` is the run's), and every name its comments
    and strings give."""
    code = {node.id for node in ast.walk(ast.parse(part)) if isinstance(node, ast.Name)}
    prose = set()
    for token in tokenize.generate_tokens(io.StringIO(part).readline):
        if token.type in (tokenize.COMMENT, tokenize.STRING):
            prose |= names_in_prose(token.string)
    return code | prose


def test_the_sections_stand_in_reading_order_with_the_minigames_after_the_algorithm():
    starts = section_starts(SOURCE)
    order = sorted(SECTIONS, key=starts.get)
    assert order == list(SECTIONS), f"the sections stand in this order: {order}"
    defined_at = {
        name: node.lineno - 1 for node in ast.parse(SOURCE).body for name in names_of(node) & set(HOMES)
    }
    assert set(defined_at) == set(HOMES), f"not defined at module level: {set(HOMES) - set(defined_at)}"
    for name, line in defined_at.items():
        home = max((banner for banner in SECTIONS if starts[banner] < line), key=starts.get)
        assert home == HOMES[name], f"{name} stands in the section {home!r}, not {HOMES[name]!r}"


def test_no_function_is_longer_than_80_lines():
    """Every function and method, its `def` line to its last line (a nested function counts in its own right and
    in the function around it)."""
    long = [
        f"{node.name} (line {node.lineno}): {node.end_lineno - node.lineno + 1} lines"
        for node in ast.walk(ast.parse(SOURCE))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, f"longer than {MAX_FUNCTION_LINES} lines: {'; '.join(long)}"


def test_part_1_names_nothing_that_part_2_or_part_3_defines():
    """In code, comments and docstrings: Part 1 reads, and runs, without the later parts; the loop reaches the run's
    plumbing only through the `run` it is handed."""
    algorithm, speed, run = parts(SOURCE)
    later = defined_names(speed) | defined_names(run)
    assert {"speed_up", "Run", "set_up", "RunInterrupted", "log_update", "evaluate", "main"} <= later
    named = named_in(algorithm) & later
    assert not named, f"Part 1 names what a later part defines: {sorted(named)}"


def test_part_2_is_installed_by_one_call_from_the_run():
    def calls(part: str) -> int:
        return sum(
            isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "speed_up"
            for node in ast.walk(ast.parse(part))
        )

    algorithm, speed, run = parts(SOURCE)
    assert (calls(algorithm), calls(speed), calls(run)) == (0, 0, 1), (
        "speed_up is called once, when a run is set up"
    )


def functions_naming(source: str, name: str) -> set[str]:
    """The module-level functions, and the methods, whose bodies (not their default arguments) name `name`."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            body = ast.Module(body=node.body, type_ignores=[])
            if any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(body)):
                found.add(node.name)
    return found


def test_the_map_defaults_are_filled_in_one_place():
    """`with_map_defaults` alone reads MAP_DEFAULTS, and it is called by `main` (every run's settings, before
    anything reads them) and by `make_q_network` (a network made on its own) alone."""
    assert functions_naming(SOURCE, "MAP_DEFAULTS") == {"with_map_defaults"}
    assert functions_naming(SOURCE, "with_map_defaults") == {"main", "make_q_network"}


@pytest.mark.slow
@pytest.mark.parametrize("amp", ["off", "bf16"])
def test_a_change_to_part_1s_update_trains_with_every_precision_a_cpu_runs(tmp_path, amp):
    """A copy whose `update` adds a Q-value penalty (and prints a line each time it runs): every update of a tiny
    run runs the change, and the logged TD loss carries it, with --amp off and with --amp bf16. (With a second copy
    of the update for mixed precision, bf16 ran it 0 times.)"""
    run = run_with_a_changed_update(tmp_path, amp)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.changed_updates == updates_of_a_run() + 1  # and once in the preallocation's update, undone
    assert len(run.td_losses) == updates_of_a_run() and min(run.td_losses) >= 1000.0  # the penalty's constant
