"""Nothing lost to any stop, for dreamer_atari.py on real Pong: the replay kept on disk as it grows comes back exactly
as the last complete checkpoint held it, after a SIGKILL after a checkpoint and after one in the middle of a
checkpoint's write (the replay evicting, its capacity smaller than the run); checkpoints on a wall-clock cadence
change nothing that trains; a resume claims its folder (a second one at once is refused), writes beside its
checkpoint wherever it was started, and honours this command's settings."""

import dataclasses
import os
import signal
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import dreamer_atari as da
import dreamer_tiny
import memory_utils as mu

ROOT = Path(__file__).resolve().parent.parent


def tiny_args(**overrides) -> da.Args:
    """2 sync envs, a replay of 150 steps (it evicts: the runs are longer), files of 16 steps, 60-step episodes."""
    schedule = dict(
        total_timesteps=300,
        learning_starts=100,
        train_ratio=4.0,
        log_interval=100,
        max_episode_steps=60,
        buffer_capacity=150,
        replay_chunk_steps=16,
        video_every=0,
        checkpoint_minutes=0.0,
    )
    return dreamer_tiny.tiny_args(**{**schedule, **overrides})


def replay_arrays(replay: da.EpisodeReplay) -> dict[str, np.ndarray]:
    """Everything a replay holds, episode after episode (each as `fill` reads it), and which are in progress."""
    episodes = [replay.fill([[(ep, ep.action.start, ep.num_steps)]], ep.num_steps) for ep in replay.episodes]
    arrays = {key: np.concatenate([e[key][0] for e in episodes]) for key in episodes[0]}
    return arrays | {
        "done": np.array([ep.done for ep in replay.episodes]),
        "rng": np.array(replay.rng.random(4)),
    }


KILLED_RUN = """
import os, signal, sys
sys.path[:0] = [{tests!r}, {root!r}]
import numpy as np
import dreamer_atari as da
import memory_utils as mu
import test_dreamer_resume as t

real_save, real_checked, saves = da.save_checkpoint, mu.save_checked, []

def save_checkpoint(path, agent, counters, run_name, args, replay=None, rng=None, loop=None):
    saves.append(counters["global_step"])
    if len(saves) < 3:
        real_save(path, agent, counters, run_name, args, replay, rng, loop)
        state = replay.rng.bit_generator.state
        np.savez(f"replay_at_{{counters['global_step']}}.npz", **t.replay_arrays(replay))
        replay.rng.bit_generator.state = state
        return path
    def dies_while_writing(path, data, needed_bytes=None):  # the third: killed half-way through its write
        def half(f):
            data(f)
            f.raw.truncate(f.raw.tell() // 2)
            os.kill(os.getpid(), signal.SIGKILL)
        real_checked(path, half, needed_bytes)
    mu.save_checked = dies_while_writing
    real_save(path, agent, counters, run_name, args, replay, rng, loop)

da.save_checkpoint = save_checkpoint
da.main(t.tiny_args(checkpoint_every=100))
"""


@pytest.fixture(scope="module")
def killed(tmp_path_factory):
    """A run checkpointed at env steps 100 and 200, and killed (SIGKILL) in the middle of writing the one at 300:
    its folder, and the replay as each complete checkpoint held it."""
    work = tmp_path_factory.mktemp("killed")
    script = KILLED_RUN.format(tests=str(ROOT / "tests"), root=str(ROOT))
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=work,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    (run_dir,) = (work / "runs").iterdir()
    return work, run_dir


def test_a_run_killed_while_writing_a_checkpoint_resumes_from_the_last_complete_one_with_its_replay(killed):
    """The checkpoint at 300 died half-written (its temporary file alone, the one at 200 whole beside it); the replay
    rebuilt from disk is the one the run held at 200, array for array, its episodes in progress included, its
    generator where it was; the files it needs were kept, though the run wrote past them."""
    work, run_dir = killed
    state = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    assert state["counters"]["global_step"] == 200 and mu.verify_checkpoint(run_dir / "checkpoint.pt") is None
    assert any(p.name.startswith(".tmp_") for p in run_dir.iterdir()), "the half-written checkpoint"
    on_disk = {p.name for p in (run_dir / "replay").glob("chunk_*.rows")}
    assert {
        f"chunk_{int(i):08d}.rows" for i in state["replay"]["log"]["crcs"]
    } <= on_disk  # none removed early
    restored = replay_arrays(dreamer_tiny.replay_of(run_dir, tiny_args(), capacity=150))
    expected = np.load(work / "replay_at_200.npz")
    assert set(restored) == set(expected.files)
    for key in expected.files:
        np.testing.assert_array_equal(restored[key], expected[key], err_msg=key)
    assert not expected["done"].all(), "no episode was in progress"
    assert len(expected["reward"]) < 200, "the replay did not evict"


