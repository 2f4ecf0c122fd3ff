"""EpisodeReplay on real Pong frames: stacks rebuilt right, bytes per step, eviction, batches own memory.

The frames are the nature model's, 4 stacked 84x84 ones: the stacks rebuilt from single stored frames are what most
of these tests check (the default model's single 64x64 frames are a stack of one, tested in test_dreamer_run.py)."""

import gc
import hashlib
import mmap
import weakref

import numpy as np
import pytest
import torch

import dreamer_atari as da
import memory_utils as mu
from dreamer_tiny import tiny_args


def collect(envs, replay, steps: int, seed: int = 0, seen: set | None = None):
    """Random-action steps into `replay`; `seen` collects a hash of every observation the env produced."""
    rng = np.random.default_rng(seed)
    obs, _ = envs.reset(seed=seed)
    for i in range(envs.num_envs):
        replay.start_episode(i, obs[i])
        if seen is not None:
            seen.add(hashlib.sha1(obs[i].tobytes()).hexdigest())
    for _ in range(steps):
        actions = rng.integers(envs.single_action_space.n, size=envs.num_envs)
        obs, rewards, terminations, truncations, infos = envs.step(actions)
        replay.add(obs, actions, rewards, terminations, truncations, infos)
        if seen is not None:
            for i in range(envs.num_envs):
                seen.add(hashlib.sha1(obs[i].tobytes()).hexdigest())
                if terminations[i] or truncations[i]:
                    seen.add(hashlib.sha1(infos["final_obs"][i].tobytes()).hexdigest())


@pytest.fixture(scope="module")
def pong_envs():
    envs = da.make_vector_env(tiny_args(model="nature", max_episode_steps=60), "test", seed=0)
    yield envs
    envs.close()


def test_sampled_stacks_are_real_observations(pong_envs):
    replay = da.EpisodeReplay(capacity=10_000, num_envs=2, seed=0)
    seen: set = set()
    collect(pong_envs, replay, 150, seen=seen)  # 60-step episodes: several finished, two in progress
    batch = replay.sample(16, 8)
    assert batch["obs"].shape == (16, 8, 4, 84, 84) and batch["obs"].dtype == np.uint8
    assert batch["action"].shape == batch["reward"].shape == batch["is_first"].shape == (16, 8)
    for stack in batch["obs"].reshape(-1, 4, 84, 84):
        assert hashlib.sha1(stack.tobytes()).hexdigest() in seen, "a rebuilt stack the env never produced"
    assert not batch["is_terminal"].any()  # truncated by the time limit, never terminated here


def test_in_progress_episode_is_sampleable(pong_envs):
    replay = da.EpisodeReplay(capacity=10_000, num_envs=2, seed=0)
    collect(pong_envs, replay, 20)  # no episode has ended yet
    assert all(not ep.done for ep in replay.episodes)
    assert replay.sample(4, 8)["obs"].shape == (4, 8, 4, 84, 84)


def test_bytes_per_step_of_stored_pong(pong_envs):
    replay = da.EpisodeReplay(capacity=10_000, num_envs=2, seed=0)
    collect(pong_envs, replay, 400)
    finished = [ep for ep in replay.episodes if ep.done]
    steps = sum(ep.num_steps for ep in finished)
    per_step = (
        sum(
            ep.frames.nbytes + sum(getattr(ep, name).nbytes for name in da.Episode.FIELDS[1:])
            for ep in finished
        )
        / steps
    )
    # one 84x84 frame (7,056 B) + 7 B of aux per step, + 3 frames per 60-step episode (seed: 28,224 B)
    assert per_step <= 7_200 + 3 * 7_056 / 60
    assert 7_056 < per_step
    stats = da.replay_stats(replay)
    assert stats["total_steps"] == sum(ep.num_steps for ep in replay.episodes)
    assert stats["num_episodes"] == len(replay.episodes)
    # an episode being written holds at most one partly used chunk per array
    slack = stats["obs_bytes"] - sum(ep.frames.end - ep.frames.start for ep in replay.episodes) * 7_056
    assert slack <= 2 * replay.chunk_size * 7_056


def test_whole_oldest_episodes_are_evicted_first(pong_envs):
    replay = da.EpisodeReplay(capacity=200, num_envs=2, seed=0)
    collect(pong_envs, replay, 400)
    assert replay.total_steps <= 200 + 2 * replay.chunk_size
    assert replay.total_steps == sum(ep.num_steps for ep in replay.episodes)
    finished = [ep for ep in replay.episodes if ep.done]
    assert finished and all(ep.action.start == 0 for ep in finished), "finished episodes are kept whole"


