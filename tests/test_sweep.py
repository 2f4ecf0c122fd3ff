"""sweep.py without Slurm: bad input is refused before anything is written, a local sweep of tiny runs of both
scripts gives results.csv and summary.md, the runs of a sweep share a wandb group, and a run killed after a
periodic checkpoint resumes from it when the sweep runs again, with no step twice in its TensorBoard curve."""

import csv
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

import sweep
from dqn_tiny import TINY_FLAGS as DQN_TINY_FLAGS
from dreamer_tiny import TINY_FLAGS

ROOT = Path(__file__).resolve().parent.parent
DQN_TINY = [*DQN_TINY_FLAGS, "--eval-every-episodes", "0"]  # no evaluation episodes in a sweep
DREAMER_TINY = [
    *TINY_FLAGS,
    "--env-id",
    "Catch-v0",
    "--learning-starts",
    "100",
    "--warmup-steps",
    "50",
    "--train-ratio",
    "2",
    "--vector-mode",
    "sync",
    "--precision",
    "float32",
    "--buffer-capacity",
    "2000",
]


def run_sweep(*argv, cwd, env=None, timeout=300):
    return subprocess.run(
        [sys.executable, str(ROOT / "sweep.py"), *argv],
        check=False,
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
        timeout=timeout,
    )


