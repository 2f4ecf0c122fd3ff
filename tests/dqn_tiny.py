"""Tiny dqn_starcraft_split.py flags shared by the DQN tests: 8-pixel built-in minigames, a run in seconds; and a
run of a copy of the script whose `update` was changed."""

import os
import shutil
import subprocess
import sys
import types
from pathlib import Path

TINY_FLAGS = [
    "--res",
    "8",
    "--step-mul",
    "128",
    "--buffer-size",
    "200",
    "--learning-starts",
    "10",
    "--eval-every-episodes",
    "1",
    "--num-eval-episodes",
    "1",
    "--num-test-episodes",
    "2",
    "--memory-log-every",
    "10",
    "--leak-warmup-steps",
    "0",
    "--log-every-steps",
    "5",
]


# A run of a copy whose Part 1 `update` was changed: 3 built-in MoveToBeacon episodes of 15 agent steps at step_mul
# 128, an update every 2 agent steps after the first 10, each update logged.
CHANGED_RUN_FLAGS = [
    "--res", "8", "--step-mul", "128", "--buffer-size", "200", "--learning-starts", "10", "--train-frequency", "2",
    "--num-episodes", "3", "--log-every-steps", "1", "--eval-every-episodes", "0", "--num-test-episodes", "1",
    "--memory-log-every", "1000", "--run-id", "changed",
]  # fmt: skip
CHANGE_MARK = "a changed update ran"
# A change to the algorithm, put into `update` right after the loss: a Q-value penalty (its constant shows in the
# logged TD loss), and a line on stdout each time it runs.
CHANGE = (
    f'    print("{CHANGE_MARK}", flush=True)\n'
    "    loss = loss + 1000.0 + 1e-3 * q_taken.pow(2).mean()  # a Q-value penalty\n"
)


def updates_of_a_run() -> int:
    """The updates of a run with CHANGED_RUN_FLAGS: at agent steps 12, 14, ..., 44 of its 45."""
    return sum(1 for step in range(1, 3 * 15 + 1) if step > 10 and step % 2 == 0)


def run_with_a_changed_update(tmp_path, amp: str, script=None) -> types.SimpleNamespace:
    """Copy the script (and memory_utils.py, all a copy needs) to `tmp_path`, put CHANGE into its `update` before
    the gradients are zeroed, and run it with `--amp amp` in a subprocess. Returns its returncode, stdout and stderr,
    how many times the change ran, and the TD losses it logged to TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root = Path(__file__).resolve().parent.parent
    source = Path(script or root / "dqn_starcraft_split.py").read_text()
    head, tail = source.split("\ndef update(", 1)
    assert "\n    optimizer.zero_grad(set_to_none=True)\n" in tail, (
        "update zeroes the gradients after the loss"
    )
    body, rest = tail.split("\n    optimizer.zero_grad(set_to_none=True)\n", 1)
    changed = f"{head}\ndef update({body}\n{CHANGE}    optimizer.zero_grad(set_to_none=True)\n{rest}"
    (tmp_path / "my_dqn.py").write_text(changed)
    shutil.copy(root / "memory_utils.py", tmp_path / "memory_utils.py")
    env = {k: v for k, v in os.environ.items() if not k.startswith("RL_")}
    env.update(WANDB_MODE="offline", WANDB_SILENT="true")
    done = subprocess.run(
        [sys.executable, "my_dqn.py", *CHANGED_RUN_FLAGS, "--amp", amp],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    td_losses = []
    if (tmp_path / "runs" / "changed").is_dir():
        events = EventAccumulator(str(tmp_path / "runs" / "changed"), size_guidance={"scalars": 0})
        events.Reload()
        if "losses/td_loss" in events.Tags()["scalars"]:
            td_losses = [event.value for event in events.Scalars("losses/td_loss")]
    return types.SimpleNamespace(
        returncode=done.returncode,
        stdout=done.stdout,
        stderr=done.stderr,
        changed_updates=done.stdout.splitlines().count(CHANGE_MARK),
        td_losses=td_losses,
    )


def replay_of(run_dir, capacity: int = 200, res: int = 8):
    """The replay a checkpoint in `run_dir` holds, rebuilt from its files on disk as a resumed run does."""
    import torch

    import dqn_starcraft_split as dqn
    import memory_utils as mu

    state = torch.load(Path(run_dir) / "checkpoint.pt", map_location="cpu", weights_only=True)["replay"]
    rb = dqn.SplitReplayBuffer(capacity, res)
    fields = {name: (array.shape[1:], array.dtype) for name, array in rb.slots().items()}
    rb.log = mu.ReplayLog(Path(run_dir) / "replay", fields, state["chunk_rows"])
    rb.restore_log(state)
    return rb
