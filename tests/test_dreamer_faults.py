"""Faults injected into tiny runs of dreamer_atari.py on real Pong at its default flags (on the CPU: the fast observe
with its hand-written backward, the fast imagination with its gathers, the shared heads): an env that gives a
non-finite reward or observation, or raises, at env step N; a loss term or a gradient that is not finite at update N;
non-finite start states for the imagination (a world model that overflowed once). Each run keeps its weights finite,
ends with its documented exit status and one line naming the source, and loses nothing (its checkpoint resumes).
Then one table of bad inputs: exit 2, one sentence, nothing written."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

import dreamer_atari as da
import dreamer_tiny
from dreamer_tiny import TINY_FLAGS

ROOT = Path(__file__).resolve().parent.parent


def tiny_args(**overrides) -> da.Args:
    """200 env steps of 2 sync envs (100 vector steps), learning from env step 100, an update every 2 vector steps,
    a log point every 50 env steps, 60-step episodes."""
    schedule = dict(
        total_timesteps=200,
        learning_starts=100,
        train_ratio=8.0,
        log_interval=50,
        max_episode_steps=60,
        buffer_capacity=500,
        video_every=0,
    )
    return dreamer_tiny.tiny_args(**{**schedule, **overrides})


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.set_num_threads(1)
    return tmp_path


class Faulty(gym.Wrapper):
    """The game below `FiniteSteps` with a fault at chosen steps of its own: `faults[step]` is "nan" or "inf" (the
    reward), "obs" (the frame as float32 with a NaN in it) or "raise"."""

    def __init__(self, env, faults: dict[int, str]):
        super().__init__(env)
        self.faults, self.steps = faults, 0

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.steps += 1
        fault = self.faults.get(self.steps)
        if fault in ("nan", "inf"):
            reward = float(fault)
        elif fault == "obs":
            obs = obs.astype(np.float32)
            obs.flat[7] = np.nan
        elif fault == "raise":
            raise RuntimeError("the emulator crashed")
        return obs, reward, terminated, truncated, info


def env_0_with_faults(monkeypatch, faults: dict[int, str]) -> None:
    """Env 0 of the run's vector env (not the envs the input checks make) with `faults` below its FiniteSteps."""
    real = da.make_env

    def make_env(env_id, idx, capture_video, run_name, args, guard=None):
        thunk = real(env_id, idx, capture_video, run_name, args, guard)
        if not run_name or idx != 0:
            return thunk

        def faulty():
            env = layer = thunk()
            while not isinstance(layer, da.FiniteSteps):
                layer = layer.env
            layer.env = Faulty(layer.env, faults)
            return env

        return faulty

    monkeypatch.setattr(da, "make_env", make_env)


def exits(args: da.Args, capsys) -> tuple[int, str, str]:
    capsys.readouterr()
    with pytest.raises(SystemExit) as stopped:
        da.main(args)
    out, err = capsys.readouterr()
    return stopped.value.code, out, err


def load(path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=True)


def finite_models(state: dict) -> bool:
    return all(
        torch.isfinite(v).all() for m in state["models"].values() for v in m.values() if v.is_floating_point()
    )


