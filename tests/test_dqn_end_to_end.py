"""Tiny complete runs of dqn_starcraft_split.py: every output file, and what an interrupted run leaves."""

import csv
import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import dqn_starcraft_split as dqn
import memory_utils as mu
from dqn_tiny import TINY_FLAGS

SCRIPT = Path(dqn.__file__)
TINY = TINY_FLAGS


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if not k.startswith("RL_")}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true", **extra)
    return env


@pytest.mark.slow
def test_tiny_run_over_two_seeds_writes_every_output(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            *TINY,
            "--num-episodes",
            "2",
            "--seeds",
            "4",
            "6",
            "--run-id",
            "tiny",
            "--track",
            "--memory-probes",
        ],
        cwd=tmp_path,
        env=clean_env(RL_BATCH_SIZE="4", RL_LR_SCHEDULER="step"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    results = tmp_path / "results"
    with open(results / "results.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["run_id"] for r in rows] == ["tiny-seed4", "tiny-seed6"]
    assert [r["seed"] for r in rows] == ["4", "6"]
    assert set(rows[0]) == set(dqn.RESULTS_COLUMNS)
    assert (
        rows[0]["batch_size"] == "4"
        and rows[0]["lr_scheduler"] == "step"
        and rows[0]["fallback_used"] == "False"
    )
    assert (
        rows[0]["use_double_dqn"] == "True"
        and rows[0]["episodes"] == "2"
        and rows[0]["map_name"] == "MoveToBeacon"
    )

    run = results / "tiny-seed4"
    config = json.loads((run / "config.json").read_text())
    assert config["sources"]["batch_size"] == "RL_BATCH_SIZE"
    assert config["sources"]["num_episodes"] == "command line"
    assert config["sources"]["learning_rate"] == "default"
    assert config["args"]["seed"] == 4 and config["episode_steps"] == 15
    test = json.loads((run / "eval" / "test_results.json").read_text())
    assert test["num_test_episodes"] == 2 and len(test["scores"]) == 2
    assert {"mean", "std", "min", "max", "win_rate"} <= set(test) and test["win_rate"] is None
    assert float(rows[0]["test_mean_score"]) == pytest.approx(test["mean"], abs=1e-4)
    assert "test: mean" in (run / "train.log").read_text()
    curve = (run / "eval" / "curve.csv").read_text().splitlines()
    assert curve[0].startswith("episode,global_step") and len(curve) == 3
    checkpoint = torch.load(run / "checkpoint.pt", weights_only=False)
    assert checkpoint["interrupted"] is False and checkpoint["global_step"] == 30
    left_out = [name for name in dqn.MAP_DEFAULTS["MoveToBeacon"] if config["sources"][name] == "default"]
    assert "context_layers" in left_out and "lr_scheduler" not in left_out  # this run gives the schedule
    assert all(
        config["args"][name] == dqn.MAP_DEFAULTS["MoveToBeacon"][name] for name in left_out
    )  # as values
    dqn.make_q_network(map_name="MoveToBeacon", res=8).load_state_dict(checkpoint["q_network"])

    events = EventAccumulator(str(tmp_path / "runs" / "tiny-seed4"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {
        "charts/episodic_return",
        "charts/episodic_length",
        "charts/learning_rate",
        "charts/epsilon",
        "charts/SPS",
        "charts/test_score",
        "losses/td_loss",
        "losses/q_values",
    } <= tags
    assert set(mu.CPU_KEYS) <= tags and set(mu.BUFFER_KEYS.values()) <= tags
    probe_stages = ("loop_start", "after_collect", "after_sample", "after_optimizer_step")
    assert {f"debug/probe/{stage}_mb" for stage in probe_stages} <= tags
    assert "probes: " in (run / "train.log").read_text()
    lrs = [e.value for e in events.Scalars("charts/learning_rate")]
    assert lrs == pytest.approx([5e-5, 5e-5])  # step schedule: halves only after 1000 episodes
    assert any((tmp_path / "results" / "tiny-seed4").rglob("wandb"))  # offline wandb run recorded


@pytest.mark.slow
@pytest.mark.parametrize("to", ["process", "group"])
def test_sigterm_leaves_a_checkpoint_and_no_results_row(tmp_path, to):
    """SIGTERM to the process, and to its whole process group (scancel, docker stop, timeout)."""
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), *TINY, "--num-episodes", "100000", "--run-id", "stopped"],
        cwd=tmp_path,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        for line in proc.stdout:  # wait until training is under way (no sleeping)
            if line.startswith("episode=3 "):
                break
        if to == "group":
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    assert "Traceback" not in stderr
    run = tmp_path / "results" / "stopped"
    checkpoint = torch.load(run / "checkpoint.pt", weights_only=False)
    # stopped part-way through an episode (to be played again), or, rarely, between two episodes
    assert checkpoint["episode"] >= 3 and checkpoint["interrupted"] in (True, False)
    assert not (tmp_path / "results" / "results.csv").exists()
    assert not (run / "eval" / "test_results.json").exists()
    assert "interrupted by SIGTERM" in (run / "train.log").read_text()
    assert not [p for p in (tmp_path / "results").rglob(".tmp_*")]


@pytest.mark.parametrize("during", ["training", "test episodes"])
def test_a_stop_signal_stops_the_run_at_the_next_agent_step(tmp_path, monkeypatch, during):
    """SIGTERM is only recorded where it lands (here inside a step sent to the game, which goes on to its end), and
    the run stops at the top of the next agent step: a checkpoint, exit 143, no results row. In training the
    checkpoint holds the episode in progress at that step, for a resume to go on with; in the final test episodes
    (all training episodes logged) the resumed run goes on from there."""
    real_game_call, calls, returned = dqn.game_call, [], []
    signal_at = 20 if during == "training" else 31  # mid-episode 2; the first step of the test (2 x 15 steps)

    def game_call(*args, **kwargs):
        calls.append(1)
        if len(calls) == signal_at:
            os.kill(os.getpid(), signal.SIGTERM)
            returned.append(True)  # the handler did not raise: this step is completed
        return real_game_call(*args, **kwargs)

    monkeypatch.setattr(dqn, "game_call", game_call)
    argv = [
        *TINY,
        "--num-episodes",
        "2",
        "--eval-every-episodes",
        "0",
        "--num-test-episodes",
        "3",
        "--run-id",
        "sig",
    ]
    assert _run_in_process(tmp_path, monkeypatch, argv) == 128 + signal.SIGTERM
    assert returned == [True] and len(calls) == signal_at  # no step after the one the signal landed in
    run = tmp_path / "results" / "sig"
    saved = torch.load(run / "checkpoint.pt", weights_only=True)
    if during == "training":
        assert (saved["episode"], saved["global_step"], saved["interrupted"]) == (2, 20, True)
        assert saved["playing"]["length"] == 5 and saved["env_state"] is not None
    else:
        assert (saved["episode"], saved["global_step"], saved["interrupted"]) == (2, 30, False)
    assert "interrupted by SIGTERM" in (run / "train.log").read_text()
    assert (
        not (run / "eval" / "test_results.json").exists()
        and not (tmp_path / "results" / "results.csv").exists()
    )


def test_results_row_is_appended_whole(tmp_path):
    path = str(tmp_path / "results.csv")
    row = dict.fromkeys(dqn.RESULTS_COLUMNS, "x")
    dqn.append_results_row(path, row)
    dqn.append_results_row(path, {**row, "run_id": "second"})
    with open(path) as f:
        rows = list(csv.DictReader(f))
    assert [r["run_id"] for r in rows] == ["x", "second"]
    assert [p.name for p in tmp_path.iterdir()] == ["results.csv"]


def test_out_of_memory_writes_a_report_and_a_checkpoint_and_no_row(tmp_path, monkeypatch):
    real_update, calls = dqn.update, []

    def oom(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:  # the start-up preallocation's update goes through
            return real_update(*args, **kwargs)
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")

    monkeypatch.setattr(dqn, "update", oom)
    monkeypatch.chdir(tmp_path)
    args, sources = dqn.parse_args([*TINY, "--num-episodes", "3", "--run-id", "oom"], {})
    threads = torch.get_num_threads()
    try:
        assert dqn.main(args, sources) == dqn.EXIT_OOM
    finally:
        torch.set_num_threads(threads)
    run = tmp_path / "results" / "oom"
    assert torch.load(run / "checkpoint.pt", weights_only=False)["interrupted"] is True
    assert (run / "oom").is_dir() and any((run / "oom").iterdir())
    log = (run / "train.log").read_text()
    assert "out of memory at step 12" in log
    assert dqn.OOM_ADVICE in log and "--precision" not in log  # this script's own flags, not Dreamer's
    assert not (tmp_path / "results" / "results.csv").exists()


def test_training_and_test_episodes_send_the_game_carried_moves(tmp_path, monkeypatch):
    """--move-through reaches every Move_screen the run sends, in training and in its evaluation and test
    episodes, while the policy's choice stays the chosen pixel; 0 sends the chosen pixel itself."""
    monkeypatch.chdir(tmp_path)
    chosen = (4, 4)
    calls = []  # (observation before the call, function, point) of every call the game received
    real_step = dqn.BuiltinMiniGame.step

    def step(self, function_id, point=None):
        calls.append((self._observe(), function_id, point))
        return real_step(self, function_id, point)

    def select_action(net, obs, epsilon, rng, device, select_own_only=False):
        if dqn.MOVE_SCREEN in obs["available_actions"]:
            return dqn.encode_action(dqn.MOVE_SCREEN, chosen, 8)
        return dqn.encode_action(dqn.FUNCTION_IDS["select_army"], None, 8)

    monkeypatch.setattr(dqn.BuiltinMiniGame, "step", step)
    monkeypatch.setattr(dqn, "select_action", select_action)
    sent = {}
    for through in ("6", "0"):  # 6 world units: 2 pixels of the 8-pixel, 24-unit screen
        calls.clear()
        args, sources = dqn.parse_args(
            [
                *TINY,
                "--map-name",
                "CollectMineralShards",
                "--num-episodes",
                "2",
                "--move-through",
                through,
                "--run-id",
                f"through{through}",
                "--no-save-model",
            ],
            {},
        )
        threads = torch.get_num_threads()
        try:
            assert dqn.main(args, sources) == 0
        finally:
            torch.set_num_threads(threads)
        moves = [(obs, point) for obs, function, point in calls if function == dqn.MOVE_SCREEN]
        assert len(moves) > 40  # 2 training, 2 evaluation and 2 test episodes of 15 steps
        index = dqn.encode_action(dqn.MOVE_SCREEN, chosen, 8)
        assert all(point == dqn.game_call(index, obs, 8, 2.0 * (through == "6"))[1] for obs, point in moves)
        sent[through] = [point for _, point in moves]
    assert set(sent["0"]) == {chosen} and sum(point != chosen for point in sent["6"]) > len(sent["6"]) / 2


def test_capture_video_records_each_test_episode(tmp_path, monkeypatch):
    from moviepy import VideoFileClip

    monkeypatch.chdir(tmp_path)
    args, sources = dqn.parse_args(
        [*TINY, "--num-episodes", "1", "--run-id", "video", "--capture-video", "--no-save-model"], {}
    )
    threads = torch.get_num_threads()
    try:
        assert dqn.main(args, sources) == 0
    finally:
        torch.set_num_threads(threads)
    videos = sorted((tmp_path / "results" / "video" / "videos").glob("*.mp4"))
    assert [v.name for v in videos] == ["test-episode-0.mp4", "test-episode-1.mp4"]
    clip = VideoFileClip(str(videos[0]))
    try:
        frames = list(clip.iter_frames())
    finally:
        clip.close()
    # the start and one frame per agent step (15 at step_mul 128), the 8x8 screen drawn 8 times larger
    assert len(frames) == 16 and frames[0].shape == (64, 64, 3)
    first = frames[0].astype(int)
    beacon = dqn.PLAYER_RELATIVE_COLOURS[3]
    assert (np.abs(first - beacon).sum(-1) < 40).any()  # the beacon is visible (colours survive the codec)


def test_rendered_screen_colours_marine_and_beacon():
    env = dqn.BuiltinMiniGame("MoveToBeacon", res=8, step_mul=128, seed=0)
    obs = env.reset()
    frame = dqn.render_screen(obs)
    assert frame.shape == (64, 64, 3) and frame.dtype == np.uint8
    ys, xs = np.nonzero(obs["feature_screen"][0] == 3)
    assert (frame[ys[0] * 8, xs[0] * 8] == dqn.PLAYER_RELATIVE_COLOURS[3]).all()
    obs, _, _ = env.step(dqn.FUNCTION_IDS["select_army"])
    ys, xs = np.nonzero(obs["feature_screen"][1])
    assert (dqn.render_screen(obs)[ys[0] * 8, xs[0] * 8] == dqn.SELECTED_COLOUR).all()


def _run_in_process(tmp_path, monkeypatch, argv):
    monkeypatch.chdir(tmp_path)
    args, sources = dqn.parse_args(argv, {})
    threads = torch.get_num_threads()
    try:
        return dqn.main(args, sources)
    finally:
        torch.set_num_threads(threads)


def _oom(*args, **kwargs):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB")


@pytest.mark.parametrize("site", ["select_action", "batch_to_device", "run_test_episodes"])
def test_out_of_memory_while_acting_copying_or_testing_is_handled_like_an_update(
    tmp_path, monkeypatch, capsys, site
):
    real = getattr(dqn, site)
    calls = {"n": 0}

    def fails_later(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] > 12:  # once training is under way
            _oom()
        return real(*args, **kwargs)

    monkeypatch.setattr(dqn, site, fails_later if site != "run_test_episodes" else _oom)
    code = _run_in_process(tmp_path, monkeypatch, [*TINY, "--num-episodes", "3", "--run-id", "oom"])
    assert code == dqn.EXIT_OOM
    run = tmp_path / "results" / "oom"
    assert (run / "oom" / "report.json").exists()
    # an OOM while acting or copying stops an episode part-way, to be played again; the test episodes come after
    # the episode has ended and been logged, so a resumed run goes on with the next one
    assert torch.load(run / "checkpoint.pt", weights_only=False)["interrupted"] is (
        site != "run_test_episodes"
    )
    log = (run / "train.log").read_text()
    # where: the innermost frame in the script (here the call site, as the stand-in lives in this file)
    caller = (
        "evaluate" if site == "run_test_episodes" else "train_one_seed"
    )  # the periodic test: its own function
    assert "out of memory at step" in log and f"(in {caller}, line" in log
    assert not (tmp_path / "results" / "results.csv").exists()
    assert "Traceback" not in capsys.readouterr().err


def test_out_of_memory_at_preallocation_stops_before_training_and_says_how_to_go_on(tmp_path, monkeypatch):
    """The A30 incident: the first optimizer step runs out of memory. Nothing is trained, nothing to save."""
    monkeypatch.setattr(torch.optim.Adam, "step", _oom)
    code = _run_in_process(tmp_path, monkeypatch, [*TINY, "--num-episodes", "3", "--run-id", "oom"])
    assert code == dqn.EXIT_OOM
    run = tmp_path / "results" / "oom"
    assert (run / "oom" / "report.json").exists() and not (run / "checkpoint.pt").exists()
    log = (run / "train.log").read_text()
    assert "out of memory at start-up" in log and "optimizer-state preallocation at batch" in log
    assert "--wait-for-gpu-mb" in log and "--fallback-batch-size" in log
    assert not (tmp_path / "results" / "results.csv").exists()


def test_out_of_memory_at_preallocation_retries_with_the_fallback_batch(tmp_path, monkeypatch):
    real_step, calls = torch.optim.Adam.step, {"n": 0}

    def first_step_fails(self, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 1:
            _oom()
        return real_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.Adam, "step", first_step_fails)
    argv = [*TINY, "--num-episodes", "2", "--run-id", "fb", "--batch-size", "8", "--fallback-batch-size", "2"]
    assert _run_in_process(tmp_path, monkeypatch, argv) == 0
    run = tmp_path / "results" / "fb"
    config = json.loads((run / "config.json").read_text())
    assert config["batch_size_used"] == 2 and config["fallback_used"] is True
    assert "preallocation" in config["fallback_reason"]
    assert "retrying with the fallback batch size 2" in (run / "train.log").read_text()
    (row,) = csv.DictReader((tmp_path / "results" / "results.csv").read_text().splitlines())
    assert row["fallback_used"] == "True" and row["batch_size"] == "2"


@pytest.mark.slow
def test_a_stopped_run_resumes_with_its_replay_and_finishes(tmp_path):
    """SIGTERM at episode 3 of a run that checkpoints its replay; `--resume` goes on in the same folder from the
    same episode, with the same counters, and writes the one results row at the end."""
    argv = [*TINY, "--num-episodes", "6", "--run-id", "stopped"]
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), *argv],
        cwd=tmp_path,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        for line in proc.stdout:
            if line.startswith("episode=3 "):
                break
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=120)
    finally:
        proc.kill()
    run = tmp_path / "results" / "stopped"
    saved = torch.load(run / "checkpoint.pt", weights_only=True)
    assert saved["replay"]["position"] > saved["replay"]["keep_from"]  # transitions of the replay on disk
    first = saved["episode"] + (0 if saved["interrupted"] else 1)  # a part-played episode is played again
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *argv, "--resume", str(run / "checkpoint.pt")],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    log = (run / "train.log").read_text()
    assert f"resumed stopped at episode {first}, step {saved['global_step']} with its replay" in log
    episodes = [
        int(line.split()[0].split("=")[1]) for line in done.stdout.splitlines() if line.startswith("episode=")
    ]
    assert episodes == list(range(first, 7))
    rows = list(csv.DictReader((tmp_path / "results" / "results.csv").read_text().splitlines()))
    assert len(rows) == 1 and rows[0]["run_id"] == "stopped" and rows[0]["episodes"] == "6"
    final = torch.load(run / "checkpoint.pt", weights_only=True)
    assert final["global_step"] > saved["global_step"] and not final["interrupted"]


