"""Memory helpers shared by the training scripts: measure, explain, and keep memory in check.

Library:
    process_rss_mb / process_uss_mb      host memory of this process (psutil, /proc fallback)
    gpu_memory_stats / memory_report     CUDA allocator figures and the flat logging dict
    LeakDetector                         robust memory slopes and a plain-English diagnosis
    configure_allocator                  PYTORCH_ALLOC_CONF defaults, set before CUDA starts
    wait_for_gpu, NvmlProbe              poll free GPU memory (NVML: no CUDA context) with a timeout
    preallocate_optimizer_state          materialise optimizer state up front, changing nothing
    amp                                  autocast + GradScaler set-up for off / fp16 / bf16
    StatusLine, ProgressLine             a status line every 30 s of wall time (rates, ETA, return, loss); a line of
                                         step, SPS, RSS and GPU memory at each log point, live on a terminal
    UpdateLog, nonfinite_modules         logged values summed on the device and read once per log interval, with
                                         the non-finite ones counted; which modules hold a weight that is not finite
    StageProbes, MemorySnapshots,
    install_oom_observer,
    write_oom_report                     forensics: where in the loop memory grows, and why an OOM hit
    claim_run_dir, StopSignals,
    out_of_memory, fixed_once_parsed,
    save_checked, read_checkpoint,
    open_tensorboard                     a run's life: its own folder, stop signals read at the loop's top, the
                                         out-of-memory sequence in one call, settings frozen once parsed,
                                         checkpoints checked against their own CRC-32s and a checksum beside them
    mapped_arrays, ChunkedArray,
    ChunkedColumns                       replay storage: growable arrays in chunks, in memory maps of their own

A run imports this file alone. The offline analysis of snapshot files and the command line (`report`,
`allocator`, `wait`, `analyze`) are in memory_analysis.py, which no run imports.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import dataclasses
import errno
import functools
import gc
import hashlib
import itertools
import json
import math
import mmap
import numbers
import os
import pickle
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import zipfile
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Self

import numpy as np
import torch

try:
    import psutil
except ImportError:  # pragma: no cover - exercised by tests through monkeypatching
    psutil = None

MB = 1024.0 * 1024.0
MB_INT = 1024 * 1024

# ---------------------------------------------------------------------------------------------------------
# Logging keys: defined once, here. Both training scripts log exactly these names.
# ---------------------------------------------------------------------------------------------------------
KEY_RSS_MB = "debug/cpu/rss_mb"
KEY_USS_MB = "debug/cpu/uss_mb"
KEY_ANON_MB = "debug/cpu/anon_mb"
KEY_HEAP_IN_USE_MB = "debug/cpu/heap_in_use_mb"
KEY_GPU_ALLOC_MB = "debug/gpu/alloc_mb"
KEY_GPU_RESERVED_MB = "debug/gpu/reserved_mb"
KEY_GPU_MAX_ALLOC_MB = "debug/gpu/max_alloc_mb"
KEY_GPU_MAX_RESERVED_MB = "debug/gpu/max_reserved_mb"
KEY_GPU_SMALL_POOL_ACTIVE_MB = "debug/gpu/small_pool_active_mb"
KEY_GPU_LARGE_POOL_ACTIVE_MB = "debug/gpu/large_pool_active_mb"
KEY_GPU_ACTIVE_BLOCKS = "debug/gpu/active_blocks"
KEY_GPU_NUM_ALLOC_RETRIES = "debug/gpu/num_alloc_retries"
KEY_GPU_NUM_OOMS = "debug/gpu/num_ooms"

CPU_KEYS = (KEY_RSS_MB, KEY_USS_MB, KEY_ANON_MB, KEY_HEAP_IN_USE_MB)
GPU_KEYS = (
    KEY_GPU_ALLOC_MB,
    KEY_GPU_RESERVED_MB,
    KEY_GPU_MAX_ALLOC_MB,
    KEY_GPU_MAX_RESERVED_MB,
    KEY_GPU_SMALL_POOL_ACTIVE_MB,
    KEY_GPU_LARGE_POOL_ACTIVE_MB,
    KEY_GPU_ACTIVE_BLOCKS,
    KEY_GPU_NUM_ALLOC_RETRIES,
    KEY_GPU_NUM_OOMS,
)
BUFFER_KEYS = {
    "total_steps": "buffer/replay/total_steps",
    "num_episodes": "buffer/replay/num_episodes",
    "obs_bytes": "buffer/replay/obs_bytes",
    "aux_bytes": "buffer/replay/aux_bytes",
}
# optional in buffer_stats: replay bytes kept on the device (frames gathered there), not in host memory
BUFFER_DEVICE_KEY = "buffer/replay/obs_device_bytes"
PROBE_KEY_PREFIX = "debug/probe/"

# which gpu_memory_stats() field feeds which logging key
_GPU_KEY_FIELDS = {
    KEY_GPU_ALLOC_MB: "alloc_mb",
    KEY_GPU_RESERVED_MB: "reserved_mb",
    KEY_GPU_MAX_ALLOC_MB: "max_alloc_mb",
    KEY_GPU_MAX_RESERVED_MB: "max_reserved_mb",
    KEY_GPU_SMALL_POOL_ACTIVE_MB: "small_pool_active_mb",
    KEY_GPU_LARGE_POOL_ACTIVE_MB: "large_pool_active_mb",
    KEY_GPU_ACTIVE_BLOCKS: "active_blocks",
    KEY_GPU_NUM_ALLOC_RETRIES: "num_alloc_retries",
    KEY_GPU_NUM_OOMS: "num_ooms",
}


def _require(condition: bool, message: str) -> None:
    """Argument check: raise ValueError(message) naming the argument when `condition` is false."""
    if not condition:
        raise ValueError(message)


def _is_number(value: Any) -> bool:
    """A finite real number, numpy's included (a step counter is often np.int64); a bool is not one."""
    return isinstance(value, numbers.Real) and not _is_bool(value) and math.isfinite(value)


def _is_int(value: Any) -> bool:
    """An integer, numpy's included; a bool is not one (`every=True` is a mistake, not 1)."""
    return isinstance(value, numbers.Integral) and not _is_bool(value)


def _is_bool(value: Any) -> bool:
    return isinstance(value, bool) or type(value).__name__ == "bool_"  # numpy's bool is no subclass of bool


def _warn_once(key: str, message: str, _seen: set = set()) -> None:  # noqa: B006 - deliberate process-wide memo
    """Diagnostics never break training: print a failing probe's message once, then stay quiet."""
    if key not in _seen:
        _seen.add(key)
        print(f"memory_utils: {message}", file=sys.stderr)


# ---------------------------------------------------------------------------------------------------------
# Files: writes that survive a full disk (no space, quota, read-only, I/O error)
# ---------------------------------------------------------------------------------------------------------
class WriteFailed(OSError):
    """A file could not be written; the partial file is already removed and the previous file at `path` (if any)
    is untouched. `needed_bytes`: what the write needed (estimated before it started where the writer streams);
    `free_bytes`: what its file system had free when it failed (None where that cannot be read)."""

    def __init__(self, path: str, needed_bytes: int | None, free_bytes: int | None, reason: str):
        self.path, self.needed_bytes, self.free_bytes, self.reason = (
            str(path),
            needed_bytes,
            free_bytes,
            reason,
        )
        needed = "an unknown size" if needed_bytes is None else _size_text(needed_bytes)
        free = "unknown" if free_bytes is None else _size_text(free_bytes)
        super().__init__(f"could not write {self.path} (needs {needed}, {free} free there): {reason}")


def _size_text(nbytes: int) -> str:
    if nbytes >= 1024 * MB:
        return f"{nbytes / (1024 * MB):,.1f} GB"
    return f"{nbytes / MB:,.1f} MB" if nbytes >= MB else f"{nbytes:,} bytes"


def free_bytes(path: str | os.PathLike) -> int | None:
    """Free bytes for this user on the file system that holds `path` (or its nearest existing parent)."""
    folder = os.path.abspath(os.fspath(path))
    while not os.path.exists(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def estimate_nbytes(obj: Any) -> int:
    """Bytes a `torch.save` of `obj` needs, about: its tensors' storages (each counted once) and arrays, plus a
    small allowance for everything else (checkpoints are tensors and plain containers)."""
    seen: set[int] = set()

    def walk(item) -> int:
        if isinstance(item, torch.Tensor):
            storage = item.untyped_storage()
            key = storage.data_ptr() if storage.data_ptr() else id(storage)
            if key in seen:
                return 0
            seen.add(key)
            return storage.nbytes() + 512
        if isinstance(item, np.ndarray):
            return item.nbytes + 256
        if isinstance(item, (bytes, bytearray, str)):
            return len(item) + 32
        if isinstance(item, dict):
            return 64 + sum(walk(k) + walk(v) for k, v in item.items())
        if isinstance(item, (list, tuple, set, frozenset, deque)):
            return 64 + sum(walk(v) for v in item)
        return 32

    return walk(obj)


class _ErrorKeepingFile:
    """The file object a serializer writes to: passes bytes on, and keeps the first OSError it raised (torch.save
    turns a failed write into an unhelpful RuntimeError; this keeps the real reason)."""

    def __init__(self, raw):
        self.raw, self.error = raw, None

    def write(self, data) -> int:
        try:
            return self.raw.write(data)
        except OSError as exc:
            self.error = self.error or exc
            raise

    def flush(self) -> None:
        self.raw.flush()

    def tell(self) -> int:
        return self.raw.tell()


def atomic_write(
    path: str | os.PathLike,
    data: bytes | Callable[[Any], Any],
    needed_bytes: int | None = None,
    before_replace: Callable[[str], None] | None = None,
) -> int:
    """Write `path` all at once or not at all: a temporary file in the same folder, flushed to disk (fsync), then
    renamed over `path`. `data` is the bytes, or a function that writes to the open binary file (`lambda f:
    torch.save(state, f)`). `before_replace(temporary path)` runs once the file is on disk, before the rename (an
    exception there leaves `path` as it was). Returns the bytes written.

    A write that fails for lack of room, quota, a read-only or failing disk removes the temporary file and raises
    `WriteFailed` (the file, the bytes it needed, the free space); the previous file at `path` stays as it was.
    Other errors (a bug in what is written) are raised as they are, also without leaving the temporary file."""
    path = os.fspath(path)
    folder = os.path.dirname(path) or "."
    if needed_bytes is None and isinstance(data, (bytes, bytearray, memoryview)):
        needed_bytes = len(data)
    tmp, out = None, None
    try:
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=".tmp_", suffix="_" + os.path.basename(path))
        with os.fdopen(fd, "wb") as raw:
            out = _ErrorKeepingFile(raw)
            if callable(data):
                data(out)
            else:
                out.write(data)
            raw.flush()
            os.fsync(raw.fileno())
            written = raw.tell()
        if before_replace is not None:
            before_replace(tmp)
        os.replace(tmp, path)
        tmp = None
        return written
    except Exception as exc:
        error = exc if isinstance(exc, OSError) else getattr(out, "error", None)
        if error is None or isinstance(exc, WriteFailed):
            raise
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.remove(tmp)
            tmp = None
        reason = error.strerror or str(error) if isinstance(error, OSError) else str(error)
        raise WriteFailed(path, needed_bytes, free_bytes(folder), reason) from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.remove(tmp)


def atomic_append(path: str | os.PathLike, text: str) -> int:
    """Add `text` at the end of a small text file (a CSV of results) with `atomic_write`: the whole file is
    rewritten and renamed, so a full disk never leaves half a line; raises `WriteFailed` like it."""
    try:
        with open(path, "rb") as f:
            existing = f.read()
    except FileNotFoundError:
        existing = b""
    return atomic_write(path, existing + text.encode())


def disk_space_warning(
    folder: str | os.PathLike, bytes_per_checkpoint: int, copies: int = 2, replay_bytes: int = 0
) -> str | None:
    """One warning line when the file system of `folder` cannot hold `copies` checkpoints of this size (the one
    kept and the one being written beside it) and the replay's files on disk when full (`replay_bytes`), else
    None."""
    free = free_bytes(folder)
    if free is None or free >= copies * bytes_per_checkpoint + replay_bytes:
        return None
    replay = f" and the replay's {_size_text(replay_bytes)} on disk when full" if replay_bytes else ""
    return (
        f"warning: {_size_text(free)} free where checkpoints go ({os.fspath(folder)}), less than {copies} "
        f"checkpoints of about {_size_text(bytes_per_checkpoint)} each{replay}: a checkpoint may fail to write"
    )


class _GuardedRecords:
    """Stands in for TensorBoard's record writer inside its writer thread: a record that cannot be written is cut
    back off the event file (no torn record) and dropped, with one warning line per run of failures."""

    def __init__(self, records, path: str, say: Callable[[str], None]):
        self._records, self._path, self._say = records, path, say
        self.dropped = 0

    def write(self, data: bytes) -> None:
        try:
            size = os.path.getsize(self._path)
        except OSError:
            size = None
        try:
            self._records.write(data)
        except OSError as exc:
            if size is not None:
                with contextlib.suppress(OSError):
                    os.truncate(self._path, size)
            if not self.dropped:
                self._say(
                    f"warning: {WriteFailed(self._path, len(data) + 16, free_bytes(self._path), exc.strerror or str(exc))}; "
                    "TensorBoard events are dropped until there is room, training goes on"
                )
            self.dropped += 1
            return
        if self.dropped:
            self._say(f"TensorBoard events are written again to {self._path} ({self.dropped} were dropped)")
            self.dropped = 0

    def flush(self) -> None:
        with contextlib.suppress(OSError):
            self._records.flush()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._records.close()


def keep_events_on_write_errors(writer, say: Callable[[str], None] | None = None) -> bool:
    """Make a `SummaryWriter`'s failed writes (a full disk) one warning line instead of the end of the run.

    TensorBoard writes events in a thread; a failed write kills that thread (printing a traceback) and the error
    comes back at the next `add_scalar`, which would end training. Guarded, a record that cannot be written is
    dropped, the event file keeps only whole records, and writing resumes when there is room. Returns whether
    the guard is in place (False, with a warning, if this TensorBoard's writer is built otherwise)."""
    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    try:
        event_writer = writer._get_file_writer().event_writer
        worker = event_writer._async_writer._worker
        worker._record_writer = _GuardedRecords(worker._record_writer, event_writer._file_name, say)
        return True
    except AttributeError:
        _warn_once(
            "events_guard", "this TensorBoard's writer has another layout; a full disk may stop the run"
        )
        return False


def open_tensorboard(
    folder: str, settings: dict, columns=("value",), resume_step: int | None = None, say=None
):
    """A run's TensorBoard `SummaryWriter` in `folder` (made absolute: wandb's service process resolves a relative
    path against its own folder), its failed writes one warning line each (`keep_events_on_write_errors`), and
    `settings` ({name: value, or a tuple of `columns`}) as its first text, a table. A resumed run (`resume_step`, the
    checkpoint's) hides what the stopped run logged after it (TensorBoard's purge): no step is logged twice."""
    from torch.utils.tensorboard import SummaryWriter  # here: the DQN's pysc2 picks protobuf's runtime first

    writer = SummaryWriter(
        os.path.abspath(folder), purge_step=None if resume_step is None else resume_step + 1
    )
    keep_events_on_write_errors(writer, say)
    rows = [f"|param|{'|'.join(columns)}|", f"|-|{'-|' * len(columns)}"]
    for name, values in settings.items():
        rows.append(f"|{name}|{'|'.join(map(str, values if isinstance(values, tuple) else (values,)))}|")
    writer.add_text("hyperparameters", "\n".join(rows))
    return writer


# ---------------------------------------------------------------------------------------------------------
# Host memory
# ---------------------------------------------------------------------------------------------------------
def _proc_status_kb(field: str, path: str = "/proc/self/status") -> float | None:
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return float(line.split()[1])
    except OSError:
        return None
    return None


def _proc_smaps_private_kb(path: str = "/proc/self/smaps_rollup") -> float | None:
    try:
        total, found = 0.0, False
        with open(path) as f:
            for line in f:
                if line.startswith(("Private_Clean:", "Private_Dirty:")):
                    total += float(line.split()[1])
                    found = True
        return total if found else None
    except OSError:
        return None


@functools.cache  # looked up once per process, not at every memory report
def _glibc():
    """The C library where it is glibc on Linux (it has `malloc_trim` and `mallopt`), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") and hasattr(libc, "mallopt") else None  # musl has neither


def trim_host_memory() -> bool:
    """Collect garbage, then hand the allocator's free heap pages back to the kernel (glibc `malloc_trim(0)`).

    Without it, glibc keeps freed pages resident and USS moves in random steps of 10-15 MB whatever the
    program does, which hides a slow leak and fakes a fast one. Returns whether the trim ran (glibc only).
    """
    gc.collect()
    libc = _glibc()
    if libc is None:
        return False
    libc.malloc_trim(0)
    return True


@contextlib.contextmanager
def collect_only_the_loops_garbage():
    """Around a training loop: every object alive when it starts (the libraries, networks, envs) is moved out of the
    garbage collector's sight (`gc.freeze`), after one collection. Each memory report collects garbage before it
    measures (`trim_host_memory`); in a process holding torch, a collection that walks all of it takes about 0.2 s,
    one that walks what the loop made a few ms. Nothing stops being freed when its last reference goes; only a cycle
    among the frozen objects waits until they go back (`gc.unfreeze`, when the loop ends, however it ends)."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def heap_in_use_mb() -> float | None:
    """MB of live blocks that glibc's malloc has handed out, in every arena and as mmaps (`mallinfo2`, glibc 2.33
    or later; None elsewhere): C and C++ allocations (numpy arrays, torch CPU tensors, Python objects over 512
    bytes) that are not yet freed, with glibc's overhead per block. Resident anonymous memory minus this is what
    lives outside malloc's live blocks: free heap space it cannot give back (after `trim_host_memory`, the
    fragments of partly used pages), Python's small-object arenas, thread stacks."""
    libc = _glibc()
    if libc is None or not hasattr(libc, "mallinfo2"):
        return None
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return (info.uordblks + info.hblkhd) / MB


