"""What each region of one Dreamer update costs: the encoder, the observe scan forward and backward, the decoder, the
world model's heads and losses, imagination, the behaviour heads and losses, the optimizers, and the rest; in
operations dispatched and FLOPs on the CPU, and (for update_variants.py) in kernels and time on a profile.

    python dev/gpu/update_regions.py --model dreamerv3 --size tiny --out /tmp/regions_dreamerv3_tiny.json
    python dev/gpu/update_regions.py --model nature --size modest --out /tmp/regions_nature_modest.json
    python dev/gpu/update_regions.py --size atari100k          # DreamerV3's batch, 16 x 64: FLOPs by region
    TRITON_INTERPRET=1 python dev/gpu/update_regions.py --size atari100k --triton   # with CUDA's Triton kernels

On the CPU, a `TorchDispatchMode` counts the aten operations (views left out: they launch no kernel) of one
world-model update and one behaviour update of dreamer_atari.py, after two warm-up updates, as
tests/test_dreamer_fast_path.py does, and their FLOPs by torch's FLOP counter's formulas
(`torch.utils.flop_counter`: matrix products and convolutions; the whole update's count by `FlopCounterMode`
itself is kept beside them). On a GPU an eager update launches about one kernel per operation (fewer where the GRU
cell's elementwise work fuses), and at batch 16 x 64 the kernel count, not arithmetic, sets its time.

How each operation finds its region (`Regions`, `labelled`):
- forward: the update's parts are wrapped while the count runs: the encoder and the decoder (modules), the agent's
  `observe`, `world_model_losses`, `imagine`, `imagined_heads` and `behavior_losses` (and the rollout of the shared heads,
  `FastHeads.rollout`, as "imagination"), and the script's `clip_and_step` (gradient norm, clip and Adam:
  "optimizers"). An operation belongs to the innermost wrapped call running (the decoder runs inside the world
  model's losses, imagination inside the behaviour losses), any other to "rest" (the batch's conversion, the logged
  values, the slow critic's update). A profiler sees the same calls as `region: NAME` ranges.
- backward: inside `loss.backward()` the autograd engine marks the node it is running
  (`torch._C._current_autograd_node()`; a profiler records it with the node's sequence number), and every node
  carries the sequence number of its creation. The wrappers record the sequence numbers before and after each call
  (one view each, which launches nothing), so a backward operation belongs to the innermost call that created its
  node, and to "rest" otherwise (including the parameters' gradient accumulation nodes). The gradient additions
  where a tensor has several consumers are made by the engine on behalf of the node that produced the later
  contribution: at the border of a region (the `deter` that both the prior and the decoder read) they count for
  that node's region.
- compiled code (--compile) is one call to the wrappers around it, and its backward one node: a region compiled
  inside another (the decoder inside the world model's compiled losses) counts for the outer one.

Each figure is also measured at sequence length T - 1 and horizon H - 1, which gives the operations one observe
step and one imagination step add, by region. `--size tiny` takes the test's sizes (batch 3 x 6, horizon 4, the
tiny widths); `--size modest` the model's own widths at batch 4 x 64, horizon 15; `--size atari100k` at batch
16 x 64, counted at batch `--count-batch` (2), its FLOPs from that batch and the next (an operation count does
not depend on the batch size, from 2, or the widths, but does on T and H; the FLOPs are linear in the batch but for
the learned initial state's one row per update, so two batches give them at any: `flops_at`, and
`tests/test_gpu_stages.py` holds them to a straight line through three). Prints a table and writes a JSON file (`--out`).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import json
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, flop_registry

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import dreamer_atari as da
import dreamer_kernels as dk
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
ATARI100K = {
    "batch_size": 16,
    "sequence_length": 64,
    "imagination_horizon": 15,
}  # DreamerV3's Atari100k update
# the labelled calls, in the order an update runs them (`labelled`); "rest" is everything outside them
PARTS = (
    "encoder",
    "observe",
    "decoder",
    "world-model heads and losses",
    "imagination",
    "behaviour heads and losses",
)
REGIONS = (
    *(f"{part} {direction}" for part in PARTS for direction in ("forward", "backward")),
    "optimizers",
    "rest forward",
    "rest backward",
)
NOT_KERNELS = frozenset({"aten.detach", "aten.lift_fresh", "aten._unsafe_view"})
NOT_KERNEL_NAMESPACES = ("profiler.",)  # a profiler range's own enter and exit (`Regions.wrap`)
REGION_LABEL = "region: "  # a labelled call's profiler range: "region: encoder"
BACKWARD_SCOPE = (
    1  # RecordScope::BACKWARD_FUNCTION: a profiled autograd node, with its node's sequence number
)


class Regions:
    """Which region of an update is running, as the wrappers `labelled` installs tell it while `active`: `current`
    (forward), and `spans`, the (first, last) autograd sequence numbers each labelled call created, innermost calls
    first (a call's span is recorded when it returns), from which a backward node's region follows. Inactive, the
    wrappers only call through; inside compiled code they do nothing (so a compiled graph is the same with them)."""

    def __init__(self):
        self.active = False
        self.current = "rest"
        self.spans: list[tuple[int, int, str]] = []
        self.marking = False  # True while a marker runs: its view is no operation of the update
        self._leaf = torch.zeros((), requires_grad=True)

    def marker(self) -> int:
        """The sequence number of a fresh autograd node: a view of a leaf (no kernel)."""
        self.marking = True
        try:
            with torch.enable_grad():
                return self._leaf.view_as(self._leaf).grad_fn._sequence_nr()
        finally:
            self.marking = False

    def forward_region(self) -> str:
        return "optimizers" if self.current == "optimizers" else f"{self.current} forward"

    def backward_region(self, sequence_nr: int) -> str:
        """The region of the backward node created with this sequence number."""
        for first, last, region in self.spans:
            if first < sequence_nr < last:
                return f"{region} backward"
        return "rest backward"

    def wrap(self, fn: Callable, region: str, spans: bool = True) -> Callable:
        """`fn`, telling this object (and a profiler, as a `region: NAME` range) that `region` runs inside it."""

        def labelled_call(*args, **kwargs):
            if (
                torch.compiler.is_compiling() or not self.active
            ):  # first: a compiled graph guards on nothing here
                return fn(*args, **kwargs)
            outer, first = self.current, self.marker() if spans else None
            self.current = region
            try:
                with torch.profiler.record_function(REGION_LABEL + region):
                    return fn(*args, **kwargs)
            finally:
                self.current = outer
                if spans:
                    self.spans.append((first, self.marker(), region))

        return labelled_call

    @contextlib.contextmanager
    def recording(self):
        """Active for one update: the spans of this update only."""
        self.spans.clear()
        self.active = True
        try:
            yield self
        finally:
            self.active = False


class LabelledModule(nn.Module):
    """A module called through `Regions.wrap` (its parameters are the wrapped module's own)."""

    def __init__(self, module: nn.Module, call: Callable):
        super().__init__()
        self.module = module
        self.call = call

    def forward(self, *args, **kwargs):
        return self.call(*args, **kwargs)


@contextlib.contextmanager
def labelled(agent: da.Agent, regions: Regions):
    """The agent's update with its parts wrapped for `regions` (see the module docstring), after `speed_up_agent`
    (so that what is wrapped is what a run calls, compiled or not) and before the first update (so that a compiled
    function traces the wrappers once). Everything is put back on exit."""
    wm = agent.world_model
    saved = (
        wm.encoder,
        wm.decoder,
        agent.observe,
        agent.world_model_losses,
        agent.imagine,
        agent.imagined_heads,
        agent.behavior_losses,
        da.clip_and_step,
    )
    # the shared heads imagine through the fast imagination's rollout, which they hold
    fast_heads = agent.imagined_heads if isinstance(agent.imagined_heads, dk.FastHeads) else None
    if fast_heads is not None:
        rollout = fast_heads.rollout
        fast_heads.rollout = regions.wrap(rollout, "imagination")
    wm.encoder = LabelledModule(wm.encoder, regions.wrap(wm.encoder, "encoder"))
    wm.decoder = LabelledModule(wm.decoder, regions.wrap(wm.decoder, "decoder"))
    agent.observe = regions.wrap(agent.observe, "observe")
    agent.world_model_losses = regions.wrap(agent.world_model_losses, "world-model heads and losses")
    agent.imagine = regions.wrap(agent.imagine, "imagination")
    agent.imagined_heads = regions.wrap(agent.imagined_heads, "behaviour heads and losses")
    agent.behavior_losses = regions.wrap(agent.behavior_losses, "behaviour heads and losses")
    da.clip_and_step = regions.wrap(da.clip_and_step, "optimizers", spans=False)
    try:
        yield agent
    finally:
        (
            wm.encoder,
            wm.decoder,
            agent.observe,
            agent.world_model_losses,
            agent.imagine,
            agent.imagined_heads,
            agent.behavior_losses,
            da.clip_and_step,
        ) = saved
        if fast_heads is not None:
            fast_heads.rollout = rollout


class RegionCounter(TorchDispatchMode):
    """Counts non-view aten operations (`ops`: (region, op name) -> count) and their FLOPs (`flops`: region -> FLOPs,
    torch's FLOP counter's formulas) by region, as `regions` says (see the module docstring)."""

    def __init__(self, regions: Regions):
        super().__init__()
        self.regions = regions
        self.ops = collections.Counter()
        self.flops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = str(func.overloadpacket)
        counted = not (
            self.regions.marking
            or func.is_view
            or name in NOT_KERNELS
            or name.startswith(NOT_KERNEL_NAMESPACES)
        )
        flop_formula = flop_registry.get(func.overloadpacket)
        if counted or flop_formula is not None:
            node = torch._C._current_autograd_node()
            region = (
                self.regions.forward_region()
                if node is None
                else self.regions.backward_region(node._sequence_nr())
            )
            if counted:
                self.ops[region, name] += 1
            if flop_formula is not None:
                self.flops[region] += flop_formula(*args, **kwargs, out_val=out)
        return out

    def by_region(self) -> dict[str, int]:
        totals = dict.fromkeys(REGIONS, 0)
        for (region, _), count in self.ops.items():
            totals[region] += count
        return totals

    def flops_by_region(self) -> dict[str, int]:
        return {region: self.flops[region] for region in REGIONS}


def event_region(event, regions: Regions) -> str:
    """The region of a profiled CPU event (an operation, or a CUDA launch): that of the innermost labelled call
    (`region: NAME` range) or autograd node around it, found up its parents."""
    while event is not None:
        if event.name.startswith(REGION_LABEL):
            part = event.name[len(REGION_LABEL) :]
            return "optimizers" if part == "optimizers" else f"{part} forward"
        if event.scope == BACKWARD_SCOPE:
            return regions.backward_region(event.sequence_nr)
        event = event.cpu_parent
    return "rest forward"


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


def model_obs_shape(args: da.Args) -> tuple:
    """One observation of the model `args` describes: (frames, side, side), or (frames, 3, side, side) in colour."""
    return (args.frame_stack, *((3,) if args.rgb else ()), args.image_size, args.image_size)


def count_update(args: da.Args, warmup: int = 2) -> dict:
    """Operations and FLOPs by region of the world-model update and behaviour update after `warmup` uncounted ones (the
    first two create the optimizer state and the sampling matrices later ones reuse; FLOPs are the same without), on
    the CPU: {"world_model": {region: ops}, "behavior": {...}, "flops": {"world_model": {region: FLOPs},
    "behavior": {...}}, "flop_counter_total": the whole update's FLOPs by `FlopCounterMode`}."""
    return count_updates(args, (args.batch_size,), warmup)[0]


def count_updates(args: da.Args, batch_sizes: tuple[int, ...], warmup: int = 2) -> list[dict]:
    """`count_update` at each of `batch_sizes`, in turn, with one agent (built and checked once). Each size after the
    first gets one uncounted update of its own first: the fast paths make their index constants once per size
    (`dk.constant`), as training makes them in its warm-up calls, so a count never depends on what ran before it."""
    torch.manual_seed(0)
    dk._CONSTANTS.clear()  # made again in the first update, whatever ran before in this process
    obs_shape = model_obs_shape(args)
    agent = da.build_agent(args, obs_shape, NUM_ACTIONS, "cpu")
    da.speed_up_agent(agent, args)  # the fast paths a run trains with
    regions = Regions()
    counts = []
    with labelled(agent, regions):
        world_model_step, behavior_step = da.make_update_steps(agent, args)
        for index, batch_size in enumerate(batch_sizes):
            batch_args = dataclasses.replace(args, batch_size=batch_size)
            raw = da.batch_tensors(random_batch(batch_args, obs_shape), "cpu")
            for _ in range(warmup if index == 0 else 1):
                _, _, start = world_model_step(raw)
                behavior_step(start)
            world, behavior = RegionCounter(regions), RegionCounter(regions)
            with FlopCounterMode(display=False) as flop_counter, regions.recording():
                with world:
                    _, _, start = world_model_step(raw)
                with behavior:
                    behavior_step(start)
            counts.append(
                {
                    "world_model": world.by_region(),
                    "behavior": behavior.by_region(),
                    "flops": {"world_model": world.flops_by_region(), "behavior": behavior.flops_by_region()},
                    "flop_counter_total": flop_counter.get_total_flops(),
                }
            )
    return counts


# profiler events that launch no kernel: allocations, views and shape bookkeeping
NOT_KERNEL_EVENTS = frozenset(
    "aten::" + name
    for name in [
        "empty",
        "empty_strided",
        "empty_like",
        "view",
        "view_as",
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
    sizes = {**SIZES[size], "model": model, "precision": "float32", "num_envs": 1}
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


SIZES = {"tiny": TINY, "modest": MODEST, "atari100k": ATARI100K}


def flops_at(args: da.Args, batch_size: int, warmup: int = 2) -> dict:
    """FLOPs by region of one update at `batch_size`, from counts at `args.batch_size` (b) and b + 1: every operation
    the FLOP counter counts is linear in the batch, plus a part that is not (the learned initial state, one row per
    update), so FLOPs(B) = FLOPs(b) + (B - b) (FLOPs(b + 1) - FLOPs(b)) exactly. Returns {"by_region", "total",
    "flop_counter_total": FlopCounterMode's count of the whole update, the same way, "counts": `count_update` at b}."""
    low, high = count_updates(args, (args.batch_size, args.batch_size + 1), warmup)
    steps = batch_size - args.batch_size

    def both(counts: dict, region: str) -> int:
        return counts["flops"]["world_model"][region] + counts["flops"]["behavior"][region]

    by_region = {
        region: both(low, region) + steps * (both(high, region) - both(low, region)) for region in REGIONS
    }
    return {
        "by_region": by_region,
        "total": sum(by_region.values()),
        "flop_counter_total": low["flop_counter_total"]
        + steps * (high["flop_counter_total"] - low["flop_counter_total"]),
        "counts": low,
    }


def measure(model: str, size: str, observe_backward: str = "hand-written", count_batch: int = 2) -> dict:
    """Counts at (T, H), (T - 1, H) and (T, H - 1), and the per-step differences; FLOPs by region at (T, H). At
    `--size atari100k` everything is counted at batch `count_batch` (and `count_batch` + 1, for the FLOPs at the
    size's batch: `flops_at`)."""
    sizes = {**SIZES[size], "model": model, "precision": "float32", "num_envs": 1}
    sizes["observe_backward"] = observe_backward
    batch_size = sizes["batch_size"]
    if size == "atari100k":
        sizes["batch_size"] = count_batch
    T, H = sizes["sequence_length"], sizes["imagination_horizon"]
    flops = flops_at(da.Args(**sizes), batch_size)
    base = flops["counts"]
    short_t = count_update(da.Args(**{**sizes, "sequence_length": T - 1}))
    short_h = count_update(da.Args(**{**sizes, "imagination_horizon": H - 1}))
    args = da.Args(**{**sizes, "batch_size": batch_size})
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
                "rgb",
            )
        },
        "counts": {"world_model": base["world_model"], "behavior": base["behavior"]},
        "total": total,
        "update_total": sum(total.values()),
        "per_observe_step": {
            region: base["world_model"][region] - short_t["world_model"][region] for region in REGIONS
        },
        "per_imagination_step": {
            region: base["behavior"][region] - short_h["behavior"][region] for region in REGIONS
        },
        "flops": flops["by_region"],
        "flops_total": flops["total"],
        "flop_counter_total": flops["flop_counter_total"],
        "flops_counted_at_batch": sizes["batch_size"],
    }


def table(result: dict) -> str:
    """The counts as a fixed-width table: one row per region."""
    lines = [
        f"{result['model']} ({result['size']}: batch {result['sizes']['batch_size']} x "
        f"{result['sizes']['sequence_length']}, horizon {result['sizes']['imagination_horizon']}), torch "
        f"{result['torch']}; FLOPs from batches {result['flops_counted_at_batch']} and "
        f"{result['flops_counted_at_batch'] + 1}",
        f"{'region':<40}{'world model':>12}{'behaviour':>11}{'total':>8}{'/observe step':>15}{'/imagine step':>15}"
        f"{'GFLOP':>10}",
    ]
    for region in REGIONS:
        lines.append(
            f"{region:<40}{result['counts']['world_model'][region]:>12}{result['counts']['behavior'][region]:>11}"
            f"{result['total'][region]:>8}{result['per_observe_step'][region]:>15}"
            f"{result['per_imagination_step'][region]:>15}{result['flops'][region] / 1e9:>10.2f}"
        )
    lines.append(
        f"{'update':<40}{sum(result['counts']['world_model'].values()):>12}"
        f"{sum(result['counts']['behavior'].values()):>11}{result['update_total']:>8}"
        f"{sum(result['per_observe_step'].values()):>15}{sum(result['per_imagination_step'].values()):>15}"
        f"{result['flops_total'] / 1e9:>10.2f}"
    )
    lines.append(
        f"FlopCounterMode's count of the whole update: {result['flop_counter_total'] / 1e9:.2f} GFLOP"
    )
    return "\n".join(lines)


def readme(folder: Path) -> str:
    """The results folder's README.md, from its JSON files (`M_S_B.json`, B the observe backward)."""
    runs = {path.stem: json.loads(path.read_text()) for path in sorted(folder.glob("*.json"))}
    some = next(run for run in runs.values() if run["size"] != "atari100k")
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
    for name, run in runs.items():
        if "flops" in run and run["size"] == "atari100k" and not run.get("triton"):
            lines += flops_table(name, run)
    for name, run in runs.items():
        plain = runs.get(name.replace("_triton", "_hand-written"))
        if run.get("triton") and plain:
            lines += triton_table(name, run, plain)
    return "\n".join(lines) + "\n"


def triton_table(name: str, run: dict, plain: dict) -> list[str]:
    """A `--triton` count (CUDA's paths: the fused scan and the fused epilogues, one operation a launch) beside the
    same update without them, region by region."""
    sizes = run["sizes"]
    lines = [
        "",
        f"## {run['model']} at {sizes['batch_size']} x {sizes['sequence_length']} with CUDA's Triton kernels "
        f"(`{name}.json`)",
        "",
        f"`TRITON_INTERPRET=1 {run['command']}`: the same update with the paths a CUDA run installs, the fused observe "
        "scan and the fused epilogues, their kernels run by Triton's interpreter on the CPU, each launch one "
        "operation (on a GPU one kernel). The rest is the same operations as on the CPU; on a GPU the convolutions "
        "and products are a kernel or two each, and the CUDA graph adds none.",
        "",
        "| region | operations, CPU paths | with the Triton kernels |",
        "|---|---:|---:|",
    ]
    for region in REGIONS:
        lines.append(f"| {region} | {plain['total'][region]:,} | {run['total'][region]:,} |")
    lines.append(f"| update | {plain['update_total']:,} | {run['update_total']:,} |")
    per_step = [
        (what, sum(plain[key].values()), sum(run[key].values()))
        for what, key in (("observe step", "per_observe_step"), ("imagination step", "per_imagination_step"))
    ]
    lines += ["", "; ".join(f"per {what}: {a} and {b}" for what, a, b in per_step) + "."]
    return lines


def flops_table(name: str, run: dict) -> list[str]:
    """One update at DreamerV3's batch, region by region: operations and FLOPs (a `--size atari100k` run)."""
    sizes = run["sizes"]
    lines = [
        "",
        f"## {run['model']} at {sizes['batch_size']} x {sizes['sequence_length']}, horizon "
        f"{sizes['imagination_horizon']}, region by region (`{name}.json`)",
        "",
        f"`{run['command']}` ({run['machine'].get('cpu', '?')}, torch {run['torch']}): the operations (counted at batch "
        f"{run['flops_counted_at_batch']}; from batch 2 they do not depend on it) and FLOPs (torch's FLOP counter: "
        f"matrix products and convolutions; from batches {run['flops_counted_at_batch']} and "
        f"{run['flops_counted_at_batch'] + 1}, extended to {sizes['batch_size']}) of one world-model and one "
        f"behaviour update. The regions' FLOPs sum to {run['flops_total'] / 1e9:.1f} GFLOP; FlopCounterMode's own count "
        f"of the whole update: {run['flop_counter_total'] / 1e9:.1f} GFLOP.",
        "",
        "| region | operations | GFLOP |",
        "|---|---:|---:|",
    ]
    for region in REGIONS:
        lines.append(f"| {region} | {run['total'][region]:,} | {run['flops'][region] / 1e9:.1f} |")
    lines.append(f"| update | {run['update_total']:,} | {run['flops_total'] / 1e9:.1f} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("dreamerv3", "nature"), default="dreamerv3")
    parser.add_argument("--size", choices=tuple(SIZES), default="tiny")
    parser.add_argument(
        "--count-batch",
        type=int,
        default=2,
        help="--size atari100k: count at this batch (and the next for FLOPs)",
    )
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
    parser.add_argument(
        "--triton",
        action="store_true",
        help="count with CUDA's Triton paths in place (the fused scan, the fused epilogues), their kernels run by "
        "Triton's interpreter on the CPU (TRITON_INTERPRET=1): each launch one operation, as on a GPU one kernel "
        "(their FLOPs uncounted)",
    )
    parser.add_argument("--readme", metavar="FOLDER", help="only write FOLDER/README.md from its JSON files")
    options = parser.parse_args()
    if options.readme:
        (Path(options.readme) / "README.md").write_text(readme(Path(options.readme)))
        return
    torch.set_num_threads(1)
    if options.triton:
        if not dk.triton_interprets():  # Triton reads it when it is first imported
            parser.error("--triton runs the kernels in Triton's interpreter: set TRITON_INTERPRET=1")
        dk.FUSED_SCAN_DEVICES = {"cuda", "cpu"}  # the paths a CUDA run installs, installed here
    result = measure(options.model, options.size, options.observe_backward, options.count_batch)
    if options.compiled:
        result["compiled"] = measure_compiled(options.model, options.size)
        compiled = result["compiled"]
        print(
            f"compiled (--compile, Inductor on the CPU): {compiled['update']} kernel calls per update, "
            f"{compiled['per_observe_step']} per observe step, {compiled['per_imagination_step']} per imagination step"
        )
    result["observe_backward"] = options.observe_backward
    result["triton"] = options.triton
    result["machine"] = bench_utils.machine()
    result["command"] = " ".join(["python", "dev/gpu/update_regions.py", *sys.argv[1:]])
    print(table(result))
    if options.out:
        result["code"] = code_version()  # the commit it ran, and whether the tree differed
        Path(options.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
