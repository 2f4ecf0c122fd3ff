"""Memory and speed of our training scripts, side by side with SheepRL, on this machine.

    python benchmark/run.py                      # full run: writes benchmark/results/<date>-<machine>.{md,json}
    python benchmark/run.py --quick              # a couple of minutes, smaller stated sizes, no peer, no results files
    python benchmark/run.py --peer sheeprl       # also SheepRL, in its own virtual environment (created on demand)
    python benchmark/run.py --peer sheeprl --matched-only   # only the side-by-side update times, minutes not an hour
    python benchmark/run.py --quick --json out.json
    python benchmark/run.py --gpu-only           # CUDA: the GPU figures and the forensics check alone

How long each takes, and where a full run's time goes (each stage's seconds are in its results file, `stage_s`):
benchmark/README.md, "How long a run takes".

Prints a markdown table; `--json PATH` writes every figure as one JSON object. Each figure is measured here,
by the code under benchmark/, never typed in: see benchmark/README.md for what each one means and how. The
options (`Args`), the targets and the output helpers that the modules it runs share live in common.py.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import tyro

from benchmark.common import (
    TARGET_BYTES_PER_STEP,
    TARGET_GPU_PEAK_MB,
    TARGET_GPU_SLOPE_MB_PER_10K,
    TARGET_PONG_RETURN,
    TARGET_PONG_WALL_MIN,
    TARGET_SAMPLE_TO_UPDATE,
    TARGET_SIZE_S_SPEEDUP,
    TARGET_SOAK_ANON_MB_PER_10K,
    TARGET_SOAK_MB_PER_10K,
    TARGET_SOAK_TO_PEER,
    TARGET_UPDATE_SPEEDUP,
    Args,
    check_gpu_only_device,
    code_markdown,
    code_version,
    fail,
    fmt,
    fmt_load,
    gpu_markdown,
    log,
    new_results_stem,
    slug,
)

# the peer's soak over the same window as ours (the defaults of ours_dreamer.py soak)
PEER_SOAK = {"turnovers": 100, "warmup": 53_000}
# --quick's soak: a small replay, but the slope is still measured after a warm-up (the replay full, the first
# open-loop GIF and its one-time imports done) and over 3,000 env steps, not over the warm-up itself
QUICK_SOAK = {"capacity": 150, "every": 150, "warmup": 2_500, "turnovers": 20}
REQUIRED_KEYS = (
    "buffer_bytes_per_step",
    "buffer_bytes_limit",
    "sample_ms",
    "update_ms",
    "sample_to_update_ratio",
    "soak_uss_slope_mb_per_10k",
    "soak_turnovers",
)
PEER_KEYS = (
    "buffer_bytes_per_step",
    "sample_ms",
    "update_ms",
    "sample_to_update_ratio",
    "soak_uss_slope_mb_per_10k",
    "soak_turnovers",
)


@contextlib.contextmanager
def timed(stage_s: dict | None, what: str):
    """Record the seconds the block took as `stage_s[what]` (the results file's `stage_s`: where a run's time goes)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        if stage_s is not None:
            stage_s[what] = round(time.perf_counter() - start, 1)


def run_json(
    cmd: list[str],
    what: str,
    work: Path,
    timeout: float,
    env: dict | None = None,
    stage_s: dict | None = None,
) -> dict:
    """Run one measurement in its own process; it writes a JSON object to the path after `--out`. Its seconds go
    into `stage_s` under `what`."""
    out = work / f"{slug(what)}.json"
    log_path = work / f"{out.stem}.log"
    start = time.perf_counter()
    with open(log_path, "w") as log_file:
        done = subprocess.run(
            cmd + ["--out", str(out)],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            check=False,
            cwd=ROOT,
            timeout=timeout,
            env=None if env is None else {**os.environ, **env},
        )
    if done.returncode != 0:
        tail = "".join(log_path.read_text().splitlines(keepends=True)[-25:])
        raise RuntimeError(f"{what} failed (exit {done.returncode}):\n{tail}")
    took = time.perf_counter() - start
    if stage_s is not None:
        stage_s[what] = round(took, 1)
    log(f"{what}: {took:.0f} s")
    return json.loads(out.read_text())


def ratio(peer: float | None, ours: float | None) -> float | None:
    """peer / ours, or None where it means nothing (a missing figure, or ours not positive)."""
    if peer is None or ours is None or ours <= 0 or peer < 0:
        return None
    return peer / ours


def measure(args: Args, work: Path) -> dict:
    py = sys.executable
    quick = ["--quick"] if args.quick else []
    threads = ["--threads", str(args.threads)]
    started = time.time()
    stage_s: dict[str, float] = {}  # seconds per stage, in the order they ran
    result: dict = {"quick": args.quick, "threads": args.threads, "load_average_start": os.getloadavg()}

    ours = run_json(
        [py, str(BENCH_DIR / "ours_dreamer.py"), "measure", *quick, *threads],
        "ours: replay, sampling, update",
        work,
        timeout=1800,
        stage_s=stage_s,
    )
    result["machine"] = ours.pop("machine")
    soak_sizes = (
        [part for key, value in QUICK_SOAK.items() for part in (f"--{key}", str(value))] if args.quick else []
    )
    soak = run_json(
        [py, str(BENCH_DIR / "ours_dreamer.py"), "soak", *quick, *threads, *soak_sizes],
        "ours: soak",
        work,
        timeout=1800,
        stage_s=stage_s,
    )
    soak.pop("machine")
    result.update(ours)
    result.update(soak)

    dqn = run_json(
        [py, str(BENCH_DIR / "ours_dqn.py"), *quick, *threads],
        "ours: DQN",
        work,
        timeout=900,
        stage_s=stage_s,
    )
    dqn.pop("machine")
    result.update(dqn)

    if args.quick:
        result["speed_trials"] = None
    else:
        # an empty compile cache, so that the first update of a compiled variant shows the whole compile time
        trials = run_json(
            [py, str(BENCH_DIR / "ours_dreamer.py"), "trials", *threads],
            "ours: speed trials",
            work,
            timeout=3600,
            env={"TORCHINDUCTOR_CACHE_DIR": str(work / "inductor-cache")},
            stage_s=stage_s,
        )
        result["speed_trials"] = trials["trials"]
        result["speed_trials_batch"] = trials["trial_batch"]

    result.update(measure_gpu(args, work, forensics=not args.quick, stage_s=stage_s))

    if args.peer == "sheeprl" and args.quick:
        log("--quick skips the peer")
    elif args.peer == "sheeprl":
        result.update(measure_peer(args, work, stage_s=stage_s))
        with timed(stage_s, MATCHED_STAGE):
            result.update(measure_matched(args, work))
        # ours again, right after the peer: the median over both passes brackets the peer's time window
        again = run_json(
            [py, str(BENCH_DIR / "ours_dreamer.py"), "update", *threads],
            "ours: update again",
            work,
            timeout=1800,
            stage_s=stage_s,
        )
        result["update_samples_ms"] = result["update_samples_ms"] + again["update_samples_ms"]
        result["update_ms"] = statistics.median(result["update_samples_ms"])
        result["sample_to_update_ratio"] = result["sample_ms"] / result["update_ms"]

    result["load_average_end"] = os.getloadavg()
    result["wall_s"] = time.time() - started
    result["stage_s"] = stage_s
    return result


