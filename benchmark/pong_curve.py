"""The learning curve of a dreamer_atari.py run, read back from its TensorBoard file.

    python benchmark/pong_curve.py RUN_DIR_OR_EVENT_FILE --json curve.json [--png curve.png]

At every log point: env step, wall seconds of training (summed over resumed parts), the mean return of the last 10 finished episodes,
env steps/s and updates/s over the last interval, peak GPU memory reserved and allocated, host RSS, and the
world-model and actor figures that say why a run does or does not learn (reward-prediction sign accuracy, image
loss, KL, actor entropy, imagined return, and ball F1 observed and open loop beside its chance level: does the
world model draw the ball where it is). Every episode's return is kept too. `open_loop_strip` turns a run's
open-loop GIF into a PNG strip of frames.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

DIAGNOSTICS = {
    "reward_sign_accuracy": "charts/reward_sign_accuracy",
    "image_loss_per_frame": "losses/image",  # squared error summed over a frame's pixels and channels
    "reward_loss": "losses/reward",
    "kl_loss": "losses/kl",
    "kl_nats": "debug/kl_value",  # KL(posterior || prior) in nats, before free nats and scales
    "actor_entropy": "losses/entropy",
    "imagined_return": "debug/imagined_return",
    "return_scale": "debug/return_scale",
    "ball_f1_observed": "world_model/ball_f1_observed",
    "ball_f1_open_loop_5": "world_model/ball_f1_open_loop_5",
    "ball_f1_open_loop_10": "world_model/ball_f1_open_loop_10",
    "ball_f1_chance_observed": "world_model/ball_f1_chance_observed",
    "ball_f1_chance_open_loop_5": "world_model/ball_f1_chance_open_loop_5",
}
MEMORY = {
    # what keeping the replay on disk and writing checkpoints cost the loop so far, in seconds (this invocation's)
    "replay_write_s": "debug/io/replay_write_s",
    "checkpoint_write_s": "debug/io/checkpoint_write_s",
    "peak_gpu_reserved_mb": "debug/gpu/max_reserved_mb",
    "peak_gpu_alloc_mb": "debug/gpu/max_alloc_mb",
    "gpu_alloc_mb": "debug/gpu/alloc_mb",
    "host_rss_mb": "debug/cpu/rss_mb",
}


def read_events(path: str) -> dict[str, list[tuple[int, float, float]]]:
    """{tag: [(step, wall_time, value), ...]} for every scalar tag."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(path), size_guidance={"scalars": 0})
    events.Reload()
    return {
        tag: [(e.step, e.wall_time, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def curve(scalars: dict[str, list[tuple[int, float, float]]], last_episodes: int = 10) -> dict:
    """The curve at each log point (the steps where charts/SPS was written)."""
    sps = scalars["charts/SPS"]
    updates_rate = {step: value for step, _, value in scalars.get("charts/updates_per_second", [])}
    # the run's own totals, which survive --resume; files from before they were logged: derived from the rates
    train_seconds = {step: value for step, _, value in scalars.get("charts/train_seconds", [])}
    total_updates = {step: value for step, _, value in scalars.get("charts/updates", [])}
    episodes = sorted((step, value) for step, _, value in scalars.get("charts/episodic_return", []))
    by_key = {
        name: {step: value for step, _, value in scalars.get(tag, [])}
        for name, tag in {**DIAGNOSTICS, **MEMORY}.items()
    }
    points, previous = [], None
    for step, wall, mean_sps in sps:
        elapsed = step / mean_sps if mean_sps > 0 else 0.0  # charts/SPS is steps over seconds since the start
        updates = updates_rate.get(step, 0.0) * elapsed  # likewise charts/updates_per_second
        elapsed, updates = train_seconds.get(step, elapsed), total_updates.get(step, updates)
        finished = [value for episode_step, value in episodes if episode_step <= step][-last_episodes:]
        point = {
            "env_step": step,
            "wall_s": round(elapsed, 1),
            "updates": round(updates),
            "mean_return_last10": float(np.mean(finished)) if finished else None,
            "episodes": sum(1 for episode_step, _ in episodes if episode_step <= step),
        }
        if previous is not None and elapsed > previous["wall_s"]:
            dt = elapsed - previous["wall_s"]
            point["env_steps_per_s"] = round((step - previous["env_step"]) / dt, 2)
            point["updates_per_s"] = round((updates - previous["updates"]) / dt, 2)
        point.update({name: values.get(step) for name, values in by_key.items()})
        points.append(point)
        previous = point
    return {"points": points, "episode_returns": [{"env_step": s, "return": v} for s, v in episodes]}


# DreamerV3's own Atari100k Pong runs (2023 code, five seeds), read from its score file once (see the file's "source")
REFERENCE = Path(__file__).resolve().parent / "results" / "dreamerv3_atari100k_pong.json"


def reference() -> dict | None:
    """DreamerV3's five Pong curves: {"source": repository, commit, path, note; "runs": [{seed, agent_step,
    return}]}, or None when the file is missing."""
    return json.loads(REFERENCE.read_text()) if REFERENCE.exists() else None


def _points(points: list[dict], key: str) -> tuple[list, list]:
    pairs = [(p["env_step"], p[key]) for p in points if p.get(key) is not None]
    return [s for s, _ in pairs], [v for _, v in pairs]


def plot(result: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = result["points"]
    steps = [p["env_step"] for p in points]
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5))
    ax = axes[0][0]
    ax.plot(
        [e["env_step"] for e in result["episode_returns"]],
        [e["return"] for e in result["episode_returns"]],
        ".",
        alpha=0.4,
        label="episode",
    )
    ax.plot(steps, [p["mean_return_last10"] for p in points], label="mean of last 10")
    dreamerv3 = reference()
    if dreamerv3:
        for i, run in enumerate(dreamerv3["runs"]):
            label = "DreamerV3 (2023), 5 seeds" if i == 0 else None
            ax.plot(run["agent_step"], run["return"], color="grey", lw=0.8, alpha=0.7, label=label)
    ax.set(title="return", xlabel="env step", ylim=(-21.5, 21.5), xlim=(0, 1.05 * max(steps[-1], 20_000)))
    ax.legend(fontsize=7)
    ax = axes[0][1]
    ax.plot(steps, [p["reward_sign_accuracy"] for p in points], label="reward sign accuracy")
    ax.plot(steps, [p["actor_entropy"] for p in points], label="actor entropy (nats)")
    for key, label in (
        ("ball_f1_observed", "ball F1, observed"),
        ("ball_f1_open_loop_5", "ball F1, 5 steps open loop"),
        ("ball_f1_chance_open_loop_5", "ball F1 by chance, 5 steps open loop"),
    ):
        ax.plot(*_points(points, key), "o-", ms=3, label=label)
    ax.set(title="world model and actor", xlabel="env step")
    ax.legend(fontsize=7)
    ax = axes[1][0]
    ax.plot(steps, [p.get("updates_per_s") for p in points], label="updates/s")
    ax.plot(steps, [p.get("env_steps_per_s") for p in points], label="env steps/s")
    ax.set(title="speed (per log interval)", xlabel="env step")
    ax.legend()
    ax = axes[1][1]
    for name in ("peak_gpu_reserved_mb", "gpu_alloc_mb", "host_rss_mb"):
        ax.plot(steps, [p[name] for p in points], label=name)
    ax.set(title="memory (MB)", xlabel="env step")
    ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


STRIP_FRAMES = (0, 4, 5, 8, 12, 20, 30, 49)  # context ends after frame 4: 5 onwards is imagined


def open_loop_strip(gif_path: Path, png_path: Path) -> dict:
    """Frames of an open-loop GIF side by side (each frame: 4 sequences x truth | model | error), in colour when the
    GIF has colour."""
    from PIL import Image, ImageChops

    gif = Image.open(gif_path)
    frames = []
    for index in STRIP_FRAMES:
        if index < gif.n_frames:
            gif.seek(index)
            frames.append(gif.convert("RGB"))
    grey = all(
        ImageChops.difference(frame, frame.convert("L").convert("RGB")).getbbox() is None for frame in frames
    )
    mode = "L" if grey else "RGB"
    frames = [frame.convert(mode) for frame in frames]
    width, height = frames[0].size
    strip = Image.new(mode, (len(frames) * (width + 4), height), "white")
    for i, frame in enumerate(frames):
        strip.paste(frame, (i * (width + 4), 0))
    strip.save(png_path, optimize=True)
    return {"png": png_path.name, "frames": list(STRIP_FRAMES[: len(frames)]), "gif_frames": gif.n_frames}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("events", help="a run directory or one TensorBoard event file")
    parser.add_argument("--json", required=True)
    parser.add_argument("--png")
    parser.add_argument("--title", default="dreamer_atari.py")
    cli = parser.parse_args()
    if not Path(cli.events).exists():
        print(f"error: {cli.events!r} does not exist.", file=sys.stderr)
        raise SystemExit(2)
    result = curve(read_events(cli.events))
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmark.common import code_version

    result["code"] = code_version()  # the commit it ran, and whether the tree differed
    Path(cli.json).write_text(json.dumps(result, indent=1))
    if cli.png:
        plot(result, cli.png, cli.title)


if __name__ == "__main__":
    main()
