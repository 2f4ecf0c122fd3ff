"""Our Dreamer's figures: replay bytes per step, sampling, update time, speed trials, and the host-memory soak.

Each command runs in its own process (run.py starts them) and writes one JSON object:

    python benchmark/ours_dreamer.py measure --out PATH [--quick]   # bytes, sampling, update at the seed config
    python benchmark/ours_dreamer.py update --out PATH              # the seed-config update alone
    python benchmark/ours_dreamer.py trials --out PATH              # defaults without channels_last / inverse-CDF, compile, bf16
    python benchmark/ours_dreamer.py soak --out PATH [--capacity N] [--warmup N] [--turnovers N]  # tiny-model main
    python benchmark/ours_dreamer.py soak --out PATH --no-updates    # the same loop, never training
    python benchmark/ours_dreamer.py gpu --out PATH [--quick]       # CUDA: updates/s and peak memory per --precision

The seed configuration is `seed_args()`: Pong, the seed's model, 2 envs, capacity 50k steps, batch 16 x 50.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import itertools
import json
import math
import os
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np
import torch

import dreamer_atari as da
import memory_utils as mu
from benchmark import bench_utils
from benchmark.common import TINY_MODEL_FIELDS, code_version

MB = 1024.0 * 1024.0
# `--quick` sizes: everything smaller, stated in the output, so the whole quick run takes a couple of minutes.
QUICK = {
    "fill_steps": 3_000,
    "update_batch": 4,
    "update_seq": 10,
    "update_reps": 3,
    "sample_reps": 5,
    "evenness_batches": 500,
}
FULL = {
    "fill_steps": None,
    "update_batch": None,
    "update_seq": None,
    "update_reps": 5,
    "sample_reps": 20,
    "evenness_batches": 10_000,
}
# The tiny model of the soak (common.TINY_MODEL_FIELDS, which run.py's --quick uses too): host-memory growth
# of the loop, not learning, is under test.
TINY_MODEL = TINY_MODEL_FIELDS


def seed_args(**overrides) -> da.Args:
    """The seed configuration (the script's defaults with the seed's model, 2 envs, batch 16 x 50, 50k replay, 5k
    prefill and 25k world-model warm-up) with these fields changed; CUDA only where there is one. The committed CPU
    figures and the comparisons with SheepRL at matched size are of this configuration."""
    seed = {
        "num_envs": 2,
        "sequence_length": 50,
        "buffer_capacity": 50_000,
        "learning_starts": 5_000,
        "warmup_steps": 25_000,
    }
    return dataclasses.replace(
        da.Args(model="nature"), **{"cuda": torch.cuda.is_available(), **seed, **overrides}
    )


def fill_replay(args: da.Args, steps: int) -> tuple[da.EpisodeReplay, tuple, int]:
    """Play `steps` real Pong env steps with random actions into a fresh replay, as training does before
    `learning_starts`. Returns the replay, the observation shape and the number of actions."""
    envs = da.make_vector_env(dataclasses.replace(args, vector_mode="sync"), "benchmark", args.seed)
    try:
        rng = np.random.default_rng(args.seed)
        replay = da.EpisodeReplay(args.buffer_capacity, args.num_envs, seed=args.seed)
        obs, _ = envs.reset(seed=args.seed)
        for i in range(args.num_envs):
            replay.start_episode(i, obs[i])
        num_actions = int(envs.single_action_space.n)
        for _ in range(math.ceil(steps / args.num_envs)):
            actions = rng.integers(num_actions, size=args.num_envs)
            obs, rewards, terminations, truncations, infos = envs.step(actions)
            replay.add(obs, actions, rewards, terminations, truncations, infos)
        return replay, envs.single_observation_space.shape, num_actions
    finally:
        envs.close()


def replay_bytes(replay: da.EpisodeReplay) -> dict:
    """Bytes of every numpy array the replay holds (each counted once), per stored step."""
    arrays = {}
    obs_ids = set()
    for episode in replay.episodes:
        for chunk in episode.frames.chunks:
            arrays[id(chunk)] = chunk.nbytes
            obs_ids.add(id(chunk))
        for array in (getattr(episode, name) for name in da.Episode.FIELDS[1:]):
            for chunk in array.chunks:
                arrays[id(chunk)] = chunk.nbytes
    total = sum(arrays.values())
    obs = sum(arrays[i] for i in obs_ids)
    stats = da.replay_stats(replay)
    return {
        "buffer_bytes_per_step": total / replay.total_steps,
        "buffer_obs_bytes_per_step": obs / replay.total_steps,
        "buffer_aux_bytes_per_step": (total - obs) / replay.total_steps,
        "buffer_steps_stored": replay.total_steps,
        "buffer_capacity_steps": replay.capacity,
        "buffer_episodes": len(replay.episodes),
        "buffer_stats_agree": stats["obs_bytes"] + stats["aux_bytes"] == total,
    }


def bytes_limit(replay: da.EpisodeReplay) -> int:
    """One frame plus one of each auxiliary field per step, from the dtypes the replay really uses."""
    episode = replay.episodes[-1]
    fields = [getattr(episode, name) for name in da.Episode.FIELDS]
    return sum(a.dtype.itemsize * int(np.prod(a.item_shape, dtype=np.int64)) for a in fields)


def time_update(agent, batch: dict, args: da.Args, reps: int, warmup: int) -> dict:
    """One full Dreamer update: world model, then actor and critic from the imagined rollouts (the slow critic
    follows inside `train_behavior`), on one sampled batch."""
    return bench_utils.time_ms(lambda: _update(agent, batch, args), reps=reps, warmup=warmup)


def agent_params(agent) -> dict:
    return {
        "params_world_model": bench_utils.param_count(agent.world_model),
        "params_actor": bench_utils.param_count(agent.actor),
        "params_critic": bench_utils.param_count(agent.critic),
        "params_total": bench_utils.param_count(agent.world_model, agent.actor, agent.critic),
    }


def biases_before_norms(*modules: torch.nn.Module) -> int:
    """Parameters in the biases of linear layers that a LayerNorm follows directly (in a Sequential): the norm's
    own shift makes them redundant, and SheepRL's layers leave them out."""
    total = 0
    for module in modules:
        for block in module.modules():
            if isinstance(block, torch.nn.Sequential):
                for layer, after in itertools.pairwise(block.children()):
                    if isinstance(layer, torch.nn.Linear) and isinstance(after, torch.nn.LayerNorm):
                        total += 0 if layer.bias is None else layer.bias.numel()
    return total


