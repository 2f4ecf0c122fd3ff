"""SheepRL's figures, measured with SheepRL's own code inside its own virtual environment.

Run by `benchmark/run.py --peer sheeprl` with the interpreter of `benchmark/.peer-venv`:

    python benchmark/peer_sheeprl.py measure --out PATH [...]   # buffer bytes, sampling, updates (V3, V1)
    python benchmark/peer_sheeprl.py soak --out PATH [...]      # host USS over buffer turnovers

Nothing of SheepRL is copied here: its Hydra configuration is composed as its command line does, its own training
entry point (`run_algorithm`) fills its replay buffer with real Pong steps and saves it in a checkpoint, and its
`build_agent`, `sample_batches` and `train` functions are timed on that buffer.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import hydra
import numpy as np
import torch
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from benchmark import bench_utils

# The seed configuration's replay and batch shape; everything else stays at SheepRL's Atari defaults.
SEED_OVERRIDES = [
    "env.id=PongNoFrameskip-v4",
    "env.num_envs=2",
    "buffer.size=50000",
    "algo.per_rank_batch_size=16",
    "algo.per_rank_sequence_length=50",
]
# Quiet, local and reproducible runs: no videos, metrics, model registry or test episode.
RUN_OVERRIDES = [
    "env.capture_video=False",
    "metric.log_level=0",
    "model_manager.disabled=True",
    "algo.run_test=False",
    "fabric.accelerator=cpu",
]
# A tiny DreamerV3 for the soak: memory growth, not learning, is under test.
TINY_V3_OVERRIDES = [
    "algo.dense_units=16",
    "algo.mlp_layers=1",
    "algo.world_model.encoder.cnn_channels_multiplier=4",
    "algo.world_model.recurrent_model.recurrent_state_size=16",
    "algo.world_model.transition_model.hidden_size=16",
    "algo.world_model.representation_model.hidden_size=16",
    "algo.world_model.stochastic_size=4",
    "algo.world_model.discrete_size=4",
]


def compose_cfg(overrides: list[str]):
    """SheepRL's configuration with these Hydra overrides, resolved and checked as its command line does."""
    from sheeprl.cli import check_configs
    from sheeprl.utils.utils import dotdict

    with initialize_config_module(config_module="sheeprl.configs", version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    cfg = dotdict(OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_configs(cfg)
    return cfg


def run_sheeprl(overrides: list[str]) -> None:
    from sheeprl.cli import run_algorithm

    run_algorithm(compose_cfg(overrides))


def fill_buffer(steps: int, log_root: str):
    """Play `steps` real Pong steps (random actions, as before `learning_starts`) through SheepRL's DreamerV3 loop with
    a buffer of exactly that many steps, save it with SheepRL's checkpoint, and load it back."""
    run_sheeprl(
        ["exp=dreamer_v3", *SEED_OVERRIDES, *RUN_OVERRIDES]
        + [
            f"buffer.size={steps}",
            f"algo.total_steps={steps}",
            f"algo.learning_starts={steps + 2}",
            "buffer.checkpoint=True",
            "checkpoint.every=0",
            "checkpoint.save_last=True",
            f"log_root={log_root}",
            "env.sync_env=True",
        ]
    )
    (path,) = glob.glob(os.path.join(log_root, "**", f"ckpt_{steps}_buffer_rank_0.pt"), recursive=True)
    return torch.load(path, weights_only=False)


def buffer_figures(rb) -> dict:
    """Bytes per stored step, from the arrays of every environment's buffer."""
    per_key: dict[str, int] = {}
    capacity = 0
    for env_rb in rb.buffer:
        capacity += env_rb.buffer_size * env_rb.n_envs
        for key, array in env_rb.buffer.items():
            per_key[key] = per_key.get(key, 0) + int(array.nbytes)
    steps_stored = sum(int(b.full) * b.buffer_size + (1 - int(b.full)) * b._pos for b in rb.buffer)
    first = rb.buffer[0].buffer
    return {
        "buffer_bytes_per_step": sum(per_key.values()) / capacity,
        "buffer_bytes_per_step_by_key": {k: v / capacity for k, v in per_key.items()},
        "buffer_arrays": {k: f"{tuple(v.shape[2:])} {v.dtype}" for k, v in first.items()},
        "buffer_capacity_steps": capacity,
        "buffer_steps_stored": steps_stored,
        "buffer_memmap": bool(rb.buffer[0].is_memmap),
    }


# DreamerV3 at our seed model's size (deter 200, 32 latents of 32 classes, 200-unit MLPs of 2 layers, encoder
# channels 16-32-64-128): 5.45M parameters against our 4.99M. Its decoder mirrors its encoder, so the channel
# multiplier 32 of our encoder's first layer would double its decoder; 16 is the closest match in total.
MATCHED_V3_OVERRIDES = [
    "algo.world_model.recurrent_model.recurrent_state_size=200",
    "algo.world_model.stochastic_size=32",
    "algo.world_model.discrete_size=32",
    "algo.dense_units=200",
    "algo.mlp_layers=2",
    "algo.world_model.transition_model.hidden_size=200",
    "algo.world_model.representation_model.hidden_size=200",
    "algo.world_model.encoder.cnn_channels_multiplier=16",
]


# SheepRL's own size S, named (its `dreamer_v3_S` preset, which `exp=dreamer_v3` also selects), at its own and our
# default's batch of 16 sequences of 64 steps; the frames stay its Atari default, 64x64 RGB, as ours.
SIZE_S_OVERRIDES = [
    "env.id=PongNoFrameskip-v4",
    "env.num_envs=2",
    "algo=dreamer_v3_S",
    "algo.per_rank_batch_size=16",
    "algo.per_rank_sequence_length=64",
]


def setup_update(
    version: str, rb, model_overrides: list[str] = (), batch_overrides: list[str] = SEED_OVERRIDES
) -> tuple:
    """SheepRL's agent and optimizers for `version`, built as its training entry point builds them; returns
    (sample, update, info): one batch sampled from `rb`, one full update (world model + actor + critic) on a
    fixed batch, and the model's sizes. `batch_overrides` set the environment and the batch (the seed's by
    default)."""
    from sheeprl.algos.dreamer_v2.utils import sample_batches
    from sheeprl.utils.env import make_env

    overrides = [f"exp=dreamer_{version}", *batch_overrides, *RUN_OVERRIDES, *model_overrides]
    cfg = compose_cfg(overrides)
    cfg.env.frame_stack = -1 if version == "v3" else 1
    fabric = hydra.utils.instantiate(cfg.fabric, strategy="auto", callbacks=[], _convert_="all")
    fabric.seed_everything(cfg.seed)
    env = make_env(cfg, cfg.seed, 0, None, "bench")()
    obs_space, actions_dim = env.observation_space, (int(env.action_space.n),)
    env.close()

    if version == "v3":
        from sheeprl.algos.dreamer_v3.agent import build_agent
        from sheeprl.algos.dreamer_v3.dreamer_v3 import train
        from sheeprl.algos.dreamer_v3.utils import Moments

        world_model, actor, critic, target_critic, _ = build_agent(fabric, actions_dim, False, cfg, obs_space)
        m = cfg.algo.actor.moments
        moments = Moments(m.decay, m.max, m.percentile.low, m.percentile.high)
    else:
        from sheeprl.algos.dreamer_v1.agent import build_agent
        from sheeprl.algos.dreamer_v1.dreamer_v1 import train

        world_model, actor, critic, _ = build_agent(fabric, actions_dim, False, cfg, obs_space)
    optimizers = fabric.setup_optimizers(
        *(
            hydra.utils.instantiate(opt_cfg, params=module.parameters(), _convert_="all")
            for opt_cfg, module in (
                (cfg.algo.world_model.optimizer, world_model),
                (cfg.algo.actor.optimizer, actor),
                (cfg.algo.critic.optimizer, critic),
            )
        )
    )

    def sample():
        return next(iter(sample_batches(fabric, cfg, rb, 1)))

    batch = sample()

    def update():
        if version == "v3":
            # the slow critic follows the critic once per gradient step, as in SheepRL's loop
            with torch.no_grad():
                for p, tp in zip(critic.module.parameters(), target_critic.parameters()):
                    tp.lerp_(p, cfg.algo.critic.tau)
            train(
                fabric,
                world_model,
                actor,
                critic,
                target_critic,
                *optimizers,
                batch,
                None,
                cfg,
                False,
                actions_dim,
                moments,
            )
        else:
            train(fabric, world_model, actor, critic, *optimizers, batch, None, cfg)

    info = {
        "update_includes": "world model, actor and critic updates and the slow-critic EMA, on one sampled batch",
        "overrides": overrides,
        "params_world_model": bench_utils.param_count(world_model),
        "params_actor": bench_utils.param_count(actor),
        "params_critic": bench_utils.param_count(critic),
        "params_total": bench_utils.param_count(world_model, actor, critic),
        "batch": {k: f"{tuple(v.shape)} {v.dtype}" for k, v in batch.items()},
        "model": {
            "deter": cfg.algo.world_model.recurrent_model.recurrent_state_size,
            "stoch": cfg.algo.world_model.stochastic_size,
            "discrete": cfg.algo.world_model.get("discrete_size"),
            "cnn_channels_multiplier": cfg.algo.world_model.encoder.cnn_channels_multiplier,
            "hidden": cfg.algo.world_model.transition_model.hidden_size,
            "dense_units": cfg.algo.dense_units,
            "mlp_layers": cfg.algo.mlp_layers,
            "horizon": cfg.algo.horizon,
            "precision": cfg.fabric.precision,
            "compile": bool(cfg.algo.compile.enabled),
            "fused_adam": bool(cfg.algo.world_model.optimizer.get("fused", False)),
        },
    }
    return sample, update, info


def measure_updates(version: str, rb, reps: int, warmup: int) -> dict:
    """Median time of one batch sampled from `rb` and of one full update (world model + actor + critic)."""
    sample, update, info = setup_update(version, rb)
    sampling = bench_utils.time_ms(sample, reps=max(5, reps), warmup=1)
    updating = bench_utils.time_ms(update, reps=reps, warmup=warmup)
    return {
        "sample_ms": sampling["median_ms"],
        "sample_samples_ms": sampling["samples_ms"],
        "update_ms": updating["median_ms"],
        "update_samples_ms": updating["samples_ms"],
        **info,
    }


def cmd_serve(args) -> None:
    """One update per `update` line on stdin, its time on stdout: `benchmark/run.py` alternates these updates
    with ours, so that a change in the machine's load hits both alike."""
    with tempfile.TemporaryDirectory(prefix="peer-", dir=args.work_dir) as log_root:
        rb = fill_buffer(args.fill_steps, log_root)
        if args.size == "matched":
            _, update, info = setup_update("v3", rb, MATCHED_V3_OVERRIDES)
        else:
            _, update, info = setup_update("v3", rb, batch_overrides=SIZE_S_OVERRIDES)
        bench_utils.serve_updates(update, {**info, "size": args.size})


def cmd_measure(args) -> dict:
    out: dict = {"config": {"exp": "dreamer_v3 / dreamer_v1", "overrides": SEED_OVERRIDES + RUN_OVERRIDES}}
    with tempfile.TemporaryDirectory(prefix="peer-", dir=args.work_dir) as log_root:
        rb = fill_buffer(args.fill_steps, log_root)
        out.update(buffer_figures(rb))
        for version in args.versions:
            out[version] = measure_updates(version, rb, args.reps, args.warmup)
        del rb
    return out


def cmd_soak(args) -> dict:
    from benchmark.peer_probe import MemoryProbedAtariPreprocessing as Probe

    Probe.every = args.every
    measured_from = max(args.capacity, args.warmup)  # as ours: the replay full and the loop warmed up
    total = measured_from + args.capacity * args.turnovers + 2 * args.every
    overrides = ["exp=dreamer_v3", *SEED_OVERRIDES, *RUN_OVERRIDES, *TINY_V3_OVERRIDES] + [
        f"buffer.size={args.capacity}",
        f"algo.total_steps={total}",
        f"algo.learning_starts={args.learning_starts}",
        f"algo.replay_ratio={1.0 / args.train_every}",
        f"algo.per_rank_batch_size={args.batch_size}",
        f"algo.per_rank_sequence_length={args.seq_len}",
        "buffer.checkpoint=False",
        "checkpoint.every=0",
        "checkpoint.save_last=False",
        "env.sync_env=True",
        "env.wrapper._target_=benchmark.peer_probe.MemoryProbedAtariPreprocessing",
    ]
    with tempfile.TemporaryDirectory(prefix="peer-soak-", dir=args.work_dir) as log_root:
        run_sheeprl(overrides + [f"log_root={log_root}"])
    steps = [s for s, _ in Probe.samples]
    # Once full, the ring buffer's arrays have a fixed size: subtracting them moves the level, not the slope.
    buffer_mb = args.capacity * args.bytes_per_step / (1024 * 1024)
    unexplained = [uss - buffer_mb for _, uss in Probe.samples]
    out = bench_utils.soak_summary(steps, unexplained, full_at=measured_from, capacity=args.capacity)
    if Probe.anon_samples:
        anon_steps = [s for s, _ in Probe.anon_samples]
        anon = [value - buffer_mb for _, value in Probe.anon_samples]
        out["soak_anon_slope_mb_per_10k"] = bench_utils.soak_summary(
            anon_steps, anon, full_at=measured_from, capacity=args.capacity
        )["soak_uss_slope_mb_per_10k"]
        # as ours: the warm-up's own slope, from the replay full (and past ours' first GIF) to the window
        out["soak_anon_slope_warmup_mb_per_10k"] = bench_utils.window_slope(
            anon_steps, anon, max(args.capacity, 2_001), measured_from
        )
    out["soak_config"] = {
        "overrides": overrides,
        "capacity_steps": args.capacity,
        "env_steps": total,
        "warmup_env_steps": measured_from,
        "buffer_mb_subtracted": buffer_mb,
        "sample_every_env_steps": args.every,
    }
    # every reading, as ours keeps them (the replay's bytes are the constant buffer_mb_subtracted)
    out["soak_samples"] = {"env_step": steps, "uss_mb": [uss for _, uss in Probe.samples]}
    if Probe.anon_samples:
        out["soak_samples"]["anon_env_step"] = [s for s, _ in Probe.anon_samples]
        out["soak_samples"]["anon_mb"] = [value for _, value in Probe.anon_samples]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    measure = sub.add_parser("measure")
    measure.add_argument("--fill-steps", type=int, default=50_000)
    measure.add_argument("--reps", type=int, default=5)
    measure.add_argument("--warmup", type=int, default=1)
    measure.add_argument("--versions", nargs="+", default=["v3", "v1"], choices=["v3", "v1"])
    soak = sub.add_parser("soak")
    soak.add_argument("--capacity", type=int, default=1000)
    soak.add_argument("--turnovers", type=int, default=10)
    soak.add_argument(
        "--warmup", type=int, default=0, help="env steps before the slope is measured (at least the capacity)"
    )
    soak.add_argument("--every", type=int, default=250)
    soak.add_argument("--learning-starts", type=int, default=256)
    soak.add_argument("--train-every", type=int, default=64)
    soak.add_argument("--batch-size", type=int, default=4)
    soak.add_argument("--seq-len", type=int, default=16)
    soak.add_argument("--bytes-per-step", type=float, required=True)
    serve = sub.add_parser("serve")
    serve.add_argument("--fill-steps", type=int, default=2_000)
    serve.add_argument(
        "--size",
        choices=["matched", "S"],
        required=True,
        help="DreamerV3 at our seed model's size (batch 16 x 50), or its own dreamer_v3_S at 16 x 64",
    )
    for p in (measure, soak, serve):
        p.add_argument("--threads", type=int, default=os.cpu_count())
        p.add_argument("--work-dir", default=None)
    for p in (measure, soak):
        p.add_argument("--out", required=True)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    np.random.seed(0)
    if args.command == "serve":
        return cmd_serve(args)
    result = cmd_measure(args) if args.command == "measure" else cmd_soak(args)
    result["machine"] = bench_utils.machine()
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
