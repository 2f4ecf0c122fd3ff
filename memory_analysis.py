"""The memory toolkit's command line, and the offline analysis of CUDA allocator snapshots. No run imports this
file; it imports memory_utils, the module a run does.

Library:
    load_snapshot                        read a snapshot file as untrusted: a pickle that would run code or blow
                                         up memory or time is refused
    summarize_snapshot, segments_text    what one snapshot holds, per allocation site, category and segment
    analyze_snapshots, write_analysis    growth tables and top allocation sites from snapshot files, as a report

CLI (`python memory_analysis.py --help`):
    report      print the memory report of a fresh process (and the CUDA devices it sees)
    allocator   show the allocator settings that `configure_allocator()` would put in force
    wait        wait for free GPU memory (read through NVML, holding nothing on the card), then run a command
                (with a fallback environment on timeout), passing stop signals on and returning its status
    analyze     turn a run's memory snapshots (and its TensorBoard events) into a report
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import json
import os
import pickle
import re
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

import memory_utils as mu


# ---------------------------------------------------------------------------------------------------------
# Snapshot analysis
# ---------------------------------------------------------------------------------------------------------
class UnsafeSnapshotError(pickle.UnpicklingError):
    """The file asked to import something: a real allocator snapshot never does."""


class _PlainUnpickler(pickle.Unpickler):
    """Admits only plain containers and scalars: no global is ever looked up, so no code can run."""

    def find_class(self, module, name):
        raise UnsafeSnapshotError(f"refusing to load {module}.{name}: snapshots hold only plain data")

    def persistent_load(self, pid):
        raise UnsafeSnapshotError("refusing persistent ids: snapshots hold only plain data")


# What a snapshot file may ask of the loader. A real one (100k history entries) has well under a million
# containers; these bounds keep any file's load under about 1 GB and a few seconds.
MAX_SNAPSHOT_CONTAINERS = 3_000_000
MAX_SNAPSHOT_BYTES = 2 * 2**30
_CONTAINER_OPS = {
    "EMPTY_DICT",
    "EMPTY_LIST",
    "EMPTY_SET",
    "EMPTY_TUPLE",
    "DICT",
    "LIST",
    "TUPLE",
    "TUPLE1",
    "TUPLE2",
    "TUPLE3",
    "FROZENSET",
}
_CODE_OPS = {
    "GLOBAL",
    "STACK_GLOBAL",
    "REDUCE",
    "BUILD",
    "INST",
    "OBJ",
    "NEWOBJ",
    "NEWOBJ_EX",
    "EXT1",
    "EXT2",
    "EXT4",
    "PERSID",
    "BINPERSID",
}


class SnapshotTooLarge(pickle.UnpicklingError):
    """The file would take more memory or time than any real allocator snapshot (a pickle bomb, or not one)."""


def check_snapshot_stream(path: str | os.PathLike) -> None:
    """Read the pickle's opcodes without building anything and refuse what a real snapshot never does: importing
    (code), memo indices beyond the objects so far (CPython allocates the memo up to the index it is given,
    gh-115952: nine bytes can ask for gigabytes), more containers than MAX_SNAPSHOT_CONTAINERS, or a file larger
    than MAX_SNAPSHOT_BYTES."""
    import pickletools

    path = Path(path)
    if path.stat().st_size > MAX_SNAPSHOT_BYTES:
        raise SnapshotTooLarge(f"{path.stat().st_size / mu.MB:.0f} MB is more than any allocator snapshot")
    containers = memo = 0
    with open(path, "rb") as f:
        try:
            for opcode, arg, _ in pickletools.genops(f):
                name = opcode.name
                if name in _CODE_OPS:
                    raise UnsafeSnapshotError(f"refusing {name}: snapshots hold only plain data")
                if name in _CONTAINER_OPS:
                    containers += 1
                    if containers > MAX_SNAPSHOT_CONTAINERS:
                        raise SnapshotTooLarge(f"more than {MAX_SNAPSHOT_CONTAINERS:,} containers")
                elif name == "MEMOIZE":
                    memo += 1
                elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
                    if int(arg) > memo:
                        raise SnapshotTooLarge(
                            f"memo index {int(arg):,} after {memo:,} objects (a memory bomb)"
                        )
                    memo = max(memo, int(arg) + 1)
        except (ValueError, EOFError) as exc:  # genops' own complaints: truncated or not a pickle
            raise pickle.UnpicklingError(f"not a readable pickle ({exc})") from None


def load_snapshot(path: str | os.PathLike) -> dict:
    """Load a CUDA allocator snapshot safely: `check_snapshot_stream` first, then an unpickler that admits only
    plain containers and scalars. Raises UnsafeSnapshotError, SnapshotTooLarge, or pickle/EOF errors."""
    check_snapshot_stream(path)
    with open(path, "rb") as f:
        data = _PlainUnpickler(f).load()
    if not isinstance(data, dict) or "segments" not in data:
        raise pickle.UnpicklingError(f"{path} is not an allocator snapshot (no 'segments')")
    return data


def _require_snapshot(condition: bool, what: str) -> None:
    if not condition:
        raise pickle.UnpicklingError(f"not an allocator snapshot: {what}")


_ACTIVE_STATES = ("active_allocated", "active_pending_free", "active_awaiting_free")
_STEP_RE = re.compile(r"snapshot_step_(\d+)\.pickle$")
_LIBRARY_MARKERS = (
    "site-packages",
    "dist-packages",
    "/torch/",
    "\\torch\\",
    "<frozen",
    "/lib/python3",
    "\\lib\\python3",
    "??",
)


def _is_project_frame(frame: dict) -> bool:
    """A frame of the user's own Python code: a .py file outside the libraries (torch's own C++ frames, which
    come first in snapshots recorded with stacks="all", are not)."""
    filename = str(frame.get("filename", "")) if isinstance(frame, dict) else ""
    return filename.endswith(".py") and not any(marker in filename for marker in _LIBRARY_MARKERS)


MAX_FRAMES_SCANNED = 256  # frames looked at per block: real stacks are far shorter


def allocation_site(frames: list) -> str:
    """The innermost frame of the project's own Python code (file:line:function), else the innermost Python
    frame, else the innermost frame."""
    if not isinstance(frames, list) or not frames:
        return "<no stack recorded>"
    scanned = [f for f in frames[:MAX_FRAMES_SCANNED] if isinstance(f, dict)]
    python = [f for f in scanned if str(f.get("filename", "")).endswith(".py")]
    frame = next((f for f in python if _is_project_frame(f)), python[0] if python else (scanned or [{}])[0])
    return f"{Path(str(frame.get('filename', '?'))).name}:{frame.get('line', '?')}:{frame.get('name', '?')}"


MAX_SNAPSHOT_BLOCKS = 5_000_000  # block visits one snapshot may cost the analysis

# What holds memory, inferred from the Python frames of an allocation (innermost first)
_CATEGORY_RULES = (
    ("optimizer state", ("/torch/optim/",)),
    ("gradients (backward)", ("/torch/autograd/", "backward")),
    ("parameters (model built or moved)", ("_apply", "build_agent", "__init__")),
    ("replay batches (copied to the device)", ("batch", "sample", "to_device")),
    ("activations (forward)", ("forward", "/torch/nn/")),
)


def allocation_category(frames: list) -> str:
    """A category a user recognises, from the frames of an allocation, where it can be inferred; else "other"."""
    if not isinstance(frames, list):
        return "other"
    text = " ".join(
        f"{f.get('filename', '')}:{f.get('name', '')}"
        for f in frames[:MAX_FRAMES_SCANNED]
        if isinstance(f, dict)
    )
    for category, markers in _CATEGORY_RULES:
        if any(marker in text for marker in markers):
            return category
    return "other" if text else "no stack recorded"


def summarize_snapshot(data: dict) -> dict:
    """Totals of one snapshot in MB and counts, and live bytes/blocks per allocation site and per category.

    `active` counts every block the program has not given back to the allocator, pending frees included (what
    the memory is); `allocated` only those still allocated (what torch.cuda.memory_allocated and the scripts'
    debug/gpu/alloc_mb log). Refuses (SnapshotTooLarge) a file whose segments share one list of blocks (memo
    references make a few kilobytes describe billions of blocks; torch never writes that) or that has more than
    MAX_SNAPSHOT_BLOCKS."""
    totals = {
        "active_mb": 0.0,
        "allocated_mb": 0.0,
        "small_pool_active_mb": 0.0,
        "large_pool_active_mb": 0.0,
        "reserved_mb": 0.0,
        "active_blocks": 0,
    }
    sites: dict[str, list] = {}
    categories: dict[str, list] = {}
    segments = data.get("segments", [])
    _require_snapshot(isinstance(segments, list), "'segments' is not a list")
    block_lists = [segment.get("blocks", []) if isinstance(segment, dict) else None for segment in segments]
    _require_snapshot(
        all(isinstance(b, list) for b in block_lists), "a segment is not a dict with a list of blocks"
    )
    if len({id(b) for b in block_lists if b}) < sum(1 for b in block_lists if b):
        raise SnapshotTooLarge("segments share one list of blocks (torch never writes that)")
    if sum(len(b) for b in block_lists) > MAX_SNAPSHOT_BLOCKS:
        raise SnapshotTooLarge(f"more than {MAX_SNAPSHOT_BLOCKS:,} blocks")
    site_of: dict[int, tuple[str, str]] = {}  # frames lists shared between blocks are read once
    for segment in segments:
        totals["reserved_mb"] += segment.get("total_size", 0) / mu.MB
        pool = "small_pool_active_mb" if segment.get("segment_type") == "small" else "large_pool_active_mb"
        for block in segment.get("blocks", []):
            if block.get("state") not in _ACTIVE_STATES:
                continue
            size = block.get("size", 0)
            totals["active_mb"] += size / mu.MB
            if block.get("state") == "active_allocated":
                totals["allocated_mb"] += size / mu.MB
            totals[pool] += size / mu.MB
            totals["active_blocks"] += 1
            frames = block.get("frames", [])
            if id(frames) not in site_of:
                site_of[id(frames)] = (allocation_site(frames), allocation_category(frames))
            site, category = site_of[id(frames)]
            for table, key in ((sites, site), (categories, category)):
                entry = table.setdefault(key, [0, 0])
                entry[0] += size
                entry[1] += 1
    return {
        "totals": totals,
        "sites": sites,
        "categories": categories,
        "expandable": _expandable_segments(data, segments),
    }


def _expandable_segments(data: dict, segments: list) -> bool:
    """Whether the run already used expandable segments: every segment says so, or the allocator settings do."""
    settings = data.get("allocator_settings")
    if isinstance(settings, dict) and settings.get("expandable_segments") in (True, "True", "true", 1):
        return True
    flags = [segment.get("is_expandable") for segment in segments if isinstance(segment, dict)]
    return bool(flags) and all(flag is True for flag in flags)


GROWTH_COLUMNS = (
    "active_mb",
    "allocated_mb",
    "small_pool_active_mb",
    "large_pool_active_mb",
    "reserved_mb",
    "active_blocks",
)


@dataclasses.dataclass
class SnapshotAnalysis:
    steps: list[int]
    rows: list[dict]  # one per snapshot: step + GROWTH_COLUMNS
    slopes: dict[str, float]  # per 1k steps
    top_sites: list[
        dict
    ]  # site, bytes_first, bytes_last, blocks_first, blocks_last, growth_mb, growth_blocks
    skipped: list[str]
    verdict: str
    events: list[dict] = dataclasses.field(default_factory=list)
    holders: list[dict] = dataclasses.field(default_factory=list)  # the last snapshot's sites, largest first
    categories: list[dict] = dataclasses.field(default_factory=list)  # the last snapshot's categories
    files: list[Path] = dataclasses.field(default_factory=list)  # the snapshots read, in step order


def _snapshot_files(snapshots_dir: Path) -> list[tuple[int, Path]]:
    found = []
    for path in snapshots_dir.glob("*.pickle"):
        match = _STEP_RE.search(path.name)
        if match:
            found.append((int(match.group(1)), path))
    return sorted(found)


def _verdict(rows: list[dict], threshold: float, expandable: bool) -> tuple[str, dict[str, float]]:
    """The verdict over snapshots in step order, and the slopes per 1k steps. Growth is judged as the leak
    detector judges a run (`growth_evidence`): one jump (a CUDA graph's pool, the first evaluation) is no leak."""
    steps = [r["step"] for r in rows]
    evidence = {
        c: mu.growth_evidence(
            steps,
            [r[c] for r in rows],
            50.0 if c == "active_blocks" else threshold,
            noise_floor=0.01,
            scales=(min(4, len(rows)), 6, 9, 12, 18, 24),
        )
        for c in GROWTH_COLUMNS
    }
    slopes = {c: evidence[c][2] for c in GROWTH_COLUMNS}
    grows = {c: evidence[c][0] for c in GROWTH_COLUMNS}
    small, large = slopes["small_pool_active_mb"], slopes["large_pool_active_mb"]
    active, reserved, blocks = slopes["active_mb"], slopes["reserved_mb"], slopes["active_blocks"]
    if len(rows) < 4:
        return (
            f"too few snapshots ({len(rows)}) to judge growth; below is what holds the memory in the last one "
            f"(slopes per 1k steps: active {active:+.2f} MB, reserved {reserved:+.2f} MB)."
        ), slopes
    if grows["small_pool_active_mb"] and grows["active_blocks"]:
        return (
            f"leak: small-pool active memory grows {small:.2f} MB and {blocks:.0f} blocks per 1k steps. Many "
            "small blocks that never die are the signature of retained autograd graphs: run collection under "
            "torch.no_grad() and store recurrent state detached. The top growing site below is where they "
            "are allocated."
        ), slopes
    if grows["active_mb"]:
        return (
            f"leak: active memory grows {active:.2f} MB per 1k steps (large pool {large:+.2f}). Tensors are "
            "kept alive; the top growing site below is where they are allocated."
        ), slopes
    if grows["reserved_mb"]:
        advice = (
            "Expandable segments are already on here, so this is reserved memory the allocator keeps for "
            "allocations of changing sizes: a lower garbage_collection_threshold in PYTORCH_ALLOC_CONF, or "
            "fewer distinct tensor sizes, give it back."
            if expandable
            else "Use PYTORCH_ALLOC_CONF=expandable_segments:True."
        )
        return (
            f"fragmentation: reserved memory grows {reserved:.2f} MB per 1k steps while active memory does not "
            f"({active:+.2f}). {advice}"
        ), slopes
    return (
        f"steady: no pool grows for good (active {active:+.2f}, reserved {reserved:+.2f} MB per 1k steps; a "
        f"single jump, such as a CUDA graph's memory pool or the first evaluation, is not growth)."
    ), slopes


def analyze_snapshots(
    snapshots: str | os.PathLike,
    events_dir: str | os.PathLike | None = None,
    threshold_mb_per_1k: float = 1.0,
    top: int = 10,
) -> SnapshotAnalysis:
    """Growth over a run's snapshots (a directory of snapshot_step_<N>.pickle files, ordered by step), the top
    growing allocation sites and a verdict; or, for one snapshot file (an OOM's `snapshot_at_oom.pickle`), what
    holds the memory at that moment. Either way the last snapshot's holders, by site and by category, largest
    first (ties by name, so the order never depends on hashing)."""
    path = Path(snapshots)
    mu._require(path.exists(), f"snapshots path {path} does not exist")
    mu._require(
        mu._is_number(threshold_mb_per_1k) and threshold_mb_per_1k > 0,
        f"threshold_mb_per_1k must be a positive number, got {threshold_mb_per_1k!r}",
    )
    files = [(0, path)] if path.is_file() else _snapshot_files(path)
    rows, summaries, skipped, read = [], [], [], []
    for step, file in files:
        try:
            summary = summarize_snapshot(load_snapshot(file))
        except (UnsafeSnapshotError, SnapshotTooLarge) as exc:
            skipped.append(f"{file.name}: refused ({exc})")
            continue
        except Exception as exc:  # noqa: BLE001 - corrupt or truncated files are skipped, not fatal
            skipped.append(f"{file.name}: unreadable ({type(exc).__name__}: {str(exc)[:200]})")
            continue
        rows.append({"step": step, **summary["totals"]})
        summaries.append(summary)
        read.append(file)
    for message in skipped:
        print(f"warning: skipped {message}", file=sys.stderr)
    mu._require(
        rows,
        f"no readable snapshot ({path.name} is not one)"
        if path.is_file()
        else f"no readable snapshot_step_<N>.pickle files in {path}",
    )
    steps = [r["step"] for r in rows]
    last = summaries[-1]
    if path.is_file():
        verdict = (
            f"one snapshot ({path.name}): {last['totals']['active_mb']:.0f} MB active, "
            f"{last['totals']['reserved_mb']:.0f} MB reserved; what holds it is below, largest first."
        )
        slopes = {c: 0.0 for c in GROWTH_COLUMNS}
    else:
        verdict, slopes = _verdict(rows, threshold_mb_per_1k, last["expandable"])
    first_sites, last_sites = summaries[0]["sites"], last["sites"]
    top_sites = []
    for site in set(first_sites) | set(last_sites):
        b0, n0 = first_sites.get(site, (0, 0))
        b1, n1 = last_sites.get(site, (0, 0))
        top_sites.append(
            {
                "site": site,
                "bytes_first": b0,
                "bytes_last": b1,
                "blocks_first": n0,
                "blocks_last": n1,
                "growth_mb": (b1 - b0) / mu.MB,
                "growth_blocks": n1 - n0,
            }
        )
    top_sites.sort(key=lambda s: (-s["growth_mb"], -s["growth_blocks"], -s["bytes_last"], s["site"]))
    holders = sorted(
        ({"site": k, "mb": v[0] / mu.MB, "blocks": v[1]} for k, v in last_sites.items()),
        key=lambda h: (-h["mb"], -h["blocks"], h["site"]),
    )
    categories = sorted(
        ({"category": k, "mb": v[0] / mu.MB, "blocks": v[1]} for k, v in last["categories"].items()),
        key=lambda h: (-h["mb"], h["category"]),
    )
    result = SnapshotAnalysis(
        steps,
        rows,
        slopes,
        top_sites[:top] if len(rows) > 1 else [],
        skipped,
        verdict,
        holders=holders[:top],
        categories=categories,
        files=read,
    )
    if events_dir is not None:
        result.events = _events_at_steps(Path(events_dir), steps, rows)
    return result


# the logged figure and the snapshot's figure that measure the same thing
_EVENT_COMPARE = {
    mu.KEY_GPU_ALLOC_MB: "allocated_mb",
    mu.KEY_GPU_RESERVED_MB: "reserved_mb",
    mu.KEY_GPU_SMALL_POOL_ACTIVE_MB: "small_pool_active_mb",
    mu.KEY_GPU_LARGE_POOL_ACTIVE_MB: "large_pool_active_mb",
    mu.KEY_GPU_ACTIVE_BLOCKS: "active_blocks",
}


def _events_at_steps(events_dir: Path, steps: list[int], rows: list[dict]) -> list[dict]:
    """The logged debug/* scalars nearest each snapshot step, beside the snapshot's own figures."""
    mu._require(events_dir.is_dir(), f"events directory {events_dir} does not exist")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(events_dir), size_guidance={"scalars": 0})
    acc.Reload()
    tags = [t for t in acc.Tags().get("scalars", []) if t.startswith("debug/")]
    series = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in tags}
    out = []
    for step, row in zip(steps, rows):
        entry: dict[str, Any] = {"step": step}
        for tag, points in series.items():
            if points:
                logged_step, value = min(points, key=lambda p: abs(p[0] - step))
                entry[tag] = value
                entry[tag + "@step"] = logged_step
        for tag, column in _EVENT_COMPARE.items():
            if tag in entry:
                logged, snap = entry[tag], row[column]
                entry[f"agree:{tag}"] = abs(logged - snap) <= max(5.0, 0.1 * max(abs(snap), abs(logged)))
        out.append(entry)
    return out


