"""The update variants at DreamerV3's Atari100k batch (B16 x T64), on one real replayed Pong batch, each region by
region.

    python dev/gpu/update_variants.py --out PATH                        # CUDA
    python dev/gpu/update_variants.py --out PATH --device cpu --quick   # the same steps, tiny, without a GPU

`gpu_stages.py --stage update` runs it in its own process with a time cap. The variants: first `training`, the
script's defaults plus what the Pong stage turns on (`common.CUDA_FAST_PATH`), the update the Pong run trains with;
then `gpu_stages.TRAINING_VARIANTS` (name, Args field overrides on top of `training`: bf16, the fused scan, Part 1
alone, compile, Part 1 compiled), then `gpu_stages.UPDATE_VARIANTS` (overrides on top of every fast path off,
`gpu_stages.FAST_PATHS_OFF`). A variant that names an Args field this version of dreamer_atari.py lacks is reported
as not available and skipped, and so is one this device cannot run (CUDA graphs or the fused scan on a CPU).

First the FLOPs of one update, by region (`count_flops`: torch's FLOP counter on the CPU at a small batch, scaled).
For each variant: its agent built by the script's `build_agent` with its fast paths (`speed_up_agent`, which
compiles with `compile`; what it trained with, whatever it asked for, is in `installed`, `kernel_paths_installed`
and `checks`), its parts labelled by region (`update_regions.labelled`), its update steps by
`make_update_steps` (captured in CUDA graphs by `CudaGraphed` with `cudagraph`), fed as the training loop feeds them
(`batch_tensors`: on CUDA from pinned memory, without blocking). Every warm-up call is timed (the first ones
compile and capture), then `--reps` updates, each followed by a device synchronisation; the median is the update as
training runs it. One more update runs under torch.profiler: its CUDA kernels (on a CPU, the aten operations one
update dispatches, counted by a TorchDispatchMode, and labelled so). Peak GPU memory is the allocator's peak over the
variant. PATH is rewritten after each variant, so a run stopped early keeps what it measured.

The regions (`regions`: kernels, busy ms, wall ms for each of `update_regions.REGIONS`; `regions_timed_as` says how
for each variant). A captured graph replays without Python, so nothing labels its kernels as it runs: the last call
before capture runs the same function eagerly and is profiled with the labels on (each kernel in the region of the
launch that started it), and the profiled replay's kernels take the regions of the same kernels of that call, matched
by name in order (`align`). Busy time is a region's kernels' durations summed; wall time its share of the replay's
GPU timeline (`timeline`: from the first kernel's start to the last one's end, the idle time before a kernel charged
to its region); they sum to that span, which the update's median exceeds by the host's share. Where the profiler sees
nothing inside a replay, the eager call's own timeline stands in (its gaps are launches the graph does not make). An
uncaptured variant's profiled update is labelled directly. On a CPU: the aten operations each region dispatches, and
the times of those a profile sees called from Python or the autograd engine.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import io
import itertools
import json
import os
import re
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import memory_utils as mu

mu.configure_allocator(verbose=False)  # what dreamer_atari.main does first: the same allocator as training

import numpy as np
import torch
import torch._dynamo
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.tensorboard import SummaryWriter

import dreamer_atari as da
from benchmark import bench_utils
from benchmark.common import ATARI100K_BATCH, CUDA_FAST_PATH, TINY_MODEL_FIELDS, code_version
from benchmark.ours_dreamer import fill_replay
from dev.gpu import update_regions
from dev.gpu.gpu_stages import FAST_PATHS_OFF, KERNEL_PATHS, TRAINING_VARIANTS, UPDATE_VARIANTS, variant_names

MB = 2.0**20
# --quick: the plumbing only
QUICK_UPDATE_MODEL = {**TINY_MODEL_FIELDS, "batch_size": 4, "sequence_length": 10}
ARGS_FIELDS = {field.name for field in dataclasses.fields(da.Args)}


class OpCounter(TorchDispatchMode):
    """Counts the aten operations dispatched while it is active (forward and backward), as update_regions.py counts
    them: views, and a profiler range's own enter and exit, left out (they launch no kernel)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        self.count += not (
            func.is_view
            or name in update_regions.NOT_KERNELS
            or name.startswith(update_regions.NOT_KERNEL_NAMESPACES)
        )
        return func(*args, **(kwargs or {}))


