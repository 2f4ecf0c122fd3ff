"""RL_* environment variables under the command line, and bad values refused before anything is written."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dqn_starcraft_split as dqn
from dqn_tiny import TINY_FLAGS

SCRIPT = Path(dqn.__file__)


def test_every_field_has_an_rl_variable_and_the_command_line_wins():
    args, sources = dqn.parse_args(
        ["--batch-size", "16", "--no-use-double-dqn"],
        {
            "RL_BATCH_SIZE": "32",
            "RL_LR_SCHEDULER": "step",
            "RL_USE_DOUBLE_DQN": "true",
            "RL_MIN_LR": "2e-6",
            "RL_SCHEDULER_TMAX": "50",
            "RL_SEEDS": "4 6 8",
            "RL_RUN_ID": "abc",
            "RL_SAVE_PATH": "out",
        },
    )
    assert args.batch_size == 16 and sources["batch_size"] == "command line"
    assert args.use_double_dqn is False and sources["use_double_dqn"] == "command line"
    assert args.lr_scheduler == "step" and sources["lr_scheduler"] == "RL_LR_SCHEDULER"
    assert args.min_lr == 2e-6 and args.scheduler_tmax == 50 and args.seeds == (4, 6, 8)
    assert (args.run_id, args.save_path) == ("abc", "out")
    assert args.learning_rate == 5e-5 and sources["learning_rate"] == "default"
    assert set(sources) == {f.name for f in dqn.dataclasses.fields(dqn.Args)}


def test_seed_defaults_are_the_long_run_recipe():
    args = dqn.with_map_defaults(dqn.parse_args([], {})[0])  # MoveToBeacon
    assert (args.num_episodes, args.buffer_size, args.exploration_steps, args.target_network_frequency) == (
        10_000,
        100_000,
        100_000,
        300,
    )
    assert (args.start_e, args.end_e, args.step_mul, args.learning_rate, args.res, args.batch_size) == (
        1.0,
        0.01,
        16,
        5e-5,
        32,
        8,
    )
    assert (
        args.use_double_dqn,
        args.lr_scheduler,
        args.min_lr,
        args.step_lr_step_size,
        args.step_lr_gamma,
    ) == (True, "cosine", 1e-6, 1000, 0.5)


@pytest.mark.parametrize(
    "env,needle",
    [
        ({"RL_BATCH_SIZE": "abc"}, "RL_BATCH_SIZE='abc' is not an integer"),
        ({"RL_BATCH_SIZE": "0"}, "batch_size must be at least 1, got 0 (from RL_BATCH_SIZE)"),
        ({"RL_USE_DOUBLE_DQN": "maybe"}, "RL_USE_DOUBLE_DQN='maybe' is not a boolean"),
        (
            {"RL_LR_SCHEDULER": "linear"},
            "RL_LR_SCHEDULER='linear' is not allowed; use one of cosine, step, none",
        ),
        ({"RL_MIN_LR": "1e-6x"}, "RL_MIN_LR='1e-6x' is not a number"),
    ],
)
def test_bad_rl_values_name_the_variable(env, needle):
    with pytest.raises(dqn.ConfigError, match=None) as error:
        dqn.parse_args([], env)
    assert needle in str(error.value)


def run_script(tmp_path, args, env_extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RL_")}
    env.update(env_extra)
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.parametrize(
    "args,env,needle",
    [
        ([], {"RL_BATCH_SIZE": "abc"}, "RL_BATCH_SIZE"),
        (["--res", "4"], {}, "res must be between 8 and 256"),
        (["--backend", "pysc2"], {"SC2PATH": "no-such-folder"}, "pysc2"),
    ],
)
def test_bad_values_exit_2_with_one_sentence_and_write_nothing(tmp_path, args, env, needle):
    result = run_script(tmp_path, args, env)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in result.stderr
    assert list(tmp_path.iterdir()) == []  # no run folder, no results, no TensorBoard events


def test_cpu_machine_ignores_the_gpu_wait_in_one_line():
    args = dqn.Args(wait_for_gpu_mb=1000, batch_size=8, fallback_batch_size=2)
    batch, fallback, line = dqn.wait_for_memory(args, dqn.torch.device("cpu"), dqn.mu.StopSignals())
    assert (batch, fallback) == (8, False) and "ignored: no CUDA device" in line


def test_gpu_wait_timeout_continues_with_the_fallback_batch(monkeypatch):
    calls = []
    monkeypatch.setattr(dqn.mu, "wait_for_gpu", lambda *a, **k: calls.append((a, k)) or False)
    args = dqn.Args(
        wait_for_gpu_mb=1000, wait_poll_s=1, wait_timeout_s=5, batch_size=8, fallback_batch_size=2
    )
    batch, fallback, line = dqn.wait_for_memory(args, dqn.torch.device("cuda"), dqn.mu.StopSignals())
    assert (batch, fallback) == (2, True) and "fallback batch size 2" in line
    assert calls[0][0] == (1000, 1, 5)


def test_a_stop_signal_ends_the_wait_for_gpu_memory_at_its_next_poll(monkeypatch):
    """SIGTERM while the run waits for GPU memory (up to --wait-timeout-s): the wait ends at its next poll, as
    RunInterrupted with exit status 143, before anything is built or written."""
    stop, polls = dqn.mu.StopSignals(), []

    def free_mb() -> float:  # never enough memory; the signal comes after the second look
        polls.append(1)
        if len(polls) == 2:
            stop.received.append(signal.SIGTERM)
        return 0.0

    real_wait = dqn.mu.wait_for_gpu
    monkeypatch.setattr(
        dqn.mu, "wait_for_gpu", lambda *a, **k: real_wait(*a, probe=free_mb, verbose=False, **k)
    )
    args = dqn.Args(wait_for_gpu_mb=1000, wait_poll_s=0.001, wait_timeout_s=5)
    with pytest.raises(dqn.RunInterrupted) as stopped:
        dqn.wait_for_memory(args, dqn.torch.device("cuda"), stop)
    assert stopped.value.exit_code == 128 + signal.SIGTERM and len(polls) == 2


@pytest.mark.parametrize("name, closest", [("RL_BATCHSIZE", "RL_BATCH_SIZE"), ("RL_EPS_DECAY", None)])
def test_an_unknown_rl_variable_is_refused_like_a_mistyped_flag(name, closest):
    with pytest.raises(dqn.ConfigError) as info:
        dqn.parse_args([], {name: "16"})
    message = str(info.value)
    assert message.startswith(f"{name} is not a setting of this script")
    assert (f"did you mean {closest}?" in message) if closest else ("see --help" in message)


@pytest.mark.parametrize(
    "argv, field",
    [
        (["--learning-starts", "0"], "learning_starts"),  # 3-step returns would bootstrap from an empty slot
        (["--buffer-size", "3", "--n-step", "3"], "buffer_size"),
        (["--batch-size", "4", "--fallback-batch-size", "8"], "fallback_batch_size"),
    ],
)
def test_settings_that_cannot_work_together_are_refused(argv, field):
    with pytest.raises(dqn.ConfigError, match=field):
        dqn.parse_args(argv, {})


def test_a_reused_run_id_is_refused_unless_overwrite(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RL_")}
    tiny = [
        *TINY_FLAGS,
        "--num-episodes",
        "1",
        "--num-test-episodes",
        "1",
        "--eval-every-episodes",
        "0",
        "--run-id",
        "same",
    ]
    first = subprocess.run(
        [sys.executable, str(SCRIPT), *tiny],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert first.returncode == 0, first.stderr[-2000:]
    config = (tmp_path / "results" / "same" / "config.json").read_text()
    again = subprocess.run(
        [sys.executable, str(SCRIPT), *tiny],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 2 and "Traceback" not in again.stderr
    assert (
        again.stderr.strip().startswith("error: run id 'same' already holds a run")
        and "--overwrite" in again.stderr
    )
    assert (tmp_path / "results" / "same" / "config.json").read_text() == config  # nothing touched
    replaced = subprocess.run(
        [sys.executable, str(SCRIPT), *tiny, "--overwrite", "--seed", "2"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert replaced.returncode == 0, replaced.stderr[-2000:]
    rows = (tmp_path / "results" / "results.csv").read_text().strip().splitlines()
    assert len(rows) == 2 and rows[1].split(",")[1] == "2"  # one row, the new run's (seed 2)


# One value per rule of dqn.RULES that breaks that rule.
BAD_VALUES = {
    "num_episodes": 0,
    "res": 4,
    "step_mul": 0,
    "screen_world_units": 0.0,
    "buffer_size": 3,
    "tower_channels": 0,
    "context_layers": -1,
    "fused_channels": 0,
    "player_channels": 0,
    "nonspatial_hidden": 0,
    "fine_gain": -1.0,
    "fine_kernel": 2,
    "move_through": 25.0,
    "learning_rate": 0.0,
    "batch_size": 0,
    "gamma": 1.5,
    "n_step": 0,
    "start_e": 1.5,
    "end_e": 2.0,
    "exploration_steps": 0,
    "learning_starts": 3,
    "train_frequency": 0,
    "target_network_frequency": 0,
    "max_grad_norm": 0.0,
    "scheduler_tmax": 0,
    "min_lr": 1.0,
    "step_lr_step_size": 0,
    "step_lr_gamma": 0.0,
    "num_test_episodes": 0,
    "test_epsilon": -0.1,
    "eval_every_episodes": -1,
    "num_eval_episodes": 0,
    "log_every_steps": 0,
    "torch_num_threads": 0,
    "time_limit_min": -1.0,
    "seed": -1,
    "seeds": (1, 1),
    "max_nonfinite": 0,
    "wait_for_gpu_mb": -1.0,
    "wait_poll_s": 0.0,
    "wait_timeout_s": -1.0,
    "fallback_batch_size": 9,
    "memory_log_every": 0,
    "leak_warmup_steps": -1,
    "memory_snapshot_every": -1,
    "snapshot_max_entries": 0,
    "gpu_memory_gb": 0.5,
    "replay_chunk_steps": 0,
    "checkpoint_minutes": -1.0,
    "checkpoint_every": -1,
}


def test_each_rule_refuses_its_bad_value_in_one_sentence():
    assert set(BAD_VALUES) == {field for field, _, _ in dqn.RULES}  # every rule is tried here
    assert dqn.Args().problems() == []
    for field, value in BAD_VALUES.items():
        problems = dict(dqn.Args(**{field: value}).problems())
        assert next(iter(problems)) == field, (
            field,
            problems,
        )  # (a zero learning rate also breaks min_lr's rule)
        sentence = problems[field]
        assert sentence.startswith(f"{field} must be ") and sentence.endswith(f", got {value!r}")
    assert (
        "larger than n_step (3)" in dqn.Args(buffer_size=3).problems()[0][1]
    )  # cross-field rules name the other


def test_a_setting_assigned_after_the_run_started_is_refused_at_once(tmp_path, monkeypatch, capsys):
    """`args.learning_rate = x` once the run has started would change nothing the optimizer reads: every Args a
    run holds is frozen, and the line fails at once in one sentence naming the flag to start the run with."""
    monkeypatch.chdir(tmp_path)
    seen = []

    def changes_a_setting(run):
        seen.append(run.args)
        run.args.learning_rate = 1e-3

    monkeypatch.setattr(dqn, "train_one_seed", changes_a_setting)
    assert dqn.main(*dqn.parse_args([*TINY_FLAGS, "--num-episodes", "1"], {})) == dqn.EXIT_CRASHED
    message = capsys.readouterr().err.strip()  # the crash's one paragraph names the refusal
    assert len(message.splitlines()) == 1 and "SettingFixed: args.learning_rate cannot change" in message
    assert "start the run with --learning-rate (or RL_LEARNING_RATE)" in message, message
    assert seen[0].learning_rate == 5e-5


def test_model_settings_reach_the_network():
    args = dqn.Args(
        res=8,
        tower_channels=4,
        fused_channels=6,
        context_layers=2,
        player_channels=2,
        nonspatial_hidden=5,
        fine_gain=3.0,
        fine_kernel=5,
    )
    net = dqn.make_q_network(**dqn.network_settings(args))
    assert net.screen_tower[0].out_channels == 4 and net.minimap_tower[2].out_channels == 4
    assert net.fuse[0].out_channels == 6 and net.player_embed[0].out_features == 2
    assert [conv.dilation for conv in net.context] == [(1, 1), (2, 2)]
    assert net.nonspatial_head.mlp[0].out_features == 5 and net.spatial_head.fine_gain == 3.0
    assert net.spatial_head.fine.kernel_size == (5, 5) and net.spatial_head.fine.padding == (2, 2)


def test_a_network_is_built_from_keywords_alone_without_args():
    """make_q_network needs no Args: keywords, the rest the map's defaults; an unknown setting is refused."""
    net = dqn.make_q_network(map_name="MoveToBeacon", res=8, fine_gain=5.0)
    assert net.res == 8 and net.spatial_head.fine_gain == 5.0 and len(net.context) == 0
    assert (
        dqn.make_q_network(map_name="CollectMineralShards", res=8, fine_gain=None).spatial_head.fine_gain
        == 30
    )
    with pytest.raises(TypeError, match="fine_gian"):
        dqn.make_q_network(res=8, fine_gian=5.0)