def measure_gpu(
    args: Args, work: Path, forensics: bool = True, device: str = "cuda", stage_s: dict | None = None
) -> dict:
    """The GPU figures and the forensics check where CUDA is available; elsewhere, why they are missing.
    `device="cpu"` runs the same steps on the CPU (no GPU memory figures), to check them without a GPU."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        return {
            "gpu": {
                "run": False,
                "reason": "No CUDA device on this machine: the GPU figures (updates/s and "
                "peak GPU memory per --amp mode, env steps/s of the training "
                "loop, GPU-allocated slope past capacity) were not measured",
            },
            "forensics": {
                "run": False,
                "reason": "No CUDA device on this machine: the forensics check "
                "(allocator snapshots of a real run, their analysis, an "
                "induced OOM) did not run",
            },
        }
    py = sys.executable
    quick = ["--quick"] if args.quick else []
    on = ["--device", device]
    out = {
        "gpu": run_json(
            [py, str(BENCH_DIR / "ours_dreamer.py"), "gpu", *quick, *on],
            "ours: GPU",
            work,
            timeout=3600,
            stage_s=stage_s,
        )
    }
    if forensics:
        out["forensics"] = run_json(
            [py, str(BENCH_DIR / "cuda_forensics.py"), *quick, *on],
            "ours: forensics",
            work,
            timeout=3600,
            stage_s=stage_s,
        )
    else:
        out["forensics"] = {
            "run": False,
            "reason": "--quick skips the forensics check (three real training runs); "
            "`python benchmark/run.py --gpu-only --quick` runs it small",
        }
    return out


def measure_gpu_only(args: Args, work: Path) -> dict:
    from benchmark import bench_utils

    started = time.time()
    stage_s: dict[str, float] = {}
    result: dict = {
        "quick": args.quick,
        "gpu_only": True,
        "machine": bench_utils.machine(),
        "load_average_start": os.getloadavg(),
    }
    if args.device == "cuda":
        result["gpu_name"] = result["machine"]["gpu"]
    if not args.pong_only:
        result.update(measure_gpu(args, work, device=args.device, stage_s=stage_s))
    if args.pong_minutes > 0:
        with timed(stage_s, "ours: Pong run and its evaluation"):
            result.update(run_pong(args))
    result["load_average_end"] = os.getloadavg()
    result["wall_s"] = time.time() - started
    result["stage_s"] = stage_s
    return result


def run_pong(args: Args, progress=None) -> dict:
    """Run (or continue) the Atari100k Pong run for --pong-minutes (see pong_run.run_pong)."""
    from benchmark import pong_run

    return pong_run.run_pong(args, progress=progress)


def measure_peer(args: Args, work: Path, stage_s: dict | None = None) -> dict:
    from benchmark import peer_venv

    with timed(stage_s, PEER_ENV_STAGE):
        versions = peer_venv.ensure(log=log)
    py = str(peer_venv.python())
    script = str(BENCH_DIR / "peer_sheeprl.py")
    threads = ["--threads", str(args.threads)]
    peer = run_json(
        [py, script, "measure", *threads, "--work-dir", str(work)],
        "peer: replay, sampling, updates (V3, V1)",
        work,
        timeout=3600,
        stage_s=stage_s,
    )
    soak = run_json(
        [
            py,
            script,
            "soak",
            *threads,
            "--work-dir",
            str(work),
            "--bytes-per-step",
            str(peer["buffer_bytes_per_step"]),
            *[part for key, value in PEER_SOAK.items() for part in (f"--{key}", str(value))],
        ],
        "peer: soak",
        work,
        timeout=1800,
        stage_s=stage_s,
    )
    v3, v1 = peer["v3"], peer.get("v1", {})
    out = {
        "peer": "sheeprl",
        "peer_versions": versions,
        "peer_config": peer["config"],
        "peer_buffer_arrays": peer["buffer_arrays"],
        "peer_buffer_bytes_per_step_by_key": peer["buffer_bytes_per_step_by_key"],
        "peer_buffer_memmap": peer["buffer_memmap"],
        "peer_buffer_capacity_steps": peer["buffer_capacity_steps"],
        "peer_buffer_bytes_per_step": peer["buffer_bytes_per_step"],
        "peer_sample_ms": v3["sample_ms"],
        "peer_update_ms": v3["update_ms"],
        "peer_sample_to_update_ratio": v3["sample_ms"] / v3["update_ms"],
        "peer_soak_uss_slope_mb_per_10k": soak["soak_uss_slope_mb_per_10k"],
        "peer_soak_anon_slope_mb_per_10k": soak.get("soak_anon_slope_mb_per_10k"),
        "peer_soak_anon_slope_warmup_mb_per_10k": soak.get("soak_anon_slope_warmup_mb_per_10k"),
        "peer_soak_turnovers": soak["soak_turnovers"],
        "peer_soak_config": soak["soak_config"],
        "peer_v3": v3,
        "peer_v1": v1 or None,
        "peer_params_total": v3["params_total"],
        "peer_v1_update_ms": v1.get("update_ms"),
        "peer_v1_params_total": v1.get("params_total"),
    }
    return out


MATCHED_ROUNDS, MATCHED_WARMUP = 11, 2
MATCHED_STAGE = "matched size: alternating updates, peer and ours"
PEER_ENV_STAGE = "peer: its environment (made when missing)"
MATCHED_PARAMS_TOLERANCE = 0.10  # "matched size": parameter counts within 10 % of the peer's
# Our contenders in the matched-size comparison: result-key suffix -> (ours_dreamer.py serve options, label).
# SheepRL's decoder starts from a 128 x 4 x 4 map at 64 pixels; ours at 64 pixels has a 4 x 4 bottleneck, so
# 128 channels there give the same map, and with it the peer's parameter count.
MATCHED_OURS = {
    "": (
        ["--image-size", "64", "--decoder-mid-channels", "128"],
        "ours 64x64x4, `--image-size 64 --decoder-mid-channels 128`",
    ),
    "_84": (["--image-size", "84"], "ours 84x84x4, the seed model"),
    "_64_seed": (["--image-size", "64"], "ours 64x64x4, the seed model (`--image-size 64`)"),
}
MATCHED_TARGETED = (
    "",
    "_84",
)  # the rows held to the 1.5x target; `_64_seed` is context (not matched in size)
# Size S, each side's own, in the same rounds: our default (`dreamer_atari.Args()`: DreamerV3 size S on 64x64
# colour frames, batch 16 x 64) against SheepRL's `dreamer_v3_S` preset at the same frames and batch. Issue 64: ours
# must not be slower (TARGET_SIZE_S_SPEEDUP).
SIZE_S_PEER, SIZE_S_OURS = "peer_S", "ours_S"


def measure_matched(args: Args, work: Path) -> dict:
    """SheepRL's DreamerV3 at our seed model's size against our contenders (`MATCHED_OURS`), and its size S against
    our default (`SIZE_S_PEER`, `SIZE_S_OURS`), one update at a time in turn (11 rounds after 2 warm-ups), so that
    the machine's load changes hit all of them alike."""
    from benchmark import peer_venv

    threads = ["--threads", str(args.threads)]
    peer_serve = [str(peer_venv.python()), str(BENCH_DIR / "peer_sheeprl.py"), "serve"]
    commands = {
        "peer": [*peer_serve, "--size", "matched", *threads, "--work-dir", str(work)],
        SIZE_S_PEER: [*peer_serve, "--size", "S", *threads, "--work-dir", str(work)],
    }
    for suffix, (options, _) in MATCHED_OURS.items():
        commands[f"ours{suffix}"] = [
            sys.executable,
            str(BENCH_DIR / "ours_dreamer.py"),
            "serve",
            *options,
            *threads,
        ]
    commands[SIZE_S_OURS] = [
        sys.executable,
        str(BENCH_DIR / "ours_dreamer.py"),
        "serve",
        "--model",
        "dreamerv3",
        *threads,
    ]
    log(
        "matched size: SheepRL DreamerV3 vs ours at 64 and 84 pixels, and each side's size S, alternating single "
        "updates"
    )
    from benchmark import bench_utils

    duel = bench_utils.alternate_updates(
        commands, rounds=MATCHED_ROUNDS, warmup=MATCHED_WARMUP, cwd=str(work)
    )
    out = {
        "matched": {**duel, "rounds": MATCHED_ROUNDS, "warmup_rounds": MATCHED_WARMUP},
        "matched_peer_update_ms": duel["peer"]["update_ms"],
        "matched_peer_params_total": duel["peer"]["info"]["params_total"],
    }
    for suffix in MATCHED_OURS:
        out[f"matched_update_ms{suffix}"] = duel[f"ours{suffix}"]["update_ms"]
        out[f"matched_params_total{suffix}"] = duel[f"ours{suffix}"]["info"]["params_total"]
    for key, name in (("size_s_peer", SIZE_S_PEER), ("size_s", SIZE_S_OURS)):
        out[f"{key}_update_ms"] = duel[name]["update_ms"]
        out[f"{key}_params_total"] = duel[name]["info"]["params_total"]
    return out