def variant_args(
    base: da.Args, overrides: dict, on_cuda: bool, training: bool = False, quick: bool = False
) -> tuple[da.Args | None, str]:
    """The Args of one variant, or None and why it cannot run here."""
    missing = sorted(set(overrides) - ARGS_FIELDS)
    if missing:
        return None, f"not available in this version (dreamer_atari.Args has no {', '.join(missing)})"
    if not on_cuda and (
        overrides.get("cudagraph")
        or overrides.get("precision") == "fp16"
        or overrides.get("fused_scan") == "on"
    ):
        return None, "needs CUDA"
    if not on_cuda and quick and overrides.get("compile"):
        return (
            None,
            "compiling takes minutes on a CPU: --quick checks the other steps (name it in --variants to run it)",
        )
    if training:
        fast = {k: v for k, v in CUDA_FAST_PATH.items() if k in ARGS_FIELDS} if on_cuda else {}
        return dataclasses.replace(base, **{**fast, **overrides}), ""
    off = {k: v for k, v in FAST_PATHS_OFF.items() if k in ARGS_FIELDS}
    return dataclasses.replace(base, **{**off, **overrides}), ""


def apply_precision(args: da.Args, device: torch.device) -> None:
    """The process-wide settings dreamer_atari.main makes for a run (`seed_everything`: cuDNN's determinism and
    benchmark, TF32 matmuls on CUDA), set anew for each variant so that none inherits an earlier one's."""
    torch.set_float32_matmul_precision("highest")
    da.seed_everything(args, device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


GPU_WORK = (
    "kernel",
    "gpu_memcpy",
    "gpu_memset",
)  # the profiler's device activities that are work (not ranges)


def profile_update(update, device: torch.device, regions: update_regions.Regions) -> tuple[list[tuple], int]:
    """One call of `update` under torch.profiler, its parts labelled (`regions` recording): what it ran, each as
    (name, start us, end us, region), in order of start. On CUDA every GPU activity the profiler records (kernels,
    copies, fills; not the device's copies of `region:` ranges), each in the region of the launch that started it
    (the CUDA runtime call with the kernel's correlation id, or else the operation the profiler links it to, and up
    their parents: `update_regions.event_region`); the second value counts those found in neither (counted as
    "rest forward"). On a CPU the aten operations called from Python or the autograd engine (not from another aten
    operation; allocations and views left out), and 0."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof, regions.recording():
        update()
        sync(device)
    events = prof.events()
    items, unlinked = [], 0
    if device.type == "cuda":
        items, unlinked = device_work(events, regions)
    else:
        for event in events:
            if not event.name.startswith("aten::") or event.name in update_regions.NOT_KERNEL_EVENTS:
                continue
            parent = event.cpu_parent
            while parent is not None and not parent.name.startswith("aten::"):
                parent = parent.cpu_parent
            if parent is None:
                items.append(
                    (
                        event.name,
                        event.time_range.start,
                        event.time_range.end,
                        update_regions.event_region(event, regions),
                    )
                )
    items.sort(key=lambda item: (item[1], item[2]))
    return items, unlinked


def device_work(events, regions: update_regions.Regions) -> tuple[list[tuple], int]:
    """The GPU work among a CUDA profile's `events`, each as (name, start us, end us, region) in the region of the
    launch that started it (the runtime call with its correlation id, or else the operation the profiler links it
    to), and how many were found in neither ("rest forward")."""
    from torch.autograd import DeviceType

    launches, operations, annotations = {}, {}, set()
    for event in events:
        if event.device_type != DeviceType.CPU:
            continue
        if is_launch(event):
            launches[event.id] = event
        elif getattr(event, "is_user_annotation", False):
            annotations.add(event.name)
        elif getattr(event, "activity_type", None) in (None, "cpu_op"):
            operations.setdefault(event.id, event)
    items, unlinked = [], 0
    for event in events:
        activity = getattr(event, "activity_type", None)
        if (
            event.device_type != DeviceType.CUDA
            or activity not in (None, *GPU_WORK)
            # a range's copy on the device's timeline, not work
            or (
                activity is None
                and (event.name in annotations or event.name.startswith(update_regions.REGION_LABEL))
            )
        ):
            continue
        source = launches.get(event.id) or operations.get(getattr(event, "linked_correlation_id", 0))
        unlinked += source is None
        region = update_regions.event_region(source, regions) if source is not None else "rest forward"
        items.append((event.name, event.time_range.start, event.time_range.end, region))
    return items, unlinked


def is_launch(event) -> bool:
    """A CUDA runtime or driver call (cudaLaunchKernel, cuLaunchKernel, cudaMemcpyAsync, ...): the profiler gives it
    the correlation id of the GPU work it started. By its activity, or by its name where this torch's profiler does
    not say the activity."""
    activity = getattr(event, "activity_type", None)
    if activity is not None:
        return activity in ("cuda_runtime", "cuda_driver")
    return re.match(r"cu(da)?[A-Z]", event.name) is not None


def align(reference: list[str], names: list[str], window: int = 4, lookahead: int = 64) -> list[int | None]:
    """For each of `names` (a graph replay's kernels, in order), the index of the same kernel in `reference` (the
    kernels of the eager call it was captured from): the same name in the same order, where one list may hold
    kernels the other lacks (a replay's copies into the graph's inputs). None where there is no counterpart."""
    matched: list[int | None] = [None] * len(names)
    i = j = 0
    while i < len(reference) and j < len(names):
        if reference[i] == names[j]:
            matched[j] = i
            i, j = i + 1, j + 1
            continue
        # the nearest place where the two agree again for `window` kernels: extra kernels in one of them
        for k in range(1, lookahead):
            if names[j + k : j + k + window] == reference[i : i + window]:
                j += k
                break
            if reference[i + k : i + k + window] == names[j : j + window]:
                i += k
                break
        else:
            i, j = i + 1, j + 1  # two different kernels in the same place: neither has a counterpart
    return matched


def timeline(items: list[tuple]) -> tuple[dict, float]:
    """(name, start us, end us, region) of each kernel, in order of start -> by region: kernels, busy ms (their
    durations summed) and wall ms (the timeline from the first kernel's start to the last one's end, each stretch
    charged to the kernel that ends it: the idle time before a kernel counts for its region); and that span (ms)."""
    by_region = {region: {"kernels": 0, "busy_ms": 0.0, "wall_ms": 0.0} for region in update_regions.REGIONS}
    reached = None
    for _, start, end, region in items:
        entry = by_region[region]
        entry["kernels"] += 1
        entry["busy_ms"] += (end - start) / 1e3
        if reached is None or end > reached:
            entry["wall_ms"] += (end - (start if reached is None else reached)) / 1e3
            reached = end
    span_ms = (reached - items[0][1]) / 1e3 if items else 0.0
    return by_region, span_ms


# kinds of GPU work by kernel name, the first that matches: cuDNN's convolutions before the GEMMs they are built on
KERNEL_KINDS = (
    ("convolution", ("conv", "fprop", "dgrad", "wgrad", "cudnn")),
    ("matmul", ("gemm", "gemv", "cutlass", "cublas", "xmma", "sm90_", "sm80_")),
    ("triton (compiled, fused)", ("triton",)),
    ("normalisation and reductions", ("norm", "reduce", "softmax", "scan", "cumsum")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "where", "fill", "copy")),
    ("memory copies and fills", ("memcpy", "memset")),
)


def kernel_times(kernels: list[tuple[str, float]], top: int = 25) -> dict:
    """{name, microseconds} of one update's kernels -> the GPU's busy time, split by kind of work (KERNEL_KINDS,
    `other` for the rest), and the `top` kernel names by total time with their counts: whether an update is made of
    long kernels or of many short ones, and which."""
    by_kind: dict[str, list[float]] = {}
    by_name: dict[str, list[float]] = {}
    for name, us in kernels:
        lowered = name.lower()
        kind = next((k for k, words in KERNEL_KINDS if any(w in lowered for w in words)), "other")
        for table, key in ((by_kind, kind), (by_name, name)):
            entry = table.setdefault(key, [0, 0.0])
            entry[0] += 1
            entry[1] += us
    ranked = sorted(by_name.items(), key=lambda item: -item[1][1])[:top]
    return {
        "busy_ms": round(sum(us for _, us in kernels) / 1e3, 4),
        "by_kind": {
            kind: {"kernels": count, "ms": round(us / 1e3, 4)}
            for kind, (count, us) in sorted(by_kind.items(), key=lambda item: -item[1][1])
        },
        "top": [
            {"name": name[:160], "kernels": count, "ms": round(us / 1e3, 4)} for name, (count, us) in ranked
        ],
    }


def count_aten_ops(update, device: torch.device) -> int:
    with OpCounter() as counter:
        update()
        sync(device)
    return counter.count


def count_region_ops(update, device: torch.device, regions: update_regions.Regions) -> dict[str, int]:
    """The aten operations one call of `update` dispatches, by region (update_regions.RegionCounter)."""
    counter = update_regions.RegionCounter(regions)
    with regions.recording(), counter:
        update()
        sync(device)
    return counter.by_region()


def measure_variant(
    args: da.Args, batch: dict, obs_shape, num_actions, device: torch.device, reps: int, warmup: int
) -> dict:
    """The variant's update timed, its kernels counted, and each region of it (`update_regions.REGIONS`) profiled:
    see `regions`. Dynamo forgets the graphs of the variants before (`torch._dynamo.reset`): a compiled variant
    traces its own, so its warm-up is not shortened by an earlier variant that compiled the same functions (Inductor's
    cache on disk still serves a graph compiled before)."""
    on_cuda = device.type == "cuda"
    torch._dynamo.reset()
    gc.collect()
    if on_cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(args.seed)
    agent = da.build_agent(args, obs_shape, num_actions, device)
    apply_precision(args, device)
    said = io.StringIO()
    with contextlib.redirect_stdout(said):
        da.speed_up_agent(agent, args)  # the fast paths a run trains with (and --compile with `compile`)
    print(said.getvalue(), end="", flush=True)
    regions = update_regions.Regions()
    with update_regions.labelled(
        agent, regions
    ):  # before the first update: compiled code traces the labels once
        figures = timed_variant(agent, args, batch, device, reps, warmup, regions)
    installed = installed_paths(agent)
    return figures | {
        "installed": installed,
        "kernel_paths_installed": kernel_paths_installed(installed),
        "checks": start_up_checks(installed),
        "speed_said": said.getvalue().splitlines(),
    }


def installed_paths(agent: da.Agent) -> dict:
    """What the variant trained with, whatever it asked for: each fast path of dreamer_kernels.py installed (and so
    through its start-up checks on this device) or not, a path that stepped aside saying why in `speed_said`; and
    whether the update's observe and imagination run compiled (--compile: Part 1's loop whole, or a fast path's
    step)."""
    observe, imagine, heads = agent.observe, agent.imagine, agent.imagined_heads
    return {
        "observe": getattr(observe, "__qualname__", type(observe).__name__),  # RSSM.observe, FastObserve
        "fast_observe": type(observe).__name__ in ("FastObserve", "FusedObserve"),
        "hand_written_backward": bool(getattr(observe, "hand_written_backward", False)),
        "fused_scan": type(observe).__name__ == "FusedObserve",
        "fast_imagine": type(imagine).__name__ == "FastImagine",
        "imagine_gathers": bool(getattr(imagine, "gathers", False)),
        "fused_epilogues": bool(getattr(imagine, "fused", False)),
        "fast_heads": type(heads).__name__ == "FastHeads",
        "fused_heads": bool(getattr(heads, "fused", False)),
        "observe_compiled": compiled(observe) or compiled(getattr(observe, "step", None)),
        "imagine_compiled": compiled(imagine) or compiled(getattr(imagine, "step", None)),
    }


def compiled(fn) -> bool:
    """Whether `fn` is torch.compile's (which keeps the function it compiles on it)."""
    return hasattr(fn, "_torchdynamo_orig_callable")


