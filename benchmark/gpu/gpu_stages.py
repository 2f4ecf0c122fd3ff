"""The GPU stages of `run.py --gpu-only --stage update pong`, and the Pong run that `--gpu-only` runs.

    python benchmark/run.py --gpu-only --stage update            # the update variants at B16 x T64 (<= 4 min)
    python benchmark/run.py --gpu-only --stage pong              # the Atari100k Pong run, its curve, its evaluation
    python benchmark/run.py --gpu-only --stage update pong --budget-minutes 9.6
    python benchmark/run.py --gpu-only --stage update pong --device cpu --quick   # the same steps, tiny, no GPU

One results file, `<results-dir>/<date>-<gpu>.json` and `.md`, rewritten whenever a step ends (each update variant,
each --pong-curve-every env steps of the Pong run, its evaluation), so that a run stopped at any point leaves what it
had measured; beside it the Pong curve as a PNG and the Pong run's first and last open-loop predictions as PNG
strips. Each stage runs in its own process: `update_variants.py` (killed at --update-minutes), `dreamer_atari.py`
(stopped with SIGTERM at --pong-minutes: it writes a checkpoint and exits 143), `pong_eval.py`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmark.common import (
    BENCH_DIR,
    COMPILED_VARIANT,
    CUDA_FAST_PATH,
    PONG_QUICK,
    PONG_QUICK_RESUMABLE,
    PONG_RECIPE,
    PONG_RESUMABLE,
    ROOT,
    UPDATE_VARIANTS,
    Args,
    check_gpu_only_device,
    fail,
    fmt,
    fmt_load,
    log,
    new_results_stem,
    slug,
)

# the speed issue's targets (an update in 5 ms): (figure, result key, must, moonshot, direction)
TARGETS = (
    ("one update, B16 x T64, median, as training runs it (ms)", "update_ms_b16_t64", 6.0, 4.0, "<="),
    ("CUDA kernels per update, B16 x T64", "kernels_per_update", 2_000, 1_000, "<="),
    ("everything outside the update, per env step (ms)", "outside_update_ms_per_env_step", 1.5, 0.7, "<="),
    ("Pong training loop, Atari100k recipe, env steps/s", "pong_env_steps_per_s", 130.0, 170.0, ">="),
    ("Pong: 100k env steps, start-up and compile included (min)", "pong_wall_min_100k", 13.0, 10.0, "<="),
    ("Pong return after 100k env steps (final agent, evaluated)", "pong_final_return", 15.0, 18.0, ">="),
)
PONG_TARGET_STEPS = 100_000
QUICK_RESULTS_DIR = BENCH_DIR / ".work" / "quick-results"  # --quick: never among the committed results
EVAL_OVERHEAD_S = 30.0  # the evaluation's start-up and the last files
SIGTERM_GRACE_S = 30.0  # the Pong run's checkpoint and exit after SIGTERM, before it is killed


def check_staged_args(args: Args) -> None:
    """One sentence and exit status 2 for each bad combination, before anything starts."""

    check_gpu_only_device(args)
    if args.pong_only:
        fail("--pong-only is the Pong run of the full suite; with --stage, ask for --stage pong.")
    if len(set(args.stage)) != len(args.stage):
        fail(f"--stage names a stage twice: {' '.join(args.stage)}.")
    if "update" in args.stage and not args.update_minutes > 0:
        fail(f"--update-minutes must be greater than 0, got {args.update_minutes}.")
    if "pong" in args.stage and not args.pong_minutes > 0:
        fail(f"--stage pong needs --pong-minutes greater than 0, got {args.pong_minutes}.")
    if args.budget_minutes is not None and not args.budget_minutes > 0:
        fail(f"--budget-minutes must be greater than 0, got {args.budget_minutes}.")
    if args.pong_curve_every < 1:
        fail(f"--pong-curve-every must be at least 1, got {args.pong_curve_every}.")
    if args.pong_eval_episodes < 0:
        fail(f"--pong-eval-episodes must be 0 or more, got {args.pong_eval_episodes}.")
    if not args.pong_eval_minutes > 0:
        fail(f"--pong-eval-minutes must be greater than 0, got {args.pong_eval_minutes}.")
    check_pong_args(args)


def check_pong_args(args: Args) -> None:
    try:
        shlex.split(args.pong_args)
    except ValueError as exc:
        fail(f"--pong-args {args.pong_args!r} cannot be split into flags ({exc}).")
    runs = Path(args.pong_dir) / "runs"
    if not args.pong_resumable and runs.is_dir() and any(runs.iterdir()):
        fail(
            f"--no-pong-resumable starts a new run, and --pong-dir {args.pong_dir!r} already holds one: give an "
            "empty --pong-dir."
        )


class Results:
    """The results file of one staged run: JSON (every figure and sample) and markdown, rewritten on each save."""

    def __init__(self, stem: Path, result: dict):
        self.stem, self.result = stem, result

    def save(self) -> None:
        self.result["saved_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        self.result["targets"] = targets(self.result)
        tmp = self.stem.with_name(self.stem.name + ".json.tmp")
        tmp.write_text(json.dumps(self.result, indent=1, default=str))
        tmp.replace(self.stem.with_name(self.stem.name + ".json"))  # a reader never sees half a file
        self.stem.with_name(self.stem.name + ".md").write_text(staged_markdown(self.result))


def main_staged(args: Args) -> dict:
    from benchmark import bench_utils

    check_staged_args(args)
    started = time.time()
    deadline = started + args.budget_minutes * 60 if args.budget_minutes else None
    machine = bench_utils.machine()
    on_cuda = args.device == "cuda"
    date = time.strftime("%Y-%m-%d")
    results_dir = args.results_dir
    if args.quick and Path(results_dir).resolve() == (BENCH_DIR / "results").resolve():
        results_dir = str(QUICK_RESULTS_DIR)
    stem = new_results_stem(results_dir, f"{date}-{slug(machine.get('gpu') if on_cuda else machine['cpu'])}")
    result: dict = {
        "date": date,
        "gpu_name": machine.get("gpu") if on_cuda else None,
        "machine": machine,
        "command": command_line(args),
        "stages": list(args.stage),
        "quick": args.quick,
        "device": args.device,
        "budget_minutes": args.budget_minutes,
        "load_average_start": os.getloadavg(),
        "results_stem": stem.name,
    }
    results = Results(stem, result)
    results.save()
    log(f"results: {stem}.json and .md, rewritten as each step ends")
    (BENCH_DIR / ".work").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="stages-", dir=BENCH_DIR / ".work") as work:
        fast_path: dict = {}
        for stage in args.stage:
            if stage == "update":
                run_update_stage(args, Path(work), result, results.save, deadline)
                fast_path = faster_path(result)
            else:
                pong = run_pong(
                    args,
                    progress=lambda figures: (result.update(figures), results.save()),
                    deadline=deadline,
                    images_to=stem,
                    fast_path=fast_path,
                )
                result.update(pong)
            results.save()
    result["load_average_end"] = os.getloadavg()
    result["wall_s"] = time.time() - started
    results.save()
    print(targets_markdown(result["targets"]))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    log(f"wrote {stem}.json and {stem}.md")
    return result


def command_line(args: Args) -> str:
    """The command as typed, with this machine's folders replaced by their roles."""
    text = " ".join(["python", "benchmark/run.py", *sys.argv[1:]])
    for path, name in ((args.results_dir, "RESULTS_DIR"), (args.pong_dir, "PONG_DIR"), (args.json, "JSON")):
        if path:
            text = text.replace(str(path), name)
    return text


