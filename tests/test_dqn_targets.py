"""The n-step Double-DQN target across the heads, the TD loss, and the per-episode learning-rate schedules."""

import math

import numpy as np
import pytest
import torch

import dqn_starcraft_split as dqn
import memory_utils as mu

# the schedules are stepped here without optimizer steps
pytestmark = pytest.mark.filterwarnings(r"ignore:Detected call of `lr_scheduler.step\(\)`")

# Two next states, 2 non-spatial functions (no_op, select_army), 4 screen points (res 2).
ONLINE_NS = torch.tensor([[1.0, 5.0], [2.0, 0.0]])
ONLINE_SP = torch.tensor([[0.0, 9.0, 1.0, 0.0], [3.0, 0.0, 0.0, 4.0]])
TARGET_NS = torch.tensor([[7.0, 2.0], [6.0, 1.0]])
TARGET_SP = torch.tensor([[8.0, 3.0, 0.0, 0.0], [0.0, 0.0, 10.0, 5.0]])
ALL_AVAILABLE = torch.tensor([[True, True, True], [True, True, True]])


class FixedQ(torch.nn.Module):
    """A 'network' returning fixed Q values, so the TD target and loss can be checked by hand: the non-spatial
    head's (B, F) and the spatial head's (B, S * P), its S functions being those the action mask has beyond F."""

    def __init__(self, q_ns, q_sp):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(()))
        self.q_ns, self.q_sp, self.res = q_ns, q_sp, 2

    def forward(self, screen, minimap, player, available):
        num_spatial = available.shape[1] - self.q_ns.shape[1]
        return [
            (self.q_ns * self.scale)[:, :, None],
            (self.q_sp * self.scale).unflatten(1, (num_spatial, -1)),
        ]


class NeverCalled(torch.nn.Module):
    def forward(self, *inputs):
        raise AssertionError("plain DQN must not ask the online network about the next state")


def states(mask):
    return {"screen": torch.zeros(2), "minimap": torch.zeros(2), "player": torch.zeros(2), "mask": mask}


def uncut(batch: dict) -> dict:
    """A hand-made batch as the replay samples one where no episode was cut short: no truncated flags, and the next
    state n steps on."""
    rewards = batch["rewards"]
    return batch | {
        "truncated": torch.zeros_like(rewards),
        "steps": torch.full((len(rewards),), rewards.shape[1]),
    }


def target_of(
    online, target, mask, rewards=None, dones=None, gamma=1.0, double=True, truncated=None, steps=None
):
    """dqn.td_target of two next states; with the default zero rewards and gamma 1 it is V(s')."""
    batch = uncut(
        {
            "next_obs": states(mask),
            "rewards": torch.zeros(2, 1) if rewards is None else torch.tensor(rewards),
            "dones": torch.zeros(2, 1) if dones is None else torch.tensor(dones),
        }
    )
    if truncated is not None:
        batch |= {"truncated": torch.tensor(truncated), "steps": torch.tensor(steps)}
    return dqn.td_target(online, target, batch, dqn.Args(gamma=gamma, use_double_dqn=double))


def test_double_dqn_online_selects_target_evaluates_both_heads():
    value = target_of(FixedQ(ONLINE_NS, ONLINE_SP), FixedQ(TARGET_NS, TARGET_SP), ALL_AVAILABLE)
    # state 0: online picks select_army (5) -> target 2; online picks point 1 (9) -> target 3; max = 3
    # state 1: online picks no_op (2) -> target 6; online picks point 3 (4) -> target 5; max = 6
    assert value.tolist() == [3.0, 6.0]


def test_plain_dqn_takes_the_target_maximum_of_both_heads():
    value = target_of(NeverCalled(), FixedQ(TARGET_NS, TARGET_SP), ALL_AVAILABLE, double=False)
    assert value.tolist() == [8.0, 10.0]  # max(7, 8) and max(6, 10)


def test_unavailable_actions_never_bootstrap():
    mask = torch.tensor([[True, False, True], [True, True, False]])  # s0: no select_army; s1: no Move_screen
    value = target_of(FixedQ(ONLINE_NS, ONLINE_SP), FixedQ(TARGET_NS, TARGET_SP), mask)
    # s0: online restricted to no_op -> target 7; spatial point 1 -> 3; max = 7
    # s1: non-spatial only: online picks no_op -> 6
    assert value.tolist() == [7.0, 6.0]


