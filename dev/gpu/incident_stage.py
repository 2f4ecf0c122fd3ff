"""The incidents' own GPUs (issue 66), one lease stage: the default Dreamer inside a 6 GB card, the DQN in each
precision, and the DQN incident replayed on a card another process fills.

    python dev/gpu/incident_stage.py --out PATH                        # CUDA (gpu_stages.py --stage incidents)
    python dev/gpu/incident_stage.py --out PATH --device cpu --quick   # the same steps at tiny sizes, no GPU

PATH (JSON) is rewritten as each part ends, so a stage stopped early keeps what it measured. In this order:
1. `dqn_incident` (CUDA only; it needs the GPU to itself): a second process (`hold`) takes all of the GPU but
   65 MB. (a) A DQN started with --wait-for-gpu-mb waits without a CUDA context of its own (NVML lists no new
   process while it waits) and starts within one poll after the holder exits. (b) With no wait, it cannot make its
   CUDA context: exit 3, a report, no traceback. (c) With a wait timeout, and the holder leaving room for a context
   (1 GiB), it starts on --fallback-batch-size and trains. (d) Started with room, then the holder takes everything:
   its first step's OOM ends in exit 3 with the report and a checkpoint, no traceback (the caching allocator is off
   in that run, PYTORCH_NO_CUDA_MEMORY_CACHING=1, so that its first step must ask the card for memory: with the cache
   on, the preallocation's cached blocks serve the first step and nothing runs out, which is the point of it).
2. At once, `dreamer_6gb`: `dreamer_atari.py --gpu-memory-gb 6` with the default's replay capacity
   (--buffer-capacity 100000, the Atari100k run's), --total-timesteps 3000 (2,000 updates past learning starts, the
   device's default paths: frames on the GPU where they fit, updates captured) and one open-loop report (--video-every
   2500); peak reserved and allocated, memory at every log point (per 1,000 steps) and the process's own use of the
   card as NVML sees it (context included: it must stay under 6 GiB); and `dqn_precisions`: the DQN on MoveToBeacon
   at its defaults in fp16 (its CUDA default), bf16 and float32 (`dqn-precision`, one process each, beside Dreamer:
   their updates/s are measured on a shared GPU and said so): updates/s, peak allocated and reserved, the loss
   scaler's scale and skipped steps, whether every loss was finite, and allocated memory just before and after the
   first optimizer step that ran (equal: the preallocated state holds).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MB = 2**20
HERE = Path(__file__).resolve()
DREAMER_6GB_FLAGS = [
    "--gpu-memory-gb",
    "6",
    "--buffer-capacity",
    "100000",  # the default Atari100k run's replay (its --total-timesteps), so its frames are the default's
    "--total-timesteps",
    "3000",  # 2,000 updates past learning starts (1,000), one per env step
    "--video-every",
    "2500",  # one open-loop report (ball measure on 64 sequences) with the updates' pool in place
    "--exp-name",
    "incident_6gb",
]
# --quick on a CPU: the same command at the soak's tiny model, a few hundred steps
DREAMER_QUICK_FLAGS = [
    "--gpu-memory-gb",
    "6",
    "--buffer-capacity",
    "1000",
    "--total-timesteps",
    "160",
    "--learning-starts",
    "100",
    "--train-ratio",
    "8",
    "--batch-size",
    "4",
    "--sequence-length",
    "16",
    "--video-every",
    "150",
    "--log-interval",
    "50",
    "--encoder-channels",
    "4",
    "4",
    "4",
    "--deterministic-dim",
    "16",
    "--stochastic-dim",
    "4",
    "--stochastic-classes",
    "4",
    "--hidden-dim",
    "16",
    "--exp-name",
    "incident_6gb",
]
DQN_PRECISION_FLAGS = ["--map-name", "MoveToBeacon", "--num-episodes", "18", "--num-test-episodes", "2"]
DQN_QUICK_FLAGS = [
    "--res",
    "8",
    "--step-mul",
    "128",
    "--buffer-size",
    "200",
    "--learning-starts",
    "10",
    "--num-episodes",
    "4",
    "--num-test-episodes",
    "1",
]
DQN_INCIDENT_FLAGS = ["--learning-starts", "100", "--num-episodes", "3", "--num-test-episodes", "1"]
LEAVE_MB = 65  # what the A30 had free at times
FALLBACK_ROOM_MB = 1024  # room the holder leaves for the fallback run: a CUDA context and a small update
POLL_S = 1.0  # the DQN's --wait-for-gpu-mb poll in the replay


def log(message: str) -> None:
    print(f"[incidents] {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------------
# NVML: what the card holds, without a CUDA context in this process
# ---------------------------------------------------------------------------------------------------------
def nvml_processes() -> list[tuple[int, float]] | None:
    """(pid, MB used) of every process with a CUDA context on GPU 0 as NVML lists them; None without NVML. The pids
    may be another PID namespace's (a container): compare lists, not pids alone."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        listed = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        return sorted((int(p.pid), (p.usedGpuMemory or 0) / MB) for p in listed)
    except Exception:  # noqa: BLE001 - a figure the stage reports as missing
        return None


