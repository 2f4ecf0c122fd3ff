"""Faults injected into tiny runs of dqn_starcraft_split.py at its default flags: a game that gives a non-finite
reward or observation, or raises, at agent step N; a TD loss or a gradient that is not finite at update N; weights
that are not finite. Each run keeps its weights finite, ends with its documented exit status and one line naming the
source, and loses nothing (its checkpoint resumes). Then one table of bad inputs, from the command line and RL_*
variables: exit 2, one sentence, nothing written; and what --overwrite may remove."""

import csv
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import dqn_starcraft_split as dqn
import memory_utils as mu
from dqn_tiny import TINY_FLAGS, replay_of

SCRIPT = Path(dqn.__file__)
# 15 agent steps an episode (step_mul 128), an update every 2 agent steps after the first 10
FLAGS = [*TINY_FLAGS, "--eval-every-episodes", "2", "--num-test-episodes", "1", "--run-id", "r"]


class FaultyGame:
    """The training game (not the test one) with a fault at chosen agent steps, counted over its episodes:
    `faults[step]` is "nan" or "inf" (the reward), "obs" (a NaN in a floating player vector) or "raise"."""

    def __init__(self, game, faults: dict[int, str]):
        self.game, self.faults, self.steps = game, faults, 0

    def reset(self):
        return self.game.reset()

    def step(self, *call):
        obs, reward, done = self.game.step(*call)
        self.steps += 1
        fault = self.faults.get(self.steps)
        if fault in ("nan", "inf"):
            reward = float(fault)
        elif fault == "obs":
            obs = dict(obs, player=np.where(np.arange(len(obs["player"])) == 3, np.nan, obs["player"]))
        elif fault == "raise":
            raise RuntimeError("the game crashed")
        return obs, reward, done

    def __getattr__(self, name):
        return getattr(self.game, name)


def with_faults(monkeypatch, faults: dict[int, str]) -> None:
    real = dqn.make_env
    monkeypatch.setattr(
        dqn,
        "make_env",
        lambda args, seed: FaultyGame(real(args, seed), faults) if seed < 10_000 else real(args, seed),
    )


def run(tmp_path, monkeypatch, capsys, *extra) -> tuple[int, str, str]:
    """dqn.cli in `tmp_path` with FLAGS and `extra`: (exit status, stdout, stderr)."""
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    code = dqn.cli([*FLAGS, *extra], {})
    out, err = capsys.readouterr()
    return code, out, err


def log_of(tmp_path) -> str:
    return (tmp_path / "results" / "r" / "train.log").read_text()


def saved(tmp_path) -> dict:
    return torch.load(tmp_path / "results" / "r" / "checkpoint.pt", weights_only=True)


def weights_finite(state: dict) -> bool:
    return all(torch.isfinite(value).all() for value in state["q_network"].values())


def scalars(tmp_path, tag: str) -> list[float]:
    events = EventAccumulator(str(tmp_path / "runs" / "r"), size_guidance={"scalars": 0})
    events.Reload()
    return [event.value for event in events.Scalars(tag)]


