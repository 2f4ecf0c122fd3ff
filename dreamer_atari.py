"""Dreamer on Atari (DreamerV3-style world model, actor-critic in imagination), memory-safe and observable.

Run:
    python dreamer_atari.py --env-id ALE/Pong-v5 --total-timesteps 1000000

What it does: a world model (NatureCNN encoder, RSSM with 32x32 categorical latents, image decoder, symlog
two-hot reward head, continue head) learns from replayed sequences; an actor and a critic learn from
15-step rollouts imagined by that model. Replay keeps every 84x84 frame once, as uint8, and rebuilds the
4-frame stacks when it samples.

What it logs, every `--log-interval` env steps, to TensorBoard in `runs/{run_name}` (and wandb with
`--track`): `charts/*` (episodic return and length, SPS, updates per second), `losses/*` (world model,
image, reward, continue, kl, actor, critic, entropy), the `memory_utils.memory_report()` keys (process and
GPU memory, replay size), and `debug/nonfinite_updates`. A leak detector reads the memory figures and says
in plain words when memory grows for a reason other than the replay filling up.

Step counts (`global_step`, `--total-timesteps`, `--buffer-capacity`, ...) are agent steps summed over the
vector envs; one agent step is 4 emulator frames.

Checkpoints (`runs/{run_name}/checkpoint.pt`) hold only tensors and plain containers, load with
`weights_only=True`, and are written by `--save-model`, `--checkpoint-every`, SIGINT/SIGTERM, an OOM, a
detected leak with `--abort-on-leak`, and a run of non-finite losses. `--resume PATH` continues the run.
"""

import gc
import math
import os
import random
import signal
import sys
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Literal

import ale_py
import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F
import tyro
from torch import nn
from torch.utils.tensorboard import SummaryWriter

import memory_utils as mu

gym.register_envs(ale_py)

# exit statuses: 2 = bad input (argument or file); the others say why a run stopped early
EXIT_BAD_INPUT = 2
EXIT_OOM = 3
EXIT_LEAK = 4
EXIT_NONFINITE = 5
CHECKPOINT_FORMAT = "dreamer_atari/1"
OOM_ADVICE = (
    "Flags that lower the peak: --amp bf16 (or fp16 on CUDA), a smaller --batch-size or --sequence-length, a "
    "shorter --imagination-horizon, and PYTORCH_ALLOC_CONF=expandable_segments:True (set by default)."
)


@dataclass
class Args:
    # experiment
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment"""
    seed: int = 1
    """seed of the experiment"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""
    cuda: bool = True
    """if toggled, cuda will be used when available"""
    track: bool = False
    """if toggled, the run is tracked with Weights and Biases (works offline with WANDB_MODE=offline)"""
    wandb_project_name: str = "cleanRL"
    """the wandb project name"""
    wandb_entity: str | None = None
    """the entity (team) of the wandb project"""
    capture_video: bool = False
    """whether to record videos of env 0 to `videos/{run_name}`"""
    save_model: bool = False
    """whether to write a checkpoint at the end of training"""
    checkpoint_every: int = 0
    """write a checkpoint every this many env steps (0 = only at the end, on signals and on errors)"""
    checkpoint_buffer: bool = False
    """whether checkpoints also hold the replay buffer (large: about 7 KB per stored step)"""
    resume: str | None = None
    """path of a checkpoint to continue from (models, optimizers, scaler, counters, RNG state)"""
    log_interval: int = 1000
    """write charts, losses and memory figures every this many env steps"""

    # environment
    env_id: str = "ALE/Pong-v5"
    """the id of the Atari environment"""
    num_envs: int = 2
    """the number of parallel game environments"""
    vector_mode: Literal["auto", "sync", "async"] = "auto"
    """`async` (a process per env), `sync` (all in this process), or `auto` (async when num_envs > 1)"""
    repeat_action_probability: float = 0.0
    """sticky-action probability of the emulator"""
    noop_max: int = 30
    """at most this many no-op actions at the start of an episode"""
    max_episode_steps: int = 0
    """truncate episodes after this many agent steps (0 = the game's own limit)"""

    # replay
    buffer_capacity: int = 50_000
    """replay capacity in env steps; whole oldest episodes are evicted first"""
    batch_size: int = 16
    """the number of sequences per world-model batch"""
    sequence_length: int = 50
    """the length of each replayed sequence"""

    # model
    encoder_channels: tuple[int, int, int] = (32, 64, 64)
    """channels of the three NatureCNN encoder convolutions"""
    embed_dim: int = 512
    """size of the encoder's output features"""
    decoder_base_channels: int = 32
    """channels of the decoder's last hidden map (the one before it has twice this)"""
    decoder_mid_channels: int = 16
    """channels of the decoder's 7x7 bottleneck map (small: it sets the size of the decoder's linear layer)"""
    deterministic_dim: int = 200
    """size of the RSSM's deterministic (GRU) state `deter`"""
    stochastic_dim: int = 32
    """number of stochastic latent variables in `stoch`"""
    stochastic_classes: int = 32
    """classes per categorical latent; 0 gives DreamerV1 Gaussian latents"""
    hidden_dim: int = 200
    """width of the RSSM's and the heads' hidden layers"""
    unimix: float = 0.01
    """share of the uniform distribution mixed into categorical latents and the policy"""
    reward_bins: int = 255
    """two-hot bins (on the symlog scale) of the reward head and the critic"""
    channels_last: bool = True
    """keep the encoder's and decoder's convolution weights channels-last (NHWC): same results, faster
    convolutions (1.1x per update on CPU in benchmark/)"""

    # training
    total_timesteps: int = 1_000_000
    """total env steps of the experiment"""
    learning_starts: int = 5_000
    """env steps of random actions that fill the replay before any update"""
    warmup_steps: int = 25_000
    """env steps after `learning_starts` during which only the world model trains"""
    train_ratio: float = 1024.0
    """replayed steps per env step. DreamerV3 learned Pong with 1024 at batch 16 x 64, one update per agent
    step; keeping the replayed-steps figure, batch 16 x 50 gives 1.28 updates per env step"""
    world_model_lr: float = 1e-4
    """learning rate of the world model"""
    actor_lr: float = 3e-5
    """learning rate of the actor"""
    critic_lr: float = 3e-5
    """learning rate of the critic"""
    adam_eps: float = 1e-8
    """epsilon of the Adam optimizers"""
    world_model_grad_clip: float = 1000.0
    """gradient norm clip of the world model"""
    actor_critic_grad_clip: float = 100.0
    """gradient norm clip of the actor and the critic"""
    kl_dyn_scale: float = 0.5
    """weight of the dynamics KL term, KL(sg(posterior) || prior)"""
    kl_rep_scale: float = 0.1
    """weight of the representation KL term, KL(posterior || sg(prior))"""
    free_nats: float = 1.0
    """each KL term is clipped below at this many nats"""
    no_decoder_loss: bool = False
    """switch off the image reconstruction loss (isolation experiments)"""
    no_reward_loss: bool = False
    """switch off the reward loss (isolation experiments)"""
    no_kl_loss: bool = False
    """switch off the KL loss (isolation experiments)"""
    imagination_horizon: int = 15
    """length of the imagined rollouts"""
    gamma: float = 0.997
    """the discount factor"""
    return_lambda: float = 0.95
    """lambda of the lambda-returns"""
    entropy_coef: float = 3e-4
    """entropy regulariser of the actor"""
    return_norm_decay: float = 0.99
    """EMA decay of the 5th-95th percentile range that normalises returns"""
    slow_critic_fraction: float = 0.02
    """EMA rate with which the slow critic follows the critic each update"""
    max_nonfinite: int = 10
    """stop (with a checkpoint) after this many non-finite updates in a row"""

    # memory
    amp: Literal["auto", "off", "fp16", "bf16"] = "auto"
    """mixed precision: auto = fp16 on CUDA, off on CPU"""
    preallocate: bool = True
    """create optimizer state at start-up with a worst-case batch (fail fast instead of OOM hours later)"""
    abort_on_leak: bool = False
    """stop with a checkpoint when the leak detector fires"""
    leak_warmup_steps: int = 10_000
    """env steps the leak detector ignores at the start"""
    memory_snapshot_every: int = 0
    """dump a CUDA allocator snapshot every this many env steps (0 = off) into runs/{run_name}/"""
    snapshot_max_entries: int = 100_000
    """allocator history ring size of the snapshots"""
    memory_probes: bool = False
    """record memory at each stage of the loop and the update (debug/probe/*) to name the stage that grows"""


class ArgsError(ValueError):
    """One sentence about one bad input value."""


