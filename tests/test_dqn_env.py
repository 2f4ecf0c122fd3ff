"""Rules of the built-in StarCraft II minigames in dqn_starcraft_split.py."""

import numpy as np
import pytest
import torch

import dqn_starcraft_split as dqn

NO_OP, SELECT_ARMY, MOVE = dqn.FUNCTION_IDS["no_op"], dqn.FUNCTION_IDS["select_army"], dqn.MOVE_SCREEN
SELECT_POINT = dqn.SELECT_POINT


def to_pixel(env, world_xy):
    return tuple(int(v) for v in np.clip(np.asarray(world_xy) * env.res / env.world_units, 0, env.res - 1))


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
    assert dqn.action_mask(obs["available_actions"]).tolist() == [
        True,
        True,
        False,
        True,
    ]  # no Move_screen yet
    with pytest.raises(ValueError, match="not available"):
        env.step(MOVE, (3, 3))
    obs, _reward, _done = env.step(SELECT_ARMY)
    assert MOVE in obs["available_actions"]
    assert obs["feature_screen"][1].sum() >= 1  # the selected layer shows the marine
    assert dqn.action_mask(obs["available_actions"]).tolist() == [True, True, True, True]


@pytest.mark.parametrize("step_mul,expected", [(16, 120), (8, 240)])
def test_episode_lasts_120_game_seconds(step_mul, expected):
    env = dqn.BuiltinMiniGame("MoveToBeacon", res=16, step_mul=step_mul, seed=0)
    env.reset()
    steps, done = 0, False
    while not done:
        _, _, done = env.step(NO_OP)
        steps += 1
    assert steps == expected == 120 * 16 / step_mul  # the map's timer: 120 game seconds of 16 game loops


@pytest.mark.parametrize("res,step_mul", [(32, 16), (64, 8)])
def test_marine_walks_at_its_game_speed_on_pysc2s_screen_scale(res, step_mul):
    env = dqn.BuiltinMiniGame("MoveToBeacon", res=res, step_mul=step_mul, seed=0)
    env.reset()
    env.marines[:] = [3.0, 9.0]
    env.targets[:] = env.marines  # standing still
    env.pickups[:] = [[30.0, 30.0]]  # out of the way
    env.step(SELECT_ARMY)
    env.step(MOVE, (res - 1, int(9.0 * res / 24)))  # far to the right
    # 2.25 units per game second of 16 game loops (3.15 per "faster" second of 22.4 loops)
    walked = np.linalg.norm(env.marines[0] - [3.0, 9.0])
    assert walked == pytest.approx(2.25 * step_mul / 16)
    # pysc2's default camera is 24 world units wide: 3.0 pixels per step at res 32, step_mul 16 and at 64, 8
    pixel_size = env.screen_x[0, 1] - env.screen_x[0, 0]  # world units between the screen's pixel centres
    assert walked / pixel_size == pytest.approx(3.0)


def test_screen_world_units_setting_sets_the_scale_of_the_builtin_screen():
    """--screen-world-units 12 (a camera zoomed in twice) makes the same walk twice as many pixels."""
    env = dqn.make_env(dqn.Args(res=32, step_mul=16, screen_world_units=12.0), seed=0)
    env.reset()
    env.marines[:] = [1.0, 5.0]
    env.targets[:] = env.marines
    env.pickups[:] = [[30.0, 30.0]]
    env.step(SELECT_ARMY)
    env.step(MOVE, (31, 13))
    pixel_size = env.screen_x[0, 1] - env.screen_x[0, 0]
    assert pixel_size == pytest.approx(12.0 / 32)
    assert np.linalg.norm(env.marines[0] - [1.0, 5.0]) / pixel_size == pytest.approx(6.0)


