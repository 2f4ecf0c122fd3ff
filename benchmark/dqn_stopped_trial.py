"""A trial of dqn_starcraft_split.py stopped before its time limit -> one results file (.json, .md).

    python benchmark/dqn_stopped_trial.py --out benchmark/results/dqn_collectmineralshards_trial_gamma_099 \
        --baseline benchmark/results/dqn_collectmineralshards_learning.json --runs results/g99_s1 \
        --trial "--gamma 0.99" --command "python dqn_starcraft_split.py ... --seed N" --conditions "..."

A run stopped early (SIGTERM: a checkpoint, no final test) has no greedy test of 20 episodes to report, only its
curve: every 25 episodes the mean training score of those episodes and a greedy test of 5. This file holds every
curve row of every run and, at equal agent steps, the rows of the baseline run of the same seed (a results file of
benchmark/dqn_learning_report.py). Every figure comes from the runs' own files; nothing is typed in.
"""

import argparse
import csv
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmark import bench_utils  # noqa: E402


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def read_run(folder: Path) -> dict:
    for name in ("config.json", "eval/curve.csv"):
        if not (folder / name).is_file():
            fail(f"{folder} has no {name}; give the folders of runs ({{save_path}}/{{run_id}}).")
    try:
        config = json.loads((folder / "config.json").read_text())
        with open(folder / "eval" / "curve.csv", newline="") as f:
            curve = [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]
        run = {
            "run_id": config["run_id"],
            "seed": config["seed"],
            # where the run wrote its files is this machine's business, not the result's
            "args": {k: v for k, v in config["args"].items() if k not in ("save_path", "log_dir", "resume")},
            "python": config["python"],
            "torch": config["torch"],
            "curve": curve,
        }
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        fail(f"{folder} does not hold a run of dqn_starcraft_split.py ({type(exc).__name__}: {exc}).")
    if not curve:
        fail(f"{folder}/eval/curve.csv has no rows yet.")
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="path without extension: writes .json and .md")
    parser.add_argument("--baseline", required=True, help="a dqn_learning_report.py results .json")
    parser.add_argument("--runs", nargs="+", required=True, help="the trial's run folders")
    parser.add_argument("--trial", required=True, help="what the trial changed")
    parser.add_argument("--command", required=True)
    parser.add_argument("--conditions", required=True, help="how the runs shared the machine, why they stopped")
    parser.add_argument("--every", type=int, default=6, help="table: every this many curve rows, and the last")
    args = parser.parse_args()
    if args.every < 1:
        fail(f"--every {args.every} must be at least 1 (every this many curve rows).")

    runs = [read_run(Path(folder)) for folder in args.runs]
    try:
        baseline = json.loads(Path(args.baseline).read_text())
        by_seed = {run["seed"]: {row["global_step"]: row for row in run["curve"]} for run in baseline["runs"]}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        fail(f"--baseline {args.baseline!r} is not a results file of dqn_learning_report.py ({exc}).")
    missing = [run["seed"] for run in runs if run["seed"] not in by_seed]
    if missing:
        fail(f"--baseline {args.baseline!r} has no run of seed {missing[0]}.")
    comparison = []
    for run in runs:
        rows = run["curve"][args.every - 1 :: args.every]
        if rows[-1:] != run["curve"][-1:]:
            rows.append(run["curve"][-1])
        for row in rows:
            comparison.append({"seed": run["seed"], "global_step": row["global_step"], "trial": row,
                               "baseline": by_seed[run["seed"]].get(row["global_step"])})
    machine = bench_utils.machine()  # the runs' own machine: this report is written where they ran
    out = Path(args.out)
    result = {"trial": args.trial, "map_name": runs[0]["args"]["map_name"], "machine": machine,
              "command": args.command, "conditions": args.conditions, "stopped": True,
              "baseline_file": Path(args.baseline).name, "runs": runs, "comparison": comparison}
    out.with_suffix(".json").write_text(json.dumps(result, indent=1))

    lines = [
        f"# {result['map_name']} trial: {args.trial}, stopped early",
        "",
        f"Command: `{args.command}`",
        "",
        f"Machine: {machine['cpu_count']} CPU cores ({machine['cpu']}), Python {runs[0]['python']}, "
        f"torch {runs[0]['torch']}, {runs[0]['args']['torch_num_threads']} torch thread per run. {args.conditions}",
        "",
        "Greedy test (5 episodes) and training score (last 25 episodes) at equal agent steps, against the baseline "
        f"run of the same seed (`{result['baseline_file']}`):",
        "",
        "| seed | agent steps | trial minutes | trial train | trial test | baseline minutes | baseline train "
        "| baseline test |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in comparison:
        t, b = row["trial"], row["baseline"]
        base = (f"{b['wall_time_s'] / 60:.1f} | {b['train_score_mean']:.1f} | {b['test_score_mean']:.1f}"
                if b else "- | - | -")
        lines.append(f"| {row['seed']} | {row['global_step']:.0f} | {t['wall_time_s'] / 60:.1f} | "
                     f"{t['train_score_mean']:.1f} | {t['test_score_mean']:.1f} | {base} |")
    lines += ["", "Every curve row of every run, and every setting, is in the JSON."]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")


if __name__ == "__main__":
    main()