def test_non_finite_game_values_never_reach_the_replay_or_the_weights(tmp_path, monkeypatch, capsys):
    """A NaN and an inf reward and a NaN in the observation, each cutting its episode short (stored as truncated):
    the first named in one line, the others counted; the replay, the weights and the results all finite; the
    checkpoint resumes with its replay."""
    with_faults(monkeypatch, {20: "nan", 40: "inf", 62: "obs"})
    code, _, err = run(tmp_path, monkeypatch, capsys, "--num-episodes", "6")
    assert code == 0, err
    log = log_of(tmp_path)
    assert log.count("non-finite") == 3, log  # the first one named, then a count at each log point after one
    assert (
        "the game gave a non-finite reward nan at agent step 19: that step is left out of the replay" in log
    )
    assert (
        "1 more game step left out of the replay for a non-finite value (2 in all; the last: reward inf"
        in log
    )
    assert "(3 in all; the last: observation player nan at agent step 59)" in log
    rb = replay_of(tmp_path / "results" / "r")  # as the resumed run has it
    # every agent step's transition, and each cut episode's last state: its non-finite step left out
    assert weights_finite(saved(tmp_path)) and rb.size == saved(tmp_path)["global_step"] + 3
    assert np.isfinite(rb.rewards[: rb.size]).all() and np.isfinite(rb.player[: rb.size]).all()
    assert int(rb.truncated[: rb.size].sum()) == 3  # one cut episode's last state each
    assert scalars(tmp_path, "debug/nonfinite_game_steps")[-1] == 3.0
    with open(tmp_path / "results" / "results.csv") as f:
        (row,) = list(csv.DictReader(f))
    assert np.isfinite(float(row["test_mean_score"]))
    # nothing lost: the checkpoint goes on, with its replay
    code, _out, err = run(
        tmp_path,
        monkeypatch,
        capsys,
        "--num-episodes",
        "7",
        "--resume",
        "results/r/checkpoint.pt",
    )
    assert code == 0, err
    assert "with its replay" in log_of(tmp_path) and saved(tmp_path)["episode"] == 7


def test_a_game_that_gives_non_finite_values_in_a_row_stops_with_the_last_finite_weights(
    tmp_path, monkeypatch, capsys
):
    """From agent step 20 on every step of the game is NaN: each episode is cut at its first step, and after
    --max-nonfinite in a row the run stops with exit 5, a checkpoint and a sentence naming the game; no results
    row. The checkpoint resumes."""
    with_faults(monkeypatch, {step: "nan" for step in range(20, 200)})
    code, _out, err = run(tmp_path, monkeypatch, capsys, "--num-episodes", "30", "--max-nonfinite", "4")
    assert code == dqn.EXIT_NONFINITE, err
    assert err.strip().startswith(
        "stopping: the game (--backend builtin) gave a non-finite value at 4 steps in a row"
    )
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "results" / "results.csv").exists()
    assert weights_finite(saved(tmp_path))
    monkeypatch.undo()
    code, _, err = run(
        tmp_path, monkeypatch, capsys, "--num-episodes", "6", "--resume", "results/r/checkpoint.pt"
    )
    assert code == 0, err


class BreakUpdates:
    """`dqn.td_loss` with faults at chosen updates: "loss" (a NaN TD loss) or "gradient" (a finite loss whose
    gradient is NaN: the square root of zero times the Q values, d sqrt / dx at 0 being inf). Records the online
    network's weights before each update."""

    def __init__(self, monkeypatch, faults: dict[int, str]):
        self.real, self.faults, self.updates, self.before = dqn.td_loss, faults, 0, []
        monkeypatch.setattr(dqn, "td_loss", self)

    def __call__(self, q_network, target_network, batch, args):
        loss, q_taken = self.real(q_network, target_network, batch, args)
        if batch["obs"]["screen"].any():  # not the preallocation's dummy step, on an empty screen
            self.updates += 1
            self.before.append({k: v.clone() for k, v in q_network.state_dict().items()})
            fault = self.faults.get(self.updates)
            if fault == "loss":
                loss = loss * float("nan")
            elif fault == "gradient":
                loss = loss + torch.sqrt(q_taken.mean() * 0.0)
        return loss, q_taken


def test_non_finite_losses_and_gradients_skip_their_updates_named_once_then_counted(
    tmp_path, monkeypatch, capsys
):
    """A NaN gradient at update 3, NaN TD losses at updates 5 and 6: those steps are skipped (the weights after each
    equal those before it), the first is named in one line, the others counted at a log point; the run finishes."""
    broken = BreakUpdates(monkeypatch, {3: "gradient", 5: "loss", 6: "loss"})
    code, _out, err = run(tmp_path, monkeypatch, capsys, "--num-episodes", "3")
    assert code == 0, err
    log = log_of(tmp_path)
    assert "update skipped: the Q network's gradient norm was nan at agent step 16" in log
    assert (
        "1 more update skipped for a non-finite value (3 in all; the last: the TD loss was nan at agent step 22)"
        in log
    )
    for update in (3, 5):  # the weights after a skipped update are those before it
        assert all(
            torch.equal(broken.before[update - 1][k], broken.before[update][k]) for k in broken.before[0]
        )
    assert not all(torch.equal(broken.before[1][k], broken.before[2][k]) for k in broken.before[0])
    assert weights_finite(saved(tmp_path)) and scalars(tmp_path, "debug/nonfinite_updates")[-1] == 3.0