def test_reaching_the_beacon_scores_and_respawns_it():
    env = dqn.BuiltinMiniGame("MoveToBeacon", res=32, step_mul=16, seed=3)
    env.reset()
    env.marines[:] = [6.0, 9.0]
    env.targets[:] = env.marines
    env.pickups[:] = [[10.0, 9.0]]  # 4 units away: the first step of 2.25 units ends 1.75 away, outside 1.25
    env.step(SELECT_ARMY)
    target = to_pixel(env, [10.0, 9.0])
    _, reward, _ = env.step(MOVE, target)
    assert reward == 0.0
    obs, reward, _ = env.step(NO_OP)  # the order keeps the marine walking
    assert reward == 1.0
    assert not np.allclose(env.pickups[0], [10.0, 9.0])  # a new beacon elsewhere
    assert np.linalg.norm(env.pickups[0] - env.marines[0]) >= dqn.BEACON_MIN_DISTANCE
    _ys, xs = np.nonzero(obs["feature_screen"][0] == 3)
    assert abs(xs.mean() - env.pickups[0][0] * 32 / env.world_units) < 2  # drawn where it now is


def test_beacon_spawns_where_the_map_script_puts_it():
    """At least 5 units from the marine, at the start and after every pickup, inside the map's spawn region."""
    env = dqn.BuiltinMiniGame("MoveToBeacon", res=32, step_mul=16, seed=0)
    x0, y0, x1, y1 = dqn.screen_rect(dqn.BEACON_SPAWN_WORLD, env.world_units)
    hole = np.array(dqn.world_to_screen_units(*dqn.BEACON_SPAWN_HOLE_WORLD[:2], env.world_units))
    distances = []
    for episode in range(100):
        env.reset()
        for pickup in range(3):
            beacon = env.pickups[0]
            distances.append(np.linalg.norm(beacon - env.marines[0]))
            assert x0 <= beacon[0] <= x1 and y0 <= beacon[1] <= y1
            assert np.linalg.norm(beacon - hole) >= dqn.BEACON_SPAWN_HOLE_WORLD[2]
            env.marines[:] = beacon  # walk onto it: the next step scores and respawns the beacon
            env.targets[:] = beacon
            assert env.step(NO_OP)[1] == 1.0
    assert min(distances) >= 5.0


def test_shards_spawn_at_least_2_units_from_every_marine():
    env = dqn.BuiltinMiniGame("CollectMineralShards", res=32, step_mul=16, seed=0)
    x0, y0, x1, y1 = dqn.screen_rect(dqn.SHARD_SPAWN_WORLD, env.world_units)
    closest = []
    for episode in range(30):
        env.reset()
        gaps = np.linalg.norm(env.pickups[:, None] - env.marines[None], axis=-1)  # (P, M)
        closest.append(gaps.min())
        assert (env.pickups[:, 0] >= x0).all() and (env.pickups[:, 0] <= x1).all()
        assert (env.pickups[:, 1] >= y0).all() and (env.pickups[:, 1] <= y1).all()
    assert min(closest) >= 2.0


def test_pysc2_minigame_geometry_on_the_screen():
    """The map's playable area lies on pysc2's 24-unit screen, shifted up by the camera's 3-unit pan south."""
    assert dqn.screen_rect(dqn.PLAYABLE_WORLD, dqn.Args.screen_world_units) == (1.0, 1.0, 23.0, 17.0)
    env = dqn.BuiltinMiniGame("CollectMineralShards", res=64, step_mul=8, seed=0)
    for _ in range(20):
        env.reset()
        assert (env.marines[:, 0] >= 1.0).all() and (env.marines[:, 0] <= 23.0).all()
        assert (env.marines[:, 1] >= 1.0).all() and (env.marines[:, 1] <= 17.0).all()


def test_collect_mineral_shards_rewards_each_shard_and_refills_the_field():
    env = dqn.BuiltinMiniGame("CollectMineralShards", res=32, step_mul=16, seed=0)
    obs = env.reset()
    assert len(env.marines) == 2 and len(env.pickups) == dqn.NUM_SHARDS
    assert obs["player"][8] == 2  # army_count
    env.step(SELECT_ARMY)
    env.marines[:] = [[6.0, 9.0], [6.0, 9.0]]
    env.targets[:] = env.marines
    env.pickups = np.array([[7.0, 9.0], [20.0, 9.0]])  # two shards left
    _, reward, _ = env.step(MOVE, to_pixel(env, [7.0, 9.0]))
    assert reward == 1.0 and len(env.pickups) == 1
    env.marines[:] = [[19.0, 9.0], [19.0, 9.0]]
    _, reward, _ = env.step(MOVE, to_pixel(env, [20.0, 9.0]))
    assert reward == 1.0
    assert len(env.pickups) == dqn.NUM_SHARDS  # all collected: a fresh field