def test_non_finite_env_values_never_reach_the_replay_or_the_weights(in_tmp, monkeypatch, capsys):
    """A NaN and an inf reward and a NaN frame from env 0: each step left out, its episode cut there (stored as
    truncated), the first named in one line and the others counted at log points; the replay and the weights stay
    finite, and the checkpoint resumes with its replay."""
    env_0_with_faults(monkeypatch, {30: "nan", 60: "inf", 75: "obs"})
    result = da.main(tiny_args(save_model=True))
    out = capsys.readouterr().out
    assert result["nonfinite_env_steps"] == 3 and result["nonfinite_updates"] == 0
    (first,) = [line for line in out.splitlines() if "gave a non-finite" in line]
    assert first == (
        "env 0 gave a non-finite reward nan at env step 58: that step is left out of the replay and its episode "
        "ends there, stored as truncated (later ones: a count per log point)"
    )
    assert "2 more env steps cut for a non-finite value (3 in all)" in out  # both in the next log interval
    state = load(in_tmp / result["run_dir"] / "checkpoint.pt")
    assert finite_models(state)
    replay = dreamer_tiny.replay_of(in_tmp / result["run_dir"], tiny_args())  # as the resumed run has it
    arrays = [replay.fill([[(ep, ep.action.start, ep.num_steps)]], ep.num_steps) for ep in replay.episodes]
    assert all(np.isfinite(a["reward"]).all() and a["obs"].dtype == np.uint8 for a in arrays)
    cut = [a for a in arrays if not a["is_terminal"][0, -1] and a["reward"].shape[1] < 61]
    assert len(cut) >= 3, "each fault cuts its episode short"
    # each episode's first frame, then one step per env step: all 200 but the 3 left out
    assert replay.total_steps == len(replay.episodes) + 200 - 3
    resumed = da.main(
        tiny_args(total_timesteps=220, resume=str(in_tmp / result["run_dir"] / "checkpoint.pt"))
    )
    assert resumed["global_step"] == 220 and resumed["updates"] > result["updates"]


def test_an_env_that_gives_non_finite_values_in_a_row_stops_with_exit_5(in_tmp, monkeypatch, capsys):
    env_0_with_faults(monkeypatch, {step: "nan" for step in range(40, 400)})
    code, _out, err = exits(tiny_args(max_nonfinite=4), capsys)
    assert code == da.EXIT_NONFINITE
    (line,) = err.strip().splitlines()
    assert line.startswith(
        "stopping: env 0 (--env-id ALE/Pong-v5) gave a non-finite value at 4 steps in a row"
    ), line
    (run_dir,) = (in_tmp / "runs").iterdir()
    assert finite_models(load(run_dir / "checkpoint.pt"))
    monkeypatch.undo()  # the faults gone (and the working folder: back to the run's)
    monkeypatch.chdir(in_tmp)
    resumed = da.main(tiny_args(resume=str(run_dir / "checkpoint.pt")))
    assert resumed["global_step"] == 200


def break_updates(monkeypatch, world_model_loss_at: set[int], actor_gradient_at: set[int]) -> None:
    """The reward loss (a term of the world model's) NaN at the updates in `world_model_loss_at`, and the actor's
    gradient NaN (a finite loss) at those in `actor_gradient_at`, counted in the run's updates (not the preflight's
    worst-case one, nor the fast paths' checks on copies)."""
    real_losses, real_step, updates = da.world_model_losses, da.clip_and_step, {"world_model": 0, "actor": 0}

    def world_model_losses(wm, settings, data, *rest):
        loss, parts = real_losses(wm, settings, data, *rest)
        if data["image"].shape[:2] == (2, 8):  # the run's batch, not the preflight's
            updates["world_model"] += 1
            if updates["world_model"] in world_model_loss_at:
                parts["losses/reward"] = parts["losses/reward"] * float("nan")
                loss = loss + parts["losses/reward"]
        return loss, parts

    def clip_and_step(optimizer, scaler, parameters, clip, loss_finite):
        if any(p is q for p in parameters for q in agent_of["actor"].parameters()):
            updates["actor"] += 1
            if updates["actor"] in actor_gradient_at:
                parameters[0].grad.view(-1)[0] = float("nan")
        return real_step(optimizer, scaler, parameters, clip, loss_finite)

    agent_of, real_build = {}, da.build_agent

    def build_agent(*args, **kwargs):
        agent = real_build(*args, **kwargs)
        agent_of.setdefault("actor", agent.actor)
        return agent

    monkeypatch.setattr(da, "world_model_losses", world_model_losses)
    monkeypatch.setattr(da, "clip_and_step", clip_and_step)
    monkeypatch.setattr(da, "build_agent", build_agent)


