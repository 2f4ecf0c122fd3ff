"""What a dreamer_atari.py user looks at to trust a run: open-loop predictions, reward-prediction quality, the
start-up check that actions change frames, the Catch task, and an ETA that follows the recent rate."""

import io
import math

import gymnasium as gym
import numpy as np
import pytest
import torch
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import dreamer_atari as da
import dreamer_tiny
import memory_utils as mu


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.set_num_threads(1)
    return tmp_path


def catch_args(**overrides) -> da.Args:
    schedule = dict(
        env_id=da.CATCH_ID,
        num_envs=1,
        total_timesteps=300,
        learning_starts=100,
        train_ratio=8.0,
        log_interval=100,
        sequence_length=12,
    )
    return dreamer_tiny.tiny_args(**{**schedule, **overrides})


def test_catch_is_a_gymnasium_env_with_the_stated_rules():
    env = gym.make(da.CATCH_ID)
    obs, _ = env.reset(seed=3)
    assert obs.shape == (84, 84) and obs.dtype == np.uint8 and env.action_space.n == 3
    catch = env.unwrapped
    rewards, steps = [], 0
    while True:  # walk under the ball: a catch
        action = 0 if catch.paddle == catch.ball_col else (1 if catch.paddle > catch.ball_col else 2)
        obs, reward, terminated, _truncated, _ = env.step(action)
        rewards.append(reward)
        steps += 1
        if terminated:
            break
    assert steps == catch.rows - 1 and rewards[-1] == 1.0 and rewards[:-1] == [0.0] * (steps - 1)
    env.reset(seed=3)
    catch.paddle = (catch.ball_col + 2) % catch.columns  # two columns away, never moving: a miss
    for _ in range(catch.rows - 1):
        obs, reward, terminated, _, _ = env.step(0)
    assert terminated and reward == -1.0


def test_reward_prediction_counts_and_rates(monkeypatch):
    """The world-model losses count how the reward head's predictions (`twohot_mean` of its logits, set here) meet
    the batch's rewards; `reward_quality` turns the counts into rates."""
    reward = torch.tensor([[1.0, -1.0, 0.0, 0.0, 1.0, 0.0]])
    predicted = torch.tensor(
        [[0.9, 0.3, 0.6, -0.1, -0.8, 0.0]]
    )  # hit, too small, false alarm, ok, wrong sign
    args = dreamer_tiny.tiny_args(batch_size=1, sequence_length=6)
    agent = da.build_agent(args, dreamer_tiny.obs_shape(args), 3, "cpu")
    raw = da.batch_tensors(da.synthetic_batch(args, dreamer_tiny.obs_shape(args)), "cpu")
    data = da.prepare_batch(raw | {"reward": reward}, 3)
    monkeypatch.setattr(da, "twohot_mean", lambda logits, bins: predicted)  # the reward head's predictions
    parts = da.world_model_loss(agent, data, args)[1]
    counts = {key: parts[key].item() for key in parts if key.startswith("debug/reward_")}
    assert counts == {
        "debug/reward_nonzero": 3.0,
        "debug/reward_hits": 1.0,
        "debug/reward_zero": 3.0,
        "debug/reward_false_alarms": 1.0,
    }
    rates = da.reward_quality(dict(counts))
    assert rates == {
        "charts/reward_sign_accuracy": pytest.approx(1 / 3),
        "charts/reward_false_alarm_rate": pytest.approx(1 / 3),
    }
    assert da.reward_quality(
        {
            "debug/reward_nonzero": 0.0,
            "debug/reward_zero": 4.0,
            "debug/reward_hits": 0.0,
            "debug/reward_false_alarms": 0.0,
        }
    ) == {"charts/reward_false_alarm_rate": 0.0}