@pytest.mark.parametrize(
    "extra, needle", [(["--res", "16"], "--res 8, but this run asks for 16"), ([], "does not exist")]
)
def test_a_resume_that_cannot_work_is_one_line(tmp_path, extra, needle):
    checkpoint = tmp_path / "results" / "x" / "checkpoint.pt"
    if extra:
        args, sources = dqn.parse_args([*TINY, "--num-episodes", "1", "--run-id", "x"], {})
        cwd = os.getcwd()
        os.chdir(tmp_path)
        try:
            assert dqn.main(args, sources) == 0
        finally:
            os.chdir(cwd)
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *TINY, *extra, "--resume", str(checkpoint)],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.strip().startswith("error: --resume") and needle in done.stderr


def saved_checkpoint(tmp_path, args: dqn.Args, **network) -> str:
    """A checkpoint of this script's format trained with `args`, with the weights of a network built with `network`."""
    saved = {
        "format": dqn.CHECKPOINT_FORMAT,
        "rng": {},
        "args": dataclasses.asdict(dqn.with_map_defaults(args)),
        "q_network": dqn.SplitQNetwork(8, **network).state_dict(),
    }
    torch.save(saved, tmp_path / "saved.pt")
    return str(tmp_path / "saved.pt")


def load_checkpoint(path: str, args: dqn.Args) -> dict:
    """`load_checkpoint` as `main` calls it: with the map's defaults filled in first."""
    return dqn.load_checkpoint(path, dqn.with_map_defaults(args))


