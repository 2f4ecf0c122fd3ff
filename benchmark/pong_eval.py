"""A trained dreamer_atari.py agent evaluated: N episodes at once, in N envs, played by the script's own Player.

    python benchmark/pong_eval.py CHECKPOINT --out eval.json [--episodes 10] [--device cuda] [--minutes 1.5]

The agent acts as it does in training (the script's `Player`: actions sampled from the actor). Env i plays one
episode from seed `--seed + i` with the training run's env settings; its first finished episode is the one counted.
Writes every episode's return and length, their mean, and which envs had not finished when `--minutes` ran out
(their return so far is kept apart and not in the mean). `--max-episode-steps` truncates episodes (`--quick` checks
of the plumbing).
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

import dreamer_atari as da


def agent_from_checkpoint(path: str, device: torch.device) -> tuple[da.Agent, da.Args, dict]:
    """The networks of a checkpoint, built with the Args it was trained with (fields this version lacks dropped)."""
    state = da.load_checkpoint(path)
    fields = {f.name: f for f in dataclasses.fields(da.Args)}
    saved = {k: (tuple(v) if isinstance(v, list) else v) for k, v in state["args"].items() if k in fields}
    # a checkpoint from before --model, --image-size or --frame-stack existed: the nature model's values
    args = da.Args(**{**da.FLAGS_BEFORE_THEY_EXISTED, **saved})
    obs_shape, num_actions = da.env_spaces(args)
    agent = da.build_agent(
        dataclasses.replace(args, cudagraph=False, compile=False), obs_shape, num_actions, device
    )
    for name, module in agent.modules().items():
        module.load_state_dict(state["models"][name])
    return agent, args, dict(state["counters"])


def evaluate(
    agent: da.Agent,
    args: da.Args,
    episodes: int,
    seed: int,
    minutes: float,
    max_episode_steps: int,
    vector_mode: str,
) -> dict:
    eval_args = dataclasses.replace(
        args,
        num_envs=episodes,
        vector_mode=vector_mode,
        capture_video=False,
        max_episode_steps=max_episode_steps or args.max_episode_steps,
    )
    envs = da.make_vector_env(eval_args, "eval", seed)
    player = da.Player(agent, episodes)
    returns: list[float | None] = [None] * episodes
    lengths: list[int | None] = [None] * episodes
    running_return = np.zeros(episodes)
    running_length = np.zeros(episodes, np.int64)
    started = time.perf_counter()
    steps = 0
    try:
        obs, _ = envs.reset(seed=seed)
        is_first = np.ones(episodes, np.bool_)
        while any(r is None for r in returns) and time.perf_counter() - started < minutes * 60:
            actions = player.act(obs, is_first)
            obs, rewards, terminations, truncations, _ = envs.step(actions)
            steps += 1
            running_return += rewards
            running_length += 1
            done = np.logical_or(terminations, truncations)
            for i in np.flatnonzero(done):
                if returns[i] is None:
                    returns[i], lengths[i] = float(running_return[i]), int(running_length[i])
            running_return[done], running_length[done] = 0.0, 0
            is_first = done
    finally:
        envs.close()
    finished = [r for r in returns if r is not None]
    return {
        "episodes": [
            {
                "env": i,
                "seed": seed + i,
                "return": returns[i],
                "length": lengths[i],
                "finished": returns[i] is not None,
                **(
                    {}
                    if returns[i] is not None
                    else {"return_so_far": float(running_return[i]), "steps_so_far": int(running_length[i])}
                ),
            }
            for i in range(episodes)
        ],
        "returns": finished,
        "mean_return": float(np.mean(finished)) if finished else None,
        "finished": len(finished),
        "asked": episodes,
        "vector_steps": steps,
        "wall_s": time.perf_counter() - started,
        "policy": "the script's Player: actions sampled from the actor, as in training",
        "max_episode_steps": eval_args.max_episode_steps,
        "vector_mode": vector_mode,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--out", required=True)
    parser.add_argument("--episodes", type=int, default=10)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--minutes", type=float, default=1.5)
    parser.add_argument("--seed", type=int, default=10_000, help="env i starts from seed + i")
    parser.add_argument(
        "--max-episode-steps", type=int, default=0, help="truncate episodes (0: the training run's)"
    )
    parser.add_argument("--vector-mode", choices=["sync", "async"], default="async")
    cli = parser.parse_args()
    if not Path(cli.checkpoint).is_file():
        print(f"error: {cli.checkpoint!r} is not a file.", file=sys.stderr)
        raise SystemExit(2)
    if cli.episodes < 1:
        print(f"error: --episodes must be at least 1, got {cli.episodes}.", file=sys.stderr)
        raise SystemExit(2)
    device = torch.device(cli.device)
    if device.type == "cpu":
        torch.set_num_threads(1)  # a few small forward passes per step: more threads only contend
    torch.manual_seed(cli.seed)
    try:
        agent, args, counters = agent_from_checkpoint(cli.checkpoint, device)
    except da.ArgsError:
        print(
            f"error: {cli.checkpoint!r} is not a readable {da.CHECKPOINT_FORMAT} checkpoint.", file=sys.stderr
        )
        raise SystemExit(2) from None
    result = evaluate(
        agent, args, cli.episodes, cli.seed, cli.minutes, cli.max_episode_steps, cli.vector_mode
    )
    result.update(
        {
            "env_id": args.env_id,
            "trained_env_steps": counters.get("global_step"),
            "trained_updates": counters.get("updates"),
            "device": str(device),
        }
    )
    Path(cli.out).write_text(json.dumps(result, indent=1))
    print(
        f"evaluation: {result['finished']}/{cli.episodes} episodes, mean return {result['mean_return']}",
        flush=True,
    )


if __name__ == "__main__":
    main()
