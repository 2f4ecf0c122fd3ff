"""The GPU stages of issue 40 for a short GPU lease (gpu_lease.sh runs them): the update variants, then the
Atari100k Pong run, into one results file.

    python dev/gpu/gpu_stages.py --stage update            # the update variants at B16 x T64 (<= 4 min)
    python dev/gpu/gpu_stages.py --stage pong              # the Atari100k Pong run, its curve, its evaluation
    python dev/gpu/gpu_stages.py --stage update pong --budget-minutes 9.6
    python dev/gpu/gpu_stages.py --stage update pong --device cpu --quick   # the same steps, tiny, no GPU

One results file, `<results-dir>/<date>-<gpu>.json` and `.md`, rewritten whenever a step ends (each update variant,
each --pong-curve-every env steps of the Pong run, its evaluation), so that a run stopped at any point leaves what it
had measured; beside it the Pong curve as a PNG and the Pong run's first and last open-loop predictions as PNG
strips. Each stage runs in its own process: `update_variants.py` (killed at --update-minutes), then the Pong run of
benchmark/pong_run.py (`dreamer_atari.py`, stopped with SIGTERM at --pong-minutes: it writes a checkpoint and exits
143; then `pong_eval.py`). The options are `benchmark/run.py --gpu-only`'s and the stages' own (`StageArgs`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Literal

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import tyro

from benchmark.common import (
    BENCH_DIR,
    Args,
    check_gpu_only_device,
    code_markdown,
    code_version,
    fail,
    fmt,
    fmt_load,
    log,
    new_results_stem,
    run_with_cap,
    slug,
)
from benchmark.pong_run import PONG_TARGET_STEPS, check_pong_args, run_pong
from dev.gpu import incident_stage

HERE = Path(__file__).resolve().parent


@dataclasses.dataclass
class StageArgs(Args):
    """`run.py --gpu-only`'s options (the device, the Pong run's), less those of the full run, and the stages'."""

    peer: tyro.conf.Suppress[Literal["sheeprl"] | None] = None
    gpu_only: tyro.conf.Suppress[bool] = True
    pong_only: tyro.conf.Suppress[bool] = False
    matched_only: tyro.conf.Suppress[bool] = False
    stage: tuple[Literal["update", "incidents", "pong"], ...] = ()
    """these stages, in this order, into one results file rewritten as each step ends. `update`: the update variants
    (UPDATE_VARIANTS) at B16 x T64; `incidents`: the incidents' GPUs (dev/gpu/incident_stage.py: the default Dreamer
    under --gpu-memory-gb 6, the DQN in each precision, the DQN incident replayed); `pong`: the Atari100k Pong run
    (PONG_RECIPE), its curve every --pong-curve-every env steps, then its final agent evaluated"""
    update_minutes: float = 4.0
    """--stage update: its time cap; variants not reached by then are reported as not measured"""
    incidents_minutes: float = 2.5
    """--stage incidents: its time cap; parts not reached by then are missing from its results"""
    update_variants: tuple[str, ...] = ()
    """--stage update: only these variants (`training`, then names of TRAINING_VARIANTS and UPDATE_VARIANTS); unset:
    all of them. The fastest of `training` (the default's update: captured, TF32) and the TRAINING_VARIANTS measured,
    their warm-up counted in, runs the Pong stage that follows"""
    budget_minutes: float | None = None
    """this whole invocation ends within this many minutes (the Pong run's training is cut short so that its
    evaluation and the results fit in); unset: only the stages' own caps"""
    pong_inductor_cache: Literal["fresh", "update-stage"] = "fresh"
    """`update-stage`: a Pong run on --compile compiles from the update stage's Inductor cache, so its start-up
    holds little compiling (said in the results: `pong_inductor_cache`); `fresh`: a new user's compile"""
    deadline_file: str | None = None
    """a file that, once it holds a time (seconds since the epoch) later than --budget-minutes' end, moves the end
    there, read at every poll of the Pong run: a later device call of the same lease lengthens the run with the time
    the lease has left (`gpu_lease.sh finish`); an earlier time, or anything else, changes nothing"""