def test_select_point_moves_two_marines_apart():
    """select_point + Move_screen on each marine: they walk to different places (select_army moves both)."""
    env = dqn.BuiltinMiniGame("CollectMineralShards", res=32, step_mul=16, seed=0)
    env.reset()
    env.marines[:] = [[8.3, 9.3], [16.3, 9.3]]  # each drawn on the pixel that holds its centre
    env.targets[:] = env.marines
    env.pickups = np.array([[30.0, 30.0]])  # out of the way
    left, right = to_pixel(env, [2.0, 9.0]), to_pixel(env, [22.0, 9.0])
    obs, _, _ = env.step(SELECT_POINT, to_pixel(env, env.marines[0]))
    assert env.selected.tolist() == [True, False]
    assert obs["feature_screen"][1][to_pixel(env, env.marines[0])[::-1]] == 1  # the selected layer shows it
    env.step(MOVE, left)
    env.step(SELECT_POINT, to_pixel(env, env.marines[1]))
    assert env.selected.tolist() == [False, True]
    env.step(MOVE, right)
    for _ in range(4):
        env.step(NO_OP)
    assert env.marines[0][0] < 3.0 and env.marines[1][0] > 21.0  # each at its own target
    assert np.linalg.norm(env.marines[0] - env.marines[1]) > 18.0


def test_select_point_on_bare_ground_selects_nothing():
    env = dqn.BuiltinMiniGame("CollectMineralShards", res=32, step_mul=16, seed=0)
    env.reset()
    env.marines[:] = [[8.0, 9.0], [16.0, 9.0]]
    obs, _, _ = env.step(SELECT_ARMY)
    assert MOVE in obs["available_actions"]
    obs, _, _ = env.step(SELECT_POINT, to_pixel(env, [12.0, 15.0]))
    assert not env.selected.any() and MOVE not in obs["available_actions"]
    with pytest.raises(ValueError, match="outside"):
        env.step(SELECT_POINT, (32, 0))


def test_scripted_agent_beats_random_agent_by_far():
    """Clicking on the beacon scores about 24 at step_mul 16 (26 at the paper's step_mul 8: the grandmaster's 28
    on the real map), a random agent about 1 (benchmark/results/dqn_replica_calibration.md)."""
    net = dqn.SplitQNetwork(32)

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
        return MOVE, (round(xs.mean()), round(ys.mean()))

    def random(env, obs, rng):
        return dqn.decode_action(dqn.select_action(net, obs, 1.0, rng, "cpu"), 32)

    scripted_mean = np.mean([play(scripted, s) for s in range(4)])
    random_mean = np.mean([play(random, s) for s in range(4)])
    assert 20 <= scripted_mean <= 30
    assert random_mean <= 4


def test_decode_action_covers_both_heads():
    assert dqn.decode_action(0, 8) == (NO_OP, None)
    assert dqn.decode_action(1, 8) == (SELECT_ARMY, None)
    assert dqn.decode_action(2 + 3 * 8 + 5, 8) == (MOVE, (5, 3))  # point index y * res + x
    assert dqn.decode_action(2 + 8 * 8 + 3 * 8 + 5, 8) == (SELECT_POINT, (5, 3))  # the second spatial map
    for index in (0, 1, 2 + 17, 2 + 64 + 17):
        assert dqn.encode_action(*dqn.decode_action(index, 8), 8) == index


