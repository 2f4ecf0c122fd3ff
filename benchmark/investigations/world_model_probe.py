"""World-model probe: does a model learn to draw Pong's ball? The world model alone, trained on a fixed Pong dataset.

    python benchmark/investigations/world_model_probe.py --json benchmark/results/world_model_probe/cpu.json --minutes 30
    python benchmark/investigations/world_model_probe.py --json probe.json --device cuda --batch-size 16 --sequence-length 64 --minutes 3

1. A Pong dataset is collected once (cached in --cache-dir): a policy that follows the ball with its paddle (from
   the emulator's RAM) and acts at random a quarter of the time, so that rallies last and the ball is in play in
   most frames; the frames at both sizes the models read (64 and 84 pixels, grey) and at 64 in colour (`--rgb`),
   from three emulators in lockstep. Its last --held-out-steps steps are held out.
2. For each configuration (a set of dreamer_atari.py flags; `dreamerv3` is the script's default, `nature` its
   smaller model in grey, `dreamerv3-grey` the default in grey; CAUSE_CONFIGS the representation KL off and the image
   loss scaled, in colour and grey), the world model alone trains on the rest with the training loop's own update (`make_update_steps`:
   captured in a CUDA graph on a GPU), at --batch-size x --sequence-length, for --minutes or --updates.
3. Every --eval-every updates, on the same held-out sequences for every configuration: ball F1
   (`dreamer_atari.open_loop_ball_scores`: the model's ball pixels against the true frame's, within a pixel) with
   its precision, recall and centroid distance, on the 5 observed frames and 5 and 10 steps open loop, each F1
   beside its chance level (the model's frames against another sequence's truth); and the squared error of the
   observed frames. One JSON (every point of every curve) and a PNG of the curves.

The batch: training replays 16 x 64 = 1,024 frames per update at DreamerV3's Atari100k settings, one update per env
step. A CPU probe of 8 x 16 reconstructs 128 frames per update: eight of its updates see the frames of one
training update, so the JSON says, beside the updates, how many frames each configuration reconstructed and the
training env step that matches at one update per env step. On a GPU, --batch-size 16 --sequence-length 64 is
training's own batch.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import tyro

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
import dreamer_atari as da
from benchmark import bench_utils
from benchmark.common import code_version

ENV_ID = "ALE/Pong-v5"
# Pong's RAM: the ball's row and the player's (right) paddle's top row
RAM_BALL_Y, RAM_PLAYER_Y = 54, 51
PADDLE_HALF = 8  # screen rows from the paddle's top to its middle
NOOP, UP, DOWN = 0, 2, 3
# the configurations: dreamer_atari.Args fields over the script's defaults (empty: the default model, in colour)
CONFIGS = {
    "dreamerv3": {},
    "nature": {"model": "nature"},
    "dreamerv3-half": {"encoder_channels": (16, 32, 64, 128), "deterministic_dim": 256, "hidden_dim": 256},
    "dreamerv3-grey": {"rgb": False},
    # what keeps the ball out of the model, if colour is not enough: the price of carrying it (the representation
    # KL, off) or its pull (the image loss, scaled; 3.75 gives a grey ball the pull of a colour one)
    "dreamerv3-no-rep-kl": {"kl_rep_scale": 0.0},
    "dreamerv3-grey-no-rep-kl": {"rgb": False, "kl_rep_scale": 0.0},
    "dreamerv3-image-x4": {"image_loss_scale": 4.0},
    "dreamerv3-grey-image-x3.75": {"rgb": False, "image_loss_scale": 3.75},
}
# the cause-finding configurations, each beside the default in colour and in grey (the lease's `probe` mode)
CAUSE_CONFIGS = (
    "dreamerv3",
    "dreamerv3-grey",
    "dreamerv3-no-rep-kl",
    "dreamerv3-grey-no-rep-kl",
    "dreamerv3-image-x4",
    "dreamerv3-grey-image-x3.75",
)


@dataclasses.dataclass
class Args:
    json: str
    """where to write the results (the PNG of the curves goes beside it, same name)"""
    configs: tuple[str, ...] = ("dreamerv3", "nature")
    """configurations to train, in order (see CONFIGS)"""
    minutes: float = 30.0
    """training time per configuration (evaluations not counted)"""
    updates: int = 0
    """stop each configuration after this many updates instead (0 = by --minutes alone)"""
    batch_size: int = 8
    """sequences per update"""
    sequence_length: int = 16
    """steps per sequence"""
    eval_every: int = 100
    """updates between evaluations"""
    eval_sequences: int = 64
    """held-out sequences scored at each evaluation (of OPEN_LOOP_CONTEXT + 10 + 1 steps)"""
    dataset_steps: int = 30_000
    """agent steps of the dataset"""
    held_out_steps: int = 3_000
    """the dataset's last steps, kept for evaluation (a new episode for the model where they begin)"""
    random_share: float = 0.25
    """share of the collecting policy's actions taken at random"""
    seed: int = 1
    """seed of the dataset, the models and the sampling"""
    device: str = "cpu"
    """cpu or cuda"""
    threads: int = 2
    """torch threads on a CPU"""
    cache_dir: str = "benchmark/.work/world_model_probe"
    """where the dataset is kept between runs"""
    note: str = ""
    """what else ran on the machine meanwhile, or anything else the results need to be read right (kept in the JSON
    and the folder's README)"""