# The update variants. `training` is the update the Pong run trains with (the script's defaults plus
# CUDA_FAST_PATH); each of TRAINING_VARIANTS changes only the Args fields it names from it, and the fastest of them
# and `training` whose start-up checks pass runs the Pong stage that follows (`faster_path`); each of
# UPDATE_VARIANTS changes the fields it names from every fast path off (FAST_PATHS_OFF, which leaves the kernels
# module's paths as `auto` has them). `part1` and `part1+compile` turn every path of dreamer_kernels.py off (PART_1):
# Part 1 alone, captured as the default is, then compiled (its observe and imagination loops each one whole graph,
# captured around it where compile allows), the baseline of a compiled learner step as TorchRL's. A variant naming a
# field this version of the script lacks is reported "not available in this version" and skipped.
FAST_PATHS_OFF = {"tf32": False, "precision": "float32", "compile": False, "cudagraph": False}
# dreamer_kernels.py's paths, by their Args fields
KERNEL_PATHS = (
    "fast_observe",
    "fused_scan",
    "fast_imagine",
    "imagine_gathers",
    "fused_epilogues",
    "fast_heads",
)
PART_1 = dict.fromkeys(KERNEL_PATHS, "off")  # Part 1's functions train, as they do without the kernels module
TRAINING_VARIANTS = (  # (name, Args field overrides); a new fast-path flag is one more line. Compile last: its
    # first calls compile for a minute or more, and a stage cut short by its time cap still measured the others
    ("training+bf16", {"precision": "bf16"}),
    # each opt-in path alone on top of the CUDA default (shown on the 2026-11-27 H200), then all of them together:
    # what each saves, and whether its checks pass on this card (`auto` turns on what a committed result shows)
    ("training+fused-scan", {"fused_scan": "on"}),
    ("training+gathers", {"imagine_gathers": "on"}),
    ("training+gathers+fast-heads", {"imagine_gathers": "on", "fast_heads": "on"}),
    (
        "training+all-opt-in",
        {"imagine_gathers": "on", "fast_heads": "on", "fused_epilogues": "on", "fused_scan": "on"},
    ),
    (
        "training+all-opt-in+bf16",
        {
            "imagine_gathers": "on",
            "fast_heads": "on",
            "fused_epilogues": "on",
            "fused_scan": "on",
            "precision": "bf16",
        },
    ),
    ("training+cudnn-benchmark", {"torch_deterministic": False}),  # cuDNN's benchmark is on only without it
    ("training-no-fast-imagine", {"fast_imagine": "off"}),
    ("part1", PART_1),  # Part 1 alone: CUDA graphs and TF32 as the default has them
    ("training+compile", {"compile": True}),
    # Part 1's loops compiled whole: the longest compile, last
    ("part1+compile", {**PART_1, "compile": True, "compile_loops": True}),
)
UPDATE_VARIANTS = (  # (name, Args field overrides on every fast path off)
    ("fp32", {}),
    ("tf32", {"tf32": True}),
    ("bf16", {"precision": "bf16"}),
    ("cudagraph", {"cudagraph": True}),
    ("bf16+cudagraph", {"precision": "bf16", "cudagraph": True}),
    ("compile", {"compile": True}),
    (
        "tf32+cudagraph, autograd observe backward",
        {"tf32": True, "cudagraph": True, "observe_backward": "autograd"},
    ),
)


def variant_names() -> list[str]:
    """Every variant, in the order the update stage measures them."""
    return ["training", *(name for name, _ in TRAINING_VARIANTS), *(name for name, _ in UPDATE_VARIANTS)]


# the speed issue's targets (an update in 5 ms): (figure, result key, must, moonshot, direction)
TARGETS = (
    ("one update, B16 x T64, median, as training runs it (ms)", "update_ms_b16_t64", 6.0, 4.0, "<="),
    ("CUDA kernels per update, B16 x T64", "kernels_per_update", 2_000, 1_000, "<="),
    ("everything outside the update, per env step (ms)", "outside_update_ms_per_env_step", 1.5, 0.7, "<="),
    ("Pong training loop, Atari100k recipe, env steps/s", "pong_env_steps_per_s", 130.0, 170.0, ">="),
    ("Pong: 100k env steps, start-up and compile included (min)", "pong_wall_min_100k", 13.0, 10.0, "<="),
    ("Pong return after 100k env steps (final agent, evaluated)", "pong_final_return", 15.0, 18.0, ">="),
)
QUICK_RESULTS_DIR = BENCH_DIR / ".work" / "quick-results"  # --quick: never among the committed results