def new_processes(before: list | None, during: list | None) -> list | None:
    """The processes NVML lists during a wait that it did not list before it (by pid): None where NVML said nothing."""
    if before is None or during is None:
        return None
    return sorted({p for p, _ in during} - {p for p, _ in before})


# ---------------------------------------------------------------------------------------------------------
# The holder: a second process that fills the GPU, told how much to leave through a file
# ---------------------------------------------------------------------------------------------------------
def hold(control: Path, state: Path) -> None:
    """Keep all of GPU 0 but the MB `control` names (a number; `exit` ends it) in blocks of this process; write
    `state` ("<leave> <free MB>") each time it has got there. 0 takes everything the card gives."""
    import torch

    blocks: list = []
    target = None
    while True:
        text = control.read_text().strip() if control.exists() else ""
        if text == "exit":
            return
        if text and text != target:
            target = text
            leave = float(text) * MB
            free = torch.cuda.mem_get_info()[0]
            while free > leave + 2 * MB:  # take
                size = int(min(256 * MB, free - leave))
                try:
                    blocks.append(torch.empty(max(size, 2 * MB), dtype=torch.uint8, device="cuda"))
                except torch.OutOfMemoryError:
                    if size <= 2 * MB:
                        break
                    leave = free - size / 2  # the card gives less than it says: take smaller blocks
                free = torch.cuda.mem_get_info()[0]
            while free < leave and blocks:  # give back
                blocks.pop()
                torch.cuda.empty_cache()
                free = torch.cuda.mem_get_info()[0]
            tmp = state.with_suffix(".tmp")
            tmp.write_text(f"{text} {free / MB:.0f}")
            tmp.replace(state)
        time.sleep(0.05)


class Holder:
    """The holder process, driven from here."""

    def __init__(self, work: Path, name: str):
        self.control, self.state = work / f"{name}.control", work / f"{name}.state"
        self.control.unlink(missing_ok=True)
        self.state.unlink(missing_ok=True)
        self.process = subprocess.Popen(
            [sys.executable, str(HERE), "hold", "--control", str(self.control), "--state", str(self.state)],
            cwd=ROOT,
        )

    def leave(self, mb: float, timeout_s: float = 60) -> float:
        """Hold all but `mb`; returns the free MB once there."""
        self.control.write_text(f"{mb:g}")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.state.exists() and self.state.read_text().split()[0] == f"{mb:g}":
                return float(self.state.read_text().split()[1])
            if self.process.poll() is not None:
                raise RuntimeError(f"the holder ended with exit status {self.process.returncode}")
            time.sleep(0.05)
        raise RuntimeError(f"the holder did not get to {mb:g} MB free in {timeout_s:g} s")

    def exit(self) -> float:
        """End it; returns the monotonic time at which it had exited."""
        self.control.write_text("exit")
        self.process.wait(timeout=30)
        return time.monotonic()


# ---------------------------------------------------------------------------------------------------------
# A process whose output lines are kept with the time each arrived
# ---------------------------------------------------------------------------------------------------------
class Watched:
    def __init__(self, cmd: list[str], cwd: Path, env: dict | None = None):
        self.lines: list[tuple[float, str]] = []
        self.process = subprocess.Popen(
            cmd,
            cwd=cwd,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))

    def first(self, text: str, timeout_s: float) -> float | None:
        """When the first line holding `text` arrived (waiting up to `timeout_s`); None if none did."""
        deadline = time.monotonic() + timeout_s
        while True:
            for at, line in list(self.lines):
                if text in line:
                    return at
            if time.monotonic() > deadline or (
                self.process.poll() is not None and not self.reader.is_alive()
            ):
                return None
            time.sleep(0.02)

    def finish(self, timeout_s: float) -> int:
        try:
            code = self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.send_signal(signal.SIGTERM)  # it checkpoints and exits 143
            code = self.process.wait(timeout=60)
        self.reader.join(timeout=5)
        return code

    def tail(self, n: int = 30) -> list[str]:
        return [line for _, line in self.lines[-n:]]