def kernel_paths_installed(installed: dict) -> list[str]:
    """The paths of dreamer_kernels.py among `installed_paths`' (none: Part 1's functions train)."""
    return [path for path in KERNEL_PATHS if installed[path]]


def start_up_checks(installed: dict) -> str:
    """What the start-up checks of the variant's paths said: `speed_up_agent` returned, so each path installed passed
    its check (one that disagrees raises FastPathMismatch: the variant then has an error, not a time)."""
    paths = kernel_paths_installed(installed)
    if not paths:
        return "none to pass: no path of dreamer_kernels.py installed, Part 1's functions train"
    return f"passed: the start-up checks of {', '.join(paths)} (dreamer_kernels.check_fast_paths)"


def timed_variant(
    agent: da.Agent,
    args: da.Args,
    batch: dict,
    device: torch.device,
    reps: int,
    warmup: int,
    regions: update_regions.Regions,
) -> dict:
    on_cuda = device.type == "cuda"
    world_model_step, behavior_step = da.make_update_steps(agent, args)

    def update() -> None:
        raw = da.batch_tensors(
            batch, device
        )  # as `sample_batch` sends a batch: pinned, without blocking, on CUDA
        _, _, start = world_model_step(raw)
        behavior_step(start)

    figures: dict = {"float32_matmul_precision": torch.get_float32_matmul_precision()}  # "high": TF32
    figures["cudnn_benchmark"] = torch.backends.cudnn.benchmark
    warmup_s, profiled_call = [], None
    before_capture = None  # the profile of the last call before capture: the captured function, run eagerly
    for call in range(warmup):
        step = world_model_step
        # the last call before capture runs the captured function uncaptured: its kernels are the graph's
        about_to_capture = (
            isinstance(step, da.CudaGraphed)
            and getattr(step, "graph", 0) is None
            and getattr(step, "calls", 0) + 1 == getattr(step, "warmup", -1)
        )
        start = time.perf_counter()
        if about_to_capture and on_cuda:
            before_capture = profile_update(update, device, regions)
            profiled_call = call
        else:
            update()
            sync(device)
        warmup_s.append(time.perf_counter() - start)
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        update()
        sync(device)
        samples.append((time.perf_counter() - start) * 1e3)
    median = statistics.median(samples)
    figures.update(
        {
            "update_ms": median,
            "samples_ms": [round(s, 3) for s in samples],
            "warmup_calls_s": [round(s, 3) for s in warmup_s],
        }
    )
    if args.compile:
        # what the first calls cost beyond steady updates: compiling (and capturing); not the profiled call
        unprofiled = [s for call, s in enumerate(warmup_s) if call != profiled_call]
        figures["compile_s"] = sum(unprofiled) - len(unprofiled) * median / 1e3
    captured = (
        isinstance(world_model_step, da.CudaGraphed) and getattr(world_model_step, "graph", None) is not None
    )
    figures["captured"] = captured
    if on_cuda:
        items, unlinked = profile_update(update, device, regions)
        figures["kernels_in_profile"] = len(items)
        if captured and len(items) < 10 and before_capture is not None:
            # the profiler did not see inside the graph replay: the same work, counted on the call before capture
            items, unlinked = before_capture
            figures["kernels_counted_as"] = (
                "CUDA kernels of the last call before capture (the captured function)"
            )
            figures["regions_timed_as"] = (
                "the last call before capture, run eagerly (torch.profiler): kernels and their busy time are the "
                "graph's, wall time is an eager call's (launch gaps are not the graph's)"
            )
        elif captured and before_capture is not None:
            # a replay runs no Python: each of its kernels takes the region of the same kernel in the call it was
            # captured from
            reference = before_capture[0]
            matched = align([item[0] for item in reference], [item[0] for item in items])
            items = [
                (*item[:3], reference[index][3] if index is not None else "rest forward")
                for item, index in zip(items, matched)
            ]
            unlinked = before_capture[1]
            figures["kernels_counted_as"] = "CUDA kernels (torch.profiler) of one update (graph replay)"
            figures["regions_matched"] = sum(index is not None for index in matched)
            figures["regions_timed_as"] = (
                "one graph replay (torch.profiler): its kernels, each in the region of the same kernel (by name, "
                "in order: `regions_matched` of them; the rest, such as the copies into the graph's inputs, in "
                "'rest forward') of the last call before capture, whose regions the profiler saw"
            )
        else:
            figures["kernels_counted_as"] = "CUDA kernels (torch.profiler) of one update" + (
                " (graph replay)" if captured else ""
            )
            figures["regions_timed_as"] = "one update, profiled (torch.profiler)" + (
                ": a graph replay whose regions could not be told (no eager call before capture was profiled)"
                if captured
                else ", eagerly"
            )
        figures["kernels_per_update"] = len(items)
        figures["kernel_time"] = kernel_times([(item[0], item[2] - item[1]) for item in items])
        figures["regions"], figures["regions_span_ms"] = timeline(items)
        figures["regions_unlinked"] = unlinked
        if not captured and not args.compile:
            # the CPU's proxy (aten operations dispatched) of the same eager update, beside its real kernels
            figures["aten_ops_per_update"] = count_aten_ops(update, device)
        figures["peak_gpu_reserved_mb"] = torch.cuda.max_memory_reserved(device) / MB
        figures["peak_gpu_allocated_mb"] = torch.cuda.max_memory_allocated(device) / MB
    elif args.compile:
        figures["kernels_per_update"] = None  # under a TorchDispatchMode compiled code falls back to eager
        figures["kernels_counted_as"] = (
            "not counted (CPU: compiled code runs eagerly under a TorchDispatchMode)"
        )
        items, _ = profile_update(update, device, regions)
        figures["regions"], figures["regions_span_ms"] = timeline(items)
        for entry in figures["regions"].values():
            entry["kernels"] = None
        figures["regions_timed_as"] = CPU_REGIONS_TIMED_AS
    else:
        figures["kernels_per_update"] = count_aten_ops(update, device)
        figures["kernels_counted_as"] = (
            "aten ops dispatched in one update (TorchDispatchMode; CPU, no CUDA kernels)"
        )
        items, _ = profile_update(update, device, regions)
        figures["regions"], figures["regions_span_ms"] = timeline(items)
        for region, ops in count_region_ops(update, device, regions).items():
            figures["regions"][region]["kernels"] = ops
        figures["regions_timed_as"] = CPU_REGIONS_TIMED_AS
    if on_cuda:  # what the training loop adds per update on the CPU: one batch copied into pinned memory
        figures["staging"] = "batch_tensors: pinned memory, copied without blocking"
    return figures