# ---------------------------------------------------------------------------------------------------------
# (a) the update variants
# ---------------------------------------------------------------------------------------------------------
def run_update_stage(
    args: Args, work: Path, result: dict, save: Callable[[], None], deadline: float | None
) -> None:
    """update_variants.py in its own process, killed at --update-minutes (or what the budget leaves); what it has
    written so far is read back every few seconds and saved."""
    out, log_path = work / "update_variants.json", work / "update_variants.log"
    cap_s = args.update_minutes * 60
    if deadline is not None:
        cap_s = min(cap_s, deadline - time.time())
    quick = ["--quick"] if args.quick else []
    cmd = [
        sys.executable,
        str(BENCH_DIR / "gpu" / "update_variants.py"),
        "--out",
        str(out),
        "--device",
        args.device,
        *quick,
        "--threads",
        str(args.threads),
        *(["--variants", *args.update_variants] if args.update_variants else []),
    ]
    # a fresh compile cache: compiled variants show what compiling costs a new user
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor-update")}
    result["update_command"] = " ".join(
        [
            "python",
            "benchmark/gpu/update_variants.py",
            "--device",
            args.device,
            *quick,
            *cmd[cmd.index("--threads") :],
        ]
    )
    result["update_cap_s"] = cap_s
    started, seen, stopped = time.time(), None, False
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        while True:
            try:
                returncode = process.wait(timeout=1.0 if args.quick else 3.0)
                break
            except subprocess.TimeoutExpired:
                pass
            if not stopped and time.time() - started >= cap_s:
                process.kill()  # nothing to save on its side: it rewrites its JSON after every variant
                stopped = True
            stamp = out.stat().st_mtime_ns if out.exists() else None
            if stamp != seen:
                seen = stamp
                merge_update_figures(result, out, final=False)
                save()
    result["update_returncode"] = returncode
    result["update_stopped_by_cap"] = stopped
    result["update_wall_s"] = time.time() - started
    result["update_log_tail"] = log_path.read_text().splitlines()[-40:]
    merge_update_figures(
        result,
        out,
        final=True,
        why_missing=(
            f"not measured: the stage's time cap ({cap_s:.0f} s) came first"
            if stopped
            else f"not measured: update_variants.py ended with exit status {returncode}"
        ),
    )
    log(
        f"update variants: {result['update_wall_s']:.0f} s, exit {returncode}"
        + (" (stopped by its time cap)" if stopped else "")
    )
    save()


