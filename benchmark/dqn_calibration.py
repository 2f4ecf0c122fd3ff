"""Calibration of the built-in StarCraft II minigames of dqn_starcraft_split.py: scripted and random agents.

    python benchmark/dqn_calibration.py --out benchmark/results/dqn_replica_calibration [--episodes 30]

At the SC2LE paper's settings (64 x 64 screen, step_mul 8) it plays, on the replica's MoveToBeacon, a scripted
agent that clicks on the beacon and the random agent of the DQN's exploration; on the replica's
CollectMineralShards the random agent, a scripted agent that moves both marines together to the shard nearest
to them, and one that splits them (select_point on one marine, Move_screen to the shard nearest to it that
the other marine is not heading for). The same agents are also played at the DQN's defaults (32 x 32,
step_mul 16), with two variants of the together agent that show what the choice of shard is worth: one that
aims at the second-nearest shard with a given probability, one that clicks past the nearest shard, one that
prefers shards with other shards near them, and two that click where the DQN's one-pixel click term would with
hand-set weights over its inputs (the distance input; `class_past`, the pixel one past a shard). Writes
`{out}.json` (machine, command, configuration, every episode's score) and `{out}.md`.

The scripted agents read unit positions from the game state, as pysc2's `feature_units` would give them; they
act only through the functions the DQN has (no_op, select_army, select_point, Move_screen).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np
import torch

import dqn_starcraft_split as dqn
from benchmark import bench_utils
from benchmark.common import code_version

NO_OP, SELECT_ARMY = dqn.FUNCTION_IDS["no_op"], dqn.FUNCTION_IDS["select_army"]
MOVE, SELECT_POINT = dqn.MOVE_SCREEN, dqn.SELECT_POINT

# Reference scores on the real maps (SC2LE paper, Vinyals et al. 2017, table of mini-game results): mean
# episode scores of the random policy and of the StarCraft grandmaster, and FullyConv's best mean.
PAPER = {
    "MoveToBeacon": {"random_policy": 1, "grandmaster": 28, "fullyconv": 26},
    "CollectMineralShards": {"random_policy": 17, "grandmaster": 177, "fullyconv": 103},
}
SETTINGS = {"paper": {"res": 64, "step_mul": 8}, "dqn_defaults": {"res": 32, "step_mul": 16}}


def pixel(env: dqn.BuiltinMiniGame, position: np.ndarray) -> tuple[int, int]:
    """The screen pixel (x, y) that holds a position in screen units (the marine is drawn on it)."""
    x, y = np.clip((np.asarray(position) * env.res / env.world_units).astype(int), 0, env.res - 1)
    return int(x), int(y)


class ScriptedBeacon:
    """Select the army once, then click on the beacon every step."""

    def act(self, env, obs, rng):
        if MOVE not in obs["available_actions"]:
            return SELECT_ARMY, None
        return MOVE, pixel(env, env.pickups[0])


class RandomAgent:
    """The DQN's exploration at epsilon 1: a function uniformly among the available ones, then a point."""

    def __init__(self, res: int):
        self.net = dqn.SplitQNetwork(res)  # not evaluated at epsilon 1; select_action reads its res

    def act(self, env, obs, rng):
        return dqn.decode_action(dqn.select_action(self.net, obs, 1.0, rng, "cpu"), env.res)


def shards_by_distance(env: dqn.BuiltinMiniGame) -> np.ndarray:
    """The shards, nearest to the marines' mean position first: (P, 2) screen units."""
    return env.pickups[np.argsort(np.linalg.norm(env.pickups - env.marines.mean(0), axis=1))]


class ScriptedShardsTogether:
    """Select the army once, then send both marines to the shard nearest to their mean position, every step."""

    def act(self, env, obs, rng):
        if MOVE not in obs["available_actions"] or not env.selected.all():
            return SELECT_ARMY, None
        return MOVE, pixel(env, shards_by_distance(env)[0])


class ScriptedShardsMissing:
    """The together agent, except that at each step, with probability `miss`, it sends both marines to the
    shard second nearest to them: how much a learned agent's choice of shard costs."""

    def __init__(self, miss: float):
        self.miss = miss

    def act(self, env, obs, rng):
        if MOVE not in obs["available_actions"] or not env.selected.all():
            return SELECT_ARMY, None
        shards = shards_by_distance(env)
        second = len(shards) > 1 and rng.random() < self.miss
        return MOVE, pixel(env, shards[1 if second else 0])