CPU_REGIONS_TIMED_AS = (
    "CPU: kernels are the aten ops each region dispatches (update_regions.RegionCounter, on another update); busy "
    "and wall time those of the aten ops called from Python or the autograd engine in one profiled update "
    "(torch.profiler)"
)


def time_outside_update(base: da.Args, device: torch.device, steps: int, warmup: int) -> dict:
    """Everything the training loop does per env step besides the update, done by the script's own functions as
    its loop does them (the player's `act`, the run's `sample_batch`, `step_envs`, with `install_speed`'s
    equivalents in place), on one real Pong env (the Atari100k
    recipe: one update per env step), the replay's frames on the device (`--replay-frames device`), acting
    captured on CUDA: one batch sampled and gathered (before acting, as the loop samples it), the policy step, the
    env step and storing it, each part timed (`outside_update_parts_ms`: in training the sampling and the env step
    run while the GPU updates, acting waits for it). A device synchronisation ends each part, so a figure holds all of
    its GPU work. The weights are untrained: the cost does not depend on them."""
    on_cuda = device.type == "cuda"
    args = dataclasses.replace(
        base, num_envs=1, vector_mode="sync", learning_starts=0, replay_frames="device", cudagraph=on_cuda
    )
    envs = da.make_vector_env(args, "benchmark", seed=0)
    obs_shape, num_actions = envs.single_observation_space.shape, int(envs.single_action_space.n)
    agent = da.build_agent(args, obs_shape, num_actions, device)
    with tempfile.TemporaryDirectory() as logs:
        run = types.SimpleNamespace(
            args=args,
            device=device,
            agent=agent,
            obs_shape=obs_shape,
            replay=da.EpisodeReplay(10_000, 1, seed=0),
            player=da.Player(agent, 1),
            sample_batch=da.sample_batch,
            rng=np.random.default_rng(0),
            counters={"global_step": 0, "episodes": 0},
            writer=SummaryWriter(logs),
            last_return=None,
        )
        da.install_speed(run)  # as a run's set-up: the frames on the device, acting captured on CUDA
        replay = run.replay
        try:
            obs, _ = envs.reset(seed=0)
            replay.start_episode(0, obs[0])
            is_first = np.ones(1, np.bool_)
            while not replay.can_sample(args.sequence_length):  # random steps until a batch can be drawn
                obs, is_first = da.step_envs(run, envs, run.rng.integers(num_actions, size=1))
            samples, parts = [], {"act": [], "sample": [], "env_step": []}
            for i in range(warmup + steps):
                sync(device)
                times = [time.perf_counter()]
                run.sample_batch(run)  # as the loop does: before acting, while the last updates run on a GPU
                sync(device)
                times.append(time.perf_counter())
                actions = run.player.act(obs, is_first)
                times.append(time.perf_counter())
                obs, is_first = da.step_envs(run, envs, actions)
                sync(device)
                times.append(time.perf_counter())
                if i >= warmup:
                    samples.append(1e3 * (times[-1] - times[0]))
                    for name, (start, end) in zip(("sample", "act", "env_step"), itertools.pairwise(times)):
                        parts[name].append(1e3 * (end - start))
        finally:
            run.writer.close()
            envs.close()
    return {
        "outside_update_ms_per_env_step": statistics.median(samples),
        "outside_update_samples_ms": samples,
        # each part's median: the sampling and the env step run while a GPU updates; acting waits for the updates
        "outside_update_parts_ms": {name: statistics.median(times) for name, times in parts.items()},
        "outside_update_setup": "1 Pong env, frames on the device, acting captured on CUDA, untrained weights",
    }


