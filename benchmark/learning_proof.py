"""Proof that dreamer_atari.py learns: its own main loop on Catch-v0, a pixel task a 2-core CPU learns in minutes.

    python benchmark/learning_proof.py --json out.json --seed 3

Trains `dreamer_atari.main` (the same replay, world model, imagination and actor code that Pong uses; only the
environment id and the sizes differ) on Catch-v0, then plays episodes with the trained agent acting as it acts in
training (actions sampled from the policy, the same `Player`), with random actions, and with a scripted agent that
walks the paddle under the ball (the best return there is). Writes one JSON object: `final_return`,
`optimal_return`, `random_return`, `env_steps`, `updates`, `seconds` (training wall time), `reached_at` (the env
step at which the mean return of the last `reach_window` training episodes first reached `reach_fraction` of the
optimal return; null if never), every training episode's return, the training curve (mean return of the episodes
in each bin of env steps), the load average around the run (other work on the machine slows it), the
configuration, the command and the machine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import ClassVar, Literal

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np
import torch
import tyro
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import dreamer_atari as da
from benchmark import bench_utils
from benchmark.common import code_version

# The proof's configuration: a small model and batch so that an update takes tens of milliseconds on a CPU;
# everything not named here is the script's default.
PROOF_ARGS = dict(
    env_id=da.CATCH_ID,
    # the seed's model and discount at a small size: this configuration was tuned and proven with them (Catch's frame
    # shows its whole state, so it needs neither DreamerV3's encoder nor its stacks of one)
    model="nature",
    continue_mode=False,
    num_envs=1,
    vector_mode="sync",
    encoder_channels=(8, 16, 16),
    embed_dim=64,
    decoder_base_channels=8,
    decoder_mid_channels=8,
    deterministic_dim=64,
    stochastic_dim=8,
    stochastic_classes=8,
    hidden_dim=64,
    sequence_length=16,
    imagination_horizon=10,
    video_every=0,
    leak_warmup_steps=0,
)


@dataclasses.dataclass
class Args:
    json: str
    """where to write the result (a JSON object)"""
    seed: int = 1
    """seed of the training run and of the evaluation episodes"""
    total_timesteps: int = 2_400
    """env steps of training (the budget: every seed should reach 0.8 of optimal by 70 % of it)"""
    train_ratio: float = 144.0
    """replayed steps per env step (at batch 8 x 16: 1.125 updates per env step)"""
    world_model_lr: float = 2e-3
    """learning rate of the world model (at 1e-3 the reward head learned Catch's +-1 too late for the policy to
    follow within 2,500 env steps for some seeds; at 3e-3 one seed's posterior collapsed onto its prior)"""
    actor_lr: float = 3e-4
    """learning rate of the actor"""
    critic_lr: float = 1e-3
    """learning rate of the critic"""
    world_model_grad_clip: float = 1000.0
    """the world model's gradient-norm clip (the script's default)"""
    entropy_coef: float = 1e-2
    """the actor's entropy bonus, 33x DreamerV3's: with less the actor's entropy collapses before the reward head
    has learned Catch's rare +-1 rewards (3e-3, seed 3: 0.50 nats at 1,000 env steps, return stuck at 0.6)"""
    frame_stack: int = 1
    """frames per observation: one shows Catch's whole state (the ball falls one row a step), and an update does a
    quarter of the image work of four"""
    image_size: int = 84
    """side of Catch's frames in pixels"""
    batch_size: int = 8
    """sequences per update (of 16 steps each)"""
    learning_starts: int = 300
    """env steps of random actions before the first update"""
    eval_episodes: int = 100
    """episodes played by each of the trained, random and scripted agents"""
    threads: int = 2
    """torch threads"""
    work_dir: str | None = None
    """where the training run writes runs/ (default: a temporary directory, removed afterwards)"""
    curve_bin: int = 500
    """env steps per point of the training curve"""
    log_interval: int = 500
    """env steps between the run's log points (the losses' means)"""
    reach_fraction: float = 0.8
    """`reached_at`: the env step at which the training episodes' mean return first reaches this share of the
    optimal return"""
    reach_window: int = 50
    """`reached_at`: over this many of the latest training episodes (about 500 env steps on Catch)"""
    precision: str = "float32"
    """dreamer_atari.py's --precision: float32 (the script's default) or bf16 (autocast, the observe scan float32)"""
    bf16_products: Literal["native", "emulated"] = "native"
    """with --precision bf16: `native` runs the products (matrix products and convolutions) on torch's bf16 kernels;
    `emulated` runs them in float32 on the bf16 operands and rounds each result to bf16 (`EmulatedBF16Products`),
    for a CPU without bf16 arithmetic, where the native kernels are 10-20x slower than float32"""


class EmulatedBF16Products(TorchDispatchMode):
    """bf16 products computed in float32: a matrix product or convolution (forward or backward) whose floating
    operands are all bf16 (autocast made them so) runs on their float32 copies, exact, and each floating result is
    rounded to bf16, the dtype the bf16 kernel returns. That is what a GPU's bf16 tensor cores do (bf16 operands,
    float32 sums, a bf16 result), up to the order of the sums. Everything else, autocast's choices included, runs
    unchanged, so a run under it is the bf16 run with different product kernels."""

    OPS: ClassVar[frozenset] = frozenset(
        {
            torch.ops.aten.mm.default,
            torch.ops.aten.addmm.default,
            torch.ops.aten.bmm.default,
            torch.ops.aten.baddbmm.default,
            torch.ops.aten.convolution.default,
            torch.ops.aten.convolution_backward.default,
        }
    )

    def __init__(self):
        super().__init__()
        self.products = 0  # products run in float32 so far

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.OPS:
            floats = [
                a
                for a in pytree.tree_leaves((args, kwargs))
                if isinstance(a, torch.Tensor) and a.is_floating_point()
            ]
            if floats and all(a.dtype == torch.bfloat16 for a in floats):
                self.products += 1

                def widen(a):
                    return a.float() if isinstance(a, torch.Tensor) and a.dtype == torch.bfloat16 else a

                out = func(*pytree.tree_map(widen, args), **pytree.tree_map(widen, kwargs))
                return pytree.tree_map(
                    lambda o: (
                        o.to(torch.bfloat16) if isinstance(o, torch.Tensor) and o.is_floating_point() else o
                    ),
                    out,
                )
        return func(*args, **kwargs)


def play(train_args: da.Args, episodes: int, seed: int, policy) -> list[float]:
    """Returns of `episodes` episodes in one env made as the training run made its envs (frame size and stack);
    `policy(obs, is_first, env)` gives the action."""
    env = da.make_env(train_args.env_id, 0, False, "", train_args)()
    returns = []
    try:
        for episode in range(episodes):
            obs, _ = env.reset(seed=seed * 100_003 + episode)
            is_first, done, total = True, False, 0.0
            while not done:
                obs, reward, terminated, truncated, _ = env.step(policy(obs, is_first, env))
                total += float(reward)
                is_first, done = False, terminated or truncated
            returns.append(total)
    finally:
        env.close()
    return returns


def trained_policy(checkpoint: str, train_args: da.Args):
    """The trained agent acting as it acts in training: `Player.act`, actions sampled from the policy."""
    state = da.load_checkpoint(checkpoint)  # checked against its checksum and its archive's CRC-32s first
    side = train_args.image_size
    agent = da.build_agent(train_args, (train_args.frame_stack, side, side), 3, "cpu")
    for name, module in agent.modules().items():
        module.load_state_dict(state["models"][name])
    player = da.Player(agent, num_envs=1)

    def policy(obs, is_first, env):
        return int(player.act(obs[None], np.array([is_first]))[0])

    return policy


def scripted_policy(obs, is_first, env):
    """Walk the paddle under the ball: the best any agent can do on Catch (every ball is reachable)."""
    catch = env.unwrapped
    return 0 if catch.paddle == catch.ball_col else (1 if catch.paddle > catch.ball_col else 2)


def episode_returns(run_dir: str) -> dict[int, float]:
    """{env step at its end: return} of every training episode, read back from the run's TensorBoard file."""
    return bench_utils.read_scalars(run_dir, ["charts/episodic_return"]).get("charts/episodic_return", {})


def reached_at(returns: dict[int, float], target: float, window: int) -> int | None:
    """The env step at which the mean return of the last `window` training episodes first reaches `target`."""
    steps = sorted(returns)
    values = np.array([returns[s] for s in steps])
    for end in range(window, len(steps) + 1):
        if values[end - window : end].mean() >= target:
            return int(steps[end - 1])
    return None


def training_curve(returns: dict[int, float], bin_steps: int) -> list[dict]:
    bins: dict[int, list[float]] = {}
    for step, value in sorted(returns.items()):
        bins.setdefault((step - 1) // bin_steps * bin_steps + bin_steps, []).append(value)
    return [
        {"env_step": step, "mean_return": float(np.mean(v)), "episodes": len(v)}
        for step, v in sorted(bins.items())
    ]


def training_args(args: Args) -> da.Args:
    """The dreamer_atari.py run the proof trains (`dreamer_atari.CATCH_ON_CPU`, which the script's preflight names
    on a CPU, is this run's learning configuration)."""
    return da.Args(
        **PROOF_ARGS,
        seed=args.seed,
        total_timesteps=args.total_timesteps,
        train_ratio=args.train_ratio,
        world_model_lr=args.world_model_lr,
        actor_lr=args.actor_lr,
        critic_lr=args.critic_lr,
        world_model_grad_clip=args.world_model_grad_clip,
        entropy_coef=args.entropy_coef,
        frame_stack=args.frame_stack,
        image_size=args.image_size,
        learning_starts=args.learning_starts,
        batch_size=args.batch_size,
        precision=args.precision,
        save_model=True,
        exp_name="learning_proof",
        log_interval=args.log_interval,
    )


def prove(args: Args) -> dict:
    threads = torch.get_num_threads()  # given back at the end: a process that goes on (a test) keeps its own
    torch.set_num_threads(args.threads)
    train_args = training_args(args)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work_dir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        cwd = os.getcwd()
        os.chdir(work)
        try:
            load_before, cpu_before = os.getloadavg(), time.process_time()
            started = time.perf_counter()
            result = da.main(train_args)
            seconds = time.perf_counter() - started
            load_after, cpu_seconds = os.getloadavg(), time.process_time() - cpu_before
            run_dir = str(work / result["run_dir"])
            returns = episode_returns(run_dir)
            curve = training_curve(returns, args.curve_bin)
            started_eval = time.perf_counter()
            policy = trained_policy(os.path.join(run_dir, "checkpoint.pt"), train_args)
            final = play(train_args, args.eval_episodes, args.seed, policy)
            rng = np.random.default_rng(args.seed)
            random_returns = play(
                train_args, args.eval_episodes, args.seed, lambda o, f, e: int(rng.integers(3))
            )
            optimal = play(train_args, args.eval_episodes, args.seed, scripted_policy)
            eval_seconds = time.perf_counter() - started_eval
        finally:
            os.chdir(cwd)
            torch.set_num_threads(threads)
    reach = reached_at(returns, args.reach_fraction * float(np.mean(optimal)), args.reach_window)
    return {
        "final_return": float(np.mean(final)),
        "optimal_return": float(np.mean(optimal)),
        "random_return": float(np.mean(random_returns)),
        "env_steps": result["global_step"],
        "updates": result["updates"],
        "behavior_updates": result["behavior_updates"],
        "seconds": seconds,
        # CPU time of this process (all its threads) while training: what the run costs, whatever else the
        # machine was doing; with one torch thread it is about the wall time of the run on an idle machine
        "cpu_seconds": cpu_seconds,
        "eval_seconds": eval_seconds,
        "eval_episodes": args.eval_episodes,
        "final_returns": final,
        "reached_at": reach,
        "reached_at_share_of_budget": None if reach is None else reach / args.total_timesteps,
        "episode_returns": [[step, value] for step, value in sorted(returns.items())],
        "curve": curve,
        # 1-minute load averages before and after training: above the core count, others' work slowed this run
        "load_average": {
            "before": [round(x, 2) for x in load_before],
            "after": [round(x, 2) for x in load_after],
        },
        "seed": args.seed,
        "config": {key: value for key, value in dataclasses.asdict(train_args).items()},
        "proof_args": dataclasses.asdict(args),
        "command": " ".join(["python", "benchmark/learning_proof.py", *sys.argv[1:]]),
        "machine": bench_utils.machine(),
    }


def summary_markdown(results: list[dict]) -> str:
    """A results table (and each run's curve) from learning_proof JSON files."""
    settings = {
        key: value
        for key, value in results[0]["proof_args"].items()
        if key not in ("json", "seed", "work_dir")
    }
    fraction, window = settings.get("reach_fraction", 0.8), settings.get("reach_window", 50)
    precision = settings.get("precision", "float32")
    if precision == "bf16":
        precision += ", its products " + (
            "emulated in float32 (bf16 operands, float32 sums, each result rounded to bf16)"
            if settings.get("bf16_products") == "emulated"
            else "on torch's bf16 kernels"
        )
    lines = [
        f"# Learning proof: dreamer_atari.py on Catch-v0, on a CPU, in {precision}",
        "",
        (
            "Each row is one `benchmark/learning_proof.py` run (its JSON file beside this one holds the "
            "configuration, the machine, every training and evaluation episode and the curve). Final return: the "
            "mean over the evaluation episodes played by the trained agent acting as it acts in training; random "
            "and optimal (a scripted paddle) are measured the same way. Reached at: the env step at which the mean "
            f"return of the last {window} training episodes first reached {fraction:g} of the optimal return "
            "(its share of the env-step budget in brackets). Target: at least 0.8 of the optimal return on every "
            "seed, reached by 70 % of the budget, in at most 200 s of training on a 2-core CPU (so that a machine "
            "1.5x slower stays within 5 minutes). Load: the 1-minute load average before / after training; above "
            "the core count, other work on the machine slowed the run and its seconds are pessimistic."
        ),
        "",
        (
            "| seed | final return | optimal | random | reached at | env steps | updates | training s | load | "
            "machine |"
        ),
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in sorted(results, key=lambda r: r["seed"]):
        m = r["machine"]
        reach = r.get("reached_at")
        reach_text = "never" if reach is None else f"{reach:,} ({reach / r['env_steps']:.0%})"
        load = r.get("load_average")
        load_text = f"{load['before'][0]:.1f} / {load['after'][0]:.1f}" if load else "-"
        lines.append(
            f"| {r['seed']} | {r['final_return']:.2f} | {r['optimal_return']:.2f} | {r['random_return']:.2f} | "
            f"{reach_text} | {r['env_steps']:,} | {r['updates']:,} | {r['seconds']:.0f} | {load_text} | "
            f"{m['cpu']}, {m['cpu_count']} cores, torch {m['torch']} |"
        )
    finals = [r["final_return"] / r["optimal_return"] for r in results]
    reached = [r.get("reached_at") for r in results]
    lines += [
        "",
        f"{len(results)} seeds: final return {min(finals):.2f} to {max(finals):.2f} of optimal (mean "
        f"{np.mean(finals):.2f}); "
        + (
            f"every seed reached {fraction:g} of optimal by env step {max(reached):,} "
            f"({max(reached) / results[0]['env_steps']:.0%} of the budget)"
            if None not in reached
            else f"{reached.count(None)} seed(s) never reached {fraction:g} of optimal in training"
        )
        + f"; training {min(r['seconds'] for r in results):.0f} to {max(r['seconds'] for r in results):.0f} s.",
    ]
    commands = "; ".join(sorted({"`" + r["command"] + "`" for r in results}))
    lines += [
        "",
        (
            f"Commands: {commands}. Settings: {json.dumps(settings)}; the model and the rest of the "
            "configuration are in each JSON file."
        ),
    ]
    lines += [
        "",
        "Training curve (mean return of the episodes in each bin of env steps):",
        "",
        "| seed | " + " | ".join(str(p["env_step"]) for p in results[0]["curve"]) + " |",
        "|---:|" + "---:|" * len(results[0]["curve"]),
    ]
    for r in sorted(results, key=lambda r: r["seed"]):
        lines.append(f"| {r['seed']} | " + " | ".join(f"{p['mean_return']:.2f}" for p in r["curve"]) + " |")
    return "\n".join(lines) + "\n"


def main(args: Args) -> dict:
    with EmulatedBF16Products() if args.bf16_products == "emulated" else contextlib.nullcontext():
        out = prove(args)  # training and evaluation
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    out["code"] = code_version()  # the commit it ran, and whether the tree differed
    Path(args.json).write_text(json.dumps(out, indent=1))
    runs = [json.loads(p.read_text()) for p in sorted(Path(args.json).parent.glob("catch_seed_*.json"))]
    if runs:  # the results folder's summary, rewritten from every run in it
        (Path(args.json).parent / "README.md").write_text(summary_markdown(runs))
    print(
        f"seed {args.seed}: final return {out['final_return']:.2f} (optimal {out['optimal_return']:.2f}, random "
        f"{out['random_return']:.2f}) after {out['env_steps']} env steps, {out['updates']} updates, "
        f"{out['seconds']:.0f} s of training; {args.reach_fraction:g} of optimal reached at env step "
        f"{out['reached_at']}"
    )
    return out


if __name__ == "__main__":
    main(tyro.cli(Args))