_M_ARENA_MAX = -8  # glibc's mallopt parameter number


def one_malloc_arena() -> bool:
    """Make every thread of this process allocate from glibc's main heap (`mallopt(M_ARENA_MAX, 1)`); call it
    before any thread starts (TensorBoard's writer thread, wandb's). Returns whether it is in force.

    Why: glibc gives each thread its own heap ("arena"), and `malloc_trim` never returns the free top of a
    thread's heap. TensorBoard's writer thread copies every record it writes (the CRC, the framing), so after
    each open-loop GIF (records of 0.2-0.7 MB that grow as the model trains) its heap keeps the freed copies
    resident, up to about twice the largest record so far: a creep of about 25 kB per GIF in the soak. With one
    arena the same memory is freed into the main heap, which `trim_host_memory` returns. A user's
    MALLOC_ARENA_MAX is left as it is; other C libraries (musl, macOS) are left alone.
    """
    libc = None if os.environ.get("MALLOC_ARENA_MAX") else _glibc()
    return libc is not None and bool(libc.mallopt(_M_ARENA_MAX, 1))


def process_rss_mb() -> float:
    """Resident set size of this process in MB (psutil; /proc/self/status VmRSS without it)."""
    if psutil is not None:
        return psutil.Process().memory_info().rss / MB
    kb = _proc_status_kb("VmRSS")
    if kb is None:
        raise RuntimeError(
            "cannot read process memory: psutil is not installed and /proc/self/status is unreadable"
        )
    return kb / 1024.0


def process_uss_mb() -> float:
    """Unique set size (memory freed if this process exited) in MB.

    psutil's `memory_full_info().uss`; without psutil, the private pages of /proc/self/smaps_rollup,
    or RssAnon from /proc/self/status when that is all the kernel offers.
    """
    if psutil is not None:
        try:
            return psutil.Process().memory_full_info().uss / MB
        except (psutil.AccessDenied, AttributeError):  # some platforms have no USS
            return process_rss_mb()
    kb = _proc_smaps_private_kb()
    if kb is None:
        kb = _proc_status_kb("RssAnon")
    if kb is None:
        return process_rss_mb()
    return kb / 1024.0


def process_anon_mb() -> float | None:
    """Resident anonymous memory in MB (RssAnon of /proc/self/status): the heap, arrays and tensors, where a
    leak lives. None where the system does not report it (not Linux).

    Unlike USS it ignores file-backed pages: USS counts a shared library's pages as this process's own only
    while no other process maps them, so a second torch process starting or ending beside this one moves USS
    by tens of MB (about 90 MB measured with torch on Linux) although nothing in this process changed.
    """
    kb = _proc_status_kb("RssAnon")
    return None if kb is None else kb / 1024.0


# ---------------------------------------------------------------------------------------------------------
# GPU memory
# ---------------------------------------------------------------------------------------------------------
def _cuda_ready() -> bool:
    try:
        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - a broken driver must not take training down
        return False


def gpu_memory_stats(device=None) -> dict:
    """CUDA allocator figures for `device` in MB (sizes) and counts; `{}` without CUDA. Never raises.

    Keys: alloc_mb, reserved_mb, max_alloc_mb, max_reserved_mb, active_mb, small_pool_active_mb,
    large_pool_active_mb, inactive_split_mb, active_blocks, num_alloc_retries, num_ooms, free_mb, total_mb.
    """
    if not _cuda_ready():
        return {}
    try:
        if device is not None and torch.device(device).type != "cuda":
            return {}
        stats = torch.cuda.memory_stats(device)
        out = {
            "alloc_mb": stats.get("allocated_bytes.all.current", 0) / MB,
            "reserved_mb": stats.get("reserved_bytes.all.current", 0) / MB,
            "max_alloc_mb": stats.get("allocated_bytes.all.peak", 0) / MB,
            "max_reserved_mb": stats.get("reserved_bytes.all.peak", 0) / MB,
            "active_mb": stats.get("active_bytes.all.current", 0) / MB,
            "small_pool_active_mb": stats.get("active_bytes.small_pool.current", 0) / MB,
            "large_pool_active_mb": stats.get("active_bytes.large_pool.current", 0) / MB,
            "inactive_split_mb": stats.get("inactive_split_bytes.all.current", 0) / MB,
            "active_blocks": float(stats.get("active.all.current", 0)),
            "num_alloc_retries": float(stats.get("num_alloc_retries", 0)),
            "num_ooms": float(stats.get("num_ooms", 0)),
        }
        free, total = torch.cuda.mem_get_info(device)
        out["free_mb"] = free / MB
        out["total_mb"] = total / MB
        return out
    except Exception as exc:  # noqa: BLE001 - diagnostics never break training
        _warn_once("gpu_memory_stats", f"reading CUDA memory stats failed ({exc}); GPU figures are left out")
        return {}


def memory_report(buffer_stats: dict | None = None, device=None, trim: bool = True) -> dict[str, float]:
    """The flat dict of memory figures logged every interval (keys defined at the top of this module).

    With `trim` (the default), garbage is collected and free heap pages are returned first
    (`trim_host_memory()`), so the host figures measure live memory, not the allocator's cache.

    Host keys always (`debug/cpu/anon_mb` where the system reports it: Linux); GPU keys when CUDA is
    available (and `device`, if given, is a CUDA device); `buffer/replay/*` keys when `buffer_stats`
    (total_steps, num_episodes, obs_bytes, aux_bytes; optionally obs_device_bytes) is given.
    Every value is a Python float, so logging it never keeps a tensor alive.
    """
    if buffer_stats is not None:
        _require(isinstance(buffer_stats, dict), "buffer_stats must be a dict or None")
        missing = [k for k in BUFFER_KEYS if k not in buffer_stats]
        _require(
            not missing, f"buffer_stats is missing {', '.join(missing)}; it needs {', '.join(BUFFER_KEYS)}"
        )
        for key in BUFFER_KEYS:
            _require(
                _is_number(buffer_stats[key]) and buffer_stats[key] >= 0,
                f"buffer_stats[{key!r}] must be a number >= 0, got {buffer_stats[key]!r}",
            )
    report: dict[str, float] = {}
    if trim:
        trim_host_memory()
    try:
        report[KEY_RSS_MB] = float(process_rss_mb())
        report[KEY_USS_MB] = float(process_uss_mb())
        anon = process_anon_mb()
        if anon is not None:
            report[KEY_ANON_MB] = float(anon)
        heap = heap_in_use_mb()
        if heap is not None:
            report[KEY_HEAP_IN_USE_MB] = float(heap)
    except Exception as exc:  # noqa: BLE001
        _warn_once("host_memory", f"reading host memory failed ({exc}); host figures are left out")
    gpu = gpu_memory_stats(device)
    for key, field in _GPU_KEY_FIELDS.items():
        if field in gpu:
            report[key] = float(gpu[field])
    if buffer_stats is not None:
        for field, key in BUFFER_KEYS.items():
            report[key] = float(buffer_stats[field])
        if "obs_device_bytes" in buffer_stats:
            report[BUFFER_DEVICE_KEY] = float(buffer_stats["obs_device_bytes"])
    return report


# ---------------------------------------------------------------------------------------------------------
# Leak detection
# ---------------------------------------------------------------------------------------------------------
# memory: not cached per window length (that cache grew as the detector's window filled, up to 73 kB a length)
def _pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    return np.triu_indices(n, k=1)


def robust_slope(steps: Sequence[float], values: Sequence[float]) -> float:
    """Theil-Sen slope (median of pairwise slopes): one spike or a GC pause does not move it."""
    x = np.asarray(steps, dtype=np.float64)
    y = np.asarray(values, dtype=np.float64)
    _require(x.shape == y.shape and x.ndim == 1, "steps and values must have the same length")
    i, j = _pairs(len(x))
    dx = x[j] - x[i]
    keep = dx != 0
    if not keep.any():
        return 0.0
    return float(np.median((y[j] - y[i])[keep] / dx[keep]))


@dataclasses.dataclass
class LeakVerdict:
    """What the LeakDetector concluded: `leaking` (growth suspected now), `abort` (suspected at `abort_after`
    checks in a row: what `--abort-on-leak` acts on), the `cause`, a plain-English `diagnosis`, the slopes."""

    leaking: bool
    # "none" | "warming_up" | "graph_retention" | "gpu_tensors" | "fragmentation" | "host_references"
    cause: str
    diagnosis: str
    slopes: dict[str, float]
    abort: bool = False

    def __str__(self) -> str:
        return self.diagnosis


# derived host metric: resident anonymous memory (USS where the system does not report it) minus what the
# replay buffer holds; this is what the detector judges host memory on
HOST_UNEXPLAINED_MB = "host_beyond_buffer_mb"

# How sure the detector must be (see `growth_evidence`); the corpus in tests/test_leak_detector.py holds it to
# its targets: no abort and at most 1 % suspected checks on steady memory, level shifts and released sawtooths,
# and a leak of 1 MB per 1k steps found within 20k steps of its start.
GROWTH_Z = 5.0  # slope over its standard error
# a window's slope must reach this share of the threshold: a leak just at the threshold is estimated below it half
# the time, and the significance test already keeps noise out
SLOPE_FRACTION = 0.5
STEP_RATIO = 0.8  # a straight line must fit better than the best single jump
STAIRCASE_RATIO = 1.2  # and not clearly worse than two jumps (a slow leak's ramp fits two about as well)
RELEASE_Z = 6.0  # a fall of this many noise units is a release: the memory was given back
# windows (samples) tried, shortest first: a fast leak shows in a short one
SCALES = (4, 6, 9, 12, 15, 18, 21, 24, 30, 36, 48)
RELEASE_GRACE = 32  # samples without a release after which a releasing series is judged like any other


def noise_scale(values) -> float:
    """The series' noise, robustly: from the median absolute deviation of its first differences, which a steady
    slope, a level shift or a release hardly moves."""
    diffs = np.diff(np.asarray(values, dtype=np.float64))
    if len(diffs) < 3:
        return 0.0
    return float(1.4826 * np.median(np.abs(diffs - np.median(diffs))) / math.sqrt(2.0))


def _two_cuts(n: int) -> tuple[np.ndarray, np.ndarray]:
    first, second = np.triu_indices(n - 1, k=1)
    return first + 1, second + 1  # 1 <= i < j <= n - 1


def _jumps_ss(y: np.ndarray, jumps: int) -> float:
    """The least squared error of a piecewise-constant fit to `y` with `jumps` (1 or 2) jumps, every placement
    tried at once through prefix sums."""
    n = len(y)
    s1 = np.concatenate([[0.0], np.cumsum(y)])
    s2 = np.concatenate([[0.0], np.cumsum(y * y)])

    def piece(a, b):  # squared error of y[a:b] around its mean
        return s2[b] - s2[a] - (s1[b] - s1[a]) ** 2 / (b - a)

    if jumps == 1:
        k = np.arange(1, n)
        return float(np.min(piece(0, k) + piece(k, n)))
    i, j = _two_cuts(n)
    return float(np.min(piece(0, i) + piece(i, j) + piece(j, n)))


def _window_growth(x: np.ndarray, y: np.ndarray, threshold: float, noise: float) -> tuple[bool, str]:
    """Sustained growth in one window: a significant slope above `threshold` (per unit of x), fitting as a
    straight line clearly better than as one jump (a level shift), with every third's median above the last."""
    n = len(x)
    dx, dy = x - x.mean(), y - y.mean()
    sxx = float(dx @ dx)
    if sxx <= 0:
        return False, "too_few"
    slope = float(dx @ dy) / sxx
    if slope <= SLOPE_FRACTION * threshold:
        return False, "steady"
    line_ss = float(((dy - slope * dx) ** 2).sum())
    sigma = max(noise, math.sqrt(line_ss / max(n - 2, 1)))
    if slope / (sigma / math.sqrt(sxx)) < GROWTH_Z:
        return False, "noise"
    # the best fit with one jump, and with two (a level shift, a staircase of two): each piece at its own level
    if line_ss > STEP_RATIO * _jumps_ss(y, 1) or (n >= 9 and line_ss > STAIRCASE_RATIO * _jumps_ss(y, 2)):
        return False, "level_shift"
    if n >= 6:
        # every third of the window above the one before, by more than the noise of a third's median
        thirds = np.array_split(y, 3)
        medians = [float(np.median(part)) for part in thirds]
        margin = 1.25 * noise * math.sqrt(2.0 / min(len(part) for part in thirds))
        if any(b - a <= margin for a, b in itertools.pairwise(medians)):
            return False, "level_shift"
    return True, "growth"


def growth_evidence(
    steps: Sequence[float],
    values: Sequence[float],
    threshold_per_1k: float,
    noise_floor: float = 0.01,
    scales: Sequence[int] = SCALES,
    judge_from: float = 0.0,
) -> tuple[bool, str, float]:
    """Is this memory series growing for good? Returns (growing, why, slope per 1k steps).

    Told apart, on the samples given (oldest first; growth is judged on those at `judge_from` steps or later, the
    earlier ones only show the noise and the releases):
    - sustained growth (a leak): in some recent window (`scales`, shortest first, so a fast leak is caught in
      a few samples and a slow one in more) the slope is above SLOPE_FRACTION of the threshold and GROWTH_Z standard
      errors above zero, a straight line fits better (by 1/STEP_RATIO) than one jump and not clearly worse than
      two (STAIRCASE_RATIO), and the median of
      every third of the window is above the one before by more than the noise;
    - a level shift (one jump up, then flat: the first evaluation, a checkpoint's buffers, a CUDA graph's pool),
      or two close together: one or two jumps fit as well as a line, or the thirds are not all rising;
    - a sawtooth (memory grows, then is given back): once a release (a fall of RELEASE_Z noise units) has been
      seen, growth is judged on the troughs after each release (a leak under a sawtooth raises them), until
      no release has come for 1.5 times the longest gap between releases (RELEASE_GRACE samples after a single
      one): then the part since the last release is judged like any other;
    - noise: the slope is not significant.
    The noise is `noise_scale` of the whole series, floored at `noise_floor`.
    """
    x = np.asarray(steps, dtype=np.float64) / 1000.0
    y = np.asarray(values, dtype=np.float64)
    noise = max(noise_scale(y), noise_floor)
    first = int(np.searchsorted(x, judge_from / 1000.0))
    release_at = (np.flatnonzero(np.diff(y) < -max(RELEASE_Z * noise, 2.0 * threshold_per_1k)) + 1).tolist()
    if release_at:
        gaps = np.diff(release_at)
        expected = 1.5 * (float(gaps.max()) if len(gaps) else RELEASE_GRACE)
        if len(y) - release_at[-1] <= expected:
            bounds = [0, *release_at, len(y)]
            troughs = [a + int(np.argmin(y[a:b])) for a, b in itertools.pairwise(bounds) if b > a]
            troughs = [i for i in troughs if i >= first]
            trough_x, trough_y = x[troughs], y[troughs]
            slope = robust_slope(trough_x, trough_y) if len(troughs) >= 2 else 0.0
            rising = len(troughs) >= 3 and bool(np.all(np.diff(trough_y) > 3 * noise))
            return (rising and slope > threshold_per_1k), "releases", slope
        first = max(first, release_at[-1])  # no release for long: judge the part since the last one
    x, y = x[first:], y[first:]
    sizes = [size for size in scales if size <= len(y)]
    if not sizes:
        return False, "too_few", robust_slope(x, y) if len(y) >= 2 else 0.0
    why = "steady"
    for size in sizes:
        grows, why = _window_growth(x[-size:], y[-size:], threshold_per_1k, noise)
        if grows:
            return True, why, robust_slope(x[-size:], y[-size:])
    return False, why, robust_slope(x[-sizes[-1] :], y[-sizes[-1] :])


class SampleWindow:
    """The last `size` (step, value) samples of one metric, in one array allocated with the first sample: the
    detector's own memory stays the same from then on (a deque of float pairs grew by about 130 bytes a sample and
    metric until it was full, 24k env steps into a run at a 250-step log interval, and a soak read that as the
    run's growth)."""

    def __init__(self, size: int):
        # memory: one array for the whole window, so the detector's own footprint never grows as it fills
        self.rows = np.zeros((size, 2))  # (step, value) per sample, a ring
        self.count = 0  # samples held
        self.next = 0  # the row the next sample goes to

    def __len__(self) -> int:
        return self.count

    def append(self, step: float, value: float) -> None:
        self.rows[self.next] = step, value
        self.next = (self.next + 1) % len(self.rows)
        self.count = min(self.count + 1, len(self.rows))

    def clear(self) -> None:
        self.count = self.next = 0

    @property
    def last_step(self) -> float:
        return float(self.rows[self.next - 1, 0])

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """(steps, values), oldest first: copies made for one check and freed after it."""
        ordered = np.roll(self.rows, -self.next, axis=0)[len(self.rows) - self.count :]
        return ordered[:, 0], ordered[:, 1]


