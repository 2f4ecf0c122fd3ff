"""Each fast path is pinned to the Part 1 code it stands for (`dreamer_kernels.PINNED`): the digest of each name's code
tokens, comments, docstrings and formatting left out. The recorded digests are today's code; a change to any pinned
name steps its paths aside at start-up, in one line naming it and the command that re-pins the path; a copy whose
source cannot be read counts as changed; exit 7 stays only where Part 1 is unchanged as a whole."""

import ast
import linecache
import subprocess
import sys
from pathlib import Path

import pytest

import dreamer_atari as da
import dreamer_kernels as dk
from dreamer_tiny import CPU_PATHS, TINY, import_copy

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = (ROOT / "dreamer_atari.py").read_text()


def test_the_recorded_digests_are_todays_code():
    dk.bind(da)
    assert dk.changed_names(da) == {}, (
        "Part 1 changed where a path is pinned: python dreamer_kernels.py pin PATH"
    )
    assert dk.code_digest(dk.part_1_source(da)) == dk.PART_1_DIGEST
    assert dk.part_1_unchanged(da)
    # every pinned name is Part 1's
    part_1 = {node.name for node in ast.parse(dk.part_1_source(da)).body if hasattr(node, "name")}
    assert {name.partition(".")[0] for digests in dk.PINNED.values() for name in digests} <= part_1
    assert set(dk.PINNED) == set(dk.OFF)


FUNCTION = '''
def f(x, y):
    """A docstring."""
    # a comment
    return g(x, y)[0]
'''
REFORMATTED = '''
def f(x, y):
    """Another docstring,
    on two lines."""
    return g(
        x,
        y,  # a comment at the end of a line
    )[0]
'''


def test_the_digest_leaves_out_comments_docstrings_and_formatting_and_sees_code():
    assert dk.code_digest(FUNCTION) == dk.code_digest(REFORMATTED)
    assert dk.code_digest("x = 'a'\n") == dk.code_digest('x = "a"\n')
    assert dk.code_digest("        x = f'{a!r}'\n") == dk.code_digest("x = f'{a!r}'\n")
    for changed in (
        FUNCTION.replace("[0]", "[1]"),
        FUNCTION.replace("x, y)[0]", "y, x)[0]"),
        FUNCTION.replace("    return", "    x = -x\n    return"),
        FUNCTION.replace('"""A docstring."""', '"""A docstring."""\n    "a string that is not one"'),
        "x = f'{a}'\n",
    ):
        assert dk.code_digest(changed) != dk.code_digest(FUNCTION if "def" in changed else "x = f'{a!r}'\n")


