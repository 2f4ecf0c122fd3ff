"""Sweeps: several seeds times a small grid of settings of dreamer_atari.py or dqn_starcraft_split.py, as one Slurm
job array (one task per run, through submitit) or locally, one run after another.

    python sweep.py dreamer_atari.py --seeds 1 2 3 --grid learning_rate=1e-4,3e-4 --backend slurm \
        --partition gpu --gpus-per-task 1 --cpus-per-task 4 --time-min 720 --mem-gb 32 -- --total-timesteps 400000
    python sweep.py dqn_starcraft_split.py --seeds 1 2 3 --grid n_step=1,3 --backend local -- --num-episodes 500

`--grid NAME=V1,V2,...` (repeatable) names a field of the script's `Args` (`learning_rate` or `learning-rate`); the
runs are every combination of the grid values times every seed. Flags after `--` go to every run unchanged. Names
and values are checked against the script's `Args` (its types, then its own validation) before anything is
submitted or written: a bad one is one sentence on stderr and exit status 2.

Each task waits for free GPU memory (memory_utils: NVML, no CUDA context; no wait on a machine without a GPU), then
runs the script in its own folder `runs/<sweep>/<run>` (the script's usual `runs/` and `results/` are inside it),
with `WANDB_RUN_GROUP=<sweep>` so that the wandb runs of a sweep (`-- --track`) share a group.

Preemption and time limits: Slurm's SIGTERM reaches the script, which writes a checkpoint and exits 143; the task
is requeued (`scontrol requeue`, preemption with requeue, or submitit's own requeue 90 s before `--time-min` runs
out) and then finds the checkpoint in its folder and continues from it with `--resume`, once the checkpoint matches
the checksum the script wrote beside it (one that does not is not resumed from: the run fails in one line and the
file stays where it is). Running the same command again with the same `--name` also continues every run that did
not finish, and skips those that did.

Each finished run writes `result.json` in its folder and every attempt a line of `attempts.jsonl`; the last run to
finish writes `runs/<sweep>/results.csv` (run, seed, overrides, final score, steps, wall time, peak memory) and
`runs/<sweep>/summary.md` (mean and spread of the final score per setting over its seeds).
"""

import contextlib
import csv
import dataclasses
import fcntl
import importlib
import importlib.util
import io
import itertools
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import tyro

HERE = Path(__file__).resolve().parent
EXIT_BAD_INPUT = 2


@dataclass
class Args:
    script: tyro.conf.Positional[str]
    """the training script: dreamer_atari.py or dqn_starcraft_split.py"""
    seeds: tuple[int, ...] = (1,)
    """the seeds of every setting"""
    grid: tuple[str, ...] = ()
    """`NAME=V1,V2,...` per swept field of the script's Args (repeat for a grid: every combination runs)"""
    name: str | None = None
    """the sweep's name and folder `{root}/{name}`; default `{script}-{date}-{time}`. Running again with the same
    name continues the runs that did not finish"""
    root: str = "runs"
    """the folder holding one folder per sweep"""
    backend: Literal["slurm", "local"] = "local"
    """`slurm`: one job array through submitit; `local`: the runs one after another on this machine"""

    # Slurm, per task (one run)
    partition: str | None = None
    """the Slurm partition (default: the cluster's default partition)"""
    gpus_per_task: int = 1
    """GPUs per run (0 on a CPU-only cluster)"""
    cpus_per_task: int = 4
    """CPU cores per run"""
    mem_gb: float = 32.0
    """memory per run, in GB"""
    time_min: int = 720
    """time limit per run, in minutes: submitit signals the task 90 s before it and requeues it"""
    account: str | None = None
    """the Slurm account to charge (default: yours)"""
    qos: str | None = None
    """the Slurm quality of service (default: the partition's)"""
    max_parallel: int = 256
    """at most this many runs of the array at once"""
    wait: bool = False
    """with `slurm`: stay until the array has left the queue, then print the summary"""
    max_restarts: int = 3
    """a run killed without a signal (SIGKILL, exit 137: a dead node, the OOM killer) resumes from its last
    checkpoint at most this many times"""

    # waiting for GPU memory, per task
    min_free_mb: float = 2000.0
    """free GPU memory (MB, whole card, through NVML) to wait for before a run starts (0: don't wait)"""
    wait_timeout_s: float = 3600.0
    """after this many seconds of waiting, start anyway (the script's own out-of-memory handling takes over)"""
    wait_poll_s: float = 30.0
    """seconds between two looks at the free memory"""


