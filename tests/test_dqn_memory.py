"""Memory rules of dqn_starcraft_split.py: compact replay, batches that own their memory, no graph while
acting, detached logged values, AMP's CPU path, and optimizer preallocation that changes nothing."""

import warnings

import numpy as np
import pytest
import torch

import dqn_starcraft_split as dqn
import memory_utils as mu


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def filled_buffer(capacity=64, steps=50, res=8, step_mul=128, seed=0):
    env = dqn.BuiltinMiniGame("MoveToBeacon", res=res, step_mul=step_mul, seed=seed)  # 15-step episodes
    rb, rng = dqn.SplitReplayBuffer(capacity, res), np.random.default_rng(seed)
    obs, history = env.reset(), []
    for t in range(steps):
        obs = {**obs, "player": obs["player"].copy()}
        obs["player"][1] = t  # a stamp (the minerals entry) that names the step
        mask = dqn.action_mask(obs["available_actions"])
        move_available = mask[dqn.FUNCTIONS.index("Move_screen")]
        action = int(rng.integers(0, 2 + (res * res if move_available else 0)))
        next_obs, reward, done = env.step(*dqn.decode_action(action, res))
        rb.add(obs, action, reward, done)
        history.append((obs, action, done))
        obs = env.reset() if done else next_obs
    return rb, history


def test_layers_are_stored_in_the_smallest_type_their_range_allows():
    rb = dqn.SplitReplayBuffer(10, 16)
    assert rb.screen["player_relative"].dtype == np.uint8
    assert rb.screen["unit_density"].dtype == np.uint8
    assert rb.screen["unit_hit_points"].dtype == np.int16  # scale 1600 does not fit a byte
    assert all(a.dtype == np.uint8 for a in rb.minimap.values())
    obs_bytes, _ = rb.bytes_per_step()
    assert obs_bytes == (3 * 1 + 1 * 2 + 3 * 1) * 16 * 16  # each state once: no second copy for s'
    assert not hasattr(rb, "next_screen")


def test_next_state_is_the_following_slot_and_terminals_do_not_leak_across_episodes():
    rb, history = filled_buffer(capacity=64, steps=50)
    assert rb.num_transitions() == 49  # the newest state's successor is not stored yet
    sample = rb.sample(256, np.random.default_rng(1))
    for b in range(256):
        i = int(sample["obs"]["player"][b, 1])
        assert np.array_equal(sample["obs"]["screen"][b], history[i][0]["feature_screen"])
        assert sample["actions"][b] == history[i][1]
        assert bool(sample["dones"][b, 0]) == history[i][2]
        if not history[i][2]:
            assert sample["next_obs"]["player"][b, 1] == i + 1
            assert np.array_equal(sample["next_obs"]["screen"][b], history[i + 1][0]["feature_screen"])
        else:
            assert sample["next_obs"]["player"][b, 1] in (i + 1, 0)  # the next episode's start: never used


def test_ring_overwrites_the_oldest_and_never_samples_the_newest_half_transition():
    rb, _history = filled_buffer(capacity=16, steps=40)
    assert rb.size == 16 and rb.pos == 40 % 16
    stamps = set(rb.sample(2000, np.random.default_rng(2))["obs"]["player"][:, 1].astype(int).tolist())
    assert stamps == set(range(40 - 16, 39))  # the last 16 steps but the newest, whose successor is unknown


def test_n_step_samples_hold_the_next_n_rewards_and_dones_and_the_state_n_later():
    env = dqn.BuiltinMiniGame("MoveToBeacon", res=8, step_mul=128, seed=0)
    rb, obs = dqn.SplitReplayBuffer(32, 8), env.reset()
    rewards, dones = [float(t) for t in range(10)], [t in (4, 9) for t in range(10)]
    for t in range(10):
        stamped = {**obs, "player": obs["player"].copy()}
        stamped["player"][1] = t
        rb.add(stamped, 0, rewards[t], dones[t])
    sample = rb.sample(500, np.random.default_rng(0), n_step=3)
    stamps = sample["obs"]["player"][:, 1].astype(int)
    assert set(stamps.tolist()) == set(range(8))  # 8 and 9 lack 3 known successors
    for b, i in enumerate(stamps):
        assert sample["rewards"][b].tolist() == rewards[i : i + 3]  # td_target cuts them at the episode's end
        assert sample["dones"][b].tolist() == [float(d) for d in dones[i : i + 3]]
        if i + 3 < 10:
            assert sample["next_obs"]["player"][b, 1] == i + 3


def test_a_sampled_batch_owns_its_memory():
    rb, _ = filled_buffer()
    sample = rb.sample(8, np.random.default_rng(0))
    storages = [
        *rb.screen.values(),
        *rb.minimap.values(),
        rb.player,
        rb.mask,
        rb.actions,
        rb.rewards,
        rb.dones,
    ]
    arrays = [
        *sample["obs"].values(),
        *sample["next_obs"].values(),
        sample["actions"],
        sample["rewards"],
        sample["dones"],
    ]
    for array in arrays:
        assert not any(np.shares_memory(array, storage) for storage in storages)
    batch = dqn.batch_to_device(sample, "cpu")
    before = batch["obs"]["screen"].clone()
    for storage in storages:
        storage[...] = 0  # evict everything
    assert torch.equal(batch["obs"]["screen"], before)


