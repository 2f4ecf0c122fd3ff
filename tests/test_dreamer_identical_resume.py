"""A resumed dreamer_atari.py run is the run never stopped: stopped by SIGTERM mid-episode, or killed by SIGKILL after a
checkpoint, with its replay past its capacity (it has evicted), the resumed run ends with every model and optimizer
tensor bit-identical to the uninterrupted run's, the same replay arrays and the same next 10 sampled batches; on
Catch-v0 (Part 1, the CPU's default) and on tiny Pong (the CPU's fast paths asked for), one thread, fixed seeds."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from test_dreamer_resume import replay_arrays

import dreamer_atari as da
import dreamer_tiny

ROOT = Path(__file__).resolve().parent.parent
CAPACITY = 150

# each game's run: 300 env steps, a replay of 150 steps that evicts, its files 16 steps long, a checkpoint every 100
# env steps; the step the signal comes at (mid-episode), and the step the kill comes after (past the one at 200)
GAMES = {
    "catch": dict(
        args=dict(
            env_id="Catch-v0",
            num_envs=1,
            fast_observe="auto",
            fast_imagine="auto",
            imagine_gathers="auto",
            fast_heads="auto",
            channels_last="auto",
            learning_starts=60,
            warmup_steps=20,
            train_ratio=8.0,
        ),
        stop_at=173,  # Catch's episodes are 9 steps: 173 is the 2nd of one
        kill_at=237,
    ),
    "pong": dict(
        args=dict(max_episode_steps=60, learning_starts=100, train_ratio=4.0), stop_at=174, kill_at=236
    ),
}


def game_args(game: str, **overrides) -> da.Args:
    schedule = dict(
        total_timesteps=300,
        log_interval=50,
        buffer_capacity=CAPACITY,
        replay_chunk_steps=16,
        video_every=0,
        checkpoint_minutes=0.0,
        checkpoint_every=100,
        seed=5,
    )
    return dreamer_tiny.tiny_args(**{**schedule, **GAMES[game]["args"], **overrides})


def stop_at_step(monkeypatch, step: int, signum: int) -> None:
    """`signum` to this process as the replay takes the vector step that reaches env step `step`."""
    real_add = da.EpisodeReplay.add
    seen = []

    def add(self, next_obs, *rest):
        real_add(self, next_obs, *rest)
        seen.append(len(next_obs))
        if sum(seen) == step:
            os.kill(os.getpid(), signum)

    monkeypatch.setattr(da.EpisodeReplay, "add", add)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Each game's run, never stopped: its folder."""
    runs = {}
    for game in GAMES:
        work = tmp_path_factory.mktemp(f"uninterrupted_{game}")
        with pytest.MonkeyPatch.context() as patch:
            patch.chdir(work)
            runs[game] = work / da.main(game_args(game))["run_dir"]
    return runs


def resume(work: Path, game: str) -> Path:
    (run_dir,) = (work / "runs").iterdir()
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(work)
        result = da.main(game_args(game, resume=str(run_dir / "checkpoint.pt")))
    assert result["global_step"] == 300
    return run_dir