def dqn_command(work: Path, name: str, *flags: str) -> list[str]:
    return [
        sys.executable,
        str(ROOT / "dqn_starcraft_split.py"),
        *flags,
        "--save-path",
        str(work / name),
        "--log-dir",
        str(work / name / "runs"),
        "--run-id",
        name,
    ]


def run_folder(work: Path, name: str) -> Path:
    return work / name / name


# ---------------------------------------------------------------------------------------------------------
# 1. the DQN incident replayed
# ---------------------------------------------------------------------------------------------------------
def dqn_incident(work: Path, save) -> dict:
    out: dict = {}
    started = time.monotonic()
    holder = Holder(work, "holder1")
    out["holder_free_mb"] = holder.leave(LEAVE_MB)
    log(f"the holder leaves {out['holder_free_mb']:.0f} MB free")

    # (a) the wait: no CUDA context while waiting, training within one poll of the holder's exit
    before = nvml_processes()
    dqn = Watched(
        dqn_command(
            work,
            "wait",
            *DQN_INCIDENT_FLAGS,
            "--wait-for-gpu-mb",
            "2000",
            "--wait-poll-s",
            f"{POLL_S:g}",
            "--wait-timeout-s",
            "120",
        ),
        ROOT,
    )
    waiting = dqn.first("polling every", timeout_s=60) is not None
    during = []
    for _ in range(3):  # what NVML lists while it waits
        time.sleep(0.5)
        during.append(nvml_processes())
    exited_at = holder.exit()
    free_at = dqn.first("MB free after", timeout_s=30)
    trained = dqn.first("optimizer state preallocated", timeout_s=60) is not None
    code = dqn.finish(timeout_s=0.1)  # started: stopped here (SIGTERM: a checkpoint, exit 143)
    new = [new_processes(before, d) for d in during]
    out["wait"] = {
        "said_it_waits": waiting,
        "nvml_before": before,
        "nvml_while_waiting": during,
        "new_processes_while_waiting": new,
        "no_context_while_waiting": None if None in new else all(not n for n in new),
        "seconds_from_holder_exit_to_start": None if free_at is None else free_at - exited_at,
        "poll_s": POLL_S,
        "started_within_one_poll": None if free_at is None else free_at - exited_at <= POLL_S + 0.5,
        "set_up_after_the_wait": trained,
        "returncode": code,
        "tail": dqn.tail(),
    }
    save()

    holder = Holder(work, "holder2")
    out["holder2_free_mb"] = holder.leave(LEAVE_MB)
    try:
        # (b) no room for a CUDA context
        dqn = Watched(dqn_command(work, "no_room", *DQN_INCIDENT_FLAGS), ROOT)
        code = dqn.finish(timeout_s=60)
        text = "\n".join(dqn.tail(60))
        out["no_room_for_a_context"] = {
            "returncode": code,
            "exit_3": code == 3,
            "said_so": "no room for this process's CUDA context" in text,
            "report": (run_folder(work, "no_room") / "oom" / "report.json").exists(),
            "traceback": "Traceback" in text,
            "tail": dqn.tail(),
        }
        save()

        # (c) a wait that times out starts on the fallback batch, where a context fits
        out["fallback_room_free_mb"] = holder.leave(FALLBACK_ROOM_MB)
        dqn = Watched(
            dqn_command(
                work,
                "fallback",
                *DQN_INCIDENT_FLAGS,
                "--wait-for-gpu-mb",
                "8000",
                "--wait-poll-s",
                "0.5",
                "--wait-timeout-s",
                "2",
                "--fallback-batch-size",
                "4",
            ),
            ROOT,
        )
        code = dqn.finish(timeout_s=90)
        config = read_json(run_folder(work, "fallback") / "config.json")
        out["fallback"] = {
            "returncode": code,
            "batch_size_used": config.get("batch_size_used"),
            "fallback_used": config.get("fallback_used"),
            "started_on_the_fallback_batch": code == 0 and config.get("batch_size_used") == 4,
            "tail": dqn.tail(),
        }
        save()

        # (d) room at start-up, none at the first step
        gate, ready = work / "gate", work / "ready"
        dqn = Watched(
            [
                sys.executable,
                str(HERE),
                "dqn-gated",
                "--gate",
                str(gate),
                "--ready",
                str(ready),
                "--",
                *dqn_command(work, "first_step", *DQN_INCIDENT_FLAGS)[2:],
            ],
            ROOT,
            env={"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"},
        )
        deadline = time.monotonic() + 60
        while not ready.exists() and dqn.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        out["first_step_free_mb"] = holder.leave(0)
        gate.write_text("go")
        code = dqn.finish(timeout_s=60)
        folder = run_folder(work, "first_step")
        text = "\n".join(dqn.tail(80))
        out["first_step_oom"] = {
            "returncode": code,
            "exit_3": code == 3,
            "report": (folder / "oom" / "report.json").exists(),
            "checkpoint": (folder / "checkpoint.pt").exists(),
            "traceback": "Traceback" in text,
            "said": [line for line in dqn.tail(80) if "out of memory" in line][:3],
            "tail": dqn.tail(),
        }
    finally:
        holder.exit()
    out["wall_s"] = time.monotonic() - started
    return out


