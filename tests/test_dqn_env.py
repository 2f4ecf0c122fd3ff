"""Rules of the built-in StarCraft II minigames in dqn_starcraft_split.py."""

import numpy as np
import pytest

import dqn_starcraft_split as dqn

NO_OP, SELECT_ARMY, MOVE = dqn.FUNCTION_IDS["no_op"], dqn.FUNCTION_IDS["select_army"], dqn.MOVE_SCREEN


def to_pixel(env, world_xy):
    return tuple(
        int(v) for v in np.clip(np.asarray(world_xy) * env.res / dqn.SCREEN_WORLD_UNITS, 0, env.res - 1)
    )


def test_observation_has_pysc2_shapes():
    env = dqn.BuiltinMiniGame("MoveToBeacon", res=32, step_mul=16, seed=0)
    obs = env.reset()
    assert obs["feature_screen"].shape == (len(dqn.SCREEN_LAYERS), 32, 32)
    assert obs["feature_minimap"].shape == (len(dqn.MINIMAP_LAYERS), 32, 32)
    assert obs["player"].shape == (11,)
    screen = dict(zip([layer.name for layer in dqn.SCREEN_LAYERS], obs["feature_screen"]))
    assert (screen["player_relative"] == 1).sum() >= 1  # the marine
    assert (screen["player_relative"] == 3).sum() >= 1  # the beacon
    assert screen["unit_density"].max() >= 1
    assert screen["selected"].sum() == 0  # nothing selected at the start
    for layer, values in zip(dqn.SCREEN_LAYERS, obs["feature_screen"]):
        assert 0 <= values.min() and values.max() < layer.scale


def test_unavailable_actions_are_refused():
    env = dqn.BuiltinMiniGame("MoveToBeacon", res=32, step_mul=16, seed=0)
    obs = env.reset()
    assert MOVE not in obs["available_actions"]
    with pytest.raises(ValueError, match="not available"):
        env.step(MOVE, (3, 3))
    obs, reward, done = env.step(SELECT_ARMY)
    assert MOVE in obs["available_actions"]
    assert obs["feature_screen"][1].sum() >= 1  # the selected layer shows the marine
    assert dqn.action_mask(obs["available_actions"]).tolist() == [True, True, True]


@pytest.mark.parametrize("step_mul,expected", [(16, 120), (8, 240)])
def test_episode_lasts_120_game_seconds(step_mul, expected):
    env = dqn.BuiltinMiniGame("MoveToBeacon", res=16, step_mul=step_mul, seed=0)
    env.reset()
    steps, done = 0, False
    while not done:
        _, _, done = env.step(NO_OP)
        steps += 1
    assert steps == expected == 120 * 16 / step_mul  # the map's timer: 120 game seconds of 16 game loops


def test_marine_walks_at_its_game_speed():
    env = dqn.BuiltinMiniGame("MoveToBeacon", res=32, step_mul=16, seed=0)
    env.reset()
    env.marines[:] = [5.0, 20.0]
    env.targets[:] = env.marines  # standing still
    env.pickups[:] = [[35.0, 35.0]]  # out of the way
    env.step(SELECT_ARMY)
    env.step(MOVE, (31, 16))  # far to the right
    # 3.15 units per second at "faster" (22.4 game loops): 2.25 units in 16 game loops
    assert np.linalg.norm(env.marines[0] - [5.0, 20.0]) == pytest.approx(3.15 * 16 / 22.4)


def test_reaching_the_beacon_scores_and_respawns_it():
    env = dqn.BuiltinMiniGame("MoveToBeacon", res=32, step_mul=16, seed=3)
    env.reset()
    env.marines[:] = [10.0, 20.0]
    env.targets[:] = env.marines
    env.pickups[:] = [[14.0, 20.0]]  # 4 units away: two steps of 2.25 units
    env.step(SELECT_ARMY)
    target = to_pixel(env, [14.0, 20.0])
    _, reward, _ = env.step(MOVE, target)
    assert reward == 0.0
    obs, reward, _ = env.step(NO_OP)  # the order keeps the marine walking
    assert reward == 1.0
    assert not np.allclose(env.pickups[0], [14.0, 20.0])  # a new beacon elsewhere
    assert np.linalg.norm(env.pickups[0] - env.marines[0]) > dqn.MARINE_RADIUS + dqn.BEACON_RADIUS
    ys, xs = np.nonzero(obs["feature_screen"][0] == 3)
    assert abs(xs.mean() - env.pickups[0][0] * 32 / dqn.SCREEN_WORLD_UNITS) < 2  # drawn where it now is


