"""The leak detector against a synthetic corpus of memory series: what it flags, what it aborts, how fast.

    python benchmark/investigations/leak_corpus.py --seeds 20 --json benchmark/results/leak_detector.json --md benchmark/results/leak_detector.md

Each series is host memory beyond the replay buffer, in MB, sampled every 1k env steps for 300k steps (the scripts'
default log interval), fed to `memory_utils.LeakDetector` exactly as a training run feeds it (`observe`, then
`check`, at every sample, after the scripts' 10k-step warm-up). Patterns:

- no leak: steady (noise sd 0.5, 5, 20 MB); a level shift of 20 to 500 MB at a random step; three level shifts;
  sawtooths (memory grows by 50 to 200 MB over a period of 5k to 30k steps, then is given back), random phase;
- leaks: linear growth of 1, 2, 5 or 53 MB per 1k steps (53: the seed's Pong incident) from a random step, with
  noise sd 2 MB (about what the scripts' trimmed host-memory figure shows) and, for the decision time alone, 5
  and 20 MB; a 5 MB per 1k leak under a 100 MB sawtooth.

For each pattern: the share of checks that said "suspected", whether any series aborted (`--abort-on-leak`),
and for leaks the steps from the leak's start to the first "suspected" (every sample is kept in the JSON file).
tests/test_leak_detector.py holds the detector to the targets on the same corpus.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import memory_utils as mu
from benchmark.common import code_version

EVERY = 1_000
LENGTH = 300_000
WARMUP = 30_000  # the scripts' --leak-warmup-steps default
BASE_MB = 1_500.0


def _steps() -> np.ndarray:
    return np.arange(0, LENGTH + 1, EVERY, dtype=np.float64)


def steady(sd: float):
    def make(rng):
        steps = _steps()
        return steps, BASE_MB + rng.normal(0, sd, len(steps)), None

    return make


def level_shifts(size: float, count: int = 1, sd: float = 5.0):
    def make(rng):
        steps = _steps()
        values = BASE_MB + rng.normal(0, sd, len(steps))
        for at in rng.uniform(20_000, 250_000, count):
            values[steps >= at] += size
        return steps, values, None

    return make


def sawtooth(peak_to_peak: float, period: int, sd: float = 5.0, leak_per_1k: float = 0.0):
    def make(rng):
        steps = _steps()
        phase = (steps + rng.uniform(0, period)) % period / period  # 0 -> 1, then given back
        values = BASE_MB + peak_to_peak * phase + rng.normal(0, sd, len(steps)) + leak_per_1k * steps / 1000
        return steps, values, (0.0 if leak_per_1k else None)

    return make


def leak(per_1k: float, sd: float = 2.0):
    def make(rng):
        steps = _steps()
        # a leak that starts during the run, once it is judged, with time left to find it
        onset = float(rng.uniform(WARMUP + 10_000, LENGTH - 50_000))
        values = BASE_MB + rng.normal(0, sd, len(steps)) + per_1k * np.clip(steps - onset, 0, None) / 1000
        return steps, values, onset

    return make


NO_LEAK = {
    **{f"steady sd {sd:g} MB": steady(sd) for sd in (0.5, 5, 20)},
    **{f"level shift +{size:g} MB": level_shifts(size) for size in (20, 120, 300, 500)},
    "level shift +500 MB, sd 20 MB": level_shifts(500, sd=20.0),
    "three level shifts of +120 MB": level_shifts(120, count=3),
    **{
        f"sawtooth {pp:g} MB per {period // 1000}k": sawtooth(pp, period)
        for pp in (50, 100, 200)
        for period in (5_000, 10_000, 20_000, 30_000)
    },
}
LEAKS = {
    **{f"leak {rate:g} MB per 1k, sd 2 MB": leak(rate) for rate in (1, 2, 5, 53)},
    **{f"leak {rate:g} MB per 1k, sd {sd:g} MB": leak(rate, sd) for rate in (1, 53) for sd in (5, 20)},
    "leak 5 MB per 1k under a 100 MB sawtooth per 10k": sawtooth(100, 10_000, leak_per_1k=5.0),
}


def run_series(make, seed: int) -> dict:
    """Feed one series to a detector as a run would; every check's verdict."""
    rng = np.random.default_rng(seed)
    steps, values, onset = make(rng)
    detector = mu.LeakDetector(warmup_steps=WARMUP)
    suspected, aborted_at, first_after_onset, before_onset = [], None, None, 0
    for step, value in zip(steps, values):
        detector.observe(int(step), {mu.KEY_ANON_MB: float(value)})
        if step < WARMUP:
            continue
        verdict = detector.check()
        suspected.append(bool(verdict.leaking))
        if verdict.abort and aborted_at is None:
            aborted_at = int(step)
        if verdict.leaking and onset is not None:
            if step < onset:
                before_onset += 1
            elif first_after_onset is None:
                first_after_onset = int(step)
    return {
        "seed": seed,
        "checks": len(suspected),
        "suspected": int(sum(suspected)),
        "aborted_at": aborted_at,
        "onset": onset,
        "decision_steps": None if first_after_onset is None else first_after_onset - onset,
        "suspected_before_onset": before_onset,
    }