def dqn_gated(gate: Path, ready: Path, argv: list[str]) -> int:
    """dqn_starcraft_split.py with `argv`, pausing once its set-up (the preallocation) is done until `gate` exists
    (`ready` says it got there): the moment another process takes the card."""
    import dqn_starcraft_split as dqn

    instrument = dqn.instrument

    def paused(run):
        ready.write_text("ready")
        while not gate.exists():
            time.sleep(0.02)
        instrument(run)

    dqn.instrument = paused
    args, sources = dqn.parse_args(argv)
    return dqn.main(args, sources)


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


# ---------------------------------------------------------------------------------------------------------
# 2. the default Dreamer under --gpu-memory-gb 6, and the DQN in each precision beside it
# ---------------------------------------------------------------------------------------------------------
def dreamer_6gb(work: Path, quick: bool, device: str) -> dict:
    from benchmark import bench_utils

    flags = DREAMER_QUICK_FLAGS if quick else DREAMER_6GB_FLAGS
    cmd = [
        sys.executable,
        str(ROOT / "dreamer_atari.py"),
        *flags,
        *(["--no-cuda"] if device == "cpu" else []),
    ]
    started = time.monotonic()
    dreamer = Watched(cmd, work)
    samples = []  # NVML's (seconds, [(pid, MB)]) of the card while it runs
    while dreamer.process.poll() is None:
        if device == "cuda":
            samples.append((round(time.monotonic() - started, 1), nvml_processes()))
        time.sleep(1.0)
    code = dreamer.finish(timeout_s=60)
    run_dirs = sorted((work / "runs").glob("*incident_6gb*"))
    keys = [
        "charts/updates",
        "debug/gpu/alloc_mb",
        "debug/gpu/reserved_mb",
        "debug/gpu/max_alloc_mb",
        "debug/gpu/max_reserved_mb",
        "debug/gpu/num_alloc_retries",
        "debug/gpu/num_ooms",
        "debug/cpu/rss_mb",
    ]
    scalars = bench_utils.read_scalars(str(run_dirs[-1]), keys) if run_dirs else {}
    steps = sorted(scalars.get("charts/updates", {}))
    points = [
        {"env_step": s, **{k.split("/")[-1]: scalars[k].get(s) for k in keys if k in scalars}} for s in steps
    ]
    own = [max((mb for _, mb in listed), default=None) for _, listed in samples if listed]
    text = "\n".join(line for _, line in dreamer.lines)
    alloc = [(p["env_step"], p.get("alloc_mb")) for p in points if p.get("alloc_mb") is not None]
    return {
        "command": "python dreamer_atari.py " + " ".join(flags),
        "returncode": code,
        "out_of_memory": "out of memory" in text,
        "traceback": "Traceback" in text,
        "updates": points[-1].get("updates") if points else None,
        "peak_reserved_mb": max(
            (p["max_reserved_mb"] for p in points if "max_reserved_mb" in p), default=None
        ),
        "peak_allocated_mb": max((p["max_alloc_mb"] for p in points if "max_alloc_mb" in p), default=None),
        "points": points,
        # growth per 1,000 env steps between consecutive log points (after the captures, it should be 0)
        "alloc_mb_per_1000_steps": [
            (b[0], (b[1] - a[1]) * 1000 / (b[0] - a[0])) for a, b in itertools.pairwise(alloc) if b[0] > a[0]
        ],
        "nvml_samples": samples,
        "nvml_peak_process_mb": max((mb for mb in own if mb is not None), default=None),
        "budget_lines": [
            line for _, line in dreamer.lines if line.startswith(("gpu:", "replay:", "preflight:"))
        ],
        "tail": dreamer.tail(),
        "wall_s": time.monotonic() - started,
    }


