"""Continue a trained dqn_starcraft_split.py network with other settings: two settings compared from the same
trained network, rather than from scratch, where an hour per seed and a seed-to-seed spread of about 7 points
hide small effects.

    python benchmark/dqn_continue.py CHECKPOINT --map-name CollectMineralShards --n-step 1 --time-limit-min 25 \\
        --run-id continue_n1

From CHECKPOINT come the networks, Adam's moments, the step and episode counters (so epsilon goes on from where it
was) and the random states. The replay starts empty and is refilled for 1,000 agent steps before the next update,
and the learning rate restarts at --learning-rate with a fresh schedule. Everything else is the script's own loop
with the settings given after CHECKPOINT, which, unlike --resume, may differ from those the network was trained
with (the network's shape may not). The run is written where the script writes one: `{save_path}/{run_id}/`.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch

import dqn_starcraft_split as dqn

REFILL_STEPS = 1_000


def main(argv: list[str]) -> int:
    if not argv or argv[0].startswith("-"):
        print("usage: python benchmark/dqn_continue.py CHECKPOINT [dqn_starcraft_split.py settings]: the first "
              "argument must be a checkpoint path.", file=sys.stderr)
        return 2
    path, flags = argv[0], argv[1:]
    if not os.path.isfile(path):
        print(f"checkpoint {path!r} does not exist or is not a file.", file=sys.stderr)
        return 2
    try:
        args, sources = dqn.parse_args(flags)
    except dqn.ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    args = dqn.with_map_defaults(args)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        saved = dqn.trained_settings(state)
    except Exception as exc:  # noqa: BLE001 - corrupt, truncated, or not a checkpoint at all
        print(f"checkpoint {path!r} is not a readable checkpoint of the script ({type(exc).__name__}).",
              file=sys.stderr)
        return 2
    shape = [name for name in dqn.RESUME_MUST_MATCH if name != "n_step"
             and saved.get(name) != getattr(args, name)]
    if shape:
        print(f"checkpoint {path!r} was trained with other {', '.join(shape)}; continue it with the same ones.",
              file=sys.stderr)
        return 2
    for group in state["optimizer"]["param_groups"]:
        group["lr"] = group["initial_lr"] = args.learning_rate
    state.update(scheduler=None, replay=None, interrupted=False)
    args = dataclasses.replace(args, seed=int(saved["seed"]), learning_starts=state["global_step"] + REFILL_STEPS)
    sources.update(seed="checkpoint", learning_starts="checkpoint")
    run_id = args.run_id or f"{args.map_name}__continue__{args.seed}"
    if os.path.exists(os.path.join(args.save_path, run_id)):
        print(f"run folder {os.path.join(args.save_path, run_id)!r} already exists; pick another --run-id.",
              file=sys.stderr)
        return 2
    row = dqn.train_one_seed(args, sources, args.seed, run_id, state)
    print(row)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