# ---------------------------------------------------------------------------------------------------------
# What the sweep needs to know about each script
# ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Script:
    """How a training script is run by a sweep, resumed, and read when it has finished."""

    file: str
    owned: tuple[str, ...]
    """fields the sweep sets itself (a run's seed, folders, resume), refused in --grid and after --"""
    fixed_flags: tuple[str, ...]
    """flags every run gets: where it writes, and a final checkpoint that holds its counters (the scripts keep their
    replay on disk by default, so a requeued run goes on with the data it had)"""

    def checkpoint(self, run_dir: Path) -> Path | None:
        """The checkpoint a run of this folder resumes from: its own (the DQN's fixed `results/run`; Dreamer's one
        run folder under runs/, the most recently written where an earlier attempt left more than one)."""
        pattern = "runs/*/checkpoint.pt" if self.file == "dreamer_atari.py" else "results/run/checkpoint.pt"
        found = sorted(run_dir.glob(pattern), key=lambda path: path.stat().st_mtime)
        return found[-1] if found else None

    def events_dir(self, run_dir: Path) -> Path | None:
        found = sorted(path for path in run_dir.glob("runs/*") if path.is_dir())
        return found[-1] if found else None

    def final(self, run_dir: Path) -> dict:
        """Final score and total steps of a finished run, from what the script wrote."""
        if self.file == "dreamer_atari.py":
            import torch

            checkpoint = self.checkpoint(run_dir)
            verify_checkpoint(checkpoint)
            state = torch.load(checkpoint, map_location="cpu", weights_only=True)
            returns = [event.value for event in scalars(self.events_dir(run_dir), "charts/episodic_return")]
            score = sum(returns[-10:]) / len(returns[-10:]) if returns else math.nan
            return {
                "final_score": score,
                "steps": int(state["counters"]["global_step"]),
                "score_is": "mean episodic return of the last 10 training episodes",
            }
        test = json.loads((run_dir / "results" / "run" / "eval" / "test_results.json").read_text())
        return {
            "final_score": float(test["mean"]),
            "steps": int(test["global_steps"]),
            "score_is": f"mean score of {test['num_test_episodes']} greedy test episodes",
        }


SCRIPTS = {
    "dreamer_atari.py": Script(
        "dreamer_atari.py",
        owned=("seed", "resume", "save_model"),
        fixed_flags=("--save-model",),
    ),
    "dqn_starcraft_split.py": Script(
        "dqn_starcraft_split.py",
        owned=("seed", "seeds", "resume", "run_id", "save_path", "log_dir", "overwrite", "save_model"),
        fixed_flags=(
            "--run-id",
            "run",
            "--save-path",
            "results",
            "--log-dir",
            "runs",
            "--save-model",
        ),
    ),
}


# ---------------------------------------------------------------------------------------------------------
# The plan: runs from seeds x grid, checked before anything is written
# ---------------------------------------------------------------------------------------------------------
class BadInput(ValueError):
    """One sentence for the user; exit status 2."""


@dataclass(frozen=True)
class Run:
    """One run of a sweep: a seed and one value per swept field."""

    name: str
    seed: int
    overrides: tuple[tuple[str, str], ...]  # (field, value as typed), in --grid order

    @property
    def setting(self) -> str:
        return ",".join(f"{field}={value}" for field, value in self.overrides) or "defaults"


@dataclass(frozen=True)
class Plan:
    """A checked sweep: everything a task needs (it is pickled into each Slurm task)."""

    sweep: str
    sweep_dir: str
    script_path: str
    script: Script
    runs: tuple[Run, ...]
    extra: tuple[str, ...]
    python: str
    min_free_mb: float
    wait_timeout_s: float
    wait_poll_s: float
    bool_fields: frozenset
    max_restarts: int = 3

    def command(self, run: Run, resume: Path | None) -> list[str]:
        flags = [self.python, self.script_path, *self.script.fixed_flags, "--seed", str(run.seed)]
        for field, value in run.overrides:
            flag = "--" + field.replace("_", "-")
            if field in self.bool_fields:
                flags.append(flag if value == "True" else "--no-" + flag[2:])
            else:
                flags += [flag, value]
        flags += self.extra
        if resume is not None:
            flags += ["--resume", str(resume)]
        return flags