def test_updates_non_finite_in_a_row_stop_with_exit_5_and_the_last_finite_weights(
    tmp_path, monkeypatch, capsys
):
    broken = BreakUpdates(monkeypatch, {update: "loss" for update in range(3, 100)})
    code, _out, err = run(tmp_path, monkeypatch, capsys, "--num-episodes", "5", "--max-nonfinite", "5")
    assert code == dqn.EXIT_NONFINITE, err
    assert err.strip() == (
        "stopping: 5 updates in a row had a non-finite loss or gradient (the last: the TD loss was nan at agent "
        "step 24) and were skipped, so the checkpoint holds the last finite weights; try a lower --learning-rate."
    )
    state = saved(tmp_path)
    assert all(torch.equal(state["q_network"][k], broken.before[2][k]) for k in state["q_network"])
    assert not (tmp_path / "results" / "results.csv").exists()
    monkeypatch.undo()
    code, _, err = run(
        tmp_path, monkeypatch, capsys, "--num-episodes", "5", "--resume", "results/r/checkpoint.pt"
    )
    assert code == 0, err


def test_weights_that_are_not_finite_give_no_evaluation_results_row_or_checkpoint(
    tmp_path, monkeypatch, capsys
):
    """A weight made NaN behind the update's back (no loss or gradient shows it): the periodic test refuses to run
    on it, exit 5, and nothing is written from it: no curve point, no results row, no checkpoint."""
    real_update = dqn.update

    def poisons_a_weight(q_network, *args, **kwargs):
        metrics = real_update(q_network, *args, **kwargs)
        with torch.no_grad():
            next(q_network.parameters()).view(-1)[0] = float("nan")
        return metrics

    monkeypatch.setattr(dqn, "update", poisons_a_weight)
    code, _out, err = run(tmp_path, monkeypatch, capsys, "--num-episodes", "4")
    assert code == dqn.EXIT_NONFINITE, err
    assert (
        "the Q network's weights are not finite" in err and "no evaluation, results row or checkpoint" in err
    )
    run_dir = tmp_path / "results" / "r"
    assert not (run_dir / "checkpoint.pt").exists() and not (tmp_path / "results" / "results.csv").exists()
    assert (run_dir / "eval" / "curve.csv").read_text().count("\n") == 1  # the header alone


def test_a_game_that_raises_mid_run_keeps_a_checkpoint_that_resumes(tmp_path, monkeypatch, capsys):
    """An SC2 crash at the 50th step: the checkpoint first, the traceback in crash.log, one paragraph naming what
    raised and where, exit 8 (EXIT_CRASHED); the checkpoint resumes, the episode the crash cut (in the middle of a
    step) starting over from the game's reset, said in one line, and the run finishes."""
    with_faults(monkeypatch, {50: "raise"})
    code, _out, err = run(tmp_path, monkeypatch, capsys, "--num-episodes", "5", "--eval-every-episodes", "0")
    assert code == dqn.EXIT_CRASHED
    (paragraph,) = err.strip().splitlines()
    assert paragraph.startswith(
        "crashed at episode 4, agent step 49: RuntimeError: the game crashed, raised in step"
    )
    assert (
        "the traceback is in results/r/crash.log" in paragraph
        and "--resume results/r/checkpoint.pt" in paragraph
    )
    crash_log = (tmp_path / "results" / "r" / "crash.log").read_text()
    assert crash_log.startswith("Traceback") and "train_one_seed" in crash_log
    assert saved(tmp_path)["interrupted"] is True
    monkeypatch.undo()
    code, _, err = run(
        tmp_path, monkeypatch, capsys, "--num-episodes", "5", "--resume", "results/r/checkpoint.pt"
    )
    assert code == 0, err
    log = (tmp_path / "results" / "r" / "train.log").read_text()
    assert "resume: episode 4 starts over from the game's reset (it could not go on)" in log
    events = EventAccumulator(str(tmp_path / "runs" / "r"), size_guidance={"scalars": 0})
    events.Reload()
    assert [event.value for event in events.Scalars("debug/restarted_episodes")][-1] == 1  # counted