def test_an_episode_longer_than_the_capacity_is_trimmed_from_the_front():
    envs = da.make_vector_env(tiny_args(model="nature", num_envs=1), "test", seed=0)
    try:
        replay = da.EpisodeReplay(capacity=100, num_envs=1, seed=0, chunk_size=16)
        collect(envs, replay, 300)  # a Pong episode lasts far longer than 300 steps
    finally:
        envs.close()
    (episode,) = replay.episodes
    assert not episode.done and episode.action.start > 0
    assert replay.total_steps <= 100 + 16
    assert sum(len(chunk) for chunk in episode.frames.chunks) <= 100 + 3 * 16
    assert replay.sample(2, 8)["obs"].shape == (2, 8, 4, 84, 84)


def test_batch_never_shares_memory_with_storage(pong_envs):
    replay = da.EpisodeReplay(capacity=10_000, num_envs=2, seed=0)
    collect(pong_envs, replay, 150)
    storage = [
        chunk
        for ep in replay.episodes
        for array in (getattr(ep, name) for name in da.Episode.FIELDS)
        for chunk in array.chunks
    ]
    for batch_size in (1, 8):
        batch = replay.sample(batch_size, 8)
        for name, array in batch.items():
            assert not any(np.shares_memory(array, chunk) for chunk in storage), (
                f"batch[{name!r}] aliases replay"
            )
        # and the tensors handed to the model on the device do not either
        data = da.batch_to_device(batch, 6, "cpu")
        for tensor in data.values():
            assert not any(np.shares_memory(tensor.numpy(), chunk) for chunk in storage)


def memory_map_of(array: np.ndarray):
    """The object that owns an array's memory (a view's base of bases)."""
    while isinstance(array, np.ndarray):
        array = array.base
    return array.obj if isinstance(array, memoryview) else array


def test_replay_storage_lives_in_memory_maps_of_its_own_one_per_chunk(pong_envs, tmp_path):
    fields = da.replay_log_fields(pong_envs.single_observation_space.shape)
    replay = da.EpisodeReplay(capacity=10_000, num_envs=2, seed=0, chunk_size=16)
    replay.log = mu.ReplayLog(tmp_path / "replay", fields, chunk_rows=16)
    collect(pong_envs, replay, 150)  # finished (compacted) episodes and two in progress
    restored = da.EpisodeReplay(capacity=10_000, num_envs=2, seed=0, chunk_size=16)
    restored.log = mu.ReplayLog(tmp_path / "replay", fields, chunk_rows=16)
    da.restore_replay(restored, da.replay_state(replay), pong_envs.single_observation_space.shape[0])
    for episode in [*replay.episodes, *restored.episodes]:
        arrays = {name: getattr(episode, name) for name in da.Episode.FIELDS}
        for index in range(len(episode.action.chunks)):
            maps = {id(memory_map_of(array.chunks[index])) for array in arrays.values()}
            assert len(maps) == 1, "a chunk's fields in more than one map"
            assert isinstance(memory_map_of(episode.action.chunks[index]), mmap.mmap)


def test_without_more_memory_maps_the_replay_goes_on_in_the_heap_and_says_so_once(
    pong_envs, monkeypatch, capsys
):
    def no_more_maps(*_):
        raise OSError(12, "Cannot allocate memory")  # what mmap gives past vm.max_map_count

    monkeypatch.setattr(mu, "_MAPS_EXHAUSTED", [])
    monkeypatch.setattr(mu.mmap, "mmap", no_more_maps)
    replay = da.EpisodeReplay(capacity=10_000, num_envs=2, seed=0, chunk_size=16)
    collect(pong_envs, replay, 150)  # finished and in-progress episodes, many chunks
    assert replay.sample(4, 8)["obs"].shape == (4, 8, 4, 84, 84)
    assert all(memory_map_of(ep.frames.chunks[0]) is None for ep in replay.episodes)  # numpy's own memory
    assert capsys.readouterr().err.count("no more memory maps") == 1


@pytest.mark.skipif(mu.heap_in_use_mb() is None, reason="glibc's mallinfo2 reads the heap")
def test_filling_the_replay_leaves_the_malloc_heap_as_it_was(pong_envs):
    replay = da.EpisodeReplay(capacity=10_000, num_envs=2, seed=0)
    before = mu.heap_in_use_mb()
    collect(pong_envs, replay, 1_000)
    stored = sum(da.replay_stats(replay)[key] for key in ("obs_bytes", "aux_bytes")) / mu.MB
    assert stored > 10
    assert mu.heap_in_use_mb() - before < 0.1 * stored