# Two spatial functions (Move_screen, select_point) of 2 points each: the spatial head gives a map per function.
ONLINE_SP2 = torch.tensor([[0.0, 9.0, 1.0, 0.0], [3.0, 0.0, 0.0, 4.0]])  # (B, S*H*W): Move 0..1, select 2..3
TARGET_SP2 = torch.tensor([[8.0, 3.0, 0.0, 2.0], [0.0, 1.0, 10.0, 5.0]])


def test_each_spatial_function_bootstraps_from_its_own_map():
    online, target = FixedQ(ONLINE_NS, ONLINE_SP2), FixedQ(TARGET_NS, TARGET_SP2)
    mask = torch.tensor([[True, True, True, True], [True, True, False, True]])  # s1: no Move_screen
    # s0: select_army -> 2; Move: online point 1 (9) -> 3; select_point: online point 0 (1) -> 0; max = 3
    # s1: no_op -> 6; Move unavailable (its target 1 never counts); select_point: online point 1 (4) -> 5; max = 6
    assert target_of(online, target, mask).tolist() == [3.0, 6.0]
    mask = torch.tensor([[True, True, False, False], [False, False, False, True]])
    assert target_of(online, target, mask).tolist() == [
        2.0,
        5.0,
    ]  # s0: select_army only; s1: select_point only
    plain = target_of(NeverCalled(), target, torch.ones(2, 4, dtype=torch.bool), double=False)
    assert plain.tolist() == [8.0, 10.0]


def test_masked_q_masks_each_spatial_map_by_its_function():
    mask = torch.tensor([[True, False, False, True]])
    q = dqn.masked_q(
        [torch.tensor([[[1.0], [2.0]]]), torch.tensor([[[3.0, 4.0], [5.0, 6.0]]])], mask, [None, None]
    )
    low = torch.finfo(q.dtype).min
    assert q.tolist() == [[1.0, low, low, low, 5.0, 6.0]]


def test_td_target_hand_computed():
    target = target_of(
        FixedQ(ONLINE_NS, ONLINE_SP),
        FixedQ(TARGET_NS, TARGET_SP),
        ALL_AVAILABLE,
        rewards=[[1.0], [0.0]],
        dones=[[0.0], [1.0]],
        gamma=0.9,
    )
    assert target.tolist() == pytest.approx([1.0 + 0.9 * 3.0, 0.0])  # the terminal state does not bootstrap


def test_n_step_target_sums_discounted_rewards_and_stops_at_the_episode_end():
    rewards = [[1.0, 2.0, 4.0], [1.0, 2.0, 4.0]]
    dones = [[0.0, 0.0, 0.0], [0.0, 1.0, 0.0]]  # state 1's episode ends after its second step
    target = target_of(
        FixedQ(ONLINE_NS, ONLINE_SP),
        FixedQ(TARGET_NS, TARGET_SP),
        ALL_AVAILABLE,
        rewards=rewards,
        dones=dones,
        gamma=0.5,
    )
    # V(s') = 3 and 6 as in the double-DQN example; s1's third reward belongs to the next episode
    assert target.tolist() == pytest.approx([1 + 0.5 * 2 + 0.25 * 4 + 0.125 * 3.0, 1 + 0.5 * 2])