def run_corpus(seeds: int) -> dict:
    out = {
        "config": {
            "every": EVERY,
            "length": LENGTH,
            "warmup": WARMUP,
            "seeds": seeds,
            "detector": {
                "growth_z": mu.GROWTH_Z,
                "slope_fraction": mu.SLOPE_FRACTION,
                "step_ratio": mu.STEP_RATIO,
                "staircase_ratio": mu.STAIRCASE_RATIO,
                "release_z": mu.RELEASE_Z,
                "release_grace": mu.RELEASE_GRACE,
                "scales": list(mu.SCALES),
                **_detector_defaults(),
            },
        },
        "no_leak": {},
        "leaks": {},
    }
    for group, patterns in (("no_leak", NO_LEAK), ("leaks", LEAKS)):
        for name, make in patterns.items():
            series = [run_series(make, seed) for seed in range(seeds)]
            checks = sum(s["checks"] for s in series)
            summary = {
                "suspected_share": sum(s["suspected"] for s in series) / checks,
                "aborted_series": sum(s["aborted_at"] is not None for s in series),
                "series": series,
            }
            if group == "leaks":
                times = [s["decision_steps"] for s in series]
                found = sorted(t for t in times if t is not None)
                summary.update(
                    found=len(found),
                    median_decision_steps=float(np.median(found)) if found else None,
                    p95_decision_steps=(
                        float(np.percentile(found, 95)) if len(found) == len(times) else None
                    ),
                    suspected_before_onset=sum(s["suspected_before_onset"] for s in series),
                )
            out[group][name] = summary
    return out


def _detector_defaults() -> dict:
    detector = mu.LeakDetector()
    return {
        "window": detector.window,
        "threshold_mb_per_1k": detector.threshold,
        "abort_after": detector.abort_after,
    }


def markdown(result: dict, command: str) -> str:
    c = result["config"]
    lines = [
        "# Leak detector on a synthetic corpus",
        "",
        (
            f"Command: `{command}`. {c['seeds']} seeds per pattern; a sample every {c['every']:,} env steps for "
            f"{c['length']:,} steps, checked at every sample after a {c['warmup']:,}-step warm-up. Detector: "
            f"`memory_utils.LeakDetector()` defaults {json.dumps(c['detector'])}. Every check of every series "
            "is in the JSON file beside this one."
        ),
        "",
        "## Memory that does not leak",
        "",
        "| pattern | suspected checks | series aborted |",
        "|---|---:|---:|",
    ]
    for name, s in result["no_leak"].items():
        lines.append(
            f"| {name} | {100 * s['suspected_share']:.2f} % | {s['aborted_series']} of {c['seeds']} |"
        )
    lines += [
        "",
        "## Leaks",
        "",
        "| pattern | found | steps from the leak's start to the first 'suspected': median | 95th percentile "
        "| suspected before it started |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, s in result["leaks"].items():
        p95 = "—" if s["p95_decision_steps"] is None else f"{s['p95_decision_steps']:,.0f}"
        median = "—" if s["median_decision_steps"] is None else f"{s['median_decision_steps']:,.0f}"
        lines.append(
            f"| {name} | {s['found']} of {c['seeds']} | {median} | {p95} | {s['suspected_before_onset']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--json", required=True)
    parser.add_argument("--md")
    cli = parser.parse_args()
    if cli.seeds < 1:
        print(f"error: --seeds must be at least 1, got {cli.seeds}.", file=sys.stderr)
        raise SystemExit(2)
    started = time.time()
    result = run_corpus(cli.seeds)
    result["wall_s"] = time.time() - started
    result["code"] = code_version()  # the commit it ran, and whether the tree differed
    Path(cli.json).write_text(json.dumps(result, indent=1))
    if cli.md:
        command = " ".join(["python", "benchmark/investigations/leak_corpus.py", *sys.argv[1:]])
        Path(cli.md).write_text(markdown(result, command))


if __name__ == "__main__":
    main()