def add_ratios(result: dict) -> None:
    if result.get("peer") is None:
        return
    for key in PEER_KEYS:
        if key == "soak_turnovers":
            continue
        result[f"ratio_{key}"] = ratio(result[f"peer_{key}"], result[key])
    # slopes are noise around zero when nothing leaks: their ratio says nothing then
    if abs(result["soak_uss_slope_mb_per_10k"]) < TARGET_SOAK_MB_PER_10K:
        result["ratio_soak_uss_slope_mb_per_10k"] = None
    result["ratio_update_ms_v1"] = ratio(result.get("peer_v1_update_ms"), result["update_ms"])
    add_matched_ratios(result)


def add_matched_ratios(result: dict) -> None:
    """peer / ours for each of our matched-size contenders (`ratio_update_ms_matched` is the like-for-like one:
    the same pixels and parameter counts within 10 %) and for each side's size S (`ratio_update_ms_size_s`), overall
    and round by round."""
    for suffix in MATCHED_OURS:
        result[f"ratio_update_ms_matched{suffix}"] = ratio(
            result.get("matched_peer_update_ms"), result.get(f"matched_update_ms{suffix}")
        )
    result["ratio_update_ms_size_s"] = ratio(
        result.get("size_s_peer_update_ms"), result.get("size_s_update_ms")
    )
    if result.get("matched"):
        # the round-by-round ratios: each round's peer update against the ours updates next to it
        peer = result["matched"]["peer"]["samples_ms"]
        for suffix in MATCHED_OURS:
            ours = result["matched"][f"ours{suffix}"]
            ours["ratio_by_round"] = [round(p / o, 3) for p, o in zip(peer, ours["samples_ms"])]
            ours["params_to_peer"] = round(
                ours["info"]["params_total"] / result["matched_peer_params_total"], 4
            )
    if result.get("matched", {}).get(SIZE_S_OURS):  # results from before issue 64 have no size S
        peer, ours = result["matched"][SIZE_S_PEER], result["matched"][SIZE_S_OURS]
        ours["ratio_by_round"] = [round(p / o, 3) for p, o in zip(peer["samples_ms"], ours["samples_ms"])]
        ours["params_to_peer"] = round(ours["info"]["params_total"] / peer["info"]["params_total"], 4)