def sampling_evenness(replay: da.EpisodeReplay, batch_size: int, sequence_length: int, batches: int) -> dict:
    """How evenly the replay draws its stored steps, by position within an episode (the p-th stored step of an
    episode): draws counted from `draw_windows` over `batches` batches, averaged over the episodes that have that
    position; positions held by every finished episode are compared. Beside it, the same ratio for the rule the
    replay had before (windows only inside one episode, uniform over all such windows), computed exactly from the
    same episodes: a step p of an L-step episode is in min(p + 1, T, L - p, L - T + 1) of them."""
    T = sequence_length
    episodes = list(replay.episodes)
    draws = {id(ep): np.zeros(ep.num_steps) for ep in episodes}
    rng = np.random.default_rng(0)
    for _ in range(batches):
        for pieces in replay.draw_windows(batch_size, T, rng):
            for episode, begin, take in pieces:
                offset = begin - episode.action.start
                draws[id(episode)][offset : offset + take] += 1
    finished = [ep for ep in episodes if ep.done and ep.action.start == 0]
    shortest = min(ep.num_steps for ep in finished)
    by_position = np.mean([draws[id(ep)][:shortest] for ep in finished], axis=0)
    old = []
    for ep in finished:
        L, p = ep.num_steps, np.arange(shortest)
        old.append(
            np.minimum.reduce([p + 1, np.full_like(p, T), L - p, np.full_like(p, L - T + 1)]).clip(min=0)
        )
    old_by_position = np.mean(old, axis=0)
    per_step = np.concatenate([draws[id(ep)] for ep in episodes])
    return {
        "sampling_position_max_to_min": float(by_position.max() / by_position.min()),
        "sampling_position_max_to_min_within_episode_rule": float(
            old_by_position.max() / old_by_position.min()
        ),
        "sampling_draws_per_step_mean": float(per_step.mean()),
        "sampling_draws_per_step_cv": float(per_step.std() / per_step.mean()),
        "sampling_draws_poisson_cv": float(1 / np.sqrt(per_step.mean())),
        "sampling_positions_compared": int(shortest),
        "sampling_batches": batches,
        "sampling_batch": f"B{batch_size} x T{T}",
    }


