"""The kernels module (dreamer_kernels.py) beside the script: the script trains without it; it never imports the
script; and no run dies for speed. A fast path that cannot import, compile or launch, or whose float32 kernels
disagree while their float64 check agrees, steps aside at start-up with one line naming it and its flag; a capture
that fails leaves that update eager; a check that disagrees at a checkpoint drops its path and the run goes on, and
a resumed run keeps it dropped. Where a CPU cannot produce the failure, a stand-in raises in its place."""

import ast
import functools
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dreamer_atari as da
import dreamer_kernels as dk
from dreamer_tiny import CPU_PATHS, TINY, TINY_FLAGS, obs_shape, tiny_args

ROOT = Path(__file__).resolve().parent.parent
CATCH_FLAGS = [
    *TINY_FLAGS,
    *("--env-id", "Catch-v0", "--num-envs", "1", "--total-timesteps", "40", "--learning-starts", "20"),
    *("--train-ratio", "16", "--log-interval", "20", "--video-every", "0"),
]


def copy_alone(tmp_path: Path, kernels_source: str | None = None) -> Path:
    """dreamer_atari.py and memory_utils.py copied to an empty folder, with `kernels_source` as dreamer_kernels.py
    beside them where given."""
    for name in ("dreamer_atari.py", "memory_utils.py"):
        shutil.copy(ROOT / name, tmp_path / name)
    if kernels_source is not None:
        (tmp_path / "dreamer_kernels.py").write_text(kernels_source)
    return tmp_path


def run_copy(folder: Path, *flags: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "dreamer_atari.py", *CATCH_FLAGS, *flags],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=600,
        env={key: value for key, value in os.environ.items() if key != "PYTHONPATH"},
    )


@pytest.mark.slow
@pytest.mark.parametrize("kernels", ["absent", "fails to import"])
def test_the_script_and_memory_utils_alone_train_catch(tmp_path, kernels):
    """Copied to an empty folder with memory_utils.py alone, or beside a kernels module that raises as it is imported,
    the script trains Catch to exit 0 on Part 1's functions, and says so in one line."""
    source = None if kernels == "absent" else 'raise RuntimeError("a half-written module")\n'
    done = run_copy(copy_alone(tmp_path, source))
    assert done.returncode == 0, done.stderr[-2000:]
    said = [line for line in done.stdout.splitlines() if "kernels module" in line]
    assert len(said) == 1 and "Part 1's functions run" in said[0], done.stdout
    assert ("ModuleNotFoundError" if kernels == "absent" else "a half-written module") in said[0]
    assert list((tmp_path / "runs").glob("*/events.out.tfevents.*"))


def test_the_kernels_module_never_imports_the_script():
    """It is handed Part 1 (`bind`): a copy of the script under another name hands its own."""
    tree = ast.parse((ROOT / "dreamer_kernels.py").read_text())
    imported = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not {name for name in imported if name and "dreamer_atari" in name}
    assert all(hasattr(da, name) for name in dk.PART1)


def installed(capsys, **overrides):
    """A tiny agent with the fast paths the flags ask for on the CPU (Triton interpreted), and what it said."""
    args = tiny_args(env_id="Catch-v0", num_envs=1, **overrides)
    torch.manual_seed(0)
    agent = da.build_agent(args, obs_shape(args), 3, "cpu")
    da.speed_up_agent(agent, args)
    return agent, capsys.readouterr().out


needs_triton = pytest.mark.skipif(
    dk.triton_problem(torch.device("cpu")) is not None or not dk.triton_interprets(),
    reason="Triton's interpreter runs the kernels on the CPU",
)


@needs_triton
def test_float32_kernels_that_disagree_step_aside_while_float64_agrees(capsys, monkeypatch):
    """The fused scan's float32 kernels at the run's batch against the fast observe: with the tolerance at 0 the real
    comparison disagrees (float32 rounding), its float64 check still agrees, and the fast observe runs, said in one
    line naming the path and --fused-scan off."""
    monkeypatch.setattr(dk, "FUSED_SCAN_DEVICES", {"cuda", "cpu"})
    agent, said = installed(capsys, fused_scan="on")
    assert type(agent.observe) is dk.FusedObserve and "fused observe scan" not in said
    monkeypatch.setattr(dk, "FLOAT32_TOLERANCE", 0.0)
    agent, said = installed(capsys, fused_scan="on")
    assert type(agent.observe) is dk.FastObserve
    lines = [line for line in said.splitlines() if "fused observe scan" in line]
    assert len(lines) == 1 and "float32" in lines[0] and "--fused-scan off" in lines[0], said