def test_a_tiny_run_writes_open_loop_videos_and_reward_quality(in_tmp, monkeypatch):
    # An earlier tracked run of this process, started from another folder: wandb's service process outlives it,
    # and this run's TensorBoard files must still be the ones it syncs.
    (in_tmp / "earlier").mkdir()
    monkeypatch.chdir(in_tmp / "earlier")
    da.main(catch_args(track=True, total_timesteps=20, learning_starts=10, log_interval=10))
    monkeypatch.chdir(in_tmp)
    args = catch_args(video_every=100, track=True, train_ratio=24.0)  # an update from step 100 on
    result = da.main(args)
    run_dir = in_tmp / result["run_dir"]
    events = EventAccumulator(str(run_dir), size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    videos = events.Images("videos/open_loop")
    assert [v.step for v in videos] == [100, 200, 300]
    gif = Image.open(io.BytesIO(videos[-1].encoded_image_string))
    assert gif.format == "GIF" and gif.n_frames == args.sequence_length
    side = args.image_size
    assert gif.size == (3 * side, 4 * side)  # 4 sequences, each truth | model | error
    gif.seek(args.sequence_length - 1)
    frame = np.asarray(gif.convert("L")).astype(float)
    truth, model, error = frame[:side, :side], frame[:side, side : 2 * side], frame[:side, 2 * side :]
    assert truth.max() == 255 and truth.min() == 0  # Catch's ball and paddle on black
    assert np.abs(error - ((model - truth) / 2 + 127.5)).max() <= 1.5  # grey = no error
    assert sorted(p.name for p in (run_dir / "open_loop").iterdir()) == [
        "step_100.gif",
        "step_200.gif",
        "step_300.gif",
    ]
    scalars = {tag: events.Scalars(tag) for tag in events.Tags()["scalars"]}
    for key in ("charts/reward_sign_accuracy", "charts/reward_false_alarm_rate"):
        assert scalars.get(key), f"{key} was not logged"
        assert all(0.0 <= e.value <= 1.0 for e in scalars[key])
    assert not any(key.startswith("debug/reward_") for key in scalars), "raw counts are logged as rates only"
    assert not any(key.startswith("world_model/ball_") for key in scalars), "Catch has no ball to score"
    (wandb_run,) = (in_tmp / "wandb").glob("offline-run-*")
    assert list(wandb_run.rglob("*.gif")), "the open-loop video did not reach wandb"


def test_a_pong_run_logs_ball_f1_beside_its_open_loop_videos(in_tmp):
    args = dreamer_tiny.tiny_args(
        total_timesteps=240,
        learning_starts=100,
        train_ratio=8.0,
        log_interval=100,
        video_every=100,
        sequence_length=16,  # 5 observed steps and 10 open loop
    )
    result = da.main(args)
    events = EventAccumulator(str(in_tmp / result["run_dir"]), size_guidance={"scalars": 0, "images": 0})
    events.Reload()
    video_steps = [v.step for v in events.Images("videos/open_loop")]
    assert len(video_steps) == 2
    for horizon in ("observed", "open_loop_5", "open_loop_10"):
        # F1 and recall are left out only where no true frame holds a ball: a random policy's Pong has one in most;
        # F1's chance level beside each
        for score in ("f1", "f1_chance", "recall"):
            key = f"world_model/ball_{score}_{horizon}"
            figures = events.Scalars(key)
            assert [e.step for e in figures] == video_steps, key
            assert all(0.0 <= e.value <= 1.0 for e in figures), key


def test_open_loop_video_does_not_change_training(in_tmp):
    with_video = da.main(catch_args(video_every=100, save_model=True, exp_name="video"))
    without = da.main(catch_args(video_every=0, save_model=True, exp_name="plain"))
    weights = [
        torch.load(in_tmp / r["run_dir"] / "checkpoint.pt", weights_only=True)["models"]["world_model"]
        for r in (with_video, without)
    ]
    for name, value in weights[0].items():
        torch.testing.assert_close(value, weights[1][name], rtol=0, atol=0, msg=name)


class IgnoreActions(gym.ActionWrapper):
    """What ale-py 0.10.x did: every action becomes a no-op."""

    def action(self, action):
        return 0


def test_action_check_passes_real_envs_and_catches_one_that_ignores_actions():
    args = dreamer_tiny.tiny_args()
    for env_id in ("ALE/Pong-v5", da.CATCH_ID):
        da.check_actions_change_frames(da.make_env(env_id, 0, False, "", args), env_id, seed=1)
    pong = da.make_env("ALE/Pong-v5", 0, False, "", args)
    with pytest.raises(da.ArgsError, match="ignores actions"):
        da.check_actions_change_frames(lambda: IgnoreActions(pong()), "ALE/Pong-v5", seed=1)


def test_a_run_on_an_env_that_ignores_actions_stops_before_writing_anything(in_tmp, capsys):
    if "test/DeadCatch-v0" not in gym.registry:
        gym.register("test/DeadCatch-v0", entry_point=lambda **kw: IgnoreActions(da.CatchEnv(**kw)))
    with pytest.raises(SystemExit) as exit_info:
        da.main(catch_args(env_id="test/DeadCatch-v0", model="nature"))  # the nature model: 84-pixel frames
    assert exit_info.value.code == da.EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "test/DeadCatch-v0" in err[0] and "ignores actions" in err[0]
    assert not (in_tmp / "runs").exists()


def test_short_episodes_train_and_a_replay_too_short_for_one_sequence_says_so_once(in_tmp, capsys):
    """Catch's episodes last 9 steps, shorter than the 12-step sequences: updates run anyway."""
    result = da.main(catch_args(learning_starts=4, total_timesteps=60, log_interval=20))
    assert result["updates"] > 0 and result["behavior_updates"] > 0
    out = capsys.readouterr().out
    assert out.count("updates wait: the replay holds") == 1


def test_eta_follows_the_recent_rate_not_the_prefill():
    """Prefill at 1,000 steps/s, then training at 2 steps/s: after three log intervals of training the ETA is
    within a factor of two of the truth (the average since the start would promise it 20x too soon)."""
    total, prefill, interval = 100_000, 5_000, 100
    progress = mu.ProgressLine(total, torch.device("cpu"), phase_starts=(prefill, prefill))
    clock, step = 0.0, 0
    for step in range(0, prefill + 1, 1_000):
        clock = step / 1_000
        progress.mark(step, now=clock)
        assert progress.eta_s(step, now=clock) is None or step >= prefill
    assert "ETA -- (prefill)" in progress.text(4_000, 1_000.0, None, 100.0, None, now=4.0)
    for step in range(prefill + interval, prefill + 4 * interval, interval):
        clock = 5.0 + (step - prefill) / 2.0
        progress.mark(step, now=clock)
    eta = progress.eta_s(step, now=clock)
    truth = (total - step) / 2.0
    assert eta is not None and truth / 2 <= eta <= 2 * truth, (eta, truth)
    assert math.isclose(eta, truth, rel_tol=1e-9)


def test_open_loop_frames_stay_in_colour_when_the_model_reads_colour():
    """A colour model's open-loop predictions and strip are in colour (truth | model as they are, channels last); the
    error column stays grey (from the frames in grey), and the ball is scored on the frames in grey."""
    args = dreamer_tiny.tiny_args(rgb=True)
    shape = dreamer_tiny.obs_shape(args)  # (1, 3, S, S)
    n, T, side = 3, 8, args.image_size
    rng = np.random.default_rng(0)
    batch = {
        "obs": rng.integers(0, 256, (n, T, *shape), dtype=np.uint8),
        "action": rng.integers(0, 6, (n, T)).astype(np.uint8),
        "reward": np.zeros((n, T), np.float32),
        "is_first": np.arange(T)[None].repeat(n, 0) == 0,
        "is_terminal": np.zeros((n, T), bool),
    }
    torch.manual_seed(0)
    truth, model = da.open_loop_predictions(da.build_agent(args, shape, 6, "cpu"), batch)
    assert truth.shape == model.shape == (n, T, 3, side, side) and model.dtype == np.uint8
    np.testing.assert_array_equal(truth, batch["obs"][:, :, -1])
    assert (model[:, :, 0] != model[:, :, 1]).any()  # the model's own colours, not a grey copy
    strip = da.open_loop_strip(truth, model)
    assert strip.shape == (T, n * side, 3 * side, 3)
    error = (da.grey(model).astype(int) - da.grey(truth) + 256) // 2  # (n, T, S, S)
    for i in range(n):
        rows = strip[:, i * side : (i + 1) * side]  # (T, S, 3S, 3)
        np.testing.assert_array_equal(rows[:, :, :side], truth[i].transpose(0, 2, 3, 1))
        np.testing.assert_array_equal(rows[:, :, side : 2 * side], model[i].transpose(0, 2, 3, 1))
        np.testing.assert_array_equal(rows[:, :, 2 * side :], np.repeat(error[i][..., None], 3, -1))
    scores = da.open_loop_ball_scores(truth, model)
    assert scores and scores == da.open_loop_ball_scores(da.grey(truth), da.grey(model))


@pytest.mark.parametrize("colour", [True, False], ids=["colour", "grey"])
def test_the_open_loop_pngs_of_the_gpu_reports_keep_the_gifs_colour(tmp_path, colour):
    """benchmark/pong_curve.py lays a GIF's frames side by side in a PNG (the GPU reports): in colour when the GIF has
    colour, in grey otherwise."""
    from benchmark import pong_curve

    rng = np.random.default_rng(0)
    truth = rng.integers(
        0, 256, (4, 10, *((3,) if colour else ()), 16, 16), dtype=np.uint8
    )  # (n, T, [3,] S, S)
    frames = da.open_loop_strip(truth, truth[::-1].copy())  # (T, 64, 48[, 3])
    images = [Image.fromarray(frame) for frame in frames]
    images[0].save(tmp_path / "step_1.gif", save_all=True, append_images=images[1:])
    out = pong_curve.open_loop_strip(tmp_path / "step_1.gif", tmp_path / "strip.png")
    png = Image.open(tmp_path / "strip.png")
    assert out["frames"] == [0, 4, 5, 8] and png.mode == ("RGB" if colour else "L")
    if colour:
        first = np.asarray(png)[:16, :16].astype(
            int
        )  # the first frame's first truth, through the GIF's palette
        assert np.abs(first - truth[0, 0].transpose(1, 2, 0)).mean() < 20