def test_collect_mineral_shards_rewards_each_shard_and_refills_the_field():
    env = dqn.BuiltinMiniGame("CollectMineralShards", res=32, step_mul=16, seed=0)
    obs = env.reset()
    assert len(env.marines) == 2 and len(env.pickups) == dqn.NUM_SHARDS
    assert obs["player"][8] == 2  # army_count
    env.step(SELECT_ARMY)
    env.marines[:] = [[10.0, 14.0], [10.0, 14.0]]
    env.targets[:] = env.marines
    env.pickups = np.array([[11.0, 14.0], [24.0, 14.0]])  # two shards left
    _, reward, _ = env.step(MOVE, to_pixel(env, [11.0, 14.0]))
    assert reward == 1.0 and len(env.pickups) == 1
    env.marines[:] = [[23.0, 14.0], [23.0, 14.0]]
    _, reward, _ = env.step(MOVE, to_pixel(env, [24.0, 14.0]))
    assert reward == 1.0
    assert len(env.pickups) == dqn.NUM_SHARDS  # all collected: a fresh field


def test_scripted_agent_beats_random_agent_by_far():
    """The calibration the constants' comment claims: clicking on the beacon scores ~27, random ~1."""

    def play(policy, seed):
        env = dqn.BuiltinMiniGame("MoveToBeacon", res=32, step_mul=16, seed=seed)
        rng = np.random.default_rng(seed)
        obs, done, score = env.reset(), False, 0.0
        while not done:
            obs, reward, done = env.step(*policy(env, obs, rng))
            score += reward
        return score

    def scripted(env, obs, rng):
        if MOVE not in obs["available_actions"]:
            return SELECT_ARMY, None
        ys, xs = np.nonzero(obs["feature_screen"][0] == 3)
        return MOVE, (int(round(xs.mean())), int(round(ys.mean())))

    def uniform(env, obs, rng):
        mask = dqn.action_mask(obs["available_actions"])
        index = rng.integers(0, 2 + (32 * 32 if mask[-1] else 0))
        return dqn.decode_action(int(index), 32)

    scripted_mean = np.mean([play(scripted, s) for s in range(4)])
    random_mean = np.mean([play(uniform, s) for s in range(4)])
    assert 22 <= scripted_mean <= 32
    assert random_mean <= 4


def test_decode_action_covers_both_heads():
    assert dqn.decode_action(0, 8) == (NO_OP, None)
    assert dqn.decode_action(1, 8) == (SELECT_ARMY, None)
    assert dqn.decode_action(2 + 3 * 8 + 5, 8) == (MOVE, (5, 3))  # point index y * res + x


def test_exploration_draws_like_pysc2_random_agent():
    """A random action: a function uniformly among the available ones, then a point uniformly."""
    net = dqn.SplitQNetwork(8)
    env = dqn.BuiltinMiniGame("MoveToBeacon", res=8, step_mul=16, seed=0)
    rng = np.random.default_rng(0)
    unselected = env.reset()
    draws = [dqn.select_action(net, unselected, 1.0, rng, "cpu") for _ in range(300)]
    assert set(draws) == {0, 1}  # Move_screen is not available yet
    selected, _, _ = env.step(SELECT_ARMY)
    draws = np.array([dqn.select_action(net, selected, 1.0, rng, "cpu") for _ in range(3000)])
    assert abs(np.mean(draws == 0) - 1 / 3) < 0.04 and abs(np.mean(draws >= 2) - 1 / 3) < 0.04
    assert draws.max() < 2 + 8 * 8 and len(set(draws[draws >= 2].tolist())) > 50