def test_a_move_is_carried_past_the_chosen_pixel_on_the_line_from_the_selection():
    """--move-through: the Move_screen point sent to the game lies `through_pixels` beyond the chosen pixel, on
    the line from the centre of the selected pixels, rounded and kept on the screen; nothing else changes."""
    obs = {"feature_screen": np.zeros((4, 16, 16), np.int32)}
    obs["feature_screen"][dqn.SELECTED_LAYER, 4, 3:5] = 1  # two selected pixels: centre x 3.5, y 4
    move = lambda x, y: dqn.encode_action(MOVE, (x, y), 16)
    assert dqn.game_call(move(9, 4), obs, 16, 2.0) == (MOVE, (11, 4))  # straight on, 2 pixels further
    assert dqn.game_call(move(3, 12), obs, 16, 3.0) == (MOVE, (3, 15))  # (3 - 0.17, 12 + 2.99), rounded
    assert dqn.game_call(move(8, 9), obs, 16, 2.0) == (MOVE, (9, 10))  # (8 + 1.34, 9 + 1.49), rounded
    assert dqn.game_call(move(1, 4), obs, 16, 2.0) == (MOVE, (0, 4))  # backwards from the selection: -1 -> 0
    assert dqn.game_call(move(14, 4), obs, 16, 4.0) == (MOVE, (15, 4))  # kept on the screen
    assert dqn.game_call(move(9, 4), obs, 16, 0.0) == (MOVE, (9, 4))  # 0: where the head points
    select = dqn.encode_action(SELECT_POINT, (9, 4), 16)
    assert dqn.game_call(select, obs, 16, 2.0) == (SELECT_POINT, (9, 4))  # only moves are carried
    assert dqn.game_call(1, obs, 16, 2.0) == dqn.decode_action(1, 16)
    obs["feature_screen"][dqn.SELECTED_LAYER] = 0
    assert dqn.game_call(move(9, 4), obs, 16, 2.0) == (MOVE, (9, 4))  # no selection, no direction


def test_a_carried_click_on_a_shard_walks_the_marines_through_it_and_on():
    """What --move-through is for: a click on a shard, carried on, picks it up and keeps the marines walking,
    where a plain click stops them on it for the rest of the step."""
    ends = {}
    for through in (0.0, 2.0):
        env = dqn.BuiltinMiniGame("CollectMineralShards", res=32, step_mul=16, seed=0)
        env.reset()
        env.marines[:] = [[6.3, 12.3], [6.3, 12.3]]
        env.targets[:] = env.marines
        env.pickups = np.array([[12.3, 12.3], [40.0, 40.0]])  # one shard ahead, one out of the way
        obs, _, _ = env.step(SELECT_ARMY)
        shard = to_pixel(env, env.pickups[0])
        obs, score, _ = env.step(*dqn.game_call(dqn.encode_action(MOVE, shard, 32), obs, 32, through))
        for _ in range(3):  # one click, then the marines walk on their own
            obs, reward, _ = env.step(NO_OP)
            score += reward
        assert score == 1.0
        ends[through] = env.marines[0].copy()
    assert ends[0.0][0] == pytest.approx((shard[0] + 0.5) * 24 / 32)  # stopped on the shard's pixel
    assert ends[2.0][0] > ends[0.0][0] + 1.0 and ends[2.0][1] == pytest.approx(ends[0.0][1])


def test_exploration_draws_like_pysc2_random_agent():
    """A random action: a function uniformly among the available ones, then a point uniformly."""
    net = dqn.SplitQNetwork(8)
    env = dqn.BuiltinMiniGame("MoveToBeacon", res=8, step_mul=16, seed=0)
    rng = np.random.default_rng(0)
    unselected = env.reset()
    draws = np.array([dqn.select_action(net, unselected, 1.0, rng, "cpu") for _ in range(3000)])
    assert not ((draws >= 2) & (draws < 2 + 64)).any()  # Move_screen is not available yet
    assert abs(np.mean(draws == 0) - 1 / 3) < 0.04 and abs(np.mean(draws >= 2 + 64) - 1 / 3) < 0.04
    selected, _, _ = env.step(SELECT_ARMY)
    draws = np.array([dqn.select_action(net, selected, 1.0, rng, "cpu") for _ in range(4000)])
    move, select_point = (draws >= 2) & (draws < 2 + 64), draws >= 2 + 64
    assert abs(np.mean(draws == 0) - 1 / 4) < 0.04 and abs(np.mean(move) - 1 / 4) < 0.04
    assert abs(np.mean(select_point) - 1 / 4) < 0.04
    assert draws.max() < 2 + 2 * 8 * 8 and len(set(draws[move].tolist())) > 50


