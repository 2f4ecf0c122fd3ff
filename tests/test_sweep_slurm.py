"""sweep.py against a real Slurm (.ci/slurm_setup.sh: one node, as CI sets it up): job arrays of tiny runs of both
scripts, and a Dreamer task requeued with `scontrol requeue` while it trains and, once it goes on, its script killed
with SIGKILL (as a dead node or the OOM killer would), against an uninterrupted run of the same seed in the same round
of submissions."""

import contextlib
import csv
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
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
# the requeue comes at step 100 (the script waits for it, stopped), and the SIGKILL 40 steps after the run went on:
# room for the test to see that step and kill before the end, also at 150 env steps/s
TOTAL = 1000
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


def latest_step(log: Path) -> int:
    """The last env step the run's output names ("step N/TOTAL"), 0 before it names one."""
    steps = re.findall(rf"step (\d+)/{TOTAL}", log.read_text()) if log.exists() else []
    return int(steps[-1]) if steps else 0


def scontrol_job(job: str) -> str:
    return subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True, check=True).stdout


@pytest.fixture(scope="module")
def sweeps(tmp_path_factory):
    """Three sweeps submitted at once: a Dreamer run that gets requeued mid-training, two DQN seeds, and the same
    Dreamer run left alone. Returns their folder and job array ids once every run has finished."""
    work = tmp_path_factory.mktemp("slurm_sweeps")
    jobs = {}
    for name, argv in (  # the requeued run last: the test watches it from its start
        ("dqn", ["dqn_starcraft_split.py", "--seeds", "1", "2", "--", *DQN_TINY, "--num-episodes", "2"]),
        ("uninterrupted", ["dreamer_atari.py", "--seeds", "1", "--", *DREAMER_RUN]),
        ("requeued", ["dreamer_atari.py", "--seeds", "1", "--", *DREAMER_RUN]),
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
        # generous: a loaded machine (the other test worker) slows the one-node cluster's tasks
        script = wait_for(lambda: training_script(log.parent), 240, "the Dreamer run's script")
        wait_for(lambda: latest_step(log) >= 100, 240, "the Dreamer run to reach step 100")
        # the script waits, stopped, for the requeue's SIGTERM: however slowly a loaded cluster passes it on, the
        # run cannot end first
        script.suspend()
        subprocess.run(["scontrol", "requeue", jobs["requeued"]], check=True, timeout=30)
        wait_for(lambda: sigterm_reached(script), 120, "the requeue's SIGTERM to reach the script")
        with contextlib.suppress(psutil.NoSuchProcess):
            script.resume()
        resumed_at = wait_for(
            lambda: log.exists() and re.search(r"resumed \S+ at step (\d+) ", log.read_text()),
            240,
            "the requeued run to go on",
        )
        past = int(resumed_at.group(1)) + 40
        # the log names a step at each --log-interval and in its progress lines, not at every step
        wait_for(lambda: latest_step(log) >= past, 240, f"the run to reach step {past}")
        script = wait_for(lambda: training_script(log.parent), 30, "the run's script")
        script.send_signal(signal.SIGKILL)  # no checkpoint on the way out: it goes on from the SIGTERM's
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


def sigterm_reached(script: psutil.Process) -> bool:
    """SIGTERM is pending for the stopped `script` (its kernel status: a stopped process holds its signals until
    SIGCONT), or the script runs again or has gone (Slurm continues a job's processes as it signals them)."""
    try:
        if script.status() != psutil.STATUS_STOPPED:
            return True
        status = Path(f"/proc/{script.pid}/status").read_text()
    except (psutil.NoSuchProcess, FileNotFoundError):
        return True
    pending = [
        int(line.split()[1], 16) for line in status.splitlines() if line.startswith(("SigPnd:", "ShdPnd:"))
    ]
    return any(mask >> (signal.SIGTERM - 1) & 1 for mask in pending)


def training_script(run_dir: Path):
    """The training script running in `run_dir` (a child of the Slurm task's sweep process), or None."""
    for process in psutil.process_iter(["cwd", "cmdline"]):
        cmdline = process.info["cmdline"] or []
        if process.info["cwd"] == str(run_dir) and any(arg.endswith("dreamer_atari.py") for arg in cmdline):
            return process
    return None


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


def test_a_requeued_then_killed_task_resumes_from_its_checkpoint_with_nothing_lost_or_counted_twice(sweeps):
    """Requeued (SIGTERM: a checkpoint, exit 143), then, 40 steps after it went on, killed (SIGKILL, exit 137: no
    checkpoint): the task goes on from the SIGTERM's checkpoint with its replay, and ends with the uninterrupted run's
    totals and curve."""
    work, jobs = sweeps
    requeued = work / "runs" / "requeued" / "defaults__seed1"
    uninterrupted = work / "runs" / "uninterrupted" / "defaults__seed1"
    assert "Restarts=1" in scontrol_job(jobs["requeued"])
    first, second, third = [
        json.loads(line) for line in (requeued / "attempts.jsonl").read_text().splitlines()
    ]
    assert first["exit_code"] == 143 and first["slurm_restart_count"] == 0 and first["resumed_from"] is None
    assert second["exit_code"] == 137 and second["slurm_restart_count"] == 1
    assert third["exit_code"] == 0 and third["slurm_restart_count"] == 1  # the same task went on
    (events_dir,) = (requeued / "runs").iterdir()  # one run folder: the run went on in the same one
    assert second["resumed_from"] == third["resumed_from"] == f"runs/{events_dir.name}/checkpoint.pt"
    output = (requeued / "output.log").read_text()
    stopped_at = int(re.search(r"checkpoint \(SIGTERM\): \S+ at step (\d+)", output).group(1))
    assert 100 <= stopped_at < 300  # it waited for the SIGTERM, stopped
    assert output.count(f"resumed {events_dir.name} at step {stopped_at} ") == 2
    assert "was killed (exit 137, SIGKILL: a dead node or the OOM killer); it goes on" in output

    # the same totals as the uninterrupted run of the same seed: env steps and updates
    mine, reference = final_counters(requeued), final_counters(uninterrupted)
    for key in ("global_step", "updates", "behavior_updates"):
        assert mine[key] == reference[key], key
    assert mine["global_step"] == TOTAL
    (row,) = read_rows(work / "runs" / "requeued" / "results.csv")
    assert row["steps"] == str(TOTAL) and row["attempts"] == "3" and row["restarts"] == "1"

    # an unbroken curve: every logged step once, as the uninterrupted run logs them (the files also hold the steps
    # the killed attempt logged past its checkpoint, which TensorBoard's purge hides)
    (reference_dir,) = (uninterrupted / "runs").iterdir()
    for tag in ("charts/SPS", "losses/world_model"):
        accumulator = EventAccumulator(str(events_dir), size_guidance={"scalars": 0})
        accumulator.Reload()
        shown = [event.step for event in accumulator.Scalars(tag)]
        assert shown == sorted(set(steps_in_files(reference_dir, tag))), tag
    accumulator = EventAccumulator(str(events_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    assert [event.step for event in accumulator.Scalars("charts/SPS")] == list(range(20, TOTAL + 1, 20))