STOPPED_RUN = """
import os, signal, sys
sys.path[:0] = [{tests!r}, {root!r}]
import numpy as np
import dreamer_atari as da
import test_dreamer_resume as t

real_save, real_add, adds = da.save_checkpoint, da.EpisodeReplay.add, []

def save_checkpoint(path, agent, counters, run_name, args, replay=None, rng=None, loop=None):
    real_save(path, agent, counters, run_name, args, replay, rng, loop)
    state = replay.rng.bit_generator.state
    np.savez(f"replay_at_{{counters['global_step']}}.npz", **t.replay_arrays(replay))
    replay.rng.bit_generator.state = state
    return path

def add(self, *step):
    real_add(self, *step)
    adds.append(1)
    if len(adds) == 87:  # env step 174: past the replay's capacity, in the middle of the second episodes
        os.kill(os.getpid(), signal.SIGTERM)

da.save_checkpoint, da.EpisodeReplay.add = save_checkpoint, add
da.main(t.tiny_args())
"""


def test_a_run_stopped_by_sigterm_resumes_with_its_replay_exactly_as_it_was(tmp_path):
    """SIGTERM mid-episode, the replay past its capacity: the signal's checkpoint holds the replay, and the one rebuilt
    from it is the one the run held then, array for array, its episodes in progress and its generator included."""
    script = STOPPED_RUN.format(tests=str(ROOT / "tests"), root=str(ROOT))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, env=env
    )
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-2000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    step = torch.load(run_dir / "checkpoint.pt", weights_only=True)["counters"]["global_step"]
    assert step == 174, step
    restored = replay_arrays(dreamer_tiny.replay_of(run_dir, tiny_args(), capacity=150))
    expected = np.load(tmp_path / f"replay_at_{step}.npz")
    assert set(restored) == set(expected.files)
    for key in expected.files:
        np.testing.assert_array_equal(restored[key], expected[key], err_msg=key)
    assert not expected["done"].all() and len(expected["reward"]) < step, "none in progress, or none evicted"


def test_the_killed_run_resumes_and_trains_on_where_the_checkpoint_stood(killed, monkeypatch, capsys):
    work, run_dir = killed
    monkeypatch.chdir(work)
    result = da.main(tiny_args(checkpoint_every=100, resume=str(run_dir / "checkpoint.pt")))
    out = capsys.readouterr().out
    assert f"resumed {run_dir.name} at step 200 (" in out and "in its replay)" in out
    assert result["global_step"] == 300 and mu.verify_checkpoint(run_dir / "checkpoint.pt") is None
    saved = torch.load(run_dir / "checkpoint.pt", weights_only=True)
    first = saved["replay"]["log"]["keep_from"] // 16
    assert min(p.name for p in (run_dir / "replay").glob("chunk_*.rows")) == f"chunk_{first:08d}.rows"


def final_weights(**overrides) -> dict[str, torch.Tensor]:
    result = da.main(tiny_args(**overrides))
    state = torch.load(Path(result["run_dir"]) / "checkpoint.pt", weights_only=True)
    return {f"{m}.{k}": v for m, weights in state["models"].items() for k, v in weights.items()}


def test_checkpoints_on_a_wall_clock_cadence_change_nothing_that_trains(tmp_path, monkeypatch, capsys):
    """A checkpoint after every env step (the wall-clock cadence at its shortest) and none but the final one: the same
    weights to the last bit."""
    monkeypatch.chdir(tmp_path)
    none = final_weights(total_timesteps=200, exp_name="none")
    every_step = final_weights(total_timesteps=200, exp_name="every", checkpoint_minutes=1e-9)
    assert capsys.readouterr().out.count("checkpoint (periodic)") > 90
    assert none.keys() == every_step.keys()
    for name, value in none.items():
        assert torch.equal(every_step[name], value), name


def test_a_second_resume_of_a_checkpoint_is_refused_while_the_first_runs(tmp_path, monkeypatch, capsys):
    """The first resume holds the run folder (its lock, taken here as that run would hold it): a second one is one
    sentence, exit 2, and writes nothing; once the first has ended, the folder is free again."""
    monkeypatch.chdir(tmp_path)
    first = da.main(tiny_args(total_timesteps=120))
    run_dir = tmp_path / first["run_dir"]
    held = mu.lock_run_dir(run_dir)
    before = sorted((p.name, p.stat().st_mtime_ns) for p in run_dir.rglob("*"))
    try:
        capsys.readouterr()
        with pytest.raises(SystemExit) as refused:
            da.main(tiny_args(total_timesteps=140, resume=str(run_dir / "checkpoint.pt")))
    finally:
        os.close(held)
    err = capsys.readouterr().err.strip()
    assert refused.value.code == 2 and err.startswith(f"error: --resume: {run_dir} is in use by a run")
    assert f"(process {os.getpid()})" in err and len(err.splitlines()) == 1
    assert sorted((p.name, p.stat().st_mtime_ns) for p in run_dir.rglob("*")) == before
    assert (
        da.main(tiny_args(total_timesteps=140, resume=str(run_dir / "checkpoint.pt")))["global_step"] == 140
    )


