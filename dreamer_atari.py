"""Dreamer on Atari: DreamerV3 2023's Atari100k recipe, a world model and an actor-critic that learns in its
imagination, memory-safe and observable. `python dreamer_atari.py --buffer-capacity 50000`

Part 1 is the algorithm in the order it runs (arguments, environment, replay, networks, the RSSM, losses, the loop);
it alone trains on a CPU (the default there) and wherever every speed option is off. On CUDA, Part 2 puts faster
equivalents of some of its functions in place, each checked against the Part 1 code it replaces and pinned to it:
where that code changed, the path steps aside and Part 1 trains the change. Part 3 runs it: input checks, logging,
videos, memory, checkpoints. Shape comments give the default model's shapes: B x T = 16 x 64 replayed steps.

Logs go to TensorBoard in `runs/{run_name}` (wandb with `--track`): `charts/*`, `losses/*`, memory figures and, on
Pong, `world_model/ball_f1_*`; checkpoints to `runs/{run_name}/checkpoint.pt` (`--resume PATH` continues a run).
"""

# =====================================================================================================================
# PART 1: THE ALGORITHM, in the order it runs. A fast path stands in for its code only where pinned to it.
# =====================================================================================================================

import contextlib
import dataclasses
import functools
import itertools
import math
import os
import random
import re
import signal
import sys
import time
import types
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Literal, get_args, get_origin

if __name__ == "__main__":  # a stop signal while the libraries below load: exit 128 + N, nothing written yet
    for _signal in (signal.SIGINT, signal.SIGTERM):
        signal.signal(_signal, lambda signum, frame: sys.exit(128 + signum))

import ale_py
import cv2
import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F
import tyro
from torch import nn
from torch.utils.tensorboard import SummaryWriter

import memory_utils as mu

gym.register_envs(ale_py)


@dataclass(frozen=True)
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
    video_every: int = 10_000
    """log open-loop predictions (5 frames seen, the rest imagined) as a video every this many env steps (0 = off)"""
    save_model: bool = True
    """whether to write a checkpoint at the end of training"""
    checkpoint_minutes: float = 15.0
    """write a checkpoint every this many minutes of wall time (DreamerV3's 900 s; 0 = not by time)"""
    checkpoint_every: int = 0
    """write a checkpoint every this many env steps too (0 = not by steps); always at the end, on signals and errors"""
    resume: str | None = None
    """path of a checkpoint to continue from (models, optimizers, loss scalers, counters, RNG state)"""
    log_interval: int = 1000
    """write charts, losses and memory figures every this many env steps"""

    # environment
    env_id: str = "ALE/Pong-v5"
    """the id of the Atari environment"""
    num_envs: int = 1
    """the number of parallel game environments (DreamerV3's Atari100k recipe: 1)"""
    vector_mode: Literal["auto", "sync", "async"] = "auto"
    """`async` (a process per env), `sync` (all in this process), or `auto` (async when num_envs > 1)"""
    repeat_action_probability: float = 0.0
    """sticky-action probability of the emulator"""
    noop_max: int = 30
    """at most this many no-op actions at the start of an episode"""
    max_episode_steps: int = 0
    """truncate episodes after this many agent steps (0 = the game's own limit)"""
    image_size: int | None = None
    """side of the square frames in pixels (Atari frames are resized to it). Unset: the --model's own (64, 84)"""
    frame_stack: int | None = None
    """frames stacked into each observation, newest last, read as channels. Unset: the --model's own (1, 4)"""
    rgb: bool = True
    """Atari frames in colour, as DreamerV3 reads them (--model nature and grey envs such as Catch-v0: grey)"""

    # replay
    buffer_capacity: int | None = None
    """replay capacity in env steps (12.3 KB per Pong step, 4.1 with --no-rgb). Unset: every step (DreamerV3's)"""
    batch_size: int = 16
    """the number of sequences per world-model batch"""
    sequence_length: int = 64
    """the length of each replayed sequence (DreamerV3: 64); its first step starts from the initial state"""
    replay_on_disk: bool = True
    """keep each stored step on disk too (runs/{run_name}/replay/): a resume restores the replay; off: a resumed run
    starts with an empty replay"""
    replay_chunk_steps: int = 1024
    """steps per file of the replay on disk (DreamerV3's chunks: 1,024); the last, partial one goes in checkpoints"""

    # model
    model: Literal["dreamerv3", "nature"] = "dreamerv3"
    """a row of `MODELS`: dreamerv3 (DreamerV3's size S) or nature (smaller, on 4 stacked 84x84 frames)"""
    encoder_channels: tuple[int, ...] | None = None
    """channels of the encoder's convolutions. Unset: dreamerv3 (32, 64, 128, 256), nature (32, 64, 64)"""
    embed_dim: int = 512
    """nature only: size of the encoder's output features (dreamerv3's are its last map, flattened)"""
    decoder_base_channels: int = 32
    """nature only: channels of the decoder's last hidden map (the one before it has twice this)"""
    decoder_mid_channels: int = 16
    """nature only: channels of the decoder's bottleneck map (7x7 at 84 pixels)"""
    deterministic_dim: int | None = None
    """size of the RSSM's deterministic (GRU) state `deter`. Unset: dreamerv3 512, nature 200"""
    stochastic_dim: int = 32
    """number of stochastic latent variables in `stoch`"""
    stochastic_classes: int = 32
    """classes per categorical latent; 0 gives DreamerV1 Gaussian latents"""
    hidden_dim: int | None = None
    """width of the RSSM's and the heads' hidden layers. Unset: dreamerv3 512, nature 200"""
    unimix: float = 0.01
    """share of the uniform distribution mixed into categorical latents and the policy"""
    initial_state: Literal["learned", "zeros"] = "learned"
    """each episode's (and replayed sequence's) first state: learned (DreamerV3's deter = tanh(w)) or zeros"""
    reward_bins: int = 255
    """two-hot bins (on the symlog scale) of the reward head and the critic"""

    # training
    total_timesteps: int = 100_000
    """total env steps of the experiment (DreamerV3's Atari100k: 100k env steps of 4 frames)"""
    learning_starts: int = 1_000
    """env steps of random actions that fill the replay before any update (DreamerV3: about 1k)"""
    warmup_steps: int = 0
    """env steps after `learning_starts` during which only the world model trains (DreamerV3: 0)"""
    train_ratio: float = 1024.0
    """replayed steps per env step: train_ratio / (batch_size x sequence_length) updates per env step"""
    world_model_lr: float = 1e-4
    """learning rate of the world model"""
    actor_lr: float = 3e-5
    """learning rate of the actor"""
    critic_lr: float = 3e-5
    """learning rate of the critic"""
    world_model_eps: float = 1e-8
    """epsilon of the world model's Adam (DreamerV3: 1e-8)"""
    actor_eps: float = 1e-5
    """epsilon of the actor's Adam (DreamerV3: 1e-5)"""
    critic_eps: float = 1e-5
    """epsilon of the critic's Adam (DreamerV3: 1e-5)"""
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
    image_loss_scale: float = 1.0
    """weight of the image reconstruction loss (DreamerV3: 1)"""
    no_decoder_loss: bool = False
    """switch off the image reconstruction loss (isolation experiments)"""
    no_reward_loss: bool = False
    """switch off the reward loss (isolation experiments)"""
    no_kl_loss: bool = False
    """switch off the KL loss (isolation experiments)"""
    imagination_horizon: int = 15
    """length of the imagined rollouts"""
    continue_mode: bool = True
    """discount imagined rollouts by the continue head's mode (0 or 1, as DreamerV3), not its probability"""
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
    """stop (exit 5) after this many updates, or steps of one env, in a row with a non-finite value (each left out)"""
    precision: Literal["float32", "bf16", "fp16"] = "float32"
    """float32 (DreamerV3's Atari100k); bf16 autocast with the observe scan in float32; fp16 (CUDA, loss scaling)"""

    # memory
    preallocate: bool = True
    """create optimizer state at start-up with a worst-case batch (fail fast instead of OOM hours later)"""
    abort_on_leak: bool = False
    """stop with a checkpoint when the leak detector has suspected growth at 30 log points in a row"""
    leak_warmup_steps: int = 30_000
    """env steps before the leak detector judges growth (a sawtooth of up to 30k steps has given memory back)"""
    memory_snapshot_every: int = 0
    """dump a CUDA allocator snapshot every this many env steps (0 = off) into runs/{run_name}/"""
    snapshot_max_entries: int = 100_000
    """allocator history ring size of the snapshots"""
    memory_probes: bool = False
    """record memory at each stage of the loop and the update (debug/probe/*) to name the stage that grows"""
    gpu_memory_gb: float | None = None
    """CUDA: use at most this many GiB of the GPU, its CUDA context's 0.5 GiB included (a share of a shared card, or
    a rehearsal of a smaller one: 6 is a 6 GB card); a run that cannot fit says what does not before it trains"""

    # speed: each flag turns off one faster equivalent of a function above, checked against it (dreamer_kernels.py's,
    # and Part 2's); `auto` is on where a committed result showed that the path pays (docs/dreamer_kernels.md)
    fast_observe: Literal["auto", "on", "off"] = "auto"
    """the observe scan in fewer kernels, its backward --observe-backward's (auto: on CUDA); off: `RSSM.observe`"""
    observe_backward: Literal["hand-written", "autograd"] = "hand-written"
    """the fast observe's backward: hand-written (47 operations per step instead of 80) or autograd's"""
    fused_scan: Literal["auto", "on", "off"] = "auto"
    """CUDA: each step of the fast observe, and of its hand-written backward, as 4 Triton kernels (auto: where shown)"""
    fast_imagine: Literal["auto", "on", "off"] = "auto"
    """imagine without a graph, then the actor once with gradients on all states (auto: on CUDA); off: `imagine`"""
    imagine_gathers: Literal["auto", "on", "off"] = "auto"
    """the fast imagination's products with one-hot latents and actions as gathers of weight rows"""
    fused_epilogues: Literal["auto", "on", "off"] = "auto"
    """CUDA, on the gathers: an imagined step's and the heads' work after each product as one Triton kernel each"""
    fast_heads: Literal["auto", "on", "off"] = "auto"
    """the five heads on imagined states share one first-layer product; off: `imagined_heads` as written"""
    compile: bool = False
    """torch.compile the update's steps, losses, targets and networks (the first updates take longer)"""
    compile_loops: bool = False
    """with --compile: Part 1's observe and imagine loops each one whole graph (many minutes of compiling)"""
    cudagraph: bool = True
    """CUDA: capture the updates and the policy step in CUDA graphs after 3 eager calls (--precision float32, bf16)"""
    tf32: bool = True
    """CUDA: float32 matrix products on TensorFloat-32 tensor cores"""
    channels_last: Literal["auto", "on", "off"] = "auto"
    """the encoder's and decoder's convolutions, and the batch's frames, channels-last (NHWC) (auto: on CUDA)"""
    replay_frames: Literal["auto", "device", "host"] = "auto"
    """the replay's frames on the `device` (batches gathered there), the `host`, or `auto` (said at start)"""
    check_every: int | None = None
    """updates between checks of the fast paths on the live weights (0: at start-up only; default: per device)"""

    def __post_init__(self):
        # the size flags left unset take the chosen model's values (an unknown --model is refused later)
        model = MODELS.get(self.model)
        for name, value in (model.sizes if model else {}).items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)  # frozen from here on
        # colour where the frames have it and the model reads it
        rgb = self.rgb and model is not None and model.colour and env_has_colour(self.env_id)
        object.__setattr__(self, "rgb", rgb)


# --- Environment ------------------------------------------------------------------------------------------------------


def is_atari(env_id: str) -> bool:
    return "ale_py" in str(gym.spec(env_id).entry_point)


def env_has_colour(env_id: str) -> bool:
    """Whether `env_id` gives colour frames (Atari); False for an id that is not registered (refused later)."""
    try:
        return is_atari(env_id)
    except gym.error.Error:
        return False


def env_kwargs(env_id: str, args: Args) -> dict:
    """What `gym.make` gets besides the id: the emulator's settings for Atari, the frames' side for other envs."""
    if is_atari(env_id):
        return dict(frameskip=1, repeat_action_probability=args.repeat_action_probability)
    return dict(size=args.image_size)


def make_env(env_id: str, idx: int, capture_video: bool, run_name: str, args: Args, guard=None) -> Callable:
    """Atari ids get the usual preprocessing (frame skip 4, `--image-size`, no-op starts); other ids are made
    with `size=--image-size` and must give grey uint8 frames of that side (Catch-v0 does). Stacks of --frame-stack.
    `guard`: the run's wrapper of each step before the episode's statistics see it (one that is not finite)."""

    def thunk():
        kwargs = env_kwargs(env_id, args)
        if capture_video and idx == 0:
            env = gym.make(env_id, render_mode="rgb_array", **kwargs)
            env = gym.wrappers.RecordVideo(env, f"videos/{run_name}")
        else:
            env = gym.make(env_id, **kwargs)
        if is_atari(env_id):
            env = gym.wrappers.AtariPreprocessing(
                env,
                frame_skip=4,
                screen_size=args.image_size,
                grayscale_obs=not args.rgb,
                noop_max=args.noop_max,
            )
            if args.rgb:  # (S, S, 3) -> (3, S, S): a frame's channels first, as the encoder reads them
                env = channels_first(env)
        env = guard(env) if guard is not None else env
        if args.max_episode_steps > 0:
            env = gym.wrappers.TimeLimit(env, args.max_episode_steps)
        env = gym.wrappers.RecordEpisodeStatistics(env)
        return gym.wrappers.FrameStackObservation(env, args.frame_stack)  # (1, 3, 64, 64) uint8

    return thunk


def channels_first(env: gym.Env) -> gym.Env:
    """Colour frames (S, S, 3) as (3, S, S)."""
    space = env.observation_space
    shape = (space.shape[2], *space.shape[:2])
    return gym.wrappers.TransformObservation(
        env, lambda obs: np.ascontiguousarray(obs.transpose(2, 0, 1)), gym.spaces.Box(0, 255, shape, np.uint8)
    )


def make_vector_env(args: Args, run_name: str, seed: int, guard=None) -> gym.vector.VectorEnv:
    """SAME_STEP autoreset: every stored transition is real (an ended episode's last obs is `final_obs`)."""
    fns = [make_env(args.env_id, i, args.capture_video, run_name, args, guard) for i in range(args.num_envs)]
    mode = args.vector_mode if args.vector_mode != "auto" else ("async" if args.num_envs > 1 else "sync")
    autoreset = gym.vector.AutoresetMode.SAME_STEP
    if mode == "async":
        with mu.workers_ignore_stop_signals():  # on a signal the run checkpoints, then closes them
            envs = gym.vector.AsyncVectorEnv(fns, autoreset_mode=autoreset)
    else:
        envs = gym.vector.SyncVectorEnv(fns, autoreset_mode=autoreset)
    assert isinstance(envs.single_action_space, gym.spaces.Discrete), "only discrete actions are supported"
    envs.action_space.seed(seed)
    return envs


# --- Replay: episodes of frames stored once, stacks rebuilt when sampling ---------------------------------------------


class Episode:
    """One episode: per step a uint8 frame, the action that led to it, the reward on arriving (float32), is_first
    and is_terminal. With stacks of k frames, step t's stack is frames[t : t + k] (k - 1 older frames stored once)."""

    FIELDS = ("frames", "action", "reward", "is_first", "is_terminal")

    @staticmethod
    def shapes(first_obs: np.ndarray) -> dict[str, tuple[tuple, type]]:
        """Each field's item (shape, dtype); a frame is (3, 64, 64) uint8."""
        shapes = dict(frames=(first_obs.shape[1:], np.uint8), action=((), np.uint8), reward=((), np.float32))
        return shapes | dict(is_first=((), np.bool_), is_terminal=((), np.bool_))

    def __init__(self, first_obs: np.ndarray, columns):
        """first_obs (k, 3, 64, 64) uint8; `columns`: the fields' arrays, by name (`new_episode` makes them)."""
        self.stack, self.columns = len(first_obs), columns
        for name in self.FIELDS:  # frames, action, reward, is_first, is_terminal
            setattr(self, name, columns[name])
        self.done = False
        for frame in first_obs[:-1]:
            self.frames.append(frame)
        self.append(first_obs[-1], 0, 0.0, True, False)

    def append(self, frame, action: int, reward: float, is_first: bool, is_terminal: bool) -> None:
        for name, value in zip(self.FIELDS, (frame, action, reward, is_first, is_terminal)):
            self.columns[name].append(value)

    @property
    def num_steps(self) -> int:
        return len(self.action)

    def drop_front(self) -> int:
        """Drop the oldest chunk of an episode still being written (frames and aux in lockstep)."""
        if self.done or len(self.action.chunks) < 2:
            return 0
        # frames run k - 1 ahead, so step `start` still has its whole stack
        return [self.columns[name].drop_front_chunk() for name in self.FIELDS][1]  # the steps dropped

    def finish(self) -> None:
        self.done = True
        self.columns.compact()  # memory: a finished episode's arrays in one exact-size block

    def evict(self) -> None:
        """The replay drops this episode: its frames are released (host arrays are freed with the episode)."""
        self.frames.release()


