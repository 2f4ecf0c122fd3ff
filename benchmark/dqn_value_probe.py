"""Does a trained CollectMineralShards network value shards right? -> one results file (.json, .md).

    python benchmark/dqn_value_probe.py --out benchmark/results/dqn_collectmineralshards_value_probe \
        --runs results/shards_s1 results/shards_s2 [--pair second|past] [--episodes 4] [--every 3] [--horizon 40]

For each run's final checkpoint it plays greedy episodes on fresh built-in environments (seed 40,000 + k) and, at
every `--every`-th step where the network clicks Move_screen with marines selected, compares two clicks that the
geometry fixes, not the network: with `--pair second`, on the shard nearest to the marines and on the
second-nearest; with `--pair past`, one pixel past the nearest shard on the line from the marines (where a click
walks them through it, the pixel `--past-input` marks) and on that shard. For each pair:

- the network's Q gap, Q(first) - Q(second): Q(nearest) - Q(second-nearest), or Q(past) - Q(on the shard);
- the Monte Carlo gap: the discounted return of each first click followed by the network's greedy policy, cut
  after `--horizon` steps and finished with gamma^horizon times the network's best Q there. Both rollouts play on
  copies of the environment as it is, random generator included, so the shards that respawn are the same;
- each shard's neighbours (other shards within NEIGHBOUR_WORLD_UNITS) and whether the network aimed at the nearest.

Bias is the Q gap minus the Monte Carlo gap. Neither click is the network's pick, so a bias is not the winner's
curse of an argmax; split by which shard has more neighbours, it shows whether the network's values lean toward
clusters. Every pair is in the JSON; nothing is typed in.
"""

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import dqn_starcraft_split as dqn  # noqa: E402
from benchmark import bench_utils  # noqa: E402
from benchmark.dqn_calibration import NEIGHBOUR_WORLD_UNITS, neighbours, pixel  # noqa: E402
from benchmark.dqn_learning_report import trained_network  # noqa: E402


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def load_network(folder: Path) -> tuple[dqn.SplitQNetwork, dqn.Args]:
    if not (folder / "checkpoint.pt").is_file():
        fail(f"{folder} has no checkpoint.pt; give the folders of runs ({{save_path}}/{{run_id}}).")
    try:
        net, args = trained_network(folder)
    except Exception as exc:  # noqa: BLE001 - any unreadable checkpoint is one line, status 2
        fail(f"{folder}/checkpoint.pt is not a checkpoint of dqn_starcraft_split.py ({type(exc).__name__}: {exc}).")
    if args.map_name != "CollectMineralShards" or args.backend != "builtin":
        fail(f"{folder} is a run of {args.backend} {args.map_name}; the probe needs the built-in CollectMineralShards.")
    return net, args


def q_values(net, obs: dict) -> torch.Tensor:
    """Q of every flat action of one observation, unavailable ones at the dtype's minimum: (A,)."""
    states = dqn.to_tensors(dqn.obs_to_states(obs), "cpu")
    with torch.no_grad():
        q_ns, q_sp = net(states["screen"], states["minimap"], states["player"], states["mask"])
    return dqn.masked_q(q_ns, q_sp, states["mask"])[0]


def rollout_return(env, first: tuple[int, tuple[int, int] | None], policy, value, gamma: float, horizon: int) -> float:
    """The discounted return of `first` and then `policy(obs) -> (function, point)` on `env` (changed in place), cut
    after `horizon` steps and finished with gamma^horizon * value(obs) unless the episode ended."""
    total, discount, action = 0.0, 1.0, first
    for step in range(horizon):
        obs, reward, done = env.step(*action)
        total += discount * reward
        discount *= gamma
        if done:
            return total
        if step + 1 < horizon:  # no action is taken where the rollout is cut
            action = policy(obs)
    return total + discount * value(obs)


def past_pixel(on: tuple[int, int], selected: np.ndarray) -> tuple[int, int]:
    """The pixel one pixel beyond pixel `on` (x, y) on the line from the centre of the `selected` layer's (H, W)
    pixels: the one the past input (`dqn.class_past`) marks for a lone unit at `on`, taken from that function so
    the probe clicks exactly where the input points."""
    lone = torch.zeros(1, 2, *selected.shape)  # (B, K, H, W) one-hot: background, and a unit at `on`
    lone[0, 1, on[1], on[0]] = 1.0
    (y, x), = torch.nonzero(dqn.class_past(torch.as_tensor(selected)[None], lone)[0, 0]).tolist()
    return x, y


