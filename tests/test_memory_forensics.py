"""Forensics: snapshot analysis on snapshots in torch's real schema, stage probes, OOM reports."""

import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch

import memory_analysis as ma
import memory_utils as mu
from conftest import ROOT

CUDA = torch.cuda.is_available()
KB = 1024
SEGMENT = 2 * 1024 * 1024  # small-pool segments are 2 MiB


def _frames(*sites):
    """Innermost first, as torch records them: library frames around the project's own frame."""
    frames = [
        {
            "filename": "/usr/lib/python3.11/site-packages/torch/nn/modules/linear.py",
            "line": 125,
            "name": "forward",
        }
    ]
    frames += [{"filename": f"/home/user/project/{f}", "line": line, "name": name} for f, line, name in sites]
    return frames


def _snapshot(leaky_blocks, steady_blocks=50, leak_site=("dreamer_atari.py", 412, "observe")):
    """One allocator snapshot: `leaky_blocks` 4 KiB blocks from one site, plus steady small and large blocks."""
    segments, address = [], 0x7F0000000000

    def add_segment(kind, total, blocks):
        nonlocal address
        seg_blocks, offset = [], 0
        for size, state, frames in blocks:
            seg_blocks.append(
                {
                    "address": address + offset,
                    "size": size,
                    "requested_size": size,
                    "state": state,
                    "frames": frames,
                }
            )
            offset += size
        if offset < total:
            seg_blocks.append(
                {
                    "address": address + offset,
                    "size": total - offset,
                    "requested_size": 0,
                    "state": "inactive",
                    "frames": [],
                }
            )
        allocated = sum(b["size"] for b in seg_blocks if b["state"] != "inactive")
        segments.append(
            {
                "device": 0,
                "address": address,
                "total_size": total,
                "allocated_size": allocated,
                "active_size": allocated,
                "requested_size": allocated,
                "stream": 0,
                "segment_type": kind,
                "blocks": seg_blocks,
            }
        )
        address += total

    leak = [
        (4 * KB, "active_allocated", _frames(leak_site, ("dreamer_atari.py", 900, "main")))
    ] * leaky_blocks
    steady = [
        (4 * KB, "active_allocated", _frames(("dreamer_atari.py", 300, "train_world_model")))
    ] * steady_blocks
    small = leak + steady
    per_segment = SEGMENT // (4 * KB)
    for i in range(0, len(small), per_segment):
        add_segment("small", SEGMENT, small[i : i + per_segment])
    add_segment(
        "large",
        64 * 1024 * 1024,
        [
            (40 * 1024 * 1024, "active_allocated", _frames(("dreamer_atari.py", 200, "build_agent"))),
            (8 * 1024 * 1024, "active_pending_free", _frames(("dreamer_atari.py", 310, "train_world_model"))),
        ],
    )
    traces = [
        [
            {
                "action": "alloc",
                "addr": 0x7F0000000000,
                "size": 4 * KB,
                "stream": 0,
                "time_us": 1,
                "frames": _frames(leak_site),
            }
        ]
    ]
    return {"segments": segments, "device_traces": traces}


def _write_series(directory, blocks_per_snapshot, steps=(1000, 2000, 3000, 4000, 5000)):
    directory.mkdir(parents=True, exist_ok=True)
    for step, blocks in zip(steps, blocks_per_snapshot):
        with open(directory / f"snapshot_step_{step}.pickle", "wb") as f:
            pickle.dump(_snapshot(blocks), f)


def test_growing_call_site_is_named_with_the_right_slope(tmp_path):
    snaps = tmp_path / "memory_snapshots"
    _write_series(snaps, [1000, 2000, 3000, 4000, 5000])  # +1000 blocks of 4 KiB per 1k steps
    analysis = ma.analyze_snapshots(snaps)
    assert analysis.steps == [1000, 2000, 3000, 4000, 5000]
    assert analysis.slopes["active_blocks"] == pytest.approx(1000)
    assert analysis.slopes["small_pool_active_mb"] == pytest.approx(1000 * 4 / 1024)
    assert analysis.slopes["large_pool_active_mb"] == pytest.approx(0)
    top = analysis.top_sites[0]
    assert top["site"] == "dreamer_atari.py:412:observe"  # innermost project frame, not torch's linear.py
    assert top["growth_blocks"] == 4000 and top["growth_mb"] == pytest.approx(4000 * 4 / 1024)
    assert analysis.verdict.startswith("leak") and "no_grad" in analysis.verdict
    assert analysis.rows[0]["large_pool_active_mb"] == pytest.approx(
        48
    )  # pending-free blocks count as active


