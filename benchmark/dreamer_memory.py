"""What the default dreamer_atari.py holds in GPU memory, part by part, measured on the CPU at full size.

    python benchmark/dreamer_memory.py                       # writes benchmark/results/dreamer_memory.{json,md}
    python benchmark/dreamer_memory.py --quick --out /tmp/m  # tiny sizes: checks the steps in seconds

The parts (docs/dreamer_atari.md turns them into what a GPU needs):
- weights and optimizer state: every parameter and buffer of the agent's modules, and Adam's moments and step
  counters as the preflight makes them (`preflight`), counted tensor by tensor;
- frames: the replay's frames as `--replay-frames device` keeps them, at the replay's capacity when no
  --buffer-capacity is given (the whole run, `replay_capacity`), sized by the script's own `frame_store_nbytes`;
- the update's activations: the peak of the bytes held by tensors made during one world-model update, one behaviour
  update, the preflight's worst-case step, one policy step and one open-loop report (the log points' ball measure on
  64 sequences), each run as training runs it on the CPU (Part 2's fast paths in place), counted by a
  TorchDispatchMode that follows every storage an operation returns until it is freed (`LiveBytes`).
On a GPU the same tensors take the same bytes; the allocator rounds each block up (512 bytes, large ones to 2 MiB
pages) and keeps freed blocks cached, which the results' GPU figures show beside these.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import weakref
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np
import torch
import tyro
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import dreamer_atari as da
from benchmark import bench_utils
from benchmark.common import TINY_MODEL_FIELDS, code_version, log

MIB = 2.0**20
PONG_ACTIONS = 6  # ALE/Pong-v5's minimal action set, which the script plays
# --quick: the plumbing only
FRAME_CAPACITIES = (50_000, 100_000, 1_000_000)  # replay capacities whose frame store the results also give
QUICK_FIELDS = {**TINY_MODEL_FIELDS, "batch_size": 2, "sequence_length": 8, "imagination_horizon": 3}


@dataclasses.dataclass
class Cli:
    out: str = str(BENCH_DIR / "results" / "dreamer_memory")
    """the results' path without its suffix: .json (every figure) and .md are written"""
    quick: bool = False
    """tiny sizes, to check the steps in seconds (the figures are not the default's)"""
    threads: int = 1
    """torch threads"""


class LiveBytes(TorchDispatchMode):
    """The bytes of the storages that operations return while it is active, each counted from the operation that
    made it until it is freed (a finalizer on the storage), and their peak. Storages that existed before (weights,
    optimizer state, the batch) are not counted: `live` and `peak` are what the code inside makes."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self.counted: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if not isinstance(tensor, torch.Tensor) or tensor.device.type == "meta":
                continue
            storage = tensor.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
            if nbytes == 0 or key in self.counted:
                continue
            self.counted.add(key)
            self.live += nbytes
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self.freed, key, nbytes)
        return out

    def freed(self, key: int, nbytes: int) -> None:
        self.live -= nbytes
        self.counted.discard(key)


def measure(fn) -> tuple[object, dict]:
    """Run `fn()` under LiveBytes: its result, and the peak and the bytes still held when it returned (MiB)."""
    with LiveBytes() as live:
        result = fn()
        figures = {"peak_mib": live.peak / MIB, "held_after_mib": live.live / MIB}
    return result, figures


def tensor_mib(tensors) -> float:
    """MiB of distinct storages among `tensors`."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values()) / MIB


def weights_and_state(agent: da.Agent) -> dict:
    """Bytes per module (parameters and buffers) and per optimizer (its state tensors)."""
    modules = {
        name: {
            "parameters": sum(p.numel() for p in module.parameters()),
            "mib": tensor_mib([*module.parameters(), *module.buffers()]),
        }
        for name, module in agent.modules().items()
    }
    optimizers = {
        name: {
            "state_tensors": sum(len(state) for state in optimizer.state.values()),
            "mib": tensor_mib(
                [
                    v
                    for state in optimizer.state.values()
                    for v in state.values()
                    if isinstance(v, torch.Tensor)
                ]
            ),
        }
        for name, optimizer in agent.named_optimizers().items()
    }
    # gradients live only inside an update (set to None after each step), so they are among its activations
    return {
        "modules": modules,
        "optimizers": optimizers,
        "weights_mib": sum(m["mib"] for m in modules.values()),
        "optimizer_state_mib": sum(o["mib"] for o in optimizers.values()),
        "parameters": sum(m["parameters"] for m in modules.values()),
    }


def open_loop_batch(args: da.Args, obs_shape: tuple) -> dict[str, np.ndarray]:
    """A replayed batch of the open-loop report's size on Pong (RECALL_SEQUENCES sequences)."""
    return da.synthetic_batch(dataclasses.replace(args, batch_size=da.RECALL_SEQUENCES), obs_shape)