class LeakDetector:
    """Watches memory over steps and names the likely cause when it grows for good.

    Feed it `observe(step, memory_report(...))` every log interval (or `add(metric, step, value)`). After
    `warmup_steps`, `check()` asks `growth_evidence` about each metric over its last `window` samples: sustained
    growth is told from noise, level shifts and sawtooths that give memory back. Host memory is judged after
    subtracting the replay buffer's bytes, so a buffer filling toward capacity is never mistaken for a leak, and
    on resident anonymous memory (`debug/cpu/anon_mb`) rather than USS, so another process starting or ending
    beside this one is not either (see `process_anon_mb`). USS is the basis only where anonymous memory is not
    reported. A verdict is `leaking` as soon as growth is suspected, and `abort` once it has been suspected at
    `abort_after` checks in a row (longer than a sawtooth's growing phase lasts, so `--abort-on-leak` never
    stops a run whose memory comes back).
    """

    def __init__(
        self,
        warmup_steps: int = 5_000,
        window: int = 96,
        threshold_mb_per_1k: float = 1.0,
        block_threshold_per_1k: float = 50.0,
        min_samples: int | None = None,
        abort_after: int = 30,
    ):
        min_samples = min(6, window) if min_samples is None and _is_int(window) else min_samples
        _require(
            _is_int(warmup_steps) and warmup_steps >= 0,
            f"warmup_steps must be an integer >= 0, got {warmup_steps!r}",
        )
        _require(_is_int(window) and window >= 3, f"window must be an integer >= 3, got {window!r}")
        _require(
            _is_number(threshold_mb_per_1k) and threshold_mb_per_1k > 0,
            f"threshold_mb_per_1k must be a positive number, got {threshold_mb_per_1k!r}",
        )
        _require(
            _is_number(block_threshold_per_1k) and block_threshold_per_1k > 0,
            f"block_threshold_per_1k must be a positive number, got {block_threshold_per_1k!r}",
        )
        _require(
            _is_int(min_samples) and 3 <= min_samples <= window,
            f"min_samples must be an integer in [3, window={window}], got {min_samples!r}",
        )
        _require(
            _is_int(abort_after) and abort_after >= 1,
            f"abort_after must be an integer >= 1, got {abort_after!r}",
        )
        self.warmup_steps = warmup_steps
        self.window = window
        self.threshold = float(threshold_mb_per_1k)
        self.block_threshold = float(block_threshold_per_1k)
        self.min_samples = min_samples
        self.scales = tuple(size for size in SCALES if size < window) + (window,)
        self.abort_after = abort_after
        self.samples: dict[str, SampleWindow] = {}  # warm-up samples show noise, releases
        self.suspected_in_a_row = 0

    def add(self, metric: str, step: int, value: float) -> None:
        _require(isinstance(metric, str) and metric, "metric must be a non-empty string")
        _require(_is_number(step) and step >= 0, f"step must be a number >= 0, got {step!r}")
        _require(_is_number(value), f"value for {metric} must be a finite number, got {value!r}")
        series = self.samples.get(metric)
        if series is None:
            series = self.samples[metric] = SampleWindow(self.window)
        if len(series) and step <= series.last_step:
            series.clear()  # the step counter went backwards (a resumed run): start the window again
        series.append(float(step), float(value))

    def observe(self, step: int, report: dict) -> None:
        """Record every known metric of a `memory_report()` dict, plus host memory minus buffer bytes."""
        _require(isinstance(report, dict), "report must be a dict from memory_report()")
        for key in CPU_KEYS + GPU_KEYS:
            if key in report:
                self.add(key, step, report[key])
        host = report.get(KEY_ANON_MB, report.get(KEY_USS_MB, report.get(KEY_RSS_MB)))
        if host is not None:
            buffer_mb = (
                report.get(BUFFER_KEYS["obs_bytes"], 0.0) + report.get(BUFFER_KEYS["aux_bytes"], 0.0)
            ) / MB
            self.add(HOST_UNEXPLAINED_MB, step, host - buffer_mb)

    JUDGED = (
        HOST_UNEXPLAINED_MB,
        KEY_GPU_ALLOC_MB,
        KEY_GPU_RESERVED_MB,
        KEY_GPU_SMALL_POOL_ACTIVE_MB,
        KEY_GPU_ACTIVE_BLOCKS,
    )  # what `check` decides on; the other metrics get a slope for the record

    def evidence(self) -> dict[str, tuple[bool, str, float]]:
        """(growing, why, slope per 1k steps) of every metric with enough samples after warm-up: from
        `growth_evidence` for the metrics `check` decides on, a robust slope over the recent samples for the rest."""
        out = {}
        for metric, series in self.samples.items():
            steps, values = series.arrays()
            judged = steps >= self.warmup_steps
            if judged.sum() < self.min_samples:
                continue
            if metric not in self.JUDGED:
                out[metric] = (
                    False,
                    "not judged",
                    1000.0 * robust_slope(steps[judged][-24:], values[judged][-24:]),
                )
                continue
            threshold = self.block_threshold if metric == KEY_GPU_ACTIVE_BLOCKS else self.threshold
            out[metric] = growth_evidence(
                steps,
                values,
                threshold,
                noise_floor=0.01 * threshold,
                scales=self.scales,
                judge_from=self.warmup_steps,
            )
        return out

    def slopes(self) -> dict[str, float]:
        """Slope per 1k steps of every metric with enough samples (robust, over the window that decided)."""
        return {metric: slope for metric, (_, _, slope) in self.evidence().items()}

    def check(self) -> LeakVerdict:
        evidence = self.evidence()
        s = {metric: slope for metric, (_, _, slope) in evidence.items()}
        if not s:
            self.suspected_in_a_row = 0
            return LeakVerdict(False, "warming_up", "leak check: not enough samples after warm-up yet", s)
        grows = lambda key: evidence.get(key, (False,))[0]
        small, blocks = s.get(KEY_GPU_SMALL_POOL_ACTIVE_MB, 0.0), s.get(KEY_GPU_ACTIVE_BLOCKS, 0.0)
        alloc, reserved = s.get(KEY_GPU_ALLOC_MB, 0.0), s.get(KEY_GPU_RESERVED_MB, 0.0)
        host = s.get(HOST_UNEXPLAINED_MB, 0.0)
        findings: list[tuple[str, str]] = []
        if grows(KEY_GPU_SMALL_POOL_ACTIVE_MB) and grows(KEY_GPU_ACTIVE_BLOCKS):
            findings.append(
                (
                    "graph_retention",
                    f"GPU small-pool active memory grows {small:.2f} MB and {blocks:.0f} active blocks per 1k steps: "
                    "autograd graphs are being kept alive. Usual causes: acting in the environment with autograd on "
                    "(wrap collection in torch.no_grad()) or a cached recurrent state that still has a grad_fn "
                    "(store it .detach()ed).",
                )
            )
        elif grows(KEY_GPU_ALLOC_MB):
            findings.append(
                (
                    "gpu_tensors",
                    f"GPU allocated memory grows {alloc:.2f} MB per 1k steps: tensors on the GPU are kept alive "
                    "(appended to a list, logged as tensors instead of .item() floats, or held by a cache).",
                )
            )
        if grows(KEY_GPU_RESERVED_MB) and not grows(KEY_GPU_ALLOC_MB):
            findings.append(
                (
                    "fragmentation",
                    f"GPU reserved memory grows {reserved:.2f} MB per 1k steps while allocated memory is flat "
                    f"({alloc:.2f} MB per 1k): the caching allocator is fragmenting. Set "
                    "PYTORCH_ALLOC_CONF=expandable_segments:True (configure_allocator() does this by default).",
                )
            )
        if grows(HOST_UNEXPLAINED_MB):
            findings.append(
                (
                    "host_references",
                    f"host memory beyond what the replay buffer holds grows {host:.2f} MB per 1k steps: something "
                    "on the host keeps references (views of evicted replay data, tensors or arrays kept in lists, "
                    "per-step logs that are never trimmed).",
                )
            )
        if not findings:
            self.suspected_in_a_row = 0
            parts = ", ".join(f"{k} {v:+.2f}" for k, v in sorted(s.items()))
            return LeakVerdict(False, "none", f"memory is steady (per 1k steps: {parts})", s)
        self.suspected_in_a_row += 1
        cause = findings[0][0]
        return LeakVerdict(
            True,
            cause,
            "memory leak suspected: " + " ".join(text for _, text in findings),
            s,
            abort=self.suspected_in_a_row >= self.abort_after,
        )


# ---------------------------------------------------------------------------------------------------------
# Allocator settings
# ---------------------------------------------------------------------------------------------------------
ALLOC_ENV_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
# Expandable segments and a garbage-collection threshold. torch 2.13 also parses max_split_size_mb, but with
# expandable segments on it makes reserved memory grow without bound under a mixed large/small allocation pattern
# (pytorch/pytorch#123548, still open), so it is only used where expandable segments are not available (native
# Windows).
DEFAULT_ALLOC_CONF = "expandable_segments:True,garbage_collection_threshold:0.7"
FALLBACK_ALLOC_CONF = "garbage_collection_threshold:0.7,max_split_size_mb:128"


def _validate_alloc_conf(conf: str) -> None:
    """Ask torch's own parser whether it accepts `conf` (raises ValueError with torch's message if not)."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is not None:
        setter(conf)


def configure_allocator(verbose: bool = True) -> str:
    """Put allocator defaults in force unless the user chose their own; return the setting in force.

    Must run before CUDA initialises (the caching allocator reads the variable once).
    A user's PYTORCH_ALLOC_CONF or PYTORCH_CUDA_ALLOC_CONF always wins.
    """
    for name in ALLOC_ENV_VARS:
        if os.environ.get(name):
            message = f"allocator: {name}={os.environ[name]} (your setting)"
            if verbose:
                print(message)
            return os.environ[name]
    conf = FALLBACK_ALLOC_CONF if sys.platform == "win32" else DEFAULT_ALLOC_CONF
    cuda_started = False
    with contextlib.suppress(Exception):
        cuda_started = torch.cuda.is_initialized()
    if cuda_started:
        _warn_once(
            "allocator_late",
            "CUDA was already initialised, so the allocator defaults could not be applied; "
            "call configure_allocator() before anything touches CUDA",
        )
        return ""
    try:
        _validate_alloc_conf(conf)
    except (ValueError, RuntimeError) as exc:
        _warn_once("allocator_rejected", f"this torch rejects {conf!r} ({exc}); keeping torch's defaults")
        return ""
    os.environ["PYTORCH_ALLOC_CONF"] = conf
    if verbose:
        print(f"allocator: PYTORCH_ALLOC_CONF={conf} (default; set PYTORCH_ALLOC_CONF to override)")
    return conf


# ---------------------------------------------------------------------------------------------------------
# Waiting for free GPU memory
# ---------------------------------------------------------------------------------------------------------
class NvmlUnavailable(RuntimeError):
    """NVML cannot report on the GPU: nvidia-ml-py missing, no NVIDIA driver, or no such device."""


def visible_gpu(index: int) -> str:
    """The `index`-th GPU this process may use, as CUDA numbers them: that entry of CUDA_VISIBLE_DEVICES (a
    device index or a GPU-/MIG- UUID) when it is set, else `index` itself (nvidia-smi's numbering)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return str(index)
    entries = [entry.strip() for entry in visible.split(",") if entry.strip()]
    if index >= len(entries):
        raise NvmlUnavailable(f"GPU {index} is not among CUDA_VISIBLE_DEVICES={visible!r}")
    return entries[index]


class NvmlProbe:
    """Free memory of one GPU as NVML reports it, the whole card with every process's share counted, without
    creating a CUDA context in this process (`torch.cuda.mem_get_info` creates one: a few hundred MB held on the
    very card being waited for, for as long as the process lives). `gpu` is an index among the GPUs this process
    may use (`visible_gpu`). `nvml` is the pynvml module (injectable for tests). Call it for the free MB."""

    def __init__(self, gpu: int = 0, nvml=None):
        if nvml is None:
            try:
                import pynvml as nvml
            except ImportError:
                raise NvmlUnavailable("nvidia-ml-py (NVML's Python binding) is not installed") from None
        self.nvml = nvml
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            raise NvmlUnavailable(f"NVML does not start ({exc}): no NVIDIA driver here?") from None
        try:
            self.entry = visible_gpu(gpu)
            if self.entry.startswith(("GPU-", "MIG-")):
                self.handle = nvml.nvmlDeviceGetHandleByUUID(self.entry)
            else:
                self.handle = nvml.nvmlDeviceGetHandleByIndex(int(self.entry))
            self.uuid = nvml.nvmlDeviceGetUUID(self.handle)
        except (nvml.NVMLError, ValueError, NvmlUnavailable) as exc:
            nvml.nvmlShutdown()
            raise NvmlUnavailable(f"NVML has no GPU {gpu} ({exc})") from None

    def __call__(self) -> float:
        return self.nvml.nvmlDeviceGetMemoryInfo(self.handle).free / MB

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.nvml.nvmlShutdown()


def _device_index(device) -> int:
    device = torch.device("cuda" if device is None else device)
    return 0 if device.index is None else device.index


def wait_for_gpu(
    min_free_mb: float,
    poll_s: float,
    timeout_s: float,
    device=None,
    probe: Callable[[], float] | None = None,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    verbose: bool = True,
) -> bool:
    """Poll until at least `min_free_mb` MB are free on the GPU; True if seen before `timeout_s`, else False.

    `probe()` returns the free MB; by default NVML's figure for `device` (`NvmlProbe`), which creates no CUDA
    context, so a process that waits holds nothing on the card it waits for. `sleep` and `clock` are injectable
    so the logic can be tested without a GPU and without waiting.
    """
    _require(
        _is_number(min_free_mb) and min_free_mb >= 0,
        f"min_free_mb must be a number >= 0, got {min_free_mb!r}",
    )
    _require(_is_number(poll_s) and poll_s > 0, f"poll_s must be a number > 0, got {poll_s!r}")
    _require(_is_number(timeout_s) and timeout_s >= 0, f"timeout_s must be a number >= 0, got {timeout_s!r}")
    nvml_probe = None
    if probe is None:
        try:
            probe = nvml_probe = NvmlProbe(_device_index(device))
        except NvmlUnavailable as exc:
            raise RuntimeError(f"wait_for_gpu reads free memory through NVML, and {exc}") from None
    try:
        return _poll_free_memory(min_free_mb, poll_s, timeout_s, probe, sleep, clock, verbose)
    finally:
        if nvml_probe is not None:
            nvml_probe.close()


def _poll_free_memory(min_free_mb, poll_s, timeout_s, probe, sleep, clock, verbose) -> bool:
    deadline = clock() + timeout_s
    polls = 0
    while True:
        free = float(probe())
        polls += 1
        if free >= min_free_mb:
            if verbose and polls > 1:
                print(f"wait: {free:.0f} MB free after {polls} polls (needed {min_free_mb:.0f} MB)")
            return True
        remaining = deadline - clock()
        if remaining <= 0:
            if verbose:
                print(
                    f"wait: timed out after {timeout_s:g} s with {free:.0f} MB free (needed {min_free_mb:.0f} MB)"
                )
            return False
        if verbose and polls == 1:
            print(
                f"wait: {free:.0f} MB free, need {min_free_mb:.0f} MB; polling every {poll_s:g} s "
                f"for up to {timeout_s:g} s"
            )
        sleep(min(poll_s, remaining))


# ---------------------------------------------------------------------------------------------------------
# A cap on GPU memory (--gpu-memory-gb): a share of a card, or a rehearsal of a smaller one
# ---------------------------------------------------------------------------------------------------------
GIB = 1024.0**3
# What a process holds on its GPU outside torch's allocator, which `torch.cuda.set_per_process_memory_fraction` does
# not count: the CUDA context (the driver's state and the kernels' code, loaded as they are first used since CUDA
# 11.7) and the cuBLAS and cuDNN handles' own memory, about 0.3-0.5 GiB with torch on current drivers. A cap leaves
# this much of what it names to them, so that `--gpu-memory-gb 6` gives torch's allocator what a 6 GB card would.
CUDA_CONTEXT_GIB = 0.5


@dataclasses.dataclass(frozen=True)
class GpuCap:
    """A process's share of one GPU: `gib` GiB in all (`flag`, as the user gave it), of which the CUDA context keeps
    CUDA_CONTEXT_GIB and torch's allocator may reserve the rest, `allocator_bytes`."""

    gib: float
    flag: str = "--gpu-memory-gb"

    @property
    def allocator_bytes(self) -> int:
        return int((self.gib - CUDA_CONTEXT_GIB) * GIB)

    def fraction(self, card_bytes: int) -> float:
        """The share of a card of `card_bytes` that `torch.cuda.set_per_process_memory_fraction` takes."""
        return self.allocator_bytes / card_bytes


def gpu_cap_problem(gib: float, card_bytes: int | None, flag: str = "--gpu-memory-gb") -> str | None:
    """One sentence when `gib` cannot cap a run's GPU memory (not more than the CUDA context's share, or more than the
    card's `card_bytes` where that is known); None when it can."""
    if not (_is_number(gib) and math.isfinite(gib) and gib > CUDA_CONTEXT_GIB):
        return (
            f"{flag} must be a number of GiB greater than {CUDA_CONTEXT_GIB:g} (the CUDA context alone takes about "
            f"that much), got {gib!r}."
        )
    if card_bytes is not None and gib * GIB > card_bytes:
        return f"{flag} {gib:g} is more than this GPU has ({card_bytes / GIB:.2f} GiB); give at most that."
    return None


def gpu_card_bytes(device=None) -> int | None:
    """The GPU's memory in bytes: NVML's figure, which makes no CUDA context (a process waiting for memory must not
    hold any), else torch's where CUDA is available; None without a GPU."""
    try:
        probe = NvmlProbe(_device_index(device))
    except NvmlUnavailable:
        if not _cuda_ready():
            return None
        return int(torch.cuda.get_device_properties(_device_index(device)).total_memory)
    try:
        return int(probe.nvml.nvmlDeviceGetMemoryInfo(probe.handle).total)
    finally:
        probe.close()


def apply_gpu_cap(cap: GpuCap, device) -> float:
    """Cap torch's allocator on `device` at `cap.allocator_bytes` (this makes the CUDA context: call it once the
    process may hold memory on the card). Returns the fraction of the card set."""
    card = torch.cuda.mem_get_info(device)[1]
    fraction = min(1.0, cap.fraction(card))
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction


def gpu_headroom_bytes(device, cap: GpuCap | None = None) -> int:
    """Bytes this process may still reserve on `device`: the card's free memory, and under a cap no more than the
    cap's allocator share less what torch's allocator holds already."""
    free = torch.cuda.mem_get_info(device)[0]
    if cap is None:
        return free
    return max(0, min(free, cap.allocator_bytes - torch.cuda.memory_reserved(device)))


def gpu_fit_problem(
    cap: GpuCap, parts: Sequence[tuple[str, float, str]], held_bytes: float = 0.0
) -> str | None:
    """The first of `parts` that does not fit under the cap, in one sentence; None when all do.

    `parts` are (what, bytes, what would fit instead), in the order the run places them on the GPU, after
    `held_bytes` already held by torch's allocator (0 before anything is built). A part fits when it and all the
    parts before it fit in the cap's allocator share."""
    used, before = float(held_bytes), []
    for what, nbytes, instead in parts:
        if used + nbytes > cap.allocator_bytes:
            after = f"the CUDA context ({CUDA_CONTEXT_GIB:g} GiB)"
            if held_bytes:
                after += f", what is held already ({held_bytes / GIB:.2f} GiB)"
            after += "".join(f", {name} ({size / GIB:.2f} GiB)" for name, size in before)
            return (
                f"{cap.flag} {cap.gib:g} is too small for this run: {what} ({nbytes / GIB:.2f} GiB) do not fit in "
                f"the {max(0.0, cap.allocator_bytes - used) / GIB:.2f} GiB it leaves after {after}; {instead}."
            )
        used += nbytes
        before.append((what, nbytes))
    return None


# ---------------------------------------------------------------------------------------------------------
# Optimizer-state preallocation
# ---------------------------------------------------------------------------------------------------------
# How each state entry of torch.optim's optimizers starts when the first step creates it: zero unless listed in
# _FRESH_STATE (value from the entry's param group). An entry this table does not know is refused, not guessed.
_ZERO_STATE = {
    "step",
    "exp_avg",
    "exp_avg_sq",
    "max_exp_avg_sq",
    "exp_inf",
    "square_avg",
    "acc_delta",
    "momentum_buffer",
    "grad_avg",
    "prev",
    "ax",
    "row_var",
    "col_var",
    "variance",
}
_FRESH_STATE = {
    "mu_product": lambda group: 1.0,  # NAdam
    "step_size": lambda group: group["lr"],  # Rprop
    "eta": lambda group: group["lr"],  # ASGD
    "mu": lambda group: 1.0,  # ASGD
}
_NO_PREALLOCATION = {
    "LBFGS": "LBFGS steps with a closure that re-evaluates the loss, several times per step",
    "SparseAdam": "SparseAdam takes sparse gradients only",
}


def _fresh_value(optimizer: torch.optim.Optimizer, group: dict, key: str, value):
    """What `value`, a state entry the first step created, would hold in a fresh optimizer; None: no entry."""
    if key == "momentum_buffer" and isinstance(optimizer, torch.optim.SGD) and group.get("dampening", 0) != 0:
        return None  # SGD starts its buffer as a copy of the first gradient: only "absent" is exact with dampening
    if key in _FRESH_STATE:
        return _FRESH_STATE[key](group)
    if key in _ZERO_STATE:
        return 0
    raise ValueError(
        f"preallocate_optimizer_state does not know how {type(optimizer).__name__}'s state entry "
        f"{key!r} starts, so it cannot undo the step exactly; preallocate without it"
    )


def preallocate_optimizer_state(
    step_fn: Callable[[], Any],
    optimizer,
    params: Iterable[torch.Tensor] | None = None,
    modules: Iterable[torch.nn.Module] = (),
) -> float:
    """Materialise optimizer state (Adam moments etc.) now, with a worst-case step, and change nothing.

    `step_fn()` runs one worst-case forward and backward (it calls `.backward()` itself). This function then
    calls `optimizer.step()` once, so every lazily created state tensor exists and the peak memory of a real step
    has been reached (fail fast, before hours of training, instead of at the first update on a contended GPU).
    Afterwards everything is as a fresh start would have it: parameters and gradients as they were, each state
    entry the step created at the value a fresh optimizer gives it (zero moments and counters, NAdam's
    mu_product 1, Rprop's step sizes and ASGD's eta at the learning rate; SGD's momentum buffer removed where
    dampening would make a zero buffer differ), state that existed before (Adagrad's sums, a resumed run's
    moments) exactly as it was, the buffers of `modules` (BatchNorm's running statistics: pass the modules whose
    forward changes buffers) and torch's RNG state. Training is then bit-identical to not calling it (tested for
    every optimizer in torch.optim). LBFGS and SparseAdam are refused, and so is a step that creates no state
    (a `step_fn` that never calls backward, or SGD without momentum: nothing to preallocate).
    Returns the peak MB of that step: the GPU peak on CUDA, the host RSS increase on CPU.
    """
    _require(callable(step_fn), "step_fn must be callable (one forward + backward)")
    optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    _require(
        optimizers and all(isinstance(o, torch.optim.Optimizer) for o in optimizers),
        "optimizer must be a torch.optim.Optimizer or a non-empty list of them",
    )
    for o in optimizers:
        _require(
            type(o).__name__ not in _NO_PREALLOCATION,
            f"cannot preallocate for {type(o).__name__}: {_NO_PREALLOCATION.get(type(o).__name__)}",
        )
    if params is None:
        params = [p for o in optimizers for g in o.param_groups for p in g["params"]]
    params = list(params)
    _require(
        params and all(isinstance(p, torch.Tensor) for p in params),
        "params must be a non-empty list of tensors",
    )
    modules = list(modules)
    _require(all(isinstance(m, torch.nn.Module) for m in modules), "modules must be torch.nn.Module objects")

    devices = {p.device for p in params}
    on_cuda = any(d.type == "cuda" for d in devices)
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if on_cuda else None
    saved = [p.detach().clone() for p in params]
    saved_grads = [None if p.grad is None else p.grad.detach().clone() for p in params]
    saved_buffers = [(b, b.detach().clone()) for m in modules for b in m.buffers()]
    saved_state = [
        {
            p: {k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in st.items()}
            for p, st in o.state.items()
        }
        for o in optimizers
    ]

    def restore_model() -> None:
        with torch.no_grad():
            for p, value, grad in zip(params, saved, saved_grads):
                p.copy_(value)
                p.grad = grad
            for buffer, value in saved_buffers:
                buffer.copy_(value)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)

    def restore_state(o, before: dict) -> None:
        """The state entries that existed before, as they were; the others as a fresh optimizer starts them."""
        group_of = {p: g for g in o.param_groups for p in g["params"]}
        for p, state in list(o.state.items()):
            for key, value in list(state.items()):
                if p in before and key in before[p]:
                    old = before[p][key]
                    if isinstance(value, torch.Tensor) and isinstance(old, torch.Tensor):
                        with torch.no_grad():
                            value.copy_(old)
                    else:
                        state[key] = old
                    continue
                fresh = _fresh_value(o, group_of[p], key, value)
                if fresh is None:
                    del state[key]
                elif isinstance(value, torch.Tensor):
                    with torch.no_grad():
                        value.fill_(fresh)
                else:
                    state[key] = type(value)(fresh)
            if not state and p not in before:
                del o.state[p]

    rss_before = process_rss_mb()
    if on_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    for o in optimizers:
        o.zero_grad(set_to_none=True)
    try:
        step_fn()
        got_gradients = any(p.grad is not None for p in params)
        for o in optimizers:
            o.step()
    except BaseException:
        # an OOM (the very thing this is for) may come after some state or some weights changed: undo all of it,
        # so that a caller can retry (a smaller batch, after waiting) from the model as it was
        restore_model()
        for o, before in zip(optimizers, saved_state):
            o.state.clear()
            o.state.update(before)
        raise
    if on_cuda:
        torch.cuda.synchronize()
        peak_mb = (torch.cuda.max_memory_allocated() - base) / MB
    else:
        peak_mb = max(0.0, process_rss_mb() - rss_before)
    created = sum(len(st) for o in optimizers for st in o.state.values()) - sum(
        len(st) for before in saved_state for st in before.values()
    )
    restore_model()
    try:
        for o, before in zip(optimizers, saved_state):
            restore_state(o, before)
    except ValueError:
        for o, before in zip(optimizers, saved_state):
            o.state.clear()
            o.state.update(before)
        raise
    _require(
        got_gradients, "step_fn gave these parameters no gradients: it must call backward on a loss of them"
    )
    _require(
        created > 0 or any(saved_state),
        "the preallocation step created no optimizer state (SGD without "
        "momentum keeps none): there is nothing to preallocate",
    )
    return float(peak_mb)