def merge_update_figures(result: dict, out: Path, final: bool, why_missing: str = "") -> None:
    try:
        data = json.loads(out.read_text())
    except (OSError, ValueError):
        data = {"variants": {}}
    variants = data.setdefault("variants", {})
    if final:
        for name in ["training", *(name for name, _ in UPDATE_VARIANTS)]:
            variants.setdefault(name, {"skipped": why_missing})
    result["update"] = data
    training = variants.get("training", {})
    measured = {name: v for name, v in variants.items() if "update_ms" in v}
    fastest = min(measured, key=lambda name: measured[name]["update_ms"]) if measured else None
    result.update(
        {
            "update_batch": data.get("batch"),
            "update_ms_b16_t64": training.get("update_ms"),
            "kernels_per_update": training.get("kernels_per_update"),
            "kernels_counted_as": training.get("kernels_counted_as"),
            "update_fastest_variant": fastest,
            "update_ms_fastest": measured[fastest]["update_ms"] if fastest else None,
            "update_sample_ms": data.get("sample_ms"),
            "outside_update_ms_per_env_step": data.get("outside_update_ms_per_env_step"),
            "peak_gpu_reserved_mb_fp32": variants.get("fp32", {}).get("peak_gpu_reserved_mb"),
            "peak_gpu_reserved_mb_tf32": variants.get("tf32", {}).get("peak_gpu_reserved_mb"),
            "peak_gpu_reserved_mb_bf16": variants.get("bf16", {}).get("peak_gpu_reserved_mb"),
        }
    )


PLANNED_UPDATES = 30_000  # the updates a lease's Pong run aims at: what a compile's warm-up is spread over


def faster_path(result: dict) -> dict:
    """The Pong run's extra fields from the update stage: {"compile": True} where the default's update with --compile
    (COMPILED_VARIANT) beat it as measured, its warm-up spread over PLANNED_UPDATES updates counted in; else none.
    Said in the results as `pong_fast_path`."""
    variants = (result.get("update") or {}).get("variants", {})

    def cost_s(name: str) -> float | None:
        entry = variants.get(name, {})
        if entry.get("update_ms") is None:
            return None
        return entry["update_ms"] / 1000 * PLANNED_UPDATES + sum(entry.get("warmup_calls_s") or [0.0])

    eager, compiled = cost_s("training"), cost_s(COMPILED_VARIANT)
    if eager is None or compiled is None:
        result["pong_fast_path"] = "the default's: the update stage measured no pair to choose from"
        return {}
    faster = compiled < eager
    result["pong_fast_path"] = (
        f"{'--compile' if faster else 'the default (no --compile)'}: {PLANNED_UPDATES:,} updates and their warm-up "
        f"would take {compiled:.0f} s with --compile against {eager:.0f} s without"
    )
    return {"compile": True} if faster else {}


# ---------------------------------------------------------------------------------------------------------
# (b) the Atari100k Pong run
# ---------------------------------------------------------------------------------------------------------
def args_flags(fields: dict) -> tuple[list[str], list[str]]:
    """dreamer_atari.py flags for these Args fields, and the fields this version of the script lacks (left out)."""
    import dreamer_atari as da

    known = {field.name for field in dataclasses.fields(da.Args)}
    flags, missing = [], []
    for name, value in fields.items():
        if name not in known:
            missing.append(name)
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + name.replace("_", "-"))
        elif isinstance(value, (tuple, list)):
            flags += [flag, *(str(v) for v in value)]
        else:
            flags += [flag, str(value)]
    return flags, missing


def pong_fields(args: Args, fast_path: dict | None = None) -> dict:
    """The Pong run's Args fields: the recipe, resumable checkpoints or not, --quick's tiny sizes, the device's, and
    the update stage's faster path (`faster_path`)."""
    on_cuda = args.device == "cuda"
    fields = {**PONG_RECIPE, **(PONG_RESUMABLE if args.pong_resumable else {})}
    if args.quick:
        fields.update({**PONG_QUICK, **(PONG_QUICK_RESUMABLE if args.pong_resumable else {})})
    fields.update(CUDA_FAST_PATH if on_cuda else {"cuda": False})
    return {**fields, **(fast_path or {})}


def read_curve(run_dir: Path | None) -> tuple[dict, dict] | None:
    """The run's curve and its scalars so far (None before its first log point, or when the file is mid-write)."""
    from benchmark import pong_curve

    if run_dir is None or not run_dir.is_dir():
        return None
    try:
        scalars = pong_curve.read_events(str(run_dir))
        if not scalars.get("charts/SPS"):
            return None
        return pong_curve.curve(scalars), scalars
    except Exception:  # noqa: BLE001 - a file being written: read it again at the next poll
        return None