@needs_triton
@pytest.mark.parametrize("failure", ["compile", "launch"])
def test_a_kernel_that_cannot_compile_or_launch_steps_aside(capsys, monkeypatch, failure):
    """Stand-ins for what a CPU cannot produce: Triton refusing a kernel when it compiles (OutOfResources) or CUDA
    refusing its launch. The fused epilogues step aside for gather_imagine_step (the heads keep their own layers'
    LayerNorms), the fused scan for the fast observe, each in one line naming --fused-epilogues off or --fused-scan
    off; the run's other fast paths stay."""
    monkeypatch.setattr(dk, "FUSED_SCAN_DEVICES", {"cuda", "cpu"})
    error = (
        RuntimeError(
            "OutOfResources: out of resource: shared memory, Required: 262144, Hardware limit: 232448"
        )
        if failure == "compile"
        else RuntimeError("CUDA error: no kernel image is available for execution on the device")
    )

    def refuses(*args, **kwargs):
        raise error

    monkeypatch.setattr(dk, "launch_epilogue", refuses)
    monkeypatch.setattr(dk, "launch", refuses)
    agent, said = installed(capsys, fused_scan="on", fused_epilogues="on")
    assert type(agent.observe) is dk.FastObserve
    assert agent.imagine.gathers and not agent.imagine.fused and not agent.imagined_heads.fused
    lines = [line for line in said.splitlines() if "cannot run on this device" in line]
    assert len(lines) == 2, said
    assert "--fused-scan off" in lines[0] and "--fused-epilogues off" in lines[1]
    assert all(str(error).split(":")[0] in line for line in lines)


def test_a_capture_that_fails_leaves_that_update_eager(capsys, monkeypatch):
    """A CUDA-graph capture that fails (a stand-in raises where capture would: this CPU has no CUDA) leaves the update
    eager from then on, with one line naming --no-cudagraph; each call still returns the update's own results."""
    calls = []

    def update(inputs):
        calls.append(inputs["x"].item())
        return (inputs["x"] * 2,)

    def capture(self, inputs):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    monkeypatch.setattr(da.CudaGraphed, "run_eagerly", lambda self, inputs: self.fn(inputs))
    monkeypatch.setattr(da.CudaGraphed, "capture", capture)
    graphed = da.CudaGraphed(update, warmup=2)
    results = [graphed({"x": torch.tensor(float(i))})[0].item() for i in range(6)]
    assert results == [0.0, 2.0, 4.0, 6.0, 8.0, 10.0] and calls == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    said = [line for line in capsys.readouterr().out.splitlines() if "CUDA graph" in line]
    assert len(said) == 1 and "update" in said[0] and "--no-cudagraph" in said[0], said


