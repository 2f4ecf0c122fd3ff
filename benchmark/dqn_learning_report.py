"""Seeded learning runs of dqn_starcraft_split.py on one built-in minigame -> one results file (.json, .md, .png).

    python benchmark/dqn_learning_report.py --out benchmark/results/dqn_collectmineralshards_learning \
        --command "python dqn_starcraft_split.py --map-name CollectMineralShards --time-limit-min 60 --seed N" \
        --conditions "how the runs shared the machine" --runs results/shards_s1 results/shards_s2 results/shards_s3

Every figure comes from the runs' own files ({save_path}/{run_id}/config.json, eval/curve.csv,
eval/test_results.json) and from benchmark/results/dqn_replica_calibration.json (the scripted and random agents
at the runs' res and step_mul); nothing is typed in.
"""

import argparse
import csv
import json
import os
import platform
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import dqn_starcraft_split as dqn
import memory_utils as mu
from benchmark.common import code_version
from benchmark.dqn_calibration import (
    NEIGHBOUR_WORLD_UNITS,
    CarriedClicks,
    ScriptedBeacon,
    ScriptedShardsTogether,
    class_past,
    neighbours,
)

CALIBRATION = Path(__file__).parent / "results" / "dqn_replica_calibration.json"
# What each map's runs must reach: (calibration figure, fraction of it, wall-time limit in minutes or None).
TARGETS = {
    "MoveToBeacon": ("scripted_beacon", 0.9, None),
    "CollectMineralShards": ("scripted_shards_together", 1.0, 60.0),
}
RANDOM = {"MoveToBeacon": "random_beacon", "CollectMineralShards": "random_shards"}
# The scripted agent of each target, played on the very episodes of the greedy behaviour runs: a paired
# comparison, free of the episode-to-episode spread that separate samples of episodes carry.
SCRIPTED = {"MoveToBeacon": ScriptedBeacon, "CollectMineralShards": ScriptedShardsTogether}


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def read_run(folder: Path) -> dict:
    for name in ("config.json", "eval/curve.csv", "eval/test_results.json", "checkpoint.pt"):
        if not (folder / name).is_file():
            fail(f"{folder} has no {name}; give the folders of finished runs ({{save_path}}/{{run_id}}).")
    config = json.loads((folder / "config.json").read_text())
    test = json.loads((folder / "eval" / "test_results.json").read_text())
    with open(folder / "eval" / "curve.csv", newline="") as f:
        curve = [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]
    return {
        "run_id": config["run_id"],
        "seed": config["seed"],
        "episode_steps": config["episode_steps"],
        # where the run wrote its files is this machine's business, not the result's
        "args": {k: v for k, v in config["args"].items() if k not in ("save_path", "log_dir", "resume")},
        "python": config["python"],
        "torch": config["torch"],
        "greedy_test": {k: test[k] for k in ("num_test_episodes", "mean", "std", "min", "max", "scores")},
        "episodes": test["episodes"],
        "global_steps": test["global_steps"],
        "stopped_by": test["stopped_by"],
        "train_wall_minutes": test["train_wall_time_s"] / 60,
        "curve": curve,
    }


def lr_schedule_words(a: dict) -> str:
    """The learning-rate schedule of a run's settings, in words."""
    if a["lr_scheduler"] == "cosine":
        return f"cosine down to {a['min_lr']:g} over {a.get('scheduler_tmax') or a['num_episodes']} episodes"
    if a["lr_scheduler"] == "step":
        return f"times {a['step_lr_gamma']:g} every {a['step_lr_step_size']} episodes"
    return "constant"


def trained_network(folder: Path) -> tuple[dqn.SplitQNetwork, dqn.Args]:
    """The online network of a run's checkpoint.pt, in eval mode, and the settings it was trained with."""
    mu.verify_checkpoint(
        folder / "checkpoint.pt"
    )  # its checksum and its archive's CRC-32s, before torch reads it
    state = torch.load(folder / "checkpoint.pt", map_location="cpu", weights_only=True)
    saved = state["args"]
    args = dqn.Args(
        **{
            k: (tuple(v) if k == "seeds" else v)
            for k, v in saved.items()
            if k in dqn.Args.__dataclass_fields__
        }
    )
    net = dqn.make_q_network(**dqn.network_settings(args))
    net.load_state_dict(state["q_network"])
    return net.eval(), args