class UpdateRecorder:
    """Records the training updates of a DQN run (Part 1's `update`, called with the agent's `amp`) without a host
    sync inside the update: each update's loss and the loss scaler's scale, the time of each (synchronised), and the
    allocated memory just before and just after the first optimizer step that runs."""

    def __init__(self, amp):
        self.amp, self.losses, self.scales, self.ms, self.first_step = amp, [], [], [], None

    def record(self, update, q_network, target_network, optimizer, batch, args, amp):
        """`update(...)` as the loop calls it, recorded."""
        import torch

        if self.first_step is None and not hasattr(optimizer, "_recorder_hooks"):
            optimizer._recorder_hooks = (
                optimizer.register_step_pre_hook(lambda opt, *_: self.step_memory("before", opt)),
                optimizer.register_step_post_hook(lambda opt, *_: self.step_memory("after", opt)),
            )
        cuda = q_network.parameters().__next__().device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
        started = time.perf_counter()
        metrics = update(q_network, target_network, optimizer, batch, args, amp)
        if cuda:
            torch.cuda.synchronize()
        self.ms.append((time.perf_counter() - started) * 1e3)
        self.losses.append(metrics["losses/td_loss"].detach().float())
        if self.amp.scaler.is_enabled():
            self.scales.append(self.amp.scaler._scale.detach().clone())
        return metrics

    def step_memory(self, when: str, optimizer) -> None:
        """Allocated memory (CUDA) and the optimizer state's bytes just before or after the first step that runs."""
        import torch

        if self.first_step is not None and "after" in self.first_step:
            return
        self.first_step = self.first_step or {}
        self.first_step[when] = torch.cuda.memory_allocated() if torch.cuda.is_available() else None
        self.first_step[f"state_{when}"] = sum(
            v.nbytes for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)
        )

    def figures(self) -> dict:
        import torch

        losses = torch.stack(self.losses) if self.losses else torch.zeros(0)
        scales = [float(s) for s in torch.stack(self.scales).cpu()] if self.scales else []
        median = statistics.median(self.ms) if self.ms else None
        first = self.first_step or {}
        return {
            "updates": len(self.ms),
            "update_ms_median": median,
            "updates_per_s": 1000 / median if median else None,
            "losses_finite": bool(torch.isfinite(losses).all()) if len(losses) else None,
            "scaler_enabled": self.amp.scaler.is_enabled(),
            "scale_first_last": [scales[0], scales[-1]] if scales else None,
            # GradScaler halves its scale at each skipped step (an overflowed gradient), and only then
            "skipped_steps": sum(b < a for a, b in itertools.pairwise(scales)) if scales else 0,
            "first_step_allocated_before": first.get("before"),
            "first_step_allocated_after": first.get("after"),
            "first_step_allocated_equal": (
                first.get("before") == first.get("after") if first.get("before") is not None else None
            ),
            # on any device: the step made no optimizer state (the preallocation had made it all)
            "first_step_optimizer_state_bytes": [first.get("state_before"), first.get("state_after")],
        }