def read_rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize(
    "argv, needle",
    [
        (
            ["dqn_starcraft_split.py", "--grid", "lerning_rate=1e-4"],
            "'lerning_rate' is not a field of dqn_starcraft_split.py's Args (did you mean learning_rate?)",
        ),
        (
            ["dqn_starcraft_split.py", "--grid", "learning_rate=1e-4,fast"],
            "learning_rate: 'fast' is not a number",
        ),
        (["dqn_starcraft_split.py", "--grid", "n_step=1,2.5"], "n_step: '2.5' is not an integer"),
        (
            ["dqn_starcraft_split.py", "--grid", "map_name=MoveToBeacon,Foo"],
            "'Foo' is not one of MoveToBeacon",
        ),
        (
            ["dqn_starcraft_split.py", "--grid", "learning_rate=-1"],
            "learning_rate must be positive and at most 1 (Adam moves each weight by about the learning rate per step), got -1.0",
        ),
        (["dreamer_atari.py", "--grid", "batch_size=0"], "batch_size"),
        (["dreamer_atari.py", "--", "--seed", "3"], "'seed' is set by the sweep itself"),
        (["dreamer_atari.py", "--", "--total-timestep", "3"], "'total_timestep' is not a field"),
        (["ppo.py"], "'ppo.py' is not a script sweep.py runs"),
        (["dreamer_atari.py", "--seeds", "1", "1"], "--seeds must be one or more distinct integers"),
    ],
)
def test_bad_input_is_one_sentence_exit_2_and_nothing_written(tmp_path, monkeypatch, capsys, argv, needle):
    monkeypatch.chdir(tmp_path)
    assert sweep.main([*argv, "--backend", "local"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("sweep.py: error: ") and needle in err and len(err.splitlines()) == 1, err
    assert list(tmp_path.iterdir()) == []


def fake_slurm(tmp_path: Path, squeue_exit: int) -> Path:
    """A PATH holding only fake sbatch and squeue: squeue answers with `squeue_exit`; sbatch records any call."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "squeue").write_text(
        f"#!/bin/sh\necho 'slurm_load_jobs error: Unable to contact slurm controller (connect failure)' >&2\n"
        f"exit {squeue_exit}\n"
    )
    (bin_dir / "sbatch").write_text(
        f"#!/bin/sh\ntouch {tmp_path / 'sbatch_was_called'}\necho 'Submitted batch job 1'\n"
    )
    for tool in ("squeue", "sbatch"):
        (bin_dir / tool).chmod(0o755)
    return bin_dir


@pytest.mark.parametrize("slurm", ["absent", "not answering"])
def test_slurm_backend_without_slurm_is_refused_before_anything_is_submitted(tmp_path, slurm):
    work = tmp_path / "work"
    work.mkdir()
    path = str(tmp_path / "empty") if slurm == "absent" else str(fake_slurm(tmp_path, squeue_exit=1))
    done = run_sweep("dreamer_atari.py", "--backend", "slurm", cwd=work, env={"PATH": path})
    assert done.returncode == 2, done.stderr
    reason = "sbatch and squeue is not on PATH" if slurm == "absent" else "its controller does not answer"
    assert done.stderr.startswith("sweep.py: error: --backend slurm needs Slurm, and " + reason), done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
    assert list(work.iterdir()) == [] and not (tmp_path / "sbatch_was_called").exists()


@pytest.mark.slow
def test_local_sweep_of_both_scripts_writes_results_csv_and_summary(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    code = sweep.main(
        [
            "dqn_starcraft_split.py",
            "--seeds",
            "1",
            "2",
            "--grid",
            "n_step=1,2",
            "--name",
            "dqn",
            "--",
            *DQN_TINY,
            "--num-episodes",
            "2",
        ]
    )
    assert code == 0
    code = sweep.main(
        [
            "dreamer_atari.py",
            "--seeds",
            "1",
            "--name",
            "dreamer",
            "--",
            *DREAMER_TINY,
            "--total-timesteps",
            "300",
            "--log-interval",
            "50",
        ]
    )
    assert code == 0

    rows = read_rows(tmp_path / "runs" / "dqn" / "results.csv")
    assert list(rows[0]) == list(sweep.COLUMNS)
    assert [(r["run"], r["seed"], r["overrides"]) for r in rows] == [
        ("n_step=1__seed1", "1", "n_step=1"),
        ("n_step=1__seed2", "2", "n_step=1"),
        ("n_step=2__seed1", "1", "n_step=2"),
        ("n_step=2__seed2", "2", "n_step=2"),
    ]
    for row in rows:  # two built-in MoveToBeacon episodes at step_mul 128: 15 agent steps each
        test = json.loads(
            (tmp_path / "runs/dqn" / row["run"] / "results/run/eval/test_results.json").read_text()
        )
        assert int(row["steps"]) == test["global_steps"] == 30 and float(row["final_score"]) == test["mean"]
        assert float(row["wall_time_s"]) > 0 and float(row["peak_rss_mb"]) > 50 and row["attempts"] == "1"
        config = json.loads((tmp_path / "runs/dqn" / row["run"] / "results/run/config.json").read_text())
        assert config["args"]["seed"] == int(row["seed"]) and config["args"]["n_step"] == int(row["run"][7])
    summary = (tmp_path / "runs" / "dqn" / "summary.md").read_text()
    assert (
        "4 of 4 runs finished" in summary
        and "| n_step=1 | 1 2 |" in summary
        and "| n_step=2 | 1 2 |" in summary
    )

    (row,) = read_rows(tmp_path / "runs" / "dreamer" / "results.csv")
    assert row["run"] == "defaults__seed1" and row["steps"] == "300" and row["final_score"] != "nan"
    assert float(row["peak_rss_mb"]) > 50


@pytest.mark.slow
def test_the_runs_of_a_sweep_share_a_wandb_group(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("WANDB_RUN_GROUP", raising=False)
    # what a process that used wandb before keeps (its service, gone by now): each run must start its own
    monkeypatch.setenv("WANDB_SERVICE", "2-99999-tcp-localhost-1")
    assert (
        sweep.main(
            [
                "dqn_starcraft_split.py",
                "--name",
                "group-7f3a",
                "--",
                *DQN_TINY,
                "--num-episodes",
                "1",
                "--num-test-episodes",
                "1",
                "--track",
            ]
        )
        == 0
    )
    (run_file,) = (tmp_path / "runs" / "group-7f3a").glob("*/results/run/wandb/offline-run-*/run-*.wandb")
    # the run record's group: protobuf field 6 of RunRecord, a string (tag byte 0x32, then its length); the bare name
    # is also in the file as part of paths, so the test looks for the field
    group = b"group-7f3a"
    assert b"\x32" + bytes([len(group)]) + group in run_file.read_bytes()


def stop_sweep_when(argv: list[str], cwd: Path, log: Path, marker: str, kill_script: bool) -> tuple[int, str]:
    """Start a local sweep, and once its run's log shows `marker`, SIGKILL the training script (`kill_script`) or
    send the sweep itself SIGTERM. Returns the sweep's exit status and stderr."""
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "sweep.py"), *argv],
        cwd=cwd,
        text=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        deadline = time.monotonic() + 120
        while not (log.exists() and marker in log.read_text()):
            assert proc.poll() is None and time.monotonic() < deadline, f"the run never logged {marker!r}"
            time.sleep(0.1)
        if kill_script:
            (script,) = psutil.Process(proc.pid).children()
            script.send_signal(signal.SIGKILL)
        else:
            proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    return proc.returncode, err