# Bad inputs from the command line and RL_* variables: (argv, variables, what the one sentence says)
LONG = "x" * 300
BAD_INPUTS = {
    "a negative seed": (["--seed", "-1"], {}, "seed must be between 0 and 2**32 - 1"),
    "a negative seed in RL_SEED": ([], {"RL_SEED": "-1"}, "(from RL_SEED)"),
    "a negative seed in RL_SEEDS": ([], {"RL_SEEDS": "-1 2"}, "seeds must be each between 0"),
    "a replay larger than the machine": (
        [],
        {"RL_BUFFER_SIZE": "10000000000"},
        "from RL_BUFFER_SIZE, 574 bytes per agent step",
    ),
    "a run id that is the folder above": (["--run-id", ".."], {}, "run_id '..' names a folder that exists"),
    "a run id that is the folder itself": (["--run-id", "."], {}, "run_id '.' names a folder"),
    "a run id that is a path": (["--run-id", "a/b"], {}, "run_id 'a/b' holds '/'"),
    "an absolute run id": ([], {"RL_RUN_ID": "/tmp/x"}, "(from RL_RUN_ID)"),
    "an exp name that is a path": (["--exp-name", "a/b"], {}, "exp_name 'a/b' holds '/'"),
    "an exp name that climbs": (["--exp-name", "../../x"], {}, "exp_name '../../x' holds '/'"),
    "an exp name too long": (["--exp-name", LONG], {}, "bytes long, and a folder name there can be at most"),
    "an infinite learning rate": (
        ["--learning-rate", "inf"],
        {},
        "learning_rate must be a finite number, got inf",
    ),
    "a learning rate of 1e30": (
        ["--learning-rate", "1e30"],
        {},
        "learning_rate must be positive and at most 1",
    ),
    "an infinite RL_LEARNING_RATE": (
        [],
        {"RL_LEARNING_RATE": "inf"},
        "RL_LEARNING_RATE='inf' is not a finite",
    ),
    "an infinite clip": (["--max-grad-norm", "inf"], {}, "max_grad_norm must be a finite number"),
    "a NaN gamma": (["--gamma", "nan"], {}, "gamma must be a finite number"),
    "a log folder under a file": (
        ["--log-dir", "notes.txt/runs"],
        {},
        "is inside notes.txt, which is a file",
    ),
    "a save folder under a file": ([], {"RL_SAVE_PATH": "notes.txt/results"}, "(from RL_SAVE_PATH)"),
    "no non-finite update allowed": (["--max-nonfinite", "0"], {}, "max_nonfinite must be at least 1"),
    "learning that starts after the run": (
        ["--learning-starts", "20", "--num-episodes", "1"],  # one episode of 15 agent steps at --step-mul 128
        {},
        "no update would ever run",
    ),
}


def tiny_flags_under(variables: dict) -> list[str]:
    """TINY_FLAGS without the flags these RL_* variables set: the command line would win over them."""
    flags, set_by_variables = [], {"--" + name[3:].lower().replace("_", "-") for name in variables}
    for flag, value in zip(TINY_FLAGS[::2], TINY_FLAGS[1::2]):
        if flag not in set_by_variables:
            flags += [flag, value]
    return flags