def check_staged_args(args: StageArgs) -> None:
    """One sentence and exit status 2 for each bad combination, before anything starts."""

    check_gpu_only_device(args, who="gpu_stages.py")
    if not args.stage:
        fail("--stage names the stages to run: update, incidents, pong, or some of them in that order.")
    if len(set(args.stage)) != len(args.stage):
        fail(f"--stage names a stage twice: {' '.join(args.stage)}.")
    if "incidents" in args.stage and not args.incidents_minutes > 0:
        fail(f"--incidents-minutes must be greater than 0, got {args.incidents_minutes}.")
    if "update" in args.stage and not args.update_minutes > 0:
        fail(f"--update-minutes must be greater than 0, got {args.update_minutes}.")
    unknown = [name for name in args.update_variants if name not in variant_names()]
    if unknown:
        fail(f"--update-variants names no variant {', '.join(unknown)}; known: {', '.join(variant_names())}.")
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


class Deadline:
    """When the invocation must end: --budget-minutes after its start, or later where --deadline-file says so (read
    at each call); None: no end but the stages' own caps."""

    def __init__(self, started: float, budget_minutes: float | None, deadline_file: str | None):
        self.base = started + budget_minutes * 60 if budget_minutes else None
        self.file = Path(deadline_file) if deadline_file else None

    def __call__(self) -> float | None:
        try:
            later = float(self.file.read_text().strip()) if self.file is not None else None
        except (OSError, ValueError):
            later = None
        if later is None or self.base is None:
            return self.base
        return max(self.base, later)


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


