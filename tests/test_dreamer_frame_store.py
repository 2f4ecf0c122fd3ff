"""The replay's frames on the device (`--replay-frames device`): batches gathered there are the batches the host
sampler gives for the same window starts, through episode boundaries, trimmed fronts, eviction, growth and a
checkpoint's round trip; evicted frames give their rows back. Device-agnostic torch, so the CPU runs it."""

import types

import numpy as np
import pytest
import torch

import dreamer_atari as da
import memory_utils as mu

FRAME = (5, 6)  # small frames of random bytes: a wrong row shows as a wrong frame


def drive(replays: list[da.EpisodeReplay], steps: int, seed: int, max_length: int = 30, num_envs: int = 3):
    """The same env steps into every replay: `num_envs` envs whose episodes last 1 to `max_length` steps (some
    shorter than a stack), some ending terminated, some truncated."""
    rng = np.random.default_rng(seed)

    def frame():
        return rng.integers(0, 256, FRAME, dtype=np.uint8)

    for env in range(num_envs):
        first = np.stack([frame() for _ in range(4)])
        for replay in replays:
            if replay.current[env] is None:  # the first call: the envs' first episodes
                replay.start_episode(env, first)
    left = rng.integers(1, max_length + 1, num_envs)
    for _ in range(steps):
        for env in range(num_envs):
            left[env] -= 1
            over = left[env] == 0
            step = (
                frame(),
                int(rng.integers(6)),
                float(rng.normal()),
                bool(over and rng.random() < 0.5),
                over,
            )
            first = np.stack([frame() for _ in range(4)]) if over else None
            for replay in replays:
                replay.add_step(env, *step)
                if over:
                    replay.start_episode(env, first)
            if over:
                left[env] = rng.integers(1, max_length + 1)


def assert_same_batches(host: da.EpisodeReplay, device: da.EpisodeReplay, seed: int, B: int = 9, T: int = 13):
    """`gather(sample)` on the device replay (its `fill` gives rows), and Part 1's `fill` reading its frames back to
    the host, equal the host replay's `sample`."""
    expected = host.sample(B, T, rng=np.random.default_rng(seed))
    indices = device.sample(B, T, rng=np.random.default_rng(seed))
    assert "obs" not in indices and indices["rows"].shape == (B, T, device.episodes[0].stack)
    gathered = device.gather(da.batch_tensors(indices, "cpu"))
    windows = device.draw_windows(B, T, rng=np.random.default_rng(seed))
    copied = da.EpisodeReplay.fill(device, windows, T)
    assert set(gathered) == set(expected) == set(copied)
    for key, value in expected.items():
        np.testing.assert_array_equal(gathered[key].numpy(), value, err_msg=key)
        np.testing.assert_array_equal(copied[key], value, err_msg=key)
    return expected


def replays(capacity: int, chunk_size: int = 8, num_envs: int = 3):
    return (
        da.EpisodeReplay(capacity, num_envs, seed=0, chunk_size=chunk_size),
        da.FrameStoreReplay(capacity, num_envs, seed=0, chunk_size=chunk_size, frames_device="cpu"),
    )


def test_device_batches_equal_the_host_sampler_through_boundaries_trimming_and_eviction():
    host, device = replays(capacity=120)
    crossings = trimmed = 0
    for round_ in range(12):
        drive([host, device], 40, seed=round_, max_length=30 if round_ % 3 else 90)
        assert host.total_steps == device.total_steps <= 120 + 3 * 8
        trimmed += any(not ep.done and ep.action.start > 0 for ep in host.episodes)
        for seed in range(3):
            batch = assert_same_batches(host, device, seed=100 * round_ + seed)
            crossings += int(batch["is_first"][:, 1:].sum())
    assert crossings > 50 and trimmed, "the windows crossed no episode boundary, or no front was trimmed"


def logged(replay: da.EpisodeReplay, folder) -> da.EpisodeReplay:
    """`replay` with its log on disk in `folder` (chunks of 16 rows), as a run with --replay-on-disk has it."""
    replay.log = mu.ReplayLog(folder, da.replay_log_fields((4, *FRAME)), chunk_rows=16)
    return replay