def test_an_episode_cut_short_bootstraps_from_its_last_state_after_its_own_rewards():
    """State 0's episode was cut short (the game gave a non-finite value) two steps on: its window holds that
    episode's last state alone (truncated, no reward of its own) and then the next episode's reward. The target is
    its two rewards, then gamma^2 times the value of that last state, which the replay hands as the next state."""
    rewards = [[1.0, 2.0, 0.0], [1.0, 2.0, 4.0]]
    truncated = [[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]
    target = target_of(
        FixedQ(ONLINE_NS, ONLINE_SP),
        FixedQ(TARGET_NS, TARGET_SP),
        ALL_AVAILABLE,
        rewards=rewards,
        dones=[[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]],
        gamma=0.5,
        truncated=truncated,
        steps=[2, 3],
    )
    assert target.tolist() == pytest.approx([1 + 0.5 * 2 + 0.25 * 3.0, 1 + 0.5 * 2 + 0.25 * 4 + 0.125 * 6.0])
    # a terminal before the cut: nothing to bootstrap, the cut belongs to the next episode
    terminal_first = target_of(
        FixedQ(ONLINE_NS, ONLINE_SP),
        FixedQ(TARGET_NS, TARGET_SP),
        ALL_AVAILABLE,
        rewards=rewards,
        dones=[[1.0, 0.0, 0.0], [0.0, 0.0, 0.0]],
        gamma=0.5,
        truncated=truncated,
        steps=[2, 3],
    )
    assert terminal_first.tolist()[0] == pytest.approx(1.0)


def test_the_replay_never_starts_a_transition_at_a_cut_episodes_end_and_bootstraps_there():
    """An episode of 3 stored steps cut short at its 4th state, then a new one: no sampled transition starts at
    the cut's slot, and each whose n steps reach it bootstraps from that state, after the steps before it."""
    env = dqn.BuiltinMiniGame("MoveToBeacon", res=8, step_mul=16, seed=0)
    rb = dqn.SplitReplayBuffer(50, 8)
    obs = env.reset()
    for step in range(3):
        next_obs, _, _ = env.step(0)
        rb.add(obs, 0, 1.0 + step, False)  # rewards 1, 2, 3 name slots 0, 1, 2
        obs = next_obs
    rb.cut(obs)  # the 4th state: the episode ends there
    last_state = dqn.player_input(obs)
    obs = env.reset()
    for step in range(6):
        next_obs, _, _ = env.step(0)
        rb.add(obs, 0, 10.0 + step, False)
        obs = next_obs
    sample = rb.sample(2000, np.random.default_rng(0), n_step=3)
    assert not np.any(sample["truncated"][:, 0]), "a transition started at the cut episode's last state"
    starts = sample["rewards"][:, 0]
    for reward, steps in ((1.0, 3), (2.0, 2), (3.0, 1)):
        drawn = np.flatnonzero(starts == reward)
        assert len(drawn) > 0 and set(sample["steps"][drawn].tolist()) == {steps}, reward
        for b in drawn:
            assert np.array_equal(sample["next_obs"]["player"][b], last_state)
    assert set(sample["steps"][starts >= 10.0].tolist()) == {3}


def test_td_loss_takes_each_transition_from_the_head_its_action_came_from():
    online = FixedQ(
        torch.tensor([[1.0, 5.0], [2.0, 0.0]]), torch.tensor([[0.0, 9.0, 1.0, 0.0], [3.0, 0.0, 0.0, 4.0]])
    )
    target = FixedQ(TARGET_NS, TARGET_SP)
    batch = uncut(
        {
            "obs": states(ALL_AVAILABLE),
            "next_obs": states(ALL_AVAILABLE),
            "actions": torch.tensor([1, 2 + 3]),  # select_army; point 3
            "rewards": torch.tensor([[1.0], [0.0]]),
            "dones": torch.tensor([[0.0], [0.0]]),
        }
    )
    loss, q_taken = dqn.td_loss(online, target, batch, dqn.Args(gamma=0.5))
    assert q_taken.tolist() == [5.0, 4.0]
    targets = [1.0 + 0.5 * 3.0, 0.0 + 0.5 * 6.0]  # V(s') as in the double-DQN example above
    errors = [5.0 - targets[0], 4.0 - targets[1]]  # 2.5 and 1.0: Huber = |e| - 0.5 for |e| >= 1
    assert loss.item() == pytest.approx(sum(abs(e) - 0.5 for e in errors) / 2)


def lrs_per_episode(args, episodes):
    optimizer = torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))], lr=args.learning_rate)
    scheduler = dqn.make_scheduler(optimizer, dqn.with_map_defaults(args))
    out = []
    for _ in range(episodes):
        out.append(optimizer.param_groups[0]["lr"])
        if scheduler is not None:
            scheduler.step()
    return out


def test_cosine_schedule_per_episode_defaults_to_the_episode_count():
    args = dqn.Args(num_episodes=10, learning_rate=1e-3, min_lr=1e-5)
    lrs = lrs_per_episode(args, 11)
    expected = [1e-5 + (1e-3 - 1e-5) * (1 + math.cos(math.pi * e / 10)) / 2 for e in range(11)]
    assert lrs == pytest.approx(expected, rel=1e-6)
    assert lrs[-1] == pytest.approx(1e-5)