def load_script_args(path: Path) -> tuple[type, types.ModuleType]:
    spec = importlib.util.spec_from_file_location(f"_sweep_target_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import does: dataclasses look their module up there
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    return module.Args, module


def parse_value(field: str, raw: str, annotation) -> typing.Any:
    """`raw` as the field's type, or BadInput naming the value and what is allowed."""
    origin, choices = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType) and type(None) in choices:
        if raw == "None":
            return None
        (annotation,) = [choice for choice in choices if choice is not type(None)]
        origin, choices = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Literal:
        if raw not in [str(choice) for choice in choices]:
            raise BadInput(f"--grid {field}: {raw!r} is not one of {', '.join(map(str, choices))}.")
        return raw
    if annotation is bool:
        if raw.lower() not in ("true", "false"):
            raise BadInput(f"--grid {field}: {raw!r} is not a boolean; use True or False.")
        return raw.lower() == "true"
    if annotation in (int, float):
        try:
            return annotation(raw)
        except ValueError:
            raise BadInput(
                f"--grid {field}: {raw!r} is not {'an integer' if annotation is int else 'a number'}."
            )
    if annotation is str:
        return raw
    raise BadInput(f"--grid {field}: a field of type {annotation} cannot be swept; give it after -- instead.")


def script_field(name: str, fields: dict, script: Script, where: str) -> str:
    field = name.replace("-", "_")
    if field not in fields:
        import difflib

        close = difflib.get_close_matches(field, sorted(fields), n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        raise BadInput(f"{where} {name!r} is not a field of {script.file}'s Args{hint}.")
    if field in script.owned:
        raise BadInput(f"{where} {name!r} is set by the sweep itself for each run; leave it out.")
    return field


def check_extra(extra: list[str], fields: dict, script: Script) -> None:
    for token in extra:
        if token.startswith("--"):
            name = token[2:].split("=", 1)[0].replace("-", "_")
            if name.startswith("no_") and name not in fields and name[3:] in fields:
                name = name[3:]
            script_field(name, fields, script, "the flag after --")


def validation_problem(module: types.ModuleType, args) -> str | None:
    """The script's own check of a run's values (Args.problems() or check_args()), as one sentence or None."""
    if hasattr(args, "problems"):
        problems = args.problems()
        return problems[0][1] if problems else None
    if hasattr(module, "check_args"):
        try:
            module.check_args(args)
        except ValueError as exc:
            return str(exc)
    return None


def plan_sweep(args: Args, extra: list[str]) -> Plan:
    """Check everything (script, names, types, values) and list the runs; BadInput on the first problem."""
    script = SCRIPTS.get(Path(args.script).name)
    if script is None:
        raise BadInput(f"{args.script!r} is not a script sweep.py runs; it runs {' or '.join(SCRIPTS)}.")
    path = Path(args.script) if Path(args.script).is_file() else HERE / script.file
    if not path.is_file():
        raise BadInput(f"{args.script!r} does not exist (neither here nor beside sweep.py).")
    if not args.seeds or len(set(args.seeds)) != len(args.seeds):
        raise BadInput(
            f"--seeds must be one or more distinct integers, got {' '.join(map(str, args.seeds))!r}."
        )
    for flag, value, least, allowed in (
        ("--gpus-per-task", args.gpus_per_task, 0, "0 or more"),
        ("--cpus-per-task", args.cpus_per_task, 1, "at least 1"),
        ("--time-min", args.time_min, 1, "at least 1"),
        ("--max-parallel", args.max_parallel, 1, "at least 1"),
        ("--mem-gb", args.mem_gb, 0, "0 or more"),
        ("--min-free-mb", args.min_free_mb, 0, "0 or more"),
        ("--wait-timeout-s", args.wait_timeout_s, 0, "0 or more"),
        ("--wait-poll-s", args.wait_poll_s, 1e-3, "positive"),
    ):
        if not value >= least:
            raise BadInput(f"{flag} must be {allowed}, got {value}.")
    if args.name is not None and not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+=-]*", args.name):
        raise BadInput(f"--name {args.name!r} must be a folder name of letters, digits and . _ + = -.")
    script_args, module = load_script_args(path)
    fields = {field.name: field for field in dataclasses.fields(script_args)}
    hints = typing.get_type_hints(script_args)
    check_extra(extra, fields, script)

    axes = []  # per swept field: [(field, text, value), ...]
    for item in args.grid:
        name, sep, values = item.partition("=")
        if not sep or not values:
            raise BadInput(f"--grid {item!r} must be NAME=V1,V2,... (e.g. learning_rate=1e-4,3e-4).")
        field = script_field(name, fields, script, "--grid")
        if field in [axis[0][0] for axis in axes]:
            raise BadInput(f"--grid names {field} twice; give all its values in one NAME=V1,V2,...")
        texts = values.split(",")
        if len(set(texts)) != len(texts) or "" in texts:
            raise BadInput(f"--grid {item!r} must list distinct, non-empty values.")
        for text in texts:
            if not re.fullmatch(r"[A-Za-z0-9._+-]+", text):
                raise BadInput(f"--grid {field}: {text!r} may hold only letters, digits and . _ + -.")
        axes.append([(field, text, parse_value(field, text, hints[field])) for text in texts])

    runs = []
    for combination in itertools.product(*axes):
        values = {field: value for field, _, value in combination}
        problem = validation_problem(module, script_args(**values))
        if problem:
            raise BadInput(
                f"--grid {','.join(f'{f}={t}' for f, t, _ in combination)}: {problem.rstrip('.')}."
            )
        overrides = tuple(
            (field, str(value) if isinstance(value, bool) else text) for field, text, value in combination
        )
        setting = ",".join(f"{field}={text}" for field, text in overrides) or "defaults"
        for seed in args.seeds:
            runs.append(Run(f"{setting}__seed{seed}", seed, overrides))

    name = args.name or f"{path.stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    return Plan(
        sweep=name,
        sweep_dir=str(Path(args.root).resolve() / name),
        script_path=str(path.resolve()),
        script=script,
        runs=tuple(runs),
        extra=tuple(extra),
        python=sys.executable,
        min_free_mb=args.min_free_mb,
        wait_timeout_s=args.wait_timeout_s,
        wait_poll_s=args.wait_poll_s,
        bool_fields=frozenset(field for field in fields if hints[field] is bool),
        max_restarts=args.max_restarts,
    )