def test_non_finite_losses_and_gradients_skip_their_updates_named_once_then_counted(
    in_tmp, monkeypatch, capsys
):
    """A NaN reward loss at update 2, a NaN gradient of the actor at update 20: each update's steps are skipped (the
    weights stay finite), the first named at the next log point with its source, the second counted with its own."""
    break_updates(monkeypatch, world_model_loss_at={2}, actor_gradient_at={20})
    result = da.main(tiny_args(save_model=True))
    out = capsys.readouterr().out
    assert result["nonfinite_updates"] == 2
    assert (
        "updates skipped: 1 since the last log point had a non-finite value (losses/reward, the world model's "
        "gradient); their steps were not "
        "taken, so the weights stay finite (later ones: a count per log point)"
    ) in out
    assert "1 more update skipped for a non-finite value (the actor's gradient; 2 in all)" in out
    assert finite_models(load(in_tmp / result["run_dir"] / "checkpoint.pt"))


def test_non_finite_start_states_skip_the_update_on_every_fast_path_and_in_a_row_stop_it(
    in_tmp, monkeypatch, capsys
):
    """A world model that overflowed once hands the imagination non-finite start states: the fast imagination's
    gathers draw no index from NaN probabilities (no IndexError; on CUDA it would be a device-side assert), the
    update is skipped, and --max-nonfinite in a row stop the run with exit 5 and the last finite weights."""
    real, calls = da.train_world_model, []

    def overflowed(agent, raw, args):
        metrics, healthy, start = real(agent, raw, args)
        calls.append(1)
        if len(calls) >= 3:
            start = {**start, "deter": start["deter"] * float("nan")}
        return metrics, healthy, start

    monkeypatch.setattr(da, "train_world_model", overflowed)
    kernels, rollouts = da.kernels_module(), []
    real_rollout = kernels.FastImagine.gather_rollout
    monkeypatch.setattr(
        kernels.FastImagine, "gather_rollout", lambda *a: rollouts.append(1) or real_rollout(*a), raising=True
    )
    code, _out, err = exits(tiny_args(max_nonfinite=3), capsys)
    assert len(rollouts) > 3, "the default CPU paths (the gathers) did not imagine"
    assert code == da.EXIT_NONFINITE, err
    (line,) = err.strip().splitlines()
    assert (
        line.startswith("stopping: ") and "updates in a row had a non-finite value (losses/actor" in line
    ), line
    (run_dir,) = (in_tmp / "runs").iterdir()
    assert finite_models(load(run_dir / "checkpoint.pt"))


def test_weights_that_are_not_finite_are_never_checkpointed(in_tmp, monkeypatch, capsys):
    """A weight made NaN behind the update's back (a finite loss and gradient cannot, an edit could): the next log
    point stops the run (exit 5), and no checkpoint is written from it."""
    real = da.train_world_model

    def poisons_a_weight(agent, raw, args):
        result = real(agent, raw, args)
        with torch.no_grad():
            weight = next(agent.world_model.parameters())
            weight[(0,) * weight.ndim] = float("nan")
        return result

    monkeypatch.setattr(da, "train_world_model", poisons_a_weight)
    code, _, err = exits(tiny_args(save_model=True, checkpoint_every=50), capsys)
    assert code == da.EXIT_NONFINITE
    assert err.strip() == (
        "stopping at step 100: the weights of world_model are not finite, so nothing more is trained or written from "
        "them; the last checkpoint is kept."
    )
    (run_dir,) = (in_tmp / "runs").iterdir()
    saved = load(run_dir / "checkpoint.pt")  # step 50's, before any update; none from the poisoned weights
    assert finite_models(saved) and saved["counters"]["global_step"] == 50


def nan_start_states(agent: da.Agent, n: int = 6) -> tuple:
    rssm = agent.world_model.rssm
    deter = torch.full((n, rssm.deter_dim), float("nan"))
    stoch = rssm.sample(rssm.prior(torch.zeros(n, rssm.deter_dim))).detach()
    return deter, stoch, torch.ones(n)


