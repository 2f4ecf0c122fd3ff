"""Dreamer on Atari: DreamerV3 2023's Atari100k recipe (a world model, and an actor-critic that learns in its
imagination), memory-safe and observable. Run: `python dreamer_atari.py --buffer-capacity 50000`

Three parts. Part 1, the algorithm, in the order it runs: arguments, environment, replay, networks (`MODELS`), the
RSSM, losses and the loop; with every speed option off it is exactly what trains. Part 2, speed: faster equivalents
of Part 1's functions, installed by one call and checked against them. Part 3, the run: input checks, logging,
videos and the ball measure, memory, checkpoints.

The world model (DreamerV3's size-S encoder and decoder on 64x64 colour frames, an RSSM with a LayerNorm GRU, a
learned initial state and 32x32 categorical latents, symlog two-hot reward and continue heads) learns from replayed
sequences of 16 x 64, one update per env step; the actor and critic from 15-step rollouts it imagines. `--model
nature` is a smaller model on 4 stacked 84x84 grey frames, whose shapes the shape comments give.

It logs to TensorBoard in `runs/{run_name}` (wandb with `--track`): `charts/*`, `losses/*`, memory figures and, on
Pong, `world_model/ball_f1_*`. Checkpoints go to `runs/{run_name}/checkpoint.pt`; `--resume PATH` continues a run.
"""

# =====================================================================================================================
# PART 1: THE ALGORITHM
# Dreamer in the order it runs: arguments, environment, replay, networks, the RSSM, losses and the loop. With every
# speed option off this is exactly what trains; Part 2 puts faster equivalents in place, and Part 3 runs it.
# =====================================================================================================================

import contextlib
import copy
import dataclasses
import functools
import itertools
import math
import mmap
import os
import random
import signal
import sys
import time
import types
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Literal

import ale_py
import cv2
import gymnasium as gym
import numpy as np
import psutil
import torch
import torch.nn.functional as F
import tyro
from torch import nn
from torch.utils.tensorboard import SummaryWriter

import memory_utils as mu

gym.register_envs(ale_py)


# A number that changes during a run is changed in place, `agent.settings.set(...)`; `args.x = y` is refused at once
@mu.fixed_once_parsed(
    lambda name: (
        f"schedule it with agent.settings.set({name!r}, value) (see UpdateSettings)"
        if name in SCHEDULED or name in LEARNING_RATES
        else f"it is not one to schedule during a run, so start the run with --{name.replace('_', '-')}"
    )
)
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
    save_model: bool = False
    """whether to write a checkpoint at the end of training"""
    checkpoint_every: int = 0
    """write a checkpoint every this many env steps (0 = only at the end, on signals and on errors)"""
    checkpoint_buffer: bool = False
    """whether checkpoints also hold the replay buffer (large: about 7 KB per stored step)"""
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
    """Atari frames in colour, as DreamerV3 reads them; --no-rgb: grey (a ball that weighs 3.75x less in the image
    loss). --model nature and grey envs (Catch-v0) read grey either way"""

    # replay
    buffer_capacity: int | None = None
    """replay capacity in env steps (12.3 KB per Pong step, 4.1 with --no-rgb). Unset: every step (DreamerV3's)"""
    batch_size: int = 16
    """the number of sequences per world-model batch"""
    sequence_length: int = 64
    """the length of each replayed sequence (DreamerV3: 64); its first step starts from the initial state"""

    # model
    model: Literal["dreamerv3", "nature"] = "dreamerv3"
    """the networks (a row of `MODELS`): dreamerv3, DreamerV3's size S; nature, a smaller NatureCNN model on 4 stacked
    84x84 frames. The size flags below left unset take the model's values"""
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
    """stop (with a checkpoint) when this many updates in a row had a non-finite loss or gradient (each is skipped)"""

    # memory
    amp: Literal["auto", "off", "fp16", "bf16"] = "off"
    """mixed precision: off = float32 (DreamerV3's), bf16, fp16 (CUDA, a loss scaler per optimizer), auto = fp16 on
    CUDA and off on CPU"""
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

    # speed: each flag turns off one faster equivalent of a function above (Part 2); the results stay the same
    fast_observe: bool = True
    """the observe scan in fewer kernels, with the backward of --observe-backward; off: `RSSM.observe` as written"""
    observe_backward: Literal["hand-written", "autograd"] = "hand-written"
    """the fast observe's backward: hand-written (47 operations per step instead of 80) or autograd's"""
    fast_imagine: bool = True
    """imagine without a graph, then the actor once with gradients on all states; off: `imagine` as written"""
    fast_decoder: bool = True
    """CPU, --model nature: the decoder's last transposed convolution as a convolution and a pixel shuffle"""
    compile: bool = False
    """torch.compile the steps an update repeats, the losses and targets, the encoder, decoder and heads (the first
    updates take longer while it compiles)"""
    cudagraph: bool = True
    """CUDA: capture the world-model and behaviour updates in CUDA graphs after 3 eager updates and replay them
    (takes --amp off or bf16)"""
    tf32: bool = True
    """CUDA: float32 matrix products on TensorFloat-32 tensor cores"""
    channels_last: bool = True
    """the encoder's and decoder's convolutions channels-last (NHWC): faster convolutions"""
    replay_frames: Literal["auto", "device", "host"] = "auto"
    """where the replay's frames live: `device` (batches gathered there), `host`, or `auto` (device on CUDA when a
    full replay takes at most a quarter of the GPU's free memory; said at start)"""

    def __post_init__(self):
        # the size flags left unset take the chosen model's values (an unknown --model is check_args' to refuse)
        model = MODELS.get(self.model)
        for name, value in (model.sizes if model else {}).items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)  # frozen from here on
        # colour where the frames have it and the model reads it
        object.__setattr__(
            self, "rgb", self.rgb and model is not None and model.colour and env_has_colour(self.env_id)
        )


# --- Environment ------------------------------------------------------------------------------------------------------


def is_atari(env_id: str) -> bool:
    return "ale_py" in str(gym.spec(env_id).entry_point)


def env_has_colour(env_id: str) -> bool:
    """Whether `env_id` gives colour frames (Atari); False for an id that is not registered (`check_env` refuses
    it)."""
    try:
        return is_atari(env_id)
    except gym.error.Error:
        return False


def env_kwargs(env_id: str, args: Args) -> dict:
    """What `gym.make` gets besides the id: the emulator's settings for Atari, the frame size for Catch-v0."""
    if is_atari(env_id):
        return dict(frameskip=1, repeat_action_probability=args.repeat_action_probability)
    return dict(size=args.image_size) if env_id == CATCH_ID else {}


def make_env(env_id: str, idx: int, capture_video: bool, run_name: str, args: Args) -> Callable[[], gym.Env]:
    """Atari ids get the usual preprocessing (frame skip 4, `--image-size` in colour or grey, no-op starts); other ids must
    give grey uint8 frames of that size themselves (Catch-v0 does). Either way `--frame-stack` frames are stacked."""

    def thunk():
        register_catch()
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
        if args.max_episode_steps > 0:
            env = gym.wrappers.TimeLimit(env, args.max_episode_steps)
        env = gym.wrappers.RecordEpisodeStatistics(env)
        env = gym.wrappers.FrameStackObservation(env, args.frame_stack)  # (4, S, S) uint8 at the defaults
        return env

    return thunk


def channels_first(env: gym.Env) -> gym.Env:
    """Colour frames (S, S, 3) as (3, S, S)."""
    space = env.observation_space
    shape = (space.shape[2], *space.shape[:2])
    return gym.wrappers.TransformObservation(
        env, lambda obs: np.ascontiguousarray(obs.transpose(2, 0, 1)), gym.spaces.Box(0, 255, shape, np.uint8)
    )


def make_vector_env(args: Args, run_name: str, seed: int) -> gym.vector.VectorEnv:
    """SAME_STEP autoreset: a step that ends an episode returns the next episode's first obs and puts the last
    obs in `infos["final_obs"]`, so every transition we store is real (no reward-0 reset step to filter)."""
    fns = [make_env(args.env_id, i, args.capture_video, run_name, args) for i in range(args.num_envs)]
    mode = args.vector_mode if args.vector_mode != "auto" else ("async" if args.num_envs > 1 else "sync")
    autoreset = gym.vector.AutoresetMode.SAME_STEP
    if mode == "async":
        # workers ignore Ctrl-C and SIGTERM (they inherit SIG_IGN): `scancel`, `docker stop` and `timeout` signal
        # the whole process group, and the main process must find its workers alive to checkpoint and close them
        stop_signals = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in stop_signals}
        try:
            envs = gym.vector.AsyncVectorEnv(fns, autoreset_mode=autoreset)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    else:
        envs = gym.vector.SyncVectorEnv(fns, autoreset_mode=autoreset)
    assert isinstance(envs.single_action_space, gym.spaces.Discrete), (
        "only discrete action spaces are supported"
    )
    envs.action_space.seed(seed)
    return envs


# --- Replay: episodes of frames stored once, stacks rebuilt when sampling ---------------------------------------------


class Episode:
    """One episode. Per step: a uint8 frame, the action that led to it, the reward received on arriving (float32),
    is_first and is_terminal. With stacks of k frames, frame j is the newest of step j - (k - 1), step t's stack is
    frames[t : t + k], and the first stack's k - 1 older frames are stored once. Chunks live in memory maps."""

    FIELDS = ("frames", "action", "reward", "is_first", "is_terminal")

    def __init__(self, first_obs: np.ndarray, chunk_size: int, frames=None):
        """`frames`: where the frames go when they live elsewhere (`ChunkedArray`'s methods); host arrays when
        None."""
        stack, *frame_shape = first_obs.shape  # (4, 84, 84) uint8; a colour frame is (3, S, S)
        self.stack = stack
        item = {
            "frames": (tuple(frame_shape), np.uint8),
            "action": ((), np.uint8),
            "reward": ((), np.float32),
        }
        item |= {"is_first": ((), np.bool_), "is_terminal": ((), np.bool_)}
        if frames is not None:
            del item["frames"]
            self.frames = frames
        blocks = ChunkBlocks({name: ((chunk_size, *shape), dtype) for name, (shape, dtype) in item.items()})
        for name, (shape, dtype) in item.items():
            # memory: the arrays hold the blocks, never the episode, so an evicted episode is freed at once
            setattr(self, name, ChunkedArray(shape, dtype, chunk_size, functools.partial(blocks.take, name)))
        self.blocks = blocks
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
    def aux(self) -> tuple["ChunkedArray", ...]:
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
        self.frames.drop_front_chunk()  # frames run k - 1 ahead, so step `start` still has its whole stack
        return dropped

    def arrays(self) -> dict[str, "ChunkedArray"]:
        return {name: getattr(self, name) for name in self.FIELDS}

    def finish(self) -> None:
        self.done = True
        arrays = {name: array for name, array in self.arrays().items() if isinstance(array, ChunkedArray)}
        exact = mapped_arrays({name: ((len(a), *a.item_shape), a.dtype) for name, a in arrays.items()})
        for name, array in arrays.items():
            array.compact(exact[name])
        self.blocks.waiting.clear()  # a chunk the frames began that the episode's end left unused

    def evict(self) -> None:
        """The replay drops this episode: its frames are released (host arrays are freed with the episode)."""
        self.frames.release()