class ScriptedShardsPast:
    """The together agent clicking `beyond` world units past the nearest shard, on the line from the marines'
    centre (kept on the screen): the marines walk through the shard instead of stopping on it."""

    def __init__(self, beyond: float):
        self.beyond = beyond

    def act(self, env, obs, rng):
        if MOVE not in obs["available_actions"] or not env.selected.all():
            return SELECT_ARMY, None
        nearest = shards_by_distance(env)[0]
        way = nearest - env.marines.mean(0)
        length = np.linalg.norm(way)
        point = nearest + (way / length * self.beyond if length > 1e-9 else 0.0)
        return MOVE, pixel(env, np.clip(point, 0.0, env.world_units))


def neighbours(env: dqn.BuiltinMiniGame, within: float) -> np.ndarray:
    """(P,) for each shard, how many other shards lie within `within` world units of it."""
    apart = np.linalg.norm(env.pickups[:, None] - env.pickups[None], axis=2)  # (P, P)
    return (apart < within).sum(1) - 1


class ScriptedShardsClustered:
    """The together agent aiming at the shard that minimises its distance from the marines minus `bonus`
    world units per other shard within NEIGHBOUR_WORLD_UNITS of it: the pull toward clusters that trained
    DQN agents show (their learning reports count the aimed shard's neighbours)."""

    def __init__(self, bonus: float):
        self.bonus = bonus

    def act(self, env, obs, rng):
        if MOVE not in obs["available_actions"] or not env.selected.all():
            return SELECT_ARMY, None
        distance = np.linalg.norm(env.pickups - env.marines.mean(0), axis=1)
        pull = self.bonus * neighbours(env, NEIGHBOUR_WORLD_UNITS)
        return MOVE, pixel(env, env.pickups[np.argmin(distance - pull)])