def verdicts(result: dict) -> dict:
    """Each target of the issue: met or not (None where the figure was not measured at the target's size:
    `--quick` fills a smaller replay, updates a smaller batch and soaks too briefly for a 1 MB per 10k slope)."""
    at_seed_size = not result["quick"]
    out = {
        "buffer_bytes_per_step <= 7200": (
            result["buffer_bytes_per_step"] <= TARGET_BYTES_PER_STEP if at_seed_size else None
        ),
        "sample_to_update_ratio <= 0.05": (
            result["sample_to_update_ratio"] <= TARGET_SAMPLE_TO_UPDATE if at_seed_size else None
        ),
        "soak_uss_slope_mb_per_10k <= 1": (
            result["soak_uss_slope_mb_per_10k"] <= TARGET_SOAK_MB_PER_10K if at_seed_size else None
        ),
        "soak_anon_slope_mb_per_10k <= 0.1": (
            result["soak_anon_slope_mb_per_10k"] <= TARGET_SOAK_ANON_MB_PER_10K
            if at_seed_size and result.get("soak_anon_slope_mb_per_10k") is not None
            else None
        ),
    }
    peer_anon = result.get("peer_soak_anon_slope_mb_per_10k")
    if at_seed_size and peer_anon is not None and result.get("soak_anon_slope_mb_per_10k") is not None:
        # the peer's soak covers the same window (PEER_SOAK) with the same kind of tiny model
        out["soak_anon_slope_mb_per_10k within 3x of the peer's"] = (
            result["soak_anon_slope_mb_per_10k"] <= TARGET_SOAK_TO_PEER * peer_anon
        )
    out.update(matched_verdicts(result))
    out.update(gpu_verdicts(result))
    return out


def matched_verdicts(result: dict) -> dict:
    """The speed targets at matched model size, where they were measured: each targeted row must be within 10 % of
    the peer's parameters and 1.5x faster; at size S, our default within 10 % of SheepRL dreamer_v3_S's parameters
    and not slower."""
    if result.get("ratio_update_ms_matched") is None:
        return {}
    out = {}
    for suffix in MATCHED_TARGETED:
        label = MATCHED_OURS[suffix][1].split(",")[0]
        size_ok = abs(result["matched"][f"ours{suffix}"]["params_to_peer"] - 1) <= MATCHED_PARAMS_TOLERANCE
        out[f"{label}: parameters within 10 % of SheepRL DreamerV3's"] = size_ok
        out[f"{label}: update >= 1.5x SheepRL DreamerV3's (its 64x64x3)"] = (
            size_ok and result[f"ratio_update_ms_matched{suffix}"] >= TARGET_UPDATE_SPEEDUP
        )
    if result.get("ratio_update_ms_size_s") is not None:
        size_ok = abs(result["matched"][SIZE_S_OURS]["params_to_peer"] - 1) <= MATCHED_PARAMS_TOLERANCE
        out["ours at size S (the defaults): parameters within 10 % of SheepRL dreamer_v3_S's"] = size_ok
        out["ours at size S: update not slower than SheepRL dreamer_v3_S's (both 64x64x3, 16 x 64)"] = (
            size_ok and result["ratio_update_ms_size_s"] >= TARGET_SIZE_S_SPEEDUP
        )
    return out


def matched_rows(result: dict, bold: bool = True) -> list[str]:
    """The matched-size table rows (figure | ours | SheepRL DreamerV3 | peer / ours | target), like for like
    first."""
    star = "**" if bold else ""
    rows = []
    for suffix, (_, label) in MATCHED_OURS.items():
        what = (
            "matched size and pixels"
            if suffix == ""
            else "matched size, ours at 84 pixels"
            if suffix == "_84"
            else "our seed model at 64 pixels (smaller)"
        )
        rows.append(
            f"| {star}one update, {what}, ms{star} ({label}; "
            f"{fmt(result[f'matched_params_total{suffix}'])} vs {fmt(result['matched_peer_params_total'])} "
            f"parameters) | {fmt(result[f'matched_update_ms{suffix}'])} | "
            f"{fmt(result['matched_peer_update_ms'])} | {star}{fmt(result[f'ratio_update_ms_matched{suffix}'])}"
            f"{star} | {'≥ 1.5' if suffix in MATCHED_TARGETED else 'context'} |"
        )
    if result.get("size_s_update_ms") is not None:
        rows.append(
            f"| {star}one update at size S, each side's own, ms{star} (ours: the defaults; SheepRL: its "
            f"`dreamer_v3_S`; both 64x64x3 frames, batch 16 x 64; {fmt(result['size_s_params_total'])} vs "
            f"{fmt(result['size_s_peer_params_total'])} parameters) | {fmt(result['size_s_update_ms'])} | "
            f"{fmt(result['size_s_peer_update_ms'])} | {star}{fmt(result['ratio_update_ms_size_s'])}{star} | "
            f"≥ {fmt(TARGET_SIZE_S_SPEEDUP)} |"
        )
    return rows


def gpu_verdicts(result: dict) -> dict:
    """The GPU targets, where they were measured: the seed config under 2 GiB of reserved GPU memory with bf16 and
    fp16, a flat GPU-allocated slope past capacity, the forensics check's outcomes, and the Pong run's return and
    wall time once it has reached 100k env steps."""
    out: dict = {}
    gpu, forensics = result.get("gpu") or {}, result.get("forensics") or {}
    if gpu.get("run", True) and gpu.get("amp"):
        at_seed_size = not result["quick"]
        for mode in ("fp16", "bf16"):  # the target: the seed config with mixed precision fits a 6 GB card
            peak = gpu["amp"].get(mode, {}).get("peak_reserved_mb")
            if peak is not None:
                out[f"GPU peak reserved with --amp {mode} < 2 GiB"] = (
                    peak < TARGET_GPU_PEAK_MB if at_seed_size else None
                )
        slope = gpu.get("loop", {}).get("gpu_alloc_slope_mb_per_10k")
        if slope is not None:
            out["GPU allocated flat past capacity (<= 1 MB per 10k)"] = (
                abs(slope) <= TARGET_GPU_SLOPE_MB_PER_10K
            )
    if "pong_env_steps" in result:
        done = result["pong_env_steps"] >= 100_000
        out["Pong: mean return of the last 10 episodes >= 18 at 100k env steps"] = (
            (result.get("pong_train_return_last_10") or -21) >= TARGET_PONG_RETURN if done else None
        )
        out["Pong: the final agent's evaluation >= 18 at 100k env steps"] = (
            (result.get("pong_final_return") or -21) >= TARGET_PONG_RETURN if done else None
        )
        out["Pong: 100k env steps within 25 minutes of training"] = (
            result["pong_wall_s"] <= TARGET_PONG_WALL_MIN * 60 if done else None
        )
    if forensics.get("run", True) and "snapshot_run" in forensics:
        analysis = forensics.get("analysis", {})
        out["forensics: analysis of a real run reads steady"] = (
            None
            if "skipped" in analysis
            else (analysis.get("returncode") == 0 and analysis.get("verdict", "").startswith("steady"))
        )
        for name in ("oom_in_update", "oom_in_preflight"):
            oom = forensics.get(name, {})
            if "skipped" not in oom:
                out[f"forensics: {name.replace('_', ' ')} exits {oom.get('expected_returncode')}"] = oom.get(
                    "returncode"
                ) == oom.get("expected_returncode")
        update = forensics.get("oom_in_update", {})
        if "skipped" not in update:
            out["forensics: OOM report, snapshot and checkpoint written"] = bool(
                {"report.json", "memory_summary.txt", "snapshot.pickle"} <= set(update.get("oom_files", {}))
                and update.get("checkpoint_written")
            )
    return out