def fast_agent(args, obs_shape, num_actions, device):
    """The agent a run trains: `build_agent`, then the script's fast paths (`speed_up_agent`, which checks them)."""
    agent = da.build_agent(args, obs_shape, num_actions, device)
    da.speed_up_agent(agent, args)
    return agent


def cmd_measure(quick: bool) -> dict:
    sizes = QUICK if quick else FULL
    args = seed_args()
    fill = sizes["fill_steps"] or args.buffer_capacity
    if quick:
        args = dataclasses.replace(args, buffer_capacity=fill)
    start = time.perf_counter()
    # past capacity, so that eviction has run and the figure is the steady state's
    replay, obs_shape, num_actions = fill_replay(args, fill + fill // 10)
    fill_s = time.perf_counter() - start
    out = {
        **replay_bytes(replay),
        "buffer_bytes_limit": bytes_limit(replay),
        "fill_env_steps_per_s": replay.total_steps / fill_s,
    }

    B, T = args.batch_size, args.sequence_length
    sampling = bench_utils.time_ms(lambda: replay.sample(B, T), reps=sizes["sample_reps"], warmup=1)
    out["sample_ms"] = sampling["median_ms"]
    out["sample_samples_ms"] = sampling["samples_ms"]
    out["sample_batch"] = f"B{B} x T{T}"
    batch = replay.sample(B, T)
    out["sample_shapes"] = {k: f"{v.shape} {v.dtype}" for k, v in batch.items()}
    out.update(sampling_evenness(replay, B, T, batches=sizes["evenness_batches"]))

    ub, ut = sizes["update_batch"] or B, sizes["update_seq"] or T
    update_args = dataclasses.replace(args, batch_size=ub, sequence_length=ut)
    torch.manual_seed(args.seed)
    agent = fast_agent(update_args, obs_shape, num_actions, "cpu")
    update_batch = replay.sample(ub, ut)
    updating = time_update(agent, update_batch, update_args, reps=sizes["update_reps"], warmup=1)
    out["update_ms"] = updating["median_ms"]
    out["update_samples_ms"] = updating["samples_ms"]
    out["update_batch"] = f"B{ub} x T{ut}"
    out["update_includes"] = (
        "world model (batch to float on the device included), actor and critic updates, "
        "slow-critic EMA, on one sampled batch"
    )
    update_sample = bench_utils.time_ms(lambda: replay.sample(ub, ut), reps=sizes["sample_reps"], warmup=1)
    # the ratio compares sampling and updating at the same batch shape
    out["sample_to_update_ratio"] = update_sample["median_ms"] / updating["median_ms"]
    out.update(agent_params(agent))
    out["model"] = {k: getattr(args, k) for k in (*da.MODEL_FLAGS, "imagination_horizon", "precision")}
    out["model"]["amp_resolved"] = agent.amp.mode
    optimizer = agent.world_model_optimizer
    out["model"]["optimizer"] = (
        f"{type(optimizer).__name__} (foreach={optimizer.defaults.get('foreach')}, "
        f"fused={optimizer.defaults.get('fused')})"
    )
    return out


def cmd_update(reps: int) -> dict:
    """The seed-config update alone (run.py times it again after the peer's, so both see the same load)."""
    args = seed_args(buffer_capacity=3_000)
    replay, obs_shape, num_actions = fill_replay(args, 3_000)
    torch.manual_seed(args.seed)
    agent = fast_agent(args, obs_shape, num_actions, "cpu")
    batch = replay.sample(args.batch_size, args.sequence_length)
    timing = time_update(agent, batch, args, reps=reps, warmup=1)
    return {
        "update_ms": timing["median_ms"],
        "update_samples_ms": timing["samples_ms"],
        "update_batch": f"B{args.batch_size} x T{args.sequence_length}",
    }


# ---------------------------------------------------------------------------------------------------------
# Speed trials: each changes one thing from the outside and times the same update on the same batch.
# ---------------------------------------------------------------------------------------------------------
def _compile(agent, args):
    da.compile_agent(agent)  # what --compile does (on the agent's fast paths, installed by `fast_agent`)


def _multinomial_sample(self, stats: torch.Tensor, noise: torch.Tensor | None = None) -> torch.Tensor:
    """`RSSM.sample` as it was before the script adopted inverse-CDF sampling: `Categorical(...).sample()` (the
    uniforms the script draws for a sequence are left unused)."""
    probs = stats.exp()
    index = torch.distributions.Categorical(probs=probs).sample()
    one_hot = torch.nn.functional.one_hot(index, self.classes).to(probs.dtype)
    return (one_hot + probs - probs.detach()).flatten(-2)


def _slow_categorical_sample(agent, args):
    agent.world_model.rssm.sample = types.MethodType(_multinomial_sample, agent.world_model.rssm)


# The baseline is the script's defaults, which adopted two trials of earlier runs (channels-last convolutions
# and inverse-CDF latent sampling); the "without_*" trials take each back out, so their speed-up is below 1.
TRIALS = {
    "baseline": (None, {}),
    "without_channels_last": (None, {"channels_last": "off"}),
    "without_inverse_cdf_sampling": (_slow_categorical_sample, {}),
    "bf16_autocast": (None, {"precision": "bf16"}),
    "compile": (_compile, {}),
    "bf16+compile": (_compile, {"precision": "bf16"}),
}


def cmd_trials(names: list[str], reps: int) -> dict:
    """Every variant gets its own agent; after each one's first (compiling) update, the timed updates go round
    robin over the variants, so that a change in the machine's load hits them all alike."""
    args = seed_args(buffer_capacity=3_000)
    replay, obs_shape, num_actions = fill_replay(args, 3_000)
    batch = replay.sample(args.batch_size, args.sequence_length)
    variants, results = {}, {}
    for name in names:
        change, arg_changes = TRIALS[name]
        trial_args = dataclasses.replace(args, **arg_changes)
        torch.manual_seed(args.seed)
        try:
            agent = fast_agent(trial_args, obs_shape, num_actions, "cpu")
            if change is not None:
                change(agent, trial_args)
            first = bench_utils.time_ms(
                functools.partial(_update, agent, batch, trial_args), reps=1, warmup=0
            )
        except Exception as exc:  # noqa: BLE001 - a trial that fails is a result too
            results[name] = {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:200]}"}
            continue
        variants[name] = (agent, trial_args)
        results[name] = {"first_update_ms": first["median_ms"], "samples_ms": []}
    for _ in range(reps):
        for name, (agent, trial_args) in variants.items():
            timing = bench_utils.time_ms(
                functools.partial(_update, agent, batch, trial_args), reps=1, warmup=0
            )
            results[name]["samples_ms"] += timing["samples_ms"]
    for name in variants:
        results[name]["update_ms"] = statistics.median(results[name]["samples_ms"])
    base = results.get("baseline", {}).get("update_ms")
    for result in results.values():
        if base and "update_ms" in result:
            result["speedup_vs_baseline"] = base / result["update_ms"]
    return {"trials": results, "trial_batch": f"B{args.batch_size} x T{args.sequence_length}"}