def test_cosine_schedule_with_explicit_tmax():
    args = dqn.Args(num_episodes=100, scheduler_tmax=4, learning_rate=1e-3, min_lr=0.0)
    assert lrs_per_episode(args, 5) == pytest.approx([1e-3, 8.535534e-4, 5e-4, 1.464466e-4, 0.0], abs=1e-9)


def test_step_schedule_halves_every_step_size_episodes():
    args = dqn.Args(lr_scheduler="step", learning_rate=1e-3, step_lr_step_size=3, step_lr_gamma=0.5)
    assert lrs_per_episode(args, 7) == pytest.approx([1e-3] * 3 + [5e-4] * 3 + [2.5e-4])


def test_no_schedule_keeps_the_rate():
    assert lrs_per_episode(dqn.Args(lr_scheduler="none", learning_rate=3e-4), 5) == [3e-4] * 5


def test_nonspatial_head_reads_the_available_actions():
    """The first state of an episode (army not selected) and the same screen with Move_screen available must
    be told apart by the head that chooses between no_op and select_army."""
    torch.manual_seed(0)
    net = dqn.SplitQNetwork(8)
    screen = torch.zeros(1, len(dqn.SCREEN_LAYERS), 8, 8, dtype=torch.int16)
    minimap = torch.zeros(1, len(dqn.MINIMAP_LAYERS), 8, 8, dtype=torch.int16)
    player = torch.zeros(1, dqn.PLAYER_INPUT_SIZE)
    with torch.no_grad():
        unselected, _ = net(screen, minimap, player, torch.tensor([[True, True, False, True]]))  # (1, F, 1)
        selected, _ = net(screen, minimap, player, torch.tensor([[True, True, True, True]]))
    assert not torch.allclose(unselected, selected)


def test_select_own_only_keeps_select_point_off_pixels_without_our_units():
    """With --select-own-only, select_point bootstraps and acts only at pixels of our own units (player_relative
    1); Move_screen everywhere; a state with none of ours on the screen has no select_point at all."""
    screen = torch.zeros(2, 4, 1, 2, dtype=torch.int16)  # res 2, laid out as 1 x 2 so that pixel k is x = k
    screen[0, 0, 0, 0] = dqn.SELF  # s0: our unit on pixel 0, a shard (neutral, 3) on pixel 1
    screen[0, 0, 0, 1] = 3
    screen[1, 0, 0, 1] = 3  # s1: a shard and nothing of ours
    points = dqn.point_masks(
        screen, True
    )  # per head: none for the non-spatial one, Move_screen, select_point
    assert points[0] is None
    assert points[1].tolist() == [[[True, True], [True, False]], [[True, True], [False, False]]]
    assert dqn.point_masks(screen, False) == [None, None]

    # 2 non-spatial functions, then Move_screen's 2 points, then select_point's 2 points
    online_ns, target_ns = torch.tensor([[0.0, 0.0], [0.0, 0.0]]), torch.tensor([[1.0, 1.0], [1.0, 1.0]])
    online_sp = torch.tensor([[0.0, 1.0, 2.0, 9.0], [0.0, 1.0, 0.0, 9.0]])
    target_sp = torch.tensor([[0.0, 3.0, 4.0, 50.0], [0.0, 2.0, 70.0, 60.0]])
    batch = uncut(
        {
            "next_obs": {
                "screen": screen,
                "minimap": torch.zeros(2),
                "player": torch.zeros(2),
                "mask": torch.ones(2, 4, dtype=torch.bool),
            },
            "rewards": torch.zeros(2, 1),
            "dones": torch.zeros(2, 1),
        }
    )
    online, target = FixedQ(online_ns, online_sp), FixedQ(target_ns, target_sp)

    def value(select_own_only):
        args = dqn.Args(gamma=1.0, select_own_only=select_own_only)
        return dqn.td_target(online, target, batch, args).tolist()

    assert value(False) == [50.0, 60.0]  # select_point on the shard pixel, which would deselect everything
    # s0: Move's point 1 -> 3, select_point only on pixel 0 -> 4; s1: Move -> 2, and no select_point at all
    assert value(True) == [4.0, 2.0]
    q = dqn.masked_q(online(*batch["next_obs"].values()), torch.ones(2, 4, dtype=torch.bool), points)
    low = torch.finfo(q.dtype).min
    assert q.tolist() == [[0.0, 0.0, 0.0, 1.0, 2.0, low], [0.0, 0.0, 0.0, 1.0, low, low]]