def dqn_precision(amp: str, out: Path, quick: bool, device: str) -> None:
    """One DQN run in `amp` (its own process), its update recorded (`UpdateRecorder`), into `out`."""
    import torch

    import dqn_starcraft_split as dqn

    recorders = []
    build_agent, update = dqn.build_agent, dqn.update

    def recorded_build_agent(*args, **kwargs):
        agent = build_agent(*args, **kwargs)
        recorders.append(UpdateRecorder(agent.amp))
        return agent

    def recorded_update(q_network, target_network, optimizer, batch, args, amp):
        if (
            recorders and amp is recorders[-1].amp
        ):  # a training update (the preallocation's has its own scaler)
            return recorders[-1].record(update, q_network, target_network, optimizer, batch, args, amp)
        return update(q_network, target_network, optimizer, batch, args, amp)

    dqn.build_agent, dqn.update = recorded_build_agent, recorded_update
    work = out.with_suffix("")
    flags = [*(DQN_QUICK_FLAGS if quick else DQN_PRECISION_FLAGS), "--amp", amp, "--eval-every-episodes", "0"]
    flags += ["--no-cuda"] if device == "cpu" else []
    args, sources = dqn.parse_args(
        [*flags, "--save-path", str(work), "--log-dir", str(work / "runs"), "--run-id", f"amp_{amp}"],
        environ={},
    )
    started = time.monotonic()
    code = dqn.main(args, sources)
    result = {
        "amp": amp,
        "command": "python dqn_starcraft_split.py " + " ".join(flags),
        "returncode": code,
        "wall_s": time.monotonic() - started,
        **(recorders[-1].figures() if recorders else {}),
    }
    if device == "cuda":
        result["peak_allocated_mb"] = torch.cuda.max_memory_allocated() / MB
        result["peak_reserved_mb"] = torch.cuda.max_memory_reserved() / MB
    out.write_text(json.dumps(result, indent=1))


def dqn_precisions_start(work: Path, quick: bool, device: str) -> dict:
    """The three precisions, each in its own process, started at once; fp16 only on CUDA."""
    runs = {}
    for amp in ("fp16", "bf16", "off"):
        if amp == "fp16" and device != "cuda":
            continue
        out = work / f"dqn_{amp}.json"
        cmd = [
            sys.executable,
            str(HERE),
            "dqn-precision",
            "--amp",
            amp,
            "--out",
            str(out),
            "--device",
            device,
        ]
        runs[amp] = (Watched([*cmd, *(["--quick"] if quick else [])], ROOT), out)
    return runs


def dqn_precisions_collect(runs: dict, device: str) -> dict:
    out = {}
    for amp in ("fp16", "bf16", "off"):
        if amp not in runs:
            out[amp] = {"skipped": "fp16 needs CUDA"}
            continue
        watched, path = runs[amp]
        code = watched.finish(timeout_s=300)
        out[amp] = read_json(path) or {"returncode": code, "tail": watched.tail()}
        out[amp]["beside_dreamer"] = device == "cuda"  # measured on a GPU shared with the Dreamer run
    return out


# ---------------------------------------------------------------------------------------------------------
# The stage
# ---------------------------------------------------------------------------------------------------------
def main_stage(out: Path, quick: bool, device: str, work: Path) -> dict:
    from benchmark import bench_utils
    from benchmark.common import code_version

    work.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    result: dict = {
        "machine": bench_utils.machine(),
        "code": code_version(),
        "device": device,
        "quick": quick,
        "leave_mb": LEAVE_MB,
    }

    def save() -> None:
        result["wall_s"] = time.monotonic() - started
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1, default=str))
        tmp.replace(out)

    if device == "cuda":
        log("the DQN incident replayed (the GPU to itself)")
        result["dqn_incident"] = {}
        result["dqn_incident"] = dqn_incident(work, save)
    else:
        result["dqn_incident"] = {"skipped": "needs CUDA: a second process fills the GPU"}
    save()
    log("Dreamer under --gpu-memory-gb 6, the DQN in each precision beside it")
    runs = dqn_precisions_start(work, quick, device)
    result["dreamer_6gb"] = dreamer_6gb(work, quick, device)
    save()
    result["dqn_precisions"] = dqn_precisions_collect(runs, device)
    save()
    log(f"done in {time.monotonic() - started:.0f} s")
    return result


