"""Shared test set-up: the repo root on sys.path, wandb offline, quiet and deterministic torch."""

import gc
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Tests never touch the network; child processes inherit these.
os.environ["WANDB_MODE"] = "offline"
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("PYTHONHASHSEED", "0")


def _pin_malloc_mmap_threshold() -> None:
    """Make USS follow live memory in memory tests.

    glibc raises its mmap threshold (up to 32 MB) after large blocks are freed; from then on large arrays
    come from the heap and reuse pages an earlier test freed but never returned, so USS stops moving when
    memory is allocated. Pinning the threshold at glibc's default (128 KiB) turns that adaptation off:
    every large array is its own mapping, returned to the kernel when freed. Same as MALLOC_MMAP_THRESHOLD_.
    """
    import ctypes
    import ctypes.util

    if not sys.platform.startswith("linux"):
        return
    name = ctypes.util.find_library("c")
    if name:
        try:
            ctypes.CDLL(name).mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
        except (OSError, AttributeError):  # not glibc
            pass


_pin_malloc_mmap_threshold()


def _triton_interprets_without_cuda() -> None:
    """Without CUDA, Triton's interpreter runs the fused scan's kernels on CPU tensors
    (tests/test_dreamer_fused_scan.py). Triton reads TRITON_INTERPRET when it is imported, so it is set here, before
    any test can import it; with CUDA the kernels compile as a run's do."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")


_triton_interprets_without_cuda()


def _bind_the_script() -> None:
    if "dreamer_atari" in sys.modules:
        sys.modules["dreamer_atari"].kernels_module()


@pytest.fixture(autouse=True, scope="module")
def _kernels_bound_to_the_script_for_the_module():
    """dreamer_kernels.py computes and checks against the Part 1 that a script hands it (`bind`); a test that imported
    a changed copy of the script left the copy's there, so each test module, and each test, starts with
    dreamer_atari.py's own (a module's own fixtures may build with it first)."""
    _bind_the_script()
    yield


@pytest.fixture(autouse=True)
def _kernels_bound_to_the_script(_kernels_bound_to_the_script_for_the_module):
    _bind_the_script()
    yield


@pytest.fixture(autouse=True, scope="module")
def _garbage_collector_skips_what_earlier_modules_left():
    """Move every object alive when a test module starts (libraries, compiled graphs, earlier modules' state) out
    of the garbage collector's sight, after one collection. `memory_utils.memory_report` collects garbage before
    each figure; in a long test session that walk over everything ever imported took about a second per figure.
    Garbage is still collected: only what a module creates is walked."""
    gc.collect()
    gc.freeze()
    yield


def record_memory_order(monkeypatch) -> list[str]:
    """What a run does, in order, of: choosing one malloc arena, opening its TensorBoard writer (whose thread starts
    then), flushing that writer, and taking a memory report."""
    from torch.utils.tensorboard import SummaryWriter

    import memory_utils as mu

    events: list[str] = []
    one_arena, init, flush, report = (
        mu.one_malloc_arena,
        SummaryWriter.__init__,
        SummaryWriter.flush,
        mu.memory_report,
    )

    def record(name, fn):
        def wrapped(*args, **kwargs):
            events.append(name)
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(mu, "one_malloc_arena", record("one_arena", one_arena))
    monkeypatch.setattr(SummaryWriter, "__init__", record("writer", init))
    monkeypatch.setattr(SummaryWriter, "flush", record("flush", flush))
    monkeypatch.setattr(mu, "memory_report", record("report", report))
    return events


def assert_memory_order(events: list[str]) -> None:
    # one heap for every thread before the writer's thread exists, so the trim can return what that thread freed
    assert "one_arena" in events and events.index("one_arena") < events.index("writer"), events
    # every reading is taken with the writer's queue written out (no GIF record in flight counted as growth)
    reports = [i for i, name in enumerate(events) if name == "report"]
    assert reports and all(events[i - 1] == "flush" for i in reports), events


def flip_200_bytes_inside_a_tensor(path) -> str:
    """Flip 200 bytes in the middle of the largest tensor a torch.save archive (a zip file, one stored record per
    tensor, `<name>/data/N`) holds; returns that record's name. torch loads the result without a word."""
    import struct
    import zipfile

    with zipfile.ZipFile(path) as archive:
        info = max((i for i in archive.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    assert info.compress_type == zipfile.ZIP_STORED and info.file_size >= 400
    data = bytearray(Path(path).read_bytes())
    name_length, extra_length = struct.unpack("<HH", data[info.header_offset + 26 : info.header_offset + 30])
    start = info.header_offset + 30 + name_length + extra_length + info.file_size // 2 - 100
    data[start : start + 200] = bytes(b ^ 0xFF for b in data[start : start + 200])
    Path(path).write_bytes(bytes(data))
    return info.filename


def pytest_sessionfinish(session, exitstatus):
    """What `_garbage_collector_skips_what_earlier_modules_left` froze goes back to the garbage collector at the end,
    so that an extension that counts its objects still alive at exit (Triton's) sees them freed instead of printing
    a leak report."""
    gc.unfreeze()


# The slowest files first (from the suite's --durations on a 2-core CPU): pytest-xdist (--dist loadfile) hands each
# worker a whole file as it frees up, in the order collected, so a long file collected late leaves the other worker
# idle at the end. Longest first keeps both busy to the last.
SLOW_FILES_FIRST = (
    "test_benchmark_quick.py",
    "test_learning_proof.py",
    "test_sweep.py",
    "test_gpu_stages.py",
    "test_dreamer_run.py",
    "test_sweep_slurm.py",
    "test_modifying_dreamer.py",
    "test_dreamer_identical_resume.py",
)


def pytest_collection_modifyitems(config, items):
    """Collect the files of SLOW_FILES_FIRST first, in that order; each file's tests keep their order."""
    rank = {name: i for i, name in enumerate(SLOW_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))
