"""Runs never share a folder: each run of dqn_starcraft_split.py claims its folder when it starts. Two runs with the
same default run id (same map, seed and second) both go on, the second under a suffix; a `--run-id` the user chose
is refused when another run holds it. A copy of the script logs under its own name."""

import csv
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import dqn_starcraft_split as dqn
from dqn_tiny import TINY_FLAGS

SCRIPT = Path(dqn.__file__)
FLAGS = [*TINY_FLAGS, "--num-episodes", "2", "--eval-every-episodes", "0", "--num-test-episodes", "1"]
# Runs the script given as the first argument with a clock pinned to one second (it still moves, by a microsecond
# a call), so that two runs started together see the same time.
PINNED_CLOCK = (
    "import itertools, os, runpy, sys, time\n"
    "ticks = itertools.count()\n"
    "time.time = lambda: 1.7e9 + next(ticks) * 1e-6\n"
    "sys.argv = sys.argv[1:]\n"
    "sys.path.insert(0, os.path.dirname(sys.argv[0]))\n"
    "runpy.run_path(sys.argv[0], run_name='__main__')\n"
)


def clean_env() -> dict:
    """This environment without RL_* variables."""
    return {k: v for k, v in os.environ.items() if not k.startswith("RL_")}


def start(cwd: Path, argv: list[str]) -> subprocess.Popen:
    """The script running in `cwd` with the pinned clock."""
    return subprocess.Popen(
        [sys.executable, "-c", PINNED_CLOCK, str(SCRIPT), *argv],
        cwd=cwd,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(procs: list[subprocess.Popen]) -> list[tuple[int, str, str]]:
    """(exit status, stdout, stderr) of each process, once it has ended."""
    outputs = [p.communicate(timeout=300) for p in procs]
    return [(p.returncode, *output) for p, output in zip(procs, outputs)]


def test_two_runs_with_the_same_default_run_id_each_get_a_folder_of_their_own(tmp_path):
    """A shell loop over learning rates, two runs in the same second with the same seed: both finish, each in its
    own folder with its own config, results and TensorBoard events."""
    procs = [start(tmp_path, [*FLAGS, "--learning-rate", rate]) for rate in ("1e-4", "3e-4")]
    outcomes = finish(procs)
    assert [code for code, _, _ in outcomes] == [0, 0], [err[-2000:] for _, _, err in outcomes]
    first = "MoveToBeacon__dqn_starcraft_split__1__1700000000"
    results = tmp_path / "results"
    assert sorted(p.name for p in results.iterdir() if p.is_dir()) == [first, f"{first}-2"]
    said = [out for _, out, _ in outcomes if f"run folder {results.name}/{first} is taken" in out]
    assert len(said) == 1 and f"this run writes to {results.name}/{first}-2" in said[0]
    rates = set()
    for run_id in (first, f"{first}-2"):
        config = json.loads((results / run_id / "config.json").read_text())
        assert config["run_id"] == run_id
        rates.add(config["args"]["learning_rate"])
        test = json.loads((results / run_id / "eval" / "test_results.json").read_text())
        assert test["run_id"] == run_id and test["episodes"] == 2
        assert f"run {run_id}: device" in (results / run_id / "train.log").read_text()
        events_dir = tmp_path / "runs" / run_id
        assert len(list(events_dir.glob("events.out.tfevents.*"))) == 1  # one writer per folder
        events = EventAccumulator(str(events_dir))
        events.Reload()
        assert [e.step for e in events.Scalars("charts/episodic_return")] == [15, 30]  # its own two episodes
    assert rates == {1e-4, 3e-4}
    rows = list(csv.DictReader((results / "results.csv").read_text().splitlines()))
    assert sorted(row["run_id"] for row in rows) == [first, f"{first}-2"]


def test_a_run_id_the_user_chose_is_refused_when_another_run_holds_it(tmp_path):
    """Two runs given the same --run-id at the same time: one trains, the other is refused in one sentence."""
    procs = [
        start(tmp_path, [*FLAGS, "--run-id", "mine", "--learning-rate", rate]) for rate in ("1e-4", "3e-4")
    ]
    outcomes = sorted(finish(procs))
    assert [code for code, _, _ in outcomes] == [0, 2], [err[-2000:] for _, _, err in outcomes]
    refusal = outcomes[1][2].strip().splitlines()
    assert len(refusal) == 1 and refusal[0].startswith("error: run id 'mine' already holds a run"), refusal
    assert [p.name for p in (tmp_path / "results").iterdir() if p.is_dir()] == ["mine"]
    assert len(list((tmp_path / "runs" / "mine").glob("events.out.tfevents.*"))) == 1


def test_a_copy_of_the_script_logs_under_its_own_name(tmp_path):
    copy = tmp_path / "my_dqn.py"
    shutil.copyfile(SCRIPT, copy)
    done = subprocess.run(
        [sys.executable, str(copy), *FLAGS, "--num-episodes", "1"],
        cwd=tmp_path,
        env={**clean_env(), "PYTHONPATH": str(SCRIPT.parent)},  # memory_utils beside the original
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    (run,) = (tmp_path / "results").glob("MoveToBeacon__my_dqn__1__*")
    assert json.loads((run / "config.json").read_text())["args"]["exp_name"] == "my_dqn"
    assert (tmp_path / "runs" / run.name).is_dir()
