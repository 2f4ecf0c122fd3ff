"""How many operations one Dreamer update dispatches, and how many of them each RSSM step adds.

    python benchmark/op_count.py --out benchmark/results/op_counts      # writes op_counts.json and op_counts.md
    python benchmark/op_count.py --other-commit 89f4221 --out ...          # the same count on another commit too

On the CPU, a `TorchDispatchMode` counts the aten operations of one world-model update and one behaviour update
(views left out: they launch no kernel), after a warm-up update, for sequence length T and T-1 and imagination
horizon H and H-1: the differences are the cost of one observe step and one imagination step, and the counts are
extrapolated to DreamerV3's Atari100k batch (T = 64, H = 15), since an op count does not depend on the batch size
or the layer widths. On a GPU the counts are an upper bound of the kernels an eager update launches: the GRU
cell's elementwise work is one fused kernel there. `--other-commit` runs the same count on another commit of the
repository, checked out in a temporary worktree, so a change's effect is measured, not estimated.
"""

from __future__ import annotations

import argparse
import collections
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
TINY = {
    "encoder_channels": (4, 8, 8),
    "embed_dim": 32,
    "decoder_base_channels": 4,
    "decoder_mid_channels": 4,
    "deterministic_dim": 16,
    "stochastic_dim": 4,
    "stochastic_classes": 4,
    "hidden_dim": 16,
    "batch_size": 3,
    "num_envs": 1,
    "amp": "off",
}
T_FULL, H_FULL = 64, 15
SIZES = ((8, 5), (7, 5), (8, 4))  # (T, H): the base point and one step less of each loop


def count(root: Path, sequence_length: int, horizon: int) -> dict:
    """Ops of one world-model update and one behaviour update of the dreamer_atari.py in `root` (its own API)."""
    sys.path.insert(0, str(root))
    import numpy as np
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import dreamer_atari as da

    torch.set_num_threads(1)

    class Counter(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket)
            if not (func.is_view or name in ("aten.detach", "aten.lift_fresh", "aten._unsafe_view")):
                self.ops[name] += 1
            return func(*args, **(kwargs or {}))

    args = da.Args(**{**TINY, "sequence_length": sequence_length, "imagination_horizon": horizon})
    torch.manual_seed(0)
    agent = da.build_agent(args, (4, 84, 84), 6, "cpu")
    rng = np.random.default_rng(0)
    batch = da.synthetic_batch(args, (4, 84, 84))
    batch["obs"] = rng.integers(0, 255, batch["obs"].shape, dtype=np.uint8)
    batch["action"] = rng.integers(0, 6, batch["action"].shape).astype(np.uint8)
    raw = da.batch_tensors(batch, "cpu")
    try:
        world_model_step, behavior_step = da.make_update_steps(agent, args)
    except TypeError:  # before the update functions lost their probe argument
        world_model_step, behavior_step = da.make_update_steps(agent, args, None)
    for _ in range(2):  # the first update creates what later ones reuse (optimizer state, sampling matrices)
        with Counter() as world:
            out = world_model_step(raw)
        start = out[2] if len(out) == 3 else {"deter": out[2], "stoch": out[3], "continue": out[4]}
        with Counter() as behavior:
            behavior_step(start)
    return {
        "world_model": dict(world.ops),
        "behavior": dict(behavior.ops),
        "host_syncs": world.ops["aten._local_scalar_dense"] + behavior.ops["aten._local_scalar_dense"],
    }


