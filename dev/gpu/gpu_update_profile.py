"""One Dreamer update on a GPU taken apart: where its time goes, and what CUDA-graph capture changes.

    python dev/gpu/gpu_update_profile.py --out DIR                       # CUDA, the seed model (B16 x T50)
    python dev/gpu/gpu_update_profile.py --out DIR --device cpu --quick  # the code path, without a GPU

On one real replayed Pong batch, for each precision (`--amp` here: off is --precision float32), it times (median of `--reps`, a device
synchronisation after each update) the script's own update as the training loop runs it: eagerly (world model,
behaviour, whole update) and captured in CUDA graphs (`--cudagraph`: the same functions, `CudaGraphed`). Then one
eager update under torch.profiler: how many kernels it launches and how long the GPU is busy (summed kernel time)
against the wall time; a GPU busy a small share of the time waits for Python and kernel launches, which graph
capture removes. Last, whether capture changes the results: two agents from the same weights and random state
train on the same batches, one eagerly and one captured, and every logged value of every update is compared.
With `--compile` it also times the update with `--compile` (torch.compile of the steps an update repeats), alone
and captured, and compares the compiled and captured agent's values with the eager ones the same way (inductor
then draws torch's own random numbers, `fallback_random`, so that both agents sample the same latents).

Writes DIR/profile.json (every sample, the machine, the command) and DIR/profile_<amp>.txt (the profiler's table).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch
import torch._dynamo
import torch._inductor.config

import dreamer_atari as da
from benchmark import bench_utils
from benchmark.common import code_version
from benchmark.ours_dreamer import fill_replay, seed_args

QUICK_MODEL = {
    "batch_size": 4,
    "sequence_length": 10,
    "deterministic_dim": 32,
    "hidden_dim": 32,
    "embed_dim": 32,
}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device, reps: int, warmup: int = 3) -> dict:
    for _ in range(warmup):
        fn()
    sync(device)
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync(device)
        samples.append((time.perf_counter() - start) * 1e3)
    return {"median_ms": statistics.median(samples), "samples_ms": [round(s, 3) for s in samples]}


def profile_once(fn, device, table_path: Path) -> dict:
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    fn()
    sync(device)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        fn()
        sync(device)
        wall_ms = (time.perf_counter() - start) * 1e3
    kernels = [e for e in prof.events() if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    busy_ms = sum(e.device_time for e in kernels) / 1e3 if kernels else None
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table_path.write_text(prof.key_averages().table(sort_by=sort, row_limit=40))
    return {
        "profiled_wall_ms": wall_ms,
        "kernels": len(kernels),
        "gpu_busy_ms": busy_ms,
        "gpu_busy_share": None if busy_ms is None else busy_ms / wall_ms,
    }


def update_fn(agent: da.Agent, args: da.Args, batch: dict, device):
    """The training loop's update: the batch copied to the device, world model, then behaviour."""
    world_model_step, behavior_step = da.make_update_steps(agent, args)

    def update() -> tuple:
        raw = da.batch_tensors(batch, device)
        metrics, healthy, start = world_model_step(raw)
        behavior, behavior_healthy = behavior_step(start)
        return metrics, behavior, healthy & behavior_healthy

    return update


def build(args: da.Args, obs_shape, num_actions, device, compiled: bool) -> da.Agent:
    torch.manual_seed(args.seed)
    agent = da.build_agent(args, obs_shape, num_actions, device)
    da.speed_up_agent(
        agent, dataclasses.replace(args, compile=compiled)
    )  # the run's fast paths (and --compile)
    return agent


def compare_with_eager(
    args: da.Args, obs_shape, num_actions, device, batches: list[dict], compiled: bool = False
) -> dict:
    """Same weights, same random state, same batches: every logged value of every update, eager against captured
    (and compiled, with `compiled`)."""
    runs = {}
    for variant in (False, True):
        run_args = dataclasses.replace(args, cudagraph=variant, compile=compiled and variant)
        agent = build(run_args, obs_shape, num_actions, device, compiled and variant)
        world_model_step, behavior_step = da.make_update_steps(agent, run_args)
        torch.manual_seed(args.seed + 1)
        values = []
        for batch in batches:
            world, _, start = world_model_step(da.batch_tensors(batch, device))
            behavior, _ = behavior_step(start)
            values.append({key: value.item() for key, value in {**world, **behavior}.items()})
        runs[variant] = values
    worst: dict[str, float] = {}
    for eager, other in zip(runs[False], runs[True]):
        for key in eager:
            e, g = eager[key], other[key]
            worst[key] = max(worst.get(key, 0.0), abs(e - g) / max(abs(e), 1e-6))
    return {
        "updates": len(batches),
        "captured_from_update": 4,
        "max_relative_difference": worst,
        "eager": runs[False],
        "compiled_graph" if compiled else "graph": runs[True],
    }


