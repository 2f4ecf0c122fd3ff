"""What run.py and the modules it runs share: its options, the targets, the Pong run's recipe, the tiny model, and
the output helpers (messages, numbers, results file names, the GPU section's markdown).

run.py is the command line. ours_dreamer.py, pong_run.py and the GPU-lease tools of dev/gpu/ read these from here,
so that no module imports the command line. Importing this module runs nothing.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Literal

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent

# The targets (thresholds to compare against, not measurements).
TARGET_BYTES_PER_STEP = 7_200
TARGET_SAMPLE_TO_UPDATE = 0.05
TARGET_SOAK_MB_PER_10K = 1.0
# issue 42: resident anonymous memory beyond the replay over >= 50k env steps, and within 3x of the peer's
TARGET_SOAK_ANON_MB_PER_10K = 0.1
TARGET_SOAK_TO_PEER = 3.0
TARGET_UPDATE_SPEEDUP = 1.5
TARGET_SIZE_S_SPEEDUP = 1.0  # issue 64: our default (DreamerV3 size S) not slower than SheepRL's dreamer_v3_S
TARGET_GPU_PEAK_MB = 2_048  # the seed config with AMP fits a 6 GB laptop card with room to spare
TARGET_GPU_SLOPE_MB_PER_10K = 1.0
TARGET_PONG_RETURN = 18.0  # Atari100k Pong: mean return of the last 10 episodes at 100k env steps
TARGET_PONG_WALL_MIN = 25.0  # minutes of training for those 100k env steps on one H100


# run.py's options, read by pong_run.py and by the GPU stages of dev/gpu/ (which add their own); `run.py --help` shows each field's docstring
@dataclasses.dataclass
class Args:
    quick: bool = False
    """smaller stated sizes, a few minutes at most; skips the peer, the speed trials and the results files"""
    json: str | None = None
    """also write every figure to this JSON file"""
    peer: Literal["sheeprl"] | None = None
    """also measure this peer in its own virtual environment (benchmark/.peer-venv)"""
    threads: int = 1
    """torch threads of every measurement, ours and the peer's alike"""
    results_dir: str = str(BENCH_DIR / "results")
    """where a full run writes <date>-<machine>.md and .json"""
    gpu_only: bool = False
    """the GPU figures, the forensics check (snapshots, analysis, an induced OOM) and the Atari100k Pong run"""
    device: str = "cuda"
    """--gpu-only: the device; `cpu` (with --quick) runs the same steps at tiny sizes, to check them without a GPU"""
    pong_minutes: float = 15.0
    """--gpu-only: minutes of the Atari100k Pong run (0 = none). It continues from its last checkpoint in
    --pong-dir, so separate invocations take it to 100k env steps"""
    pong_dir: str = str(BENCH_DIR / ".work" / "pong")
    """--gpu-only: where the Pong run lives between invocations (its checkpoints hold the replay)"""
    pong_only: bool = False
    """--gpu-only: just continue the Pong run (no other figures)"""
    matched_only: bool = False
    """with --peer sheeprl: only the matched-size comparison (SheepRL's DreamerV3 at our model's size against
    ours at 64 and 84 pixels, and its dreamer_v3_S against our default, taking turns update by update), written to
    <date>-<machine>-matched.md and .json"""
    pong_resumable: bool = True
    """checkpoints every 5k env steps hold the replay, so a later invocation continues the run; --no-pong-resumable
    (a machine whose disk goes back): one weights-only checkpoint at the end, for the evaluation"""
    pong_curve_every: int = 5000
    """the Pong run: read its curve (and, in dev/gpu's stages, write the results) every this many env steps
    (--quick: 100)"""
    pong_eval_episodes: int = 10
    """episodes the final agent plays after the Pong run, all at once in as many envs (0 = no evaluation)"""
    pong_eval_minutes: float = 1.5
    """time cap of that evaluation; episodes unfinished by then are reported as unfinished"""
    pong_args: str = ""
    """more dreamer_atari.py flags for the Pong run, as one value: --pong-args="--precision bf16" (kept in the results)"""