# ---------------------------------------------------------------------------------------------------------
# In gpu_stages.py: `--stage incidents`
# ---------------------------------------------------------------------------------------------------------
def run_incident_stage(args, work: Path, result: dict, save, deadline: float | None) -> None:
    """This file in its own process (`gpu_stages.py --stage incidents`), killed at --incidents-minutes (or what the
    budget leaves); what it has written is read back every few seconds into `result["incidents"]` and saved."""
    from benchmark.common import run_with_cap

    out, log_path = work / "incidents.json", work / "incidents.log"
    cap_s = args.incidents_minutes * 60
    if deadline is not None:
        cap_s = min(cap_s, deadline - time.time())
    cmd = [
        sys.executable,
        str(HERE),
        "--out",
        str(out),
        "--device",
        args.device,
        "--work",
        str(work / "incidents"),
    ]
    cmd += ["--quick"] if args.quick else []
    result["incidents_command"] = " ".join(
        ["python", "dev/gpu/incident_stage.py", *cmd[2:3], "--device", args.device]
    )
    result["incidents_cap_s"] = cap_s

    def read_back():
        result["incidents"] = read_json(out)
        save()

    returncode, stopped, started = run_with_cap(cmd, log_path, cap_s, 1.0 if args.quick else 3.0, read_back)
    result["incidents"] = read_json(out)
    result["incidents_returncode"] = returncode
    result["incidents_stopped_by_cap"] = stopped
    result["incidents_wall_s"] = time.time() - started
    result["incidents_log_tail"] = log_path.read_text().splitlines()[-40:]
    result.update(incident_verdicts(result["incidents"]))
    save()


def incident_verdicts(incidents: dict) -> dict:
    """The stage's checks as flat keys of the results (None where a part did not run)."""
    dreamer = incidents.get("dreamer_6gb") or {}
    replay = incidents.get("dqn_incident") or {}
    precisions = incidents.get("dqn_precisions") or {}
    six_gib_mb = 6 * 1024
    return {
        "dreamer_6gb_updates": dreamer.get("updates"),
        "dreamer_6gb_no_oom": (
            None
            if "returncode" not in dreamer
            else dreamer["returncode"] == 0 and not dreamer["out_of_memory"]
        ),
        "dreamer_6gb_peak_reserved_mb": dreamer.get("peak_reserved_mb"),
        "dreamer_6gb_peak_allocated_mb": dreamer.get("peak_allocated_mb"),
        "dreamer_6gb_nvml_peak_process_mb": dreamer.get("nvml_peak_process_mb"),
        "dreamer_6gb_within_6_gib": (
            None
            if dreamer.get("nvml_peak_process_mb") is None
            else dreamer["nvml_peak_process_mb"] <= six_gib_mb
        ),
        "dqn_losses_finite": {amp: p.get("losses_finite") for amp, p in precisions.items()},
        "dqn_first_step_allocated_equal": {
            amp: p.get("first_step_allocated_equal") for amp, p in precisions.items()
        },
        "dqn_wait_without_context": (replay.get("wait") or {}).get("no_context_while_waiting"),
        "dqn_wait_started_within_one_poll": (replay.get("wait") or {}).get("started_within_one_poll"),
        "dqn_no_room_exit_3": (replay.get("no_room_for_a_context") or {}).get("exit_3"),
        "dqn_fallback_started": (replay.get("fallback") or {}).get("started_on_the_fallback_batch"),
        "dqn_first_step_oom_exit_3_with_checkpoint": (
            None
            if "first_step_oom" not in replay
            else replay["first_step_oom"]["exit_3"]
            and replay["first_step_oom"]["checkpoint"]
            and replay["first_step_oom"]["report"]
            and not replay["first_step_oom"]["traceback"]
        ),
    }