def probe(net, args: dqn.Args, episodes: int, every: int, horizon: int, pair: str = "second") -> list[dict]:
    """Every compared pair of clicks of `episodes` greedy episodes (see the module's docstring)."""
    res = args.res
    through = (args.move_through or 0.0) * res / args.screen_world_units  # --move-through, in pixels

    def policy(obs):
        return dqn.game_call(int(q_values(net, obs).argmax()), obs, res, through)

    def value(obs):
        return float(q_values(net, obs).max())

    samples = []
    for k in range(episodes):
        env = dqn.make_env(args, 40_000 + k)
        obs, done = env.reset(), False
        while not done:
            q = q_values(net, obs)
            function, point = dqn.decode_action(int(q.argmax()), res)
            if (function == dqn.MOVE_SCREEN and env.selected.any() and len(env.pickups) > 1
                    and env.steps % every == 0):
                centre = env.marines[env.selected].mean(0)
                click = (np.array(point) + 0.5) * env.world_units / res
                aimed = int(np.linalg.norm(env.pickups - click, axis=1).argmin())
                nearest, second = np.argsort(np.linalg.norm(env.pickups - centre, axis=1))[:2]
                around = neighbours(env, NEIGHBOUR_WORLD_UNITS)
                points = [pixel(env, env.pickups[i]) for i in (nearest, second)]
                if pair == "past":
                    points = [past_pixel(points[0], obs["feature_screen"][dqn.SELECTED_LAYER]), points[0]]
                qs = [float(q[dqn.encode_action(dqn.MOVE_SCREEN, p, res)]) for p in points]
                calls = [dqn.game_call(dqn.encode_action(dqn.MOVE_SCREEN, p, res), obs, res, through) for p in points]
                mc = [rollout_return(copy.deepcopy(env), call, policy, value, args.gamma, horizon) for call in calls]
                samples.append({"episode": k, "step": env.steps, "aims_at_nearest": bool(aimed == nearest),
                                "nearest_neighbours": int(around[nearest]), "second_neighbours": int(around[second]),
                                "clicks": points, "q_gap": qs[0] - qs[1], "mc_gap": mc[0] - mc[1]})
            obs, _, done = env.step(*dqn.game_call(int(q.argmax()), obs, res, through))
    return samples


# What each pair compares: (the first click, the second click), in words
PAIRS = {"second": ("the shard nearest to the marines", "the second-nearest"),
         "past": ("one pixel past the nearest shard, on the line from the marines", "that shard")}
GROUPS = {  # name: (words, which pairs); the neighbour split only for --pair second
    "all": ("all pairs", lambda s: True),
    "second_has_more_neighbours": ("the second-nearest has more neighbours",
                                   lambda s: s["second_neighbours"] > s["nearest_neighbours"]),
    "second_has_no_more_neighbours": ("the second-nearest has no more neighbours",
                                      lambda s: s["second_neighbours"] <= s["nearest_neighbours"]),
}


def summarise(samples: list[dict], pair: str = "second") -> dict:
    out = {}
    for name, (_, keep) in GROUPS.items():
        if pair != "second" and name != "all":
            continue
        group = [s for s in samples if keep(s)]
        out[name] = {"pairs": len(group)}
        if group:
            out[name].update({
                "mean_q_gap": statistics.fmean(s["q_gap"] for s in group),
                "mean_mc_gap": statistics.fmean(s["mc_gap"] for s in group),
                "share_first_really_better": statistics.fmean(s["mc_gap"] > 0 for s in group),
                "share_aimed_at_nearest": statistics.fmean(s["aims_at_nearest"] for s in group),
                "mean_bias": statistics.fmean(s["q_gap"] - s["mc_gap"] for s in group)})
    return out