def test_buffer_stats_feed_memory_report():
    rb, _ = filled_buffer(steps=50)
    report = mu.memory_report(buffer_stats=rb.stats())
    obs_bytes, aux_bytes = rb.bytes_per_step()
    assert report[mu.BUFFER_KEYS["total_steps"]] == 50.0
    assert report[mu.BUFFER_KEYS["obs_bytes"]] == 50.0 * obs_bytes
    assert report[mu.BUFFER_KEYS["aux_bytes"]] == 50.0 * aux_bytes
    assert report[mu.BUFFER_KEYS["num_episodes"]] == 3.0  # three 15-step episodes ended


def test_acting_builds_no_graph():
    net = dqn.SplitQNetwork(8)
    seen = []
    net.register_forward_hook(
        lambda module, inputs, outputs: seen.append(
            (torch.is_grad_enabled(), outputs[0].grad_fn, outputs[1].grad_fn)
        )
    )
    obs = dqn.BuiltinMiniGame("MoveToBeacon", res=8, step_mul=16, seed=0).reset()
    dqn.select_action(net, obs, 0.0, np.random.default_rng(0), "cpu")
    assert seen == [(False, None, None)]


def make_nets(res=8, seed=0):
    torch.manual_seed(seed)
    q, target = dqn.SplitQNetwork(res), dqn.SplitQNetwork(res)
    target.load_state_dict(q.state_dict())
    return q, target


def real_batch(res=8):
    rb, _ = filled_buffer(res=res)
    return dqn.batch_to_device(rb.sample(8, np.random.default_rng(3)), "cpu")


def test_update_returns_detached_values():
    q, target = make_nets()
    optimizer = torch.optim.Adam(q.parameters(), lr=1e-3)
    metrics = dqn.update(q, target, optimizer, real_batch(), dqn.Args(res=8), mu.amp("off", "cpu"))
    assert set(metrics) == {"losses/td_loss", "losses/q_values", "losses/grad_norm", "finite"}
    assert metrics.pop("finite") is True  # a plain bool: whether the step was taken
    assert all(v.grad_fn is None and not v.requires_grad for v in metrics.values())


@pytest.mark.parametrize("amp", ["auto", "bf16"])
def test_amp_cpu_path_trains_without_scaler_warnings(amp):
    """The agent's precision on a CPU (auto: off; bf16: autocast without a loss scaler) trains, and no GradScaler
    or autocast warning is raised (a scaler built for CUDA warns on a CPU)."""
    args = dqn.with_map_defaults(dqn.Args(res=8, amp=amp))
    setup = dqn.build_agent(args, seed=0, device="cpu").amp
    assert setup.mode == {"auto": "off", "bf16": "bf16"}[amp] and not setup.scaler.is_enabled()
    q, target = make_nets()
    optimizer = torch.optim.Adam(q.parameters(), lr=1e-3)
    before = [p.detach().clone() for p in q.parameters()]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a GradScaler/autocast warning would fail here
        for _ in range(2):
            metrics = dqn.update(q, target, optimizer, real_batch(), args, setup)
    assert np.isfinite(metrics["losses/td_loss"].item())
    assert any(not torch.equal(a, b) for a, b in zip(before, q.parameters()))  # it did train


def test_bf16_autocast_runs_every_forward_of_the_update_on_cpu():
    setup = mu.amp("bf16", "cpu")
    q, target = make_nets()
    optimizer = torch.optim.Adam(q.parameters(), lr=1e-3)
    dtypes = []
    for net in (q, target):
        net.spatial_head.coarse.register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
    metrics = dqn.update(q, target, optimizer, real_batch(), dqn.Args(res=8), setup)
    assert dtypes == [torch.bfloat16] * 3  # online on s, target on s', online on s' (double DQN)
    loss = metrics["losses/td_loss"]
    assert loss.dtype == torch.float32 and torch.isfinite(loss)


def test_preallocation_changes_no_weight_and_training_is_bit_identical():
    args = dqn.Args(res=8)
    setup = mu.amp("auto", "cpu")
    batch = real_batch()

    def train(preallocated: bool):
        q, target = make_nets(seed=5)
        optimizer = torch.optim.Adam(q.parameters(), lr=1e-3)
        weights = [p.detach().clone() for p in q.parameters()]
        if preallocated:
            dqn.preallocate(q, target, optimizer, setup, args, batch_size=8, device="cpu")
            assert all(torch.equal(a, b) for a, b in zip(weights, q.parameters()))
            assert all(p.grad is None for p in q.parameters())
            assert len(optimizer.state) == len(weights)  # Adam's moments exist already
            assert all(float(s["exp_avg"].abs().sum()) == 0.0 for s in optimizer.state.values())
        for _ in range(3):
            dqn.update(q, target, optimizer, batch, args, setup)
        return [p.detach().clone() for p in q.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(train(False), train(True)))