@pytest.mark.parametrize("path", ["imagine", "gathers", "gathers and fused epilogues"])
def test_each_imagination_draws_its_actions_and_latents_in_range_from_nan_probabilities(path):
    """Part 1's imagination and each fast one (the fused epilogues' Triton kernels interpreted on the CPU) on NaN
    start states: every drawn index is a class that exists, so nothing raises, and the NaN shows in the outputs."""
    kernels = da.kernels_module()
    if path == "gathers and fused epilogues" and kernels.triton_problem(torch.device("cpu")) is not None:
        pytest.skip("Triton's interpreter is not available here")
    agent = da.build_agent(
        dreamer_tiny.tiny_args(), dreamer_tiny.obs_shape(dreamer_tiny.tiny_args()), 6, "cpu"
    )
    rollout = {
        "imagine": da.imagine,
        "gathers": kernels.FastImagine(gathers=True),
        "gathers and fused epilogues": kernels.FastImagine(gathers=True, fused=True),
    }[path]
    feat, log_prob, _entropy = rollout(agent, nan_start_states(agent), 4)
    assert not torch.isfinite(feat[1:]).all() and not torch.isfinite(log_prob).all()
    if path != "imagine":
        _, stoch_index, action_index = rollout.rollout(agent, nan_start_states(agent), 4)
        rssm = agent.world_model.rssm
        assert 0 <= int(action_index.min()) and int(action_index.max()) < 6
        assert 0 <= int(stoch_index.min()) and int(stoch_index.max()) < rssm.stoch_dim * rssm.classes


def test_an_env_that_raises_keeps_a_checkpoint_that_resumes(in_tmp, monkeypatch, capsys):
    """The emulator raising at its 80th step: a checkpoint first, the traceback in crash.log, one paragraph naming
    what raised and where, exit 8; the checkpoint resumes."""
    env_0_with_faults(monkeypatch, {80: "raise"})
    code, _out, err = exits(tiny_args(), capsys)
    assert code == da.EXIT_CRASHED
    (paragraph,) = err.strip().splitlines()
    assert paragraph.startswith("crashed at step 158: RuntimeError: the emulator crashed, raised in step"), (
        paragraph
    )
    (run_dir,) = (in_tmp / "runs").iterdir()
    assert f"--resume runs/{run_dir.name}/checkpoint.pt goes on from step 158" in paragraph
    assert "step_envs" in (run_dir / "crash.log").read_text()
    monkeypatch.undo()  # the faults gone (and the working folder: back to the run's)
    monkeypatch.chdir(in_tmp)
    resumed = da.main(tiny_args(resume=str(run_dir / "checkpoint.pt")))
    assert resumed["global_step"] == 200


BAD_INPUTS = {
    "an exp name that is a path": (dict(exp_name="a/b"), "--exp-name 'a/b' holds '/'"),
    "an exp name that climbs": (dict(exp_name="../../x"), "--exp-name '../../x' holds '/'"),
    "an exp name that is the folder above": (dict(exp_name=".."), "--exp-name '..' names a folder"),
    "an exp name too long for the file system": (dict(exp_name="x" * 300), "is 300 bytes long"),
    "a run name too long for the file system": (dict(exp_name="x" * 240), "the run's name (from --env-id"),
    "a seed numpy cannot take": (dict(seed=2**32), "--seed must be between 0 and 2**32 - 1"),
    "a negative seed": (dict(seed=-1), "--seed must be a number of 0 or more, got -1."),
    "a choice set in code that is none of its choices": (
        dict(fast_observe="yes"),
        "--fast-observe must be one of",
    ),
    "learning that starts at the end": (dict(learning_starts=200), "no update would ever run"),
    "a train ratio that gives no update": (dict(train_ratio=0.01), "no update would run; give at least"),
    "an infinite learning rate": (
        dict(world_model_lr=float("inf")),
        "--world-model-lr must be greater than 0",
    ),
    "a learning rate of 1e30": (dict(actor_lr=1e30), "--actor-lr must be greater than 0 and at most 1"),
    "an infinite eps": (dict(critic_eps=float("inf")), "--critic-eps must be greater than 0 and finite"),
    "a replay larger than the machine": (dict(buffer_capacity=10**10), "GB) this machine has in all"),
    "loops to compile without --compile": (
        dict(compile_loops=True),
        "--compile-loops compiles Part 1's loops",
    ),
}