def class_past(selected: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
    """`selected` (B, H, W) integer layer, `classes` (B, K, H, W) one-hot -> (B, K-1, H, W): for each class but
    the background, 1 at each pixel that lies one pixel beyond one of its unselected pixels, on the straight line
    from the centre of the selected pixels through that pixel (a click there walks the selection through it);
    zero if none is selected."""
    B, K, H, W = classes.shape
    centre_y, centre_x, any_selected = dqn.selection_centre(selected)
    ys = torch.arange(H, dtype=torch.float32, device=selected.device)[None, :, None]
    xs = torch.arange(W, dtype=torch.float32, device=selected.device)[None, None, :]
    dy, dx = ys - centre_y[:, None, None], xs - centre_x[:, None, None]  # (B, H, W): away from the centre
    length = torch.sqrt(dy * dy + dx * dx).clamp(min=1e-6)
    past_y = (
        (ys + 0.5 + dy / length).floor().clamp(0, H - 1).long()
    )  # the pixel holding the point one pixel on
    past_x = (xs + 0.5 + dx / length).floor().clamp(0, W - 1).long()
    index = (past_y * W + past_x).flatten(1)[:, None].expand(-1, K - 1, -1)  # (B, K-1, HW)
    units = (classes[:, 1:] * (selected[:, None] == 0)).flatten(2)  # (B, K-1, HW)
    past = torch.zeros_like(units).scatter_add_(2, index, units).clamp(max=1)
    return past.view(B, K - 1, H, W) * any_selected[:, None, None, None]


class ScriptedClickTerm:
    """The together agent clicking where the DQN's one-pixel click term would with weights set by hand, over the
    network's own inputs: 2 on the target channel and -1 on every class's distance input, so that the value of a
    pixel is highest on the nearest target pixel. The target channel is the shard class (the nearest shard pixel)
    or, with `past`, the shard channel of `class_past` (the pixel one pixel past a shard on the line from the
    selected marines): what those inputs let a greedy click express."""

    def __init__(self, past: bool):
        self.past = past

    def act(self, env, obs, rng):
        if MOVE not in obs["available_actions"] or not env.selected.all():
            return SELECT_ARMY, None
        screen = torch.as_tensor(obs["feature_screen"])[None]
        selected = screen[:, dqn.SELECTED_LAYER]
        classes = dqn.preprocess_layers(screen, dqn.SCREEN_LAYERS)[:, : dqn.CLASS_CHANNELS]
        neutral = 3  # player_relative of shards
        target = class_past(selected, classes)[0, neutral - 1] if self.past else classes[0, neutral]
        value = 2 * target - dqn.class_distance(selected, classes)[0].sum(0)  # distances are below 1.5 widths
        y, x = divmod(int(value.flatten().argmax()), env.res)
        return MOVE, (x, y)


class CarriedClicks:
    """Another agent whose Move clicks reach the game as the DQN's do with `--move-through` (dqn.game_call):
    carried `world_units` past the pixel the agent chose, on the line from the centre of the selected pixels."""

    def __init__(self, agent, world_units: float):
        self.agent, self.world_units = agent, world_units

    def act(self, env, obs, rng):
        index = dqn.encode_action(*self.agent.act(env, obs, rng), env.res)
        return dqn.game_call(index, obs, env.res, self.world_units * env.res / env.world_units)


# The variants played at each setting: probabilities of aiming at the second-nearest shard, how far past the
# nearest shard to click (world units), and the clustered agent's bonus per neighbour (world units) within
# NEIGHBOUR_WORLD_UNITS
MISSES = (0.1, 0.3, 0.5)
PAST_WORLD_UNITS = 3.0
THROUGH_WORLD_UNITS = dqn.MAP_DEFAULTS["CollectMineralShards"]["move_through"]
CLUSTER_BONUSES = (1.0, 2.0)
NEIGHBOUR_WORLD_UNITS = 4.0


class ScriptedShardsSplit:
    """Each marine walks its own nearest-shard tour: when a marine's shard is gone, pick the shard nearest to it
    that the other marine is not heading to, select that marine alone (select_point on its pixel) and move it."""

    def act(self, env, obs, rng):
        marines = range(len(env.marines))
        if env.steps == 0:
            self.targets, self.ordered = [None for _ in marines], [False for _ in marines]
        for i in marines:
            if self.targets[i] is not None and (np.abs(env.pickups - self.targets[i]).sum(1) < 1e-9).any():
                continue  # its shard is still there: it keeps walking
            others = [t for k, t in enumerate(self.targets) if k != i and t is not None]
            free = [p for p in env.pickups if all(np.abs(p - t).sum() > 1e-9 for t in others)]
            candidates = np.array(free) if free else env.pickups
            self.targets[i] = candidates[np.linalg.norm(candidates - env.marines[i], axis=1).argmin()].copy()
            self.ordered[i] = False
        for i in marines:
            if not self.ordered[i]:
                if env.selected.tolist() == [k == i for k in marines]:
                    self.ordered[i] = True
                    return MOVE, pixel(env, self.targets[i])
                return SELECT_POINT, pixel(env, env.marines[i])
        return NO_OP, None


def play(agent, map_name: str, res: int, step_mul: int, episodes: int, seed: int) -> list[float]:
    """Scores of `episodes` consecutive episodes of one environment (seeded once) and one agent."""
    env = dqn.BuiltinMiniGame(map_name, res, step_mul, seed)
    rng = np.random.default_rng(seed)
    scores = []
    for _ in range(episodes):
        obs, done, score = env.reset(), False, 0.0
        while not done:
            obs, reward, done = env.step(*agent.act(env, obs, rng))
            score += reward
        scores.append(score)
    return scores


def summary(scores: list[float]) -> dict:
    return {
        "mean": statistics.fmean(scores),
        "std": statistics.pstdev(scores),
        "min": min(scores),
        "max": max(scores),
        "episodes": len(scores),
        "scores": scores,
    }


def measure(res: int, step_mul: int, episodes: int, seed: int) -> dict:
    return {
        "scripted_beacon": summary(play(ScriptedBeacon(), "MoveToBeacon", res, step_mul, episodes, seed)),
        "random_beacon": summary(play(RandomAgent(res), "MoveToBeacon", res, step_mul, episodes, seed)),
        "random_shards": summary(
            play(RandomAgent(res), "CollectMineralShards", res, step_mul, episodes, seed)
        ),
        "scripted_shards_together": summary(
            play(ScriptedShardsTogether(), "CollectMineralShards", res, step_mul, episodes, seed)
        ),
        "scripted_shards_split": summary(
            play(ScriptedShardsSplit(), "CollectMineralShards", res, step_mul, episodes, seed)
        ),
        **{
            f"scripted_shards_together_miss_{miss:g}": summary(
                play(ScriptedShardsMissing(miss), "CollectMineralShards", res, step_mul, episodes, seed)
            )
            for miss in MISSES
        },
        "scripted_shards_together_past": summary(
            play(ScriptedShardsPast(PAST_WORLD_UNITS), "CollectMineralShards", res, step_mul, episodes, seed)
        ),
        **{
            f"scripted_shards_together_cluster_{bonus:g}": summary(
                play(ScriptedShardsClustered(bonus), "CollectMineralShards", res, step_mul, episodes, seed)
            )
            for bonus in CLUSTER_BONUSES
        },
        **{
            f"scripted_shards_click_term_{name}": summary(
                play(ScriptedClickTerm(past), "CollectMineralShards", res, step_mul, episodes, seed)
            )
            for name, past in (("distance", False), ("past", True))
        },
        "scripted_shards_together_through": summary(
            play(
                CarriedClicks(ScriptedShardsTogether(), THROUGH_WORLD_UNITS),
                "CollectMineralShards",
                res,
                step_mul,
                episodes,
                seed,
            )
        ),
        "scripted_shards_click_term_distance_through": summary(
            play(
                CarriedClicks(ScriptedClickTerm(False), THROUGH_WORLD_UNITS),
                "CollectMineralShards",
                res,
                step_mul,
                episodes,
                seed,
            )
        ),
    }


def configuration() -> dict:
    """The replica's constants that the figures depend on (each with its source in dqn_starcraft_split.py)."""
    names = [
        "GAME_LOOPS_PER_SECOND",
        "EPISODE_SECONDS",
        "MARINE_SPEED_PER_LOOP",
        "MARINE_RADIUS",
        "PLAYABLE_WORLD",
        "CAMERA_CENTRE_WORLD",
        "BEACON_SPAWN_WORLD",
        "BEACON_SPAWN_HOLE_WORLD",
        "BEACON_MIN_DISTANCE",
        "BEACON_RADIUS",
        "SHARD_SPAWN_WORLD",
        "SHARD_MIN_DISTANCE",
        "SHARD_RADIUS",
        "NUM_SHARDS",
        "FUNCTIONS",
    ]
    return {"screen_world_units": dqn.Args.screen_world_units, **{name: getattr(dqn, name) for name in names}}


def write_markdown(path: Path, report: dict) -> None:
    r = report["results"]["paper"]
    d = report["results"]["dqn_defaults"]
    m = report["machine"]

    def line(key: str, res: dict) -> str:
        s = res[key]
        return f"{s['mean']:.2f} (std {s['std']:.2f}, min {s['min']:g}, max {s['max']:g})"

    rows = [
        ("MoveToBeacon", "scripted: click on the beacon", "scripted_beacon", "grandmaster 28"),
        ("MoveToBeacon", "random", "random_beacon", "random policy 1"),
        ("CollectMineralShards", "random", "random_shards", "random policy 17"),
        (
            "CollectMineralShards",
            "scripted: both marines together (select_army)",
            "scripted_shards_together",
            "FullyConv 103",
        ),
        (
            "CollectMineralShards",
            "scripted: marines split (select_point)",
            "scripted_shards_split",
            "grandmaster 177",
        ),
    ]
    text = [
        "# Built-in minigames of dqn_starcraft_split.py: scripted and random agents\n",
        "Command (from the repository root):\n",
        f"```\n{report['command']}\n```\n",
        f"Machine: {m['cpu']}, {m['cpu_count']} cores, Python {m['python']}, torch {m['torch']}, "
        f"{m['platform']}. Written in {report['wall_time_s']:.0f} s.\n",
        f"Each figure is the mean score of {report['episodes']} consecutive episodes of one environment (seed "
        f"{report['seed']}); every episode's score is in `dqn_replica_calibration.json`, with the replica's "
        "constants (`configuration`). Scripted agents read unit positions from the game state (as pysc2's "
        "feature_units give them) and act only through no_op, select_army, select_point and Move_screen; the "
        "random agent is the DQN's exploration at epsilon 1 (a function uniformly among the available ones, "
        "then a point uniformly).\n",
        "## At the SC2LE paper's settings: 64 x 64 screen, step_mul 8 (240 agent steps an episode)\n",
        "| map | agent | key | mean score | real map (SC2LE paper) |",
        "|---|---|---|---|---|",
        *[f"| {mp} | {agent} | `{key}_mean` | {line(key, r)} | {ref} |" for mp, agent, key, ref in rows],
        "",
        "## At the DQN's defaults: 32 x 32 screen, step_mul 16 (120 agent steps an episode)\n",
        "| map | agent | mean score |",
        "|---|---|---|",
        *[f"| {mp} | {agent} | {line(key, d)} |" for mp, agent, key, _ in rows],
        "",
        "What these can be compared with: the replica's spawn rules, timer, marine speed and screen scale are the "
        "real maps' (sources in the constants' comments), but it has no unit collisions, no formations, no "
        "acceleration or turning, and the shard pickup radius is assumed; the paper's agents also had every "
        "pysc2 function, not four. A replica score is a score on the replica: it says whether an agent learns "
        "the task, and the scripted agents show what simple policies reach on it. It is not a measurement on "
        "StarCraft II, and the paper's numbers are quoted for scale only.\n",
    ]
    text += [
        "## What the choice of shard costs, at the DQN's defaults\n",
        "The together agent above, changed in one thing, to show what the choice of shard is worth (the DQN "
        "learning reports give the share of a trained agent's clicks aimed at the shard nearest to the "
        "marines).\n",
        "| agent | key | mean score |",
        "|---|---|---|",
        *[
            f"| together, aiming at the second-nearest shard with probability {miss:g} at each step | "
            f"`scripted_shards_together_miss_{miss:g}` | {line(f'scripted_shards_together_miss_{miss:g}', d)} |"
            for miss in MISSES
        ],
        f"| together, clicking {PAST_WORLD_UNITS:g} world units past the nearest shard (walks through it) | "
        f"`scripted_shards_together_past` | {line('scripted_shards_together_past', d)} |",
        *[
            f"| together, aiming at the shard whose distance (world units) minus {bonus:g} x its neighbours (other "
            f"shards within {NEIGHBOUR_WORLD_UNITS:g} world units of it) is least: drawn to clusters | "
            f"`scripted_shards_together_cluster_{bonus:g}` | "
            f"{line(f'scripted_shards_together_cluster_{bonus:g}', d)} |"
            for bonus in CLUSTER_BONUSES
        ],
        "| together, clicking where the DQN's one-pixel click term would with hand-set weights on the distance "
        "input: the nearest shard pixel, from what the screen shows | `scripted_shards_click_term_distance` | "
        f"{line('scripted_shards_click_term_distance', d)} |",
        "| the same with the past input: the nearest pixel one pixel past a shard, on the line from the selected "
        "marines (`class_past`) | `scripted_shards_click_term_past` | "
        f"{line('scripted_shards_click_term_past', d)} |",
        f"| together, its clicks sent as the DQN sends its own on this map: carried {THROUGH_WORLD_UNITS:g} world "
        "units past the nearest shard's pixel, on the line from the selected marines (`--move-through`) | "
        f"`scripted_shards_together_through` | {line('scripted_shards_together_through', d)} |",
        "| the click-term agent on the distance input, its clicks carried the same way | "
        f"`scripted_shards_click_term_distance_through` | {line('scripted_shards_click_term_distance_through', d)} |",
        "",
    ]
    split, together = d["scripted_shards_split"]["mean"], d["scripted_shards_together"]["mean"]
    if split < together:
        text.append(
            f"At step_mul 16 the split agent ({split:.2f}) scores below the together agent ({together:.2f}): "
            "each select_point costs an agent step of 16 game loops, twice the paper's.\n"
        )
    path.write_text("\n".join(text))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="path without extension; .json and .md are written")
    parser.add_argument(
        "--episodes", type=int, default=30, help="episodes per agent and setting (at least 20)"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the environments and the random agents")
    args = parser.parse_args()
    if args.episodes < 20:
        print(f"error: --episodes must be at least 20, got {args.episodes}.", file=sys.stderr)
        return 2
    out = Path(args.out)
    if not out.parent.is_dir():
        print(f"error: --out {args.out!r}: its folder does not exist.", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    start = time.perf_counter()
    results = {
        name: measure(s["res"], s["step_mul"], args.episodes, args.seed) for name, s in SETTINGS.items()
    }
    paper = results["paper"]
    report = {
        **{f"{key}_mean": value["mean"] for key, value in paper.items()},
        "command": " ".join(["python", "benchmark/dqn_calibration.py", *sys.argv[1:]]),
        "machine": bench_utils.machine(),
        "episodes": args.episodes,
        "seed": args.seed,
        "settings": SETTINGS,
        "configuration": configuration(),
        "paper_real_maps": PAPER,
        "results": results,
        "python": platform.python_version(),
        "wall_time_s": time.perf_counter() - start,
    }
    report["code"] = code_version()  # the commit it ran, and whether the tree differed
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    write_markdown(out.with_suffix(".md"), report)
    for key in paper:
        print(
            f"{key}_mean = {paper[key]['mean']:.2f} (64 px, step_mul 8); {results['dqn_defaults'][key]['mean']:.2f} "
            f"(32 px, step_mul 16)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