def count_flops(base: da.Args, count_batch: int) -> dict:
    """FLOPs of one update by region (`update_regions.flops_at`: torch's FLOP counter's formulas, and FlopCounterMode's
    count of the whole update beside them), counted on the CPU at batches `count_batch` and `count_batch` + 1 and
    extended to the run's batch, for the training update without compiling and in float32: every variant does the
    same products (compiled, captured, in bf16 or fused)."""
    on_cpu = {key: value for key, value in (("compile", False), ("fused_scan", "off")) if key in ARGS_FIELDS}
    args = dataclasses.replace(base, batch_size=count_batch, cuda=False, precision="float32", **on_cpu)
    started = time.perf_counter()
    flops = update_regions.flops_at(args, base.batch_size, warmup=0)
    return {
        "by_region": flops["by_region"],
        "total": flops["total"],
        "flop_counter_total": flops["flop_counter_total"],
        "counted_as": (
            f"torch's FLOP counter (torch.utils.flop_counter: matrix products and convolutions) on the CPU, one update "
            f"at B{count_batch} and one at B{count_batch + 1} (x T{base.sequence_length}), extended to "
            f"B{base.batch_size} (linear in the batch, but for the learned initial state's one row per update)"
        ),
        "count_s": time.perf_counter() - started,
    }