def check_args(args: Args) -> None:
    """Raise ArgsError naming the first bad value and what is allowed. Starts no env, touches no file."""
    positive = {
        "--total-timesteps": args.total_timesteps,
        "--num-envs": args.num_envs,
        "--batch-size": args.batch_size,
        "--sequence-length": args.sequence_length,
        "--log-interval": args.log_interval,
        "--embed-dim": args.embed_dim,
        "--decoder-base-channels": args.decoder_base_channels,
        "--decoder-mid-channels": args.decoder_mid_channels,
        "--deterministic-dim": args.deterministic_dim,
        "--stochastic-dim": args.stochastic_dim,
        "--hidden-dim": args.hidden_dim,
        "--reward-bins": args.reward_bins,
        "--imagination-horizon": args.imagination_horizon,
        "--max-nonfinite": args.max_nonfinite,
        "--snapshot-max-entries": args.snapshot_max_entries,
    }
    for flag, value in positive.items():
        if value < 1:
            raise ArgsError(f"{flag} must be at least 1, got {value}.")
    non_negative = {
        "--learning-starts": args.learning_starts,
        "--warmup-steps": args.warmup_steps,
        "--checkpoint-every": args.checkpoint_every,
        "--memory-snapshot-every": args.memory_snapshot_every,
        "--max-episode-steps": args.max_episode_steps,
        "--noop-max": args.noop_max,
        "--leak-warmup-steps": args.leak_warmup_steps,
    }
    for flag, value in non_negative.items():
        if value < 0:
            raise ArgsError(f"{flag} must be 0 or more, got {value}.")
    if min(args.encoder_channels) < 1:
        raise ArgsError(f"--encoder-channels must all be at least 1, got {args.encoder_channels}.")
    if args.buffer_capacity < args.sequence_length:
        raise ArgsError(
            f"--buffer-capacity ({args.buffer_capacity}) must be at least --sequence-length "
            f"({args.sequence_length}): the replay could never hold one sequence."
        )
    if args.stochastic_classes == 1 or args.stochastic_classes < 0:
        raise ArgsError(
            f"--stochastic-classes must be 0 (Gaussian) or at least 2, got {args.stochastic_classes}."
        )
    if not args.train_ratio > 0:
        raise ArgsError(f"--train-ratio must be greater than 0, got {args.train_ratio}.")
    for flag, value in {
        "--gamma": args.gamma,
        "--return-lambda": args.return_lambda,
        "--repeat-action-probability": args.repeat_action_probability,
        "--unimix": args.unimix,
        "--return-norm-decay": args.return_norm_decay,
        "--slow-critic-fraction": args.slow_critic_fraction,
    }.items():
        if not 0.0 <= value <= 1.0:
            raise ArgsError(f"{flag} must be between 0 and 1, got {value}.")
    for flag, value in {
        "--world-model-lr": args.world_model_lr,
        "--actor-lr": args.actor_lr,
        "--critic-lr": args.critic_lr,
        "--adam-eps": args.adam_eps,
    }.items():
        if not value > 0:
            raise ArgsError(f"{flag} must be greater than 0, got {value}.")
    try:
        gym.spec(args.env_id)
    except gym.error.Error:
        raise ArgsError(
            f"--env-id {args.env_id!r} is not a registered environment; ALE ids look like ALE/Pong-v5."
        )
    if args.resume is not None and not os.path.isfile(args.resume):
        raise ArgsError(f"--resume {args.resume!r} does not exist or is not a file.")


def make_env(env_id: str, idx: int, capture_video: bool, run_name: str, args: Args) -> Callable[[], gym.Env]:
    def thunk():
        kwargs = dict(frameskip=1, repeat_action_probability=args.repeat_action_probability)
        if capture_video and idx == 0:
            env = gym.make(env_id, render_mode="rgb_array", **kwargs)
            env = gym.wrappers.RecordVideo(env, f"videos/{run_name}")
        else:
            env = gym.make(env_id, **kwargs)
        env = gym.wrappers.AtariPreprocessing(
            env, frame_skip=4, screen_size=84, grayscale_obs=True, noop_max=args.noop_max
        )
        if args.max_episode_steps > 0:
            env = gym.wrappers.TimeLimit(env, args.max_episode_steps)
        env = gym.wrappers.RecordEpisodeStatistics(env)
        env = gym.wrappers.FrameStackObservation(env, 4)  # (4, 84, 84) uint8
        return env

    return thunk


def make_vector_env(args: Args, run_name: str, seed: int) -> gym.vector.VectorEnv:
    """SAME_STEP autoreset: a step that ends an episode returns the next episode's first obs and puts the last
    obs in `infos["final_obs"]`, so every transition we store is real (no reward-0 reset step to filter)."""
    fns = [make_env(args.env_id, i, args.capture_video, run_name, args) for i in range(args.num_envs)]
    mode = args.vector_mode if args.vector_mode != "auto" else ("async" if args.num_envs > 1 else "sync")
    autoreset = gym.vector.AutoresetMode.SAME_STEP
    if mode == "async":
        # workers ignore Ctrl-C (they inherit SIG_IGN): the main process catches it and checkpoints first
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            envs = gym.vector.AsyncVectorEnv(fns, autoreset_mode=autoreset)
        finally:
            signal.signal(signal.SIGINT, previous)
    else:
        envs = gym.vector.SyncVectorEnv(fns, autoreset_mode=autoreset)
    assert isinstance(envs.single_action_space, gym.spaces.Discrete), (
        "only discrete action spaces are supported"
    )
    envs.action_space.seed(seed)
    return envs


# ---------------------------------------------------------------------------------------------------------
# Replay: episodes of frames stored once, stacks rebuilt when sampling
# ---------------------------------------------------------------------------------------------------------
class ChunkedArray:
    """A growable array kept as fixed-size numpy chunks, so it can grow without copying and drop its front.

    Logical indices run from `start` (first kept element) to `end` (one past the last). A finished episode is
    compacted into one exact-size array, so stored bytes match stored steps.
    """

    def __init__(self, item_shape: tuple, dtype, chunk_size: int):
        self.item_shape, self.dtype, self.chunk_size = tuple(item_shape), np.dtype(dtype), chunk_size
        self.chunks: list[np.ndarray] = []
        self.start = 0
        self.end = 0
        self.compacted = False

    def __len__(self) -> int:
        return self.end - self.start

    @property
    def nbytes(self) -> int:
        return sum(chunk.nbytes for chunk in self.chunks)

    def append(self, item) -> None:
        assert not self.compacted, "a compacted array is read-only"
        offset = (self.end - self.start) % self.chunk_size
        if offset == 0 and self.end - self.start == len(self.chunks) * self.chunk_size:
            self.chunks.append(np.empty((self.chunk_size, *self.item_shape), self.dtype))
        self.chunks[-1][offset] = item
        self.end += 1

    def read_into(self, out: np.ndarray, begin: int, stop: int) -> None:
        """Copy logical elements [begin, stop) into `out` (the caller's own memory)."""
        assert self.start <= begin <= stop <= self.end
        if self.compacted:
            out[:] = self.chunks[0][begin - self.start : stop - self.start]
            return
        pos = begin - self.start
        written = 0
        while written < stop - begin:
            chunk, offset = divmod(pos, self.chunk_size)
            take = min(self.chunk_size - offset, stop - begin - written)
            out[written : written + take] = self.chunks[chunk][offset : offset + take]
            written += take
            pos += take

    def drop_front_chunk(self) -> int:
        """Free the oldest chunk; returns how many elements went. Only while growing; never the last chunk."""
        if self.compacted or len(self.chunks) < 2:
            return 0
        self.chunks.pop(0)
        self.start += self.chunk_size
        return self.chunk_size

    def compact(self) -> None:
        """Replace the chunks by one exact-size array (frees the unused tail of the last chunk)."""
        if self.compacted:
            return
        exact = np.empty((len(self), *self.item_shape), self.dtype)
        self.read_into(exact, self.start, self.end)
        self.chunks = [exact]
        self.compacted = True


class Episode:
    """One episode: frame j of `frames` is the newest frame of step j - 3; step t's stack is frames[t : t+4].

    Per step: one 84x84 uint8 frame, the action that led to it (uint8), the reward received on arriving
    (float32), is_first and is_terminal (bool). The three older frames of the first stack are stored once.
    """

    def __init__(self, first_obs: np.ndarray, chunk_size: int):
        stack, height, width = first_obs.shape  # (4, 84, 84) uint8
        self.stack = stack
        self.frames = ChunkedArray((height, width), np.uint8, chunk_size)
        self.action = ChunkedArray((), np.uint8, chunk_size)
        self.reward = ChunkedArray((), np.float32, chunk_size)
        self.is_first = ChunkedArray((), np.bool_, chunk_size)
        self.is_terminal = ChunkedArray((), np.bool_, chunk_size)
        self.done = False
        for frame in first_obs[:-1]:
            self.frames.append(frame)
        self.append(first_obs[-1], 0, 0.0, True, False)

    def append(self, frame, action: int, reward: float, is_first: bool, is_terminal: bool) -> None:
        self.frames.append(frame)
        self.action.append(action)
        self.reward.append(reward)
        self.is_first.append(is_first)
        self.is_terminal.append(is_terminal)

    @property
    def aux(self) -> tuple[ChunkedArray, ...]:
        return (self.action, self.reward, self.is_first, self.is_terminal)

    @property
    def first_step(self) -> int:
        return self.action.start

    @property
    def num_steps(self) -> int:
        return len(self.action)

    def drop_front(self) -> int:
        """Drop the oldest chunk of an episode still being written (frames and aux in lockstep)."""
        if self.done or len(self.action.chunks) < 2:
            return 0
        dropped = self.action.drop_front_chunk()
        for array in (self.reward, self.is_first, self.is_terminal):
            array.drop_front_chunk()
        self.frames.drop_front_chunk()  # frames run 3 ahead, so step `start` still has its whole stack
        return dropped

    def finish(self) -> None:
        self.done = True
        for array in (self.frames, *self.aux):
            array.compact()

    @property
    def obs_bytes(self) -> int:
        return self.frames.nbytes

    @property
    def aux_bytes(self) -> int:
        return sum(array.nbytes for array in self.aux)