# ---------------------------------------------------------------------------------------------------------
# The dataset
# ---------------------------------------------------------------------------------------------------------
# the dataset's frames: each the same emulator steps, at a size, in grey or colour
FRAMES = {
    "frames64": {"image_size": 64, "rgb": False},
    "frames84": {"image_size": 84, "rgb": False},
    "frames64rgb": {"image_size": 64, "rgb": True},
}


def frames_key(train_args: da.Args) -> str:
    """Which of the dataset's frames a configuration trains on."""
    return f"frames{train_args.image_size}" + ("rgb" if train_args.rgb else "")


def collect(args: Args) -> dict:
    """The dataset: `frames64` and `frames84` (N, S, S) and `frames64rgb` (N, 3, 64, 64) uint8, the same emulator
    steps at both sizes and in colour, and per step `action` (the one that led to it), `reward`, `is_first`,
    `is_terminal`, as the replay stores them. Read from --cache-dir when it was collected before (with every kind of
    frames)."""
    path = Path(args.cache_dir) / f"pong_{args.dataset_steps}_seed{args.seed}_random{args.random_share}.npz"
    if path.exists():
        with np.load(path) as saved:
            data = {key: saved[key] for key in saved.files}
        if set(FRAMES) <= set(data):
            return data
    envs = {
        key: da.make_env(ENV_ID, 0, False, "", da.Args(**settings, frame_stack=1))()
        for key, settings in FRAMES.items()
    }
    rng = np.random.default_rng(args.seed)
    n = args.dataset_steps
    data = {key: np.empty((n, *env.observation_space.shape[1:]), np.uint8) for key, env in envs.items()}
    data |= {
        "action": np.zeros(n, np.uint8),
        "reward": np.zeros(n, np.float32),
        "is_first": np.zeros(n, bool),
        "is_terminal": np.zeros(n, bool),
    }
    episode, start, over = 0, True, False
    action, reward, terminated = 0, 0.0, False
    for t in range(n):
        if start:  # a new episode: its first step has no action or reward
            obs = {key: env.reset(seed=args.seed * 1000 + episode)[0] for key, env in envs.items()}
            episode, action, reward, terminated, over = episode + 1, 0, 0.0, False, False
        for key in FRAMES:
            data[key][t] = obs[key][-1]
        # as the replay stores a step: its frame, the action that led to it, the reward and flags on arriving
        data["action"][t], data["reward"][t] = action, reward
        data["is_first"][t], data["is_terminal"][t] = start, terminated
        start = over
        if over:  # the episode's last frame is stored; the next step starts a new one
            continue
        ram = envs["frames64"].unwrapped.ale.getRAM()
        ball, paddle = int(ram[RAM_BALL_Y]), int(ram[RAM_PLAYER_Y]) + PADDLE_HALF
        if rng.random() < args.random_share:
            action = int(rng.integers(6))
        elif ball and abs(ball - paddle) >= 4:  # ball 0: none in play
            action = DOWN if ball > paddle else UP
        else:
            action = NOOP
        steps = {key: env.step(action) for key, env in envs.items()}
        if len({float(step[1]) for step in steps.values()}) != 1:
            raise RuntimeError("the emulators diverged")
        _, reward, terminated, truncated, _ = steps["frames64"]
        obs = {key: step[0] for key, step in steps.items()}
        over = bool(terminated or truncated)
    for env in envs.values():
        env.close()
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path.with_suffix(".tmp.npz"), **data)
    os.replace(path.with_suffix(".tmp.npz"), path)
    return data