# ---------------------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------------------
def markdown_table(result: dict) -> str:
    has_peer = result.get("peer") is not None
    rows = [
        ("replay bytes per stored Pong step", "buffer_bytes_per_step", "≤ 7,200"),
        ("replay bytes floor (frame + aux fields)", "buffer_bytes_limit", ""),
        (f"sample one batch, ms ({result['sample_batch']})", "sample_ms", ""),
        (f"one full update, ms ({result['update_batch']})", "update_ms", ""),
        ("sample / update (same batch shape)", "sample_to_update_ratio", "≤ 0.05"),
        (
            "sampling: most / least drawn position in an episode (windows cross episodes)",
            "sampling_position_max_to_min",
            "",
        ),
        (
            "the same under the old rule (windows inside one episode)",
            "sampling_position_max_to_min_within_episode_rule",
            "",
        ),
        ("sampling: draws per stored step, coefficient of variation", "sampling_draws_per_step_cv", ""),
        ("the same for draws by pure chance (Poisson)", "sampling_draws_poisson_cv", ""),
        ("soak: USS − replay, MB per 10k env steps", "soak_uss_slope_mb_per_10k", "≤ 1"),
        ("soak: resident anonymous − replay, MB per 10k", "soak_anon_slope_mb_per_10k", "≤ 0.1"),
        ("the same over the warm-up (the heap settling)", "soak_anon_slope_warmup_mb_per_10k", ""),
        ("soak: of which live malloc'd blocks − replay", "soak_heap_in_use_slope_mb_per_10k", ""),
        ("soak: of which outside malloc's live blocks", "soak_anon_outside_heap_slope_mb_per_10k", ""),
        ("soak: replay turnovers", "soak_turnovers", "≥ 10"),
        ("parameters (world model + actor + critic)", "params_total", ""),
    ]
    head = "| figure | ours |" + (" SheepRL DreamerV3 | peer / ours |" if has_peer else "") + " target |"
    lines = [head, "|---|---:|" + ("---:|---:|" if has_peer else "") + "---|"]
    if result.get("matched"):
        lines += matched_rows(result)  # the like-for-like figures first
    for label, key, target in rows:
        line = f"| {label} | {fmt(result.get(key))} |"
        if has_peer:
            peer_key = "peer_params_total" if key == "params_total" else f"peer_{key}"
            line += f" {fmt(result.get(peer_key))} | {fmt(result.get(f'ratio_{key}'))} |"
        lines.append(line + f" {target} |")
    if has_peer:
        lines.append(
            f"| SheepRL DreamerV1 update, ms (B16 x T50) | {fmt(result['update_ms'])} | "
            f"{fmt(result.get('peer_v1_update_ms'))} | {fmt(result.get('ratio_update_ms_v1'))} | |"
        )
        lines.append(
            f"| SheepRL DreamerV1 parameters | {fmt(result['params_total'])} | "
            f"{fmt(result.get('peer_v1_params_total'))} | | |"
        )
    if result["quick"]:
        lines.append("")
        lines.append(
            f"--quick: a replay of {result['buffer_capacity_steps']:,} steps (not 50k), the update at "
            f"{result['update_batch']} (not B16 x T50), a soak of {result['soak_config']['env_steps']:,} "
            f"env steps whose slope is measured after a warm-up of "
            f"{result['soak_config'].get('warmup_env_steps', 0):,}, over "
            f"{result['soak_config'].get('measured_env_steps', 0):,}; the targets are not judged."
        )
    lines.append("")
    lines.append("| DQN (StarCraft II split heads, built-in minigame) | value |")
    lines.append("|---|---:|")
    for key in (
        "dqn_env_steps_per_s_MoveToBeacon",
        "dqn_env_steps_per_s_CollectMineralShards",
        "dqn_greedy_steps_per_s_MoveToBeacon",
        "dqn_greedy_steps_per_s_CollectMineralShards",
        "dqn_updates_per_s",
        "dqn_buffer_bytes_per_step",
        "dqn_params",
    ):
        lines.append(f"| {key.removeprefix('dqn_').replace('_', ' ')} | {fmt(result.get(key))} |")
    if result.get("speed_trials"):
        lines += [
            "",
            (
                f"| speed trial ({result['speed_trials_batch']}, full update) | median ms | first update ms "
                "| speed-up |"
            ),
            "|---|---:|---:|---:|",
        ]
        for name, trial in result["speed_trials"].items():
            if "error" in trial:
                lines.append(f"| {name} | failed: {trial['error']} | | |")
            else:
                lines.append(
                    f"| {name} | {fmt(trial['update_ms'])} | {fmt(trial['first_update_ms'])} | "
                    f"{fmt(trial.get('speedup_vs_baseline'))} |"
                )
    lines += ["", targets_table(result["targets_met"])]
    return "\n".join(lines)


