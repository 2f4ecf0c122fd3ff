"""How many operations each region of one Dreamer update dispatches: observe forward and backward, imagination
forward and backward, the optimizers, and the rest.

    python dev/gpu/update_regions.py --model dreamerv3 --size tiny --out /tmp/regions_dreamerv3_tiny.json
    python dev/gpu/update_regions.py --model nature --size modest --out /tmp/regions_nature_modest.json

On the CPU, a `TorchDispatchMode` counts the aten operations (views left out: they launch no kernel) of one
world-model update and one behaviour update of dreamer_atari.py, after a warm-up update, as
tests/test_dreamer_fast_path.py does. On a GPU an eager update launches about one kernel per operation (fewer where
the GRU cell's elementwise work fuses), and at batch 16 x 64 the kernel count, not arithmetic, sets its time.

How each operation finds its region:
- forward: the fast observe, the fast imagination and `clip_and_step` (gradient norm, clip and Adam: "optimizers") are wrapped
  while the count runs; an operation dispatched inside one of them belongs to it, any other to "rest".
- backward: inside `loss.backward()` the autograd engine marks the node it is running
  (`torch._C._current_autograd_node()`), and every node carries the sequence number of its creation. The wrappers
  record the sequence numbers before and after the fast observe and imagination ran (one marker node each, not
  counted), so a backward operation belongs to observe or imagination when the node that dispatched it was
  created inside that call, and to "rest" otherwise (including the parameters' gradient accumulation nodes). The
  gradient additions where a tensor has several consumers are made by the engine on behalf of the node that
  produced the later contribution: at the border of a region (the `deter` that both the prior and the decoder
  read) they count for that node's region.

Each figure is also measured at sequence length T - 1 and horizon H - 1, which gives the operations one observe
step and one imagination step add, by region. `--size tiny` takes the test's sizes (batch 3 x 6, horizon 4, the
tiny widths); `--size modest` the model's own widths at batch 4 x 64, horizon 15 (an op count does not depend on
the batch size or the widths, but does on T and H). Prints a table and writes a JSON file (`--out`).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import dreamer_atari as da
from benchmark import bench_utils
from benchmark.common import code_version

NUM_ACTIONS = 6
TINY = {  # tests/dreamer_tiny.py's widths at tests/test_dreamer_fast_path.py's batch
    "encoder_channels": (4, 8, 8),
    "embed_dim": 32,
    "decoder_base_channels": 4,
    "decoder_mid_channels": 4,
    "deterministic_dim": 16,
    "stochastic_dim": 4,
    "stochastic_classes": 4,
    "hidden_dim": 16,
    "batch_size": 3,
    "sequence_length": 6,
    "imagination_horizon": 4,
}
MODEST = {"batch_size": 4, "sequence_length": 64, "imagination_horizon": 15}
REGIONS = (
    "observe forward",
    "observe backward",
    "imagination forward",
    "imagination backward",
    "optimizers",
    "rest forward",
    "rest backward",
)
NOT_KERNELS = frozenset({"aten.detach", "aten.lift_fresh", "aten._unsafe_view"})


class RegionCounter(TorchDispatchMode):
    """Counts non-view aten operations by region (see the module docstring): `forward_region` is set by the
    wrappers, `spans` holds the (first, last) autograd sequence numbers each wrapped call created."""

    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()  # (region, op name) -> count
        self.forward_region = "rest"
        self.spans: list[tuple[int, int, str]] = []
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if not (self.paused or func.is_view or name in NOT_KERNELS):
            node = torch._C._current_autograd_node()
            if node is None:
                region = (
                    f"{self.forward_region} forward" if self.forward_region != "optimizers" else "optimizers"
                )
            else:
                region = f"{self.backward_region(node._sequence_nr())} backward"
            self.ops[region, name] += 1
        return func(*args, **(kwargs or {}))

    def backward_region(self, sequence_nr: int) -> str:
        """The wrapped call that created the node with this sequence number, or "rest"."""
        for first, last, region in self.spans:
            if first < sequence_nr < last:
                return region
        return "rest"

    def marker(self) -> int:
        """The sequence number of a fresh autograd node (not counted)."""
        self.paused = True
        try:
            with torch.enable_grad():
                return (torch.zeros((), requires_grad=True) * 1.0).grad_fn._sequence_nr()
        finally:
            self.paused = False

    def by_region(self) -> dict[str, int]:
        totals = dict.fromkeys(REGIONS, 0)
        for (region, _), count in self.ops.items():
            totals[region] += count
        return totals


@contextlib.contextmanager
def wrapped(counter: RegionCounter):
    """The fast observe and imagination (`FastObserve`, `FastImagine`: what a run's updates call) and
    `da.clip_and_step` replaced by wrappers that tell `counter` their region."""

    def wrap(fn, region: str, spans: bool):
        def inner(*args, **kwargs):
            outer = counter.forward_region
            first = counter.marker() if spans else None
            counter.forward_region = region
            try:
                return fn(*args, **kwargs)
            finally:
                counter.forward_region = outer
                if spans:
                    counter.spans.append((first, counter.marker(), region))

        return inner

    saved = da.FastObserve.__call__, da.FastImagine.__call__, da.clip_and_step
    da.FastObserve.__call__ = wrap(da.FastObserve.__call__, "observe", True)
    da.FastImagine.__call__ = wrap(da.FastImagine.__call__, "imagination", True)
    da.clip_and_step = wrap(da.clip_and_step, "optimizers", False)
    try:
        yield
    finally:
        da.FastObserve.__call__, da.FastImagine.__call__, da.clip_and_step = saved


def random_batch(args: da.Args, obs_shape: tuple, seed: int = 0) -> dict:
    """Random frames and actions, a reward, an episode start inside the sequence and a terminal step."""
    rng = np.random.default_rng(seed)
    batch = da.synthetic_batch(args, obs_shape)
    batch["obs"] = rng.integers(0, 255, batch["obs"].shape, dtype=np.uint8)
    batch["action"] = rng.integers(0, NUM_ACTIONS, batch["action"].shape).astype(np.uint8)
    batch["reward"][:, 3] = 1.0
    batch["is_first"][-1, 4] = True
    batch["is_terminal"][-1, 3] = True
    return batch


def count_update(args: da.Args) -> dict[str, dict[str, int]]:
    """Operations by region of the third world-model update and behaviour update (the first two create the
    optimizer state and the sampling matrices later ones reuse): {"world_model": {...}, "behavior": {...}}."""
    torch.manual_seed(0)
    obs_shape = (args.frame_stack, args.image_size, args.image_size)
    agent = da.build_agent(args, obs_shape, NUM_ACTIONS, "cpu")
    da.speed_up_agent(agent, args)  # the fast paths a run trains with
    raw = da.batch_tensors(random_batch(args, obs_shape), "cpu")
    world_model_step, behavior_step = da.make_update_steps(agent, args)
    for _ in range(3):
        world, behavior = RegionCounter(), RegionCounter()
        with wrapped(world), world:
            _, _, start = world_model_step(raw)
        with wrapped(behavior), behavior:
            behavior_step(start)
    return {"world_model": world.by_region(), "behavior": behavior.by_region()}


# profiler events that launch no kernel: allocations, views and shape bookkeeping
NOT_KERNEL_EVENTS = frozenset(
    "aten::" + name
    for name in [
        "empty",
        "empty_strided",
        "empty_like",
        "view",
        "as_strided",
        "detach",
        "alias",
        "reshape",
        "_reshape_alias",
        "resize_",
        "lift_fresh",
        "t",
        "transpose",
        "permute",
        "expand",
        "slice",
        "select",
        "unsqueeze",
        "squeeze",
        "unflatten",
        "flatten",
        "_unsafe_view",
        "unbind",
        "split",
        "chunk",
        "narrow",
        "set_",
        "result_type",
        "resolve_conj",
        "resolve_neg",
        "_local_scalar_dense",
        "item",
        "numpy_T",
        "contiguous",
        "to",
        "_to_copy_meta",
    ]
)


def count_compiled_update(args: da.Args) -> int:
    """Kernel calls of the third world-model and behaviour update with --compile (Inductor on the CPU): the kernels
    Inductor generated (each call profiled by name: `cpp.enable_kernel_profile`) and the aten operations that run
    outside them (the matmuls and convolutions the graphs call, the eager code between graphs), allocations and
    views left out. Inductor's CPU kernels fuse about as its GPU kernels do, so this estimates a compiled update's
    CUDA kernels; a GPU profile is the real count."""
    import torch._dynamo
    import torch._inductor.config
    from torch.profiler import ProfilerActivity, profile

    torch._dynamo.reset()
    torch._inductor.config.cpp.enable_kernel_profile = True
    torch.manual_seed(0)
    obs_shape = (args.frame_stack, args.image_size, args.image_size)
    agent = da.build_agent(args, obs_shape, NUM_ACTIONS, "cpu")
    da.speed_up_agent(
        agent, dataclasses.replace(args, compile=True)
    )  # the fast paths, compiled as --compile does
    raw = da.batch_tensors(random_batch(args, obs_shape), "cpu")
    world_model_step, behavior_step = da.make_update_steps(agent, args)
    for _ in range(2):
        _, _, start = world_model_step(raw)
        behavior_step(start)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _, _, start = world_model_step(raw)
        behavior_step(start)
    count = 0
    for event in prof.events():
        if "cpp_fused" in event.name:
            count += 1
        elif event.name.startswith("aten::") and event.name not in NOT_KERNEL_EVENTS:
            # an aten operation called from Python or from a graph, not from another aten operation (aten::linear
            # counts once, not again as the addmm it calls)
            parent = event.cpu_parent
            while parent is not None and not parent.name.startswith("aten::"):
                parent = parent.cpu_parent
            count += parent is None
    return count


def measure_compiled(model: str, size: str) -> dict:
    """Compiled kernel calls at (T, H), (T - 1, H) and (T, H - 1), and the per-step differences."""
    sizes = {**(TINY if size == "tiny" else MODEST), "model": model, "amp": "off", "num_envs": 1}
    T, H = sizes["sequence_length"], sizes["imagination_horizon"]
    base = count_compiled_update(da.Args(**sizes))
    short_t = count_compiled_update(da.Args(**{**sizes, "sequence_length": T - 1}))
    short_h = count_compiled_update(da.Args(**{**sizes, "imagination_horizon": H - 1}))
    return {
        "update": base,
        "per_observe_step": base - short_t,
        "per_imagination_step": base - short_h,
        "counted_as": count_compiled_update.__doc__.split(":")[0].strip() + " (see update_regions.py)",
    }


def measure(model: str, size: str, observe_backward: str = "hand-written") -> dict:
    """Counts at (T, H), (T - 1, H) and (T, H - 1), and the per-step differences."""
    sizes = {**(TINY if size == "tiny" else MODEST), "model": model, "amp": "off", "num_envs": 1}
    sizes["observe_backward"] = observe_backward
    T, H = sizes["sequence_length"], sizes["imagination_horizon"]
    base = count_update(da.Args(**sizes))
    short_t = count_update(da.Args(**{**sizes, "sequence_length": T - 1}))
    short_h = count_update(da.Args(**{**sizes, "imagination_horizon": H - 1}))
    args = da.Args(**sizes)
    total = {region: base["world_model"][region] + base["behavior"][region] for region in REGIONS}
    return {
        "torch": torch.__version__,
        "model": model,
        "size": size,
        "sizes": {
            key: getattr(args, key)
            for key in (
                "batch_size",
                "sequence_length",
                "imagination_horizon",
                "deterministic_dim",
                "hidden_dim",
                "stochastic_dim",
                "stochastic_classes",
                "embed_dim",
                "encoder_channels",
                "image_size",
                "frame_stack",
            )
        },
        "counts": base,
        "total": total,
        "update_total": sum(total.values()),
        "per_observe_step": {
            region: base["world_model"][region] - short_t["world_model"][region] for region in REGIONS
        },
        "per_imagination_step": {
            region: base["behavior"][region] - short_h["behavior"][region] for region in REGIONS
        },
    }


def table(result: dict) -> str:
    """The counts as a fixed-width table: one row per region."""
    lines = [
        f"{result['model']} ({result['size']}: batch {result['sizes']['batch_size']} x "
        f"{result['sizes']['sequence_length']}, horizon {result['sizes']['imagination_horizon']}), torch "
        f"{result['torch']}",
        f"{'region':<22}{'world model':>12}{'behaviour':>11}{'total':>8}{'/observe step':>15}{'/imagine step':>15}",
    ]
    for region in REGIONS:
        lines.append(
            f"{region:<22}{result['counts']['world_model'][region]:>12}{result['counts']['behavior'][region]:>11}"
            f"{result['total'][region]:>8}{result['per_observe_step'][region]:>15}"
            f"{result['per_imagination_step'][region]:>15}"
        )
    lines.append(
        f"{'update':<22}{sum(result['counts']['world_model'].values()):>12}"
        f"{sum(result['counts']['behavior'].values()):>11}{result['update_total']:>8}"
        f"{sum(result['per_observe_step'].values()):>15}{sum(result['per_imagination_step'].values()):>15}"
    )
    return "\n".join(lines)


def readme(folder: Path) -> str:
    """The results folder's README.md, from its JSON files (`M_S_B.json`, B the observe backward)."""
    runs = {path.stem: json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))}
    some = next(iter(runs.values()))
    lines = [
        "# Operations per Dreamer update, by region",
        "",
        "`python dev/gpu/update_regions.py --model M --size S --observe-backward B [--compiled] --out "
        "M_S_B.json`, on the CPU",
        f"({some['machine'].get('cpu', '?')}, torch {some['torch']}, one thread): the aten operations (views "
        "excluded; on a GPU about one kernel each) of one world-model update and one behaviour update, by region. "
        "`autograd` is autograd's backward of the observe scan (the update before the hand-written backward through "
        "time), `hand-written` the script's default now (`ObserveBackwardThroughTime`). `compiled`: the kernel calls "
        "of the same update with --compile (Inductor on the CPU: its generated kernels and the aten operations "
        "called from Python or a graph, allocations and views excluded), an estimate of a compiled update's CUDA "
        "kernels. Each JSON file holds every region's count, the per-step counts, the sizes, the machine and the "
        "command. This README is written by `update_regions.py --readme`.",
        "",
        "| model | size | observe forward / backward, autograd | the same, hand-written | per observe step, autograd "
        "| hand-written | compiled | per imagination step, hand-written | compiled | update, autograd | hand-written "
        "| compiled |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for model in ("dreamerv3", "nature"):
        for size in ("tiny", "modest"):
            auto, hand = runs.get(f"{model}_{size}_autograd"), runs.get(f"{model}_{size}_hand-written")
            if not (auto and hand):
                continue
            sizes = hand["sizes"]
            compiled = hand.get("compiled", {})

            def regions(run):
                return f"{run['total']['observe forward']} / {run['total']['observe backward']}"

            lines.append(
                f"| {model} | {size} ({sizes['batch_size']} x {sizes['sequence_length']}, H "
                f"{sizes['imagination_horizon']}) | {regions(auto)} | {regions(hand)} "
                f"| {sum(auto['per_observe_step'].values())} | {sum(hand['per_observe_step'].values())} "
                f"| {compiled.get('per_observe_step', '—')} | {sum(hand['per_imagination_step'].values())} "
                f"| {compiled.get('per_imagination_step', '—')} | {auto['update_total']:,} "
                f"| {hand['update_total']:,} | {compiled['update']:,} |"
                if compiled
                else f"| {model} | {size} | {regions(auto)} | {regions(hand)} | — | — | — | — | — | — | — | — |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("dreamerv3", "nature"), default="dreamerv3")
    parser.add_argument("--size", choices=("tiny", "modest"), default="tiny")
    parser.add_argument("--out", help="write the counts to this JSON file")
    parser.add_argument(
        "--observe-backward",
        choices=("hand-written", "autograd"),
        default="hand-written",
        help="observe's backward pass: the script's hand-written one (where it applies) or autograd's, for comparison",
    )
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="also count the kernel calls of the --compile path (Inductor on the CPU), whole update and per step",
    )
    parser.add_argument("--readme", metavar="FOLDER", help="only write FOLDER/README.md from its JSON files")
    options = parser.parse_args()
    if options.readme:
        (Path(options.readme) / "README.md").write_text(readme(Path(options.readme)))
        return
    torch.set_num_threads(1)
    result = measure(options.model, options.size, options.observe_backward)
    if options.compiled:
        result["compiled"] = measure_compiled(options.model, options.size)
        compiled = result["compiled"]
        print(
            f"compiled (--compile, Inductor on the CPU): {compiled['update']} kernel calls per update, "
            f"{compiled['per_observe_step']} per observe step, {compiled['per_imagination_step']} per imagination step"
        )
    result["observe_backward"] = options.observe_backward
    result["machine"] = bench_utils.machine()
    result["command"] = " ".join(["python", "dev/gpu/update_regions.py", *sys.argv[1:]])
    print(table(result))
    if options.out:
        result["code"] = code_version()  # the commit it ran, and whether the tree differed
        Path(options.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