def split_replays(data: dict, args: Args, train_args: da.Args) -> tuple[da.EpisodeReplay, da.EpisodeReplay]:
    """The dataset at the configuration's frame size and stack, as two replays: training and held out (the last
    --held-out-steps). They sample with the training loop's own code."""
    frames, stack = data[frames_key(train_args)], train_args.frame_stack
    held_out_from = len(frames) - args.held_out_steps
    replays = []
    for begin, end in ((0, held_out_from), (held_out_from, len(frames))):
        replay = da.EpisodeReplay(end - begin, num_envs=1, seed=args.seed)
        for t in range(begin, end):
            if data["is_first"][t] or t == begin:
                replay.start_episode(0, np.repeat(frames[t][None], stack, 0))
                continue
            over = t + 1 == end or bool(data["is_first"][t + 1])
            replay.add_step(
                0,
                frames[t],
                int(data["action"][t]),
                float(data["reward"][t]),
                bool(data["is_terminal"][t]),
                over,
            )
        replays.append(replay)
    return replays[0], replays[1]


def in_play_share(frames: np.ndarray) -> float:
    return float(np.mean([da.find_balls(frame)[0].any() for frame in frames]))


# ---------------------------------------------------------------------------------------------------------
# Training and evaluation
# ---------------------------------------------------------------------------------------------------------
BALL_FIGURES = tuple(
    f"ball_{score}_{horizon}"
    for horizon in ("observed", *(f"open_loop_{k}" for k in da.OPEN_LOOP_BALL_STEPS))
    for score in ("f1", "f1_chance", "precision", "recall", "centroid_px")
)  # ball_f1_observed, ball_f1_chance_observed, ..., ball_centroid_px_open_loop_10


def evaluate(agent: da.Agent, eval_batch: dict[str, np.ndarray]) -> dict:
    """Ball scores (BALL_FIGURES, `da.open_loop_ball_scores`; None where there is nothing to count) and the observed
    frames' squared error (per pixel, on [0, 1] frames) on the held-out sequences; the latent samples from a fixed
    seed, so every evaluation draws the same noise."""
    devices = [agent.device] if agent.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(0)
        # (n, T, S, S) uint8, in grey also from a colour model: the error below is a grey frame's, as it always was
        truth, model = (da.grey_frames(frames) for frames in da.open_loop_predictions(agent, eval_batch))
    context = da.OPEN_LOOP_CONTEXT
    error = (model[:, :context].astype(np.float32) - truth[:, :context]) / 255.0
    scores = da.open_loop_ball_scores(truth, model)
    return {
        **{name: scores.get(f"world_model/{name}") for name in BALL_FIGURES},
        "observed_mse": float((error**2).mean()),
    }


