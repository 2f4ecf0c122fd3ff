"""The update variants at DreamerV3's Atari100k batch (B16 x T64), on one real replayed Pong batch.

    python dev/gpu/update_variants.py --out PATH                        # CUDA
    python dev/gpu/update_variants.py --out PATH --device cpu --quick   # the same steps, tiny, without a GPU

`gpu_stages.py --stage update` runs it in its own process with a time cap. The variants are the table
`gpu_stages.UPDATE_VARIANTS` (name, Args field overrides), each on top of every fast path off
(`gpu_stages.FAST_PATHS_OFF`), and first `training`: the script's defaults plus what the Pong stage turns on
(`common.CUDA_FAST_PATH`), the update the Pong run trains with. A variant that names an Args field this
version of dreamer_atari.py lacks is reported as not available and skipped, and so is one this device cannot
run (CUDA graphs on a CPU).

For each variant: its agent built by the script's `build_agent` with its fast paths (`speed_up_agent`, which compiles with `compile`), its update
steps by `make_update_steps` (captured in CUDA graphs by `CudaGraphed` with `cudagraph`), fed as the training loop
feeds them (on CUDA from the script's pinned staging buffers, `PinnedBatches`). Every warm-up call is timed (the
first ones compile and capture), then `--reps` updates, each followed by a device synchronisation; the median is
the update as training runs it. One more update runs under torch.profiler: its CUDA kernels (on a CPU, the aten
operations one update dispatches, counted by a TorchDispatchMode, and labelled so). Peak GPU memory is the
allocator's peak over the variant. PATH is rewritten after each variant, so a run stopped early keeps what it
measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
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
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.tensorboard import SummaryWriter

import dreamer_atari as da
from benchmark import bench_utils
from benchmark.common import ATARI100K_BATCH, CUDA_FAST_PATH, TINY_MODEL_FIELDS, code_version
from benchmark.ours_dreamer import fill_replay
from dev.gpu.gpu_stages import FAST_PATHS_OFF, UPDATE_VARIANTS

MB = 2.0**20
# --quick: the plumbing only
QUICK_UPDATE_MODEL = {**TINY_MODEL_FIELDS, "batch_size": 4, "sequence_length": 10}
ARGS_FIELDS = {field.name for field in dataclasses.fields(da.Args)}


class OpCounter(TorchDispatchMode):
    """Counts the aten operations dispatched while it is active (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def variant_args(
    base: da.Args, overrides: dict, on_cuda: bool, training: bool = False, quick: bool = False
) -> tuple[da.Args | None, str]:
    """The Args of one variant, or None and why it cannot run here."""
    missing = sorted(set(overrides) - ARGS_FIELDS)
    if missing:
        return None, f"not available in this version (dreamer_atari.Args has no {', '.join(missing)})"
    if not on_cuda and (overrides.get("cudagraph") or overrides.get("amp") == "fp16"):
        return None, "needs CUDA"
    if not on_cuda and quick and overrides.get("compile"):
        return (
            None,
            "compiling takes minutes on a CPU: --quick checks the other steps (name it in --variants to run it)",
        )
    if training:
        fast = {k: v for k, v in CUDA_FAST_PATH.items() if k in ARGS_FIELDS} if on_cuda else {}
        return dataclasses.replace(base, **fast, **overrides), ""
    off = {k: v for k, v in FAST_PATHS_OFF.items() if k in ARGS_FIELDS}
    return dataclasses.replace(base, **{**off, **overrides}), ""


def apply_precision(args: da.Args) -> None:
    """The process-wide settings dreamer_atari.main makes for a run: cuDNN determinism, and TF32 matmuls where the
    script has a `tf32` field (set explicitly each time, so no variant inherits an earlier one's)."""
    torch.backends.cudnn.deterministic = args.torch_deterministic
    torch.set_float32_matmul_precision("high" if getattr(args, "tf32", False) else "highest")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def count_kernels(update, device: torch.device) -> tuple[int, dict]:
    """CUDA kernels (every GPU activity the profiler records: kernels, copies, fills) of one call, and where their
    time goes (`kernel_times`)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        update()
        sync(device)
    kernels = [
        (e.name, e.time_range.elapsed_us())
        for e in prof.events()
        if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA
    ]
    return len(kernels), kernel_times(kernels)


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


def measure_variant(
    args: da.Args, batch: dict, obs_shape, num_actions, device: torch.device, reps: int, warmup: int
) -> dict:
    on_cuda = device.type == "cuda"
    gc.collect()
    if on_cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    torch.manual_seed(args.seed)
    agent = da.build_agent(args, obs_shape, num_actions, device)
    apply_precision(args)
    da.speed_up_agent(agent, args)  # the fast paths a run trains with (and --compile with `compile`)
    world_model_step, behavior_step = da.make_update_steps(agent, args)
    staging = da.PinnedBatches(batch, device) if on_cuda else None
    if staging is not None:
        # both pinned buffers hold the batch; each update copies one to the device, as training does
        for _ in range(2):
            for key, array in staging.host_arrays().items():
                np.copyto(array, batch[key])
            staging.to_device()

    def update() -> None:
        if staging is not None:
            staging.host_arrays()  # waits for the copy that last read this buffer, as the training loop does
            raw = staging.to_device()
        else:
            raw = da.batch_tensors(batch, device)
        _, _, start = world_model_step(raw)
        behavior_step(start)

    figures: dict = {"float32_matmul_precision": torch.get_float32_matmul_precision()}  # "high": TF32
    warmup_s, profiled_call = [], None
    kernels_before_capture = times_before_capture = None
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
            kernels_before_capture, times_before_capture = count_kernels(update, device)
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
        kernels, figures["kernel_time"] = count_kernels(update, device)
        figures["kernels_in_profile"] = kernels
        if captured and kernels < 10 and kernels_before_capture is not None:
            # the profiler did not see inside the graph replay: the same work, counted on the call before capture
            figures["kernels_per_update"] = kernels_before_capture
            figures["kernel_time"] = times_before_capture  # an eager call's: launch gaps are not the graph's
            figures["kernels_counted_as"] = (
                "CUDA kernels of the last call before capture (the captured function)"
            )
        else:
            figures["kernels_per_update"] = kernels
            figures["kernels_counted_as"] = "CUDA kernels (torch.profiler) of one update" + (
                " (graph replay)" if captured else ""
            )
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
    else:
        figures["kernels_per_update"] = count_aten_ops(update, device)
        figures["kernels_counted_as"] = (
            "aten ops dispatched in one update (TorchDispatchMode; CPU, no CUDA kernels)"
        )
    if (
        staging is not None
    ):  # what the training loop adds per update on the CPU: one batch sampled into pinned memory
        figures["staging"] = "pinned buffers (PinnedBatches), copied without blocking"
    return figures


def time_outside_update(base: da.Args, device: torch.device, steps: int, warmup: int) -> dict:
    """Everything the training loop does per env step besides the update, done by the script's own functions as
    its loop does them (the player's `act`, the run's `sample_batch`, `step_envs`, with `install_speed`'s
    equivalents in place), on one real Pong env (the Atari100k
    recipe: one update per env step), the replay's frames on the device (`--replay-frames device`), acting
    captured on CUDA: the policy step, one batch sampled and gathered, the env step and storing it. Each iteration
    ends with a device synchronisation, so a figure holds all of its GPU work. The weights are untrained: the cost
    does not depend on them."""
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
            samples = []
            for i in range(warmup + steps):
                sync(device)
                begin = time.perf_counter()
                actions = run.player.act(obs, is_first)
                run.sample_batch(run)
                obs, is_first = da.step_envs(run, envs, actions)
                sync(device)
                if i >= warmup:
                    samples.append(1e3 * (time.perf_counter() - begin))
        finally:
            run.writer.close()
            envs.close()
    return {
        "outside_update_ms_per_env_step": statistics.median(samples),
        "outside_update_samples_ms": samples,
        "outside_update_setup": "1 Pong env, frames on the device, acting captured on CUDA, untrained weights",
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
    names = ["training", *(name for name, _ in UPDATE_VARIANTS)]
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
    scratch = {
        key: array.copy() for key, array in batch.items()
    }  # sampled into, as training samples into its buffers
    sampling = bench_utils.time_ms(
        lambda: replay.sample(base.batch_size, base.sequence_length, out=scratch), reps=reps, warmup=1
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
    table = [("training", None), *UPDATE_VARIANTS]
    for name, overrides in table:
        if cli.variants and name not in cli.variants:
            continue
        quick_skip = cli.quick and not (cli.variants and name in cli.variants)
        args, why = variant_args(base, overrides or {}, on_cuda, training=overrides is None, quick=quick_skip)
        entry: dict = {"overrides": overrides if overrides is not None else CUDA_FAST_PATH if on_cuda else {}}
        if args is None:
            entry["skipped"] = why
            print(f"{name}: skipped, {why}", flush=True)
        else:
            entry["args"] = {
                k: getattr(args, k) for k in (*FAST_PATHS_OFF, *CUDA_FAST_PATH) if k in ARGS_FIELDS
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
                print(f"{name}: failed, {entry['error']}", flush=True)
            if on_cuda:
                torch.cuda.empty_cache()
        result["variants"][name] = entry
        save()


if __name__ == "__main__":
    main()