def test_network_settings_default_to_the_maps_own_and_a_given_value_wins():
    assert dqn.MAP_DEFAULTS == {
        "MoveToBeacon": {
            "context_layers": 0,
            "click_distance": False,
            "timer_input": False,
            "coarse_level": False,
            "fine_kernel": 3,
            "fine_gain": 10.0,
            "exploration_steps": 100_000,
            "select_own_only": False,
            "move_through": 0.0,
            "lr_scheduler": "cosine",
            "step_lr_step_size": 1000,
            "step_lr_gamma": 0.5,
        },
        "CollectMineralShards": {
            "context_layers": 3,
            "click_distance": True,
            "timer_input": True,
            "coarse_level": True,
            "fine_kernel": 1,
            "fine_gain": 30.0,
            "exploration_steps": 50_000,
            "select_own_only": True,
            "move_through": 1.5,
            "lr_scheduler": "step",
            "step_lr_step_size": 600,
            "step_lr_gamma": 0.2,
        },
    }
    for map_name, defaults in dqn.MAP_DEFAULTS.items():
        args = dqn.Args(res=8, map_name=map_name)
        assert args.problems() == [] and all(getattr(args, name) is None for name in defaults)
        filled = dqn.with_map_defaults(args)
        assert {name: getattr(filled, name) for name in defaults} == defaults
        net = dqn.make_q_network(**dqn.network_settings(args))
        assert len(net.context) == defaults["context_layers"]
        assert net.click_distance == defaults["click_distance"]
        assert net.player_embed[0].in_features == dqn.PLAYER_SIZE + defaults["timer_input"] + len(
            dqn.FUNCTIONS
        )
        assert net.spatial_head.coarse_level == defaults["coarse_level"]
        assert net.spatial_head.fine.kernel_size == (defaults["fine_kernel"],) * 2
        assert net.spatial_head.fine_gain == defaults["fine_gain"]
        given = dqn.Args(
            res=8,
            map_name=map_name,
            context_layers=1,
            click_distance=False,
            timer_input=True,
            coarse_level=True,
            fine_kernel=5,
            fine_gain=2.0,
            exploration_steps=7,
            move_through=0.75,
            select_own_only=not defaults["select_own_only"],
            lr_scheduler="none",
            step_lr_step_size=3,
            step_lr_gamma=0.9,
        )
        net = dqn.make_q_network(**dqn.network_settings(given))
        assert dqn.with_map_defaults(given) == given and len(net.context) == 1
        assert net.spatial_head.fine.kernel_size == (5, 5)
    parsed, sources = dqn.parse_args(["--map-name", "CollectMineralShards"], environ={})
    assert parsed.context_layers is None and sources["context_layers"] == "default"
    parsed, sources = dqn.parse_args(["--click-distance", "False"], environ={"RL_TIMER_INPUT": "1"})
    assert (parsed.click_distance, parsed.timer_input) == (False, True)
    assert (sources["click_distance"], sources["timer_input"]) == ("command line", "RL_TIMER_INPUT")