def matched_markdown(result: dict) -> list[str]:
    """What the matched-size comparison compares, and where it is not like for like."""
    if not result.get("matched"):
        return []
    m = result["matched"]
    peer = m["peer"]
    ours = [(m[f"ours{suffix}"], label) for suffix, (_, label) in MATCHED_OURS.items()]
    contenders = "; ".join(
        f"{label}: {o['info']['params_total']:,} parameters ({o['params_to_peer']:.3f} of the peer's), batch obs "
        f"{o['info']['obs']}, median {fmt(o['update_ms'])} ms (min-max {fmt(o['min_ms'])}-{fmt(o['max_ms'])}), "
        f"peer / ours round by round {min(o['ratio_by_round'])}-{max(o['ratio_by_round'])}"
        for o, label in ours
    )
    return [
        (
            f"- Matched size (the first rows): SheepRL DreamerV3 with `{' '.join(peer['info']['overrides'])}` "
            f"({peer['info']['params_total']:,} parameters; model {json.dumps(peer['info']['model'])}; batch "
            f"{json.dumps(peer['info']['batch'])}; median {fmt(peer['update_ms'])} ms, min-max {fmt(peer['min_ms'])}-"
            f"{fmt(peer['max_ms'])}) against {contenders}. All took turns, one update each, {m['rounds']} rounds "
            f"after {m['warmup_rounds']} warm-ups, the order rotating every round."
        ),
        (
            "- Not like for like: SheepRL's trainer takes only power-of-two frame sizes and no frame stack, so its "
            "batch holds 64x64 RGB frames (3 channels) where ours holds 4 stacked grey frames (4 channels); at 84 "
            "pixels ours reads about 1.7x the pixel positions. Its encoder has 4 convolutions whose channels double "
            f"from the multiplier ({peer['info']['model']['cnn_channels_multiplier']}) and a decoder that mirrors "
            "it; ours has NatureCNN's 3, and at 64 pixels with `--decoder-mid-channels 128` its decoder starts from "
            "the same 128 x 4 x 4 map as SheepRL's. SheepRL's imagination runs with autograd on, recording a graph "
            "through its RSSM at every imagined step; ours rolls the dynamics without gradients (our actor learns "
            "by REINFORCE on Atari's discrete actions and needs none). Both train in float32 with Adam (SheepRL "
            f"fused: {peer['info']['model']['fused_adam']}; ours fused)."
            + (
                " The unmatched rows below compare our seed model with SheepRL's Atari size S."
                if result.get("peer_v3")
                else ""
            )
        ),
        *size_s_markdown(result),
    ]


def size_s_markdown(result: dict) -> list[str]:
    """What the size-S row compares: each side's own DreamerV3 size S, and how close their parameter counts are."""
    if not result.get("matched", {}).get(SIZE_S_OURS):
        return []
    peer, ours = result["matched"][SIZE_S_PEER], result["matched"][SIZE_S_OURS]
    p, o = peer["info"], ours["info"]
    gap = o["params_total"] - p["params_total"]
    by_part = ", ".join(
        f"{part.replace('_', ' ')} {o[f'params_{part}']:,} vs {p[f'params_{part}']:,}"
        for part in ("world_model", "actor", "critic")
    )
    biases = o.get("params_biases_before_norms")
    why = (
        f" {biases:,} of ours are the biases of dense layers that a LayerNorm follows: ours keeps them, SheepRL's "
        "layers leave them out (the LayerNorm's own shift makes them redundant)"
        + (
            ", which is the whole difference."
            if biases == gap
            else f"; the other {gap - biases:,} differ elsewhere."
        )
        if biases is not None
        else ""
    )
    return [
        (
            f"- Size S (the last row), each side's own: ours is `dreamer_atari.Args()` as it is, model "
            f"{json.dumps(o['model'])}, batch obs {o['obs']}, {o['params_total']:,} parameters; SheepRL is "
            f"`{' '.join(p['overrides'])}` (its `dreamer_v3_S` preset), model {json.dumps(p['model'])}, batch "
            f"{json.dumps(p['batch'])}, {p['params_total']:,} parameters. Ours has {gap:+,} parameters "
            f"({ours['params_to_peer']:.4f} of SheepRL's; by part: {by_part}).{why} Medians: ours "
            f"{fmt(ours['update_ms'])} ms (min-max {fmt(ours['min_ms'])}-{fmt(ours['max_ms'])}), SheepRL "
            f"{fmt(peer['update_ms'])} ms (min-max {fmt(peer['min_ms'])}-{fmt(peer['max_ms'])}), peer / ours "
            f"{fmt(result['ratio_update_ms_size_s'])}, round by round {min(ours['ratio_by_round'])}-"
            f"{max(ours['ratio_by_round'])}, over {len(ours['samples_ms'])} samples each, taken in the same rounds "
            f"as the rows above. Both read the same frames (64x64 RGB, no stack) and batch. Precision: ours "
            f"{o.get('precision')}, SheepRL {p['model']['precision']}; fused Adam: ours {fmt(o.get('fused_adam'))}, "
            f"SheepRL {fmt(p['model']['fused_adam'])}. The difference left in the work: SheepRL's imagination "
            "records an autograd graph through its RSSM, ours rolls the dynamics without gradients."
        ),
    ]


def targets_table(targets: dict) -> str:
    return "\n".join(
        ["| target | met |", "|---|---|"] + [f"| {name} | {fmt(met)} |" for name, met in targets.items()]
    )


def time_taken(result: dict) -> str:
    """One sentence: the run's wall time and each stage's seconds (`stage_s`), so that a README can state what a run
    takes from a results file."""
    stages = "; ".join(f"{what} {fmt(seconds)}" for what, seconds in result.get("stage_s", {}).items())
    return f"Wall time {fmt(result['wall_s'] / 60)} minutes" + (
        f" (seconds per stage: {stages})." if stages else "."
    )