def test_a_checkpoint_of_an_older_version_is_refused_in_one_sentence(tmp_path):
    """A checkpoint written by an older version of the script (another format) is not resumed: one sentence on
    stderr, exit status 2, nothing trained."""
    args = dqn.Args(res=8, map_name="CollectMineralShards")
    path = saved_checkpoint(
        tmp_path,
        args,
        context_layers=3,
        coarse_level=True,
        fine_kernel=1,
        click_distance=True,
        timer_input=True,
    )
    old = torch.load(path, weights_only=True)
    old["format"] = "dqn_starcraft_split/2"
    del old["args"]["move_through"]  # a setting that version did not record
    torch.save(old, tmp_path / "old.pt")
    with pytest.raises(dqn.ConfigError, match="was written by another version of this script"):
        load_checkpoint(str(tmp_path / "old.pt"), args)
    done = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            *TINY,
            "--map-name",
            "CollectMineralShards",
            "--resume",
            str(tmp_path / "old.pt"),
        ],
        cwd=tmp_path,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "dqn_starcraft_split/2" in done.stderr and "start a new run" in done.stderr
    assert not (tmp_path / "runs").exists()


def test_a_checkpoint_resumes_only_with_the_learning_rate_schedule_it_was_trained_with(tmp_path):
    """The scheduler's saved state belongs to its schedule: a CollectMineralShards checkpoint trained with the
    cosine schedule (the map's default before the step schedule) refuses the step schedule, naming both."""
    args = dqn.Args(res=8, map_name="CollectMineralShards", context_layers=0, lr_scheduler="cosine")
    path = saved_checkpoint(tmp_path, args, context_layers=0)
    assert load_checkpoint(path, args)["args"]["lr_scheduler"] == "cosine"
    with pytest.raises(dqn.ConfigError, match="--lr-scheduler cosine, but this run asks for step"):
        load_checkpoint(path, dataclasses.replace(args, lr_scheduler=None))  # the map's default: step
    stepped = dataclasses.replace(args, lr_scheduler="step", step_lr_step_size=600, step_lr_gamma=0.2)
    path = saved_checkpoint(tmp_path, stepped, context_layers=0)
    with pytest.raises(dqn.ConfigError, match="--step-lr-gamma 0.2, but this run asks for 0.5"):
        load_checkpoint(path, dataclasses.replace(stepped, step_lr_gamma=0.5))
    assert load_checkpoint(path, dataclasses.replace(stepped, num_episodes=50_000))  # a longer run is fine