def fail(message: str) -> None:
    """Print one sentence as an error and exit with status 2 (a wrong option)."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def log(message: str) -> None:
    """A progress line on stderr."""
    print(f"[benchmark] {message}", file=sys.stderr, flush=True)


def run_with_cap(cmd: list[str], log_path: Path, cap_s: float, poll_s: float, on_poll, env=None) -> tuple:
    """`cmd` in its own process from the repository root, its output into `log_path`, killed once it has run `cap_s`
    seconds; `on_poll()` every `poll_s` seconds while it runs (to read back what it has written). Returns (its exit
    status, whether the cap stopped it, the time it started)."""
    started, stopped = time.time(), False
    with open(log_path, "w") as log_file:
        process = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, cwd=ROOT, env=env)
        while True:
            try:
                return process.wait(timeout=poll_s), stopped, started
            except subprocess.TimeoutExpired:
                pass
            if not stopped and time.time() - started >= cap_s:
                process.kill()
                stopped = True
            on_poll()


def check_gpu_only_device(args: Args, who: str = "--gpu-only") -> None:
    """The checks of --peer and --device of `who` (run.py --gpu-only, or dev/gpu's stages): one sentence and exit
    status 2."""
    import torch

    if args.peer is not None:
        fail(f"{who} measures our GPU figures alone; drop --peer.")
    if args.device not in ("cuda", "cpu"):
        fail(f"--device must be cuda or cpu, got {args.device!r}.")
    if args.device == "cpu" and not args.quick:
        fail(f"{who} --device cpu checks the steps at tiny sizes: add --quick.")
    if args.device == "cuda" and not torch.cuda.is_available():
        fail(
            f"{who} needs a CUDA device, and torch sees none on this machine (--device cpu --quick checks the "
            "steps without one)."
        )


# ---------------------------------------------------------------------------------------------------------
# The Atari100k Pong run (`--gpu-only`, pong_run.py; dev/gpu's stages too), as dreamer_atari.Args fields. A field
# this version of the script lacks is left out and said so.
# ---------------------------------------------------------------------------------------------------------
ATARI100K_BATCH = {"batch_size": 16, "sequence_length": 64}  # DreamerV3's Atari100k batch
# DreamerV3's Atari100k recipe (its 2023 code's `atari100k`): 100k env steps, train ratio 1024 at batch 16 x 64
# (one update per env step), float32, one env, colour frames: the script's defaults, named here so that the results
# say them.
PONG_RECIPE = {
    "exp_name": "atari100k",
    "total_timesteps": 100_000,
    "num_envs": 1,
    **ATARI100K_BATCH,
    "train_ratio": 1024.0,
    "rgb": True,  # the script's default, said in the results' pong_config
    "log_interval": 1000,
    # open-loop images and, beside them, ball F1 over 64 sequences (at log points): at 5k, 10k, 20k and 30k among
    # others, the steps the lease keeps pictures of
    "video_every": 2500,
    "save_model": True,
}
# checkpoints (and the replay, on disk by default), so that a later invocation continues the run (--pong-resumable)
PONG_RESUMABLE = {"checkpoint_every": 5000}
# what training on CUDA adds to the script's defaults (TF32 matmuls and CUDA-graph capture are already its
# defaults on CUDA); the update stage's `training` variant uses the same dict.
CUDA_FAST_PATH: dict = {}
# --quick: the soak's tiny model on a few hundred steps, only to check the plumbing
TINY_MODEL_FIELDS = {
    "encoder_channels": (4, 4, 4),
    "embed_dim": 16,
    "decoder_base_channels": 4,
    "decoder_mid_channels": 4,
    "deterministic_dim": 16,
    "stochastic_dim": 4,
    "stochastic_classes": 4,
    "hidden_dim": 16,
}
PONG_QUICK = {
    **TINY_MODEL_FIELDS,
    "learning_starts": 100,
    "train_ratio": 16.0,
    "log_interval": 100,
    "video_every": 200,
    "batch_size": 4,
    "sequence_length": 16,
}
PONG_QUICK_RESUMABLE = {"checkpoint_every": 200}


# ---------------------------------------------------------------------------------------------------------
# The code a result ran: every results file records it (`code`)
# ---------------------------------------------------------------------------------------------------------
# where the code travels without .git (a GPU lease's copy of the working tree), `dev/code_version.py` writes what git
# said before it left; ignored by git, carried to the device beside the wheels
CODE_VERSION_FILE = ".code-version.json"
CODE_SUFFIXES = (
    ".py",
    ".sh",
    ".txt",
    ".toml",
)  # the files whose bytes `code_sha256` covers: the code a run runs
LISTED_PATHS = 20  # differing paths named in a result (their count is always there)


def git(root: Path, *argv: str) -> str | None:
    """git's output in `root`, or None where it is not a checkout (or git is missing)."""
    try:
        done = subprocess.run(["git", "-C", str(root), *argv], capture_output=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.decode(errors="replace") if done.returncode == 0 else None


def code_files(root: Path) -> list[str]:
    """The code files of the checkout at `root` as the device tool sends them: tracked, and untracked where git does
    not ignore them (CODE_SUFFIXES only), sorted."""
    listed = git(root, "ls-files", "--cached", "--others", "--exclude-standard", "-z") or ""
    return sorted({path for path in listed.split("\0") if path.endswith(CODE_SUFFIXES)})


def code_sha256(root: Path, paths: list[str]) -> str:
    """One SHA-256 over the paths and bytes of `paths` under `root` (a missing file counts as missing)."""
    digest = hashlib.sha256()
    for path in paths:
        file = root / path
        digest.update(path.encode() + b"\0")
        digest.update(file.read_bytes() if file.is_file() else b"<missing>")
        digest.update(b"\0")
    return digest.hexdigest()


def code_from_git(root: Path) -> dict | None:
    """The commit checked out at `root` and whether the working tree differs from it (tracked files changed, or
    untracked files git does not ignore); None where `root` is not a checkout."""
    commit = git(root, "rev-parse", "HEAD")
    if commit is None:
        return None
    status = [
        line[3:] for line in (git(root, "status", "--porcelain", "--untracked-files=all") or "").splitlines()
    ]
    untracked = sorted(path for path in status if (root / path).is_file())
    digest = hashlib.sha256((git(root, "diff", "HEAD", "--binary") or "").encode())
    digest.update(code_sha256(root, untracked).encode())
    return {
        "commit": commit.strip(),
        "tree_differs": bool(status),
        "differing_paths": status[:LISTED_PATHS],
        "differing_count": len(status),
        "diff_sha256": digest.hexdigest() if status else None,  # the same changes give the same digest
        "from": "git",
    }


def code_version(root: Path = ROOT) -> dict:
    """The commit the code at `root` is and whether its working tree differed from it: from git in a checkout, else
    from CODE_VERSION_FILE (a lease's copy has no .git; `files_match` says whether the code files are still those it
    was written for), else unknown, said so."""
    from_git = code_from_git(root)
    if from_git is not None:
        return from_git
    file = root / CODE_VERSION_FILE
    try:
        recorded = json.loads(file.read_text())
        paths = list(recorded.pop("code_files"))
    except (OSError, ValueError, KeyError, TypeError):
        return {
            "commit": None,
            "tree_differs": None,
            "from": f"unknown: no git checkout here and no readable {CODE_VERSION_FILE} (dev/code_version.py writes it)",
        }
    return {
        **recorded,
        "from": f"{CODE_VERSION_FILE}, written by dev/code_version.py at {recorded.get('written_at')}",
        "files_match": code_sha256(root, paths) == recorded.get("code_sha256"),
    }


def write_code_version(root: Path = ROOT) -> dict:
    """CODE_VERSION_FILE at `root`: what git says now, with the code files' digest that `code_version` checks."""
    from_git = code_from_git(root)
    if from_git is None:
        fail(f"{root} is not a git checkout: there is no commit to record.")
    paths = code_files(root)
    recorded = {
        **from_git,
        "written_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "code_sha256": code_sha256(root, paths),
        "code_files": paths,
    }
    del recorded["from"]
    tmp = root / (CODE_VERSION_FILE + ".tmp")
    tmp.write_text(json.dumps(recorded, indent=1) + "\n")
    tmp.replace(root / CODE_VERSION_FILE)
    return recorded


def read_results(path: str | Path) -> dict:
    """A results JSON file of any age, in today's meaning of its keys: `pong_final_return` is the evaluation's mean
    return everywhere. GPU results files written before that (the 2026-11-22 H100 session's) hold the mean of the
    last 10 training episodes under `pong.pong_final_return`: read as `pong.pong_train_return_last_10`, with
    `pong.pong_final_return` None (nothing was evaluated)."""
    result = json.loads(Path(path).read_text())
    pong = result.get("pong")
    if isinstance(pong, dict) and "pong_final_return" in pong and "pong_train_return_last_10" not in pong:
        pong["pong_train_return_last_10"] = pong["pong_final_return"]
        pong["pong_final_return"] = None
    return result


def machine_markdown(machine: dict, command: str, threads: int | None = None) -> str:
    """One sentence for a results file's markdown: the CPU machine it ran on and the command."""
    threads_text = f", {threads} threads" if threads is not None else ""
    return (
        f"Machine: {machine.get('cpu')} ({machine.get('cpu_count')} cores), torch {machine.get('torch')}"
        f"{threads_text}. Command: `{command}`."
    )


def code_markdown(code: dict | None) -> str:
    """One sentence for a results file's markdown: the code it ran."""
    if not code or not code.get("commit"):
        return "Code: not recorded" + (
            f" ({code['from']})." if code else " (a file from before results named their code)."
        )
    text = f"Code: commit {code['commit'][:10]}"
    if code.get("tree_differs"):
        text += f", with {code.get('differing_count', 'some')} paths changed or added (diff {str(code.get('diff_sha256'))[:10]})"
    else:
        text += ", no changes"
    if code.get("files_match") is False:
        text += "; the code files differ from those the record was written for"
    return text + "."


# ---------------------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------------------
def fmt(value, digits: int = 3) -> str:
    """A figure as the results files print it: thousands separated, 3 significant digits, — for None."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if value != 0 and (abs(value) >= 1e4 or abs(value) < 1e-3):
            return f"{value:,.0f}" if abs(value) >= 1e4 else f"{value:.2e}"
        return f"{value:,.{digits}g}" if abs(value) < 1000 else f"{value:,.0f}"
    return str(value)


def fmt_load(load) -> str:
    """A load average (1, 5, 15 min) as three numbers."""
    return ", ".join(f"{x:.2f}" for x in load)


def slug(text: str) -> str:
    """Lower-case letters and digits joined by dashes: a machine's name as a file name."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


def new_results_stem(results_dir: str, name: str) -> Path:
    """<results_dir>/<name>, or <name>-2, -3, ... where an earlier run of the same day and machine left its files
    there: a run never overwrites another's results."""
    folder = Path(results_dir)
    folder.mkdir(parents=True, exist_ok=True)
    stem, n = folder / name, 1
    while any((folder / f"{stem.name}{ext}").exists() for ext in (".md", ".json")):
        n += 1
        stem = folder / f"{name}-{n}"
    return stem


def gpu_markdown(result: dict) -> str:
    """The GPU figures and the forensics check, or why they are missing."""
    gpu, forensics = result["gpu"], result["forensics"]
    parts = ["## GPU", ""]
    loop = gpu.get("loop")
    if not gpu.get("run", True):
        parts.append(gpu["reason"] + ".")
    elif not gpu["amp"]:
        parts.append(f"Device: {gpu['device']}. Eager update and peak memory per --amp: not measured.")
    else:
        parts += [
            (
                f"Device: {gpu['device']}. One update of the seed model on one batch ({gpu['update_batch']}), "
                "medians after two warm-up updates; peaks are torch's allocator peaks over those updates."
            ),
            "",
            "| --amp | update ms | updates/s | peak allocated MB | peak reserved MB |",
            "|---|---:|---:|---:|---:|",
        ]
        for mode, fig in gpu["amp"].items():
            if "error" in fig:
                parts.append(f"| {mode} | not available: {fig['error']} | | | |")
            else:
                parts.append(
                    f"| {mode} | {fmt(fig['update_ms'])} | {fmt(fig['updates_per_s'])} | "
                    f"{fmt(fig.get('peak_alloc_mb'))} | {fmt(fig.get('peak_reserved_mb'))} |"
                )
    if gpu.get("run", True) and loop is None:
        parts += [
            "",
            f"Training loop past replay capacity: not measured ({gpu.get('loop_reason', 'not run')}).",
        ]
    elif gpu.get("run", True):
        parts += [
            "",
            (
                f"Training loop (`dreamer_atari.main`, seed model, capacity {loop['capacity_steps']:,} steps, "
                f"{loop['env_steps']:,} env steps, {loop['batch']}, {loop['updates']:,} updates): "
                f"{fmt(loop['env_steps_per_s'])} env steps/s; GPU allocated after the replay is full: "
                f"{fmt(loop.get('gpu_alloc_slope_mb_per_10k'))} MB per 10k env steps (first and last "
                f"{json.dumps(loop.get('gpu_alloc_mb_first_last'))} MB)."
            ),
        ]
    parts += ["", "## Forensics on a real run", ""]
    if not forensics.get("run", True):
        parts.append(forensics["reason"] + ".")
        return "\n".join(parts)
    run1 = forensics["snapshot_run"]
    parts += [
        (
            f"Device: {forensics['device']}; model: {forensics['model']}. Each step below is the real command "
            "line in its own process."
        ),
        "",
        (
            f"1. `{run1['command']}`: exit {run1['returncode']}, {run1['wall_s']} s, snapshots "
            f"{json.dumps(run1.get('snapshots'))}; {run1.get('probe_verdict')}."
        ),
    ]
    analysis = forensics["analysis"]
    if "skipped" in analysis:
        parts.append(f"2. Analysis skipped: {analysis['skipped']}.")
    else:
        parts += [
            (
                f"2. `{analysis['command']}`: exit {analysis['returncode']}, {analysis['wall_s']} s, wrote "
                f"{', '.join(analysis['files'])}. It printed:"
            ),
            "",
            "```",
            analysis["printed"],
            "```",
        ]
    for number, name, what in (
        (3, "oom_in_update", "an OOM in the first update (`--no-preallocate`)"),
        (4, "oom_in_preflight", "an OOM in the preflight (preallocation on)"),
    ):
        oom = forensics[name]
        if "skipped" in oom:
            parts.append(f"{number}. {what}: skipped: {oom['skipped']}.")
            continue
        cap = forensics["cap"]
        parts += [
            "",
            (
                f"{number}. {what}, capped at {fmt(cap['cap_mb'])} MB (fraction {cap['fraction']:.5f} of "
                f"{fmt(cap['device_total_mb'])} MB, half of run 1's peak reserved {fmt(cap['run1_peak_reserved_mb'])}"
                f" MB): exit {oom['returncode']} (expected {oom['expected_returncode']}), oom/ files "
                f"{json.dumps(oom.get('oom_files'))}, checkpoint written: {fmt(oom.get('checkpoint_written'))}."
            ),
        ]
        if oom.get("gpu_at_oom"):
            at, later = oom["gpu_at_oom"], oom.get("gpu_when_reported", {})
            parts.append(
                f"   GPU allocated at the OOM (observer): {fmt(at['allocated_mb'])} MB, asking for "
                f"{fmt(at['requested_mb'])} MB more; when the report was written (the failed step's "
                f"tensors dropped): {fmt(later.get('alloc_mb'))} MB."
            )
        if oom.get("top_sites_at_oom"):
            sites = "; ".join(
                f"{t['site']} {fmt(t['mb'])} MB in {t['blocks']} blocks" for t in oom["top_sites_at_oom"][:5]
            )
            parts.append(f"   Largest live allocation sites in {oom['top_sites_from']}: {sites}.")
        parts += ["", "   What it printed (end of stderr):", "", "```", oom["stderr_tail"], "```"]
    return "\n".join(parts)