def test_the_timer_input_is_what_separates_two_states_that_differ_only_in_time_left():
    """The screen does not show the map's timer: with --timer-input the value of the same screen early and late
    in an episode differs, without it the two are one input."""
    env = dqn.BuiltinMiniGame("CollectMineralShards", res=8, step_mul=16, seed=0)
    obs = env.reset()
    late = {**obs, "game_loop": 1800}
    assert dqn.player_input(late)[-1] == pytest.approx(1800 / 1920) and dqn.player_input(obs)[-1] == 0.0
    for timer_input in (False, True):
        torch.manual_seed(0)
        net = dqn.SplitQNetwork(8, context_layers=0, timer_input=timer_input)
        torch.nn.init.normal_(net.player_embed[0].weight)  # a weight on every input, the timer's too
        q = [
            net(*dqn.to_tensors(dqn.obs_to_states(o), "cpu").values())[0] for o in (obs, late)
        ]  # non-spatial
        assert torch.equal(q[0], q[1]) != timer_input, timer_input


@pytest.mark.parametrize("res", [32, 30])
def test_with_coarse_level_the_full_resolution_term_alone_decides_where_to_click(res):
    """The fine term starts at zero, so a new network's spatial Q is its coarse term. With --coarse-level that is one
    value per spatial function, the same at every pixel, which still follows the state (a marine moved); without
    it the upsampled half-resolution map ranks the pixels too."""
    env = dqn.BuiltinMiniGame("CollectMineralShards", res=res, step_mul=16, seed=0)
    states = dqn.to_tensors(dqn.obs_to_states(env.reset()), "cpu")
    moved = states["screen"].clone()
    moved[0, 0, 20:22, 20:22] = 1  # a unit of ours appears: player_relative 1
    for coarse_level in (False, True):
        torch.manual_seed(0)
        net = dqn.SplitQNetwork(res, coarse_level=coarse_level)
        with torch.no_grad():
            q = [
                net(screen, states["minimap"], states["player"], states["mask"])[1]  # (B, S, H*W)
                for screen in (states["screen"], moved)
            ]
        assert (q[0].amax(2) == q[0].amin(2)).all().item() == coarse_level, coarse_level
        assert not torch.equal(q[0], q[1])