def test_steady_series_reads_as_steady(tmp_path):
    snaps = tmp_path / "memory_snapshots"
    _write_series(snaps, [1500] * 5)
    analysis = ma.analyze_snapshots(snaps)
    assert analysis.verdict.startswith("steady")
    assert all(abs(v) < 1e-9 for v in analysis.slopes.values())


class _Exploit:
    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_malicious_and_corrupt_pickles_are_refused_and_skipped(tmp_path, capsys):
    snaps = tmp_path / "memory_snapshots"
    _write_series(snaps, [100, 200, 300], steps=(1000, 2000, 3000))
    marker = tmp_path / "pwned"
    exploit = _Exploit()
    exploit.marker = marker
    (snaps / "snapshot_step_4000.pickle").write_bytes(pickle.dumps({"segments": [exploit]}))
    good = (snaps / "snapshot_step_1000.pickle").read_bytes()
    (snaps / "snapshot_step_5000.pickle").write_bytes(good[: len(good) // 2])  # truncated
    with pytest.raises(ma.UnsafeSnapshotError):
        ma.load_snapshot(snaps / "snapshot_step_4000.pickle")
    analysis = ma.analyze_snapshots(snaps)
    assert not marker.exists()  # the pickle's code never ran
    assert analysis.steps == [1000, 2000, 3000]
    assert any("snapshot_step_4000" in s and "refused" in s for s in analysis.skipped)
    assert any("snapshot_step_5000" in s and "unreadable" in s for s in analysis.skipped)
    assert "skipped snapshot_step_5000" in capsys.readouterr().err


def test_analyze_cli_writes_the_report_and_compares_with_logged_scalars(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    run_dir = tmp_path / "runs" / "demo"
    snaps = run_dir / "memory_snapshots"
    blocks = [1000, 2000, 3000, 4000, 5000]
    _write_series(snaps, blocks)
    writer = SummaryWriter(str(run_dir))
    for step, n in zip((1000, 2000, 3000, 4000, 5000), blocks):
        allocated = ma.summarize_snapshot(_snapshot(n))["totals"][
            "allocated_mb"
        ]  # what memory_allocated() says
        writer.add_scalar(mu.KEY_GPU_ALLOC_MB, allocated, step)
        writer.add_scalar(mu.KEY_GPU_RESERVED_MB, 1.0, step)  # deliberately disagrees
    writer.close()
    out = tmp_path / "analysis"
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "memory_analysis.py"),
            "analyze",
            "--snapshots-dir",
            str(snaps),
            "--events-dir",
            str(run_dir),
            "--out-dir",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert result.returncode == 0, result.stderr
    assert "slope per 1k steps" in result.stdout and "dreamer_atari.py:412:observe" in result.stdout
    assert "leak:" in result.stdout
    for name in ("report.md", "report.html", "growth.csv", "memory.png", "segments.txt", "timeline.html"):
        assert (out / name).stat().st_size > 0, name
    page = (out / "report.html").read_text()
    assert "<script" not in page and "http" not in page and "data:image/png;base64," in page  # opens offline
    assert "dreamer_atari.py:412:observe" in page
    # every segment is listed, the 2 MiB small-pool ones too (torch's segsum leaves out those under 20 MiB)
    assert (out / "segments.txt").read_text().count(" small ") == len(
        ma.load_snapshot(snaps / "snapshot_step_5000.pickle")["segments"]
    ) - 1
    rows = (out / "growth.csv").read_text().strip().splitlines()
    assert rows[0].startswith("step,active_mb") and len(rows) == 6
    report = (out / "report.md").read_text()
    alloc_row = next(line for line in report.splitlines() if line.startswith("| 3000 |") and "yes" in line)
    assert "NO" in alloc_row  # the reserved column disagrees, the allocated one agrees


def test_analyze_cli_bad_path_is_one_line(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "memory_analysis.py"),
            "analyze",
            "--snapshots-dir",
            str(tmp_path / "nope"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "does not exist" in result.stderr and "Traceback" not in result.stderr


# --------------------------------------------------------------------------------------- stage probes
def test_probes_name_the_stage_that_keeps_memory():
    # every array here is larger than glibc's largest mmap threshold (32 MB), so it is its own mapping whatever
    # threshold this process has drifted to, and RssAnon follows it exactly
    probes = mu.StageProbes(enabled=True, device="cpu")
    kept = []
    for i in range(12):
        probes("loop_start")
        probes("after_collect")
        kept.append(np.ones(40 * 1024 * 1024 // 8))  # the bug: 40 MB per iteration kept at the sample stage
        probes("after_sample")
        activations = np.ones(64 * 1024 * 1024 // 8)  # transient: freed after backward
        probes("after_encoder")
        probes("after_rssm")
        probes("after_decoder")
        del activations
        probes("after_backward")
        probes("after_optimizer_step")
        probes.end_iteration(i * 100)
    retained = probes.retained_per_stage()
    assert max(retained, key=retained.get) == "after_sample"
    assert retained["after_sample"] == pytest.approx(40.0, abs=1.0)
    scalars = probes.scalars()
    assert scalars["debug/probe/baseline_slope_mb_per_1k"] == pytest.approx(400.0, rel=0.25)
    assert {f"debug/probe/{s}_mb" for s in mu.StageProbes.STAGES} <= set(scalars)
    assert "'after_sample'" in probes.verdict()


def test_probes_disabled_cost_nothing_and_bad_stage_is_refused():
    off = mu.StageProbes(enabled=False)
    off("loop_start")
    off.end_iteration(1)
    assert off.scalars() == {}
    with pytest.raises(ValueError, match="unknown probe stage"):
        mu.StageProbes(enabled=True)("after_lunch")


# --------------------------------------------------------------------------------------- snapshots and OOM
@pytest.mark.skipif(CUDA, reason="checks the CPU fallback; the CUDA path is exercised on a GPU machine")
def test_snapshots_on_cpu_warn_once_and_write_nothing(tmp_path, capsys):
    snaps = mu.MemorySnapshots(str(tmp_path), every=10)
    assert snaps.maybe_dump(10) is None and snaps.maybe_dump(20) is None
    snaps.close()
    assert not (tmp_path / "memory_snapshots").exists()
    err = capsys.readouterr().err
    assert err.count("memory snapshots need CUDA") <= 1  # warn once per process
    with pytest.raises(ValueError, match="every"):
        mu.MemorySnapshots(str(tmp_path), every=-1)


@pytest.mark.skipif(not CUDA, reason="needs CUDA: recording allocator history")
def test_snapshots_on_cuda_are_written_and_readable(tmp_path):
    snaps = mu.MemorySnapshots(str(tmp_path), every=5, max_entries=1000)
    x = torch.ones(1024, device="cuda")
    assert snaps.maybe_dump(3) is None
    path = snaps.maybe_dump(5)
    snaps.close()
    assert path and ma.load_snapshot(path)["segments"]
    del x


def test_snapshots_record_python_frames_only_in_a_bounded_ring(tmp_path, monkeypatch):
    # CUDA cannot run here, so the recorder is stood in for; what is checked is how it is asked to record:
    # a bounded ring, and Python frames only (C++ frames cost minutes per dump to symbolise).
    calls = []
    monkeypatch.setattr(mu, "_cuda_ready", lambda: True)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **kw: calls.append((a, kw)))
    snaps = mu.MemorySnapshots(str(tmp_path), every=5, max_entries=1234)
    snaps.close()
    assert calls[0] == ((), {"max_entries": 1234, "stacks": "python"})
    assert calls[1] == ((), {"enabled": None})


@pytest.mark.skipif(CUDA, reason="checks the CPU fallback")
def test_oom_observer_is_not_attached_without_cuda(tmp_path):
    assert mu.install_oom_observer(str(tmp_path)) is False


ADVICE = "Flags that lower the peak: a smaller --batch-size."  # each script passes its own OOM_ADVICE


def test_oom_report_is_written_up_to_the_cuda_calls(tmp_path):
    exc = torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total capacity ..."
    )
    verdict = mu.LeakVerdict(True, "graph_retention", "memory leak suspected: graphs", {})
    diagnosis = mu.write_oom_report(str(tmp_path), exc, {mu.KEY_RSS_MB: 1234.0}, verdict, advice=ADVICE)
    report = json.loads((tmp_path / "oom" / "report.json").read_text())
    assert report["last_memory_report"] == {mu.KEY_RSS_MB: 1234.0}
    assert report["leak_verdict"]["cause"] == "graph_retention"
    assert "20 MiB" in diagnosis and diagnosis.endswith(ADVICE) and report["diagnosis"] == diagnosis
    assert (tmp_path / "oom" / "memory_summary.txt").exists()


def test_oom_diagnosis_explains_wsl_spill_and_contention():
    # the incident: 12.15 GiB allocated on a 6 GiB laptop card under WSL2
    wsl = mu.diagnose_oom(
        "Tried to allocate 2.00 GiB",
        allocated_mb=12.15 * 1024,
        reserved_mb=12.5 * 1024,
        free_mb=0.0,
        total_mb=6 * 1024,
        advice=ADVICE,
    )
    assert "2048 MiB" in wsl and "spilling into shared host memory" in wsl and "WSL2" in wsl
    # the A30 case: another process holds most of the card
    contended = mu.diagnose_oom(
        "Tried to allocate 512.00 MiB",
        allocated_mb=900,
        reserved_mb=1000,
        free_mb=300,
        total_mb=24 * 1024,
        advice=ADVICE,
    )
    assert "Another process holds a large share" in contended and "spilling" not in contended
    assert "cap" not in wsl and "cap" not in contended


def test_oom_diagnosis_names_a_per_process_cap():
    # torch adds "<size> allowed;" to the message when torch.cuda.set_per_process_memory_fraction is in force
    message = (
        "CUDA out of memory. Tried to allocate 100.00 MiB. GPU 0 has a total capacity of 79.19 GiB of which "
        "77.90 GiB is free. Including non-PyTorch memory, this process has 1.29 GiB memory in use. "
        "1.20 GiB allowed; Of the allocated memory 1.10 GiB is allocated by PyTorch, and 20.00 MiB is "
        "reserved by PyTorch but unallocated."
    )
    capped = mu.diagnose_oom(
        message,
        allocated_mb=1126,
        reserved_mb=1146,
        free_mb=77.9 * 1024,
        total_mb=79.19 * 1024,
        advice=ADVICE,
    )
    assert "100 MiB" in capped and "at most 1229 MiB" in capped and "per-process cap" in capped
    assert "Another process" not in capped and "spilling" not in capped


def test_probe_scalars_keep_stages_an_iteration_skipped():
    probes = mu.StageProbes(enabled=True)
    probes("loop_start")
    probes("after_encoder")  # an iteration with an update
    probes.end_iteration(1)
    probes("loop_start")  # prefill: no update this time
    probes.end_iteration(2)
    assert {"debug/probe/loop_start_mb", "debug/probe/after_encoder_mb"} <= set(probes.scalars())


def _memo_bomb() -> bytes:
    """Nine bytes: an empty dict, then a memo index of 2**27, which makes CPython's unpickler allocate a memo of
    that size (1 GiB of pointers) before it notices anything (gh-115952)."""
    return b"\x80\x04}r" + (2**27).to_bytes(4, "little") + b"."


def _empty_sets_bomb() -> bytes:
    """5 MB of empty sets in one list: about 1.2 GB once built."""
    return b"\x80\x04]" + b"(" + b"\x8f" * 5_000_000 + b"e."


def _shared_blocks_bomb() -> bytes:
    """A few dozen KB whose memo references describe 10^4 segments sharing one list of 10^4 blocks, each with the
    same 10^3 frames: 10^8 blocks for an analysis that walks them."""
    frames = [{"filename": "/usr/lib/python3.11/site-packages/torch/x.py", "line": 1, "name": "f"}] * 1000
    block = {"size": 512, "requested_size": 512, "state": "active_allocated", "frames": frames}
    blocks = [block] * 10_000
    segment = {"total_size": 2**21, "segment_type": "small", "blocks": blocks}
    return pickle.dumps({"segments": [segment] * 10_000, "device_traces": []})


@pytest.mark.parametrize(
    "bomb, why",
    [
        (_memo_bomb, "memo index"),
        (_empty_sets_bomb, "containers"),
        (_shared_blocks_bomb, "share one list of blocks"),
    ],
)
def test_snapshot_bombs_are_refused_in_one_line_with_bounded_memory(tmp_path, bomb, why):
    snaps = tmp_path / "memory_snapshots"
    snaps.mkdir()
    (snaps / "snapshot_step_1000.pickle").write_bytes(bomb())
    assert (snaps / "snapshot_step_1000.pickle").stat().st_size < 6_000_000
    # the peak is VmHWM, this process's own: Linux's ru_maxrss also counts the parent's resident memory at the fork
    # (a test worker's, 1 GB late in the suite), whatever the child does after exec
    script = (
        "import runpy, sys\n"  # noqa: UP031 - %r quotes the path as Python source
        "sys.argv = ['memory_analysis.py', 'analyze', '--snapshots-dir', sys.argv[1]]\n"
        "try:\n    runpy.run_path(sys.argv[0] if False else %r, run_name='__main__')\n"
        "finally:\n"
        "    peak = [line.split()[1] for line in open('/proc/self/status') if line.startswith('VmHWM')][0]\n"
        "    print('maxrss_kb', peak, file=sys.stderr)\n" % str(ROOT / "memory_analysis.py")
    )
    done = subprocess.run(
        [sys.executable, "-c", script, str(snaps)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-2000:]
    lines = [line for line in done.stderr.splitlines() if not line.startswith("maxrss_kb")]
    assert lines[0].startswith("warning: skipped snapshot_step_1000.pickle: refused (") and why in lines[0], (
        lines
    )
    assert "no readable snapshot_step_<N>.pickle files" in lines[1] and len(lines) == 2
    maxrss_mb = int(done.stderr.split("maxrss_kb ")[1].split()[0]) / 1024
    assert maxrss_mb < 1024, f"the refusal itself took {maxrss_mb:.0f} MB"


def test_a_real_snapshot_passes_the_stream_check(tmp_path):
    path = tmp_path / "snapshot_step_1000.pickle"
    path.write_bytes(pickle.dumps(_snapshot(500)))
    ma.check_snapshot_stream(path)
    assert ma.summarize_snapshot(ma.load_snapshot(path))["totals"]["active_blocks"] > 500


def _holders_snapshot(expandable=False, cpp_first=False):
    """One OOM-time snapshot: optimizer state, parameters, a replay batch and activations, as torch records them."""

    def frames(*python):
        out = [
            {"filename": "/usr/lib/python3.11/site-packages/torch/" + f, "line": 1, "name": n}
            for f, n in python
        ]
        out += [{"filename": "/home/user/project/dreamer_atari.py", "line": 1000, "name": "main"}]
        if cpp_first:  # torch's default stacks="all": C++ frames first, the allocator's own innermost
            out = [
                {"filename": "c10/cuda/CUDACachingAllocator.cpp", "line": 1, "name": "malloc"},
                {"filename": "??", "line": 0, "name": "at::empty"},
            ] + out
        return out

    blocks = [
        (300, frames(("optim/adam.py", "_init_group"))),
        (120, frames(("nn/modules/module.py", "_apply"))),
        (
            40,
            [{"filename": "/home/user/project/dreamer_atari.py", "line": 1210, "name": "batch_tensors"}]
            + frames(),
        ),
        (500, frames(("nn/modules/linear.py", "forward"))),
    ]
    segments = []
    for i, (mb, block_frames) in enumerate(blocks):
        size = mb * 1024 * 1024
        segments.append(
            {
                "device": 0,
                "address": i << 40,
                "total_size": size,
                "allocated_size": size,
                "active_size": size,
                "requested_size": size,
                "stream": 0,
                "segment_type": "large",
                "is_expandable": expandable,
                "blocks": [
                    {
                        "address": i << 40,
                        "size": size,
                        "requested_size": size,
                        "state": "active_allocated",
                        "frames": block_frames,
                    }
                ],
            }
        )
    return {"segments": segments, "device_traces": [[]]}


def test_analyze_reads_one_oom_snapshot_and_says_what_holds_the_memory(tmp_path):
    path = tmp_path / "oom" / "snapshot_at_oom.pickle"
    path.parent.mkdir()
    path.write_bytes(pickle.dumps(_holders_snapshot(cpp_first=True)))
    outputs = []
    for hash_seed in ("0", "1"):  # the order is by size, never by hashing
        done = subprocess.run(
            [sys.executable, str(ROOT / "memory_analysis.py"), "analyze", str(path)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONHASHSEED": hash_seed},
        )
        assert done.returncode == 0, done.stderr
        outputs.append(done.stdout)
    assert outputs[0] == outputs[1]
    held = outputs[0].split("What holds the memory at that moment:")[1].splitlines()[1:5]
    assert [line.split(":")[0].strip() for line in held] == [
        "activations (forward)",
        "optimizer state",
        "parameters (model built or moved)",
        "replay batches (copied to the device)",
    ]
    # C++ frames first (stacks="all"): still attributed to the user's innermost Python frame
    assert "dreamer_atari.py:1210:batch_tensors: 40.00 MB" in outputs[0]
    assert "CUDACachingAllocator" not in outputs[0]
    assert "one snapshot (snapshot_at_oom.pickle): 960 MB active" in outputs[0]
    assert (path.parent / "snapshot_at_oom_analysis" / "report.html").exists()


def test_a_single_jump_in_reserved_memory_is_not_fragmentation(tmp_path):
    """The H100 forensics run: reserved went 782 -> 824 MB once (a new segment) and stayed: no growth."""
    snaps = tmp_path / "memory_snapshots"
    _write_series(snaps, [1500] * 6, steps=(500, 1000, 1500, 2000, 2500, 3000))
    for step in (1500, 2000, 2500, 3000):
        path = snaps / f"snapshot_step_{step}.pickle"
        data = ma.load_snapshot(path)
        data["segments"].append(
            {
                "device": 0,
                "address": 1 << 45,
                "total_size": 42 * 1024 * 1024,
                "segment_type": "large",
                "blocks": [],
            }
        )
        path.write_bytes(pickle.dumps(data))
    analysis = ma.analyze_snapshots(snaps)
    assert analysis.verdict.startswith("steady"), analysis.verdict


@pytest.mark.parametrize("expandable", [False, True])
def test_fragmentation_advice_knows_whether_expandable_segments_are_on(tmp_path, expandable):
    snaps = tmp_path / "memory_snapshots"
    snaps.mkdir()
    for i, step in enumerate(range(1000, 7000, 1000)):
        data = _holders_snapshot(expandable=expandable)
        data["segments"].append(
            {
                "device": 0,
                "address": 1 << 45,
                "total_size": (10 + 20 * i) * 1024 * 1024,
                "segment_type": "large",
                "is_expandable": expandable,
                "blocks": [],
            }
        )
        (snaps / f"snapshot_step_{step}.pickle").write_bytes(pickle.dumps(data))
    verdict = ma.analyze_snapshots(snaps).verdict
    assert verdict.startswith("fragmentation"), verdict
    assert ("expandable_segments:True" in verdict) is not expandable
