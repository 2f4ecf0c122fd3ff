"""Helpers shared by our measurements and the peer's: timing, slopes, the machine's name.

Imported in two environments (ours and the peer's virtual environment): standard library, torch, psutil and
`memory_utils` (the repo root is on sys.path) only, so both sides measure with the same code.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

import memory_utils as mu


def time_ms(fn: Callable[[], Any], reps: int, warmup: int = 1) -> dict:
    """Call `fn` `warmup` times untimed, then `reps` times timed; the median and every sample, in ms."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        gc.collect()
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1e3)
    return {"median_ms": statistics.median(samples), "samples_ms": [round(s, 3) for s in samples]}


# Alternating updates: each contender is a process (ours and the peer's live in different environments) that
# times one update per `update` line it reads and answers on a line of its own, which the driver tells apart
# from whatever else the process prints by this prefix.
SERVE_PREFIX = "@serve "


def serve_updates(update: Callable[[], Any], info: dict) -> None:
    """Answer `ready` with `info`, then time one call of `update` per `update` line on stdin (after a gc, as
    `time_ms` does), until stdin closes."""
    print(SERVE_PREFIX + json.dumps({"ready": info}), flush=True)
    for line in sys.stdin:
        if line.strip() != "update":
            continue
        gc.collect()
        start = time.perf_counter()
        update()
        print(SERVE_PREFIX + json.dumps({"ms": (time.perf_counter() - start) * 1e3}), flush=True)


def _serve_reply(proc) -> dict:
    for line in proc.stdout:
        if line.startswith(SERVE_PREFIX):
            return json.loads(line[len(SERVE_PREFIX) :])
    raise RuntimeError(f"a contender ended before answering (exit status {proc.wait()})")


def alternate_updates(
    commands: dict[str, list[str]], rounds: int, warmup: int, env: dict | None = None, cwd: str | None = None
) -> dict:
    """Start every contender, wait until all are ready, then `warmup` untimed and `rounds` timed rounds of one
    update each, one contender at a time (the order rotates every round). Returns, per contender, its `info`,
    every sample and the median, in ms."""
    procs = {
        name: subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=cwd
        )
        for name, cmd in commands.items()
    }
    try:
        out = {name: {"info": _serve_reply(proc)["ready"], "samples_ms": []} for name, proc in procs.items()}
        names = list(procs)
        for round_ in range(warmup + rounds):
            for name in names[round_ % len(names) :] + names[: round_ % len(names)]:
                procs[name].stdin.write("update\n")
                procs[name].stdin.flush()
                ms = _serve_reply(procs[name])["ms"]
                if round_ >= warmup:
                    out[name]["samples_ms"].append(round(ms, 3))
    finally:
        for proc in procs.values():
            if proc.stdin:
                proc.stdin.close()
        for proc in procs.values():
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
    for result in out.values():
        result["update_ms"] = statistics.median(result["samples_ms"])
        result["min_ms"], result["max_ms"] = min(result["samples_ms"]), max(result["samples_ms"])
    return out


trim_host_memory = mu.trim_host_memory  # live memory only: gc, then glibc's malloc_trim(0)


def soak_summary(steps: Sequence[int], unexplained_mb: Sequence[float], full_at: int, capacity: int) -> dict:
    """Slope of (USS - buffer bytes) after the buffer is full, in MB per 10k env steps, and the turnovers it spans."""
    points = [(s, m) for s, m in zip(steps, unexplained_mb) if s >= full_at]
    if len(points) < 3:
        raise RuntimeError(
            f"the soak recorded {len(points)} points after the buffer was full; it needs at least 3"
        )
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    return {
        "soak_uss_slope_mb_per_10k": mu.robust_slope(xs, ys) * 10_000,
        "soak_turnovers": (xs[-1] - xs[0]) / capacity,
        "soak_points": len(points),
        "soak_unexplained_mb_first_last": [round(ys[0], 2), round(ys[-1], 2)],
    }


def window_slope(steps: Sequence[int], values: Sequence[float], start: int, stop: int) -> float | None:
    """Theil-Sen slope in MB per 10k env steps of the points with start <= step <= stop (None under 3 points)."""
    points = [(s, v) for s, v in zip(steps, values) if start <= s <= stop]
    if len(points) < 3:
        return None
    return mu.robust_slope([p[0] for p in points], [p[1] for p in points]) * 10_000


def cpu_name() -> str:
    """The CPU's model name as the kernel reports it (falls back to the platform's processor string)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    """What the figures were measured on."""
    info = {
        "cpu": cpu_name(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def param_count(*modules: torch.nn.Module) -> int:
    """Parameters of the modules, each counted once (shared ones too)."""
    seen = {}
    for module in modules:
        for p in module.parameters():
            seen[id(p)] = p.numel()
    return sum(seen.values())


def read_scalars(run_dir: str, keys: list[str]) -> dict[str, dict[int, float]]:
    """{key: {step: value}} from a run's TensorBoard file, for the keys it logged (missing keys are left out)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    logged = set(events.Tags().get("scalars", []))
    return {key: {e.step: e.value for e in events.Scalars(key)} for key in keys if key in logged}