def pong_figures(curve: dict, scalars: dict, learning_starts: int, launched: float, resumed: bool) -> dict:
    """The curve's figures: each log point, the steady training rate, memory peaks, start-up time."""
    from benchmark import pong_curve

    points = curve["points"]
    last = points[-1]
    training = [p for p in points if p["env_step"] > learning_starts]
    rate = None
    if len(training) >= 2 and training[-1]["wall_s"] > training[0]["wall_s"]:
        # from the first log point after updates began (the interval with compiling and capture is left out)
        rate = (training[-1]["env_step"] - training[0]["env_step"]) / (
            training[-1]["wall_s"] - training[0]["wall_s"]
        )

    def peak(key: str) -> float | None:
        values = [p[key] for p in points if p.get(key) is not None]
        return max(values) if values else None

    # start-up of this invocation: launch to its first log point, less the loop's own time until then
    this_part = [(step, wall) for step, wall, _ in scalars["charts/SPS"] if wall >= launched]
    startup_s = None
    if this_part and not resumed:
        first = next(p for p in points if p["env_step"] == this_part[0][0])
        startup_s = this_part[0][1] - launched - first["wall_s"]
    keys = (
        "env_step",
        "wall_s",
        "updates",
        "mean_return_last10",
        "ball_f1_observed",
        "ball_f1_open_loop_5",
        "ball_f1_open_loop_10",
        "ball_f1_chance_open_loop_5",
        "image_loss_per_frame",
        "kl_nats",
        "actor_entropy",
        "episodes",
        "env_steps_per_s",
        "updates_per_s",
        "peak_gpu_reserved_mb",
        "gpu_alloc_mb",
        "host_rss_mb",
    )
    dreamerv3 = pong_curve.reference()
    figures = {
        # the curves drawn beside ours on the plot: DreamerV3's own runs, from the score file this names
        "pong_reference": dreamerv3["source"] if dreamerv3 else None,
        "pong_curve": [{key: p.get(key) for key in keys} for p in points],
        "pong_points": points,
        "pong_episode_returns": curve["episode_returns"],
        "pong_env_steps": last["env_step"],
        "pong_updates": last["updates"],
        "pong_wall_s": last["wall_s"],
        "pong_train_return_last_10": last["mean_return_last10"],
        "pong_env_steps_per_s": rate,
        "pong_startup_s": startup_s,
        "pong_peak_gpu_reserved_mb": peak("peak_gpu_reserved_mb"),
        "pong_peak_gpu_alloc_mb": peak("peak_gpu_alloc_mb"),
        "pong_peak_host_rss_mb": peak("host_rss_mb"),
    }
    reached = [p for p in points if p["env_step"] >= PONG_TARGET_STEPS]
    if reached and startup_s is not None:
        figures["pong_wall_min_100k"] = (reached[0]["wall_s"] + startup_s) / 60
        figures["pong_wall_min_100k_how"] = "measured: start-up, compile and training to 100k env steps"
    elif rate and startup_s is not None:
        figures["pong_wall_min_100k"] = (
            startup_s + last["wall_s"] + (PONG_TARGET_STEPS - last["env_step"]) / rate
        ) / 60
        figures["pong_wall_min_100k_how"] = (
            f"projected: start-up and {last['env_step']:,} env steps as measured, the rest at the steady rate"
        )
    return figures


def gpu_utilization_reader() -> Callable[[], float | None] | None:
    """GPU 0's utilisation in percent, read through NVML (no CUDA context in this process); None without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    except Exception:  # noqa: BLE001 - a missing figure, not a failed run
        return None

    def read() -> float | None:
        try:
            return float(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
        except Exception:  # noqa: BLE001
            return None

    return read


def events_size(run_dir: Path | None) -> int:
    """Bytes of the run's TensorBoard files: the curve is read again only when they grew."""
    if run_dir is None or not run_dir.is_dir():
        return 0
    return sum(p.stat().st_size for p in run_dir.glob("events.out.tfevents.*"))


def newest_run_dir(pong_dir: Path) -> Path | None:
    runs = [p for p in (pong_dir / "runs").iterdir() if p.is_dir()] if (pong_dir / "runs").is_dir() else []
    return max(runs, key=lambda p: p.stat().st_mtime) if runs else None


