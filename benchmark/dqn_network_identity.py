"""Do two commits of dqn_starcraft_split.py train the same network? Each script runs the same short training
from the same seed, from its own commit (the script and memory_utils.py as they were), and every weight of the
online and target networks and every Adam moment is hashed. Equal hashes mean that a learning file measured with
one commit holds for the other.

    python benchmark/dqn_network_identity.py --map-name CollectMineralShards --commits 0bcdf39 HEAD \
        --out benchmark/results/dqn_collectmineralshards_default_network_identity

A commit whose script needs flags to train what another trains by default gets them with --flags COMMIT=FLAGS
(for one, the flags a trial ran with, against the commit that made them the defaults).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmark import bench_utils  # noqa: E402

FILES = ("dqn_starcraft_split.py", "memory_utils.py")


def tensor_hash(tensors) -> str:
    """sha256 over the names, shapes, dtypes and bytes of (name, tensor) pairs, in order."""
    digest = hashlib.sha256()
    for name, tensor in tensors:
        tensor = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


def adam_tensors(optimizer_state: dict):
    for index, moments in sorted(optimizer_state["state"].items()):
        for key, value in sorted(moments.items()):
            if torch.is_tensor(value):
                yield f"{index}.{key}", value


SETTINGS = ("context_layers", "click_distance", "timer_input", "coarse_level", "fine_kernel", "fine_gain",
            "exploration_steps", "path_input", "past_input", "select_own_only", "lr_scheduler", "step_lr_step_size",
            "step_lr_gamma")


def run_commit(commit: str, script_args: list[str], workdir: Path) -> dict:
    """Train with the script of `commit` in a fresh folder; the hashes of its final checkpoint."""
    full = subprocess.run(["git", "rev-parse", "--short", commit], cwd=REPO, capture_output=True, text=True,
                          check=True).stdout.strip()
    folder = workdir / full
    folder.mkdir()
    for name in FILES:
        text = subprocess.run(["git", "show", f"{full}:{name}"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout
        (folder / name).write_text(text)
    env = {**os.environ, "WANDB_MODE": "offline"}
    done = subprocess.run([sys.executable, "dqn_starcraft_split.py", *script_args, "--run-id", "ident"],
                          cwd=folder, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"the script of {full} failed ({done.returncode}): {done.stderr.strip()[-400:]}")
    state = torch.load(folder / "results" / "ident" / "checkpoint.pt", map_location="cpu", weights_only=False)
    network = {k: state["args"].get(k) for k in SETTINGS}
    return {
        "script_commit": full,
        "command": "python dqn_starcraft_split.py " + " ".join(script_args) + " --run-id ident",
        "network_settings": {k: ("absent (no such setting at that commit)" if v is None else v)
                             for k, v in network.items()},
        "global_step": state["global_step"],
        "q_network_sha256": tensor_hash(state["q_network"].items()),
        "target_network_sha256": tensor_hash(state["target_network"].items()),
        "adam_state_sha256": tensor_hash(adam_tensors(state["optimizer"])),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--map-name", required=True, choices=("MoveToBeacon", "CollectMineralShards"))
    parser.add_argument("--commits", nargs="+", required=True, help="two or more commits to compare")
    parser.add_argument("--episodes", type=int, default=30)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", required=True, help="output path without extension (.json and .md are written)")
    parser.add_argument("--what", default="", help="one sentence: why these commits are compared")
    parser.add_argument("--flags", nargs="*", default=[], metavar="COMMIT=FLAGS",
                        help="flags one commit's script gets on top of the common ones")
    opts = parser.parse_args()
    if len(opts.commits) < 2:
        parser.error("--commits needs at least two commits")
    extra = dict(item.split("=", 1) for item in opts.flags if "=" in item)
    if len(extra) != len(opts.flags) or not set(extra) <= set(opts.commits):
        parser.error("--flags takes COMMIT=FLAGS, with COMMIT one of --commits")
    script_args = ["--map-name", opts.map_name, "--num-episodes", str(opts.episodes), "--scheduler-tmax", "10000",
                   "--seed", str(opts.seed)]
    with tempfile.TemporaryDirectory() as tmp:
        runs = [run_commit(commit, script_args + extra.get(commit, "").split(), Path(tmp)) for commit in opts.commits]
    keys = ("q_network_sha256", "target_network_sha256", "adam_state_sha256")
    identical = all(run[k] == runs[0][k] for run in runs for k in keys)
    result = {
        "what": opts.what or f"{opts.map_name}: the networks the scripts of {', '.join(opts.commits)} train from "
                              f"seed {opts.seed} in {opts.episodes} episodes",
        "map_name": opts.map_name,
        "machine": {**bench_utils.machine(), "torch_threads": 1},  # every commit's default: one thread
        "identical": identical,
        "runs": runs,
    }
    out = Path(opts.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"# {opts.map_name}: do these commits train the same network?", "", result["what"] + ".", "",
             "Each script ran from its own commit: "
             + "; ".join(f"{run['script_commit']}: `{run['command']}`" for run in runs)
             + ". Hashes: sha256 over every tensor's name, shape, dtype and bytes.", "",
             "| commit | network settings | agent steps | online network | target network | Adam state |",
             "|---|---|---:|---|---|---|"]
    for run in runs:
        settings = ", ".join(f"{k} {v}" for k, v in run["network_settings"].items())
        lines.append(f"| {run['script_commit']} | {settings} | {run['global_step']} | "
                     + " | ".join(f"`{run[k][:16]}`" for k in keys) + " |")
    lines += ["", f"**{'Identical' if identical else 'Not identical'}.**", ""]
    out.with_suffix(".md").write_text("\n".join(lines))
    print(out.with_suffix(".md").read_text())
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