@pytest.mark.parametrize("overrides, needle", BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_each_bad_input_is_one_sentence_exit_2_and_nothing_written(in_tmp, capsys, overrides, needle):
    code, _out, err = exits(tiny_args(**overrides), capsys)
    assert code == 2 and err.startswith("error: ") and len(err.strip().splitlines()) == 1 and needle in err, (
        err
    )
    assert list(in_tmp.iterdir()) == [], "bad input left something behind"


def test_a_runs_folder_that_is_a_file_is_refused_and_left_as_it_is(in_tmp, capsys):
    (in_tmp / "runs").write_text("a user's file")
    code, _out, err = exits(tiny_args(), capsys)
    assert (
        code == 2
        and err.strip() == "error: the run's folder runs/ 'runs' is a file, not a folder; give a folder."
    )
    assert (in_tmp / "runs").read_text() == "a user's file"


def test_a_working_folder_on_a_read_only_file_system_is_one_sentence(tmp_path):
    if subprocess.run(["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.skip("no unprivileged mount namespaces here (unshare -rm)")
    folder = tmp_path / "read-only"
    folder.mkdir()
    script = f'mount -t tmpfs -o ro none {folder} && cd {folder} && exec "$@"'
    done = subprocess.run(
        [
            "unshare",
            "-rm",
            "sh",
            "-c",
            script,
            "sh",
            sys.executable,
            str(ROOT / "dreamer_atari.py"),
            *TINY_FLAGS,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert done.stderr.strip() == (
        "error: the run's folder runs/ 'runs' cannot be written: Read-only file system (the nearest folder of it "
        f"that exists, {folder}); give a folder this user can write."
    )


STARTUP_SIGNAL = """
import os, signal, sys
sys.path[:0] = [{tests!r}, {root!r}]
import dreamer_atari as da
import test_dreamer_faults as t
real = da.{target}
def signalled(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C, at this moment of the start-up
    return real(*args, **kwargs)
da.{target} = signalled
real_later = da.instrument
def later(*args, **kwargs):
    print("a later stage of the start-up ran", flush=True)
    return real_later(*args, **kwargs)
da.instrument = later
da.main(t.tiny_args(vector_mode="async"))
"""


@pytest.mark.parametrize("target", ["preflight", "learn"], ids=["in the set-up", "before the first env step"])
def test_ctrl_c_during_the_start_up_exits_130_and_leaves_no_half_made_run_folder(tmp_path, target):
    """Ctrl-C during the preflight (the run's folder and TensorBoard events made), or once all is set up but before
    the first env step (the async env workers running): exit 130, one sentence, no traceback, nothing left behind."""
    script = STARTUP_SIGNAL.format(tests=str(ROOT / "tests"), root=str(ROOT), target=target)
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 128 + signal.SIGINT, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "Traceback" not in done.stdout
    assert (
        done.stderr.strip()
        .splitlines()[-1]
        .startswith(
            "stopped by SIGINT during start-up, before the first step: nothing was trained, and the run's folder runs/"
        )
    )
    assert list(tmp_path.iterdir()) == []
    # a signal in the set-up stops it where it lands: no later stage of the start-up runs
    assert ("a later stage of the start-up ran" in done.stdout) == (target == "learn")


def test_tracking_that_cannot_start_is_one_line_and_the_run_trains_on(in_tmp, capsys):
    """./wandb cannot be made (a file is in its way): one line says tracking is off and why; the run trains."""
    (in_tmp / "wandb").write_text("in the way")
    result = da.main(tiny_args(total_timesteps=120, track=True))
    out = capsys.readouterr().out
    (line,) = [line for line in out.splitlines() if "tracking is off" in line]
    assert line.startswith("tracking is off: wandb could not start (") and line.endswith(
        "); the run trains on"
    )
    assert result["global_step"] == 120 and result["updates"] > 0