def serve_args(model: str, image_size: int, decoder_mid_channels: int | None = None) -> da.Args:
    """What `serve` updates: the seed model at `image_size` (and `decoder_mid_channels` where given), or, for
    `dreamerv3`, the script's defaults (DreamerV3 size S on 64x64 colour frames, batch 16 x 64) as they are."""
    if model == "dreamerv3":
        return dataclasses.replace(da.Args(), cuda=torch.cuda.is_available(), buffer_capacity=3_000)
    sizes = {} if decoder_mid_channels is None else {"decoder_mid_channels": decoder_mid_channels}
    return seed_args(buffer_capacity=3_000, image_size=image_size, **sizes)


def cmd_serve(model: str, image_size: int, decoder_mid_channels: int | None = None) -> None:
    """`serve_args`' model, one update per `update` line on stdin (see bench_utils.alternate_updates)."""
    args = serve_args(model, image_size, decoder_mid_channels)
    replay, obs_shape, num_actions = fill_replay(args, 3_000)
    batch = replay.sample(args.batch_size, args.sequence_length)
    torch.manual_seed(args.seed)
    agent = fast_agent(args, obs_shape, num_actions, "cpu")
    info = {
        **agent_params(agent),
        "params_biases_before_norms": biases_before_norms(agent.world_model, agent.actor, agent.critic),
        "image_size": args.image_size,
        "obs": f"{tuple(batch['obs'].shape)} uint8",
        "decoder_mid_channels": args.decoder_mid_channels,
        "model": {k: getattr(args, k) for k in da.MODEL_FLAGS},
        "precision": args.precision,
        "fused_adam": bool(agent.world_model_optimizer.defaults.get("fused")),
        "update_includes": "world model (batch to float on the device included), actor and critic updates, "
        "slow-critic EMA, on one sampled batch",
    }
    bench_utils.serve_updates(functools.partial(_update, agent, batch, args), info)