# ---------------------------------------------------------------------------------------------------------
# Mixed precision
# ---------------------------------------------------------------------------------------------------------
AMP_MODES = ("auto", "off", "fp16", "bf16")


@dataclasses.dataclass
class AmpSetup:
    """Autocast and loss scaling for one device: `with setup.autocast(): ...`; `setup.scaler` for fp16."""

    mode: str
    device_type: str
    dtype: torch.dtype | None
    scaler: torch.amp.GradScaler

    @property
    def enabled(self) -> bool:
        return self.dtype is not None

    def new_scaler(self) -> torch.amp.GradScaler:
        """Another scaler set up like `scaler`: give each optimizer its own, so that an overflow in one loss shrinks
        that loss's scale alone, and each scale grows at the rate its `update()` calls set."""
        return torch.amp.GradScaler(
            "cuda" if self.device_type == "cuda" else "cpu", enabled=self.scaler.is_enabled()
        )

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.dtype)


def _device_type(device) -> str:
    try:
        return torch.device(device).type
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(
            f"device must be a torch.device or a device name such as 'cpu' or 'cuda:0', got {device!r}"
        ) from None


def amp(mode: str, device) -> AmpSetup:
    """Resolve `mode` (auto/off/fp16/bf16) for `device` into an autocast factory and a GradScaler.

    auto = fp16 on CUDA, off elsewhere. The scaler is enabled only for fp16 on CUDA (bf16 keeps fp32's
    exponent range and needs none); a disabled scaler passes scale/step/update straight through.
    fp16 without CUDA is refused (CPU fp16 autocast is slow and has no scaler).
    """
    _require(mode in AMP_MODES, f"amp mode must be one of {', '.join(AMP_MODES)}, got {mode!r}")
    device_type = _device_type(device)
    if mode == "auto":
        mode = "fp16" if device_type == "cuda" else "off"
    if mode == "fp16" and device_type != "cuda":
        raise ValueError(f"amp mode fp16 needs a CUDA device, got {device_type}; use bf16 or off")
    dtype = {"off": None, "fp16": torch.float16, "bf16": torch.bfloat16}[mode]
    scaler_device = "cuda" if device_type == "cuda" else "cpu"
    scaler = torch.amp.GradScaler(scaler_device, enabled=(mode == "fp16"))
    return AmpSetup(mode=mode, device_type=device_type, dtype=dtype, scaler=scaler)


def step_if_healthy(optimizer: torch.optim.Optimizer, healthy: torch.Tensor) -> None:
    """`optimizer.step()`, skipped on the device where `healthy` (a 0-d bool tensor) is False: the weights and the
    moments stay as they were, with no host sync (a captured update may call it). A fused optimizer (Adam's
    `fused=True`) reads `found_inf` as `torch.amp.GradScaler` sets it; any other optimizer would need the flag on
    the host, and is refused."""
    _require(
        bool(optimizer.defaults.get("fused")),
        f"step_if_healthy needs a fused optimizer (fused=True), got {type(optimizer).__name__} without it",
    )
    optimizer.grad_scale, optimizer.found_inf = None, (~healthy).float()
    try:
        optimizer.step()
    finally:
        del optimizer.grad_scale, optimizer.found_inf


# ---------------------------------------------------------------------------------------------------------
# Progress: a status line by time as well as by steps
# ---------------------------------------------------------------------------------------------------------
STATUS_EVERY_S = 30.0  # a run says it is alive at least this often, however slow its steps are
KEY_STATUS_SPS = "status/env_steps_per_second"
KEY_STATUS_UPDATES_PER_S = "status/updates_per_second"
KEY_STATUS_ETA_S = "status/eta_seconds"
KEY_STATUS_RETURN = "status/episodic_return"
STATUS_KEY_PREFIX = "status/"  # and the loss the script names: status/world_model_loss, status/td_loss