def main_staged(args: StageArgs) -> dict:
    from benchmark import bench_utils

    check_staged_args(args)
    started = time.time()
    deadline = Deadline(started, args.budget_minutes, args.deadline_file)
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
        "code": code_version(),  # the commit it runs, and whether the tree differs (.code-version.json on a lease)
    }
    results = Results(stem, result)
    results.save()
    log(f"results: {stem}.json and .md, rewritten as each step ends")
    (BENCH_DIR / ".work").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="stages-", dir=BENCH_DIR / ".work") as work:
        fast_path: dict = {}
        for stage in args.stage:
            if stage == "update":
                run_update_stage(args, Path(work), result, results.save, deadline())
                fast_path = faster_path(result)
            elif stage == "incidents":
                incident_stage.run_incident_stage(args, Path(work), result, results.save, deadline())
            else:
                pong = run_pong(
                    args,
                    progress=lambda figures: (result.update(figures), results.save()),
                    deadline=deadline,
                    images_to=stem,
                    fast_path=fast_path,
                    inductor_cache=(
                        Path(work) / "inductor-update"
                        if args.pong_inductor_cache == "update-stage" and "update" in args.stage
                        else None
                    ),
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


def command_line(args: StageArgs) -> str:
    """The command as typed, with this machine's folders replaced by their roles."""
    text = " ".join(["python", "dev/gpu/gpu_stages.py", *sys.argv[1:]])
    for path, name in ((args.results_dir, "RESULTS_DIR"), (args.pong_dir, "PONG_DIR"), (args.json, "JSON")):
        if path:
            text = text.replace(str(path), name)
    return text


# ---------------------------------------------------------------------------------------------------------
# (a) the update variants
# ---------------------------------------------------------------------------------------------------------
def run_update_stage(
    args: StageArgs, work: Path, result: dict, save: Callable[[], None], deadline: float | None
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
        str(HERE / "update_variants.py"),
        "--out",
        str(out),
        "--device",
        args.device,
        *quick,
        "--threads",
        str(args.threads),
        *(["--variants", *args.update_variants] if args.update_variants else []),
    ]
    # a fresh compile cache: compiled variants show what compiling costs a new user. Its FX graphs and AOTAutograd's
    # (on by default; forced on here), autotuning's results and Triton's kernels all go into this one folder, which
    # the Pong run reuses with --pong-inductor-cache update-stage (update_variants.py says what was on)
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor-update"),
        "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
        "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
    }
    result["update_command"] = " ".join(
        [
            "python",
            "dev/gpu/update_variants.py",
            "--device",
            args.device,
            *quick,
            *cmd[cmd.index("--threads") :],
        ]
    )
    result["update_cap_s"] = cap_s
    seen = [None]  # the JSON's last modification read back

    def read_back():
        stamp = out.stat().st_mtime_ns if out.exists() else None
        if stamp != seen[0]:
            seen[0] = stamp
            merge_update_figures(result, out, final=False)
            save()

    # killed at its cap with nothing lost: it rewrites its JSON after every variant
    returncode, stopped, started = run_with_cap(
        cmd, log_path, cap_s, 1.0 if args.quick else 3.0, read_back, env
    )
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
        for name in variant_names():
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
    """The Pong run's extra fields from the update stage: the overrides of the fastest of `training` and the
    TRAINING_VARIANTS as measured (its start-up checks passed: a variant they refuse has an error, not a time), its
    warm-up spread over PLANNED_UPDATES updates counted in; {} for `training` or where none was measured. Said in the
    results as `pong_fast_path`."""
    variants = (result.get("update") or {}).get("variants", {})
    candidates = {"training": {}, **dict(TRAINING_VARIANTS)}

    def cost_s(name: str) -> float | None:
        entry = variants.get(name, {})
        if entry.get("update_ms") is None:
            return None
        return entry["update_ms"] / 1000 * PLANNED_UPDATES + sum(entry.get("warmup_calls_s") or [0.0])

    costs = {name: cost_s(name) for name in candidates if cost_s(name) is not None}
    if "training" not in costs or len(costs) < 2:
        result["pong_fast_path"] = "the default's: the update stage measured no pair to choose from"
        return {}
    fastest = min(costs, key=costs.get)
    fields = candidates[fastest]
    result["pong_fast_path"] = (
        f"{'the default (training)' if not fields else fastest + ' (' + json.dumps(fields) + ')'}: "
        f"{PLANNED_UPDATES:,} updates and their warm-up would take "
        + ", ".join(
            f"{cost:.0f} s with {name}" for name, cost in sorted(costs.items(), key=lambda item: item[1])
        )
    )
    return dict(fields)


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
            if result.get("pong_inductor_cache", "fresh") != "fresh" and (
                result.get("pong_config") or {}
            ).get("compile"):
                # a new user compiles from nothing: a warm cache's start-up is not theirs
                judged = False
                note += "; compiled from the update stage's Inductor cache, not judged"
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
            f"agent from the same seed, fed through the script's batch_tensors as training feeds it; median of "
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
            f"{fmt(v.get('compile_s'))} | {fmt(v.get('peak_gpu_reserved_mb'))} | {variant_note(v)} |"
        )
    counted = {
        v.get("kernels_counted_as") for v in data.get("variants", {}).values() if v.get("kernels_counted_as")
    }
    lines += ["", "Kernels counted as: " + "; ".join(sorted(counted)) + "." if counted else ""]
    if result.get("pong_fast_path"):
        lines += ["", f"The Pong run's update: {result['pong_fast_path']}."]
    lines += regions_markdown(data)
    for name, v in data.get("variants", {}).items():
        times = v.get("kernel_time")
        if times and v.get("update_ms"):
            kinds = ", ".join(
                f"{kind} {fmt(entry['ms'])} ms ({fmt(entry['kernels'])} kernels)"
                for kind, entry in times["by_kind"].items()
            )
            lines += [
                "",
                f"Where `{name}`'s GPU time goes (one profiled update): kernels busy {fmt(times['busy_ms'])} ms of "
                f"{fmt(v['update_ms'])} ms per update; {kinds}. The longest kernels by total time are in the JSON "
                f"(`update.variants.{name}.kernel_time.top`).",
            ]
    return lines


def variant_note(v: dict) -> str:
    """What a measured variant trained with: captured or not, the kernels' paths installed (none: Part 1), which loops
    ran compiled."""
    installed = v.get("installed") or {}
    paths = v.get("kernel_paths_installed")
    loops = [loop for loop in ("observe", "imagine") if installed.get(f"{loop}_compiled")]
    words = ["captured"] * bool(v.get("captured"))
    words += [] if paths is None else [f"paths: {', '.join(paths)}" if paths else "Part 1 (no kernels path)"]
    return "; ".join(words + ([f"compiled: {', '.join(loops)}"] if loops else []))