def test_evicted_episode_is_freed_after_updates(pong_envs):
    args = tiny_args(model="nature")
    torch.manual_seed(0)
    agent = da.build_agent(args, (4, 84, 84), 6, "cpu")
    replay = da.EpisodeReplay(capacity=150, num_envs=2, seed=0)
    collect(pong_envs, replay, 70)  # the first two 60-step episodes are finished now
    oldest = replay.episodes[0]
    assert oldest.done
    frames_ref = weakref.ref(oldest.frames.chunks[0])
    reward_ref = weakref.ref(oldest.reward.chunks[0])
    map_ref = weakref.ref(memory_map_of(oldest.frames.chunks[0]))  # the episode's storage, outside the heap
    episode_ref = weakref.ref(oldest)
    del oldest
    for _ in range(4):  # updates on batches that come from the oldest episode too
        _, _, states = da.train_world_model(agent, da.batch_tensors(replay.sample(4, 8), "cpu"), args)
        da.train_behavior(agent, states, args)
    collect(pong_envs, replay, 120, seed=1)  # pushes the oldest episodes out
    assert episode_ref() is None or episode_ref() not in replay.episodes
    gc.collect()
    assert episode_ref() is None, "an evicted episode is still referenced"
    assert frames_ref() is None and reward_ref() is None, "an evicted episode's arrays are still alive"
    assert map_ref() is None, "an evicted episode's memory map is still alive"


def test_windows_cross_episode_boundaries_with_is_first_where_an_episode_starts():
    """Pong cut into 6-step episodes, sequences of 16: each window spans several episodes (none fits one)."""
    envs = da.make_vector_env(tiny_args(model="nature", max_episode_steps=5), "test", seed=0)
    replay = da.EpisodeReplay(capacity=10_000, num_envs=2, seed=0)
    seen: set = set()
    try:
        collect(envs, replay, 60, seen=seen)
    finally:
        envs.close()
    assert max(ep.num_steps for ep in replay.episodes) < 16
    batch = replay.sample(32, 16)
    first_stacks = set()
    for ep in replay.episodes:
        stack = np.empty((4, 84, 84), np.uint8)
        ep.frames.read_into(stack, ep.action.start, ep.action.start + 4)
        first_stacks.add(hashlib.sha1(stack.tobytes()).hexdigest())
    for stack in batch["obs"].reshape(-1, 4, 84, 84):
        # a stack mixing two episodes' frames would be one the env never produced
        assert hashlib.sha1(stack.tobytes()).hexdigest() in seen, "a rebuilt stack the env never produced"
    for stack in batch["obs"][:, 1:][
        batch["is_first"][:, 1:]
    ]:  # (a window's first step starts the state too)
        assert hashlib.sha1(stack.tobytes()).hexdigest() in first_stacks, (
            "is_first on a step that starts nothing"
        )
    assert batch["is_first"][:, 1:].sum(1).min() >= 2, (
        "a 16-step window over 6-step episodes crosses two starts"
    )
    # an episode's first step has no action that led to it (a window's first step starts the state too, see
    # test_dreamer_recipe.py, and its action, which the model does not read, may be any)
    assert (batch["action"][:, 1:][batch["is_first"][:, 1:]] == 0).all()