def inductor_caches() -> dict:
    """Whether the caches that spare a later process compiling are on, and whether they are kept in the one folder
    TORCHINDUCTOR_CACHE_DIR names (the update stage's, which the lease's Pong run reuses)."""
    import torch._functorch.config
    import torch._inductor.config
    from torch._inductor.runtime.cache_dir_utils import cache_dir, triton_cache_dir

    folder = Path(cache_dir()).resolve()
    return {
        "cache_dir_from_env": "TORCHINDUCTOR_CACHE_DIR" in os.environ,
        "fx_graph_cache": bool(torch._inductor.config.fx_graph_cache),
        "autograd_cache": bool(torch._functorch.config.enable_autograd_cache),
        "autotune_local_cache": bool(torch._inductor.config.autotune_local_cache),
        # FX graphs, AOTAutograd's and autotuning's entries go into cache_dir(); Triton's kernels into this folder
        "triton_cache_in_cache_dir": folder in Path(triton_cache_dir(0)).resolve().parents,
        "inductor_cudagraphs": bool(torch._inductor.config.triton.cudagraphs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="a tiny model and batch, to check the steps")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument(
        "--warmup", type=int, default=5, help="untimed-for-the-median calls (compile, capture)"
    )
    parser.add_argument("--variants", nargs="+", help="only these (default: training, then the whole table)")
    parser.add_argument(
        "--model", default="dreamerv3", choices=sorted(da.MODELS), help="dreamer_atari.py's --model"
    )
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads on a CPU (CUDA: torch's default)"
    )
    cli = parser.parse_args()
    names = variant_names()
    if cli.variants and set(cli.variants) - set(names):
        print(
            f"error: unknown variants {sorted(set(cli.variants) - set(names))}; known: {names}.",
            file=sys.stderr,
        )
        raise SystemExit(2)
    device = torch.device(cli.device)
    on_cuda = device.type == "cuda"
    if not on_cuda:
        torch.set_num_threads(cli.threads)
    base = dataclasses.replace(
        da.Args(model=cli.model), cuda=on_cuda, **ATARI100K_BATCH
    )  # the script's defaults for that model, DreamerV3's batch
    if cli.quick:
        base = dataclasses.replace(base, **QUICK_UPDATE_MODEL)
    reps = 3 if cli.quick else cli.reps
    warmup = (
        2 if cli.quick and not on_cuda else cli.warmup
    )  # nothing compiles or captures in a quick CPU check
    started = time.perf_counter()
    fill_steps = 400 if cli.quick else 2_000
    replay, obs_shape, num_actions = fill_replay(
        dataclasses.replace(base, buffer_capacity=fill_steps, num_envs=2), fill_steps
    )
    batch = replay.sample(base.batch_size, base.sequence_length)
    sampling = bench_utils.time_ms(  # as training samples a batch (a fresh copy of its windows)
        lambda: replay.sample(base.batch_size, base.sequence_length), reps=reps, warmup=1
    )
    result: dict = {
        "machine": bench_utils.machine(),
        "command": " ".join(["python", "dev/gpu/update_variants.py", *sys.argv[1:]]).replace(
            str(cli.out), "OUT_JSON"
        ),
        "device": torch.cuda.get_device_name(device) if on_cuda else str(device),
        "batch": f"B{base.batch_size} x T{base.sequence_length}",
        "batch_from": f"one batch sampled from {replay.total_steps:,} real Pong steps (random actions)",
        "base_args": {
            k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(base).items()
        },
        "fast_paths_off": FAST_PATHS_OFF,
        "cuda_fast_path": CUDA_FAST_PATH,
        "sample_ms": sampling["median_ms"],
        "sample_samples_ms": sampling["samples_ms"],
        "reps": reps,
        "variants": {},
    }
    out = Path(cli.out)

    def save() -> None:
        result["wall_s"] = time.perf_counter() - started
        tmp = out.with_suffix(".tmp")
        result.setdefault("code", code_version())  # the commit it ran (once), and whether the tree differed
        tmp.write_text(json.dumps(result, indent=1))
        tmp.replace(out)  # a reader never sees half a file

    try:
        result.update(time_outside_update(base, device, steps=reps * 5, warmup=cli.warmup))
        print(
            f"outside the update: {result['outside_update_ms_per_env_step']:.2f} ms per env step", flush=True
        )
    except Exception as exc:  # noqa: BLE001 - a figure that cannot be measured is a finding, not the end
        result["outside_update_error"] = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
        print(f"outside the update: failed, {result['outside_update_error']}", flush=True)
    save()
    try:
        result["flops"] = count_flops(base, count_batch=2 if cli.quick else 1)
        print(f"FLOPs of one update: {result['flops']['total'] / 1e9:.1f} GFLOP", flush=True)
    except Exception as exc:  # noqa: BLE001 - a figure that cannot be measured is a finding, not the end
        result["flops_error"] = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
        print(f"FLOPs: failed, {result['flops_error']}", flush=True)
    result["inductor_caches"] = inductor_caches()
    save()
    table = [
        ("training", None, True),
        *((name, overrides, True) for name, overrides in TRAINING_VARIANTS),
        *((name, overrides, False) for name, overrides in UPDATE_VARIANTS),
    ]
    for name, overrides, on_training in table:
        if cli.variants and name not in cli.variants:
            continue
        quick_skip = cli.quick and not (cli.variants and name in cli.variants)
        args, why = variant_args(base, overrides or {}, on_cuda, training=on_training, quick=quick_skip)
        entry: dict = {"overrides": overrides if overrides is not None else CUDA_FAST_PATH if on_cuda else {}}
        if on_training:
            entry["on"] = "training"  # the overrides change the training update, not every fast path off
        if args is None:
            entry["skipped"] = why
            print(f"{name}: skipped, {why}", flush=True)
        else:
            entry["args"] = {
                k: getattr(args, k)
                for k in (*FAST_PATHS_OFF, *KERNEL_PATHS, *CUDA_FAST_PATH, *(overrides or {}))
                if k in ARGS_FIELDS
            }
            try:
                entry.update(measure_variant(args, batch, obs_shape, num_actions, device, reps, warmup))
                print(
                    f"{name}: {entry['update_ms']:.2f} ms per update, {entry['kernels_per_update']} "
                    f"{'kernels' if on_cuda else 'aten ops'}, warm-up {sum(entry['warmup_calls_s']):.1f} s",
                    flush=True,
                )
            except Exception as exc:  # noqa: BLE001 - a variant that cannot run is a finding, not the end
                entry["error"] = (
                    f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}"
                )
                if isinstance(exc, da.FastPathMismatch):  # a path's start-up check refused it
                    entry["checks"] = f"failed: {entry['error']}"
                print(f"{name}: failed, {entry['error']}", flush=True)
            if on_cuda:
                torch.cuda.empty_cache()
        result["variants"][name] = entry
        save()


if __name__ == "__main__":
    main()
