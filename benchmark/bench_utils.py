"""Helpers shared by our measurements and the peer's: timing, slopes, the machine's name.

Imported in two environments (ours and the peer's virtual environment): standard library, torch, psutil and
`memory_utils` (the repo root is on sys.path) only, so both sides measure with the same code.
"""

from __future__ import annotations

import gc
import os
import platform
import statistics
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


trim_host_memory = mu.trim_host_memory  # live memory only: gc, then glibc's malloc_trim(0)


def soak_summary(steps: Sequence[int], unexplained_mb: Sequence[float], full_at: int, capacity: int) -> dict:
    """Slope of (USS - buffer bytes) after the buffer is full, in MB per 10k env steps, and the turnovers it spans."""
    points = [(s, m) for s, m in zip(steps, unexplained_mb) if s >= full_at]
    if len(points) < 3:
        raise RuntimeError(f"the soak recorded {len(points)} points after the buffer was full; it needs at least 3")
    xs = [p[0] for p in points]
    ys = [p[1] for p in points]
    return {
        "soak_uss_slope_mb_per_10k": mu.robust_slope(xs, ys) * 10_000,
        "soak_turnovers": (xs[-1] - xs[0]) / capacity,
        "soak_points": len(points),
        "soak_unexplained_mb_first_last": [round(ys[0], 2), round(ys[-1], 2)],
    }


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