def _growth_table(analysis: SnapshotAnalysis) -> str:
    header = "| step | " + " | ".join(GROWTH_COLUMNS) + " |"
    lines = [header, "|" + "---|" * (len(GROWTH_COLUMNS) + 1)]
    for row in analysis.rows:
        lines.append(
            f"| {row['step']} | "
            + " | ".join(f"{row[c]:.0f}" if c == "active_blocks" else f"{row[c]:.2f}" for c in GROWTH_COLUMNS)
            + " |"
        )
    lines.append(
        "| slope per 1k steps | " + " | ".join(f"{analysis.slopes[c]:+.2f}" for c in GROWTH_COLUMNS) + " |"
    )
    return "\n".join(lines)


def _holders_table(analysis: SnapshotAnalysis) -> str:
    lines = ["| what holds it | MB | blocks |", "|---|---:|---:|"]
    lines += [f"| {c['category']} | {c['mb']:.2f} | {c['blocks']} |" for c in analysis.categories]
    lines += ["", "| allocation site | MB | blocks |", "|---|---:|---:|"]
    lines += [f"| `{h['site']}` | {h['mb']:.2f} | {h['blocks']} |" for h in analysis.holders]
    return "\n".join(lines)


def segments_text(data: dict) -> str:
    """Every segment, small ones included (torch's segsum leaves out those under 20 MiB, and with them any
    small-pool leak): address, pool, size, active bytes, blocks, and its largest allocation sites."""
    lines = [f"{'address':>16} {'pool':>5} {'MB':>9} {'active MB':>10} {'blocks':>7}  largest sites"]
    segments = sorted(
        (s for s in data.get("segments", []) if isinstance(s, dict)),
        key=lambda s: (-s.get("total_size", 0), s.get("address", 0)),
    )
    for segment in segments:
        sites: dict[str, int] = {}
        active = 0
        blocks = [b for b in segment.get("blocks", []) if b.get("state") in _ACTIVE_STATES]
        for block in blocks:
            active += block.get("size", 0)
            site = allocation_site(block.get("frames", []))
            sites[site] = sites.get(site, 0) + block.get("size", 0)
        largest = ", ".join(
            f"{k} {v / mu.MB:.2f}" for k, v in sorted(sites.items(), key=lambda kv: (-kv[1], kv[0]))[:3]
        )
        lines.append(
            f"{segment.get('address', 0):>16x} {segment.get('segment_type', '?')!s:>5} "
            f"{segment.get('total_size', 0) / mu.MB:>9.2f} {active / mu.MB:>10.2f} {len(blocks):>7}  {largest}"
        )
    return "\n".join(lines) + "\n"