def test_calibration_variants_of_the_together_agent_aim_where_they_say():
    """benchmark/dqn_calibration.py: the agent that misses aims at the second-nearest shard as often as asked
    (never at 0, always at 1), the agent that clicks past the nearest shard clicks on its far side, on the
    line from the marines, and the carried agent sends its Move clicks as the DQN's --move-through does."""
    from benchmark.dqn_calibration import (
        CarriedClicks,
        ScriptedShardsMissing,
        ScriptedShardsPast,
        ScriptedShardsTogether,
        pixel,
    )

    env = dqn.BuiltinMiniGame("CollectMineralShards", res=32, step_mul=16, seed=3)
    obs = env.reset()
    obs, _, _ = env.step(SELECT_ARMY)
    rng = np.random.default_rng(0)
    centre = env.marines.mean(0)
    order = np.argsort(np.linalg.norm(env.pickups - centre, axis=1))
    nearest, second = pixel(env, env.pickups[order[0]]), pixel(env, env.pickups[order[1]])
    assert nearest != second
    assert ScriptedShardsTogether().act(env, obs, rng) == (MOVE, nearest)
    assert all(ScriptedShardsMissing(0.0).act(env, obs, rng) == (MOVE, nearest) for _ in range(20))
    assert all(ScriptedShardsMissing(1.0).act(env, obs, rng) == (MOVE, second) for _ in range(20))
    shares = [ScriptedShardsMissing(0.3).act(env, obs, rng)[1] == second for _ in range(2000)]
    assert abs(np.mean(shares) - 0.3) < 0.04
    function, (x, y) = ScriptedShardsPast(3.0).act(env, obs, rng)
    click = (np.array([x, y]) + 0.5) * env.world_units / env.res
    way, shard = env.pickups[order[0]] - centre, env.pickups[order[0]]
    along = np.dot(click - centre, way) / np.linalg.norm(way)
    assert (
        function == MOVE and along > np.linalg.norm(way) + 1.5
    )  # past the shard; a pixel rounds by < 1 unit
    assert np.linalg.norm(click - shard) < 3.0 + env.world_units / env.res  # by about 3 units, not anywhere
    carried = CarriedClicks(ScriptedShardsTogether(), 1.5).act(env, obs, rng)  # 2 pixels at res 32
    assert (
        carried == dqn.game_call(dqn.encode_action(MOVE, nearest, 32), obs, 32, 2.0) and carried[1] != nearest
    )
    assert CarriedClicks(ScriptedShardsTogether(), 1.5).act(env, env.reset(), rng) == (SELECT_ARMY, None)


def test_calibration_clustered_agent_trades_distance_for_neighbours():
    """benchmark/dqn_calibration.py: with no bonus the clustered agent is the together agent; with a bonus it
    aims at the shard whose distance minus the bonus per neighbour within 4 world units is least, which on this
    field is not the nearest."""
    from benchmark.dqn_calibration import ScriptedShardsClustered, ScriptedShardsTogether, neighbours, pixel

    env = dqn.BuiltinMiniGame("CollectMineralShards", res=32, step_mul=16, seed=3)
    obs = env.reset()
    obs, _, _ = env.step(SELECT_ARMY)
    rng = np.random.default_rng(0)
    # neighbours counts other shards closer than 4 units, never the shard itself
    apart = np.linalg.norm(env.pickups[:, None] - env.pickups[None], axis=2)
    assert neighbours(env, 4.0).tolist() == [int(((row < 4.0) & (row > 0)).sum()) for row in apart]
    assert ScriptedShardsClustered(0.0).act(env, obs, rng) == ScriptedShardsTogether().act(env, obs, rng)
    distance = np.linalg.norm(env.pickups - env.marines.mean(0), axis=1)
    bonus = 5.0
    aimed = int(np.argmin(distance - bonus * neighbours(env, 4.0)))
    assert aimed != int(distance.argmin())
    assert ScriptedShardsClustered(bonus).act(env, obs, rng) == (MOVE, pixel(env, env.pickups[aimed]))


