"""Split-head Double DQN for the StarCraft II minigames MoveToBeacon and CollectMineralShards.

The network reads the screen and minimap feature layers and the player vector and has a list of Q heads (HEADS):
one over non-spatial functions (no_op, select_army) and one over screen points, a map for each spatial
function (Move_screen(x, y), select_point(x, y): the latter lets the two marines of CollectMineralShards split).

    python dqn_starcraft_split.py --map-name MoveToBeacon            # built-in numpy minigame (CPU is fine)
    python dqn_starcraft_split.py --backend pysc2 --map-name MoveToBeacon  # the real game (SC2PATH)

Every `Args` field can also be set with an `RL_*` environment variable (RL_BATCH_SIZE=16, ...); the
command line wins over the variable, the variable over the default.

Writes, per run: `{save_path}/{run_id}/config.json` (values and where each came from), `train.log`,
`checkpoint.pt` and its checksum `checkpoint.pt.sha256`, `eval/test_results.json` (greedy test episodes),
`eval/curve.csv` (periodic greedy tests during training), `videos/*.mp4` (the final test episodes, with
`--capture-video`); TensorBoard events in `{log_dir}/{run_id}` (`charts/*`, `losses/*`, and the memory keys of
memory_utils); and one row per finished run in `{save_path}/results.csv`. Each run claims its folder when it
starts: a default run id that another run took already (same map, seed and second) gets a suffix (`-2`).

Exit status: 0 done; 2 a bad value (one sentence on stderr, nothing written); 130/143 stopped by
SIGINT/SIGTERM at the next agent step (checkpoint saved, no results row; before the first step nothing is left);
3 CUDA out of memory (report in `{run_id}/oom/`, checkpoint saved, no results row); 5 too many non-finite updates
or game steps in a row (neither reaches the weights or the replay; checkpoint of the last finite weights); 6 a file
the run needs could not be written; 8 an error in a run (checkpoint saved, traceback in `{run_id}/crash.log`).
`--resume {save_path}/{run_id}/checkpoint.pt` continues a stopped run in its folder (networks, optimizer,
scheduler, loss scaler, counters, RNG states; the replay, kept on disk in `{run_id}/replay/`), once the checkpoint matches
its checksum.

The file reads top to bottom in three parts, each opened by a banner: Part 1, the algorithm (the settings, the
environment, the replay buffer, the networks, the TD target and the update in the precision of --amp, acting, the
training loop; after them what each setting allows and, in a section of their own, the minigames); Part 2, speed
(the thread count); Part 3, the run (input checks, logging, video, memory wiring, checkpoints, results rows, run
folders, signals, `main`).
"""

import signal
import sys

if __name__ == "__main__":  # a stop signal while the libraries below load: exit 128 + N, nothing written yet
    for _signal in (signal.SIGINT, signal.SIGTERM):
        signal.signal(_signal, lambda signum, frame: sys.exit(128 + signum))

import contextlib
import csv
import dataclasses
import fcntl
import io
import json
import logging
import math
import os
import platform
import random
import shutil
import time
import types
import typing
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
import tyro

import memory_utils as mu

# =========================================================================================================
# Part 1: the algorithm. In reading order: the settings (Args, and the map defaults, filled in once when a run
# starts), the environment (what the agent sees, the action space, `make_env`), the replay buffer, the networks, the
# TD target and the update, acting, and the training loop (`train_one_seed`); after them what each setting allows
# (RULES) and, in a section of their own, the minigames. This is what trains, on every device and in every precision
# (--amp is PyTorch's mixed-precision recipe inside `update`). Nothing here names Part 2 or Part 3: the loop is handed
# the run's plumbing (folders, logs, checkpoints, memory reports, stop signals) as `run`, which Part 3 makes.
# =========================================================================================================


# Nothing changes a setting during a run: `args.x = y` is refused at once; the learning rate and epsilon follow the
# schedules their flags set (--lr-scheduler, --exploration-steps)
@mu.fixed_once_parsed(
    lambda name: (
        f"start the run with --{name.replace('_', '-')} (or RL_{name.upper()}) instead; a learning-rate "
        f"or epsilon schedule is a flag too (--lr-scheduler, --exploration-steps)"
    )
)
@dataclass(frozen=True)
class Args:
    # experiment
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """the name of this experiment (part of the default run id)"""
    seed: int = 1
    """seed of the experiment"""
    seeds: tuple[int, ...] = ()
    """run these seeds one after another (e.g. `--seeds 4 6 8`); empty: just `--seed`"""
    torch_deterministic: bool = True
    """if toggled, `torch.backends.cudnn.deterministic=True`"""
    cuda: bool = True
    """if toggled, CUDA is used when available"""
    track: bool = False
    """if toggled, the run is tracked with Weights and Biases (works offline with WANDB_MODE=offline)"""
    wandb_project_name: str = "sc2-split-dqn"
    """the wandb project name"""
    wandb_entity: str | None = None
    """the entity (team) of the wandb project"""
    save_model: bool = True
    """if toggled, the final model is saved to `{save_path}/{run_id}/checkpoint.pt`"""
    checkpoint_minutes: float = 15.0
    """also write a checkpoint at the first episode end after every this many minutes of wall time (0: not by time)"""
    checkpoint_every: int = 0
    """also write a checkpoint at the first episode end after every this many agent steps (0: not by steps)"""
    resume: str | None = None
    """path of a checkpoint to continue from, in the same run folder"""
    save_path: str = "results"
    """folder holding one sub-folder per run and the `results.csv` across runs"""
    run_id: str | None = None
    """name of the run folder; default `{map_name}__{exp_name}__{seed}__{unix time}`"""
    overwrite: bool = False
    """replace the results of an earlier run with the same `--run-id` (its folder, its TensorBoard events)"""
    log_dir: str = "runs"
    """TensorBoard events go to `{log_dir}/{run_id}`"""
    time_limit_min: float = 0.0
    """stop training after this many minutes of wall time, then run the test episodes (0: no limit)"""
    capture_video: bool = False
    """if toggled, the final test episodes are recorded to `{save_path}/{run_id}/videos/*.mp4`"""

    # environment
    backend: Literal["builtin", "pysc2"] = "builtin"
    """`builtin`: the numpy minigames in this file; `pysc2`: the real game (needs pysc2 and SC2PATH)"""
    map_name: Literal["MoveToBeacon", "CollectMineralShards"] = "MoveToBeacon"
    """the minigame"""
    res: int = 32
    """screen and minimap resolution (pixels per side)"""
    step_mul: int = 16
    """game loops per agent step (16 loops are one game second of the map's timer)"""
    screen_world_units: float = 24.0
    """world units across the feature screen, on both backends (pysc2's default camera width)"""

    # replay
    buffer_size: int = 100_000
    """replay capacity in agent steps"""
    replay_on_disk: bool = True
    """keep each stored step on disk too (`{run_id}/replay/`): a resume restores the replay; off: a resumed run
    starts with an empty replay"""
    replay_chunk_steps: int = 1024
    """agent steps per file of the replay on disk; the last, partial one goes in checkpoints"""

    # model (None: the map's default, MAP_DEFAULTS)
    tower_channels: int = 16
    """channels of the screen and minimap convolution towers"""
    fused_channels: int = 32
    """channels of the fused features that both Q heads read"""
    context_layers: int | None = None
    """dilated 3x3 convolutions over the fused features at quarter resolution (3: the whole screen at res 32)"""
    click_distance: bool | None = None
    """the click term also reads each unit class times the pixel's distance from the selected units"""
    timer_input: bool | None = None
    """the network also reads the share of the map's timer gone"""
    coarse_level: bool | None = None
    """the spatial head's coarse term is one level per spatial function (else an upsampled map)"""
    select_own_only: bool | None = None
    """select_point only on pixels of our own units"""
    move_through: float | None = None
    """world units by which a Move_screen click is carried on past the chosen pixel"""
    player_channels: int = 8
    """channels of the embedding of the player vector and the available actions, tiled over the screen"""
    nonspatial_hidden: int = 64
    """hidden units of the non-spatial head"""
    fine_kernel: int | None = None
    """kernel size of the spatial head's full-resolution click term"""
    fine_gain: float | None = None
    """learning-rate multiplier of the spatial head's full-resolution click term"""

    # training
    num_episodes: int = 10_000
    """number of training episodes"""
    learning_rate: float = 5e-5
    """Adam learning rate at the start of the schedule"""
    batch_size: int = 8
    """transitions per update"""
    gamma: float = 0.95
    """discount factor"""
    n_step: int = 3
    """n-step returns"""
    start_e: float = 1.0
    """epsilon at the first step"""
    end_e: float = 0.01
    """epsilon after `exploration_steps`"""
    exploration_steps: int | None = None
    """agent steps over which epsilon goes linearly from `start_e` to `end_e`"""
    learning_starts: int = 1_000
    """agent steps of experience collected before the first update"""
    train_frequency: int = 2
    """one update every this many agent steps"""
    target_network_frequency: int = 300
    """agent steps between copies of the online network into the target network"""
    max_grad_norm: float = 10.0
    """gradient norm clip"""
    use_double_dqn: bool = True
    """if toggled, the online network picks the next function and point and the target network scores them"""
    lr_scheduler: Literal["cosine", "step", "none"] | None = None
    """learning-rate schedule, stepped once per episode"""
    scheduler_tmax: int | None = None
    """episodes of one cosine half-period (default: `num_episodes`)"""
    min_lr: float = 1e-6
    """the cosine schedule's floor"""
    step_lr_step_size: int | None = None
    """episodes between multiplications by `step_lr_gamma` (step schedule)"""
    step_lr_gamma: float | None = None
    """factor of the step schedule"""
    num_test_episodes: int = 20
    """greedy test episodes at the end of the run (`eval/test_results.json`)"""
    test_epsilon: float = 0.0
    """epsilon of the test episodes (0: greedy)"""
    eval_every_episodes: int = 25
    """run `num_eval_episodes` greedy episodes every this many episodes (`eval/curve.csv`); 0: never"""
    num_eval_episodes: int = 5
    """greedy episodes per periodic evaluation"""
    log_every_steps: int = 200
    """agent steps between `losses/*` scalars"""
    max_nonfinite: int = 10
    """stop (exit 5, a checkpoint of the last finite weights) after this many updates, or game steps, in a row with a
    non-finite value (each update is skipped, each game step left out of the replay)"""

    # memory
    wait_for_gpu_mb: float = 0.0
    """before building anything, wait until this many MB are free on the GPU (0: don't wait)"""
    wait_poll_s: float = 10.0
    """seconds between free-memory polls while waiting"""
    wait_timeout_s: float = 600.0
    """give up waiting after this many seconds and train with `fallback_batch_size`"""
    fallback_batch_size: int = 4
    """batch size used when the wait for GPU memory timed out"""
    memory_log_every: int = 1_000
    """agent steps between memory reports (`debug/*`, `buffer/replay/*`) and leak checks"""
    leak_warmup_steps: int = 30_000
    """agent steps before the leak detector judges growth"""
    memory_snapshot_every: int = 0
    """dump a CUDA allocator snapshot every this many agent steps into `{run_id}/memory_snapshots/` (0: off)"""
    snapshot_max_entries: int = 100_000
    """allocator history ring size of the snapshots"""
    memory_probes: bool = False
    """record memory at each stage of the loop (`debug/probe/*`) to name the stage that keeps memory"""
    gpu_memory_gb: float | None = None
    """CUDA: use at most this many GiB of the GPU, its CUDA context's 0.5 GiB included (a share of a shared card, or
    a rehearsal of a smaller one); a run that cannot fit says what does not before it trains. Unset: the whole card"""

    # speed: the precision of `update` (PyTorch's mixed-precision recipe, in it) and the CPU threads (Part 2)
    amp: Literal["auto", "off", "fp16", "bf16"] = "auto"
    """mixed precision: auto = fp16 autocast + GradScaler on CUDA, off on CPU"""
    torch_num_threads: int = 1
    """CPU threads for torch (one is fastest at these sizes and leaves the other cores free)"""

    def problems(self) -> list[tuple[str, str]]:
        """Every invalid value as (field, one sentence); empty when all is well. The rules: RULES, after the loop;
        before them, every number must be finite (inf or nan is no setting), and names stay names (`name_problem`)."""
        values = dataclasses.asdict(self)
        infinite = [
            (field, f"{field} must be a finite number, got {value!r}")
            for field, value in values.items()
            if isinstance(value, float) and not math.isfinite(value)
        ]
        if infinite:
            return infinite
        names = [(field, problem) for field, problem in name_problems(self) if problem]
        return names + [
            (field, f"{field} must be {allowed.format(**values)}, got {values[field]!r}")
            for field, ok, allowed in RULES
            if not ok(self)
        ]


# The settings each map uses where they are left out (None); docs/dqn_starcraft_split.md says why each differs.
# fmt: off
MAP_DEFAULTS = {
    "MoveToBeacon": {"context_layers": 0, "click_distance": False, "timer_input": False, "coarse_level": False,
                     "fine_kernel": 3, "fine_gain": 10.0, "exploration_steps": 100_000, "select_own_only": False,
                     "move_through": 0.0, "lr_scheduler": "cosine", "step_lr_step_size": 1000, "step_lr_gamma": 0.5},
    "CollectMineralShards": {"context_layers": 3, "click_distance": True, "timer_input": True, "coarse_level": True,
                             "fine_kernel": 1, "fine_gain": 30.0, "exploration_steps": 50_000, "select_own_only": True,
                             "move_through": 1.5, "lr_scheduler": "step", "step_lr_step_size": 600,
                             "step_lr_gamma": 0.2},
}
# fmt: on


def with_map_defaults(args: Args) -> Args:
    """`args` with each setting left to the map (None) filled in, so config.json and checkpoints record values."""
    left_out = {
        name: value for name, value in MAP_DEFAULTS[args.map_name].items() if getattr(args, name) is None
    }
    return dataclasses.replace(args, **left_out)


# ---------------------------------------------------------------------------------------------------------
# Environment: what the agent sees, the action space, the game's clock, and `make_env`
# ---------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layer:
    name: str
    scale: int  # values lie in [0, scale), as in pysc2's feature definitions
    categorical: bool


# The layers the agent reads; names and scales are pysc2's (lib/features.py), so both backends agree.
SCREEN_LAYERS = (
    Layer("player_relative", 5, True),  # 0 none, 1 self, 2 ally, 3 neutral (beacon, shards), 4 enemy
    Layer("selected", 2, True),
    Layer("unit_density", 16, False),
    Layer("unit_hit_points", 1600, False),
)


MINIMAP_LAYERS = (
    Layer("player_relative", 5, True),
    Layer("selected", 2, True),
    Layer("camera", 2, True),
)


PLAYER_SIZE = 11  # player_id, minerals, vespene, food_used, food_cap, food_army, food_workers,


#                   idle_worker_count, army_count, warp_gate_count, larva_count
# What the replay stores besides the feature layers: the player vector and the share of the map's timer gone
# (pysc2's game_loop over the episode's loops), which the network reads with --timer-input.
PLAYER_INPUT_SIZE = PLAYER_SIZE + 1


# The action space: pysc2 functions (ids from pysc2/lib/actions.py) split over the Q heads of HEADS. A head scores
# its functions, each either called without arguments (one value) or at a screen point (one res x res map, its value
# at (x, y) being that function called at that point). One flat action index, used by acting, the replay buffer
# and the TD target alike, numbers them all, head after head, function after function, point after point:
#     0 .. F-1                         the non-spatial head's functions (F of them)
#     F + k * res * res + y * res + x  the spatial head's k-th function at screen point (x, y)
# which is the column order of torch.cat([q.flatten(1) for q in q_network(...)], 1). Acting takes the best available
# index over all heads, so choosing a function is comparing values. The action mask has one entry per FUNCTIONS;
# with --select-own-only, `point_masks` also limits select_point's points to our own units. The index is what the
# agent chooses and the replay stores; `game_call` turns it into the call sent to the game, where --move-through
# carries a Move on past the chosen point.
FUNCTION_IDS = {"no_op": 0, "select_point": 2, "select_army": 7, "Move_screen": 331}


@dataclass(frozen=True)
class Head:
    """One Q head's share of the action space: its functions (names in FUNCTION_IDS), each called either without
    arguments or at a point of the screen."""

    functions: tuple[str, ...]
    takes_point: bool

    def points(self, res: int) -> int:
        """Actions per function: one per screen point, or one."""
        return res * res if self.takes_point else 1


# ALGO LOGIC: the heads, in the order of the flat action index. Another head is an entry here, its module in
# SplitQNetwork.heads (in this order), and its call in the environments (Pysc2MiniGame.function_call).
HEADS = (
    Head(("no_op", "select_army"), takes_point=False),
    Head(("Move_screen", "select_point"), takes_point=True),
)


FUNCTIONS = tuple(name for head in HEADS for name in head.functions)  # the action mask's order


HEAD_OF = {name: head for head in HEADS for name in head.functions}


MOVE_SCREEN = FUNCTION_IDS["Move_screen"]


SELECT_POINT = FUNCTION_IDS["select_point"]


def action_mask(available_actions: np.ndarray) -> np.ndarray:
    """(len(FUNCTIONS),) bool: which of FUNCTIONS (head after head) are available."""
    return np.isin([FUNCTION_IDS[name] for name in FUNCTIONS], available_actions)