def _update(agent, batch: dict, args: da.Args) -> None:
    """One whole update from a numpy batch, as the training loop runs it (the copy to the device included)."""
    _, _, states = da.train_world_model(agent, da.batch_tensors(batch, agent.device), args)
    da.train_behavior(agent, states, args)


# ---------------------------------------------------------------------------------------------------------
# Soak: the real training loop, tiny model, small capacity, many turnovers; USS read back from TensorBoard.
# ---------------------------------------------------------------------------------------------------------
SOAK_VIDEO_EVERY = 2_000  # the soak makes open-loop GIFs as training does, the first one inside the warm-up
# the slope is measured past the heap's one-time settling (most of it in the first 25k env steps: Python's
# arenas and glibc's free lists taking their working shape), over 100 turnovers; the settling's own slope is
# reported beside it (`soak_anon_slope_warmup_mb_per_10k`)
SOAK_WARMUP = 53_000


def soak_warmup(capacity: int, warmup: int, video_every: int = SOAK_VIDEO_EVERY) -> int:
    """The env step from which the soak's slope is measured: the replay full, and every periodic thing of the loop
    (log points, the leak detector, the first open-loop GIF and the imports it makes) done at least once."""
    return max(capacity, warmup, video_every + 1)


def soak_args(
    capacity: int,
    turnovers: int,
    every: int,
    batch: int = 4,
    seq: int = 16,
    train_every: int = 64,
    warmup: int = 0,
    video_every: int = SOAK_VIDEO_EVERY,
    env_id: str | None = None,
    updates: bool = True,
) -> da.Args:
    return seed_args(
        **({"env_id": env_id} if env_id else {}),
        **TINY_MODEL,
        buffer_capacity=capacity,
        # the warm-up, then `turnovers` replay capacities measured
        total_timesteps=soak_warmup(capacity, warmup, video_every) + capacity * turnovers + 2 * every,
        video_every=video_every,
        learning_starts=256 if updates else 10**9,  # without updates: the loop, replay and logging alone
        warmup_steps=0,
        batch_size=batch,
        sequence_length=seq,
        # one update per `train_every` env steps (the replayed-steps ratio of the script's `train_ratio`)
        train_ratio=batch * seq / train_every,
        log_interval=every,
        vector_mode="sync",
        leak_warmup_steps=0,
    )