def test_calibration_click_term_agents_click_the_nearest_shard_pixel_or_one_pixel_past_it():
    """benchmark/dqn_calibration.py: the click-term agent on the distance input clicks the shard pixel nearest to
    the selected marines' centre; on the past input, a pixel next to that shard pixel, farther from the marines,
    on the line from them through it."""
    from benchmark.dqn_calibration import ScriptedClickTerm

    env = dqn.BuiltinMiniGame("CollectMineralShards", res=32, step_mul=16, seed=3)
    obs = env.reset()
    rng = np.random.default_rng(0)
    assert ScriptedClickTerm(True).act(env, obs, rng) == (SELECT_ARMY, None)
    obs, _, _ = env.step(SELECT_ARMY)
    sel = np.argwhere(obs["feature_screen"][dqn.SELECTED_LAYER] > 0).mean(0)  # (y, x) in pixels
    shards = np.argwhere(obs["feature_screen"][0] == 3)
    nearest = shards[np.linalg.norm(shards - sel, axis=1).argmin()]
    function, (x, y) = ScriptedClickTerm(False).act(env, obs, rng)
    assert function == MOVE and (y, x) == tuple(nearest)
    function, (x, y) = ScriptedClickTerm(True).act(env, obs, rng)
    click = np.array([y, x])
    assert function == MOVE and np.abs(click - nearest).max() == 1  # the next pixel ...
    assert np.linalg.norm(click - sel) > np.linalg.norm(nearest - sel)  # ... beyond the shard ...
    way = (nearest - sel) / np.linalg.norm(nearest - sel)
    off_line = click - sel - np.dot(click - sel, way) * way
    assert np.linalg.norm(off_line) < 1.0  # ... within a pixel of the line through it


def test_select_own_only_draws_and_picks_select_point_on_our_marines_alone():
    """--select-own-only: a random select_point lands on a marine's pixel, and a greedy one too, even where the
    network values a click on bare ground (which would deselect everything) most."""
    env = dqn.BuiltinMiniGame("CollectMineralShards", res=16, step_mul=16, seed=1)
    obs = env.reset()
    own = set(np.flatnonzero(obs["feature_screen"][0] == dqn.SELF).tolist())
    assert 0 < len(own) < 16 * 16
    net = dqn.SplitQNetwork(16)
    rng = np.random.default_rng(0)
    select_base = 2 + 16 * 16  # select_point's map follows Move_screen's
    draws = [dqn.select_action(net, obs, 1.0, rng, "cpu", select_own_only=True) for _ in range(600)]
    clicked = {draw - select_base for draw in draws if draw >= select_base}
    assert len(clicked) > 1 and clicked <= own
    free = [
        draw - select_base
        for draw in (dqn.select_action(net, obs, 1.0, rng, "cpu") for _ in range(600))
        if draw >= select_base
    ]
    assert not set(free) <= own  # without the flag the points are drawn over the whole screen
    none_of_ours = {
        **obs,
        "feature_screen": np.where(obs["feature_screen"] == dqn.SELF, 0, obs["feature_screen"]),
    }
    draws = [dqn.select_action(net, none_of_ours, 1.0, rng, "cpu", select_own_only=True) for _ in range(300)]
    assert set(draws) == {0, 1}  # no_op and select_army; nothing selected yet, so no Move_screen either
    with torch.no_grad():
        fine = net.spatial_head.fine  # the full-resolution click term
        fine.bias[1] = 5.0  # select_point scores 150 (gain 30) at every pixel,
        fine.weight[1, 0, 0, 0] = 1.0  # and 30 more on bare ground (player_relative's channel 0)
    assert dqn.select_action(net, obs, 0.0, rng, "cpu") - select_base not in own
    assert dqn.select_action(net, obs, 0.0, rng, "cpu", select_own_only=True) - select_base in own
