"""Nothing lost to any stop, for dqn_starcraft_split.py on its built-in minigames: the replay kept on disk as it grows
comes back exactly as the last complete checkpoint held it, after a SIGKILL in the middle of a checkpoint's write
(the replay evicting, its capacity smaller than the run); checkpoints on a wall-clock cadence change nothing that
trains; a resume claims its folder, writes beside its checkpoint wherever it was started, honours this command's
learning rate and refuses a replay too small for the saved one before anything is written."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import dqn_starcraft_split as dqn
import memory_utils as mu
from dqn_tiny import TINY_FLAGS, replay_of

ROOT = Path(__file__).resolve().parent.parent
# 15 agent steps an episode; a replay of 40 transitions (the runs are longer), files of 8
FLAGS = [*TINY_FLAGS, "--eval-every-episodes", "0", "--num-test-episodes", "1", "--run-id", "r"]
FLAGS += ["--buffer-size", "40", "--replay-chunk-steps", "8", "--checkpoint-minutes", "0"]


def ring(rb: "dqn.SplitReplayBuffer") -> dict[str, np.ndarray]:
    """The transitions a replay holds, oldest first, every array of them."""
    oldest = rb.pos if rb.size == rb.capacity else 0
    order = (oldest + np.arange(rb.size)) % rb.capacity
    return {name: array[order] for name, array in rb.slots().items()}


KILLED_RUN = """
import os, signal, sys
sys.path[:0] = [{tests!r}, {root!r}]
import numpy as np
import dqn_starcraft_split as dqn
import memory_utils as mu
import test_dqn_resume as t

real_save, real_checked, saves = dqn.save_run, mu.save_checked, []

def save_run(run, episode, global_step, scores, interrupted, playing=None):
    saves.append(global_step)
    if len(saves) < 3:
        real_save(run, episode, global_step, scores, interrupted, playing)
        np.savez(f"replay_at_{{global_step}}.npz", **t.ring(run.agent.rb))
        return
    def dies_while_writing(path, data, needed_bytes=None):  # the third: killed half-way through its write
        def half(f):
            f.write(data[: len(data) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        real_checked(path, half, needed_bytes)
    mu.save_checked = dies_while_writing
    real_save(run, episode, global_step, scores, interrupted, playing)

dqn.save_run = save_run
sys.exit(dqn.cli([*t.FLAGS, "--num-episodes", "8", "--checkpoint-every", "30"], {{}}))
"""


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """A run checkpointed at agent steps 30 and 60 (episode ends), killed in the middle of writing the one at 90."""
    work = tmp_path_factory.mktemp("killed")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RL_")}
    script = KILLED_RUN.format(tests=str(ROOT / "tests"), root=str(ROOT))
    done = subprocess.run([sys.executable, "-c", script], cwd=work, capture_output=True, text=True, env=env)
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    return work, work / "results" / "r"


def test_a_run_killed_while_writing_a_checkpoint_resumes_from_the_last_complete_one_with_its_replay(killed):
    work, run_dir = killed
    state = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert state["global_step"] == 60 and mu.verify_checkpoint(run_dir / "checkpoint.pt") is None
    rb = replay_of(run_dir, capacity=40)
    restored, expected = ring(rb), np.load(work / "replay_at_60.npz")
    assert rb.size == 40, "the replay did not evict"
    for name in expected.files:
        np.testing.assert_array_equal(restored[name], expected[name], err_msg=name)


STOPPED_RUN = """
import os, signal, sys
sys.path[:0] = [{tests!r}, {root!r}]
import numpy as np
import dqn_starcraft_split as dqn
import test_dqn_resume as t

real_save, real_add, adds = dqn.save_run, dqn.SplitReplayBuffer.add, []

def save_run(run, episode, global_step, scores, interrupted, playing=None):
    real_save(run, episode, global_step, scores, interrupted, playing)
    np.savez(f"replay_at_{{global_step}}.npz", **t.ring(run.agent.rb))

def add(self, *transition, **named):
    real_add(self, *transition, **named)
    adds.append(1)
    if len(adds) == 50:  # agent step 50: past the replay's 40, five steps into the fourth episode
        os.kill(os.getpid(), signal.SIGTERM)

dqn.save_run, dqn.SplitReplayBuffer.add = save_run, add
sys.exit(dqn.cli([*t.FLAGS, "--num-episodes", "8"], {{}}))
"""


def test_a_run_stopped_by_sigterm_resumes_with_its_replay_exactly_as_it_was(tmp_path):
    """SIGTERM mid-episode, the replay past its capacity: the signal's checkpoint holds the replay, and the one rebuilt
    from it is the one the run held then, every array of every transition."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RL_")}
    script = STOPPED_RUN.format(tests=str(ROOT / "tests"), root=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, env=env
    )
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-2000:]
    run_dir = tmp_path / "results" / "r"
    step = torch.load(run_dir / "checkpoint.pt", weights_only=True)["global_step"]
    assert step == 50  # where it stopped: a resumed run goes on with that episode from there
    rb = replay_of(run_dir, capacity=40)
    restored, expected = ring(rb), np.load(tmp_path / f"replay_at_{step}.npz")
    assert rb.size == 40, "the replay did not evict"
    for name in expected.files:
        np.testing.assert_array_equal(restored[name], expected[name], err_msg=name)