def other_pythons() -> list[str]:
    """The Python 3.12 and 3.13 interpreters that run here."""
    found = []
    for name in ("python3.12", "python3.13"):
        candidates = [name, *map(str, Path.home().glob(f".pyenv/versions/3.1[23]*/bin/{name}"))]
        for candidate in candidates:
            try:
                done = subprocess.run([candidate, "--version"], capture_output=True, timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                continue
            if done.returncode == 0:
                found.append(candidate)
                break
    return found


# the digest functions alone (the standard library's), run by another Python on this repository's files
DIGESTS_ELSEWHERE = """
import ast, contextlib, hashlib, io, sys, textwrap, tokenize
source = open("dreamer_kernels.py").read()
space = dict(ast=ast, contextlib=contextlib, hashlib=hashlib, io=io, textwrap=textwrap, tokenize=tokenize)
for node in ast.parse(source).body:
    if isinstance(node, ast.FunctionDef) and node.name in ("code_tokens", "code_digest"):
        exec(ast.get_source_segment(source, node), space)
for file in ("dreamer_atari.py", "dreamer_kernels.py", "memory_utils.py"):
    print(space["code_digest"](open(file).read()))
"""


def test_the_digest_is_the_same_on_python_3_12_and_3_13():
    """Python 3.12 tokenizes an f-string in parts (3.11 as one string): the digests of the script, the kernels module
    and memory_utils.py, all full of f-strings, agree whichever Python takes them."""
    pythons = other_pythons()
    if not pythons:
        pytest.skip("no Python 3.12 or 3.13 here")
    ours = [
        dk.code_digest((ROOT / file).read_text())
        for file in ("dreamer_atari.py", "dreamer_kernels.py", "memory_utils.py")
    ]
    for python in pythons:
        done = subprocess.run(
            [python, "-c", DIGESTS_ELSEWHERE], cwd=ROOT, capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == ours, python


def mutated(source: str, name: str) -> str:
    """`source` with one statement more at the top of `name`'s body (a function, a class, or `Class.method`)."""
    owner, _, method = name.partition(".")
    node = next(n for n in ast.parse(source).body if getattr(n, "name", None) == owner)
    if method:
        node = next(n for n in node.body if getattr(n, "name", None) == method)
    body = node.body
    docstring = isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant)
    first = body[1] if docstring and len(body) > 1 else body[0]
    rows = source.split("\n")
    at = first.lineno - 1 if first is not body[0] or not docstring else body[0].end_lineno
    indent = " " * first.col_offset
    rows[at:at] = [f"{indent}_pin_probe = None"]
    return "\n".join(rows)


PINNED_NAMES = sorted({name for digests in dk.PINNED.values() for name in digests})


# the classes whose methods are pinned: each method's digest takes in its class's __init__
CLASSES = sorted({name.partition(".")[0] for name in PINNED_NAMES if "." in name})


def test_each_pinned_name_changed_steps_its_paths_aside_and_only_those(tmp_path, monkeypatch):
    for i, name in enumerate(PINNED_NAMES + [f"{owner}.__init__" for owner in CLASSES]):
        module = import_copy(mutated(SCRIPT, name), tmp_path / f"dreamer_pin{i}.py", monkeypatch)
        owner, _, method = name.partition(".")
        names = {
            pinned
            for digests in dk.PINNED.values()
            for pinned in digests
            if pinned == name or (method == "__init__" and pinned.startswith(f"{owner}."))
        }
        expected = {path for path, digests in dk.PINNED.items() if names & set(digests)}
        changed = dk.changed_names(module)
        assert expected and set(changed) == expected, name
        assert all(set(found) <= names for found in changed.values()), name
        assert not dk.part_1_unchanged(module)


def test_a_copy_whose_source_cannot_be_read_counts_as_changed(tmp_path, monkeypatch):
    path = tmp_path / "dreamer_gone.py"
    module = import_copy(SCRIPT, path, monkeypatch)
    assert dk.changed_names(module) == {} and dk.part_1_unchanged(module)  # the same code, read from its file
    path.unlink()
    linecache.clearcache()
    assert set(dk.changed_names(module)) == set(dk.PINNED) and not dk.part_1_unchanged(module)


def tiny_catch(module, **overrides):
    schedule = dict(total_timesteps=30, learning_starts=20, train_ratio=16.0, log_interval=10)
    return module.Args(
        **{
            **TINY,
            **CPU_PATHS,
            "env_id": "Catch-v0",
            "num_envs": 1,
            "vector_mode": "sync",
            **schedule,
            **overrides,
        }
    )


def test_a_disagreement_where_part_1_changed_steps_the_path_aside_and_where_it_did_not_exits_7(
    tmp_path, monkeypatch, capsys
):
    """The fast imagination made to disagree by hand (a stand-in for a kernel edited without its Part 1 function):
    with Part 1 as pinned the run stops at start-up with exit 7 naming the flag; in a copy whose Part 1 changed
    outside every pinned name (a constant), the same disagreement steps the path aside in one line and the run
    trains."""
    real = dk.check_fast_imagine

    def disagrees(agent, *args, **kwargs):
        real(agent, *args, **kwargs)
        raise dk.FastPathMismatch("the fast imagination differs (a stand-in)", off={"fast_imagine": "off"})

    monkeypatch.setattr(dk, "check_fast_imagine", disagrees)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stopped:
        da.main(tiny_catch(da))
    assert stopped.value.code == da.EXIT_FAST_PATH
    assert "the fast imagination differs" in capsys.readouterr().err
    source = SCRIPT.replace("NORM_EPS = 1e-3", "NORM_EPS = 1e-3\nMY_CONSTANT = 2", 1)
    module = import_copy(source, tmp_path / "dreamer_constant.py", monkeypatch)
    counters = module.main(tiny_catch(module))
    said = capsys.readouterr().out
    assert counters["updates"] > 0
    lines = [line for line in said.splitlines() if "the fast imagination differs" in line]
    assert (
        len(lines) == 1
        and "Part 1 changed since the paths were pinned" in lines[0]
        and "--fast-imagine off" in lines[0]
    )


def test_pin_re_pins_the_paths_named_to_the_script_named_and_refuses_a_path_it_has_not(tmp_path):
    """A researcher's copy under another name, its `imagine` changed: `pin --script FILE fast_imagine` records that
    path's digests of the copy and Part 1's as a whole, and leaves every other path's as they were (still pinned to
    the old `imagine`); a path or script it has not is one sentence and exit 2, the kernels file untouched."""
    import shutil

    for name in ("dreamer_kernels.py", "memory_utils.py"):
        shutil.copy(ROOT / name, tmp_path / name)
    (tmp_path / "my_dreamer.py").write_text(mutated(SCRIPT, "imagine"))

    def pin(*words):
        return subprocess.run(
            [sys.executable, "dreamer_kernels.py", "pin", *words],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )

    before = (tmp_path / "dreamer_kernels.py").read_text()
    for words, why in (
        (("--script", "my_dreamer.py", "fast_nothing"), "no path fast_nothing"),
        (("--script", "gone.py"), "no script gone.py"),
    ):
        done = pin(*words)
        assert done.returncode == 2 and why in done.stderr and "Traceback" not in done.stderr, done.stderr
        assert (tmp_path / "dreamer_kernels.py").read_text() == before
    done = pin("--script", "my_dreamer.py", "fast_imagine")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("pinned fast_imagine: ")
    after = (tmp_path / "dreamer_kernels.py").read_text()
    block = ast.parse(after[after.index("# pinned: start") : after.index("# pinned: end")])
    space = {node.targets[0].id: ast.literal_eval(node.value) for node in block.body}
    changed = {
        (path, name)
        for path, digests in dk.PINNED.items()
        for name, digest in digests.items()
        if space["PINNED"][path][name] != digest
    }
    assert changed == {("fast_imagine", "imagine")}
    assert "imagine" in {
        name for path, digests in dk.PINNED.items() if path != "fast_imagine" for name in digests
    }
    assert space["PART_1_DIGEST"] != dk.PART_1_DIGEST
    assert after.replace(
        after[after.index("# pinned: start") : after.index("# pinned: end")], ""
    ) == before.replace(before[before.index("# pinned: start") : before.index("# pinned: end")], "")
