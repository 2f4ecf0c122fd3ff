"""sweep.py against a real Slurm (.ci/slurm_setup.sh: one node, as CI sets it up): job arrays of tiny runs of both
scripts, and a Dreamer task requeued with `scontrol requeue` while it trains, against an uninterrupted run of the
same seed in the same round of submissions."""

import csv
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_sweep import DQN_TINY, DREAMER_TINY, steps_in_files

import sweep

pytestmark = pytest.mark.skipif(
    shutil.which("sinfo") is None,
    reason="no Slurm here (sinfo is not on PATH); `bash .ci/slurm_setup.sh` sets up a one-node cluster, as CI does",
)

SLURM = [
    "--backend",
    "slurm",
    "--gpus-per-task",
    "0",
    "--cpus-per-task",
    "1",
    "--mem-gb",
    "1",
    "--time-min",
    "10",
]
# long enough that the requeue at step 100 lands well before the end also on a fast, idle machine (about 100 env
# steps/s: a 600-step run once finished in the seconds between the requeue and its signal)
TOTAL = 1500
DREAMER_RUN = [*DREAMER_TINY, "--total-timesteps", str(TOTAL), "--log-interval", "20"]


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(0.2)
    return value


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def scontrol_job(job: str) -> str:
    return subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, check=True).stdout


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory):
    """Three sweeps submitted at once: a Dreamer run that gets requeued mid-training, two DQN seeds, and the same
    Dreamer run left alone. Returns their folder and job array ids once every run has finished."""
    work = tmp_path_factory.mktemp("slurm_sweeps")
    jobs = {}
    for name, argv in (
        ("requeued", ["dreamer_atari.py", "--seeds", "1", "--", *DREAMER_RUN]),
        ("dqn", ["dqn_starcraft_split.py", "--seeds", "1", "2", "--", *DQN_TINY, "--num-episodes", "2"]),
        ("uninterrupted", ["dreamer_atari.py", "--seeds", "1", "--", *DREAMER_RUN]),
    ):
        done = subprocess.run(
            [sys.executable, str(Path(sweep.__file__)), *argv[:1], "--name", name, *SLURM, *argv[1:]],
            cwd=work,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        jobs[name] = re.search(r"submitted job (?:array )?(\d+) ", done.stdout).group(1)
    try:
        log = work / "runs" / "requeued" / "defaults__seed1" / "output.log"
        wait_for(
            lambda: log.exists() and f"step 100/{TOTAL}" in log.read_text(),
            120,
            "the Dreamer run to reach step 100",
        )
        subprocess.run(["scontrol", "requeue", jobs["requeued"]], check=True, timeout=30)
        expected = {"requeued": 1, "dqn": 2, "uninterrupted": 1}
        wait_for(
            lambda: all(
                len(read_rows(work / "runs" / name / "results.csv")) == n for name, n in expected.items()
            ),
            180,
            "every run of the three sweeps to finish",
        )
        wait_for(  # the last task writes results.csv just before it ends
            lambda: (
                not subprocess.run(
                    ["squeue", "-h", "-j", ",".join(jobs.values())],
                    capture_output=True,
                    text=True,
                    check=False,
                ).stdout.strip()
            ),
            60,
            "the jobs to leave the queue",
        )
        yield work, jobs
    finally:
        subprocess.run(["scancel", *jobs.values()], check=False)


def test_a_sweep_is_one_array_task_per_run_and_ends_in_results_csv(sweeps):
    work, jobs = sweeps
    dqn = work / "runs" / "dqn"
    rows = read_rows(dqn / "results.csv")
    assert [(row["run"], row["seed"], row["steps"]) for row in rows] == [
        ("defaults__seed1", "1", "30"),
        ("defaults__seed2", "2", "30"),
    ]
    tasks = {}
    for row in rows:
        (attempt,) = [
            json.loads(line) for line in (dqn / row["run"] / "attempts.jsonl").read_text().splitlines()
        ]
        assert attempt["exit_code"] == 0 and attempt["slurm_job"] is not None
        tasks[attempt["slurm_array_task"]] = row["run"]
    assert tasks == {"0": "defaults__seed1", "1": "defaults__seed2"}
    info = scontrol_job(jobs["dqn"])
    assert sorted(re.findall(r"ArrayTaskId=(\d+)", info)) == ["0", "1"]
    assert re.findall(r"JobState=(\w+)", info) == ["COMPLETED", "COMPLETED"]
    assert "2 of 2 runs finished" in (dqn / "summary.md").read_text()
    (row,) = read_rows(work / "runs" / "uninterrupted" / "results.csv")
    assert row["steps"] == str(TOTAL) and row["attempts"] == "1"


def final_counters(run_dir: Path) -> dict:
    (checkpoint,) = run_dir.glob("runs/*/checkpoint.pt")
    return torch.load(checkpoint, weights_only=True)["counters"]


def test_a_requeued_task_resumes_from_its_checkpoint_with_nothing_lost_or_counted_twice(sweeps):
    work, jobs = sweeps
    requeued = work / "runs" / "requeued" / "defaults__seed1"
    uninterrupted = work / "runs" / "uninterrupted" / "defaults__seed1"
    assert "Restarts=1" in scontrol_job(jobs["requeued"])
    first, second = [json.loads(line) for line in (requeued / "attempts.jsonl").read_text().splitlines()]
    assert first["exit_code"] == 143 and first["slurm_restart_count"] == 0 and first["resumed_from"] is None
    assert second["exit_code"] == 0 and second["slurm_restart_count"] == 1
    (events_dir,) = (requeued / "runs").iterdir()  # one run folder: the requeued task went on in the same run
    assert second["resumed_from"] == f"runs/{events_dir.name}/checkpoint.pt"
    output = (requeued / "output.log").read_text()
    stopped_at = int(re.search(r"checkpoint \(SIGTERM\): \S+ at step (\d+)", output).group(1))
    assert 100 <= stopped_at < TOTAL
    assert f"resumed {events_dir.name} at step {stopped_at} " in output

    # the same totals as the uninterrupted run of the same seed: env steps and updates
    mine, reference = final_counters(requeued), final_counters(uninterrupted)
    for key in ("global_step", "updates", "behavior_updates"):
        assert mine[key] == reference[key], key
    assert mine["global_step"] == TOTAL
    (row,) = read_rows(work / "runs" / "requeued" / "results.csv")
    assert row["steps"] == str(TOTAL) and row["attempts"] == "2"

    # an unbroken curve: every logged step once, the same steps as the uninterrupted run, in the files as written
    (reference_dir,) = (uninterrupted / "runs").iterdir()
    for tag in ("charts/SPS", "losses/world_model"):
        written = steps_in_files(events_dir, tag)
        assert written == steps_in_files(reference_dir, tag), tag
        assert written == sorted(set(written)), tag
    accumulator = EventAccumulator(str(events_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    assert [event.step for event in accumulator.Scalars("charts/SPS")] == list(range(20, TOTAL + 1, 20))