def test_a_resumed_replay_gives_the_same_batches_whichever_side_saved_it(tmp_path):
    """Saved with its log on disk by a replay of either kind (trimmed fronts and episodes in progress included),
    rebuilt by either kind: the same batches as the replay that saved it, its own generator's included, and the same
    ones again after both go on alike (the same evictions)."""
    host, device = (
        logged(replays(capacity=150)[0], tmp_path / "host"),
        logged(replays(capacity=150)[1], tmp_path / "device"),
    )
    drive([host, device], 120, seed=1, max_length=90)
    assert any(ep.action.start > 0 for ep in host.episodes), "no front was trimmed"
    saved_by_host, saved_by_device = da.replay_state(host), da.replay_state(device)
    assert saved_by_host["episodes"] == saved_by_device["episodes"]
    resumed_host, resumed_device = replays(capacity=150)
    da.restore_replay(logged(resumed_host, tmp_path / "device"), saved_by_device, 4)
    da.restore_replay(logged(resumed_device, tmp_path / "host"), saved_by_host, 4)
    for seed in range(4):
        assert_same_batches(host, resumed_device, seed)
        assert_same_batches(resumed_host, device, seed)

    def own_batch(replay):  # a batch drawn by the replay's own generator (gathered on the device replay)
        batch = replay.sample(5, 13)
        return (
            replay.gather(da.batch_tensors(batch, "cpu"))
            if "rows" in batch
            else da.batch_tensors(batch, "cpu")
        )

    for ours, theirs in ((host, resumed_host), (device, resumed_device)):
        batch, again = own_batch(ours), own_batch(theirs)  # each one's generator as it was
        for key, value in batch.items():
            assert torch.equal(again[key], value), key
    # and all go on alike: the same episodes in progress, the same evictions
    drive([host, device, resumed_host, resumed_device], 200, seed=2, max_length=90)
    for seed in range(4):
        assert_same_batches(host, resumed_device, seed)
        assert_same_batches(resumed_host, device, seed)


def in_use(store: da.FrameStore) -> int:
    return len(store.rows) // store.block - len(store.free)


def test_evicted_frames_give_their_rows_back_and_the_store_stays_its_size():
    host, device = replays(capacity=200, chunk_size=16)
    drive([host, device], 200, seed=3)
    store = device.store
    size = len(store.rows)
    for round_ in range(20):  # ten times the capacity goes through
        drive([host, device], 100, seed=10 + round_)
        frames = sum(len(ep.frames) for ep in device.episodes)
        # every row in use holds a kept frame, but for each env's partly used first and last blocks
        assert in_use(store) * store.block <= frames + 2 * 3 * store.block
    assert len(store.rows) == size, "rows were never given back: the store grew instead"
    assert_same_batches(host, device, seed=0)


def test_many_short_episodes_grow_the_store_and_say_so(capsys):
    host, device = replays(capacity=60, chunk_size=16, num_envs=2)
    drive([host, device], 20, seed=4, max_length=2, num_envs=2)  # 1- and 2-step episodes: 3 more frames each
    size = len(device.store.rows)
    drive([host, device], 200, seed=5, max_length=2, num_envs=2)
    assert len(device.store.rows) > size
    assert "replay: the frame store grew to" in capsys.readouterr().out
    for seed in range(3):
        assert_same_batches(host, device, seed, T=7)


def test_a_gathered_batch_owns_its_memory_and_written_frames_wait_at_most_a_few():
    _, device = replays(capacity=500)
    drive([device], 100, seed=6)
    assert 0 < len(device.store.pending) < da.FrameStore.FLUSH_EVERY
    batch = device.gather(da.batch_tensors(device.sample(4, 8), "cpu"))
    assert not device.store.pending  # sampling flushed them first
    rows = device.store.rows
    begin, end = rows.data_ptr(), rows.data_ptr() + rows.nbytes
    assert not begin <= batch["obs"].data_ptr() < end
    # memory: a sampled batch keeps nothing of the store alive, and writing to it changes nothing stored
    before = rows.clone()
    batch["obs"].fill_(7)
    assert torch.equal(rows, before)