def markdown(report: dict) -> str:
    first, second = PAIRS[report["pair"]]
    L = ["# Does a trained CollectMineralShards network value shards right?\n",
         "Command (from the repository root):\n", "```\n" + report["command"] + "\n```\n",
         f"Machine: {report['machine']['cpu']}, {report['machine']['cpu_count']} cores, Python "
         f"{report['machine']['python']}, torch {report['machine']['torch']}. "
         f"Written in {report['wall_time_s']:.0f} s.\n",
         f"Greedy episodes from each run's final checkpoint ({report['episodes']} per run, environment seeds 40,000 + "
         f"k); every {report['every']} agent steps, if the network clicks Move_screen there, a click on {first} "
         f"set against a click on {second}. Q gap: Q(first) - Q(second), from the "
         "network. Monte Carlo gap: the same difference of discounted returns, each click followed by the "
         f"network's greedy policy for up to {report['horizon']} steps on copies of the environment (same "
         "respawns), then the network's best Q. Bias: Q gap minus Monte Carlo gap; negative means the network "
         f"undervalues the first click. Neighbours: other shards within {report['neighbour_world_units']:g} world "
         "units. Every pair is in the JSON (`runs[].samples`).\n",
         "| run | seed | pairs | network aimed at the nearest | mean Q gap | mean Monte Carlo gap | first really "
         "better | mean bias |", "|---|---:|---|---:|---:|---:|---:|---:|"]
    for run in report["runs"]:
        for name, (words, _) in GROUPS.items():
            if name not in run["summary"]:
                continue
            s = run["summary"][name]
            if not s["pairs"]:
                L.append(f"| {run['run_id']} | {run['seed']} | {words}: 0 | | | | | |")
                continue
            L.append(f"| {run['run_id']} | {run['seed']} | {words}: {s['pairs']} | {s['share_aimed_at_nearest']:.0%} | "
                     f"{s['mean_q_gap']:+.3f} | {s['mean_mc_gap']:+.3f} | {s['share_first_really_better']:.0%} | "
                     f"{s['mean_bias']:+.3f} |")
    L.append("")
    return "\n".join(L)


def portable_command(cli: argparse.Namespace, run_ids: list[str]) -> str:
    """The command as a reader would type it: each run in the training script's default folder (results/{run_id}),
    not where this machine kept it."""
    out = Path(cli.out)
    return " ".join(["python", "benchmark/dqn_value_probe.py", "--out", f"benchmark/results/{out.name}",
                     "--pair", cli.pair, "--episodes", str(cli.episodes), "--every", str(cli.every), "--horizon", str(cli.horizon),
                     "--runs", *(f"{dqn.Args.save_path}/{run_id}" for run_id in run_ids)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", required=True, help="run folders, {save_path}/{run_id}")
    parser.add_argument("--out", required=True, help="path without extension: writes .json and .md")
    parser.add_argument("--pair", choices=sorted(PAIRS), default="second",
                        help="the two clicks compared: nearest against second-nearest shard, or past against on it")
    parser.add_argument("--episodes", type=int, default=4, help="greedy episodes per run (at least 1)")
    parser.add_argument("--every", type=int, default=3, help="probe every this many agent steps (at least 1)")
    parser.add_argument("--horizon", type=int, default=40, help="Monte Carlo steps before bootstrapping (>= 1)")
    cli = parser.parse_args()
    for name in ("episodes", "every", "horizon"):
        if getattr(cli, name) < 1:
            fail(f"--{name} must be at least 1, got {getattr(cli, name)}.")
    out = Path(cli.out)
    if not out.parent.is_dir():
        fail(f"--out {cli.out!r}: its folder does not exist.")
    torch.set_num_threads(1)
    loaded = [(Path(folder), *load_network(Path(folder))) for folder in cli.runs]  # every bad folder before any work
    start = time.perf_counter()
    runs = []
    for folder, net, args in loaded:
        samples = probe(net, args, cli.episodes, cli.every, cli.horizon, cli.pair)
        runs.append({"run_id": folder.name, "seed": args.seed, "res": args.res, "step_mul": args.step_mul,
                     "gamma": args.gamma, "past_input": args.past_input, "summary": summarise(samples, cli.pair),
                     "samples": samples})
    report = {"command": portable_command(cli, [folder.name for folder, _, _ in loaded]),
              "machine": bench_utils.machine(), "pair": cli.pair, "episodes": cli.episodes, "every": cli.every,
              "horizon": cli.horizon, "neighbour_world_units": NEIGHBOUR_WORLD_UNITS,
              "wall_time_s": time.perf_counter() - start, "runs": runs}
    out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