def run_pong(
    args: Args,
    progress: Callable[[dict], None] | None = None,
    deadline: float | None = None,
    images_to: Path | None = None,
    fast_path: dict | None = None,
) -> dict:
    """Run (or continue) the Atari100k Pong run for --pong-minutes (less where the budget leaves less), then stop
    it with SIGTERM, which makes the script write a checkpoint and exit 143. Every --pong-curve-every env steps its
    curve so far goes to `progress`; at the end its final agent is evaluated (pong_eval.py)."""
    import dreamer_atari as da

    pong_dir = Path(args.pong_dir).resolve()
    (pong_dir / "runs").mkdir(parents=True, exist_ok=True)
    checkpoints = sorted(pong_dir.glob("runs/*/checkpoint.pt"), key=lambda p: p.stat().st_mtime)
    resume = checkpoints[-1] if (checkpoints and args.pong_resumable) else None
    fields = pong_fields(args, fast_path)
    flags, missing = args_flags(fields)
    cmd = [sys.executable, str(ROOT / "dreamer_atari.py"), *flags, *shlex.split(args.pong_args)]
    if resume is not None:
        cmd += ["--resume", str(resume)]
    cap_s = args.pong_minutes * 60
    reserve_s = (
        (args.pong_eval_minutes * 60 if args.pong_eval_episodes else 0.0) + EVAL_OVERHEAD_S + SIGTERM_GRACE_S
    )
    if deadline is not None:
        cap_s = min(cap_s, deadline - time.time() - reserve_s)
    shown = " ".join(["python", "dreamer_atari.py", *cmd[2:]]).replace(str(pong_dir), "PONG_DIR")
    out: dict = {
        "pong_command": shown,
        "pong_config": {k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()},
        "pong_fields_not_in_this_version": missing,
        "pong_extra_args": args.pong_args,
        "pong_resumed": resume is not None,
        "pong_cap_s": cap_s,
    }
    if cap_s < 30:
        out["pong_skipped"] = f"not run: {cap_s:.0f} s were left for it in --budget-minutes"
        log(out["pong_skipped"])
        return out
    learning_starts = fields.get("learning_starts", da.Args().learning_starts)
    every = 100 if args.quick else args.pong_curve_every  # --quick: each log point of its tiny run
    log_path = pong_dir / "train.log"
    cache = tempfile.mkdtemp(prefix="inductor-", dir=pong_dir)  # compiling counts in the run's start-up time
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline", "TORCHINDUCTOR_CACHE_DIR": cache}
    if args.device == "cpu":
        # --threads, as every CPU measurement here (more threads only contend on a busy machine)
        env["OMP_NUM_THREADS"] = str(args.threads)
    writes: list[dict] = []
    out["pong_curve_writes"] = writes
    next_write = every
    launched = time.time()
    run_dir = resume.parent if resume is not None else None
    stopped_at, seen_size = None, 0
    utilization = gpu_utilization_reader() if args.device == "cuda" else None
    busy: list[list[float]] = []  # [seconds since launch, GPU utilisation %] at each poll
    if utilization is not None:
        out["pong_gpu_utilization"] = {"source": "NVML, every poll of the run (5 s)", "samples": busy}

    def write_curve(read: tuple[dict, dict] | None, running: bool) -> None:
        if read is None:
            return
        out.update(pong_figures(*read, learning_starts, launched, resume is not None))
        out["pong_log_tail"] = log_path.read_text(errors="replace").splitlines()[-40:]
        writes.append(
            {
                "env_step": out["pong_env_steps"],
                "training_running": running,
                "s_since_launch": round(time.time() - launched, 1),
            }
        )
        if images_to is not None:
            plot_curve(read[0], images_to, out["pong_env_steps"])
        if progress is not None:
            progress(out)

    with open(log_path, "a") as log_file:
        process = subprocess.Popen(cmd, cwd=pong_dir, stdout=log_file, stderr=subprocess.STDOUT, env=env)
        while True:
            try:
                returncode = process.wait(timeout=1.0 if args.quick else 5.0)
                break
            except subprocess.TimeoutExpired:
                pass
            now = time.time()
            if utilization is not None:
                busy.append([round(now - launched, 1), utilization()])
            if stopped_at is None and now - launched >= cap_s:
                process.send_signal(signal.SIGTERM)  # the script checkpoints and exits 128 + 15
                stopped_at = now
            elif stopped_at is not None and now - stopped_at > SIGTERM_GRACE_S:
                process.kill()  # it did not reach its checkpoint in time
            if run_dir is None:
                newest = newest_run_dir(pong_dir)
                run_dir = newest if newest is not None and newest.stat().st_mtime >= launched - 1 else None
            size = events_size(run_dir)
            if stopped_at is not None or size == seen_size:
                continue
            seen_size = size
            read = read_curve(run_dir)
            if read is not None and read[0]["points"][-1]["env_step"] >= next_write:
                step = read[0]["points"][-1]["env_step"]
                next_write = (step // every + 1) * every
                write_curve(read, running=process.poll() is None)
    out["pong_process_wall_s"] = time.time() - launched
    out["pong_returncode"] = returncode
    log(f"pong: {out['pong_process_wall_s']:.0f} s, exit {returncode}")
    out["pong_log_tail"] = log_path.read_text(errors="replace").splitlines()[-40:]
    shutil.rmtree(cache, ignore_errors=True)
    run_dir = run_dir or newest_run_dir(pong_dir)
    # SIGTERM before the script installed its handler: stopped, no checkpoint
    stopped_early = stopped_at is not None and returncode == -signal.SIGTERM
    if returncode not in (0, 128 + signal.SIGTERM) and not stopped_early:
        out["pong_error"] = f"the Pong run failed (exit {returncode})"
        if progress is None:
            raise RuntimeError(f"{out['pong_error']}:\n" + "\n".join(out["pong_log_tail"][-25:]))
    write_curve(read_curve(run_dir), running=False)
    if images_to is not None and run_dir is not None:
        out["pong_open_loop_images"] = open_loop_images(run_dir, images_to)
    if args.pong_eval_episodes and run_dir is not None:
        out.update(evaluate(args, run_dir / "checkpoint.pt", pong_dir))
    out.setdefault("pong_final_return", None)
    if progress is not None:
        progress(out)
    return out


def evaluate(args: Args, checkpoint: Path, pong_dir: Path) -> dict:
    """pong_eval.py on the final checkpoint: --pong-eval-episodes episodes at once, the script's own Player."""
    if not checkpoint.is_file():
        return {"pong_final_return": None, "pong_eval": {"skipped": "no checkpoint was written"}}
    out = pong_dir / "eval.json"
    out.unlink(missing_ok=True)  # an earlier invocation's evaluation is never read as this one's
    quick = ["--max-episode-steps", "100", "--vector-mode", "sync"] if args.quick else []
    cmd = [
        sys.executable,
        str(BENCH_DIR / "pong_eval.py"),
        str(checkpoint),
        "--out",
        str(out),
        "--episodes",
        str(args.pong_eval_episodes),
        "--device",
        args.device,
        "--minutes",
        str(args.pong_eval_minutes),
        *quick,
    ]
    started = time.time()
    try:
        done = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            cwd=ROOT,
            check=False,
            timeout=args.pong_eval_minutes * 60 + EVAL_OVERHEAD_S,
        )
    except subprocess.TimeoutExpired:
        return {"pong_final_return": None, "pong_eval": {"skipped": "the evaluation outran its time cap"}}
    if done.returncode != 0 or not out.exists():
        tail = (done.stdout + done.stderr).strip().splitlines()[-5:]
        return {
            "pong_final_return": None,
            "pong_eval": {"skipped": f"exit {done.returncode}", "output_tail": tail},
        }
    evaluation = json.loads(out.read_text())
    evaluation["command"] = " ".join(["python", "benchmark/pong_eval.py", "CHECKPOINT", *cmd[3:]]).replace(
        str(out), "EVAL_JSON"
    )
    evaluation["process_wall_s"] = time.time() - started
    log(
        f"evaluation: {evaluation['finished']}/{evaluation['asked']} episodes, mean return "
        f"{fmt(evaluation['mean_return'])}"
    )
    return {
        "pong_final_return": evaluation["mean_return"],
        "pong_eval_returns": evaluation["returns"],
        "pong_eval": evaluation,
    }