def check_slurm() -> None:
    """BadInput unless sbatch and squeue exist and the controller answers."""
    missing = [tool for tool in ("sbatch", "squeue") if shutil.which(tool) is None]
    if missing:
        raise BadInput(
            f"--backend slurm needs Slurm, and {' and '.join(missing)} is not on PATH here; "
            f"use --backend local."
        )
    try:
        subprocess.run(
            ["squeue", "-h", "-u", "root", "-o", "%i"], capture_output=True, check=True, timeout=30
        )
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        detail = (getattr(exc, "stderr", b"") or b"").decode().strip().splitlines()
        raise BadInput(
            f"--backend slurm needs Slurm, and its controller does not answer"
            f"{' (' + detail[-1] + ')' if detail else ''}; use --backend local."
        )


# ---------------------------------------------------------------------------------------------------------
# One task: wait for the GPU, run (or resume) the script in its folder, record the result
# ---------------------------------------------------------------------------------------------------------
class RunStopped(RuntimeError):
    """The script was stopped by a signal after writing its checkpoint: the run continues when requeued."""


KILLED = 128 + signal.SIGKILL  # what a run killed without a chance to checkpoint ends with (137)


class RunFailed(RuntimeError):
    """The script failed; its output is in the run folder."""


def wait_for_free_gpu(plan: Plan, log) -> None:
    """memory_utils' NVML wait (no CUDA context in this process); returns at once where NVML sees no GPU."""
    if plan.min_free_mb <= 0:
        return
    import memory_utils as mu

    try:
        probe = mu.NvmlProbe(0)
    except mu.NvmlUnavailable as exc:
        log(f"sweep: not waiting for GPU memory: {exc}")
        return
    try:
        ready = mu.wait_for_gpu(
            plan.min_free_mb, plan.wait_poll_s, plan.wait_timeout_s, probe=probe, verbose=False
        )
    finally:
        probe.close()
    log(
        f"sweep: {'enough' if ready else 'still not enough after waiting'} free GPU memory "
        f"({plan.min_free_mb:g} MB wanted); starting"
    )


