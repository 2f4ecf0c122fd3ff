"""What keeping the replay on disk costs at the default Pong recipe: per env step, and one checkpoint's write.

    python benchmark/replay_disk.py --json benchmark/results/replay_disk/<date>-<machine>.json

The env steps are real Pong frames' shape (3 x 64 x 64 uint8, the default's) stored through dreamer_atari.py's own
replay (`EpisodeReplay.add_step`, 1,000-step episodes), with its log on disk (`mu.ReplayLog`, files of
--replay-chunk-steps) and without, in alternating rounds on the same machine: the difference of the two medians is
what the log costs an env step, every chunk's write included. The checkpoint is the default model's (its weights and
Adam's state, built on the CPU) with the replay's index and the chunk still filling, written by `save_checkpoint` as a
run writes it, fsync included. Every sample is kept; nothing is typed in.
"""

import dataclasses
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import tyro

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import dreamer_atari as da
import memory_utils as mu
from benchmark import bench_utils
from benchmark.common import code_markdown, code_version


@dataclasses.dataclass
class Args:
    json: str | None = None
    """where to write every figure and sample (and a markdown beside it); none: print only"""
    steps: int = 8192
    """env steps per round (each round with the log and without)"""
    rounds: int = 5
    """alternating rounds"""
    chunk_steps: int = da.Args.replay_chunk_steps
    """steps per replay file (the script's default)"""
    folder: str | None = None
    """where the replay files go (default: a temporary folder on the disk of this checkout)"""


def store_steps(replay: da.EpisodeReplay, frames: np.ndarray, steps: int) -> float:
    """Seconds to store `steps` env steps into `replay`, in 1,000-step episodes of one env."""
    start = time.perf_counter()
    for step in range(steps):
        if step % 1000 == 0:
            replay.start_episode(0, frames[step % len(frames)][None])
        else:
            replay.add_step(0, frames[step % len(frames)], step % 6, 0.0, False, step % 1000 == 999)
    return time.perf_counter() - start


def per_step_us(args: Args, folder: Path) -> dict:
    """Alternating rounds of the same steps into a replay with its log on disk and one without."""
    fields = da.replay_log_fields((1, 3, 64, 64))
    frames = np.random.default_rng(0).integers(0, 256, (64, 3, 64, 64), dtype=np.uint8)
    samples = {"with_log_us": [], "without_log_us": []}
    for round_ in range(args.rounds):
        for name in ("with_log_us", "without_log_us")[:: 1 if round_ % 2 == 0 else -1]:
            replay = da.EpisodeReplay(args.steps, 1, seed=0)
            if name == "with_log_us":
                shutil.rmtree(folder, ignore_errors=True)
                replay.log = mu.ReplayLog(folder, fields, args.chunk_steps)
            seconds = store_steps(replay, frames, args.steps)
            if replay.log is not None:  # what a checkpoint adds: the files made durable
                start = time.perf_counter()
                replay.log.sync()
                seconds += time.perf_counter() - start
            samples[name].append(round(seconds / args.steps * 1e6, 3))
    medians = {name: statistics.median(values) for name, values in samples.items()}
    return {
        "samples": samples,
        "medians_us": medians,
        "log_us_per_env_step": medians["with_log_us"] - medians["without_log_us"],
        "bytes_per_row": mu.ReplayLog.row_nbytes(fields),
    }


def checkpoint_write(args: Args, folder: Path) -> dict:
    """One checkpoint of the default model with a full chunk of replay rows still filling, as a run writes it."""
    run_args = da.Args(cuda=False, replay_chunk_steps=args.chunk_steps)
    agent = da.build_agent(run_args, (1, 3, 64, 64), 6, "cpu")
    replay = da.EpisodeReplay(args.chunk_steps * 2, 1, seed=0)
    replay.log = mu.ReplayLog(folder / "replay", da.replay_log_fields((1, 3, 64, 64)), args.chunk_steps)
    frames = np.random.default_rng(1).integers(0, 256, (64, 3, 64, 64), dtype=np.uint8)
    # one file written, the next chunk one row short of full
    store_steps(replay, frames, 2 * args.chunk_steps - 1)
    path = folder / "checkpoint.pt"
    samples = []
    for _ in range(3):
        start = time.perf_counter()
        da.save_checkpoint(
            str(path), agent, dict(da.NEW_COUNTERS), "bench", run_args, replay, np.random.default_rng(0)
        )
        samples.append(round(time.perf_counter() - start, 3))
    return {"seconds": samples, "median_s": statistics.median(samples), "bytes": path.stat().st_size}


def markdown(result: dict) -> str:
    steps, write = result["per_step"], result["checkpoint"]
    return "\n".join(
        [
            f"# The replay on disk: its cost at the default Pong recipe ({result['date']})",
            "",
            f"Machine: {result['machine']['cpu']} ({result['machine']['cpu_count']} cores), torch "
            f"{result['machine']['torch']}. Command: `{result['command']}`.",
            "",
            f"- Per env step: {steps['log_us_per_env_step']:.1f} us more with the log on disk "
            f"({steps['medians_us']['with_log_us']:.1f} us a step against {steps['medians_us']['without_log_us']:.1f}; "
            f"medians of {len(steps['samples']['with_log_us'])} alternating rounds of {result['args']['steps']:,} "
            f"steps, files of {result['args']['chunk_steps']:,} steps of {steps['bytes_per_row']:,} bytes each, "
            f"their fsync included).",
            f"- One checkpoint of the default model with the chunk still filling ({write['bytes'] / 2**20:.0f} MB): "
            f"{write['median_s']:.2f} s (samples {write['seconds']}).",
            "",
            code_markdown(result["code"]),
            "",
            "Every sample is in the JSON beside this file.",
            "",
        ]
    )


def main(args: Args) -> dict:
    torch.set_num_threads(1)
    base = Path(args.folder) if args.folder else Path(tempfile.mkdtemp(dir=ROOT, prefix=".replay_bench_"))
    try:
        result = {
            "date": time.strftime("%Y-%m-%d"),
            "machine": bench_utils.machine(),
            "command": "python benchmark/replay_disk.py " + " ".join(sys.argv[1:]),
            "args": dataclasses.asdict(args),
            "code": code_version(),  # the commit it ran, and whether the tree differed
            "per_step": per_step_us(args, base / "rounds"),
            "checkpoint": checkpoint_write(args, base / "checkpoint"),
        }
    finally:
        if not args.folder:
            shutil.rmtree(base, ignore_errors=True)
    print(markdown(result))
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        Path(args.json).with_suffix(".md").write_text(markdown(result))
    return result


if __name__ == "__main__":
    main(tyro.cli(Args))