def plot_curve(curve: dict, stem: Path, env_steps: int) -> None:
    from benchmark import pong_curve

    try:
        pong_curve.plot(
            curve,
            str(stem.with_name(stem.name + "_pong_curve.png")),
            f"ALE/Pong-v5, Atari100k recipe, {env_steps:,} env steps",
        )
    except Exception as exc:  # noqa: BLE001 - a figure that fails to draw never stops the run
        log(f"the curve PNG was not drawn ({type(exc).__name__}: {exc})")


# env steps whose open-loop predictions are kept as pictures beside the results: where Pong is decided (DreamerV3's
# runs are at -21 to -20 at 10k and pass -15 between 15k and 30k); four, so that a lease's files stay within 8
OPEN_LOOP_PICTURE_STEPS = (5_000, 10_000, 20_000, 30_000)


def open_loop_images(run_dir: Path, stem: Path) -> list[dict]:
    """The run's open-loop GIFs at OPEN_LOOP_PICTURE_STEPS as PNG strips beside the results
    (gpu_report.open_loop_strip); the last GIF in place of any of those steps the run did not reach, and the first
    and last where it wrote none at them (--quick)."""
    from benchmark.gpu.gpu_report import open_loop_strip

    gifs = sorted((run_dir / "open_loop").glob("step_*.gif"), key=lambda p: int(p.stem.split("_")[1]))
    by_step = {int(gif.stem.split("_")[1]): gif for gif in gifs}
    chosen = [by_step[step] for step in OPEN_LOOP_PICTURE_STEPS if step in by_step]
    if len(chosen) < len(OPEN_LOOP_PICTURE_STEPS) and gifs:
        chosen.append(gifs[-1])
    if not chosen:
        chosen = [*gifs[:1], *gifs[-1:]]
    strips = []
    for gif in dict.fromkeys(chosen[: len(OPEN_LOOP_PICTURE_STEPS)]):
        try:
            strips.append(open_loop_strip(gif, stem.with_name(f"{stem.name}_open_loop_{gif.stem}.png")))
        except Exception as exc:  # noqa: BLE001 - an image that fails never stops the run
            log(f"open-loop image {gif.name} not written ({type(exc).__name__}: {exc})")
    return strips


# ---------------------------------------------------------------------------------------------------------
# Verdicts and the markdown
# ---------------------------------------------------------------------------------------------------------
def targets(result: dict) -> list[dict]:
    """Each target of issue 40 against what this run measured. Judged only where the figure is the real one: on
    CUDA, not --quick, and for the Pong return and wall time once the run reached 100k env steps."""
    full_size = result.get("device") == "cuda" and not result.get("quick")
    rows = []
    for figure, key, must, moonshot, direction in TARGETS:
        value = result.get(key)
        note = ""
        judged = full_size and value is not None
        if (
            key in ("pong_wall_min_100k", "pong_final_return")
            and (result.get("pong_env_steps") or 0) < PONG_TARGET_STEPS
        ):
            judged = False
            note = f"the run reached {result.get('pong_env_steps') or 0:,} env steps"
        if key == "pong_wall_min_100k" and value is not None:
            note = result.get("pong_wall_min_100k_how", "")
        if key == "kernels_per_update" and value is not None:
            note = result.get("kernels_counted_as") or ""
        if value is not None and not full_size:
            note = (note + "; " if note else "") + "tiny sizes (--quick), not judged"

        met = [
            None if not judged else value <= limit if direction == "<=" else value >= limit
            for limit in (must, moonshot)
        ]
        rows.append(
            {
                "figure": figure,
                "key": key,
                "measured": value,
                "must": f"{direction} {must:g}",
                "moonshot": f"{direction} {moonshot:g}",
                "met_must": met[0],
                "met_moonshot": met[1],
                "note": note,
            }
        )
    return rows