def steps_in_files(events_dir: Path, tag: str) -> list[int]:
    """Every step of `tag` in the event files as written, purged ones included."""
    steps = []
    for path in sorted(events_dir.glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            steps += [event.step for value in event.summary.value if value.tag == tag]
    return steps


@pytest.mark.slow
def test_a_killed_run_resumes_from_its_checkpoint_with_each_step_once(tmp_path):
    """SIGKILL (a dead node, the OOM killer: no checkpoint on the way out) after a periodic checkpoint: the run has
    logged steps past it. The sweep resumes it from that checkpoint at once, with its replay; TensorBoard shows each
    step once, the run ends at the same total step count, and the summary says it was killed and resumed."""
    argv = [
        "dreamer_atari.py",
        "--name",
        "killed",
        "--",
        *DREAMER_TINY,
        "--total-timesteps",
        "600",
        "--log-interval",
        "20",
        "--checkpoint-every",
        "200",
    ]
    log = tmp_path / "runs" / "killed" / "defaults__seed1" / "output.log"
    returncode, err = stop_sweep_when(argv, tmp_path, log, "step 340/600", kill_script=True)
    assert returncode == 0, err
    first, second = [json.loads(line) for line in (log.parent / "attempts.jsonl").read_text().splitlines()]
    assert first["exit_code"] == 137 and second["exit_code"] == 0
    (events_dir,) = (tmp_path / "runs/killed/defaults__seed1/runs").iterdir()
    assert second["resumed_from"] == f"runs/{events_dir.name}/checkpoint.pt"
    text = log.read_text()
    assert (
        "was killed (exit 137, SIGKILL: a dead node or the OOM killer); it goes on from its last checkpoint"
        in text
    )
    assert "resumed" in text and "at step 200 " in text and "in its replay" in text
    written = steps_in_files(events_dir, "charts/SPS")
    assert len(written) > len(set(written))  # the files hold steps 220.. twice: the purge is what hides them
    accumulator = EventAccumulator(str(events_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    shown = [event.step for event in accumulator.Scalars("charts/SPS")]
    assert shown == list(range(20, 601, 20))  # an uninterrupted run logs every 20 steps up to 600: each once
    (row,) = read_rows(tmp_path / "runs" / "killed" / "results.csv")
    assert row["steps"] == "600" and row["attempts"] == "2" and row["restarts"] == "1"
    summary = (tmp_path / "runs" / "killed" / "summary.md").read_text()
    assert "resumed from their last checkpoint: defaults__seed1 (1x)" in summary


def test_dreamer_update_log_carried_by_a_checkpoint_gives_the_interval_an_uninterrupted_run_logs():
    """The updates made between the last log point and a stop are saved with the checkpoint: the resumed run's
    next log point averages them with its own, as the uninterrupted run does (else that point is lost)."""
    import torch

    import memory_utils as mu

    rows = [
        {"losses/a": torch.tensor(a), "losses/b": torch.tensor(b)}
        for a, b in ((1.0, 10.0), (3.0, 30.0), (8.0, 80.0))
    ]
    healthy = torch.tensor(True)
    uninterrupted, stopped = mu.UpdateLog("cpu"), mu.UpdateLog("cpu")
    for row in rows:
        uninterrupted.add(row, healthy)
        uninterrupted.end_update(healthy)
    stopped.add(rows[0], healthy)
    stopped.end_update(healthy)
    saved = torch.load(_saved(stopped.state()), weights_only=True)  # as a checkpoint holds it
    resumed = mu.UpdateLog("cpu")
    resumed.restore(saved)
    for row in rows[1:]:
        resumed.add(row, healthy)
        resumed.end_update(healthy)
    assert resumed.pop() == uninterrupted.pop() == ({"losses/a": 4.0, "losses/b": 40.0}, 0, 0, {})


def _saved(state):
    import io

    import torch

    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return buffer


@pytest.mark.slow
def test_a_local_sweep_stopped_by_sigterm_continues_when_run_again(tmp_path):
    """SIGTERM to a local sweep reaches the running script once: it checkpoints, the sweep stops (exit 143) and says
    so; the same command again resumes that run from its checkpoint and finishes the sweep."""
    argv = [
        "dqn_starcraft_split.py",
        "--seeds",
        "1",
        "2",
        "--name",
        "stopped",
        "--",
        *DQN_TINY,
        "--num-episodes",
        "8",
    ]
    log = tmp_path / "runs" / "stopped" / "defaults__seed1" / "output.log"
    returncode, err = stop_sweep_when(argv, tmp_path, log, "episode=2 ", kill_script=False)
    assert returncode == 143 and "stopped by SIGTERM after writing its checkpoint" in err, err
    assert "Traceback" not in err and not (log.parent.parent / "defaults__seed2").exists()

    done = run_sweep(*argv, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    first, second = [json.loads(line) for line in (log.parent / "attempts.jsonl").read_text().splitlines()]
    assert first["exit_code"] == 143 and second["resumed_from"] == "results/run/checkpoint.pt"
    rows = read_rows(tmp_path / "runs" / "stopped" / "results.csv")
    assert [(row["run"], row["attempts"]) for row in rows] == [
        ("defaults__seed1", "2"),
        ("defaults__seed2", "1"),
    ]
    # 8 episodes of 15 steps; the episode it was stopped in is played again and its steps counted once
    assert rows[1]["steps"] == "120" and rows[0]["steps"] == "120"


@pytest.mark.slow
def test_a_run_killed_before_any_checkpoint_starts_afresh_and_past_its_restarts_fails(tmp_path):
    """SIGKILL to a DQN run before its first checkpoint, with --max-restarts 0: the run fails in one sentence. Run
    again, the sweep has nothing to resume and starts the run over in a clean folder (the script would refuse a
    folder holding a run), each step logged once."""
    argv = ["dqn_starcraft_split.py", "--name", "fresh", "--max-restarts", "0", "--", *DQN_TINY]
    argv += ["--num-episodes", "8"]
    log = tmp_path / "runs" / "fresh" / "defaults__seed1" / "output.log"
    returncode, err = stop_sweep_when(argv, tmp_path, log, "episode=2 ", kill_script=True)
    assert (
        returncode == 1 and "was killed (exit 137, SIGKILL: a dead node or the OOM killer) 1 time," in err
    ), err
    assert "more than --max-restarts 0" in err

    done = run_sweep(*argv, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    first, second = [json.loads(line) for line in (log.parent / "attempts.jsonl").read_text().splitlines()]
    assert first["exit_code"] == 137 and second["exit_code"] == 0 and second["resumed_from"] is None
    (row,) = read_rows(tmp_path / "runs" / "fresh" / "results.csv")
    assert row["steps"] == "120"
    written = steps_in_files(log.parent / "runs" / "run", "charts/episodic_return")
    assert written == list(range(15, 121, 15))  # one per episode, from the fresh start only


@pytest.mark.parametrize("read", ["to resume", "for the result"])
def test_a_damaged_checkpoint_without_its_checksum_is_neither_resumed_nor_read(tmp_path, monkeypatch, read):
    """A checkpoint copied without its .sha256 is checked against its archive's own CRC-32s before the sweep resumes
    from it or reads its counters: 200 flipped bytes inside a tensor fail the run in one sentence naming the record,
    the script is not started and the file stays as it is."""
    import torch

    import memory_utils as mu
    from conftest import flip_200_bytes_inside_a_tensor

    plan = sweep.plan_sweep(
        sweep.Args(script="dreamer_atari.py", root=str(tmp_path), name="s", min_free_mb=0), []
    )
    run_dir = Path(plan.sweep_dir) / plan.runs[0].name
    checkpoint = run_dir / "runs" / "run" / "checkpoint.pt"
    checkpoint.parent.mkdir(parents=True)
    mu.save_checked(
        checkpoint, lambda f: torch.save({"counters": {"global_step": 7}, "w": torch.ones(500)}, f)
    )
    (run_dir / "runs" / "run" / "checkpoint.pt.sha256").unlink()
    record = flip_200_bytes_inside_a_tensor(checkpoint)
    damaged = checkpoint.read_bytes()
    started = []
    monkeypatch.setattr(sweep, "run_script", lambda command, *args: started.append(command))
    said = re.escape(f"{checkpoint} is damaged: its record {record} does not match the CRC-32 stored with it")
    with pytest.raises(sweep.RunFailed, match=said):
        if read == "to resume":
            sweep.run_one(plan, 0)
        else:
            plan.script.final(run_dir)
    assert started == [] and checkpoint.read_bytes() == damaged


def test_a_checkpoint_that_fails_its_checksum_is_not_resumed(tmp_path, monkeypatch):
    """A run whose checkpoint is not the one its script wrote (its checksum beside it differs) is not resumed: the
    run fails in one line, the script is not started and the file stays for a look. One without a checksum (written
    before checkpoints had one) is resumed, after a note in the run's log."""
    import memory_utils as mu

    plan = sweep.plan_sweep(
        sweep.Args(script="dqn_starcraft_split.py", root=str(tmp_path), name="s", min_free_mb=0), []
    )
    run_dir = Path(plan.sweep_dir) / plan.runs[0].name
    checkpoint = run_dir / "results" / "run" / "checkpoint.pt"
    checkpoint.parent.mkdir(parents=True)
    mu.save_checked(checkpoint, b"the checkpoint as written")
    checkpoint.write_bytes(b"the checkpoint changed since")
    started = []
    monkeypatch.setattr(sweep, "run_script", lambda command, *args: started.append(command))
    with pytest.raises(sweep.RunFailed, match=r"is not resumed: .*checkpoint.pt does not match its checksum"):
        sweep.run_one(plan, 0)
    assert started == [] and checkpoint.read_bytes() == b"the checkpoint changed since"
    assert "does not match its checksum" in (run_dir / "output.log").read_text()

    (run_dir / "results" / "run" / "checkpoint.pt.sha256").unlink()

    def stopped_by_sigterm(command, cwd, log_path, outcome):
        started.append(command)
        outcome["exit_code"] = 128 + signal.SIGTERM

    monkeypatch.setattr(sweep, "run_script", stopped_by_sigterm)
    with pytest.raises(sweep.RunStopped):
        sweep.run_one(plan, 0)
    assert started[0][-2:] == ["--resume", str(checkpoint)]
    assert "could not be verified" in (run_dir / "output.log").read_text()