def regions_markdown(data: dict) -> list[str]:
    """The update region by region (update_variants.py, dev/gpu/update_regions.py): its FLOPs, then for each variant
    measured its kernels, their busy time and the wall time of each region."""
    flops = data.get("flops") or {}
    by_region = flops.get("by_region") or {}
    lines = ["", "### The update region by region", ""]
    if flops:
        lines.append(
            f"FLOPs per update: {fmt(flops['total'] / 1e9)} GFLOP, {flops['counted_as']}; FlopCounterMode's count of "
            f"the whole update {fmt(flops['flop_counter_total'] / 1e9)} GFLOP. The same for every variant (the same "
            "products, compiled, captured, fused or in bf16)."
        )
    elif data.get("flops_error"):
        lines.append(f"FLOPs: not counted ({data['flops_error']}).")
    caches = data.get("inductor_caches")
    if caches:
        lines += [
            "",
            "Inductor's caches in this process: "
            + ", ".join(f"{key} {fmt(value)}" for key, value in caches.items())
            + ".",
        ]
    for name, v in data.get("variants", {}).items():
        regions = v.get("regions")
        if not regions or "update_ms" not in v:
            continue
        lines += [
            "",
            (
                f"`{name}`: {v.get('regions_timed_as')}. The regions' wall time sums to the profiled update's span, "
                f"{fmt(v.get('regions_span_ms'))} ms from its first kernel's start to its last kernel's end, of its "
                f"median {fmt(v['update_ms'])} ms, timed without the profiler (on CUDA the rest of it is the host's: "
                "the batch's copy, the launches)"
                + (
                    f"; {v['regions_unlinked']} kernels whose launch the profiler did not link are in 'rest forward'"
                    if v.get("regions_unlinked")
                    else ""
                )
                + "."
            ),
            "",
            "| region | kernels | busy ms | wall ms | busy / wall | GFLOP | TFLOP/s over wall |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        for region, entry in [*regions.items(), ("update", update_totals(regions))]:
            region_flops = flops["total"] if region == "update" and flops else by_region.get(region)
            wall = entry["wall_ms"]
            lines.append(
                f"| {region} | {fmt(entry['kernels'])} | {fmt(entry['busy_ms'])} | {fmt(wall)} | "
                f"{fmt(entry['busy_ms'] / wall if wall else None)} | "
                f"{fmt(region_flops / 1e9 if region_flops is not None else None)} | "
                f"{fmt(region_flops / wall / 1e9 if region_flops and wall else None)} |"
            )
    return lines


def update_totals(regions: dict) -> dict:
    """The regions' kernels, busy and wall time summed (None where a region's kernels were not counted)."""
    kernels = [entry["kernels"] for entry in regions.values()]
    return {
        "kernels": None if None in kernels else sum(kernels),
        "busy_ms": sum(entry["busy_ms"] for entry in regions.values()),
        "wall_ms": sum(entry["wall_ms"] for entry in regions.values()),
    }


def pong_markdown_staged(result: dict) -> list[str]:
    if "pong_command" not in result:
        return []
    lines = [
        "## (b) Pong, Atari100k recipe",
        "",
        f"`{result['pong_command']}`"
        + (" (continued from its last checkpoint)" if result.get("pong_resumed") else "")
        + (
            "; with --compile it compiles from the update stage's Inductor cache, so its start-up holds little "
            "compiling"
            if result.get("pong_inductor_cache", "fresh") != "fresh"
            else ""
        ),
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
    if result.get("pong_cap_moves"):
        lines += [
            "Its time cap was moved by a later device call of the lease (`--deadline-file`): "
            + "; ".join(
                f"at {fmt(at)} s after its launch to {fmt(cap)} s" for at, cap in result["pong_cap_moves"]
            )
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
                f" MB; peak host RSS {fmt(result.get('pong_peak_host_rss_mb'))} MB. Keeping the replay on disk "
                f"took {fmt(result.get('pong_replay_write_us_per_env_step'))} us per env step, and writing "
                f"checkpoints {fmt(result.get('pong_checkpoint_write_s'))} s in all."
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
                    + (f" {result['pong_reference_added']}." if result.get("pong_reference_added") else "")
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
            + ". Every sample is in the JSON file. "
            + code_markdown(result.get("code"))
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
            [
                *head,
                *lease_markdown(result),
                *update_markdown(result),
                "",
                *incident_stage.incidents_markdown(result),
                *pong_markdown_staged(result),
            ]
        )
        + "\n"
    )


def lease_markdown(result: dict) -> list[str]:
    """The device calls a run spanned (`gpu_lease.sh start` and `finish`, dev/gpu/gpu_lease_note.py)."""
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


if __name__ == "__main__":
    main_staged(tyro.cli(StageArgs))
