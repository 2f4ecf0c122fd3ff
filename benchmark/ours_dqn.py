"""DQN (StarCraft II split heads) figures: env steps/s of the built-in minigames and learner updates/s.

    python benchmark/ours_dqn.py --out PATH [--quick]

The configuration is `dqn_starcraft_split.Args()` as it is (res 32, step_mul 16, batch 8, Adam), on the CPU,
with CollectMineralShards's network (its 3 context layers, click distance and timer input; MoveToBeacon's default
has none of them) on both maps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np
import torch

import dqn_starcraft_split as dqn
import memory_utils as mu
from benchmark import bench_utils
from benchmark.common import code_version


def env_steps_per_s(args: dqn.Args, steps: int, epsilon: float, q_network, rng) -> float:
    """Agent steps per second of the built-in minigame, acting as training does (epsilon-greedy)."""
    env = dqn.make_env(args, args.seed)
    obs = env.reset()
    through = (
        dqn.with_map_defaults(args).move_through * args.res / args.screen_world_units
    )  # as training carries moves
    start = time.perf_counter()
    for _ in range(steps):
        action = dqn.select_action(q_network, obs, epsilon, rng, "cpu")
        obs, _, done = env.step(*dqn.game_call(action, obs, args.res, through))
        if done:
            obs = env.reset()
    elapsed = time.perf_counter() - start
    env.close()
    return steps / elapsed


def measure(quick: bool) -> dict:
    args = dqn.Args(cuda=False)
    rng = np.random.default_rng(args.seed)
    torch.manual_seed(args.seed)
    # the larger of the two maps' default networks: CollectMineralShards's, with its context layers
    settings = dqn.network_settings(dataclasses.replace(args, map_name="CollectMineralShards"))
    q_network = dqn.make_q_network(**settings)
    target_network = dqn.make_q_network(**settings)
    target_network.load_state_dict(q_network.state_dict())
    steps = 500 if quick else 5_000
    out: dict = {
        "dqn_config": {
            "res": args.res,
            "step_mul": args.step_mul,
            "batch_size": args.batch_size,
            "optimizer": "torch.optim.Adam",
            "amp": mu.amp(args.amp, "cpu").mode,
        }
    }
    for map_name in ("MoveToBeacon", "CollectMineralShards"):
        map_args = dataclasses.replace(args, map_name=map_name)
        out[f"dqn_env_steps_per_s_{map_name}"] = env_steps_per_s(map_args, steps, 1.0, q_network, rng)
        out[f"dqn_greedy_steps_per_s_{map_name}"] = env_steps_per_s(map_args, steps // 5, 0.0, q_network, rng)

    # the learner: a replay filled with real minigame steps, then one sample + update per call
    fill = 500 if quick else 2_000
    rb = dqn.SplitReplayBuffer(fill, args.res)
    env = dqn.make_env(args, args.seed)
    obs = env.reset()
    for _ in range(fill):
        action = dqn.select_action(q_network, obs, 1.0, rng, "cpu")
        next_obs, reward, done = env.step(*dqn.decode_action(action, args.res))
        rb.add(obs, action, reward, done)
        obs = env.reset() if done else next_obs
    env.close()
    optimizer = torch.optim.Adam(q_network.parameters(), lr=args.learning_rate)
    amp = mu.amp(args.amp, "cpu")  # --amp resolved on the CPU, as training's `build_agent` does

    def learner_step():
        batch = dqn.batch_to_device(rb.sample(args.batch_size, rng, args.n_step), "cpu")
        dqn.update(q_network, target_network, optimizer, batch, args, amp)

    timing = bench_utils.time_ms(learner_step, reps=20 if quick else 200, warmup=3)
    out["dqn_update_ms"] = timing["median_ms"]
    out["dqn_updates_per_s"] = 1e3 / timing["median_ms"]
    out["dqn_params"] = bench_utils.param_count(q_network)
    obs_bytes, aux_bytes = rb.bytes_per_step()
    out["dqn_buffer_bytes_per_step"] = obs_bytes + aux_bytes
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result = measure(args.quick)
    result["machine"] = bench_utils.machine()
    result["code"] = code_version()  # the commit it ran, and whether the tree differed
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