def results_markdown(result: dict, table: str, command: str) -> str:
    m = result["machine"]
    parts = [
        f"# Benchmark, {result['date']}, {m['cpu']}",
        "",
        (
            f"Command: `{command}`. Machine: {m['cpu']}, {m['cpu_count']} CPU cores, {m['platform']}, Python "
            f"{m['python']}, torch {m['torch']}; {result['threads']} torch thread(s) for every measurement, ours and "
            f"the peer's. Load average (1, 5, 15 min) at the start {fmt_load(result['load_average_start'])}, at the "
            f"end {fmt_load(result['load_average_end'])}. Medians of several repetitions after a warm-up (every "
            "sample is in the JSON file); one run, so the ratios carry this machine's noise. "
            + time_taken(result)
        ),
        "",
        table,
        "",
        "## Configurations",
        "",
        *matched_markdown(result),
        (
            f"- Ours: the seed configuration (`ours_dreamer.seed_args()`): model {json.dumps(result['model'])}; "
            f"replay of whole episodes, capacity {result['buffer_capacity_steps']:,} steps, filled with "
            f"{result['buffer_steps_stored']:,} real Pong steps (random actions, 2 envs) in "
            f"{result['buffer_episodes']} episodes; arrays per step: obs "
            f"{fmt(result['buffer_obs_bytes_per_step'])} B, aux {fmt(result['buffer_aux_bytes_per_step'])} B."
        ),
        (
            f"- Soak (ours): `dreamer_atari.main` with a tiny model {json.dumps(result['soak_config']['model'])}, "
            f"capacity {result['soak_config']['capacity_steps']} steps, {result['soak_config']['env_steps']:,} env "
            f"steps, {result['soak_config']['batch']}, {result['soak_config']['updates']} updates; USS and replay "
            "bytes as the script logs them (debug/cpu/uss_mb, buffer/replay/*), read back from its TensorBoard file; "
            f"slope = Theil-Sen over the points after a warm-up of "
            f"{result['soak_config'].get('warmup_env_steps', result['soak_config']['capacity_steps']):,} env steps "
            f"(the replay full, the first open-loop GIF made), over "
            f"{result['soak_config'].get('measured_env_steps', 0):,} env steps."
        ),
    ]
    if result.get("peer"):
        v3, v1 = result["peer_v3"], result.get("peer_v1") or {}
        measured = set(result["peer_config"]["overrides"])
        soak_only = [o for o in result["peer_soak_config"]["overrides"] if o not in measured]
        parts += [
            (
                f"- SheepRL {result['peer_versions']['sheeprl']} in its own virtual environment "
                f"(`benchmark/.peer-venv`: {', '.join(f'{k} {v}' for k, v in result['peer_versions'].items())}). "
                f"Hydra: `exp=dreamer_v3` (its Atari recipe, size S) or `exp=dreamer_v1`, with "
                f"`{' '.join(result['peer_config']['overrides'])}`. Its Atari observation is what it stores: "
                f"{json.dumps(result['peer_buffer_arrays'])} per step, bytes per step by key "
                f"{json.dumps(result['peer_buffer_bytes_per_step_by_key'])}, memory-mapped files "
                f"(`buffer.memmap={result['peer_buffer_memmap']}`, its default), buffer filled to "
                f"{result['peer_buffer_capacity_steps']:,} steps by its own training loop (random actions before "
                "`learning_starts`) and read back from its checkpoint."
            ),
            (
                f"- SheepRL DreamerV3 model: {json.dumps(v3['model'])}, {v3['params_total']:,} parameters; "
                f"DreamerV1: {json.dumps(v1.get('model'))}, {v1.get('params_total') or 0:,} parameters. Update = its "
                "`train()` (world model, actor, critic) plus the slow-critic EMA; sampling = its `sample_batches` "
                "(which also turns the batch into float tensors)."
            ),
            (
                f"- Soak (SheepRL): its own training loop (`run_algorithm`), the overrides above plus "
                f"`{' '.join(soak_only)}`; USS sampled every "
                f"{result['peer_soak_config']['sample_every_env_steps']} env steps by an `AtariPreprocessing` "
                "subclass set as its `env.wrapper._target_` (with `env.sync_env=True` the envs step in the training "
                "process)."
            ),
        ]
    parts += [
        "",
        "## What was tried for speed",
        "",
    ]
    if result.get("speed_trials"):
        parts.append(
            "The baseline is the script's defaults, which include channels-last convolution weights and "
            "inverse-CDF latent sampling (both adopted from earlier trials: same results, less time); the "
            "without_* trials take one of them back out. "
            "Each trial changes one thing from outside the script and times the same full update on the "
            "same batch (seed model, CPU), round robin over the variants after each one's first update; "
            "the compile cache starts empty, so a compiled variant's first update includes its compile "
            "time. Timings only: whether a variant (bf16 above all) learns as well was not checked here."
        )
        parts.append("")
        for name, trial in result["speed_trials"].items():
            if "error" in trial:
                parts.append(f"- {name}: failed ({trial['error']}).")
            else:
                parts.append(
                    f"- {name}: {fmt(trial['update_ms'])} ms per update, "
                    f"{fmt(trial.get('speedup_vs_baseline'))}x the baseline (first update "
                    f"{fmt(trial['first_update_ms'])} ms)."
                )
    parts += ["", gpu_markdown(result)]
    return "\n".join(parts) + "\n"


def gpu_only_markdown(result: dict, table: str, command: str) -> str:
    m = result["machine"]
    head = [
        f"# Benchmark (GPU only), {result['date']}, {m.get('gpu', 'no GPU')}",
        "",
        (
            f"Command: `{command}`. Machine: {m.get('gpu')}, {m['cpu']}, {m['cpu_count']} CPU cores, "
            f"{m['platform']}, Python {m['python']}, torch {m['torch']}. The CPU figures are in the CPU results "
            "files. " + time_taken(result)
        ),
        "",
        table,
        "",
    ]
    body = gpu_markdown(result) if "gpu" in result else ""
    return "\n".join(head) + body + "\n" + pong_markdown(result) + "\n"