def _report_html(analysis: SnapshotAnalysis, png: bytes | None) -> str:
    """A self-contained page (the plot inlined, no script, nothing fetched): opens offline."""
    import base64
    import html

    def table(rows: list[list[str]], header: list[str]) -> str:
        head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
        return f"<table><tr>{head}</tr>{body}</table>"

    parts = [
        "<!doctype html><meta charset='utf-8'><title>Memory snapshot analysis</title>",
        "<style>body{font-family:sans-serif;max-width:70em;margin:2em auto}td,th{padding:2px 8px;"
        "border-bottom:1px solid #ddd;text-align:right}td:first-child,th:first-child{text-align:left}</style>",
        "<h1>Memory snapshot analysis</h1>",
        f"<p><b>Verdict:</b> {html.escape(analysis.verdict)}</p>",
    ]
    if png:
        parts.append(
            f"<img alt='memory per pool and step' src='data:image/png;base64,{base64.b64encode(png).decode()}'>"
        )
    parts += [
        "<h2>Per snapshot (MB)</h2>",
        table(
            [[str(r["step"]), *[f"{r[c]:.2f}" for c in GROWTH_COLUMNS]] for r in analysis.rows],
            ["step", *GROWTH_COLUMNS],
        ),
    ]
    if analysis.top_sites:
        parts += [
            "<h2>Top growing allocation sites (first to last snapshot)</h2>",
            table(
                [
                    [
                        s["site"],
                        f"{s['bytes_first'] / mu.MB:.2f}",
                        f"{s['bytes_last'] / mu.MB:.2f}",
                        f"{s['growth_mb']:+.2f}",
                        str(s["growth_blocks"]),
                    ]
                    for s in analysis.top_sites
                ],
                ["site", "MB first", "MB last", "growth MB", "growth blocks"],
            ),
        ]
    parts += [
        "<h2>What holds the memory (last snapshot)</h2>",
        table(
            [[c["category"], f"{c['mb']:.2f}", str(c["blocks"])] for c in analysis.categories],
            ["what", "MB", "blocks"],
        ),
        table(
            [[h["site"], f"{h['mb']:.2f}", str(h["blocks"])] for h in analysis.holders],
            ["allocation site", "MB", "blocks"],
        ),
    ]
    return "\n".join(parts) + "\n"