def test_the_killed_run_resumes_and_finishes(killed, monkeypatch, capsys):
    work, run_dir = killed
    monkeypatch.chdir(work)
    assert dqn.cli([*FLAGS, "--num-episodes", "8", "--resume", str(run_dir / "checkpoint.pt")], {}) == 0
    log = (run_dir / "train.log").read_text()
    assert "resumed r at episode 5, step 60 with its replay of 40 transitions" in log
    assert torch.load(run_dir / "checkpoint.pt", weights_only=True)["global_step"] == 120


def final_weights(tmp_path, minutes: str, run_id: str) -> dict[str, torch.Tensor]:
    argv = [*TINY_FLAGS, "--eval-every-episodes", "0", "--num-test-episodes", "1", "--num-episodes", "4"]
    assert dqn.cli([*argv, "--checkpoint-minutes", minutes, "--run-id", run_id], {}) == 0
    return torch.load(tmp_path / "results" / run_id / "checkpoint.pt", weights_only=True)["q_network"]


def test_checkpoints_on_a_wall_clock_cadence_change_nothing_that_trains(tmp_path, monkeypatch, capsys):
    """A checkpoint at every episode's end (the wall-clock cadence at its shortest) and none but the final one: the
    same weights to the last bit."""
    monkeypatch.chdir(tmp_path)
    none = final_weights(tmp_path, "0", "none")
    every = final_weights(tmp_path, "1e-9", "every")
    assert (tmp_path / "results" / "every" / "train.log").read_text().count("checkpoint (periodic)") == 3
    for name, value in none.items():
        assert torch.equal(every[name], value), name


def test_a_resume_is_refused_while_another_holds_the_folder_and_writes_beside_its_checkpoint(
    tmp_path, monkeypatch, capsys
):
    """A second resume of one checkpoint is one sentence (the folder's lock, held here as the first would hold it);
    once free, a resume started from another working folder writes into the run's own folder and TensorBoard folder,
    takes this command's learning rate as the schedule's new base, and records it."""
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    assert dqn.cli([*FLAGS, "--num-episodes", "2"], {}) == 0
    run_dir, events = tmp_path / "results" / "r", tmp_path / "runs" / "r"
    held = mu.lock_run_dir(run_dir)
    config = (run_dir / "config.json").read_text()
    capsys.readouterr()
    try:
        assert dqn.cli([*FLAGS, "--num-episodes", "3", "--resume", str(run_dir / "checkpoint.pt")], {}) == 2
    finally:
        os.close(held)
    err = capsys.readouterr().err.strip()
    assert err.startswith(
        f"error: --resume: {run_dir} is in use by a run still going (process {os.getpid()})"
    )
    assert (run_dir / "config.json").read_text() == config
    monkeypatch.chdir(tmp_path / "elsewhere")
    events_before = len(list(events.glob("events.out.tfevents.*")))
    argv = [
        *FLAGS,
        "--num-episodes",
        "3",
        "--learning-rate",
        "1e-4",
        "--resume",
        str(run_dir / "checkpoint.pt"),
    ]
    assert dqn.cli(argv, {}) == 0
    assert list((tmp_path / "elsewhere").iterdir()) == []
    assert len(list(events.glob("events.out.tfevents.*"))) == events_before + 1
    recorded = json.loads((run_dir / "config.json").read_text())["args"]["learning_rate"]
    state = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert recorded == 1e-4 and state["optimizer"]["param_groups"][0]["initial_lr"] == 1e-4
    assert "resume: --learning-rate 5e-05 -> 0.0001" in (run_dir / "train.log").read_text()


def test_a_buffer_smaller_than_the_saved_replay_is_refused_before_anything_is_written(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    assert dqn.cli([*FLAGS, "--num-episodes", "4"], {}) == 0
    run_dir = tmp_path / "results" / "r"
    before = sorted((p.name, p.stat().st_mtime_ns) for p in run_dir.rglob("*"))
    capsys.readouterr()
    argv = [*FLAGS, "--num-episodes", "5", "--buffer-size", "20", "--resume", str(run_dir / "checkpoint.pt")]
    assert dqn.cli(argv, {}) == 2
    assert capsys.readouterr().err.strip() == (
        "error: --resume checkpoint's replay holds 40 transitions, more than --buffer-size 20 can: give at least 40."
    )
    assert sorted((p.name, p.stat().st_mtime_ns) for p in run_dir.rglob("*")) == before


def test_with_the_replay_in_memory_only_nothing_is_written_for_it_and_a_resume_says_so(tmp_path, monkeypatch):
    """--no-replay-on-disk: no replay folder, no replay in the checkpoint, and a resumed run says its replay was not
    saved (it trains on what it collects from then on)."""
    monkeypatch.chdir(tmp_path)
    assert dqn.cli([*FLAGS, "--num-episodes", "2", "--no-replay-on-disk"], {}) == 0
    run_dir = tmp_path / "results" / "r"
    assert not (run_dir / "replay").exists()
    assert torch.load(run_dir / "checkpoint.pt", weights_only=True)["replay"] is None
    argv = [*FLAGS, "--num-episodes", "3", "--no-replay-on-disk", "--resume", str(run_dir / "checkpoint.pt")]
    assert dqn.cli(argv, {}) == 0 and not (run_dir / "replay").exists()
    assert "resumed r at episode 3, step 30 (replay not saved)" in (run_dir / "train.log").read_text()


def test_a_default_run_checkpoints_every_15_minutes_with_its_replay_on_disk():
    """What a run killed without a signal (the OOM killer, a dead node) keeps by default: the last 15 minutes at most
    (at the first episode's end after them), with its replay."""
    assert dqn.Args().checkpoint_minutes == 15 and dqn.Args().replay_on_disk
