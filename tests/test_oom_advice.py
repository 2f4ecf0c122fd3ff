"""Every flag an OOM diagnosis names exists where the user would type it: the script's own flags in that script's
`Args`, and the `memory_analysis.py wait` command it suggests in memory_analysis's parser. The diagnosis comes from
memory_utils, shared by both scripts, and ends with the script's own `OOM_ADVICE`; a flag the script lacks (the
shared advice once told Dreamer's users `--amp bf16`, a flag Dreamer no longer has) sends the user to an error
instead of a fix."""

import ast
import dataclasses
import importlib
import re
import shlex
from pathlib import Path

import pytest

import memory_analysis
import memory_utils as mu

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ("dreamer_atari", "dqn_starcraft_split")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")
WAIT_COMMAND = re.compile(r"`python memory_analysis\.py ([^`]*)`")
OOM_FUNCTIONS = {"out_of_memory", "write_oom_report", "diagnose_oom"}

# torch's message when a per-process cap is in force ("... allowed;"), as in test_memory_forensics
CAPPED = (
    "CUDA out of memory. Tried to allocate 100.00 MiB. GPU 0 has a total capacity of 8.00 GiB of which 0 bytes is "
    "free. 1.20 GiB allowed; Of the allocated memory 1.10 GiB is allocated by PyTorch."
)
# what each of diagnose_oom's conditional lines says
CONDITIONAL_LINES = (
    "per-process cap",
    "spilling into shared host memory",
    "reserved but unused",
    "Another process",
)


def every_line(advice: str) -> str:
    """The diagnoses that between them hold every line diagnose_oom can write: a cap, a spill into host memory and
    fragmentation in one; another process holding most of the card in the other."""
    spill = mu.diagnose_oom(
        CAPPED, allocated_mb=9000, reserved_mb=14000, free_mb=0, total_mb=8192, advice=advice
    )
    contended = mu.diagnose_oom(
        "Tried to allocate 512.00 MiB",
        allocated_mb=900,
        reserved_mb=1000,
        free_mb=300,
        total_mb=24576,
        advice=advice,
    )
    text = spill + "\n" + contended
    for line in CONDITIONAL_LINES:
        assert line in text, f"the figures no longer reach the line about {line!r}: choose ones that do"
    return text


def script_flags(module) -> set[str]:
    """The flags tyro makes of the script's Args: `--batch-size` for `batch_size`, and `--no-x` for a bool `x`."""
    flags = set()
    for field in dataclasses.fields(module.Args):
        flag = "--" + field.name.replace("_", "-")
        flags.add(flag)
        if field.type in (bool, "bool"):
            flags.add("--no-" + flag[2:])
    return flags


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_flag_an_oom_diagnosis_names_exists_in_its_script(name):
    module = importlib.import_module(name)
    text = every_line(module.OOM_ADVICE)
    assert text.endswith(module.OOM_ADVICE)
    # the command the diagnosis suggests parses as memory_analysis's own (its flags are its, not the script's)
    commands = WAIT_COMMAND.findall(text)
    assert commands, "the contention line no longer suggests memory_analysis.py wait"
    for command in commands:
        words = ["100" if w == "MB" else "true" if w == "<command>" else w for w in shlex.split(command)]
        assert memory_analysis.build_parser().parse_args(words).command == "wait"
    named = set(FLAG.findall(WAIT_COMMAND.sub("", text)))
    assert named, "the advice names no flag: it should say which of the script's flags lower the peak"
    missing = named - script_flags(module)
    assert not missing, (
        f"the OOM diagnosis of {name}.py names {sorted(missing)}, which {name}.py does not have"
    )


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_oom_report_of_a_script_ends_with_its_own_advice(name):
    """Each call into memory_utils's OOM functions passes `advice=OOM_ADVICE`: the advice is required, so a call
    without it would fail only when the OOM it reports had already happened."""
    tree = ast.parse((ROOT / f"{name}.py").read_text())
    calls = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in OOM_FUNCTIONS
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "mu"
    ]
    assert calls, f"{name}.py no longer reports an OOM through memory_utils"
    for call in calls:
        advice = [k.value for k in call.keywords if k.arg == "advice"]
        assert len(advice) == 1 and isinstance(advice[0], ast.Name) and advice[0].id == "OOM_ADVICE", (
            f"{name}.py line {call.lineno}: mu.{call.func.attr}(...) must pass advice=OOM_ADVICE"
        )