def summarize(counts: dict) -> dict:
    base, short_t, short_h = (counts[f"T{t}_H{h}"] for t, h in SIZES)
    world, behavior = sum(base["world_model"].values()), sum(base["behavior"].values())
    observe_step = world - sum(short_t["world_model"].values())
    imagine_step = behavior - sum(short_h["behavior"].values())
    t, h = SIZES[0]
    return {
        "world_model_update": world,
        "behavior_update": behavior,
        "per_observe_step": observe_step,
        "per_imagination_step": imagine_step,
        "host_syncs_per_update": base["host_syncs"],
        f"update_at_T{T_FULL}_H{H_FULL}": world
        + observe_step * (T_FULL - t)
        + behavior
        + imagine_step * (H_FULL - h),
        "observe_step_ops": dict(
            collections.Counter(base["world_model"]) - collections.Counter(short_t["world_model"])
        ),
        "imagination_step_ops": dict(
            collections.Counter(base["behavior"]) - collections.Counter(short_h["behavior"])
        ),
    }


def measure(root: Path) -> dict:
    """Each size in its own process: a fresh import of that root's script."""
    counts = {}
    for t, h in SIZES:
        code = (
            f"import json, sys; sys.path.insert(0, {str(ROOT)!r}); from benchmark import op_count; "
            f"print(json.dumps(op_count.count(__import__('pathlib').Path({str(root)!r}), {t}, {h})))"
        )
        done = subprocess.run(
            [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
        )
        counts[f"T{t}_H{h}"] = json.loads(done.stdout.strip().splitlines()[-1])
    return {"counts": counts, **summarize(counts)}


def commit_of(root: Path) -> str:
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True
    ).stdout.strip()


def markdown(result: dict) -> str:
    rows = [
        "| figure | " + " | ".join(f"`{c}`" for c in result["commits"]) + " |",
        "|---|" + "---:|" * len(result["commits"]),
    ]
    keys = (
        "per_observe_step",
        "per_imagination_step",
        "world_model_update",
        "behavior_update",
        "host_syncs_per_update",
        f"update_at_T{T_FULL}_H{H_FULL}",
    )
    for key in keys:
        rows.append(
            f"| {key} | " + " | ".join(f"{result['by_commit'][c][key]:,}" for c in result["commits"]) + " |"
        )
    lines = [
        "# aten operations per Dreamer update (CPU, views left out)",
        "",
        f"Command: `{result['command']}`. Machine: {result['machine']['cpu']}, torch {result['machine']['torch']}. Tiny model (`{TINY}`) at T = "
        f"{SIZES[0][0]}, H = {SIZES[0][1]}; the per-step figures are the differences to T - 1 and H - 1, and "
        f"the last row extrapolates to T = {T_FULL}, H = {H_FULL} (the count does not depend on widths or batch).",
        "",
        *rows,
        "",
    ]
    for commit in result["commits"]:
        figures = result["by_commit"][commit]
        for key in ("observe_step_ops", "imagination_step_ops"):
            top = sorted(figures[key].items(), key=lambda kv: -kv[1])
            lines.append(
                f"- `{commit}` {key}: " + ", ".join(f"{name.removeprefix('aten.')} {n}" for name, n in top)
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for op_counts.json and op_counts.md")
    parser.add_argument(
        "--other-commit", default=None, help="also count on this commit (a temporary worktree)"
    )
    cli = parser.parse_args()
    from benchmark import bench_utils

    result = {
        "command": " ".join(["python", "benchmark/op_count.py", *sys.argv[1:]]),
        "machine": bench_utils.machine(),
        "commits": [],
        "by_commit": {},
    }
    roots = []
    with tempfile.TemporaryDirectory() as tmp:
        if cli.other_commit:
            other = Path(tmp) / "other"
            subprocess.run(
                ["git", "worktree", "add", "--detach", str(other), cli.other_commit],
                cwd=ROOT,
                check=True,
                capture_output=True,
            )
            roots.append(other)
        roots.append(ROOT)
        try:
            for root in roots:
                commit = commit_of(root)
                result["commits"].append(commit)
                result["by_commit"][commit] = measure(root)
        finally:
            if cli.other_commit:
                subprocess.run(["git", "worktree", "remove", "--force", str(roots[0])], cwd=ROOT, check=False)
    out = Path(cli.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "op_counts.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "op_counts.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