def verify_checkpoint(path: Path) -> str | None:
    """memory_utils' check of a checkpoint against its archive's own CRC-32s and the checksum the script wrote
    beside it, before the sweep reads or resumes it: RunFailed (one sentence) when its bytes are not the ones
    written; a line to log when neither check is possible (no checksum, not a zip archive), else None."""
    import memory_utils as mu

    try:
        return mu.verify_checkpoint(path)
    except mu.CheckpointInvalid as exc:
        raise RunFailed(str(exc)) from None


def in_slurm() -> bool:
    return "SLURM_JOB_ID" in os.environ


_child: subprocess.Popen | None = None  # the script now running, for the signal forwarding of local sweeps


def run_script(command: list[str], cwd: Path, log_path: Path, outcome: dict) -> None:
    """Run the script in `cwd`, its output appended to `log_path`; `outcome["exit_code"]`: its exit status as a
    shell reports it (128 + N for signal N), set even when this process is being made to exit.

    Under Slurm the script is in this task's process group: Slurm's SIGTERM (preemption, requeue, scancel) reaches
    it directly, once. Locally it gets its own group and this process passes SIGINT/SIGTERM/SIGHUP on, once each."""
    global _child
    # each run starts its own wandb service: wandb records its service in WANDB_SERVICE of the process that used it,
    # and a run that inherited it would report to that process's service, which may be gone by then
    env = {**{k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}, "PYTHONUNBUFFERED": "1"}
    env.setdefault("WANDB_RUN_GROUP", Path(cwd).parent.name)
    if "SLURM_CPUS_PER_TASK" in env:  # the task's cores, not the node's (oversubscribed OpenMP crawls)
        env.setdefault("OMP_NUM_THREADS", env["SLURM_CPUS_PER_TASK"])
    local = not in_slurm()
    previous = {}
    if local:

        def forward(signum, frame):
            if _child is not None and _child.poll() is None:
                _child.send_signal(signum)

        previous = {
            sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
        }
    try:
        with open(log_path, "a") as out:
            _child = subprocess.Popen(
                command,
                cwd=cwd,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                process_group=0 if local else None,
            )
            try:
                _child.wait()
            finally:
                # submitit's timeout requeue exits this process from its signal handler, which interrupts the
                # wait above: let the script finish its checkpoint first
                with contextlib.suppress(subprocess.TimeoutExpired):
                    _child.wait(timeout=300)
                code = _child.returncode
                outcome["exit_code"] = None if code is None else 128 - code if code < 0 else code
    finally:
        _child = None
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_one(plan: Plan, index: int) -> dict:
    """Task `index` of the sweep: its result row (from result.json if the run had already finished)."""
    run = plan.runs[index]
    run_dir = Path(plan.sweep_dir) / run.name
    run_dir.mkdir(parents=True, exist_ok=True)
    result_path = run_dir / "result.json"
    if result_path.exists():
        return json.loads(result_path.read_text())
    log_path = run_dir / "output.log"

    def log(line: str) -> None:
        with open(log_path, "a") as out:
            out.write(line + "\n")
        print(line, flush=True)

    wait_for_free_gpu(plan, log)
    while attempt_run(plan, run, run_dir, log) == KILLED:
        restarts = sum(a["exit_code"] == KILLED for a in attempts(run_dir))
        if restarts > plan.max_restarts:
            raise RunFailed(
                f"run {run.name} was killed (exit {KILLED}, SIGKILL: a dead node or the OOM killer) {restarts} "
                f"time{'s' * (restarts != 1)}, more than --max-restarts {plan.max_restarts}; see {log_path}"
            )
        log(
            f"sweep: run {run.name} was killed (exit {KILLED}, SIGKILL: a dead node or the OOM killer); it goes on "
            f"from its last checkpoint (restart {restarts} of at most {plan.max_restarts})"
        )
    row = {
        "run": run.name,
        "seed": run.seed,
        "overrides": run.setting,
        **plan.script.final(run_dir),
        "wall_time_s": round(sum(a["seconds"] for a in attempts(run_dir)), 1),
        "attempts": len(attempts(run_dir)),
        "restarts": sum(a["exit_code"] == KILLED for a in attempts(run_dir)),
        **peak_memory(plan.script.events_dir(run_dir)),
    }
    atomic_write(result_path, json.dumps(row, indent=2))
    write_summary(plan)
    return row