def cmd_soak(
    capacity: int,
    turnovers: int,
    every: int,
    warmup: int = 0,
    video_every: int = SOAK_VIDEO_EVERY,
    env_id: str | None = None,
    updates: bool = True,
) -> dict:
    """`video_every` and `env_id` change what the soak stresses: open-loop GIFs every 250 env steps on Catch-v0
    show in 20k steps a per-GIF creep that Pong's one per 2,000 spreads over 160k. Without `updates` the same loop
    never trains (nor makes GIFs): what the env, replay, logging and leak detector keep, apart from training."""
    args = soak_args(
        capacity, turnovers, every, warmup=warmup, video_every=video_every, env_id=env_id, updates=updates
    )
    measured_from = soak_warmup(capacity, warmup, video_every)
    # the script's own memory_report() trims the heap before measuring, so USS is live memory
    with tempfile.TemporaryDirectory(prefix="soak-") as work:
        cwd = os.getcwd()
        os.chdir(work)  # the run directory (runs/...) goes in the temporary folder
        try:
            result = da.main(args)
            # anon_mb is logged where the system reports it (Linux): read_scalars leaves out what is missing
            keys = [
                mu.KEY_USS_MB,
                mu.BUFFER_KEYS["obs_bytes"],
                mu.BUFFER_KEYS["aux_bytes"],
                mu.KEY_ANON_MB,
                mu.KEY_HEAP_IN_USE_MB,
            ]
            scalars = bench_utils.read_scalars(os.path.join(work, result["run_dir"]), keys)
        finally:
            os.chdir(cwd)
    steps = sorted(scalars[mu.KEY_USS_MB])
    buffer_mb = [(scalars[keys[1]][s] + scalars[keys[2]][s]) / MB for s in steps]
    unexplained = [scalars[mu.KEY_USS_MB][s] - b for s, b in zip(steps, buffer_mb)]
    out = bench_utils.soak_summary(steps, unexplained, full_at=measured_from, capacity=capacity)
    if mu.KEY_ANON_MB in scalars:  # the leak detector's basis: other processes do not move it
        anon = [scalars[mu.KEY_ANON_MB][s] - b for s, b in zip(steps, buffer_mb)]
        out["soak_anon_slope_mb_per_10k"] = bench_utils.soak_summary(
            steps, anon, full_at=measured_from, capacity=capacity
        )["soak_uss_slope_mb_per_10k"]
        # the one-time settling before the window: from the replay full and the first GIF made to the warm-up's end
        out["soak_anon_slope_warmup_mb_per_10k"] = bench_utils.window_slope(
            steps, anon, soak_warmup(capacity, 0, video_every), measured_from
        )
    # glibc: what of it is live malloc'd blocks, and what lives outside them
    if mu.KEY_HEAP_IN_USE_MB in scalars:
        heap = [scalars[mu.KEY_HEAP_IN_USE_MB][s] - b for s, b in zip(steps, buffer_mb)]
        out["soak_heap_in_use_slope_mb_per_10k"] = bench_utils.soak_summary(
            steps, heap, full_at=measured_from, capacity=capacity
        )["soak_uss_slope_mb_per_10k"]
        if mu.KEY_ANON_MB in scalars:
            outside = [scalars[mu.KEY_ANON_MB][s] - scalars[mu.KEY_HEAP_IN_USE_MB][s] for s in steps]
            out["soak_anon_outside_heap_slope_mb_per_10k"] = bench_utils.soak_summary(
                steps, outside, full_at=measured_from, capacity=capacity
            )["soak_uss_slope_mb_per_10k"]
    out["soak_config"] = {
        "env_id": args.env_id,
        "model": TINY_MODEL,
        "capacity_steps": capacity,
        "env_steps": args.total_timesteps,
        "warmup_env_steps": measured_from,  # the slope is measured from here to the end
        "measured_env_steps": steps[-1] - min(s for s in steps if s >= measured_from),
        "video_every": args.video_every,
        "training": updates,
        "batch": f"B{args.batch_size} x T{args.sequence_length}",
        "updates": result["updates"],
        "sample_every_env_steps": every,
        "buffer_mb_subtracted_first_last": [round(buffer_mb[0], 3), round(buffer_mb[-1], 3)],
    }
    # every reading, so that any window's slope can be computed again from the file
    out["soak_samples"] = {
        "env_step": steps,
        "replay_mb": buffer_mb,
        **{
            name: [scalars[key][s] for s in steps]
            for name, key in (
                ("uss_mb", mu.KEY_USS_MB),
                ("anon_mb", mu.KEY_ANON_MB),
                ("heap_in_use_mb", mu.KEY_HEAP_IN_USE_MB),
            )
            if key in scalars
        },
    }
    return out