def incidents_markdown(result: dict) -> list[str]:
    from benchmark.common import fmt

    incidents = result.get("incidents")
    if not incidents and "incidents_command" not in result:
        return []
    incidents = incidents or {}
    lines = [
        "## The incidents' GPUs (issue 66)",
        "",
        f"`{result.get('incidents_command')}`: {fmt(result.get('incidents_wall_s'))} s, exit "
        f"{result.get('incidents_returncode', 'running')}"
        + (", stopped by its time cap" if result.get("incidents_stopped_by_cap") else "")
        + ". Every figure is in the JSON (`incidents`).",
        "",
    ]
    dreamer = incidents.get("dreamer_6gb")
    if dreamer:
        lines += [
            f"Dreamer on a 6 GB card: `{dreamer['command']}`: exit {dreamer['returncode']}, "
            f"{fmt(dreamer.get('updates'))} updates, out of memory: {fmt(dreamer['out_of_memory'])}; peak reserved "
            f"{fmt(dreamer.get('peak_reserved_mb'))} MB, allocated {fmt(dreamer.get('peak_allocated_mb'))} MB; the "
            f"process on the card (NVML, context included) at most {fmt(dreamer.get('nvml_peak_process_mb'))} MB. "
            "Allocated MB at each log point: "
            + ", ".join(f"{p['env_step']:,}: {fmt(p.get('alloc_mb'))}" for p in dreamer.get("points", []))
            + ".",
            "",
            *(f"    {line}" for line in dreamer.get("budget_lines", [])),
            "",
        ]
    precisions = incidents.get("dqn_precisions") or {}
    if precisions:
        lines += [
            "| DQN --amp | updates | updates/s | peak allocated MB | peak reserved MB | scale first, last | skipped "
            "steps | every loss finite | allocated before = after the first step |",
            "|---|---:|---:|---:|---:|---|---:|---|---|",
        ]
        for amp, p in precisions.items():
            if "skipped" in p:
                lines.append(f"| {amp} | {p['skipped']} | | | | | | | |")
                continue
            lines.append(
                f"| {amp} | {fmt(p.get('updates'))} | {fmt(p.get('updates_per_s'))} | "
                f"{fmt(p.get('peak_allocated_mb'))} | {fmt(p.get('peak_reserved_mb'))} | "
                f"{p.get('scale_first_last')} | {fmt(p.get('skipped_steps'))} | {fmt(p.get('losses_finite'))} | "
                f"{fmt(p.get('first_step_allocated_equal'))} ({fmt(p.get('first_step_allocated_before'))}, "
                f"{fmt(p.get('first_step_allocated_after'))}) |"
            )
        lines += [
            "",
            "The DQN runs share the GPU with the Dreamer run: their updates/s are not a lone card's.",
            "",
        ]
    replay = incidents.get("dqn_incident") or {}
    if "skipped" in replay:
        lines += [f"The DQN incident replayed: {replay['skipped']}.", ""]
    elif replay:
        wait, room = replay.get("wait") or {}, replay.get("no_room_for_a_context") or {}
        fallback, first = replay.get("fallback") or {}, replay.get("first_step_oom") or {}
        lines += [
            f"The DQN incident replayed (a second process leaves {fmt(replay.get('holder_free_mb'))} MB free): "
            f"waiting with --wait-for-gpu-mb, new CUDA processes NVML listed {wait.get('new_processes_while_waiting')}"
            f", started {fmt(wait.get('seconds_from_holder_exit_to_start'))} s after the holder exited (poll "
            f"{fmt(wait.get('poll_s'))} s); with no wait and no room for a context: exit {room.get('returncode')}, "
            f"report {fmt(room.get('report'))}, traceback {fmt(room.get('traceback'))}; with a wait timeout and "
            f"{fmt(replay.get('fallback_room_free_mb'))} MB free: exit {fallback.get('returncode')}, batch "
            f"{fallback.get('batch_size_used')}; room at start-up and none at the first step: exit "
            f"{first.get('returncode')}, report {fmt(first.get('report'))}, checkpoint {fmt(first.get('checkpoint'))}, "
            f"traceback {fmt(first.get('traceback'))}.",
            "",
        ]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    held = sub.add_parser("hold")
    held.add_argument("--control", type=Path, required=True)
    held.add_argument("--state", type=Path, required=True)
    precision = sub.add_parser("dqn-precision")
    precision.add_argument("--amp", required=True)
    precision.add_argument("--out", type=Path, required=True)
    precision.add_argument("--device", default="cuda")
    precision.add_argument("--quick", action="store_true")
    gated = sub.add_parser("dqn-gated")
    gated.add_argument("--gate", type=Path, required=True)
    gated.add_argument("--ready", type=Path, required=True)
    gated.add_argument("argv", nargs=argparse.REMAINDER)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--work", type=Path)
    cli = parser.parse_args()
    if cli.command == "hold":
        hold(cli.control, cli.state)
    elif cli.command == "dqn-precision":
        dqn_precision(cli.amp, cli.out, cli.quick, cli.device)
    elif cli.command == "dqn-gated":
        raise SystemExit(dqn_gated(cli.gate, cli.ready, [a for a in cli.argv if a != "--"]))
    else:
        if cli.out is None:
            parser.error("--out is required")
        import tempfile

        with tempfile.TemporaryDirectory(prefix="incidents-") as tmp:
            main_stage(cli.out, cli.quick, cli.device, cli.work or Path(tmp))


if __name__ == "__main__":
    main()
