"""What each of Dreamer's fast paths saves on the CPU, alone, against the path beneath it, and what a check of them
on live weights costs: the figures behind which paths the CPU runs by default and how often the run checks them.

    python benchmark/cpu_fast_paths.py --json benchmark/results/cpu_fast_paths/<date>-<machine>.json

Two sizes: the default Pong recipe (dreamer_atari.py's defaults: DreamerV3's size S on 64x64 colour frames, batch
16 x 64) and the learning proof's (benchmark/learning_proof.py's Catch configuration). At each, every variant gets an
agent of its own (`build_agent`, then `speed_up_agent` with the variant's flags, as a run installs them) and the same
batch of real frames; after one untimed update each, the timed updates go round robin over the variants (the order
rotating every round), so that the machine's load hits them all alike. A path's saving is its median update against
the median of the variant beneath it: Part 1 with every path off, or the path it stands on (the hand-written backward
on the fast observe's autograd, the gathers on the fast imagination's products, the shared heads on the fast
imagination). The check's cost is `dreamer_kernels.check_fast_paths` on the agent with every CPU path on. Every sample
is kept; nothing is typed in.
"""

import dataclasses
import json
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch
import tyro

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import dreamer_atari as da
import dreamer_kernels as dk
from benchmark import bench_utils
from benchmark.common import code_markdown, code_version, machine_markdown
from benchmark.learning_proof import PROOF_ARGS


@dataclasses.dataclass
class Args:
    json: str | None = None
    """where to write every figure and sample (and a markdown beside it); none: print only"""
    sizes: tuple[str, ...] = ("pong", "proof")
    """which sizes to measure: the default Pong recipe, the learning proof's"""
    rounds: int = 7
    """timed updates per variant at the Pong recipe (the proof's size gets ten times as many)"""
    threads: int = 2
    """torch threads"""
    check_reps: int = 3
    """timed checks of the fast paths"""


# Every speed option off: Part 1's functions train
PART_1 = dict(
    fast_observe="off",
    fast_imagine="off",
    imagine_gathers="off",
    fast_heads="off",
    channels_last="off",
)
# name -> (the variant beneath it, the flags that add the path)
VARIANTS = {
    "part1": (None, {}),
    "fast_observe": ("part1", dict(fast_observe="on", observe_backward="autograd")),
    "observe_backward": ("fast_observe", dict(fast_observe="on", observe_backward="hand-written")),
    "fast_imagine": ("part1", dict(fast_imagine="on")),
    "imagine_gathers": ("fast_imagine", dict(fast_imagine="on", imagine_gathers="on")),
    "fast_heads": ("fast_imagine", dict(fast_imagine="on", fast_heads="on")),
    "channels_last": ("part1", dict(channels_last="on")),
}
# every CPU path on at once (what the check's cost is measured on)
ALL_ON = dict(
    fast_observe="on",
    observe_backward="hand-written",
    fast_imagine="on",
    imagine_gathers="on",
    fast_heads="on",
    channels_last="on",
)


def size_args(size: str) -> da.Args:
    """The run's flags at `size`, on the CPU, every path off."""
    base = da.Args(cuda=False) if size == "pong" else da.Args(cuda=False, **PROOF_ARGS)
    return dataclasses.replace(base, **PART_1)


def real_batch(args: da.Args) -> tuple[dict, tuple, int]:
    """A batch of real frames at `args`' shapes: random actions into a fresh replay, as before learning starts."""
    envs = da.make_vector_env(
        dataclasses.replace(args, vector_mode="sync", num_envs=1), "benchmark", args.seed
    )
    try:
        rng = np.random.default_rng(args.seed)
        replay = da.EpisodeReplay(4_000, 1, seed=args.seed)
        obs, _ = envs.reset(seed=args.seed)
        replay.start_episode(0, obs[0])
        num_actions = int(envs.single_action_space.n)
        for _ in range(max(3 * args.sequence_length, 400)):
            actions = rng.integers(num_actions, size=1)
            obs, rewards, terminations, truncations, infos = envs.step(actions)
            replay.add(obs, actions, rewards, terminations, truncations, infos)
        return (
            replay.sample(args.batch_size, args.sequence_length),
            envs.single_observation_space.shape,
            num_actions,
        )
    finally:
        envs.close()


def update(agent, batch: dict, args: da.Args) -> None:
    """One whole update from a numpy batch, as the loop runs it eagerly: world model, then actor and critic."""
    _, _, states = da.train_world_model(agent, da.batch_tensors(batch, agent.device), args)
    da.train_behavior(agent, states, args)