# ---------------------------------------------------------------------------------------------------------
# GPU figures (run by run.py only where torch.cuda.is_available()); `--device cpu` runs the same code path
# without the CUDA memory figures, to check it on a machine without a GPU.
# ---------------------------------------------------------------------------------------------------------
def cmd_gpu(quick: bool, device_name: str, parts: tuple[str, ...] = ("amp", "loop")) -> dict:
    """`amp`: one eager update per --precision (float32 is "off" there), its time and peak memory; `loop`: the training loop past replay
    capacity (captured updates on CUDA), its env steps/s and the slope of GPU-allocated memory once full."""
    device = torch.device(device_name)
    on_cuda = device.type == "cuda"
    args = seed_args(cuda=on_cuda)
    if quick:
        args = dataclasses.replace(args, batch_size=4, sequence_length=10)
    replay, obs_shape, num_actions = fill_replay(dataclasses.replace(args, buffer_capacity=3_000), 3_000)
    batch = replay.sample(args.batch_size, args.sequence_length)
    out: dict = {
        "run": True,
        "device": torch.cuda.get_device_name(device) if on_cuda else str(device),
        "update_batch": f"B{args.batch_size} x T{args.sequence_length}",
        "amp": {},
    }
    for mode in ("off", "bf16", "fp16") if "amp" in parts else ():
        amp_args = dataclasses.replace(
            args, precision={"off": "float32"}.get(mode, mode), cudagraph=False
        )  # the eager update (Adam not capturable)
        try:
            mu.amp(mode, device)
        except ValueError as exc:
            out["amp"][mode] = {"error": str(exc)}
            continue
        gc.collect()
        if on_cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        torch.manual_seed(args.seed)
        agent = fast_agent(amp_args, obs_shape, num_actions, device)

        def update(agent=agent, amp_args=amp_args):
            _update(agent, batch, amp_args)
            if on_cuda:
                torch.cuda.synchronize(device)

        timing = bench_utils.time_ms(update, reps=3 if quick else 10, warmup=2)
        figures = {
            "update_ms": timing["median_ms"],
            "updates_per_s": 1e3 / timing["median_ms"],
            "samples_ms": timing["samples_ms"],
        }
        if on_cuda:
            figures["peak_alloc_mb"] = torch.cuda.max_memory_allocated(device) / MB
            figures["peak_reserved_mb"] = torch.cuda.max_memory_reserved(device) / MB
        out["amp"][mode] = figures
        del agent, update

    if "loop" not in parts:
        return out
    # the whole training loop past replay capacity: env steps/s and the GPU-allocated slope once full
    capacity = 200 if quick else 1_000
    loop_args = seed_args(
        cuda=on_cuda,
        buffer_capacity=capacity,
        total_timesteps=4 * capacity,
        learning_starts=capacity // 2,
        warmup_steps=0,
        log_interval=capacity // 4,
        leak_warmup_steps=0,
        cudagraph=on_cuda,
        video_every=0,
    )
    if quick:  # one update per 16 env steps instead of the seed's 1.28 per env step
        loop_args = dataclasses.replace(loop_args, batch_size=4, sequence_length=10, train_ratio=4 * 10 / 16)
    with tempfile.TemporaryDirectory(prefix="gpu-loop-") as work:
        cwd = os.getcwd()
        os.chdir(work)
        try:
            result = da.main(loop_args)
            keys = ["charts/SPS", mu.KEY_GPU_ALLOC_MB] if on_cuda else ["charts/SPS"]
            scalars = bench_utils.read_scalars(os.path.join(work, result["run_dir"]), keys)
        finally:
            os.chdir(cwd)
    out["loop"] = {
        "capacity_steps": capacity,
        "cudagraph": loop_args.cudagraph,
        "precision": loop_args.precision,
        "env_steps": loop_args.total_timesteps,
        "batch": f"B{loop_args.batch_size} x T{loop_args.sequence_length}",
        "updates": result["updates"],
        "env_steps_per_s": scalars["charts/SPS"][max(scalars["charts/SPS"])],
    }
    if on_cuda:
        alloc = scalars[mu.KEY_GPU_ALLOC_MB]
        steps = [s for s in sorted(alloc) if s >= capacity]
        out["loop"]["gpu_alloc_slope_mb_per_10k"] = mu.robust_slope(steps, [alloc[s] for s in steps]) * 10_000
        out["loop"]["gpu_alloc_mb_first_last"] = [alloc[steps[0]], alloc[steps[-1]]]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["measure", "update", "trials", "soak", "gpu", "serve"])
    parser.add_argument("--reps", type=int, default=5, help="update: timed repetitions")
    parser.add_argument("--device", default="cuda", help="gpu: the device (cpu checks the code path)")
    parser.add_argument(
        "--parts", nargs="+", default=["amp", "loop"], choices=["amp", "loop"], help="gpu: which parts"
    )
    parser.add_argument(
        "--model",
        choices=["nature", "dreamerv3"],
        default="nature",
        help="serve: the seed model (nature) or the script's defaults as they are (dreamerv3, size S)",
    )
    parser.add_argument("--image-size", type=int, default=84, help="serve: frame side of the seed model")
    parser.add_argument(
        "--decoder-mid-channels", type=int, help="serve: channels of the decoder's bottleneck"
    )
    parser.add_argument("--out", help="where the JSON result goes (all but serve)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--trials", nargs="+", default=list(TRIALS), choices=list(TRIALS))
    parser.add_argument("--trial-reps", type=int, default=3)
    parser.add_argument("--capacity", type=int, default=1_000, help="soak: replay capacity in env steps")
    parser.add_argument(
        "--turnovers", type=int, default=100, help="soak: replay turnovers measured after the warm-up"
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=SOAK_WARMUP,
        help="soak: env steps before the slope is measured (at least the capacity and the first GIF)",
    )
    parser.add_argument("--every", type=int, default=250, help="soak: env steps between memory samples")
    parser.add_argument(
        "--video-every", type=int, default=SOAK_VIDEO_EVERY, help="soak: env steps between open-loop GIFs"
    )
    parser.add_argument("--env-id", default=None, help="soak: the environment (default: the seed's, Pong)")
    parser.add_argument(
        "--no-updates",
        action="store_true",
        help="soak: the same loop without training (the prefill never ends)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.command == "serve":
        return cmd_serve(args.model, args.image_size, args.decoder_mid_channels)
    if args.out is None:
        parser.error("--out is required")
    if args.command == "measure":
        result = cmd_measure(args.quick)
    elif args.command == "update":
        result = cmd_update(args.reps)
    elif args.command == "trials":
        result = cmd_trials(args.trials, args.trial_reps)
    elif args.command == "soak":
        result = cmd_soak(
            args.capacity,
            args.turnovers,
            args.every,
            args.warmup,
            args.video_every,
            args.env_id,
            updates=not args.no_updates,
        )
    else:
        result = cmd_gpu(args.quick, args.device, tuple(args.parts))
    result["machine"] = bench_utils.machine()
    result["code"] = code_version()  # the commit it ran, and whether the tree differed
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