def same_values(a, b, where: str) -> int:
    """Assert `a` and `b` (nested dicts, lists, tensors, numbers) equal to the last bit; returns the tensors compared."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        return sum(same_values(a[key], b[key], f"{where}.{key}") for key in a)
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        return sum(same_values(x, y, f"{where}[{i}]") for i, (x, y) in enumerate(zip(a, b)))
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), where
        return 1
    assert a == b, where
    return 0


def assert_same_run(ours: Path, theirs: Path, game: str) -> None:
    """Every model and optimizer tensor bit-identical, the same replay arrays, the same next 10 batches."""
    mine, expected = (torch.load(d / "checkpoint.pt", weights_only=True) for d in (ours, theirs))
    assert mine["counters"]["global_step"] == expected["counters"]["global_step"] == 300
    assert mine["counters"]["updates"] == expected["counters"]["updates"] > 0
    for section in ("models", "optimizers", "scalers", "settings", "rng"):
        tensors = same_values(mine[section], expected[section], section)
        assert tensors or section == "scalers", section  # float32: the loss scalers hold no tensor
    # what the loop carried at the end: its obs and is_first, the player's state, the videos' generator, ... (the
    # envs' state holds wall-clock times of their episodes' starts, so theirs shows in what trained instead)
    loops = [
        {key: value for key, value in state["loop"].items() if key != "envs"} for state in (mine, expected)
    ]
    assert same_values(*loops, "loop") == 5
    args = game_args(game)
    replays = [
        dreamer_tiny.replay_of(d, args, capacity=CAPACITY, num_envs=args.num_envs) for d in (ours, theirs)
    ]
    batches = [[r.sample(args.batch_size, args.sequence_length) for _ in range(10)] for r in replays]
    for a, b in zip(*batches):
        for key in b:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)
    arrays = [replay_arrays(r) for r in replays]
    assert len(arrays[1]["reward"]) < 300, "the replay did not evict"
    for key in arrays[1]:
        np.testing.assert_array_equal(arrays[0][key], arrays[1][key], err_msg=key)


@pytest.mark.slow
@pytest.mark.parametrize("game", list(GAMES))
def test_a_run_stopped_by_sigterm_mid_episode_resumes_bit_identical(
    game, uninterrupted, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    with monkeypatch.context() as patch:
        stop_at_step(patch, GAMES[game]["stop_at"], signal.SIGTERM)
        with pytest.raises(SystemExit) as stopped:
            da.main(game_args(game))
    assert stopped.value.code == 128 + signal.SIGTERM
    run_dir = resume(tmp_path, game)
    assert_same_run(run_dir, uninterrupted[game], game)


KILLED_RUN = """
import sys
sys.path[:0] = [{tests!r}, {root!r}]
import pytest, signal
import dreamer_atari as da
import test_dreamer_identical_resume as t
with pytest.MonkeyPatch.context() as patch:
    t.stop_at_step(patch, {kill_at}, signal.SIGKILL)
    da.main(t.game_args({game!r}))
"""


@pytest.mark.slow
@pytest.mark.parametrize("game", list(GAMES))
def test_a_run_killed_after_a_checkpoint_resumes_from_it_bit_identical(game, uninterrupted, tmp_path):
    script = KILLED_RUN.format(
        tests=str(ROOT / "tests"), root=str(ROOT), kill_at=GAMES[game]["kill_at"], game=game
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    assert torch.load(run_dir / "checkpoint.pt", weights_only=True)["counters"]["global_step"] == 200
    run_dir = resume(tmp_path, game)
    assert_same_run(run_dir, uninterrupted[game], game)


@pytest.mark.slow
def test_async_envs_episodes_in_progress_start_over_on_resume_said_and_counted(tmp_path, monkeypatch, capsys):
    """Async envs keep their state in their worker processes: the checkpoint holds none of it, and a resumed run's
    episodes in progress start over, said in one line and counted in `debug/restarted_episodes`; the rest goes on."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.chdir(tmp_path)
    args = dict(num_envs=2, vector_mode="async", total_timesteps=120, checkpoint_every=0, log_interval=20)
    with monkeypatch.context() as patch:
        stop_at_step(patch, 70, signal.SIGTERM)
        with pytest.raises(SystemExit):
            da.main(game_args("catch", **args))
    (run_dir,) = (tmp_path / "runs").iterdir()
    saved = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert saved["counters"]["global_step"] == 70 and saved["loop"]["envs"] is None
    capsys.readouterr()
    result = da.main(game_args("catch", **args, resume=str(run_dir / "checkpoint.pt")))
    assert result["global_step"] == 120 and result["restarted_episodes"] == 2
    assert (
        "resume: the 2 episodes in progress start over; the rest goes on as it was" in capsys.readouterr().out
    )
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    assert [event.value for event in events.Scalars("debug/restarted_episodes")][-1] == 2