def test_a_checkpoint_resumes_only_with_the_spatial_head_it_was_trained_with(tmp_path):
    """--coarse-level and --fine-kernel change the shapes of the spatial head's weights: a checkpoint trained with
    an upsampled coarse term and a 3x3 click term refuses a run asking for either other value, naming both."""
    args = dqn.Args(
        res=8, map_name="CollectMineralShards", context_layers=0, coarse_level=False, fine_kernel=3
    )
    path = saved_checkpoint(tmp_path, args, context_layers=0, coarse_level=False, fine_kernel=3)
    state = load_checkpoint(path, args)
    dqn.make_q_network(**dqn.network_settings(args)).load_state_dict(state["q_network"])
    with pytest.raises(dqn.ConfigError, match="--fine-kernel 3, but this run asks for 1"):
        load_checkpoint(path, dataclasses.replace(args, fine_kernel=1))
    with pytest.raises(dqn.ConfigError, match="--coarse-level False, but this run asks for True"):
        load_checkpoint(path, dataclasses.replace(args, coarse_level=True))


def test_memory_is_read_on_one_heap_with_tensorboards_queue_written(tmp_path, monkeypatch):
    from conftest import assert_memory_order, record_memory_order

    monkeypatch.chdir(tmp_path)
    events = record_memory_order(monkeypatch)
    args, sources = dqn.parse_args([*TINY, "--num-episodes", "2", "--run-id", "order", "--no-save-model"], {})
    threads = torch.get_num_threads()
    try:
        assert dqn.main(args, sources) == 0
    finally:
        torch.set_num_threads(threads)
    assert_memory_order(events)
