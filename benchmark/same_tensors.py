"""Whether a change to dreamer_atari.py trains the same tensors as the code before it: a tiny Catch-v0 run of each
on the CPU, the same seed and flags, and every tensor of their final checkpoints (the models' weights, the optimizers'
states, the return normaliser) compared bit for bit, with the logged losses.

    python benchmark/same_tensors.py --before COMMIT --json benchmark/results/same_tensors/<date>-<machine>.json

`--before` is checked out into a temporary git worktree (nothing in this checkout changes); the code after is this
checkout as it is. Each pair of variants names its flags in each version's words (today's, since the flags became
auto|on|off): Part 1 alone, and the fast paths a CPU can run. Each run is a subprocess in a folder of its own, one
thread, deterministic; every tensor that differs is named in the results.
"""

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import tyro

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmark import bench_utils
from benchmark.common import code_markdown, code_version, machine_markdown

# a few hundred updates of a tiny agent: seconds on a CPU, long enough for every path to train
TINY_RUN = [
    *("--env-id", "Catch-v0", "--num-envs", "1", "--vector-mode", "sync", "--seed", "3"),
    *("--total-timesteps", "120", "--learning-starts", "20", "--train-ratio", "32", "--log-interval", "20"),
    *("--video-every", "0", "--encoder-channels", "4", "8", "8", "--deterministic-dim", "16"),
    *("--stochastic-dim", "4", "--stochastic-classes", "4", "--hidden-dim", "16", "--batch-size", "2"),
    *("--sequence-length", "8", "--imagination-horizon", "5", "--checkpoint-minutes", "0"),
]
# each variant: (its flags before, its flags after), in each version's words; both spell them as today since the
# flags became auto|on|off (commit 569d87f; the file of 2026-12-07 against dd47e3f used `--no-fast-observe`, ...)
CPU_PATHS = ["--fast-observe", "on", "--fast-imagine", "on", "--imagine-gathers", "on", "--fast-heads", "on"]
CPU_PATHS += ["--channels-last", "on"]
VARIANTS = {
    "part 1 alone": ([], []),  # the CPU's default
    "the CPU's fast paths": (CPU_PATHS, CPU_PATHS),
}


@dataclasses.dataclass
class Args:
    before: str
    """the commit to compare against (checked out into a temporary worktree)"""
    json: str = "same_tensors.json"
    """where to write the results (a markdown table beside it)"""


def train(code: Path, flags: list[str], work: Path) -> tuple[dict, dict, str]:
    """A tiny run of `code`'s dreamer_atari.py in `work`: its final checkpoint's tensors by name, its logged losses
    {key: [values]}, and the command."""
    work.mkdir(parents=True)
    command = [sys.executable, str(code / "dreamer_atari.py"), *TINY_RUN, *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONHASHSEED="0", WANDB_MODE="offline")
    env["PYTHONPATH"] = str(code)
    done = subprocess.run(command, cwd=work, env=env, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"error: {' '.join(command)} exited {done.returncode}:\n{done.stderr[-3000:]}")
    (run_dir,) = (work / "runs").iterdir()
    state = torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=False)
    tensors = {}
    for model, weights in state["models"].items():
        tensors |= {f"models/{model}/{name}": value for name, value in weights.items()}
    for name, optimizer in state["optimizers"].items():
        for index, values in optimizer["state"].items():
            tensors |= {
                f"optimizers/{name}/{index}/{key}": value
                for key, value in values.items()
                if isinstance(value, torch.Tensor)
            }
    keys = ["losses/image", "losses/reward", "losses/kl", "losses/actor", "losses/critic", "losses/entropy"]
    scalars = bench_utils.read_scalars(str(run_dir), keys)
    logged = {key: [series[step] for step in sorted(series)] for key, series in scalars.items()}
    return tensors, logged, " ".join(["python", "dreamer_atari.py", *TINY_RUN, *flags])


def compare(before: tuple, after: tuple) -> dict:
    """Which tensors and logged values differ between two runs, and by how much at most."""
    (tensors_a, logged_a, _), (tensors_b, logged_b, _) = before, after
    names = sorted(tensors_a.keys() | tensors_b.keys())
    differ = {}
    for name in names:
        a, b = tensors_a.get(name), tensors_b.get(name)
        if a is None or b is None:
            differ[name] = "only in " + ("the run after" if a is None else "the run before")
        elif a.shape != b.shape:
            differ[name] = f"shapes {tuple(a.shape)} and {tuple(b.shape)}"
        elif not torch.equal(a, b):
            differ[name] = f"largest difference {(a.double() - b.double()).abs().max().item():.3g}"
    logged_differ = sorted(
        key for key in logged_a.keys() | logged_b.keys() if logged_a.get(key) != logged_b.get(key)
    )
    return {
        "tensors": len(names),
        "tensors_that_differ": differ,
        "logged_that_differ": logged_differ,
        "logged_before": logged_a,
        "logged_after": logged_b,
        "identical": not differ and not logged_differ,
    }


def markdown(out: dict) -> str:
    rows = [
        f"# Do the same flags train the same tensors before and after? ({out['date']})",
        "",
        machine_markdown(out["machine"], out["command"]),
        f"Before: commit {out['before_commit'][:10]}. After: {code_markdown(out['code'])}",
        "",
        "| variant | flags before | flags after | tensors | that differ | logged losses that differ |",
        "|---|---|---|---|---|---|",
    ]
    for name, result in out["variants"].items():
        before, after = (" ".join(flags) or "(defaults)" for flags in VARIANTS[name])
        rows.append(
            f"| {name} | `{before}` | `{after}` | {result['tensors']} | {len(result['tensors_that_differ'])} | "
            f"{', '.join(result['logged_that_differ']) or 'none'} |"
        )
    rows.append("")
    rows.append(
        f"Each run: `{out['run']}` and the variant's flags. Every value is in the JSON beside this file."
    )
    return "\n".join(rows) + "\n"


def main(args: Args) -> dict:
    commit = subprocess.run(
        ["git", "rev-parse", args.before], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.strip()
    with tempfile.TemporaryDirectory() as temp:
        old = Path(temp) / "before"
        subprocess.run(["git", "worktree", "add", "--detach", str(old), commit], cwd=ROOT, check=True)
        try:
            variants = {}
            for name, (flags_before, flags_after) in VARIANTS.items():
                before = train(old, flags_before, Path(temp) / name.replace(" ", "_") / "before")
                after = train(ROOT, flags_after, Path(temp) / name.replace(" ", "_") / "after")
                variants[name] = compare(before, after) | {
                    "command_before": before[2],
                    "command_after": after[2],
                }
                print(f"{name}: {'identical' if variants[name]['identical'] else 'differs'}")
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(old)], cwd=ROOT, check=False)
    out = {
        "date": time.strftime("%Y-%m-%d"),
        "machine": bench_utils.machine(),
        "command": "python benchmark/same_tensors.py " + " ".join(sys.argv[1:]),
        "run": " ".join(["python", "dreamer_atari.py", *TINY_RUN]),
        "before_commit": commit,
        "code": code_version(ROOT),
        "variants": variants,
    }
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1))
    path.with_suffix(".md").write_text(markdown(out))
    return out


if __name__ == "__main__":
    main(tyro.cli(Args))