def attempt_run(plan: Plan, run: Run, run_dir: Path, log) -> int:
    """One attempt at a run: resumed from its checkpoint when it has one (once that matches its checksum), started
    afresh otherwise; returns its exit status when it finished (0) or was killed (137); RunStopped when a signal
    stopped it after its checkpoint, RunFailed when it failed."""
    log_path = run_dir / "output.log"
    resume = plan.script.checkpoint(run_dir)
    if resume is not None:
        try:
            if note := verify_checkpoint(resume):
                log(f"sweep: {note}")
        except RunFailed as exc:  # not resumed from, and not removed: the run is left for a look
            log(f"sweep: {exc}")
            raise RunFailed(f"run {run.name} is not resumed: {exc}") from None
    stale = [run_dir / name for name in ("runs", "results") if (run_dir / name).exists()]
    if resume is None and stale:  # an earlier attempt died before any checkpoint: start that run afresh
        log(f"sweep: no checkpoint from the earlier attempt; removing {', '.join(p.name for p in stale)}")
        for path in stale:
            shutil.rmtree(path)
    attempt = {
        "attempt": len(attempts(run_dir)) + 1,
        "slurm_job": os.environ.get("SLURM_JOB_ID"),
        "slurm_array_task": os.environ.get("SLURM_ARRAY_TASK_ID"),
        "slurm_restart_count": int(os.environ.get("SLURM_RESTART_COUNT", "0")),
        "resumed_from": str(resume.relative_to(run_dir)) if resume else None,
        "started": time.time(),
    }
    command = plan.command(run, resume)
    log(
        f"sweep: run {run.name} attempt {attempt['attempt']}{f', resuming {resume}' if resume else ''}: "
        f"{' '.join(command)}"
    )
    outcome = {"exit_code": None}
    try:
        run_script(command, run_dir, log_path, outcome)
    finally:
        attempt.update(seconds=time.time() - attempt["started"], exit_code=outcome["exit_code"])
        with open(run_dir / "attempts.jsonl", "a") as out:
            out.write(json.dumps(attempt) + "\n")
    returncode = outcome["exit_code"]
    if returncode in (128 + signal.SIGTERM, 128 + signal.SIGINT):
        raise RunStopped(
            f"run {run.name} was stopped by {signal.Signals(returncode - 128).name} after writing its "
            f"checkpoint; it continues from it when the task is requeued or the sweep is run again"
        )
    if returncode not in (0, KILLED):
        tail = log_path.read_text().strip().splitlines()[-1:] or [""]
        raise RunFailed(
            f"run {run.name} failed with exit status {returncode} ({tail[0][:200]}); see {log_path}"
        )
    return returncode


def attempts(run_dir: Path) -> list[dict]:
    path = run_dir / "attempts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


class SweepTask:
    """The callable submitit runs in each array task. Checkpointable: when submitit's timeout signal (USR2, 90 s
    before the time limit) comes, it requeues the task, and Slurm's SIGTERM makes the script write its checkpoint;
    the requeued task resumes from it."""

    def __init__(self, plan: Plan):
        self.plan = plan

    def __call__(self, index: int) -> dict:
        return run_one(self.plan, index)

    def checkpoint(self, index: int):
        import submitit

        return submitit.helpers.DelayedSubmission(self, index)


# ---------------------------------------------------------------------------------------------------------
# Results: results.csv and summary.md of the runs that finished
# ---------------------------------------------------------------------------------------------------------
COLUMNS = (
    "run",
    "seed",
    "overrides",
    "final_score",
    "steps",
    "wall_time_s",
    "peak_rss_mb",
    "peak_gpu_reserved_mb",
    "attempts",
    "restarts",
)