def variant_agent(args: da.Args, flags: dict, obs_shape, num_actions):
    """An agent as a run with `flags` trains it: `build_agent`, then the fast paths those flags ask for."""
    run_args = dataclasses.replace(args, **flags)
    torch.manual_seed(args.seed)
    agent = da.build_agent(run_args, obs_shape, num_actions, "cpu")
    da.speed_up_agent(agent, run_args)
    return agent, run_args


def measure_size(size: str, rounds: int, check_reps: int) -> dict:
    args = size_args(size)
    batch, obs_shape, num_actions = real_batch(args)
    agents = {
        name: variant_agent(args, flags, obs_shape, num_actions) for name, (_, flags) in VARIANTS.items()
    }
    installed = {
        name: {
            "observe": type(agent.observe).__name__,
            "hand_written_backward": bool(getattr(agent.observe, "hand_written_backward", False)),
            "imagine": type(agent.imagine).__name__,
            "gathers": bool(getattr(agent.imagine, "gathers", False)),
            "imagined_heads": getattr(agent.imagined_heads, "__name__", type(agent.imagined_heads).__name__),
        }
        for name, (agent, _) in agents.items()
    }
    for agent, run_args in agents.values():  # the first update of each, untimed
        update(agent, batch, run_args)
    samples = {name: [] for name in agents}
    names = list(agents)
    for round_ in range(rounds):
        for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
            agent, run_args = agents[name]
            start = time.perf_counter()
            update(agent, batch, run_args)
            samples[name].append(round((time.perf_counter() - start) * 1e3, 3))
    medians = {name: statistics.median(values) for name, values in samples.items()}
    savings = {
        name: 1.0 - medians[name] / medians[beneath]
        for name, (beneath, _) in VARIANTS.items()
        if beneath is not None
    }
    everything, everything_args = variant_agent(args, ALL_ON, obs_shape, num_actions)
    update(everything, batch, everything_args)
    check_s = []
    for _ in range(check_reps):
        start = time.perf_counter()
        dk.check_fast_paths(everything, everything_args)
        check_s.append(round(time.perf_counter() - start, 3))
    return {
        "flags": {name: {**PART_1, **flags} for name, (_, flags) in VARIANTS.items()},
        "beneath": {name: beneath for name, (beneath, _) in VARIANTS.items()},
        "installed": installed,
        "batch": f"B{args.batch_size} x T{args.sequence_length}, obs {obs_shape}",
        "update_samples_ms": samples,
        "update_median_ms": medians,
        "saving": savings,
        "check_s": check_s,
        "check_median_s": statistics.median(check_s),
    }


def markdown(result: dict) -> str:
    lines = [
        f"# Dreamer's fast paths on the CPU: what each saves, and what a check costs ({result['date']})",
        "",
        machine_markdown(result["machine"], result["command"], result["args"]["threads"]),
        code_markdown(result["code"]),
        "",
    ]
    for size, figures in result["sizes"].items():
        lines += [
            f"## {'the default Pong recipe' if size == 'pong' else 'the learning proof'} ({figures['batch']})",
            "",
            "| path | beneath it | update (median ms) | saving |",
            "|---|---|---|---|",
        ]
        for name, median in figures["update_median_ms"].items():
            beneath = figures["beneath"][name]
            saving = "" if beneath is None else f"{100 * figures['saving'][name]:.1f} %"
            lines.append(f"| {name} | {beneath or ''} | {median:,.1f} | {saving} |")
        lines += [
            "",
            f"A check of every CPU path on live weights: {figures['check_median_s']:.2f} s "
            f"(samples {figures['check_s']}), {len(figures['update_samples_ms']['part1'])} timed updates per "
            "variant.",
            "",
        ]
    return "\n".join(lines + ["Every sample is in the JSON beside this file.", ""])


def main(args: Args) -> dict:
    torch.set_num_threads(args.threads)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": bench_utils.machine(),
        "command": "python benchmark/cpu_fast_paths.py " + " ".join(sys.argv[1:]),
        "args": dataclasses.asdict(args),
        "code": code_version(),  # the commit it ran, and whether the tree differed
        "sizes": {},
    }
    for size in args.sizes:
        rounds = args.rounds if size == "pong" else 10 * args.rounds
        result["sizes"][size] = measure_size(size, rounds, args.check_reps)
    print(markdown(result))
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        Path(args.json).with_suffix(".md").write_text(markdown(result))
    return result


if __name__ == "__main__":
    main(tyro.cli(Args))