def train_config(name: str, data: dict, args: Args) -> dict:
    overrides = CONFIGS[name]
    train_args = da.Args(
        **overrides,
        env_id=ENV_ID,
        seed=args.seed,
        batch_size=args.batch_size,
        sequence_length=args.sequence_length,
        cuda=args.device == "cuda",
    )
    da.check_args(train_args)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high" if train_args.tf32 else "highest")
    train, held_out = split_replays(data, args, train_args)
    stack, side = train_args.frame_stack, train_args.image_size
    obs_shape = (stack, *data[frames_key(train_args)].shape[1:])  # (stack, S, S), in colour (stack, 3, S, S)
    agent = da.build_agent(train_args, obs_shape, 6, device)
    da.speed_up_agent(agent, train_args)  # the fast paths a run trains with
    world_model_step, _ = da.make_update_steps(agent, train_args)
    eval_length = da.OPEN_LOOP_CONTEXT + max(da.OPEN_LOOP_BALL_STEPS) + 1
    eval_batch = held_out.sample(args.eval_sequences, eval_length, rng=np.random.default_rng(args.seed))
    sample_rng = np.random.default_rng(args.seed + 1)
    curve, losses = [], []  # losses: each evaluation interval's mean image loss
    train_s, updates = 0.0, 0

    def point() -> dict:
        figures = evaluate(agent, eval_batch)
        row = {
            "updates": updates,
            "train_s": round(train_s, 1),
            "frames_reconstructed": updates * args.batch_size * args.sequence_length,
            "train_image_loss": float(np.mean(losses)) if losses else None,
            **figures,
        }
        losses.clear()
        print(f"[{name}] {json.dumps(row)}", flush=True)
        return row

    curve.append(point())
    budget_s = args.minutes * 60
    while (args.updates == 0 or updates < args.updates) and train_s < budget_s:
        if device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        # summed on the device (the captured update's outputs are overwritten by the next call): one host read per
        # evaluation interval
        loss_sum, interval_updates = torch.zeros((), device=device), 0
        for _ in range(args.eval_every):
            batch = da.batch_tensors(
                train.sample(args.batch_size, args.sequence_length, rng=sample_rng), device
            )
            metrics, _, _ = world_model_step(batch)
            loss_sum = loss_sum + metrics["losses/image"]
            updates, interval_updates = updates + 1, interval_updates + 1
            if args.updates and updates >= args.updates:
                break
        losses.append(loss_sum.item() / interval_updates)
        train_s += time.perf_counter() - started
        curve.append(point())
    last = curve[-1]
    per_update = train_s / max(updates, 1)
    return {
        "name": name,
        "is_default": not overrides,
        "flags": overrides,
        "model": train_args.model,
        "image_size": side,
        "frame_stack": stack,
        "world_model_parameters": bench_utils.param_count(agent.world_model),
        "batch": [args.batch_size, args.sequence_length],
        "updates": updates,
        "train_s": round(train_s, 1),
        "ms_per_update": round(per_update * 1e3, 2),
        "frames_reconstructed": last["frames_reconstructed"],
        # at training's 16 x 64 and one update per env step, the env step whose updates reconstructed as many frames
        "matching_training_env_step": last["frames_reconstructed"] // (16 * 64),
        **{name: last[name] for name in BALL_FIGURES if name.startswith("ball_f1")},
        "observed_mse": last["observed_mse"],
        "curve": curve,
    }


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = ("ball_f1_observed", "ball_f1_open_loop_5", "observed_mse")
    titles = (
        "ball F1, observed frames (dashed: chance)",
        "ball F1, 5 steps open loop (dashed: chance)",
        "squared error per pixel, observed",
    )
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for config in result["configurations"]:
        updates = [p["updates"] for p in config["curve"]]
        for ax, key in zip(axes, keys):
            values = [np.nan if p.get(key) is None else p[key] for p in config["curve"]]
            label = config["name"] + (" (default)" if config["is_default"] else "")
            (line,) = ax.plot(updates, values, label=label)
            chance = key.replace("ball_f1_", "ball_f1_chance_")
            if chance != key:
                values = [np.nan if p.get(chance) is None else p[chance] for p in config["curve"]]
                ax.plot(updates, values, "--", color=line.get_color())
    for ax, title in zip(axes, titles):
        ax.set_title(title)
        ax.set_xlabel(f"updates (batch {result['batch'][0]} x {result['batch'][1]})")
        ax.grid(alpha=0.3)
    axes[2].set_yscale("log")
    axes[0].legend()
    fig.suptitle(f"World-model probe on Pong, {result['machine']['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def fmt(value, digits: int = 3) -> str:
    return "—" if value is None else f"{value:.{digits}g}"


def summary_markdown(results: dict[str, dict]) -> str:
    """The README of a results folder: one table row per configuration of each results file in it."""
    lines = [
        "# World-model probe: does the world model learn to draw Pong's ball?",
        "",
        "Each results file is one `benchmark/investigations/world_model_probe.py` run (its command, machine, dataset and every point "
        "of every curve are in the JSON; the PNG beside it draws the curves). The world model alone trains on a fixed "
        "Pong dataset; ball F1 says how well it draws the ball on held-out sequences "
        "(`dreamer_atari.open_loop_ball_scores`): the model's frame is searched for the ball as the true frame is, "
        "and F1 is the harmonic mean of the share of its ball pixels within a pixel of the true ball's (precision) "
        "and the share of the true ball's pixels within a pixel of its own (recall), on the 5 observed frames and 5 "
        "and 10 steps open loop; chance is the F1 of the same frames against another sequence's truth. Results "
        "files from before F1 report ball recall, the earlier measure (the share of the true ball's pixels the model "
        "drew about as bright; speckle or a bright band scored on it). Frames: the frames its updates "
        "reconstructed; training env step: the Atari100k env step whose updates (16 x 64, one per env step) "
        "reconstruct as many.",
        "",
        "| results | machine | configuration | default | batch | updates | frames | training env step | "
        "ball measure | observed | 5 open loop | 10 open loop | chance, 5 open loop | "
        "squared error per pixel, observed | ms per update |",
        "|---|---|---|---|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, result in sorted(results.items()):
        for config in result["configurations"]:
            measure = "f1" if "ball_f1_observed" in config else "recall"  # recall: files from before F1
            lines.append(
                f"| [{name}]({name}) | {result['machine']['device']} | {config['name']} | "
                f"{'yes' if config['is_default'] else ''} | {config['batch'][0]} x {config['batch'][1]} | "
                f"{config['updates']:,} | {config['frames_reconstructed']:,} | "
                f"{config['matching_training_env_step']:,} | {'F1' if measure == 'f1' else 'recall'} | "
                f"{fmt(config[f'ball_{measure}_observed'])} | {fmt(config[f'ball_{measure}_open_loop_5'])} | "
                f"{fmt(config[f'ball_{measure}_open_loop_10'])} | "
                f"{fmt(config.get('ball_f1_chance_open_loop_5'))} | "
                f"{fmt(config['observed_mse'])} | {config['ms_per_update']} |"
            )
    lines += [""] + [
        f"- `{name}`: `{result['command']}`" + (f". {result['note']}" if result.get("note") else "")
        for name, result in sorted(results.items())
    ]
    return "\n".join(lines) + "\n"


def write_summary(folder: Path) -> None:
    results = {path.name: json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))}
    (folder / "README.md").write_text(summary_markdown(results))