def targets_markdown(rows: list[dict]) -> str:
    lines = [
        "| figure | measured | must | moonshot | must met | moonshot met | note |",
        "|---|---:|---:|---:|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row['figure']} | {fmt(row['measured'])} | {row['must']} | {row['moonshot']} | "
            f"{fmt(row['met_must'])} | {fmt(row['met_moonshot'])} | {row['note']} |"
        )
    return "\n".join(lines)


def update_markdown(result: dict) -> list[str]:
    data = result.get("update")
    if not data:
        return []
    lines = [
        "## (a) The update variants",
        "",
        (
            f"`{result.get('update_command')}`: {data.get('batch')}, {data.get('batch_from')}; each variant's "
            f"agent from the same seed, fed from the script's staging buffers as training feeds it; median of "
            f"{data.get('reps')} updates after the warm-up calls (which compile and capture), a device "
            f"synchronisation after each. Variants change the named Args fields from every fast path off "
            f"({json.dumps(data.get('fast_paths_off'))}); `training` is the script's defaults plus "
            f"{json.dumps(data.get('cuda_fast_path'))} on CUDA, the update the Pong run trains with. Sampling one "
            f"batch on the CPU: {fmt(data.get('sample_ms'))} ms. Everything outside the update per env step (act, "
            f"sample and gather on the device, env step, store; 1 Pong env): "
            f"{fmt(data.get('outside_update_ms_per_env_step'))} ms. Stage: {fmt(result.get('update_wall_s'))} s, exit "
            f"{result.get('update_returncode')}"
            + (", stopped by its time cap." if result.get("update_stopped_by_cap") else ".")
        ),
        "",
        (
            "| variant | overrides | update ms | kernels per update | warm-up s | compile s | peak reserved MB "
            "| note |"
        ),
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for name, v in data.get("variants", {}).items():
        if "update_ms" not in v:
            note = v.get("skipped") or v.get("error") or ""
            lines.append(f"| {name} | `{json.dumps(v.get('overrides'))}` | — | — | — | — | — | {note} |")
            continue
        lines.append(
            f"| {name} | `{json.dumps(v.get('overrides'))}` | {fmt(v['update_ms'])} | "
            f"{fmt(v.get('kernels_per_update'))} | {fmt(sum(v.get('warmup_calls_s', [])))} | "
            f"{fmt(v.get('compile_s'))} | {fmt(v.get('peak_gpu_reserved_mb'))} | "
            f"{'captured' if v.get('captured') else ''} |"
        )
    counted = {
        v.get("kernels_counted_as") for v in data.get("variants", {}).values() if v.get("kernels_counted_as")
    }
    lines += ["", "Kernels counted as: " + "; ".join(sorted(counted)) + "." if counted else ""]
    return lines


def pong_markdown_staged(result: dict) -> list[str]:
    if "pong_command" not in result:
        return []
    lines = [
        "## (b) Pong, Atari100k recipe",
        "",
        f"`{result['pong_command']}`"
        + (" (continued from its last checkpoint)" if result.get("pong_resumed") else ""),
        "",
    ]
    if result.get("pong_skipped"):
        return lines + [result["pong_skipped"] + "."]
    if result.get("pong_fields_not_in_this_version"):
        lines += [
            "Recipe fields this version of the script lacks (left out): "
            + ", ".join(result["pong_fields_not_in_this_version"])
            + ".",
            "",
        ]
    if "pong_env_steps" in result:
        lines += [
            (
                f"Exit {result.get('pong_returncode', 'running')} (143: stopped by its time cap after a checkpoint); "
                f"{result['pong_env_steps']:,} env steps, {result['pong_updates']:,} updates, "
                f"{fmt(result['pong_wall_s'])} s of training, start-up {fmt(result.get('pong_startup_s'))} s; steady "
                f"rate {fmt(result.get('pong_env_steps_per_s'))} env steps/s; mean return of the last 10 training "
                f"episodes {fmt(result.get('pong_train_return_last_10'))}. Peak GPU reserved "
                f"{fmt(result.get('pong_peak_gpu_reserved_mb'))} MB, allocated {fmt(result.get('pong_peak_gpu_alloc_mb'))}"
                f" MB; peak host RSS {fmt(result.get('pong_peak_host_rss_mb'))} MB."
            ),
            "",
            f"![curve]({result['results_stem']}_pong_curve.png)",
            "",
        ]
        reference = result.get("pong_reference")
        if reference:
            lines += [
                (
                    f"Grey lines on the return plot: DreamerV3's own five Atari100k Pong runs (2023 code), from "
                    f"`{reference['path']}` of {reference['repository']} at commit {reference['commit'][:7]} "
                    f"({reference['note']})."
                ),
                "",
            ]
        lines += [
            (
                "| env step | training s | updates | mean return, last 10 | ball F1, observed | ball F1, 5 steps "
                "open loop | ball F1 by chance, 5 steps open loop | image loss per frame | KL (nats) | actor entropy "
                "(nats) | env steps/s | updates/s | GPU reserved MB (peak) | GPU alloc MB | host RSS MB |"
            ),
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for p in result["pong_curve"]:
            lines.append(
                f"| {p['env_step']:,} | {fmt(p['wall_s'])} | {fmt(p['updates'])} | "
                f"{fmt(p['mean_return_last10'])} | {fmt(p.get('ball_f1_observed'))} | "
                f"{fmt(p.get('ball_f1_open_loop_5'))} | {fmt(p.get('ball_f1_chance_open_loop_5'))} | "
                f"{fmt(p.get('image_loss_per_frame'))} | {fmt(p.get('kl_nats'))} | {fmt(p.get('actor_entropy'))} | "
                f"{fmt(p.get('env_steps_per_s'))} | "
                f"{fmt(p.get('updates_per_s'))} | {fmt(p.get('peak_gpu_reserved_mb'))} | "
                f"{fmt(p.get('gpu_alloc_mb'))} | {fmt(p.get('host_rss_mb'))} |"
            )
    samples = [v for _, v in (result.get("pong_gpu_utilization") or {}).get("samples", []) if v is not None]
    if samples:
        lines += [
            "",
            (
                f"GPU utilisation (NVML, every 5 s over the run): median {fmt(statistics.median(samples))} %, "
                f"{len(samples)} samples."
            ),
        ]
    evaluation = result.get("pong_eval")
    if evaluation and "skipped" in evaluation:
        lines += ["", f"Evaluation of the final agent: not done ({evaluation['skipped']})."]
    elif evaluation:
        returns = ", ".join(
            fmt(e["return"]) if e["finished"] else f"unfinished ({fmt(e['return_so_far'])} so far)"
            for e in evaluation["episodes"]
        )
        lines += [
            "",
            (
                f"Evaluation of the final agent (`{evaluation['command']}`, {evaluation['policy']}): "
                f"{evaluation['finished']} of {evaluation['asked']} episodes finished in "
                f"{fmt(evaluation['wall_s'])} s, mean return {fmt(evaluation['mean_return'])}; every episode: "
                f"{returns}."
            ),
        ]
    for strip in result.get("pong_open_loop_images") or []:
        lines += [
            "",
            (
                f"Open-loop predictions ({strip['png']}: 4 replayed sequences, each truth | model | error; the "
                f"model sees frames 0-4 and imagines the rest from the real actions), frames {strip['frames']}:"
            ),
            "",
            f"![{strip['png']}]({strip['png']})",
        ]
    return lines


def staged_markdown(result: dict) -> str:
    m = result["machine"]
    head = [
        f"# GPU stages ({', '.join(result['stages'])}), {result['date']}, {result.get('gpu_name') or m['cpu']}",
        "",
        (
            f"Command: `{result['command']}`. Machine: {m.get('gpu') or 'no GPU'}, {m['cpu']}, {m['cpu_count']} CPU "
            f"cores, {m['platform']}, Python {m['python']}, torch {m['torch']}. Load average at the start "
            f"{fmt_load(result['load_average_start'])}"
            + (
                f", at the end {fmt_load(result['load_average_end'])}"
                if "load_average_end" in result
                else " (the run had not finished when this was written)"
            )
            + ". Every sample is in the JSON file."
            + (
                " Tiny sizes (--quick): the figures check the steps, they are not the issue's."
                if result["quick"]
                else ""
            )
        ),
        "",
        "## Targets (issue 40)",
        "",
        targets_markdown(result.get("targets") or targets(result)),
        "",
    ]
    return (
        "\n".join(
            [*head, *lease_markdown(result), *update_markdown(result), "", *pong_markdown_staged(result)]
        )
        + "\n"
    )


def lease_markdown(result: dict) -> list[str]:
    """The device calls a run spanned (`gpu_lease.sh start` and `finish`, benchmark/gpu/gpu_lease_note.py)."""
    lease = result.get("lease")
    if not lease:
        return []
    run, first, second = lease["run"], lease["call_1"], lease.get("call_2")
    times = (
        f"Seconds from call 1's start: call 1 (`gpu_lease.sh {first['mode']}`, budget {first['budget_s']} s) "
        f"collected its files at {fmt(first['collected_after_s'])}"
    )
    if second:
        times += (
            f"; call 2 (`finish`, budget {second['budget_s']} s) started at {fmt(second['started_after_s'])} and "
            f"collected these files at {fmt(second['collected_after_s'])}"
        )
    times += f"; the run was launched at {fmt(run['launched_after_s'])}" + (
        f" and ended at {fmt(run['ended_after_s'])}, exit {run['exit_status']} (its own wall time "
        f"{fmt(run['wall_s'])} s)."
        if run["ended_after_s"] is not None
        else f" and had run {fmt(run['wall_s_so_far'])} s."
    )
    return [f"## Device calls: {lease['device_calls']}", "", lease["summary"], "", times, ""]