class EpisodeReplay:
    """At most `capacity` env steps, whole oldest episodes evicted first (one that alone outgrows it loses its oldest
    chunk). Episodes being played are sampleable; a sequence may run from one stored episode into the next."""

    def __init__(self, capacity: int, num_envs: int, seed: int, chunk_size: int | None = None):
        self.capacity, self.num_envs = capacity, num_envs
        # memory: an episode being written wastes at most a chunk (64 colour frames: 0.79 MB, 8 B a step of 100k)
        self.chunk_size = chunk_size or int(np.clip(capacity // 64, 16, 64))
        self.episodes: deque[Episode] = deque()  # oldest first
        self.current: list[Episode | None] = [None] * num_envs
        self.total_steps = 0
        self.rng = np.random.default_rng(seed)
        # the steps' copy on disk (`mu.ReplayLog`) or None; the episodes begun (each one's id)
        self.log, self.begun = None, 0

    def new_episode(self, env_idx: int, first_obs: np.ndarray) -> Episode:
        # memory: in chunks (an episode being played wastes at most one) in memory maps of their own, out of the heap
        return Episode(first_obs, mu.ChunkedColumns(Episode.shapes(first_obs), self.chunk_size))

    def start_episode(self, env_idx: int, obs: np.ndarray) -> None:
        # an env reset in the middle of an episode: that episode has ended
        if self.current[env_idx] is not None:
            self.current[env_idx].finish()
        episode = self.new_episode(env_idx, obs)
        episode.id, episode.env, self.begun = self.begun, env_idx, self.begun + 1
        for index, frame in enumerate(obs):  # its first frames, the last of them its first step
            self.log_step(episode, index, frame, 0, 0.0, True, False)
        self.current[env_idx] = episode
        self.episodes.append(episode)
        self.total_steps += 1
        self._evict()

    def add_step(self, env_idx: int, frame, action: int, reward: float, terminated: bool, over: bool) -> None:
        episode = self.current[env_idx]
        episode.append(frame, action, reward, False, terminated)
        self.log_step(
            episode, episode.action.end + episode.stack - 2, frame, action, reward, False, terminated
        )
        self.total_steps += 1
        if over:
            episode.finish()
            self.current[env_idx] = None
        self._evict()

    def log_step(self, episode: Episode, index: int, *values) -> None:
        """The frame `index` of `episode` just stored, and its step's values (Episode.FIELDS), to the log on disk."""
        if self.log is not None:
            episode.log_start = episode.log_start if index else self.log.position  # where its rows begin
            self.log.append(
                dict(zip(Episode.FIELDS, values), episode=episode.id, env=episode.env, index=index)
            )

    def add(self, next_obs: np.ndarray, actions, rewards, terminations, truncations, infos: dict) -> None:
        """Store one vector step (SAME_STEP autoreset): `next_obs` is (N, 1, 3, 64, 64) uint8. A step the run's guard
        cut (info "nonfinite": a reward or frame that is not finite) is left out: its episode ends before it, truncated."""
        cut = infos.get("final_info", {}).get("_nonfinite", np.zeros(len(actions), np.bool_))
        for i in range(len(actions)):
            over = bool(terminations[i] or truncations[i])
            if not cut[i]:
                last = infos["final_obs"][i] if over else next_obs[i]
                self.add_step(i, last[-1], int(actions[i]), float(rewards[i]), bool(terminations[i]), over)
            if over:
                self.start_episode(i, next_obs[i])  # (a cut episode finishes here)

    def _evict(self) -> None:
        while self.total_steps > self.capacity:
            freed = 0
            for episode in list(self.episodes):
                if episode.done:
                    # memory: the only reference to a finished episode lives in this deque
                    self.episodes.remove(episode)
                    episode.evict()
                    freed = episode.num_steps
                elif episode.num_steps > 1:
                    freed = episode.drop_front()
                if freed:
                    break
            if not freed:
                return  # only chunks still being written are left; at most one chunk per env over capacity
            self.total_steps -= freed

    def can_sample(self, sequence_length: int) -> bool:
        return self.total_steps >= sequence_length

    def draw_windows(self, batch_size: int, sequence_length: int, rng=None) -> list[list[tuple]]:
        """Each window's pieces (episode, first step, steps): consecutive steps of the ring the stored episodes form, so
        every stored step is drawn equally often whatever the episode lengths. `rng`: the replay's own if None."""
        episodes = list(self.episodes)
        lengths = np.fromiter((ep.num_steps for ep in episodes), np.int64, len(episodes))
        ends = np.cumsum(lengths)  # stream position one past each episode's last step
        if ends[-1] < sequence_length:
            raise RuntimeError(
                f"the replay holds {ends[-1]} steps, fewer than one sequence of {sequence_length}"
            )
        rng = self.rng if rng is None else rng
        windows = []
        for start in rng.integers(0, ends[-1], size=batch_size):
            index = int(np.searchsorted(ends, start, side="right"))
            offset = int(start - (ends[index] - lengths[index]))  # steps into episode `index`
            pieces, left = [], sequence_length
            while left > 0:
                episode = episodes[index]
                take = min(left, episode.num_steps - offset)
                pieces.append((episode, episode.action.start + offset, take))
                left -= take
                index, offset = (index + 1) % len(episodes), 0
            windows.append(pieces)
        return windows

    def sample(self, batch_size: int, sequence_length: int, rng=None) -> dict[str, np.ndarray]:
        """Windows (`draw_windows`) as obs (B, T, 1, 3, 64, 64) uint8, action, reward, is_first, is_terminal (B, T),
        `is_first` where a window crosses into another episode. Another `rng` leaves the training batches as they are."""
        return self.fill(self.draw_windows(batch_size, sequence_length, rng), sequence_length)

    def fill(self, windows: list, sequence_length: int) -> dict[str, np.ndarray]:
        """The arrays of these windows, each a fresh copy."""
        T, B = sequence_length, len(windows)
        stack, frame_shape = windows[0][0][0].stack, windows[0][0][0].frames.item_shape
        # memory: a batch is a copy; it never aliases replay storage, so it cannot keep evicted episodes alive
        batch = {"obs": np.empty((B, T, stack, *frame_shape), np.uint8)}
        batch |= {"action": np.empty((B, T), np.uint8), "reward": np.empty((B, T), np.float32)}
        batch |= {"is_first": np.empty((B, T), np.bool_), "is_terminal": np.empty((B, T), np.bool_)}
        frames = np.empty((T + stack - 1, *frame_shape), np.uint8)  # one piece's frames, reused
        for b, pieces in enumerate(windows):
            filled = 0
            for episode, begin, take in pieces:
                piece = slice(filled, filled + take)
                # each piece rebuilds its stacks from its own episode's frames: a stack never mixes two episodes
                episode.frames.read_into(frames[: take + stack - 1], begin, begin + take + stack - 1)
                for k in range(stack):
                    batch["obs"][b, piece, k] = frames[k : k + take]
                for key in ("action", "reward", "is_first", "is_terminal"):
                    getattr(episode, key).read_into(batch[key][b, piece], begin, begin + take)
                # the state resets where a piece starts (DreamerV3's replay: from the initial state, no action)
                batch["is_first"][b, filled] = True
                filled += take
        return batch


# --- Networks ---------------------------------------------------------------------------------------------------------


def upcast(x: torch.Tensor) -> torch.Tensor:
    """An autocast output (bf16, fp16) back in float32 for the delicate parts; float32 and float64 stay."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def symlog(x: torch.Tensor) -> torch.Tensor:
    return torch.sign(x) * torch.log1p(x.abs())


def symexp(x: torch.Tensor) -> torch.Tensor:
    return torch.sign(x) * torch.expm1(x.abs())


def twohot_loss(logits: torch.Tensor, target: torch.Tensor, bins: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of `logits` (..., K) against the two-hot encoding of symlog(target) (...)."""
    x = symlog(target.to(bins.dtype)).clamp(bins[0], bins[-1]).unsqueeze(-1)  # (..., 1)
    below = ((bins <= x).sum(-1) - 1).clamp(0, len(bins) - 1)
    above = (below + 1).clamp(max=len(bins) - 1)
    dist_below = (bins[below] - x.squeeze(-1)).abs()
    dist_above = (bins[above] - x.squeeze(-1)).abs()
    same = below == above
    total = torch.where(same, torch.ones_like(dist_below), dist_below + dist_above)
    weight_below = torch.where(same, torch.ones_like(dist_below), dist_above / total)
    weight_above = torch.where(same, torch.zeros_like(dist_below), dist_below / total)
    log_probs = F.log_softmax(upcast(logits), -1)
    return -(
        log_probs.gather(-1, below.unsqueeze(-1)).squeeze(-1) * weight_below
        + log_probs.gather(-1, above.unsqueeze(-1)).squeeze(-1) * weight_above
    )


def twohot_mean(logits: torch.Tensor, bins: torch.Tensor) -> torch.Tensor:
    """Expected value of a symlog two-hot head, back on the original scale."""
    return symexp((F.softmax(upcast(logits), -1) * bins).sum(-1))


def mix_uniform(probs: torch.Tensor, unimix: float) -> torch.Tensor:
    """`probs` (..., C) with `unimix` of the uniform mixed in (DreamerV3's unimix: no class below unimix / C)."""
    return (1 - unimix) * probs + unimix / probs.shape[-1]


def draw_index(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """The class drawn from `probs` (..., C) by a uniform in [0, 1) per row (..., 1), as its index (...) int64: class k
    where CDF(k - 1) < u <= CDF(k), as `Categorical(probs).sample()`; the last class where no step of the float32 CDF
    before it lies below u (so rounding never leaves none, nor do probabilities that are not finite)."""
    cdf = probs.detach().float().cumsum(-1)
    return (cdf[..., :-1] < uniform).sum(-1)


def one_hot_draw(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """`draw_index`'s class as a float32 one-hot (..., C)."""
    return one_hot(draw_index(probs, uniform), probs.shape[-1])


def one_hot(index: torch.Tensor, classes: int) -> torch.Tensor:
    """float32 one-hot (..., classes) of integer `index` (...), with no range check read back to the host."""
    return (index.unsqueeze(-1) == torch.arange(classes, device=index.device)).float()


NORM_EPS = 1e-3  # every LayerNorm's epsilon, as DreamerV3's (torch's default is 1e-5)


def mlp(in_dim: int, out_dim: int, hidden_dim: int, zero_output: bool = False) -> nn.Sequential:
    layers = nn.Sequential()
    for previous in (in_dim, hidden_dim):  # two hidden layers: linear, LayerNorm, SiLU
        layers.extend([nn.Linear(previous, hidden_dim), nn.LayerNorm(hidden_dim, eps=NORM_EPS), nn.SiLU()])
    layers.append(nn.Linear(hidden_dim, out_dim))
    if zero_output:  # DreamerV3: reward and value heads start predicting 0
        nn.init.zeros_(layers[-1].weight)
        nn.init.zeros_(layers[-1].bias)
        layers[-1].zero_init = True  # decided here, once: `dreamerv3_init_` keeps it at zero
    return layers


def dense(in_dim: int, hidden_dim: int, out_dim: int | None = None) -> nn.Sequential:
    """The RSSM's layers: linear, LayerNorm and SiLU (`linear`, `norm`, `act`), then a linear `out` to `out_dim`."""
    layers = OrderedDict(linear=nn.Linear(in_dim, hidden_dim), norm=nn.LayerNorm(hidden_dim, eps=NORM_EPS))
    layers["act"] = nn.SiLU()
    if out_dim is not None:
        layers["out"] = nn.Linear(hidden_dim, out_dim)
    return nn.Sequential(layers)


NATURE_CONVS = ((8, 4), (4, 2), (3, 1))  # the NatureCNN's convolutions: (kernel, stride)


def nature_cnn_sizes(image_size: int) -> tuple[int, int, int]:
    """Sides of the NatureCNN's three maps: 84 gives 20, 9, 7 and 64 gives 15, 6, 4."""
    s1 = (image_size - 8) // 4 + 1
    s2 = (s1 - 4) // 2 + 1
    return s1, s2, s2 - 2


class NatureCNNEncoder(nn.Module):
    """(N, 4, S, S) float in [-0.5, 0.5] -> (N, E); S = --image-size, 84 in the shape comments."""

    def __init__(self, in_channels: int, channels: tuple, embed_dim: int, image_size: int = 84):
        super().__init__()
        self.embed_dim = embed_dim
        convs = zip(itertools.pairwise((in_channels, *channels)), NATURE_CONVS)  # (in, out), (kernel, stride)
        layers = [layer for (i, o), (k, s) in convs for layer in (nn.Conv2d(i, o, k, stride=s), nn.ReLU())]
        side = nature_cnn_sizes(image_size)[2]  # the maps' sides: 20, 9, 7 at 84
        self.net = nn.Sequential(
            *layers, nn.Flatten(), nn.Linear(channels[-1] * side**2, embed_dim), nn.ReLU()
        )

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.net(image)


class AtariConvDecoder(nn.Module):
    """(N, F) latent features -> (N, 4, S, S) image mean; NatureCNN reversed (7 -> 9 -> 20 -> 84 at S = 84).
    `output_padding` restores the rows a strided convolution of the encoder dropped (none at 84; 64 needs one)."""

    def __init__(self, feat_dim: int, out_channels: int, base_channels: int, mid_channels: int, image_size):
        super().__init__()
        self.mid_channels = mid_channels
        s1, _, self.side = nature_cnn_sizes(image_size)
        self.linear = nn.Linear(feat_dim, mid_channels * self.side * self.side)
        self.net = nn.Sequential(
            nn.ConvTranspose2d(mid_channels, 2 * base_channels, 3, stride=1),
            nn.ReLU(),  # (N, 2b, 9, 9)
            nn.ConvTranspose2d(2 * base_channels, base_channels, 4, stride=2, output_padding=(s1 - 4) % 2),
            nn.ReLU(),  # (N, b, 20, 20)
            nn.ConvTranspose2d(base_channels, out_channels, 8, stride=4, output_padding=(image_size - 8) % 4),
        )  # (N, 4, 84, 84)

    def forward(self, feat: torch.Tensor) -> torch.Tensor:
        return self.net(self.linear(feat).unflatten(-1, (self.mid_channels, self.side, self.side)))


class ChannelNorm(nn.Module):
    """LayerNorm over the channels of each pixel of an (N, C, H, W) map, as DreamerV3's convolutions use it."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm = nn.LayerNorm(channels, eps=NORM_EPS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ConvEncoder(nn.Module):
    """DreamerV3's encoder: (N, C, S, S) in [-0.5, 0.5] -> (N, E), 4x4 stride-2 convolutions each with LayerNorm and
    SiLU (64 -> 32 -> 16 -> 8 -> 4), the last map flattened (4 x 4 x 256 = 4,096 features)."""

    def __init__(self, in_channels: int, channels: tuple[int, ...], image_size: int):
        super().__init__()
        layers = []
        for previous, current in itertools.pairwise((in_channels, *channels)):
            # no bias: the LayerNorm after it has one
            layers += [nn.Conv2d(previous, current, 4, 2, 1, bias=False), ChannelNorm(current), nn.SiLU()]
        self.net = nn.Sequential(*layers, nn.Flatten())
        self.embed_dim = channels[-1] * (image_size >> len(channels)) ** 2

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.net(image)


class ConvDecoder(nn.Module):
    """DreamerV3's decoder, the encoder mirrored: (N, F) -> a linear layer to the last map (4 x 4 x 256), then 4x4
    stride-2 transposed convolutions, all but the last with LayerNorm and SiLU -> (N, C, S, S) image mean."""

    def __init__(self, feat_dim: int, out_channels: int, channels: tuple[int, ...], image_size: int):
        super().__init__()
        self.channels, self.side = channels[-1], image_size >> len(channels)
        self.linear = nn.Linear(feat_dim, self.channels * self.side * self.side)
        widths = channels[::-1]  # (256, 128, 64, 32)
        layers = []
        for previous, current in itertools.pairwise(widths):  # no bias: the LayerNorm after it has one
            layers += [nn.ConvTranspose2d(previous, current, 4, 2, 1, bias=False), ChannelNorm(current)]
            layers.append(nn.SiLU())
        layers.append(nn.ConvTranspose2d(widths[-1], out_channels, 4, 2, 1))
        self.net = nn.Sequential(*layers)

    def forward(self, feat: torch.Tensor) -> torch.Tensor:
        return self.net(self.linear(feat).unflatten(-1, (self.channels, self.side, self.side)))


class LayerNormGRUCell(nn.Module):
    """DreamerV3's GRU: (input (N, I), state (N, D)) -> state (N, D). One linear layer on [input, state] and a
    LayerNorm give the reset, candidate and update parts; the update gate's bias of -1 makes the state change slowly."""

    def __init__(self, input_dim: int, hidden_dim: int):
        super().__init__()
        self.linear = nn.Linear(input_dim + hidden_dim, 3 * hidden_dim, bias=False)
        self.norm = nn.LayerNorm(3 * hidden_dim, eps=NORM_EPS)

    def forward(self, x: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
        reset, candidate, update = upcast(self.norm(self.linear(torch.cat([x, state], -1)))).chunk(3, -1)
        candidate = torch.tanh(torch.sigmoid(reset) * candidate)
        update = torch.sigmoid(update - 1.0)
        # update * candidate + (1 - update) * state, in one kernel
        return torch.lerp(state, candidate, update)


@torch.no_grad()
def dreamerv3_init_(module: nn.Module) -> None:
    """DreamerV3's initialisation: linear and convolution weights from a normal truncated at 2 std, variance 1 / the
    mean of fan-in and fan-out; biases zero. A layer made to start at zero (`mlp(..., zero_output=True)`) stays so."""
    for layer in module.modules():
        if isinstance(layer, (nn.Linear, nn.Conv2d, nn.ConvTranspose2d)):
            weight = layer.weight  # (out, in, ...), or (in, out, ...) transposed: the same sum of fans
            taps = weight[0, 0].numel()  # kernel positions (1 for a linear layer)
            # 0.8796...: the std of a unit normal truncated at two standard deviations
            std = math.sqrt(2.0 / ((weight.shape[0] + weight.shape[1]) * taps)) / 0.87962566103423978
            nn.init.trunc_normal_(layer.weight, 0.0, std, -2 * std, 2 * std)
            if getattr(layer, "zero_init", False):  # drawn all the same: the layers after get the same draws
                nn.init.zeros_(layer.weight)
            if layer.bias is not None:
                nn.init.zeros_(layer.bias)


@dataclass(frozen=True)
class Model:
    """One --model: the parts its world model is made of, how they start, and the sizes its flags default to."""

    encoder: Callable  # (args, channels, side) -> module: (N, C, S, S) in [-0.5, 0.5] -> (N, .embed_dim)
    decoder: Callable  # (args, feat_dim, channels, side) -> module: (N, F) -> (N, C, S, S) image mean
    gru: Callable  # (input_dim, deter_dim) -> cell: (input (N, I), deter (N, D)) -> deter (N, D)
    init: Callable | None  # applied to the world model, actor and critic (None: torch's own)
    colour: bool  # whether it reads colour frames where the env has them (--rgb)
    sizes: dict  # the size flags' values when left unset


# ALGO LOGIC: the models; a new one is a row here and its classes above
MODELS = {
    "dreamerv3": Model(
        encoder=lambda args, channels, side: ConvEncoder(channels, args.encoder_channels, side),
        decoder=lambda args, feat, channels, side: ConvDecoder(feat, channels, args.encoder_channels, side),
        gru=LayerNormGRUCell,
        init=dreamerv3_init_,  # zero outputs (the reward head, the critic) stay as `mlp` made them
        colour=True,
        sizes=dict(
            image_size=64,
            frame_stack=1,
            encoder_channels=(32, 64, 128, 256),
            deterministic_dim=512,
            hidden_dim=512,
        ),
    ),
    "nature": Model(
        encoder=lambda args, channels, side: NatureCNNEncoder(
            channels, args.encoder_channels, args.embed_dim, side
        ),
        decoder=lambda args, feat, channels, side: AtariConvDecoder(
            feat, channels, args.decoder_base_channels, args.decoder_mid_channels, side
        ),
        gru=nn.GRUCell,
        init=None,
        colour=False,
        sizes=dict(
            image_size=84, frame_stack=4, encoder_channels=(32, 64, 64), deterministic_dim=200, hidden_dim=200
        ),
    ),
}


# --- The RSSM: one recurrent cell that observing and imagining both use -----------------------------------------------


class RSSM(nn.Module):
    """Recurrent state-space model: `deter` (GRU state) and `stoch`, `stoch_dim` categorical latents of `classes` classes
    (straight-through, `unimix` mixed in) or, with classes 0, Gaussians. `stats`: log-probs (..., S, C), or mean, std."""

    def __init__(self, embed_dim, num_actions, deter_dim, stoch_dim, classes, hidden, unimix, gru, learned):
        super().__init__()
        self.deter_dim, self.stoch_dim, self.classes, self.unimix = deter_dim, stoch_dim, classes, unimix
        self.stoch_flat = stoch_dim * classes if classes else stoch_dim
        stats_dim = stoch_dim * classes if classes else 2 * stoch_dim
        self.img_in = dense(self.stoch_flat + num_actions, hidden)  # [stoch, action] -> (N, H)
        self.gru = gru(hidden, deter_dim)  # (input (N, H), deter (N, D)) -> deter (N, D)
        self.prior_net = dense(deter_dim, hidden, stats_dim)  # deter -> stats
        self.posterior_net = dense(deter_dim + embed_dim, hidden, stats_dim)  # [deter, embed] -> stats
        # DreamerV3's learned initial state: deter = tanh(initial_deter), zeros at first (None: the zero state)
        self.initial_deter = nn.Parameter(torch.zeros(deter_dim)) if learned else None

    def initial(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The state an episode starts from, deter (n, D) and stoch (n, S): learned (DreamerV3's deter = tanh(w), and
        stoch the prior's mode from it, with no gradient through the mode), or zeros."""
        weight = self.prior_net.linear.weight  # float32 (also under autocast), float64 in the equality tests
        if self.initial_deter is None:
            zeros = functools.partial(torch.zeros, device=weight.device, dtype=weight.dtype)
            return zeros(n, self.deter_dim), zeros(n, self.stoch_flat)
        deter = torch.tanh(self.initial_deter).unsqueeze(0)  # (1, D)
        with torch.no_grad():
            stoch = self.mode(self.prior(deter)).to(deter.dtype)  # (1, S)
        return deter.expand(n, -1), stoch.expand(n, -1)

    def episode_start(self, first: torch.Tensor, deter, stoch, initial: tuple) -> tuple:
        """The previous state a step reads: deter (B, D) and stoch (B, S), or the `initial(1)` state where `first`
        (B, 1) bool says an episode starts (where the previous action is zero too)."""
        return torch.where(first, initial[0], deter), torch.where(first, initial[1], stoch)

    def _stats(self, raw: torch.Tensor) -> torch.Tensor:
        raw = upcast(raw)
        if self.classes:
            return mix_uniform(
                F.softmax(raw.unflatten(-1, (self.stoch_dim, self.classes)), -1), self.unimix
            ).log()
        mean, std = raw.chunk(2, -1)
        return torch.cat([mean, F.softplus(std) + 0.1], -1)

    def img_step(self, deter: torch.Tensor, stoch: torch.Tensor, action: torch.Tensor) -> torch.Tensor:
        """h_t = GRU(h_{t-1}, [z_{t-1}, a_{t-1}])."""
        return self.gru(upcast(self.img_in(torch.cat([stoch, action], -1))), deter)

    def prior(self, deter: torch.Tensor) -> torch.Tensor:
        return self._stats(self.prior_net(deter))

    def posterior(self, deter: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
        return self._stats(self.posterior_net(torch.cat([deter, upcast(embed)], -1)))

    def noise(self, shape: tuple[int, ...], device) -> torch.Tensor:
        """The random numbers `sample` turns into `shape` latents: uniforms (*shape, S, 1), or normals (*shape, S)."""
        if self.classes:
            return torch.rand(*shape, self.stoch_dim, 1, device=device)
        return torch.randn(*shape, self.stoch_dim, device=device)

    def sample(self, stats: torch.Tensor, noise: torch.Tensor | None = None, draw=None) -> torch.Tensor:
        """A flat latent (..., stoch_flat) with gradients (straight-through or reparameterised) from `noise`; `draw`
        picks each categorical latent's class (`one_hot_draw`, or a faster form of it)."""
        if self.classes:
            probs = stats.exp()
            noise = torch.rand(stats.shape[:-1] + (1,), device=stats.device) if noise is None else noise
            one_hot = (draw or one_hot_draw)(probs, noise).to(probs.dtype)
            if torch.is_grad_enabled():  # straight-through: the one-hot's value, the probabilities' gradient
                one_hot = one_hot + probs - probs.detach()
            return one_hot.flatten(-2)
        mean, std = stats.chunk(2, -1)
        return mean + std * (torch.randn_like(std) if noise is None else noise)

    def mode(self, stats: torch.Tensor) -> torch.Tensor:
        """The most likely latent (..., stoch_flat), without gradients (each class one-hot, or the mean)."""
        if self.classes:
            return one_hot(stats.argmax(-1), self.classes).to(stats.dtype).flatten(-2)
        return stats.chunk(2, -1)[0].detach()

    def kl(self, lhs: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
        """KL(lhs || rhs) summed over latents: (...)."""
        if self.classes:
            return (lhs.exp() * (lhs - rhs)).sum((-2, -1))
        mean_l, std_l = lhs.chunk(2, -1)
        mean_r, std_r = rhs.chunk(2, -1)
        return (torch.log(std_r / std_l) + (std_l**2 + (mean_l - mean_r) ** 2) / (2 * std_r**2) - 0.5).sum(-1)

    def observe(self, embed: torch.Tensor, action: torch.Tensor, is_first: torch.Tensor, noise=None):
        """Posterior rollout, step by step through the cell (`img_step`, `posterior`, `sample`), reset to the initial
        state where an episode starts: embed (B, T, E), action (B, T, A) one-hot (the action that led to step t),
        is_first (B, T), noise (T, B, ...) or None -> deter (B, T, D), stoch (B, T, S), posterior and prior stats."""
        B, T = embed.shape[:2]
        if noise is None:
            noise = self.noise((T, B), embed.device)
        initial = self.initial(1)
        deter, stoch = self.initial(B)
        deters, stochs, posteriors = [], [], []
        for t in range(T):
            first = is_first[:, t].unsqueeze(-1)  # (B, 1)
            deter, stoch = self.episode_start(first, deter, stoch, initial)
            deter = self.img_step(deter, stoch, action[:, t] * (~first).to(deter.dtype))
            posterior = self.posterior(deter, embed[:, t])
            stoch = self.sample(posterior, noise[t])
            deters.append(deter), stochs.append(stoch), posteriors.append(posterior)
        deter = torch.stack(deters, 1)  # (B, T, D)
        return deter, torch.stack(stochs, 1), torch.stack(posteriors, 1), self.prior(deter)


# --- World model, actor, critic ---------------------------------------------------------------------------------------


class WorldModel(nn.Module):
    """The encoder, the RSSM and the heads on its features (deter and stoch): the decoder, reward and continue."""

    def __init__(self, args: Args, obs_shape: tuple, num_actions: int):
        super().__init__()
        model = MODELS[args.model]
        channels, side = math.prod(obs_shape[:-2]), obs_shape[-1]  # frames (x 3 in colour) as channels
        self.encoder = model.encoder(args, channels, side)
        self.embed_dim = self.encoder.embed_dim
        sizes = (args.deterministic_dim, args.stochastic_dim, args.stochastic_classes, args.hidden_dim)
        learned = args.initial_state == "learned"
        self.rssm = RSSM(self.embed_dim, num_actions, *sizes, args.unimix, model.gru, learned)
        feat_dim = args.deterministic_dim + self.rssm.stoch_flat
        self.decoder = model.decoder(args, feat_dim, channels, side)
        self.reward_head = mlp(feat_dim, args.reward_bins, args.hidden_dim, zero_output=True)
        self.continue_head = mlp(feat_dim, 1, args.hidden_dim)
        self.register_buffer("bins", torch.linspace(-20.0, 20.0, args.reward_bins))


class Actor(nn.Module):
    def __init__(self, feat_dim: int, num_actions: int, hidden_dim: int, unimix: float):
        super().__init__()
        self.net = mlp(feat_dim, num_actions, hidden_dim)
        self.unimix = unimix

    def forward(self, feat: torch.Tensor) -> torch.Tensor:
        """The policy's action probabilities (..., A), with `unimix` uniform mixed in."""
        return self.probs(self.net(feat))

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """`forward` from the net's output, logits (..., A)."""
        return mix_uniform(F.softmax(upcast(logits), -1), self.unimix)


def policy_terms(probs: torch.Tensor, action: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The log-probability of each one-hot `action` (..., A) under the policy's `probs` (..., A), and its entropy."""
    log_probs = probs.log()
    return (log_probs * action).sum(-1), -(probs * log_probs).sum(-1)


class Critic(nn.Module):
    """Value as symlog two-hot logits (..., K)."""

    def __init__(self, feat_dim: int, hidden_dim: int, bins: int):
        super().__init__()
        self.net = mlp(feat_dim, bins, hidden_dim, zero_output=True)
        self.register_buffer("bins", torch.linspace(-20.0, 20.0, bins))

    def forward(self, feat: torch.Tensor) -> torch.Tensor:
        return self.net(feat)


class ReturnNormalizer(nn.Module):
    """EMA of the 5th and 95th percentiles of lambda-returns; scale = max(1, P95 - P5)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("low", torch.zeros(()))
        self.register_buffer("high", torch.zeros(()))
        self.register_buffer("levels", torch.tensor([0.05, 0.95]), persistent=False)

    @torch.no_grad()
    def update(self, returns: torch.Tensor, rate: torch.Tensor) -> None:
        """Move the EMAs toward this rollout's percentiles by `rate` (1 - --return-norm-decay, a 0-d tensor)."""
        quantiles = torch.quantile(upcast(returns.detach()).flatten(), self.levels)  # (2,): one sort for both
        for ema, quantile in zip((self.low, self.high), quantiles.unbind(0)):
            # a non-finite rollout (its update is skipped) leaves the EMA as it was, without a host sync
            ema.copy_(torch.where(torch.isfinite(quantile), ema.lerp(quantile, rate), ema))

    def scale(self) -> torch.Tensor:
        return torch.clamp(self.high - self.low, min=1.0)


class Settings:
    """The numbers the update reads (`settings["gamma"]`) that a run may change (`set`: a KL warm-up, a learning-rate
    decay), as 0-d tensors changed in place, which a captured or compiled update reads anew (`1 - x`: in double)."""

    # ALGO LOGIC: a number to schedule is one more name here, read as settings["name"] in the update
    NAMES = ("kl_dyn_scale", "kl_rep_scale", "free_nats", "entropy_coef", "gamma", "return_lambda")
    NAMES += ("return_norm_decay", "slow_critic_fraction", "world_model_grad_clip", "actor_critic_grad_clip")
    NAMES += ("world_model_lr", "actor_lr", "critic_lr")
    COMPLEMENTS = ("return_lambda", "return_norm_decay")

    def __init__(self, args: Args, optimizers: dict[str, torch.optim.Optimizer], device: torch.device):
        self.tensors = {}
        for name in self.NAMES:
            if name.endswith("_lr"):  # fused Adam reads it in float32 on CUDA, in double on a CPU (a float)
                group = optimizers[name.removesuffix("_lr")].param_groups[0]
                dtype = torch.float32 if device.type == "cuda" else torch.float64
                group["lr"] = self.tensors[name] = torch.tensor(group["lr"], device=device, dtype=dtype)
            else:
                self.tensors[name] = torch.tensor(float(getattr(args, name)), device=device)
        for name in self.COMPLEMENTS:
            self.tensors[f"1 - {name}"] = torch.tensor(1 - float(getattr(args, name)), device=device)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def set(self, name: str, value: float) -> None:
        if name not in self.NAMES:
            raise KeyError(f"{name!r} is not a scheduled setting; these are: {', '.join(self.NAMES)}")
        self.tensors[name].fill_(float(value))
        if name in self.COMPLEMENTS:
            self.tensors[f"1 - {name}"].fill_(1 - float(value))


@dataclass
class Agent:
    """Everything that learns: networks, optimizers, loss scalers (fp16), autocast, settings, update functions."""

    world_model: WorldModel
    actor: Actor
    critic: Critic
    slow_critic: Critic
    return_norm: ReturnNormalizer
    world_model_optimizer: torch.optim.Optimizer
    actor_optimizer: torch.optim.Optimizer
    critic_optimizer: torch.optim.Optimizer
    amp: "mu.AmpSetup"
    scalers: dict[str, torch.amp.GradScaler]  # "world_model", "actor", "critic"
    device: torch.device
    num_actions: int
    settings: Settings
    # ALGO LOGIC: the functions an update calls (`build_agent`'s; Part 2 may put checked faster equivalents here)
    observe: Callable  # `RSSM.observe` of the world model's RSSM
    imagine: Callable  # `imagine`
    imagined_heads: Callable  # `imagined_heads`
    world_model_losses: Callable  # `world_model_losses`
    imagined_targets: Callable  # `imagined_targets`
    behavior_losses: Callable  # `behavior_losses`
    channels_last: bool = False  # the batch's frames channels-last, as Part 2 lays out the convolutions

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return list(self.named_optimizers().values())

    def named_optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return {name: getattr(self, f"{name}_optimizer") for name in ("world_model", "actor", "critic")}

    def modules(self) -> dict[str, nn.Module]:
        names = ("world_model", "actor", "critic", "slow_critic", "return_norm")
        return {name: getattr(self, name) for name in names}


def build_agent(args: Args, obs_shape: tuple, num_actions: int, device) -> Agent:
    device = torch.device(device)
    world_model = WorldModel(args, obs_shape, num_actions)
    feat_dim = args.deterministic_dim + world_model.rssm.stoch_flat
    actor = Actor(feat_dim, num_actions, args.hidden_dim, args.unimix)
    critic = Critic(feat_dim, args.hidden_dim, args.reward_bins)
    if (init := MODELS[args.model].init) is not None:
        for module in (world_model, actor, critic):
            init(module)
    world_model, actor, critic = world_model.to(device), actor.to(device), critic.to(device)
    slow_critic = Critic(feat_dim, args.hidden_dim, args.reward_bins).to(device)
    slow_critic.load_state_dict(critic.state_dict())
    slow_critic.requires_grad_(False)
    amp = mu.amp("off" if args.precision == "float32" else args.precision, device)  # autocast, loss scaling
    # fused Adam: one kernel per step, and it can skip a step on the device (see `clip_and_step`)
    optimizers = {
        name: torch.optim.Adam(
            module.parameters(), lr=getattr(args, f"{name}_lr"), eps=getattr(args, f"{name}_eps"), fused=True
        )
        for name, module in (("world_model", world_model), ("actor", actor), ("critic", critic))
    }
    return Agent(
        *(world_model, actor, critic, slow_critic, ReturnNormalizer().to(device)),
        *(optimizers["world_model"], optimizers["actor"], optimizers["critic"]),
        amp=amp,
        # one scaler per optimizer: an overflow in one loss shrinks that loss's scale alone
        scalers={name: amp.new_scaler() for name in optimizers},
        device=device,
        num_actions=num_actions,
        settings=Settings(args, optimizers, device),
        observe=world_model.rssm.observe,
        imagine=imagine,
        imagined_heads=imagined_heads,
        world_model_losses=world_model_losses,
        imagined_targets=imagined_targets,
        behavior_losses=behavior_losses,
    )


class Player:
    """Acts in the vector env, each env's latent state kept across steps, detached, in tensors updated in place."""

    def __init__(self, agent: Agent, num_envs: int):
        self.agent, self.num_envs = agent, num_envs
        with torch.no_grad():  # memory: the cached state never carries a graph; (N, D), (N, S) of their own
            self.deter, self.stoch = (x.clone() for x in agent.world_model.rssm.initial(num_envs))
        self.prev_action = torch.zeros(num_envs, agent.num_actions, device=agent.device)  # (N, A) one-hot
        self.policy = self.policy_step  # what `act` calls (it may be captured in a CUDA graph)

    # memory: acting builds no graph; otherwise each step's graph stays reachable from the cached state
    @torch.no_grad()
    def policy_step(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor]:
        """obs (N, 1, 3, 64, 64) uint8 and is_first (N,) bool on the device -> actions (N,) int64 on the device; the
        cached state moves on. No host read and no Python branch on a tensor, so it can be captured."""
        wm = self.agent.world_model
        with self.agent.amp.autocast():
            image = inputs["obs"].flatten(1, -3).float() / 255.0 - 0.5  # (N, 3, 64, 64): frames as channels
            first = inputs["is_first"].unsqueeze(-1)  # (N, 1) bool
            deter, stoch = wm.rssm.episode_start(first, self.deter, self.stoch, wm.rssm.initial(1))
            deter = wm.rssm.img_step(deter, stoch, self.prev_action * (~first).float())
            stoch = wm.rssm.sample(wm.rssm.posterior(deter, wm.encoder(image)))
            probs = self.agent.actor(torch.cat([deter, stoch], -1))  # (N, A)
            action = draw_index(probs, torch.rand(len(probs), 1, device=probs.device))  # (N,)
        self.deter.copy_(deter), self.stoch.copy_(stoch)
        self.prev_action.copy_(one_hot(action, self.agent.num_actions))
        return (action,)

    def act(self, obs: np.ndarray, is_first: np.ndarray) -> np.ndarray:
        """obs (N, 1, 3, 64, 64) uint8, is_first (N,) bool -> actions (N,) int64."""
        as_tensor = functools.partial(torch.as_tensor, device=self.agent.device)
        (action,) = self.policy({"obs": as_tensor(obs), "is_first": as_tensor(is_first)})
        return action.cpu().numpy()


# --- Losses and updates: plain functions of tensors; each update returns its logged values as device tensors ---


def lambda_returns(reward, value, discount, lambda_, one_minus_lambda=None) -> torch.Tensor:
    """R_t = r_{t+1} + d_{t+1} ((1 - lambda) v_{t+1} + lambda R_{t+1}), R_H = v_H. reward, value, discount: (H+1, N)
    for imagined states s_0..s_H (those received on arriving at s_k); returns (H, N) for s_0..s_{H-1}. The loop is one
    fused multiply-add per step. lambda_ and `one_minus_lambda` (1 - lambda_ in double, `Settings`): floats or 0-d."""
    if one_minus_lambda is None:
        one_minus_lambda = 1 - lambda_
    base = reward[1:] + discount[1:] * one_minus_lambda * value[1:]  # (H, N)
    factor = discount[1:] * lambda_  # (H, N)
    returns = [value[-1]]
    for base_t, factor_t in zip(reversed(base.unbind(0)), reversed(factor.unbind(0))):
        returns.append(torch.addcmul(base_t, factor_t, returns[-1]))
    return torch.stack(returns[1:][::-1])


def batch_tensors(batch: dict[str, np.ndarray], device) -> dict[str, torch.Tensor]:
    """The sampled arrays as tensors on `device`, still uint8 and bool; to CUDA from pinned memory, without waiting."""
    pin = torch.device(device).type == "cuda"
    # memory: observations cross to the device as uint8 (a quarter of float32); floats exist only there
    tensors = {key: torch.from_numpy(value) for key, value in batch.items()}
    return {key: (x.pin_memory() if pin else x).to(device, non_blocking=pin) for key, x in tensors.items()}


def prepare_batch(raw: dict[str, torch.Tensor], num_actions: int, channels_last: bool = False) -> dict:
    """A raw batch converted on the device: image (B, T, 3, 64, 64) in [-0.5, 0.5] (channels-last, as such convolutions
    read it, with `channels_last`), action (B, T, A) one-hot; reward, is_first and is_terminal (B, T) as they are."""
    obs = raw["obs"].flatten(2, -3)  # (B, T, 1, 3, 64, 64) uint8 -> (B, T, 3, 64, 64): frames as channels
    layout = torch.channels_last if channels_last else torch.contiguous_format
    image = obs.flatten(0, 1).to(torch.float32, memory_format=layout).div_(255.0).sub_(0.5)
    image = image.unflatten(0, obs.shape[:2])
    data = {"image": image, "action": one_hot(raw["action"], num_actions)}
    return data | {key: raw[key] for key in ("reward", "is_first", "is_terminal")}


def world_model_loss(agent: Agent, data: dict[str, torch.Tensor], args: Args):
    """Returns (loss, parts: the logged values as named tensors, posterior (deter, stoch) (B, T, ...))."""
    wm, (B, T) = agent.world_model, data["image"].shape[:2]
    embed = wm.encoder(data["image"].flatten(0, 1)).unflatten(0, (B, T))  # (B, T, E)
    # the observe scan in float32 whatever --precision: its steps add up their rounding
    with torch.autocast(embed.device.type, enabled=False):
        deter, stoch, posterior, prior = agent.observe(upcast(embed), data["action"], data["is_first"])
    loss, parts = agent.world_model_losses(wm, agent.settings, data, deter, stoch, posterior, prior, args)
    return loss, parts, (deter, stoch)


# ALGO LOGIC: how much each world-model loss counts; --no-decoder-loss, --no-reward-loss and --no-kl-loss make
# theirs 0 (isolation experiments). The keys are `world_model_losses`' names.
def loss_scales(args: Args) -> dict[str, float]:
    return {
        "continue": 1.0,
        "image": 0.0 if args.no_decoder_loss else args.image_loss_scale,
        "reward": 0.0 if args.no_reward_loss else 1.0,
        "kl": 0.0 if args.no_kl_loss else 1.0,
    }


def world_model_losses(wm: WorldModel, settings: Settings, data: dict, deter, stoch, posterior, prior, args):
    """The named losses from the posterior rollout on, summed against `loss_scales`: (loss, logged values)."""
    image = data["image"]
    B, T = image.shape[:2]
    feat = torch.cat([deter, stoch], -1)  # (B, T, D + S)
    reconstruction = wm.decoder(feat.flatten(0, 1)).unflatten(0, (B, T))  # (B, T, 3, 64, 64)
    # squared error summed over each image, averaged over images (one fused kernel each way)
    image_loss = F.mse_loss(upcast(reconstruction), image, reduction="sum") / (B * T)
    reward_logits = wm.reward_head(feat)  # (B, T, K)
    reward_loss = twohot_loss(reward_logits, data["reward"], wm.bins).mean()
    continue_logits = upcast(wm.continue_head(feat).squeeze(-1))  # (B, T)
    continues = (~data["is_terminal"]).to(continue_logits.dtype)
    continue_loss = F.binary_cross_entropy_with_logits(continue_logits, continues)
    dyn = wm.rssm.kl(posterior.detach(), prior)  # (B, T)
    rep = wm.rssm.kl(posterior, prior.detach())
    kl_loss = (
        settings["kl_dyn_scale"] * dyn.clamp(min=settings["free_nats"]).mean()
        + settings["kl_rep_scale"] * rep.clamp(min=settings["free_nats"]).mean()
    )
    # ALGO LOGIC: the named losses, each summed with its scale (`loss_scales`): a new head is one entry in each
    losses = {"continue": continue_loss, "image": image_loss, "reward": reward_loss, "kl": kl_loss}
    scales = loss_scales(args)
    assert losses.keys() == scales.keys(), (losses.keys(), scales.keys())
    # a scale of 0 leaves its loss out (no gradient, and a non-finite value of it cannot spread), 1 adds it as it is
    terms = [term if scales[key] == 1 else scales[key] * term for key, term in losses.items() if scales[key]]
    loss = functools.reduce(torch.add, terms)
    # the reward head on real rewards: hits (the sign, half the size), false alarms (0.5 or more for a zero)
    predicted, reward = twohot_mean(reward_logits.detach(), wm.bins), data["reward"]
    nonzero, alarm = reward != 0, predicted.abs() >= 0.5
    hits = nonzero & (predicted * torch.sign(reward) >= 0.5 * reward.abs())
    counts = dict(
        reward_nonzero=nonzero, reward_hits=hits, reward_zero=~nonzero, reward_false_alarms=~nonzero & alarm
    )
    parts = {"losses/world_model": loss, **{f"losses/{name}": value for name, value in losses.items()}}
    parts |= {"debug/kl_value": dyn.mean(), **{f"debug/{key}": n.float().sum() for key, n in counts.items()}}
    return loss, parts


def clip_and_step(optimizer, scaler, parameters: list, clip: torch.Tensor, loss_finite: torch.Tensor):
    """After the backward pass: unscale (fp16), clip to the norm `clip` (0-d), and step unless the loss or the
    gradient is non-finite (skipped on the device; fp16's scaler skips overflows): (grad_norm, healthy), 0-d."""
    scaler.unscale_(optimizer)
    grads = [p.grad for p in parameters if p.grad is not None]
    grad_norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    # clip_grad_norm_'s arithmetic, with the clip as a tensor (it turns max_norm into a float, which a graph keeps)
    torch._foreach_mul_(grads, torch.clamp((grad_norm + 1e-6).reciprocal() * clip, max=1.0))
    if scaler.is_enabled():
        scaler.step(optimizer)
        scaler.update()
        return grad_norm, loss_finite
    healthy = loss_finite & torch.isfinite(grad_norm)
    mu.step_if_healthy(optimizer, healthy)
    return grad_norm, healthy


def train_world_model(agent: Agent, raw: dict[str, torch.Tensor], args: Args):
    """One world-model update on a raw batch on the device, without host synchronisation. Returns the logged values
    (detached 0-d float32 tensors), healthy (0-d bool: False when a non-finite loss or gradient skipped the step) and
    the posterior states to imagine from, detached: {"deter": (B*T, D), "stoch": (B*T, S), "continue": (B*T,)}."""
    data = prepare_batch(raw, agent.num_actions, agent.channels_last)
    with agent.amp.autocast():
        loss, parts, (deter, stoch) = world_model_loss(agent, data, args)
    optimizer, scaler = agent.world_model_optimizer, agent.scalers["world_model"]
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    metrics = {key: value.detach().float() for key, value in parts.items()}
    finite = torch.isfinite(torch.stack(list(metrics.values()))).all()
    parameters, clip = list(agent.world_model.parameters()), agent.settings["world_model_grad_clip"]
    grad_norm, healthy = clip_and_step(optimizer, scaler, parameters, clip, finite)
    optimizer.zero_grad(set_to_none=True)  # memory: gradients are not kept between updates
    metrics["debug/world_model_grad_norm"] = grad_norm.detach().float()
    start = {"deter": deter.detach().flatten(0, 1), "stoch": stoch.detach().flatten(0, 1)}
    return metrics, healthy, start | {"continue": (~data["is_terminal"]).float().flatten(0, 1)}


def imagine(agent: Agent, start_states, horizon: int):
    """Roll the prior `horizon` steps from (N, ...) start states with the actor's actions (REINFORCE: with gradients),
    the cell (`img_step`) and the prior's samples: feat (H+1, N, F) detached, log_prob and entropy (H, N)."""
    deter, stoch, _ = start_states
    rssm = agent.world_model.rssm
    action_uniforms = torch.rand(horizon, deter.shape[0], 1, device=deter.device)  # (H, N, 1)
    latent_noise = rssm.noise((horizon, deter.shape[0]), deter.device)  # (H, N, ...)
    feats, log_probs, entropies = [], [], []
    for t in range(horizon):
        feat = torch.cat([deter, stoch], -1)
        probs = agent.actor(feat)
        action = one_hot_draw(probs.detach(), action_uniforms[t]).to(probs.dtype)
        log_prob, entropy = policy_terms(probs, action)
        log_probs.append(log_prob)
        entropies.append(entropy)
        feats.append(feat)
        with torch.no_grad():
            deter = rssm.img_step(deter, stoch, action)
            stoch = rssm.sample(rssm.prior(deter), latent_noise[t])
    feats.append(torch.cat([deter, stoch], -1))
    return torch.stack(feats).detach(), torch.stack(log_probs), torch.stack(entropies)


def imagined_heads(agent: Agent, start_states, args: Args) -> dict:
    """An imagined rollout and the heads on its states: the actor's log_prob and entropy (H, N) and the critic's logits
    (H+1, N, K) with gradients; without, the slow critic's (H, N, K), the reward's and continue's (H+1, N, ...)."""
    feat, log_prob, entropy = agent.imagine(agent, start_states, args.imagination_horizon)  # feat (H+1, N, F)
    # one critic pass gives both the values the targets bootstrap from (detached) and the logits its loss trains
    heads = {"log_prob": log_prob, "entropy": entropy, "critic": agent.critic(feat)}
    with torch.no_grad():
        heads["slow critic"] = agent.slow_critic(feat[:-1])  # s_0..s_{H-1}: what the critic regresses
        wm = agent.world_model
        return heads | {"reward": wm.reward_head(feat), "continue": wm.continue_head(feat)}


def behavior_losses(agent: Agent, heads: dict, start_continue, args: Args, update_norm: bool = True):
    """Actor and critic losses from the heads on an imagined rollout (`imagined_heads`). Returns (actor_loss,
    critic_loss, parts)."""
    with torch.no_grad():
        returns, weight, advantage, slow_value = agent.imagined_targets(
            agent, heads, start_continue, args, update_norm
        )
    # ALGO LOGIC: REINFORCE on normalised advantages + entropy; the critic is pulled toward the slow critic
    log_prob, entropy = heads["log_prob"], heads["entropy"]
    actor_loss = -(weight * (log_prob * advantage + agent.settings["entropy_coef"] * entropy)).mean()
    bins, logits = agent.critic.bins, heads["critic"][:-1]
    critic_loss = twohot_loss(logits, returns, bins) + twohot_loss(logits, slow_value, bins)
    critic_loss = (weight * critic_loss).mean()
    parts = {"losses/actor": actor_loss, "losses/critic": critic_loss, "losses/entropy": entropy.mean()}
    parts |= {"debug/imagined_return": returns.mean(), "debug/return_scale": agent.return_norm.scale()}
    return actor_loss, critic_loss, parts


def imagined_targets(agent: Agent, heads: dict, start_continue, args: Args, update_norm: bool):
    """What the actor and critic learn toward, from the heads on a rollout (`imagined_heads`), without gradients: the
    lambda-returns, discount weights, normalised advantages and slow critic's values, (H, N) each."""
    wm, settings = agent.world_model, agent.settings
    reward = twohot_mean(heads["reward"], wm.bins)  # (H+1, N)
    continues = torch.sigmoid(upcast(heads["continue"].squeeze(-1)))  # (H+1, N)
    if args.continue_mode:  # DreamerV3: an imagined state either goes on or ends
        continues = (continues > 0.5).to(continues.dtype)
    continues[0] = start_continue  # the start state's own continue flag is known
    discount = settings["gamma"] * continues
    value = twohot_mean(heads["critic"].detach(), agent.critic.bins)  # (H+1, N)
    slow_value = twohot_mean(heads["slow critic"], agent.slow_critic.bins)  # (H, N)
    lambda_, one_minus_lambda = settings["return_lambda"], settings["1 - return_lambda"]
    returns = lambda_returns(reward, value, discount, lambda_, one_minus_lambda)  # (H, N)
    # DreamerV3's weights: w_t = prod_{k <= t} (gamma c_k) / gamma (w_0 = c_0: 0 from a terminal start)
    weight = torch.cumprod(discount[:-1], 0) / settings["gamma"]  # (H, N)
    if update_norm:
        agent.return_norm.update(returns, settings["1 - return_norm_decay"])
    advantage = (returns - value[:-1]) / agent.return_norm.scale()
    return returns, weight, advantage, slow_value


def train_behavior(agent: Agent, start: dict[str, torch.Tensor], args: Args):
    """One actor and one critic update imagined from `start`, then the slow critic follows: (logged, healthy)."""
    with agent.amp.autocast():
        heads = agent.imagined_heads(agent, (start["deter"], start["stoch"], start["continue"]), args)
        actor_loss, critic_loss, parts = agent.behavior_losses(agent, heads, start["continue"], args)
    scalers = agent.scalers
    for optimizer in (agent.actor_optimizer, agent.critic_optimizer):
        optimizer.zero_grad(set_to_none=True)
    # one backward pass for both: they share no parameters and no graph, so each gets its own loss's gradient
    (scalers["actor"].scale(actor_loss) + scalers["critic"].scale(critic_loss)).backward()
    metrics = {key: value.detach().float() for key, value in parts.items()}
    clip, steps = agent.settings["actor_critic_grad_clip"], {}
    for name, loss in (("actor", actor_loss), ("critic", critic_loss)):
        optimizer, parameters = getattr(agent, f"{name}_optimizer"), list(getattr(agent, name).parameters())
        steps[name] = clip_and_step(optimizer, scalers[name], parameters, clip, torch.isfinite(loss.detach()))
    (actor_norm, actor_healthy), (critic_norm, critic_healthy) = steps["actor"], steps["critic"]
    for optimizer in (agent.actor_optimizer, agent.critic_optimizer):
        optimizer.zero_grad(set_to_none=True)  # memory: gradients are not kept between updates
    # one fused kernel for all the slow critic's tensors; it stays put when the critic did
    with torch.no_grad():
        slow, fast = list(agent.slow_critic.parameters()), list(agent.critic.parameters())
        fraction = agent.settings["slow_critic_fraction"] * critic_healthy.to(slow[0].dtype)
        torch._foreach_lerp_(slow, fast, [fraction] * len(slow))
    metrics["debug/actor_grad_norm"] = actor_norm.detach().float()
    metrics["debug/critic_grad_norm"] = critic_norm.detach().float()
    return metrics, actor_healthy & critic_healthy


# --- The loop ---------------------------------------------------------------------------------------------------------


def step_envs(run, envs, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One vector step into the replay, its finished episodes' returns logged; returns the next obs and is_first."""
    args, counters = run.args, run.counters
    next_obs, rewards, terminations, truncations, infos = envs.step(actions)
    run.replay.add(next_obs, actions, rewards, terminations, truncations, infos)
    if "final_info" in infos and "episode" in infos["final_info"]:
        episode = infos["final_info"]["episode"]
        for i in np.flatnonzero(infos["final_info"]["_episode"]):
            run.last_return = float(episode["r"][i])
            counters["episodes"] += 1
            run.writer.add_scalar("charts/episodic_return", run.last_return, counters["global_step"])
            run.writer.add_scalar("charts/episodic_length", float(episode["l"][i]), counters["global_step"])
    for i in np.flatnonzero(infos.get("final_info", {}).get("_nonfinite", [])):  # a step the guard cut: said
        run.env_fault(int(i), infos["final_info"]["nonfinite"][i])
    counters["global_step"] += args.num_envs
    return next_obs, np.logical_or(terminations, truncations)


def sample_batch(run) -> dict[str, torch.Tensor]:
    """One training batch on the device, still uint8 and bool (`train_world_model` converts it there)."""
    return batch_tensors(run.replay.sample(run.args.batch_size, run.args.sequence_length), run.device)


def owed_updates(run) -> int:
    """The updates this env step owes at --train-ratio (none before learning starts, nor while the replay holds less
    than a sequence: the run says so), each later on a batch of its own, never sampled all at once to catch up."""
    args, counters = run.args, run.counters
    if run.step + args.num_envs < args.learning_starts or not run.replay.can_sample(args.sequence_length):
        return 0
    counters["updates_owed"] += args.num_envs * args.train_ratio / (args.batch_size * args.sequence_length)
    owed = 0
    while counters["updates_owed"] >= 1.0:
        counters["updates_owed"] -= 1.0
        owed += 1
    return owed


def train(run, owed: int, batch) -> None:
    """`owed` updates, the first on `batch`, later ones on batches sampled then: world model, then actor and critic."""
    args, counters = run.args, run.counters
    # actor and critic learn once the env step these updates go with is past the warm-up
    behavior = run.step + args.num_envs >= args.learning_starts + args.warmup_steps
    for update in range(owed):
        raw = batch if update == 0 else run.sample_batch(run)
        run.probes("after_sample")
        metrics, healthy, start = run.world_model_step(raw)
        run.update_log.add(metrics, healthy)
        if behavior:
            behavior_metrics, behavior_healthy = run.behavior_step(start)
            run.update_log.add(behavior_metrics, behavior_healthy)
            healthy = healthy & behavior_healthy
            counters["behavior_updates"] += 1
        run.update_log.end_update(healthy)
        counters["updates"] += 1


def learn(run, envs) -> None:
    """Dreamer's loop to --total-timesteps; `run` (Part 3) holds the agent, replay, update steps and watchers."""
    args = run.args
    # reset, or as a resumed run's checkpoint left them; what a checkpoint saves of the loop, with the envs' state
    run.obs, run.is_first = run.start_envs(envs)
    while run.step < args.total_timesteps:
        run.probes("loop_start")  # TRY NOT TO MODIFY: memory probes, and a signal's checkpoint and exit
        run.stop_if_signalled()
        # ALGO LOGIC: the updates owed, and the first one's batch, sampled before acting (on a GPU while updates run)
        owed = owed_updates(run)
        batch = run.sample_batch(run) if owed else None
        # ALGO LOGIC: act: random until learning starts, then the policy (the loop's one sync with a GPU)
        if run.step < args.learning_starts:
            actions = run.rng.integers(run.agent.num_actions, size=args.num_envs)
        else:
            actions = run.player.act(run.obs, run.is_first)
        # ALGO LOGIC: the updates, before the env step (on a GPU they overlap it); a schedule goes here (settings.set)
        train(run, owed, batch)
        run.obs, run.is_first = step_envs(run, envs, actions)
        run.probes("after_collect")
        run.watch()  # TRY NOT TO MODIFY: videos, log points, checkpoints


# =====================================================================================================================
# PART 2: SPEED
# One call from the run's set-up (`install_speed`) puts the faster equivalents of Part 1's functions in place, never
# inside Part 1: the kernels module's (dreamer_kernels.py beside this file, each checked against the Part 1 function
# it replaces), then the wrappers of this part (compile, CUDA graphs, frames on the device). Each flag turns one off;
# after start-up a path whose check disagrees is dropped and Part 1 goes on (`check_run_fast_paths`): nothing about
# speed ends a run then (out of memory in a check is the run's own, exit 3).
# =====================================================================================================================


try:  # the faster equivalents of Part 1's functions, in their own module beside this file (`install_speed`)
    import dreamer_kernels
except Exception as exc:  # noqa: BLE001 - whatever stops it importing, Part 1's functions train (said in one line)
    dreamer_kernels, KERNELS_MISSING = None, f"{type(exc).__name__}: {exc}".splitlines()[0]


class FastPathMismatch(RuntimeError):
    """A fast path computes something other than the readable function it replaces (one sentence: which path, and the
    flag that switches it off). `off` holds that flag's value that switches it off ({"fused_scan": "off"}): after
    start-up the run goes on with the path dropped (`check_run_fast_paths`)."""

    def __init__(self, message: str, off: dict | None = None):
        super().__init__(message)
        self.off = off or {}


def kernels_module():
    """The kernels module with this script's Part 1 handed over (`dreamer_kernels.bind`: a copy of this script hands
    its own), or None where it is not beside this file."""
    if dreamer_kernels is not None:
        dreamer_kernels.bind(sys.modules[__name__])
    return dreamer_kernels


def compile_agent(agent: Agent, backend: str = "inductor", loops: bool = False) -> None:
    """--compile: torch.compile what an update repeats. Where the kernels module's paths run, one step of the fast
    observe, one step of its hand-written backward pass and one imagination step are each compiled once and reused
    at every step of a sequence. With `loops` (--compile-loops), where the fast observe or the fast imagination does
    not run (--fast-observe off, --fast-imagine off, no kernels module), Part 1's `RSSM.observe` or `imagine` in its
    place is compiled whole, its T or H steps unrolled into one graph forward and one backward: Inductor's time grows
    with the steps it unrolls (many minutes at the default sizes), and it draws the loop's random numbers its own way, seeded from torch's
    generator (the same distributions, other numbers than eager's). The encoder, decoder and heads, which run once
    per update over all steps, are compiled too (`nn.Module.compile`, or `run_layers` for an nn.Sequential: their
    state_dict keys stay, so checkpoints are the same either way), and so are the world model's losses
    (`world_model_losses`) and the actor-critic targets (`imagined_targets`, the lambda-return loop included), each
    as one graph. Each compiles as one whole graph (`fullgraph=True`: a graph break is an error, not a silent slow
    path). Inductor compiles without CUDA graphs of its own: `CudaGraphed` (--cudagraph) captures the whole update
    around the compiled code, and Inductor's (its "reduce-overhead" mode, or `triton.cudagraphs` from
    TORCHINDUCTOR_CUDAGRAPHS=1) would start a capture of its own while ours captures, which CUDA refuses; so the
    mode stays the default and each compile turns them off."""
    wm = agent.world_model
    # no CUDA graphs of Inductor's inside ours (see above)
    options = {"options": {"triton.cudagraphs": False}} if backend == "inductor" else {}

    def compile_(fn):
        return torch.compile(fn, dynamic=False, fullgraph=True, backend=backend, **options)

    if kernels_module() is not None:  # their steps; the heads and the targets as Part 1 writes them
        dreamer_kernels.compile_paths(agent, compile_)
    # no fast observe, no fast imagination: Part 1's loop in its place, its T or H steps unrolled into one graph
    if loops and agent.observe == wm.rssm.observe:
        agent.observe = compile_(wm.rssm.observe)
    if loops and agent.imagine is imagine:
        agent.imagine = compile_(imagine)
    agent.world_model_losses = compile_(world_model_losses)
    agent.imagined_targets = compile_(imagined_targets)
    heads = (wm.reward_head, wm.continue_head, agent.actor, agent.critic, agent.slow_critic)
    for module in (wm.encoder, wm.decoder, *heads):
        if type(module).forward is nn.Sequential.forward:  # Dynamo compiles no frame of torch's: ours runs it
            module.forward = compile_(functools.partial(run_layers, module))
        else:
            module.compile(dynamic=False, fullgraph=True, backend=backend, **options)


def run_layers(layers: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """`layers(x)`, in a frame of this file for `compile_agent`."""
    for layer in layers:
        x = layer(x)
    return x


class CaptureInvalid(RuntimeError):
    """A setting the captured update read as a Python value changed after capture (one sentence naming it)."""


def capture_settings(agent: Agent) -> Callable[[], dict]:
    """What a captured update keeps as it was at capture: each optimizer's hyperparameters (a tensor by identity: its
    value may change in place, the object may not) and the settings' tensors. (`Args` is frozen: no field of it can
    change.) Returns a function that reads them now; `CudaGraphed` compares its result with the one taken at capture
    before each replay."""

    def read() -> dict:
        values = {
            f"settings[{key!r}]": ("tensor", id(value)) for key, value in agent.settings.tensors.items()
        }
        for name, optimizer in agent.named_optimizers().items():
            values |= {
                f"the {name} optimizer's {key!r}": ("tensor", id(value)) if torch.is_tensor(value) else value
                for key, value in optimizer.param_groups[0].items()
                if key != "params"
            }
        return values

    return read


class CudaGraphed:
    """`fn(inputs: dict of tensors) -> tuple of tensors`, run eagerly `warmup` times, then captured once in a CUDA
    graph and replayed (`--cudagraph`): the same function, without the Python and kernel-launch cost of its
    thousands of small ops. Each call copies `inputs` into the graph's static inputs and returns the graph's
    static outputs, which the next call overwrites. `fn` must not synchronise with the host or branch on tensor
    values (the updates above do neither): a replay repeats exactly the captured work. The warm-up calls are real
    updates; they run on a side stream, as capture requires. (tensordict's CudaGraphModule does the same job; this
    is the part of it an update needs, without the dependency.)

    A replay repeats the Python values `fn` read when it was captured. `settings()` (see `capture_settings`) reads
    those values; a replay after one of them changed raises `CaptureInvalid` naming it, instead of silently
    training on the old value. Scheduled numbers go through `Settings`, whose tensors a replay reads.

    A captured graph keeps the memory its function used while it was captured, at its peak, as a private pool for
    its replays. Graphs given the same `pool` (`torch.cuda.graph_pool_handle()`) share one: a later capture reuses
    what an earlier one's temporaries left free, which is safe for graphs replayed one after another on one stream
    whose outputs are read before the next replay (the updates' are: `mu.UpdateLog.add`, the behaviour step's copy
    of its inputs), so two updates need the larger of their peaks instead of the sum.
    """

    def __init__(
        self, fn: Callable[[dict], tuple], warmup: int = 3, settings: Callable | None = None, pool=None
    ):
        self.fn, self.warmup, self.calls, self.pool = fn, warmup, 0, pool
        self.name, self.settings = getattr(fn, "__name__", "an update"), settings or dict
        self.captured_settings: dict | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_inputs, self.static_outputs = {}, ()  # dict[str, torch.Tensor], tuple
        self.side_stream: torch.cuda.Stream | None = None
        self.eager = False  # a capture failed: every call runs `fn` as it is

    def __call__(self, inputs: dict[str, torch.Tensor]) -> tuple:
        if self.eager:
            return self.fn(inputs)
        if self.captured_settings is not None:
            self.check_settings()
            return self.replay(inputs)
        self.calls += 1
        if self.calls <= self.warmup:
            return self.run_eagerly(inputs)
        try:
            outputs = self.capture(inputs)
        except torch.OutOfMemoryError:
            raise  # the run's OOM report and exit 3, as for any update
        except Exception as exc:  # noqa: BLE001 - nothing about speed ends a run: this update runs eagerly
            self.eager, self.graph = True, None
            why = f"{type(exc).__name__}: {exc}".splitlines()[0]
            print(
                f"speed: {self.name} could not be captured in a CUDA graph ({why}); it runs eagerly (--no-cudagraph)"
            )
            return self.fn(inputs)
        self.captured_settings = self.settings()
        return outputs

    def check_settings(self) -> None:
        """Refuse to replay when a value read at capture has changed since (a dict comparison: microseconds)."""
        now, then = self.settings(), self.captured_settings
        if now == then:
            return
        changed = next(key for key in {**now, **then} if now.get(key) != then.get(key))
        raise CaptureInvalid(
            f"{changed} changed from {then.get(changed)!r} to {now.get(changed)!r} after the update "
            f"was captured in a CUDA graph, which would go on using the old value: schedule it with "
            f"agent.settings.set(...) (see Settings), or run with --no-cudagraph."
        )

    def run_eagerly(self, inputs: dict[str, torch.Tensor]) -> tuple:
        """A warm-up update, on a side stream as capture requires."""
        if self.side_stream is None:  # made at the first call: a CPU run never makes one
            self.side_stream = torch.cuda.Stream()
        self.side_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side_stream):
            outputs = self.fn(inputs)
        torch.cuda.current_stream().wait_stream(self.side_stream)
        return outputs

    def capture(self, inputs: dict[str, torch.Tensor]) -> tuple:
        self.static_inputs = {key: value.clone() for key, value in inputs.items()}
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=self.pool):  # it frees the warm-up's cached blocks first
            self.static_outputs = self.fn(self.static_inputs)
        self.graph.replay()  # capture runs nothing: this replay is this call's update
        return self.static_outputs

    def replay(self, inputs: dict[str, torch.Tensor]) -> tuple:
        for key, value in inputs.items():
            self.static_inputs[key].copy_(value, non_blocking=True)
        self.graph.replay()
        return self.static_outputs


def captures_updates(args: Args, device: torch.device) -> bool:
    """Whether the updates are captured in CUDA graphs: --cudagraph (the default) on a CUDA device."""
    return args.cudagraph and torch.device(device).type == "cuda"


# --- Frames on the device, pinned batches -----------------------------------------------------------------------------


class FrameStore:
    """The replay's frames in one tensor on a device (`--replay-frames device`), so that a batch's stacks are
    gathered there in one indexing operation instead of copied on the host and sent over.

    The tensor's rows (one frame each) are handed out in blocks of `block` rows. Each env writes its frames in the
    order it makes them into blocks of its own: its frame number `seq` (counted from its first) is in row
    table[seq // block] * block + seq % block. The replay evicts each env's frames oldest first (whole episodes,
    or the front of one still being played), so a block goes back to the free list as soon as the env's oldest
    kept frame is past it. Written frames wait in host memory and cross together (`flush`) before anything reads
    the rows: on CUDA from pinned memory without blocking, so storing a frame never waits for a running update."""

    FLUSH_EVERY = 256  # frames that wait at most (before learning starts no batch is sampled to flush them)

    def __init__(self, frame_shape: tuple, num_envs: int, block: int, num_blocks: int, device):
        self.frame_shape, self.block, self.device = tuple(frame_shape), block, torch.device(device)
        self.rows = torch.empty((num_blocks * block, *frame_shape), dtype=torch.uint8, device=self.device)
        self.free = list(range(num_blocks - 1, -1, -1))  # block ids; the next one handed out is the last
        # env -> its block ids, oldest first
        self.tables: list[deque[int]] = [deque() for _ in range(num_envs)]
        self.first_block = [0] * num_envs  # env -> the block number (seq // block) of tables[env][0]
        self.written = [0] * num_envs  # env -> frames written so far: the seq of its next frame
        # env -> its table as an array, until it changes
        self.cached: list[np.ndarray | None] = [None] * num_envs
        self.pending: list[np.ndarray] = []  # frames not yet on the device, with their rows
        self.pending_rows: list[int] = []

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes

    def append(self, env: int, frame: np.ndarray) -> None:
        seq = self.written[env]
        if seq % self.block == 0:
            if not self.free:
                self.grow()
            self.tables[env].append(self.free.pop())
            self.cached[env] = None
        self.pending.append(np.array(frame, np.uint8))  # a copy: the env may reuse its array
        self.pending_rows.append(self.tables[env][-1] * self.block + seq % self.block)
        self.written[env] += 1
        if len(self.pending) >= self.FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        """Queue the waiting frames' copy into their rows (one copy and one indexed write)."""
        if not self.pending:
            return
        # a row written twice in one copy would keep either frame (CUDA's indexed write has no order)
        assert len(set(self.pending_rows)) == len(self.pending_rows), "a row handed out twice before a flush"
        frames = torch.from_numpy(np.stack(self.pending))  # (n, S, S) uint8
        rows = torch.tensor(self.pending_rows, dtype=torch.int64)
        if self.device.type == "cuda":
            # pinned: the copy runs without blocking; torch keeps the pinned block until the copy has read it
            frames, rows = frames.pin_memory(), rows.pin_memory()
        to_device = functools.partial(torch.Tensor.to, device=self.device, non_blocking=True)
        self.rows.index_copy_(0, to_device(rows), to_device(frames))
        self.pending, self.pending_rows = [], []

    def release_before(self, env: int, seq: int) -> None:
        """The env keeps no frame before `seq` any more: its blocks wholly before it go back to the free list."""
        table = self.tables[env]
        if table and (self.first_block[env] + 1) * self.block <= seq:
            self.flush()  # a waiting frame's row may be handed out again below
        while table and (self.first_block[env] + 1) * self.block <= seq:
            self.free.append(table.popleft())
            self.first_block[env] += 1
            self.cached[env] = None

    def grow(self) -> None:
        """A quarter more rows (the replay holds more short episodes than it was sized for: each stores
        frame_stack - 1 frames more than steps); said in one line."""
        self.flush()
        blocks = len(self.rows) // self.block
        more = max(1, blocks // 4)
        extra = torch.empty((more * self.block, *self.frame_shape), dtype=torch.uint8, device=self.device)
        self.rows = torch.cat([self.rows, extra])
        self.free = list(range(blocks + more - 1, blocks - 1, -1)) + self.free
        print(f"replay: the frame store grew to {len(self.rows):,} frames ({self.rows.nbytes >> 20} MiB)")

    def row_of(self, env: int, seqs: np.ndarray) -> np.ndarray:
        """The rows (same shape, int64) of the env's frames `seqs`."""
        if self.cached[env] is None:
            self.cached[env] = np.fromiter(self.tables[env], np.int64, len(self.tables[env]))
        blocks = seqs // self.block - self.first_block[env]
        return self.cached[env][blocks] * self.block + seqs % self.block

    def read(self, env: int, begin: int, stop: int) -> np.ndarray:
        """A host copy of the env's frames [begin, stop) (for checkpoints and the open-loop report)."""
        self.flush()
        rows = torch.from_numpy(self.row_of(env, np.arange(begin, stop)))
        return self.rows[rows.to(self.device)].cpu().numpy()


class DeviceFrames:
    """An episode's frames in a `FrameStore`: the part of `ChunkedArray` that `Episode` uses, with the same logical
    indices. Frame i is the env's frame `first + i`. Not compacted when the episode ends: the env's next episode
    continues in the same block."""

    def __init__(self, store: FrameStore, env: int, item_shape: tuple, chunk_size: int):
        self.store, self.env, self.item_shape, self.chunk_size = store, env, tuple(item_shape), chunk_size
        self.dtype = np.dtype(np.uint8)
        self.first = store.written[env]  # the env's number of this episode's frame 0
        self.start = 0
        self.end = 0

    def __len__(self) -> int:
        return self.end - self.start

    @property
    def nbytes(self) -> int:
        return 0  # the store's rows are counted once, as the replay's device bytes

    def append(self, frame) -> None:
        assert self.store.written[self.env] == self.first + self.end, "one episode at a time per env"
        self.store.append(self.env, frame)
        self.end += 1

    def read_into(self, out: np.ndarray, begin: int, stop: int) -> None:
        assert self.start <= begin <= stop <= self.end
        out[:] = self.store.read(self.env, self.first + begin, self.first + stop)

    def rows(self, begin: int, steps: int, stack: int) -> np.ndarray:
        """The rows (steps, stack) of the stacks of `steps` steps from step `begin`: step t's stack is frames
        [t, t + stack), as in `Episode`."""
        seqs = self.first + begin + np.arange(steps)[:, None] + np.arange(stack)  # (steps, stack)
        assert begin >= self.start and begin + steps + stack - 1 <= self.end
        return self.store.row_of(self.env, seqs)

    def drop_front_chunk(self) -> int:
        self.start += self.chunk_size
        self.store.release_before(self.env, self.first + self.start)
        return self.chunk_size

    def compact(self, exact: np.ndarray) -> None:
        """Nothing to do: an env's frames are packed in its blocks."""

    def release(self) -> None:
        """The episode is evicted: its frames go (the env's earlier episodes went before it)."""
        self.start = self.end
        self.store.release_before(self.env, self.first + self.end)


class DeviceColumns(mu.ChunkedColumns):
    """An episode's arrays (`mu.ChunkedColumns`) with its frames in a `FrameStore` (`DeviceFrames`)."""

    def __init__(self, shapes: dict, chunk_size: int, frames: DeviceFrames):
        super().__init__({name: shape for name, shape in shapes.items() if name != "frames"}, chunk_size)
        self.frames = frames

    def __getitem__(self, name: str):
        return self.frames if name == "frames" else super().__getitem__(name)

    def load(self, saved: dict[str, np.ndarray]) -> None:
        super().load(saved)  # all but the frames, whose first stack the episode already wrote
        for frame in saved["frames"][len(self.frames) :]:
            self.frames.append(frame)


class FrameStoreReplay(EpisodeReplay):
    """`EpisodeReplay` with its frames in a `FrameStore` on `frames_device` (`--replay-frames device`; the rest stays
    in host memory). `sample` runs as written, with `fill` giving where each stack's frames are in the store, `rows`
    (B, T, k) int64, in place of obs; `gather`, on the device, makes obs from them (`sample_gathered`). The batches
    are the host sampler's (`check_device_frames`)."""

    def __init__(
        self, capacity: int, num_envs: int, seed: int, chunk_size: int | None = None, frames_device="cpu"
    ):
        super().__init__(capacity, num_envs, seed, chunk_size)
        self.frames_device = torch.device(frames_device)
        self.store: FrameStore | None = None  # made with the first episode, which gives the frames' shape
        # False once a check dropped the gather: Part 1's fill, the frames read back for each batch
        self.gathered = True

    def new_episode(self, env_idx: int, first_obs: np.ndarray) -> Episode:
        if self.store is None:
            # a full replay's frames, each episode's frame_stack - 1 extra frames and each env's partly used
            # blocks; a replay of many short episodes grows it
            blocks = math.ceil(1.05 * self.capacity / self.chunk_size) + 2 * self.num_envs + 2
            self.store = FrameStore(
                first_obs.shape[1:], self.num_envs, self.chunk_size, blocks, self.frames_device
            )
        frames = DeviceFrames(self.store, env_idx, first_obs.shape[1:], self.chunk_size)
        return Episode(first_obs, DeviceColumns(Episode.shapes(first_obs), self.chunk_size, frames))

    def fill(self, windows: list, sequence_length: int) -> dict[str, np.ndarray]:
        """`EpisodeReplay.fill` with `rows` (B, T, k) int64, each stack's rows in the store, in place of obs."""
        self.store.flush()  # queued before the gather that reads them
        if not self.gathered:
            return super().fill(windows, sequence_length)
        T, B, stack = sequence_length, len(windows), windows[0][0][0].stack
        batch = {"rows": np.empty((B, T, stack), np.int64)}
        batch |= {"action": np.empty((B, T), np.uint8), "reward": np.empty((B, T), np.float32)}
        batch |= {"is_first": np.empty((B, T), np.bool_), "is_terminal": np.empty((B, T), np.bool_)}
        for b, pieces in enumerate(windows):
            filled = 0
            for episode, begin, take in pieces:
                piece = slice(filled, filled + take)
                batch["rows"][b, piece] = episode.frames.rows(begin, take, stack)  # (take, k)
                for key in ("action", "reward", "is_first", "is_terminal"):
                    getattr(episode, key).read_into(batch[key][b, piece], begin, begin + take)
                batch["is_first"][b, filled] = True
                filled += take
        return batch

    def gather(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The batch `sample` gives on the host, from `fill`'s moved to the store's device: obs (B, T, k, ...) uint8
        is one indexing of the store's rows (a new tensor: it never aliases the store)."""
        gathered = {"obs": self.store.rows[batch["rows"]]}  # (B, T, 1, 3, 64, 64) uint8
        return gathered | {key: value for key, value in batch.items() if key != "rows"}


def frame_store_nbytes(
    capacity: int, num_envs: int, frame_shape: tuple, chunk_size: int | None = None
) -> int:
    """The bytes of the `FrameStore` a `FrameStoreReplay` of `capacity` steps makes (its sizing, in arithmetic)."""
    chunk_size = chunk_size or EpisodeReplay(capacity, num_envs, seed=0).chunk_size  # the replay's own choice
    blocks = math.ceil(1.05 * capacity / chunk_size) + 2 * num_envs + 2
    return blocks * chunk_size * math.prod(frame_shape)


def replay_frames_device(args: Args, device: torch.device, obs_shape: tuple) -> torch.device | None:
    """Where the replay's frames live (`--replay-frames`): the training device, or host memory (None); said in one
    line. `auto` puts them on the device when a full replay's frames take at most a quarter of what this process may
    still take there: the GPU's free memory, and under --gpu-memory-gb no more than the cap leaves."""
    full = replay_capacity(args) * math.prod(obs_shape[1:])  # a full replay's frames, one per step
    if args.replay_frames == "host" or (args.replay_frames == "auto" and device.type != "cuda"):
        return None
    if args.replay_frames == "auto":
        free = mu.gpu_headroom_bytes(device, gpu_cap(args))
        if full > free / 4:
            within = " the cap leaves of" if args.gpu_memory_gb is not None else ""
            print(
                f"replay: frames in host memory: a full replay's {full / 2**30:.2f} GiB of frames is over a quarter "
                f"of{within} the GPU's {free / 2**30:.1f} GiB free (--replay-frames device puts them there anyway)"
            )
            return None
    print(f"replay: frames on {device} ({full / 2**30:.2f} GiB when full); batches are gathered there")
    return device


# --- The checks that hold each fast path to the function it replaces --------------------------------------------------


def check_device_frames(run: "Run") -> None:
    """The frames on the device (`FrameStoreReplay`, `sample_gathered`) against `sample_batch` with the frames in host
    memory (`EpisodeReplay`), run as the run's own code: two small replays of the same random episodes, the same
    seed, one batch each. Another batch, or an error on one side only (a change to `EpisodeReplay.sample` or `fill`
    that the device's `fill` does not carry), raises FastPathMismatch naming --replay-frames host."""
    args, device = run.args, run.replay.frames_device
    twin_args = dataclasses.replace(args, batch_size=3, sequence_length=min(args.sequence_length, 12))
    replays = (
        EpisodeReplay(200, num_envs=2, seed=0, chunk_size=16),
        FrameStoreReplay(200, num_envs=2, seed=0, chunk_size=16, frames_device=device),
    )
    for replay in replays:
        rng = np.random.default_rng(0)  # the same episodes in both
        for env in range(2):
            replay.start_episode(env, rng.integers(0, 256, run.obs_shape, np.uint8))
        for step in range(60):
            obs, over = rng.integers(0, 256, run.obs_shape, np.uint8), bool(rng.random() < 0.1)
            action = int(rng.integers(run.agent.num_actions))
            replay.add_step(step % 2, obs[-1], action, rng.normal(), over, over)
            if over:
                replay.start_episode(step % 2, obs)
    batches = []
    for sampler, replay in ((sample_batch, replays[0]), (sample_gathered, replays[1])):
        twin = types.SimpleNamespace(args=twin_args, replay=replay, device=device)
        try:
            batches.append({key: value.cpu() for key, value in sampler(twin).items()})
        except Exception as exc:  # noqa: BLE001 - said in the mismatch's sentence
            batches.append(f"{type(exc).__name__}: {exc}")
    host, gathered = batches
    if isinstance(host, str) != isinstance(gathered, str):
        problem = f"fails where the host's does not ({gathered})" if isinstance(gathered, str) else None
        problem = problem or f"runs where the host's fails ({host})"
    elif isinstance(host, str) or host.keys() != gathered.keys():
        problem = None if isinstance(host, str) else f"gives the keys {sorted(gathered)}, not {sorted(host)},"
    else:
        same = {
            key: host[key].dtype == gathered[key].dtype and torch.equal(host[key], gathered[key])
            for key in host
        }
        problem = next((f"gives another {key}" for key, equal in same.items() if not equal), None)
    if problem:
        raise FastPathMismatch(
            f"sampling with the frames on the device (FrameStoreReplay.fill, then gathered there) {problem} than "
            f"EpisodeReplay.sample with the frames in host memory: carry the change into FrameStoreReplay.fill, or "
            f"run with --replay-frames host.",
            off={"replay_frames": "host"},
        )


def speed_args(run: "Run") -> Args:
    """The flags the fast paths are installed with: the run's, less the paths a check dropped after start-up (kept in
    the checkpoint's counters, so a resumed run keeps them dropped)."""
    return dataclasses.replace(run.args, **run.counters.get("dropped_fast_paths", {}))


# Updates between checks on the live weights (`check_cadence`), at most 1 % of update time: on 2 CPU cores a check
# took 0.96 s against a 7.2 s update at the Pong recipe, 0.20 s against 0.25 s at the proof's (0.8 % at 100); on a GPU
# ~1 s against ~33 ms (benchmark/results/cpu_fast_paths/, benchmark/results/2026-11-27-nvidia-h200.json)
CHECK_EVERY = {"cpu": 100, "cuda": 5_000}


def check_cadence(args: Args, device: torch.device) -> int:
    """--check-every, or its default on `device` (`CHECK_EVERY`); 0: the fast paths are checked at start-up only."""
    return CHECK_EVERY.get(device.type, CHECK_EVERY["cuda"]) if args.check_every is None else args.check_every


# Every fast path off: what a disagreement that names no flag of its own drops (Part 1 alone has nothing to check)
# fmt: off
EVERY_PATH_OFF = dict(fast_observe="off", fast_imagine="off", imagine_gathers="off", fused_scan="off",
                      fused_epilogues="off", fast_heads="off", replay_frames="host")
# fmt: on


def check_run_fast_paths(run: "Run") -> None:
    """After --resume, and every `check_cadence` updates: the fast paths held to Part 1's functions on the live
    weights (`dreamer_kernels.check_fast_paths`), and the frames on the device (`check_device_frames`); the checks
    draw no number from the run's generators. Nothing about speed ends a run after start-up: a path that disagrees is
    dropped, with one warning line naming it and its flag (`debug/speed/dropped_paths` counts them), and Part 1's
    function (or the path beneath) goes on from this update, its updates captured again (frames on the device stay
    there, read back by Part 1's sampling). A disagreement that names no flag of its own drops every path."""
    say = run.progress.say if run.progress is not None else print
    reinstall = False
    while True:  # each pass drops a path not dropped before (or all of them), or returns
        dropped = run.counters.get("dropped_fast_paths", {})
        try:
            if reinstall:
                reinstall_speed(run)
            if EVERY_PATH_OFF.items() <= dropped.items():
                return  # Part 1 alone: nothing to check
            if kernels_module() is not None and not reinstall:  # a reinstall has just checked them
                dreamer_kernels.check_fast_paths(run.agent, speed_args(run))
            if isinstance(run.replay, FrameStoreReplay) and run.replay.gathered:
                check_device_frames(run)
            return
        except torch.OutOfMemoryError:
            raise
        except FastPathMismatch as exc:
            fresh = exc.off and not exc.off.items() <= dropped.items()
            run.counters["dropped_fast_paths"] = {**dropped, **(exc.off if fresh else EVERY_PATH_OFF)}
            say(
                f"warning: {exc} Dropped at step {run.step} (update {run.counters['updates']}): "
                + ("Part 1's function runs" if fresh else "Part 1 trains, every fast path off,")
                + " from here on."
            )
            reinstall = True
        except Exception as exc:  # noqa: BLE001 - a check that cannot run ends nothing: the paths agreed at start-up
            why = f"{type(exc).__name__}: {exc}".splitlines()[0]
            say(
                f"warning: the fast paths' check could not run at step {run.step} (update {run.counters['updates']}, "
                f"{why}); the run goes on"
            )
            return


def reinstall_speed(run: "Run") -> None:
    """The agent's fast paths made again with `speed_args` (a path dropped stays out), and the update steps with them
    (captured anew on CUDA)."""
    use_part1(run.agent)
    speed_up_agent(run.agent, speed_args(run))
    run.world_model_step, run.behavior_step = make_update_steps(run.agent, speed_args(run))
    if speed_args(run).replay_frames == "host" and isinstance(run.replay, FrameStoreReplay):
        # the frames stay where they are; Part 1's sampling reads them back for each batch
        run.replay.gathered, run.sample_batch = False, sample_batch


def use_part1(agent: Agent) -> None:
    """Part 1's functions back in the agent's places, as `build_agent` puts them."""
    agent.observe, agent.imagine = agent.world_model.rssm.observe, imagine
    agent.world_model_losses, agent.imagined_targets = world_model_losses, imagined_targets
    agent.imagined_heads, agent.behavior_losses = imagined_heads, behavior_losses


# --- Installing it all: one call from the run's set-up ----------------------------------------------------------------


def sample_gathered(run: "Run") -> dict[str, torch.Tensor]:
    """`sample_batch` with the frames on the device: the batch it sends holds where each stack's frames are (a few
    KB), and the device gathers them."""
    return run.replay.gather(sample_batch(run))


def install_speed(run: "Run") -> None:
    """Part 2 in one call from the run's set-up (LeanRL's executables block), before the run has a folder: the
    agent's faster equivalents (`speed_up_agent`), then the run's: CUDA graphs of the update steps and the policy
    step (wrapping them), the frames on the device. Each is checked against the function it replaces before anything
    trains (FastPathMismatch: exit 7 where Part 1 is unchanged, else the path steps aside in one line). Nothing in
    Part 1 changes."""
    args, device = speed_args(run), run.device
    speed_up_agent(run.agent, args)
    run.world_model_step, run.behavior_step = make_update_steps(run.agent, args)
    if captures_updates(args, device):
        run.player.policy = CudaGraphed(run.player.policy_step)
    frames_device = replay_frames_device(args, device, run.obs_shape)
    if frames_device is not None:
        host, run.sample_batch = run.replay, sample_gathered
        run.replay = FrameStoreReplay(
            host.capacity, args.num_envs, seed=args.seed, frames_device=frames_device
        )
        try:
            check_device_frames(run)
        except FastPathMismatch as exc:  # exit 7 only where Part 1 is as the paths were pinned to it
            if kernels_module() is not None and dreamer_kernels.part_1_unchanged():
                raise
            run.replay, run.sample_batch = host, sample_batch
            print(f"speed: {str(exc).splitlines()[0]} Part 1 changed, so the frames stay in host memory.")


def make_update_steps(agent: "Agent", args: Args) -> tuple[Callable, Callable]:
    """The update steps (`update_steps`), captured in CUDA graphs where `captures_updates`."""
    world_model_step, behavior_step = update_steps(agent, args)
    if captures_updates(args, agent.device):
        for optimizer in agent.optimizers:  # Adam's step in a CUDA graph
            optimizer.param_groups[0]["capturable"] = True
        settings = capture_settings(agent)
        # memory: one pool for both updates' graphs, about the larger peak instead of the sum (see CudaGraphed)
        pool = torch.cuda.graph_pool_handle()
        return (
            CudaGraphed(world_model_step, settings=settings, pool=pool),
            CudaGraphed(behavior_step, settings=settings, pool=pool),
        )
    return world_model_step, behavior_step


def speed_up_agent(agent: "Agent", args: Args) -> None:
    """The agent's faster equivalents: the kernels module's (`dreamer_kernels.install`, each checked against the Part 1
    function it replaces: a float64 disagreement raises FastPathMismatch, a path that cannot run here steps aside
    with one line), channels-last convolutions, then --compile. Without the module, or where it cannot run at all,
    Part 1's functions, said in one line."""
    if kernels_module() is None:
        print(f"speed: Part 1's functions run (the kernels module is not here: {KERNELS_MISSING})")
    else:
        try:
            said = dreamer_kernels.install(agent, args)
        except (FastPathMismatch, torch.OutOfMemoryError):  # exit 7; the OOM report and exit 3
            raise
        except Exception as exc:  # noqa: BLE001 - nothing about speed stops a run: Part 1's functions run
            use_part1(agent)
            said = [f"speed: Part 1's functions run (the kernels module failed: {type(exc).__name__}: {exc})"]
        for line in said:
            print(line.splitlines()[0])
    agent.channels_last = {"on": True, "off": False}.get(args.channels_last, agent.device.type == "cuda")
    if agent.channels_last:
        agent.world_model.encoder.to(memory_format=torch.channels_last)
        agent.world_model.decoder.to(memory_format=torch.channels_last)
    if args.compile:
        compile_agent(agent, loops=args.compile_loops)


# =====================================================================================================================
# PART 3: THE RUN
# Input checks, logging, video and the ball measure, memory wiring and checkpoints: what makes a run safe and
# observable. Nothing here changes what is learned.
# =====================================================================================================================


# exit statuses (memory_utils', the same in both scripts): 2 bad input (an argument or a file), 3 out of memory, 4 a
# leak (--abort-on-leak), 5 too many non-finite updates or env steps in a row, 6 a checkpoint the run cannot go on
# without not written, 7 a fast path that computes another formula at start-up, 8 a crash (a checkpoint first)
EXIT_BAD_INPUT, EXIT_OOM, EXIT_LEAK = mu.EXIT_BAD_INPUT, mu.EXIT_OOM, mu.EXIT_LEAK
EXIT_NONFINITE, EXIT_WRITE_FAILED = mu.EXIT_NONFINITE, mu.EXIT_WRITE_FAILED
EXIT_FAST_PATH, EXIT_CRASHED = mu.EXIT_FAST_PATH, mu.EXIT_CRASHED

CHECKPOINT_FORMAT = "dreamer_atari/1"

OOM_ADVICE = (
    "Flags that lower the peak: --precision bf16, a smaller --batch-size or --sequence-length, a "
    "shorter --imagination-horizon, and PYTORCH_ALLOC_CONF=expandable_segments:True (set by default)."
)


# `args.x = y` during a run is refused at once, in one sentence: a captured update would keep the old value
Args = mu.fixed_once_parsed(
    lambda name: (
        f"schedule it with agent.settings.set({name!r}, value) (see Settings)"
        if name in Settings.NAMES
        else f"it is not one to schedule during a run, so start the run with --{name.replace('_', '-')}"
    )
)(Args)


# --- Input checks -----------------------------------------------------------------------------------------------------


class ArgsError(ValueError):
    """One sentence about one bad input value."""


def check_args(args: Args) -> None:
    """Raise ArgsError naming the first bad value and what is allowed. Builds one env at most, writes nothing."""
    for field in dataclasses.fields(args):  # a choice (Literal) set in code: tyro's parser refuses the others
        # a new model is a row of MODELS
        choices = tuple(MODELS) if field.name == "model" else get_args(field.type)
        if get_origin(field.type) is Literal and (value := getattr(args, field.name)) not in choices:
            raise ArgsError(
                f"--{field.name.replace('_', '-')} must be one of {', '.join(choices)}, got {value!r}."
            )
    if args.compile_loops and not args.compile:
        raise ArgsError(
            "--compile-loops compiles Part 1's loops under --compile: add --compile, or leave it out."
        )
    check_ranges(args)
    check_updates_happen(args)
    check_model_sizes(args)
    check_replay_fits(args)
    check_env(args)
    if args.resume is not None and not os.path.isfile(args.resume):
        raise ArgsError(f"--resume {args.resume!r} does not exist or is not a file.")
    check_folders(args)


# the longest suffix `mu.claim_run_dir` adds to a run's name when it is taken (`-99`)
RUN_NAME_SUFFIX_BYTES = 3


def run_name_of(args: Args) -> str:
    """A new run's name, `{env id}__{exp name}__{seed}__{unix time}` (the folder under runs/)."""
    return f"{args.env_id.replace('/', '_')}__{args.exp_name}__{args.seed}__{int(time.time())}"


def check_folders(args: Args) -> None:
    """The names and folders the run writes, before anything is written: --exp-name is a name of its own (no path,
    not . or ..) and the run's name short enough for the file system; runs/ (and videos/, ./wandb with --capture-video,
    --track) can be made and written here."""
    if problem := mu.name_problem(args.exp_name, "--exp-name", "runs"):
        raise ArgsError(problem + ".")
    made_of = "the run's name (from --env-id and --exp-name)"
    if problem := mu.name_problem(run_name_of(args), made_of, "runs", RUN_NAME_SUFFIX_BYTES):
        raise ArgsError(problem + ".")
    folders = ["runs"] + ["videos"] * args.capture_video
    for folder in folders:
        if problem := mu.folder_problem(folder, f"the run's folder {folder}/"):
            raise ArgsError(problem + ".")


def check_replay_fits(args: Args) -> None:
    """A full replay against this machine's memory, or its cgroup's limit, before any of it exists: more than either
    can ever hold is refused (`say_replay_size` warns when it is more than is available now). Frames count in host
    memory unless --replay-frames device."""
    obs_shape = (args.frame_stack, *((3,) if args.rgb else ()), args.image_size, args.image_size)
    per_step = (0 if args.replay_frames == "device" else math.prod(obs_shape[1:])) + REPLAY_AUX_BYTES_PER_STEP
    capacity = replay_capacity(args)
    flag = "--total-timesteps (no --buffer-capacity)" if args.buffer_capacity is None else "--buffer-capacity"
    problem, _ = mu.replay_memory_problem(
        capacity * per_step,
        f"the replay ({flag} {capacity:,} steps, {per_step:,} bytes each)",
        lambda nbytes: f"--buffer-capacity {nbytes // per_step:,} would take about half of that",
    )
    if problem:
        raise ArgsError(problem + ".")


def check_updates_happen(args: Args) -> None:
    """Settings that would train nothing at all: learning that starts at or after the last env step, or a train
    ratio so small that the env steps after learning starts owe less than one update."""
    if args.learning_starts >= args.total_timesteps:
        raise ArgsError(
            f"--learning-starts ({args.learning_starts:,}) must be below --total-timesteps "
            f"({args.total_timesteps:,}): no update would ever run."
        )
    steps = args.total_timesteps - args.learning_starts
    updates = steps * args.train_ratio / (args.batch_size * args.sequence_length)
    if updates < 1:
        least = args.batch_size * args.sequence_length / steps
        raise ArgsError(
            f"--train-ratio {args.train_ratio:g} gives {updates:.2f} updates in the {steps:,} env steps after learning "
            f"starts (updates per env step = train ratio / (--batch-size x --sequence-length)): no update would run; "
            f"give at least {least:.3g}."
        )


# What each number may be: (what is allowed, the test, the flags); any other number of Args, a new one too, must be
# finite and not negative (`check_ranges`). A test written positively refuses nan too.
# fmt: off
RANGES = (
    ("at least 1", lambda v: v >= 1, ("total_timesteps", "frame_stack", "num_envs", "batch_size", "sequence_length",
     "log_interval", "embed_dim", "decoder_base_channels", "decoder_mid_channels", "deterministic_dim",
     "stochastic_dim", "hidden_dim", "reward_bins", "imagination_horizon", "max_nonfinite", "replay_chunk_steps",
     "snapshot_max_entries")),
    ("0 or more", lambda v: v >= 0, ("learning_starts", "warmup_steps", "checkpoint_every", "check_every",
     "memory_snapshot_every", "max_episode_steps", "noop_max", "leak_warmup_steps", "video_every",
     "image_loss_scale")),
    ("greater than 0", lambda v: v > 0, ("train_ratio",)),
    ("greater than 0 and at most 1", lambda v: 0 < v <= 1, ("gamma",)),  # the imagination weights divide by it
    ("between 0 and 1", lambda v: 0 <= v <= 1, ("return_lambda", "repeat_action_probability", "unimix",
     "return_norm_decay", "slow_critic_fraction")),
    ("greater than 0 and at most 1 (Adam moves each weight by about the learning rate per step)",
     lambda v: 0 < v <= 1, ("world_model_lr", "actor_lr", "critic_lr")),
    ("greater than 0 and finite", lambda v: 0 < v < math.inf, ("world_model_eps", "actor_eps", "critic_eps")),
    ("between 0 and 2**32 - 1 (numpy's seeds)", lambda v: v < 2**32, ("seed",)),
)
# fmt: on


def check_ranges(args: Args) -> None:
    """Every number within `RANGES`; any other finite and not negative (--gpu-memory-gb: its own check, later)."""
    for allowed, ok, names in RANGES:
        for name in names:
            if (value := getattr(args, name)) is not None and not ok(value):
                raise ArgsError(f"--{name.replace('_', '-')} must be {allowed}, got {value}.")
    for field in dataclasses.fields(args):
        value = None if field.name == "gpu_memory_gb" else getattr(args, field.name)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not 0 <= value < math.inf:
            raise ArgsError(f"--{field.name.replace('_', '-')} must be a number of 0 or more, got {value}.")


MIN_IMAGE_SIZE, MAX_IMAGE_SIZE = 36, 256  # the nature encoder's three convolutions need 36


def check_model_sizes(args: Args) -> None:
    """Sizes the networks can be built with: channels, the replay against a sequence, latents, the image side."""
    if not args.encoder_channels or min(args.encoder_channels) < 1:
        raise ArgsError(f"--encoder-channels must all be at least 1, got {args.encoder_channels}.")
    if args.buffer_capacity is not None and args.buffer_capacity < args.sequence_length:
        raise ArgsError(
            f"--buffer-capacity ({args.buffer_capacity}) must be at least --sequence-length "
            f"({args.sequence_length}): the replay could never hold one sequence."
        )
    if args.stochastic_classes == 1 or args.stochastic_classes < 0:
        raise ArgsError(
            f"--stochastic-classes must be 0 (Gaussian) or at least 2, got {args.stochastic_classes}."
        )
    if not MIN_IMAGE_SIZE <= args.image_size <= MAX_IMAGE_SIZE:
        raise ArgsError(
            f"--image-size must be between {MIN_IMAGE_SIZE} and {MAX_IMAGE_SIZE} pixels (the nature encoder's "
            f"three convolutions need at least {MIN_IMAGE_SIZE}), got {args.image_size}."
        )
    sizes = {"dreamerv3": dreamerv3_size_problem, "nature": nature_size_problem}.get(args.model)
    if problem := (sizes and sizes(args)) or world_model_problem(args):
        raise ArgsError(problem)


def world_model_problem(args: Args) -> str | None:
    """Any --model, a new row of MODELS too: its world model built on the meta device (no memory) and one frame through
    its encoder and decoder. An error, or a frame of another shape back, said in one sentence; None when it fits."""
    obs_shape = (args.frame_stack, *((3,) if args.rgb else ()), args.image_size, args.image_size)
    sizes = f"--image-size {args.image_size}, --encoder-channels {' '.join(map(str, args.encoder_channels))}"
    try:
        with torch.device("meta"):
            wm = WorldModel(args, obs_shape, num_actions=2)
            image = torch.zeros(1, math.prod(obs_shape[:-2]), args.image_size, args.image_size)
            embed = wm.encoder(image)
            frame = wm.decoder(torch.zeros(1, args.deterministic_dim + wm.rssm.stoch_flat))
    except Exception as exc:  # noqa: BLE001 - said in the sentence
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        return f"--model {args.model} cannot be built with {sizes}: {first_line}."
    if tuple(embed.shape) != (1, wm.embed_dim):
        return f"--model {args.model}'s encoder gives {embed.shape[-1]} features, not its embed_dim {wm.embed_dim}, with {sizes}."
    if frame.shape != image.shape:
        return (
            f"--model {args.model}'s decoder draws {tuple(frame.shape[1:])} frames for {tuple(image.shape[1:])} ones "
            f"with {sizes}."
        )
    return None


def nature_size_problem(args: "Args") -> str | None:
    if len(args.encoder_channels) != 3:
        return (
            f"--encoder-channels takes exactly three values with --model nature (its three convolutions), got "
            f"{args.encoder_channels}."
        )
    return None


def dreamerv3_size_problem(args: "Args") -> str | None:
    halvings = len(args.encoder_channels)
    if args.image_size % 2**halvings or args.image_size < 2 ** (halvings + 1):
        return (
            f"--image-size {args.image_size} does not suit --model dreamerv3 with {halvings} convolutions, each of "
            f"which halves the side: it must be a multiple of {2**halvings} of at least {2 ** (halvings + 1)} "
            f"(64 with the default four)."
        )
    return None


def check_env(args: Args) -> None:
    """A registered env id; a non-Atari env must give frames of --image-size (built once to see)."""
    try:
        spec = gym.spec(args.env_id)
    except gym.error.Error:
        raise ArgsError(
            f"--env-id {args.env_id!r} is not a registered environment; ALE ids look like ALE/Pong-v5, "
            f"and {CATCH_ID} is the built-in test task."
        )
    if not is_atari(args.env_id):
        side = args.image_size
        try:  # builds the env once, before anything is written
            space = gym.make(spec, **env_kwargs(args.env_id, args)).observation_space
        except TypeError as exc:
            raise ArgsError(
                f"--env-id {args.env_id!r} cannot be made with size={side} ({exc}); this script takes Atari ids "
                f"(ALE/...) or environments made with size=--image-size that give grey uint8 frames of that side."
            )
        if space.shape != (side, side) or space.dtype != np.uint8:
            raise ArgsError(
                f"--env-id {args.env_id!r} gives observations of shape {space.shape} {space.dtype}; this script "
                f"takes Atari ids (ALE/...) or environments that give {side}x{side} grey uint8 frames "
                f"(--image-size {side})."
            )


def check_actions_change_frames(
    env_fn: Callable[[], gym.Env], env_id: str, seed: int, steps: int = 50
) -> None:
    """Raise ArgsError if two different action sequences from the same seed give the same frames.

    ale-py 0.10.x silently turned actions into no-ops (ALE issue 594): an agent then learns nothing and nothing
    says why. Two short plays from one seed, one always taking action 0 and one taking random other actions,
    must differ somewhere.
    """
    env = env_fn()
    try:
        num_actions = int(env.action_space.n)
        if num_actions < 2:
            return
        others = np.random.default_rng(seed).integers(1, num_actions, size=steps)
        plays = []
        for actions in (np.zeros(steps, np.int64), others):
            obs, _ = env.reset(seed=seed)
            frames = [obs]
            for action in actions:
                obs, _, terminated, truncated, _ = env.step(int(action))
                frames.append(obs)
                if terminated or truncated:
                    break
            plays.append(frames)
    finally:
        env.close()
    if len(plays[0]) == len(plays[1]) and all(np.array_equal(a, b) for a, b in zip(*plays)):
        raise ArgsError(
            f"--env-id {env_id!r} ignores actions: {steps} steps of action 0 and {steps} steps of other actions "
            f"from the same seed gave identical frames, so nothing could be learned (ale-py 0.10.x had this bug, "
            f"ALE issue 594; requirements.txt pins a fixed ale-py)."
        )


def env_spaces(args: Args) -> tuple[tuple, int]:
    """The stacked observation shape, (--frame-stack, S, S) or (--frame-stack, 3, S, S) with --rgb, and the number
    of actions, from one env opened and closed."""
    env = make_env(args.env_id, 0, False, "", args)()
    try:
        return env.observation_space.shape, int(env.action_space.n)
    finally:
        env.close()


REPLAY_AUX_BYTES_PER_STEP = 1 + 4 + 1 + 1  # action uint8, reward float32, is_first, is_terminal


def replay_capacity(args: Args) -> int:
    """`--buffer-capacity`, or the whole run when it is not set."""
    return args.buffer_capacity if args.buffer_capacity is not None else args.total_timesteps


def batch_to_device(
    batch: dict[str, np.ndarray], num_actions: int, device, channels_last: bool = False
) -> dict[str, torch.Tensor]:
    return prepare_batch(batch_tensors(batch, device), num_actions, channels_last)


def say_replay_size(capacity: int, obs_shape: tuple, frames_on_device: bool = False) -> None:
    """Print how much host memory the replay grows to, with a warning when that is more than is available now."""
    # memory: the replay is the run's largest host allocation: say its size before it grows, not at 3 a.m.
    full = capacity * ((0 if frames_on_device else math.prod(obs_shape[1:])) + REPLAY_AUX_BYTES_PER_STEP)
    print(f"replay: up to {capacity:,} steps, about {full / 2**30:.2f} GiB of host memory when full")

    def fits(nbytes: int) -> str:
        return f"--buffer-capacity {nbytes * capacity // full:,} would take about half"

    if warning := mu.replay_memory_problem(full, "a full replay", fits)[1]:
        print(f"replay: {warning}")


# --- Open-loop videos and the ball measure ----------------------------------------------------------------------------


OPEN_LOOP_CONTEXT = 5  # frames the model sees before it imagines, as DreamerV3's report does

RECALL_SEQUENCES = 64  # replayed sequences whose open-loop predictions score the ball on Pong (`ball_scores`)


@torch.no_grad()
def open_loop_predictions(
    agent: Agent, batch: dict[str, np.ndarray], context: int = OPEN_LOOP_CONTEXT
) -> tuple[np.ndarray, np.ndarray]:
    """What the world model predicts without looking: it observes the first `context` steps of each replayed
    sequence, then imagines the rest from the real actions (prior samples). Returns (truth, model), each (n, T, S, S)
    uint8, or (n, T, 3, S, S) when the model reads colour: the newest frame of each stack and the model's
    reconstruction (steps < context) or prediction of it.
    Past an episode boundary inside a sequence the model cannot know the new episode's frames."""
    wm, rssm = agent.world_model, agent.world_model.rssm
    data = batch_to_device(batch, agent.num_actions, agent.device)
    image = data["image"]  # (n, T, C, S, S) in [-0.5, 0.5]
    n, T = image.shape[:2]
    context = min(context, T)
    with agent.amp.autocast():
        embed = wm.encoder(image[:, :context].flatten(0, 1)).unflatten(0, (n, context))  # (n, C, E)
        deter, stoch, _, _ = agent.observe(embed, data["action"][:, :context], data["is_first"][:, :context])
        feats = [torch.cat([deter, stoch], -1)]  # (n, C, F): posterior states of the context
        d, s = deter[:, -1], stoch[:, -1]
        for t in range(context, T):
            d = rssm.img_step(d, s, data["action"][:, t])
            s = rssm.sample(rssm.prior(d))
            feats.append(torch.cat([d, s], -1).unsqueeze(1))
        feat = torch.cat(feats, 1)  # (n, T, F)
        model = wm.decoder(feat.flatten(0, 1)).unflatten(0, (n, T))  # (n, T, C, S, S)
    truth = batch["obs"][:, :, -1]  # (n, T, S, S) uint8; in colour (n, T, 3, S, S)
    colour = truth.ndim == 5
    newest = model[:, :, -3:] if colour else model[:, :, -1]  # the newest frame's channels
    model = ((newest.float() + 0.5).clamp(0.0, 1.0) * 255).round().to(torch.uint8).cpu().numpy()
    return truth, model


GREY_WEIGHTS = (0.299, 0.587, 0.114)  # ITU-R BT.601, as OpenCV's and ALE's own grey frames


def grey(frames: np.ndarray) -> np.ndarray:
    """Colour frames (..., 3, S, S) uint8 in grey (..., S, S) uint8, weighted as the grey frames are."""
    weights = np.asarray(GREY_WEIGHTS, np.float32).reshape(3, 1, 1)
    return np.rint((frames.astype(np.float32) * weights).sum(-3)).clip(0, 255).astype(np.uint8)


def grey_frames(frames: np.ndarray) -> np.ndarray:
    """Open-loop frames in grey: colour ones (n, T, 3, S, S) through `grey`, grey ones (n, T, S, S) as they are."""
    return grey(frames) if frames.ndim == 5 else frames


def open_loop_strip(truth: np.ndarray, model: np.ndarray) -> np.ndarray:
    """(n, T, S, S) truth and model frames -> (T, n * S, 3 * S) uint8: one row per sequence with truth | model |
    error (grey 128 = no error, from the frames in grey). Colour frames (n, T, 3, S, S) give a colour strip
    (T, n * S, 3 * S, 3), its error column grey."""
    error = (grey_frames(model).astype(np.int16) - grey_frames(truth) + 256) // 2  # (n, T, S, S)
    error = error.astype(np.uint8)
    if truth.ndim == 5:  # channels last, the error in all three
        truth, model = truth.transpose(0, 1, 3, 4, 2), model.transpose(0, 1, 3, 4, 2)  # (n, T, S, S, 3)
        error = np.repeat(error[..., None], 3, -1)
    rows = np.concatenate([truth, model, error], 3)  # (n, T, S, 3S) or (n, T, S, 3S, 3)
    n, T = rows.shape[:2]
    return np.ascontiguousarray(rows.swapaxes(0, 1).reshape(T, n * rows.shape[2], *rows.shape[3:]))


PONG_SCREEN_ROWS, PONG_SCREEN_COLUMNS = 210, 160

PONG_PLAYFIELD = (34, 194)  # screen rows between the top and bottom walls (the score sits above the top wall)

PONG_PADDLE_COLUMNS = ((16, 20), (140, 144))  # screen columns of the opponent's and the player's paddle

BALL_EDGE = 25  # grey levels above the background: a pixel the ball covers in part

# the ball's brightest pixel is 64-149 above the background at 64-84 pixels; half of the dimmest, so that a ball
# drawn at half its contrast is still a ball (a paddle, 61 above, is told apart by its columns and size)
BALL_PEAK = 30

# width, height: at most the ball (2 x 4 screen pixels) seen twice, max-pooled
BALL_MAX_SIDE = (6 / 160, 8 / 210)


BALL_TOLERANCE = 1  # pixels (Chebyshev distance) between a model's ball pixel and a true one that still match

OPEN_LOOP_BALL_STEPS = (5, 10)  # open-loop steps after the last observed frame whose ball is scored


def pong_playfield(side: int) -> slice:
    """The rows of an (S, S) Pong frame between the walls, clear of the rows the walls blend into."""
    top, bottom = PONG_PLAYFIELD
    return slice(math.ceil(top * side / PONG_SCREEN_ROWS), math.floor(bottom * side / PONG_SCREEN_ROWS))


def pong_paddle_columns(side: int) -> np.ndarray:
    """(S,) bool: the columns of an (S, S) Pong frame that a paddle covers, in whole or in part."""
    columns, scale = np.zeros(side, bool), side / PONG_SCREEN_COLUMNS
    for left, right in PONG_PADDLE_COLUMNS:
        columns[math.floor(left * scale) : math.ceil(right * scale)] = True
    return columns


def find_balls(frame: np.ndarray) -> tuple[np.ndarray, float]:
    """Pong's ball in an (S, S) uint8 grey frame: (mask (S, S) bool of its pixels, background grey level, the
    playfield's median). The ball is a small bright object in the playfield: a connected (8-neighbour) patch of
    pixels at least BALL_EDGE above the background whose brightest pixel is at least BALL_PEAK above it, no larger
    than the ball, and clear of the paddles' columns (a paddle mostly hidden behind a wall is ball-sized).
    The mask is empty when the ball is not in play or touches a paddle. Every ball-like patch is in it: a bright
    band or blob larger than the ball is none, while each ball-sized fleck of speckle is one (`ball_scores`'s
    precision is what tells speckle from a ball)."""
    side = frame.shape[-1]
    rows = pong_playfield(side)
    field = frame[rows].astype(np.int16)
    background = float(np.median(field))
    contrast = field - background
    count, labels, stats, _ = cv2.connectedComponentsWithStats(
        (contrast >= BALL_EDGE).astype(np.uint8), connectivity=8
    )
    peak = np.full(count, -np.inf)
    np.maximum.at(peak, labels.ravel(), contrast.ravel())
    left, width = stats[:, cv2.CC_STAT_LEFT], stats[:, cv2.CC_STAT_WIDTH]
    paddle_columns = np.concatenate([[0], np.cumsum(pong_paddle_columns(side))])
    is_ball = (
        (width <= math.ceil(BALL_MAX_SIDE[0] * side) + 1)
        & (stats[:, cv2.CC_STAT_HEIGHT] <= math.ceil(BALL_MAX_SIDE[1] * side) + 1)
        & (peak >= BALL_PEAK)
        & (paddle_columns[left + width] == paddle_columns[left])  # no paddle column inside the patch
    )
    is_ball[0] = False  # label 0: the pixels below BALL_EDGE
    mask = np.zeros(frame.shape, bool)
    mask[rows] = is_ball[labels]
    return mask, background


def ball_scores(truth: np.ndarray, model: np.ndarray) -> dict[str, float]:
    """How well a model's frames draw Pong's ball, over frames (..., S, S) uint8 grey (colour frames in grey first,
    `grey`): both frames' balls are found alike (`find_balls`), and a ball pixel matches when a ball pixel of the
    other frame is within BALL_TOLERANCE pixels (Chebyshev distance). Pixel counts are pooled over all frames:
    - `precision`: matched model ball pixels / model ball pixels. A ball drawn where the truth has none, or
      speckle that looks like balls, counts against it.
    - `recall`: matched true ball pixels / true ball pixels. A ball the model leaves out counts against it.
    - `f1`: their harmonic mean; 0 when either is 0 or has nothing to count (no ball drawn, or none to draw).
    - `centroid_px`: the distance in pixels between the model's and the truth's ball centroids (of all their ball
      pixels), averaged over the frames where both have a ball.
    Frames where neither has a ball add nothing. A score with nothing to count (precision: no model ball pixels;
    recall: no true ones; f1: neither; centroid_px: no frame where both have a ball) is left out."""
    near = np.ones((2 * BALL_TOLERANCE + 1,) * 2, np.uint8)
    matched_model = model_pixels = matched_truth = true_pixels = 0
    distances = []
    for true_frame, model_frame in zip(
        truth.reshape(-1, *truth.shape[-2:]), model.reshape(-1, *model.shape[-2:])
    ):
        true_ball, model_ball = find_balls(true_frame)[0], find_balls(model_frame)[0]
        if true_ball.any() or model_ball.any():
            near_truth = cv2.dilate(true_ball.astype(np.uint8), near).astype(bool)  # (S, S)
            near_model = cv2.dilate(model_ball.astype(np.uint8), near).astype(bool)
            matched_model += int((model_ball & near_truth).sum())
            matched_truth += int((true_ball & near_model).sum())
            model_pixels += int(model_ball.sum())
            true_pixels += int(true_ball.sum())
        if true_ball.any() and model_ball.any():
            centroids = np.argwhere(true_ball).mean(0), np.argwhere(model_ball).mean(0)
            distances.append(float(np.linalg.norm(centroids[0] - centroids[1])))
    scores = {}
    if model_pixels:
        scores["precision"] = matched_model / model_pixels
    if true_pixels:
        scores["recall"] = matched_truth / true_pixels
    if model_pixels or true_pixels:
        precision, recall = scores.get("precision", 0.0), scores.get("recall", 0.0)
        scores["f1"] = 2 * precision * recall / (precision + recall) if precision and recall else 0.0
    if distances:
        scores["centroid_px"] = float(np.mean(distances))
    return scores


def open_loop_ball_scores(
    truth: np.ndarray, model: np.ndarray, context: int = OPEN_LOOP_CONTEXT
) -> dict[str, float]:
    """`ball_scores` of open-loop predictions (n, T, S, S), colour ones in grey, per horizon: the `context` observed
    frames (`world_model/ball_f1_observed`, `_precision_`, `_recall_`, `_centroid_px_`) and the frames 5 and 10 steps
    after the last observed one (`world_model/ball_f1_open_loop_5`, `_10`, ...). Beside each F1, its chance level
    (`world_model/ball_f1_chance_observed`, ...): the same model frames scored against the next sequence's truth
    (truth rolled by one along n), so a model that draws a ball where the truth is, and not just anywhere, scores
    well above it (needs n >= 2). A figure with nothing to count, or that the sequences are too short for, is
    left out."""
    truth, model = grey_frames(truth), grey_frames(model)  # (n, T, S, S): the ball is found in grey
    horizons = {"observed": np.s_[:, :context]}
    for k in OPEN_LOOP_BALL_STEPS:
        if context - 1 + k < truth.shape[1]:
            horizons[f"open_loop_{k}"] = np.s_[:, context - 1 + k]
    out = {}
    for name, frames in horizons.items():
        for score, value in ball_scores(truth[frames], model[frames]).items():
            out[f"world_model/ball_{score}_{name}"] = value
        if truth.shape[0] > 1:
            chance = ball_scores(np.roll(truth, 1, axis=0)[frames], model[frames])
            if "f1" in chance:
                out[f"world_model/ball_f1_chance_{name}"] = chance["f1"]
    return out


def is_pong(env_id: str) -> bool:
    return is_atari(env_id) and "pong" in env_id.lower()


def log_open_loop(run: "Run", num_sequences: int = 4) -> str:
    """Open-loop predictions of replayed sequences as an animated GIF (in colour when the model reads colour): in
    TensorBoard's image tab (and wandb's media, which syncs it as a video) under `videos/open_loop`, and as
    `open_loop/step_<N>.gif` in the run dir. On Pong, beside it, how well the predictions draw the ball
    (`open_loop_ball_scores`: F1, precision, recall, centroid distance and F1's chance level per horizon) over
    RECALL_SEQUENCES sequences. Uses its own random generators, so the training batches and latents that follow are
    the same with or without it."""
    import io

    from PIL import Image
    from tensorboard.compat.proto.summary_pb2 import Summary

    agent, args, writer, step, rng = run.agent, run.args, run.writer, run.step, run.video_rng
    # Pong: the ball scored over more sequences than the GIF shows (its first `num_sequences`)
    sequences = RECALL_SEQUENCES if is_pong(args.env_id) else num_sequences
    batch = run.replay.sample(sequences, args.sequence_length, rng=rng)
    devices = [agent.device] if agent.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(int(rng.integers(2**31)))
        truth, model = open_loop_predictions(agent, batch)  # (n, T, S, S) uint8; colour (n, T, 3, S, S)
    if is_pong(args.env_id):
        for key, value in open_loop_ball_scores(truth, model).items():
            writer.add_scalar(key, value, step)
    # (T, H, W) uint8; colour (T, H, W, 3)
    frames = open_loop_strip(truth[:num_sequences], model[:num_sequences])
    images = [Image.fromarray(frame) for frame in frames]
    gif = io.BytesIO()
    images[0].save(gif, format="GIF", save_all=True, append_images=images[1:], duration=100, loop=0)
    height, width = frames.shape[1:3]
    colorspace = 3 if frames.ndim == 4 else 1  # RGB or grey
    image = Summary.Image(
        height=height, width=width, colorspace=colorspace, encoded_image_string=gif.getvalue()
    )
    writer._get_file_writer().add_summary(
        Summary(value=[Summary.Value(tag="videos/open_loop", image=image)]), step
    )
    path = os.path.join(run.run_dir, "open_loop", f"step_{step}.gif")
    mu.atomic_write(path, gif.getvalue())  # mu.WriteFailed on a full disk: no partial file
    return path


# --- Memory: the preflight and the stage probes -----------------------------------------------------------------------


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


def seconds_since(start: float, device: torch.device) -> float:
    """Wall time since `start` (time.perf_counter) of the work queued on `device` since then."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def preflight(agent: Agent, args: Args, obs_shape: tuple) -> float:
    """Create all optimizer state now with a worst-case batch; weights and moments are left untouched. Then say what
    the whole run takes at the rate of that update (`say_run_time`). Returns the step's peak in MiB (on CUDA: what it
    allocated beyond what was allocated before)."""
    seconds = {}  # the worst-case update's parts, timed

    def step_fn():
        start = time.perf_counter()
        batch = synthetic_batch(args, obs_shape)
        data = batch_to_device(batch, agent.num_actions, agent.device, agent.channels_last)
        with agent.amp.autocast():
            loss, _, (deter, stoch) = world_model_loss(agent, data, args)
        loss.backward()
        seconds["world_model"] = seconds_since(start, agent.device)
        start = time.perf_counter()
        deter, stoch = deter.detach().flatten(0, 1), stoch.detach().flatten(0, 1)  # (B*T, D), (B*T, S)
        states = (deter, stoch, torch.ones(deter.shape[0], device=agent.device))
        with agent.amp.autocast():
            heads = agent.imagined_heads(agent, states, args)
            actor_loss, critic_loss, _ = agent.behavior_losses(
                agent, heads, states[2], args, update_norm=False
            )
        (actor_loss + critic_loss).backward()
        seconds["behavior"] = seconds_since(start, agent.device)

    # memory: Adam's moments exist before the first real update (fail now, not hours later); no weight moves.
    # An OOM here goes to main's start-up handler: a report, no checkpoint (nothing is trained yet), exit 3.
    peak_mb = mu.preallocate_optimizer_state(step_fn, agent.optimizers, modules=agent.modules().values())
    if agent.device.type == "cuda":
        # the first pass paid CUDA's one-time costs (kernels loaded, handles made): time a second one, which
        # draws its own random numbers and leaves no gradient behind
        with torch.random.fork_rng(devices=[agent.device]):
            step_fn()
        for optimizer in agent.optimizers:
            optimizer.zero_grad(set_to_none=True)
        # memory: the steps' cached blocks go back to the card (the warm-up updates run on another stream, which
        # could not reuse them)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(agent.device)
        print(f"preflight: peak {peak_mb:.0f} MiB, free {free / 2**20:.0f} MiB of {total / 2**20:.0f} MiB")
        if peak_mb > 0.9 * free:
            print(
                "preflight: little headroom; --precision bf16, a smaller --batch-size or --sequence-length help"
            )
    else:
        print(f"preflight: peak {peak_mb:.0f} MiB of host memory for one worst-case update")
    say_run_time(agent, args, obs_shape, seconds)
    return peak_mb


# a run on a CPU longer than this is told how to see learning on this machine in minutes (Catch)
LONG_CPU_RUN_S = 3600.0


def run_seconds(args: Args, world_model_s: float, behavior_s: float, act_s: float) -> float:
    """The wall time of a whole run at these costs: a world-model update and a behaviour update, each --train-ratio
    owes, and acting (the policy's step, once per vector step after --learning-starts). The emulator's own time and
    sampling batches are left out (about 1 ms a Pong step on a CPU core)."""
    per_step = args.train_ratio / (args.batch_size * args.sequence_length)  # updates per env step
    trained = max(0, args.total_timesteps - args.learning_starts)  # env steps with the policy and updates
    behaving = max(0, trained - args.warmup_steps)
    return trained / args.num_envs * act_s + per_step * (trained * world_model_s + behaving * behavior_s)


def time_acting(agent: Agent, args: Args, obs_shape: tuple, repeats: int = 2) -> float:
    """Seconds of one policy step for --num-envs observations (the fastest of `repeats` after one to warm up), with
    its own random numbers and a state of its own."""
    player = Player(agent, args.num_envs)
    obs = np.zeros((args.num_envs, *obs_shape), np.uint8)
    is_first = np.ones(args.num_envs, np.bool_)
    devices = [agent.device] if agent.device.type == "cuda" else []
    times = []
    with torch.random.fork_rng(devices=devices):
        for _ in range(repeats + 1):
            start = time.perf_counter()
            player.act(obs, is_first)  # reads the actions back: synchronised
            times.append(time.perf_counter() - start)
    return min(times[1:])


def seconds_text(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.1f} s"


def say_run_time(agent: Agent, args: Args, obs_shape: tuple, seconds: dict[str, float]) -> None:
    """One line: the preflight's update and the policy's step as timed here, and the whole run's wall time at that
    rate; on a CPU, when that is more than LONG_CPU_RUN_S, the same line names the Catch-v0 run that learns here in
    minutes (timed here too, `catch_seconds`), and the next line gives its command."""
    act_s = time_acting(agent, args, obs_shape)
    total_s = run_seconds(args, seconds["world_model"], seconds["behavior"], act_s)
    per_step = args.train_ratio / (args.batch_size * args.sequence_length)
    updates = per_step * max(0, args.total_timesteps - args.learning_starts)
    eager = " (eager; a captured one is faster)" if captures_updates(args, agent.device) else ""
    line = (
        f"preflight: an update of {args.batch_size} x {args.sequence_length} takes "
        f"{seconds_text(seconds['world_model'] + seconds['behavior'])} here{eager} and acting "
        f"{seconds_text(act_s)} an env step: this run, {args.total_timesteps:,} env steps with {updates:,.0f} "
        f"updates, takes about {mu.duration_text(total_s)} at that rate"
    )
    if agent.device.type == "cpu" and args.env_id != CATCH_ID and total_s > LONG_CPU_RUN_S:
        line += (
            f". To see learning on this machine, --env-id Catch-v0 at a small size learns in about "
            f"{mu.duration_text(catch_seconds())} here:\n  {catch_command()}"
        )
    print(line)


# --- Memory: a cap on GPU memory (--gpu-memory-gb) --------------------------------------------------------------------


# what would fit instead, said after each part that does not fit under the cap
MODEL_INSTEAD = "a smaller model (--hidden-dim, --deterministic-dim, --encoder-channels) would fit"
FRAMES_INSTEAD = "--replay-frames host (or a smaller --buffer-capacity) would fit"
ACTIVATIONS_INSTEAD = "a smaller --batch-size or --sequence-length, or --precision bf16, would fit"
REPORT_INSTEAD = "--video-every 0 (no open-loop reports) would fit"


def gpu_cap(args: Args) -> "mu.GpuCap | None":
    """--gpu-memory-gb as a cap, or None."""
    return None if args.gpu_memory_gb is None else mu.GpuCap(args.gpu_memory_gb)


def weights_and_optimizer_nbytes(args: Args, obs_shape: tuple, num_actions: int) -> int:
    """The bytes of the agent's weights and buffers (the slow critic's too) and of Adam's state (two moments per
    trained weight, a step per tensor), from its networks built on the meta device: nothing is allocated."""
    with torch.device("meta"):
        world_model = WorldModel(args, obs_shape, num_actions)
        feat_dim = args.deterministic_dim + world_model.rssm.stoch_flat
        actor = Actor(feat_dim, num_actions, args.hidden_dim, args.unimix)
        critic = Critic(feat_dim, args.hidden_dim, args.reward_bins)
        return_norm = ReturnNormalizer()
    trained = [p for module in (world_model, actor, critic) for p in module.parameters()]
    # the slow critic is a copy of the critic
    buffers = [b for module in (world_model, actor, critic, critic, return_norm) for b in module.buffers()]
    slow_critic = list(critic.parameters())
    return sum(t.nbytes for t in trained + slow_critic + buffers) + sum(2 * p.nbytes + 4 for p in trained)


def frames_on_device_nbytes(args: Args, obs_shape: tuple) -> int:
    """The bytes of a full replay's frames on the device (`FrameStoreReplay`'s store)."""
    return frame_store_nbytes(replay_capacity(args), args.num_envs, obs_shape[1:])


def cap_gpu_memory(args: Args, device: torch.device) -> None:
    """--gpu-memory-gb on CUDA: first, by arithmetic, the model and its optimizer state, and with --replay-frames
    device the replay's frames, must fit in the cap (else one sentence and exit 3, before anything is written); then
    torch's allocator is capped at the cap less the CUDA context's share. On a CPU the flag is said to be ignored."""
    cap = gpu_cap(args)
    if cap is None:
        return
    if device.type != "cuda":
        print(f"--gpu-memory-gb {cap.gib:g} ignored: no CUDA device, training on the CPU")
        return
    obs_shape, num_actions = env_spaces(args)
    parts = [
        ("the model and its optimizer state", weights_and_optimizer_nbytes(args, obs_shape, num_actions))
    ]
    if args.replay_frames == "device":
        parts.append(("the replay's frames on the device", frames_on_device_nbytes(args, obs_shape)))
    if problem := fit_problem(cap, parts):
        exit_with(f"error: {problem}", EXIT_OOM)
    fraction = mu.apply_gpu_cap(cap, device)
    print(
        f"gpu: at most {cap.gib:g} GiB (--gpu-memory-gb): torch's allocator capped at "
        f"{cap.allocator_bytes / 2**30:.2f} GiB ({fraction:.4f} of the card), {mu.CUDA_CONTEXT_GIB:g} GiB left to "
        f"the CUDA context"
    )


def fit_problem(cap: "mu.GpuCap", parts: list[tuple[str, float]], held_bytes: float = 0.0) -> str | None:
    """The first of the parts (name, bytes) that does not fit under the cap, after `held_bytes`, in one sentence
    that says what would fit instead; None when all do."""
    instead = {
        "the model and its optimizer state": MODEL_INSTEAD,
        "the replay's frames on the device": FRAMES_INSTEAD,
        "the update's activations at the preflight's peak": ACTIVATIONS_INSTEAD,
        "an open-loop report's activations": REPORT_INSTEAD,
    }
    return mu.gpu_fit_problem(cap, [(name, nbytes, instead[name]) for name, nbytes in parts], held_bytes)


def open_loop_peak_bytes(run: "Run") -> int:
    """CUDA: what one open-loop report (`open_loop_predictions` on as many sequences as `log_open_loop` draws)
    allocates at its peak, measured once on a synthetic batch, with torch's random state left as it was."""
    args, device = run.args, run.device
    sequences = RECALL_SEQUENCES if is_pong(args.env_id) else 4
    batch = synthetic_batch(dataclasses.replace(args, batch_size=sequences), run.obs_shape)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    with torch.random.fork_rng(devices=[device]):
        open_loop_predictions(run.agent, batch)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()  # memory: its blocks go back, as the preflight's did
    return peak


def check_fits_under_cap(run: "Run", activations_bytes: float) -> None:
    """After the preflight, under --gpu-memory-gb on CUDA: what is held (weights, optimizer state), the replay's frames
    when they are on the device (made with the first episode), the update's activations (the preflight's peak, which
    a captured update keeps as its graphs' pool) and, with open-loop reports, one report's peak must fit in the cap;
    otherwise one sentence and exit 3, before anything trains. Said in one line when they fit."""
    args, cap = run.args, gpu_cap(run.args)
    held = torch.cuda.memory_allocated(run.device)
    parts = []
    if isinstance(run.replay, FrameStoreReplay):
        parts.append(("the replay's frames on the device", frames_on_device_nbytes(args, run.obs_shape)))
    parts.append(("the update's activations at the preflight's peak", activations_bytes))
    if args.video_every:
        parts.append(("an open-loop report's activations", open_loop_peak_bytes(run)))
    if problem := fit_problem(cap, parts, held_bytes=held):
        run.writer.close()
        exit_with(f"error: {problem}", EXIT_OOM)
    print(
        f"gpu: under --gpu-memory-gb {cap.gib:g}: held {held / 2**30:.2f} GiB, "
        + ", ".join(f"{name} {nbytes / 2**30:.2f} GiB" for name, nbytes in parts)
        + f": {(held + sum(n for _, n in parts)) / 2**30:.2f} of the allocator's {cap.allocator_bytes / 2**30:.2f} GiB"
    )


# --- Catch: a pixel task that learns in minutes on a CPU (the learning proof, the tests) ------------------------------


class CatchEnv(gym.Env):
    """Catch, a pixel task small enough to learn in minutes on a CPU, for checking that the whole agent learns.

    A ball starts in a random column of the top row of a `rows` x `columns` grid and falls one row per step;
    the paddle on the bottom row moves left, stays or moves right. When the ball reaches the bottom row the
    episode ends: +1 if the paddle is under it, -1 if not (every ball can be caught: the optimal return is 1).
    Observations are `size` x `size` grey uint8 images (84 by default), like preprocessed Atari frames.
    Actions: 0 stay, 1 left, 2 right.
    """

    metadata = {"render_modes": ["rgb_array"], "render_fps": 8}  # noqa: RUF012 - gymnasium's own convention

    def __init__(self, rows: int = 10, columns: int = 5, size: int = 84, render_mode: str | None = None):
        self.rows, self.columns, self.size, self.render_mode = rows, columns, size, render_mode
        self.observation_space = gym.spaces.Box(0, 255, (size, size), np.uint8)
        self.action_space = gym.spaces.Discrete(3)
        self.cell_h, self.cell_w = size // rows, size // columns
        self.top = (size - rows * self.cell_h) // 2
        self.left = (size - columns * self.cell_w) // 2

    def _frame(self) -> np.ndarray:
        frame = np.zeros((self.size, self.size), np.uint8)  # (size, size)
        for (row, col), height in (
            ((self.ball_row, self.ball_col), self.cell_h),
            ((self.rows - 1, self.paddle), 3),
        ):
            y = self.top + (row + 1) * self.cell_h - height
            x = self.left + col * self.cell_w
            frame[y : y + height, x + 1 : x + self.cell_w - 1] = 255
        return frame

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        self.ball_row, self.ball_col = 0, int(self.np_random.integers(self.columns))
        self.paddle = self.columns // 2
        return self._frame(), {}

    def step(self, action):
        self.paddle = int(np.clip(self.paddle + (0, -1, 1)[int(action)], 0, self.columns - 1))
        self.ball_row += 1
        terminated = self.ball_row == self.rows - 1
        reward = (1.0 if self.paddle == self.ball_col else -1.0) if terminated else 0.0
        return self._frame(), reward, terminated, False, {}

    def render(self) -> np.ndarray:
        return np.repeat(self._frame()[..., None], 3, axis=-1)  # (size, size, 3)


CATCH_ID = "Catch-v0"


def register_catch() -> None:
    """Make `--env-id Catch-v0` a gymnasium id (also inside vector-env workers that start fresh)."""
    if CATCH_ID not in gym.registry:
        gym.register(CATCH_ID, entry_point=CatchEnv, max_episode_steps=100)


register_catch()


# The run that learns Catch-v0 on a CPU in minutes: benchmark/learning_proof.py's configuration, with which seeds 1-10
# all reached 0.8 of the optimal return (tests/test_learning_proof.py holds the two equal)
# fmt: off
CATCH_ON_CPU = dict(
    env_id=CATCH_ID, model="nature", continue_mode=False, encoder_channels=(8, 16, 16), embed_dim=64,
    decoder_base_channels=8, decoder_mid_channels=8, deterministic_dim=64, stochastic_dim=8, stochastic_classes=8,
    hidden_dim=64, frame_stack=1, image_size=84, batch_size=8, sequence_length=16, imagination_horizon=10,
    total_timesteps=2_400, learning_starts=300, train_ratio=144.0, world_model_lr=2e-3, actor_lr=3e-4, critic_lr=1e-3,
    entropy_coef=1e-2,
)
# fmt: on


def catch_command() -> str:
    """The command line of CATCH_ON_CPU: its flags that differ from the defaults of --model nature."""
    defaults = Args(env_id=CATCH_ID, model=CATCH_ON_CPU["model"])
    flags = []
    for name, value in CATCH_ON_CPU.items():
        if name not in ("env_id", "model") and value == getattr(defaults, name):
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else f"--no-{flag[2:]}")
        else:
            flags += [flag, *(str(v) for v in (value if isinstance(value, tuple) else (value,)))]
    return " ".join(["python", os.path.basename(__file__), *flags])


def catch_seconds(repeats: int = 1) -> float:
    """The wall time of CATCH_ON_CPU's run on this machine's CPU (`run_seconds`), from its update and its policy
    step timed here on a model of its own (two updates: about a second on an idle 2-core CPU), with random numbers
    of their own."""
    args = Args(**CATCH_ON_CPU)
    obs_shape = (args.frame_stack, args.image_size, args.image_size)  # (1, 84, 84)
    with torch.random.fork_rng(devices=[]):
        agent = build_agent(args, obs_shape, int(CatchEnv().action_space.n), torch.device("cpu"))
        speed_up_agent(agent, args)
        raw = batch_tensors(synthetic_batch(args, obs_shape), agent.device)
        world_model_s, behavior_s = [], []
        for _ in range(repeats + 1):  # the first warms up
            start = time.perf_counter()
            _, _, states = train_world_model(agent, raw, args)
            world_model_s.append(time.perf_counter() - start)
            start = time.perf_counter()
            train_behavior(agent, states, args)
            behavior_s.append(time.perf_counter() - start)
        act_s = time_acting(agent, args, obs_shape)
    return run_seconds(args, min(world_model_s[1:]), min(behavior_s[1:]), act_s)


# --- Checkpoints ------------------------------------------------------------------------------------------------------


def replay_stats(replay: EpisodeReplay) -> dict[str, int]:
    """The replay's sizes from its real arrays, for `memory_utils.memory_report(buffer_stats=...)`: obs_bytes in host
    memory, obs_device_bytes in a `FrameStore` on the device."""
    store = getattr(replay, "store", None)
    return {
        "total_steps": replay.total_steps,
        "num_episodes": len(replay.episodes),
        "obs_bytes": sum(ep.frames.nbytes for ep in replay.episodes),
        "aux_bytes": sum(getattr(ep, name).nbytes for ep in replay.episodes for name in Episode.FIELDS[1:]),
        "obs_device_bytes": 0 if store is None else store.nbytes,
    }


def replay_log_fields(obs_shape: tuple) -> dict[str, tuple[tuple, type]]:
    """A row of the replay on disk (`mu.ReplayLog`): an episode's frame (obs_shape[1:]), its step's values (those of
    `Episode.shapes`), which episode (its id, its env) and which of its frames it is."""
    fields = Episode.shapes(np.zeros((1, *obs_shape[1:]), np.uint8))
    return fields | {"episode": ((), np.int64), "env": ((), np.int16), "index": ((), np.int32)}


def replay_state(replay: EpisodeReplay) -> dict | None:
    """The replay for a checkpoint (with --replay-on-disk; None without): the log on disk's state (where it stands,
    its files' CRC-32s, the rows of the chunk still filling) and the index of what the replay holds, oldest episode
    first: each one's id and env, where its frames and steps start (an episode that outgrew the replay lost its
    front), and whether it is done; the episodes in progress are those not done. Tensors and plain containers only."""
    if replay.log is None:
        return None
    keep_from = min((episode.log_start for episode in replay.episodes), default=replay.log.position)
    if (log := replay.log.state(keep_from)) is None:  # a file that could not be written: in memory only
        return None
    index = [
        {"id": ep.id, "env": ep.env, "frames": ep.frames.start, "steps": ep.action.start, "done": ep.done}
        for ep in replay.episodes
    ]
    return {"log": log, "episodes": index, "total_steps": replay.total_steps, "begun": replay.begun,
            "rng": replay.rng.bit_generator.state}  # fmt: skip


def restore_replay(replay: EpisodeReplay, state: dict, stack: int) -> None:
    """The replay exactly as a checkpoint holds it (`replay_state`), from its rows on disk: each episode rebuilt from
    its stored frames (the first `frame_stack` of them, then one step each), in the order the replay held them,
    those in progress as each env's current one; the replay's counts and generator as they were. Raises
    mu.ReplayLogInvalid when a file the checkpoint needs is missing or changed."""
    wanted = {saved["id"]: saved for saved in state["episodes"]}
    # id -> the episode rebuilt; id -> its first frames, until it has a stack of them
    episodes, pending = {}, {}
    for start, rows in replay.log.rows(state["log"]):
        for offset, (episode_id, index) in enumerate(zip(rows["episode"].tolist(), rows["index"].tolist())):
            saved = wanted.get(episode_id)
            if saved is None or index < saved["frames"]:
                continue  # an evicted episode's frame, or one its episode dropped from its front
            if episode_id in episodes:
                step = {name: rows[name][offset] for name in Episode.FIELDS}
                episodes[episode_id].append(*(step[name] for name in Episode.FIELDS))
                continue
            frames = pending.setdefault(episode_id, [])
            frames.append((rows["frames"][offset], {name: rows[name][offset] for name in Episode.FIELDS[1:]}))
            if len(frames) == stack:
                episode = replay.new_episode(saved["env"], np.stack([frame for frame, _ in frames]))
                if saved["steps"]:  # it lost its front: its first step's own values, not an episode start's
                    for name, value in frames[-1][1].items():
                        getattr(episode, name).chunks[0][0] = value
                episode.id, episode.env, episode.log_start = episode_id, saved["env"], start + offset
                episodes[episode_id] = episode
                del pending[episode_id]
    replay.episodes.clear()
    for saved in state["episodes"]:
        episode = episodes.get(saved["id"])
        if episode is None:
            raise mu.ReplayLogInvalid(
                f"the checkpoint's replay has no rows of its episode {saved['id']} on disk"
            )
        replay.episodes.append(episode)
        if saved["done"]:
            episode.finish()
        else:
            replay.current[saved["env"]] = episode
    replay.total_steps, replay.begun = sum(episode.num_steps for episode in replay.episodes), state["begun"]
    if replay.total_steps != state["total_steps"]:
        raise mu.ReplayLogInvalid(
            f"the replay rebuilt from disk holds {replay.total_steps} steps, and the checkpoint's held "
            f"{state['total_steps']}"
        )
    replay.rng.bit_generator.state = state["rng"]
    replay.log.resume(state["log"])


def load_replay_state(replay: EpisodeReplay, state: dict) -> None:
    """A saved replay (`replay_state`) into `replay` (empty, or dropped first). Frames kept on the device are written
    as the first env's: saved episodes are the oldest, so they are evicted before its new ones, in order."""
    for episode in replay.episodes:
        episode.evict()
    replay.episodes.clear()
    replay.total_steps = 0
    for arrays in state["episodes"]:
        frames = arrays["frames"].numpy()
        stack = len(frames) - len(arrays["action"]) + 1  # an episode stores k - 1 frames more than steps
        episode = replay.new_episode(0, frames[:stack])
        episode.columns.load({name: arrays[name].numpy() for name in Episode.FIELDS})
        episode.done = True
        replay.episodes.append(episode)
        replay.total_steps += episode.num_steps
    replay.rng.bit_generator.state = state["rng"]
    replay._evict()


def save_checkpoint(
    path: str,
    agent: Agent,
    counters: dict,
    run_name: str,
    args: Args,
    replay: EpisodeReplay | None = None,
    rng: np.random.Generator | None = None,
    loop: dict | None = None,
) -> str:
    state = {
        "format": CHECKPOINT_FORMAT,
        "run_name": run_name,
        "args": asdict(args),
        "models": {name: module.state_dict() for name, module in agent.modules().items()},
        "optimizers": {name: optimizer.state_dict() for name, optimizer in agent.named_optimizers().items()},
        "scalers": {name: scaler.state_dict() for name, scaler in agent.scalers.items()},
        "counters": dict(counters),
        # each setting's tensor now (a schedule may have set it), its complement too: a resumed run goes on with them
        "settings": {name: value.detach().cpu().clone() for name, value in agent.settings.tensors.items()},
        "rng": {
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
            "numpy": None if rng is None else rng.bit_generator.state,
        },
        "replay": replay_state(replay) if replay is not None else None,
        "loop": loop,  # `loop_state`
    }
    if torch.cuda.is_available() and agent.device.type == "cuda":
        state["rng"]["cuda"] = torch.cuda.get_rng_state(agent.device)
    # a crash or a full disk while writing never leaves a half-written checkpoint behind (mu.WriteFailed); the
    # checksum beside it (checkpoint.pt.sha256) lets a resumed run refuse a file changed since
    mu.save_checked(path, lambda f: torch.save(state, f), needed_bytes=mu.estimate_nbytes(state))
    if state["replay"] is not None:  # written whole: the replay's files it no longer needs can go
        replay.log.commit(state["replay"]["log"])
    return path


def load_checkpoint(path: str) -> dict:
    """The checkpoint --resume names, verified and loaded (`mu.read_checkpoint`); any problem is one ArgsError
    sentence, and the file stays where it is."""
    try:
        state, note = mu.read_checkpoint(path, (CHECKPOINT_FORMAT,))
    except mu.CheckpointInvalid as exc:
        raise ArgsError(str(exc))
    if note:
        print(note)
    return state


# the flags that shape the networks, and what checkpoints from before some of them existed were trained with
# fmt: off
MODEL_FLAGS = ("env_id", "model", "image_size", "frame_stack", "rgb", "encoder_channels", "embed_dim",
               "decoder_base_channels", "decoder_mid_channels", "deterministic_dim", "stochastic_dim",
               "stochastic_classes", "hidden_dim", "reward_bins", "initial_state")
FLAGS_BEFORE_THEY_EXISTED = {"model": "nature", "image_size": 84, "frame_stack": 4, "rgb": False,
                             "initial_state": "zeros"}
# fmt: on


def check_checkpoint_matches(state: dict, args: Args) -> None:
    """The flags that shape the networks must be the ones the checkpoint was trained with."""
    for name in MODEL_FLAGS:
        saved, wanted = state["args"].get(name, FLAGS_BEFORE_THEY_EXISTED.get(name)), getattr(args, name)
        if isinstance(wanted, tuple):
            saved = tuple(saved) if saved is not None else None
        if saved != wanted:
            flag = "--" + name.replace("_", "-")
            raise ArgsError(
                f"--resume checkpoint was trained with {flag} {saved}, but this run asks for {wanted}."
            )
    replay, saved_args = state.get("replay") or {}, state["args"]
    held = replay.get("total_steps", 0)
    saved_capacity = saved_args.get("buffer_capacity") or saved_args.get("total_timesteps", 0)
    if replay_capacity(args) < min(held, saved_capacity):
        raise ArgsError(
            f"--resume checkpoint's replay holds {held:,} steps, more than --buffer-capacity "
            f"{replay_capacity(args):,} can: give at least {saved_capacity:,} (the run's own)."
        )


def load_optimizer(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """torch's `load_state_dict` replaces each param group, its learning-rate tensor and `capturable` included: the
    saved rate goes into the optimizer's own tensor instead, which `Settings` and a captured update hold, and
    `capturable` stays this run's (a CPU run's checkpoint resumes captured on a GPU)."""
    live = [(group["lr"], group["capturable"]) for group in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, (rate, capturable) in zip(optimizer.param_groups, live):
        rate.fill_(float(group["lr"]))
        group["lr"], group["capturable"] = rate, capturable


def named_rssm_keys(weights: dict) -> dict:
    """A world model's weights saved when the RSSM's layers had numbers (`rssm.img_in.0.weight`), under their names
    (`rssm.img_in.linear.weight`, see `dense`)."""
    names = {"0": "linear", "1": "norm", "3": "out"}
    pattern = re.compile(r"^rssm\.(img_in|prior_net|posterior_net)\.([013])\.")
    return {
        pattern.sub(lambda m: f"rssm.{m[1]}.{names[m[2]]}.", key): value for key, value in weights.items()
    }


def restore_checkpoint(
    state: dict, agent: Agent, replay: EpisodeReplay, rng: np.random.Generator, frame_stack: int
) -> dict:
    """The checkpoint's modules, optimizers, loss scalers, RNG states and replay into the run's; returns its counters.
    A replay the run keeps in memory only (--no-replay-on-disk) starts empty."""
    state["models"]["world_model"] = named_rssm_keys(state["models"]["world_model"])
    try:
        for name, module in agent.modules().items():
            module.load_state_dict(state["models"][name])
        for name, optimizer in agent.named_optimizers().items():
            load_optimizer(optimizer, state["optimizers"][name])
    except (RuntimeError, KeyError, ValueError) as exc:
        first_line = str(exc).strip().splitlines()[0]
        raise ArgsError(f"the checkpoint does not match these model flags ({first_line[:160]}).")

    # a checkpoint with one scaler ("scaler") shares it among the three optimizers
    saved_scalers = state.get("scalers") or {name: state.get("scaler") for name in agent.scalers}
    for name, scaler in agent.scalers.items():
        if saved_scalers.get(name):
            scaler.load_state_dict(saved_scalers[name])
    torch.set_rng_state(state["rng"]["torch"])
    random.setstate(state["rng"]["python"])
    if state["rng"].get("numpy") is not None:
        rng.bit_generator.state = state["rng"]["numpy"]
    if "cuda" in state["rng"] and agent.device.type == "cuda":
        torch.cuda.set_rng_state(state["rng"]["cuda"], agent.device)
    saved_replay = state.get("replay")
    if saved_replay is not None and "log" not in saved_replay:  # an older version's (--checkpoint-buffer)
        load_replay_state(replay, saved_replay)
    elif saved_replay is not None and replay.log is not None:
        restore_replay(replay, saved_replay, frame_stack)
    return dict(state["counters"])


# --- Logging and the run's set-up -------------------------------------------------------------------------------------


REWARD_COUNT_KEYS = ("reward_nonzero", "reward_hits", "reward_zero", "reward_false_alarms")


def reward_quality(means: dict[str, float]) -> dict[str, float]:
    """`charts/reward_sign_accuracy` (share of nonzero rewards predicted with the right sign and at least half
    the size) and `charts/reward_false_alarm_rate` (share of zero rewards predicted as 0.5 or more), from the
    mean counts of a log interval; a rate whose denominator is 0 in the interval is left out."""
    nonzero, hits, zero, false_alarms = (means.pop(f"debug/{key}", 0.0) for key in REWARD_COUNT_KEYS)
    out = {}
    if nonzero > 0:
        out["charts/reward_sign_accuracy"] = hits / nonzero
    if zero > 0:
        out["charts/reward_false_alarm_rate"] = false_alarms / zero
    return out


def exit_with(message: str, code: int) -> None:
    print(message, file=sys.stderr, flush=True)
    raise SystemExit(code)


@dataclass
class Run:
    """Everything one training run holds between loop iterations; made by `set_up`: first the learner (agent,
    replay, update steps), then its folder and logs (`open_run`), then the instruments that watch it (`instrument`)."""

    args: Args
    device: torch.device
    agent: Agent
    replay: EpisodeReplay
    player: Player
    rng: np.random.Generator
    counters: dict
    world_model_step: Callable
    behavior_step: Callable
    update_log: mu.UpdateLog
    obs_shape: tuple
    # its folder and logs (`open_run`)
    run_name: str = ""
    run_dir: str = ""
    writer: SummaryWriter | None = None
    # what `train` samples with: `sample_batch`, or Part 2's (`install_speed`), called as run.sample_batch(run)
    sample_batch: Callable = sample_batch
    # instruments and schedules (`instrument`)
    probes: "mu.StageProbes | None" = None
    snapshots: "mu.MemorySnapshots | None" = None
    leak_detector: "mu.LeakDetector | None" = None
    progress: "mu.ProgressLine | None" = None
    status: "mu.StatusLine | None" = None
    next_log: int = 0
    next_checkpoint: int | None = None
    next_check: int | None = None  # the update at which the fast paths are next checked (`check_cadence`)
    next_checkpoint_time: float = math.inf  # when the next checkpoint by wall time is due (time.time())
    next_video: int | None = None
    video_rng: np.random.Generator | None = None
    start_time: float = dataclasses.field(default_factory=time.time)
    start_step: int = 0
    start_updates: int = 0
    seconds_before: float = 0.0  # training time of the earlier parts of a resumed run
    checkpoint_seconds: float = 0.0  # spent writing checkpoints in this invocation
    last_report: dict = dataclasses.field(default_factory=dict)
    last_return: float | None = None
    last_verdict: "mu.LeakVerdict | None" = None
    said_replay_short: bool = False
    stop: mu.StopSignals = dataclasses.field(default_factory=mu.StopSignals)  # read at the loop's top
    made: "mu.StartUp | None" = None  # what the start-up made: a stop before the first env step takes it away
    # non-finite values kept out: updates skipped (`log_point`), env steps cut (`env_fault`), and what was said
    said_nonfinite: dict = dataclasses.field(default_factory=lambda: {"updates": 0, "env": 0})
    env_faults: dict = dataclasses.field(
        default_factory=dict
    )  # env index -> (in a row, the step of the last)
    # what the loop carries from one env step to the next (`learn`), and what a resumed run's checkpoint held of it
    envs: "gym.vector.VectorEnv | None" = None
    obs: np.ndarray | None = None
    is_first: np.ndarray | None = None
    resumed_loop: dict | None = None

    @property
    def checkpoint_path(self) -> str:
        return os.path.join(self.run_dir, "checkpoint.pt")

    @property
    def step(self) -> int:
        return self.counters["global_step"]

    def sps(self) -> float:
        return (self.step - self.start_step) / max(time.time() - self.start_time, 1e-9)

    def stop_if_signalled(self) -> None:
        """SIGINT or SIGTERM since the last iteration: a checkpoint, then exit 128 + N; before the run's first env
        step there is nothing to keep, and a new run's folder is removed (`mu.StartUp`)."""
        if not self.stop.received:
            return
        if self.step == self.start_step:
            exit_with((self.made or mu.StartUp(new=False)).discard(self.stop.name), self.stop.exit_code)
        checkpoint(self, self.stop.name)
        message = f"stopped by {self.stop.name} at step {self.step}: --resume {self.checkpoint_path} goes on"
        exit_with(message, self.stop.exit_code)

    def env_fault(self, env_index: int, fault: str) -> None:
        """`env_fault` for this run."""
        env_fault(self, env_index, fault)

    def start_envs(self, envs) -> tuple[np.ndarray, np.ndarray]:
        """The loop's first obs and is_first: a new run's envs reset, an episode starting in each; a resumed run's as
        its checkpoint left them (`loop_state`). Where it holds no env state (async envs, a crash mid-step) or no
        replay (--no-replay-on-disk), the episodes in progress start over: said in one line, and counted."""
        self.envs, loop, args = envs, self.resumed_loop or {}, self.args
        obs, _ = envs.reset(seed=args.seed + self.step)
        if loop.get("envs") is not None and None not in self.replay.current:
            mu.restore_env_state(envs, loop["envs"])
            return loop["obs"].numpy(), loop["is_first"].numpy()
        if self.step > 0:
            self.counters["restarted_episodes"] = self.counters.get("restarted_episodes", 0) + args.num_envs
            print(f"resume: the {args.num_envs} episodes in progress start over; the rest goes on as it was")
        for i in range(args.num_envs):
            self.replay.start_episode(i, obs[i])
        return obs, np.ones(args.num_envs, np.bool_)

    def watch(self) -> None:
        """After each env step: the open-loop videos, probes, snapshots and progress line (`diagnose`), the status
        line every 30 s (`say_status`), a log point every --log-interval env steps, the fast paths' check every
        --check-every updates (counted in updates, so two runs check at the same ones), a checkpoint every
        --checkpoint-minutes of wall time and every --checkpoint-every env steps. A checkpoint changes nothing that
        trains (it draws no random number and checks nothing), so two runs train alike whenever theirs come."""
        args = self.args
        diagnose(self)
        say_status(self)
        if self.step >= self.next_log:
            log_point(self)
        if self.next_check is not None and self.counters["updates"] >= self.next_check:
            every = check_cadence(args, self.device)
            self.next_check = (self.counters["updates"] // every + 1) * every
            check_run_fast_paths(self)
        by_steps = self.next_checkpoint is not None and self.step >= self.next_checkpoint
        by_time = args.checkpoint_minutes > 0 and time.time() >= self.next_checkpoint_time
        final_next = args.save_model and self.step >= args.total_timesteps  # the final one comes at once
        if (by_steps or by_time) and not final_next:
            if args.checkpoint_every:
                self.next_checkpoint = (self.step // args.checkpoint_every + 1) * args.checkpoint_every
            self.next_checkpoint_time = time.time() + 60 * args.checkpoint_minutes
            # a full disk: a warning, the next interval tries again
            checkpoint(self, "periodic", required=False)
        if self.step >= args.learning_starts and not self.replay.can_sample(args.sequence_length):
            say_replay_short(self)


def check_input(args: Args) -> tuple[torch.device, dict | None]:
    """Validate everything before anything starts or is written; bad input exits 2 with one sentence. Returns the
    device and the checkpoint to resume from."""
    try:
        check_args(args)
        device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
        try:
            amp = mu.amp("off" if args.precision == "float32" else args.precision, device)
        except ValueError as exc:
            raise ArgsError(f"--precision {args.precision} is not available here: {exc}.")
        if captures_updates(args, device) and amp.dtype == torch.float16:
            raise ArgsError(
                "CUDA-graph capture (on by default on CUDA) takes --precision float32 or bf16, got --precision fp16 "
                "(fp16's loss scaling is not captured); add --no-cudagraph to run fp16 eagerly."
            )
        if args.memory_probes and (args.compile or captures_updates(args, device)):
            off = "run without --compile" if args.compile else "add --no-cudagraph"
            raise ArgsError(
                f"--memory-probes measures eager updates (its hooks run no compiled or captured code); {off}."
            )
        if args.gpu_memory_gb is not None:
            card = mu.gpu_card_bytes(device) if device.type == "cuda" else None
            if problem := mu.gpu_cap_problem(args.gpu_memory_gb, card):
                raise ArgsError(problem)
        resume_state = load_checkpoint(args.resume) if args.resume else None
        if resume_state is not None:
            check_checkpoint_matches(resume_state, args)
        check_actions_change_frames(make_env(args.env_id, 0, False, "", args), args.env_id, args.seed)
    except ArgsError as exc:
        exit_with(f"error: {exc}", EXIT_BAD_INPUT)
    return device, resume_state


# what a run counts; train_seconds: the wall time of this run, summed over its resumed parts
# fmt: off
NEW_COUNTERS = {"global_step": 0, "updates": 0, "behavior_updates": 0, "updates_owed": 0.0, "nonfinite_updates": 0,
                "nonfinite_env_steps": 0, "episodes": 0, "train_seconds": 0.0}
# fmt: on


def set_up(args: Args, stop: mu.StopSignals | None = None, made: "mu.StartUp | None" = None) -> Run:
    """The run, in the order it is made: the input checked (bad input exits 2 before anything is written), the
    learner with Part 2's equivalents checked (`build_learner`: a mismatch exits 7, before the run has a folder), its
    folder and logs, the optimizer state (`preflight`), a resumed run's state restored, then the instruments that
    watch it. Out of memory before training (the worst-case update does not fit) is a report and exit 3. `stop`: the
    run's stop signals; `made`: what the start-up made, filled in as it goes."""
    mu.configure_allocator(verbose=False)  # memory: before anything touches CUDA
    mu.one_malloc_arena()  # memory: before TensorBoard's and wandb's threads, whose own heaps are never trimmed
    device, resume_state = check_input(args)
    cap_gpu_memory(args, device)  # before anything is written or built; a run that cannot fit exits 3
    seed_everything(args, device)
    run, made = None, made or mu.StartUp(new=resume_state is None)
    try:
        run = build_learner(args, device, resume_state)
        run.stop, run.made = stop or run.stop, made
        run.run_name, run.run_dir, run.writer = open_run(args, resume_state, made)
        if args.replay_on_disk:  # memory: one chunk of steps in host memory; the rest written as the run goes
            fields = replay_log_fields(run.obs_shape)
            folder = os.path.join(run.run_dir, "replay")
            run.replay.log = mu.ReplayLog(folder, fields, args.replay_chunk_steps)  # (a warning: one line)
        if device.type == "cuda":
            mu.install_oom_observer(run.run_dir)
        if args.preallocate:
            peak_mb = preflight(run.agent, args, run.obs_shape)
            if gpu_cap(args) is not None and device.type == "cuda":
                check_fits_under_cap(run, peak_mb * 2**20)
    except torch.OutOfMemoryError as exc:
        run_dir = run.run_dir if run is not None and run.run_dir else open_run(args, resume_state, made)[1]
        run = None  # memory: the half-built learner goes before the report
        oom = mu.out_of_memory(exc, __file__, run_dir, device=device, advice=OOM_ADVICE)
        under = f" under --gpu-memory-gb {args.gpu_memory_gb:g}" if gpu_cap(args) is not None else ""
        exit_with(f"out of memory at start-up ({oom.where}), before any training: a worst-case update (--batch-size "
                  f"{args.batch_size} x --sequence-length {args.sequence_length}) does not fit here{under}.\n"
                  f"{oom.diagnosis}", EXIT_OOM)  # fmt: skip
    say_replay_size(
        run.replay.capacity, run.obs_shape, frames_on_device=isinstance(run.replay, FrameStoreReplay)
    )
    if resume_state is not None:
        restore_run(run, resume_state)
        resume_state = None  # memory: the loaded tensors are now inside the modules; drop the copies
    probes = mu.StageProbes(enabled=args.memory_probes, device=device)
    if args.memory_probes:  # hooks before the first update (a captured one would record nothing)
        wm = run.agent.world_model  # (the prior: `RSSM.observe` runs it once, after its loop)
        stages = {"after_encoder": wm.encoder, "after_rssm": wm.rssm.prior_net, "after_decoder": wm.decoder}
        probes.attach(stages, run.agent.world_model_optimizer)
    instrument(run, probes)
    return run


def restore_run(run: Run, state: dict) -> None:
    """A resumed run as its checkpoint left it: the modules, optimizers, scalers, RNG states, counters and the replay
    (`restore_checkpoint`), this command's settings where they differ (`honour_settings`), and the fast paths held to
    Part 1 on those weights (one that disagrees is dropped). A checkpoint that does not fit, or whose replay on disk
    is missing or changed, is one sentence and exit 2."""
    args = run.args
    try:
        run.counters.update(restore_checkpoint(state, run.agent, run.replay, run.rng, args.frame_stack))
    except (ArgsError, mu.ReplayLogInvalid) as exc:
        run.writer.close()
        exit_with(f"error: --resume: {str(exc).rstrip('.')}.", EXIT_BAD_INPUT)
    if (loop := state.get("loop")) is not None:  # the loop as it stood (`loop_state`), its envs at its start
        for name, value in loop["player"].items():
            getattr(run.player, name).copy_(value)
        run.env_faults, run.last_return = dict(loop["env_faults"]), loop["last_return"]
        run.resumed_loop = loop
    honour_settings(run, state)
    check_run_fast_paths(run)  # on the weights and data the run goes on with (one that disagrees is dropped)
    held = state.get("replay") is not None and run.replay.log is not None
    replay = f", {run.replay.total_steps:,} in its replay" if held else ", its replay empty (none on disk)"
    print(f"resumed {run.run_name} at step {run.step} ({run.counters['updates']} updates{replay})")


def honour_settings(run: Run, state: dict) -> None:
    """This command's settings on a resumed run: each of `Settings` (the learning rates, clips, KL scales, entropy,
    ...) and each Adam's eps takes this command's value where it differs from the checkpoint's, said in one line;
    the others go on as the checkpoint left them (a value a schedule set with `settings.set` included)."""
    saved_args, saved_values = state["args"], state.get("settings", {})
    changed = []
    for name in Settings.NAMES:
        wanted = float(getattr(run.args, name))
        if name in saved_args and float(saved_args[name]) != wanted:
            run.agent.settings.set(name, wanted)
            changed.append(f"--{name.replace('_', '-')} {saved_args[name]:g} -> {wanted:g}")
        elif name in saved_values:  # as the checkpoint held it, to the last bit (an older one's: a float)
            run.agent.settings.set(name, float(saved_values[name]))
            for key in (name, f"1 - {name}"):
                if isinstance(saved_values.get(key), torch.Tensor):
                    run.agent.settings[key].copy_(saved_values[key])
    for name, optimizer in run.agent.named_optimizers().items():
        wanted = getattr(run.args, f"{name}_eps")
        if saved_args.get(f"{name}_eps", wanted) != wanted:
            for group in optimizer.param_groups:
                group["eps"] = wanted
            changed.append(f"--{name.replace('_', '-')}-eps {saved_args[f'{name}_eps']:g} -> {wanted:g}")
    if changed:
        print(f"resume: this command's {', '.join(changed)}; the rest as the checkpoint left it")


def open_run(args: Args, resume_state: dict | None, made: "mu.StartUp") -> tuple[str, str, SummaryWriter]:
    """The run's folder (`runs/{run_name}`, claimed atomically and marked as this script's: a name another run already
    holds gets a suffix; a resumed run goes on in the checkpoint's folder, wherever it was started), held for this
    process alone (`mu.lock_run_dir`: a second resume of one checkpoint is refused, exit 2, before anything is
    written), TensorBoard and, with --track, wandb (one that cannot start is one line, and the run trains on).
    Returns (run name, folder, writer); `made` records what it made."""
    if resume_state is not None:
        run_name, run_dir = resume_state["run_name"], os.path.dirname(args.resume) or "."
    else:
        run_dir, run_name = mu.claim_run_dir("runs", run_name_of(args), script=__file__)
    made.run_dir = run_dir
    try:
        made.lock = mu.lock_run_dir(run_dir)
    except mu.RunDirInUse as exc:
        exit_with(f"error: --resume: {exc}.", EXIT_BAD_INPUT)
    if args.capture_video:
        made.folders.append(f"videos/{run_name}")
    # ./wandb beside ./runs (a resumed run's: beside its folder's), also when an earlier run set another place
    wandb_dir = os.path.dirname(os.path.dirname(os.path.abspath(run_dir)))
    # fmt: off
    tracking = args.track and mu.start_wandb(
        print, project=args.wandb_project_name, entity=args.wandb_entity, sync_tensorboard=True, config=vars(args),
        name=run_name, id=run_name, dir=wandb_dir, resume="allow", monitor_gym=True, save_code=True)
    # fmt: on
    if tracking:
        made.closers.append(lambda: sys.modules["wandb"].finish())
    resume_step = resume_state["counters"]["global_step"] if resume_state is not None else None
    writer = mu.open_tensorboard(run_dir, vars(args), resume_step=resume_step)  # a full disk: warnings only
    made.closers.append(writer.close)
    return run_name, run_dir, writer


def seed_everything(args: Args, device: torch.device) -> None:
    """The seeds, and the numerics the whole process keeps. cuDNN's benchmark (on CUDA without --torch-deterministic)
    times each convolution's algorithms the first time it meets their shapes, in the first updates, before they are
    captured, and keeps the fastest. With --torch-deterministic (the default) it stays off: benchmarking would then
    choose among deterministic algorithms only, but by their timings, so two runs could choose differently and
    differ in their last bits; off, cuDNN's choice is the same in every run."""
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    torch.backends.cudnn.benchmark = device.type == "cuda" and not args.torch_deterministic
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high" if args.tf32 else "highest")


def update_steps(agent: Agent, args: Args) -> tuple[Callable, Callable]:
    """`train_world_model` and `train_behavior` as functions of one dict of device tensors each (the form a CUDA
    graph replays, Part 2)."""

    def world_model_step(raw: dict[str, torch.Tensor]) -> tuple:
        return train_world_model(agent, raw, args)

    def behavior_step(start: dict[str, torch.Tensor]) -> tuple:
        return train_behavior(agent, start, args)

    return world_model_step, behavior_step


def build_learner(args: Args, device: torch.device, resume_state: dict | None = None) -> Run:
    """Part 1's learner (agent, replay, player, update steps), with Part 2's faster equivalents put in place and
    checked (`install_speed`; a mismatch exits 7). A resumed run keeps out the paths its checks dropped."""
    # the env workers start with the loop, where one `finally` closes them whatever happens; until then one env
    # gives the shapes (an async worker left open would block this process's exit: workers ignore SIGTERM)
    obs_shape, num_actions = env_spaces(args)  # (--frame-stack, 3, S, S), number of actions
    agent = build_agent(args, obs_shape, num_actions, device)
    replay = EpisodeReplay(replay_capacity(args), args.num_envs, seed=args.seed)
    # fmt: off
    run = Run(args=args, device=device, agent=agent, replay=replay, player=Player(agent, args.num_envs),
              rng=np.random.default_rng(args.seed), counters=dict(NEW_COUNTERS), update_log=mu.UpdateLog(device),
              world_model_step=None, behavior_step=None, obs_shape=obs_shape)  # the update steps: `install_speed`'s
    # fmt: on
    if dropped := (resume_state or {}).get("counters", {}).get("dropped_fast_paths"):
        defaults = {field.name: field.default for field in dataclasses.fields(Args)}
        dropped = {  # an older checkpoint's: `False` for a flag now auto|on|off, a path since removed
            name: "off" if value is False and isinstance(defaults[name], str) else value
            for name, value in dropped.items()
            if name in defaults
        }
        run.counters["dropped_fast_paths"] = dropped
        flags = ", ".join(
            f"--no-{flag.replace('_', '-')}" if value is False else f"--{flag.replace('_', '-')} {value}"
            for flag, value in dropped.items()
        )
        print(f"speed: {flags}: a check dropped these paths earlier in this run, and they stay dropped")
    try:
        install_speed(run)
    except FastPathMismatch as exc:
        exit_with(f"error: {exc}", EXIT_FAST_PATH)
    return run


def instrument(run: Run, probes: "mu.StageProbes") -> None:
    """What watches the run: memory probes, allocator snapshots, the leak detector, the disk check, the progress
    line; and the schedule of log points, checkpoints and videos (from the step a resumed run starts at)."""
    args, counters, step = run.args, run.counters, run.step
    if "update_log" in counters:  # resumed: the updates the stopped run made since its last log point
        run.update_log.restore(counters.pop("update_log"))
    # a full disk: say so now, not at the first checkpoint
    replay_bytes = 0 if run.replay.log is None else run.replay.log.disk_nbytes(run.replay.capacity)
    if warning := mu.disk_space_warning(run.run_dir, checkpoint_nbytes(run), replay_bytes=replay_bytes):
        print(warning)
    run.probes = probes
    run.snapshots = mu.MemorySnapshots(
        run.run_dir,
        every=args.memory_snapshot_every,
        max_entries=args.snapshot_max_entries,
        device=run.device,
    )
    run.leak_detector = mu.LeakDetector(warmup_steps=step + args.leak_warmup_steps)
    behavior_starts = args.learning_starts + args.warmup_steps
    run.progress = mu.ProgressLine(
        args.total_timesteps, run.device, phase_starts=(args.learning_starts, behavior_starts)
    )
    # a phase's rates start at the env step before its first update (`train` runs before the envs step)
    phase_starts = (args.learning_starts - args.num_envs, behavior_starts - args.num_envs)
    run.status = mu.StatusLine(
        run.writer, "world_model_loss", phase_starts=phase_starts, say=run.progress.say
    )
    run.next_log = (step // args.log_interval + 1) * args.log_interval
    if args.checkpoint_every:
        run.next_checkpoint = (step // args.checkpoint_every + 1) * args.checkpoint_every
    if args.checkpoint_minutes > 0:
        run.next_checkpoint_time = time.time() + 60 * args.checkpoint_minutes
    if every := check_cadence(args, run.device):
        run.next_check = (counters["updates"] // every + 1) * every
    if args.video_every:
        run.next_video = (step // args.video_every + 1) * args.video_every
    run.video_rng = np.random.default_rng([args.seed, step])
    if run.resumed_loop is not None:
        run.video_rng.bit_generator.state = run.resumed_loop["video_rng"]
    run.start_step, run.start_updates = step, counters["updates"]
    run.seconds_before = counters.get("train_seconds", 0.0)  # a checkpoint from before this counter has none


def checkpoint_nbytes(run: Run) -> int:
    """About how large a checkpoint of this run is: the modules, the optimizer state and, with --replay-on-disk, the
    replay's chunk still filling (at most --replay-chunk-steps rows)."""
    modules = {name: module.state_dict() for name, module in run.agent.modules().items()}
    nbytes = mu.estimate_nbytes([modules, [optimizer.state_dict() for optimizer in run.agent.optimizers]])
    if run.replay.log is not None:
        nbytes += run.replay.log.chunk_rows * mu.ReplayLog.row_nbytes(run.replay.log.fields)
    return nbytes


def diagnose(run: Run) -> None:
    """Per loop iteration, all cheap unless asked for: open-loop videos, stage probes, allocator snapshots and the
    live progress line."""
    args, step = run.args, run.step
    if run.next_video is not None and step >= run.next_video and run.counters["updates"] > 0:
        run.next_video = (step // args.video_every + 1) * args.video_every
        try:
            log_open_loop(run)
        except torch.OutOfMemoryError:
            raise  # the loop's OOM handler: a report and a checkpoint, like any other OOM
        except mu.WriteFailed as exc:  # a full disk: the next video tries again
            run.progress.say(f"warning: {exc}; no open-loop GIF this time")
        except Exception as exc:  # noqa: BLE001 - diagnostics never break training
            run.next_video = None
            run.progress.say(f"open-loop video failed ({type(exc).__name__}: {exc}); no more videos this run")
    run.probes.end_iteration(step)
    run.snapshots.maybe_dump(step)
    run.progress.refresh(step, run.sps(), run.last_return)


def log_point(run: Run) -> None:
    """Every --log-interval env steps: charts, the interval's mean losses (its one host sync), memory figures and
    the leak detector's verdict; stops the run (with a checkpoint) after too many non-finite updates in a row, or
    on a leak with --abort-on-leak."""
    args, counters, step = run.args, run.counters, run.step
    run.next_log = (step // args.log_interval + 1) * args.log_interval
    elapsed = max(time.time() - run.start_time, 1e-9)
    sps = (step - run.start_step) / elapsed
    run.writer.flush()  # memory: no TensorBoard record still queued (a GIF's: 0.2-0.7 MB) is read as growth
    # memory: memory_report() collects garbage and trims the heap first, so this is live memory
    run.last_report = mu.memory_report(buffer_stats=replay_stats(run.replay), device=run.device)
    # the interval's one host sync
    interval_means, skipped, longest_skipped_run, nonfinite = run.update_log.pop()
    counters["nonfinite_updates"] += skipped
    scalars = {
        **run.last_report, **reward_quality(interval_means), **interval_means, **run.probes.scalars(),
        "charts/SPS": sps,
        "charts/updates_per_second": (counters["updates"] - run.start_updates) / elapsed,
        "charts/updates": float(counters["updates"]),
        "charts/train_seconds": run.seconds_before + elapsed,
        "debug/nonfinite_updates": float(counters["nonfinite_updates"]),
        "debug/nonfinite_env_steps": float(counters["nonfinite_env_steps"]),
        "debug/restarted_episodes": float(counters.get("restarted_episodes", 0)),  # on resume (`Run.start_envs`)
        "debug/speed/dropped_paths": float(len(counters.get("dropped_fast_paths", {}))),
        # what keeping the replay on disk and writing checkpoints cost this invocation's loop, in seconds
        "debug/io/replay_write_s": 0.0 if run.replay.log is None else run.replay.log.seconds,
        "debug/io/checkpoint_write_s": run.checkpoint_seconds,
    }  # fmt: skip
    for key, value in scalars.items():
        run.writer.add_scalar(key, value, step)
    run.leak_detector.observe(step, run.last_report)
    verdict = run.leak_detector.check()
    last = run.last_verdict
    if verdict.leaking and (last is None or not last.leaking or verdict.cause != last.cause):
        run.progress.say(verdict.diagnosis)
    run.last_verdict = verdict
    run.progress.mark(step)
    run.progress.line(step, sps, run.last_return, run.last_report)
    say_nonfinite(run, skipped, nonfinite)
    # no step with a finite loss and gradient moves a weight to inf, but an edit might: nothing is written from them
    if bad := mu.nonfinite_modules(run.agent.modules()):
        exit_with(f"stopping at step {step}: the weights of {', '.join(bad)} are not finite, so nothing more is "
                  f"trained or written from them; the last checkpoint is kept.", EXIT_NONFINITE)  # fmt: skip
    if longest_skipped_run >= args.max_nonfinite:
        checkpoint(run, "non-finite losses")
        advice = ("" if args.precision == "float32" else "--precision float32 or ") + "lower learning rates"
        sources = nonfinite_sources(nonfinite)
        exit_with(f"stopping: {longest_skipped_run} updates in a row had a non-finite value ({sources}) and each "
                  f"step was skipped, so the checkpoint holds the last finite weights; try {advice}.",
                  EXIT_NONFINITE)  # fmt: skip
    if verdict.abort and args.abort_on_leak:
        checkpoint(run, "leak detected")
        exit_with(f"stopping (--abort-on-leak): {verdict.diagnosis}", EXIT_LEAK)


# the value whose non-finite count names the network whose gradient it is
GRADIENT_OF = {
    "debug/world_model_grad_norm": "the world model's gradient",
    "debug/actor_grad_norm": "the actor's gradient",
    "debug/critic_grad_norm": "the critic's gradient",
}


def nonfinite_sources(nonfinite: dict[str, int]) -> str:
    """What was not finite in skipped updates, from `mu.UpdateLog.pop`'s counts: the loss terms (the world model's
    sum only when no term of it was), then the networks whose gradient was."""
    losses = [key for key in nonfinite if key.startswith("losses/")]
    terms = [key for key in losses if key != "losses/world_model"]
    named = (terms if terms or "losses/world_model" not in losses else losses) + [
        GRADIENT_OF[key] for key in nonfinite if key in GRADIENT_OF
    ]
    others = [key for key in nonfinite if not key.startswith("losses/") and key not in GRADIENT_OF]
    return ", ".join(named + others) or "a loss or a gradient"


def say_nonfinite(run: Run, skipped: int, nonfinite: dict[str, int]) -> None:
    """At a log point: the updates skipped since the last one (a non-finite loss term or gradient), named in full the
    first time, as a count while it recurs; and the env steps cut since (`env_fault` names the first)."""
    counters, said = run.counters, run.said_nonfinite
    if skipped:
        sources = nonfinite_sources(nonfinite)
        if said["updates"] == 0:
            run.progress.say(
                f"updates skipped: {skipped} since the last log point had a non-finite value ({sources}); their steps "
                f"were not taken, so the weights stay finite (later ones: a count per log point)"
            )
        else:
            run.progress.say(
                f"{skipped} more update{'s' * (skipped != 1)} skipped for a non-finite value ({sources}; "
                f"{counters['nonfinite_updates']} in all)"
            )
        said["updates"] = counters["nonfinite_updates"]
    if (cut := counters["nonfinite_env_steps"] - said["env"]) > 0:
        run.progress.say(
            f"{cut} more env step{'s' * (cut != 1)} cut for a non-finite value ({counters['nonfinite_env_steps']} "
            f"in all)"
        )
        said["env"] = counters["nonfinite_env_steps"]


class FiniteSteps(gym.Wrapper):
    """The run's guard of each env step (`make_env`'s `guard`): a step whose reward or observation is not a finite
    number (`mu.nonfinite`) ends its episode there, cut short: the last finite observation back with reward 0,
    truncated, and what it was in info["nonfinite"] ("reward nan"). `EpisodeReplay.add` leaves that step out, and the
    episode's statistics never see it."""

    def reset(self, **kwargs):
        self.last_obs, info = self.env.reset(**kwargs)
        return self.last_obs, info

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        if (fault := mu.nonfinite(reward, obs)) is None:
            self.last_obs = obs
            return obs, reward, terminated, truncated, info
        return self.last_obs, 0.0, False, True, {**info, "nonfinite": fault}


def env_fault(run: Run, env_index: int, fault: str) -> None:
    """An env step whose reward or observation was not finite (`FiniteSteps`), left out of the replay, its episode
    cut there: counted and, the first time, named in one line (later ones at each log point). `--max-nonfinite` such
    steps of one env in a row stop the run (exit 5): nothing to learn from comes out of it."""
    counters, step = run.counters, run.step
    in_a_row, last = run.env_faults.get(env_index, (0, None))
    in_a_row = in_a_row + 1 if last == step - run.args.num_envs else 1
    run.env_faults[env_index] = (in_a_row, step)
    counters["nonfinite_env_steps"] += 1
    if run.said_nonfinite["env"] == 0:
        run.said_nonfinite["env"] = counters["nonfinite_env_steps"]
        run.progress.say(
            f"env {env_index} gave a non-finite {fault} at env step {step}: that step is left out of the replay and "
            f"its episode ends there, stored as truncated (later ones: a count per log point)"
        )
    if in_a_row >= run.args.max_nonfinite:
        checkpoint(run, "non-finite env steps", between_steps=False)
        exit_with(f"stopping: env {env_index} (--env-id {run.args.env_id}) gave a non-finite value at {in_a_row} "
                  f"steps in a row (the last: {fault} at env step {step}); none reached the replay, and the "
                  f"checkpoint holds the last finite weights.", EXIT_NONFINITE)  # fmt: skip


def checkpoint(run: Run, reason: str, required: bool = True, between_steps: bool = True) -> bool:
    """Everything the run needs to go on, written whole or not at all (the last good one stays until this one is
    complete), with the replay's index and its last rows when the replay is on disk; one line says so. One that
    fails to write (a full disk): `required` (the final one, a signal's, an OOM's) ends the run with one sentence and
    EXIT_WRITE_FAILED; otherwise one warning line and the last good one stays. None is written from weights that are
    not finite (one line: the last good one stays). It changes nothing that trains. Returns whether it was written."""
    if bad := mu.nonfinite_modules(run.agent.modules()):
        run.progress.say(f"checkpoint ({reason}) not written: the weights of {', '.join(bad)} are not finite")
        return False
    run.counters["train_seconds"] = run.seconds_before + time.time() - run.start_time
    # the updates since the last log point, so that a resumed run logs their means with the next interval
    counters, start = {**run.counters, "update_log": run.update_log.state()}, time.perf_counter()
    try:
        args = (run.checkpoint_path, run.agent, counters, run.run_name, run.args, run.replay, run.rng)
        save_checkpoint(*args, loop=loop_state(run) if between_steps else None)
    except mu.WriteFailed as exc:
        if not required:
            run.progress.say(f"warning: {exc}; checkpoint ({reason}) not written, the last good one is kept")
            return False
        exit_with(
            f"stopping: {exc}; the run cannot go on without this checkpoint ({reason}).", EXIT_WRITE_FAILED
        )
    run.checkpoint_seconds += (seconds := time.perf_counter() - start)  # this invocation's, `debug/io/*`
    run.progress.say(f"checkpoint ({reason}): {run.checkpoint_path} at step {run.step} ({seconds:.2f} s)")
    return True


def loop_state(run: Run) -> dict | None:
    """What the loop carries from one env step to the next, for a checkpoint (None before the loop starts): obs and
    is_first, the envs' state (`mu.env_state`: None for async envs), the player's, the envs' non-finite steps in a
    row, the last return and the videos' generator: a resumed run trains bit for bit as one never stopped."""
    if run.obs is None:
        return None
    player = {name: getattr(run.player, name).cpu() for name in ("deter", "stoch", "prev_action")}
    # fmt: off
    return {"obs": torch.tensor(run.obs), "is_first": torch.tensor(run.is_first), "envs": mu.env_state(run.envs),
            "player": player, "env_faults": run.env_faults, "last_return": run.last_return,
            "video_rng": run.video_rng.bit_generator.state}
    # fmt: on


def say_replay_short(run: Run) -> None:
    """Once: the updates wait for the replay to hold one sequence."""
    if not run.said_replay_short:
        run.said_replay_short = True
        run.progress.say(
            f"updates wait: the replay holds {run.replay.total_steps} steps, fewer than one sequence of "
            f"{run.args.sequence_length} (--sequence-length)"
        )


def say_status(run: Run) -> None:
    """Every 30 s of wall time (`mu.StatusLine`), however slow an update is: the step, env steps/s, updates/s, the
    ETA to --total-timesteps, the last episode's return and the world model's mean loss since the last status line
    (read from the device sums then: the line's one host transfer), printed and under `status/*` in TensorBoard."""
    args, step, updates = run.args, run.step, run.counters["updates"]
    if run.status.tick(step, updates):
        loss = run.update_log.recent("losses/world_model")
        run.status.emit(step, updates, remaining_steps=args.total_timesteps - step, last_return=run.last_return,
                        loss=loss, progress=f"step {step:,}/{args.total_timesteps:,}")  # fmt: skip


def finish(run: Run) -> None:
    """The end of training: the final checkpoint (--save-model) and the memory probes' verdict."""
    if run.args.save_model:
        checkpoint(run, "end of training")
    if run.args.memory_probes:
        run.progress.say(run.probes.verdict())


def main(args: Args) -> dict:
    """Train (Part 1's `learn`); returns the final counters (global_step, updates, ...) and the run directory. A stop
    signal during the start-up stops it at once (`mu.Stopped`: what it made is removed), later at the loop's top.
    However the run ends, what it opened is closed and its folder's lock let go."""
    stop = mu.StopSignals()
    made = mu.StartUp(new=args.resume is None, parents=("runs", "videos"))
    with stop, contextlib.closing(made):  # signals: recorded, read at the loop's top; in the start-up, raised
        try:
            with stop.at_once():
                # the input checked, the run's folder and logs, the learner, ...
                run = set_up(args, stop, made)
                envs = make_vector_env(args, run.run_name, args.seed, guard=FiniteSteps)
                made.closers.append(envs.close)
        except mu.Stopped as exc:
            exit_with(made.discard(exc.name), exc.exit_code)
        except Exception as exc:  # noqa: BLE001 - a bug, an env that fails to start: one paragraph, exit 8
            made.close()
            log = os.path.join(made.run_dir, "crash.log") if made.run_dir else None
            report = mu.crash_report(exc, __file__, log)
            exit_with(f"crashed during start-up, nothing trained: {report}.", EXIT_CRASHED)
        with guarded(run, envs):  # a signal, an out-of-memory error or a crash leaves a checkpoint
            run.progress.mark(run.step)
            with mu.collect_only_the_loops_garbage():  # memory reports: a collection walks the loop's objects
                learn(run, envs)
                finish(run)
    if stop.received:  # during the final checkpoint: the run is complete, the signal is still said
        exit_with(
            f"stopped by {stop.name} after the last step (the final checkpoint is written)", stop.exit_code
        )
    return {**run.counters, "run_dir": run.run_dir, "run_name": run.run_name}


@contextlib.contextmanager
def guarded(run: Run, envs):
    """The loop's guard: an out-of-memory error gets a report, a checkpoint and exit 3; any other error a checkpoint,
    its traceback in the run's crash.log, one paragraph and exit 8; and whatever happens the snapshots, envs,
    TensorBoard and wandb are closed. While it runs, a status line comes at least every 30 s, also while an update
    outlasts that (`mu.StatusLine.keep_alive`). Stop signals are read at the loop's top (`Run.stop_if_signalled`)."""
    with run.status.keep_alive():
        try:
            yield
        except torch.OutOfMemoryError as exc:
            out_of_memory(run, exc)
        except Exception as exc:  # noqa: BLE001 - an env that crashed, a bug: keep what was trained, then say it
            crashed(run, exc)
        finally:
            closers = [run.snapshots.close, envs.close, run.writer.close]
            if run.args.track and "wandb" in sys.modules:
                closers.append(sys.modules["wandb"].finish)
            for close in closers:
                with contextlib.suppress(Exception):
                    close()


def crashed(run: Run, exc: Exception) -> None:
    """An error in the loop: the checkpoint of where training stands, the traceback in {run_dir}/crash.log, one
    paragraph on stderr saying what raised and where, exit 8 (EXIT_CRASHED)."""
    report = mu.crash_report(exc, __file__, os.path.join(run.run_dir, "crash.log"))
    try:
        kept = "no checkpoint written"
        if checkpoint(run, f"crashed with {type(exc).__name__}", required=False, between_steps=False):
            kept = f"--resume {run.checkpoint_path} goes on from step {run.step}"
    except Exception as save_error:  # noqa: BLE001 - the crash is the one to report
        kept = f"the checkpoint could not be written ({type(save_error).__name__}: {save_error})"
    exit_with(f"crashed at step {run.step}: {report}; {kept}.", EXIT_CRASHED)


def out_of_memory(run: Run, exc: torch.OutOfMemoryError) -> None:
    """Any OOM of the loop (acting, sampling, an update, an open-loop video): a report, a checkpoint, exit 3."""
    oom = mu.out_of_memory(exc, __file__, run.run_dir, last_report=run.last_report, verdict=run.last_verdict,
                           device=run.device, advice=OOM_ADVICE)  # fmt: skip
    checkpoint(run, "out of memory", between_steps=False)
    exit_with(f"out of memory at step {run.step} ({oom.where}):\n{oom.diagnosis}", EXIT_OOM)


if __name__ == "__main__":
    main(tyro.cli(Args))