def scalars(events_dir: Path | None, tag: str) -> list:
    """A tag's scalar events as TensorBoard shows them (a resumed run's purged steps left out), in step order."""
    if events_dir is None:
        return []
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(events_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return accumulator.Scalars(tag) if tag in accumulator.Tags()["scalars"] else []


def peak_memory(events_dir: Path | None) -> dict:
    """The largest host RSS and GPU reserved memory the run logged (memory_utils' keys), in MB."""
    peaks = {}
    for column, tag in (
        ("peak_rss_mb", "debug/cpu/rss_mb"),
        ("peak_gpu_reserved_mb", "debug/gpu/max_reserved_mb"),
    ):
        values = [event.value for event in scalars(events_dir, tag)]
        peaks[column] = round(max(values), 1) if values else ""
    return peaks


def atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_summary(plan: Plan) -> list[dict]:
    """results.csv and summary.md from every finished run; under a lock, so the last task to finish writes all."""
    sweep_dir = Path(plan.sweep_dir)
    with open(sweep_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        rows = [
            json.loads(path.read_text())
            for run in plan.runs
            if (path := sweep_dir / run.name / "result.json").exists()
        ]
        text = io.StringIO()
        writer = csv.DictWriter(text, fieldnames=COLUMNS, extrasaction="ignore", lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        atomic_write(sweep_dir / "results.csv", text.getvalue())
        atomic_write(sweep_dir / "summary.md", summary_markdown(plan, rows))
    return rows


def summary_markdown(plan: Plan, rows: list[dict]) -> str:
    score_is = rows[0].get("score_is", "final score") if rows else "final score"
    lines = [
        f"# Sweep {plan.sweep}: {Path(plan.script_path).name}",
        "",
        f"{len(rows)} of {len(plan.runs)} runs finished. Final score: {score_is}; spread: the sample standard "
        + "deviation over seeds.",
        "",
        "| setting | seeds | final score mean | spread | min | max | steps |",
        "|-|-|-|-|-|-|-|",
    ]
    settings = dict.fromkeys(run.setting for run in plan.runs)
    for setting in settings:
        done = [row for row in rows if row["overrides"] == setting]
        scores = [float(row["final_score"]) for row in done]
        if not scores:
            lines.append(f"| {setting} | 0 | | | | | |")
            continue
        mean = sum(scores) / len(scores)
        spread = (
            math.sqrt(sum((s - mean) ** 2 for s in scores) / (len(scores) - 1)) if len(scores) > 1 else 0.0
        )
        seeds = " ".join(str(row["seed"]) for row in done)
        steps = "/".join(sorted({str(row["steps"]) for row in done}))
        lines.append(
            f"| {setting} | {seeds} | {mean:.3f} | {spread:.3f} | {min(scores):.3f} | {max(scores):.3f} "
            f"| {steps} |"
        )
    killed = [f"{row['run']} ({row['restarts']}x)" for row in rows if row.get("restarts")]
    if killed:
        lines += [
            "",
            f"Killed without a signal (SIGKILL: a dead node, the OOM killer) and resumed from their last checkpoint: "
            f"{', '.join(killed)}.",
        ]
    if plan.extra:
        lines += ["", f"Every run also had: `{' '.join(plan.extra)}`"]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------------------------------------
def write_plan(plan: Plan) -> None:
    """`sweep.json` records the sweep; a second sweep of the same name must be the same sweep (it continues it)."""
    sweep_dir = Path(plan.sweep_dir)
    record = {
        "script": Path(plan.script_path).name,
        "runs": [dataclasses.asdict(run) for run in plan.runs],
        "extra": list(plan.extra),
    }
    path = sweep_dir / "sweep.json"
    if path.exists():
        if json.loads(path.read_text()) != json.loads(json.dumps(record)):
            raise BadInput(
                f"sweep {plan.sweep!r} already exists in {sweep_dir} with other runs or flags; choose "
                f"another --name."
            )
        return
    sweep_dir.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(record, indent=2))


def run_local(plan: Plan) -> int:
    failed = []
    for index, run in enumerate(plan.runs):
        print(f"sweep: {index + 1}/{len(plan.runs)} {run.name}", flush=True)
        try:
            run_one(plan, index)
        except RunStopped as exc:
            print(
                f"sweep: {exc}; stopping the sweep (run the same command again to continue it)",
                file=sys.stderr,
            )
            return 128 + signal.SIGTERM
        except RunFailed as exc:
            print(f"sweep: {exc}", file=sys.stderr)
            failed.append(run.name)
    rows = write_summary(plan)
    print(
        f"sweep: {len(rows)} of {len(plan.runs)} runs finished; {plan.sweep_dir}/results.csv and summary.md"
    )
    return 1 if failed else 0


def submit_slurm(args: Args, plan: Plan) -> int:
    import submitit

    class ExecSlurmExecutor(submitit.SlurmExecutor):
        @property
        def _submitit_command_str(self) -> str:
            return "exec " + super()._submitit_command_str

    executor = ExecSlurmExecutor(folder=Path(plan.sweep_dir) / "slurm" / "%j", max_num_timeout=100)
    executor.update_parameters(
        job_name=f"sweep-{plan.sweep}",
        partition=args.partition,
        account=args.account,
        qos=args.qos,
        time=args.time_min,
        mem=f"{max(1, round(args.mem_gb * 1024))}M",
        cpus_per_task=args.cpus_per_task,
        ntasks_per_node=1,
        gpus_per_task=args.gpus_per_task or None,
        array_parallelism=args.max_parallel,
        # submitit's Python replaces the batch shell (exec, no srun): on a requeue or preemption srun kills its step
        # at once ("forcing job termination"), before the script has written its checkpoint. So Slurm's SIGTERM
        # reaches submitit (which passes it by) and the script (which checkpoints within KillWait), and the
        # time-limit signal goes to the batch shell, which is submitit's Python (B:)
        use_srun=False,
        additional_parameters={"requeue": True, "signal": "B:USR2@90"},
    )
    # the task imports this module by name, as `sweep`, wherever the job starts
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    try:
        jobs = executor.map_array(SweepTask(plan), list(range(len(plan.runs))))
    except submitit.core.utils.FailedJobError as exc:
        lines = str(exc).strip().splitlines() or ["no reason given"]
        raise BadInput(f"Slurm refused the job array: {lines[-1]}") from None
    array_id = jobs[0].job_id.split("_")[0]  # submitit submits a single run as a plain job, not an array
    what = f"job array {array_id} with {len(jobs)} tasks" if len(jobs) > 1 else f"job {array_id} (one run)"
    print(
        f"sweep: submitted {what}; runs in {plan.sweep_dir}, Slurm logs in "
        f"{plan.sweep_dir}/slurm; results.csv and summary.md appear there when the last run finishes",
        flush=True,
    )
    if not args.wait:
        return 0
    while subprocess.run(
        ["squeue", "-h", "-j", array_id, "-o", "%i"], capture_output=True, text=True, check=False
    ).stdout.strip():
        time.sleep(5)
    rows = write_summary(plan)
    print(Path(plan.sweep_dir, "summary.md").read_text())
    return 0 if len(rows) == len(plan.runs) else 1


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """The sweep's own flags, and the flags after `--` that every run gets."""
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1 :]
    return argv, []


def main(argv: list[str] | None = None) -> int:
    own, extra = split_argv(sys.argv[1:] if argv is None else list(argv))
    args = tyro.cli(Args, args=own)
    try:
        plan = plan_sweep(args, extra)
        if args.backend == "slurm":
            check_slurm()
    except BadInput as exc:
        print(f"sweep.py: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    created = [path for path in (Path(plan.sweep_dir).parent, Path(plan.sweep_dir)) if not path.exists()]
    try:
        write_plan(plan)
        print(f"sweep: {plan.sweep}: {len(plan.runs)} runs of {Path(plan.script_path).name} ({args.backend})")
        if args.backend == "local":
            return run_local(plan)
        return submit_slurm(args, plan)
    except BadInput as exc:
        for path in reversed(created):  # nothing was submitted: leave nothing behind either
            shutil.rmtree(path, ignore_errors=True)
        print(f"sweep.py: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    # run as the module `sweep`, so that the task each Slurm job unpickles is importable by that name
    sys.path.insert(0, str(HERE))
    sys.exit(importlib.import_module("sweep").main())