def greedy_behaviour(folder: Path, episodes: int) -> dict:
    """What the trained network does: `episodes` greedy episodes from the run's final checkpoint on a fresh
    built-in environment (seed 20,000 + k): how often it picks each function, and where its clicks land; and the
    map's scripted agent (SCRIPTED) on the same episodes."""
    net, args = trained_network(folder)
    counts = {name: 0 for name in dqn.FUNCTIONS}
    on_target = past_target = clicks = on_nearest = switches = 0
    selects = selects_off_own = (
        0  # select_point calls, and those on a pixel without a unit of ours (they deselect)
    )
    click_distance, nearest_distance = (
        [],
        [],
    )  # world units from the selected marines to the click / the nearest pickup
    aimed_neighbours, nearest_neighbours = (
        [],
        [],
    )  # other pickups within NEIGHBOUR_WORLD_UNITS of the aimed / nearest
    scores, scripted_scores, scripted_through_scores = [], [], []
    rng = np.random.default_rng(0)
    through = (args.move_through or 0.0) * args.res / args.screen_world_units  # pixels
    for k in range(episodes):
        env = dqn.make_env(args, 20_000 + k)
        obs, done, score, scripted = env.reset(), False, 0.0, SCRIPTED[args.map_name]()
        while not done:
            obs, reward, done = env.step(*scripted.act(env, obs, rng))
            score += reward
        scripted_scores.append(score)
        if through > 0:  # the scripted agent again, its Move clicks carried on as the network's are
            env = dqn.make_env(args, 20_000 + k)
            obs, done, score = env.reset(), False, 0.0
            scripted = CarriedClicks(SCRIPTED[args.map_name](), args.move_through)
            while not done:
                obs, reward, done = env.step(*scripted.act(env, obs, rng))
                score += reward
            scripted_through_scores.append(score)
        env = dqn.make_env(args, 20_000 + k)  # the same episode again, for the network
        obs, done, score = env.reset(), False, 0.0
        heading = None  # the pickup the last click sent the marines to
        while not done:
            action = dqn.select_action(net, obs, 0.0, rng, "cpu", bool(args.select_own_only))
            function_id, point = dqn.decode_action(action, args.res)
            name = next(n for n in dqn.FUNCTIONS if dqn.FUNCTION_IDS[n] == function_id)
            counts[name] += 1
            if function_id == dqn.SELECT_POINT:
                selects += 1
                selects_off_own += int(obs["feature_screen"][0][point[1], point[0]] != dqn.SELF)
            if function_id == dqn.MOVE_SCREEN:
                x, y = point
                clicks += 1
                on_target += int(obs["feature_screen"][0][y, x] == 3)  # player_relative 3: beacon or shard
                screen = torch.as_tensor(obs["feature_screen"])[None]
                classes = dqn.preprocess_layers(screen, dqn.SCREEN_LAYERS)[:, : dqn.CLASS_CHANNELS]
                past = class_past(screen[:, dqn.SELECTED_LAYER], classes)[0, 3 - 1]  # one pixel past a pickup
                past_target += int(past[y, x] > 0)
                if env.selected.any():
                    centre = env.marines[env.selected].mean(0)
                    click = (np.array([x, y]) + 0.5) * env.world_units / args.res
                    click_distance.append(float(np.linalg.norm(click - centre)))
                    from_marines = np.linalg.norm(env.pickups - centre, axis=1)
                    nearest_distance.append(float(from_marines.min()))
                    aimed_index = np.linalg.norm(env.pickups - click, axis=1).argmin()
                    aimed = env.pickups[aimed_index].copy()
                    on_nearest += int(np.array_equal(aimed, env.pickups[from_marines.argmin()]))
                    around = neighbours(env, NEIGHBOUR_WORLD_UNITS)
                    aimed_neighbours.append(int(around[aimed_index]))
                    nearest_neighbours.append(int(around[from_marines.argmin()]))
                    still_there = heading is not None and any(np.array_equal(p, heading) for p in env.pickups)
                    switches += int(still_there and not np.array_equal(aimed, heading))
                    heading = aimed
            obs, reward, done = env.step(*dqn.game_call(action, obs, args.res, through))  # --move-through
            score += reward
        scores.append(score)
    total = sum(counts.values())
    return {
        "episodes": episodes,
        "scores": scores,
        "scripted_scores": scripted_scores,
        "scripted_through_scores": scripted_through_scores or None,
        "function_share": {n: c / total for n, c in counts.items()},
        "move_clicks_on_a_pickup": on_target / max(clicks, 1),
        "move_clicks_past_a_pickup": past_target / max(clicks, 1),
        "move_clicks_nearest_the_nearest_pickup": on_nearest / max(clicks, 1),
        "move_clicks_switching_pickup": switches / max(clicks, 1),
        "select_points_off_own_units": selects_off_own / selects if selects else None,
        "mean_click_distance": statistics.fmean(click_distance) if click_distance else None,
        "mean_nearest_pickup_distance": statistics.fmean(nearest_distance) if nearest_distance else None,
        "neighbour_world_units": NEIGHBOUR_WORLD_UNITS,
        "mean_aimed_pickup_neighbours": statistics.fmean(aimed_neighbours) if aimed_neighbours else None,
        "mean_nearest_pickup_neighbours": statistics.fmean(nearest_neighbours)
        if nearest_neighbours
        else None,
    }


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for run in report["runs"]:
        steps = [row["global_step"] for row in run["curve"]]
        ax.plot(
            steps, [row["test_score_mean"] for row in run["curve"]], lw=1, label=f"seed {run['seed']} greedy"
        )
    ax.axhline(
        report["reference_mean"],
        color="k",
        ls="--",
        label=f"{report['reference']} {report['reference_mean']:.1f}",
    )
    ax.axhline(report["random_mean"], color="grey", ls=":", label=f"random {report['random_mean']:.1f}")
    ax.set_xlabel("agent steps")
    ax.set_ylabel("episode score (5 greedy episodes)")
    ax.set_title(f"{report['map_name']} (built-in), split-head Double DQN")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def markdown(r: dict) -> str:
    L = [f"# Built-in {r['map_name']}: split-head Double DQN, {len(r['runs'])} seeds\n"]
    L.append("Command (from the repository root), once per seed:\n")
    L.append("```\n" + r["command"] + "\n```\n")
    L.append(
        f"Machine: {r['machine']['cpu_count']} CPU cores ({r['machine']['cpu']}), no GPU, Python "
        f"{r['machine']['python']}, torch {r['machine']['torch']}, one torch thread per run. "
        f"{r['conditions']}\n"
    )
    a = r["settings"]
    L.append(
        f"Settings: res {a['res']}, step_mul {a['step_mul']} ({r['episode_steps']} agent steps "
        f"an episode), lr {a['learning_rate']:g} ({lr_schedule_words(a)}), batch "
        f"{a['batch_size']}, replay {a['buffer_size']}, gamma {a['gamma']}, {a['n_step']}-step returns, "
        f"epsilon {a['start_e']:g} -> {a['end_e']:g} over {a['exploration_steps']} steps, target copy every "
        f"{a['target_network_frequency']} steps, one update every {a['train_frequency']} steps, "
        f"{a['context_layers']} context layers, the click term's distance input "
        f"{'on' if a.get('click_distance') else 'off'}, the timer input {'on' if a.get('timer_input') else 'off'}"
        f", the spatial head's coarse term {'one level per function' if a.get('coarse_level') else 'upsampled'}"
        f", a {a.get('fine_kernel', 3)}x{a.get('fine_kernel', 3)} click term at gain {a.get('fine_gain', 10):g}"
        f", select_point {'on our units only' if a.get('select_own_only') else 'anywhere'}, "
        + (
            f"Move clicks carried {a['move_through']:g} world units past the chosen pixel (`--move-through`)."
            if a.get("move_through")
            else "Move clicks where the head points."
        )
        + " Every value of every run is in the JSON (`runs[].args`).\n"
    )
    L.append("## Result\n")
    L.append(
        f"Final greedy test ({r['runs'][0]['greedy_test']['num_test_episodes']} episodes per seed, epsilon 0): "
        f"**{r['greedy_test_mean']:.2f}** mean over seeds (seed means {', '.join(f'{m:.2f}' for m in r['seed_means'])};"
        f" spread: std {r['greedy_test_seed_std']:.2f}, min {min(r['seed_means']):.2f}, max "
        f"{max(r['seed_means']):.2f}).\n"
    )
    L.append(
        f"Reference at the same settings (`dqn_replica_calibration.json`): {r['reference']} "
        f"{r['reference_mean']:.2f}, random agent {r['random_mean']:.2f}.\n"
    )
    limit = f" within {r['time_limit_minutes']:g} minutes" if r["time_limit_minutes"] else ""
    wall = [run["train_wall_minutes"] for run in r["runs"]]
    L.append(
        f"Target: {r['target']}{limit}. Verdict: **{'reached' if r['target_reached'] else 'not reached'}** "
        f"(training wall time per seed: {', '.join(f'{m:.1f}' for m in wall)} min).\n"
    )
    L.append(
        "| seed | episodes | agent steps | training min | greedy test mean | std | min | max | "
        "best periodic test |"
    )
    L.append("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for run in r["runs"]:
        t = run["greedy_test"]
        best = max(run["curve"], key=lambda row: row["test_score_mean"])
        L.append(
            f"| {run['seed']} | {run['episodes']} | {run['global_steps']} | {run['train_wall_minutes']:.1f} | "
            f"{t['mean']:.2f} | {t['std']:.2f} | {t['min']:g} | {t['max']:g} | "
            f"{best['test_score_mean']:.2f} (step {int(best['global_step'])}) |"
        )
    L.append("")
    L.append(
        f"What the trained networks do ({r['runs'][0]['greedy_behaviour']['episodes']} greedy episodes per seed "
        "from the final checkpoint, on fresh episodes): share of each function among the agent's steps, and "
        "the share of Move_screen clicks that land on a pixel of a beacon or shard, and on a pixel one pixel past "
        "one, on the line from the selected marines (the pixels `class_past` of dqn_calibration.py marks), and how far (world units) "
        "the click is from the selected marines' centre against how far the nearest pickup was; the share of "
        "clicks aimed at (nearest to) the pickup nearest to the selected marines, and the share that aim at "
        "another pickup while the one the last click aimed at is still there (switching targets); how many "
        f"other pickups lie within {NEIGHBOUR_WORLD_UNITS:g} world units of the aimed pickup and of the nearest "
        "one (`dqn_replica_calibration.md` gives what a pull toward such clusters costs a scripted agent); the "
        "share of select_point calls on a pixel with no unit of ours, which deselect everything.\n"
    )
    L.append(
        "| seed | score | " + " | ".join(dqn.FUNCTIONS) + " | Move clicks on a pickup | one pixel past one | "
        "click distance | "
        "nearest pickup distance | aimed at the nearest | switching | aimed's neighbours | nearest's neighbours | "
        "select_point off our units |"
    )
    L.append("|---:|---:|" + "---:|" * (len(dqn.FUNCTIONS) + 9))
    for run in r["runs"]:
        b = run["greedy_behaviour"]
        L.append(
            f"| {run['seed']} | {statistics.fmean(b['scores']):.1f} | "
            + " | ".join(f"{b['function_share'][n]:.0%}" for n in dqn.FUNCTIONS)
            + f" | {b['move_clicks_on_a_pickup']:.0%} | "
            + ("-" if b.get("move_clicks_past_a_pickup") is None else f"{b['move_clicks_past_a_pickup']:.0%}")
            + f" | {b['mean_click_distance'] or 0:.2f} | "
            f"{b['mean_nearest_pickup_distance'] or 0:.2f} | "
            f"{b['move_clicks_nearest_the_nearest_pickup']:.0%} | {b['move_clicks_switching_pickup']:.0%} | "
            f"{b['mean_aimed_pickup_neighbours'] or 0:.2f} | {b['mean_nearest_pickup_neighbours'] or 0:.2f} | "
            + ("-" if b["select_points_off_own_units"] is None else f"{b['select_points_off_own_units']:.0%}")
            + " |"
        )
    L.append("")
    L.append(paired_comparison(r))
    L.append(
        f"Curves: `{r['png']}` and, every row, in the JSON (`runs[].curve`: every "
        f"{a['eval_every_episodes']} episodes the mean epsilon-greedy training score of those episodes and "
        f"the mean of {a['num_eval_episodes']} greedy test episodes).\n"
    )
    L.append(
        "| agent steps | " + " | ".join(f"seed {run['seed']} greedy (train)" for run in r["runs"]) + " |"
    )
    L.append("|---:|" + "---:|" * len(r["runs"]))
    longest = max(r["runs"], key=lambda run: len(run["curve"]))
    stride = max(1, len(longest["curve"]) // 20)
    for k in range(stride - 1, len(longest["curve"]), stride):
        cells = []
        for run in r["runs"]:
            row = run["curve"][k] if k < len(run["curve"]) else None
            cells.append(f"{row['test_score_mean']:.1f} ({row['train_score_mean']:.1f})" if row else "")
        L.append(f"| {int(longest['curve'][k]['global_step'])} | " + " | ".join(cells) + " |")
    L.append("")
    L.append(
        "What a replica score can be compared with: other runs on the replica, and the scripted and random "
        "agents above, measured on the same replica at the same settings. It is not a StarCraft II score: "
        "the replica follows the real maps' spawn rules, timer, marine speed and screen scale, but has no "
        "unit collisions or formations, an assumed shard pickup radius and only four functions, so the SC2LE "
        "paper's figures (FullyConv 26 on MoveToBeacon, 103 on CollectMineralShards, at 64 px and step_mul 8 "
        "after hundreds of millions of steps) are for scale only.\n"
    )
    return "\n".join(L)


def paired(pairs: list[tuple[float, float]]) -> dict:
    """(network, scripted) scores of the same episodes -> their means, the mean difference and its standard error."""
    differences = [net - scripted for net, scripted in pairs]
    return {
        "episodes": len(pairs),
        "network_mean": statistics.fmean(n for n, _ in pairs),
        "scripted_mean": statistics.fmean(s for _, s in pairs),
        "difference": statistics.fmean(differences),
        "standard_error": statistics.stdev(differences) / len(pairs) ** 0.5 if len(pairs) > 1 else None,
    }


def paired_over_seeds(runs: list[dict]) -> dict:
    """Every seed plays the same episodes: each episode's network score is the mean over the seeds, so that the
    standard error counts episodes, not seeds times episodes."""
    behaviours = [run["greedy_behaviour"] for run in runs]
    scripted = behaviours[0]["scripted_scores"]
    if any(b["scripted_scores"] != scripted for b in behaviours):
        fail("the runs' behaviour episodes differ; run them with the same --behaviour-episodes.")
    return paired(
        [(statistics.fmean(b["scores"][k] for b in behaviours), scripted[k]) for k in range(len(scripted))]
    )


def paired_comparison(r: dict) -> str:
    """The networks against the map's scripted agent on the same greedy behaviour episodes, per seed and over all
    seeds' episodes."""
    L = [
        f"The same greedy episodes played by the scripted agent of the target (`{SCRIPTED[r['map_name']].__name__}`"
        " of `benchmark/dqn_calibration.py`), episode for episode: the network's score minus the scripted agent's, "
        "with the standard error of that mean difference. Every seed plays the same episodes; in the last row each "
        "episode's network score is the mean over the seeds, and the standard error counts episodes.\n",
        "| seed | episodes | network | scripted | difference | standard error |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    rows = [(str(run["seed"]), run["greedy_behaviour"]["paired"]) for run in r["runs"]]
    for label, p in rows + [("all", r["paired_with_scripted"])]:
        error = "-" if p["standard_error"] is None else f"{p['standard_error']:.2f}"
        L.append(
            f"| {label} | {p['episodes']} | {p['network_mean']:.2f} | {p['scripted_mean']:.2f} | "
            f"{p['difference']:+.2f} | {error} |"
        )
    through = r["runs"][0]["greedy_behaviour"].get("scripted_through_scores")
    if through:
        L.append(
            f"\nThe same scripted agent with its Move clicks carried past the shard as the networks' are "
            f"(`--move-through {r['runs'][0]['args']['move_through']:g}`) scores "
            f"{statistics.fmean(through):.2f} on these episodes: what the carried click alone is worth."
        )
    return "\n".join(L) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="+", required=True, help="the runs' folders, {save_path}/{run_id}")
    parser.add_argument("--out", required=True, help="path without extension; writes .json, .md and .png")
    parser.add_argument("--command", required=True, help="the command each run used")
    parser.add_argument("--conditions", default="", help="how the runs shared the machine, in words")
    parser.add_argument(
        "--behaviour-episodes",
        type=int,
        default=30,
        help="greedy episodes per run, from its final checkpoint, to describe what it does",
    )
    cli = parser.parse_args()
    torch.set_num_threads(1)
    runs = [read_run(Path(folder)) for folder in cli.runs]
    for run, folder in zip(runs, cli.runs):
        run["greedy_behaviour"] = greedy_behaviour(Path(folder), cli.behaviour_episodes)
        behaviour = run["greedy_behaviour"]
        behaviour["paired"] = paired(list(zip(behaviour["scores"], behaviour["scripted_scores"])))
    maps = {run["args"]["map_name"] for run in runs}
    settings = {(run["args"]["res"], run["args"]["step_mul"]) for run in runs}
    if len(maps) != 1 or len(settings) != 1:
        fail(
            f"the runs must share one map and one res/step_mul, got maps {sorted(maps)} and {sorted(settings)}."
        )
    (map_name,), ((res, step_mul),) = maps, settings
    if map_name not in TARGETS:
        fail(f"no target is defined for map {map_name!r}; use one of {', '.join(TARGETS)}.")
    calibration = json.loads(CALIBRATION.read_text())
    names = [k for k, v in calibration["settings"].items() if (v["res"], v["step_mul"]) == (res, step_mul)]
    if not names:
        fail(f"dqn_replica_calibration.json has no figures at res {res}, step_mul {step_mul}.")
    figures = calibration["results"][names[0]]
    reference, fraction, limit = TARGETS[map_name]
    seed_means = [run["greedy_test"]["mean"] for run in runs]
    mean = statistics.fmean(seed_means)
    reference_mean = figures[reference]["mean"]
    in_time = limit is None or all(
        run["train_wall_minutes"] <= limit + 1.0 for run in runs
    )  # + the last episode
    out = Path(cli.out)
    report = {
        "map_name": map_name,
        "command": cli.command,
        "conditions": cli.conditions,
        "machine": {
            "cpu": cpu_name(),
            "cpu_count": os.cpu_count(),
            "python": runs[0]["python"],
            "torch": runs[0]["torch"],
            "platform": platform.platform(terse=True),
        },
        "settings": {
            k: v for k, v in runs[0]["args"].items() if k not in ("seed", "run_id", "save_path", "log_dir")
        },
        "episode_steps": runs[0]["episode_steps"],
        "greedy_test_mean": mean,
        "greedy_test_seed_std": statistics.pstdev(seed_means),
        "seed_means": seed_means,
        "wall_minutes": max(run["train_wall_minutes"] for run in runs),
        "reference": reference,
        "reference_mean": reference_mean,
        "random_mean": figures[RANDOM[map_name]]["mean"],
        "target": (
            f"greedy_test_mean above {reference} ({reference_mean:.2f})"
            if fraction == 1.0
            else f"greedy_test_mean >= {fraction:.0%} of {reference} ({fraction * reference_mean:.2f})"
        ),
        "time_limit_minutes": limit,
        "target_reached": bool(
            (mean > reference_mean if fraction == 1.0 else mean >= fraction * reference_mean) and in_time
        ),
        "paired_with_scripted": paired_over_seeds(runs),
        "png": out.name + ".png",
        "runs": runs,
    }
    if map_name == "CollectMineralShards":
        report["scripted_together_mean"] = reference_mean
        report["scripted_split_mean"] = figures["scripted_shards_split"]["mean"]
    else:
        report["scripted_beacon_mean"] = reference_mean
    out.parent.mkdir(parents=True, exist_ok=True)
    report["code"] = code_version()  # the commit it ran, and whether the tree differed
    out.with_suffix(".json").write_text(json.dumps(report, indent=1))
    plot(report, out.with_suffix(".png"))
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report).split("## Result")[1][:1200])


if __name__ == "__main__":
    main()