def main(cli: Cli) -> dict:
    code = code_version()  # before anything is measured or written
    torch.set_num_threads(cli.threads)
    args = da.Args(**(QUICK_FIELDS if cli.quick else {}))
    obs_shape = (
        args.frame_stack,
        *((3,) if args.rgb else ()),
        args.image_size,
        args.image_size,
    )  # env_spaces'
    torch.manual_seed(args.seed)
    log(
        f"building the default agent on the CPU, its fast paths checked ({obs_shape}, {PONG_ACTIONS} actions)"
    )
    agent = da.build_agent(args, obs_shape, PONG_ACTIONS, "cpu")
    da.speed_up_agent(agent, args)
    world_model_step, behavior_step = da.update_steps(agent, args)
    started = time.time()

    log("the preflight's worst-case step (it makes the optimizer state)")
    _, preflight = measure(lambda: da.preflight(agent, args, obs_shape))
    held = weights_and_state(agent)
    raw = da.batch_tensors(da.synthetic_batch(args, obs_shape), "cpu")  # the batch as the update receives it
    raw_mib = tensor_mib(raw.values())

    timings, updates = {}, {}
    for n in range(2):  # the first updates make nothing the second does not (the preflight made Adam's state)
        log(f"world-model update {n + 1} of 2")
        t = time.time()
        (_, _, start), world_model = measure(lambda: world_model_step(raw))
        timings[f"world_model_{n + 1}_s"] = time.time() - t
        log(f"behaviour update {n + 1} of 2")
        t = time.time()
        _, behavior = measure(lambda start=start: behavior_step(start))
        timings[f"behavior_{n + 1}_s"] = time.time() - t
        updates = {"world_model": world_model, "behavior": behavior}
    start_mib = tensor_mib(start.values())

    log("one policy step and one open-loop report (64 sequences)")
    player = da.Player(agent, num_envs=1)
    obs = np.zeros((1, *obs_shape), np.uint8)
    _, policy = measure(lambda: player.act(obs, np.ones(1, np.bool_)))
    _, open_loop = measure(lambda: da.open_loop_predictions(agent, open_loop_batch(args, obs_shape)))

    capacity = da.replay_capacity(args)
    frame_bytes = int(np.prod(obs_shape[1:]))
    frames_mib = da.frame_store_nbytes(capacity, args.num_envs, obs_shape[1:]) / MIB
    result = {
        "what": "the default dreamer_atari.py's memory, part by part, measured on the CPU",
        "command": "python benchmark/dreamer_memory.py" + (" --quick" if cli.quick else ""),
        "code": code,
        "machine": bench_utils.machine(),
        "quick": cli.quick,
        "args": {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(args).items()},
        "obs_shape": list(obs_shape),
        "num_actions": PONG_ACTIONS,
        "counted_as": (
            "bytes of the storages operations return, from the operation that made each to its free "
            "(a TorchDispatchMode on the CPU, Part 2's fast paths in place as on CUDA); MiB = 2**20 bytes"
        ),
        "weights_and_optimizer": held,
        "frames": {
            "bytes_per_step": frame_bytes,
            "capacity_steps": capacity,
            "capacity_from": "--buffer-capacity" if args.buffer_capacity is not None else "--total-timesteps",
            "frame_store_mib": frames_mib,
            # the same store at other capacities (--buffer-capacity, or --total-timesteps without it)
            "frame_store_mib_by_capacity": {
                str(steps): da.frame_store_nbytes(steps, args.num_envs, obs_shape[1:]) / MIB
                for steps in FRAME_CAPACITIES
            },
        },
        "batch_mib": raw_mib,
        "start_states_mib": start_mib,
        "activations": {
            "world_model_update": updates["world_model"],
            "behavior_update": updates["behavior"],
            "preflight_step": preflight,
            "policy_step": policy,
            "open_loop_report": open_loop,
        },
        "seconds": timings,
        "wall_s": time.time() - started,
    }
    out = Path(cli.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    log(f"wrote {out}.json and .md")
    return result


def fmt(mib: float) -> str:
    return f"{mib:,.1f}"


def markdown(result: dict) -> str:
    held, frames, act = result["weights_and_optimizer"], result["frames"], result["activations"]
    m = result["machine"]
    lines = [
        "# The default dreamer_atari.py's memory, part by part",
        "",
        (
            f"`{result['command']}` on {m['cpu']} ({m['cpu_count']} cores), Python {m['python']}, torch {m['torch']}"
            f"; code {result['code'].get('commit')}"
            + (" with changes not committed" if result["code"].get("tree_differs") else "")
            + f". Observations {result['obs_shape']}, {result['num_actions']} actions, batch "
            f"{result['args']['batch_size']} x {result['args']['sequence_length']}, imagination horizon "
            f"{result['args']['imagination_horizon']}. Counted as {result['counted_as']}."
            + (" Tiny sizes (--quick): not the default's figures." if result["quick"] else "")
        ),
        "",
        "| part | MiB |",
        "|---|---:|",
        f"| weights ({held['parameters']:,} parameters; the slow critic's included) | {fmt(held['weights_mib'])} |",
        f"| Adam's state (two moments and a step per parameter tensor) | {fmt(held['optimizer_state_mib'])} |",
        (
            f"| frames: {frames['capacity_steps']:,} steps ({frames['capacity_from']}) x "
            f"{frames['bytes_per_step']:,} B, as the frame store sizes them | {fmt(frames['frame_store_mib'])} |"
        ),
        "| the same store at "
        + ", ".join(f"{int(k):,}" for k in frames["frame_store_mib_by_capacity"])
        + " steps | "
        + ", ".join(fmt(v) for v in frames["frame_store_mib_by_capacity"].values())
        + " |",
        f"| one batch as the update receives it (uint8 frames) | {fmt(result['batch_mib'])} |",
        f"| the start states a world-model update hands the behaviour update | {fmt(result['start_states_mib'])} |",
    ]
    for name, what in (
        ("world_model_update", "one world-model update: peak of what it makes (gradients included)"),
        ("behavior_update", "one behaviour update: peak of what it makes"),
        ("preflight_step", "the preflight's worst-case step (both updates' backward, Adam's state made)"),
        ("policy_step", "one policy step"),
        ("open_loop_report", "one open-loop report (64 sequences, at log points on Pong)"),
    ):
        lines.append(f"| {what} | {fmt(act[name]['peak_mib'])} |")
    lines += ["", f"Seconds: {json.dumps({k: round(v, 1) for k, v in result['seconds'].items()})}.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    main(tyro.cli(Cli))