def test_the_heads_number_the_flat_actions_head_after_head():
    """Each head of HEADS gives Q (B, F, P) for its F functions and P points, in the order of HEADS, and the flat
    index that decode_action reads and encode_action writes counts through them in that order."""
    res = 8
    net = dqn.SplitQNetwork(res)
    states = dqn.to_tensors(dqn.obs_to_states(dqn.BuiltinMiniGame("MoveToBeacon", res, 16, 0).reset()), "cpu")
    with torch.no_grad():
        qs = net(*states.values())
    assert [tuple(q.shape) for q in qs] == [(1, len(h.functions), h.points(res)) for h in dqn.HEADS]
    assert all(any(head is module for module in net.children()) for head in net.heads)  # all of them trained
    total = sum(q.shape[1] * q.shape[2] for q in qs)
    decoded = [dqn.decode_action(index, res) for index in range(total)]
    assert [dqn.encode_action(*call, res) for call in decoded] == list(range(total))
    names = [name for head in dqn.HEADS for name in head.functions for _ in range(head.points(res))]
    assert [call[0] for call in decoded] == [dqn.FUNCTION_IDS[name] for name in names]
    with pytest.raises(ValueError):
        dqn.decode_action(total, res)


def seeded_training(map_name: str, updates: int = 4) -> list[tuple[float, float, float]]:
    """td_loss, q_values and grad_norm of the first updates of a seeded tiny training (res 8, batch 8)."""
    torch.set_num_threads(1)
    args = dqn.with_map_defaults(dqn.Args(res=8, map_name=map_name, n_step=3, batch_size=8))
    torch.manual_seed(0)
    q, target = (
        dqn.make_q_network(**dqn.network_settings(args)),
        dqn.make_q_network(**dqn.network_settings(args)),
    )
    target.load_state_dict(q.state_dict())
    optimizer = torch.optim.Adam(q.parameters(), lr=1e-3)
    env, rng = dqn.BuiltinMiniGame(map_name, res=8, step_mul=16, seed=0), np.random.default_rng(0)
    rb = dqn.SplitReplayBuffer(200, 8)
    obs = env.reset()
    for _ in range(150):
        action = dqn.select_action(q, obs, 0.5, rng, "cpu", args.select_own_only)
        next_obs, reward, done = env.step(*dqn.game_call(action, obs, 8))
        rb.add(obs, action, reward, done)
        obs = env.reset() if done else next_obs
    losses = []
    for _ in range(updates):
        batch = dqn.batch_to_device(rb.sample(8, rng, 3), "cpu")
        metrics = dqn.update(q, target, optimizer, batch, args, mu.amp("off", "cpu"))
        losses.append(
            tuple(metrics[key].item() for key in ("losses/td_loss", "losses/q_values", "losses/grad_norm"))
        )
    return losses


# What seeded_training gave when these values were recorded, with one torch thread (on a 2-core x86 CPU the same
# to the last bit): an edit that means to change no number (a refactoring) keeps them. The comparison allows
# another CPU's rounding (1e-5), not a change of the algorithm.
RECORDED_LOSSES = {
    "MoveToBeacon": [
        (0.009339140728116035, 0.18871401250362396, 0.5754501819610596),
        (0.0015055574476718903, 0.16095490753650665, 1.015720248222351),
        (0.0014465824933722615, 0.166518434882164, 0.6115601658821106),
        (0.0009697407949715853, 0.22265248000621796, 0.7070409655570984),
    ],
    "CollectMineralShards": [
        (0.03378209099173546, 0.1807796061038971, 4.812361240386963),
        (0.03432721644639969, 0.12412284314632416, 2.972299098968506),
        (0.017571713775396347, 0.15212088823318481, 4.85036563873291),
        (0.014517167583107948, 0.18547633290290833, 3.129248857498169),
    ],
}


@pytest.mark.parametrize("map_name", sorted(RECORDED_LOSSES))
def test_a_seeded_tiny_training_gives_the_recorded_losses(map_name):
    threads = torch.get_num_threads()
    try:
        losses = seeded_training(map_name)
    finally:
        torch.set_num_threads(threads)
    assert losses == [pytest.approx(row, rel=1e-5) for row in RECORDED_LOSSES[map_name]]
