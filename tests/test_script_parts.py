"""dreamer_atari.py reads in three parts (the algorithm, speed, the run), each opened by a banner that names it, and
the algorithm names nothing of the other two: a researcher who copies Part 1 and changes it never has to read Part 2
or Part 3, Part 2 installs itself from the run's set-up, and the loop reaches the run through the `run` it is given."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BANNERS = ("# PART 1: THE ALGORITHM", "# PART 2: SPEED", "# PART 3: THE RUN")
# Part 1, counted from its banner to Part 2's: the limit leaves room for the changes that docs/dreamer_atari.md walks
# through (the largest adds 32 lines), so that a copy with one of them still passes
PART_1_MAX_LINES = 1_450


def parts(script: str, text: str | None = None) -> list[str]:
    """The script's text (or `text`, a changed copy of it) before Part 2's banner, from there to Part 3's, and the
    rest."""
    text = (ROOT / script).read_text() if text is None else text
    starts = [text.index(banner) for banner in BANNERS]  # ValueError: a banner is missing
    assert starts == sorted(starts), f"{script}: the banners are out of order"
    return [text[: starts[1]], text[starts[1] : starts[2]], text[starts[2] :]]


def defined_names(source: str) -> set[str]:
    """The names a part defines at the top level: functions, classes and assigned constants."""
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names |= {target.id for target in node.targets if isinstance(target, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def part_2_source(script: str) -> str:
    """Part 2's text as a parseable module (its banner comments and definitions)."""
    return parts(script)[1]


@pytest.mark.parametrize("script", ["dreamer_atari.py"])
def test_the_algorithm_names_nothing_of_the_speed_part(script):
    part_1, part_2, _ = parts(script)
    speed_names = defined_names(part_2)
    assert speed_names, f"{script}: Part 2 defines nothing"
    # a word of Part 1 (code, comments and docstrings alike) that is a name Part 2 defines
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", part_1))
    named = sorted(words & speed_names)
    assert not named, f"{script}: Part 1 names Part 2's {', '.join(named)}"


def part_1_lines(text: str | None = None) -> int:
    """dreamer_atari.py's Part 1 (or a changed copy's), its lines from its banner to Part 2's."""
    text = (ROOT / "dreamer_atari.py").read_text() if text is None else text
    return parts("dreamer_atari.py", text)[0].split(BANNERS[0])[1].count("\n")


def test_the_algorithm_part_stays_short_enough_to_read():
    lines = part_1_lines()
    assert lines <= PART_1_MAX_LINES, (
        f"dreamer_atari.py: Part 1 is {lines} lines (at most {PART_1_MAX_LINES})"
    )


def names_used(source: str) -> set[str]:
    """The names `source` uses in its code (not attributes: `run.watch()` reaches the run it is given), in its string
    annotations, and in backticks in its comments and docstrings (how a docstring points at a function)."""
    tree = ast.parse(source)
    used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            used |= set(re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)", node.value))
    return used | set(re.findall(r"#[^\n]*?`([A-Za-z_][A-Za-z0-9_]*)", source))


def test_the_algorithm_names_nothing_of_the_run_part():
    """Part 1 neither calls nor points at a Part 3 function, class or constant: the run's machinery (checks, logs,
    checkpoints, memory wiring, Catch) stays out of the algorithm a researcher copies and changes."""
    part_1, _, part_3 = parts("dreamer_atari.py")
    run_names = defined_names(part_3) - defined_names(part_1)  # Part 3 wraps `Args` in place: still Part 1's
    named = sorted(names_used(part_1) & run_names)
    assert not named, f"dreamer_atari.py: Part 1 names Part 3's {', '.join(named)}"


def test_speed_is_installed_by_one_call_from_the_run():
    """`install_speed` (Part 2) is called once, from Part 3's set-up, and nowhere in Part 1."""
    part_1, _, part_3 = parts("dreamer_atari.py")
    assert "install_speed(" not in part_1
    assert part_3.count("install_speed(") == 1


def test_with_every_speed_option_off_the_readable_functions_train(tmp_path, monkeypatch):
    """--fast-observe off, --fast-imagine off, --fast-heads off and --channels-last off (the CPU runs
    eagerly, and --compile is off by default): a run trains through Part 1's `RSSM.observe`, `imagine` and
    `behavior_losses`, and Part 2's equivalents never run."""
    import dreamer_atari as da
    import dreamer_kernels as dk
    from dreamer_tiny import tiny_args

    def refuse(*args, **kwargs):
        raise AssertionError("a fast path ran with its flag off")

    calls = {"observe": 0, "imagine": 0, "behavior_losses": 0}
    real_observe, real_imagine, real_behavior_losses = da.RSSM.observe, da.imagine, da.behavior_losses

    def observe(self, *args, **kwargs):
        calls["observe"] += 1
        return real_observe(self, *args, **kwargs)

    def imagine(*args, **kwargs):
        calls["imagine"] += 1
        return real_imagine(*args, **kwargs)

    def behavior_losses(*args, **kwargs):
        calls["behavior_losses"] += 1
        return real_behavior_losses(*args, **kwargs)

    monkeypatch.setattr(dk.FastObserve, "__call__", refuse)
    monkeypatch.setattr(dk.FastImagine, "__call__", refuse)
    monkeypatch.setattr(dk.FastHeads, "__call__", refuse)
    monkeypatch.setattr(da.RSSM, "observe", observe)
    monkeypatch.setattr(da, "imagine", imagine)
    monkeypatch.setattr(da, "behavior_losses", behavior_losses)
    monkeypatch.chdir(tmp_path)
    speed_off = dict(fast_observe="off", fast_imagine="off", fast_heads="off", channels_last="off")
    for model in ("dreamerv3", "nature"):
        counters = da.main(
            tiny_args(
                model=model, num_envs=1, total_timesteps=40, learning_starts=10, train_ratio=16.0, **speed_off
            )
        )
        assert counters["updates"] > 0 and counters["behavior_updates"] > 0
    assert calls["observe"] > 0 and calls["imagine"] > 0 and calls["behavior_losses"] > 0


def test_no_part_defines_again_a_name_another_defines():
    """A later part's function of the same name would replace the earlier part's at import, for every caller (a Part 2
    helper named like a Part 1 layer builder once would have); only Part 3's freezing of `Args` rebinds it."""
    part_1, part_2, part_3 = (defined_names(part) for part in parts("dreamer_atari.py"))
    again = sorted(((part_1 & part_2) | (part_1 & part_3) | (part_2 & part_3)) - {"Args"})
    assert not again, f"dreamer_atari.py defines {', '.join(again)} in two parts"


def test_the_speed_part_reaches_the_algorithms_layers_by_name_not_by_position():
    """`rssm.img_in.linear`, not `rssm.img_in[0]`: a layer added to a Sequential in Part 1 moves every later position,
    and a fast path that indexes by position would silently read another layer."""
    _, part_2, _ = parts("dreamer_atari.py")
    indexed = re.findall(
        r"\.(?:img_in|prior_net|posterior_net|net|encoder|decoder|reward_head|continue_head)\[", part_2
    )
    assert not indexed, f"Part 2 indexes Part 1's layers by position: {indexed}"
