"""EpisodeReplay on real Pong frames: stacks rebuilt right, bytes per step, eviction, batches own memory."""

import gc
import hashlib
import weakref

import numpy as np
import pytest
import torch

import dreamer_atari as da
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
    envs = da.make_vector_env(tiny_args(max_episode_steps=60), "test", seed=0)
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
    # windows never cross episodes: is_first can only be the first step of a window
    assert not batch["is_first"][:, 1:].any()
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
    per_step = sum(ep.obs_bytes + ep.aux_bytes for ep in finished) / steps
    # one 84x84 frame (7,056 B) + 7 B of aux per step, + 3 frames per 60-step episode (seed: 28,224 B)
    assert per_step <= 7_200 + 3 * 7_056 / 60
    assert 7_056 < per_step
    stats = replay.stats()
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
    assert finished and all(ep.first_step == 0 for ep in finished), "finished episodes are kept whole"


def test_an_episode_longer_than_the_capacity_is_trimmed_from_the_front():
    envs = da.make_vector_env(tiny_args(num_envs=1), "test", seed=0)
    try:
        replay = da.EpisodeReplay(capacity=100, num_envs=1, seed=0, chunk_size=16)
        collect(envs, replay, 300)  # a Pong episode lasts far longer than 300 steps
    finally:
        envs.close()
    (episode,) = replay.episodes
    assert not episode.done and episode.first_step > 0
    assert replay.total_steps <= 100 + 16
    assert sum(len(chunk) for chunk in episode.frames.chunks) <= 100 + 3 * 16
    assert replay.sample(2, 8)["obs"].shape == (2, 8, 4, 84, 84)


def test_batch_never_shares_memory_with_storage(pong_envs):
    replay = da.EpisodeReplay(capacity=10_000, num_envs=2, seed=0)
    collect(pong_envs, replay, 150)
    storage = [chunk for ep in replay.episodes for array in (ep.frames, *ep.aux) for chunk in array.chunks]
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


def test_evicted_episode_is_freed_after_updates(pong_envs):
    args = tiny_args()
    torch.manual_seed(0)
    agent = da.build_agent(args, (4, 84, 84), 6, "cpu")
    replay = da.EpisodeReplay(capacity=150, num_envs=2, seed=0)
    collect(pong_envs, replay, 70)  # the first two 60-step episodes are finished now
    oldest = replay.episodes[0]
    assert oldest.done
    frames_ref = weakref.ref(oldest.frames.chunks[0])
    reward_ref = weakref.ref(oldest.reward.chunks[0])
    episode_ref = weakref.ref(oldest)
    del oldest
    for _ in range(4):  # updates on batches that come from the oldest episode too
        metrics, states = da.train_world_model(agent, replay.sample(4, 8), args)
        da.train_behavior(agent, states, args)
    collect(pong_envs, replay, 120, seed=1)  # pushes the oldest episodes out
    assert episode_ref() is None or episode_ref() not in replay.episodes
    gc.collect()
    assert episode_ref() is None, "an evicted episode is still referenced"
    assert frames_ref() is None and reward_ref() is None, "an evicted episode's arrays are still alive"
