"""Memory discipline of dreamer_atari.py: no graph while acting, float-only logging, a flat soak run."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import dreamer_atari as da
import memory_utils as mu
from dreamer_tiny import TINY_FLAGS, dreamerv3_initial_state, obs_shape, tiny_args

ROOT = Path(__file__).resolve().parent.parent


def test_acting_builds_no_graph_and_caches_detached_state():
    args = tiny_args(max_episode_steps=30)
    torch.manual_seed(0)
    agent = da.build_agent(args, obs_shape(args), 6, "cpu")
    player = da.Player(agent, num_envs=2)
    envs = da.make_vector_env(args, "test", seed=0)
    saved = []
    try:
        obs, _ = envs.reset(seed=0)
        is_first = np.ones(2, np.bool_)
        # every tensor autograd would keep for a backward pass goes through this hook
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
            for _ in range(40):  # crosses an episode end (30 steps)
                actions = player.act(obs, is_first)
                obs, _, terminations, truncations, _ = envs.step(actions)
                is_first = terminations | truncations
    finally:
        envs.close()
    assert saved == [], f"acting saved {len(saved)} tensors for backward: collection runs with autograd on"
    for name in ("deter", "stoch", "prev_action"):
        cached = getattr(player, name)
        assert cached.grad_fn is None and not cached.requires_grad, f"cached {name} carries a graph"


def test_acting_keeps_its_state_in_place_and_reads_nothing_back_inside_the_policy_step():
    """What capturing the policy step in a CUDA graph needs (a replay reads and writes the memory it captured, and
    cannot read a tensor back to the host): the cached state stays in the same tensors from step to step, and the
    step dispatches no host read; its actions are those of the readable cell's step."""
    from test_dreamer_fast_path import OpCounter

    args = tiny_args()
    torch.manual_seed(0)
    agent = da.build_agent(args, obs_shape(args), 6, "cpu")
    with torch.no_grad():  # a learned initial state away from its zero start
        agent.world_model.rssm.initial_deter.normal_()
    player = da.Player(agent, num_envs=3)
    addresses = [player.deter.data_ptr(), player.stoch.data_ptr(), player.prev_action.data_ptr()]
    rng = np.random.default_rng(0)
    for step in range(6):
        obs = rng.integers(0, 255, (3, *obs_shape(args)), dtype=np.uint8)
        is_first = np.array([step == 0, step == 3, False])
        deter, stoch, prev_action = player.deter.clone(), player.stoch.clone(), player.prev_action.clone()
        state = torch.get_rng_state()
        with OpCounter() as counter:
            actions = player.act(obs, is_first)
        assert counter.ops["aten._local_scalar_dense"] == 0 and counter.ops["aten.item"] == 0
        torch.set_rng_state(state)  # the same step by the readable cell, from the same state and noise
        with torch.no_grad():
            wm = agent.world_model
            first = torch.as_tensor(is_first).unsqueeze(-1)
            initial_deter, initial_stoch = dreamerv3_initial_state(wm.rssm)
            expected_deter = wm.rssm.img_step(
                torch.where(first, initial_deter, deter),
                torch.where(first, initial_stoch, stoch),
                torch.where(first, 0.0, prev_action),
            )
            image = torch.as_tensor(obs).flatten(1, -3).float() / 255.0 - 0.5
            expected_stoch = wm.rssm.sample(wm.rssm.posterior(expected_deter, wm.encoder(image)))
            probs = agent.actor(torch.cat([expected_deter, expected_stoch], -1))
            expected = da.one_hot_draw(probs, torch.rand(len(probs), 1)).argmax(-1)
        np.testing.assert_array_equal(actions, expected.numpy())
        torch.testing.assert_close(player.deter, expected_deter)
        assert [player.deter.data_ptr(), player.stoch.data_ptr(), player.prev_action.data_ptr()] == addresses
    assert player.deter.grad_fn is None and player.stoch.grad_fn is None
    fresh = da.Player(
        agent, num_envs=3
    )  # a new player starts from the initial state, with no previous action
    initial_deter, initial_stoch = dreamerv3_initial_state(agent.world_model.rssm)
    assert torch.equal(fresh.deter, initial_deter.expand(3, -1)) and not fresh.prev_action.any()
    assert torch.equal(fresh.stoch, initial_stoch.expand(3, -1)) and fresh.deter.grad_fn is None