def test_a_resume_started_elsewhere_writes_beside_its_checkpoint_and_takes_this_commands_settings(
    tmp_path, monkeypatch, capsys
):
    """Resumed from another working folder with another world-model learning rate and actor eps: nothing is written
    there, the run goes on in its own folder (its TensorBoard file too), and the new values train and are recorded;
    a setting left as it was keeps the checkpoint's value."""
    (tmp_path / "first").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "first")
    first = da.main(tiny_args(total_timesteps=120))
    checkpoint = tmp_path / "first" / first["run_dir"] / "checkpoint.pt"
    monkeypatch.chdir(tmp_path / "elsewhere")
    capsys.readouterr()
    da.main(tiny_args(total_timesteps=140, world_model_lr=3e-4, actor_eps=1e-6, resume=str(checkpoint)))
    out = capsys.readouterr().out
    assert "resume: this command's --world-model-lr 0.0001 -> 0.0003, --actor-eps 1e-05 -> 1e-06" in out
    assert list((tmp_path / "elsewhere").iterdir()) == []
    state = torch.load(checkpoint, weights_only=True)
    assert state["counters"]["global_step"] == 140
    assert state["optimizers"]["world_model"]["param_groups"][0]["lr"] == pytest.approx(3e-4)
    assert state["optimizers"]["actor"]["param_groups"][0]["eps"] == 1e-6
    assert (
        state["settings"]["world_model_lr"] == pytest.approx(3e-4) and state["args"]["world_model_lr"] == 3e-4
    )
    assert state["settings"]["critic_lr"] == pytest.approx(3e-5)


def test_a_value_a_schedule_set_goes_on_after_a_resume_unless_the_command_changes_it():
    """`honour_settings`: the checkpoint's value of a setting (set during the run by `settings.set`) where this
    command's flag is the one the run started with; this command's where it differs."""
    args = dreamer_tiny.tiny_args()
    agent = da.build_agent(args, dreamer_tiny.obs_shape(args), 6, "cpu")
    run = types.SimpleNamespace(args=dataclasses.replace(args, entropy_coef=1e-3), agent=agent)
    state = {"args": dataclasses.asdict(args), "settings": {"kl_dyn_scale": 0.25, "entropy_coef": 5e-4}}
    da.honour_settings(run, state)
    assert float(agent.settings["kl_dyn_scale"]) == 0.25  # the schedule's value goes on
    assert float(agent.settings["entropy_coef"]) == pytest.approx(1e-3)  # this command's flag wins


def test_a_replay_capacity_smaller_than_the_saved_replay_is_refused_before_anything_is_written(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    first = da.main(tiny_args(total_timesteps=200))
    run_dir = tmp_path / first["run_dir"]
    before = sorted((p.name, p.stat().st_mtime_ns) for p in run_dir.rglob("*"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:
        da.main(tiny_args(total_timesteps=260, buffer_capacity=100, resume=str(run_dir / "checkpoint.pt")))
    err = capsys.readouterr().err.strip()
    assert refused.value.code == 2 and err.startswith("error: --resume checkpoint's replay holds ")
    assert err.endswith("more than --buffer-capacity 100 can: give at least 150 (the run's own).")
    assert sorted((p.name, p.stat().st_mtime_ns) for p in run_dir.rglob("*")) == before


def test_with_the_replay_in_memory_only_nothing_is_written_for_it_and_a_resume_says_it_starts_empty(
    tmp_path, monkeypatch, capsys
):
    """--no-replay-on-disk: no replay folder, no replay in the checkpoint, and a resumed run says its replay starts
    empty (it trains on what it collects from then on)."""
    monkeypatch.chdir(tmp_path)
    in_tmp = tmp_path
    first = da.main(tiny_args(total_timesteps=150, replay_on_disk=False, save_model=True))
    run_dir = in_tmp / first["run_dir"]
    assert not (run_dir / "replay").exists()
    assert torch.load(run_dir / "checkpoint.pt", weights_only=True)["replay"] is None
    capsys.readouterr()
    resumed = da.main(
        tiny_args(total_timesteps=200, replay_on_disk=False, resume=str(run_dir / "checkpoint.pt"))
    )
    assert resumed["global_step"] == 200 and not (run_dir / "replay").exists()
    assert f"resumed {run_dir.name} at step 150 (" in (out := capsys.readouterr().out)
    assert "its replay empty (none on disk)" in out, out


def test_a_default_run_checkpoints_every_15_minutes_with_its_replay_on_disk():
    """What a run killed without a signal (the OOM killer, a dead node) keeps by default: the last 15 minutes at most,
    with its replay."""
    assert da.Args().checkpoint_minutes == 15 and da.Args().replay_on_disk
