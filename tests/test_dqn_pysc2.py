"""The pysc2 backend against pysc2's own SC2TestEnv (no game needed); skipped where pysc2 is not installed.

It runs in a child process: pysc2's protocol files need protobuf's pure-Python runtime, which is chosen when
protobuf is first imported, and other tests in this process have imported it already (TensorBoard).
"""

import importlib.util
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import dqn_starcraft_split as dqn

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("pysc2") is None,
    reason="pysc2 is not installed (pip install -r requirements-sc2.txt)",
)

CHILD = textwrap.dedent("""
    import numpy as np
    import dqn_starcraft_split as dqn
    sc2_env, actions = dqn.import_pysc2()
    from pysc2.env import mock_sc2_env
    from pysc2.lib import features

    res = 16
    interface = sc2_env.AgentInterfaceFormat(
        feature_dimensions=sc2_env.Dimensions(screen=res, minimap=res),
        camera_width_world_units=dqn.Args.screen_world_units)
    mock = mock_sc2_env.SC2TestEnv(map_name="MoveToBeacon", agent_interface_format=interface)
    mock.episode_length = 3
    env = dqn.Pysc2MiniGame(mock, res)
    obs = env.reset()
    assert obs["feature_screen"].shape == (len(dqn.SCREEN_LAYERS), res, res), obs["feature_screen"].shape
    assert obs["feature_minimap"].shape == (len(dqn.MINIMAP_LAYERS), res, res)
    assert obs["player"].shape == (11,)
    mask = dqn.action_mask(obs["available_actions"])
    # no_op, select_army, Move_screen (only with a selection), select_point (always offered by pysc2)
    assert mask.tolist() == [True, True, 331 in obs["available_actions"], True], mask

    # the real pysc2 layer order differs from ours: the adapter picks layers by name
    names = [f.name for f in sc2_env.features.SCREEN_FEATURES]
    assert names.index("player_relative") != 0

    rb = dqn.SplitReplayBuffer(10, res)
    net = dqn.SplitQNetwork(res)
    rng = np.random.default_rng(0)
    done, steps = False, 0
    while not done:
        action = dqn.select_action(net, obs, 0.0, rng, "cpu")
        next_obs, reward, done = env.step(*dqn.game_call(action, obs, res, 2.0))  # moves carried, as by default
        rb.add(obs, action, reward, done)
        obs, steps = next_obs, steps + 1
    assert steps == 3 and rb.num_transitions() == 3

    # every function of the action split by its pysc2 name, and each call is one that pysc2 turns into a game
    # action with the intended arguments
    for name in dqn.FUNCTIONS:
        assert actions.FUNCTIONS[dqn.FUNCTION_IDS[name]].name == name
    for function_id, point in [(0, None), (7, None), (331, (3, 5)), (2, (3, 5))]:
        env.step(function_id, point)
    game = features.Features(agent_interface_format=interface, map_size=(64, 64))
    click = game.transform_action(None, env.function_call(2, (3, 5)), skip_available=True)
    selection = click.action_feature_layer.unit_selection_point
    assert (selection.selection_screen_coord.x, selection.selection_screen_coord.y) == (3, 5)
    assert selection.type == 1  # select (replace the selection), not toggle or all-of-type
    move = game.transform_action(None, env.function_call(331, (3, 5)), skip_available=True)
    assert move.action_feature_layer.unit_command.target_screen_coord.x == 3
    army = game.transform_action(None, env.function_call(7), skip_available=True)
    assert army.action_ui.select_army.selection_add is False
    print("adapter ok")
""")


def test_adapter_against_sc2_test_env():
    root = Path(dqn.__file__).parent
    result = subprocess.run(
        [sys.executable, "-c", CHILD], cwd=root, capture_output=True, text=True, timeout=180
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "adapter ok" in result.stdout