@pytest.mark.parametrize("argv, variables, needle", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_each_bad_input_is_one_sentence_exit_2_and_nothing_written(
    tmp_path, monkeypatch, capsys, argv, variables, needle
):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("a user's notes")
    assert dqn.cli([*tiny_flags_under(variables), *argv], variables) == 2
    _out, err = capsys.readouterr()
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1 and needle in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"], "bad input left something behind"


def test_bad_input_is_refused_by_the_script_itself_without_a_traceback(tmp_path):
    """The real command line, in a process of its own: RL_SEEDS with a negative seed, exit 2, one line, nothing
    written (the table above calls the same `cli`)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RL_")}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *TINY_FLAGS],
        cwd=tmp_path,
        env={**env, "RL_SEEDS": "-1 2"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "error: seeds must be each between 0 and 2**32 - 1 (numpy's seeds), got (-1, 2) (from RL_SEEDS)."
    ]
    assert list(tmp_path.iterdir()) == []


def in_read_only_folder(tmp_path, command: list[str]) -> subprocess.CompletedProcess:
    """`command` run with its working folder on a read-only file system (a tmpfs mounted read-only in a mount
    namespace of its own, which `unshare` makes without privileges)."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    script = f'mount -t tmpfs -o ro none {folder} && cd {folder} && exec "$@"'
    return subprocess.run(
        ["unshare", "-rm", "sh", "-c", script, "sh", *command],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith("RL_")},
    )


def test_a_working_folder_on_a_read_only_file_system_is_one_sentence(tmp_path):
    if subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("no unprivileged mount namespaces here (unshare -rm)")
    done = in_read_only_folder(tmp_path, [sys.executable, str(SCRIPT), *TINY_FLAGS])
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.strip() == (
        "error: save_path 'results' cannot be written: Read-only file system (the nearest folder of it that "
        f"exists, {tmp_path / 'read-only'}); give a folder this user can write."
    )


def first_run(tmp_path, monkeypatch, capsys, run_id="mine") -> None:
    monkeypatch.chdir(tmp_path)
    assert (
        dqn.cli([*TINY_FLAGS, "--num-episodes", "1", "--eval-every-episodes", "0", "--run-id", run_id], {})
        == 0
    )
    capsys.readouterr()


def overwrite(tmp_path, capsys, run_id="mine") -> tuple[int, str]:
    code = dqn.cli(
        [*TINY_FLAGS, "--num-episodes", "1", "--eval-every-episodes", "0", "--run-id", run_id, "--overwrite"],
        {},
    )
    return code, capsys.readouterr().err


def test_overwrite_removes_only_what_this_script_made(tmp_path, monkeypatch, capsys):
    """--overwrite replaces a run folder the script made (its mark), and removes of TensorBoard's folder only the
    event files; a folder with a user's file in it is refused in one sentence and nothing is removed."""
    first_run(tmp_path, monkeypatch, capsys)
    run_dir, events = tmp_path / "results" / "mine", tmp_path / "runs" / "mine"
    (events / "my_plot.png").write_bytes(b"a user's plot")
    old_events = sorted(p.name for p in events.glob("events.out.tfevents.*"))
    code, err = overwrite(tmp_path, capsys)
    assert code == 0, err
    assert (events / "my_plot.png").exists() and not set(old_events) & {p.name for p in events.iterdir()}
    (run_dir / "notes.txt").write_text("a user's notes")
    code, err = overwrite(tmp_path, capsys)
    assert code == 0, err  # marked: the script made it, notes and all
    config = (run_dir / "config.json").read_text()
    (run_dir / mu.RUN_MARK).unlink()  # as a folder another program made, that holds a user's file
    (run_dir / "notes.txt").write_text("a user's notes")
    code, err = overwrite(tmp_path, capsys)
    assert code == 2 and err.strip() == (
        "error: --overwrite removes only run folders this script made, and results/mine holds what it did not "
        "write (notes.txt); nothing was removed: choose another --run-id."
    )
    assert (run_dir / "notes.txt").exists() and (run_dir / "config.json").read_text() == config