def write_analysis(
    analysis: SnapshotAnalysis, out_dir: str | os.PathLike, last_snapshot: Path | None = None
) -> dict[str, str]:
    """report.md and report.html (self-contained, opens offline), growth.csv, memory.png, segments.txt (every
    segment), and torch's own timeline.html (which fetches its viewer from the web when opened)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    last_snapshot = last_snapshot or (analysis.files[-1] if analysis.files else None)
    written = {}
    with open(out / "growth.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["step", *GROWTH_COLUMNS])
        writer.writeheader()
        writer.writerows(analysis.rows)
    written["growth.csv"] = str(out / "growth.csv")
    png = None
    try:
        import io

        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4.5))
        for column in (
            "active_mb",
            "allocated_mb",
            "small_pool_active_mb",
            "large_pool_active_mb",
            "reserved_mb",
        ):
            ax.plot(analysis.steps, [r[column] for r in analysis.rows], marker="o", label=column)
        ax.set_xlabel("env step")
        ax.set_ylabel("MB")
        ax.set_title("GPU memory per snapshot")
        ax.legend()
        fig.tight_layout()
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=100)
        plt.close(fig)
        png = buffer.getvalue()
        (out / "memory.png").write_bytes(png)
        written["memory.png"] = str(out / "memory.png")
    except Exception as exc:  # noqa: BLE001
        print(f"warning: memory.png not written ({exc})", file=sys.stderr)
    (out / "report.html").write_text(_report_html(analysis, png))
    written["report.html"] = str(out / "report.html")
    viz_note = "no snapshot to draw"
    if last_snapshot is not None:
        try:
            data = load_snapshot(last_snapshot)
            (out / "segments.txt").write_text(segments_text(data))
            written["segments.txt"] = str(out / "segments.txt")
            from torch.cuda import _memory_viz

            (out / "timeline.html").write_text(_memory_viz.trace_plot(data))
            written["timeline.html"] = str(out / "timeline.html")
            viz_note = (
                f"`report.html` opens offline. `segments.txt` lists every segment of {last_snapshot.name}. "
                "`timeline.html` is torch's own timeline; it fetches its viewer (MemoryViz.js) from the web "
                "when opened, so offline, drag the pickle into a saved copy of pytorch.org/memory_viz."
            )
        except Exception as exc:  # noqa: BLE001
            viz_note = f"{last_snapshot.name} could not be drawn ({exc})"
    lines = [
        "# Memory snapshot analysis",
        "",
        f"**Verdict:** {analysis.verdict}",
        "",
        "## Growth",
        "",
        _growth_table(analysis),
        "",
    ]
    if analysis.top_sites:
        lines += [
            "## Top growing allocation sites (first → last snapshot)",
            "",
            "| site | MB first | MB last | growth MB | blocks first | blocks last |",
            "|---|---|---|---|---|---|",
        ]
        for s in analysis.top_sites:
            lines.append(
                f"| `{s['site']}` | {s['bytes_first'] / mu.MB:.2f} | {s['bytes_last'] / mu.MB:.2f} | "
                f"{s['growth_mb']:+.2f} | {s['blocks_first']} | {s['blocks_last']} |"
            )
        lines.append("")
    lines += ["## What holds the memory in the last snapshot", "", _holders_table(analysis)]
    if analysis.events:
        lines += [
            "",
            "## Logged scalars at the snapshot steps",
            "",
            "Logged allocated memory is compared with the snapshot's allocated blocks (pending frees are active "
            "but no longer allocated), logged reserved with the snapshot's segments.",
            "",
            "| step | logged alloc MB | snapshot allocated MB | agree | logged reserved MB | snapshot reserved MB "
            "| agree |",
            "|---|---|---|---|---|---|---|",
        ]
        for entry, row in zip(analysis.events, analysis.rows):

            def cell(tag, column, entry=entry, row=row):
                if tag not in entry:
                    return "n/a | " + f"{row[column]:.2f} | n/a"
                return f"{entry[tag]:.2f} | {row[column]:.2f} | {'yes' if entry['agree:' + tag] else 'NO'}"

            lines.append(
                f"| {entry['step']} | {cell(mu.KEY_GPU_ALLOC_MB, 'allocated_mb')} | "
                f"{cell(mu.KEY_GPU_RESERVED_MB, 'reserved_mb')} |"
            )
    if analysis.skipped:
        lines += ["", "## Skipped files", ""] + [f"- {m}" for m in analysis.skipped]
    lines += ["", "## Views", "", viz_note, ""]
    (out / "report.md").write_text("\n".join(lines))
    written["report.md"] = str(out / "report.md")
    return written


# ---------------------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------------------
class _CliError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad argument in one line and exits 2 (no usage dump, no traceback)."""

    def error(self, message):
        raise _CliError(message)