def pong_markdown(result: dict) -> str:
    """The Atari100k Pong run: its command, where it stands, its curve."""
    if "pong_curve" not in result:
        return ""
    lines = [
        "## Pong, Atari100k recipe",
        "",
        (
            f"`{result['pong_command']}`"
            + (" (continued from its last checkpoint)" if result["pong_resumed"] else "")
            + f": exit {result['pong_returncode']} (143: stopped by its time budget after a checkpoint). "
            f"{result['pong_env_steps']:,} env steps, {result['pong_updates']:,} updates, "
            f"{fmt(result['pong_wall_s'])} s of training in all; mean return of the last 10 episodes "
            f"{fmt(result.get('pong_train_return_last_10'))}, of the final agent's evaluation "
            f"{fmt(result.get('pong_final_return'))}. Peak GPU reserved {fmt(result['pong_peak_gpu_reserved_mb'])} MB, "
            f"allocated {fmt(result['pong_peak_gpu_alloc_mb'])} MB; peak host RSS "
            f"{fmt(result['pong_peak_host_rss_mb'])} MB."
        ),
        "",
        "| env step | training s | updates | mean return, last 10 episodes | env steps/s | updates/s |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for p in result["pong_points"]:
        lines.append(
            f"| {p['env_step']:,} | {fmt(p['wall_s'])} | {p['updates']:,} | {fmt(p['mean_return_last10'])} "
            f"| {fmt(p.get('env_steps_per_s'))} | {fmt(p.get('updates_per_s'))} |"
        )
    return "\n".join(lines) + "\n"


def main(args: Args) -> dict:
    if args.threads < 1:
        fail(f"--threads must be at least 1, got {args.threads}.")
    if args.json is not None and not Path(args.json).resolve().parent.is_dir():
        fail(f"--json {args.json!r}: its folder does not exist.")
    if args.gpu_only:
        return main_gpu_only(args)
    if args.matched_only:
        return main_matched_only(args)
    code = code_version()  # the commit it runs, and whether the tree differs, before anything is written
    (BENCH_DIR / ".work").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="run-", dir=BENCH_DIR / ".work") as work:
        result = measure(args, Path(work))
    result["code"] = code
    result["date"] = time.strftime("%Y-%m-%d")
    add_ratios(result)
    result["targets_met"] = verdicts(result)
    missing = [k for k in REQUIRED_KEYS if not isinstance(result.get(k), (int, float))]
    if missing:
        raise RuntimeError(f"figures missing from the run: {missing}")
    table = markdown_table(result)
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if not args.quick:
        gpu_or_cpu = result["machine"].get("gpu") or result["machine"]["cpu"]
        stem = new_results_stem(args.results_dir, f"{result['date']}-{slug(gpu_or_cpu)}")
        command = "python benchmark/run.py" + (f" --peer {args.peer}" if args.peer else "")
        Path(f"{stem}.md").write_text(
            results_markdown(result, table, command) + "\n" + code_markdown(code) + "\n"
        )
        Path(f"{stem}.json").write_text(json.dumps(result, indent=2))
        log(f"wrote {stem}.md and {stem}.json")
    return result


def main_matched_only(args: Args) -> dict:
    from benchmark import bench_utils

    if args.peer != "sheeprl":
        fail("--matched-only compares with the peer: add --peer sheeprl.")
    if args.quick:
        fail("--matched-only has no --quick form (it measures the seed model's update).")
    from benchmark import peer_venv

    started = time.time()
    stage_s: dict[str, float] = {}
    result: dict = {
        "threads": args.threads,
        "load_average_start": os.getloadavg(),
        "peer": "sheeprl",
        "code": code_version(),  # the commit it runs, and whether the tree differs
    }
    with timed(stage_s, PEER_ENV_STAGE):
        result["peer_versions"] = peer_venv.ensure(log=log)
    result["machine"] = bench_utils.machine()
    (BENCH_DIR / ".work").mkdir(exist_ok=True)
    with (
        tempfile.TemporaryDirectory(prefix="run-", dir=BENCH_DIR / ".work") as work,
        timed(stage_s, MATCHED_STAGE),
    ):
        result.update(measure_matched(args, Path(work)))
    result["load_average_end"] = os.getloadavg()
    result["wall_s"] = time.time() - started
    result["stage_s"] = stage_s
    result["date"] = time.strftime("%Y-%m-%d")
    add_matched_ratios(result)
    result["targets_met"] = matched_verdicts(result)
    m = result["machine"]
    command = "python benchmark/run.py --peer sheeprl --matched-only"
    table = "\n".join(
        [
            "| figure | ours | SheepRL DreamerV3 | peer / ours | target |",
            "|---|---:|---:|---:|---|",
            *matched_rows(result, bold=False),
            "",
            targets_table(result["targets_met"]),
        ]
    )
    print(table)
    text = "\n".join(
        [
            f"# Matched-size update time, {result['date']}, {m['cpu']}",
            "",
            (
                f"Command: `{command}`. Machine: {m['cpu']}, {m['cpu_count']} CPU cores, {m['platform']}, Python "
                f"{m['python']}, torch {m['torch']}; {args.threads} torch thread(s) for each side. Load average (1, 5, "
                f"15 min) at the start {fmt_load(result['load_average_start'])}, at the end "
                f"{fmt_load(result['load_average_end'])}. Every sample is in the JSON file. "
                + time_taken(result)
            ),
            "",
            table,
            "",
            "## Configuration",
            "",
            *matched_markdown(result),
            "",
            code_markdown(result["code"]),
            "",
        ]
    )
    stem = new_results_stem(args.results_dir, f"{result['date']}-{slug(m.get('gpu') or m['cpu'])}-matched")
    Path(f"{stem}.md").write_text(text)
    Path(f"{stem}.json").write_text(json.dumps(result, indent=2))
    log(f"wrote {stem}.md and {stem}.json")
    return result


def main_gpu_only(args: Args) -> dict:
    check_gpu_only_device(args)
    if args.pong_minutes < 0:
        fail(f"--pong-minutes must be 0 or more, got {args.pong_minutes}.")
    if args.pong_only and args.pong_minutes == 0:
        fail("--pong-only with --pong-minutes 0 would do nothing.")
    code = code_version()  # the commit it runs, and whether the tree differs, before anything is written
    (BENCH_DIR / ".work").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="run-", dir=BENCH_DIR / ".work") as work:
        result = measure_gpu_only(args, Path(work))
    result["code"] = code
    result["date"] = time.strftime("%Y-%m-%d")
    result["targets_met"] = gpu_verdicts(result)
    table = targets_table(result["targets_met"])
    print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    if not args.quick:
        stem = new_results_stem(args.results_dir, f"{result['date']}-{slug(result['machine']['gpu'])}")
        text = gpu_only_markdown(result, table, "python benchmark/run.py --gpu-only")
        Path(f"{stem}.md").write_text(text + "\n" + code_markdown(code) + "\n")
        Path(f"{stem}.json").write_text(json.dumps(result, indent=2))
        log(f"wrote {stem}.md and {stem}.json")
    return result


if __name__ == "__main__":
    main(tyro.cli(Args))