def scalars(run_dir: str, key: str) -> list[float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(run_dir)
    events.Reload()
    return [event.value for event in events.Scalars(key)] if key in events.Tags()["scalars"] else []


@pytest.mark.slow
def test_a_check_that_disagrees_mid_run_drops_its_path_and_a_resume_keeps_it_dropped(
    tmp_path, monkeypatch, capsys
):
    """At start-up the fast imagination agrees; at the first check on live weights (update 10 of --check-every 10)
    it disagrees (a stand-in for weights that a later step moved where the two part: the CPU's are the same code).
    The run does not stop: one warning line names --fast-imagine off and the update, Part 1's `imagine` trains from
    there on, the checkpoint records the dropped path and TensorBoard counts it. Resumed, the run keeps it dropped,
    said in one line."""
    monkeypatch.chdir(tmp_path)
    checks, imagined = [], []
    real_check, real_imagine = dk.check_fast_imagine, da.imagine

    def check_fast_imagine(agent, *args, **kwargs):
        checks.append(agent)
        if len(checks) > 1:  # after start-up
            raise da.FastPathMismatch(
                "the fast imagination gives another feat than imagine (a stand-in): run with --fast-imagine off.",
                off={"fast_imagine": "off"},
            )
        return real_check(agent, *args, **kwargs)

    @functools.wraps(real_imagine)  # stands for Part 1's imagine: the paths pinned to it stay pinned
    def imagine(*args, **kwargs):
        imagined.append(1)
        return real_imagine(*args, **kwargs)

    monkeypatch.setattr(dk, "check_fast_imagine", check_fast_imagine)
    monkeypatch.setattr(da, "imagine", imagine)
    schedule = dict(total_timesteps=60, learning_starts=20, train_ratio=16.0, log_interval=20, video_every=0)
    args = da.Args(
        **TINY, **CPU_PATHS, env_id="Catch-v0", num_envs=1, vector_mode="sync", check_every=10, **schedule
    )
    counters = da.main(args)
    said = capsys.readouterr().out
    assert counters["global_step"] == 60 and counters["dropped_fast_paths"] == {"fast_imagine": "off"}
    warnings = [
        line for line in said.splitlines() if line.startswith("warning:") and "--fast-imagine off" in line
    ]
    assert len(warnings) == 1 and "(update 10)" in warnings[0], said
    assert imagined, "Part 1's imagine did not train after the drop"
    assert scalars(counters["run_dir"], "debug/speed/dropped_paths")[-1] == 1.0
    saved = torch.load(Path(counters["run_dir"]) / "checkpoint.pt", weights_only=False)
    assert saved["counters"]["dropped_fast_paths"] == {"fast_imagine": "off"}

    imagined.clear()
    checks.clear()
    checks.append("start-up already checked")  # the resumed run's checks would disagree too: it must not ask
    resumed = da.main(
        da.Args(
            **{**dict(TINY), **CPU_PATHS, **schedule, "total_timesteps": 80},
            env_id="Catch-v0",
            num_envs=1,
            vector_mode="sync",
            resume=str(Path(counters["run_dir"]) / "checkpoint.pt"),
        )
    )
    said = capsys.readouterr().out
    assert resumed["global_step"] == 80 and resumed["dropped_fast_paths"] == {"fast_imagine": "off"}
    assert (
        len([line for line in said.splitlines() if "stay dropped" in line and "--fast-imagine off" in line])
        == 1
    )
    assert imagined and not [line for line in said.splitlines() if line.startswith("warning:")], said


def test_the_docs_table_of_fast_paths_is_the_modules_and_cites_real_gpu_results():
    """docs/dreamer_kernels.md's table is `fast_paths_table()`'s, never typed: each GPU result it cites is a
    committed results file of the card it names, and every path `auto` turns on on CUDA rests on one."""
    page = (ROOT / "docs" / "dreamer_kernels.md").read_text()
    start, end = (
        "<!-- fast paths: made by dreamer_kernels.fast_paths_table() -->",
        "<!-- end of fast paths -->",
    )
    assert page[page.index(start) + len(start) : page.index(end)].strip() == dk.fast_paths_table()
    for path in dk.FAST_PATHS:
        for card, commit, results in path.shown:
            data = json.loads((ROOT / results).read_text())
            assert data["gpu_name"] in card and len(commit) >= 7, (path.flag, results)
    for name, capabilities in dk.SHOWN_ON.items():
        path = next(path for path in dk.FAST_PATHS if path.flag == "--" + name.replace("_", "-"))
        assert not capabilities or path.shown, f"{path.flag} is on by default on CUDA without a GPU result"


@pytest.mark.slow
def test_frames_on_the_device_that_disagree_mid_run_give_way_to_part_1s_sampling(
    tmp_path, monkeypatch, capsys
):
    """The frames on the device (`--replay-frames device`, here the CPU's memory) agree at start-up; at the first
    check on live weights (update 10) their check disagrees (a stand-in). The run goes on: one warning line names
    --replay-frames host, the frames stay where they are and Part 1's `sample_batch` and `EpisodeReplay.fill` make
    every later batch from them."""
    monkeypatch.chdir(tmp_path)
    checks, fills = [], []
    real_check, real_fill = da.check_device_frames, da.EpisodeReplay.fill

    def check_device_frames(run):
        checks.append(run.step)
        if len(checks) > 1:
            raise da.FastPathMismatch(
                "sampling with the frames on the device gives another obs (a stand-in): run with --replay-frames host.",
                off={"replay_frames": "host"},
            )
        return real_check(run)

    def fill(self, windows, sequence_length):
        fills.append(type(self).__name__)
        return real_fill(self, windows, sequence_length)

    monkeypatch.setattr(da, "check_device_frames", check_device_frames)
    monkeypatch.setattr(da.EpisodeReplay, "fill", fill)
    schedule = dict(total_timesteps=50, learning_starts=20, train_ratio=16.0, log_interval=10, video_every=0)
    args = da.Args(
        **TINY,
        env_id="Catch-v0",
        num_envs=1,
        vector_mode="sync",
        replay_frames="device",
        check_every=10,
        **schedule,
    )
    counters = da.main(args)
    said = capsys.readouterr().out
    assert counters["global_step"] == 50 and counters["dropped_fast_paths"] == {"replay_frames": "host"}
    warnings = [
        line for line in said.splitlines() if line.startswith("warning:") and "--replay-frames host" in line
    ]
    assert len(warnings) == 1 and "(update 10)" in warnings[0], said
    assert fills.count("FrameStoreReplay") >= 20 - 1, fills  # every batch after the drop, by Part 1's fill


def test_a_check_that_cannot_run_mid_run_ends_nothing(tmp_path, monkeypatch, capsys):
    """A check on live weights that raises something else than a disagreement (a stand-in for a kernel a later
    compile refuses) is one warning line; the run goes on with the paths that agreed at start-up."""
    monkeypatch.chdir(tmp_path)
    calls = []
    real_check = dk.check_fast_paths

    def check_fast_paths(agent, args, kernels=True):
        calls.append(kernels)
        if len(calls) > 1:
            raise RuntimeError("OutOfResources: out of resource: shared memory (a stand-in)")
        return real_check(agent, args, kernels)

    monkeypatch.setattr(dk, "check_fast_paths", check_fast_paths)
    schedule = dict(total_timesteps=40, learning_starts=20, train_ratio=16.0, log_interval=20, video_every=0)
    counters = da.main(
        da.Args(**TINY, env_id="Catch-v0", num_envs=1, vector_mode="sync", check_every=10, **schedule)
    )
    said = capsys.readouterr().out
    assert counters["global_step"] == 40 and "dropped_fast_paths" not in counters
    warnings = [
        line for line in said.splitlines() if "check could not run at step" in line and "(update 10," in line
    ]
    assert len(warnings) == 1 and "OutOfResources" in warnings[0], said
