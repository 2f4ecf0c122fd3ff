"""The Atari100k Pong run on a GPU: `dreamer_atari.py` with DreamerV3's recipe, its curve read as it trains, its final
agent evaluated. `run.py --gpu-only` runs it (and continues it from its last checkpoint in --pong-dir); the GPU
stages of dev/gpu/ run the same, with a time budget and pictures beside their results file.

The run is `dreamer_atari.py` in its own process, stopped with SIGTERM at --pong-minutes (it writes a checkpoint and
exits 143); its curve comes from its TensorBoard file (pong_curve.py), its evaluation from pong_eval.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from benchmark.common import (
    BENCH_DIR,
    CUDA_FAST_PATH,
    PONG_QUICK,
    PONG_QUICK_RESUMABLE,
    PONG_RECIPE,
    PONG_RESUMABLE,
    ROOT,
    Args,
    fail,
    fmt,
    log,
)

PONG_TARGET_STEPS = 100_000
EVAL_OVERHEAD_S = 30.0  # the evaluation's start-up and the last files
SIGTERM_GRACE_S = 30.0  # the Pong run's checkpoint and exit after SIGTERM, before it is killed


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


def io_per_step(last: dict, key: str, start_step: int) -> float | None:
    """Microseconds per env step of `key` (seconds this invocation spent, from `start_step` on) at the last point."""
    steps = last["env_step"] - start_step
    return None if last.get(key) is None or steps <= 0 else 1e6 * last[key] / steps


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
    # this invocation's env steps: from 0, or for a resumed part from its first log point (a slight overestimate)
    start_step = this_part[0][0] if this_part and resumed else 0
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
        # the replay written to disk as it grows, and the checkpoints, over the last invocation's env steps
        "pong_replay_write_us_per_env_step": io_per_step(last, "replay_write_s", start_step),
        "pong_checkpoint_write_s": last.get("checkpoint_write_s"),
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
    deadline: float | Callable[[], float | None] | None = None,
    images_to: Path | None = None,
    fast_path: dict | None = None,
    inductor_cache: Path | None = None,
) -> dict:
    """Run (or continue) the Atari100k Pong run for --pong-minutes (less where the budget leaves less), then stop
    it with SIGTERM, which makes the script write a checkpoint and exit 143. Every --pong-curve-every env steps its
    curve so far goes to `progress`; at the end its final agent is evaluated (pong_eval.py). A callable `deadline` is
    read again at each poll, so the run's cap follows it (`pong_cap_s`; each change in `pong_cap_moves`).
    `inductor_cache`: a --compile run compiles from this Inductor cache (another stage's), else from a fresh one."""
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
    reserve_s = (
        (args.pong_eval_minutes * 60 if args.pong_eval_episodes else 0.0) + EVAL_OVERHEAD_S + SIGTERM_GRACE_S
    )

    def cap(launched: float) -> float:
        """Seconds from the launch at which the run is stopped: --pong-minutes, or less where the deadline leaves
        less once its evaluation and the results are set aside."""
        end = deadline() if callable(deadline) else deadline
        return (
            args.pong_minutes * 60 if end is None else min(args.pong_minutes * 60, end - launched - reserve_s)
        )

    cap_s = cap(time.time())
    shown = " ".join(["python", "dreamer_atari.py", *cmd[2:]]).replace(str(pong_dir), "PONG_DIR")
    out: dict = {
        "pong_command": shown,
        "pong_config": {k: list(v) if isinstance(v, tuple) else v for k, v in fields.items()},
        "pong_fields_not_in_this_version": missing,
        "pong_extra_args": args.pong_args,
        "pong_resumed": resume is not None,
        "pong_cap_s": cap_s,
    }
    if cap_s < (10 if args.quick else 30):  # --quick's tiny run starts in seconds; the recipe's takes longer
        out["pong_skipped"] = f"not run: {cap_s:.0f} s were left for it in --budget-minutes"
        log(out["pong_skipped"])
        return out
    learning_starts = fields.get("learning_starts", da.Args().learning_starts)
    every = 100 if args.quick else args.pong_curve_every  # --quick: each log point of its tiny run
    log_path = pong_dir / "train.log"
    # a fresh cache: compiling counts in the run's start-up time, as a new user's would
    cache = (
        str(inductor_cache)
        if inductor_cache is not None
        else tempfile.mkdtemp(prefix="inductor-", dir=pong_dir)
    )
    out["pong_inductor_cache"] = "another stage's (warm)" if inductor_cache is not None else "fresh"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "WANDB_MODE": "offline", "TORCHINDUCTOR_CACHE_DIR": cache}
    if args.device == "cpu":
        # --threads, as every CPU measurement here (more threads only contend on a busy machine)
        env["OMP_NUM_THREADS"] = str(args.threads)
    writes: list[dict] = []
    out["pong_curve_writes"] = writes
    next_write = every
    launched = time.time()
    cap_s = out["pong_cap_s"] = cap(launched)
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
            if callable(deadline) and stopped_at is None and abs((moved := cap(launched)) - cap_s) > 1:
                cap_s = out["pong_cap_s"] = moved
                out.setdefault("pong_cap_moves", []).append([round(now - launched, 1), round(moved, 1)])
                log(f"pong: its cap moved to {moved:.0f} s after its launch (the deadline file)")
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
    if inductor_cache is None:
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
    (pong_curve.open_loop_strip); the last GIF in place of any of those steps the run did not reach, and the first
    and last where it wrote none at them (--quick)."""
    from benchmark import pong_curve

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
            strips.append(
                pong_curve.open_loop_strip(gif, stem.with_name(f"{stem.name}_open_loop_{gif.stem}.png"))
            )
        except Exception as exc:  # noqa: BLE001 - an image that fails never stops the run
            log(f"open-loop image {gif.name} not written ({type(exc).__name__}: {exc})")
    return strips