def test_overwrite_recognises_an_older_versions_run_folder_by_its_run_files(tmp_path, monkeypatch, capsys):
    """A run folder of a version from before the mark: only a run's own files in it, so --overwrite replaces it."""
    first_run(tmp_path, monkeypatch, capsys)
    (tmp_path / "results" / "mine" / mu.RUN_MARK).unlink()
    code, err = overwrite(tmp_path, capsys)
    assert code == 0, err
    assert (tmp_path / "results" / "mine" / mu.RUN_MARK).exists()


def test_a_run_id_naming_a_folder_the_script_did_not_make_is_refused_and_left_alone(
    tmp_path, monkeypatch, capsys
):
    """`results/notes` is a user's folder (no run in it) and `results/link` a link to one: a run with either id is
    refused, --overwrite or not, and nothing in them changes."""
    monkeypatch.chdir(tmp_path)
    notes = tmp_path / "results" / "notes"
    notes.mkdir(parents=True)
    (notes / "todo.txt").write_text("a user's file")
    (tmp_path / "results" / "link").symlink_to(notes)
    assert dqn.cli([*TINY_FLAGS, "--run-id", "notes"], {}) == 2
    assert "exists and holds no run of this script" in capsys.readouterr().err
    for run_id in ("notes", "link"):
        code, err = overwrite(tmp_path, capsys, run_id)
        assert code == 2 and "nothing was removed" in err, err
    assert sorted(p.name for p in notes.iterdir()) == ["todo.txt"]


STARTUP_SIGNAL = """
import os, signal, sys
sys.path.insert(0, {root!r})
import dqn_starcraft_split as dqn
real = dqn.{target}
def signalled(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, at this moment of the start-up
    return real(*args, **kwargs)
dqn.{target} = signalled
real_later = dqn.instrument
def later(*args, **kwargs):
    print("a later stage of the start-up ran", flush=True)
    return real_later(*args, **kwargs)
dqn.instrument = later
sys.exit(dqn.cli({argv!r}, {{}}))
"""


@pytest.mark.parametrize(
    "target", ["build_agent", "train_one_seed"], ids=["in the set-up", "before the first step"]
)
def test_ctrl_c_during_the_start_up_exits_130_and_leaves_no_half_made_run_folder(tmp_path, target):
    """Ctrl-C while the run is being set up (its folder and TensorBoard events already made), or once set up but
    before its first agent step: exit 130, one sentence, no traceback, and no folder or file left behind."""
    argv = [*TINY_FLAGS, "--num-episodes", "2"]
    script = STARTUP_SIGNAL.format(root=str(SCRIPT.parent), target=target, argv=argv)
    env = {k: v for k, v in os.environ.items() if not k.startswith("RL_")}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert done.returncode == 128 + signal.SIGINT and "Traceback" not in done.stderr, done.stderr[-2000:]
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(
        "stopped by SIGINT during start-up, before the first step: nothing was trained, and the"
    )
    assert list(tmp_path.iterdir()) == []
    # a signal in the set-up stops it where it lands: no later stage of the start-up runs
    assert ("a later stage of the start-up ran" in done.stdout) == (target == "train_one_seed")


def test_tracking_that_cannot_start_is_one_line_and_the_run_trains_on(tmp_path, monkeypatch, capsys):
    """wandb with no API key (its own UsageError, raised by wandb.init): one line says tracking is off and why."""
    import wandb

    def no_key(**kwargs):
        raise wandb.errors.UsageError("api_key not configured (no-tty). call wandb.login(key=[your_api_key])")

    monkeypatch.setattr(wandb, "init", no_key)
    code, out, err = run(
        tmp_path, monkeypatch, capsys, "--num-episodes", "1", "--eval-every-episodes", "0", "--track"
    )
    assert code == 0, err
    (line,) = [line for line in out.splitlines() if "tracking is off" in line]
    assert line.endswith(
        "tracking is off: wandb could not start (UsageError: api_key not configured (no-tty). call "
        "wandb.login(key=[your_api_key])); the run trains on"
    )
    assert json.loads((tmp_path / "results" / "r" / "config.json").read_text())["args"]["track"] is True