def decode_action(index: int, res: int) -> tuple[int, tuple[int, int] | None]:
    """Flat action index -> (function id, point or None)."""
    for head in HEADS:
        size = len(head.functions) * head.points(res)
        if index < size:
            function, point = divmod(index, head.points(res))
            xy = (point % res, point // res) if head.takes_point else None
            return FUNCTION_IDS[head.functions[function]], xy
        index -= size
    raise ValueError(f"action index beyond the {len(HEADS)} heads' actions at res {res}")


def encode_action(function_id: int, point: tuple[int, int] | None, res: int) -> int:
    """(function id, point or None) -> flat action index; the inverse of decode_action."""
    name = next(name for name in FUNCTIONS if FUNCTION_IDS[name] == function_id)
    first = 0  # the flat index of the head's first action
    for head in HEADS:
        if name in head.functions:
            index = first + head.functions.index(name) * head.points(res)
            return index + (point[1] * res + point[0] if head.takes_point else 0)
        first += len(head.functions) * head.points(res)
    raise AssertionError("unreachable: every function belongs to a head")


def game_call(
    index: int, obs: dict, res: int, through_pixels: float = 0.0
) -> tuple[int, tuple[int, int] | None]:
    """Flat action index -> the call sent to the game, (function id, point or None): decode_action's, except that
    a Move_screen point is carried `through_pixels` further along the line from the centre of the selected pixels
    (the screen's `selected` layer) through it, rounded to a pixel and kept on the screen (`--move-through`)."""
    function_id, point = decode_action(index, res)
    if function_id != MOVE_SCREEN or through_pixels <= 0:
        return function_id, point
    ys, xs = np.nonzero(obs["feature_screen"][SELECTED_LAYER])
    way = np.array(point, np.float64) - (xs.mean(), ys.mean()) if len(xs) else np.zeros(2)
    length = float(np.hypot(*way))
    if length < 1e-9:
        return function_id, point  # nothing selected, or the click is on the selection's centre: no direction
    x, y = np.clip(np.rint(np.array(point) + way / length * through_pixels), 0, res - 1).astype(int)
    return function_id, (int(x), int(y))


# Game time. The minigame maps' 120-second timers count game seconds at "normal" speed, 16 game loops each
# (pysc2 runs the game at "faster", 22.4 loops per real second, but the map's clock ticks per 16 loops), so
# an episode is 1,920 game loops: 120 agent steps at step_mul 16, 240 at pysc2's default 8 (the episode
# length reported for pysc2's MoveToBeacon). Source: both maps' MapScript.galaxy (inside the .SC2Map archives
# in pysc2/maps/mini_games) start a 120.0 s countdown with c_timeGame; docs/mini_games.md: "120 seconds".
GAME_LOOPS_PER_SECOND = 16


EPISODE_SECONDS = 120.0


EPISODE_LOOPS = EPISODE_SECONDS * GAME_LOOPS_PER_SECOND


def episode_steps(step_mul: int) -> int:
    """Agent steps of one episode of the map's 120-second timer at `step_mul` game loops per step."""
    return round(EPISODE_SECONDS * GAME_LOOPS_PER_SECOND / step_mul)


def player_input(obs: dict) -> np.ndarray:
    """The player vector and the share of the map's timer gone: (PLAYER_INPUT_SIZE,) float32."""
    return np.append(np.asarray(obs["player"], np.float32), np.float32(obs["game_loop"] / EPISODE_LOOPS))


def storage_dtype(layer: Layer) -> np.dtype:
    """uint8 when every value fits, else int16 (pysc2's scales are all below 32,768 for these layers)."""
    # memory: 1 byte per pixel for categorical layers, 2 for hit points; not the int32 pysc2 hands out
    return np.dtype(np.uint8) if layer.scale <= 256 else np.dtype(np.int16)


def make_env(args: Args, seed: int):
    """The minigame of `args.backend`: the built-in numpy replica or the real game through pysc2."""
    if args.backend == "pysc2":
        return Pysc2MiniGame.make(args.map_name, args.res, args.step_mul, seed, args.screen_world_units)
    return BuiltinMiniGame(args.map_name, args.res, args.step_mul, seed, args.screen_world_units)


# ---------------------------------------------------------------------------------------------------------
# Replay buffer
# ---------------------------------------------------------------------------------------------------------


class SplitReplayBuffer:
    """A ring of states; transition i is (state i, action i, reward i, done i, state i+1).

    # memory: each state is stored once (the next state of slot i is slot i+1, never a second copy), and each
    # feature layer in the smallest integer type its pysc2 value range allows (uint8; int16 for hit points).
    When done[i] the next state is never read (the map's timer is a true terminal: pysc2 gives discount 0). An
    episode cut short (`cut`: the game gave a non-finite value) ends with a slot of its last state alone, truncated[i]:
    no transition starts there, and the transitions before it bootstrap from that state.
    """

    def __init__(self, capacity: int, res: int):
        self.capacity, self.res = capacity, res
        self.screen = {l.name: np.zeros((capacity, res, res), storage_dtype(l)) for l in SCREEN_LAYERS}
        self.minimap = {l.name: np.zeros((capacity, res, res), storage_dtype(l)) for l in MINIMAP_LAYERS}
        self.player = np.zeros((capacity, PLAYER_INPUT_SIZE), np.float32)
        self.mask = np.zeros((capacity, len(FUNCTIONS)), bool)
        self.actions = np.zeros(capacity, np.int32)
        self.rewards = np.zeros(capacity, np.float32)
        self.dones = np.zeros(capacity, bool)
        self.truncated = np.zeros(capacity, bool)
        self.pos, self.size = 0, 0
        self.log = None  # the run's copy on disk of each transition stored, as it is stored (`mu.ReplayLog`), or None

    def add(self, obs: dict, action: int, reward: float, done: bool, truncated: bool = False) -> None:
        """Store one transition at the ring's position (the state, its action, reward and done)."""
        i = self.pos
        for k, layer in enumerate(SCREEN_LAYERS):
            self.screen[layer.name][i] = obs["feature_screen"][k]
        for k, layer in enumerate(MINIMAP_LAYERS):
            self.minimap[layer.name][i] = obs["feature_minimap"][k]
        self.player[i] = player_input(obs)
        self.mask[i] = action_mask(obs["available_actions"])
        self.actions[i], self.rewards[i], self.dones[i], self.truncated[i] = action, reward, done, truncated
        self.pos = (i + 1) % self.capacity
        self.size = min(self.size + 1, self.capacity)
        if self.log is not None:
            self.log.append({name: array[i] for name, array in self.slots().items()})

    def cut(self, obs: dict) -> None:
        """End the episode at state `obs` without a terminal (truncated): the slot holds that state alone, so that the
        transition before it has its next state, and no transition starts there."""
        self.add(obs, 0, 0.0, False, truncated=True)

    def num_transitions(self) -> int:
        """Slots whose next state is known: all but the newest, unless the newest ended its episode."""
        if self.size == 0:
            return 0
        newest = (self.pos - 1) % self.capacity
        return self.size if self.dones[newest] or self.truncated[newest] else self.size - 1

    def _states(self, idx: np.ndarray) -> dict:
        """The states of slots `idx`, copied out of the ring."""
        # memory: fancy indexing copies, so a batch never aliases the ring (evicted slots can be overwritten)
        return {
            "screen": np.stack([self.screen[l.name][idx] for l in SCREEN_LAYERS], 1),  # (B, Ls, H, W) int16
            "minimap": np.stack([self.minimap[l.name][idx] for l in MINIMAP_LAYERS], 1),  # (B, Lm, H, W)
            "player": self.player[idx],  # (B, PLAYER_INPUT_SIZE)
            "mask": self.mask[idx],  # (B, F + S)
        }

    def sample(self, batch_size: int, rng: np.random.Generator, n_step: int = 1) -> dict:
        """n-step transitions: state i, action i, the n rewards, dones and truncated flags i .. i+n-1, and the state
        `td_target` bootstraps from, `steps` later: i+n, or an episode's last state where it was cut short within the
        n (read only if no terminal came first). Only slots whose n following transitions are all known, and that
        are no cut episode's last state, are drawn."""
        oldest = self.pos if self.size == self.capacity else 0
        high = max(self.num_transitions() - n_step + 1, 1)
        idx = (oldest + rng.integers(0, high, batch_size)) % self.capacity
        for _ in range(1000):  # no transition starts at a cut episode's last state: draw those again
            if not (last_states := self.truncated[idx]).any():
                break
            idx[last_states] = (oldest + rng.integers(0, high, int(last_states.sum()))) % self.capacity
        else:
            raise RuntimeError("the replay holds no transition to sample, only cut episodes' ends")
        slots = (idx[:, None] + np.arange(n_step)) % self.capacity  # (B, n)
        truncated = self.truncated[slots]  # (B, n)
        steps = np.where(truncated.any(1), truncated.argmax(1), n_step)  # (B,): to the next state read
        return {
            "obs": self._states(idx),
            "next_obs": self._states((idx + steps) % self.capacity),
            "actions": self.actions[idx].astype(np.int64),
            "rewards": self.rewards[slots],  # (B, n) float32, a fresh array
            "dones": self.dones[slots].astype(np.float32),  # (B, n)
            "truncated": truncated.astype(np.float32),  # (B, n)
            "steps": steps.astype(np.int64),  # (B,)
        }

    def slots(self) -> dict[str, np.ndarray]:
        """Every array of the ring, by name, one item per slot: a transition is one item of each."""
        layers = {f"screen_{k}": v for k, v in self.screen.items()} | {
            f"minimap_{k}": v for k, v in self.minimap.items()
        }
        aux = {"player": self.player, "mask": self.mask, "actions": self.actions, "rewards": self.rewards}
        return layers | aux | {"dones": self.dones, "truncated": self.truncated}

    def log_state(self) -> dict | None:
        """The replay for a checkpoint when it is on disk (else None): the log's state, from the oldest transition
        the ring holds."""
        return None if self.log is None else self.log.state(keep_from=self.log.position - self.size)

    def restore_log(self, state: dict) -> None:
        """The ring as a checkpoint's log state holds it (`log_state`), oldest transition first from slot 0: the same
        transitions in the same order, so the same ones are sampled; then the log goes on from there."""
        self.pos, self.size, slots = 0, 0, self.slots()
        for _, rows in self.log.rows(state):
            count = len(rows["actions"])
            for name, array in slots.items():
                array[self.size : self.size + count] = rows[name]
            self.size += count
        self.pos = self.size % self.capacity
        self.log.resume(state)

    def state_dict(self) -> dict:
        """Every array as a tensor (loads with weights_only=True), and the ring's position."""
        arrays = {
            "player": self.player,
            "mask": self.mask,
            "actions": self.actions,
            "rewards": self.rewards,
            "dones": self.dones,
            "truncated": self.truncated,
        }
        return {
            "screen": {k: torch.from_numpy(v) for k, v in self.screen.items()},
            "minimap": {k: torch.from_numpy(v) for k, v in self.minimap.items()},
            **{k: torch.from_numpy(v) for k, v in arrays.items()},
            "pos": self.pos,
            "size": self.size,
        }

    def load_state_dict(self, state: dict) -> None:
        """The arrays and position of a `state_dict`; the newest transition ends its episode."""
        for group in ("screen", "minimap"):
            for name, value in state[group].items():
                getattr(self, group)[name][...] = value.numpy()
        for name in ("player", "mask", "actions", "rewards", "dones"):
            getattr(self, name)[...] = state[name].numpy()
        if "truncated" in state:  # a checkpoint from before cut episodes has none
            self.truncated[...] = state["truncated"].numpy()
        self.pos, self.size = int(state["pos"]), int(state["size"])
        if self.size:
            # the interrupted episode's last transition has no next state in the buffer: it ends there
            self.dones[(self.pos - 1) % self.capacity] = True

    def bytes_per_step(self) -> tuple[int, int]:
        """(observation bytes, other bytes) one stored agent step takes."""
        return self.step_nbytes(self.res)

    @staticmethod
    def step_nbytes(res: int) -> tuple[int, int]:
        """(observation bytes, other bytes) of one stored agent step at `res`, as `__init__` allocates them."""
        obs = sum(storage_dtype(layer).itemsize * res * res for layer in (*SCREEN_LAYERS, *MINIMAP_LAYERS))
        # player float32, mask bool, action int32, reward float32, done and truncated bool
        aux = 4 * PLAYER_INPUT_SIZE + len(FUNCTIONS) + 4 + 4 + 1 + 1
        return obs, aux

    def stats(self) -> dict:
        """For mu.memory_report: bytes actually filled (the arrays' untouched pages cost nothing yet)."""
        obs, aux = self.bytes_per_step()
        return {
            "total_steps": self.size,
            "num_episodes": int(self.dones[: self.size].sum() + self.truncated[: self.size].sum()),
            "obs_bytes": obs * self.size,
            "aux_bytes": aux * self.size,
        }


# ---------------------------------------------------------------------------------------------------------
# Networks
# ---------------------------------------------------------------------------------------------------------


def layer_channels(layers) -> int:
    """Input channels of `preprocess_layers` for these layers."""
    return sum(l.scale if (l.categorical and l.scale > 2) else 1 for l in layers)


def preprocess_layers(x: torch.Tensor, layers) -> torch.Tensor:
    """(B, L, H, W) integer -> (B, C, H, W) float: one-hot for categorical layers, log scale for amounts."""
    channels = []
    for k, layer in enumerate(layers):
        v = x[:, k]
        if layer.categorical and layer.scale > 2:
            channels.append(
                F.one_hot(v.long().clamp(0, layer.scale - 1), layer.scale).permute(0, 3, 1, 2).float()
            )
        elif layer.categorical:
            channels.append((v > 0).float()[:, None])
        else:
            channels.append((torch.log1p(v.float().clamp(min=0)) / math.log1p(layer.scale))[:, None])
    return torch.cat(channels, 1)


SELECTED_LAYER = [layer.name for layer in SCREEN_LAYERS].index("selected")


CLASS_CHANNELS = SCREEN_LAYERS[0].scale  # player_relative's one-hot channels come first in preprocess_layers


def selection_centre(selected: torch.Tensor):
    """`selected` (B, H, W) integer layer -> the centre of the selected pixels, y and x (B,) each in pixels, and
    whether any is selected (B,) float."""
    _, H, W = selected.shape
    mask = (selected > 0).float()
    count = mask.sum((1, 2))  # (B,)
    ys = torch.arange(H, dtype=torch.float32, device=selected.device)
    xs = torch.arange(W, dtype=torch.float32, device=selected.device)
    centre_y = (mask.sum(2) * ys).sum(1) / count.clamp(min=1)
    centre_x = (mask.sum(1) * xs).sum(1) / count.clamp(min=1)
    return centre_y, centre_x, (count > 0).float()


def class_distance(selected: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
    """`selected` (B, H, W) integer layer, `classes` (B, K, H, W) one-hot -> (B, K, H, W): each class channel
    times the pixel's distance from the centre of the selected pixels, in screen widths; zero if none is selected."""
    _, H, W = selected.shape
    centre_y, centre_x, any_selected = selection_centre(selected)
    ys = torch.arange(H, dtype=torch.float32, device=selected.device)
    xs = torch.arange(W, dtype=torch.float32, device=selected.device)
    dx = (xs[None, None, :] - centre_x[:, None, None]) / W  # (B, 1, W)
    dy = (ys[None, :, None] - centre_y[:, None, None]) / H  # (B, H, 1)
    distance = torch.sqrt(dx * dx + dy * dy) * any_selected[:, None, None]  # (B, H, W)
    return classes * distance[:, None]


class Features(typing.NamedTuple):
    """What the trunk of SplitQNetwork hands each head."""

    pooled: torch.Tensor  # (B, 2E): the fused features' mean and max over the screen
    fused: torch.Tensor  # (B, E, H/2, W/2): the fused features at half resolution
    fine_input: torch.Tensor  # (B, C, H, W): the full-resolution screen (and, with click_distance, distances)
    available: torch.Tensor  # (B, len(FUNCTIONS)) float: the action mask


class NonSpatialHead(nn.Module):
    """Q of each function without arguments, (B, F, 1), from the pooled features and the available actions.

    The available actions are an input, as in SC2LE's agents: "is Move_screen available" (is the army selected)
    is one clean bit for the head that chooses between no_op and select_army, which do the same in every state but
    the first, unselected one of an episode (there no_op leaves the marine standing)."""

    def __init__(self, num_functions: int, fused_channels: int, hidden: int):
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(2 * fused_channels + len(FUNCTIONS), hidden),
            nn.ReLU(),
            nn.Linear(hidden, num_functions),
        )

    def forward(self, features: Features) -> torch.Tensor:
        """Features -> (B, F, 1)."""
        return self.mlp(torch.cat([features.pooled, features.available], 1))[:, :, None]


class SpatialHead(nn.Module):
    """Q of each spatial function at each screen point, (B, S, H*W): a coarse term from the fused features (where the
    marines are, what is selected), either upsampled back to res x res or one level per function (`coarse_level`),
    plus a small convolution over the full-resolution screen (`fine_kernel`), so that a click can land on an exact
    pixel.

    The fine term alone can say "the target is at this pixel". Its output is multiplied by a fixed gain, which is a
    learning-rate multiplier for this one layer (`fine_gain`); its zero start keeps the gain from amplifying initial
    noise."""

    def __init__(
        self,
        num_functions: int,
        res: int,
        fused_channels: int,
        fine_channels: int,
        coarse_level: bool,
        fine_kernel: int,
        fine_gain: float,
    ):
        super().__init__()
        self.res, self.coarse_level, self.fine_gain = res, coarse_level, fine_gain
        if coarse_level:
            self.coarse = nn.Linear(2 * fused_channels, num_functions)  # from the pooled features
        else:
            self.coarse = nn.Conv2d(fused_channels, num_functions, 1)  # from each half-resolution cell
        self.fine = nn.Conv2d(fine_channels, num_functions, fine_kernel, padding=fine_kernel // 2)
        nn.init.zeros_(self.fine.weight)
        nn.init.zeros_(self.fine.bias)

    def forward(self, features: Features) -> torch.Tensor:
        """Features -> (B, S, H*W)."""
        if self.coarse_level:
            coarse = self.coarse(features.pooled)[:, :, None, None]  # (B, S, 1, 1): one level per function
        else:
            coarse = F.interpolate(self.coarse(features.fused), size=(self.res, self.res), mode="nearest")
        return (coarse + self.fine_gain * self.fine(features.fine_input)).flatten(2)  # (B, S, H*W)


class SplitQNetwork(nn.Module):
    """Screen and minimap conv towers + the tiled embedding of the player vector and the available actions,
    fused; one Q head per entry of HEADS: one value per non-spatial function (NonSpatialHead), and one res x res
    map per spatial function (SpatialHead).

    The towers work at half resolution (a stride-2 first conv) to keep an update cheap on a CPU. The context layers
    widen what the fused features see from a few pixels to the whole screen.
    """

    def __init__(
        self,
        res: int,
        tower_channels: int = Args.tower_channels,
        fused_channels: int = Args.fused_channels,
        context_layers: int = MAP_DEFAULTS["CollectMineralShards"]["context_layers"],
        click_distance: bool = MAP_DEFAULTS["CollectMineralShards"]["click_distance"],
        timer_input: bool = MAP_DEFAULTS["CollectMineralShards"]["timer_input"],
        player_channels: int = Args.player_channels,
        nonspatial_hidden: int = Args.nonspatial_hidden,
        fine_gain: float = MAP_DEFAULTS["CollectMineralShards"]["fine_gain"],
        fine_kernel: int = MAP_DEFAULTS["CollectMineralShards"]["fine_kernel"],
        coarse_level: bool = MAP_DEFAULTS["CollectMineralShards"]["coarse_level"],
    ):
        super().__init__()
        self.res = res
        screen_in, minimap_in = layer_channels(SCREEN_LAYERS), layer_channels(MINIMAP_LAYERS)
        self.screen_tower = nn.Sequential(
            nn.Conv2d(screen_in, tower_channels, 4, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(tower_channels, tower_channels, 3, padding=1),
            nn.ReLU(),
        )
        self.minimap_tower = nn.Sequential(
            nn.Conv2d(minimap_in, tower_channels, 4, stride=2, padding=1),
            nn.ReLU(),
            nn.Conv2d(tower_channels, tower_channels, 3, padding=1),
            nn.ReLU(),
        )
        self.player_inputs = PLAYER_SIZE + timer_input  # the timer is the last column of `player_input`
        self.player_embed = nn.Sequential(
            nn.Linear(self.player_inputs + len(FUNCTIONS), player_channels), nn.ReLU()
        )
        self.fuse = nn.Sequential(
            nn.Conv2d(2 * tower_channels + player_channels, fused_channels, 1), nn.ReLU()
        )
        self.click_distance = click_distance
        fine_channels = screen_in + CLASS_CHANNELS * click_distance
        # The order of creation decides each layer's initial weights from the seed, and the order of registration
        # the optimizer's order of parameters (which the checkpoints' optimizer state follows): the spatial head,
        # the non-spatial head, then the context layers, as the committed results were trained.
        self.spatial_head = SpatialHead(
            len(HEADS[1].functions), res, fused_channels, fine_channels, coarse_level, fine_kernel, fine_gain
        )
        self.nonspatial_head = NonSpatialHead(len(HEADS[0].functions), fused_channels, nonspatial_hidden)
        self.context = nn.ModuleList(
            nn.Conv2d(fused_channels, fused_channels, 3, padding=2**i, dilation=2**i)
            for i in range(context_layers)
        )
        # ALGO LOGIC: the heads in the order of HEADS (the flat action index); each one is registered above
        self.heads = (self.nonspatial_head, self.spatial_head)
        assert len(self.heads) == len(HEADS), "one module per entry of HEADS"
        self.register_load_state_dict_pre_hook(rename_format_3_keys)  # format-3 checkpoints' keys (below)

    def features(self, screen, minimap, player, available) -> Features:
        """The trunk: the towers, the player embedding and the context layers (see `forward` for the inputs)."""
        available = available.float()  # (B, len(FUNCTIONS))
        selected = screen[:, SELECTED_LAYER]  # (B, H, W)
        screen = preprocess_layers(screen, SCREEN_LAYERS)  # (B, Cs, H, W)
        fine_input = [screen]
        if self.click_distance:
            fine_input.append(class_distance(selected, screen[:, :CLASS_CHANNELS]))  # (B, K, H, W)
        fine_input = torch.cat(fine_input, 1)
        minimap = preprocess_layers(minimap, MINIMAP_LAYERS)  # (B, Cm, H, W)
        s = self.screen_tower(screen)  # (B, T, H/2, W/2)
        m = self.minimap_tower(minimap)  # (B, T, H/2, W/2)
        player = player[:, : self.player_inputs].float()
        p = self.player_embed(torch.cat([torch.log1p(player.clamp(min=0)), available], 1))  # (B, P)
        p = p[:, :, None, None].expand(-1, -1, s.shape[2], s.shape[3])  # tiled: (B, P, H/2, W/2)
        fused = self.fuse(torch.cat([s, m, p], 1))  # (B, E, H/2, W/2)
        if len(self.context):
            context = F.avg_pool2d(fused, 2, ceil_mode=True)  # (B, E, H/4, W/4)
            for conv in self.context:
                context = context + F.relu(conv(context))  # each pixel now sees twice as far
            context = F.interpolate(context, scale_factor=2, mode="nearest")[
                :, :, : fused.shape[2], : fused.shape[3]
            ]
            fused = fused + context  # (B, E, H/2, W/2)
        pooled = torch.cat([fused.mean((2, 3)), fused.amax((2, 3))], 1)  # (B, 2E)
        return Features(pooled, fused, fine_input, available)

    def forward(self, screen, minimap, player, available) -> list[torch.Tensor]:
        """screen (B, Ls, H, W), minimap (B, Lm, H, W) integer; player (B, PLAYER_INPUT_SIZE), `player_input`;
        available (B, len(FUNCTIONS)) bool, the action mask -> per head of HEADS, Q (B, F, P): one value per
        function and point (P = 1 for functions without arguments). Flattened and concatenated, one value per flat
        action index."""
        features = self.features(screen, minimap, player, available)
        return [head(features) for head in self.heads]


# The state_dict keys of format-3 checkpoints, whose heads' layers belonged to the network itself -> today's keys.
FORMAT_3_KEYS = (
    ("nonspatial_head.", "nonspatial_head.mlp."),
    ("spatial_coarse.", "spatial_head.coarse."),
    ("spatial_fine.", "spatial_head.fine."),
)


def rename_format_3_keys(module, state_dict, prefix, *unused) -> None:
    """A load_state_dict pre-hook: a format-3 state_dict (it has `spatial_fine.weight`) gets today's keys."""
    if prefix + "spatial_fine.weight" not in state_dict:
        return
    for key in [key for key in state_dict if key.startswith(prefix)]:
        for old, new in FORMAT_3_KEYS:
            if key.startswith(prefix + old):
                state_dict[prefix + new + key[len(prefix + old) :]] = state_dict.pop(key)
                break


# SplitQNetwork's settings: the keyword arguments of make_q_network besides the map and the resolution.
NETWORK_SETTINGS = (
    "tower_channels",
    "fused_channels",
    "context_layers",
    "click_distance",
    "timer_input",
    "player_channels",
    "nonspatial_hidden",
    "fine_gain",
    "fine_kernel",
    "coarse_level",
)


def make_q_network(*, map_name: str = Args.map_name, res: int = Args.res, **settings) -> SplitQNetwork:
    """The Q network from keywords alone, e.g. `make_q_network(map_name="MoveToBeacon", res=32, fine_gain=5.0)`:
    each of NETWORK_SETTINGS left out (or None) is the map's default (`with_map_defaults`), else Args'."""
    unknown = set(settings) - set(NETWORK_SETTINGS)
    if unknown:
        raise TypeError(f"make_q_network() got settings it does not know: {', '.join(sorted(unknown))}")
    given = {name: value for name, value in settings.items() if value is not None}
    args = with_map_defaults(Args(map_name=map_name, res=res, **given))
    return SplitQNetwork(res, **{name: getattr(args, name) for name in NETWORK_SETTINGS})


def network_settings(args: Args) -> dict:
    """A run's keyword arguments of make_q_network: `make_q_network(**network_settings(args))`."""
    return {
        "map_name": args.map_name,
        "res": args.res,
        **{name: getattr(args, name) for name in NETWORK_SETTINGS},
    }


SELF = 1  # player_relative of our own units


def point_masks(screen: torch.Tensor, select_own_only: bool) -> list[torch.Tensor | None]:
    """screen (B, Ls, H, W) integer -> per head of HEADS, (B, F, H*W) bool: the points at which each of its
    functions may be called, or None for everywhere. With `select_own_only`, select_point only at our own units'
    pixels."""
    if not select_own_only:
        return [None] * len(HEADS)
    own = (screen[:, 0] == SELF).flatten(1)  # (B, H*W); player_relative is screen layer 0
    anywhere = torch.ones_like(own)
    return [
        torch.stack([own if name == "select_point" else anywhere for name in head.functions], 1)
        if head.takes_point
        else None
        for head in HEADS
    ]


def allowed_actions(qs: list[torch.Tensor], mask: torch.Tensor, points: list) -> list[torch.Tensor]:
    """Per head, (B, F, P) bool, the shape of its Q in `qs`: the actions that may be chosen, those whose function
    is available (`mask`, (B, len(FUNCTIONS)), head after head) at a point `points` (`point_masks`) allows."""
    allowed, first = [], 0
    for q, head_points in zip(qs, points, strict=True):
        available = mask[:, first : first + q.shape[1], None]  # (B, F, 1)
        first += q.shape[1]
        allowed.append(available.expand(q.shape) if head_points is None else available & head_points)
    return allowed


def masked_q(qs: list[torch.Tensor], mask: torch.Tensor, points: list) -> torch.Tensor:
    """All heads as one Q per flat action index (B, A); actions `allowed_actions` leaves out get -inf."""
    neg_inf = torch.finfo(qs[0].dtype).min
    allowed = allowed_actions(qs, mask, points)
    return torch.cat([q.masked_fill(~ok, neg_inf).flatten(1) for q, ok in zip(qs, allowed)], 1)


def to_tensors(states: dict, device) -> dict:
    """numpy states (batched) -> tensors on device; float conversion happens later, inside the network."""
    # memory: integers travel to the device; the float copies exist only for the forward pass
    return {
        "screen": torch.as_tensor(states["screen"], device=device),
        "minimap": torch.as_tensor(states["minimap"], device=device),
        "player": torch.as_tensor(states["player"], device=device),
        "mask": torch.as_tensor(states["mask"], device=device),
    }


def obs_to_states(obs: dict) -> dict:
    """One environment observation -> a batch of one, in the replay buffer's layout."""
    return {
        "screen": obs["feature_screen"][None].astype(np.int16),
        "minimap": obs["feature_minimap"][None].astype(np.int16),
        "player": player_input(obs)[None],
        "mask": action_mask(obs["available_actions"])[None],
    }


# ---------------------------------------------------------------------------------------------------------
# The TD target, the loss, the update, and the schedules of the learning rate and epsilon
# ---------------------------------------------------------------------------------------------------------


def td_target(q_network, target_network, batch: dict, args: Args) -> torch.Tensor:
    """The n-step Double-DQN target of each sampled transition, (B,):

        y = sum_{j<n} gamma^j r_{i+j}  +  gamma^n * V(s_{i+n}),   summed only up to the end of the episode,
        V(s') = the best available function in s', over all heads: a function's value without arguments, or a
                spatial function's value at its best point,

    where V is 0 if the episode ended within the n steps (the map's timer is a true terminal: pysc2 gives
    discount 0); an episode cut short within them (truncated) bootstraps from its last state instead, gamma^k
    V(s_{i+k}) after its k rewards (`steps`). Double DQN: the online network selects (a non-spatial head's function; per spatial function, its
    point) and the target network evaluates what was selected; plain DQN: the target network does both. An
    unavailable function in s' is never selected and never counts, nor is a point outside `point_masks`.
    """
    # ALGO LOGIC: the learning target, all of it in this function
    rewards, dones, truncated = batch["rewards"], batch["dones"], batch["truncated"]  # (B, n) each
    next_obs = batch["next_obs"]  # `steps` (B,) after state i: i+n, or where the episode was cut short
    next_inputs = (next_obs["screen"], next_obs["minimap"], next_obs["player"], next_obs["mask"])
    with torch.no_grad():
        # the n-step return, cut at the end of the episode (later rewards belong to the next one)
        returns = torch.zeros_like(rewards[:, 0])  # (B,)
        ended = torch.zeros_like(dones[:, 0], dtype=torch.bool)  # (B,)
        terminal = torch.zeros_like(ended)  # (B,): it ended in a terminal state: nothing to bootstrap
        for j in range(rewards.shape[1]):
            returns = returns + torch.where(ended, 0.0, args.gamma**j * rewards[:, j])
            terminal = terminal | (~ended & (dones[:, j] > 0))
            ended = ended | (dones[:, j] > 0) | (truncated[:, j] > 0)
        # V(s'): selection by the online network, evaluation by the target network
        target_qs = [q.float() for q in target_network(*next_inputs)]  # per head (B, F, P)
        online_qs = [q.float() for q in q_network(*next_inputs)] if args.use_double_dqn else target_qs
        points = point_masks(next_obs["screen"], args.select_own_only)
        allowed = allowed_actions(target_qs, next_obs["mask"], points)
        neg_inf = torch.finfo(torch.float32).min
        picks = []  # per head (B, G): the target network's value of each selection the online network made
        for head, online, target, ok in zip(HEADS, online_qs, target_qs, allowed, strict=True):
            if not head.takes_point:  # one selection among the head's functions: (B, 1, F)
                online, target, ok = online.transpose(1, 2), target.transpose(1, 2), ok.transpose(1, 2)
            best = online.masked_fill(~ok, neg_inf).argmax(2, keepdim=True)  # (B, G, 1); a point per function
            value = target.gather(2, best).squeeze(2)  # (B, G)
            picks.append(value.masked_fill(~ok.any(2), neg_inf))  # nothing available there: it never counts
        next_value = torch.cat(picks, 1).max(1).values  # (B,): the best selection over all heads
        next_value = torch.where(terminal, torch.zeros_like(next_value), next_value)  # -inf never leaks
        # gamma^steps in double, as Python's own power, then float32
        discount = torch.full_like(next_value, args.gamma, dtype=torch.float64).pow(batch["steps"]).float()
        return returns + discount * next_value


def td_loss(q_network, target_network, batch: dict, args: Args):
    """Huber loss between Q(s, a) and the TD target, and the Q values, for a batch on the device.

    Every transition's action came from exactly one head (a function from the non-spatial head or a point from
    the spatial head), so each transition contributes one TD error, Q_head(s, a) - y, where y bootstraps from
    the best of all heads in s'. The errors of all heads are averaged together over the batch: a batch mostly of
    Move_screen steps mostly trains the spatial head, and no head is weighted by hand.
    """
    obs = batch["obs"]
    qs = q_network(obs["screen"], obs["minimap"], obs["player"], obs["mask"])  # per head (B, F, P)
    q_all = torch.cat([q.flatten(1) for q in qs], 1).float()  # (B, A): one value per flat action index
    q_taken = q_all.gather(1, batch["actions"][:, None]).squeeze(1)  # (B,)
    return F.smooth_l1_loss(q_taken, td_target(q_network, target_network, batch, args)), q_taken


def batch_to_device(sample: dict, device) -> dict:
    """A sampled batch (numpy) as tensors on `device`."""
    return {
        "obs": to_tensors(sample["obs"], device),
        "next_obs": to_tensors(sample["next_obs"], device),
        "actions": torch.as_tensor(sample["actions"], device=device),
        "rewards": torch.as_tensor(sample["rewards"], device=device),
        "dones": torch.as_tensor(sample["dones"], device=device),
        "truncated": torch.as_tensor(sample["truncated"], device=device),
        "steps": torch.as_tensor(sample["steps"], device=device),
    }


def update(q_network, target_network, optimizer, batch: dict, args: Args, amp: mu.AmpSetup) -> dict:
    """One gradient step on the TD loss, its gradient norm clipped; returns what it logs (`logged_values`).

    In the precision of --amp, by PyTorch's mixed-precision recipe: the forward passes under autocast (fp16 or bf16
    convolutions and linear layers; the Q values are float32 for the target and the loss) and the gradients through
    a GradScaler (fp16: the loss scaled up so that small gradients do not flush to zero, unscaled before the clip, a
    step with an overflowed gradient skipped). With --amp off autocast does nothing and the disabled scaler makes
    each call the plain one (`loss.backward()`, `optimizer.step()`); bf16 needs no scaler. One function for every
    precision, so a change here trains on every device."""
    # ALGO LOGIC: the gradient step
    with amp.autocast():
        loss, q_taken = td_loss(q_network, target_network, batch, args)
    optimizer.zero_grad(set_to_none=True)
    amp.scaler.scale(loss).backward()
    amp.scaler.unscale_(optimizer)  # the clip sees the true gradients
    grad_norm = nn.utils.clip_grad_norm_(q_network.parameters(), args.max_grad_norm)
    # nothing non-finite reaches the weights: a non-finite loss or gradient skips the step (fp16's scaler skips its
    # own overflows, and lowers its scale)
    finite = bool(torch.isfinite(loss.detach()) and (amp.scaler.is_enabled() or torch.isfinite(grad_norm)))
    if finite:
        amp.scaler.step(optimizer)  # skipped when a gradient overflowed (fp16)
    amp.scaler.update()
    return logged_values(loss, q_taken, grad_norm) | {"finite": finite}


def logged_values(loss: torch.Tensor, q_taken: torch.Tensor, grad_norm: torch.Tensor) -> dict:
    """What an update logs, as 0-d tensors: turned into floats only when logged, once per log interval (`update`
    adds whether its step was taken, "finite")."""
    # memory: detached, so nothing logged keeps the graph alive
    return {
        "losses/td_loss": loss.detach(),
        "losses/q_values": q_taken.detach().mean(),
        "losses/grad_norm": grad_norm.detach(),
    }


def make_scheduler(optimizer, args: Args):
    """Per-episode learning-rate schedule (None for `none`)."""
    if args.lr_scheduler == "cosine":
        t_max = args.scheduler_tmax or args.num_episodes
        return torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=t_max, eta_min=args.min_lr)
    if args.lr_scheduler == "step":
        return torch.optim.lr_scheduler.StepLR(
            optimizer, step_size=args.step_lr_step_size, gamma=args.step_lr_gamma
        )
    return None


def linear_schedule(start_e: float, end_e: float, duration: int, t: int) -> float:
    """Epsilon at step `t`: from `start_e` down to `end_e` over `duration` steps, then `end_e`."""
    slope = (end_e - start_e) / duration
    return max(slope * t + start_e, end_e)


# ---------------------------------------------------------------------------------------------------------
# Acting: epsilon-greedy over the flat action index
# ---------------------------------------------------------------------------------------------------------


def select_action(
    q_network, obs: dict, epsilon: float, rng: np.random.Generator, device, select_own_only: bool = False
) -> int:
    """Epsilon-greedy over the flat action space (functions, then points), available actions only (and, with
    `select_own_only`, select_point only on our own units).

    A random action is drawn like pysc2's random agent (the SC2LE "random policy"): a function uniformly
    among the available ones, then a point uniformly among its allowed points. Drawing uniformly over all flat
    actions instead would almost never no-op, so a random walk would be redirected every step and rarely arrive.
    """
    if rng.random() < epsilon:
        mask = action_mask(obs["available_actions"])
        own = np.flatnonzero(obs["feature_screen"][0] == SELF) if select_own_only else None
        if own is not None and own.size == 0:
            mask[FUNCTIONS.index("select_point")] = False  # nothing of ours on the screen to select
        name = FUNCTIONS[int(rng.choice(np.flatnonzero(mask)))]
        res = q_network.res
        if not HEAD_OF[name].takes_point:
            return encode_action(FUNCTION_IDS[name], None, res)
        if own is not None and name == "select_point":
            point = int(rng.choice(own))
        else:
            point = int(rng.integers(0, res * res))
        return encode_action(FUNCTION_IDS[name], (point % res, point // res), res)
    states = to_tensors(obs_to_states(obs), device)
    # memory: acting builds no graph
    with torch.no_grad():
        qs = q_network(states["screen"], states["minimap"], states["player"], states["mask"])
        points = point_masks(states["screen"], select_own_only)
        return int(masked_q([q.float() for q in qs], states["mask"], points).argmax(1).item())


# ---------------------------------------------------------------------------------------------------------
# The training loop
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Agent:
    """The learner `build_agent` makes from Args and a seed."""

    q_network: SplitQNetwork
    target_network: SplitQNetwork
    optimizer: torch.optim.Optimizer
    amp: mu.AmpSetup  # --amp on this device: `update`'s autocast and loss scaler (checkpoints keep its state)
    scheduler: typing.Any  # a per-episode learning-rate schedule, or None
    rb: SplitReplayBuffer
    rng: np.random.Generator  # exploration and replay sampling


def build_agent(args: Args, seed: int, device) -> Agent:
    """ALGO LOGIC: the seeds, the online and target networks, Adam, the precision of the update (--amp: auto is fp16
    on CUDA, off on a CPU), the learning-rate schedule and the replay, in the order that fixes every random number."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    rng = np.random.default_rng(seed)
    q_network = make_q_network(**network_settings(args)).to(device)
    target_network = make_q_network(**network_settings(args)).to(device)
    target_network.load_state_dict(q_network.state_dict())
    optimizer = torch.optim.Adam(q_network.parameters(), lr=args.learning_rate)
    amp = mu.amp(args.amp, device)
    scheduler = make_scheduler(optimizer, args)
    rb = SplitReplayBuffer(args.buffer_size, args.res)
    return Agent(q_network, target_network, optimizer, amp, scheduler, rb, rng)


class Progress(typing.NamedTuple):
    """Where training stands, as the loop leaves it at the top of each agent step and at each episode's end; what a
    checkpoint saves and --resume goes on from."""

    episode: int  # the latest episode begun (0: none yet)
    global_step: int  # agent steps taken
    recent_train_scores: list  # the latest training episodes' scores (as many as --eval-every-episodes)
    # the episode in progress at global_step (its obs, score and length); None once it has ended
    playing: dict | None


def train_one_seed(run) -> str:
    """One seed's training, or the rest of it after --resume: episode after episode, act epsilon-greedily, store each
    transition, update on a sampled batch every `train_frequency` agent steps and copy the online network into the
    target network every `target_network_frequency`. Returns what ended it: "num_episodes" or "time_limit".
    `run` (Part 3 makes it) holds the environments, the agent and where training stands (`run.progress`); each
    `run.` call below is the run's plumbing: stop signals, out-of-memory reports, logs, periodic tests, memory."""
    args, env, agent = run.args, run.env, run.agent
    q_network, target_network, optimizer = agent.q_network, agent.target_network, agent.optimizer
    rb, rng = agent.rb, agent.rng  # the replay buffer; the generator of exploration and replay sampling
    last_episode, global_step, recent_train_scores, playing = run.progress  # new run: 0, 0, [], None
    for episode in range(last_episode if playing else last_episode + 1, args.num_episodes + 1):
        # TRY NOT TO MODIFY: a new episode from the game's reset, or the one a resumed run stopped in, where it stopped
        playing = run.progress.playing or dict(obs=env.reset(), score=0.0, length=0)
        obs, score, length, done = playing["obs"], playing["score"], playing["length"], False
        while not done:
            # TRY NOT TO MODIFY: where training stands, which a stop signal checkpoints here, between two steps
            playing = dict(obs=obs, score=score, length=length)
            run.progress = Progress(episode, global_step, recent_train_scores, playing)
            run.check_stop()
            run.probes("loop_start")
            # ALGO LOGIC: the action, epsilon-greedy
            epsilon = linear_schedule(args.start_e, args.end_e, args.exploration_steps, global_step)
            # memory: a CUDA OOM while acting, copying a batch or updating ends the run (report, checkpoint)
            with run.out_of_memory_ends_the_run(global_step):
                action = select_action(q_network, obs, epsilon, rng, run.device, args.select_own_only)

            # TRY NOT TO MODIFY: play it in the game (a Move carried on by --move-through), store the transition
            next_obs, reward, done = env.step(*game_call(action, obs, args.res, run.through_pixels))
            if (fault := mu.nonfinite(reward, next_obs)) is not None:
                # nothing non-finite reaches the replay: the episode ends at `obs`, cut short (stored as truncated)
                rb.cut(obs)
                run.game_fault(fault, global_step)  # said, counted; too many in a row stop the run
                break
            rb.add(obs, action, reward, done)
            run.probes("after_collect")
            obs = next_obs
            score += reward
            length += 1
            global_step += 1

            # ALGO LOGIC: training
            if global_step > args.learning_starts and global_step % args.train_frequency == 0:
                with run.out_of_memory_ends_the_run(global_step):
                    batch = batch_to_device(rb.sample(run.batch_size, rng, args.n_step), run.device)
                run.probes("after_sample")
                with run.out_of_memory_ends_the_run(global_step):
                    metrics = update(q_network, target_network, optimizer, batch, args, agent.amp)
                run.probes("after_optimizer_step")
                run.count_update(metrics, global_step)  # a skipped one is said; too many stop the run
                if global_step % args.log_every_steps < args.train_frequency:
                    run.log_update(metrics, global_step)

            # ALGO LOGIC: the target network
            if global_step % args.target_network_frequency == 0:
                target_network.load_state_dict(q_network.state_dict())
            # memory: the stage probes, allocator snapshots, the memory report and the leak check, when due
            run.watch_memory(global_step)
            run.say_status(global_step)  # every 30 s: rates, ETA, the last return and TD loss

        # TRY NOT TO MODIFY: the episode's charts, then the periodic greedy test and the time limit
        recent_train_scores = (recent_train_scores + [score])[-args.eval_every_episodes or -1 :]
        lr = optimizer.param_groups[0]["lr"]
        run.log_episode(episode, global_step, score, length, epsilon, lr)
        # TRY NOT TO MODIFY: this episode has ended and been logged: a resumed run goes on with the next one
        run.progress = Progress(episode, global_step, recent_train_scores, playing=None)
        if agent.scheduler is not None:
            agent.scheduler.step()  # ALGO LOGIC: the learning-rate schedule moves once per episode
        over_time = args.time_limit_min > 0 and time.time() - run.start_time >= 60 * args.time_limit_min
        if args.eval_every_episodes and (episode % args.eval_every_episodes == 0 or over_time):
            run.evaluate(episode, global_step, epsilon, lr, recent_train_scores)
        run.checkpoint_when_due(
            global_step
        )  # TRY NOT TO MODIFY: every --checkpoint-minutes, --checkpoint-every
        if over_time:
            run.logger.info(f"time limit of {args.time_limit_min:g} min reached after {episode} episodes")
            return "time_limit"
    return "num_episodes"


# ---------------------------------------------------------------------------------------------------------
# What each setting allows: RULES, read by `Args.problems` (and so by the input checks and sweep.py)
# ---------------------------------------------------------------------------------------------------------


# What each field allows: (field, test, the allowed values in words). A value that fails its test is refused in
# one sentence, "{field} must be {allowed}, got {value}", before anything is written.
# fmt: off
RULES = (
    ("num_episodes", lambda a: a.num_episodes >= 1, "at least 1"),
    ("res", lambda a: 8 <= a.res <= 256, "between 8 and 256 pixels"),
    ("step_mul", lambda a: a.step_mul >= 1, "at least 1 game loop"),
    ("screen_world_units", lambda a: 0 < a.screen_world_units <= 256, "between 0 and 256 world units (pysc2: 24)"),
    ("buffer_size", lambda a: a.buffer_size > a.n_step, "larger than n_step ({n_step}) so that an n-step return fits"),
    ("tower_channels", lambda a: a.tower_channels >= 1, "at least 1"),
    ("fused_channels", lambda a: a.fused_channels >= 1, "at least 1"),
    ("context_layers", lambda a: a.context_layers is None or 0 <= a.context_layers <= 8,
     "between 0 and 8 (or left out: the map's default)"),
    ("player_channels", lambda a: a.player_channels >= 1, "at least 1"),
    ("nonspatial_hidden", lambda a: a.nonspatial_hidden >= 1, "at least 1"),
    ("fine_kernel", lambda a: a.fine_kernel in (None, 1, 3, 5, 7),
     "1, 3, 5 or 7 (odd, so that it centres on the pixel; or left out: the map's default)"),
    ("fine_gain", lambda a: a.fine_gain is None or 0 <= a.fine_gain < math.inf,
     "0 or more (or left out: the map's default)"),
    ("move_through", lambda a: a.move_through is None or 0 <= a.move_through <= a.screen_world_units,
     "between 0 and screen_world_units ({screen_world_units}) (or left out: the map's default)"),
    ("seed", lambda a: 0 <= a.seed < 2**32, "between 0 and 2**32 - 1 (numpy's seeds)"),
    ("seeds", lambda a: all(0 <= seed < 2**32 for seed in a.seeds), "each between 0 and 2**32 - 1 (numpy's seeds)"),
    ("learning_rate", lambda a: 0 < a.learning_rate <= 1,
     "positive and at most 1 (Adam moves each weight by about the learning rate per step)"),
    ("batch_size", lambda a: a.batch_size >= 1, "at least 1"),
    ("gamma", lambda a: 0 < a.gamma <= 1, "in (0, 1]"),
    ("n_step", lambda a: 1 <= a.n_step <= 100, "between 1 and 100"),
    ("start_e", lambda a: 0 <= a.start_e <= 1, "in [0, 1]"),
    ("end_e", lambda a: 0 <= a.end_e <= a.start_e, "between 0 and start_e ({start_e})"),
    ("exploration_steps", lambda a: a.exploration_steps is None or a.exploration_steps >= 1,
     "at least 1 (or left out: the map's default)"),
    ("learning_starts", lambda a: a.learning_starts > a.n_step,
     "larger than n_step ({n_step}): the first updates would bootstrap from transitions not yet stored"),
    ("learning_starts", lambda a: a.backend != "builtin" or a.step_mul < 1 or a.learning_starts < a.num_episodes * episode_steps(a.step_mul),
     "below the run's agent steps on a built-in map (num_episodes x the steps of an episode at step_mul "
     "{step_mul}): no update would ever run"),
    ("train_frequency", lambda a: a.train_frequency >= 1, "at least 1"),
    ("target_network_frequency", lambda a: a.target_network_frequency >= 1, "at least 1"),
    ("max_grad_norm", lambda a: a.max_grad_norm > 0, "positive"),
    ("scheduler_tmax", lambda a: a.scheduler_tmax is None or a.scheduler_tmax >= 1, "at least 1 episode"),
    ("min_lr", lambda a: 0 <= a.min_lr <= a.learning_rate, "between 0 and learning_rate ({learning_rate})"),
    ("step_lr_step_size", lambda a: a.step_lr_step_size is None or a.step_lr_step_size >= 1,
     "at least 1 episode (or left out: the map's default)"),
    ("step_lr_gamma", lambda a: a.step_lr_gamma is None or 0 < a.step_lr_gamma <= 1,
     "in (0, 1] (or left out: the map's default)"),
    ("num_test_episodes", lambda a: a.num_test_episodes >= 1, "at least 1"),
    ("test_epsilon", lambda a: 0 <= a.test_epsilon <= 1, "in [0, 1]"),
    ("eval_every_episodes", lambda a: a.eval_every_episodes >= 0, "0 (never) or more"),
    ("num_eval_episodes", lambda a: a.num_eval_episodes >= 1, "at least 1"),
    ("log_every_steps", lambda a: a.log_every_steps >= 1, "at least 1"),
    ("torch_num_threads", lambda a: a.torch_num_threads >= 1, "at least 1"),
    ("time_limit_min", lambda a: a.time_limit_min >= 0, "0 (no limit) or more"),
    ("seeds", lambda a: len(set(a.seeds)) == len(a.seeds), "distinct"),
    ("wait_for_gpu_mb", lambda a: a.wait_for_gpu_mb >= 0, "0 (don't wait) or more"),
    ("wait_poll_s", lambda a: a.wait_poll_s > 0, "positive"),
    ("wait_timeout_s", lambda a: a.wait_timeout_s >= 0, "0 or more"),
    ("fallback_batch_size", lambda a: 1 <= a.fallback_batch_size <= a.batch_size,
     "between 1 and batch_size ({batch_size}): it is the smaller batch to fall back to"),
    ("memory_log_every", lambda a: a.memory_log_every >= 1, "at least 1"),
    ("leak_warmup_steps", lambda a: a.leak_warmup_steps >= 0, "0 or more"),
    ("max_nonfinite", lambda a: a.max_nonfinite >= 1, "at least 1"),
    ("replay_chunk_steps", lambda a: a.replay_chunk_steps >= 1, "at least 1"),
    ("checkpoint_minutes", lambda a: a.checkpoint_minutes >= 0, "0 (not by time) or more"),
    ("checkpoint_every", lambda a: a.checkpoint_every >= 0, "0 (not by steps) or more"),
    ("memory_snapshot_every", lambda a: a.memory_snapshot_every >= 0, "0 (off) or more"),
    ("snapshot_max_entries", lambda a: a.snapshot_max_entries >= 1, "at least 1"),
    ("gpu_memory_gb", lambda a: a.gpu_memory_gb is None or a.gpu_memory_gb > mu.CUDA_CONTEXT_GIB,
     f"more than {mu.CUDA_CONTEXT_GIB:g} GiB (the CUDA context alone takes about that much) or left out"),
)
# fmt: on


# the longest suffix a run id may get: `-seed4294967295` (several --seeds) or `-99` (a taken default id)
RUN_ID_SUFFIX_BYTES = len("-seed4294967295")


def name_problems(args: Args) -> list[tuple[str, str | None]]:
    """(field, why it cannot name a folder or None) for --run-id and --exp-name, which name the run's folders inside
    --save-path and --log-dir (`mu.name_problem`: no path, no `.` or `..`, short enough for the file system). The
    default run id, `{map_name}__{exp_name}__{seed}__{unix time}`, is checked whole."""
    default_id = f"{args.map_name}__{args.exp_name}__{2**32 - 1}__{2**31}"
    checks = [
        ("exp_name", args.exp_name, "exp_name"),
        ("exp_name", default_id, "the run id made from exp_name"),
    ]
    if args.run_id is not None:
        checks = [("run_id", args.run_id, "run_id"), checks[0]]
    return [
        (field, mu.name_problem(name, what, folder, reserve=RUN_ID_SUFFIX_BYTES))
        for field, name, what in checks
        for folder in (args.save_path, args.log_dir)
    ]


# =========================================================================================================
# The minigames: MoveToBeacon and CollectMineralShards in numpy (pysc2's observations, each map's own spawn rules,
# timer and marine speed), and the real game through pysc2, behind the one interface (reset, step, close) that
# `make_env` hands the loop. Part of Part 1, read only to change a map: nothing above needs their details.
# =========================================================================================================


# The marine. Speed 2.25 world units per normal-speed game second and radius 0.375: the game's unit data
# (the "Marine" entry of BurnySc2/sc2-techtree data/data.json, read from the game through its API); Liquipedia
# lists the same speed as 3.15 because it quotes "faster" real seconds (2.25 x 1.4). Per game loop:
# 2.25 / 16 = 3.15 / 22.4 = 0.1406 units, 2.25 units per agent step at step_mul 16.
MARINE_SPEED_PER_LOOP = 2.25 / GAME_LOOPS_PER_SECOND


MARINE_RADIUS = 0.375


MARINE_HIT_POINTS = 45  # max_health 45 in the same unit data


# Space. pysc2's feature screen spans `camera_width_world_units` across (`Args.screen_world_units`, pysc2's
# default 24 on both backends) and is centred on the camera: res / width pixels per world unit.
# Where things are, in the maps' own world coordinates (x east, y north), from the files inside
# pysc2/maps/mini_games/{MoveToBeacon,CollectMineralShards}.SC2Map: `Regions` and `MapScript.galaxy`.
# Both maps: "Playable Space" is the rectangle (22, 20)-(44, 36), the marines spawn at uniform random points
# in it, and the camera is panned to that rectangle's centre offset 3 units at 270 degrees (south).
PLAYABLE_WORLD = (22.0, 20.0, 44.0, 36.0)


CAMERA_CENTRE_WORLD = (33.0, 25.0)


# MoveToBeacon: the beacon spawns at a uniform random point of "Beacon Spawn Region", the rectangle
# (23.5, 21.5)-(42.5, 34.5) less a disc of radius 4 around (33, 28), drawn again until it is at least 5 units
# from the marine, at the start and after every pickup (the map script's `< 5.0` loops; docs/mini_games.md
# says "at least 4 units" for the start, the script uses 5 both times). A pickup is scored when the marine's
# position is inside "Beacon Area", a circle of radius 1.25 kept centred on the beacon (checked every 0.0625
# game seconds, i.e. every game loop). We draw the beacon with that radius: the Beacon_Terran model's own
# footprint radius is not in a source we could find.
BEACON_SPAWN_WORLD = (23.5, 21.5, 42.5, 34.5)


BEACON_SPAWN_HOLE_WORLD = (33.0, 28.0, 4.0)  # (x, y, radius) cut out of the spawn rectangle


BEACON_MIN_DISTANCE = 5.0


BEACON_RADIUS = 1.25


# CollectMineralShards: 20 shards ("NaturalMinerals") at uniform random points of "Mineral Area", the
# rectangle (23, 21)-(43, 35), each at least 2 units from the closest marine; a new field of 20 when all are
# collected (map script; docs/mini_games.md says the same). A marine collects a shard by touching it. The
# shard's pickup radius is an assumption (0.5 units): we found no source for it.
SHARD_SPAWN_WORLD = (23.0, 21.0, 43.0, 35.0)


SHARD_MIN_DISTANCE = 2.0


SHARD_RADIUS = 0.5


NUM_SHARDS = 20


# The minimap: we assume it shows the playable area, scaled so that its longer side (22 units) fills the
# minimap, centred (the minigames never move the camera, so it carries little beyond the screen).
MAP_WORLD_UNITS = PLAYABLE_WORLD[2] - PLAYABLE_WORLD[0]


def world_to_screen_units(x: float, y: float, width: float) -> tuple[float, float]:
    """Map world coordinates -> screen units (x right, y down from the top-left corner of a screen `width`
    world units across), as pysc2's feature-screen transform does for the camera at CAMERA_CENTRE_WORLD."""
    cx, cy = CAMERA_CENTRE_WORLD
    return x - (cx - width / 2), (cy + width / 2) - y


def screen_rect(
    world_rect: tuple[float, float, float, float], width: float
) -> tuple[float, float, float, float]:
    """A world rectangle (x0, y0, x1, y1) -> the same rectangle in screen units (x0, y0, x1, y1), y down."""
    x0, y1 = world_to_screen_units(world_rect[0], world_rect[1], width)
    x1, y0 = world_to_screen_units(world_rect[2], world_rect[3], width)
    return x0, y0, x1, y1


class BuiltinMiniGame:
    """MoveToBeacon / CollectMineralShards in numpy, with pysc2-shaped observations.

    `reset() -> obs`; `step(function_id, point) -> (obs, reward, done)` where point is (x, y) in screen
    pixels for Move_screen and select_point and None otherwise. obs: feature_screen (len(SCREEN_LAYERS), res,
    res) and feature_minimap (len(MINIMAP_LAYERS), res, res) int32 indexed [layer, y, x], player (11,) int64,
    available_actions (function ids). An unavailable function raises ValueError, as pysc2 does.
    Positions are kept in screen units (`world_units` across, y down; `world_to_screen_units`).
    Marines keep walking to their last Move target while the agent no-ops, as units in the game do.
    select_point selects the marine drawn at the clicked pixel (the nearer one if both are), or nothing on bare
    ground. Simplification: marines that are moved together all walk to the clicked point (no formation
    offsets, no collisions).
    """

    def __init__(
        self, map_name: str, res: int, step_mul: int, seed: int, world_units: float = Args.screen_world_units
    ):
        self.map_name, self.res, self.step_mul, self.world_units = map_name, res, step_mul, world_units
        self.max_steps = episode_steps(step_mul)
        self.rng = np.random.default_rng(seed)
        self.move_per_step = MARINE_SPEED_PER_LOOP * step_mul  # world units per agent step
        pixel = world_units / res
        centres = (np.arange(res) + 0.5) * pixel
        self.screen_x, self.screen_y = np.meshgrid(
            centres, centres
        )  # (res, res) screen units of pixel centres
        x0, y0, x1, y1 = screen_rect(PLAYABLE_WORLD, world_units)
        mini_pixel = MAP_WORLD_UNITS / res
        mini_x = (x0 + x1) / 2 + (np.arange(res) + 0.5 - res / 2) * mini_pixel
        mini_y = (y0 + y1) / 2 + (np.arange(res) + 0.5 - res / 2) * mini_pixel
        self.mini_x, self.mini_y = np.meshgrid(mini_x, mini_y)  # (res, res) screen units of minimap pixels
        inside = lambda c: (c >= 0) & (c < world_units)
        self.camera = (inside(self.mini_x) & inside(self.mini_y)).astype(np.int32)
        self.num_marines = 1 if map_name == "MoveToBeacon" else 2

    # -- world ------------------------------------------------------------------------------------------
    def _uniform_points(self, rect: tuple[float, float, float, float], n: int) -> np.ndarray:
        """n uniform random points of a world rectangle, in screen units: (n, 2)."""
        x0, y0, x1, y1 = screen_rect(rect, self.world_units)
        return np.stack([self.rng.uniform(x0, x1, n), self.rng.uniform(y0, y1, n)], axis=1)

    def _spawn_beacon(self) -> None:
        """A new beacon where the map script puts one (MoveToBeacon)."""
        hole_x, hole_y, hole_radius = BEACON_SPAWN_HOLE_WORLD
        hole = np.array(world_to_screen_units(hole_x, hole_y, self.world_units))
        while True:  # the map script draws again until both conditions hold
            p = self._uniform_points(BEACON_SPAWN_WORLD, 1)[0]
            far = np.linalg.norm(p - self.marines[0]) >= BEACON_MIN_DISTANCE
            if far and np.linalg.norm(p - hole) >= hole_radius:
                break
        self.pickups, self.pickup_radius = p[None], BEACON_RADIUS

    def _spawn_shards(self) -> None:
        """A new field of NUM_SHARDS shards where the map script puts them (CollectMineralShards)."""
        points = []
        while len(points) < NUM_SHARDS:
            p = self._uniform_points(SHARD_SPAWN_WORLD, 1)[0]
            if np.min(np.linalg.norm(self.marines - p, axis=1)) >= SHARD_MIN_DISTANCE:
                points.append(p)
        self.pickups, self.pickup_radius = np.array(points), SHARD_RADIUS

    def _spawn_pickups(self) -> None:
        """The map's pickups: a beacon or a field of shards."""
        self._spawn_beacon() if self.map_name == "MoveToBeacon" else self._spawn_shards()

    def reset(self) -> dict:
        """A new episode: marines and pickups where the map puts them; the first observation."""
        self.steps = 0
        self.marines = self._uniform_points(PLAYABLE_WORLD, self.num_marines)  # (M, 2) screen units
        self.targets = self.marines.copy()  # where each marine is walking to
        self.selected = np.zeros(self.num_marines, bool)
        self._spawn_pickups()
        return self._observe()

    def available_actions(self) -> np.ndarray:
        """The function ids pysc2 would offer now."""
        # select_point is always available in pysc2, select_army whenever there is an army (always here)
        ids = [FUNCTION_IDS["no_op"], SELECT_POINT, FUNCTION_IDS["select_army"]]
        if self.selected.any():
            ids.append(MOVE_SCREEN)
        return np.array(ids, np.int64)

    def step(self, function_id: int, point: tuple[int, int] | None = None):
        """One agent step: the call, then `step_mul` game loops of walking; (obs, reward, done)."""
        if function_id not in self.available_actions():
            raise ValueError(
                f"function {function_id} is not available now (available: {self.available_actions()})"
            )
        if function_id in (MOVE_SCREEN, SELECT_POINT):
            x, y = point
            if not (0 <= x < self.res and 0 <= y < self.res):
                raise ValueError(
                    f"point {point} of function {function_id} is outside the {self.res}x{self.res} screen"
                )
        if function_id == FUNCTION_IDS["select_army"]:
            self.selected[:] = True
        elif function_id == SELECT_POINT:
            self.selected[:] = False
            under = self._discs(self.screen_x, self.screen_y, self.marines, MARINE_RADIUS)[:, y, x]  # (M,)
            if under.any():
                clicked = np.array([self.screen_x[y, x], self.screen_y[y, x]])
                distance = np.where(under, np.linalg.norm(self.marines - clicked, axis=1), np.inf)
                self.selected[int(distance.argmin())] = True
        elif function_id == MOVE_SCREEN:
            target = np.array([(x + 0.5), (y + 0.5)]) * self.world_units / self.res
            self.targets[self.selected] = target
        reward = self._advance()
        self.steps += 1
        return self._observe(), reward, self.steps >= self.max_steps

    def _reach(self) -> float:
        """Distance between a marine's centre and a pickup's centre at which the pickup is scored."""
        if self.map_name == "MoveToBeacon":
            return BEACON_RADIUS  # the marine's position inside the "Beacon Area" circle
        return MARINE_RADIUS + SHARD_RADIUS  # the marine touches the shard

    def _advance(self) -> float:
        """Walk every marine up to one step's distance toward its target; collect what its path touches."""
        start = self.marines.copy()
        delta = self.targets - start
        dist = np.linalg.norm(delta, axis=1, keepdims=True)
        travel = np.minimum(dist, self.move_per_step)
        self.marines = start + np.where(dist > 0, delta / np.maximum(dist, 1e-9), 0.0) * travel
        # distance from each pickup to each marine's path segment: (M, P)
        seg = self.marines - start
        seg_len2 = np.maximum((seg**2).sum(1, keepdims=True), 1e-12)
        rel = self.pickups[None, :, :] - start[:, None, :]
        t = np.clip((rel * seg[:, None, :]).sum(-1) / seg_len2, 0.0, 1.0)
        closest = start[:, None, :] + t[..., None] * seg[:, None, :]
        touched = (np.linalg.norm(self.pickups[None] - closest, axis=-1) < self._reach()).any(0)
        reward = float(touched.sum())
        if touched.any():
            if self.map_name == "MoveToBeacon":
                self._spawn_beacon()  # the beacon moves somewhere new
            else:
                self.pickups = self.pickups[~touched]
                if len(self.pickups) == 0:
                    self._spawn_shards()  # all shards collected: a new field of 20
        return reward

    # -- observation ------------------------------------------------------------------------------------
    def _discs(self, gx, gy, centres, radius) -> np.ndarray:
        """(N, res, res) bool: pixels whose centre lies within `radius` of each centre (at least 1 pixel)."""
        d2 = (gx[None] - centres[:, 0, None, None]) ** 2 + (gy[None] - centres[:, 1, None, None]) ** 2
        discs = d2 <= radius**2
        nearest = d2.reshape(len(centres), -1).argmin(1)
        discs.reshape(len(centres), -1)[np.arange(len(centres)), nearest] = True
        return discs

    def _render(self, gx, gy, with_hit_points: bool):
        """One view's layers: player_relative, selected, unit_density and, on the screen, hit points."""
        marines = self._discs(gx, gy, self.marines, MARINE_RADIUS)  # (M, res, res)
        pickups = self._discs(gx, gy, self.pickups, self.pickup_radius)  # (P, res, res)
        player_relative = np.zeros((self.res, self.res), np.int32)
        player_relative[pickups.any(0)] = 3  # neutral
        player_relative[marines.any(0)] = 1  # self, drawn on top
        selected = marines[self.selected].any(0).astype(np.int32)
        density = marines.sum(0) + pickups.sum(0)
        hit_points = marines.any(0) * MARINE_HIT_POINTS if with_hit_points else None
        return player_relative, selected, density.astype(np.int32), hit_points

    def _observe(self) -> dict:
        """The observation dict, as pysc2's feature layers give it."""
        pr, sel, density, hp = self._render(self.screen_x, self.screen_y, True)
        mpr, msel, _, _ = self._render(self.mini_x, self.mini_y, False)
        n = self.num_marines
        player = np.array([1, 0, 0, n, n, n, 0, 0, n, 0, 0], np.int64)
        return {
            "feature_screen": np.stack([pr, sel, density, hp.astype(np.int32)]),  # (4, res, res)
            "feature_minimap": np.stack([mpr, msel, self.camera]),  # (3, res, res)
            "player": player,
            "game_loop": self.steps * self.step_mul,
            "available_actions": self.available_actions(),
        }

    def close(self) -> None:
        """Nothing to release."""


def import_pysc2():
    """Import pysc2 4.0.0 on Python >= 3.11 with a current protobuf; returns (sc2_env, actions).

    Two small compatibility fixes, nothing else changed:
    - pysc2/lib/colors.py calls random.shuffle(x, fn), an argument Python 3.11 removed. While pysc2
      imports, random.shuffle accepts it again and does exactly the old shuffle with `fn`.
    - s2clientprotocol's generated protobuf files predate protobuf 4; protobuf's pure-Python runtime still
      reads them. That runtime is picked when google.protobuf is first imported, which is why this runs
      before TensorBoard is imported.
    """
    os.environ.setdefault("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", "python")
    os.environ.setdefault("PYGAME_HIDE_SUPPORT_PROMPT", "1")
    original_shuffle = random.shuffle

    def legacy_shuffle(x, random_fn=None):
        """random.shuffle as it was before Python 3.11, with its `random` argument."""
        if random_fn is None:
            return original_shuffle(x)
        for i in reversed(range(1, len(x))):
            j = math.floor(random_fn() * (i + 1))
            x[i], x[j] = x[j], x[i]

    random.shuffle = legacy_shuffle
    try:
        from pysc2.env import sc2_env
        from pysc2.lib import actions
    finally:
        random.shuffle = original_shuffle
    return sc2_env, actions


class Pysc2MiniGame:
    """The real game (or pysc2's SC2TestEnv) behind the same interface as BuiltinMiniGame."""

    def __init__(self, env, res: int):
        self.env, self.res = env, res
        _, self.actions = import_pysc2()
        self.max_steps = None  # the map's own timer ends the episode

    @classmethod
    def make(
        cls, map_name: str, res: int, step_mul: int, seed: int, world_units: float = Args.screen_world_units
    ) -> "Pysc2MiniGame":
        """A pysc2 SC2Env of the minigame, with the built-in game's screen scale."""
        sc2_env, _ = import_pysc2()
        env = sc2_env.SC2Env(
            map_name=map_name,
            players=[sc2_env.Agent(sc2_env.Race.terran)],
            agent_interface_format=sc2_env.AgentInterfaceFormat(
                feature_dimensions=sc2_env.Dimensions(screen=res, minimap=res),
                camera_width_world_units=world_units,  # the built-in screen's scale
            ),
            step_mul=step_mul,
            game_steps_per_episode=0,  # the minigame's own 120 s timer ends the episode
            visualize=False,
            random_seed=seed,
        )
        return cls(env, res)

    def _convert(self, timestep) -> tuple[dict, float, bool]:
        """A pysc2 TimeStep -> (observation dict, reward, done)."""
        o = timestep.observation
        screen, minimap = o["feature_screen"], o["feature_minimap"]
        obs = {
            "feature_screen": np.stack([np.asarray(screen[layer.name]) for layer in SCREEN_LAYERS]),
            "feature_minimap": np.stack([np.asarray(minimap[layer.name]) for layer in MINIMAP_LAYERS]),
            "player": np.asarray(o["player"], np.int64),
            "game_loop": int(np.asarray(o["game_loop"]).reshape(-1)[0]),
            "available_actions": np.asarray(o["available_actions"], np.int64),
        }
        return obs, float(timestep.reward), bool(timestep.last())

    def reset(self) -> dict:
        """A new episode of the game; the first observation."""
        return self._convert(self.env.reset()[0])[0]

    def function_call(self, function_id: int, point: tuple[int, int] | None = None):
        """The pysc2 FunctionCall of one of FUNCTIONS, with the arguments pysc2's actions.py defines for it."""
        if function_id == MOVE_SCREEN:
            return self.actions.FunctionCall(function_id, [[0], list(point)])  # queued=now, (x, y)
        if function_id == SELECT_POINT:
            return self.actions.FunctionCall(
                function_id, [[0], list(point)]
            )  # select_point_act=select, (x, y)
        if function_id == FUNCTION_IDS["select_army"]:
            return self.actions.FunctionCall(function_id, [[0]])  # select, not add
        return self.actions.FunctionCall(function_id, [])

    def step(self, function_id: int, point: tuple[int, int] | None = None):
        """One agent step in the game: (obs, reward, done)."""
        return self._convert(self.env.step([self.function_call(function_id, point)])[0])

    def close(self) -> None:
        """Close the game."""
        self.env.close()


# =========================================================================================================
# Part 2: speed, installed by one call when a run is set up (`speed_up`, from `open_run`): today the torch thread
# count. It replaces no Part 1 function: mixed precision (--amp) is PyTorch's recipe inside Part 1's `update`, so
# the loop trains with the functions above as they are written, on every device. A faster version added here either
# calls the Part 1 function it replaces (wraps it, as LeanRL wraps `update` in torch.compile) or is checked against
# it on the run's own weights and batch at start-up, on resume and at each checkpoint, with a flag that turns it off,
# named by the sentence that stops the run when they differ (exit 7, as dreamer_atari.py's EXIT_FAST_PATH). Part 1
# names nothing here.
# =========================================================================================================


def speed_up(args: Args) -> None:
    """The speed options of `args`, installed: the torch thread count (--torch-num-threads)."""
    torch.set_num_threads(args.torch_num_threads)


# =========================================================================================================
# Part 3: the run. Input checks, stopping, the run's folder and set-up, memory wiring (memory_utils), logging and
# evaluation, test episodes and video, checkpoints, the results rows across runs, and `main`.
# =========================================================================================================


# ---------------------------------------------------------------------------------------------------------
# Input checks: the command line, RL_* variables, the game's installation
# ---------------------------------------------------------------------------------------------------------


class ConfigError(Exception):
    """A bad value from the command line, an RL_* variable or the machine: one sentence, exit status 2."""


def env_var_name(field: str) -> str:
    """The RL_* variable of an Args field."""
    return "RL_" + field.upper()


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def parse_env_value(name: str, raw: str, annotation) -> typing.Any:
    """Convert the text of one RL_* variable to the field's type, or raise ConfigError naming it."""
    origin, type_args = typing.get_origin(annotation), typing.get_args(annotation)
    text = raw.strip()
    if origin in (typing.Union, types.UnionType) and type(None) in type_args:
        if text.lower() in ("", "none", "null"):
            return None
        (annotation,) = [a for a in type_args if a is not type(None)]
        origin, type_args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        if text not in type_args:
            raise ConfigError(f"{name}={raw!r} is not allowed; use one of {', '.join(map(str, type_args))}.")
        return text
    if origin is tuple:
        try:
            return tuple(int(part) for part in text.replace(",", " ").split())
        except ValueError:
            raise ConfigError(f"{name}={raw!r} is not a list of integers; write them like '4 6 8'.") from None
    if annotation is bool:
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
        raise ConfigError(f"{name}={raw!r} is not a boolean; use true/false (or 1/0).")
    if annotation is int:
        try:
            return int(text)
        except ValueError:
            raise ConfigError(f"{name}={raw!r} is not an integer; give a whole number such as 8.") from None
    if annotation is float:
        try:
            value = float(text)
        except ValueError:
            raise ConfigError(f"{name}={raw!r} is not a number; give a value such as 5e-5.") from None
        if not math.isfinite(value):
            raise ConfigError(f"{name}={raw!r} is not a finite number.")
        return value
    return raw


def cli_fields(argv: list[str], bool_fields: set[str]) -> set[str]:
    """Fields named on the command line (tyro spells `batch_size` as --batch-size, booleans also --no-...)."""
    named = set()
    for token in argv:
        if not token.startswith("--"):
            continue
        name = token[2:].split("=", 1)[0].replace("-", "_")
        if name.startswith("no_") and name[3:] in bool_fields:
            name = name[3:]
        named.add(name)
    return named


def parse_args(argv: list[str] | None = None, environ: dict | None = None) -> tuple[Args, dict[str, str]]:
    """Command line > RL_* variable > default. Returns the Args and, per field, where its value came from."""
    argv = sys.argv[1:] if argv is None else list(argv)
    environ = os.environ if environ is None else environ
    hints = typing.get_type_hints(Args)
    known = {env_var_name(field.name) for field in dataclasses.fields(Args)}
    for name in sorted(environ):
        if name.startswith("RL_") and name not in known:  # a typo would silently train with the default
            import difflib

            close = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.8)
            hint = f"; did you mean {close[0]}?" if close else "; see --help for the settings"
            raise ConfigError(f"{name} is not a setting of this script{hint}")
    from_env = {}
    for field in dataclasses.fields(Args):
        name = env_var_name(field.name)
        if name in environ:
            from_env[field.name] = parse_env_value(name, environ[name], hints[field.name])
    args = tyro.cli(Args, args=argv, default=Args(**from_env))
    named = cli_fields(argv, {f.name for f in dataclasses.fields(Args) if hints[f.name] is bool})
    sources = {}
    for field in dataclasses.fields(Args):
        if field.name in named:
            sources[field.name] = "command line"
        elif field.name in from_env:
            sources[field.name] = env_var_name(field.name)
        else:
            sources[field.name] = "default"
    for field, sentence in args.problems():
        where = f" (from {sources[field]})" if sources[field].startswith("RL_") else ""
        raise ConfigError(sentence + where + ".")
    if args.amp == "fp16" and not (args.cuda and torch.cuda.is_available()):
        raise ConfigError("amp=fp16 needs a CUDA device and none is in use; use --amp auto, bf16 or off.")
    if args.gpu_memory_gb is not None and args.cuda and torch.cuda.is_available():
        # NVML's figure of the card: no CUDA context before the wait for memory (--wait-for-gpu-mb)
        problem = mu.gpu_cap_problem(args.gpu_memory_gb, mu.gpu_card_bytes(), flag="gpu_memory_gb")
        if problem:
            where = sources["gpu_memory_gb"]
            raise ConfigError(problem[:-1] + (f" (from {where})." if where.startswith("RL_") else "."))
    if args.backend == "pysc2":
        check_sc2_installed()
    return args, sources


def sc2_game_dir() -> str:
    """Where pysc2 looks for the game on Linux: SC2PATH, else ~/StarCraftII."""
    return os.environ.get("SC2PATH") or os.path.expanduser("~/StarCraftII")


def check_sc2_installed() -> None:
    """ConfigError (one sentence) unless pysc2 imports and the game is installed where it looks."""
    try:
        import_pysc2()
    except ImportError:
        raise ConfigError(
            "--backend pysc2 needs pysc2: pip install -r requirements-sc2.txt (or use --backend builtin)."
        ) from None
    except Exception as exc:  # noqa: BLE001 - any import-time failure is an installation problem
        raise ConfigError(
            f"pysc2 is installed but does not import ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''}); use --backend builtin."
        ) from None
    if not os.path.isdir(os.path.join(sc2_game_dir(), "Versions")):
        raise ConfigError(
            "--backend pysc2 needs the StarCraft II game, and none was found: install it and "
            "set SC2PATH to its folder (the one holding Versions/ and Maps/), or use --backend builtin."
        )


# ---------------------------------------------------------------------------------------------------------
# Stopping: signals and exit statuses
# ---------------------------------------------------------------------------------------------------------


EXIT_OOM = mu.EXIT_OOM


# the last line of an OOM diagnosis: this script's own flags that lower the peak (tests/test_oom_advice.py checks
# that each one exists); on CUDA --amp auto is already fp16
OOM_ADVICE = (
    "Flags that lower the peak: --amp fp16 or bf16 (if it was off), a smaller --batch-size, and "
    "PYTORCH_ALLOC_CONF=expandable_segments:True (set by default)."
)


# too many updates, or game steps, in a row with a non-finite value: a checkpoint of the last finite weights
EXIT_NONFINITE = mu.EXIT_NONFINITE


# a file the run cannot go on without (config, final or interrupted checkpoint, results) could not be written
EXIT_WRITE_FAILED = mu.EXIT_WRITE_FAILED


# an error in the loop (a crashed game, a bug): a checkpoint first, the traceback in {run_id}/crash.log
EXIT_CRASHED = mu.EXIT_CRASHED


class RunInterrupted(BaseException):
    """A run stopped early (a stop signal, seen at the top of an agent step; CUDA out of memory; too many non-finite
    values in a row): it checkpoints, unless `checkpoint` is False, and writes no results row. `sentence`: what is
    said on stderr (default: the reason). A BaseException, as KeyboardInterrupt is, so that no `except Exception`
    between the loop and the checkpoint code takes it for an ordinary error."""

    def __init__(
        self,
        reason: str,
        exit_code: int,
        sentence: str | None = None,
        checkpoint: bool = True,
        signal_: bool = False,
    ):
        super().__init__(reason)
        self.exit_code, self.checkpoint, self.signal = exit_code, checkpoint, signal_
        self.sentence = sentence or f"stopped by {reason}"


class RunCrashed(Exception):
    """An error in a run (a game that crashed, a bug), said in one paragraph: what raised and where, the checkpoint
    written first and the traceback in the run's crash.log."""


def check_stop(stop: mu.StopSignals) -> None:
    """At the top of every agent step (training, evaluation and test episodes): a SIGINT or SIGTERM received since
    the last step stops the run here, where nothing is half done (RunInterrupted: checkpoint, exit 128 + N)."""
    if stop.received:
        raise RunInterrupted(stop.name, stop.exit_code, signal_=True)


def sleep_unless_stopped(stop: mu.StopSignals):
    """A `sleep` for mu.wait_for_gpu that ends the wait for GPU memory (RunInterrupted) once a stop signal came."""

    def sleep(seconds: float) -> None:
        """Sleep, unless a stop signal came (before or during)."""
        check_stop(stop)
        time.sleep(seconds)
        check_stop(stop)

    return sleep


# ---------------------------------------------------------------------------------------------------------
# Setting a run up: its folder, config.json, logs, environments, agent and speed options
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Run:
    """What one seed's run holds: opened by `open_run`, given its agent, environments and memory instruments by
    `set_up`, handed to Part 1's loop (`train_one_seed`, through `run_one_seed`), closed by `close`."""

    args: Args
    seed: int
    run_id: str
    run_dir: str
    device: torch.device
    stop: mu.StopSignals  # SIGINT and SIGTERM, recorded; read at the top of every agent step
    config: dict  # config.json as written
    logger: logging.Logger
    writer: typing.Any  # torch.utils.tensorboard.SummaryWriter
    batch_size: int
    fallback_used: bool
    agent: Agent | None = None
    env: typing.Any = None  # BuiltinMiniGame or Pysc2MiniGame
    eval_env: typing.Any = None  # a second built-in game, or the same pysc2 game
    through_pixels: float = 0.0  # --move-through, in screen pixels
    leak: mu.LeakDetector | None = None
    probes: mu.StageProbes | None = None
    snapshots: mu.MemorySnapshots | None = None
    last_report: dict | None = None  # the latest memory report and leak verdict, for an OOM report
    last_verdict: typing.Any = None
    memory_report_failed: bool = False
    # where training stands: kept by Part 1's loop, set by `restore`, saved by a checkpoint
    progress: Progress = dataclasses.field(default_factory=lambda: Progress(0, 0, [], None))
    start_time: float = 0.0  # when the loop started (time.time()): steps/s, the time limit
    # the status line every 30 s (`say_status`), and what it says that the loop's logging saw last
    status: mu.StatusLine | None = None
    episodes_done: int = 0
    episode_end_step: int = 0  # the agent step the last finished episode ended at
    restarted_episodes: int = 0  # episodes a resume played again from the game's reset (`restore`)
    next_checkpoint_time: float = math.inf  # when a periodic checkpoint is due by wall time (time.time())
    next_checkpoint_step: float = math.inf  # and by agent steps
    last_length: int | None = None
    last_return: float | None = None
    last_td_loss: float | None = None
    # non-finite values kept out of the weights and the replay (`count_update`, `game_fault`), said by `say_faults`
    faults: dict = dataclasses.field(default_factory=lambda: {kind: Faults() for kind in FAULT_KINDS})

    @property
    def checkpoint_path(self) -> str:
        """Where the run's checkpoint goes."""
        return os.path.join(self.run_dir, "checkpoint.pt")

    @property
    def curve_path(self) -> str:
        """The periodic greedy tests' CSV."""
        return os.path.join(self.run_dir, "eval", "curve.csv")

    # The run's plumbing that Part 1's loop calls, `run.` and the name of the function below that does it
    def check_stop(self) -> None:
        """`check_stop` on this run's stop signals."""
        check_stop(self.stop)

    def out_of_memory_ends_the_run(self, global_step: int):
        """`out_of_memory_ends_the_run` for this run."""
        return out_of_memory_ends_the_run(self, global_step)

    def log_update(self, metrics: dict, global_step: int) -> None:
        """`log_update` for this run."""
        log_update(self, metrics, global_step, self.start_time)

    def watch_memory(self, global_step: int) -> None:
        """`watch_memory` for this run."""
        watch_memory(self, global_step)

    def say_status(self, global_step: int) -> None:
        """`say_status` for this run."""
        say_status(self, global_step)

    def log_episode(self, episode: int, global_step: int, score: float, length: int, epsilon: float, lr):
        """`log_episode` for this run."""
        log_episode(self, episode, global_step, score, length, epsilon, lr)

    def evaluate(self, episode: int, global_step: int, epsilon: float, lr: float, recent_train_scores: list):
        """`evaluate` for this run."""
        evaluate(self, episode, global_step, epsilon, lr, recent_train_scores, self.start_time)

    def checkpoint_when_due(self, global_step: int) -> None:
        """`checkpoint_when_due` for this run."""
        checkpoint_when_due(self, global_step)

    def count_update(self, metrics: dict, global_step: int) -> None:
        """`count_update` for this run."""
        count_update(self, metrics, global_step)

    def game_fault(self, fault: str, global_step: int) -> None:
        """`game_fault` for this run."""
        game_fault(self, fault, global_step)


@dataclass
class Faults:
    """Non-finite values of one kind (skipped updates, game steps left out): how many, in a row now, the last one
    and how many were said."""

    count: int = 0
    in_a_row: int = 0
    last: str = ""
    last_step: int = -1
    said: int = 0


FAULT_KINDS = ("updates", "game_steps")


def set_up(
    args: Args,
    sources: dict,
    seed: int,
    run_id: str,
    resume_step: int | None,
    stop: mu.StopSignals,
    made: "mu.StartUp | None" = None,
) -> Run:
    """A run ready to train: its folder's files, logs and speed options (`open_run`, which says in `made` what it
    made), its environments, the agent and its replay (`build_agent`) with the optimizer state preallocated, then the
    memory instruments (`instrument`)."""
    run = open_run(
        args, sources, seed, run_id, resume_step, stop, made or mu.StartUp(new=resume_step is None)
    )
    args = run.args
    run.env = make_env(args, seed)
    run.eval_env = make_env(args, seed + 10_000) if args.backend == "builtin" else run.env
    run.through_pixels = args.move_through * args.res / args.screen_world_units
    run.agent = build_agent(args, seed, run.device)
    if (
        args.replay_on_disk
    ):  # memory: one chunk of transitions in host memory; the rest written as the run goes
        fields = {name: (array.shape[1:], array.dtype) for name, array in run.agent.rb.slots().items()}
        folder = os.path.join(run.run_dir, "replay")
        run.agent.rb.log = mu.ReplayLog(folder, fields, args.replay_chunk_steps, say=run.logger.info)
    prealloc_mb = preallocate_or_fall_back(run, sources)
    if run.config["batch_size_used"] != run.batch_size:  # the fallback batch, after an OOM at preallocation
        run.config.update(
            batch_size_used=run.batch_size,
            fallback_used=True,
            fallback_reason="optimizer-state preallocation ran out of memory at the full batch",
        )
        atomic_write_bytes(
            os.path.join(run.run_dir, "config.json"), json.dumps(run.config, indent=2).encode()
        )
    run.logger.info(
        f"run {run.run_id}: device {run.device}, amp {run.agent.amp.mode}, batch {run.batch_size}"
        f"{' (fallback)' if run.fallback_used else ''}, optimizer state preallocated ({prealloc_mb:.1f} MB peak)"
    )
    instrument(run)
    return run


def open_run(
    args: Args,
    sources: dict,
    seed: int,
    run_id: str,
    resume_step: int | None,
    stop: mu.StopSignals,
    made: "mu.StartUp",
) -> Run:
    """The run's folder, claimed for a new run (`claim_run_folder`: the run id may get a suffix), with config.json,
    train.log and eval/curve.csv; wandb and TensorBoard; after waiting for GPU memory when asked to. `made` records
    what it made, as it makes it."""
    allocator = mu.configure_allocator(verbose=False)  # memory: before anything touches CUDA
    mu.one_malloc_arena()  # memory: before TensorBoard's and wandb's threads, whose own heaps are never trimmed
    device = resolve_device(args)
    batch_size, fallback_used, wait_line = wait_for_memory(args, device, stop)  # before building anything
    check_fits_under_cap(args, device)  # by arithmetic, before anything is written (DoesNotFit: exit 3)
    if resume_step is None:  # a resumed run goes on in its own folder
        run_id = claim_run_folder(args.save_path, run_id, chosen=args.run_id is not None)
    run_dir = made.run_dir = os.path.join(args.save_path, run_id)
    try:  # held for this process alone: two resumes of one checkpoint never write into one folder
        made.lock = mu.lock_run_dir(run_dir)
    except mu.RunDirInUse as exc:
        raise ConfigError(f"--resume: {exc}." if resume_step is not None else f"{exc}.") from None
    events_dir = tensorboard_dir(args, run_dir, run_id, resumed=resume_step is not None)
    os.makedirs(os.path.join(run_dir, "eval"), exist_ok=True)
    logger = make_logger(run_dir, run_id)
    if wait_line:
        logger.info(wait_line)
    # the CUDA context, capped (--gpu-memory-gb); a GPU without room for it: exit 3
    start_cuda(args, device, run_dir, logger)
    speed_up(args)  # Part 2, installed once: the thread count
    config = {
        "run_id": run_id,
        "seed": seed,
        "device": str(device),
        "batch_size_used": batch_size,
        "fallback_used": fallback_used,
        "amp": mu.amp(args.amp, device).mode,  # --amp resolved on this device, as `build_agent` does
        "allocator": allocator,
        "episode_steps": episode_steps(args.step_mul) if args.backend == "builtin" else None,
        "tensorboard_dir": events_dir,
        "args": dataclasses.asdict(args),
        "sources": sources,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
    }
    atomic_write_bytes(os.path.join(run_dir, "config.json"), json.dumps(config, indent=2).encode())
    curve_path = os.path.join(run_dir, "eval", "curve.csv")
    if resume_step is None or not os.path.exists(curve_path):
        atomic_write_bytes(
            curve_path, b"episode,global_step,wall_time_s,epsilon,train_score_mean,test_score_mean\n"
        )
    if args.track and start_wandb(args, run_id, run_dir, logger):
        made.closers.append(lambda: sys.modules["wandb"].finish())
    elif args.track:
        args = dataclasses.replace(args, track=False)
    made.event_dirs.append(events_dir)
    writer = open_tensorboard(args, sources, events_dir, resume_step, logger)
    made.closers.append(writer.close)
    return Run(
        args,
        seed,
        run_id,
        run_dir,
        device,
        stop,
        config,
        logger,
        writer,
        batch_size,
        fallback_used,
    )


def resolve_device(args: Args) -> torch.device:
    """CUDA when asked for and present, else the CPU."""
    return torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")


def claim_run_folder(save_path: str, run_id: str, chosen: bool) -> str:
    """Create a new run's folder, marked as this script's (`mu.make_run_dir`), so that no two runs ever share one;
    returns the run id it got. A default run id (`{map}__{exp_name}__{seed}__{unix time}`) that another run took
    already gets a suffix (`-2`, said in one line); a `--run-id` the user chose is refused (ConfigError) when its
    folder exists: creating a folder is atomic, so of two runs given one --run-id at once, one gets it."""
    if not chosen:
        return mu.claim_run_dir(save_path, run_id, script=__file__)[1]
    folder = os.path.join(save_path, run_id)
    try:
        mu.make_run_dir(save_path, run_id, script=__file__)
    except FileExistsError:
        raise ConfigError(folder_taken(run_id, folder)) from None
    return run_id


# what a run writes into its folder: a folder of these alone is a run's, also without the mark of RUN_MARK
RUN_FILES = (
    "config.json",
    "train.log",
    "checkpoint.pt",
    "checkpoint.pt.sha256",
    "crash.log",
    "eval",
    "videos",
)
RUN_FILES += ("oom", "memory_snapshots", "wandb", "replay", mu.LOCK_FILE)


def folder_taken(run_id: str, folder: str) -> str:
    """The sentence that refuses a --run-id whose folder exists: a run's (--overwrite replaces it) or not."""
    if os.path.isfile(os.path.join(folder, "config.json")) or os.path.isfile(
        os.path.join(folder, mu.RUN_MARK)
    ):
        return run_id_taken(run_id, folder)
    return (
        f"run id {run_id!r} names {folder}, which exists and holds no run of this script; choose another --run-id "
        f"(its files are left as they are)."
    )


def run_id_taken(run_id: str, folder: str) -> str:
    """The sentence that refuses a --run-id whose folder holds a run."""
    return (
        f"run id {run_id!r} already holds a run in {folder}; pass --overwrite to replace it, "
        f"or choose another --run-id."
    )


def atomic_write_bytes(path: str, data: bytes) -> None:
    """Write a temporary file in the same folder, then rename it over `path`: old or new, never half. A full disk
    (no space, quota, read-only, I/O error) raises mu.WriteFailed with the partial file already removed."""
    mu.atomic_write(path, data)


def start_wandb(args: Args, run_id: str, run_dir: str, logger) -> bool:
    """Track the run in Weights and Biases (offline with WANDB_MODE=offline); False, after one line saying that
    tracking is off and why (no API key, a folder it cannot write), if it cannot start: the run trains on."""
    return mu.start_wandb(
        logger.info,
        project=args.wandb_project_name,
        entity=args.wandb_entity,
        sync_tensorboard=True,
        config=dataclasses.asdict(args),
        name=run_id,
        dir=run_dir,
        save_code=True,
    )


def tensorboard_dir(args: Args, run_dir: str, run_id: str, resumed: bool) -> str:
    """Where the run's TensorBoard events go, as an absolute path: `{log_dir}/{run_id}`; a resumed run's where the
    run's first part wrote them (its config.json says), wherever it was started."""
    if resumed:
        with (
            contextlib.suppress(OSError, ValueError, KeyError, TypeError),
            open(os.path.join(run_dir, "config.json")) as f,
        ):
            return json.load(f)["tensorboard_dir"]
    return os.path.abspath(os.path.join(args.log_dir, run_id))


def open_tensorboard(args: Args, sources: dict, events_dir: str, resume_step: int | None, logger):
    """The SummaryWriter of `events_dir` (`tensorboard_dir`), with the hyperparameters as its first text."""
    settings = {name: (value, sources[name]) for name, value in dataclasses.asdict(args).items()}
    return mu.open_tensorboard(events_dir, settings, ("value", "source"), resume_step, logger.info)


def make_logger(run_dir: str, run_id: str) -> logging.Logger:
    """train.log in the run folder, and stdout: each line with its time."""
    logger = logging.getLogger(f"{__name__}.{run_id}")
    logger.setLevel(logging.INFO)
    logger.propagate = False
    logger.handlers.clear()
    formatter = logging.Formatter("%(asctime)s %(message)s")
    for handler in (
        logging.FileHandler(os.path.join(run_dir, "train.log")),
        logging.StreamHandler(sys.stdout),
    ):
        handler.setFormatter(formatter)
        logger.addHandler(handler)
    return logger


# ---------------------------------------------------------------------------------------------------------
# Memory wiring (memory_utils): waiting for GPU memory, optimizer-state preallocation, reports, OOM
# ---------------------------------------------------------------------------------------------------------


def wait_for_memory(args: Args, device, stop: mu.StopSignals) -> tuple[int, bool, str | None]:
    """Before anything is built: (batch size to use, whether the fallback is used, a line to log). A stop signal
    ends the wait (RunInterrupted)."""
    if args.wait_for_gpu_mb <= 0:
        return args.batch_size, False, None
    if device.type != "cuda":
        return (
            args.batch_size,
            False,
            (f"wait: --wait-for-gpu-mb {args.wait_for_gpu_mb:g} ignored: no CUDA device, training on CPU"),
        )
    if mu.wait_for_gpu(
        args.wait_for_gpu_mb,
        args.wait_poll_s,
        args.wait_timeout_s,
        device=device,
        sleep=sleep_unless_stopped(stop),
    ):
        return args.batch_size, False, f"wait: {args.wait_for_gpu_mb:g} MB free on {device}"
    return (
        args.fallback_batch_size,
        True,
        (
            f"wait: fewer than {args.wait_for_gpu_mb:g} MB free after {args.wait_timeout_s:g} s; "
            f"continuing with fallback batch size {args.fallback_batch_size} instead of {args.batch_size}"
        ),
    )


class DoesNotFit(Exception):
    """The run cannot fit under --gpu-memory-gb: one sentence naming what does not, exit status 3 (EXIT_OOM)."""


def networks_and_optimizer_nbytes(args: Args) -> int:
    """Bytes of the online and target Q networks and of Adam's state (two moments per weight, a step per tensor),
    from the network built on the meta device: nothing is allocated."""
    with torch.device("meta"):
        q_network = make_q_network(**network_settings(args))
    weights = [*q_network.parameters(), *q_network.buffers()]
    return 2 * sum(t.nbytes for t in weights) + sum(2 * p.nbytes + 4 for p in q_network.parameters())


def check_fits_under_cap(args: Args, device) -> None:
    """--gpu-memory-gb on CUDA, by arithmetic before anything is built or written: the Q networks and the optimizer
    state must fit in the cap (DoesNotFit otherwise). The update's activations are measured by the preallocation,
    under the cap (`start_cuda` sets it): an OOM there says so in train.log and exits 3."""
    if args.gpu_memory_gb is None or device.type != "cuda":
        return
    problem = mu.gpu_fit_problem(
        mu.GpuCap(args.gpu_memory_gb),
        [
            (
                "the Q networks and the optimizer state",
                networks_and_optimizer_nbytes(args),
                "smaller --tower-channels and --fused-channels would fit",
            )
        ],
    )
    if problem:
        raise DoesNotFit(problem)


def start_cuda(args: Args, device, run_dir: str, logger) -> None:
    """Make this process's CUDA context now (after any wait for memory), with torch's allocator capped under
    --gpu-memory-gb. A GPU without room for the context itself (another process holds nearly all of it) is an
    out-of-memory error like any other: the report in oom/, one line in train.log, exit 3, nothing trained."""
    if device.type != "cuda":
        if args.gpu_memory_gb is not None:
            logger.info(
                f"--gpu-memory-gb {args.gpu_memory_gb:g} ignored: no CUDA device, training on the CPU"
            )
        return
    try:
        if args.gpu_memory_gb is None:
            torch.cuda.mem_get_info(device)  # the context is made by the first call that needs it
            return
        cap = mu.GpuCap(args.gpu_memory_gb)
        fraction = mu.apply_gpu_cap(cap, device)
    except RuntimeError as exc:  # the driver's "CUDA error: out of memory" is not torch's OutOfMemoryError
        if "out of memory" not in str(exc).lower():
            raise
        oom = mu.out_of_memory(exc, __file__, run_dir, advice=OOM_ADVICE, device=device)
        logger.info(
            f"out of memory at start-up ({oom.where}): the GPU has no room for this process's CUDA context (about "
            f"{mu.CUDA_CONTEXT_GIB:g} GiB), so nothing was built or trained; --wait-for-gpu-mb MB waits for room."
        )
        raise RunInterrupted("out of memory", EXIT_OOM) from None
    logger.info(
        f"gpu: at most {cap.gib:g} GiB (--gpu-memory-gb): torch's allocator capped at "
        f"{cap.allocator_bytes / mu.GIB:.2f} GiB ({fraction:.4f} of the card), {mu.CUDA_CONTEXT_GIB:g} GiB left to "
        f"the CUDA context"
    )


def dummy_batch(batch_size: int, res: int, n_step: int, device) -> dict:
    """A worst-case-sized batch (all actions available) for optimizer-state preallocation."""

    def states():
        """Zero states of the batch's shape, every action available."""
        return {
            "screen": np.zeros((batch_size, len(SCREEN_LAYERS), res, res), np.int16),
            "minimap": np.zeros((batch_size, len(MINIMAP_LAYERS), res, res), np.int16),
            "player": np.zeros((batch_size, PLAYER_INPUT_SIZE), np.float32),
            "mask": np.ones((batch_size, len(FUNCTIONS)), bool),
        }

    return batch_to_device(
        {
            "obs": states(),
            "next_obs": states(),
            "actions": np.zeros(batch_size, np.int64),
            "rewards": np.zeros((batch_size, n_step), np.float32),
            "dones": np.zeros((batch_size, n_step), np.float32),
            "truncated": np.zeros((batch_size, n_step), np.float32),
            "steps": np.full(batch_size, n_step, np.int64),
        },
        device,
    )


def preallocate(
    q_network, target_network, optimizer, amp: mu.AmpSetup, args: Args, batch_size: int, device
) -> float:
    """Adam's moments exist before the first real update, and not one weight changes: Part 1's `update` on a
    worst-case batch, then undone (weights, gradients, Adam's state, RNG states). Its loss scaler is a fresh one set
    up like `amp.scaler`, so that the run's loss scale does not move."""
    batch = dummy_batch(batch_size, args.res, args.n_step, device)
    amp = dataclasses.replace(amp, scaler=amp.new_scaler())

    def step_fn():
        """The update the run makes, on the dummy batch."""
        update(q_network, target_network, optimizer, batch, args, amp)

    # memory: fail now, not at the first update hours later, if the optimizer state does not fit
    return mu.preallocate_optimizer_state(step_fn, optimizer, modules=[q_network, target_network])


def drop_optimizer_state(optimizer) -> None:
    """The gradients and optimizer state a failed step made: dropped, so that a retry starts from nothing."""
    optimizer.zero_grad(set_to_none=True)
    optimizer.state.clear()


def preallocate_or_fall_back(run: "Run", sources: dict) -> float:
    """Preallocate the optimizer state (the first step is where memory runs out). If that runs out of memory and
    the user asked for a fallback (--wait-for-gpu-mb, or --fallback-batch-size set), wait for the memory once more
    and retry at the fallback batch (`run.batch_size`, `run.fallback_used`); otherwise, or if that fails too, write
    the OOM report and stop with exit 3 before anything is trained. Returns the peak MB."""
    args, agent = run.args, run.agent
    fallback_asked = args.wait_for_gpu_mb > 0 or sources.get("fallback_batch_size", "default") != "default"
    while True:
        fallback_left = fallback_asked and run.batch_size > args.fallback_batch_size
        try:
            return preallocate(
                agent.q_network,
                agent.target_network,
                agent.optimizer,
                run.agent.amp,
                args,
                run.batch_size,
                run.device,
            )
        except torch.OutOfMemoryError as exc:
            oom = mu.out_of_memory(
                exc,
                __file__,
                None if fallback_left else run.run_dir,  # the report, once no fallback is left
                advice=OOM_ADVICE,
                release=lambda: drop_optimizer_state(agent.optimizer),
                device=run.device,
            )
        if not fallback_left:
            under = f" under --gpu-memory-gb {args.gpu_memory_gb:g}" if args.gpu_memory_gb is not None else ""
            run.logger.info(
                f"out of memory at start-up ({oom.where}): optimizer-state preallocation at batch {run.batch_size} "
                f"(the update's activations) does not fit{under}, so nothing was trained.\n{oom.diagnosis}\n"
                + (
                    ""
                    if fallback_asked
                    else "--wait-for-gpu-mb MB (wait for room) or --fallback-batch-size N "
                    "(retry smaller) let the run go on instead."
                )
            )
            raise RunInterrupted("out of memory", EXIT_OOM)
        run.logger.info(
            f"preallocation: batch {run.batch_size} does not fit ({str(oom.error).splitlines()[0]}); "
            f"retrying with the fallback batch size {args.fallback_batch_size}"
        )
        if run.device.type == "cuda" and args.wait_for_gpu_mb > 0:
            mu.wait_for_gpu(
                args.wait_for_gpu_mb,
                args.wait_poll_s,
                args.wait_timeout_s,
                device=run.device,
                sleep=sleep_unless_stopped(run.stop),
            )
        run.batch_size, run.fallback_used = args.fallback_batch_size, True


def instrument(run: Run) -> None:
    """The memory instruments: the replay's size in train.log, a full disk said now (not at the first checkpoint),
    stage probes, allocator snapshots, a snapshot at the moment of a CUDA OOM, and the leak detector."""
    args, agent = run.args, run.agent
    obs_bytes, aux_bytes = agent.rb.bytes_per_step()
    run.logger.info(
        f"replay: {obs_bytes} B of observations + {aux_bytes} B of the rest per step, "
        f"{(obs_bytes + aux_bytes) * args.buffer_size / 2**20:.0f} MB when full"
    )
    checkpoint_bytes = mu.estimate_nbytes(
        [agent.q_network.state_dict(), agent.target_network.state_dict(), agent.optimizer.state_dict()]
    )
    log = agent.rb.log
    checkpoint_bytes += 0 if log is None else log.chunk_rows * mu.ReplayLog.row_nbytes(log.fields)
    replay_bytes = 0 if log is None else log.disk_nbytes(args.buffer_size)
    if warning := mu.disk_space_warning(run.run_dir, checkpoint_bytes, replay_bytes=replay_bytes):
        run.logger.info(warning)
    run.probes = mu.StageProbes(enabled=args.memory_probes, device=run.device)
    run.snapshots = mu.MemorySnapshots(
        run.run_dir,
        every=args.memory_snapshot_every,
        max_entries=args.snapshot_max_entries,
        device=run.device,
    )
    if run.device.type == "cuda":
        mu.install_oom_observer(run.run_dir)
    run.leak = mu.LeakDetector(warmup_steps=args.leak_warmup_steps)
    run.status = mu.StatusLine(
        run.writer, "td_loss", phase_starts=(args.learning_starts,), say=run.logger.info
    )


def watch_memory(run: Run, global_step: int) -> None:
    """The end of an agent step: the stage probes' iteration, an allocator snapshot when one is due and, every
    `memory_log_every` agent steps, the memory report and the leak check (never again once a report failed)."""
    run.probes.end_iteration(global_step)
    run.snapshots.maybe_dump(global_step)
    if global_step % run.args.memory_log_every == 0 and not run.memory_report_failed:
        log_memory(run, global_step)


def log_memory(run: Run, global_step: int) -> None:
    """The memory report and the leak check, every `memory_log_every` agent steps."""
    try:
        run.writer.flush()  # memory: no TensorBoard record still queued is read as growth
        # memory: memory_report() collects garbage and trims the heap first (live memory)
        run.last_report = mu.memory_report(buffer_stats=run.agent.rb.stats(), device=run.device)
        for key, value in {**run.last_report, **run.probes.scalars()}.items():
            run.writer.add_scalar(key, value, global_step)
        if run.args.memory_probes:
            run.logger.info(run.probes.verdict())
        run.leak.observe(global_step, run.last_report)
        verdict = run.leak.check()
        last = run.last_verdict
        if verdict.leaking and (last is None or not last.leaking or verdict.cause != last.cause):
            run.logger.info(f"memory: {verdict.diagnosis}")
        run.last_verdict = verdict
    except Exception as exc:  # noqa: BLE001 - memory: diagnostics never break training
        run.logger.info(f"memory: report failed ({type(exc).__name__}: {exc}); not reporting again")
        run.memory_report_failed = True


@contextlib.contextmanager
def out_of_memory_ends_the_run(run: Run, global_step: int):
    """A CUDA OOM while acting, copying a batch, updating or testing: the report in oom/, the diagnosis in
    train.log, then RunInterrupted (checkpoint, exit 3), as a stop signal would."""
    try:
        yield
    except torch.OutOfMemoryError as exc:
        # memory: the failed step's tensors are dropped before the report looks at what is left
        oom = mu.out_of_memory(
            exc,
            __file__,
            run.run_dir,
            advice=OOM_ADVICE,
            last_report=run.last_report,
            verdict=run.last_verdict,
            device=run.device,
        )
        run.logger.info(f"out of memory at step {global_step} ({oom.where}):\n{oom.diagnosis}")
        raise RunInterrupted("out of memory", EXIT_OOM) from None


# ---------------------------------------------------------------------------------------------------------
# Logging and evaluation during training
# ---------------------------------------------------------------------------------------------------------


def log_update(run: Run, metrics: dict, global_step: int, start_time: float) -> None:
    """`losses/*` of the latest update, `charts/SPS`, and what non-finite values were kept out since the last time."""
    for key, value in metrics.items():  # memory: floats, once per log interval
        if key == "finite":
            continue
        value = value.item()
        run.writer.add_scalar(key, value, global_step)
        if key == "losses/td_loss":
            run.last_td_loss = value  # for the status line
    run.writer.add_scalar("charts/SPS", global_step / (time.time() - start_time), global_step)
    say_faults(run, global_step)


def count_update(run: Run, metrics: dict, global_step: int) -> None:
    """After each update: one whose step was skipped (`update`: a non-finite loss or gradient) is counted and, the
    first time, named in one line (the TD loss, or the Q network's gradient); later ones are counted at each log
    point (`say_faults`). `--max-nonfinite` in a row stop the run (exit 5) with a checkpoint of the weights, which
    no skipped step changed."""
    faults = run.faults["updates"]
    if metrics["finite"]:
        faults.in_a_row = 0
        return
    loss, grad_norm = metrics["losses/td_loss"].item(), metrics["losses/grad_norm"].item()
    source = (
        f"the TD loss was {loss:g}"
        if not math.isfinite(loss)
        else f"the Q network's gradient norm was {grad_norm:g}"
    )
    faults.count, faults.in_a_row, faults.last = (
        faults.count + 1,
        faults.in_a_row + 1,
        f"{source} at agent step {global_step}",
    )
    if faults.count == 1:
        faults.said = 1
        run.logger.info(
            f"update skipped: {faults.last}; the weights stay as they were (later ones: a count per log point)"
        )
    if faults.in_a_row >= run.args.max_nonfinite:
        weights_finite(run, global_step)  # weights no skipped step changed, unless something else did
        raise RunInterrupted(
            "non-finite updates",
            EXIT_NONFINITE,
            sentence=f"stopping: {faults.in_a_row} updates in a row had a non-finite loss or gradient (the last: "
            f"{faults.last}) and were skipped, so the checkpoint holds the last finite weights; try a lower "
            f"--learning-rate{' or --amp off' if run.agent.amp.enabled else ''}.",
        )


def game_fault(run: Run, fault: str, global_step: int) -> None:
    """A game's step with a non-finite reward or observation (`mu.nonfinite`), which the loop left out of the replay,
    ending its episode: counted and, the first time, named in one line; later ones at each log point. A step that
    fails again before any finite one (at the same agent step) counts in a row: `--max-nonfinite` of them stop the
    run (exit 5): nothing it could learn from comes out of the game."""
    faults = run.faults["game_steps"]
    faults.in_a_row = faults.in_a_row + 1 if global_step == faults.last_step else 1
    faults.count, faults.last_step, faults.last = (
        faults.count + 1,
        global_step,
        f"{fault} at agent step {global_step}",
    )
    if faults.count == 1:
        faults.said = 1
        run.logger.info(
            f"the game gave a non-finite {faults.last}: that step is left out of the replay and its episode ends "
            f"there, stored as truncated (later ones: a count per log point)"
        )
    if faults.in_a_row >= run.args.max_nonfinite:
        raise RunInterrupted(
            "non-finite game steps",
            EXIT_NONFINITE,
            sentence=f"stopping: the game (--backend {run.args.backend}) gave a non-finite value at {faults.in_a_row} "
            f"steps in a row (the last: {faults.last}); none reached the replay, and the checkpoint holds the last "
            f"finite weights.",
        )


def say_faults(run: Run, global_step: int) -> None:
    """At each log point (an update's logged, an episode's end): the skipped updates and the game steps left out
    since the last one said, if any, in a line and in TensorBoard (`debug/nonfinite_*`)."""
    for kind, faults in run.faults.items():
        if faults.count > faults.said:
            new = faults.count - faults.said
            what = ("update" if new == 1 else "updates") + " skipped"
            if kind == "game_steps":
                what = ("game step" if new == 1 else "game steps") + " left out of the replay"
            run.logger.info(
                f"{new} more {what} for a non-finite value ({faults.count} in all; the last: {faults.last})"
            )
            faults.said = faults.count
        run.writer.add_scalar(f"debug/nonfinite_{kind}", faults.count, global_step)


def weights_finite(run: Run, global_step: int) -> None:
    """Before an evaluation, the final test or a checkpoint: the Q network's weights are finite, or the run stops
    (exit 5) with no evaluation, results row or checkpoint from them (the last checkpoint stays)."""
    bad = [name for name, p in run.agent.q_network.named_parameters() if not torch.isfinite(p).all()]
    if bad:
        raise RunInterrupted(
            "non-finite weights",
            EXIT_NONFINITE,
            sentence=f"stopping at agent step {global_step}: the Q network's weights are not finite ({bad[0]}"
            f"{f' and {len(bad) - 1} more' if len(bad) > 1 else ''}), so no evaluation, results row or checkpoint is "
            f"written from them; the last checkpoint is kept.",
            checkpoint=False,
        )


def log_episode(
    run: Run, episode: int, global_step: int, score: float, length: int, epsilon: float, lr: float
):
    """`charts/*` of a finished training episode, and its line on stdout."""
    run.episodes_done, run.episode_end_step = episode, global_step  # for the status line
    run.last_length, run.last_return = length, score
    run.writer.add_scalar("charts/episodic_return", score, global_step)
    run.writer.add_scalar("charts/episodic_length", length, global_step)
    run.writer.add_scalar("charts/epsilon", epsilon, global_step)
    run.writer.add_scalar("charts/learning_rate", lr, episode)
    run.writer.add_scalar("debug/restarted_episodes", run.restarted_episodes, global_step)
    print(
        f"episode={episode} global_step={global_step} score={score:g} epsilon={epsilon:.3f} lr={lr:.3g}",
        flush=True,
    )
    say_faults(run, global_step)


def updates_made(args: Args, global_step: int) -> int:
    """The updates the loop has made by `global_step`: one every `train_frequency` agent steps after
    `learning_starts`."""
    if global_step <= args.learning_starts:
        return 0
    return global_step // args.train_frequency - args.learning_starts // args.train_frequency


def say_status(run: Run, global_step: int) -> None:
    """Every 30 s of wall time (`mu.StatusLine`): the episode and step, agent steps/s, updates/s, the ETA of the run's
    end (the episodes left at the last episode's length, or the --time-limit-min left if that comes first), the
    last episode's score and the last logged TD loss, in train.log and under `status/*` in TensorBoard."""
    args = run.args
    updates = updates_made(args, global_step)
    if not run.status.tick(global_step, updates):
        return
    episode_length = run.last_length or (episode_steps(args.step_mul) if args.backend == "builtin" else None)
    episodes_left = args.num_episodes - run.episodes_done
    remaining = (
        episodes_left * episode_length - (global_step - run.episode_end_step) if episode_length else None
    )
    time_left = 60 * args.time_limit_min - run.status.elapsed_s() if args.time_limit_min > 0 else None
    run.status.emit(
        global_step,
        updates,
        remaining_steps=remaining,
        last_return=run.last_return,
        loss=run.last_td_loss,
        progress=f"episode {run.episodes_done + 1:,}/{args.num_episodes:,} step {global_step:,}",
        time_left_s=time_left,
    )


def evaluate(
    run: Run,
    episode: int,
    global_step: int,
    epsilon: float,
    lr: float,
    recent_train_scores: list,
    start_time: float,
) -> None:
    """Greedy test episodes during training: `charts/test_score` and a row of eval/curve.csv."""
    args = run.args
    weights_finite(run, global_step)
    with out_of_memory_ends_the_run(run, global_step):
        test_scores = run_test_episodes(
            run.agent.q_network,
            run.eval_env,
            args.num_eval_episodes,
            args.res,
            run.device,
            args.test_epsilon,
            select_own_only=args.select_own_only,
            through_pixels=run.through_pixels,
            stop=run.stop,
            say=run.logger.info,
        )
    test_mean = float(np.mean(test_scores))
    train_mean = float(np.mean(recent_train_scores))
    run.writer.add_scalar("charts/test_score", test_mean, global_step)
    try:  # a full disk: this point is not saved (one warning line), training goes on
        mu.atomic_append(
            run.curve_path,
            f"{episode},{global_step},{time.time() - start_time:.1f},{epsilon:.4f},"
            f"{train_mean:.3f},{test_mean:.3f}\n",
        )
    except mu.WriteFailed as exc:
        run.logger.info(f"warning: {exc}; this curve point is not saved, training goes on")
    run.logger.info(
        f"episode {episode} step {global_step}: train score {train_mean:.2f} (last "
        f"{len(recent_train_scores)}), greedy test {test_mean:.2f}, epsilon {epsilon:.3f}, "
        f"lr {lr:.3g}, {global_step / (time.time() - start_time):.0f} steps/s"
    )


# ---------------------------------------------------------------------------------------------------------
# Test episodes and video
# ---------------------------------------------------------------------------------------------------------


# Colours of the video frames, by player_relative value: background, self (marines), ally, neutral (beacon,
# shards), enemy; selected marines are drawn brighter.
PLAYER_RELATIVE_COLOURS = np.array(
    [[20, 20, 20], [0, 160, 0], [40, 80, 255], [0, 220, 255], [230, 40, 40]], np.uint8
)


SELECTED_COLOUR = np.array([120, 255, 120], np.uint8)


VIDEO_PIXELS_PER_CELL = 8


VIDEO_FPS = 4


def render_screen(obs: dict) -> np.ndarray:
    """The screen's player_relative and selected layers as an RGB frame (res * 8, res * 8, 3) uint8."""
    player_relative = obs["feature_screen"][0].clip(0, len(PLAYER_RELATIVE_COLOURS) - 1)  # (H, W)
    frame = PLAYER_RELATIVE_COLOURS[player_relative]  # (H, W, 3)
    frame[obs["feature_screen"][1] > 0] = SELECTED_COLOUR
    return frame.repeat(VIDEO_PIXELS_PER_CELL, 0).repeat(VIDEO_PIXELS_PER_CELL, 1)


def write_video(frames: list[np.ndarray], path: str) -> None:
    """The frames as an mp4 at VIDEO_FPS."""
    from moviepy import ImageSequenceClip  # imported only when videos are recorded

    clip = ImageSequenceClip(frames, fps=VIDEO_FPS)
    clip.write_videofile(path, codec="libx264", audio=False, logger=None)
    clip.close()


def run_test_episodes(
    q_network,
    env,
    num_episodes: int,
    res: int,
    device,
    epsilon: float = 0.0,
    video_dir: str | None = None,
    select_own_only: bool = False,
    through_pixels: float = 0.0,
    stop: mu.StopSignals | None = None,
    say: typing.Callable[[str], None] | None = None,
) -> list[float]:
    """Test episodes (greedy at epsilon 0); returns each episode's score. With `video_dir`, each episode's
    screen is written to `{video_dir}/test-episode-{k}.mp4`. Moves are carried `through_pixels` on (game_call).
    A stop signal ends them at the top of a step (RunInterrupted). A step with a non-finite reward or observation
    (`mu.nonfinite`) ends its episode there, its score the finite rewards before it, said by `say`."""
    rng = np.random.default_rng(0)
    scores = []
    for k in range(num_episodes):
        obs, done, score = env.reset(), False, 0.0
        frames = [render_screen(obs)] if video_dir else None
        while not done:
            if stop is not None:
                check_stop(stop)
            action = select_action(q_network, obs, epsilon, rng, device, select_own_only)
            next_obs, reward, done = env.step(*game_call(action, obs, res, through_pixels))
            if (fault := mu.nonfinite(reward, next_obs)) is not None:
                if say is not None:
                    say(
                        f"test episode {k + 1} ends early: the game gave a non-finite {fault} (its score: {score:g})"
                    )
                break
            obs, score = next_obs, score + reward
            if frames is not None:
                frames.append(render_screen(obs))
        scores.append(score)
        if frames is not None:
            os.makedirs(video_dir, exist_ok=True)
            write_video(frames, os.path.join(video_dir, f"test-episode-{k}.mp4"))
    return scores


# ---------------------------------------------------------------------------------------------------------
# Checkpoints (tensors and plain containers only: they load with weights_only=True)
# ---------------------------------------------------------------------------------------------------------


# 4: the heads' weights under `nonspatial_head.mlp.` and `spatial_head.`; 3 (the same but for those keys, which
# SplitQNetwork renames on load) is read too
CHECKPOINT_FORMAT = "dqn_starcraft_split/4"


READABLE_FORMATS = (CHECKPOINT_FORMAT, "dqn_starcraft_split/3")


# what shapes the networks and the data: a checkpoint trained otherwise does not fit, or means something else
RESUME_MUST_MATCH = (
    "backend",
    "map_name",
    "res",
    "step_mul",
    "screen_world_units",
    "n_step",
    *NETWORK_SETTINGS,
    "move_through",
)


# what the saved scheduler state holds: loaded into another schedule it would not fit, or would silently override
# the values this run records
RESUME_SAME_SCHEDULE = ("lr_scheduler", "scheduler_tmax", "step_lr_step_size", "step_lr_gamma")


def save_checkpoint(
    path: str,
    q_network,
    target_network,
    optimizer,
    scheduler,
    episode: int,
    global_step: int,
    args: Args,
    interrupted: bool,
    extra: dict | None = None,
) -> None:
    """Tensors and plain containers only (loads with weights_only=True); `extra`: the scaler, RNG states,
    recent scores and the replay's state on disk (with --replay-on-disk). Written all at once or not at all, with its checksum
    beside it (`checkpoint.pt.sha256`), which `load_checkpoint` checks before it reads a byte."""
    buffer = io.BytesIO()
    torch.save(
        {
            "format": CHECKPOINT_FORMAT,
            "q_network": q_network.state_dict(),
            "target_network": target_network.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": None if scheduler is None else scheduler.state_dict(),
            "episode": episode,
            "global_step": global_step,
            "args": dataclasses.asdict(args),
            "interrupted": interrupted,
            **(extra or {}),
        },
        buffer,
    )
    mu.save_checked(path, buffer.getvalue())


def load_checkpoint(path: str, args: Args) -> dict:
    """A checkpoint to resume from, its bytes checked against its archive's own CRC-32s and its checksum
    (`checkpoint.pt.sha256`), and its settings against this run's; any problem is one ConfigError, and the file is
    left where it is. A checkpoint neither check can verify (no checksum, not a zip archive) is read, after one line
    on stderr."""
    try:
        state, note = mu.read_checkpoint(path, READABLE_FORMATS, keys=("rng", "q_network", "args"))
    except mu.CheckpointInvalid as exc:
        raise ConfigError(str(exc)) from None
    trained = state["args"]
    for name in RESUME_MUST_MATCH + RESUME_SAME_SCHEDULE:
        saved, wanted = trained.get(name), getattr(args, name)
        if saved != wanted:
            raise ConfigError(
                f"--resume checkpoint was trained with --{name.replace('_', '-')} {saved}, but this run "
                f"asks for {wanted}."
            )
    replay = state.get("replay") or {}
    held = replay["position"] - replay["keep_from"] if "position" in replay else int(replay.get("size", 0))
    if held > args.buffer_size:
        raise ConfigError(
            f"--resume checkpoint's replay holds {held:,} transitions, more than --buffer-size {args.buffer_size:,} "
            f"can: give at least {held:,}."
        )
    if note:
        print(note, file=sys.stderr)
    return state


def save_run(
    run: Run,
    episode: int,
    global_step: int,
    recent_train_scores: list,
    interrupted: bool,
    playing: dict | None = None,
) -> None:
    """Checkpoint the run as it is now, with everything --resume needs; never from non-finite weights (the last
    checkpoint stays). `interrupted`: `episode` had not ended; `playing`: where it stood, to go on from there (at the
    top of an agent step: the loop's obs, score and length, and the built-in game's state, `mu.env_state`)."""
    if not all(torch.isfinite(p).all() for p in run.agent.q_network.parameters()):
        run.logger.info(
            "checkpoint not written: the Q network's weights are not finite; the last one is kept"
        )
        return
    kind, keys, pos, has_gauss, gauss = np.random.get_state()  # keys as a tensor: weights_only loads it
    rngs = {
        "torch": torch.get_rng_state(),
        "python": random.getstate(),
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, gauss],
        "actions": run.agent.rng.bit_generator.state,
    }
    for name, game in (("env", run.env), ("eval_env", run.eval_env)):
        if hasattr(game, "rng"):
            rngs[name] = game.rng.bit_generator.state
    extra = {
        "rng": rngs,
        "scaler": run.agent.amp.scaler.state_dict(),
        "recent_train_scores": list(recent_train_scores),
        "replay": run.agent.rb.log_state(),  # with --replay-on-disk (else None)
        # the game's own state (a built-in one's; pysc2's game cannot be saved), and the episode in progress
        "env_state": mu.env_state(run.env) if isinstance(run.env, BuiltinMiniGame) else None,
        "playing": None if playing is None else {**playing, "obs": mu.to_checkpoint(playing["obs"])},
        "restarted_episodes": run.restarted_episodes,
    }
    save_checkpoint(
        run.checkpoint_path,
        run.agent.q_network,
        run.agent.target_network,
        run.agent.optimizer,
        run.agent.scheduler,
        episode,
        global_step,
        run.args,
        interrupted=interrupted,
        extra=extra,
    )
    if extra["replay"] is not None:  # written whole: the replay's files it no longer needs can go
        run.agent.rb.log.commit(extra["replay"])


def restore(run: Run, state: dict) -> None:
    """Load a checkpoint's networks, optimizer, scheduler, loss scaler, RNG states, game state and (if saved) replay
    into the run, and where its training stood (`run.progress`): an episode stopped at the top of a step goes on where
    it stopped; one that cannot (pysc2's game, a stop in the middle of a step, no replay kept) is played again from
    the game's reset, said in one line and counted; after a finished one comes the next."""
    playing, interrupted = state.get("playing"), state["interrupted"]
    goes_on = playing is not None and state.get("env_state") is not None and run.agent.rb.log is not None
    goes_on = goes_on and isinstance(run.env, BuiltinMiniGame) and state.get("replay") is not None
    first_episode = state["episode"] + (0 if interrupted else 1)
    run.episodes_done, run.episode_end_step = first_episode - 1, state["global_step"]
    run.agent.q_network.load_state_dict(state["q_network"])
    run.agent.target_network.load_state_dict(state["target_network"])
    run.agent.optimizer.load_state_dict(state["optimizer"])
    if run.agent.scheduler is not None and state["scheduler"] is not None:
        run.agent.scheduler.load_state_dict(state["scheduler"])
    honour_learning_rate(run, state["args"])
    if state.get("scaler"):
        run.agent.amp.scaler.load_state_dict(state["scaler"])
    rngs = state["rng"]
    torch.set_rng_state(rngs["torch"])
    random.setstate(rngs["python"])
    kind, keys, pos, has_gauss, gauss = rngs["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    run.agent.rng.bit_generator.state = rngs["actions"]
    for name, game in (("env", run.env), ("eval_env", run.eval_env)):
        if name in rngs and hasattr(game, "rng"):
            game.rng.bit_generator.state = rngs[name]
    if state.get("env_state") is not None and isinstance(run.env, BuiltinMiniGame):
        mu.restore_env_state(run.env, state["env_state"])
    rb, saved_replay = run.agent.rb, state.get("replay")
    if (
        saved_replay is not None and "position" not in saved_replay
    ):  # an older version's (--checkpoint-buffer)
        rb.load_state_dict(saved_replay)
    elif saved_replay is not None and rb.log is not None:
        try:
            rb.restore_log(saved_replay)
        except mu.ReplayLogInvalid as exc:
            raise ConfigError(f"--resume: {exc}.") from None
        # the episode stopped part-way is played again from the game's reset: it ends here
        if interrupted and not goes_on and rb.size:
            rb.dones[(rb.pos - 1) % rb.capacity] = True
    else:
        saved_replay = None
    run.logger.info(
        f"resumed {run.run_id} at episode {first_episode}, step {state['global_step']}"
        f"{f' with its replay of {rb.size:,} transitions' if saved_replay is not None else ' (replay not saved)'}"
    )
    scores = list(state.get("recent_train_scores", []))
    run.restarted_episodes = state.get("restarted_episodes", 0)
    if goes_on:
        playing = {**playing, "obs": mu.from_checkpoint(playing["obs"])}
        run.progress = Progress(state["episode"], state["global_step"], scores, playing)
    else:  # the loop plays the next episode, or the interrupted one again from its start
        run.progress = Progress(first_episode - 1, state["global_step"], scores, None)
        if interrupted:
            run.restarted_episodes += 1
            run.logger.info(
                f"resume: episode {first_episode} starts over from the game's reset (it could not go on)"
            )


def honour_learning_rate(run: Run, saved_args: dict) -> None:
    """This command's --learning-rate and --min-lr on a resumed run: the schedule's base rate is the new one, at the
    position the checkpoint saved (the episode it had reached), said in one line. Every other setting is read from
    this run's Args at each use, so it takes effect as it is."""
    args, optimizer, scheduler = run.args, run.agent.optimizer, run.agent.scheduler
    if saved_args.get("learning_rate") == args.learning_rate and saved_args.get("min_lr") == args.min_lr:
        return
    for group in optimizer.param_groups:
        group["initial_lr"] = args.learning_rate
    if scheduler is None:
        rates = [args.learning_rate] * len(optimizer.param_groups)
    else:
        scheduler.base_lrs = [args.learning_rate] * len(optimizer.param_groups)
        if hasattr(scheduler, "eta_min"):
            scheduler.eta_min = args.min_lr
        rates = scheduler._get_closed_form_lr()  # the schedule's rate at its position, from its base
        scheduler._last_lr = list(rates)
    for group, rate in zip(optimizer.param_groups, rates):
        group["lr"] = rate
    run.logger.info(
        f"resume: --learning-rate {saved_args.get('learning_rate')} -> {args.learning_rate} (min_lr "
        f"{saved_args.get('min_lr')} -> {args.min_lr}): the rate is now {rates[0]:.3g}, at the schedule's position"
    )


def checkpoint_when_due(run: Run, global_step: int) -> None:
    """At an episode's end: a checkpoint once --checkpoint-minutes of wall time, or --checkpoint-every agent steps,
    have passed since the last (one line in train.log). It changes nothing that trains: it draws no random number.
    One that cannot be written (a full disk) is one warning line, and the last good one stays."""
    args, (episode, _, recent_train_scores, _) = run.args, run.progress
    if time.time() < run.next_checkpoint_time and global_step < run.next_checkpoint_step:
        return
    schedule_checkpoints(run, global_step)
    if episode >= args.num_episodes and args.save_model:
        return  # the final checkpoint comes at once
    try:
        save_run(run, episode, global_step, recent_train_scores, interrupted=False)
    except mu.WriteFailed as exc:
        run.logger.info(f"warning: {exc}; this periodic checkpoint is not written, the last good one is kept")
        return
    run.logger.info(f"checkpoint (periodic) at episode {episode}, step {global_step}: {run.checkpoint_path}")


def schedule_checkpoints(run: Run, global_step: int) -> None:
    """When the next periodic checkpoint is due: --checkpoint-minutes from now, --checkpoint-every agent steps on."""
    args = run.args
    run.next_checkpoint_time = (
        time.time() + 60 * args.checkpoint_minutes if args.checkpoint_minutes else math.inf
    )
    every = args.checkpoint_every
    run.next_checkpoint_step = (global_step // every + 1) * every if every else math.inf


def save_interrupted(
    run: Run,
    reason: Exception | str,
    episode: int,
    global_step: int,
    recent_train_scores: list,
    playing: dict | None,
):
    """A stop signal, a CUDA OOM, non-finite values or a crash stopped the run: a checkpoint (unless the reason says
    none: non-finite weights), a line in train.log, no results row. A stop signal comes at the top of an agent step:
    the resumed run goes on with the episode in progress (`playing`) where it stopped. Any other reason may come in the
    middle of a step: the resumed run plays that episode again from the game's reset. Without an episode in progress
    (it had ended and was logged) the resumed run goes on with the next one. Another stop signal meanwhile is only
    recorded: the checkpoint is written whole."""
    if getattr(reason, "checkpoint", True):
        exact = playing if getattr(reason, "signal", False) else None
        save_run(
            run, episode, global_step, recent_train_scores, interrupted=playing is not None, playing=exact
        )
        saved = f"checkpoint saved to {run.checkpoint_path}"
    else:
        saved = "no checkpoint written"
    run.logger.info(
        f"interrupted by {reason} at episode {episode}, step {global_step}: {saved}; no results row written"
    )
    close(run)


# ---------------------------------------------------------------------------------------------------------
# The end of a run: the final test, the results row across runs
# ---------------------------------------------------------------------------------------------------------


def finish(
    run: Run,
    episode: int,
    global_step: int,
    recent_train_scores: list,
    stopped_by: str,
    start_time: float,
    wall_start: float,
) -> dict:
    """The final greedy test of the trained network (eval/test_results.json), the final checkpoint; returns the
    run's results row. None of them from non-finite weights (`weights_finite`: exit 5)."""
    args = run.args
    weights_finite(run, global_step)
    with out_of_memory_ends_the_run(run, global_step):
        test_scores = run_test_episodes(
            run.agent.q_network,
            run.eval_env,
            args.num_test_episodes,
            args.res,
            run.device,
            args.test_epsilon,
            video_dir=os.path.join(run.run_dir, "videos") if args.capture_video else None,
            select_own_only=args.select_own_only,
            through_pixels=run.through_pixels,
            stop=run.stop,
            say=run.logger.info,
        )
    verdict = run.leak.check()
    results = {
        "run_id": run.run_id,
        "map_name": args.map_name,
        "backend": args.backend,
        "seed": run.seed,
        "episodes": episode,
        "global_steps": global_step,
        "stopped_by": stopped_by,
        "num_test_episodes": len(test_scores),
        "test_epsilon": args.test_epsilon,
        "scores": test_scores,
        "mean": float(np.mean(test_scores)),
        "std": float(np.std(test_scores)),
        "min": float(np.min(test_scores)),
        "max": float(np.max(test_scores)),
        "win_rate": None,  # neither minigame defines a win; the score is the measure
        "train_wall_time_s": time.time() - start_time,
        "leak_check": verdict.diagnosis,
    }
    atomic_write_bytes(
        os.path.join(run.run_dir, "eval", "test_results.json"), json.dumps(results, indent=2).encode()
    )
    run.writer.add_scalar("charts/final_test_score", results["mean"], global_step)
    if args.save_model:
        save_run(run, episode, global_step, recent_train_scores, interrupted=False)
    run.logger.info(
        f"test: mean {results['mean']:.2f} +- {results['std']:.2f} "
        f"over {len(test_scores)} greedy episodes (min {results['min']:g}, max {results['max']:g}); "
        f"{verdict.diagnosis}"
    )
    return {
        "run_id": run.run_id,
        "seed": run.seed,
        "map_name": args.map_name,
        "backend": args.backend,
        "episodes": episode,
        "global_steps": global_step,
        "test_mean_score": f"{results['mean']:.4f}",
        "test_std_score": f"{results['std']:.4f}",
        "use_double_dqn": args.use_double_dqn,
        "lr_scheduler": args.lr_scheduler,
        "batch_size": run.batch_size,
        "fallback_used": run.fallback_used,
        "wall_time_s": f"{time.time() - wall_start:.1f}",
    }


def close(run: Run) -> None:
    """The end of a run: TensorBoard, the environments, the snapshots and wandb closed (one that fails to close,
    a crashed game say, is passed over)."""
    closers = [run.writer.close, run.env.close, run.snapshots.close]
    if run.eval_env is not run.env:
        closers.append(run.eval_env.close)
    if run.args.track:
        closers.append(lambda: sys.modules["wandb"].finish())
    for closer in closers:
        with contextlib.suppress(Exception):
            closer()


RESULTS_COLUMNS = (
    "run_id",
    "seed",
    "map_name",
    "backend",
    "episodes",
    "global_steps",
    "test_mean_score",
    "test_std_score",
    "use_double_dqn",
    "lr_scheduler",
    "batch_size",
    "fallback_used",
    "wall_time_s",
)


@contextlib.contextmanager
def folder_lock(folder: str):
    """An exclusive lock on `folder` while the block runs, so that runs ending at once rewrite the CSV across runs
    in turn (flock on the folder itself: no lock file is left behind)."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def append_results_row(path: str, row: dict) -> None:
    """Append one row to the CSV across runs, atomically (the whole file is rewritten and renamed)."""
    with folder_lock(os.path.dirname(os.path.abspath(path))):
        existing = b""
        if os.path.exists(path):
            with open(path, "rb") as f:
                existing = f.read()
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=RESULTS_COLUMNS, lineterminator="\n")
        if not existing:
            writer.writeheader()
        writer.writerow(row)
        if existing and not existing.endswith(b"\n"):
            existing += b"\n"
        atomic_write_bytes(path, existing + text.getvalue().encode())


def drop_results_rows(path: str, run_id: str) -> None:
    """Remove an earlier run's row from the CSV across runs (`--overwrite`), atomically."""
    if not os.path.exists(path):
        return
    with folder_lock(os.path.dirname(os.path.abspath(path))):
        with open(path, newline="") as f:
            rows = [row for row in csv.DictReader(f) if row.get("run_id") != run_id]
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=RESULTS_COLUMNS, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        atomic_write_bytes(path, text.getvalue().encode())


# ---------------------------------------------------------------------------------------------------------
# main: every seed's run
# ---------------------------------------------------------------------------------------------------------


def run_one_seed(
    args: Args, sources: dict, seed: int, run_id: str, stop: mu.StopSignals, resume_state: dict | None = None
) -> dict:
    """One seed's run, or the rest of one (from `resume_state`): set up (`set_up`, `restore`), trained by Part 1's
    `train_one_seed`, then tested and checkpointed (`finish`); returns its results row. A stop signal or a CUDA OOM
    checkpoints the run where its training stands (`run.progress`) and raises RunInterrupted. However it ends, what
    it opened is closed and its folder's lock let go."""
    made = mu.StartUp(new=resume_state is None, parents=(args.save_path, args.log_dir))
    with contextlib.closing(made):
        return run_seed(args, sources, seed, run_id, stop, resume_state, made)


def run_seed(
    args: Args,
    sources: dict,
    seed: int,
    run_id: str,
    stop: mu.StopSignals,
    resume_state: dict | None,
    made: mu.StartUp,
) -> dict:
    """`run_one_seed`, with what its start-up makes recorded in `made`."""
    wall_start = time.time()
    resume_step = None if resume_state is None else resume_state["global_step"]
    try:
        with stop.at_once():  # memory: nothing trained yet, so a signal stops the start-up at once
            run = set_up(args, sources, seed, run_id, resume_step, stop, made)
            if resume_state is not None:
                restore(run, resume_state)
                resume_state = None  # memory: the loaded tensors live in the networks now
    except mu.Stopped as exc:  # nothing trained: a new run's folder and events go, a resumed one's stay
        raise RunInterrupted(
            exc.name, exc.exit_code, sentence=made.discard(exc.name), checkpoint=False
        ) from None
    except Exception as exc:
        if isinstance(exc, (ConfigError, DoesNotFit, mu.WriteFailed)):
            raise
        log = os.path.join(made.run_dir, "crash.log") if made.run_dir else None
        raise RunCrashed(
            f"crashed during start-up, nothing trained: {mu.crash_report(exc, __file__, log)}."
        ) from None
    run.start_time = time.time()
    schedule_checkpoints(run, run.progress.global_step)
    try:
        with mu.collect_only_the_loops_garbage():  # memory reports: a collection walks the loop's objects
            stopped_by = train_one_seed(run)
            episode, global_step, recent_train_scores, _ = run.progress
            row = finish(
                run, episode, global_step, recent_train_scores, stopped_by, run.start_time, wall_start
            )
    except RunInterrupted as exc:  # in training, in a periodic test or in the final one
        if exc.signal and made.new and run.progress.global_step == 0:  # before any step: nothing to keep
            close(run)
            exc.sentence = made.discard(exc.args[0])
            raise
        # an episode stopped part-way is played again on resume, from the step it began at: its steps count once
        save_interrupted(run, exc, *run.progress)
        if exc.signal:
            exc.sentence = (
                f"stopped by {exc.args[0]} at agent step {run.progress.global_step}: its checkpoint is "
                f"{run.checkpoint_path} (--resume it to go on)"
            )
        raise
    except mu.WriteFailed:  # a file the run cannot go on without: one sentence and exit 6 (`main`)
        close(run)
        raise
    except Exception as exc:  # noqa: BLE001 - a crashed game, a bug: what was trained is kept, then said
        raise crashed(run, exc) from None
    close(run)
    return row


def crashed(run: Run, exc: Exception) -> RunCrashed:
    """An error in the loop, the periodic tests or the final one: the checkpoint of where training stands (the
    interrupted episode is played again on resume), the traceback in {run_id}/crash.log, and the paragraph to say."""
    episode, global_step = run.progress.episode, run.progress.global_step
    report = mu.crash_report(exc, __file__, os.path.join(run.run_dir, "crash.log"))
    try:
        save_interrupted(run, f"a crash ({type(exc).__name__})", *run.progress)
        kept = f"the checkpoint {run.checkpoint_path} holds what was trained (--resume {run.checkpoint_path} goes on)"
    except Exception as save_error:  # noqa: BLE001 - the crash is the one to report
        kept = f"the checkpoint could not be written ({type(save_error).__name__}: {save_error})"
        close(run)
    run.logger.info(f"crashed at episode {episode}, step {global_step}: {report}")
    return RunCrashed(f"crashed at episode {episode}, agent step {global_step}: {report}; {kept}.")


def main(args: Args, sources: dict) -> int:
    """Every seed's run, one after another; the exit status (0, or the first run's that did not finish). Bad input
    is refused (exit 2) before anything is written; a stop signal at any moment ends with exit 128 + N."""
    with mu.StopSignals() as stop:  # SIGINT and SIGTERM are recorded; the loop stops at its next step
        try:
            args, seeds, run_ids, resume_state = prepare(with_map_defaults(args), sources)
        except ConfigError as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        for seed in seeds:
            try:
                # a signal during the last seed's final checkpoint: the next one does not start
                check_stop(stop)
                row = run_one_seed(
                    dataclasses.replace(args, seed=seed), sources, seed, run_ids[seed], stop, resume_state
                )
            except RunInterrupted as exc:
                print(
                    f"{exc.sentence}; remaining seeds not run" if len(seeds) > 1 else exc.sentence,
                    file=sys.stderr,
                )
                return exc.exit_code
            except RunCrashed as exc:
                print(exc, file=sys.stderr)
                return EXIT_CRASHED
            except ConfigError as error:  # another run took this --run-id since the check above
                print(f"error: {error}", file=sys.stderr)
                return 2
            except DoesNotFit as error:  # under --gpu-memory-gb, before anything was written
                print(f"error: {error}", file=sys.stderr)
                return EXIT_OOM
            except mu.WriteFailed as exc:  # config, test results, the final or interrupted checkpoint
                print(f"stopped: {exc}; the run cannot go on without this file.", file=sys.stderr)
                return EXIT_WRITE_FAILED
            # The row is the very last thing a run writes, in one atomic rename: an interrupted run has none.
            try:
                append_results_row(os.path.join(args.save_path, "results.csv"), row)
            except mu.WriteFailed as exc:
                print(f"stopped: {exc}; this run's results row is not saved.", file=sys.stderr)
                return EXIT_WRITE_FAILED
            resume_state = None
    if stop.received:  # a signal during the last run's final checkpoint or results row: that run is complete
        print(f"stopped by {stop.name} after the last run had finished", file=sys.stderr)
        return stop.exit_code
    return 0


def prepare(args: Args, sources: dict) -> tuple[Args, list[int], dict[int, str], dict | None]:
    """Everything checked before anything is written (ConfigError: one sentence): the values (`Args.problems`, also
    when `args` did not come from `parse_args`), the checkpoint to resume from (its folder then holds the run), the
    folders the run writes, the replay against this machine's memory, and the chosen run ids (removed with
    --overwrite only where this script made them). Returns the args, the seeds, each seed's run id and the checkpoint."""
    for _, sentence in args.problems():
        raise ConfigError(sentence + ".")
    seeds = list(args.seeds) or [args.seed]
    base_id = args.run_id or f"{args.map_name}__{args.exp_name}__{{seed}}__{int(time.time())}"
    run_ids = {
        seed: (args.run_id if len(seeds) == 1 else f"{args.run_id}-seed{seed}")
        if args.run_id
        else base_id.format(seed=seed)
        for seed in seeds
    }
    resume_state = None
    if args.resume is not None:
        resume_state = load_checkpoint(args.resume, args)
        if len(seeds) != 1:
            raise ConfigError("--resume continues one run; give no --seeds with it.")
        # the run goes on in its own folder: {save_path}/{run_id}/checkpoint.pt
        args = dataclasses.replace(
            args,
            save_path=os.path.dirname(os.path.dirname(os.path.abspath(args.resume))),
            seed=int(resume_state["args"]["seed"]),
        )
        seeds = [args.seed]
        run_ids = {args.seed: os.path.basename(os.path.dirname(os.path.abspath(args.resume)))}
    for field in ("save_path", "log_dir"):
        if problem := mu.folder_problem(getattr(args, field), field):
            where = f" (from {sources[field]})" if sources.get(field, "").startswith("RL_") else ""
            raise ConfigError(problem + where + ".")
    check_replay_fits(args, sources)
    if args.resume is None and args.run_id is not None:
        take_chosen_run_ids(args, run_ids.values())
    return args, seeds, run_ids, resume_state


def check_replay_fits(args: Args, sources: dict) -> None:
    """The replay's arrays (allocated when a run starts; pages taken as it fills) against the machine's memory, or
    its cgroup's limit: more than either can hold is refused (ConfigError), more than is free now is a warning."""
    per_step = sum(SplitReplayBuffer.step_nbytes(args.res))
    where = f" from {sources['buffer_size']}" if sources.get("buffer_size", "").startswith("RL_") else ""
    problem, warning = mu.replay_memory_problem(
        args.buffer_size * per_step,
        f"the replay (buffer_size {args.buffer_size:,}{where}, {per_step:,} bytes per agent step at res {args.res})",
        lambda nbytes: f"--buffer-size {nbytes // per_step:,} would take about half of that",
    )
    if problem:
        raise ConfigError(problem + ".")
    if warning:
        print(warning)


def take_chosen_run_ids(args: Args, run_ids) -> None:
    """Before anything is written: the folders of the run ids the user chose (--run-id) hold no run, or, with
    --overwrite, their runs are removed (folder, TensorBoard events, results row) where this script made them
    (`mu.foreign_entries`: its mark, or only a run's files, no link). ConfigError, with nothing removed, when one holds
    a run and --overwrite is not given, or holds anything this script did not write: a user's files are never
    deleted, and an earlier run never overwritten by accident."""
    folders = {run_id: os.path.join(args.save_path, run_id) for run_id in run_ids}
    taken = {run_id: folder for run_id, folder in folders.items() if os.path.lexists(folder)}
    for run_id, folder in taken.items():
        if not args.overwrite:
            raise ConfigError(folder_taken(run_id, folder))
        foreign = [folder] if os.path.islink(folder) else mu.foreign_entries(folder, RUN_FILES)
        if foreign:
            held = ", ".join(os.path.basename(entry) or entry for entry in foreign[:3])
            raise ConfigError(
                f"--overwrite removes only run folders this script made, and {folder} holds what it did not write "
                f"({held}{', ...' if len(foreign) > 3 else ''}); nothing was removed: choose another --run-id."
            )
    for run_id, folder in taken.items():
        shutil.rmtree(folder)
        mu.remove_event_files(os.path.join(args.log_dir, run_id))
        drop_results_rows(os.path.join(args.save_path, "results.csv"), run_id)


def cli(argv: list[str] | None = None, environ: dict | None = None) -> int:
    """The command line: its values and the RL_* variables parsed (a bad one: one sentence, exit 2), then `main`."""
    try:
        args, sources = parse_args(argv, environ)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return main(args, sources)


if __name__ == "__main__":
    sys.exit(cli())