def main(args: Args) -> dict:
    if not 0 < args.held_out_steps < args.dataset_steps // 2:
        raise SystemExit(
            f"--held-out-steps must be between 1 and half of --dataset-steps, got {args.held_out_steps}."
        )
    unknown = [name for name in args.configs if name not in CONFIGS]
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; known: {', '.join(CONFIGS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here.")
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    data = collect(args)
    machine = bench_utils.machine()
    machine["device"] = torch.cuda.get_device_name() if args.device == "cuda" else machine.get("cpu", "cpu")
    result = {
        "what": "the world model alone trained on a fixed Pong dataset; ball F1 on held-out sequences",
        "command": "python " + " ".join(sys.argv),
        "note": args.note,
        "machine": machine,
        "torch": torch.__version__,
        "batch": [args.batch_size, args.sequence_length],
        "training_batch": [16, 64],
        "dataset": {
            "env_id": ENV_ID,
            "steps": args.dataset_steps,
            "episodes": int(data["is_first"].sum()),
            "held_out_steps": args.held_out_steps,
            "policy": f"follows the ball with the paddle (RAM), random actions {args.random_share:.0%} of the time",
            "ball_in_play_share_64": in_play_share(data["frames64"]),
            "collect_s": round(time.perf_counter() - started, 1),
        },
        "args": dataclasses.asdict(args),
        "configurations": [],
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    for name in args.configs:
        result["configurations"].append(train_config(name, data, args))
        result.setdefault("code", code_version())  # the commit it ran (once), and whether the tree differed
        out.write_text(json.dumps(result, indent=1) + "\n")
        plot(result, out.with_suffix(".png"))
        write_summary(out.parent)
    return result


if __name__ == "__main__":
    main(tyro.cli(Args))
