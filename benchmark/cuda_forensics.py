"""The forensics instruments on a real Dreamer run: allocator snapshots and their analysis, and an induced OOM.

    python benchmark/cuda_forensics.py --out PATH             # CUDA: the seed model, a short real Pong run
    python benchmark/cuda_forensics.py --out PATH --quick     # a tiny model and fewer steps
    python benchmark/cuda_forensics.py --out PATH --quick --device cpu   # the plumbing, on a machine without CUDA

Every step goes through the real command lines, each in its own process, in a temporary folder:

1. `dreamer_atari.py --memory-snapshot-every N --memory-probes`: a short run past replay capacity;
2. `memory_analysis.py analyze` on its snapshots with `--events-dir`: what it printed is kept verbatim;
3. the same run with the process capped by `torch.cuda.set_per_process_memory_fraction` at half of run 1's peak
   reserved memory and `--no-preallocate`: the first update runs out of memory. Kept: the exit status, the
   diagnosis the script printed, the files of `oom/`, the GPU memory held at the OOM (the observer) and when the
   report was written (after the failed step's tensors were dropped), the top allocation sites at the OOM, and
   whether the checkpoint was written;
4. the same cap with preallocation on (the default): the preflight must refuse before the first env step.

With `--device cpu` only run 1 is possible (snapshots then warn once and write nothing); steps 2-4 are reported as
skipped, with the reason. Writes one JSON object to `--out`; run.py turns it into the results file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import memory_analysis as ma
import memory_utils as mu
from benchmark import bench_utils
from benchmark.common import code_version
from dreamer_atari import EXIT_OOM

# Run sizes. Full: the seed model (dreamer_atari.Args() defaults) with fewer updates per env step, so the run stays
# short; quick: the soak's tiny model.
FULL = {
    "total": 3_000,
    "capacity": 2_000,
    "learning_starts": 1_000,
    "every": 500,
    "train_ratio": 128.0,
    "model": [],
}
QUICK = {
    "total": 600,
    "capacity": 400,
    "learning_starts": 200,
    "every": 200,
    "train_ratio": 8.0,
    "model": [
        "--encoder-channels",
        "4",
        "4",
        "4",
        "--embed-dim",
        "16",
        "--decoder-base-channels",
        "4",
        "--decoder-mid-channels",
        "4",
        "--deterministic-dim",
        "16",
        "--stochastic-dim",
        "4",
        "--stochastic-classes",
        "4",
        "--hidden-dim",
        "16",
        "--batch-size",
        "4",
        "--sequence-length",
        "16",
    ],
}
# Runs the training script with this process capped at a fraction of the GPU: the allocator settings go in first,
# as the script itself would put them, because capping initialises CUDA.
CAP_WRAPPER = """\
import runpy, sys
import memory_utils as mu
mu.configure_allocator(verbose=False)
import torch
torch.cuda.set_per_process_memory_fraction(float(sys.argv[1]))
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def run(cmd: list[str], work: Path, timeout: float) -> dict:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "WANDB_MODE": "offline",
        "PYTHONUNBUFFERED": "1",
    }
    start = time.perf_counter()
    done = subprocess.run(
        cmd, cwd=work, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    return {
        "returncode": done.returncode,
        "stdout": done.stdout,
        "stderr": done.stderr,
        "wall_s": round(time.perf_counter() - start, 1),
    }


def tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


def training_cmd(sizes: dict, on_cuda: bool, exp_name: str, extra: list[str] = ()) -> list[str]:
    return [
        str(ROOT / "dreamer_atari.py"),
        "--exp-name",
        exp_name,
        "--seed",
        "1",
        "--total-timesteps",
        str(sizes["total"]),
        "--buffer-capacity",
        str(sizes["capacity"]),
        "--learning-starts",
        str(sizes["learning_starts"]),
        "--warmup-steps",
        "0",
        "--train-ratio",
        str(sizes["train_ratio"]),
        "--log-interval",
        str(sizes["every"] // 2),
        "--cuda" if on_cuda else "--no-cuda",
        "--no-cudagraph",
        *sizes["model"],
        *extra,
    ]  # eager: probes need it


def run_dir(work: Path, exp_name: str) -> Path | None:
    found = sorted((work / "runs").glob(f"*__{exp_name}__*"))
    return found[-1] if found else None


def files_in(directory: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(directory.iterdir())} if directory.is_dir() else {}


def top_sites_at_oom(snapshot: Path, top: int = 8) -> list[dict]:
    summary = ma.summarize_snapshot(ma.load_snapshot(snapshot))
    ranked = sorted(summary["sites"].items(), key=lambda kv: -kv[1][0])[:top]
    return [{"site": site, "mb": round(size / mu.MB, 1), "blocks": blocks} for site, (size, blocks) in ranked]


def snapshots_run(sizes: dict, on_cuda: bool, work: Path) -> dict:
    cmd = [
        sys.executable,
        *training_cmd(
            sizes, on_cuda, "snapshots", ["--memory-snapshot-every", str(sizes["every"]), "--memory-probes"]
        ),
    ]
    done = run(cmd, work, timeout=1200)
    out = {
        "command": "python " + " ".join(Path(c).name if c.endswith(".py") else c for c in cmd[1:]),
        "returncode": done["returncode"],
        "wall_s": done["wall_s"],
        "output_tail": tail(done["stdout"]),
        "warnings": [line for line in done["stderr"].splitlines() if line.startswith("memory_utils:")],
    }
    directory = run_dir(work, "snapshots")
    if done["returncode"] != 0 or directory is None:
        out["stderr_tail"] = tail(done["stderr"])
        return out
    out["run_dir"] = directory
    out["snapshots"] = files_in(directory / "memory_snapshots")
    out["probe_verdict"] = next(
        (
            line
            for line in done["stdout"].splitlines() + done["stderr"].splitlines()
            if line.startswith("probes:")
        ),
        None,
    )
    keys = (mu.KEY_GPU_MAX_RESERVED_MB, mu.KEY_GPU_MAX_ALLOC_MB, "charts/SPS", "charts/updates_per_second")
    scalars = bench_utils.read_scalars(directory, list(keys))
    for key in keys:
        out[key] = scalars[key][max(scalars[key])] if key in scalars else None  # the last logged value
    return out


def analysis_run(snapshots: dict, work: Path) -> dict:
    directory = snapshots["run_dir"]
    cmd = [
        sys.executable,
        str(ROOT / "memory_analysis.py"),
        "analyze",
        "--snapshots-dir",
        str(directory / "memory_snapshots"),
        "--events-dir",
        str(directory),
        "--out-dir",
        str(work / "analysis"),
    ]
    done = run(cmd, work, timeout=600)
    out = {
        "command": "python memory_analysis.py analyze --snapshots-dir RUN/memory_snapshots --events-dir RUN "
        "--out-dir OUT",
        "returncode": done["returncode"],
        "wall_s": done["wall_s"],
        "printed": done["stdout"].split("\nwrote ")[0].rstrip(),
        "stderr_tail": tail(done["stderr"], 10),
        "files": files_in(work / "analysis"),
    }
    out["verdict"] = out["printed"].rsplit("\n", 1)[-1]  # its last paragraph, one line
    report = work / "analysis" / "report.md"
    if report.exists():
        out["report_md"] = report.read_text()
    return out


def capped_run(sizes: dict, fraction: float, work: Path, exp_name: str, preallocate: bool) -> dict:
    extra = [] if preallocate else ["--no-preallocate"]
    cmd = [sys.executable, "-c", CAP_WRAPPER, f"{fraction:.6f}", *training_cmd(sizes, True, exp_name, extra)]
    done = run(cmd, work, timeout=1200)
    out = {
        "fraction": fraction,
        "preallocate": preallocate,
        "returncode": done["returncode"],
        "expected_returncode": EXIT_OOM,
        "wall_s": done["wall_s"],
        "stderr_tail": tail(done["stderr"], 25),
    }
    directory = run_dir(work, exp_name)
    if directory is None:
        return out
    oom_dir = directory / "oom"
    out["oom_files"] = files_in(oom_dir)
    out["checkpoint_written"] = (directory / "checkpoint.pt").exists()
    if (oom_dir / "report.json").exists():
        report = json.loads((oom_dir / "report.json").read_text())
        out["diagnosis"] = report["diagnosis"]
        out["error"] = report["error"]
        out["gpu_when_reported"] = report["gpu"]
    if (oom_dir / "observer.json").exists():
        observer = json.loads((oom_dir / "observer.json").read_text())
        out["gpu_at_oom"] = {
            "requested_mb": observer["requested_bytes"] / mu.MB,
            "allocated_mb": observer["device_allocated_bytes"] / mu.MB,
            "device_free_mb": observer["device_free_bytes"] / mu.MB,
        }
    for name in ("snapshot_at_oom.pickle", "snapshot.pickle"):
        if (oom_dir / name).exists():
            try:
                out["top_sites_at_oom"] = top_sites_at_oom(oom_dir / name)
                out["top_sites_from"] = name
            except Exception as exc:  # noqa: BLE001 - recorded, not fatal: the other figures still stand
                out["top_sites_error"] = f"{name}: {type(exc).__name__}: {exc}"
            break
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = parser.parse_args()
    import torch

    on_cuda = args.device == "cuda"
    if on_cuda and not torch.cuda.is_available():
        print(
            "error: --device cuda needs a CUDA device and torch sees none; use --device cpu to check the "
            "plumbing.",
            file=sys.stderr,
        )
        raise SystemExit(2)
    sizes = QUICK if args.quick else FULL
    result: dict = {
        "device": torch.cuda.get_device_name(0) if on_cuda else "cpu",
        "quick": args.quick,
        "sizes": {k: v for k, v in sizes.items() if k != "model"},
        "model": "tiny (the soak's)" if args.quick else "seed (dreamer_atari.Args() defaults)",
    }
    skipped = "needs CUDA: allocator snapshots, the OOM observer and a GPU memory cap exist only there"
    with tempfile.TemporaryDirectory(prefix="forensics-") as tmp:
        work = Path(tmp)
        snapshots = snapshots_run(sizes, on_cuda, work)
        if snapshots["returncode"] != 0:
            raise SystemExit(
                f"the snapshot run failed (exit {snapshots['returncode']}):\n"
                f"{snapshots.get('stderr_tail', '')}"
            )
        if on_cuda and snapshots.get("snapshots"):
            result["analysis"] = analysis_run(snapshots, work)
        else:
            result["analysis"] = {"skipped": skipped if not on_cuda else "the run wrote no snapshots"}
        if on_cuda:
            total_mb = torch.cuda.get_device_properties(0).total_memory / mu.MB
            peak_mb = snapshots[mu.KEY_GPU_MAX_RESERVED_MB]
            fraction = 0.5 * peak_mb / total_mb
            result["cap"] = {
                "run1_peak_reserved_mb": peak_mb,
                "device_total_mb": total_mb,
                "fraction": fraction,
                "cap_mb": fraction * total_mb,
            }
            result["oom_in_update"] = capped_run(sizes, fraction, work, "oom_update", preallocate=False)
            result["oom_in_preflight"] = capped_run(sizes, fraction, work, "oom_preflight", preallocate=True)
        else:
            result["oom_in_update"] = result["oom_in_preflight"] = {"skipped": skipped}
        snapshots["run_dir"] = str(snapshots["run_dir"].relative_to(work))
        result["snapshot_run"] = snapshots
    result["code"] = code_version()  # the commit it ran, and whether the tree differed
    Path(args.out).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