def test_updates_return_detached_values_that_the_log_sums_on_the_device():
    args = tiny_args()
    torch.manual_seed(0)
    agent = da.build_agent(args, obs_shape(args), 6, "cpu")
    batch = da.synthetic_batch(args, obs_shape(args))
    batch["obs"] = np.random.default_rng(0).integers(0, 255, batch["obs"].shape, dtype=np.uint8)
    metrics, healthy, start = da.train_world_model(agent, da.batch_tensors(batch, "cpu"), args)
    behavior, behavior_healthy = da.train_behavior(agent, start, args)
    assert {"losses/world_model", "losses/kl", "debug/world_model_grad_norm"} <= set(metrics)
    assert {"losses/actor", "losses/critic", "debug/critic_grad_norm"} <= set(behavior)
    for tensor in (*metrics.values(), healthy, *behavior.values(), behavior_healthy, *start.values()):
        # memory: a logged value with a graph would keep the whole update alive until the log point
        assert tensor.grad_fn is None and not tensor.requires_grad
    log = mu.UpdateLog("cpu")
    nan = {key: torch.tensor(float("nan")) for key in metrics}
    double = {key: 2 * value for key, value in metrics.items()}
    for update_values, update_healthy in (
        (metrics, healthy),
        (double, healthy),
        (nan, torch.tensor(False)),
        (nan, torch.tensor(False)),
        (metrics, healthy),
    ):
        log.add(update_values, update_healthy)
        log.end_update(update_healthy)
    means, skipped, longest, nonfinite = log.pop()
    expected = {key: 4 * value.item() / 3 for key, value in metrics.items()}  # the healthy updates' mean
    assert means == pytest.approx(expected) and skipped == 2 and longest == 2
    assert nonfinite == dict.fromkeys(
        metrics, 2
    )  # each value that was not finite, counted: it names the source
    log.add(behavior, torch.tensor(False))
    log.end_update(torch.tensor(False))
    # nothing healthy to average; the run of skips restarted with the interval; every value was finite
    assert log.pop() == ({}, 1, 1, {})


def read_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_soak_host_memory_flat_over_buffer_turnovers(tmp_path):
    """Tiny model, 200-step buffer, 1,800 env steps: eight buffer turnovers of real Pong with updates."""
    capacity, total = 200, 1_800
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    cmd = [
        sys.executable,
        str(ROOT / "dreamer_atari.py"),
        *TINY_FLAGS,
        "--total-timesteps",
        str(total),
        "--buffer-capacity",
        str(capacity),
        "--learning-starts",
        "100",
        "--warmup-steps",
        "100",
        "--train-ratio",
        "1",
        "--log-interval",
        "100",
        "--max-episode-steps",
        "50",
        "--vector-mode",
        "sync",
        "--exp-name",
        "soak",
    ]
    result = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    (run_dir,) = (tmp_path / "runs").iterdir()
    scalars = read_scalars(run_dir)
    uss = dict(scalars[mu.KEY_USS_MB])
    obs_bytes = dict(scalars[mu.BUFFER_KEYS["obs_bytes"]])
    aux_bytes = dict(scalars[mu.BUFFER_KEYS["aux_bytes"]])
    stored = dict(scalars[mu.BUFFER_KEYS["total_steps"]])
    assert max(stored.values()) <= capacity + 2 * 16
    assert scalars["losses/actor"], "behaviour learning never ran"
    # after the buffer is full and the first updates have settled (step 400), five+ turnovers remain
    steps = sorted(step for step in uss if step >= 400)
    assert (steps[-1] - steps[0]) / capacity >= 5
    unexplained = [uss[s] - (obs_bytes[s] + aux_bytes[s]) / 2**20 for s in steps]
    slope = 1000.0 * mu.robust_slope(steps, unexplained)
    half = len(unexplained) // 2
    rise = float(np.median(unexplained[half:]) - np.median(unexplained[:half]))
    # a graph kept alive by acting costs ~110 MB per 1k env steps at these sizes; allocator noise is a few MB
    assert slope < 5.0, f"host memory beyond the buffer grows {slope:.1f} MB per 1k steps: {unexplained}"
    assert rise < 10.0, f"host memory beyond the buffer rose {rise:.1f} MB over the run: {unexplained}"


def test_an_update_log_saved_before_the_non_finite_counts_restores_with_none():
    """A checkpoint of an earlier version holds each group's sums and count alone: it restores, counting no
    non-finite value, and the interval's means are the same."""
    log = mu.UpdateLog("cpu")
    log.restore(
        {"sums": {"losses/a|losses/b": [4.0, 40.0, 2.0]}, "streak": 0.0, "longest": 0.0, "skipped": 0.0}
    )
    log.add({"losses/a": torch.tensor(2.0), "losses/b": torch.tensor(20.0)}, torch.tensor(True))
    log.end_update(torch.tensor(True))
    assert log.pop() == ({"losses/a": 2.0, "losses/b": 20.0}, 0, 0, {})
