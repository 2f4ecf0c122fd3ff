"""What checking a checkpoint before loading it costs: the default dreamerv3 agent's checkpoint, on the CPU.

    python benchmark/investigations/checkpoint_check.py --out benchmark/results/checkpoint_check [--reps 7]

`--resume` reads a checkpoint twice before torch loads it: once for the checksum beside it (`mu.file_digest`,
SHA-256) and once for the CRC-32 of every record of torch.save's zip archive (`mu.check_archive_crcs`, zipfile's
`testzip`). The checkpoint is the one a run of the default flags writes (`da.save_checkpoint`, Adam's moments made
by the preflight; no replay in it): each figure is timed warm (the file in the page cache, as just after it was
written) and cold (its pages dropped from the cache with `posix_fadvise` before each sample, so that it comes from
the disk). Writes `<out>.json` (the machine, the command, every sample) and `<out>.md`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
import torch

import dreamer_atari as da
import memory_utils as mu
from benchmark import bench_utils
from benchmark.common import code_version


def default_checkpoint(folder: str) -> str:
    """The checkpoint a run of the default flags writes: the dreamerv3 agent at its default sizes, with Adam's
    moments (the preflight makes them at small batch sizes: their shapes are the weights')."""
    args = da.Args()
    obs_shape = (args.frame_stack, *((3,) if args.rgb else ()), args.image_size, args.image_size)
    torch.manual_seed(args.seed)
    agent = da.build_agent(args, obs_shape, 6, "cpu")
    da.preflight(
        agent, dataclasses.replace(args, batch_size=2, sequence_length=4, imagination_horizon=2), obs_shape
    )
    counters = {**da.NEW_COUNTERS, "global_step": 1}
    return da.save_checkpoint(
        os.path.join(folder, "checkpoint.pt"), agent, counters, "checkpoint_check", args
    )


def drop_from_page_cache(path: str) -> None:
    with open(path, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def samples_ms(fn, path: str, reps: int, cold: bool) -> list[float]:
    fn(path)  # untimed: the first call pays for imports and allocations
    samples = []
    for _ in range(reps):
        if cold:
            drop_from_page_cache(path)
        start = time.perf_counter()
        fn(path)
        samples.append(round((time.perf_counter() - start) * 1e3, 3))
    return samples


MEASURED = {
    "crc32 check (mu.check_archive_crcs)": mu.check_archive_crcs,
    "sha256 checksum (mu.file_digest)": mu.file_digest,
    "both checks (mu.verify_checkpoint)": mu.verify_checkpoint,
    "torch.load(weights_only=True)": lambda path: torch.load(path, map_location="cpu", weights_only=True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="results path without its suffix")
    parser.add_argument("--reps", type=int, default=7)
    options = parser.parse_args()
    torch.set_num_threads(1)
    work = ROOT / "benchmark" / ".work"  # git-ignored, on the repository's disk
    work.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=work) as folder:
        path = default_checkpoint(folder)
        nbytes = os.path.getsize(path)
        rows = {
            f"{name}, {cache}": samples_ms(fn, path, options.reps, cold=cache == "cold")
            for cache in ("warm", "cold")
            for name, fn in MEASURED.items()
        }
    result = {
        "machine": bench_utils.machine(),
        "command": "python benchmark/investigations/checkpoint_check.py " + " ".join(sys.argv[1:]),
        "checkpoint": "the default dreamerv3 agent (dreamer_atari.Args()), Adam moments, no replay",
        "checkpoint_bytes": nbytes,
        "reps": options.reps,
        "samples_ms": rows,
        "median_ms": {name: statistics.median(samples) for name, samples in rows.items()},
    }
    result["code"] = code_version()  # the commit it ran, and whether the tree differed
    Path(options.out + ".json").write_text(json.dumps(result, indent=1) + "\n")
    lines = [
        "# Checking a checkpoint before loading it",
        "",
        f"`{result['command']}` on {result['machine']['cpu']} ({result['machine']['cpu_count']} cores, torch "
        f"{result['machine']['torch']}, 1 thread). The default dreamerv3 agent's checkpoint: "
        f"{nbytes / 2**20:.1f} MiB. Warm: the file in the page cache; cold: its pages dropped from this machine's "
        f"cache before each sample (a virtual machine's host may still hold them).",
        "",
        "| what | median ms | MB/s | samples (ms) |",
        "|---|---|---|---|",
        *(
            f"| {name} | {result['median_ms'][name]:.1f} | {nbytes / 1e6 / (result['median_ms'][name] / 1e3):.0f} | "
            f"{', '.join(f'{s:.1f}' for s in samples)} |"
            for name, samples in rows.items()
        ),
        "",
    ]
    Path(options.out + ".md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