@pytest.mark.parametrize("fine_kernel", [1, 3])
def test_a_one_pixel_click_term_values_each_pixel_by_that_pixel_alone(fine_kernel):
    """With --fine-kernel 1 and the coarse term a level, a shard appearing beside a clicked pixel leaves that
    click's value alone; with 3 the neighbour counts."""
    env = dqn.BuiltinMiniGame("CollectMineralShards", res=16, step_mul=16, seed=0)
    states = dqn.to_tensors(dqn.obs_to_states(env.reset()), "cpu")
    screen = states["screen"].clone()
    screen[:, :, 2:7, 2:7] = 0  # empty ground around the clicked pixel (4, 4) ...
    beside = screen.clone()
    beside[0, 0, 4, 5] = 3  # ... and a shard (player_relative 3) on the next pixel
    torch.manual_seed(0)
    net = dqn.SplitQNetwork(16, coarse_level=True, fine_kernel=fine_kernel)
    torch.nn.init.normal_(net.spatial_head.fine.weight)
    with torch.no_grad():
        q = [
            net(s, states["minimap"], states["player"], states["mask"])[1].unflatten(2, (16, 16))
            for s in (screen, beside)
        ]
    q = [x - x[:, :, :1, :1] for x in q]  # relative to pixel (0, 0): the coarse level drops out
    change = (q[1][0, :, 4, 4] - q[0][0, :, 4, 4]).abs().max().item()  # a normal weight times the gain: ~10
    assert change < 1e-4 if fine_kernel == 1 else change > 0.1, change