class EpisodeReplay:
    """Episode-based replay holding at most `capacity` env steps; whole oldest episodes are evicted first.

    Episodes still being played are sampleable. When an episode alone outgrows the capacity, its oldest chunk
    is dropped instead. Sequences never cross episodes; an episode shorter than the sequence length is
    stored but not sampled (Atari episodes are far longer).
    """

    def __init__(self, capacity: int, num_envs: int, seed: int, chunk_size: int | None = None):
        self.capacity = capacity
        # memory: chunks bound the unused tail of an episode being written to one chunk per env
        # (64 steps: 0.45 MB, i.e. under 20 bytes per stored step with 2 envs at the default capacity)
        self.chunk_size = chunk_size or int(np.clip(capacity // 64, 16, 64))
        self.episodes: deque[Episode] = deque()  # oldest first
        self.current: list[Episode | None] = [None] * num_envs
        self.total_steps = 0
        self.rng = np.random.default_rng(seed)

    def start_episode(self, env_idx: int, obs: np.ndarray) -> None:
        episode = Episode(obs, self.chunk_size)
        self.current[env_idx] = episode
        self.episodes.append(episode)
        self.total_steps += 1
        self._evict()

    def add_step(
        self,
        env_idx: int,
        frame: np.ndarray,
        action: int,
        reward: float,
        terminated: bool,
        episode_over: bool,
    ) -> None:
        episode = self.current[env_idx]
        episode.append(frame, action, reward, False, terminated)
        self.total_steps += 1
        if episode_over:
            episode.finish()
            self.current[env_idx] = None
        self._evict()

    def add(
        self,
        next_obs: np.ndarray,
        actions: np.ndarray,
        rewards: np.ndarray,
        terminations: np.ndarray,
        truncations: np.ndarray,
        infos: dict,
    ) -> None:
        """Store one vector step (SAME_STEP autoreset): `next_obs` is (N, 4, 84, 84) uint8."""
        for i in range(len(actions)):
            over = bool(terminations[i] or truncations[i])
            last_obs = infos["final_obs"][i] if over else next_obs[i]
            self.add_step(i, last_obs[-1], int(actions[i]), float(rewards[i]), bool(terminations[i]), over)
            if over:
                self.start_episode(i, next_obs[i])

    def _evict(self) -> None:
        while self.total_steps > self.capacity:
            freed = 0
            for episode in list(self.episodes):
                if episode.done:
                    # memory: the only reference to a finished episode lives in this deque
                    self.episodes.remove(episode)
                    freed = episode.num_steps
                elif episode.num_steps > 1:
                    freed = episode.drop_front()
                if freed:
                    break
            if not freed:
                return  # only chunks still being written are left; at most one chunk per env over capacity
            self.total_steps -= freed

    def can_sample(self, sequence_length: int) -> bool:
        return any(episode.num_steps >= sequence_length for episode in self.episodes)

    def sample(self, batch_size: int, sequence_length: int) -> dict[str, np.ndarray]:
        """Uniform over all stored windows. Every returned array is a fresh copy that owns its memory."""
        episodes = list(self.episodes)
        windows = np.array([max(0, ep.num_steps - sequence_length + 1) for ep in episodes], dtype=np.float64)
        if windows.sum() == 0:
            raise RuntimeError(f"no stored episode has {sequence_length} steps yet")
        picks = self.rng.choice(len(episodes), size=batch_size, p=windows / windows.sum())
        stack, (height, width) = episodes[0].stack, episodes[0].frames.item_shape
        T = sequence_length
        # memory: a batch is a copy; it never aliases replay storage, so it cannot keep evicted episodes alive
        frames = np.empty((batch_size, T + stack - 1, height, width), np.uint8)  # (B, T+3, 84, 84)
        action = np.empty((batch_size, T), np.uint8)
        reward = np.empty((batch_size, T), np.float32)
        is_first = np.empty((batch_size, T), np.bool_)
        is_terminal = np.empty((batch_size, T), np.bool_)
        for b, pick in enumerate(picks):
            episode = episodes[pick]
            start = episode.first_step + int(self.rng.integers(int(windows[pick])))
            episode.frames.read_into(frames[b], start, start + T + stack - 1)
            episode.action.read_into(action[b], start, start + T)
            episode.reward.read_into(reward[b], start, start + T)
            episode.is_first.read_into(is_first[b], start, start + T)
            episode.is_terminal.read_into(is_terminal[b], start, start + T)
        obs = np.stack([frames[:, k : k + T] for k in range(stack)], axis=2)  # (B, T, 4, 84, 84) uint8
        return {
            "obs": obs,
            "action": action,
            "reward": reward,
            "is_first": is_first,
            "is_terminal": is_terminal,
        }

    def stats(self) -> dict[str, int]:
        """Sizes from the real arrays (feeds `memory_utils.memory_report(buffer_stats=...)`)."""
        return {
            "total_steps": self.total_steps,
            "num_episodes": len(self.episodes),
            "obs_bytes": sum(ep.obs_bytes for ep in self.episodes),
            "aux_bytes": sum(ep.aux_bytes for ep in self.episodes),
        }

    def state_dict(self) -> dict:
        """Tensors only (loads with weights_only=True). Episodes being played are saved as ended: the
        emulators cannot be restored, so a resumed run starts fresh episodes."""
        saved = []
        for ep in self.episodes:
            arrays = {}
            for name in ("frames", "action", "reward", "is_first", "is_terminal"):
                array = getattr(ep, name)
                exact = np.empty((len(array), *array.item_shape), array.dtype)
                array.read_into(exact, array.start, array.end)
                arrays[name] = torch.from_numpy(exact)
            saved.append(arrays)
        return {"episodes": saved, "rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        self.episodes.clear()
        self.total_steps = 0
        for arrays in state["episodes"]:
            frames = arrays["frames"].numpy()
            episode = Episode(frames[:4], self.chunk_size)
            episode.frames.chunks, episode.frames.end = [frames.copy()], len(frames)
            for name in ("action", "reward", "is_first", "is_terminal"):
                array = getattr(episode, name)
                array.chunks, array.end = [arrays[name].numpy().copy()], len(arrays[name])
            for array in (episode.frames, *episode.aux):
                array.compacted = True
            episode.done = True
            self.episodes.append(episode)
            self.total_steps += episode.num_steps
        self.rng.bit_generator.state = state["rng"]
        self._evict()


# ---------------------------------------------------------------------------------------------------------
# Networks
# ---------------------------------------------------------------------------------------------------------
def symlog(x: torch.Tensor) -> torch.Tensor:
    return torch.sign(x) * torch.log1p(x.abs())


def symexp(x: torch.Tensor) -> torch.Tensor:
    return torch.sign(x) * torch.expm1(x.abs())


def twohot_loss(logits: torch.Tensor, target: torch.Tensor, bins: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of `logits` (..., K) against the two-hot encoding of symlog(target) (...)."""
    x = symlog(target.float()).clamp(bins[0], bins[-1]).unsqueeze(-1)  # (..., 1)
    below = ((bins <= x).sum(-1) - 1).clamp(0, len(bins) - 1)
    above = (below + 1).clamp(max=len(bins) - 1)
    dist_below = (bins[below] - x.squeeze(-1)).abs()
    dist_above = (bins[above] - x.squeeze(-1)).abs()
    same = below == above
    total = torch.where(same, torch.ones_like(dist_below), dist_below + dist_above)
    weight_below = torch.where(same, torch.ones_like(dist_below), dist_above / total)
    weight_above = torch.where(same, torch.zeros_like(dist_below), dist_below / total)
    log_probs = F.log_softmax(logits.float(), -1)
    return -(
        log_probs.gather(-1, below.unsqueeze(-1)).squeeze(-1) * weight_below
        + log_probs.gather(-1, above.unsqueeze(-1)).squeeze(-1) * weight_above
    )


def twohot_mean(logits: torch.Tensor, bins: torch.Tensor) -> torch.Tensor:
    """Expected value of a symlog two-hot head, back on the original scale."""
    return symexp((F.softmax(logits.float(), -1) * bins).sum(-1))


def mlp(in_dim: int, out_dim: int, hidden_dim: int, zero_output: bool = False) -> nn.Sequential:
    layers = nn.Sequential(
        nn.Linear(in_dim, hidden_dim),
        nn.LayerNorm(hidden_dim),
        nn.SiLU(),
        nn.Linear(hidden_dim, hidden_dim),
        nn.LayerNorm(hidden_dim),
        nn.SiLU(),
        nn.Linear(hidden_dim, out_dim),
    )
    if zero_output:  # DreamerV3: reward and value heads start predicting 0
        nn.init.zeros_(layers[-1].weight)
        nn.init.zeros_(layers[-1].bias)
    return layers


class NatureCNNEncoder(nn.Module):
    """(N, 4, 84, 84) float in [-0.5, 0.5] -> (N, E)."""

    def __init__(self, in_channels: int, channels: tuple[int, int, int], embed_dim: int):
        super().__init__()
        c1, c2, c3 = channels
        self.net = nn.Sequential(
            nn.Conv2d(in_channels, c1, 8, stride=4),
            nn.ReLU(),  # (N, c1, 20, 20)
            nn.Conv2d(c1, c2, 4, stride=2),
            nn.ReLU(),  # (N, c2, 9, 9)
            nn.Conv2d(c2, c3, 3, stride=1),
            nn.ReLU(),  # (N, c3, 7, 7)
            nn.Flatten(),
            nn.Linear(c3 * 7 * 7, embed_dim),
            nn.ReLU(),
        )

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.net(image)


class AtariConvDecoder(nn.Module):
    """(N, F) latent features -> (N, 4, 84, 84) image mean; NatureCNN reversed (7 -> 9 -> 20 -> 84)."""

    def __init__(self, feat_dim: int, out_channels: int, base_channels: int, mid_channels: int):
        super().__init__()
        self.mid_channels = mid_channels
        self.linear = nn.Linear(feat_dim, mid_channels * 7 * 7)
        self.net = nn.Sequential(
            nn.ConvTranspose2d(mid_channels, 2 * base_channels, 3, stride=1),
            nn.ReLU(),  # (N, 2b, 9, 9)
            nn.ConvTranspose2d(2 * base_channels, base_channels, 4, stride=2),
            nn.ReLU(),  # (N, b, 20, 20)
            nn.ConvTranspose2d(base_channels, out_channels, 8, stride=4),  # (N, 4, 84, 84)
        )

    def forward(self, feat: torch.Tensor) -> torch.Tensor:
        return self.net(self.linear(feat).unflatten(-1, (self.mid_channels, 7, 7)))


class RSSM(nn.Module):
    """Recurrent state-space model: `deter` (GRU state) and `stoch` (categorical or Gaussian latents).

    Categorical: `stoch_dim` latents of `classes` classes, sampled with straight-through gradients, with
    `unimix` uniform mixed in. Gaussian (classes == 0): DreamerV1 latents. The `stats` of a distribution are
    log-probabilities (..., stoch_dim, classes) or mean and std concatenated (..., 2 * stoch_dim).
    """

    def __init__(
        self,
        embed_dim: int,
        num_actions: int,
        deter_dim: int,
        stoch_dim: int,
        classes: int,
        hidden_dim: int,
        unimix: float,
    ):
        super().__init__()
        self.deter_dim, self.stoch_dim, self.classes, self.unimix = deter_dim, stoch_dim, classes, unimix
        self.stoch_flat = stoch_dim * classes if classes else stoch_dim
        stats_dim = stoch_dim * classes if classes else 2 * stoch_dim
        self.img_in = nn.Sequential(
            nn.Linear(self.stoch_flat + num_actions, hidden_dim), nn.LayerNorm(hidden_dim), nn.SiLU()
        )
        self.gru = nn.GRUCell(hidden_dim, deter_dim)
        self.prior_net = nn.Sequential(
            nn.Linear(deter_dim, hidden_dim),
            nn.LayerNorm(hidden_dim),
            nn.SiLU(),
            nn.Linear(hidden_dim, stats_dim),
        )
        self.posterior_net = nn.Sequential(
            nn.Linear(deter_dim + embed_dim, hidden_dim),
            nn.LayerNorm(hidden_dim),
            nn.SiLU(),
            nn.Linear(hidden_dim, stats_dim),
        )

    def initial(self, n: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(n, self.deter_dim, device=device), torch.zeros(n, self.stoch_flat, device=device)

    def _stats(self, raw: torch.Tensor) -> torch.Tensor:
        raw = raw.float()
        if self.classes:
            probs = F.softmax(raw.unflatten(-1, (self.stoch_dim, self.classes)), -1)
            probs = (1 - self.unimix) * probs + self.unimix / self.classes
            return probs.log()
        mean, std = raw.chunk(2, -1)
        return torch.cat([mean, F.softplus(std) + 0.1], -1)

    def img_step(self, deter: torch.Tensor, stoch: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        """h_t = GRU(h_{t-1}, [z_{t-1}, a_{t-1}])."""
        return self.gru(self.img_in(torch.cat([stoch, action], -1)).float(), deter)

    def prior(self, deter: torch.Tensor) -> torch.Tensor:
        return self._stats(self.prior_net(deter))

    def posterior(self, deter: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
        return self._stats(self.posterior_net(torch.cat([deter, embed.float()], -1)))

    def sample(self, stats: torch.Tensor) -> torch.Tensor:
        """A flat latent sample (..., stoch_flat) with gradients (straight-through or reparameterised)."""
        if self.classes:
            probs = stats.exp()
            # inverse-CDF draw: the same distribution as Categorical(probs).sample(), ~10x cheaper on CPU
            uniform = torch.rand(probs.shape[:-1] + (1,), device=probs.device, dtype=probs.dtype)
            index = (probs.cumsum(-1) < uniform).sum(-1).clamp_(max=self.classes - 1)
            one_hot = F.one_hot(index, self.classes).to(probs.dtype)
            return (one_hot + probs - probs.detach()).flatten(-2)
        mean, std = stats.chunk(2, -1)
        return mean + std * torch.randn_like(std)

    def kl(self, lhs: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
        """KL(lhs || rhs) summed over latents: (...)."""
        if self.classes:
            return (lhs.exp() * (lhs - rhs)).sum((-2, -1))
        mean_l, std_l = lhs.chunk(2, -1)
        mean_r, std_r = rhs.chunk(2, -1)
        return (torch.log(std_r / std_l) + (std_l**2 + (mean_l - mean_r) ** 2) / (2 * std_r**2) - 0.5).sum(-1)

    def observe(self, embed: torch.Tensor, action: torch.Tensor, is_first: torch.Tensor):
        """Posterior rollout over a sequence.

        embed (B, T, E); action (B, T, A) one-hot, the action that led to step t; is_first (B, T).
        Returns deter (B, T, D), stoch (B, T, S), posterior and prior stats (B, T, ...).
        """
        B, T = embed.shape[:2]
        deter, stoch = self.initial(B, embed.device)
        deters, stochs, posteriors, priors = [], [], [], []
        for t in range(T):
            keep = (~is_first[:, t]).float().unsqueeze(-1)  # (B, 1): 0 where an episode starts
            deter, stoch = deter * keep, stoch * keep
            deter = self.img_step(deter, stoch, action[:, t] * keep)
            prior = self.prior(deter)
            posterior = self.posterior(deter, embed[:, t])
            stoch = self.sample(posterior)
            deters.append(deter), stochs.append(stoch), posteriors.append(posterior), priors.append(prior)
        return (
            torch.stack(deters, 1),
            torch.stack(stochs, 1),
            torch.stack(posteriors, 1),
            torch.stack(priors, 1),
        )


class WorldModel(nn.Module):
    def __init__(self, args: Args, obs_shape: tuple, num_actions: int):
        super().__init__()
        self.encoder = NatureCNNEncoder(obs_shape[0], args.encoder_channels, args.embed_dim)
        self.rssm = RSSM(
            args.embed_dim,
            num_actions,
            args.deterministic_dim,
            args.stochastic_dim,
            args.stochastic_classes,
            args.hidden_dim,
            args.unimix,
        )
        feat_dim = args.deterministic_dim + self.rssm.stoch_flat
        self.decoder = AtariConvDecoder(
            feat_dim, obs_shape[0], args.decoder_base_channels, args.decoder_mid_channels
        )
        self.reward_head = mlp(feat_dim, args.reward_bins, args.hidden_dim, zero_output=True)
        self.continue_head = mlp(feat_dim, 1, args.hidden_dim)
        self.register_buffer("bins", torch.linspace(-20.0, 20.0, args.reward_bins))


class Actor(nn.Module):
    def __init__(self, feat_dim: int, num_actions: int, hidden_dim: int, unimix: float):
        super().__init__()
        self.net = mlp(feat_dim, num_actions, hidden_dim)
        self.unimix = unimix

    def forward(self, feat: torch.Tensor) -> torch.distributions.Categorical:
        probs = F.softmax(self.net(feat).float(), -1)
        return torch.distributions.Categorical(
            probs=(1 - self.unimix) * probs + self.unimix / probs.shape[-1]
        )


class Critic(nn.Module):
    """Value as symlog two-hot logits (..., K)."""

    def __init__(self, feat_dim: int, hidden_dim: int, bins: int):
        super().__init__()
        self.net = mlp(feat_dim, bins, hidden_dim, zero_output=True)
        self.register_buffer("bins", torch.linspace(-20.0, 20.0, bins))

    def forward(self, feat: torch.Tensor) -> torch.Tensor:
        return self.net(feat)

    def value(self, feat: torch.Tensor) -> torch.Tensor:
        return twohot_mean(self(feat), self.bins)


class ReturnNormalizer(nn.Module):
    """EMA of the 5th and 95th percentiles of lambda-returns; scale = max(1, P95 - P5)."""

    def __init__(self, decay: float):
        super().__init__()
        self.decay = decay
        self.register_buffer("low", torch.zeros(()))
        self.register_buffer("high", torch.zeros(()))

    @torch.no_grad()
    def update(self, returns: torch.Tensor) -> None:
        flat = returns.detach().float().flatten()
        self.low.lerp_(torch.quantile(flat, 0.05), 1 - self.decay)
        self.high.lerp_(torch.quantile(flat, 0.95), 1 - self.decay)

    def scale(self) -> torch.Tensor:
        return torch.clamp(self.high - self.low, min=1.0)


@dataclass
class Agent:
    """Everything that learns, plus the mixed-precision setup shared by the three optimizers."""

    world_model: WorldModel
    actor: Actor
    critic: Critic
    slow_critic: Critic
    return_norm: ReturnNormalizer
    world_model_optimizer: torch.optim.Optimizer
    actor_optimizer: torch.optim.Optimizer
    critic_optimizer: torch.optim.Optimizer
    amp: "mu.AmpSetup"
    device: torch.device
    num_actions: int

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return [self.world_model_optimizer, self.actor_optimizer, self.critic_optimizer]

    def modules(self) -> dict[str, nn.Module]:
        return {
            "world_model": self.world_model,
            "actor": self.actor,
            "critic": self.critic,
            "slow_critic": self.slow_critic,
            "return_norm": self.return_norm,
        }


def build_agent(args: Args, obs_shape: tuple, num_actions: int, device) -> Agent:
    device = torch.device(device)
    world_model = WorldModel(args, obs_shape, num_actions).to(device)
    if args.channels_last:
        world_model.encoder.to(memory_format=torch.channels_last)
        world_model.decoder.to(memory_format=torch.channels_last)
    feat_dim = args.deterministic_dim + world_model.rssm.stoch_flat
    actor = Actor(feat_dim, num_actions, args.hidden_dim, args.unimix).to(device)
    critic = Critic(feat_dim, args.hidden_dim, args.reward_bins).to(device)
    slow_critic = Critic(feat_dim, args.hidden_dim, args.reward_bins).to(device)
    slow_critic.load_state_dict(critic.state_dict())
    slow_critic.requires_grad_(False)
    return Agent(
        world_model=world_model,
        actor=actor,
        critic=critic,
        slow_critic=slow_critic,
        return_norm=ReturnNormalizer(args.return_norm_decay).to(device),
        world_model_optimizer=torch.optim.Adam(
            world_model.parameters(), lr=args.world_model_lr, eps=args.adam_eps
        ),
        actor_optimizer=torch.optim.Adam(actor.parameters(), lr=args.actor_lr, eps=args.adam_eps),
        critic_optimizer=torch.optim.Adam(critic.parameters(), lr=args.critic_lr, eps=args.adam_eps),
        amp=mu.amp(args.amp, device),
        device=device,
        num_actions=num_actions,
    )


class Player:
    """Acts in the vector env: keeps each env's latent state across steps, always detached."""

    def __init__(self, agent: Agent, num_envs: int):
        self.agent, self.num_envs = agent, num_envs
        self.reset()

    def reset(self) -> None:
        device, rssm = self.agent.device, self.agent.world_model.rssm
        self.deter, self.stoch = rssm.initial(self.num_envs, device)  # (N, D), (N, S)
        self.prev_action = torch.zeros(self.num_envs, self.agent.num_actions, device=device)  # (N, A) one-hot

    # memory: acting builds no graph; otherwise each step's graph stays reachable from the cached state
    @torch.no_grad()
    def act(self, obs: np.ndarray, is_first: np.ndarray) -> np.ndarray:
        """obs (N, 4, 84, 84) uint8, is_first (N,) bool -> actions (N,) int64."""
        wm, device = self.agent.world_model, self.agent.device
        with self.agent.amp.autocast():
            image = torch.as_tensor(obs, device=device).float() / 255.0 - 0.5  # (N, 4, 84, 84)
            keep = torch.as_tensor(~is_first, device=device).float().unsqueeze(-1)  # (N, 1)
            deter = wm.rssm.img_step(self.deter * keep, self.stoch * keep, self.prev_action * keep)
            stoch = wm.rssm.sample(wm.rssm.posterior(deter, wm.encoder(image)))
            action = self.agent.actor(torch.cat([deter, stoch], -1)).sample()  # (N,)
        # memory: the cached state is stored detached, so it can never carry a graph into the next step
        self.deter, self.stoch = deter.detach().float(), stoch.detach().float()
        self.prev_action = F.one_hot(action, self.agent.num_actions).float()
        return action.cpu().numpy()


# ---------------------------------------------------------------------------------------------------------
# Losses and updates (plain functions; every update returns Python floats)
# ---------------------------------------------------------------------------------------------------------
def lambda_returns(
    reward: torch.Tensor, value: torch.Tensor, discount: torch.Tensor, lambda_: float
) -> torch.Tensor:
    """R_t = r_{t+1} + d_{t+1} ((1 - lambda) v_{t+1} + lambda R_{t+1}), R_H = v_H.

    reward, value, discount: (H+1, N) for imagined states s_0..s_H (the reward and discount of s_k are those
    received on arriving at s_k). Returns (H, N) for s_0..s_{H-1}.
    """
    returns = [value[-1]]
    for t in reversed(range(len(value) - 1)):
        returns.append(
            reward[t + 1] + discount[t + 1] * ((1 - lambda_) * value[t + 1] + lambda_ * returns[-1])
        )
    return torch.stack(returns[1:][::-1])


def batch_to_device(batch: dict[str, np.ndarray], num_actions: int, device) -> dict[str, torch.Tensor]:
    """uint8 on the host, float on the device. On CUDA the copy is a plain synchronous one: no pinned source
    whose lifetime would need managing."""
    # memory: observations cross to the device as uint8 (a quarter of float32); floats exist only there
    as_tensor = {key: torch.from_numpy(value).to(device) for key, value in batch.items()}
    return {
        "image": as_tensor["obs"].float() / 255.0 - 0.5,  # (B, T, 4, 84, 84), converted on the device
        "action": F.one_hot(as_tensor["action"].long(), num_actions).float(),  # (B, T, A)
        "reward": as_tensor["reward"],  # (B, T)
        "is_first": as_tensor["is_first"],  # (B, T) bool
        "is_terminal": as_tensor["is_terminal"],  # (B, T) bool
    }


def world_model_loss(agent: Agent, data: dict[str, torch.Tensor], args: Args, probe: Callable[[str], None]):
    """Returns (loss, parts as tensors, posterior (deter, stoch) (B, T, ...))."""
    wm = agent.world_model
    image = data["image"]
    B, T = image.shape[:2]
    embed = wm.encoder(image.flatten(0, 1)).unflatten(0, (B, T))  # (B, T, E)
    probe("after_encoder")
    deter, stoch, posterior, prior = wm.rssm.observe(embed, data["action"], data["is_first"])
    probe("after_rssm")
    feat = torch.cat([deter, stoch], -1)  # (B, T, D + S)
    reconstruction = wm.decoder(feat.flatten(0, 1)).unflatten(0, (B, T))  # (B, T, 4, 84, 84)
    image_loss = (reconstruction.float() - image).pow(2).sum((-3, -2, -1)).mean()
    reward_loss = twohot_loss(wm.reward_head(feat), data["reward"], wm.bins).mean()
    continue_target = (~data["is_terminal"]).float()
    continue_loss = F.binary_cross_entropy_with_logits(
        wm.continue_head(feat).squeeze(-1).float(), continue_target
    )
    dyn = wm.rssm.kl(posterior.detach(), prior)  # (B, T)
    rep = wm.rssm.kl(posterior, prior.detach())
    kl_loss = (
        args.kl_dyn_scale * dyn.clamp(min=args.free_nats).mean()
        + args.kl_rep_scale * rep.clamp(min=args.free_nats).mean()
    )
    probe("after_decoder")
    # ALGO LOGIC: the loss branches, each switchable for isolation experiments
    loss = continue_loss
    if not args.no_decoder_loss:
        loss = loss + image_loss
    if not args.no_reward_loss:
        loss = loss + reward_loss
    if not args.no_kl_loss:
        loss = loss + kl_loss
    parts = {
        "losses/world_model": loss,
        "losses/image": image_loss,
        "losses/reward": reward_loss,
        "losses/continue": continue_loss,
        "losses/kl": kl_loss,
        "debug/kl_value": dyn.mean(),
    }
    return loss, parts, (deter, stoch)


def optimizer_step(
    agent: Agent,
    optimizer: torch.optim.Optimizer,
    parameters,
    loss: torch.Tensor,
    clip: float,
    parts: dict[str, torch.Tensor],
    probe: Callable[[str], None],
) -> tuple[dict[str, float], bool]:
    """Backward, clip, and step unless the loss or the gradient is non-finite. Returns (floats, stepped)."""
    scaler = agent.amp.scaler
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    probe("after_backward")
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_(parameters, clip)
    # memory: one .tolist() per update; what leaves this function is plain Python floats, never tensors
    values = torch.stack([value.detach().float() for value in parts.values()] + [grad_norm.float()]).tolist()
    metrics = dict(zip(parts.keys(), values[:-1]))
    finite = all(math.isfinite(v) for v in values[:-1])
    if not scaler.is_enabled():  # with fp16 the scaler itself skips steps whose gradients overflowed
        finite = finite and math.isfinite(values[-1])
    if finite:
        scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    metrics["grad_norm"] = values[-1]
    return metrics, finite


def _no_probe(stage: str) -> None:
    pass


def train_world_model(
    agent: Agent, batch: dict[str, np.ndarray], args: Args, probe: Callable[[str], None] | None = None
):
    """One world-model update on a sampled batch.

    Returns (dict of floats, posterior states): the states are (deter (B*T, D), stoch (B*T, S),
    continue (B*T,)), detached, to start imagination from. A non-finite loss or gradient skips the step
    and sets `debug/update_skipped` to 1.0.
    """
    probe = probe or _no_probe
    data = batch_to_device(batch, agent.num_actions, agent.device)
    with agent.amp.autocast():
        loss, parts, (deter, stoch) = world_model_loss(agent, data, args, probe)
    metrics, stepped = optimizer_step(
        agent,
        agent.world_model_optimizer,
        agent.world_model.parameters(),
        loss,
        args.world_model_grad_clip,
        parts,
        probe,
    )
    probe("after_optimizer_step")
    metrics["debug/world_model_grad_norm"] = metrics.pop("grad_norm")
    metrics["debug/update_skipped"] = 0.0 if stepped else 1.0
    start_continue = (~data["is_terminal"]).float().flatten(0, 1)  # (B*T,)
    return metrics, (deter.detach().flatten(0, 1), stoch.detach().flatten(0, 1), start_continue)


def imagine(agent: Agent, start_states, horizon: int):
    """Roll the prior forward `horizon` steps with the actor, from (N, ...) start states.

    The dynamics run without gradients (the actor learns by REINFORCE, the critic from fixed targets), so
    the only graph kept is the actor's. Returns feat (H+1, N, F) detached, log_prob (H, N), entropy (H, N).
    """
    rssm = agent.world_model.rssm
    deter, stoch, _ = start_states
    feats, log_probs, entropies = [], [], []
    for _ in range(horizon):
        feat = torch.cat([deter, stoch], -1)  # (N, F)
        feats.append(feat)
        policy = agent.actor(feat)
        action = policy.sample()  # (N,)
        log_probs.append(policy.log_prob(action))
        entropies.append(policy.entropy())
        with torch.no_grad():
            deter = rssm.img_step(deter, stoch, F.one_hot(action, agent.num_actions).to(deter.dtype))
            stoch = rssm.sample(rssm.prior(deter))
    feats.append(torch.cat([deter, stoch], -1))
    return torch.stack(feats), torch.stack(log_probs), torch.stack(entropies)


def behavior_losses(agent: Agent, start_states, args: Args, update_norm: bool = True):
    """Actor and critic losses on an imagined rollout. Returns (actor_loss, critic_loss, parts)."""
    wm = agent.world_model
    feat, log_prob, entropy = imagine(agent, start_states, args.imagination_horizon)  # (H+1, N, F), (H, N)
    with torch.no_grad():
        reward = twohot_mean(wm.reward_head(feat), wm.bins)  # (H+1, N)
        continues = torch.sigmoid(wm.continue_head(feat).squeeze(-1).float())
        continues[0] = start_states[2]  # the start state's own continue flag is known
        discount = args.gamma * continues
        value = agent.critic.value(feat)  # (H+1, N)
        slow_value = agent.slow_critic.value(feat)
        returns = lambda_returns(reward, value, discount, args.return_lambda)  # (H, N)
        weight = torch.cumprod(torch.cat([torch.ones_like(discount[:1]), discount[:-2]]), 0)  # (H, N)
        if update_norm:
            agent.return_norm.update(returns)
        advantage = (returns - value[:-1]) / agent.return_norm.scale()
    # ALGO LOGIC: REINFORCE on normalised advantages + entropy; the critic is pulled toward the slow critic
    actor_loss = -(weight * (log_prob * advantage + args.entropy_coef * entropy)).mean()
    critic_logits = agent.critic(feat[:-1])  # (H, N, K)
    critic_loss = (
        weight
        * (
            twohot_loss(critic_logits, returns, agent.critic.bins)
            + twohot_loss(critic_logits, slow_value[:-1], agent.critic.bins)
        )
    ).mean()
    parts = {
        "losses/actor": actor_loss,
        "losses/critic": critic_loss,
        "losses/entropy": entropy.mean(),
        "debug/imagined_return": returns.mean(),
        "debug/return_scale": agent.return_norm.scale(),
    }
    return actor_loss, critic_loss, parts


def train_behavior(agent: Agent, start_states, args: Args) -> dict[str, float]:
    """One actor and one critic update from imagined rollouts; then the slow critic follows the critic."""
    with agent.amp.autocast():
        actor_loss, critic_loss, parts = behavior_losses(agent, start_states, args)
    actor_parts = {k: v for k, v in parts.items() if k != "losses/critic"}
    metrics, actor_stepped = optimizer_step(
        agent,
        agent.actor_optimizer,
        agent.actor.parameters(),
        actor_loss,
        args.actor_critic_grad_clip,
        actor_parts,
        _no_probe,
    )
    metrics["debug/actor_grad_norm"] = metrics.pop("grad_norm")
    critic_metrics, critic_stepped = optimizer_step(
        agent,
        agent.critic_optimizer,
        agent.critic.parameters(),
        critic_loss,
        args.actor_critic_grad_clip,
        {"losses/critic": parts["losses/critic"]},
        _no_probe,
    )
    metrics["losses/critic"] = critic_metrics["losses/critic"]
    metrics["debug/critic_grad_norm"] = critic_metrics["grad_norm"]
    with torch.no_grad():
        for slow, fast in zip(agent.slow_critic.parameters(), agent.critic.parameters()):
            slow.lerp_(fast, args.slow_critic_fraction)
    metrics["debug/update_skipped"] = 0.0 if (actor_stepped and critic_stepped) else 1.0
    return metrics


def synthetic_batch(args: Args, obs_shape: tuple) -> dict[str, np.ndarray]:
    """A worst-case-sized batch (full B x T) for the start-up preflight."""
    B, T = args.batch_size, args.sequence_length
    is_first = np.zeros((B, T), np.bool_)
    is_first[:, 0] = True
    return {
        "obs": np.zeros((B, T, *obs_shape), np.uint8),
        "action": np.zeros((B, T), np.uint8),
        "reward": np.zeros((B, T), np.float32),
        "is_first": is_first,
        "is_terminal": np.zeros((B, T), np.bool_),
    }


def preflight(agent: Agent, args: Args, obs_shape: tuple) -> None:
    """Create all optimizer state now with a worst-case batch; weights and moments are left untouched."""

    def step_fn():
        data = batch_to_device(synthetic_batch(args, obs_shape), agent.num_actions, agent.device)
        with agent.amp.autocast():
            loss, _, (deter, stoch) = world_model_loss(agent, data, args, _no_probe)
        loss.backward()
        deter, stoch = deter.detach().flatten(0, 1), stoch.detach().flatten(0, 1)  # (B*T, D), (B*T, S)
        states = (deter, stoch, torch.ones(deter.shape[0], device=agent.device))
        with agent.amp.autocast():
            actor_loss, critic_loss, _ = behavior_losses(agent, states, args, update_norm=False)
        (actor_loss + critic_loss).backward()

    try:
        # memory: Adam's moments exist before the first real update (fail now, not hours later); no weight moves
        peak_mb = mu.preallocate_optimizer_state(step_fn, agent.optimizers)
    except torch.OutOfMemoryError:
        free, total = torch.cuda.mem_get_info(agent.device)
        print(
            f"preflight: a worst-case update does not fit "
            f"({free / 2**20:.0f} MiB free of {total / 2**20:.0f} MiB). "
            f"Flags that help: --amp fp16, a smaller --batch-size ({args.batch_size}) or --sequence-length "
            f"({args.sequence_length}), a shorter --imagination-horizon ({args.imagination_horizon}).",
            file=sys.stderr,
        )
        raise SystemExit(EXIT_OOM)
    if agent.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(agent.device)
        print(f"preflight: peak {peak_mb:.0f} MiB, free {free / 2**20:.0f} MiB of {total / 2**20:.0f} MiB")
        if peak_mb > 0.9 * free:
            print(
                "preflight: little headroom left; --amp fp16, a smaller --batch-size or --sequence-length "
                "help"
            )
    else:
        print(f"preflight: peak {peak_mb:.0f} MiB of host memory for one worst-case update")


# ---------------------------------------------------------------------------------------------------------
# Checkpoints (tensors and plain containers only: they load with weights_only=True)
# ---------------------------------------------------------------------------------------------------------
def save_checkpoint(
    path: str,
    agent: Agent,
    counters: dict,
    run_name: str,
    args: Args,
    replay: EpisodeReplay | None = None,
    rng: np.random.Generator | None = None,
) -> str:
    state = {
        "format": CHECKPOINT_FORMAT,
        "run_name": run_name,
        "args": asdict(args),
        "models": {name: module.state_dict() for name, module in agent.modules().items()},
        "optimizers": {
            "world_model": agent.world_model_optimizer.state_dict(),
            "actor": agent.actor_optimizer.state_dict(),
            "critic": agent.critic_optimizer.state_dict(),
        },
        "scaler": agent.amp.scaler.state_dict(),
        "counters": dict(counters),
        "rng": {
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
            "numpy": None if rng is None else rng.bit_generator.state,
        },
        "replay": replay.state_dict() if (replay is not None and args.checkpoint_buffer) else None,
    }
    if torch.cuda.is_available() and agent.device.type == "cuda":
        state["rng"]["cuda"] = torch.cuda.get_rng_state(agent.device)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, path)  # a crash while writing never leaves a half-written checkpoint behind
    return path


def load_checkpoint(path: str) -> dict:
    """Load with weights_only=True; any failure is one ArgsError sentence."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - corrupt, truncated, or not a checkpoint at all
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ArgsError(f"--resume {path!r} is not a readable checkpoint ({first_line[:160]}).")
    if (
        not isinstance(state, dict)
        or state.get("format") != CHECKPOINT_FORMAT
        or not isinstance(state.get("args"), dict)
    ):
        raise ArgsError(f"--resume {path!r} is not a {CHECKPOINT_FORMAT} checkpoint.")
    return state


MODEL_FLAGS = (
    "env_id",
    "encoder_channels",
    "embed_dim",
    "decoder_base_channels",
    "decoder_mid_channels",
    "deterministic_dim",
    "stochastic_dim",
    "stochastic_classes",
    "hidden_dim",
    "reward_bins",
)


def check_checkpoint_matches(state: dict, args: Args) -> None:
    """The flags that shape the networks must be the ones the checkpoint was trained with."""
    for name in MODEL_FLAGS:
        saved, wanted = state["args"].get(name), getattr(args, name)
        if isinstance(wanted, tuple):
            saved = tuple(saved) if saved is not None else None
        if saved != wanted:
            flag = "--" + name.replace("_", "-")
            raise ArgsError(
                f"--resume checkpoint was trained with {flag} {saved}, but this run asks for {wanted}."
            )


def restore_checkpoint(state: dict, agent: Agent, replay: EpisodeReplay, rng: np.random.Generator) -> dict:
    try:
        for name, module in agent.modules().items():
            module.load_state_dict(state["models"][name])
        agent.world_model_optimizer.load_state_dict(state["optimizers"]["world_model"])
        agent.actor_optimizer.load_state_dict(state["optimizers"]["actor"])
        agent.critic_optimizer.load_state_dict(state["optimizers"]["critic"])
    except (RuntimeError, KeyError, ValueError) as exc:
        first_line = str(exc).strip().splitlines()[0]
        raise ArgsError(f"the checkpoint does not match these model flags ({first_line[:160]}).")
    if state["scaler"]:
        agent.amp.scaler.load_state_dict(state["scaler"])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    if state["rng"].get("numpy") is not None:
        rng.bit_generator.state = state["rng"]["numpy"]
    if "cuda" in state["rng"] and agent.device.type == "cuda":
        torch.cuda.set_rng_state(state["rng"]["cuda"], agent.device)
    if state.get("replay") is not None:
        replay.load_state_dict(state["replay"])
    return dict(state["counters"])


# ---------------------------------------------------------------------------------------------------------
# Logging helpers
# ---------------------------------------------------------------------------------------------------------
class MetricMeans:
    """Running means of logged values between two log points. Accepts Python numbers only."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.counts: dict[str, int] = {}

    def add(self, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            # memory: a tensor here would keep its whole graph alive until the next log point
            if not isinstance(value, (int, float)):
                raise TypeError(f"{key} must be a Python number, got {type(value).__name__}")
            self.sums[key] = self.sums.get(key, 0.0) + float(value)
            self.counts[key] = self.counts.get(key, 0) + 1

    def pop(self) -> dict[str, float]:
        means = {key: self.sums[key] / self.counts[key] for key in self.sums}
        self.sums, self.counts = {}, {}
        return means


class ProgressLine:
    """step, SPS, last return, RSS, GPU alloc, ETA. On a terminal the line is rewritten about once a second;
    in a log file it is printed once per log interval."""

    def __init__(self, total: int, device: torch.device):
        self.total, self.device = total, device
        self.live = sys.stdout.isatty()
        self.last_refresh = 0.0
        self.pending = False  # a live line without its newline is on screen

    def text(
        self, step: int, sps: float, last_return: float | None, rss_mb: float, gpu_mb: float | None
    ) -> str:
        eta_s = (self.total - step) / sps if sps > 0 else float("inf")
        eta = (
            f"{int(eta_s // 3600)}:{time.strftime('%M:%S', time.gmtime(eta_s))}"
            if math.isfinite(eta_s)
            else "--"
        )
        ret = "--" if last_return is None else f"{last_return:.1f}"
        gpu = "--" if gpu_mb is None else f"{gpu_mb:.0f} MB"
        return (
            f"step {step}/{self.total}  SPS {sps:.0f}  return {ret}  RSS {rss_mb:.0f} MB  "
            f"GPU alloc {gpu}  ETA {eta}"
        )

    def refresh(self, step: int, sps: float, last_return: float | None) -> None:
        """Cheap enough to call every loop iteration: does something at most once a second, on a terminal."""
        now = time.time()
        if not self.live or now - self.last_refresh < 1.0:
            return
        self.last_refresh = now
        gpu = torch.cuda.memory_allocated(self.device) / 2**20 if self.device.type == "cuda" else None
        print("\r" + self.text(step, sps, last_return, mu.process_rss_mb(), gpu), end="", flush=True)
        self.pending = True

    def line(self, step: int, sps: float, last_return: float | None, report: dict) -> None:
        self.say(
            self.text(step, sps, last_return, report.get(mu.KEY_RSS_MB, 0.0), report.get(mu.KEY_GPU_ALLOC_MB))
        )

    def say(self, message: str) -> None:
        """Print a whole line without mangling a live line that is on screen."""
        print(("\r\033[K" if self.pending else "") + message, flush=True)
        self.pending = False


def exit_with(message: str, code: int) -> None:
    print(message, file=sys.stderr, flush=True)
    raise SystemExit(code)


# ---------------------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------------------
def main(args: Args) -> dict:
    """Train; returns the final counters (global_step, updates, ...) and the run directory."""
    mu.configure_allocator(verbose=False)  # memory: before anything touches CUDA
    # validation first: nothing starts and nothing is written for bad input
    try:
        check_args(args)
        device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
        try:
            mu.amp(args.amp, device)
        except ValueError as exc:
            raise ArgsError(f"--amp {args.amp} is not available here: {exc}.")
        resume_state = load_checkpoint(args.resume) if args.resume else None
        if resume_state is not None:
            check_checkpoint_matches(resume_state, args)
    except ArgsError as exc:
        exit_with(f"error: {exc}", EXIT_BAD_INPUT)

    run_name = (
        resume_state["run_name"]
        if resume_state
        else f"{args.env_id.replace('/', '_')}__{args.exp_name}__{args.seed}__{int(time.time())}"
    )
    run_dir = f"runs/{run_name}"
    checkpoint_path = os.path.join(run_dir, "checkpoint.pt")
    if args.track:
        import wandb

        wandb.init(
            project=args.wandb_project_name,
            entity=args.wandb_entity,
            sync_tensorboard=True,
            config=vars(args),
            name=run_name,
            id=run_name,
            resume="allow",
            monitor_gym=True,
            save_code=True,
        )
    writer = SummaryWriter(run_dir)
    writer.add_text(
        "hyperparameters",
        "|param|value|\n|-|-|\n%s" % "\n".join(f"|{key}|{value}|" for key, value in vars(args).items()),
    )

    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    rng = np.random.default_rng(args.seed)

    envs = make_vector_env(args, run_name, args.seed)
    obs_shape = envs.single_observation_space.shape  # (4, 84, 84)
    num_actions = int(envs.single_action_space.n)
    agent = build_agent(args, obs_shape, num_actions, device)
    replay = EpisodeReplay(args.buffer_capacity, args.num_envs, seed=args.seed)
    player = Player(agent, args.num_envs)
    if device.type == "cuda":
        mu.install_oom_observer(run_dir)
    if args.preallocate:
        preflight(agent, args, obs_shape)

    counters = {
        "global_step": 0,
        "updates": 0,
        "behavior_updates": 0,
        "updates_owed": 0.0,
        "nonfinite_updates": 0,
        "episodes": 0,
    }
    if resume_state is not None:
        try:
            counters.update(restore_checkpoint(resume_state, agent, replay, rng))
        except ArgsError as exc:
            envs.close()
            exit_with(f"error: {exc}", EXIT_BAD_INPUT)
        print(f"resumed {run_name} at step {counters['global_step']} ({counters['updates']} updates)")
        resume_state = None  # memory: the loaded tensors are now inside the modules; drop the copies

    probes = mu.StageProbes(enabled=args.memory_probes, device=device)
    snapshots = mu.MemorySnapshots(
        run_dir, every=args.memory_snapshot_every, max_entries=args.snapshot_max_entries, device=device
    )
    leak_detector = mu.LeakDetector(warmup_steps=counters["global_step"] + args.leak_warmup_steps)
    means = MetricMeans()
    progress = ProgressLine(args.total_timesteps, device)
    last_report: dict[str, float] = {}
    last_return: float | None = None
    last_verdict = None
    nonfinite_in_a_row = 0

    stop_signal: list[int] = []
    previous_handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in previous_handlers:
        signal.signal(sig, lambda signum, frame: stop_signal.append(signum))

    def checkpoint(reason: str) -> None:
        save_checkpoint(checkpoint_path, agent, counters, run_name, args, replay, rng)
        progress.say(f"checkpoint ({reason}): {checkpoint_path} at step {counters['global_step']}")

    start_time, start_step, start_updates = time.time(), counters["global_step"], counters["updates"]
    next_log = (counters["global_step"] // args.log_interval + 1) * args.log_interval
    next_checkpoint = (
        (counters["global_step"] // args.checkpoint_every + 1) * args.checkpoint_every
        if args.checkpoint_every
        else None
    )
    behavior_starts = args.learning_starts + args.warmup_steps
    obs, _ = envs.reset(seed=args.seed + counters["global_step"])
    for i in range(args.num_envs):
        replay.start_episode(i, obs[i])
    is_first = np.ones(args.num_envs, np.bool_)
    try:
        while counters["global_step"] < args.total_timesteps:
            probes("loop_start")
            if stop_signal:
                checkpoint(signal.Signals(stop_signal[0]).name)
                raise SystemExit(128 + stop_signal[0])

            # ALGO LOGIC: collect one vector step (random actions until learning starts)
            if counters["global_step"] < args.learning_starts:
                actions = rng.integers(num_actions, size=args.num_envs)
            else:
                actions = player.act(obs, is_first)
            next_obs, rewards, terminations, truncations, infos = envs.step(actions)
            replay.add(next_obs, actions, rewards, terminations, truncations, infos)
            if "final_info" in infos and "episode" in infos["final_info"]:
                episode = infos["final_info"]["episode"]
                for i in np.flatnonzero(infos["final_info"]["_episode"]):
                    last_return = float(episode["r"][i])
                    counters["episodes"] += 1
                    writer.add_scalar("charts/episodic_return", last_return, counters["global_step"])
                    writer.add_scalar(
                        "charts/episodic_length", float(episode["l"][i]), counters["global_step"]
                    )
            obs, is_first = next_obs, np.logical_or(terminations, truncations)
            counters["global_step"] += args.num_envs
            probes("after_collect")

            # ALGO LOGIC: updates, one batch at a time (never sampled all at once to "catch up")
            if counters["global_step"] >= args.learning_starts and replay.can_sample(args.sequence_length):
                replayed_per_update = args.batch_size * args.sequence_length
                counters["updates_owed"] += args.num_envs * args.train_ratio / replayed_per_update
                while counters["updates_owed"] >= 1.0:
                    counters["updates_owed"] -= 1.0
                    oom_error = None
                    try:
                        batch = replay.sample(args.batch_size, args.sequence_length)
                        probes("after_sample")
                        probe = probes if args.memory_probes else None
                        metrics, states = train_world_model(agent, batch, args, probe=probe)
                        del batch
                        skipped = metrics["debug/update_skipped"] > 0
                        if not skipped and counters["global_step"] >= behavior_starts:
                            behavior = train_behavior(agent, states, args)
                            skipped = behavior.pop("debug/update_skipped") > 0
                            metrics.update(behavior)
                            counters["behavior_updates"] += 1
                        del states
                    except torch.OutOfMemoryError as exc:
                        # memory: clear the failed step's frames so its activations are freed before reporting
                        traceback.clear_frames(exc.__traceback__)
                        oom_error = exc.with_traceback(None)
                    if oom_error is not None:
                        batch = states = None
                        gc.collect()
                        diagnosis = mu.write_oom_report(
                            run_dir, oom_error, last_report, verdict=last_verdict, device=device, advice=OOM_ADVICE
                        )
                        if device.type == "cuda":
                            torch.cuda.empty_cache()  # after the report, so it still shows any fragmentation
                        checkpoint("out of memory")
                        exit_with(f"out of memory at step {counters['global_step']}:\n{diagnosis}", EXIT_OOM)
                    metrics.pop("debug/update_skipped")
                    counters["updates"] += 1
                    if skipped:
                        counters["nonfinite_updates"] += 1
                        nonfinite_in_a_row += 1
                        if nonfinite_in_a_row >= args.max_nonfinite:
                            checkpoint("non-finite losses")
                            exit_with(
                                f"stopping: {nonfinite_in_a_row} updates in a row had a non-finite loss or "
                                f"gradient (last: {metrics}); try --amp off or lower learning rates.",
                                EXIT_NONFINITE,
                            )
                    else:
                        nonfinite_in_a_row = 0
                        means.add(metrics)
            probes.end_iteration(counters["global_step"])
            snapshots.maybe_dump(counters["global_step"])
            progress.refresh(
                counters["global_step"],
                (counters["global_step"] - start_step) / max(time.time() - start_time, 1e-9),
                last_return,
            )

            if counters["global_step"] >= next_log:
                next_log = (counters["global_step"] // args.log_interval + 1) * args.log_interval
                step = counters["global_step"]
                elapsed = max(time.time() - start_time, 1e-9)
                sps = (step - start_step) / elapsed
                # memory: memory_report() collects garbage and trims the heap first, so this is live memory
                last_report = mu.memory_report(buffer_stats=replay.stats(), device=device)
                scalars = {
                    **last_report,
                    **means.pop(),
                    **probes.scalars(),
                    "charts/SPS": sps,
                    "charts/updates_per_second": (counters["updates"] - start_updates) / elapsed,
                    "debug/nonfinite_updates": float(counters["nonfinite_updates"]),
                }
                for key, value in scalars.items():
                    writer.add_scalar(key, value, step)
                leak_detector.observe(step, last_report)
                verdict = leak_detector.check()
                if verdict.leaking and (
                    last_verdict is None or not last_verdict.leaking or verdict.cause != last_verdict.cause
                ):
                    progress.say(verdict.diagnosis)
                last_verdict = verdict
                progress.line(step, sps, last_return, last_report)
                if verdict.leaking and args.abort_on_leak:
                    checkpoint("leak detected")
                    exit_with(f"stopping (--abort-on-leak): {verdict.diagnosis}", EXIT_LEAK)
            if next_checkpoint is not None and counters["global_step"] >= next_checkpoint:
                next_checkpoint = (
                    counters["global_step"] // args.checkpoint_every + 1
                ) * args.checkpoint_every
                checkpoint("periodic")

        if args.save_model:
            checkpoint("end of training")
        if args.memory_probes:
            progress.say(probes.verdict())
    finally:
        for sig, handler in previous_handlers.items():
            signal.signal(sig, handler)
        snapshots.close()
        envs.close()
        writer.close()
        if args.track:
            import wandb

            wandb.finish()
    return {**counters, "run_dir": run_dir, "run_name": run_name}


if __name__ == "__main__":
    main(tyro.cli(Args))