def synthetic_episode_replay(lengths: list[int], capacity: int = 100_000) -> da.EpisodeReplay:
    """Episodes of the given lengths whose frames carry (episode, step) in their first pixels."""
    replay = da.EpisodeReplay(capacity=capacity, num_envs=1, seed=0, chunk_size=16)
    for e, length in enumerate(lengths):
        frame = lambda t, e=e: (
            np.full((4, 4), 0, np.uint8) + np.array([e % 256, t % 256, e // 256, 0], np.uint8)[:, None]
        )
        replay.start_episode(0, np.stack([frame(0)] * 4))
        for t in range(1, length):
            replay.add_step(0, frame(t), 1, 0.0, t == length - 1, t == length - 1)
    return replay


def test_every_stored_step_is_sampled_equally_often_whatever_the_episode_lengths():
    lengths = [3, 9, 40, 5, 120, 2, 16, 9, 9, 60]  # many shorter than the sequence
    replay = synthetic_episode_replay(lengths)
    counts: dict[tuple[int, int], int] = {}
    for _ in range(400):
        obs = replay.sample(64, 16)["obs"][:, :, -1, :, 0].astype(
            int
        )  # (B, T, 4): newest frame's first column
        for e, t in zip((obs[..., 0] + 256 * obs[..., 2]).ravel(), obs[..., 1].ravel()):
            counts[(e, t)] = counts.get((e, t), 0) + 1
    assert len(counts) == sum(lengths), "some stored steps were never sampled"
    values = np.array(list(counts.values()))
    expected = 400 * 64 * 16 / sum(lengths)
    # binomial noise at ~1,500 draws per step is ~2.6 %; the old within-episode rule never drew the 2- to
    # 9-step episodes and drew an episode's first step 16x less often than its middle
    assert values.min() > 0.85 * expected and values.max() < 1.15 * expected, (
        values.min(),
        values.max(),
        expected,
    )


def test_a_replay_shorter_than_one_sequence_cannot_sample_and_one_step_more_can():
    replay = synthetic_episode_replay([3, 4])
    assert not replay.can_sample(8)
    with pytest.raises(RuntimeError, match="fewer than one sequence"):
        replay.sample(2, 8)
    replay = synthetic_episode_replay([3, 4, 1])
    assert replay.can_sample(8) and replay.sample(2, 8)["obs"].shape == (2, 8, 4, 4, 4)


def test_a_trimmed_episode_resets_the_state_where_a_window_enters_it():
    """An episode longer than the capacity loses its front: its oldest kept step is no episode start, but a
    window coming from another episode into it (or wrapping round the stream) must still reset the state there."""
    replay = da.EpisodeReplay(capacity=40, num_envs=2, seed=0, chunk_size=8)
    frame = lambda e, t: np.full((4, 4), 0, np.uint8) + np.array([e, t, 0, 0], np.uint8)[:, None]
    replay.start_episode(0, np.stack([frame(0, 0)] * 4))
    for t in range(1, 80):
        replay.add_step(0, frame(0, t), 1, 0.0, False, False)  # env 0: one long episode, never ending
        if t % 6 == 0:  # env 1: 6-step episodes, numbered 1, 2, ...
            replay.start_episode(1, np.stack([frame(t // 6, 0)] * 4))
        elif t > 6:
            replay.add_step(1, frame(t // 6, t % 6), 1, 0.0, t % 6 == 5, t % 6 == 5)
    assert any(not ep.done and ep.action.start > 0 for ep in replay.episodes), "no episode was trimmed"
    for _ in range(50):
        batch = replay.sample(16, 12)
        ids = batch["obs"][:, :, -1, :, 0].astype(int)  # (B, T, 4): (episode, step) of each newest frame
        enters = (ids[:, 1:, 0] != ids[:, :-1, 0]) | (ids[:, 1:, 1] != ids[:, :-1, 1] + 1)
        np.testing.assert_array_equal(batch["is_first"][:, 1:], enters)


def test_world_model_resets_where_a_window_enters_the_next_episode():
    """The posterior of an episode's steps is the same whether its window starts at the episode or comes from
    the end of the one before (latent draws replaced by their modes, so both are deterministic)."""
    args = tiny_args(model="nature", sequence_length=12)
    torch.manual_seed(0)
    wm = da.build_agent(args, (4, 84, 84), 6, "cpu").world_model
    wm.rssm.sample = lambda stats, noise=None: (
        torch.nn.functional.one_hot(stats.argmax(-1), stats.shape[-1]).float().flatten(-2)
    )
    rng = np.random.default_rng(0)
    stream = {  # 5 steps of an episode's end, then 7 of the next episode
        "obs": rng.integers(0, 255, (1, 12, 4, 84, 84), dtype=np.uint8),
        "action": rng.integers(0, 6, (1, 12)).astype(np.uint8),
        "reward": np.zeros((1, 12), np.float32),
        "is_first": np.zeros((1, 12), np.bool_),
        "is_terminal": np.zeros((1, 12), np.bool_),
    }
    stream["is_first"][0, 5] = True
    alone = {key: value[:, 5:].copy() for key, value in stream.items()}

    def posterior(batch):
        data = da.batch_to_device(batch, 6, "cpu")
        embed = wm.encoder(data["image"].flatten(0, 1)).unflatten(0, data["image"].shape[:2])
        with torch.no_grad():
            return wm.rssm.observe(embed, data["action"], data["is_first"])[2]

    torch.testing.assert_close(posterior(stream)[:, 5:], posterior(alone), rtol=0, atol=1e-6)