class EpisodeReplay:
    """At most `capacity` env steps; whole oldest episodes are evicted first (an episode that alone outgrows the
    capacity loses its oldest chunk). Episodes still being played are sampleable, and a sequence may cross from one
    stored episode into the next (as DreamerV3's stream), so every stored step is sampled about equally often."""

    def __init__(self, capacity: int, num_envs: int, seed: int, chunk_size: int | None = None):
        self.capacity, self.num_envs = capacity, num_envs
        # memory: chunks bound the unused tail of an episode being written to one chunk per env
        # (64 steps: 0.45 MB, i.e. under 20 bytes per stored step with 2 envs at the default capacity)
        self.chunk_size = chunk_size or int(np.clip(capacity // 64, 16, 64))
        self.episodes: deque[Episode] = deque()  # oldest first
        self.current: list[Episode | None] = [None] * num_envs
        self.total_steps = 0
        self.rng = np.random.default_rng(seed)

    def new_episode(self, env_idx: int, first_obs: np.ndarray) -> Episode:
        return Episode(first_obs, self.chunk_size)

    def start_episode(self, env_idx: int, obs: np.ndarray) -> None:
        # an env reset in the middle of an episode: that episode has ended
        if self.current[env_idx] is not None:
            self.current[env_idx].finish()
        episode = self.new_episode(env_idx, obs)
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

    def draw_windows(
        self, batch_size: int, sequence_length: int, rng: np.random.Generator | None = None
    ) -> list[list[tuple[Episode, int, int]]]:
        """Where `sample` reads: for each window, its pieces (episode, first step, steps). Windows are consecutive
        steps of the stream the stored episodes form, a ring (a window may wrap from the newest step to the oldest),
        so every stored step is drawn equally often whatever the episode lengths. `rng`: the replay's own if None."""
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
                pieces.append((episode, episode.first_step + offset, take))
                left -= take
                index, offset = (index + 1) % len(episodes), 0
            windows.append(pieces)
        return windows

    def sample(
        self,
        batch_size: int,
        sequence_length: int,
        rng: np.random.Generator | None = None,
        out: dict[str, np.ndarray] | None = None,
    ) -> dict[str, np.ndarray]:
        """A batch of windows (`draw_windows`). A window may run from the end of one episode into the next one:
        `is_first` marks where, and the world model resets its state there. Every returned array is a fresh
        copy that owns its memory, or, with `out`, is written into the caller's arrays of the same shapes (pinned
        buffers on CUDA). Pass another `rng` to sample without changing the training batches to come."""
        return self.fill(self.draw_windows(batch_size, sequence_length, rng), sequence_length, "obs", out)

    def fill(
        self, windows: list, sequence_length: int, frames_key: str, out: dict[str, np.ndarray] | None
    ) -> dict[str, np.ndarray]:
        """The arrays of these windows: the frames' stacks as `obs` (copies) or as `rows` (where they are, for frames
        kept on the device), then action, reward, is_first and is_terminal."""
        T, B = sequence_length, len(windows)
        stack, frame_shape = windows[0][0][0].stack, windows[0][0][0].frames.item_shape
        frames_shape = (B, T, stack, *frame_shape) if frames_key == "obs" else (B, T, stack)
        shapes = {frames_key: (frames_shape, np.uint8 if frames_key == "obs" else np.int64)}
        shapes |= {"action": ((B, T), np.uint8), "reward": ((B, T), np.float32)}
        shapes |= {"is_first": ((B, T), np.bool_), "is_terminal": ((B, T), np.bool_)}
        if out is not None:
            for key, (shape, dtype) in shapes.items():
                assert out[key].shape == shape and out[key].dtype == dtype, (key, out[key].shape, shape)
        # memory: a batch is a copy; it never aliases replay storage, so it cannot keep evicted episodes alive
        arrays = (
            out
            if out is not None
            else {key: np.empty(shape, dtype) for key, (shape, dtype) in shapes.items()}
        )
        frames = np.empty((T + stack - 1, *frame_shape), np.uint8)  # one piece's frames, reused
        for b, pieces in enumerate(windows):
            filled = 0
            for episode, begin, take in pieces:
                piece = slice(filled, filled + take)
                # each piece rebuilds its stacks from its own episode's frames: a stack never mixes two episodes
                if frames_key == "rows":
                    arrays["rows"][b, piece] = episode.frames.rows(begin, take, stack)  # (take, k)
                else:
                    obs = arrays["obs"]  # (B, T, 4, 84, 84) uint8
                    episode.frames.read_into(frames[: take + stack - 1], begin, begin + take + stack - 1)
                    for k in range(stack):
                        obs[b, piece, k] = frames[k : k + take]
                for key in ("action", "reward", "is_first", "is_terminal"):
                    getattr(episode, key).read_into(arrays[key][b, piece], begin, begin + take)
                # the state resets where a piece starts, also where an episode's front was trimmed, and at each
                # window's first step (DreamerV3's replay: a sequence starts from the initial state, with no action)
                arrays["is_first"][b, filled] = True
                filled += take
        return arrays


# --- Networks ---------------------------------------------------------------------------------------------------------


def upcast(x: torch.Tensor) -> torch.Tensor:
    """An autocast output (bf16, fp16) back in float32 for the delicate parts (softmaxes, losses, the recurrent
    state); float32 and float64 (the equality tests) stay as they are."""
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


_DRAW_MATRICES: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}


def one_hot_draw(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """One-hot draws (..., C) float32 from `probs` (..., C), one uniform in [0, 1) per row (..., 1): class k where
    CDF(k - 1) < u <= CDF(k), as `Categorical(probs).sample()`, in four kernels and no host sync. The CDF is a product
    with a triangular matrix of ones (a GPU's cumsum is slow), one-hot a product with a difference matrix; the last
    CDF column is doubled, so rounding never leaves a row without a class."""
    if torch.compiler.is_compiling():
        return one_hot_draw_fused(probs, uniform)
    classes, key = probs.shape[-1], (probs.shape[-1], probs.device)
    if key not in _DRAW_MATRICES:
        eye = torch.eye(classes, dtype=torch.float32, device=probs.device)
        cdf = torch.ones_like(eye).triu()
        cdf[:, -1] = 2.0
        diff = eye - eye.roll(1, 1).triu()
        _DRAW_MATRICES[key] = cdf, diff
    cdf_matrix, diff_matrix = _DRAW_MATRICES[key]
    precision = torch.get_float32_matmul_precision()  # the CDF in full float32: TF32 rounds probs to 10 bits
    torch.set_float32_matmul_precision("highest")
    try:
        with torch.autocast(probs.device.type, enabled=False):  # in float32, also under --amp
            above = (probs.float() @ cdf_matrix >= uniform).float()  # 0 up to the drawn class, 1 from it
            return above @ diff_matrix
    finally:
        torch.set_float32_matmul_precision(precision)


def one_hot_draw_fused(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """`one_hot_draw` as --compile runs it: a cumulative sum and a difference, which Inductor fuses with the work
    around them (the eager draw's products would stay matmul kernels). Part 2 checks that both draw alike."""
    with torch.autocast(probs.device.type, enabled=False):
        cdf = probs.float().cumsum(-1)
        cdf = torch.cat([cdf[..., :-1], torch.full_like(cdf[..., -1:], 2.0)], -1)
        above = (cdf >= uniform).float()  # (..., C): 0 up to the drawn class, 1 from it
        return above - F.pad(above[..., :-1], (1, 0))


def categorical_draw(probs: torch.Tensor) -> torch.Tensor:
    """One class index per row of `probs` (..., C) (`one_hot_draw` with fresh uniforms): the actions sent to the
    envs."""
    uniform = torch.rand(probs.shape[:-1] + (1,), device=probs.device)
    return one_hot_draw(probs, uniform).argmax(-1)


def one_hot(index: torch.Tensor, classes: int) -> torch.Tensor:
    """float32 one-hot (..., classes) of integer `index` (...), by comparison with 0..classes-1: two kernels, and
    unlike F.one_hot no check of the range that reads the indices back to the host."""
    return (index.unsqueeze(-1) == torch.arange(classes, device=index.device)).float()


NORM_EPS = 1e-3  # every LayerNorm's epsilon, as DreamerV3's (torch's default is 1e-5)


def mlp(in_dim: int, out_dim: int, hidden_dim: int, zero_output: bool = False) -> nn.Sequential:
    layers = nn.Sequential(
        nn.Linear(in_dim, hidden_dim),
        nn.LayerNorm(hidden_dim, eps=NORM_EPS),
        nn.SiLU(),
        nn.Linear(hidden_dim, hidden_dim),
        nn.LayerNorm(hidden_dim, eps=NORM_EPS),
        nn.SiLU(),
        nn.Linear(hidden_dim, out_dim),
    )
    if zero_output:  # DreamerV3: reward and value heads start predicting 0
        nn.init.zeros_(layers[-1].weight)
        nn.init.zeros_(layers[-1].bias)
        layers[-1].zero_init = True  # decided here, once: `dreamerv3_init_` keeps it at zero
    return layers


MIN_IMAGE_SIZE, MAX_IMAGE_SIZE = 36, 256


def nature_cnn_sizes(image_size: int) -> tuple[int, int, int]:
    """Sides of the NatureCNN's three maps (8x8 stride 4, 4x4 stride 2, 3x3 stride 1): 84 gives 20, 9, 7 and
    64 gives 15, 6, 4."""
    s1 = (image_size - 8) // 4 + 1
    s2 = (s1 - 4) // 2 + 1
    return s1, s2, s2 - 2


class NatureCNNEncoder(nn.Module):
    """(N, 4, S, S) float in [-0.5, 0.5] -> (N, E); S = --image-size, 84 in the shape comments."""

    def __init__(
        self, in_channels: int, channels: tuple[int, int, int], embed_dim: int, image_size: int = 84
    ):
        super().__init__()
        self.embed_dim = embed_dim
        c1, c2, c3 = channels
        side = nature_cnn_sizes(image_size)[2]
        self.net = nn.Sequential(
            nn.Conv2d(in_channels, c1, 8, stride=4),
            nn.ReLU(),  # (N, c1, 20, 20)
            nn.Conv2d(c1, c2, 4, stride=2),
            nn.ReLU(),  # (N, c2, 9, 9)
            nn.Conv2d(c2, c3, 3, stride=1),
            nn.ReLU(),  # (N, c3, 7, 7)
            nn.Flatten(),
            nn.Linear(c3 * side * side, embed_dim),
            nn.ReLU(),
        )

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        return self.net(image)


class AtariConvDecoder(nn.Module):
    """(N, F) latent features -> (N, 4, S, S) image mean; NatureCNN reversed (7 -> 9 -> 20 -> 84 at S = 84).
    `output_padding` restores the rows a strided convolution of the encoder dropped (none at 84; 64 needs one)."""

    def __init__(
        self, feat_dim: int, out_channels: int, base_channels: int, mid_channels: int, image_size: int = 84
    ):
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
    """LayerNorm over the channels of each pixel of an (N, C, H, W) map, as DreamerV3's convolutions use it (on a
    channels-last map both permutes are free)."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm = nn.LayerNorm(channels, eps=NORM_EPS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class ConvEncoder(nn.Module):
    """DreamerV3's encoder: (N, C, S, S) float in [-0.5, 0.5] -> (N, E). Each convolution (4x4, stride 2) halves the
    side and is followed by a LayerNorm over channels and SiLU: 64 -> 32 -> 16 -> 8 -> 4 with four; E is the last
    map flattened (4 x 4 x 256 = 4,096 at the defaults)."""

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
    """DreamerV3's decoder, the encoder mirrored: (N, F) -> a linear layer to the encoder's last map (4 x 4 x 256 at
    the defaults), then 4x4 stride-2 transposed convolutions that double the side, each but the last followed by a
    LayerNorm over channels and SiLU -> (N, C, S, S) image mean."""

    def __init__(self, feat_dim: int, out_channels: int, channels: tuple[int, ...], image_size: int):
        super().__init__()
        self.channels, self.side = channels[-1], image_size >> len(channels)
        self.linear = nn.Linear(feat_dim, self.channels * self.side * self.side)
        widths = channels[::-1]  # (256, 128, 64, 32)
        layers = []
        for previous, current in itertools.pairwise(widths):
            layers += [
                nn.ConvTranspose2d(previous, current, 4, 2, 1, bias=False),
                ChannelNorm(current),
                nn.SiLU(),
            ]
        layers.append(nn.ConvTranspose2d(widths[-1], out_channels, 4, 2, 1))
        self.net = nn.Sequential(*layers)

    def forward(self, feat: torch.Tensor) -> torch.Tensor:
        return self.net(self.linear(feat).unflatten(-1, (self.channels, self.side, self.side)))


class LayerNormGRUCell(nn.Module):
    """DreamerV3's GRU: (input (N, I), state (N, D)) -> state (N, D). One linear layer on [input, state] and a
    LayerNorm give the reset, candidate and update parts; the update gate's bias of -1 makes the state change slowly
    from the start."""

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
    """DreamerV3's initialisation of every linear and convolution weight in `module`: a normal truncated at two
    standard deviations, with variance 1 / the mean of fan-in and fan-out; biases zero. A layer made to start at
    zero (`mlp(..., zero_output=True)`) stays zero."""
    for layer in module.modules():
        if isinstance(layer, (nn.Linear, nn.Conv2d, nn.ConvTranspose2d)):
            weight = layer.weight  # (out, in, ...), or (in, out, ...) transposed: the same sum of fans
            taps = weight[0, 0].numel()  # kernel positions (1 for a linear layer)
            # 0.8796...: the std of a unit normal truncated at two standard deviations
            std = math.sqrt(2.0 / ((weight.shape[0] + weight.shape[1]) * taps)) / 0.87962566103423978
            nn.init.trunc_normal_(layer.weight, 0.0, std, -2 * std, 2 * std)
            # a zero layer is drawn all the same, so that the layers after it get the same draws
            if getattr(layer, "zero_init", False):
                nn.init.zeros_(layer.weight)
            if layer.bias is not None:
                nn.init.zeros_(layer.bias)


@dataclass(frozen=True)
class Model:
    """One --model: the parts its world model is made of, how they start, and the sizes its flags default to."""

    encoder: Callable[
        ..., nn.Module
    ]  # (args, channels, side) -> (N, C, S, S) in [-0.5, 0.5] -> (N, .embed_dim)
    decoder: Callable[..., nn.Module]  # (args, feat_dim, channels, side) -> (N, F) -> (N, C, S, S) image mean
    gru: Callable[
        [int, int], nn.Module
    ]  # (input_dim, deter_dim) -> cell: (input (N, I), state (N, D)) -> (N, D)
    init: (
        Callable[[nn.Module], None] | None
    )  # applied to the world model, actor and critic; None: torch's own
    colour: bool  # reads colour frames where the env has them (--rgb)
    sizes: dict  # the size flags' values when left unset
    size_problem: Callable[
        ["Args"], str | None
    ]  # what about the sizes this model cannot be built with, or None


# ALGO LOGIC: the models; a new one is a row here and its classes above
MODELS = {
    "dreamerv3": Model(
        encoder=lambda args, channels, side: ConvEncoder(channels, args.encoder_channels, side),
        decoder=lambda args, feat_dim, channels, side: ConvDecoder(
            feat_dim, channels, args.encoder_channels, side
        ),
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
        size_problem=lambda args: dreamerv3_size_problem(args),
    ),
    "nature": Model(
        encoder=lambda args, channels, side: NatureCNNEncoder(
            channels, args.encoder_channels, args.embed_dim, side
        ),
        decoder=lambda args, feat_dim, channels, side: AtariConvDecoder(
            feat_dim, channels, args.decoder_base_channels, args.decoder_mid_channels, side
        ),
        gru=nn.GRUCell,
        init=None,
        colour=False,
        sizes=dict(
            image_size=84, frame_stack=4, encoder_channels=(32, 64, 64), deterministic_dim=200, hidden_dim=200
        ),
        size_problem=lambda args: nature_size_problem(args),
    ),
}


# --- The RSSM: one recurrent cell that observing and imagining both use -----------------------------------------------


class RSSM(nn.Module):
    """Recurrent state-space model: `deter` (GRU state) and `stoch`, `stoch_dim` categorical latents of `classes`
    classes (straight-through gradients, `unimix` uniform mixed in) or, with classes 0, DreamerV1's Gaussians. A
    distribution's `stats`: log-probabilities (..., stoch_dim, classes), or mean and std (..., 2 * stoch_dim)."""

    def __init__(
        self,
        embed_dim: int,
        num_actions: int,
        deter_dim: int,
        stoch_dim: int,
        classes: int,
        hidden_dim: int,
        unimix: float,
        gru: Callable[[int, int], nn.Module] = nn.GRUCell,
        learned_initial: bool = False,
    ):
        super().__init__()
        self.deter_dim, self.stoch_dim, self.classes, self.unimix = deter_dim, stoch_dim, classes, unimix
        self.stoch_flat = stoch_dim * classes if classes else stoch_dim
        stats_dim = stoch_dim * classes if classes else 2 * stoch_dim
        self.img_in = nn.Sequential(
            nn.Linear(self.stoch_flat + num_actions, hidden_dim),
            nn.LayerNorm(hidden_dim, eps=NORM_EPS),
            nn.SiLU(),
        )
        self.gru = gru(hidden_dim, deter_dim)  # (input (N, H), deter (N, D)) -> deter (N, D)
        self.prior_net = nn.Sequential(
            nn.Linear(deter_dim, hidden_dim),
            nn.LayerNorm(hidden_dim, eps=NORM_EPS),
            nn.SiLU(),
            nn.Linear(hidden_dim, stats_dim),
        )
        self.posterior_net = nn.Sequential(
            nn.Linear(deter_dim + embed_dim, hidden_dim),
            nn.LayerNorm(hidden_dim, eps=NORM_EPS),
            nn.SiLU(),
            nn.Linear(hidden_dim, stats_dim),
        )
        # DreamerV3's learned initial state: deter = tanh(initial_deter), zeros at first (None: the zero state)
        self.initial_deter = nn.Parameter(torch.zeros(deter_dim)) if learned_initial else None

    def initial(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The state an episode starts from, deter (n, D) and stoch (n, S). Learned (DreamerV3): deter = tanh(w),
        which the loss trains through every episode start, and stoch the prior's mode from it (no gradient through
        the mode, as DreamerV3's); or zeros."""
        weight = self.prior_net[0].weight  # float32 (also under autocast), float64 in the equality tests
        if self.initial_deter is None:
            zeros = functools.partial(torch.zeros, device=weight.device, dtype=weight.dtype)
            return zeros(n, self.deter_dim), zeros(n, self.stoch_flat)
        deter = torch.tanh(self.initial_deter).unsqueeze(0)  # (1, D)
        with torch.no_grad():
            stoch = self.mode(self.prior(deter)).to(deter.dtype)  # (1, S)
        return deter.expand(n, -1), stoch.expand(n, -1)

    def episode_start(
        self, first: torch.Tensor, deter, stoch, initial: tuple
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The previous state a step reads: deter (B, D) and stoch (B, S) as they are, or the `initial` state
        (`initial(1)`) where `first` (B, 1) bool says an episode starts (also the previous action: zero there)."""
        return torch.where(first, initial[0], deter), torch.where(first, initial[1], stoch)

    def _stats(self, raw: torch.Tensor) -> torch.Tensor:
        raw = upcast(raw)
        if self.classes:
            probs = F.softmax(raw.unflatten(-1, (self.stoch_dim, self.classes)), -1)
            probs = (1 - self.unimix) * probs + self.unimix / self.classes
            return probs.log()
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
        """The random numbers `sample` turns into latents, for `shape` samples: uniforms (*shape, stoch_dim, 1) for
        categorical latents, normals (*shape, stoch_dim) for Gaussian ones. A sequence draws them all in one call."""
        if self.classes:
            return torch.rand(*shape, self.stoch_dim, 1, device=device)
        return torch.randn(*shape, self.stoch_dim, device=device)

    def sample(self, stats: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
        """A flat latent sample (..., stoch_flat) with gradients (straight-through or reparameterised), from `noise`
        (see `noise`; fresh when None)."""
        if self.classes:
            probs = stats.exp()
            noise = torch.rand(stats.shape[:-1] + (1,), device=stats.device) if noise is None else noise
            one_hot = one_hot_draw(probs, noise).to(probs.dtype)
            if torch.is_grad_enabled():  # straight-through: the one-hot's value, the probabilities' gradient
                one_hot = one_hot + probs - probs.detach()
            return one_hot.flatten(-2)
        mean, std = stats.chunk(2, -1)
        return mean + std * (torch.randn_like(std) if noise is None else noise)

    def mode(self, stats: torch.Tensor) -> torch.Tensor:
        """The most likely latent (..., stoch_flat), without gradients: each categorical's most likely class one-hot,
        or the Gaussian's mean."""
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
        """Posterior rollout over a sequence, one step at a time through the cell (`img_step`, `posterior`, `sample`),
        the state reset to the initial one where an episode starts. embed (B, T, E); action (B, T, A) one-hot, the
        action that led to step t; is_first (B, T); noise (T, B, ...) each step's sampling noise (drawn when None).
        Returns deter (B, T, D), stoch (B, T, S), posterior and prior stats (B, T, ...)."""
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
        self.rssm = RSSM(
            self.embed_dim,
            num_actions,
            args.deterministic_dim,
            args.stochastic_dim,
            args.stochastic_classes,
            args.hidden_dim,
            args.unimix,
            gru=model.gru,
            learned_initial=args.initial_state == "learned",
        )
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
        probs = F.softmax(upcast(self.net(feat)), -1)
        return (1 - self.unimix) * probs + self.unimix / probs.shape[-1]


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


# ALGO LOGIC: the numbers a researcher may schedule during a run (`agent.settings.set`); the update reads them from
# `agent.settings`, never from `args`
SCHEDULED = (
    "kl_dyn_scale",
    "kl_rep_scale",
    "free_nats",
    "entropy_coef",
    "gamma",
    "return_lambda",
    "return_norm_decay",
    "slow_critic_fraction",
    "world_model_grad_clip",
    "actor_critic_grad_clip",
)


LEARNING_RATES = {"world_model_lr": "world_model", "actor_lr": "actor", "critic_lr": "critic"}


# numbers the update reads that follow from a scheduled one: (the one, how)
DERIVED_SETTINGS = {
    "return_norm_rate": ("return_norm_decay", lambda x: 1 - x),
    "one_minus_lambda": ("return_lambda", lambda x: 1 - x),
}


class UpdateSettings:
    """The scheduled numbers (`SCHEDULED`, `values`) and the learning rates (each its optimizer's own), as the update
    reads them (`settings["name"]`, the derived ones included), changed from the loop with `set`:
    `run.agent.settings.set("kl_dyn_scale", 0.3)`. (Part 2 keeps them as tensors changed in place.)"""

    def __init__(self, args: Args, optimizers: dict[str, torch.optim.Optimizer]):
        self.values = {name: float(getattr(args, name)) for name in (*SCHEDULED, *LEARNING_RATES)}
        self.optimizers = optimizers

    def __getitem__(self, name: str):
        if name in DERIVED_SETTINGS:
            source, derive = DERIVED_SETTINGS[name]
            return derive(self.values[source])
        if name in LEARNING_RATES:
            return self.optimizers[LEARNING_RATES[name]].param_groups[0]["lr"]
        return self.values[name]

    def set(self, name: str, value: float) -> None:
        if name not in self.values:
            raise KeyError(f"{name!r} is not a scheduled setting; these are: {', '.join(self.values)}")
        self.values[name] = float(value)
        if name in LEARNING_RATES:
            self.optimizers[LEARNING_RATES[name]].param_groups[0]["lr"] = float(value)


@dataclass
class Agent:
    """Everything that learns: the networks, their optimizers, one loss scaler per optimizer (fp16 only; a scaler
    that is not enabled passes everything through), and the autocast setup."""

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
    settings: UpdateSettings
    # ALGO LOGIC: the functions an update calls: this part's own (`build_agent`), until the run's set-up puts faster
    # equivalents in their place (Part 2: the same arguments and results, held to these by checks)
    observe: Callable  # `RSSM.observe` of the world model's RSSM
    imagine: Callable  # `imagine`
    world_model_losses: Callable  # `world_model_losses`
    imagined_targets: Callable  # `imagined_targets`

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        return list(self.named_optimizers().values())

    def named_optimizers(self) -> dict[str, torch.optim.Optimizer]:
        return {name: getattr(self, f"{name}_optimizer") for name in ("world_model", "actor", "critic")}

    def modules(self) -> dict[str, nn.Module]:
        return {
            name: getattr(self, name)
            for name in ("world_model", "actor", "critic", "slow_critic", "return_norm")
        }


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
    amp = mu.amp(args.amp, device)
    # a CUDA graph (--cudagraph) needs capturable Adam
    adam = {"fused": True, "capturable": args.cudagraph and device.type == "cuda"}
    # fused Adam: one kernel per step, and it can skip a step on the device (see `clip_and_step`)
    optimizers = {
        name: torch.optim.Adam(
            module.parameters(), lr=getattr(args, f"{name}_lr"), eps=getattr(args, f"{name}_eps"), **adam
        )
        for name, module in (("world_model", world_model), ("actor", actor), ("critic", critic))
    }
    return Agent(
        world_model=world_model,
        actor=actor,
        critic=critic,
        slow_critic=slow_critic,
        return_norm=ReturnNormalizer().to(device),
        world_model_optimizer=optimizers["world_model"],
        actor_optimizer=optimizers["actor"],
        critic_optimizer=optimizers["critic"],
        amp=amp,
        # one scaler per optimizer: an overflow in one loss shrinks that loss's scale alone
        scalers={name: amp.new_scaler() for name in ("world_model", "actor", "critic")},
        device=device,
        num_actions=num_actions,
        settings=UpdateSettings(args, optimizers),
        observe=world_model.rssm.observe,
        imagine=imagine,
        world_model_losses=world_model_losses,
        imagined_targets=imagined_targets,
    )


class Player:
    """Acts in the vector env: keeps each env's latent state across steps, always detached, in tensors updated in
    place (the same memory from the first step to the last, which a CUDA graph's replay needs)."""

    def __init__(self, agent: Agent, num_envs: int):
        self.agent, self.num_envs = agent, num_envs
        self.deter: torch.Tensor | None = None
        self.reset()
        self.policy = self.policy_step  # what `act` calls (Part 2 may capture it in a CUDA graph)

    @torch.no_grad()  # memory: the cached state never carries a graph
    def reset(self) -> None:
        device, rssm = self.agent.device, self.agent.world_model.rssm
        # (N, D), (N, S): tensors of their own
        deter, stoch = (x.clone() for x in rssm.initial(self.num_envs))
        prev_action = torch.zeros(self.num_envs, self.agent.num_actions, device=device)  # (N, A) one-hot
        if self.deter is None:
            self.deter, self.stoch, self.prev_action = deter, stoch, prev_action
        else:  # in place: a captured policy step reads and writes these very tensors
            self.deter.copy_(deter), self.stoch.copy_(stoch), self.prev_action.copy_(prev_action)

    # memory: acting builds no graph; otherwise each step's graph stays reachable from the cached state
    @torch.no_grad()
    def policy_step(self, inputs: dict[str, torch.Tensor]) -> tuple[torch.Tensor]:
        """obs (N, 4, 84, 84) uint8 and is_first (N,) bool on the device -> actions (N,) int64 on the device; the
        cached state moves on. No host read and no Python branch on a tensor, so it can be captured."""
        wm = self.agent.world_model
        with self.agent.amp.autocast():
            # (N, 4, 84, 84); a colour stack's frames and channels together
            image = inputs["obs"].flatten(1, -3).float() / 255.0 - 0.5
            first = inputs["is_first"].unsqueeze(-1)  # (N, 1) bool
            deter, stoch = wm.rssm.episode_start(first, self.deter, self.stoch, wm.rssm.initial(1))
            deter = wm.rssm.img_step(deter, stoch, self.prev_action * (~first).float())
            stoch = wm.rssm.sample(wm.rssm.posterior(deter, wm.encoder(image)))
            action = categorical_draw(self.agent.actor(torch.cat([deter, stoch], -1)))  # (N,)
        # memory: the cached state is written under no_grad, so it can never carry a graph into the next step
        self.deter.copy_(deter), self.stoch.copy_(stoch)
        self.prev_action.copy_(one_hot(action, self.agent.num_actions))
        return (action,)

    def act(self, obs: np.ndarray, is_first: np.ndarray) -> np.ndarray:
        """obs (N, 4, 84, 84) uint8, is_first (N,) bool -> actions (N,) int64."""
        device = self.agent.device
        inputs = {
            "obs": torch.as_tensor(obs, device=device),
            "is_first": torch.as_tensor(is_first, device=device),
        }
        (action,) = self.policy(inputs)
        return action.cpu().numpy()


# --- Losses and updates: plain functions of tensors; each update returns its logged values as device tensors ---


def lambda_returns(
    reward: torch.Tensor,
    value: torch.Tensor,
    discount: torch.Tensor,
    lambda_: torch.Tensor | float,
    one_minus_lambda: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """R_t = r_{t+1} + d_{t+1} ((1 - lambda) v_{t+1} + lambda R_{t+1}), R_H = v_H. reward, value, discount: (H+1, N)
    for imagined states s_0..s_H (those received on arriving at s_k); returns (H, N) for s_0..s_{H-1}. The loop is one
    fused multiply-add per step. `one_minus_lambda`: 1 - lambda computed in double (`UpdateSettings`)."""
    if one_minus_lambda is None:
        one_minus_lambda = 1 - lambda_
    base = reward[1:] + discount[1:] * one_minus_lambda * value[1:]  # (H, N)
    factor = discount[1:] * lambda_  # (H, N)
    returns = [value[-1]]
    for base_t, factor_t in zip(reversed(base.unbind(0)), reversed(factor.unbind(0))):
        returns.append(torch.addcmul(base_t, factor_t, returns[-1]))
    return torch.stack(returns[1:][::-1])


def batch_tensors(batch: dict[str, np.ndarray], device) -> dict[str, torch.Tensor]:
    """The sampled arrays as tensors on `device`, still uint8 and bool."""
    # memory: observations cross to the device as uint8 (a quarter of float32); floats exist only there
    return {key: torch.from_numpy(value).to(device) for key, value in batch.items()}


def prepare_batch(
    raw: dict[str, torch.Tensor], num_actions: int, channels_last: bool = False
) -> dict[str, torch.Tensor]:
    """The conversions a raw batch needs, made on the device: images to float, actions to one-hot. `channels_last`
    lays the images out as channels-last convolutions read them (no layout copy of the batch, no strided loss)."""
    obs = raw["obs"]  # (B, T, 4, 84, 84) uint8; in colour (B, T, stack, 3, S, S)
    obs = obs.flatten(2, -3)  # (B, T, C, S, S): a colour stack's frames and channels together
    layout = torch.channels_last if channels_last else torch.contiguous_format
    image = obs.flatten(0, 1).to(torch.float32, memory_format=layout).div_(255.0).sub_(0.5)
    image = image.unflatten(0, obs.shape[:2])
    return {
        "image": image,  # (B, T, 4, 84, 84) in [-0.5, 0.5]
        "action": one_hot(raw["action"], num_actions),  # (B, T, A)
        "reward": raw["reward"],  # (B, T)
        "is_first": raw["is_first"],  # (B, T) bool
        "is_terminal": raw["is_terminal"],  # (B, T) bool
    }


def world_model_loss(agent: Agent, data: dict[str, torch.Tensor], args: Args):
    """Returns (loss, parts: the logged values as named tensors, posterior (deter, stoch) (B, T, ...))."""
    wm = agent.world_model
    image = data["image"]
    B, T = image.shape[:2]
    embed = wm.encoder(image.flatten(0, 1)).unflatten(0, (B, T))  # (B, T, E)
    deter, stoch, posterior, prior = agent.observe(embed, data["action"], data["is_first"])
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


def world_model_losses(
    wm: "WorldModel",
    settings: "UpdateSettings",
    data: dict[str, torch.Tensor],
    deter,
    stoch,
    posterior,
    prior,
    args,
):
    """`world_model_loss` from the posterior rollout on: the named losses (reconstruction, reward, continue, KL),
    summed against `loss_scales`. Returns (loss, parts: the logged values)."""
    image = data["image"]
    B, T = image.shape[:2]
    feat = torch.cat([deter, stoch], -1)  # (B, T, D + S)
    reconstruction = wm.decoder(feat.flatten(0, 1)).unflatten(0, (B, T))  # (B, T, 4, 84, 84)
    # squared error summed over each image, averaged over images (one fused kernel each way)
    image_loss = F.mse_loss(upcast(reconstruction), image, reduction="sum") / (B * T)
    reward_logits = wm.reward_head(feat)  # (B, T, K)
    reward_loss = twohot_loss(reward_logits, data["reward"], wm.bins).mean()
    continue_logits = upcast(wm.continue_head(feat).squeeze(-1))  # (B, T)
    continue_loss = F.binary_cross_entropy_with_logits(
        continue_logits, (~data["is_terminal"]).to(continue_logits.dtype)
    )
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
    terms = [
        value if scales[name] == 1 else scales[name] * value for name, value in losses.items() if scales[name]
    ]
    loss = functools.reduce(torch.add, terms)
    parts = {
        "losses/world_model": loss,
        **{f"losses/{name}": value for name, value in losses.items()},
        "debug/kl_value": dyn.mean(),
        **reward_prediction_counts(twohot_mean(reward_logits.detach(), wm.bins), data["reward"]),
    }
    return loss, parts


def clip_and_step(
    optimizer: torch.optim.Optimizer,
    scaler: torch.amp.GradScaler,
    parameters: list[torch.Tensor],
    clip: torch.Tensor,
    loss_finite: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """After the backward pass: unscale (fp16), clip to the norm `clip` (a 0-d tensor), and step unless the loss or
    the gradient is non-finite, skipped on the device through the `found_inf` tensor fused Adam reads (as GradScaler
    does; no host sync), so weights and moments stay as they were. fp16's scaler skips overflows itself. Returns
    (grad_norm, healthy), 0-d tensors; `healthy` is False for a step skipped as a fault."""
    scaler.unscale_(optimizer)
    grads = [p.grad for p in parameters if p.grad is not None]
    grad_norm = torch.nn.utils.get_total_norm(grads, foreach=True)
    # torch's clip_grad_norm_ turns its max_norm into a float, which a captured graph would keep: the same
    # arithmetic (reciprocal, then the clip), with the clip as a tensor
    torch._foreach_mul_(grads, torch.clamp((grad_norm + 1e-6).reciprocal() * clip, max=1.0))
    if scaler.is_enabled():
        scaler.step(optimizer)
        scaler.update()
        return grad_norm, loss_finite
    healthy = loss_finite & torch.isfinite(grad_norm)
    optimizer.grad_scale, optimizer.found_inf = None, (~healthy).float()
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale, optimizer.found_inf
    return grad_norm, healthy


def train_world_model(agent: Agent, raw: dict[str, torch.Tensor], args: Args):
    """One world-model update on a raw batch on the device, without host synchronisation. Returns the logged values
    (detached 0-d float32 tensors), healthy (0-d bool: False when a non-finite loss or gradient skipped the step) and
    the posterior states to imagine from, detached: {"deter": (B*T, D), "stoch": (B*T, S), "continue": (B*T,)}."""
    data = prepare_batch(raw, agent.num_actions, args.channels_last)
    with agent.amp.autocast():
        loss, parts, (deter, stoch) = world_model_loss(agent, data, args)
    optimizer, scaler = agent.world_model_optimizer, agent.scalers["world_model"]
    optimizer.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    metrics = {key: value.detach().float() for key, value in parts.items()}
    grad_norm, healthy = clip_and_step(
        optimizer,
        scaler,
        list(agent.world_model.parameters()),
        agent.settings["world_model_grad_clip"],
        torch.isfinite(torch.stack(list(metrics.values()))).all(),
    )
    optimizer.zero_grad(set_to_none=True)  # memory: gradients are not kept between updates
    metrics["debug/world_model_grad_norm"] = grad_norm.detach().float()
    start = {
        "deter": deter.detach().flatten(0, 1),
        "stoch": stoch.detach().flatten(0, 1),
        "continue": (~data["is_terminal"]).float().flatten(0, 1),
    }
    return metrics, healthy, start


def imagine(agent: Agent, start_states, horizon: int):
    """Roll the prior forward `horizon` steps with the actor from (N, ...) start states (deter, stoch, continue): the
    actor picks an action (with gradients, for REINFORCE), the cell moves on (`img_step`), the prior's sample is the
    next stoch. Returns feat (H+1, N, F) detached, log_prob (H, N), entropy (H, N)."""
    deter, stoch, _ = start_states
    rssm = agent.world_model.rssm
    action_uniforms = torch.rand(horizon, deter.shape[0], 1, device=deter.device)  # (H, N, 1)
    latent_noise = rssm.noise((horizon, deter.shape[0]), deter.device)  # (H, N, ...)
    feats, log_probs, entropies = [], [], []
    for t in range(horizon):
        feat = torch.cat([deter, stoch], -1)
        probs = agent.actor(feat)
        action = one_hot_draw(probs.detach(), action_uniforms[t]).to(probs.dtype)
        log_probs.append((probs.log() * action).sum(-1))
        entropies.append(-(probs * probs.log()).sum(-1))
        feats.append(feat)
        with torch.no_grad():
            deter = rssm.img_step(deter, stoch, action)
            stoch = rssm.sample(rssm.prior(deter), latent_noise[t])
    feats.append(torch.cat([deter, stoch], -1))
    return torch.stack(feats).detach(), torch.stack(log_probs), torch.stack(entropies)


def behavior_losses(agent: Agent, start_states, args: Args, update_norm: bool = True):
    """Actor and critic losses on an imagined rollout. Returns (actor_loss, critic_loss, parts)."""
    # (H+1, N, F), (H, N)
    feat, log_prob, entropy = agent.imagine(agent, start_states, args.imagination_horizon)
    # one critic pass gives both the values the targets bootstrap from (detached) and the logits its loss trains
    critic_logits = agent.critic(feat)  # (H+1, N, K)
    with torch.no_grad():
        returns, weight, advantage, slow_value = agent.imagined_targets(
            agent, feat, critic_logits, start_states[2], args, update_norm
        )
    settings = agent.settings
    # ALGO LOGIC: REINFORCE on normalised advantages + entropy; the critic is pulled toward the slow critic
    actor_loss = -(weight * (log_prob * advantage + settings["entropy_coef"] * entropy)).mean()
    critic_loss = (
        weight
        * (
            twohot_loss(critic_logits[:-1], returns, agent.critic.bins)
            + twohot_loss(critic_logits[:-1], slow_value, agent.critic.bins)
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


def imagined_targets(
    agent: Agent, feat, critic_logits, start_continue, args: Args, update_norm: bool
) -> tuple:
    """What the actor and critic learn toward on an imagined rollout, without gradients: feat (H+1, N, F) and the
    critic's logits (H+1, N, K) in. Returns lambda-returns, the discount weights, the normalised advantages and the
    slow critic's values, (H, N) each."""
    wm, settings = agent.world_model, agent.settings
    reward = twohot_mean(wm.reward_head(feat), wm.bins)  # (H+1, N)
    continues = torch.sigmoid(upcast(wm.continue_head(feat).squeeze(-1)))  # (H+1, N)
    if args.continue_mode:  # DreamerV3: an imagined state either goes on or ends
        continues = (continues > 0.5).to(continues.dtype)
    continues[0] = start_continue  # the start state's own continue flag is known
    discount = settings["gamma"] * continues
    value = twohot_mean(critic_logits.detach(), agent.critic.bins)  # (H+1, N)
    slow_value = agent.slow_critic.value(feat[:-1])  # (H, N): the critic regresses states s_0..s_{H-1}
    returns = lambda_returns(
        reward, value, discount, settings["return_lambda"], settings["one_minus_lambda"]
    )  # (H, N)
    # DreamerV3's weights: w_t = prod_{k <= t} (gamma c_k) / gamma, so w_0 = c_0 (0 from a terminal start) and
    # a state's own continue flag counts (the action chosen in a terminal state matters to nothing)
    weight = torch.cumprod(discount[:-1], 0) / settings["gamma"]  # (H, N)
    if update_norm:
        agent.return_norm.update(returns, settings["return_norm_rate"])
    advantage = (returns - value[:-1]) / agent.return_norm.scale()
    return returns, weight, advantage, slow_value


def train_behavior(agent: Agent, start: dict[str, torch.Tensor], args: Args):
    """One actor and one critic update on rollouts imagined from `start`, then the slow critic follows the critic;
    no host sync. Returns the logged values (detached 0-d float32 tensors) and healthy (0-d bool)."""
    with agent.amp.autocast():
        actor_loss, critic_loss, parts = behavior_losses(
            agent, (start["deter"], start["stoch"], start["continue"]), args
        )
    scalers = agent.scalers
    for optimizer in (agent.actor_optimizer, agent.critic_optimizer):
        optimizer.zero_grad(set_to_none=True)
    # one backward pass for both: they share no parameters (the features are detached, the critic's targets and the
    # actor's advantages are computed without gradients), so each gets exactly its own loss's gradient
    (scalers["actor"].scale(actor_loss) + scalers["critic"].scale(critic_loss)).backward()
    metrics = {key: value.detach().float() for key, value in parts.items()}
    actor_norm, actor_healthy = clip_and_step(
        agent.actor_optimizer,
        scalers["actor"],
        list(agent.actor.parameters()),
        agent.settings["actor_critic_grad_clip"],
        torch.isfinite(actor_loss.detach()),
    )
    critic_norm, critic_healthy = clip_and_step(
        agent.critic_optimizer,
        scalers["critic"],
        list(agent.critic.parameters()),
        agent.settings["actor_critic_grad_clip"],
        torch.isfinite(critic_loss.detach()),
    )
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


def step_envs(run: "Run", envs, actions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
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
    counters["global_step"] += args.num_envs
    return next_obs, np.logical_or(terminations, truncations)


def sample_batch(run: "Run") -> dict[str, torch.Tensor]:
    """One training batch on the device, still uint8 and bool (`train_world_model` converts it there)."""
    return batch_tensors(run.replay.sample(run.args.batch_size, run.args.sequence_length), run.device)


def train(run: "Run") -> None:
    """The updates this env step owes at --train-ratio, one batch at a time (never sampled all at once to "catch
    up"): a world-model update, then (once behaviour learning has started) an actor-critic update from its states."""
    args, counters, replay = run.args, run.counters, run.replay
    step = counters["global_step"] + args.num_envs  # the env step they go with (it runs while they do)
    if step < args.learning_starts:
        return
    if not replay.can_sample(args.sequence_length):
        say_replay_short(run)
        return
    counters["updates_owed"] += args.num_envs * args.train_ratio / (args.batch_size * args.sequence_length)
    while counters["updates_owed"] >= 1.0:
        counters["updates_owed"] -= 1.0
        raw = run.sample_batch(run)
        run.probes("after_sample")
        metrics, healthy, start = run.world_model_step(raw)
        run.update_log.add(metrics, healthy)
        if step >= args.learning_starts + args.warmup_steps:
            behavior_metrics, behavior_healthy = run.behavior_step(start)
            run.update_log.add(behavior_metrics, behavior_healthy)
            healthy = healthy & behavior_healthy
            counters["behavior_updates"] += 1
        run.update_log.end_update(healthy)
        counters["updates"] += 1


def main(args: Args) -> dict:
    """Train; returns the final counters (global_step, updates, ...) and the run directory."""
    # TRY NOT TO MODIFY: the run (Part 3): the input checked, its folder and logs, the agent, the replay, the update
    # steps (with Part 2's faster equivalents in place), a resumed run's state, and what watches its memory
    run = set_up(args)
    envs = make_vector_env(args, run.run_name, args.seed)
    # TRY NOT TO MODIFY: a signal, an out-of-memory error or a crash leaves a checkpoint (Part 3)
    with guarded(run, envs):
        run.progress.mark(run.step)
        obs, _ = envs.reset(seed=args.seed + run.step)
        for i in range(args.num_envs):
            run.replay.start_episode(i, obs[i])
        is_first = np.ones(args.num_envs, np.bool_)
        while run.step < args.total_timesteps:
            run.probes("loop_start")
            stop_if_signalled(run)
            # ALGO LOGIC: act: random until learning starts, then the policy (which waits for the updates queued
            # before it on a GPU and reads the actions back: the loop's one sync per env step)
            if run.step < args.learning_starts:
                actions = run.rng.integers(run.agent.num_actions, size=args.num_envs)
            else:
                actions = run.player.act(obs, is_first)
            # ALGO LOGIC: the updates owed so far, queued first: on a GPU they run while the envs step (the newest
            # step joins the replay after them). A schedule goes here: `run.agent.settings.set(name, value)`
            train(run)
            obs, is_first = step_envs(run, envs, actions)
            run.probes("after_collect")
            watch(run)  # videos, log points, checkpoints (Part 3)
        finish(run)
    return {**run.counters, "run_dir": run.run_dir, "run_name": run.run_name}


# =====================================================================================================================
# PART 2: SPEED
# Faster equivalents of Part 1's functions, installed by one call (`install_speed`, from the run's set-up) as
# wrappers and replacements, never inside Part 1; each flag turns one off, and the checks at the end hold each to
# the Part 1 function it replaces on the weights the run is using.
# =====================================================================================================================


class SubpixelTransposedConv(nn.ConvTranspose2d):
    """--fast-decoder (CPU, --model nature): the decoder's last layer, the same parameters, computed by
    `transposed_conv_as_subpixel`. torch's CPU transposed convolution is slow there: as a convolution and a pixel
    shuffle it takes half the time (fwd + bwd at batch 8 x 16: 25 -> 13 ms with one frame, 54 -> 34 ms with four)."""

    @classmethod
    def sharing(cls, layer: nn.ConvTranspose2d) -> "SubpixelTransposedConv":
        """A layer of this kind holding `layer`'s own parameters (the optimizer's and the checkpoint's)."""
        shared = cls.__new__(cls)
        shared.__dict__.update(layer.__dict__)
        shared._parameters = dict(layer._parameters)
        return shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return transposed_conv_as_subpixel(x, self)


def transposed_conv_as_subpixel(x: torch.Tensor, layer: nn.ConvTranspose2d) -> torch.Tensor:
    """`layer(x)` for a transposed convolution whose kernel is twice its stride s (the decoder's last layer: 8x8,
    stride 4), computed as a 2x2 convolution to s * s maps per output channel, one map per output phase, which
    `pixel_shuffle` interleaves. The same weights and the same sums: output pixel (s*q + r) takes tap r of input
    q and tap s + r of input q - 1, so tap (a*s + r) of `layer` is tap (1 - a) of phase r's 2x2 kernel.
    (N, in, H, W) -> (N, out, (H - 1) s + 2s + output_padding, ...)."""
    s = layer.stride[0]
    cin, cout = layer.weight.shape[:2]  # (in, out, 2s, 2s)
    # (in, out, a, r, b, r') -> (out, r, r', in, 1 - a, 1 - b): phase maps in pixel_shuffle's channel order
    weight = layer.weight.unflatten(2, (2, s)).unflatten(4, (2, s)).flip(2, 4)
    weight = weight.permute(1, 3, 5, 0, 2, 4).reshape(cout * s * s, cin, 2, 2)
    out = F.pixel_shuffle(F.conv2d(x, weight, padding=1), s)  # (N, out, (H + 1) s, (W + 1) s)
    pad_h, pad_w = layer.output_padding  # rows and columns no input reaches: the bias alone
    if pad_h or pad_w:
        out = F.pad(out, (0, pad_w, 0, pad_h))
    return out + layer.bias.view(1, -1, 1, 1)


# --- The fast observe: the RSSM's loop in fewer kernels, and its hand-written backward pass ---------------------------


def silu_derivative(x: torch.Tensor) -> torch.Tensor:
    """d silu(x) / dx = sigmoid(x) (1 + x (1 - sigmoid(x)))."""
    sigmoid = torch.sigmoid(x)
    return sigmoid * (1 + x * (1 - sigmoid))


def layer_norm_stats(x: torch.Tensor, norm: nn.LayerNorm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`norm(x)` (..., N), with the mean and 1 / std (..., 1) of each row that its backward pass reads."""
    return torch.native_layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)


def layer_norm_input_grad(grad, x, mean, rstd, norm: nn.LayerNorm) -> torch.Tensor:
    """The gradient of a LayerNorm's input x (..., N) from that of its output, in one operation: with
    n = (x - mean) rstd and g = grad * weight, d x = rstd (g - mean(g) - n mean(g n)), means over the row."""
    mask = [True, False, False]
    return torch.ops.aten.native_layer_norm_backward(
        grad, x, norm.normalized_shape, mean, rstd, norm.weight, norm.bias, mask
    )[0]


def layer_norm_affine_grads(grad, x, mean, rstd, norm: nn.LayerNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients of a LayerNorm's weight and bias (N,), summed over all rows of x (..., N): sum(grad n) and
    sum(grad), n = (x - mean) rstd."""
    mask = [False, True, True]
    _, weight_grad, bias_grad = torch.ops.aten.native_layer_norm_backward(
        grad, x, norm.normalized_shape, mean, rstd, norm.weight, norm.bias, mask
    )
    return weight_grad, bias_grad


class LayerNormGRUBackward:
    """`LayerNormGRUCell`'s part of `ObserveBackwardThroughTime`: its activations for all steps at once, the input
    gradients of one step, and the weight gradients of all steps.

    Forward: [reset, candidate, update] = LayerNorm(W [x, state]) (3 x (.., D)); cand = tanh(sigmoid(reset)
    candidate); u = sigmoid(update - 1); deter = u cand + (1 - u) state.
    """

    def __init__(self, gru: LayerNormGRUCell, x: torch.Tensor, state: torch.Tensor):
        """x (T, B, H) and state (T, B, D): each step's input and (reset-masked) previous deter."""
        self.gru, self.x_dim = gru, x.shape[-1]
        self.inputs = torch.cat([x, state], -1)  # (T, B, H + D)
        self.pre_norm = F.linear(self.inputs, gru.linear.weight)  # (T, B, 3D)
        normed, self.mean, self.rstd = layer_norm_stats(self.pre_norm, gru.norm)
        reset, candidate, update = normed.chunk(3, -1)  # (T, B, D) each
        reset = torch.sigmoid(reset)
        cand = torch.tanh(reset * candidate)
        update = torch.sigmoid(update - 1.0)
        d_cand = update * (1 - cand * cand)  # d deter / d (sigmoid(reset) candidate)
        # d deter / d [reset, candidate, update] (the LayerNorm's output), unit by unit
        self.gate_grads = torch.stack(
            [
                d_cand * candidate * reset * (1 - reset),
                d_cand * reset,
                (cand - state) * update * (1 - update),
            ],
            -2,
        )  # (T, B, 3, D)
        self.state_grad = 1 - update  # (T, B, D): d deter / d state, the direct path

    def step_inputs(self) -> list[torch.Tensor]:
        """What `step` reads of each step, time-major (T, B, ...)."""
        return [self.gate_grads, self.pre_norm, self.mean, self.rstd, self.state_grad]

    @staticmethod
    def step(gru: LayerNormGRUCell, grad, gate_grads, pre_norm, mean, rstd, state_grad) -> tuple:
        """d x (B, H) and d state (B, D) of one step from d deter (B, D) and that step's `step_inputs`, with what
        `weight_grads` reads: (the LayerNorm's output gradient, its input gradient) (B, 3D) each."""
        norm_grad = (grad.unsqueeze(-2) * gate_grads).flatten(-2)  # (B, 3D)
        pre_norm_grad = layer_norm_input_grad(norm_grad, pre_norm, mean, rstd, gru.norm)  # (B, 3D)
        input_grad = pre_norm_grad @ gru.linear.weight  # (B, H + D)
        x_dim = gru.linear.in_features - grad.shape[-1]
        x_grad, state_part = input_grad[:, :x_dim], input_grad[:, x_dim:]
        return x_grad, torch.addcmul(state_part, state_grad, grad), (norm_grad, pre_norm_grad)

    def weight_grads(self, saved: list[torch.Tensor]) -> list[torch.Tensor]:
        """Gradients of linear.weight (3D, H + D), norm.weight and norm.bias (3D,), summed over all steps, from
        `step`'s saved gradients stacked time-major (T, B, 3D)."""
        norm_grad, pre_norm_grad = (grad.flatten(0, 1) for grad in saved)  # (T * B, 3D)
        linear_grad = pre_norm_grad.T @ self.inputs.flatten(0, 1)
        norm_weight_grad, norm_bias_grad = layer_norm_affine_grads(
            norm_grad,
            self.pre_norm.flatten(0, 1),
            self.mean.flatten(0, 1),
            self.rstd.flatten(0, 1),
            self.gru.norm,
        )
        return [linear_grad, norm_weight_grad, norm_bias_grad]


class TorchGRUBackward:
    """`nn.GRUCell`'s part of `ObserveBackwardThroughTime` (the nature model), as `LayerNormGRUBackward`.

    Forward: [r, z, n] input parts i = W_ih x + b_ih and state parts s = W_hh state + b_hh (3 x (.., D)); r =
    sigmoid(i_r + s_r), z = sigmoid(i_z + s_z), n = tanh(i_n + r s_n); deter = (1 - z) n + z state.
    """

    def __init__(self, gru: nn.GRUCell, x: torch.Tensor, state: torch.Tensor):
        """x (T, B, H) and state (T, B, D): each step's input and (reset-masked) previous deter."""
        self.gru, self.x, self.state = gru, x, state
        input_r, input_z, input_n = F.linear(x, gru.weight_ih, gru.bias_ih).chunk(3, -1)  # (T, B, D) each
        state_r, state_z, state_n = F.linear(state, gru.weight_hh, gru.bias_hh).chunk(3, -1)
        r = torch.sigmoid(input_r + state_r)
        z = torch.sigmoid(input_z + state_z)
        n = torch.tanh(input_n + r * state_n)
        d_n = (1 - z) * (1 - n * n)  # d deter / d (i_n + r s_n)
        d_r = d_n * state_n * r * (1 - r)  # d deter / d (i_r + s_r)
        d_z = (state - n) * z * (1 - z)  # d deter / d (i_z + s_z)
        self.input_part_grads = torch.stack([d_r, d_z, d_n], -2)  # (T, B, 3, D): d deter / d i
        self.state_part_grads = torch.stack([d_r, d_z, d_n * r], -2)  # (T, B, 3, D): d deter / d s
        self.state_grad = z  # (T, B, D): d deter / d state, the direct path

    def step_inputs(self) -> list[torch.Tensor]:
        """What `step` reads of each step, time-major (T, B, ...)."""
        return [self.input_part_grads, self.state_part_grads, self.state_grad]

    @staticmethod
    def step(gru: nn.GRUCell, grad, input_part_grads, state_part_grads, direct_grad) -> tuple:
        """d x (B, H) and d state (B, D) of one step from d deter (B, D) and that step's `step_inputs`, with what
        `weight_grads` reads: the gradients of the input and state parts (B, 3D) each."""
        input_grad = (grad.unsqueeze(-2) * input_part_grads).flatten(-2)  # (B, 3D)
        state_grad = (grad.unsqueeze(-2) * state_part_grads).flatten(-2)  # (B, 3D)
        x_grad = input_grad @ gru.weight_ih  # (B, H)
        return x_grad, torch.addmm(direct_grad * grad, state_grad, gru.weight_hh), (input_grad, state_grad)

    def weight_grads(self, saved: list[torch.Tensor]) -> list[torch.Tensor]:
        """Gradients of weight_ih (3D, H), weight_hh (3D, D), bias_ih and bias_hh (3D,), summed over all steps,
        from `step`'s saved gradients stacked time-major (T, B, 3D)."""
        input_grad, state_grad = (grad.flatten(0, 1) for grad in saved)  # (T * B, 3D)
        return [
            input_grad.T @ self.x.flatten(0, 1),
            state_grad.T @ self.state.flatten(0, 1),
            input_grad.sum(0),
            state_grad.sum(0),
        ]


class FastObserve:
    """`RSSM.observe` in fewer kernels, with a hand-written backward pass (`ObserveBackwardThroughTime`) where it
    applies: the same arguments and results (`check_observe_forward`, `check_observe_backward`). The first layers of
    `img_in` and of the posterior are split: the action's and the embedding's shares for all steps at once before
    the loop, so a step is two fused products and the rest of the cell. --no-fast-observe leaves `RSSM.observe`."""

    def __init__(self, rssm: RSSM, hand_written_backward: bool = True):
        self.rssm = rssm
        # False: autograd's backward of the per-step loop (the same gradients, more operations)
        self.hand_written_backward = hand_written_backward
        # the functions each step runs; `compile_agent` puts compiled ones in their place
        self.step, self.reverse_step = self.observe_step, ObserveBackwardThroughTime.reverse_step

    def observe_step(
        self,
        deter,
        stoch,
        first,
        initial_deter,
        initial_stoch,
        action_in,
        embed_in,
        noise,
        stoch_weight,
        deter_weight,
    ):
        """One posterior step, `img_step` then `posterior` then `sample`, with the parts that do not depend on the
        previous step computed for the whole sequence beforehand (see `__call__`): deter (B, D), stoch (B, S), first
        (B, 1) bool (True where an episode starts: the initial state (1, D), (1, S) replaces the previous one),
        action_in (B, H) and embed_in (B, H) the action's share of `img_in`'s first layer and the embedding's share
        of the posterior's first layer (biases included), noise this step's (see `RSSM.noise`), stoch_weight and
        deter_weight the other shares' weights. Returns deter, stoch, posterior."""
        rssm = self.rssm
        deter, stoch = rssm.episode_start(first, deter, stoch, (initial_deter, initial_stoch))
        # one fused product-and-sum each: = img_in[0](cat[stoch, action]), then = posterior_net[0](cat[deter, embed])
        hidden = torch.addmm(action_in, stoch, stoch_weight.t())
        deter = rssm.gru(upcast(rssm.img_in[1:](hidden)), deter)
        hidden = torch.addmm(embed_in, deter, deter_weight.t())
        posterior = rssm._stats(rssm.posterior_net[1:](hidden))
        return deter, rssm.sample(posterior, noise), posterior

    def __call__(self, embed: torch.Tensor, action: torch.Tensor, is_first: torch.Tensor, noise=None):
        """`RSSM.observe(embed, action, is_first, noise)`, see there."""
        rssm = self.rssm
        B, T = embed.shape[:2]
        first = is_first.unsqueeze(-1)  # (B, T, 1) bool: where an episode starts
        keep = (~first).to(
            embed.dtype
        )  # (B, T, 1): 0 where an episode starts (and its previous action is zero)
        if noise is None:
            noise = rssm.noise((T, B), embed.device)
        # the first layers of img_in (on [stoch, action]) and of the posterior (on [deter, embed]), split: the action
        # and embed halves for all steps at once, before the loop (the same weights and sums, far fewer kernels)
        img_first, post_first = rssm.img_in[0], rssm.posterior_net[0]
        action_in = F.linear(
            action * keep, img_first.weight[:, rssm.stoch_flat :], img_first.bias
        )  # (B, T, H)
        embed_in = F.linear(embed, post_first.weight[:, rssm.deter_dim :], post_first.bias)  # (B, T, H)
        stoch_weight, deter_weight = (
            img_first.weight[:, : rssm.stoch_flat],
            post_first.weight[:, : rssm.deter_dim],
        )
        initial_deter, initial_stoch = rssm.initial(1)  # (1, D), (1, S)
        inputs = (first, initial_deter, initial_stoch, action_in, embed_in, noise, stoch_weight, deter_weight)
        if self.backward_through_time_applies(embed):
            deter, stoch, posterior = ObserveBackwardThroughTime.apply(self, *inputs, *self.scan_parameters())
        else:
            deter, stoch, posterior = self.observe_loop(*inputs)
        # the prior depends on deter alone: all steps at once, after the loop
        return deter, stoch, posterior, rssm.prior(deter)

    def observe_loop(
        self, first, initial_deter, initial_stoch, action_in, embed_in, noise, stoch_weight, deter_weight
    ):
        """`observe_step` at each step of a sequence (`__call__`'s inputs, see there): deter (B, T, D), stoch (B, T,
        S), posterior (B, T, ...). Autograd records every step, unless `ObserveBackwardThroughTime` runs it. Before
        the first step the state is the initial one."""
        B = first.shape[0]
        # (B, D), (B, S); the first step's inputs shaped as the later steps' (a compiled step compiles once)
        deter, stoch = initial_deter.expand(B, -1).contiguous(), initial_stoch.expand(B, -1).contiguous()
        deters, stochs, posteriors = [], [], []
        # unbind: one view per step, and one stack in the backward pass (indexing [:, t] would zero-fill and add a
        # whole (B, T, H) gradient at every step)
        for first_t, action_t, embed_t, noise_t in zip(
            first.unbind(1), action_in.unbind(1), embed_in.unbind(1), noise.unbind(0)
        ):
            deter, stoch, posterior = self.step(
                deter,
                stoch,
                first_t,
                initial_deter,
                initial_stoch,
                action_t,
                embed_t,
                noise_t,
                stoch_weight,
                deter_weight,
            )
            deters.append(deter), stochs.append(stoch), posteriors.append(posterior)
        return torch.stack(deters, 1), torch.stack(stochs, 1), torch.stack(posteriors, 1)

    def backward_through_time_applies(self, embed: torch.Tensor) -> bool:
        """Whether the call takes `ObserveBackwardThroughTime` (its hand-written backward pass): with gradients,
        categorical latents and no autocast. Gaussian latents (classes 0) and --amp take autograd's backward of
        `observe_loop` (tests/test_dreamer_fast_path.py checks which runs); without gradients both are the loop."""
        return (
            self.hand_written_backward
            and self.rssm.classes > 0
            and torch.is_grad_enabled()
            and not torch.is_autocast_enabled(embed.device.type)
        )

    def scan_parameters(self) -> list[torch.Tensor]:
        """The parameters `observe_step` uses besides the first layers' (whose shares `__call__` passes in), in the
        order `ObserveBackwardThroughTime` returns their gradients: img_in's and the posterior's LayerNorms, the
        posterior's output layer, then the GRU's own (`LayerNormGRUCell` or `nn.GRUCell`)."""
        rssm = self.rssm
        img_norm, post_norm, post_out = rssm.img_in[1], rssm.posterior_net[1], rssm.posterior_net[3]
        return [
            img_norm.weight,
            img_norm.bias,
            post_norm.weight,
            post_norm.bias,
            post_out.weight,
            post_out.bias,
            *rssm.gru.parameters(),
        ]


class ObserveBackwardThroughTime(torch.autograd.Function):
    """`RSSM.observe`'s loop with a hand-written backward pass through time (categorical latents, no autocast).

    Autograd's backward pass of the per-step loop computes, at every step, that step's share of the gradient of each
    of the ~12 weight tensors the step uses, and adds it up: most of its operations. Only the gradients of the state
    (deter, stoch) must be computed one step after another, in reverse; a weight's gradient is a sum over all B x T
    rows of (its layer's output gradient) x (its layer's input), so it is computed once, after the loop, as one large
    product. So the forward pass runs `FastObserve.observe_loop` without a graph, keeping only its inputs and outputs; the
    backward pass recomputes the steps' activations for all steps at once (given the states, no step depends on
    another), walks the steps in reverse for the state gradients, then forms the weight gradients. Equal to
    autograd's in float64 (tests/test_dreamer_fast_path.py). The forward pass calls `observe_step` and the backward
    pass `FastObserve.reverse_step` at each step, both compiled with --compile.

    A step (`observe_step`), with the previous deter and stoch replaced by the initial state where an episode starts
    (keep = 0 there; the initial deter's gradient is the sum of the previous deter's gradients at those steps):
    img = silu(LN(stoch Ws^T + action_in)); deter = GRU(img, deter); post = silu(LN(deter Wd^T + embed_in));
    probs = softmax(post Wo^T + bo) (B, S, C); mixed = (1 - unimix) probs + unimix / C; posterior = log(mixed);
    stoch = one_hot + mixed - sg(mixed) (straight-through: d stoch / d posterior = mixed).
    """

    @staticmethod
    def forward(ctx, fast: "FastObserve", *inputs):
        """`fast.observe_loop(*inputs[:8])` (first, initial_deter, initial_stoch, action_in, embed_in, noise,
        stoch_weight, deter_weight; no graph: autograd.Function runs this without one); `inputs[8:]` are
        `fast.scan_parameters()`, passed so that autograd knows the outputs depend on them."""
        deter, stoch, posterior = fast.observe_loop(*inputs[:8])
        ctx.fast = fast
        ctx.save_for_backward(*inputs, deter, stoch)
        return deter, stoch, posterior

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, deter_grad, stoch_grad, posterior_grad):
        """d outputs (B, T, ...) -> d inputs, in `forward`'s order (None for fast, first, initial_stoch, noise)."""
        fast = ctx.fast
        rssm = fast.rssm
        first, initial_deter, initial_stoch, action_in, embed_in, _, stoch_weight, deter_weight, *rest = (
            ctx.saved_tensors
        )
        deter, stoch = rest[-2:]
        # time-major from here, (T, B, ...): a step's rows are contiguous
        first = first.transpose(0, 1)  # (T, B, 1) bool
        keep = (~first).to(deter.dtype)  # (T, B, 1)
        deter, stoch = deter.transpose(0, 1), stoch.transpose(0, 1)  # (T, B, D), (T, B, S*C)
        grads = (deter_grad.transpose(0, 1), stoch_grad.transpose(0, 1), posterior_grad.transpose(0, 1))
        # 1. every step's activations at once, from the states the forward pass returned
        initial = (initial_deter, initial_stoch)
        acts = ObserveActivations(
            rssm, first, initial, action_in, embed_in, stoch_weight, deter_weight, deter, stoch
        )
        # 2. the steps in reverse: the state gradients (the only sequential part) and each layer's output gradient
        layer_grads = ObserveBackwardThroughTime.reverse_steps(
            acts, keep, *grads, reverse_step=fast.reverse_step
        )
        # 3. the weight gradients, each a sum over all T x B rows: one product or one reduction
        return ObserveBackwardThroughTime.weight_grads(acts, first, layer_grads)

    @staticmethod
    def reverse_steps(
        acts: "ObserveActivations", keep, deter_grad, stoch_grad, posterior_grad, reverse_step: Callable
    ) -> tuple:
        """The steps in reverse, time-major (T, B, ...) gradients of the outputs in: the gradients of each layer's
        output at every step (T, B, ...), for `weight_grads`: logits, post_norm, post_pre, img_norm, img_pre, then
        the GRU's own (see its `step`). `reverse_step` is `ObserveBackwardThroughTime.reverse_step`, or its compiled
        form with --compile."""
        rssm = acts.rssm
        S, C, T = rssm.stoch_dim, rssm.classes, acts.deter.shape[0]
        probs_share, mixed = acts.probs_share, acts.mixed
        # softmax's backward reads probs * d probs. Through posterior = log(mixed): d probs = (1 - unimix) d posterior
        # / mixed; through the straight-through stoch (d stoch / d posterior = mixed, so d stoch / d mixed = 1):
        # d probs = (1 - unimix) d stoch. `own_grad` is the share of each step's own output gradients, for all steps
        # at once; `carried_factor` multiplies the stoch gradient that step t + 1 sends back (0 where it starts an
        # episode, and after the last step)
        own_grad = probs_share / mixed * posterior_grad
        own_grad = torch.addcmul(own_grad, probs_share, stoch_grad.unflatten(-1, (S, C)))  # (T, B, S, C)
        keep_next = torch.cat([keep[1:], torch.zeros_like(keep[:1])]).unsqueeze(-1)  # (T, B, 1, 1)
        carried_factor = probs_share * keep_next  # (T, B, S, C)
        # (T, B, D): at step t, step t - 1's output gradient of deter
        deter_grad_prev = torch.cat([torch.zeros_like(deter_grad[:1]), deter_grad[:-1]])
        step_inputs = [
            own_grad,
            carried_factor,
            acts.probs,
            acts.post_silu_grad,
            acts.post_pre,
            acts.post_mean,
            acts.post_rstd,
            acts.img_silu_grad,
            acts.img_pre,
            acts.img_mean,
            acts.img_rstd,
            deter_grad_prev,
            keep,
            *acts.gru.step_inputs(),
        ]
        steps = list(zip(*(tensor.unbind(0) for tensor in step_inputs)))  # views, step by step
        deter_carry = deter_grad[T - 1].contiguous()  # (B, D): d deter_t from the outputs and the later steps
        # (B, S*C): d (stoch_t * keep_{t+1}), from step t + 1 (none after the last step)
        stoch_carry = torch.zeros_like(acts.stoch_prev[0])
        saved = []
        for t in reversed(range(T)):
            deter_carry, stoch_carry, layer_grads = reverse_step(
                rssm, acts.gru.step, acts.deter_weight, acts.stoch_weight, deter_carry, stoch_carry, *steps[t]
            )
            saved.append(layer_grads)
        return tuple(torch.stack(grads[::-1]) for grads in zip(*saved))  # (T, B, ...) each

    @staticmethod
    def reverse_step(
        rssm,
        gru_step,
        deter_weight,
        stoch_weight,
        deter_carry,
        stoch_carry,
        own_grad,
        carried_factor,
        probs,
        post_silu_grad,
        post_pre,
        post_mean,
        post_rstd,
        img_silu_grad,
        img_pre,
        img_mean,
        img_rstd,
        deter_grad_prev,
        keep,
        *gru_inputs,
    ) -> tuple:
        """One step of `reverse_steps`, step t's tensors in (B, ...): d deter_t and d stoch_t carried from the
        later steps in, those of step t - 1 out (masked where step t starts an episode), with the gradients of each
        layer's output at step t. --compile compiles it once for every step (`FastObserve.reverse_step`)."""
        S, C = rssm.stoch_dim, rssm.classes
        post_norm, post_out = rssm.posterior_net[1], rssm.posterior_net[3]
        # posterior head: probs * d probs -> d logits (softmax) -> d post_pre (silu, LayerNorm)
        probs_grad = torch.addcmul(own_grad, carried_factor, stoch_carry.unflatten(-1, (S, C)))  # (B, S, C)
        logits_grad = torch.addcmul(probs_grad, probs, probs_grad.sum(-1, keepdim=True), value=-1)
        logits_grad = logits_grad.flatten(-2)  # (B, S*C)
        post_norm_grad = (logits_grad @ post_out.weight) * post_silu_grad  # (B, H)
        post_pre_grad = layer_norm_input_grad(
            post_norm_grad, post_pre, post_mean, post_rstd, post_norm
        )  # (B, H)
        deter_total = torch.addmm(deter_carry, post_pre_grad, deter_weight)  # (B, D): all of d deter_t
        # GRU, then img_in: d img -> d img_pre (silu, LayerNorm) -> d stoch_prev
        img_grad, deter_prev_grad, gru_grads = gru_step(rssm.gru, deter_total, *gru_inputs)  # (B, H), (B, D)
        img_norm_grad = img_grad * img_silu_grad
        img_pre_grad = layer_norm_input_grad(img_norm_grad, img_pre, img_mean, img_rstd, rssm.img_in[1])
        # the previous step's state gradients, masked where this step starts an episode (keep is in
        # carried_factor for stoch); there, and at t = 0, deter's goes to the initial state (`weight_grads`)
        deter_carry = torch.addcmul(deter_grad_prev, keep, deter_prev_grad)
        stoch_carry = img_pre_grad @ stoch_weight  # (B, S*C)
        layer_grads = (
            logits_grad,
            post_norm_grad,
            post_pre_grad,
            img_norm_grad,
            img_pre_grad,
            deter_prev_grad,
        )
        return deter_carry, stoch_carry, (*layer_grads, *gru_grads)

    @staticmethod
    def weight_grads(acts: "ObserveActivations", first, layer_grads: tuple) -> tuple:
        """`backward`'s result from the layers' output gradients (`reverse_steps`): each weight's gradient one
        product or one reduction over all T x B rows; the initial deter's, the previous deter's gradient summed over
        the steps that start from it (first (T, B, 1), and every sequence's step 0)."""
        rssm = acts.rssm
        img_norm, post_norm = rssm.img_in[1], rssm.posterior_net[1]
        logits_grad, post_norm_grad, post_pre_grad, img_norm_grad, img_pre_grad = layer_grads[:5]
        deter_prev_grad, gru_grads = layer_grads[5], layer_grads[6:]

        def rows(x: torch.Tensor) -> torch.Tensor:
            """(T, B, ...) -> (T * B, ...)."""
            return x.flatten(0, 1)

        img_norm_weight_grad, img_norm_bias_grad = layer_norm_affine_grads(
            rows(img_norm_grad), rows(acts.img_pre), rows(acts.img_mean), rows(acts.img_rstd), img_norm
        )
        post_norm_weight_grad, post_norm_bias_grad = layer_norm_affine_grads(
            rows(post_norm_grad), rows(acts.post_pre), rows(acts.post_mean), rows(acts.post_rstd), post_norm
        )
        parameter_grads = [
            img_norm_weight_grad,
            img_norm_bias_grad,
            post_norm_weight_grad,
            post_norm_bias_grad,
            rows(logits_grad).T @ rows(acts.post),  # (S*C, H)
            rows(logits_grad).sum(0),
            *acts.gru.weight_grads(gru_grads),
        ]
        stoch_weight_grad = rows(img_pre_grad).T @ rows(acts.stoch_prev)  # (H, S*C)
        deter_weight_grad = rows(post_pre_grad).T @ rows(acts.deter)  # (H, D)
        action_in_grad, embed_in_grad = (
            img_pre_grad.transpose(0, 1),
            post_pre_grad.transpose(0, 1),
        )  # (B, T, H)
        from_initial = first.clone()
        from_initial[0] = True  # (T, B, 1): the steps whose previous deter is the initial one
        initial_deter_grad = torch.where(from_initial, deter_prev_grad, 0).sum((0, 1)).unsqueeze(0)  # (1, D)
        return (
            None,
            None,
            initial_deter_grad,
            None,
            action_in_grad,
            embed_in_grad,
            None,
            stoch_weight_grad,
            deter_weight_grad,
            *parameter_grads,
        )


class ObserveActivations:
    """Every step's activations of `FastObserve.observe_step` at once, time-major (T, B, ...), recomputed from the states
    the forward pass returned (given deter and stoch, no step depends on another): what `ObserveBackwardThroughTime`
    reads."""

    def __init__(self, rssm, first, initial, action_in, embed_in, stoch_weight, deter_weight, deter, stoch):
        """first (T, B, 1) bool, deter (T, B, D), stoch (T, B, S*C) time-major, initial the initial deter (1, D) and
        stoch (1, S*C); action_in and embed_in (B, T, H)."""
        img_norm, post_norm, post_out = rssm.img_in[1], rssm.posterior_net[1], rssm.posterior_net[3]
        S, C, unimix = rssm.stoch_dim, rssm.classes, rssm.unimix
        self.rssm, self.stoch_weight, self.deter_weight, self.deter = rssm, stoch_weight, deter_weight, deter
        # each step's previous state: the one before, or the initial one where an episode starts and at step 0
        initial_deter, initial_stoch = (x.expand_as(state[:1]) for x, state in zip(initial, (deter, stoch)))
        deter_prev = torch.where(first, initial_deter, torch.cat([initial_deter, deter[:-1]]))  # (T, B, D)
        self.stoch_prev = torch.where(
            first, initial_stoch, torch.cat([initial_stoch, stoch[:-1]])
        )  # (T, B, S*C)
        self.img_pre = F.linear(self.stoch_prev, stoch_weight) + action_in.transpose(0, 1)  # (T, B, H)
        img_normed, self.img_mean, self.img_rstd = layer_norm_stats(self.img_pre, img_norm)
        img = F.silu(img_normed)  # (T, B, H): the GRU's input
        self.img_silu_grad = silu_derivative(img_normed)
        gru_kind = LayerNormGRUBackward if isinstance(rssm.gru, LayerNormGRUCell) else TorchGRUBackward
        self.gru = gru_kind(rssm.gru, img, deter_prev)
        self.post_pre = F.linear(deter, deter_weight) + embed_in.transpose(0, 1)  # (T, B, H)
        post_normed, self.post_mean, self.post_rstd = layer_norm_stats(self.post_pre, post_norm)
        self.post = F.silu(post_normed)  # (T, B, H)
        self.post_silu_grad = silu_derivative(post_normed)
        self.probs = F.softmax(post_out(self.post).unflatten(-1, (S, C)), -1)  # (T, B, S, C)
        self.probs_share = (1 - unimix) * self.probs  # (T, B, S, C)
        self.mixed = self.probs_share + unimix / C  # the posterior's probabilities, as `_stats` computes them


# --- The fast imagination, compile and CUDA graphs --------------------------------------------------------------------


class FastImagine:
    """`imagine` in fewer operations: the same arguments, random numbers and results (--no-fast-imagine leaves
    `imagine`; tests/test_dreamer_fast_path.py holds them equal in float64).

    The rollout runs without gradients: the actor learns by REINFORCE and the critic from fixed targets, so only
    the actor's log-probabilities and entropy need a graph. The actor therefore runs once more after the loop, with
    gradients, on all imagined states at once: one forward and one backward pass for the whole rollout instead of
    one per step (the same values). The random numbers of the whole rollout are drawn in two calls. Returns feat
    (H+1, N, F) detached, log_prob (H, N), entropy (H, N).
    """

    def __init__(self):
        self.step = imagine_step  # one imagined step (`compile_agent` puts a compiled one here)

    def __call__(self, agent: "Agent", start_states, horizon: int):
        deter, stoch, _ = start_states
        rssm = agent.world_model.rssm
        action_uniforms = torch.rand(horizon, deter.shape[0], 1, device=deter.device)  # (H, N, 1)
        latent_noise = rssm.noise((horizon, deter.shape[0]), deter.device)  # (H, N, ...)
        step = self.step
        with torch.no_grad():
            deters, stochs, actions = [deter], [stoch], []
            for action_uniform, noise in zip(action_uniforms.unbind(0), latent_noise.unbind(0)):
                action, deter, stoch = step(agent.actor, rssm, deter, stoch, action_uniform, noise)
                deters.append(deter), stochs.append(stoch), actions.append(action)
            feat = torch.cat([torch.stack(deters), torch.stack(stochs)], -1)  # (H+1, N, F)
            action = torch.stack(actions)  # (H, N, A) one-hot
        probs = agent.actor(feat[:-1])  # (H, N, A), with gradients
        log_probs = probs.log()
        return feat, (log_probs * action).sum(-1), -(probs * log_probs).sum(-1)


def imagine_step(actor: "Actor", rssm: RSSM, deter, stoch, action_uniform, latent_noise) -> tuple:
    """One imagined step from deter (N, D), stoch (N, S), without gradients: the actor picks an action (from
    `action_uniform` (N, 1)), the prior moves on (`latent_noise`). Returns the one-hot action (N, A), the next deter
    and stoch. `--compile` compiles this function once and reuses it at every step."""
    action = one_hot_draw(actor(torch.cat([deter, stoch], -1)), action_uniform)  # (N, A)
    deter = rssm.img_step(deter, stoch, action.to(deter.dtype))
    return action, deter, rssm.sample(rssm.prior(deter), latent_noise)


def compile_agent(agent: Agent, backend: str = "inductor") -> None:
    """--compile: torch.compile what an update repeats. One step of the fast observe, one step of its hand-written
    backward pass and one imagination step are each compiled once and reused at every step of a sequence (compiling
    a whole unrolled sequence takes minutes); the encoder, decoder and heads, which run once per update over all
    steps, are compiled too (`nn.Module.compile`: their state_dict keys stay, so checkpoints are the same either
    way), and so are the world model's losses (`world_model_losses`) and the actor-critic targets
    (`imagined_targets`, the lambda-return loop included), each as one graph. Each compiles as one whole graph
    (`fullgraph=True`: a graph break is an error, not a silent slow path)."""
    wm = agent.world_model

    def compile_(fn):
        return torch.compile(fn, dynamic=False, fullgraph=True, backend=backend)

    if isinstance(agent.observe, FastObserve):
        agent.observe.step = compile_(agent.observe.observe_step)
        agent.observe.reverse_step = compile_(ObserveBackwardThroughTime.reverse_step)
    if isinstance(agent.imagine, FastImagine):
        agent.imagine.step = compile_(imagine_step)
    agent.world_model_losses = compile_(world_model_losses)
    agent.imagined_targets = compile_(imagined_targets)
    for module in (
        wm.encoder,
        wm.decoder,
        wm.reward_head,
        wm.continue_head,
        agent.actor,
        agent.critic,
        agent.slow_critic,
    ):
        module.compile(dynamic=False, fullgraph=True, backend=backend)


class CaptureInvalid(RuntimeError):
    """A setting the captured update read as a Python value changed after capture (one sentence naming it)."""


def learning_rate(value: float, device) -> torch.Tensor:
    """A learning rate as a 0-d tensor on `device`, the form fused Adam reads at each step without the host. CUDA's
    fused Adam reads a float32 tensor; the CPU's computes in double, as from a float."""
    device = torch.device(device)
    return torch.tensor(value, device=device, dtype=torch.float32 if device.type == "cuda" else torch.float64)


class SettingsTensors(UpdateSettings):
    """`UpdateSettings` as 0-d tensors on the update's device, changed in place by `set`: a CUDA graph replays the
    tensors it was captured with, and a compiled update reads them without compiling again, where a Python float
    would keep its first value. The learning rates become the optimizers' own `lr` tensors (`learning_rate`; a
    checkpoint's optimizer state restores them). Derived numbers (`1 - decay`, `1 - lambda`) are computed in double
    when set, as from floats, so that the losses are the same to the last bit. `dtype`: the parameters' (float32;
    float64 in the equality tests)."""

    def __init__(self, settings: UpdateSettings, device, dtype):
        self.values, self.optimizers = dict(settings.values), settings.optimizers
        self.tensors = {name: torch.tensor(settings[name], device=device, dtype=dtype) for name in SCHEDULED}
        for name in DERIVED_SETTINGS:
            self.tensors[name] = torch.tensor(settings[name], device=device, dtype=dtype)
        for name, optimizer in LEARNING_RATES.items():
            group = self.optimizers[optimizer].param_groups[0]
            if not isinstance(group["lr"], torch.Tensor):  # before the optimizer's first step
                group["lr"] = learning_rate(group["lr"], device)
            self.tensors[name] = group["lr"]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.tensors[name]

    def set(self, name: str, value: float) -> None:
        """Write `value` into the tensor the update reads (and into the numbers derived from it)."""
        if name not in self.values:
            raise KeyError(f"{name!r} is not a scheduled setting; these are: {', '.join(self.values)}")
        self.values[name] = float(value)
        self.tensors[name].fill_(float(value))
        for derived, (source, derive) in DERIVED_SETTINGS.items():
            if source == name:
                self.tensors[derived].fill_(derive(float(value)))


def capture_settings(agent: Agent) -> Callable[[], dict]:
    """What a captured update keeps as it was at capture: each optimizer's hyperparameters (a tensor by identity: its
    value may change in place, the object may not) and the settings' tensors. (`Args` is frozen: no field of it can
    change.) Returns a function that reads them now; `CudaGraphed` compares its result with the one taken at capture
    before each replay."""

    def read() -> dict:
        values = {}
        for name, optimizer in agent.named_optimizers().items():
            for key, value in optimizer.param_groups[0].items():
                if key != "params":
                    values[f"the {name} optimizer's {key!r}"] = (
                        ("tensor", id(value)) if isinstance(value, torch.Tensor) else value
                    )
        for key, value in agent.settings.tensors.items():
            values[f"settings[{key!r}]"] = ("tensor", id(value))
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
    training on the old value. Scheduled numbers go through `UpdateSettings`, whose tensors a replay reads.
    """

    def __init__(
        self,
        fn: Callable[[dict[str, torch.Tensor]], tuple],
        warmup: int = 3,
        settings: Callable[[], dict] | None = None,
    ):
        self.fn, self.warmup, self.calls = fn, warmup, 0
        self.settings = settings or dict
        self.captured_settings: dict | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static_inputs: dict[str, torch.Tensor] = {}
        self.static_outputs: tuple = ()
        self.side_stream: torch.cuda.Stream | None = None

    def __call__(self, inputs: dict[str, torch.Tensor]) -> tuple:
        if self.captured_settings is not None:
            self.check_settings()
            return self.replay(inputs)
        self.calls += 1
        if self.calls <= self.warmup:
            return self.run_eagerly(inputs)
        self.captured_settings = self.settings()
        return self.capture(inputs)

    def check_settings(self) -> None:
        """Refuse to replay when a value read at capture has changed since (a dict comparison: microseconds)."""
        now = self.settings()
        if now == self.captured_settings:
            return
        changed = next(
            key
            for key in {**now, **self.captured_settings}
            if now.get(key) != self.captured_settings.get(key)
        )
        raise CaptureInvalid(
            f"{changed} changed from {self.captured_settings.get(changed)!r} to {now.get(changed)!r} after the update "
            f"was captured in a CUDA graph, which would go on using the old value: schedule it with "
            f"agent.settings.set(...) (see UpdateSettings), or run with --no-cudagraph."
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
        with torch.cuda.graph(self.graph):
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
        assert len(set(self.pending_rows)) == len(self.pending_rows), (
            "a row was handed out again before the flush"
        )
        frames = torch.from_numpy(np.stack(self.pending))  # (n, S, S) uint8
        rows = torch.tensor(self.pending_rows, dtype=torch.int64)
        if self.device.type == "cuda":
            # pinned: the copy runs without blocking; torch keeps the pinned block until the copy has read it
            frames, rows = frames.pin_memory(), rows.pin_memory()
        self.rows.index_copy_(
            0, rows.to(self.device, non_blocking=True), frames.to(self.device, non_blocking=True)
        )
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
        print(
            f"replay: the frame store grew to {len(self.rows):,} frames ({self.rows.nbytes / 2**20:.0f} MiB)"
        )

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
        assert self.store.written[self.env] == self.first + self.end, (
            "one episode at a time writes an env's frames"
        )
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


class FrameStoreReplay(EpisodeReplay):
    """`EpisodeReplay` with its frames in a `FrameStore` on `frames_device` (`--replay-frames device`; the rest stays
    in host memory): training batches are gathered there (`sample_rows`, then `gather` on the device), the same
    batches as `sample` gives."""

    def __init__(
        self, capacity: int, num_envs: int, seed: int, chunk_size: int | None = None, frames_device="cpu"
    ):
        super().__init__(capacity, num_envs, seed, chunk_size)
        self.frames_device = torch.device(frames_device)
        self.store: FrameStore | None = None  # made with the first episode, which gives the frames' shape

    def new_episode(self, env_idx: int, first_obs: np.ndarray) -> Episode:
        if self.store is None:
            # a full replay's frames, each episode's frame_stack - 1 extra frames and each env's partly used
            # blocks; a replay of many short episodes grows it
            blocks = math.ceil(1.05 * self.capacity / self.chunk_size) + 2 * self.num_envs + 2
            self.store = FrameStore(
                first_obs.shape[1:], self.num_envs, self.chunk_size, blocks, self.frames_device
            )
        frames = DeviceFrames(self.store, env_idx, first_obs.shape[1:], self.chunk_size)
        return Episode(first_obs, self.chunk_size, frames)

    def sample_rows(
        self,
        batch_size: int,
        sequence_length: int,
        rng: np.random.Generator | None = None,
        out: dict[str, np.ndarray] | None = None,
    ) -> dict[str, np.ndarray]:
        """`sample` with the frames in the `FrameStore`: the same windows and arrays, with `rows` (B, T, k) int64 in place
        of obs: where each stack's frames are in the store. `gather`, on the device, makes the batch from them."""
        self.store.flush()  # queued before the gather that reads them
        return self.fill(self.draw_windows(batch_size, sequence_length, rng), sequence_length, "rows", out)

    def gather(self, indices: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The batch that `sample` gives, from `sample_rows`' arrays moved to the store's device: obs (B, T, k, ...)
        uint8 is one indexing of the store's rows (a new tensor: it never aliases the store)."""
        batch = {"obs": self.store.rows[indices["rows"]]}  # (B, T, 4, 84, 84) uint8
        return batch | {key: value for key, value in indices.items() if key != "rows"}


def replay_frames_device(args: Args, device: torch.device, obs_shape: tuple) -> torch.device | None:
    """Where the replay's frames live (`--replay-frames`): the training device, or host memory (None); said in one
    line."""
    full = replay_capacity(args) * math.prod(obs_shape[1:])  # a full replay's frames, one per step
    if args.replay_frames == "host" or (args.replay_frames == "auto" and device.type != "cuda"):
        return None
    if args.replay_frames == "auto":
        free = torch.cuda.mem_get_info(device)[0]
        if full > free / 4:
            print(
                f"replay: frames in host memory: a full replay's {full / 2**30:.2f} GiB of frames is over a quarter "
                f"of the GPU's {free / 2**30:.1f} GiB free (--replay-frames device puts them there anyway)"
            )
            return None
    print(f"replay: frames on {device} ({full / 2**30:.2f} GiB when full); batches are gathered there")
    return device


def staging_template(args: Args, obs_shape: tuple, frames_on_device: bool) -> dict[str, np.ndarray]:
    """The arrays a training batch is sampled into on the host (`PinnedBatches`' shapes): the batch itself, or, with
    the frames on the device, the rows of its stacks in the `FrameStore` (B, T, k) int64 in place of its frames."""
    template = synthetic_batch(args, obs_shape)
    if frames_on_device:
        template["rows"] = np.zeros((args.batch_size, args.sequence_length, obs_shape[0]), np.int64)
        del template["obs"]
    return template


class PinnedBatches:
    """Two pinned host buffers that batches are sampled into and copied to the GPU from without blocking, so the
    CPU samples the next batch while the GPU trains on this one. A buffer is written again only after the copy
    that last read it has finished (a CUDA event)."""

    def __init__(self, template: dict[str, np.ndarray], device: torch.device):
        self.device = device
        self.buffers = [
            {key: torch.from_numpy(value).pin_memory() for key, value in template.items()} for _ in range(2)
        ]
        self.copied: list[torch.cuda.Event | None] = [None, None]
        self.index = 0

    def host_arrays(self) -> dict[str, np.ndarray]:
        """numpy views of the next buffer, to sample into (waits until its last copy has finished)."""
        if self.copied[self.index] is not None:
            self.copied[self.index].synchronize()
        return {key: tensor.numpy() for key, tensor in self.buffers[self.index].items()}

    def to_device(self) -> dict[str, torch.Tensor]:
        """Copies of that buffer on the device, queued without blocking; the next call uses the other buffer."""
        tensors = {
            key: tensor.to(self.device, non_blocking=True) for key, tensor in self.buffers[self.index].items()
        }
        event = torch.cuda.Event()
        event.record()
        self.copied[self.index] = event
        self.index ^= 1
        return tensors


# --- The checks that hold each fast path to the function it replaces --------------------------------------------------


class FastPathMismatch(RuntimeError):
    """A fast path computes something other than the readable function it replaces (one sentence: which path, and the
    flag that switches it off)."""


class ObserveBackwardMismatch(FastPathMismatch):
    """`FastObserve.observe_step` and the hand-written backward of `ObserveBackwardThroughTime` compute different things."""


def float64_copy(rssm: RSSM, gru_scale: float = 1.0) -> RSSM:
    """A float64 copy of `rssm` on the CPU, the GRU's parameters multiplied by `gru_scale`: at 8 its units saturate,
    where a clamp or a cut of the state shows."""
    reference = copy.deepcopy(rssm).cpu().double()
    with torch.no_grad():
        for p in reference.gru.parameters():
            p.mul_(gru_scale)
    return reference


def check_inputs(rssm: RSSM, B: int = 2, T: int = 6) -> tuple:
    """A small seeded batch for the checks: embed (B, T, E), one-hot actions, is_first (both sequences start, one has
    an episode start inside), the sampling noise. The global random state is left as it was."""
    embed_dim = rssm.posterior_net[0].in_features - rssm.deter_dim
    num_actions = rssm.img_in[0].in_features - rssm.stoch_flat
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        embed = torch.randn(B, T, embed_dim, dtype=torch.float64)
        action = F.one_hot(torch.randint(num_actions, (B, T)), num_actions).double()
        is_first = torch.zeros(B, T, dtype=torch.bool)
        is_first[:, 0], is_first[1, 2] = True, True
        noise = rssm.noise((T, B), "cpu")
    return embed, action, is_first, noise


def check_observe_forward(rssm: RSSM, tolerance: float = 1e-9) -> None:
    """The fast observe's forward (`FastObserve`: its first layers split out of the loop, `observe_step`) against
    `RSSM.observe` (`img_step`, `posterior`, `sample` at each step), in float64, on `rssm`'s weights and with its GRU
    saturated: a change to one that is not carried into the other raises FastPathMismatch."""
    for scale, weights in ((1.0, "the run's weights"), (8.0, "the run's weights with the GRU's x 8")):
        reference = float64_copy(rssm, scale)
        inputs = check_inputs(reference)
        with torch.no_grad():
            fast = FastObserve(reference)(*inputs)
            readable = reference.observe(*inputs)
        for name, ours, expected in zip(("deter", "stoch", "posterior", "prior"), fast, readable):
            error = (ours - expected).abs().max().item() / max(expected.abs().max().item(), 1e-12)
            if not error <= tolerance:
                raise FastPathMismatch(
                    f"the fast observe (FastObserve.observe_step) gives another {name} than the readable cell "
                    f"(RSSM.observe) on {weights} (relative error {error:.1e}): carry the change into both, or "
                    f"run with --no-fast-observe."
                )


def observe_gradients(reference: RSSM, hand_written: bool) -> dict[str, torch.Tensor]:
    """The gradients of a fixed loss on `reference`'s observe (`check_inputs`), with the hand-written backward or
    autograd's: {"embed": ..., parameter name: ...} (zeros where a parameter gets none)."""
    embed, action, is_first, noise = check_inputs(reference)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        weights = [
            torch.randn(*is_first.shape, n, dtype=torch.float64)
            for n in (reference.deter_dim, reference.stoch_flat)
        ]
    named = {"embed": embed.requires_grad_(True), **dict(reference.named_parameters())}
    fast = FastObserve(reference, hand_written_backward=hand_written)
    deter, stoch, posterior, _ = fast(embed, action, is_first, noise)
    loss = (deter * weights[0]).sum() + (stoch * weights[1]).sum() + posterior.exp().square().sum()
    grads = torch.autograd.grad(loss, list(named.values()), allow_unused=True)
    return {name: torch.zeros_like(x) if g is None else g for (name, x), g in zip(named.items(), grads)}


def check_observe_backward(rssm: RSSM, tolerance: float = 1e-8) -> None:
    """The hand-written backward against autograd's, on a float64 copy of `rssm` (its weights, and with its GRU
    saturated). `ObserveBackwardThroughTime` recomputes the step with its own code, so a change to `observe_step`
    that is not carried into it would train on wrong gradients without a word; this raises ObserveBackwardMismatch
    instead. The global random state is left as it was."""
    if rssm.classes == 0:  # Gaussian latents take autograd's backward
        return
    for scale in (1.0, 8.0):
        reference = float64_copy(rssm, scale)
        ours, autograd = observe_gradients(reference, True), observe_gradients(reference, False)
        for name, expected in autograd.items():
            error = (ours[name] - expected).abs().max().item() / max(expected.abs().max().item(), 1e-12)
            if not error <= tolerance:
                raise ObserveBackwardMismatch(
                    f"the fast observe's hand-written backward (ObserveBackwardThroughTime) gives another gradient of "
                    f"{name} than autograd's (relative error {error:.1e}): a change to observe_step must be carried "
                    f"into its backward, or run with --observe-backward autograd."
                )


_COMPILED_DRAW: list[Callable] = []  # torch.compile(one_hot_draw), made at its first check


def check_compiled_draw(device: torch.device) -> None:
    """--compile: the compiled categorical draw (`one_hot_draw_fused`) against the eager one, on 4,096 rows of 32
    classes (a row certain of one class and a uniform past the CDF's rounded end included; rows whose uniform lies
    within 1e-5 of a CDF step are left out, where the two sums may round apart): other classes raise
    FastPathMismatch. Compiles once (seconds), then milliseconds."""
    if not _COMPILED_DRAW:
        _COMPILED_DRAW.append(torch.compile(one_hot_draw, fullgraph=True, dynamic=False))
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(0)
        probs = torch.softmax(3 * torch.randn(4096, 32, device=device), -1)
        uniform = torch.rand(4096, 1, device=device)
    probs[0] = 0.0
    probs[0, 5] = 1.0  # one class certain
    uniform[1] = 1.0 - 1e-7  # beyond any CDF that rounding left short of 1
    clear = (probs.double().cumsum(-1) - uniform.double()).abs().min(-1).values > 1e-5  # (4096,)
    clear[:2] = True
    compiled, eager = _COMPILED_DRAW[0](probs, uniform)[clear], one_hot_draw(probs, uniform)[clear]
    if not torch.equal(compiled, eager):
        rows = int((compiled != eager).any(-1).sum())
        raise FastPathMismatch(
            f"the compiled categorical draw (one_hot_draw_fused, under --compile) picks other classes than the eager "
            f"one_hot_draw in {rows} of {len(eager)} rows: carry the change into both, or run without --compile."
        )


def check_fast_imagine(agent: "Agent", tolerance: float = 1e-9) -> None:
    """The fast imagination (`FastImagine`) against `imagine`, on float64 copies of the run's actor and RSSM, with the
    same random numbers: the imagined features, log-probabilities and entropies, and the actor's gradients from them.
    A change to one that is not carried into the other raises FastPathMismatch."""
    rssm = float64_copy(agent.world_model.rssm)
    actor = copy.deepcopy(agent.actor).cpu().double()
    twin = types.SimpleNamespace(world_model=types.SimpleNamespace(rssm=rssm), actor=actor)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        N = 3
        deter = torch.randn(N, rssm.deter_dim, dtype=torch.float64)
        stoch = rssm.sample(rssm.prior(deter)).detach()
        results = []
        for rollout in (FastImagine(), imagine):
            torch.manual_seed(4)  # the same random numbers for both
            feat, log_prob, entropy = rollout(twin, (deter, stoch, None), 4)
            grads = torch.autograd.grad((log_prob.sum() + entropy.sum()), list(actor.parameters()))
            results.append((feat, log_prob, entropy, *grads))
    for index, (ours, expected) in enumerate(zip(*results)):
        error = (ours - expected).abs().max().item() / max(expected.abs().max().item(), 1e-12)
        if not error <= tolerance:
            raise FastPathMismatch(
                f"the fast imagination (FastImagine) gives another result ({index}) than imagine (relative error "
                f"{error:.1e}): carry the change into both, or run with --no-fast-imagine."
            )


def check_subpixel_decoder(layer: nn.ConvTranspose2d, tolerance: float = 1e-9) -> None:
    """--fast-decoder: `transposed_conv_as_subpixel` against torch's transposed convolution, on a float64 copy of the
    decoder's last layer: other values raise FastPathMismatch."""
    reference = copy.deepcopy(layer).cpu().double()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        x = torch.randn(2, reference.in_channels, 5, 5, dtype=torch.float64)
    ours = transposed_conv_as_subpixel(x, reference)
    expected = F.conv_transpose2d(
        x, reference.weight, reference.bias, reference.stride, reference.padding, reference.output_padding
    )
    error = (ours - expected).abs().max().item() / max(expected.abs().max().item(), 1e-12)
    if not error <= tolerance:
        raise FastPathMismatch(
            f"the decoder's last layer as a pixel shuffle (transposed_conv_as_subpixel) gives other values than the "
            f"transposed convolution (relative error {error:.1e}): run with --no-fast-decoder."
        )


def check_fast_paths(agent: "Agent", args: Args) -> None:
    """Each fast path in use against the Part 1 function it replaces, on the weights the run is using: the fast
    observe against `RSSM.observe` and its hand-written backward against autograd (float64 copies, also with the GRU
    saturated), the fast imagination against `imagine`, the pixel-shuffle decoder layer against the transposed
    convolution, and with --compile the compiled draw against the eager one. Run at start-up, after --resume on the
    loaded weights, and at each periodic and final checkpoint on the live ones; FastPathMismatch names the path and
    the flag that switches it off. About a second on a CPU for the default model, in float64 whatever the device (the
    compiled draw's first check compiles it: seconds more)."""
    if isinstance(agent.observe, FastObserve):
        check_observe_forward(agent.world_model.rssm)
        if agent.observe.hand_written_backward:
            check_observe_backward(agent.world_model.rssm)
    if isinstance(agent.imagine, FastImagine):
        check_fast_imagine(agent)
    decoder_layers = getattr(agent.world_model.decoder, "net", [None])
    if isinstance(decoder_layers[-1], SubpixelTransposedConv):
        check_subpixel_decoder(decoder_layers[-1])
    if args.compile:
        check_compiled_draw(agent.device)


# --- Installing it all: one call from the run's set-up ----------------------------------------------------------------


class CudaPlayer(Player):
    """`Player` on CUDA: the observations cross from a pinned buffer without blocking and the actions come back with
    the one wait of the env step; with --cudagraph `policy_step` is captured in a CUDA graph after 3 eager steps
    (`CudaGraphed`)."""

    def __init__(self, agent: "Agent", num_envs: int, capture: bool):
        super().__init__(agent, num_envs)
        if capture:
            self.policy = CudaGraphed(self.policy_step)
        self.pinned: dict[str, torch.Tensor] = {}  # host buffers of obs, is_first and the actions

    def act(self, obs: np.ndarray, is_first: np.ndarray) -> np.ndarray:
        """obs (N, 4, 84, 84) uint8, is_first (N,) bool -> actions (N,) int64."""
        if not self.pinned:
            self.pinned = {
                "obs": torch.empty(obs.shape, dtype=torch.uint8).pin_memory(),
                "is_first": torch.empty(is_first.shape, dtype=torch.bool).pin_memory(),
                "action": torch.empty(len(obs), dtype=torch.int64).pin_memory(),
            }
        # the last step's copies out of these buffers have finished: its actions were read after them
        self.pinned["obs"].numpy()[:] = obs
        self.pinned["is_first"].numpy()[:] = is_first
        inputs = {
            key: self.pinned[key].to(self.agent.device, non_blocking=True) for key in ("obs", "is_first")
        }
        (action,) = self.policy(inputs)
        self.pinned["action"].copy_(action, non_blocking=True)
        torch.cuda.current_stream().synchronize()  # the env step's one wait: for the updates queued before, too
        return self.pinned["action"].numpy().copy()


def sample_gathered(run: "Run") -> dict[str, torch.Tensor]:
    """`sample_batch` with the frames on the device: the host draws the windows and sends where their frames are (a
    few KB), the device gathers them."""
    B, T, replay = run.args.batch_size, run.args.sequence_length, run.replay
    return replay.gather(batch_tensors(replay.sample_rows(B, T), run.device))


def sample_staged(run: "Run", staging: "PinnedBatches") -> dict[str, torch.Tensor]:
    """`sample_batch` on CUDA: sampled into a pinned buffer and sent without blocking (the frames' rows only, when they
    are on the device, which gathers them)."""
    B, T, replay = run.args.batch_size, run.args.sequence_length, run.replay
    if isinstance(replay, FrameStoreReplay):
        replay.sample_rows(B, T, out=staging.host_arrays())
        return replay.gather(staging.to_device())
    replay.sample(B, T, out=staging.host_arrays())
    return staging.to_device()


def install_speed(run: "Run") -> None:
    """Part 2 in one call from the run's set-up (LeanRL's executables block): each Part 1 function with a faster
    equivalent here gets it in its place, unless its flag turns it off, and each is checked against the function it
    replaces before anything trains (`check_fast_paths`: FastPathMismatch). Nothing in Part 1 changes. The agent's
    own (`speed_up_agent`), then the run's: CUDA graphs of the update steps and the policy, pinned transfers, the
    frames on the device."""
    args, device = run.args, run.device
    speed_up_agent(run.agent, args)
    capture = captures_updates(args, device)
    run.world_model_step, run.behavior_step = make_update_steps(run.agent, args)
    if device.type == "cuda":
        run.player = CudaPlayer(run.agent, args.num_envs, capture=capture)
    frames_device = replay_frames_device(args, device, run.obs_shape)
    if frames_device is not None:
        run.replay = FrameStoreReplay(
            run.replay.capacity, args.num_envs, seed=args.seed, frames_device=frames_device
        )
        run.sample_batch = sample_gathered
    if device.type == "cuda":
        # memory: batches are sampled into two reused pinned buffers and copied without blocking
        staging = PinnedBatches(staging_template(args, run.obs_shape, frames_device is not None), run.device)
        run.sample_batch = functools.partial(sample_staged, staging=staging)


def make_update_steps(agent: "Agent", args: Args) -> tuple[Callable, Callable]:
    """The update steps (`update_steps`), captured in CUDA graphs where `captures_updates`."""
    world_model_step, behavior_step = update_steps(agent, args)
    if captures_updates(args, agent.device):
        settings = capture_settings(agent)
        return CudaGraphed(world_model_step, settings=settings), CudaGraphed(behavior_step, settings=settings)
    return world_model_step, behavior_step


def speed_up_agent(agent: "Agent", args: Args) -> None:
    """The agent's faster equivalents (the settings as tensors, the fast observe and imagination, the CPU decoder
    layer, channels-last convolutions, then --compile), each checked against Part 1's function first
    (FastPathMismatch)."""
    wm, device = agent.world_model, agent.device
    agent.settings = SettingsTensors(agent.settings, device, next(wm.parameters()).dtype)
    if args.fast_observe:
        agent.observe = FastObserve(wm.rssm, hand_written_backward=args.observe_backward == "hand-written")
    if args.fast_imagine:
        agent.imagine = FastImagine()
    if args.fast_decoder and device.type == "cpu" and isinstance(wm.decoder, AtariConvDecoder):
        wm.decoder.net[-1] = SubpixelTransposedConv.sharing(wm.decoder.net[-1])
    if args.channels_last:
        wm.encoder.to(memory_format=torch.channels_last)
        wm.decoder.to(memory_format=torch.channels_last)
    check_fast_paths(agent, args)
    if args.compile:
        compile_agent(agent)


# =====================================================================================================================
# PART 3: THE RUN
# Input checks, logging, video and the ball measure, memory wiring and checkpoints: what makes a run safe and
# observable. Nothing here changes what is learned.
# =====================================================================================================================


# exit statuses: 2 = bad input (argument or file); the others say why a run stopped early
EXIT_BAD_INPUT = 2


EXIT_OOM = 3


EXIT_LEAK = 4


EXIT_NONFINITE = 5


EXIT_WRITE_FAILED = 6  # a checkpoint the run cannot go on without (final, signal, OOM) could not be written


EXIT_FAST_PATH = 7  # a fast path computes something other than the readable function it replaces


CHECKPOINT_FORMAT = "dreamer_atari/1"


OOM_ADVICE = (
    "Flags that lower the peak: --amp bf16 (or fp16 on CUDA), a smaller --batch-size or --sequence-length, a "
    "shorter --imagination-horizon, and PYTORCH_ALLOC_CONF=expandable_segments:True (set by default)."
)


# --- Input checks -----------------------------------------------------------------------------------------------------


class ArgsError(ValueError):
    """One sentence about one bad input value."""


def check_args(args: Args) -> None:
    """Raise ArgsError naming the first bad value and what is allowed. Builds one env at most, writes nothing."""
    if args.model not in MODELS:
        raise ArgsError(f"--model must be one of {', '.join(MODELS)}, got {args.model!r}.")
    if args.initial_state not in ("learned", "zeros"):
        raise ArgsError(f"--initial-state must be learned or zeros, got {args.initial_state!r}.")
    if args.observe_backward not in ("hand-written", "autograd"):
        raise ArgsError(
            f"--observe-backward must be hand-written or autograd, got {args.observe_backward!r}."
        )
    check_ranges(args)
    check_model_sizes(args)
    check_env(args)
    if args.resume is not None and not os.path.isfile(args.resume):
        raise ArgsError(f"--resume {args.resume!r} does not exist or is not a file.")


def check_ranges(args: Args) -> None:
    """The numbers that must be positive, non-negative, within 0 and 1, or greater than 0."""
    positive = {
        "--total-timesteps": args.total_timesteps,
        "--frame-stack": args.frame_stack,
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
        "--video-every": args.video_every,
    }
    for flag, value in non_negative.items():
        if value < 0:
            raise ArgsError(f"{flag} must be 0 or more, got {value}.")
    if not args.image_loss_scale >= 0:
        raise ArgsError(f"--image-loss-scale must be 0 or more, got {args.image_loss_scale}.")
    if not args.train_ratio > 0:
        raise ArgsError(f"--train-ratio must be greater than 0, got {args.train_ratio}.")
    if not 0.0 < args.gamma <= 1.0:  # the imagination weights divide by it
        raise ArgsError(f"--gamma must be greater than 0 and at most 1, got {args.gamma}.")
    for flag, value in {
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
        "--world-model-eps": args.world_model_eps,
        "--actor-eps": args.actor_eps,
        "--critic-eps": args.critic_eps,
    }.items():
        if not value > 0:
            raise ArgsError(f"{flag} must be greater than 0, got {value}.")


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
    if problem := MODELS[args.model].size_problem(args):
        raise ArgsError(problem)


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
        # builds the env once, before anything is written
        space = gym.make(spec, **env_kwargs(args.env_id, args)).observation_space
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
    """Print how much host memory the replay grows to, and warn when that is more than this machine has free."""
    # memory: the replay is the run's largest host allocation: say its size before it grows, not at 3 a.m.
    full = capacity * ((0 if frames_on_device else math.prod(obs_shape[1:])) + REPLAY_AUX_BYTES_PER_STEP)
    available = psutil.virtual_memory().available
    print(
        f"replay: up to {capacity:,} steps, about {full / 2**30:.2f} GiB of host memory when full "
        f"({available / 2**30:.1f} GiB available now)"
    )
    if full > 0.8 * available:
        print(
            f"replay: warning: a full replay would take more than 80 % of the memory available now; "
            f"--buffer-capacity {int(0.5 * available / (full / capacity)):,} would take about half"
        )


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
    error = ((grey_frames(model).astype(np.int16) - grey_frames(truth) + 256) // 2).astype(
        np.uint8
    )  # (n, T, S, S)
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


BALL_MAX_SIDE = (
    6 / 160,
    8 / 210,
)  # width, height: at most the ball (2 x 4 screen pixels) seen twice, max-pooled


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


def log_open_loop(
    agent: Agent,
    replay: "EpisodeReplay",
    args: Args,
    writer: SummaryWriter,
    run_dir: str,
    step: int,
    rng: np.random.Generator,
    num_sequences: int = 4,
) -> str:
    """Open-loop predictions of replayed sequences as an animated GIF (in colour when the model reads colour): in
    TensorBoard's image tab (and wandb's media, which syncs it as a video) under `videos/open_loop`, and as
    `open_loop/step_<N>.gif` in the run dir. On
    Pong, beside it, how well the predictions draw the ball (`open_loop_ball_scores`: F1, precision, recall,
    centroid distance and F1's chance level per horizon) over RECALL_SEQUENCES sequences.
    Uses its own random generators, so the training batches and latents that follow are the same with or
    without it."""
    import io

    from PIL import Image
    from tensorboard.compat.proto.summary_pb2 import Summary

    # Pong: the ball scored over more sequences than the GIF shows (its first `num_sequences`)
    batch = replay.sample(
        RECALL_SEQUENCES if is_pong(args.env_id) else num_sequences, args.sequence_length, rng=rng
    )
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
    path = os.path.join(run_dir, "open_loop", f"step_{step}.gif")
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


def preflight(agent: Agent, args: Args, obs_shape: tuple) -> None:
    """Create all optimizer state now with a worst-case batch; weights and moments are left untouched. Then say what
    the whole run takes at the rate of that update (`say_run_time`)."""
    seconds = {}  # the worst-case update's parts, timed

    def step_fn():
        start = time.perf_counter()
        batch = synthetic_batch(args, obs_shape)
        data = batch_to_device(batch, agent.num_actions, agent.device, args.channels_last)
        with agent.amp.autocast():
            loss, _, (deter, stoch) = world_model_loss(agent, data, args)
        loss.backward()
        seconds["world_model"] = seconds_since(start, agent.device)
        start = time.perf_counter()
        deter, stoch = deter.detach().flatten(0, 1), stoch.detach().flatten(0, 1)  # (B*T, D), (B*T, S)
        states = (deter, stoch, torch.ones(deter.shape[0], device=agent.device))
        with agent.amp.autocast():
            actor_loss, critic_loss, _ = behavior_losses(agent, states, args, update_norm=False)
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
    say_run_time(agent, args, obs_shape, seconds)


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


def attach_memory_probes(agent: Agent, probes: "mu.StageProbes") -> None:
    """--memory-probes: record memory at the stages of a world-model update, from outside the update: forward hooks
    on the encoder, the prior (which `RSSM.observe` runs once, after its loop) and the decoder, and hooks on the
    world model's optimizer step (before it: after the backward pass and the clip; after it). The forward hooks
    record only with gradients on, which leaves out acting, imagination and the open-loop videos."""
    wm = agent.world_model
    for module, stage in (
        (wm.encoder, "after_encoder"),
        (wm.rssm.prior_net, "after_rssm"),
        (wm.decoder, "after_decoder"),
    ):
        module.register_forward_hook(
            lambda *_, stage=stage: probes(stage) if torch.is_grad_enabled() else None
        )
    agent.world_model_optimizer.register_step_pre_hook(lambda *_: probes("after_backward"))
    agent.world_model_optimizer.register_step_post_hook(lambda *_: probes("after_optimizer_step"))


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
CATCH_ON_CPU = dict(
    env_id=CATCH_ID,
    model="nature",
    continue_mode=False,
    encoder_channels=(8, 16, 16),
    embed_dim=64,
    decoder_base_channels=8,
    decoder_mid_channels=8,
    deterministic_dim=64,
    stochastic_dim=8,
    stochastic_classes=8,
    hidden_dim=64,
    frame_stack=1,
    image_size=84,
    batch_size=8,
    sequence_length=16,
    imagination_horizon=10,
    total_timesteps=2_400,
    learning_starts=300,
    train_ratio=144.0,
    world_model_lr=2e-3,
    actor_lr=3e-4,
    critic_lr=1e-3,
    entropy_coef=1e-2,
)


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


# --- Memory: the replay's storage -------------------------------------------------------------------------------------


_MAPS_EXHAUSTED: list[OSError] = []  # the first failed map, so that the warning is said once


def mapped_arrays(shapes: dict[str, tuple[tuple, np.dtype]]) -> dict[str, np.ndarray]:
    """Uninitialised arrays of these (shape, dtype), all in one anonymous memory map of their own.

    memory: the replay keeps its storage out of the malloc heap. Its small arrays (a chunk's actions and rewards:
    tens of bytes) live for a whole turnover of the replay. In the heap, among the short-lived tensors of the
    updates, each one kept a page resident after the tensors around it were freed, and resident memory crept up
    turnover after turnover (benchmark/results/soak/README.md). A map of its own goes back to the system whole
    as soon as its last array is dropped. Where the system allows no more maps (Linux: `vm.max_map_count`, about
    65k, which a replay of many very short episodes can reach), the arrays go in the heap instead, said once."""
    fields = sorted(shapes.items(), key=lambda field: -np.dtype(field[1][1]).itemsize)  # each one aligned
    sizes = [math.prod(shape) * np.dtype(dtype).itemsize for _, (shape, dtype) in fields]
    try:
        block = mmap.mmap(-1, max(sum(sizes), 1))
    except OSError as exc:
        if not _MAPS_EXHAUSTED:
            _MAPS_EXHAUSTED.append(exc)
            print(
                f"replay: warning: no more memory maps ({exc.strerror}; Linux: sysctl vm.max_map_count); "
                "new replay arrays go in the heap, where host memory may creep",
                file=sys.stderr,
            )
        return {name: np.empty(shape, dtype) for name, (shape, dtype) in shapes.items()}
    arrays, offset = {}, 0
    for (name, (shape, dtype)), size in zip(fields, sizes):
        arrays[name] = np.frombuffer(block, dtype, math.prod(shape), offset).reshape(shape)
        offset += size
    return arrays


class ChunkBlocks:
    """The chunks of an episode's five arrays, mapped together (`mapped_arrays`): chunk i of every field lives in
    one map. The frames reach chunk i k - 1 steps before the rest; the map waits here for the others' views."""

    def __init__(self, shapes: dict[str, tuple[tuple, np.dtype]]):
        self.shapes = shapes
        self.waiting: dict[int, dict[str, np.ndarray]] = {}  # chunk index -> views not yet taken

    def take(self, name: str, index: int) -> np.ndarray:
        views = self.waiting.get(index)
        if views is None:
            views = self.waiting[index] = mapped_arrays(self.shapes)
        view = views.pop(name)
        if not views:
            del self.waiting[index]
        return view


class ChunkedArray:
    """A growable array kept as fixed-size numpy chunks, so it can grow without copying and drop its front.

    Logical indices run from `start` (first kept element) to `end` (one past the last). A finished episode is
    compacted into one exact-size array, so stored bytes match stored steps. `allocate(i)` gives chunk i's
    array.
    """

    def __init__(self, item_shape: tuple, dtype, chunk_size: int, allocate: Callable[[int], np.ndarray]):
        self.item_shape, self.dtype, self.chunk_size = tuple(item_shape), np.dtype(dtype), chunk_size
        self.allocate = allocate
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
            self.chunks.append(self.allocate(self.start // self.chunk_size + len(self.chunks)))
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

    def release(self) -> None:
        """Nothing to do: the arrays are freed with the episode that holds them."""

    def compact(self, exact: np.ndarray) -> None:
        """Replace the chunks by `exact`, an array of exactly len(self) items (frees the unused tail of the last
        chunk)."""
        if self.compacted:
            return
        self.read_into(exact, self.start, self.end)
        self.chunks = [exact]
        self.compacted = True


# --- Checkpoints ------------------------------------------------------------------------------------------------------


def replay_stats(replay: EpisodeReplay) -> dict[str, int]:
    """The replay's sizes from its real arrays, for `memory_utils.memory_report(buffer_stats=...)`: obs_bytes in host
    memory, obs_device_bytes in a `FrameStore` on the device."""
    store = getattr(replay, "store", None)
    return {
        "total_steps": replay.total_steps,
        "num_episodes": len(replay.episodes),
        "obs_bytes": sum(ep.frames.nbytes for ep in replay.episodes),
        "aux_bytes": sum(array.nbytes for ep in replay.episodes for array in ep.aux),
        "obs_device_bytes": 0 if store is None else store.nbytes,
    }


def replay_state(replay: EpisodeReplay) -> dict:
    """The replay for a checkpoint (--checkpoint-buffer): tensors only (loads with weights_only=True). Episodes being
    played are saved as ended: the emulators cannot be restored, so a resumed run starts fresh episodes."""
    saved = []
    for ep in replay.episodes:
        arrays = {}
        for name in ("frames", "action", "reward", "is_first", "is_terminal"):
            array = getattr(ep, name)
            exact = np.empty((len(array), *array.item_shape), array.dtype)
            array.read_into(exact, array.start, array.end)
            arrays[name] = torch.from_numpy(exact)
        saved.append(arrays)
    return {"episodes": saved, "rng": replay.rng.bit_generator.state}


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
        saved = {name: arrays[name].numpy() for name in Episode.FIELDS}
        host = {name: array for name, array in episode.arrays().items() if isinstance(array, ChunkedArray)}
        exact = mapped_arrays({name: (saved[name].shape, saved[name].dtype) for name in host})
        for name, array in host.items():
            exact[name][:] = saved[name]
            array.chunks, array.end, array.compacted = [exact[name]], len(saved[name]), True
        if not isinstance(episode.frames, ChunkedArray):
            for frame in saved["frames"][stack:]:
                episode.frames.append(frame)
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
        "scalers": {name: scaler.state_dict() for name, scaler in agent.scalers.items()},
        "counters": dict(counters),
        "rng": {
            "torch": torch.get_rng_state(),
            "python": random.getstate(),
            "numpy": None if rng is None else rng.bit_generator.state,
        },
        "replay": replay_state(replay) if (replay is not None and args.checkpoint_buffer) else None,
    }
    if torch.cuda.is_available() and agent.device.type == "cuda":
        state["rng"]["cuda"] = torch.cuda.get_rng_state(agent.device)
    # a crash or a full disk while writing never leaves a half-written checkpoint behind (mu.WriteFailed); the
    # checksum beside it (checkpoint.pt.sha256) lets a resumed run refuse a file changed since
    mu.save_checked(path, lambda f: torch.save(state, f), needed_bytes=mu.estimate_nbytes(state))
    return path


def load_checkpoint(path: str) -> dict:
    """Verify against its archive's own CRC-32s and the checksum beside it (`mu.verify_checkpoint`), then load with
    weights_only=True; any failure is one ArgsError sentence, and the file stays where it is."""
    if not os.path.isfile(path):
        raise ArgsError(f"--resume {path!r} does not exist or is not a file.")
    try:
        if note := mu.verify_checkpoint(path):
            print(note)
    except mu.CheckpointInvalid as exc:
        raise ArgsError(f"--resume: {exc}")
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
    "model",
    "image_size",
    "frame_stack",
    "rgb",
    "encoder_channels",
    "embed_dim",
    "decoder_base_channels",
    "decoder_mid_channels",
    "deterministic_dim",
    "stochastic_dim",
    "stochastic_classes",
    "hidden_dim",
    "reward_bins",
    "initial_state",
)


FLAGS_BEFORE_THEY_EXISTED = {
    "model": "nature",
    "image_size": 84,
    "frame_stack": 4,
    "rgb": False,
    "initial_state": "zeros",
}


def check_checkpoint_matches(state: dict, args: Args) -> None:
    """The flags that shape the networks must be the ones the checkpoint was trained with."""
    for name in MODEL_FLAGS:
        # checkpoints written before --model, --image-size, --frame-stack and --rgb existed: the nature model, 84-pixel
        # frames, stacks of 4
        saved, wanted = state["args"].get(name, FLAGS_BEFORE_THEY_EXISTED.get(name)), getattr(args, name)
        if isinstance(wanted, tuple):
            saved = tuple(saved) if saved is not None else None
        if saved != wanted:
            flag = "--" + name.replace("_", "-")
            raise ArgsError(
                f"--resume checkpoint was trained with {flag} {saved}, but this run asks for {wanted}."
            )


def load_optimizer(optimizer: torch.optim.Optimizer, state: dict) -> None:
    """torch's `load_state_dict` replaces each param group, learning-rate tensor included: the saved rate goes into
    the optimizer's own device tensor instead, which `SettingsTensors` and a captured update hold (a rate that is a
    float, with the speed options off, is the saved one as a float)."""
    rates = [group["lr"] for group in optimizer.param_groups]
    optimizer.load_state_dict(state)
    for group, rate in zip(optimizer.param_groups, rates):
        if isinstance(rate, torch.Tensor):
            rate.fill_(float(group["lr"]))
            group["lr"] = rate
        else:
            group["lr"] = float(group["lr"])


def restore_checkpoint(state: dict, agent: Agent, replay: EpisodeReplay, rng: np.random.Generator) -> dict:
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
    if state.get("replay") is not None:
        load_replay_state(replay, state["replay"])
    return dict(state["counters"])


# --- Logging and the run's set-up -------------------------------------------------------------------------------------


REWARD_COUNT_KEYS = ("reward_nonzero", "reward_hits", "reward_zero", "reward_false_alarms")


def reward_prediction_counts(predicted: torch.Tensor, reward: torch.Tensor) -> dict[str, torch.Tensor]:
    """How well the reward head predicts the rewards of real data (posterior states), as counts over (B, T).

    A nonzero reward is a hit when the prediction has its sign and at least half its size; a zero reward is a
    false alarm when the prediction is 0.5 or more in size. `reward_quality` turns the counts into rates.
    """
    nonzero = reward != 0
    hits = nonzero & (predicted * torch.sign(reward) >= 0.5 * reward.abs())
    false_alarms = ~nonzero & (predicted.abs() >= 0.5)
    counts = (nonzero, hits, ~nonzero, false_alarms)
    return {f"debug/{key}": count.float().sum() for key, count in zip(REWARD_COUNT_KEYS, counts)}


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


class UpdateLog:
    """What the updates log, summed on the device between two log points and read with one host transfer per log
    interval, so that no update waits for the host. The values of an update whose step was skipped (a non-finite
    loss or gradient) are left out of the means; such updates are counted, with the longest run of them in a row.
    """

    def __init__(self, device):
        self.device = torch.device(device)
        self.sums: dict[
            tuple[str, ...], torch.Tensor
        ] = {}  # keys -> (len(keys) + 1,): value sums, then count
        self.streak = torch.zeros((), device=self.device)  # non-finite updates in a row, now
        self.longest = torch.zeros((), device=self.device)  # the longest such run since the last `pop`
        self.skipped = torch.zeros((), device=self.device)  # non-finite updates since the last `pop`
        self.seen: dict[str, torch.Tensor] = {}  # key -> (2,): its sum and count at the last `recent`

    def add(self, metrics: dict[str, torch.Tensor], healthy: torch.Tensor) -> None:
        """The named 0-d values of one part of an update, and whether that part was healthy (0-d bool)."""
        keys = tuple(metrics)
        # memory: only detached values are summed, so no update's graph stays alive until the log point
        values = torch.stack([value.detach() for value in metrics.values()])
        row = torch.cat([torch.where(healthy, values, 0.0), healthy.detach().float().reshape(1)])
        if keys in self.sums:
            self.sums[keys] += row
        else:
            self.sums[keys] = row

    def end_update(self, healthy: torch.Tensor) -> None:
        """Once per update, with whether all of its parts were healthy."""
        faulty = ~healthy.detach()
        self.streak.add_(1.0).mul_(faulty)
        torch.maximum(self.longest, self.streak, out=self.longest)
        self.skipped.add_(faulty)

    def pop(self) -> tuple[dict[str, float], int, int]:
        """(means of each key over its healthy updates, updates skipped, longest run of skipped updates in a row),
        since the last call; then starts again (a run still going on carries over)."""
        groups = list(self.sums.items())
        flat = torch.cat(
            [row for _, row in groups] + [self.skipped.reshape(1), self.longest.reshape(1)]
        ).tolist()
        means, offset = {}, 0
        for keys, _ in groups:
            count = flat[offset + len(keys)]
            if count > 0:
                means.update({key: flat[offset + i] / count for i, key in enumerate(keys)})
            offset += len(keys) + 1
        self.sums, self.seen = {}, {}
        self.skipped.zero_()
        self.longest.copy_(self.streak)
        return means, int(flat[-2]), int(flat[-1])

    def recent(self, key: str) -> float | None:
        """The mean of `key` over the healthy updates since the last call (or the last `pop`), for the status line:
        one host transfer, every 30 s, never per update. The sums go on to `pop` as they are. None when no healthy
        update logged it since."""
        for keys, row in self.sums.items():
            if key in keys:
                now = row[[keys.index(key), -1]]  # (2,): the sum and the count (a copy)
                since = now - self.seen[key] if key in self.seen else now
                self.seen[key] = now
                total, count = since.tolist()
                return total / count if count > 0 else None
        return None

    def state(self) -> dict:
        """The sums since the last log point as plain numbers, for a checkpoint: a run resumed from it logs the
        interval it stopped in with the updates made before the stop, as an uninterrupted run would."""
        return {
            "sums": {"|".join(keys): row.tolist() for keys, row in self.sums.items()},
            **{name: float(getattr(self, name)) for name in ("streak", "longest", "skipped")},
        }

    def restore(self, state: dict) -> None:
        self.seen = {}
        self.sums = {
            tuple(keys.split("|")): torch.tensor(row, device=self.device)
            for keys, row in state["sums"].items()
        }
        for name in ("streak", "longest", "skipped"):
            getattr(self, name).fill_(state[name])


class ProgressLine:
    """step, SPS, last return, RSS, GPU alloc, ETA. On a terminal the line is rewritten about once a second;
    in a log file it is printed once per log interval.

    The ETA comes from the recent rate, not the average since the start: random prefill steps cost nothing
    next to training steps, so an average that includes them promises a day-long run in minutes. The rate is
    taken over the last `window` log points within the current phase (a phase starts where updates start and
    where behaviour learning starts); during the prefill there is no training rate yet, and the ETA says so.
    """

    def __init__(self, total: int, device: torch.device, phase_starts: tuple[int, ...] = (), window: int = 5):
        self.total, self.device = total, device
        self.phase_starts = sorted(set(phase_starts))
        self.updates_start = self.phase_starts[0] if self.phase_starts else 0
        self.points: deque[tuple[float, int]] = deque(maxlen=window + 1)  # (time, step) of the current phase
        self.phase = -1
        self.live = sys.stdout.isatty()
        self.last_refresh = 0.0
        self.pending = False  # a live line without its newline is on screen

    def mark(self, step: int, now: float | None = None) -> None:
        """Record (time, step); call at every log point. A new phase forgets the previous phase's points."""
        now = time.time() if now is None else now
        phase = sum(step >= start for start in self.phase_starts)
        if phase != self.phase:
            self.phase = phase
            self.points.clear()
        self.points.append((now, step))

    def eta_s(self, step: int, now: float | None = None) -> float | None:
        """Seconds left at the recent rate; None during the prefill or before the phase has a measured rate."""
        now = time.time() if now is None else now
        if step < self.updates_start or not self.points:
            return None
        first_time, first_step = self.points[0]
        if step <= first_step or now - first_time < 1e-6:
            return None
        return (self.total - step) * (now - first_time) / (step - first_step)

    def text(
        self,
        step: int,
        sps: float,
        last_return: float | None,
        rss_mb: float,
        gpu_mb: float | None,
        now: float | None = None,
    ) -> str:
        eta_s = self.eta_s(step, now)
        if eta_s is not None:
            eta = f"{int(eta_s // 3600)}:{time.strftime('%M:%S', time.gmtime(eta_s))}"
        else:
            eta = "-- (prefill)" if step < self.updates_start else "--"
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


@dataclass
class Run:
    """Everything one training run holds between loop iterations; made by `set_up`: first the learner (agent,
    replay, update steps), then the instruments that watch it (`instrument`)."""

    args: Args
    device: torch.device
    run_name: str
    run_dir: str
    writer: SummaryWriter
    agent: Agent
    replay: EpisodeReplay
    player: Player
    rng: np.random.Generator
    counters: dict
    world_model_step: Callable
    behavior_step: Callable
    update_log: UpdateLog
    obs_shape: tuple
    # what `train` samples with: `sample_batch`, or Part 2's (`install_speed`), called as run.sample_batch(run)
    sample_batch: Callable = sample_batch
    # instruments and schedules (`instrument`)
    probes: "mu.StageProbes | None" = None
    snapshots: "mu.MemorySnapshots | None" = None
    leak_detector: "mu.LeakDetector | None" = None
    progress: ProgressLine | None = None
    status: "mu.StatusLine | None" = None
    next_log: int = 0
    next_checkpoint: int | None = None
    next_video: int | None = None
    video_rng: np.random.Generator | None = None
    start_time: float = dataclasses.field(default_factory=time.time)
    start_step: int = 0
    start_updates: int = 0
    seconds_before: float = 0.0  # training time of the earlier parts of a resumed run
    last_report: dict = dataclasses.field(default_factory=dict)
    last_return: float | None = None
    last_verdict: "mu.LeakVerdict | None" = None
    said_replay_short: bool = False
    stop: mu.StopSignals = dataclasses.field(default_factory=mu.StopSignals)  # read at the loop's top

    @property
    def checkpoint_path(self) -> str:
        return os.path.join(self.run_dir, "checkpoint.pt")

    @property
    def step(self) -> int:
        return self.counters["global_step"]

    def sps(self) -> float:
        return (self.step - self.start_step) / max(time.time() - self.start_time, 1e-9)


def check_input(args: Args) -> tuple[torch.device, dict | None]:
    """Validate everything before anything starts or is written; bad input exits 2 with one sentence. Returns the
    device and the checkpoint to resume from."""
    try:
        check_args(args)
        device = torch.device("cuda" if torch.cuda.is_available() and args.cuda else "cpu")
        try:
            amp = mu.amp(args.amp, device)
        except ValueError as exc:
            raise ArgsError(f"--amp {args.amp} is not available here: {exc}.")
        if captures_updates(args, device) and amp.dtype == torch.float16:
            raise ArgsError(
                f"CUDA-graph capture (on by default on CUDA) takes --amp off or bf16, got --amp {args.amp} "
                f"(fp16's loss scaling is not captured); add --no-cudagraph to run fp16 eagerly."
            )
        if args.compile and args.memory_probes:
            raise ArgsError(
                "--memory-probes measures eager updates (its hooks cannot run inside compiled modules); run without "
                "--compile."
            )
        if captures_updates(args, device) and args.memory_probes:
            raise ArgsError(
                "--memory-probes measures eager updates (a captured graph runs no Python); add "
                "--no-cudagraph."
            )
        resume_state = load_checkpoint(args.resume) if args.resume else None
        if resume_state is not None:
            check_checkpoint_matches(resume_state, args)
        check_actions_change_frames(make_env(args.env_id, 0, False, "", args), args.env_id, args.seed)
    except ArgsError as exc:
        exit_with(f"error: {exc}", EXIT_BAD_INPUT)
    return device, resume_state


NEW_COUNTERS = {
    "global_step": 0,
    "updates": 0,
    "behavior_updates": 0,
    "updates_owed": 0.0,
    "nonfinite_updates": 0,
    "episodes": 0,
    "train_seconds": 0.0,  # wall time of this run, summed over its resumed parts
}


def set_up(args: Args) -> Run:
    """The run, in the order it is made: the input checked (bad input exits 2 before anything is written), its
    folder and logs, the learner (`build_learner`), a resumed run's state restored, then the instruments that watch
    it."""
    mu.configure_allocator(verbose=False)  # memory: before anything touches CUDA
    mu.one_malloc_arena()  # memory: before TensorBoard's and wandb's threads, whose own heaps are never trimmed
    device, resume_state = check_input(args)
    run_name, run_dir, writer = open_run(args, resume_state)
    seed_everything(args, device)
    run = build_learner(args, device, run_name, run_dir, writer)
    say_replay_size(
        run.replay.capacity, run.obs_shape, frames_on_device=isinstance(run.replay, FrameStoreReplay)
    )
    if resume_state is not None:
        try:
            run.counters.update(restore_checkpoint(resume_state, run.agent, run.replay, run.rng))
        except ArgsError as exc:
            writer.close()
            exit_with(f"error: {exc}", EXIT_BAD_INPUT)
        try:  # the fast paths on the weights the run goes on with
            check_fast_paths(run.agent, args)
        except FastPathMismatch as exc:
            writer.close()
            exit_with(
                f"error: {exc} (on the weights of --resume {args.resume!r}, left as it is)", EXIT_FAST_PATH
            )
        print(f"resumed {run_name} at step {run.counters['global_step']} ({run.counters['updates']} updates)")
        resume_state = None  # memory: the loaded tensors are now inside the modules; drop the copies
    probes = mu.StageProbes(enabled=args.memory_probes, device=device)
    if args.memory_probes:  # before the first update (a captured one would record nothing)
        attach_memory_probes(run.agent, probes)
    instrument(run, probes)
    return run


def open_run(args: Args, resume_state: dict | None) -> tuple[str, str, SummaryWriter]:
    """The run's folder (`runs/{run_name}`, claimed atomically: a name another run already holds gets a suffix;
    a resumed run goes on in its own), TensorBoard and, with --track, wandb. Returns (run name, folder, writer)."""
    if resume_state is not None:
        run_name = resume_state["run_name"]
        run_dir = f"runs/{run_name}"
    else:
        wanted = f"{args.env_id.replace('/', '_')}__{args.exp_name}__{args.seed}__{int(time.time())}"
        run_dir, run_name = mu.claim_run_dir("runs", wanted)
    if args.track:
        import wandb

        wandb.init(
            project=args.wandb_project_name,
            entity=args.wandb_entity,
            sync_tensorboard=True,
            config=vars(args),
            name=run_name,
            id=run_name,
            dir=os.getcwd(),  # ./wandb beside ./runs, also when an earlier run in this process set another place
            resume="allow",
            monitor_gym=True,
            save_code=True,
        )
    # absolute: wandb's service process resolves a relative path against its own folder, which is that of the
    # first tracked run of this Python process
    # a resumed run hides what the stopped one logged after its checkpoint (TensorBoard's purge): no step twice
    purge_step = resume_state["counters"]["global_step"] + 1 if resume_state is not None else None
    writer = SummaryWriter(os.path.abspath(run_dir), purge_step=purge_step)
    mu.keep_events_on_write_errors(writer)  # a full disk: one warning line, events dropped, training goes on
    writer.add_text(
        "hyperparameters",
        "|param|value|\n|-|-|\n" + "\n".join(f"|{key}|{value}|" for key, value in vars(args).items()),
    )
    return run_name, run_dir, writer


def seed_everything(args: Args, device: torch.device) -> None:
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
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


def build_learner(
    args: Args, device: torch.device, run_name: str, run_dir: str, writer: SummaryWriter
) -> Run:
    """Part 1's learner (agent, replay, player, update steps), Part 2's faster equivalents put in place and checked
    (`install_speed`; a mismatch exits 7), and the optimizer state made by the preflight. Out of memory here (the
    worst-case update does not fit) is a report and exit 3 before any training."""
    # the env workers start with the loop, where one `finally` closes them whatever happens; until then one env
    # gives the shapes (an async worker left open would block this process's exit: workers ignore SIGTERM)
    obs_shape, num_actions = env_spaces(args)  # (--frame-stack, S, S), number of actions
    if device.type == "cuda":
        mu.install_oom_observer(run_dir)
    try:
        agent = build_agent(args, obs_shape, num_actions, device)
        world_model_step, behavior_step = update_steps(agent, args)
        run = Run(
            args=args,
            device=device,
            run_name=run_name,
            run_dir=run_dir,
            writer=writer,
            agent=agent,
            replay=EpisodeReplay(replay_capacity(args), args.num_envs, seed=args.seed),
            player=Player(agent, args.num_envs),
            rng=np.random.default_rng(args.seed),
            counters=dict(NEW_COUNTERS),
            world_model_step=world_model_step,
            behavior_step=behavior_step,
            update_log=UpdateLog(device),
            obs_shape=obs_shape,
        )
        try:
            install_speed(run)
        except FastPathMismatch as exc:
            writer.close()
            exit_with(f"error: {exc}", EXIT_FAST_PATH)
        if args.preallocate:
            preflight(agent, args, obs_shape)
        return run
    except torch.OutOfMemoryError as exc:
        agent = run = None  # memory: the half-built learner goes before the report
        oom = mu.out_of_memory(exc, __file__, run_dir, device=device, advice=OOM_ADVICE)
        writer.close()
        exit_with(
            f"out of memory at start-up ({oom.where}), before any training: a worst-case update (--batch-size "
            f"{args.batch_size} x --sequence-length {args.sequence_length}) does not fit here.\n{oom.diagnosis}",
            EXIT_OOM,
        )


def instrument(run: Run, probes: "mu.StageProbes") -> None:
    """What watches the run: memory probes, allocator snapshots, the leak detector, the disk check, the progress
    line; and the schedule of log points, checkpoints and videos (from the step a resumed run starts at)."""
    args, counters, step = run.args, run.counters, run.step
    if "update_log" in counters:  # resumed: the updates the stopped run made since its last log point
        run.update_log.restore(counters.pop("update_log"))
    # a full disk: say so now, not at the first checkpoint
    checkpoints = args.save_model or args.checkpoint_every
    if checkpoints and (warning := mu.disk_space_warning(run.run_dir, checkpoint_nbytes(run))):
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
    run.progress = ProgressLine(
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
    if args.video_every:
        run.next_video = (step // args.video_every + 1) * args.video_every
    run.video_rng = np.random.default_rng([args.seed, step])
    run.start_step, run.start_updates = step, counters["updates"]
    run.seconds_before = counters.get("train_seconds", 0.0)  # a checkpoint from before this counter has none


def checkpoint_nbytes(run: Run) -> int:
    """About how large a checkpoint of this run is: the modules, the optimizer state and, with
    --checkpoint-buffer, the replay at capacity."""
    nbytes = mu.estimate_nbytes(
        [
            {n: m.state_dict() for n, m in run.agent.modules().items()},
            [o.state_dict() for o in run.agent.optimizers],
        ]
    )
    if run.args.checkpoint_buffer:
        nbytes += run.replay.capacity * (math.prod(run.obs_shape[1:]) + REPLAY_AUX_BYTES_PER_STEP)
    return nbytes


def diagnose(run: Run) -> None:
    """Per loop iteration, all cheap unless asked for: open-loop videos, stage probes, allocator snapshots and the
    live progress line."""
    args, step = run.args, run.step
    if run.next_video is not None and step >= run.next_video and run.counters["updates"] > 0:
        run.next_video = (step // args.video_every + 1) * args.video_every
        try:
            log_open_loop(run.agent, run.replay, args, run.writer, run.run_dir, step, run.video_rng)
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
    interval_means, skipped, longest_skipped_run = run.update_log.pop()  # the interval's one host sync
    counters["nonfinite_updates"] += skipped
    scalars = {
        **run.last_report,
        **reward_quality(interval_means),
        **interval_means,
        **run.probes.scalars(),
        "charts/SPS": sps,
        "charts/updates_per_second": (counters["updates"] - run.start_updates) / elapsed,
        "charts/updates": float(counters["updates"]),
        "charts/train_seconds": run.seconds_before + elapsed,
        "debug/nonfinite_updates": float(counters["nonfinite_updates"]),
    }
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
    if longest_skipped_run >= args.max_nonfinite:
        checkpoint(run, "non-finite losses")
        exit_with(
            f"stopping: {longest_skipped_run} updates in a row had a non-finite loss or gradient (each step was "
            f"skipped, so the checkpoint holds the last finite weights); try --amp off or lower learning rates.",
            EXIT_NONFINITE,
        )
    if verdict.abort and args.abort_on_leak:
        checkpoint(run, "leak detected")
        exit_with(f"stopping (--abort-on-leak): {verdict.diagnosis}", EXIT_LEAK)


def checkpoint(run: Run, reason: str, required: bool = True, check: bool = False) -> None:
    """A checkpoint that fails to write (a full disk): `required` (the final one, a signal's, an OOM's) ends the run
    with one sentence and EXIT_WRITE_FAILED; otherwise one warning line and the last good one stays. With `check` (the
    periodic and final ones) the fast paths are then held to the readable functions on the live weights
    (`check_fast_paths`); a mismatch stops the run, the checkpoint written, with EXIT_FAST_PATH."""
    run.counters["train_seconds"] = run.seconds_before + time.time() - run.start_time
    # the updates since the last log point, so that a resumed run logs their means with the next interval
    counters = {**run.counters, "update_log": run.update_log.state()}
    try:
        save_checkpoint(run.checkpoint_path, run.agent, counters, run.run_name, run.args, run.replay, run.rng)
    except mu.WriteFailed as exc:
        if not required:
            run.progress.say(f"warning: {exc}; checkpoint ({reason}) not written, the last good one is kept")
            return
        exit_with(
            f"stopping: {exc}; the run cannot go on without this checkpoint ({reason}).", EXIT_WRITE_FAILED
        )
    run.progress.say(f"checkpoint ({reason}): {run.checkpoint_path} at step {run.step}")
    if check:
        try:
            check_fast_paths(run.agent, run.args)
        except FastPathMismatch as exc:
            exit_with(f"stopping at step {run.step}, its checkpoint written: {exc}", EXIT_FAST_PATH)


def say_replay_short(run: Run) -> None:
    """Once: the updates wait for the replay to hold one sequence."""
    if not run.said_replay_short:
        run.said_replay_short = True
        run.progress.say(
            f"updates wait: the replay holds {run.replay.total_steps} steps, fewer than one sequence of "
            f"{run.args.sequence_length} (--sequence-length)"
        )


def stop_if_signalled(run: Run) -> None:
    """SIGINT or SIGTERM since the last iteration: a checkpoint, then exit 128 + N."""
    if run.stop.received:
        checkpoint(run, run.stop.name)
        raise SystemExit(run.stop.exit_code)


def say_status(run: Run) -> None:
    """Every 30 s of wall time (`mu.StatusLine`), however slow an update is: the step, env steps/s, updates/s, the
    ETA to --total-timesteps, the last episode's return and the world model's mean loss since the last status line
    (read from the device sums then: the line's one host transfer), printed and under `status/*` in TensorBoard."""
    args, step, updates = run.args, run.step, run.counters["updates"]
    if run.status.tick(step, updates):
        run.status.emit(
            step,
            updates,
            remaining_steps=args.total_timesteps - step,
            last_return=run.last_return,
            loss=run.update_log.recent("losses/world_model"),
            progress=f"step {step:,}/{args.total_timesteps:,}",
        )


def watch(run: Run) -> None:
    """After each env step: the open-loop videos, probes, snapshots and progress line (`diagnose`), the status line
    every 30 s, a log point every --log-interval env steps, a checkpoint every --checkpoint-every."""
    args = run.args
    diagnose(run)
    say_status(run)
    if run.step >= run.next_log:
        log_point(run)
    if run.next_checkpoint is not None and run.step >= run.next_checkpoint:
        run.next_checkpoint = (run.step // args.checkpoint_every + 1) * args.checkpoint_every
        # a full disk: a warning, the next interval tries again
        checkpoint(run, "periodic", required=False, check=True)


def finish(run: Run) -> None:
    """The end of training: the final checkpoint (--save-model) and the memory probes' verdict."""
    if run.args.save_model:
        checkpoint(run, "end of training", check=True)
    if run.args.memory_probes:
        run.progress.say(run.probes.verdict())


@contextlib.contextmanager
def guarded(run: Run, envs):
    """The loop's guard: SIGINT and SIGTERM are recorded from here on (and read at the top of the loop); an
    out-of-memory error gets a report, a checkpoint and exit 3; any other error a checkpoint, then its traceback; and
    whatever happens the snapshots, envs, TensorBoard and wandb are closed. While it runs, a status line comes at
    least every 30 s, also while an update outlasts that (`mu.StatusLine.keep_alive`)."""
    with run.stop, run.status.keep_alive():
        try:
            yield
        except torch.OutOfMemoryError as exc:
            out_of_memory(run, exc)
        except Exception as exc:
            # anything else (an env that crashed, a bug): keep what was trained, then show the traceback
            try:
                checkpoint(run, f"crashed with {type(exc).__name__}", required=False)
            except Exception as save_error:  # noqa: BLE001 - the original error is the one to show
                run.progress.say(f"could not write a checkpoint after the crash ({save_error})")
            raise
        finally:
            run.snapshots.close()
            envs.close()
            run.writer.close()
            if run.args.track:
                import wandb

                wandb.finish()


def out_of_memory(run: Run, exc: torch.OutOfMemoryError) -> None:
    """Any OOM of the loop (acting, sampling, an update, an open-loop video): a report, a checkpoint, exit 3."""
    oom = mu.out_of_memory(
        exc,
        __file__,
        run.run_dir,
        last_report=run.last_report,
        verdict=run.last_verdict,
        device=run.device,
        advice=OOM_ADVICE,
    )
    checkpoint(run, "out of memory")
    exit_with(f"out of memory at step {run.step} ({oom.where}):\n{oom.diagnosis}", EXIT_OOM)


if __name__ == "__main__":
    main(tyro.cli(Args))