def _parse_env_assignment(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
        raise ValueError(f"--fallback-env expects NAME=VALUE, got {text!r}")
    return name, value


def run_wait(
    min_free_mb: float,
    poll_s: float,
    timeout_s: float,
    command: list[str],
    gpu: int | None = None,
    fallback_env: Sequence[str] = (),
    allow_no_gpu: bool = False,
    probe: Callable[[], float] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    nvml=None,
) -> int:
    """The `wait` command: wait for free memory, then run `command`; on timeout run it with `fallback_env`."""
    mu._require(bool(command), "wait needs a command after --, e.g. `-- python dqn_starcraft_split.py`")
    mu._require(
        mu._is_number(min_free_mb) and min_free_mb >= 0,
        f"--min-free must be a number of MB >= 0, got {min_free_mb!r}",
    )
    mu._require(
        mu._is_number(poll_s) and poll_s > 0, f"--sleep must be a number of seconds > 0, got {poll_s!r}"
    )
    mu._require(
        mu._is_number(timeout_s) and timeout_s >= 0,
        f"--timeout must be a number of seconds >= 0, got {timeout_s!r}",
    )
    mu._require(gpu is None or (mu._is_int(gpu) and gpu >= 0), f"--gpu must be an integer >= 0, got {gpu!r}")
    overrides = dict(_parse_env_assignment(a) for a in fallback_env)
    env = os.environ.copy()
    with _signals_as_exit() as stopped:
        nvml_probe = None
        if probe is None:
            try:
                probe = nvml_probe = mu.NvmlProbe(gpu or 0, nvml)
            except mu.NvmlUnavailable as exc:
                if not allow_no_gpu:
                    raise _CliError(
                        f"cannot read the GPU's free memory: {exc} (pass --allow-no-gpu to run the "
                        f"command anyway)"
                    ) from None
                print(f"wait: {exc}; running the command without waiting (--allow-no-gpu)")
        if nvml_probe is not None and gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = (
                nvml_probe.uuid
            )  # the very card that was probed, whatever CUDA's order
        try:
            ready = probe is None or mu._poll_free_memory(
                min_free_mb, poll_s, timeout_s, probe, sleep, time.monotonic, verbose=True
            )
        finally:
            if nvml_probe is not None:
                nvml_probe.close()
        if not ready:
            if overrides:
                print(
                    "wait: running with the fallback environment "
                    + " ".join(f"{k}={v}" for k, v in overrides.items())
                )
                env.update(overrides)
            else:
                print("wait: no --fallback-env given; running the command as it is")
    if stopped:
        return 128 + stopped[0]
    return run_forwarding_signals(command, env)


FORWARDED_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")


@contextlib.contextmanager
def _signals_as_exit():
    """While waiting for memory, a stop signal ends the wait quietly; the list it yields holds the signal."""
    import signal

    stopped: list[int] = []

    class _Stop(Exception):
        pass

    def handler(signum, frame):
        stopped.append(signum)
        raise _Stop

    previous = {
        getattr(signal, name): signal.signal(getattr(signal, name), handler) for name in FORWARDED_SIGNALS
    }
    try:
        yield stopped
    except _Stop:
        pass
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def run_forwarding_signals(command: list[str], env: dict) -> int:
    """Run `command` in its own process group and pass SIGINT, SIGTERM and SIGHUP on to it, exactly once each
    (a signal to this process's group does not reach it directly); return its exit status as a shell reports
    it: 128 + N when signal N ended it (137 for SIGKILL)."""
    import signal

    sys.stdout.flush()  # our lines before the command's
    child: subprocess.Popen | None = None
    pending: list[int] = []  # a signal that arrives while the command is starting is passed on once it runs

    def forward(signum, frame):
        if child is None:
            pending.append(signum)
        else:
            child.send_signal(signum)

    sigs = [getattr(signal, name) for name in FORWARDED_SIGNALS]
    previous = {sig: signal.signal(sig, forward) for sig in sigs}
    try:
        try:
            child = subprocess.Popen(command, env=env, process_group=0)
        except FileNotFoundError:
            raise _CliError(f"command not found: {command[0]}") from None
        except PermissionError:
            raise _CliError(f"command is not executable: {command[0]}") from None
        for signum in pending:
            child.send_signal(signum)
        returncode = child.wait()
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
    return 128 - returncode if returncode < 0 else returncode


def _cmd_report(args) -> int:
    print(
        json.dumps(
            {
                "memory_report": mu.memory_report(),
                "gpu": mu.gpu_memory_stats(),
                "cuda_devices": torch.cuda.device_count() if mu._cuda_ready() else 0,
            },
            indent=2,
        )
    )
    return 0


def _cmd_allocator(args) -> int:
    conf = mu.configure_allocator(verbose=False)
    print(conf or "(torch defaults)")
    return 0


def _cmd_analyze(args) -> int:
    source = args.path or args.snapshots_dir
    if source is None:
        raise _CliError("analyze needs a snapshot file or a folder of them (PATH, or --snapshots-dir)")
    if args.path and args.snapshots_dir:
        raise _CliError("give the snapshots once: PATH or --snapshots-dir, not both")
    analysis = analyze_snapshots(source, args.events_dir, args.threshold)
    source = Path(source)
    out_dir = (
        Path(args.out_dir)
        if args.out_dir
        else (
            source.parent / f"{source.stem}_analysis"
            if source.is_file()
            else source.parent / "memory_analysis"
        )
    )
    try:
        written = write_analysis(analysis, out_dir)
    except OSError as exc:
        raise _CliError(
            f"cannot write the report to --out-dir {str(out_dir)!r} ({exc.strerror or exc})"
        ) from None
    if len(analysis.rows) > 1:
        print(_growth_table(analysis))
    if analysis.top_sites:
        print("\nTop growing allocation sites:")
        for s in analysis.top_sites[:5]:
            print(f"  {s['site']}: {s['growth_mb']:+.2f} MB, {s['growth_blocks']:+d} blocks")
    print("\nWhat holds the memory" + (" at that moment:" if source.is_file() else " in the last snapshot:"))
    for c in analysis.categories:
        print(f"  {c['category']}: {c['mb']:.2f} MB in {c['blocks']} blocks")
    for h in analysis.holders[:5]:
        print(f"  {h['site']}: {h['mb']:.2f} MB in {h['blocks']} blocks")
    print(f"\n{analysis.verdict}")
    print(f"\nwrote {', '.join(sorted(written))} to {out_dir}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="memory_analysis.py",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run `python memory_analysis.py COMMAND --help` for a command's options.",
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    p = sub.add_parser("report", help="print this process's memory report and the CUDA devices it sees")
    p.set_defaults(func=_cmd_report)
    p = sub.add_parser("allocator", help="print the allocator settings configure_allocator() puts in force")
    p.set_defaults(func=_cmd_allocator)
    p = sub.add_parser(
        "wait",
        help="wait for free GPU memory, then run a command",
        description="Poll free GPU memory until --min-free MB are free, then run COMMAND (its exit "
        "status is passed through). On timeout run it with the --fallback-env "
        "variables, e.g. RL_BATCH_SIZE=2.",
    )
    p.add_argument(
        "--min-free", type=float, required=True, metavar="MB", help="free GPU memory to wait for, in MB"
    )
    p.add_argument(
        "--sleep", type=float, default=30.0, metavar="S", help="seconds between polls (default 30)"
    )
    p.add_argument(
        "--timeout", type=float, default=3600.0, metavar="S", help="give up after S seconds (default 3600)"
    )
    p.add_argument(
        "--gpu",
        type=int,
        default=None,
        metavar="N",
        help="wait for the N-th GPU this process may use (the N-th of CUDA_VISIBLE_DEVICES when set) and "
        "give the command that GPU alone",
    )
    p.add_argument(
        "--fallback-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a variable for the command when the wait times out; repeat the flag for several",
    )
    p.add_argument(
        "--allow-no-gpu", action="store_true", help="without CUDA, run the command instead of exiting 2"
    )
    p.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- COMMAND ...")
    p.set_defaults(func=None)
    p = sub.add_parser(
        "analyze",
        help="analyse a run's memory snapshots",
        description="Growth table, top growing allocation sites and a verdict from "
        "{run_dir}/memory_snapshots/snapshot_step_N.pickle files, or what holds the memory "
        "in one snapshot file; with --events-dir, the logged debug/* scalars beside them. "
        "Writes report.md, report.html (opens offline), growth.csv, memory.png, "
        "segments.txt and torch's timeline.html. Files are read as untrusted: a pickle "
        "that would run code or blow up memory or time is refused in one line.",
    )
    p.add_argument(
        "path",
        nargs="?",
        default=None,
        help="one snapshot file (an OOM's snapshot_at_oom.pickle) or a folder of snapshot_step_N.pickle",
    )
    p.add_argument(
        "--snapshots-dir", default=None, help="a folder of snapshot_step_N.pickle files (same as PATH)"
    )
    p.add_argument("--events-dir", default=None, help="the run's TensorBoard directory (runs/<run_name>)")
    p.add_argument(
        "--out-dir", default=None, help="where to write the report (default: beside the snapshots)"
    )
    p.add_argument(
        "--threshold", type=float, default=1.0, help="MB per 1k steps that counts as growth (default 1)"
    )
    p.set_defaults(func=_cmd_analyze)
    return parser


def main(
    argv: list[str] | None = None,
    probe: Callable[[], float] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    nvml=None,
) -> int:
    """CLI entry point; `probe`, `sleep` and `nvml` (a pynvml stand-in) are injectable for `wait` (tests run it
    without a GPU)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if args.command == "wait":
            command = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
            return run_wait(
                args.min_free,
                args.sleep,
                args.timeout,
                command,
                gpu=args.gpu,
                fallback_env=args.fallback_env,
                allow_no_gpu=args.allow_no_gpu,
                probe=probe,
                sleep=sleep,
                nvml=nvml,
            )
        return args.func(args)
    except (_CliError, ValueError, RuntimeError) as exc:
        print(f"memory_analysis.py: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
