"""A resumed dqn_starcraft_split.py run is the run never stopped: stopped by SIGTERM mid-episode, or killed by SIGKILL
after a checkpoint, with its replay past its capacity (it has evicted), the resumed run goes on with the episode it
stopped in, where it stopped, and ends with every network, optimizer and RNG tensor bit-identical to the
uninterrupted run's, the same replay arrays and the same next 10 sampled batches; on both built-in minigames."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from test_dqn_resume import ring
from test_dreamer_identical_resume import same_values

import dqn_starcraft_split as dqn
from dqn_tiny import TINY_FLAGS, replay_of

ROOT = Path(__file__).resolve().parent.parent
CAPACITY = 40
# 6 episodes of 15 agent steps, a replay of 40 transitions (it evicts), files of 8, an update every 4 steps, a
# checkpoint at the end of the episodes that pass every 30 agent steps (30 and 60)
FLAGS = [*TINY_FLAGS, "--eval-every-episodes", "0", "--num-test-episodes", "1", "--run-id", "r"]
FLAGS += ["--buffer-size", str(CAPACITY), "--replay-chunk-steps", "8", "--checkpoint-minutes", "0"]
FLAGS += ["--checkpoint-every", "30", "--num-episodes", "6", "--train-frequency", "4"]
MAPS = ["MoveToBeacon", "CollectMineralShards"]
STOP_AT = 57  # SIGTERM at agent step 57: 12 steps into the fourth episode (a shard collected at 55 on Shards)
KILL_AT = 68  # SIGKILL at agent step 68: 8 steps into the fifth, after the checkpoint at 60


def flags(map_name: str, *extra: str) -> list[str]:
    return [*FLAGS, "--map-name", map_name, *extra]


def signal_at_step(monkeypatch, step: int, signum: int) -> None:
    """`signum` to this process once the replay has stored `step` transitions."""
    real_add, adds = dqn.SplitReplayBuffer.add, []

    def add(self, *transition, **named):
        real_add(self, *transition, **named)
        adds.append(1)
        if len(adds) == step:
            os.kill(os.getpid(), signum)

    monkeypatch.setattr(dqn.SplitReplayBuffer, "add", add)


def run_in_process(work: Path, argv: list[str]) -> int:
    threads = torch.get_num_threads()
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.chdir(work)
            env = {k: v for k, v in os.environ.items() if not k.startswith("RL_")}
            return dqn.cli(argv, env)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Each map's run, never stopped: its folder."""
    runs = {}
    for map_name in MAPS:
        work = tmp_path_factory.mktemp(f"uninterrupted_{map_name}")
        assert run_in_process(work, flags(map_name)) == 0
        runs[map_name] = work / "results" / "r"
    return runs


def episodes(events_dir: Path, tag: str) -> list[tuple[int, float]]:
    """(step, value) of each of `tag`'s points as TensorBoard shows them (what a resumed run purged left out)."""
    accumulator = EventAccumulator(str(events_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return [(event.step, event.value) for event in accumulator.Scalars(tag)]


def assert_same_run(ours: Path, theirs: Path) -> None:
    """Every network, optimizer, scheduler, scaler and RNG state bit-identical; the same replay, the same next 10
    batches."""
    mine, expected = (torch.load(d / "checkpoint.pt", weights_only=True) for d in (ours, theirs))
    assert (
        mine["global_step"] == expected["global_step"] == 90 and mine["episode"] == expected["episode"] == 6
    )
    for section in ("q_network", "target_network", "optimizer", "scheduler", "scaler", "rng", "env_state"):
        same_values(mine[section], expected[section], section)
    # every training episode's score and length, the stopped one's included, as TensorBoard shows them
    for tag in ("charts/episodic_return", "charts/episodic_length"):
        series = [episodes(d.parent.parent / "runs" / "r", tag) for d in (ours, theirs)]
        assert series[0] == series[1] and len(series[1]) == 6, tag
    replays = [replay_of(d, capacity=CAPACITY) for d in (ours, theirs)]
    assert replays[1].size == CAPACITY, "the replay did not evict"
    arrays = [ring(rb) for rb in replays]
    for name in arrays[1]:
        np.testing.assert_array_equal(arrays[0][name], arrays[1][name], err_msg=name)
    generators = [np.random.default_rng() for _ in replays]
    for rng, state in zip(generators, (mine, expected)):
        rng.bit_generator.state = state["rng"]["actions"]
    for _ in range(10):
        a, b = (rb.sample(4, rng, 1) for rb, rng in zip(replays, generators))
        for key in b:
            for name, value in (b[key] if isinstance(b[key], dict) else {"": b[key]}).items():
                ours = a[key][name] if name else a[key]
                np.testing.assert_array_equal(ours, value, err_msg=f"{key} {name}")


@pytest.mark.slow
@pytest.mark.parametrize("map_name", MAPS)
def test_a_run_stopped_by_sigterm_mid_episode_goes_on_where_it_stopped_bit_identical(
    map_name, uninterrupted, tmp_path, monkeypatch
):
    with monkeypatch.context() as patch:
        signal_at_step(patch, STOP_AT, signal.SIGTERM)
        assert run_in_process(tmp_path, flags(map_name)) == 128 + signal.SIGTERM
    run_dir = tmp_path / "results" / "r"
    saved = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert (saved["episode"], saved["global_step"], saved["interrupted"]) == (4, STOP_AT, True)
    assert saved["playing"]["length"] == 12 and (saved["playing"]["score"] > 0 or map_name == "MoveToBeacon")
    assert run_in_process(tmp_path, flags(map_name, "--resume", str(run_dir / "checkpoint.pt"))) == 0
    log = (run_dir / "train.log").read_text()
    assert f"resumed r at episode 4, step {STOP_AT}" in log and "starts over" not in log
    assert_same_run(run_dir, uninterrupted[map_name])


KILLED_RUN = """
import sys
sys.path[:0] = [{tests!r}, {root!r}]
import os, signal, pytest
import dqn_starcraft_split as dqn
import test_dqn_identical_resume as t
with pytest.MonkeyPatch.context() as patch:
    t.signal_at_step(patch, t.KILL_AT, signal.SIGKILL)
    env = {{k: v for k, v in os.environ.items() if not k.startswith("RL_")}}
    sys.exit(dqn.cli(t.flags({map_name!r}), env))
"""


@pytest.mark.slow
@pytest.mark.parametrize("map_name", MAPS)
def test_a_run_killed_after_a_checkpoint_resumes_from_it_bit_identical(map_name, uninterrupted, tmp_path):
    script = KILLED_RUN.format(tests=str(ROOT / "tests"), root=str(ROOT), map_name=map_name)
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    run_dir = tmp_path / "results" / "r"
    assert torch.load(run_dir / "checkpoint.pt", weights_only=True)["global_step"] == 60
    assert run_in_process(tmp_path, flags(map_name, "--resume", str(run_dir / "checkpoint.pt"))) == 0
    assert_same_run(run_dir, uninterrupted[map_name])
