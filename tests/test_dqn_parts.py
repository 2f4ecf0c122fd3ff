"""dqn_starcraft_split.py reads top to bottom in three parts, each opened by a banner that names it: the algorithm,
speed, the run. Part 1 names nothing that Part 2 defines, Part 2 is installed by one call, and with every speed option
off the loop runs Part 1's own functions; Part 2's mixed-precision update is Part 1's update, step for step."""

import ast
import re
from pathlib import Path

import numpy as np
import torch

import dqn_starcraft_split as dqn
import memory_utils as mu

SOURCE = Path(dqn.__file__).read_text()
BANNERS = ("# Part 1: the algorithm", "# Part 2: speed", "# Part 3: the run")


def parts(source: str) -> list[str]:
    """The text of Part 1 (everything above Part 2's banner: the docstring and imports open it), Part 2 and Part 3.
    Fails unless each banner stands once, at the start of a line, in the order of BANNERS."""
    lines = source.splitlines(keepends=True)
    starts = []
    for banner in BANNERS:
        found = [i for i, line in enumerate(lines) if line.startswith(banner)]
        assert len(found) == 1, f"the banner {banner!r} stands {len(found)} times, not once"
        starts.append(found[0])
    assert starts == sorted(starts), f"the banners stand out of order, at lines {[i + 1 for i in starts]}"
    return ["".join(lines[: starts[1]]), "".join(lines[starts[1] : starts[2]]), "".join(lines[starts[2] :])]


def defined_names(part: str) -> set[str]:
    """The names a part defines at module level: functions, classes, assignments and imports."""
    names = set()
    for node in ast.parse(part).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(alias.asname or alias.name).split(".")[0] for alias in node.names}
    return names


def test_the_three_banners_stand_in_order_and_part_2_lies_between_the_algorithm_and_the_run():
    algorithm, speed, run = parts(SOURCE)
    assert "class Args" in algorithm and "def train_one_seed" in algorithm  # the settings and the loop
    assert defined_names(speed), "Part 2 defines the speed machinery"
    assert "def main" in run and "def parse_args" in run


def test_part_1_names_nothing_that_part_2_defines():
    """Not in code, strings or comments: Part 1 reads, and runs, without Part 2."""
    algorithm, speed, _ = parts(SOURCE)
    part_2_names = defined_names(speed)
    assert {"speed_up", "MixedPrecision", "Executables"} <= part_2_names
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", algorithm))
    assert not part_2_names & words, f"Part 1 names what Part 2 defines: {sorted(part_2_names & words)}"


def test_part_2_is_installed_by_one_call_and_off_the_loop_calls_part_1s_update():
    calls = [
        node
        for node in ast.walk(ast.parse(SOURCE))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "speed_up"
    ]
    assert len(calls) == 1, f"speed_up is called {len(calls)} times, not once (when a run is set up)"
    threads = torch.get_num_threads()
    try:
        executables = dqn.speed_up(dqn.Args(), "cpu")  # --amp auto: off on a CPU
    finally:
        torch.set_num_threads(threads)
    assert executables.amp.mode == "off" and executables.update is dqn.update


def trained_weights(update, seed=0, updates=3):
    """Weights and Adam's moments after a few updates of one network on one real batch."""
    torch.manual_seed(seed)
    q, target = dqn.SplitQNetwork(8), dqn.SplitQNetwork(8)
    target.load_state_dict(q.state_dict())
    optimizer = torch.optim.Adam(q.parameters(), lr=1e-3)
    env, rng = (
        dqn.BuiltinMiniGame("CollectMineralShards", res=8, step_mul=64, seed=seed),
        np.random.default_rng(0),
    )
    rb, obs = dqn.SplitReplayBuffer(64, 8), env.reset()
    for _ in range(40):
        action = dqn.select_action(q, obs, 1.0, rng, "cpu")
        next_obs, reward, done = env.step(*dqn.decode_action(action, 8))
        rb.add(obs, action, reward, done)
        obs = env.reset() if done else next_obs
    batch = dqn.batch_to_device(rb.sample(8, rng, 3), "cpu")
    logged = [update(q, target, optimizer, batch, dqn.Args(res=8)) for _ in range(updates)]
    moments = [s[k] for s in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]
    return [p.detach().clone() for p in q.parameters()] + moments, logged


def test_the_mixed_precision_update_is_part_1s_update_step_for_step():
    """With autocast off, MixedPrecision.update trains to Part 1's weights bit for bit, also through an enabled loss
    scaler (a power of two up and down again is exact): an edit to Part 1's update that Part 2 misses fails here."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected, expected_logged = trained_weights(dqn.update)
        for scaler in (torch.amp.GradScaler("cpu", enabled=False), torch.amp.GradScaler("cpu", enabled=True)):
            setup = mu.AmpSetup(mode="off", device_type="cpu", dtype=None, scaler=scaler)
            weights, logged = trained_weights(dqn.MixedPrecision(setup).update)
            assert all(torch.equal(a, b) for a, b in zip(expected, weights, strict=True)), scaler.is_enabled()
            assert [{k: v.item() for k, v in m.items()} for m in logged] == [
                {k: v.item() for k, v in m.items()} for m in expected_logged
            ]
    finally:
        torch.set_num_threads(threads)