def time_compiled(args: da.Args, obs_shape, num_actions, device, batch: dict, reps: int) -> dict:
    """The update with --compile (and --cudagraph when `args` asks for it): the warm-up calls, which compile (and
    capture), are timed apart from the steady updates."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    agent = build(args, obs_shape, num_actions, device, compiled=True)
    fn = update_fn(agent, args, batch, device)
    start = time.perf_counter()
    try:
        for _ in range(5):
            fn()
        sync(device)
    except Exception as exc:  # noqa: BLE001 - a variant that cannot run is a finding, not the end of the profile
        return {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300]}"}
    figures = {"warmup_s": time.perf_counter() - start, **timed(fn, device, reps, warmup=0)}
    if device.type == "cuda":
        figures["peak_reserved_mb"] = torch.cuda.max_memory_reserved(device) / 2**20
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--amp", nargs="+", default=["off", "bf16"])
    parser.add_argument(
        "--compile",
        action="store_true",
        help="also time the update with --compile, alone and captured (compiling takes minutes)",
    )
    cli = parser.parse_args()
    out_dir = Path(cli.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device(cli.device)
    on_cuda = device.type == "cuda"
    args = seed_args(cuda=on_cuda)
    if cli.quick:
        args = dataclasses.replace(args, **QUICK_MODEL)
    reps = 3 if cli.quick else cli.reps
    replay, obs_shape, num_actions = fill_replay(dataclasses.replace(args, buffer_capacity=2_000), 2_000)
    batch = replay.sample(args.batch_size, args.sequence_length)
    result: dict = {
        "machine": bench_utils.machine(),
        "batch": f"B{args.batch_size} x T{args.sequence_length}",
        "command": " ".join(["python", "dev/gpu/gpu_update_profile.py", *sys.argv[1:]]),
        "amp": {},
    }

    def save():
        result["code"] = code_version()  # the commit it ran, and whether the tree differed
        (out_dir / "profile.json").write_text(json.dumps(result, indent=1))

    for mode in cli.amp:
        amp_args = dataclasses.replace(
            args, precision={"off": "float32"}.get(mode, mode), cudagraph=False
        )  # eager; the graph figures below capture
        figures: dict = {}
        torch.manual_seed(args.seed)
        agent = build(amp_args, obs_shape, num_actions, device, compiled=False)
        figures["eager"] = timed(update_fn(agent, amp_args, batch, device), device, reps)
        figures.update(
            profile_once(update_fn(agent, amp_args, batch, device), device, out_dir / f"profile_{mode}.txt")
        )
        del agent
        if on_cuda and mode != "fp16":
            graph_args = dataclasses.replace(amp_args, cudagraph=True)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            torch.manual_seed(args.seed)
            agent = build(graph_args, obs_shape, num_actions, device, compiled=False)
            figures["graph"] = timed(update_fn(agent, graph_args, batch, device), device, reps, warmup=5)
            figures["graph_peak_reserved_mb"] = torch.cuda.max_memory_reserved(device) / 2**20
            del agent
        if cli.compile:
            figures["compiled"] = time_compiled(
                dataclasses.replace(amp_args, compile=True), obs_shape, num_actions, device, batch, reps
            )
            if on_cuda and mode != "fp16":
                figures["compiled_graph"] = time_compiled(
                    dataclasses.replace(amp_args, compile=True, cudagraph=True),
                    obs_shape,
                    num_actions,
                    device,
                    batch,
                    reps,
                )
        result["amp"][mode] = figures
        save()
        print(
            f"{mode}: eager {figures['eager']['median_ms']:.2f} ms, graph "
            f"{figures.get('graph', {}).get('median_ms')} ms, compiled {figures.get('compiled', {}).get('median_ms')}"
            f" ms, compiled and captured {figures.get('compiled_graph', {}).get('median_ms')} ms, "
            f"{figures['kernels']} kernels, GPU busy {figures['gpu_busy_share']}",
            flush=True,
        )
        for variant in ("compiled", "compiled_graph"):
            if "error" in figures.get(variant, {}):
                print(f"{mode}, {variant}: {figures[variant]['error']}", flush=True)
    batches = [replay.sample(args.batch_size, args.sequence_length) for _ in range(8)]
    if on_cuda:
        result["eager_vs_graph"] = compare_with_eager(args, obs_shape, num_actions, device, batches)
        save()
        worst = result["eager_vs_graph"]["max_relative_difference"]
        print("eager vs graph, worst relative difference per key:", json.dumps(worst), flush=True)
    if on_cuda and cli.compile and "median_ms" in result["amp"].get("off", {}).get("compiled_graph", {}):
        torch._dynamo.reset()
        torch._inductor.config.fallback_random = True  # the compiled agent draws the eager agent's latents
        result["eager_vs_compiled_graph"] = compare_with_eager(
            args, obs_shape, num_actions, device, batches, compiled=True
        )
        save()
        worst = result["eager_vs_compiled_graph"]["max_relative_difference"]
        print(
            "eager vs compiled and captured, worst relative difference per key:",
            json.dumps(worst),
            flush=True,
        )


if __name__ == "__main__":
    main()