def duration_text(seconds: float) -> str:
    """A duration as a person says it: '45 s', '12 min', '2.4 h', '3.1 days'."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    if seconds < 36 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


class StatusLine:
    """One line every `every_s` seconds of wall time (however long an env step or an update takes), printed and
    written to TensorBoard under `status/*` at the step it was said: the step, env steps/s, updates/s, the ETA of
    the run's end, the last episode's return and the script's loss. Both training scripts say it alike.

    `tick(step, updates)` is cheap (one clock read): call it every loop iteration; when it returns True, `emit`
    the line, and only then read what costs a host transfer (a loss summed on the device). Rates are taken over
    the last `window` lines within the current phase (a phase starts at each of `phase_starts`, such as the end of
    a random prefill, whose fast steps say nothing of the training rate), and the ETA from them; during the first
    phase of a run that has phases there is no training rate yet, and the ETA says so. A line due just as a phase
    begins gives the rates since the previous line, and no ETA. A line comes at the first tick `every_s` after the
    last; while one loop iteration outlasts that (an update on a slow machine), `keep_alive`'s thread says how long
    the loop has been busy instead. `clock` (a class attribute, seconds) is what a test replaces with a fake one.
    """

    clock = staticmethod(time.monotonic)

    def __init__(
        self,
        writer=None,
        loss_name: str = "loss",
        every_s: float = STATUS_EVERY_S,
        phase_starts: Iterable[int] = (),
        window: int = 4,
        say: Callable[[str], None] = print,
    ):
        _require(every_s > 0, f"every_s must be positive, got {every_s!r}")
        _require(window >= 1, f"window must be at least 1, got {window!r}")
        self.writer, self.loss_name, self.every_s, self.say = writer, loss_name, every_s, say
        self.phase_starts = sorted(set(phase_starts))
        # (time, step, updates) of the window's points, oldest first
        self.points: deque[tuple[float, int, int]] = deque(maxlen=window)
        self.phase = -1
        self.now = 0.0
        self.started: float | None = None  # the first tick's time
        # (time, step, updates) of the last line (or the first tick), and of the last tick
        self.last_line: tuple[float, int, int] | None = None
        self.last_tick: tuple[float, int, int] | None = None
        self.last_busy = -math.inf  # when `busy_line` last said something

    def tick(self, step: int, updates: int) -> bool:
        """Whether a line is due now; a new phase starts its rates from here."""
        self.now = self.clock()
        self.last_tick = (self.now, step, updates)
        if self.started is None:
            self.started, self.last_line = self.now, self.last_tick
        phase = sum(step >= start for start in self.phase_starts)
        if phase != self.phase:
            self.phase = phase
            self.points.clear()
            self.points.append((self.now, step, updates))
        return self.now - self.last_line[0] >= self.every_s

    def busy_line(self) -> str | None:
        """The line to say when one loop iteration has run for `every_s` / 6 or more (an update on a slow machine, a
        checkpoint) and nothing was said for `every_s`: where the loop is and how long it has been busy, from the last
        tick alone (no device read), so that another thread can say it (`keep_alive`). None when nothing is due."""
        if self.last_tick is None:
            return None
        now = self.clock()
        then, step, updates = self.last_tick
        if now - then < self.every_s / 6 or now - max(self.last_line[0], self.last_busy) < self.every_s:
            return None
        self.last_busy = now
        return (
            f"status: step {step:,}  busy for {duration_text(now - then)} in one loop iteration (an update, a "
            f"checkpoint); updates so far: {updates:,}"
        )

    @contextlib.contextmanager
    def keep_alive(self, poll_s: float = 1.0):
        """While inside, a thread says `busy_line` when one is due (polled every `poll_s`), so that a line comes at
        least every `every_s` + `poll_s` also while one iteration outlasts the interval; it stops on the way out."""
        stop = threading.Event()

        def watch() -> None:
            while not stop.wait(poll_s):
                try:
                    if (line := self.busy_line()) is not None:
                        self.say(line)
                except Exception:  # noqa: BLE001 - memory: diagnostics never break training
                    return

        thread = threading.Thread(target=watch, name="status-line", daemon=True)
        thread.start()
        try:
            yield thread
        finally:
            stop.set()
            thread.join()

    def elapsed_s(self) -> float:
        """Seconds since the first tick, at the last tick."""
        return 0.0 if self.started is None else self.now - self.started

    def rates(self, step: int, updates: int, since: tuple[float, int, int]) -> tuple[float, float] | None:
        """(env steps/s, updates/s) from `since` (time, step, updates) to the last tick; None if no time passed."""
        then, first_step, first_updates = since
        seconds = self.now - then
        if seconds <= 0:
            return None
        return (step - first_step) / seconds, (updates - first_updates) / seconds

    def emit(
        self,
        step: int,
        updates: int,
        remaining_steps: float | None,
        last_return: float | None = None,
        loss: float | None = None,
        progress: str | None = None,
        time_left_s: float | None = None,
    ) -> str:
        """Say the line and write its scalars (those that are known) at `step`; returns the line. `remaining_steps`:
        env steps to the run's end (None: not known yet); `time_left_s`: seconds to a time limit, which caps the ETA;
        `progress`: how far the run is, in its own words (default: the step)."""
        window = self.rates(step, updates, self.points[0])  # within the phase
        rates = window or self.rates(
            step, updates, self.last_line
        )  # a phase that begins now: since the last line
        sps, ups = rates if rates is not None else (None, None)
        in_prefill = bool(self.phase_starts) and self.phase == 0
        eta_s = None
        if not in_prefill and window and window[0] > 0 and remaining_steps is not None:
            eta_s = max(0.0, remaining_steps) / window[0]
        if time_left_s is not None:
            eta_s = max(0.0, time_left_s) if eta_s is None else min(eta_s, max(0.0, time_left_s))
        eta = duration_text(eta_s) if eta_s is not None else ("-- (prefill)" if in_prefill else "--")
        parts = [
            progress if progress is not None else f"step {step:,}",
            "-- env steps/s" if sps is None else f"{sps:.3g} env steps/s",
            "-- updates/s" if ups is None else f"{ups:.3g} updates/s",
            f"ETA {eta}",
            f"return {'--' if last_return is None else f'{last_return:g}'}",
            f"{self.loss_name} {'--' if loss is None else f'{loss:.4g}'}",
        ]
        line = "status: " + "  ".join(parts)
        self.say(line)
        scalars = {
            KEY_STATUS_SPS: sps,
            KEY_STATUS_UPDATES_PER_S: ups,
            KEY_STATUS_ETA_S: eta_s,
            KEY_STATUS_RETURN: last_return,
            STATUS_KEY_PREFIX + self.loss_name: loss,
        }
        if self.writer is not None:
            for key, value in scalars.items():
                if value is not None:
                    self.writer.add_scalar(key, float(value), step)
        self.points.append((self.now, step, updates))
        self.last_line = (self.now, step, updates)
        return line


class UpdateLog:
    """What the updates log, summed on the device between two log points and read with one host transfer per log
    interval, so that no update waits for the host. The values of an update whose step was skipped (a non-finite
    loss or gradient) are left out of the means; such updates are counted, with the longest run of them in a row,
    and so is each value that was not finite (which names the source: a loss term, a network's gradient).
    """

    def __init__(self, device):
        self.device = torch.device(device)
        # keys -> (2 len(keys) + 1,): value sums, then the count of healthy updates, then each value's non-finite count
        self.sums: dict[tuple[str, ...], torch.Tensor] = {}
        self.streak = torch.zeros((), device=self.device)  # non-finite updates in a row, now
        self.longest = torch.zeros((), device=self.device)  # the longest such run since the last `pop`
        self.skipped = torch.zeros((), device=self.device)  # non-finite updates since the last `pop`
        self.seen: dict[str, torch.Tensor] = {}  # key -> (2,): its sum and count at the last `recent`

    def add(self, metrics: dict[str, torch.Tensor], healthy: torch.Tensor) -> None:
        """The named 0-d values of one part of an update, and whether that part was healthy (0-d bool)."""
        keys = tuple(metrics)
        # memory: only detached values are summed, so no update's graph stays alive until the log point
        values = torch.stack([value.detach() for value in metrics.values()])
        healthy = healthy.detach()
        row = torch.cat(
            [torch.where(healthy, values, 0.0), healthy.float().reshape(1), (~values.isfinite()).float()]
        )
        if keys in self.sums:
            self.sums[keys] += row
        else:
            self.sums[keys] = row

    def end_update(self, healthy: torch.Tensor) -> None:
        """Once per update, with whether all of its parts were healthy."""
        faulty = ~healthy.detach()
        self.streak.add_(1.0).mul_(faulty)
        torch.maximum(self.longest, self.streak, out=self.longest)
        self.skipped.add_(faulty)

    def pop(self) -> tuple[dict[str, float], int, int, dict[str, int]]:
        """(means of each key over its healthy updates, updates skipped, longest run of skipped updates in a row, how
        often each key that was ever non-finite was), since the last call; then starts again (a run still going on
        carries over)."""
        groups = list(self.sums.items())
        flat = torch.cat(
            [row for _, row in groups] + [self.skipped.reshape(1), self.longest.reshape(1)]
        ).tolist()
        means, nonfinite, offset = {}, {}, 0
        for keys, _ in groups:
            count = flat[offset + len(keys)]
            if count > 0:
                means.update({key: flat[offset + i] / count for i, key in enumerate(keys)})
            bad = flat[offset + len(keys) + 1 : offset + 2 * len(keys) + 1]
            nonfinite.update({key: int(n) for key, n in zip(keys, bad) if n > 0})
            offset += 2 * len(keys) + 1
        self.sums, self.seen = {}, {}
        self.skipped.zero_()
        self.longest.copy_(self.streak)
        return means, int(flat[-2]), int(flat[-1]), nonfinite

    def recent(self, key: str) -> float | None:
        """The mean of `key` over the healthy updates since the last call (or the last `pop`), for the status line:
        one host transfer, every 30 s, never per update. The sums go on to `pop` as they are. None when no healthy
        update logged it since."""
        for keys, row in self.sums.items():
            if key in keys:
                now = row[[keys.index(key), len(keys)]]  # (2,): the sum and the count (a copy)
                since = now - self.seen[key] if key in self.seen else now
                self.seen[key] = now
                total, count = since.tolist()
                return total / count if count > 0 else None
        return None

    def state(self) -> dict:
        """The sums since the last log point as plain numbers, for a checkpoint: a run resumed from it logs the
        interval it stopped in with the updates made before the stop, as an uninterrupted run would."""
        return {
            "sums": {"|".join(keys): row.tolist() for keys, row in self.sums.items()},
            **{name: float(getattr(self, name)) for name in ("streak", "longest", "skipped")},
        }

    def restore(self, state: dict) -> None:
        self.seen = {}
        self.sums = {}
        for keys, row in state["sums"].items():
            keys = tuple(keys.split("|"))
            # a checkpoint from before the non-finite counts has fewer columns
            padded = row + [0.0] * (2 * len(keys) + 1 - len(row))
            self.sums[keys] = torch.tensor(padded, device=self.device)
        for name in ("streak", "longest", "skipped"):
            getattr(self, name).fill_(state[name])


class ProgressLine:
    """step, SPS, last return, RSS, GPU alloc, ETA. On a terminal the line is rewritten about once a second;
    in a log file it is printed once per log interval.

    The ETA comes from the recent rate, not the average since the start: random prefill steps cost nothing
    next to training steps, so an average that includes them promises a day-long run in minutes. The rate is
    taken over the last `window` log points within the current phase (a phase starts where updates start and
    where behaviour learning starts); during the prefill there is no training rate yet, and the ETA says so.
    """

    def __init__(self, total: int, device: torch.device, phase_starts: tuple[int, ...] = (), window: int = 5):
        self.total, self.device = total, device
        self.phase_starts = sorted(set(phase_starts))
        self.updates_start = self.phase_starts[0] if self.phase_starts else 0
        self.points: deque[tuple[float, int]] = deque(maxlen=window + 1)  # (time, step) of the current phase
        self.phase = -1
        self.live = sys.stdout.isatty()
        self.last_refresh = 0.0
        self.pending = False  # a live line without its newline is on screen

    def mark(self, step: int, now: float | None = None) -> None:
        """Record (time, step); call at every log point. A new phase forgets the previous phase's points."""
        now = time.time() if now is None else now
        phase = sum(step >= start for start in self.phase_starts)
        if phase != self.phase:
            self.phase = phase
            self.points.clear()
        self.points.append((now, step))

    def eta_s(self, step: int, now: float | None = None) -> float | None:
        """Seconds left at the recent rate; None during the prefill or before the phase has a measured rate."""
        now = time.time() if now is None else now
        if step < self.updates_start or not self.points:
            return None
        first_time, first_step = self.points[0]
        if step <= first_step or now - first_time < 1e-6:
            return None
        return (self.total - step) * (now - first_time) / (step - first_step)

    def text(
        self,
        step: int,
        sps: float,
        last_return: float | None,
        rss_mb: float,
        gpu_mb: float | None,
        now: float | None = None,
    ) -> str:
        eta_s = self.eta_s(step, now)
        if eta_s is not None:
            eta = f"{int(eta_s // 3600)}:{time.strftime('%M:%S', time.gmtime(eta_s))}"
        else:
            eta = "-- (prefill)" if step < self.updates_start else "--"
        ret = "--" if last_return is None else f"{last_return:.1f}"
        gpu = "--" if gpu_mb is None else f"{gpu_mb:.0f} MB"
        return (
            f"step {step}/{self.total}  SPS {sps:.0f}  return {ret}  RSS {rss_mb:.0f} MB  "
            f"GPU alloc {gpu}  ETA {eta}"
        )

    def refresh(self, step: int, sps: float, last_return: float | None) -> None:
        """Cheap enough to call every loop iteration: does something at most once a second, on a terminal."""
        now = time.time()
        if not self.live or now - self.last_refresh < 1.0:
            return
        self.last_refresh = now
        gpu = torch.cuda.memory_allocated(self.device) / 2**20 if self.device.type == "cuda" else None
        print("\r" + self.text(step, sps, last_return, process_rss_mb(), gpu), end="", flush=True)
        self.pending = True

    def line(self, step: int, sps: float, last_return: float | None, report: dict) -> None:
        self.say(self.text(step, sps, last_return, report.get(KEY_RSS_MB, 0.0), report.get(KEY_GPU_ALLOC_MB)))

    def say(self, message: str) -> None:
        """Print a whole line without mangling a live line that is on screen."""
        print(("\r\033[K" if self.pending else "") + message, flush=True)
        self.pending = False


def nonfinite_modules(modules: dict[str, torch.nn.Module]) -> list[str]:
    """The names of the modules with a weight or a floating buffer (a running statistic) that is not finite, read
    with one host sync; [] when all are: what a script checks before it writes a checkpoint, a results row or an
    evaluation from its weights."""
    finite = []
    for module in modules.values():
        tensors = [t for t in itertools.chain(module.parameters(), module.buffers()) if t.is_floating_point()]
        finite.append(
            torch.stack([t.isfinite().all() for t in tensors]).all() if tensors else torch.tensor(True)
        )
    return [name for name, ok in zip(modules, torch.stack([f.cpu() for f in finite]).tolist()) if not ok]


# ---------------------------------------------------------------------------------------------------------
# Forensics: stage probes
# ---------------------------------------------------------------------------------------------------------
class StageProbes:
    """Memory at fixed points of the training loop, to name the stage that ratchets memory up.

    Call `probes(stage)` at each stage (GPU allocated MB on CUDA, resident anonymous MB on CPU) and
    `end_iteration(step)` once per loop iteration. Two things come out: the slope of the loop-start baseline over
    steps (is memory ratcheting at all?), and, per stage, the memory it adds that is never given back before the
    next loop start (which stage does it?). Transient activations that the backward pass frees count as zero.
    On CPU the figure is RssAnon (USS where the system has no such figure): unlike USS, it does not move when
    another torch process maps or unmaps the same libraries, as a second seed or a test beside this one does. It
    follows the allocator's pages, so glibc's moving mmap threshold can shift a few MB between neighbouring
    stages (MALLOC_MMAP_THRESHOLD_=131072 pins it). On CUDA it is exact.
    """

    STAGES = (
        "loop_start",
        "after_collect",
        "after_sample",
        "after_encoder",
        "after_rssm",
        "after_decoder",
        "after_backward",
        "after_optimizer_step",
    )
    SLOPE_KEY = PROBE_KEY_PREFIX + "baseline_slope_mb_per_1k"

    def __init__(self, enabled: bool, device="cpu", window: int = 50):
        _require(_is_int(window) and window >= 3, f"window must be an integer >= 3, got {window!r}")
        self.enabled = bool(enabled)
        self.on_cuda = torch.device(device).type == "cuda" and _cuda_ready()
        self.device = device
        self.current: list[tuple[str, float]] = []  # this iteration's (stage, MB) in call order
        self.last_seen: dict[str, float] = {}  # latest MB per stage (iterations without an update skip some)
        self.iterations: deque = deque(maxlen=window)  # (step, [(stage, MB), ...]) per finished iteration

    def _measure(self) -> float:
        if self.on_cuda:
            return torch.cuda.memory_allocated(self.device) / MB
        anon = process_anon_mb()
        return process_uss_mb() if anon is None else anon

    def __call__(self, stage: str) -> None:
        if not self.enabled:
            return
        _require(stage in self.STAGES, f"unknown probe stage {stage!r}; stages are {', '.join(self.STAGES)}")
        try:
            value = self._measure()
            self.current.append((stage, value))
            self.last_seen[stage] = value
        except Exception as exc:  # noqa: BLE001 - diagnostics never break training
            _warn_once("probe", f"memory probe failed ({exc}); probes are off from now on")
            self.enabled = False

    def attach(self, stages: dict[str, torch.nn.Module], optimizer: torch.optim.Optimizer) -> None:
        """Record from outside the code it watches: after the forward pass of each module in `stages` ({stage: module}),
        only with gradients on (an update's, not acting's or imagining's), and before and after the optimizer's step
        (after the backward pass; after the step)."""
        for stage, module in stages.items():
            module.register_forward_hook(
                lambda *_, stage=stage: self(stage) if torch.is_grad_enabled() else None
            )
        optimizer.register_step_pre_hook(lambda *_: self("after_backward"))
        optimizer.register_step_post_hook(lambda *_: self("after_optimizer_step"))

    def end_iteration(self, step: int) -> None:
        if not self.enabled:
            return
        if self.current and self.current[0][0] == "loop_start":
            self.iterations.append((float(step), self.current))
        self.current = []

    def baseline_slope(self) -> float | None:
        """Loop-start memory, MB per 1k steps, over the recent window."""
        if len(self.iterations) < 3:
            return None
        steps = [step for step, _ in self.iterations]
        values = [stages[0][1] for _, stages in self.iterations]
        return 1000.0 * robust_slope(steps, values)

    def retained_per_stage(self) -> dict[str, float]:
        """Mean MB per iteration that each stage adds and nothing gives back before the next loop start."""
        totals: dict[str, float] = {}
        pairs = list(zip(self.iterations, list(self.iterations)[1:]))
        for (_, stages), (_, following) in pairs:
            values = [v for _, v in stages] + [following[0][1]]
            base = values[0]
            rel = [v - base for v in values]
            # floor[i] = the lowest memory from probe i on: what of the rise up to i is still held at the end
            floor = rel[:]
            for i in range(len(floor) - 2, -1, -1):
                floor[i] = min(floor[i], floor[i + 1])
            for i in range(1, len(stages)):
                totals[stages[i][0]] = totals.get(stages[i][0], 0.0) + floor[i] - floor[i - 1]
            totals[stages[0][0]] = totals.get(stages[0][0], 0.0) + floor[0]
        return {stage: total / len(pairs) for stage, total in totals.items()} if pairs else {}

    def scalars(self) -> dict[str, float]:
        if not self.enabled:
            return {}
        out = {f"{PROBE_KEY_PREFIX}{stage}_mb": value for stage, value in self.last_seen.items()}
        slope = self.baseline_slope()
        if slope is not None:
            out[self.SLOPE_KEY] = slope
        return out

    def verdict(self, threshold_mb_per_1k: float = 1.0) -> str:
        slope = self.baseline_slope()
        if slope is None:
            return "probes: not enough iterations yet"
        if slope <= threshold_mb_per_1k:
            return f"probes: loop-start memory is flat ({slope:+.2f} MB per 1k steps)"
        retained = self.retained_per_stage()
        culprit = max(retained, key=retained.get) if retained else "unknown"
        return (
            f"probes: loop-start memory grows {slope:+.2f} MB per 1k steps; '{culprit}' adds "
            f"{retained.get(culprit, 0.0):.3f} MB per iteration that is never given back"
        )


# ---------------------------------------------------------------------------------------------------------
# Forensics: allocator snapshots and OOM reports
# ---------------------------------------------------------------------------------------------------------
class MemorySnapshots:
    """Record CUDA allocator history in a bounded ring and dump it every `every` env steps.

    Files: {run_dir}/memory_snapshots/snapshot_step_{step}.pickle, readable by `python memory_analysis.py
    analyze` and by https://pytorch.org/memory_viz. Without CUDA it warns once and does nothing. A failure to
    write is reported once and training continues.
    """

    def __init__(self, run_dir: str, every: int, max_entries: int = 100_000, device=None):
        _require(isinstance(run_dir, (str, os.PathLike)), f"run_dir must be a path, got {run_dir!r}")
        _require(_is_int(every) and every >= 0, f"every must be an integer >= 0, got {every!r}")
        _require(
            _is_int(max_entries) and max_entries > 0,
            f"max_entries must be a positive integer, got {max_entries!r}",
        )
        self.out_dir = Path(run_dir) / "memory_snapshots"
        self.every = every
        self.max_entries = max_entries
        self.active = False
        self.next_step = every
        if every == 0:
            return
        if not _cuda_ready() or (device is not None and torch.device(device).type != "cuda"):
            _warn_once(
                "snapshots_cpu", "memory snapshots need CUDA; --memory-snapshot-every is ignored on this run"
            )
            return
        try:
            # Python frames only: the analysis reads nothing else, and symbolising C++ frames (torch's default,
            # stacks="all") can make one dump take minutes on a large model.
            torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
            self.active = True
        except Exception as exc:  # noqa: BLE001
            _warn_once(
                "snapshots_start", f"could not start recording allocator history ({exc}); no snapshots"
            )

    def dump(self, path: Path) -> str | None:
        """Write one snapshot; a failed write (a full disk) is one warning line, the partial file removed, and
        the next interval tries again."""
        try:
            snapshot = (
                torch.cuda.memory._snapshot()
            )  # what _dump_snapshot pickles, written here all or nothing
            atomic_write(path, functools.partial(pickle.dump, snapshot))
            del snapshot
            return str(path)
        except WriteFailed as exc:
            print(f"memory_utils: warning: {exc}; no snapshot this time, training continues", file=sys.stderr)
            return None
        except Exception as exc:  # noqa: BLE001 - diagnostics never break training
            _warn_once(
                "snapshots_write", f"writing memory snapshot {path} failed ({exc}); training continues"
            )
            return None

    def maybe_dump(self, step: int) -> str | None:
        if not self.active or step < self.next_step:
            return None
        while self.next_step <= step:
            self.next_step += self.every
        return self.dump(self.out_dir / f"snapshot_step_{step}.pickle")

    def close(self) -> None:
        if self.active:
            with contextlib.suppress(Exception):
                torch.cuda.memory._record_memory_history(enabled=None)
            self.active = False


def install_oom_observer(run_dir: str) -> bool:
    """Dump an allocator snapshot to {run_dir}/oom/ at the moment the CUDA allocator runs out of memory.

    Uses torch's OOM observer, which exists only with CUDA and the native caching allocator (not under
    backend:cudaMallocAsync). Returns whether it was attached.
    """
    attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
    if attach is None or not _cuda_ready():
        return False
    oom_dir = Path(run_dir) / "oom"

    def observer(device, alloc, device_alloc, device_free):
        try:
            atomic_write(
                oom_dir / "observer.json",
                json.dumps(
                    {
                        "device": device,
                        "requested_bytes": alloc,
                        "device_allocated_bytes": device_alloc,
                        "device_free_bytes": device_free,
                    },
                    indent=2,
                ).encode(),
            )
            atomic_write(
                oom_dir / "snapshot_at_oom.pickle",
                functools.partial(pickle.dump, torch.cuda.memory._snapshot()),
            )
        except WriteFailed as exc:
            print(f"memory_utils: warning: {exc}; the OOM observer's files are incomplete", file=sys.stderr)
        except Exception as exc:  # noqa: BLE001
            _warn_once("oom_observer", f"OOM observer could not write its snapshot ({exc})")

    try:
        attach(observer)
        return True
    except Exception as exc:  # noqa: BLE001
        _warn_once("oom_observer_attach", f"could not attach the OOM observer ({exc})")
        return False


_REQUEST_RE = re.compile(r"Tried to allocate ([\d.]+) (B|KiB|MiB|GiB|TiB)")
_ALLOWED_RE = re.compile(r"([\d.]+) (B|KiB|MiB|GiB|TiB) allowed;")  # present when a per-process cap is set
_UNITS = {"B": 1 / MB, "KiB": 1 / 1024, "MiB": 1.0, "GiB": 1024.0, "TiB": 1024.0 * 1024.0}


def diagnose_oom(
    message: str,
    allocated_mb: float | None,
    reserved_mb: float | None,
    free_mb: float | None,
    total_mb: float | None,
    advice: str,
) -> str:
    """A short explanation of a CUDA OOM from its message and the allocator's figures (all MB).

    `advice` is the calling script's own sentence naming its flags that lower the peak (its `OOM_ADVICE`): the
    scripts' flags differ, so no default here could name the right ones (tests/test_oom_advice.py checks each).
    """
    lines = ["CUDA out of memory."]
    match = _REQUEST_RE.search(message or "")
    if match:
        lines[0] += f" It asked for {float(match.group(1)) * _UNITS[match.group(2)]:.0f} MiB more."
    allowed = _ALLOWED_RE.search(message or "")
    if allowed:
        allowed_mb = float(allowed.group(1)) * _UNITS[allowed.group(2)]
        card = f" of a {total_mb:.0f} MiB card" if total_mb else ""
        lines.append(
            f"This process may use at most {allowed_mb:.0f} MiB{card}: a per-process cap "
            "(torch.cuda.set_per_process_memory_fraction, or a limit the job's launcher set) ran out, "
            "not the card. Raise the cap, or lower the peak with the flags below."
        )
    if total_mb:
        held = reserved_mb or 0.0
        others = max(0.0, total_mb - (free_mb or 0.0) - held)
        lines.append(
            f"This process holds {held:.0f} MiB ({allocated_mb or 0.0:.0f} MiB in live tensors); "
            f"other processes and CUDA contexts hold about {others:.0f} MiB; {free_mb or 0.0:.0f} MiB "
            f"of {total_mb:.0f} MiB is free."
        )
        if others > 0.25 * total_mb:
            lines.append(
                "Another process holds a large share of this GPU: wait for it "
                "(`python memory_analysis.py wait --min-free MB -- <command>`) or use another device."
            )
        if allocated_mb and allocated_mb > total_mb:
            lines.append(
                f"Allocated ({allocated_mb / 1024:.2f} GiB) exceeds the card's {total_mb / 1024:.2f} GiB: the "
                "driver is spilling into shared host memory (WSL2/Windows do this). That is not "
                "corruption; it is memory pressure, and it makes training slow long before it fails."
            )
        if reserved_mb and allocated_mb is not None and reserved_mb - allocated_mb > 0.3 * reserved_mb:
            lines.append(
                f"{reserved_mb - allocated_mb:.0f} MiB is reserved but unused (fragmentation): "
                "PYTORCH_ALLOC_CONF=expandable_segments:True helps."
            )
    lines.append(advice)
    return "\n".join(lines)


def write_oom_report(
    run_dir: str,
    exc: BaseException,
    last_report: dict | None,
    verdict=None,
    device=None,
    *,
    advice: str,
) -> str:
    """Write {run_dir}/oom/ (snapshot, memory_summary.txt, report.json) and return a short diagnosis.

    Call it from `except torch.OutOfMemoryError` after dropping the failed step's tensors: the traceback's
    frames hold them, so run `traceback.clear_frames(exc.__traceback__)` first (setting `__traceback__` to
    None alone is not enough while another reference to it exists). Never raises.
    """
    oom_dir = Path(run_dir) / "oom"
    stats = gpu_memory_stats(device)
    diagnosis = diagnose_oom(
        str(exc),
        stats.get("alloc_mb"),
        stats.get("reserved_mb"),
        stats.get("free_mb"),
        stats.get("total_mb"),
        advice,
    )
    try:
        oom_dir.mkdir(parents=True, exist_ok=True)
        summary = "CUDA is not available; no allocator summary."
        if _cuda_ready():
            with contextlib.suppress(Exception):
                summary = torch.cuda.memory_summary(device)
            with contextlib.suppress(Exception):
                atomic_write(
                    oom_dir / "snapshot.pickle", functools.partial(pickle.dump, torch.cuda.memory._snapshot())
                )
        atomic_write(oom_dir / "memory_summary.txt", summary.encode())
        payload = {
            "error": str(exc),
            "diagnosis": diagnosis,
            "gpu": stats,
            "last_memory_report": last_report or {},
            "leak_verdict": None
            if verdict is None
            else {
                "leaking": getattr(verdict, "leaking", None),
                "cause": getattr(verdict, "cause", None),
                "diagnosis": str(verdict),
            },
        }
        atomic_write(oom_dir / "report.json", json.dumps(payload, indent=2, default=str).encode())
    except WriteFailed as err:
        print(f"memory_utils: warning: {err}; the OOM report is incomplete", file=sys.stderr)
    except Exception as err:  # noqa: BLE001
        _warn_once("oom_report", f"could not write the OOM report to {oom_dir} ({err})")
    return diagnosis


# ---------------------------------------------------------------------------------------------------------
# A run's life: its folder, stop signals, out of memory, verified checkpoints
# ---------------------------------------------------------------------------------------------------------
# Exit statuses, the same in both scripts (each script's docs list what it uses)
EXIT_BAD_INPUT = 2  # a bad value: one sentence, nothing written
EXIT_OOM = 3  # out of memory (report and checkpoint), or a run that cannot fit, said before it trains
EXIT_LEAK = 4  # the leak detector's abort (Dreamer's --abort-on-leak)
EXIT_NONFINITE = 5  # too many non-finite updates or env steps in a row: checkpoint of the last finite weights
EXIT_WRITE_FAILED = 6  # a file the run cannot go on without could not be written
EXIT_FAST_PATH = 7  # Dreamer: a fast path differs from the readable function at start-up
EXIT_CRASHED = 8  # an error in the loop: a checkpoint first, the traceback in the run's crash.log


RUN_MARK = ".run.json"  # what a script writes into each run folder it makes: `--overwrite` removes only those


def name_problem(name: str, what: str, parent: str | os.PathLike = ".", reserve: int = 0) -> str | None:
    """Why `name` cannot be the name of one folder inside `parent` (a sentence naming the value and what is allowed,
    without its full stop), or None: empty, `.` or `..`, a path separator or a NUL byte, or longer than the file system
    of `parent` allows for one name, less `reserve` bytes the script may add (a `-2` suffix). A name that passes stays
    inside `parent`: nothing a user passes as a name can reach another folder."""
    shown = name if len(name) <= 60 else name[:40] + "..." + name[-8:]
    plain = "give a plain folder name such as 'baseline'"
    if not name.strip():
        return f"{what} must not be empty; {plain}"
    if name in (".", ".."):
        return f"{what} {name!r} names a folder that exists already, not one of its own; {plain}"
    if "\0" in name:
        return f"{what} {shown!r} holds a NUL byte, which no file name can; {plain}"
    separators = [s for s in (os.sep, os.altsep) if s and s in name]
    if separators or os.path.isabs(name):
        return f"{what} {shown!r} holds {(separators or [os.sep])[0]!r}, so it would name a path, not one folder; {plain}"
    existing = os.path.abspath(os.fspath(parent))
    while not os.path.isdir(existing) and os.path.dirname(existing) != existing:
        existing = os.path.dirname(existing)
    try:
        longest = os.pathconf(existing, "PC_NAME_MAX")
    except (OSError, ValueError):
        longest = 255
    size = len(os.fsencode(name))
    if size + reserve > longest:
        return (
            f"{what} {shown!r} is {size} bytes long, and a folder name there can be at most {longest - reserve} bytes "
            f"({longest} on this file system, less {reserve} for what the script adds); give a shorter name"
        )
    return None


def folder_problem(path: str | os.PathLike, what: str) -> str | None:
    """Why a run cannot make folder `path` and write files there (a sentence without its full stop), or None. The
    nearest folder of `path` that exists is tried with a folder made and removed at once, so a read-only file
    system, missing permissions or a file in the way are found before the run writes anything, and nothing is left
    behind."""
    shown = os.fspath(path)
    existing = os.path.normpath(shown)  # spelled as the user spelled it, relative or not
    while not os.path.lexists(existing) and os.path.dirname(existing) not in ("", existing):
        existing = os.path.dirname(existing)
    if not os.path.lexists(existing):
        existing = "."
    if not os.path.isdir(existing):
        where = (
            "is a file" if existing == os.path.normpath(shown) else f"is inside {existing}, which is a file"
        )
        return f"{what} {shown!r} {where}, not a folder; give a folder"
    try:
        os.rmdir(tempfile.mkdtemp(dir=existing, prefix=".write_check_"))
    except OSError as exc:
        reason = exc.strerror or str(exc)
        nearest = os.path.abspath(existing)
        where = (
            ""
            if existing == os.path.normpath(shown)
            else f" (the nearest folder of it that exists, {nearest})"
        )
        return f"{what} {shown!r} cannot be written: {reason}{where}; give a folder this user can write"
    return None


def make_run_dir(parent: str | os.PathLike, name: str, script: str = "") -> str:
    """Create `parent/name` for a new run, marked as made by `script` (RUN_MARK), and return its path; raises
    FileExistsError when it exists. Creating a folder is atomic: of two runs that want one name, one gets it."""
    path = os.path.join(os.fspath(parent), name)
    try:
        os.makedirs(parent, exist_ok=True)
    except FileExistsError:  # a file in the way: not a name that is taken
        raise NotADirectoryError(errno.ENOTDIR, "not a folder", os.fspath(parent)) from None
    os.mkdir(path)
    mark = {"script": os.path.basename(script), "name": name, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    with open(os.path.join(path, RUN_MARK), "w") as f:
        json.dump(mark, f)
    return path


def claim_run_dir(
    parent: str | os.PathLike, name: str, say: Callable[[str], None] = print, script: str = ""
) -> tuple[str, str]:
    """Create `parent/name` for a new run (`make_run_dir`) and return (its path, its name). Of two runs that want the
    same name (started in the same second with the same seed), one gets it and the other the first free `name-2`,
    `name-3`, ..., said in one line, so that no two runs ever write into one folder."""
    for attempt in range(1, 1000):
        candidate = name if attempt == 1 else f"{name}-{attempt}"
        try:
            path = make_run_dir(parent, candidate, script)
        except FileExistsError:
            continue
        if attempt > 1:
            say(f"run folder {os.path.join(os.fspath(parent), name)} is taken; this run writes to {path}")
        return path, candidate
    raise FileExistsError(errno.EEXIST, f"{name} and its 998 suffixes are all taken", os.fspath(parent))


class RunDirInUse(Exception):
    """Another process runs in the run folder (one sentence)."""


LOCK_FILE = ".lock"


def lock_run_dir(run_dir: str | os.PathLike) -> int:
    """Hold the run folder for this process: an exclusive lock (flock) on its `.lock`, which holds this process's id,
    kept until the process ends, however it ends (SIGKILL included: the kernel lets it go). Returns the file
    descriptor, to keep open. RunDirInUse when another process holds it: two runs (two resumes of one checkpoint)
    never write into one folder."""
    import fcntl

    path = os.path.join(os.fspath(run_dir), LOCK_FILE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise RunDirInUse(
            f"{os.fspath(run_dir)} is in use by a run still going (process {holder}): two runs never write into one "
            f"folder; wait for it to end, or copy the folder and resume the copy"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def foreign_entries(
    folder: str | os.PathLike, run_files: Iterable[str], config: str = "config.json"
) -> list[str]:
    """What in `folder` a script did not write there: nothing when it carries RUN_MARK (the script made it) or is
    empty; else, for a run folder of an older version (no mark, its `config` and only `run_files` in it), nothing;
    otherwise the entries that are not `run_files`, or the folder itself when its `config` is missing. `--overwrite`
    removes a folder only when this is empty: a user's files are never deleted."""
    folder = os.fspath(folder)
    try:
        entries = sorted(os.listdir(folder))
    except FileNotFoundError:
        return []
    except NotADirectoryError:
        return [folder]
    if RUN_MARK in entries or not entries:
        return []
    unknown = [entry for entry in entries if entry not in set(run_files)]
    return unknown if unknown or config in entries else [folder]


def remove_event_files(folder: str | os.PathLike) -> None:
    """Remove the TensorBoard event files of a run from `folder`, and the folder once nothing else is in it: a user's
    other files stay."""
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        return
    for entry in os.listdir(folder):
        if entry.startswith("events.out.tfevents."):
            with contextlib.suppress(OSError):
                os.remove(os.path.join(folder, entry))
    with contextlib.suppress(OSError):
        os.rmdir(folder)


def host_memory_limit(cgroups: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> tuple[int, str]:
    """The most host memory this process can have, in bytes, and what sets it: the machine's, or its cgroup's limit
    (cgroup v2 `memory.max` of its own group and those above it, v1 `memory.limit_in_bytes`) where that is lower.
    `cgroups` and `root`: where this process's groups are listed and mounted."""
    total = (
        psutil.virtual_memory().total
        if psutil is not None
        else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    )
    limits = [(total, "this machine")]
    with contextlib.suppress(OSError, ValueError):
        with open(cgroups) as f:
            lines = f.read().splitlines()
        for line in lines:
            _, controllers, relative = line.split(":", 2)
            if controllers == "":  # v2: the group and each group above it may set a limit
                group = Path(root) / relative.lstrip("/")
                for folder in [group, *group.parents]:
                    limit_file = folder / "memory.max"
                    if limit_file.exists() and (text := limit_file.read_text().strip()) != "max":
                        limits.append((int(text), f"this process's cgroup ({folder})"))
                    if folder == Path(root):
                        break
            elif "memory" in controllers.split(","):
                limit_file = Path(root) / "memory" / relative.lstrip("/") / "memory.limit_in_bytes"
                if limit_file.exists():
                    limits.append((int(limit_file.read_text().strip()), "this process's cgroup"))
    return min(limits)


def replay_memory_problem(
    nbytes: int, what: str, smaller: Callable[[int], str]
) -> tuple[str | None, str | None]:
    """(a sentence refusing a replay of `nbytes` when full, or None; a warning line, or None), before any of it is
    allocated. Refused when it is more than this process can ever have (`host_memory_limit`); a warning when it is
    more than is available now (other processes may give memory back, and a replay grows as it fills).
    `smaller(bytes per ...)`: the script's own clause saying which value would fit in the bytes it is given."""
    limit, source = host_memory_limit()
    if nbytes > limit:
        return (
            f"{what} would take {nbytes:,} bytes ({_size_text(nbytes)}) when full, more than the {limit:,} bytes "
            f"({_size_text(limit)}) {source} has in all; {smaller(int(0.5 * limit))}",
            None,
        )
    available = psutil.virtual_memory().available if psutil is not None else None
    if available is not None and nbytes > available:
        return None, (
            f"warning: {what} would take {_size_text(nbytes)} when full, more than the {_size_text(available)} "
            f"available now; {smaller(int(0.5 * available))}"
        )
    return None, None


def nonfinite(reward: float, observation: Any = None) -> str | None:
    """What of an environment's step is not a finite number, said as "reward nan" or "observation player inf", or
    None: its reward and any floating array of its observation (an array, or a dict of them; integer frames and
    feature layers are always finite). A run keeps such a step out of its replay."""
    if not math.isfinite(float(reward)):
        return f"reward {float(reward)}"
    parts = observation.items() if isinstance(observation, dict) else [("", observation)]
    for key, value in parts:
        array = np.asarray(value)
        if array.dtype.kind in "fc" and not np.isfinite(array).all():
            return f"observation {f'{key} ' if key else ''}{array[~np.isfinite(array)].flat[0]}"
    return None


class Stopped(BaseException):
    """A stop signal during a run's start-up (`StopSignals.at_once`), raised where it landed: nothing is worth a
    checkpoint yet, so the run removes the folder it made and exits 128 + N. A BaseException, as KeyboardInterrupt
    is, so that no `except Exception` on the way takes it for an error."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class StartUp:
    """What a run's start-up has made so far, filled in as it makes it, so that a stop signal before the run's first
    step (`Stopped`) can take it away again (`discard`): what it opened (`closers`: TensorBoard, wandb, envs), a new
    run's folder (`run_dir`), folders named after it (`folders`: its videos), its TensorBoard events elsewhere
    (`event_dirs`), and the folders above them it made (`parents` that did not exist: removed if left empty). A
    resumed run's folder and events are never removed."""

    def __init__(self, new: bool, parents: Iterable[str | os.PathLike] = ()):
        self.new = new
        self.run_dir: str | None = None
        self.folders: list[str] = []
        self.event_dirs: list[str] = []
        self.closers: list[Callable[[], Any]] = []
        self.parents = [os.path.abspath(p) for p in parents if not os.path.exists(p)]
        self.lock: int | None = None  # the run folder's lock (`lock_run_dir`), held while the process runs

    def close(self) -> None:
        """Close what was opened, last first (one that fails is passed over), and let the folder's lock go."""
        for closer in reversed(self.closers):
            with contextlib.suppress(Exception):
                closer()
        if self.lock is not None:
            with contextlib.suppress(OSError):
                os.close(self.lock)
            self.lock = None

    def discard(self, signal_name: str) -> str:
        """Close what was opened, remove what this start-up made; returns the sentence to say."""
        self.close()
        if not self.new or self.run_dir is None:
            return f"stopped by {signal_name} during start-up, before the first step: nothing was trained"
        for folder in (self.run_dir, *self.folders):
            shutil.rmtree(folder, ignore_errors=True)
        for folder in self.event_dirs:
            remove_event_files(folder)
        for folder in self.parents:
            with contextlib.suppress(OSError):
                os.rmdir(folder)
        return (
            f"stopped by {signal_name} during start-up, before the first step: nothing was trained, and the run's "
            f"folder {self.run_dir} was removed"
        )


def start_wandb(say: Callable[[str], None], **init) -> bool:
    """`wandb.init(**init)`; False, after one line saying that tracking is off and why, when wandb cannot start (not
    installed, no API key, a folder it cannot write): tracking never stops a run, which logs to TensorBoard anyway."""
    try:
        import wandb

        wandb.init(**init)
        return True
    except Exception as exc:  # noqa: BLE001 - tracking must never stop training
        first_line = (str(exc).strip().splitlines() or [""])[0][:200]
        say(f"tracking is off: wandb could not start ({type(exc).__name__}: {first_line}); the run trains on")
        with contextlib.suppress(Exception):
            sys.modules["wandb"].finish()
        return False


def crash_report(exc: BaseException, script: str, log_path: str | None) -> str:
    """A crash of the loop in one paragraph: what raised and where (the innermost frame, and the script's own line
    that led there), with the whole traceback written to `log_path` (None: not written). Never raises."""
    import traceback

    frames = traceback.extract_tb(exc.__traceback__)
    here = os.path.abspath(script)
    ours = [f for f in frames if os.path.abspath(f.filename) == here]
    where = ""
    if frames:
        last = frames[-1]
        where = f" in {last.name} ({os.path.basename(last.filename)}, line {last.lineno})"
        if ours and ours[-1] is not last:
            where += f", reached from {ours[-1].name} (line {ours[-1].lineno})"
    message = (str(exc).strip().splitlines() or [""])[0][:300].rstrip(".")
    text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    logged = ""
    if log_path is not None:
        try:
            atomic_write(log_path, "".join(traceback.format_exception(exc)).encode())
            logged = f"; the traceback is in {log_path}"
        except Exception as log_error:  # noqa: BLE001 - the crash is the one to report
            logged = f"; its traceback could not be written ({log_error})"
    return f"{text}, raised{where}{logged}"


class StopSignals:
    """SIGINT and SIGTERM recorded, not raised, while the `with` block runs: the loop reads `received` at the top
    of each iteration, where everything is consistent, checkpoints and exits with `exit_code` (128 + N). A signal
    that raised wherever the loop happened to be could land inside a checkpoint write, a memory report or a
    library's `except Exception`. The previous handlers come back when the block ends."""

    SIGNALS = ("SIGINT", "SIGTERM")

    def __init__(self):
        self.received: list[int] = []
        self._previous: dict = {}
        self._raise = False

    def __enter__(self) -> Self:
        for name in self.SIGNALS:
            sig = getattr(signal, name)
            self._previous[sig] = signal.signal(sig, self._record)
        return self

    def _record(self, signum: int, frame) -> None:
        self.received.append(signum)
        if self._raise:
            raise Stopped(signum)

    @contextlib.contextmanager
    def at_once(self):
        """Inside the block (a run's start-up, where nothing is worth a checkpoint yet) a signal raises `Stopped`
        where it lands, so that Ctrl-C stops a long start-up at once; one received before the block raises at its
        start. Outside it signals are recorded, as ever."""
        previous, self._raise = self._raise, True
        try:
            if self.received:
                raise Stopped(self.received[0])
            yield
        finally:
            self._raise = previous

    def __exit__(self, *exc_info) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    @property
    def name(self) -> str | None:
        """The first signal received (`SIGTERM`), or None."""
        return signal.Signals(self.received[0]).name if self.received else None

    @property
    def exit_code(self) -> int:
        return 128 + self.received[0]


@contextlib.contextmanager
def workers_ignore_stop_signals():
    """Processes started inside the block (vector-env workers) ignore SIGINT and SIGTERM: they inherit SIG_IGN.
    `scancel`, `docker stop`, `timeout` and Ctrl-C signal the whole process group, and the main process must find
    its workers alive to checkpoint and close them. This process's handlers come back when the block ends."""
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


@dataclasses.dataclass
class OutOfMemory:
    """What `out_of_memory` found: `where` in the script it happened, the error (its traceback dropped), and the
    diagnosis written to `{run_dir}/oom/` (None when no report was asked for)."""

    where: str
    error: BaseException
    diagnosis: str | None


def out_of_memory(
    exc: BaseException,
    script: str,
    run_dir: str | None = None,
    *,
    advice: str,
    release: Callable[[], None] | None = None,
    last_report: dict | None = None,
    verdict=None,
    device=None,
) -> OutOfMemory:
    """The out-of-memory sequence of a training script, in one call from its `except torch.OutOfMemoryError`:
    1. where it happened: the innermost frame of `script` (pass `__file__`) on the traceback;
    2. the failed step's tensors dropped: its frames cleared and the traceback detached from the error;
    3. `release()` (optimizer state made by the failed step, say), then garbage collected;
    4. the report written to `{run_dir}/oom/` (`write_oom_report`, ending with `advice`, the script's own
       sentence on which of its flags lower the peak), unless `run_dir` is None;
    5. the CUDA cache emptied, after the report so that it still shows any fragmentation.
    Never raises (the report's own failures are warnings)."""
    import traceback

    here = os.path.abspath(script)
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if os.path.abspath(f.filename) == here]
    where = f"in {frames[-1].name}, line {frames[-1].lineno}" if frames else "outside this script"
    traceback.clear_frames(exc.__traceback__)  # memory: the failed step's tensors go before the report looks
    error = exc.with_traceback(None)
    if release is not None:
        release()
    gc.collect()
    diagnosis = None
    if run_dir is not None:
        diagnosis = write_oom_report(
            run_dir, error, last_report, verdict=verdict, device=device, advice=advice
        )
    if _cuda_ready():
        with contextlib.suppress(Exception):
            torch.cuda.empty_cache()
    return OutOfMemory(where, error, diagnosis)


class SettingFixed(dataclasses.FrozenInstanceError):
    """A field of a script's `Args` assigned once the run has begun (one sentence saying how to change it)."""


def fixed_once_parsed(how_to_change: Callable[[str], str]):
    """Class decorator of a script's `@dataclass(frozen=True) class Args`. A frozen dataclass refuses `args.x = y`
    with a generic message; this one says in one sentence what to do instead: `how_to_change(name)`, which ends the
    sentence. Every device refuses it alike, at once: a captured CUDA graph would have kept the old value, the CPU
    would have read the new one. Before a run starts, `dataclasses.replace(args, x=y)` makes another Args."""

    def decorate(cls):
        if not cls.__dataclass_params__.frozen:
            raise TypeError(f"{cls.__name__} must be a frozen dataclass")

        def refuse(self, name: str, *value) -> None:  # __setattr__ and __delattr__
            raise SettingFixed(
                f"args.{name} cannot change once {cls.__name__} is parsed (it is frozen): {how_to_change(name)}."
            )

        cls.__setattr__ = cls.__delattr__ = refuse
        return cls

    return decorate


CHECKSUM_SUFFIX = ".sha256"


class CheckpointInvalid(ValueError):
    """A checkpoint whose bytes are not the ones written (changed, truncated or replaced); the message is one
    sentence naming the file."""


def file_digest(path: str | os.PathLike) -> str:
    """`sha256:<hex>` of a file's bytes, read in 1 MB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MB_INT), b""):
            digest.update(block)
    return "sha256:" + digest.hexdigest()


def _accepted_digests(sidecar: str) -> list[str]:
    try:
        with open(sidecar, encoding="utf-8") as f:
            return [line.split()[0] for line in f if line.strip()]
    except (FileNotFoundError, UnicodeDecodeError, IndexError):
        return []


def save_checked(
    path: str | os.PathLike, data: bytes | Callable[[Any], Any], needed_bytes: int | None = None
) -> int:
    """`atomic_write` of a checkpoint with its checksum beside it, in `path + ".sha256"`.

    The order keeps the pair consistent whenever the process dies: the new file's checksum is added to the
    sidecar before the rename (the sidecar then accepts the old and the new file), and the old one is dropped
    after it. A full disk raises `WriteFailed` with the previous checkpoint and its checksum untouched."""
    path = os.fspath(path)
    sidecar = path + CHECKSUM_SUFFIX
    new: list[str] = []

    def add_checksum(tmp: str) -> None:
        new.append(file_digest(tmp))
        kept = [d for d in _accepted_digests(sidecar) if d != new[0]][:1]
        atomic_write(sidecar, "".join(f"{d}\n" for d in new + kept).encode())

    written = atomic_write(path, data, needed_bytes, before_replace=add_checksum)
    with contextlib.suppress(WriteFailed):  # a full disk now: the sidecar still accepts the new file
        atomic_write(sidecar, f"{new[0]}\n".encode())
    return written


ZIP_SIGNATURE = b"PK\x03\x04"  # the first bytes of a zip archive, which is what torch.save writes


def check_archive_crcs(path: str | os.PathLike) -> bool:
    """Read every record of a zip archive (torch.save's format: one record per tensor's bytes, one for the pickled
    structure) and check it against the CRC-32 the archive stores with it. torch's loader checks none of them.
    Raises `CheckpointInvalid` naming the first damaged record (one sentence; the file is left as it is); returns
    False when the file is no zip archive (torch's legacy format, say): there is nothing to check."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        if f.read(len(ZIP_SIGNATURE)) != ZIP_SIGNATURE:
            return False
    try:
        with zipfile.ZipFile(path) as archive:
            damaged = archive.testzip()  # the first record whose bytes fail their CRC-32, or None
    except (zipfile.BadZipFile, EOFError, ValueError, NotImplementedError, zlib.error) as exc:
        raise CheckpointInvalid(
            f"{path} begins as a zip archive (torch.save's format) but cannot be read as one ({exc}): it was "
            f"truncated or changed since it was written; it is left as it is."
        ) from None
    if damaged is not None:
        raise CheckpointInvalid(
            f"{path} is damaged: its record {damaged} does not match the CRC-32 stored with it (changed since it "
            f"was written); it is left as it is."
        )
    return True


def verify_checkpoint(path: str | os.PathLike) -> str | None:
    """Check a checkpoint, before anything loads it, against the checksum `save_checked` wrote beside it and against
    its archive's own CRC-32s (`check_archive_crcs`): torch's loader checks neither, and flipped bytes inside a
    tensor load without a word. Raises `CheckpointInvalid` (one sentence; the file is left where it is) when either
    fails; returns None when verified, or one line to print when neither check is possible (no `.sha256` beside
    it, and not a zip archive)."""
    path = os.fspath(path)
    sidecar = path + CHECKSUM_SUFFIX
    has_sidecar = os.path.exists(sidecar)
    if has_sidecar:
        accepted = _accepted_digests(sidecar)
        if not accepted:
            raise CheckpointInvalid(
                f"{sidecar} is not a checksum file, so {path} cannot be verified; it is left as it is."
            )
        if file_digest(path) not in accepted:
            raise CheckpointInvalid(
                f"{path} does not match its checksum in {sidecar} (changed, truncated or replaced since it was "
                f"written); it is left as it is."
            )
    if check_archive_crcs(path) or has_sidecar:
        return None
    return (
        f"note: {path} has no {CHECKSUM_SUFFIX} beside it, so it could not be verified; loading it as it is"
    )


def read_checkpoint(
    path: str, formats: Sequence[str], keys: Iterable[str] = ("args",)
) -> tuple[dict, str | None]:
    """The checkpoint `--resume` names, as both scripts read it: a file, its bytes checked against its archive's own
    CRC-32s and the checksum beside it (`verify_checkpoint`; torch's loader notices neither), loaded with
    weights_only=True, written in one of `formats` (the first: this version's) and holding `keys`. Returns (state,
    a line to say where neither check could verify it, or None); any problem is one CheckpointInvalid sentence, and
    the file stays where it is."""
    if not os.path.isfile(path):
        raise CheckpointInvalid(f"--resume {path!r} does not exist or is not a file.")
    try:
        note = verify_checkpoint(path)
    except CheckpointInvalid as exc:
        raise CheckpointInvalid(f"--resume: {exc}") from None
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - corrupt, truncated, or not a checkpoint at all
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise CheckpointInvalid(
            f"--resume {path!r} is not a readable checkpoint ({first_line[:160]})."
        ) from None
    if not isinstance(state, dict) or not {"format", *keys} <= set(state):
        raise CheckpointInvalid(f"--resume {path!r} is not a {formats[0]} checkpoint that can be resumed.")
    if state["format"] not in formats:
        raise CheckpointInvalid(
            f"--resume {path!r} was written by another version of this script ({state['format']}, this one reads "
            f"{formats[0]}); start a new run."
        )
    return state, note


# what is never an environment's state: the layer below (saved as its own), its spaces and registration
ENV_STATE_SKIPS = frozenset({"env", "envs", "spec", "_cached_spec", "_saved_kwargs", "_ezpickle_args"})


def env_state(env) -> list[list[dict]] | None:
    """The state of an environment, to go on exactly where it stands after `restore_env_state`: for a vector env of
    environments in this process (gymnasium's SyncVectorEnv: `envs`) or for one environment, each environment's
    wrappers from the outside in, each one's attributes that hold data (numbers, strings, arrays, deques, lists,
    tuples and dicts of them; numpy generators' states; an Atari emulator's state with its RNG, ALE's
    `cloneState(include_rng=True)`), in the forms `torch.load(weights_only=True)` reads back. Attributes of any
    other type (functions, spaces, renderers) are set up alike by making the environment again. None where the
    state lives elsewhere (an async vector env's, in its workers)."""
    if hasattr(env, "envs"):
        return [env_state(one)[0] for one in env.envs]
    if hasattr(env, "num_envs") and not hasattr(env, "env"):  # a vector env without its environments here
        return None
    layers, layer = [], env
    while layer is not None:
        state = {}
        for name, value in vars(layer).items():
            if name not in ENV_STATE_SKIPS and (saved := to_checkpoint(value)) is not UNSAVED:
                state[name] = saved
        layers.append(state)
        layer = getattr(layer, "env", None)
    return [layers]


def restore_env_state(env, state: list[list[dict]]) -> None:
    """`env_state`'s state back into an environment made alike (same id, wrappers and settings)."""
    envs = env.envs if hasattr(env, "envs") else [env]
    if len(envs) != len(state):
        raise ValueError(f"the saved state is of {len(state)} environments, this one has {len(envs)}")
    for one, layers in zip(envs, state):
        layer = one
        for saved in layers:
            for name, value in saved.items():
                _restore_value(layer, name, value)
            layer = getattr(layer, "env", None)


UNSAVED = object()


def to_checkpoint(value):
    """`value` (numbers, strings, numpy arrays and scalars, generators, ALE emulators, and lists, tuples, deques and
    dicts of them) in a form torch's weights_only loader reads, tagged where its type must come back
    (`from_checkpoint`); UNSAVED for anything else."""
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        return value
    if isinstance(value, np.generic):
        return ("numpy", torch.from_numpy(np.array([value])), value.dtype.str)
    if isinstance(value, np.ndarray):
        if value.dtype.kind not in "biuf":
            return UNSAVED
        return ("numpy", torch.from_numpy(np.array(value)), None)
    if isinstance(value, np.random.Generator):
        return ("generator", value.bit_generator.state)
    if type(value).__name__ == "ALEInterface":
        return ("ale", value.cloneState(include_rng=True).__getstate__())
    if isinstance(value, (list, tuple, deque)):
        items = [to_checkpoint(item) for item in value]
        if any(item is UNSAVED for item in items):
            return UNSAVED
        return ("deque", items, value.maxlen) if isinstance(value, deque) else type(value)(items)
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        items = {key: to_checkpoint(item) for key, item in value.items()}
        return UNSAVED if any(item is UNSAVED for item in items.values()) else items
    return UNSAVED


def from_checkpoint(saved):
    """`to_checkpoint`'s form back as the value (generators and emulators are restored in place, `restore_env_state`)."""
    if isinstance(saved, tuple) and saved and saved[0] == "numpy" and len(saved) == 3:
        array = saved[1].numpy().copy()
        return array.astype(np.dtype(saved[2]))[0] if saved[2] is not None else array
    if isinstance(saved, tuple) and saved and saved[0] == "deque" and len(saved) == 3:
        return deque((from_checkpoint(item) for item in saved[1]), maxlen=saved[2])
    if isinstance(saved, (list, tuple)):
        return type(saved)(from_checkpoint(item) for item in saved)
    if isinstance(saved, dict):
        return {key: from_checkpoint(item) for key, item in saved.items()}
    return saved


def _restore_value(layer, name: str, saved) -> None:
    """One attribute of `layer` as `env_state` saved it."""
    tag = saved[0] if isinstance(saved, tuple) and len(saved) == 2 else None
    if tag == "generator":
        getattr(layer, name).bit_generator.state = saved[1]
    elif tag == "ale":
        ale = getattr(layer, name)
        state_type = type(ale.cloneState())  # ale_py.ALEState, without importing ale_py here
        ale_state = state_type.__new__(state_type)
        ale_state.__setstate__(saved[1])
        ale.restoreState(ale_state)
    else:
        setattr(layer, name, from_checkpoint(saved))


# ---------------------------------------------------------------------------------------------------------
# Replay storage: growable arrays in chunks, in memory maps of their own
# ---------------------------------------------------------------------------------------------------------
_MAPS_EXHAUSTED: list[OSError] = []  # the first failed map, so that the warning is said once


def mapped_arrays(shapes: dict[str, tuple[tuple, np.dtype]]) -> dict[str, np.ndarray]:
    """Uninitialised arrays of these (shape, dtype), all in one anonymous memory map of their own.

    memory: a replay keeps its storage out of the malloc heap. Its small arrays (a chunk's actions and rewards:
    tens of bytes) live for a whole turnover of the replay. In the heap, among the short-lived tensors of the
    updates, each one kept a page resident after the tensors around it were freed, and resident memory crept up
    turnover after turnover (benchmark/results/soak/README.md). A map of its own goes back to the system whole
    as soon as its last array is dropped. Where the system allows no more maps (Linux: `vm.max_map_count`, about
    65k, which a replay of many very short episodes can reach), the arrays go in the heap instead, said once."""
    fields = sorted(shapes.items(), key=lambda field: -np.dtype(field[1][1]).itemsize)  # each one aligned
    sizes = [math.prod(shape) * np.dtype(dtype).itemsize for _, (shape, dtype) in fields]
    try:
        block = mmap.mmap(-1, max(sum(sizes), 1))
    except OSError as exc:
        if not _MAPS_EXHAUSTED:
            _MAPS_EXHAUSTED.append(exc)
            print(
                f"replay: warning: no more memory maps ({exc.strerror}; Linux: sysctl vm.max_map_count); "
                "new replay arrays go in the heap, where host memory may creep",
                file=sys.stderr,
            )
        return {name: np.empty(shape, dtype) for name, (shape, dtype) in shapes.items()}
    arrays, offset = {}, 0
    for (name, (shape, dtype)), size in zip(fields, sizes):
        arrays[name] = np.frombuffer(block, dtype, math.prod(shape), offset).reshape(shape)
        offset += size
    return arrays


class ChunkedArray:
    """A growable array kept as fixed-size numpy chunks, so it can grow without copying and drop its front.

    Logical indices run from `start` (first kept element) to `end` (one past the last). A finished one is compacted
    into one exact-size array, so stored bytes match stored items. `allocate(i)` gives chunk i's array.
    """

    def __init__(self, item_shape: tuple, dtype, chunk_size: int, allocate: Callable[[int], np.ndarray]):
        self.item_shape, self.dtype, self.chunk_size = tuple(item_shape), np.dtype(dtype), chunk_size
        self.allocate = allocate
        self.chunks: list[np.ndarray] = []
        self.start = 0
        self.end = 0
        self.compacted = False

    def __len__(self) -> int:
        return self.end - self.start

    @property
    def nbytes(self) -> int:
        return sum(chunk.nbytes for chunk in self.chunks)

    def append(self, item) -> None:
        assert not self.compacted, "a compacted array is read-only"
        offset = (self.end - self.start) % self.chunk_size
        if offset == 0 and self.end - self.start == len(self.chunks) * self.chunk_size:
            self.chunks.append(self.allocate(self.start // self.chunk_size + len(self.chunks)))
        self.chunks[-1][offset] = item
        self.end += 1

    def read_into(self, out: np.ndarray, begin: int, stop: int) -> None:
        """Copy logical elements [begin, stop) into `out` (the caller's own memory)."""
        assert self.start <= begin <= stop <= self.end
        if self.compacted:
            out[:] = self.chunks[0][begin - self.start : stop - self.start]
            return
        pos = begin - self.start
        written = 0
        while written < stop - begin:
            chunk, offset = divmod(pos, self.chunk_size)
            take = min(self.chunk_size - offset, stop - begin - written)
            out[written : written + take] = self.chunks[chunk][offset : offset + take]
            written += take
            pos += take

    def drop_front_chunk(self) -> int:
        """Free the oldest chunk; returns how many elements went. Only while growing; never the last chunk."""
        if self.compacted or len(self.chunks) < 2:
            return 0
        self.chunks.pop(0)
        self.start += self.chunk_size
        return self.chunk_size

    def release(self) -> None:
        """Nothing to do: the arrays are freed with whatever holds this one."""

    def compact(self, exact: np.ndarray) -> None:
        """Replace the chunks by `exact`, an array of exactly len(self) items (frees the unused tail of the last
        chunk)."""
        if self.compacted:
            return
        self.read_into(exact, self.start, self.end)
        self.chunks = [exact]
        self.compacted = True


class _ChunkMaps:
    """Chunk i of every column of a `ChunkedColumns`, mapped together (`mapped_arrays`). A column may reach chunk i
    before the others (an episode's frames run k - 1 steps ahead): the map waits here for the others' views. The
    columns hold this, never the other way round, so dropping the columns frees everything at once."""

    def __init__(self, shapes: dict[str, tuple[tuple, np.dtype]]):
        self.shapes = shapes  # name -> a chunk's (shape, dtype)
        self.waiting: dict[int, dict[str, np.ndarray]] = {}  # chunk index -> views not yet taken

    def take(self, name: str, index: int) -> np.ndarray:
        views = self.waiting.get(index)
        if views is None:
            views = self.waiting[index] = mapped_arrays(self.shapes)
        view = views.pop(name)
        if not views:
            del self.waiting[index]
        return view


class ChunkedColumns:
    """Named growable arrays of one table (an episode's frames, actions, rewards...), `columns["reward"]`: chunk i of
    every column lives in one memory map of its own (`mapped_arrays`), and `compact` moves the whole table into one
    exact-size map. memory: a table being written wastes at most one chunk per column, a finished one nothing."""

    def __init__(self, shapes: dict[str, tuple[tuple, np.dtype]], chunk_size: int):
        """`shapes`: each column's item (shape, dtype)."""
        self.maps = _ChunkMaps(
            {name: ((chunk_size, *shape), dtype) for name, (shape, dtype) in shapes.items()}
        )
        self.columns = {
            name: ChunkedArray(shape, dtype, chunk_size, functools.partial(self.maps.take, name))
            for name, (shape, dtype) in shapes.items()
        }

    def __getitem__(self, name: str) -> ChunkedArray:
        return self.columns[name]

    def compact(self) -> None:
        """Every column in one exact-size map (a table that grows no more)."""
        exact = mapped_arrays({name: ((len(a), *a.item_shape), a.dtype) for name, a in self.columns.items()})
        for name, array in self.columns.items():
            array.compact(exact[name])
        self.maps.waiting.clear()  # a chunk one column began that the table's end left unused

    def load(self, saved: dict[str, np.ndarray]) -> None:
        """The columns as `saved` (each column's items, as one array), compacted in one map."""
        exact = mapped_arrays({name: (saved[name].shape, saved[name].dtype) for name in self.columns})
        for name, array in self.columns.items():
            exact[name][:] = saved[name]
            array.chunks, array.start, array.end, array.compacted = [exact[name]], 0, len(saved[name]), True
        self.maps.waiting.clear()


# ---------------------------------------------------------------------------------------------------------
# The replay on disk: every stored step, in chunk files written once as the run goes
# ---------------------------------------------------------------------------------------------------------
class ReplayLogInvalid(ValueError):
    """A replay's chunk file that a checkpoint needs is missing or is not the one written (one sentence)."""


class ReplayLog:
    """A replay's stored steps kept on disk as the run stores them, so that a run killed at any moment resumes with
    its replay. Each step is a row of `fields` (name -> an item's (shape, dtype)), appended as it is stored
    (`append`); every `chunk_rows` rows are written once to `folder/chunk_{index:08d}.rows` (the fields one after another), whole or not at all, and
    their CRC-32 recorded. The rows of the chunk still filling go into the run's checkpoint (`state`), with where the
    stream stands and the first row the replay still needs; `rows` reads back exactly a checkpoint's rows, each file
    checked against its CRC-32, and `commit` (once that checkpoint is written whole) removes the files no checkpoint
    needs any more. On disk: the replay's capacity, plus what was written since the last checkpoint.

    memory: one chunk of rows in host memory (1,024 Pong steps: 12.6 MB); the files are written, never mapped, so
    they take no memory of this process (the kernel's page cache holds them while it has room, outside RSS)."""

    def __init__(
        self,
        folder: str | os.PathLike,
        fields: dict[str, tuple[tuple, Any]],
        chunk_rows: int = 1024,
        say: Callable[[str], None] = print,
    ):
        self.folder, self.chunk_rows, self.say = os.fspath(folder), int(chunk_rows), say
        self.failed: str | None = None  # why a file could not be written (in memory only from then)
        self.fields = {name: (tuple(shape), np.dtype(dtype)) for name, (shape, dtype) in fields.items()}
        self.buffer = {
            name: np.zeros((chunk_rows, *shape), dtype) for name, (shape, dtype) in self.fields.items()
        }
        self.position = 0  # rows appended since the run began
        self.crcs: dict[int, int] = {}  # chunk index -> CRC-32 of its file
        self.unsynced: list[str] = []  # files written since the last `sync`
        # wall time spent in `append` (rows and chunk files): what keeping the replay on disk costs the loop; the
        # files' fsync (`sync`) is part of the checkpoint that needs them, and counted with its write
        self.seconds = 0.0
        os.makedirs(self.folder, exist_ok=True)

    @staticmethod
    def row_nbytes(fields: dict[str, tuple[tuple, Any]]) -> int:
        """The bytes of one row of `fields`."""
        return sum(math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in fields.values())

    def path(self, index: int) -> str:
        return os.path.join(self.folder, f"chunk_{index:08d}.rows")

    def append(self, row: dict[str, Any]) -> None:
        """One stored step (every field, by name); the chunk's file is written when it is full."""
        if self.failed is not None:
            return
        start, offset = time.perf_counter(), self.position % self.chunk_rows
        for name, array in self.buffer.items():
            array[offset] = row[name]
        self.position += 1
        if offset == self.chunk_rows - 1:
            self._write(self.position // self.chunk_rows - 1)
        self.seconds += time.perf_counter() - start

    def _write(self, index: int) -> None:
        """The full buffer as chunk `index`'s file: written to a temporary file and renamed (a killed process leaves
        the old file or none); `sync` makes it durable before a checkpoint relies on it."""
        parts = [memoryview(np.ascontiguousarray(array)).cast("B") for array in self.buffer.values()]
        crc = 0
        for part in parts:
            crc = zlib.crc32(part, crc)
        self.crcs[index] = crc
        data = sum(len(part) for part in parts)
        path, tmp = self.path(index), None
        try:
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".tmp_", suffix=".rows")
            with os.fdopen(fd, "wb") as f:
                for part in parts:  # the fields' bytes one after another, in the order of `fields`
                    f.write(part)
            os.replace(tmp, path)
            tmp = None
        except OSError as exc:  # a full disk, a quota: the run goes on, its replay in memory only
            self.failed = exc.strerror or str(exc)
            free = free_bytes(self.folder)
            self.say(
                f"warning: could not write {path} (needs {_size_text(data)}, "
                f"{'unknown' if free is None else _size_text(free)} free there): {self.failed}; the replay is kept "
                f"in memory only from here on, and checkpoints no longer hold it (a resumed run starts with an "
                f"empty replay)"
            )
        finally:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.remove(tmp)
        if self.failed is None:
            self.unsynced.append(path)

    def sync(self) -> None:
        """The chunk files written since the last call flushed to disk (fsync), as a checkpoint needs them."""
        for path in self.unsynced:
            with contextlib.suppress(FileNotFoundError):
                fd = os.open(path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        if self.unsynced:
            with contextlib.suppress(OSError):
                fd = os.open(self.folder, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        self.unsynced = []

    def state(self, keep_from: int) -> dict | None:
        """What a checkpoint holds of the log: where the stream stands, the first row the replay needs (`keep_from`),
        the CRC-32 of each chunk file from there on, and the rows of the chunk still filling (tensors: loads with
        weights_only=True); None once a file could not be written. Calls `sync` first."""
        if self.failed is not None:
            return None
        self.sync()
        filled = self.position % self.chunk_rows
        first, last = keep_from // self.chunk_rows, self.position // self.chunk_rows
        return {
            "position": self.position,
            "keep_from": int(keep_from),
            "chunk_rows": self.chunk_rows,
            "crcs": {str(i): self.crcs[i] for i in range(first, last)},
            "partial": {name: torch.from_numpy(array[:filled].copy()) for name, array in self.buffer.items()},
        }

    def commit(self, state: dict) -> None:
        """Once the checkpoint holding `state` is written whole: remove the chunk files it does not need, those
        whose rows all come before its `keep_from` (the replay dropped them) and any written beyond its position by a
        run that was killed (the stream goes on from the checkpoint, and writes them again)."""
        first = state["keep_from"] // self.chunk_rows
        last = (
            state["position"] // self.chunk_rows
        )  # the chunk still filling, and later ones: not the checkpoint's
        for entry in os.listdir(self.folder):
            if entry.startswith("chunk_") and entry.endswith(".rows"):
                index = int(entry[len("chunk_") : -len(".rows")])
                if index < first or (index >= last and index not in self.crcs):
                    with contextlib.suppress(FileNotFoundError):
                        os.remove(os.path.join(self.folder, entry))
        self.crcs = {i: crc for i, crc in self.crcs.items() if i >= first}

    def rows(self, state: dict):
        """A checkpoint's rows from its `keep_from` to its position, chunk by chunk: (the first row's position, a
        dict of arrays). Each file is checked against its CRC-32 (ReplayLogInvalid otherwise); the last rows come
        from the checkpoint itself."""
        chunk_rows, keep_from, position = state["chunk_rows"], state["keep_from"], state["position"]
        for index in range(keep_from // chunk_rows, position // chunk_rows):
            path = self.path(index)
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except FileNotFoundError:
                raise ReplayLogInvalid(f"{path} is missing, and the checkpoint's replay needs it") from None
            if zlib.crc32(data) != state["crcs"][str(index)]:
                raise ReplayLogInvalid(
                    f"{path} does not match the CRC-32 the checkpoint recorded for it (changed since it was written)"
                )
            chunk, offset = {}, 0
            for name, (shape, dtype) in self.fields.items():
                count = chunk_rows * math.prod(shape)
                chunk[name] = np.frombuffer(data, dtype, count, offset).reshape(chunk_rows, *shape)
                offset += count * dtype.itemsize
            first = index * chunk_rows
            skip = max(keep_from - first, 0)
            yield first + skip, {name: array[skip:] for name, array in chunk.items()}
        start = position - position % chunk_rows
        partial = {name: value.numpy() for name, value in state["partial"].items()}
        skip = max(keep_from - start, 0)
        if position > start + skip:
            yield start + skip, {name: array[skip:] for name, array in partial.items()}

    def resume(self, state: dict) -> None:
        """Go on from a checkpoint's `state`: the stream's position, the CRC-32s of the files it keeps, and the
        chunk still filling back in the buffer; files the killed run wrote after it are removed (`commit`)."""
        if state["chunk_rows"] != self.chunk_rows:
            raise ReplayLogInvalid(
                f"the checkpoint's replay has chunks of {state['chunk_rows']} rows, not {self.chunk_rows}"
            )
        self.position = int(state["position"])
        self.crcs = {int(i): crc for i, crc in state["crcs"].items()}
        filled = self.position % self.chunk_rows
        for name, array in self.buffer.items():
            array[:filled] = state["partial"][name].numpy()
        self.commit(state)

    def disk_nbytes(self, capacity_rows: int) -> int:
        """About the most disk the log takes: `capacity_rows` rows, the chunk on each side of them, and the rows one
        checkpoint interval writes are not counted (the caller adds them)."""
        return (capacity_rows + 2 * self.chunk_rows) * self.row_nbytes(self.fields)


if __name__ == "__main__":
    print(
        "memory_utils.py is the library a run imports and has no command line: the command line (report, allocator, "
        "wait, analyze) is memory_analysis.py (python memory_analysis.py --help).",
        file=sys.stderr,
    )
    raise SystemExit(2)