@pytest.mark.parametrize("res", [32, 30])
def test_context_layers_let_a_click_see_marines_across_the_screen(res):
    """The value of clicking the top-left pixel changes when a marine appears 24 pixels away only with the
    context layers; without them a click sees about 4 pixels. (The change is small at initialisation, 1e-5 of
    a value of 0.1, but float32 rounding at that size is 1e-8.)"""
    change = {}
    for layers in (0, 3):
        torch.manual_seed(0)
        net = dqn.SplitQNetwork(res, context_layers=layers, coarse_level=False)  # a coarse term per pixel
        env = dqn.BuiltinMiniGame("CollectMineralShards", res=res, step_mul=16, seed=0)
        states = dqn.to_tensors(dqn.obs_to_states(env.reset()), "cpu")
        screen = states["screen"].clone()
        screen[:, :, :6, :6] = 0  # empty ground around the clicked pixel ...
        moved = screen.clone()
        moved[0, 0, 24:26, 24:26] = 1  # ... and a unit of ours appears far away: player_relative 1
        q = [
            net(s, states["minimap"], states["player"], states["mask"])[1][0, 0, 0].item()
            for s in (screen, moved)
        ]
        change[layers] = abs(q[1] - q[0])
    assert change[0] == 0.0 and change[3] > 1e-6, change