def test_replay_stats_count_device_frames_apart_from_host_memory():
    host, device = replays(capacity=500)
    drive([host, device], 100, seed=7)
    on_host, on_device = da.replay_stats(host), da.replay_stats(device)
    assert on_host["obs_device_bytes"] == 0 and on_host["obs_bytes"] > 0
    assert on_device["obs_bytes"] == 0 and on_device["obs_device_bytes"] == device.store.rows.nbytes
    assert (
        on_device["aux_bytes"] == on_host["aux_bytes"] and on_device["total_steps"] == on_host["total_steps"]
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_batches_equal_the_host_sampler():
    host = da.EpisodeReplay(300, 3, seed=0, chunk_size=8)
    device = da.FrameStoreReplay(300, 3, seed=0, chunk_size=8, frames_device="cuda")
    drive([host, device], 400, seed=8)
    expected = host.sample(9, 13, rng=np.random.default_rng(0))
    gathered = device.gather(da.batch_tensors(device.sample(9, 13, rng=np.random.default_rng(0)), "cuda"))
    for key, value in expected.items():
        np.testing.assert_array_equal(gathered[key].cpu().numpy(), value, err_msg=key)


def run_weights(**overrides) -> tuple[dict, dict]:
    """A seeded tiny Pong run with a saved replay; its result and checkpoint."""
    from dreamer_tiny import tiny_args

    schedule = dict(
        learning_starts=100, train_ratio=8.0, max_episode_steps=60, buffer_capacity=150, log_interval=100
    )
    result = da.main(
        tiny_args(
            total_timesteps=240,
            save_model=True,
            model="nature",
            **schedule,
            **overrides,
        )
    )
    path = f"{result['run_dir']}/checkpoint.pt"
    return result, torch.load(path, map_location="cpu", weights_only=True)


def test_a_run_with_frames_on_the_device_trains_exactly_as_one_with_frames_in_host_memory(
    tmp_path, monkeypatch, capsys
):
    """The training loop's own path (`sample_batch`), with stacks of four frames: the same batches, so the same
    weights to the last bit; the saved replays are the same too, and resuming from either works either way."""
    monkeypatch.chdir(tmp_path)
    _, on_host = run_weights(replay_frames="host", exp_name="host")
    result, on_device = run_weights(replay_frames="device", exp_name="device")
    assert "replay: frames on cpu" in capsys.readouterr().out
    assert result["updates"] > 0
    assert on_device["counters"]["updates"] == on_host["counters"]["updates"] == result["updates"]
    # the memory log says where the frames are: none in host memory, the store's bytes on the device
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(result["run_dir"], size_guidance={"scalars": 0})
    events.Reload()
    assert all(e.value == 0 for e in events.Scalars(mu.BUFFER_KEYS["obs_bytes"]))
    assert all(e.value > 0 for e in events.Scalars(mu.BUFFER_DEVICE_KEY))
    for module, weights in on_host["models"].items():
        for name, tensor in weights.items():
            assert torch.equal(on_device["models"][module][name], tensor), f"{module}.{name}"
    assert (
        on_host["replay"]["episodes"] == on_device["replay"]["episodes"]
    )  # the same index of the same steps
    for name, rows in on_host["replay"]["log"]["partial"].items():  # the same last rows, the frames' too
        assert torch.equal(rows, on_device["replay"]["log"]["partial"][name]), name
    from dreamer_tiny import tiny_args

    resumed = da.main(
        tiny_args(
            total_timesteps=300,
            model="nature",
            learning_starts=100,
            train_ratio=8.0,
            max_episode_steps=60,
            buffer_capacity=150,
            replay_frames="device",
            resume=f"{result['run_dir']}/checkpoint.pt",
        )
    )
    assert resumed["global_step"] == 300 and resumed["updates"] > result["updates"]


def device_run(**overrides):
    """What `check_device_frames` reads of a run: its args, observation shape, agent's action count and replay."""
    from dreamer_tiny import tiny_args

    replay = da.FrameStoreReplay(200, 1, seed=0, frames_device="cpu")
    agent = types.SimpleNamespace(num_actions=3)
    return types.SimpleNamespace(
        args=tiny_args(**overrides), obs_shape=(4, *FRAME), agent=agent, replay=replay
    )


def test_the_device_sampler_is_checked_against_the_host_sampler_as_written(monkeypatch):
    """`check_device_frames` runs both samplers as the run's code has them: as written they agree; a change to Part
    1's `fill` that the device's `fill` does not carry, or a `sample` that reads the frames (an augmentation), is
    refused in one sentence naming --replay-frames host."""
    da.check_device_frames(device_run())
    real_fill = da.EpisodeReplay.fill

    def reward_doubled(self, windows, sequence_length):
        batch = real_fill(self, windows, sequence_length)
        batch["reward"] = 2 * batch["reward"]
        return batch

    monkeypatch.setattr(da.EpisodeReplay, "fill", reward_doubled)
    with pytest.raises(da.FastPathMismatch, match="another reward") as refused:
        da.check_device_frames(device_run())
    assert "FrameStoreReplay.fill" in str(refused.value) and "--replay-frames host" in str(refused.value)
    monkeypatch.setattr(da.EpisodeReplay, "fill", real_fill)
    real_sample = da.EpisodeReplay.sample

    def shifted(self, *args, **kwargs):
        batch = real_sample(self, *args, **kwargs)
        batch["obs"] = np.roll(batch["obs"], 1, axis=-1)
        return batch

    monkeypatch.setattr(da.EpisodeReplay, "sample", shifted)
    with pytest.raises(da.FastPathMismatch, match="fails where the host's does not .KeyError"):
        da.check_device_frames(device_run())
