"""--gpu-memory-gb in both scripts: the cap's arithmetic (memory_utils), bad values refused with exit 2, a run that
cannot fit refused with exit 3 in one sentence naming what does not fit, and `--replay-frames auto` choosing within
the cap. Everything here runs on the CPU; the calls that need CUDA are in tests/test_gpu_memory_cap_cuda.py."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import dqn_starcraft_split as dqn
import dreamer_atari as da
import memory_utils as mu
from dreamer_tiny import obs_shape, tiny_args

GIB = 2**30
ROOT = Path(__file__).resolve().parent.parent
# the default Dreamer's parts as benchmark/results/dreamer_memory.json measured them on the CPU (MiB)
DEFAULT_DREAMER = json.loads((ROOT / "benchmark" / "results" / "dreamer_memory.json").read_text())


# --- memory_utils: the cap's arithmetic -------------------------------------------------------------------------------


def test_a_cap_leaves_the_cuda_context_its_share_and_caps_the_allocator_at_the_rest():
    cap = mu.GpuCap(6.0)
    assert cap.allocator_bytes == int((6.0 - mu.CUDA_CONTEXT_GIB) * GIB)
    # an 80 GiB card rehearsing a 6 GB one: the allocator gets 5.5 of its 80 GiB
    assert cap.fraction(80 * GIB) == pytest.approx(5.5 / 80)


@pytest.mark.parametrize(
    "gib,card,needle",
    [
        (0.0, None, "greater than 0.5"),
        (-2.0, None, "greater than 0.5"),
        (0.5, None, "greater than 0.5"),  # the context alone
        (float("nan"), None, "greater than 0.5"),
        (float("inf"), None, "greater than 0.5"),
        (7.0, 6 * GIB, "more than this GPU has (6.00 GiB)"),
    ],
)
def test_a_cap_that_cannot_be_is_one_sentence(gib, card, needle):
    problem = mu.gpu_cap_problem(gib, card)
    assert problem is not None and needle in problem and problem.count(". ") == 0 and problem.endswith(".")


def test_a_cap_within_the_card_is_accepted():
    assert mu.gpu_cap_problem(6.0, 6 * GIB) is None and mu.gpu_cap_problem(0.6, None) is None


def test_the_first_part_past_the_cap_is_named_with_what_came_before_and_what_would_fit():
    cap = mu.GpuCap(2.0)  # 1.5 GiB for the allocator
    parts = [
        ("the model", 0.5 * GIB, "a smaller model would fit"),
        ("the frames", 1.2 * GIB, "host frames would fit"),
    ]
    problem = mu.gpu_fit_problem(cap, parts)
    assert problem == (
        "--gpu-memory-gb 2 is too small for this run: the frames (1.20 GiB) do not fit in the 1.00 GiB it leaves "
        "after the CUDA context (0.5 GiB), the model (0.50 GiB); host frames would fit."
    )
    assert mu.gpu_fit_problem(mu.GpuCap(2.3), parts) is None  # 1.8 GiB: both fit
    held = mu.gpu_fit_problem(cap, parts[:1], held_bytes=1.2 * GIB)
    assert "the model (0.50 GiB)" in held and "what is held already (1.20 GiB)" in held


# --- dreamer_atari.py -------------------------------------------------------------------------------------------------


def test_dreamer_bad_caps_exit_2_with_one_sentence_before_anything_is_written(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for gib in (0.0, -1.0):
        with pytest.raises(SystemExit) as stop:
            da.check_input(tiny_args(env_id=da.CATCH_ID, image_size=64, gpu_memory_gb=gib))
        assert stop.value.code == da.EXIT_BAD_INPUT
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--gpu-memory-gb must be a number of GiB greater than 0.5" in err[0]
    assert list(tmp_path.iterdir()) == []


def test_dreamer_counts_its_weights_and_optimizer_state_without_building_them():
    """The arithmetic the cap checks before anything is allocated is what the built agent holds after the preflight
    (weights, buffers, the slow critic, Adam's moments and steps), to the byte."""
    args = tiny_args()
    shape = obs_shape(args)
    agent = da.build_agent(args, shape, 6, "cpu")
    da.preflight(agent, args, shape)
    tensors = [t for module in agent.modules().values() for t in (*module.parameters(), *module.buffers())]
    tensors += [v for opt in agent.optimizers for state in opt.state.values() for v in state.values()]
    held = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
    assert da.weights_and_optimizer_nbytes(args, shape, 6) == held


def test_dreamer_sizes_the_frame_store_as_the_replay_makes_it():
    for capacity, num_envs in ((300, 2), (100_000, 1)):
        replay = da.FrameStoreReplay(capacity, num_envs, seed=0, frames_device="meta")
        replay.start_episode(0, np.zeros((1, 3, 64, 64), np.uint8))
        assert da.frame_store_nbytes(capacity, num_envs, (3, 64, 64)) == replay.store.nbytes


def test_dreamer_a_cap_too_small_for_its_model_or_its_frames_exits_3_naming_it(tmp_path, capsys, monkeypatch):
    """On a CUDA device, before anything is built or written: the model and its optimizer state, then (with
    --replay-frames device) a full replay's frames, must fit under the cap."""
    monkeypatch.chdir(tmp_path)
    applied = []
    monkeypatch.setattr(da.mu, "apply_gpu_cap", lambda cap, device: applied.append(cap) or 0.01)
    cuda = torch.device("cuda")
    cases = [
        (
            da.Args(gpu_memory_gb=0.6),
            "the model and its optimizer state (0.20 GiB) do not fit",
            da.MODEL_INSTEAD,
        ),
        (
            da.Args(gpu_memory_gb=1.5, buffer_capacity=100_000, replay_frames="device"),
            "the replay's frames on the device (1.20 GiB) do not fit in the 0.80 GiB",
            da.FRAMES_INSTEAD,
        ),
    ]
    for args, needle, instead in cases:
        with pytest.raises(SystemExit) as stop:
            da.cap_gpu_memory(args, cuda)
        assert stop.value.code == da.EXIT_OOM
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0] and err[0].endswith(instead + ".")
    assert applied == [] and list(tmp_path.iterdir()) == []
    # the same frames under 6 GiB: they fit, and the cap is put in place
    da.cap_gpu_memory(da.Args(gpu_memory_gb=6.0, buffer_capacity=100_000, replay_frames="device"), cuda)
    assert applied == [mu.GpuCap(6.0)]


def test_dreamer_on_a_cpu_says_the_cap_is_ignored(capsys):
    da.cap_gpu_memory(da.Args(gpu_memory_gb=6.0), torch.device("cpu"))
    assert "--gpu-memory-gb 6 ignored: no CUDA device" in capsys.readouterr().out


def test_dreamer_auto_frames_go_where_a_quarter_of_what_the_cap_leaves_holds_them(monkeypatch, capsys):
    """`--replay-frames auto` compares a full replay's frames with a quarter of the headroom: the card's free memory,
    and under a cap what the cap leaves (`mu.gpu_headroom_bytes`, given the cap)."""
    seen = []

    def headroom(device, cap):
        seen.append(cap)
        return 8 * GIB if cap is None else 4 * GIB

    monkeypatch.setattr(da.mu, "gpu_headroom_bytes", headroom)
    cuda, shape = torch.device("cuda"), (1, 3, 64, 64)
    frames_1_1_gib = dict(buffer_capacity=100_000)  # 1.14 GiB: a quarter of 8 GiB holds it, of 4 GiB not
    assert da.replay_frames_device(da.Args(**frames_1_1_gib), cuda, shape) == cuda
    assert da.replay_frames_device(da.Args(**frames_1_1_gib, gpu_memory_gb=6.0), cuda, shape) is None
    assert "over a quarter of the cap leaves of the GPU's 4.0 GiB free" in capsys.readouterr().out
    assert seen == [None, mu.GpuCap(6.0)]


def test_dreamer_the_default_fits_a_6_gb_card_by_the_measured_parts_and_not_a_4_gb_one():
    """The check after the preflight with the default's parts as measured (benchmark/results/dreamer_memory.json):
    under 6 GiB everything fits; under 4 GiB the open-loop report is what does not."""
    mib = 2**20
    held = (
        DEFAULT_DREAMER["weights_and_optimizer"]["weights_mib"]
        + DEFAULT_DREAMER["weights_and_optimizer"]["optimizer_state_mib"]
    ) * mib
    act = DEFAULT_DREAMER["activations"]
    parts = [
        (
            "the replay's frames on the device",
            DEFAULT_DREAMER["frames"]["frame_store_mib_by_capacity"]["100000"] * mib,
        ),
        ("the update's activations at the preflight's peak", act["preflight_step"]["peak_mib"] * mib),
        ("an open-loop report's activations", act["open_loop_report"]["peak_mib"] * mib),
    ]
    assert da.fit_problem(mu.GpuCap(6.0), parts, held_bytes=held) is None
    problem = da.fit_problem(mu.GpuCap(4.0), parts, held_bytes=held)
    assert problem.startswith(
        "--gpu-memory-gb 4 is too small for this run: an open-loop report's activations"
    )
    assert problem.endswith(da.REPORT_INSTEAD + ".")


# --- dqn_starcraft_split.py -------------------------------------------------------------------------------------------


def run_dqn(tmp_path, args, env):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("RL_")}, **env}
    return subprocess.run(
        [sys.executable, str(ROOT / "dqn_starcraft_split.py"), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_dqn_bad_caps_exit_2_from_the_command_line_or_its_rl_variable(tmp_path):
    for args, env, needle in (
        (["--gpu-memory-gb", "0"], {}, "gpu_memory_gb must be more than 0.5 GiB"),
        ([], {"RL_GPU_MEMORY_GB": "-3"}, "got -3.0 (from RL_GPU_MEMORY_GB)"),
    ):
        result = run_dqn(tmp_path, args, env)
        lines = result.stderr.strip().splitlines()
        assert result.returncode == 2 and len(lines) == 1 and needle in lines[0], result.stderr
    assert list(tmp_path.iterdir()) == []
    args, sources = dqn.parse_args([], environ={"RL_GPU_MEMORY_GB": "6"})
    assert args.gpu_memory_gb == 6.0 and sources["gpu_memory_gb"] == "RL_GPU_MEMORY_GB"


def test_dqn_counts_its_networks_and_optimizer_state_without_building_them():
    args = dqn.with_map_defaults(dqn.Args(res=8))
    agent = dqn.build_agent(args, seed=0, device="cpu")
    dqn.preallocate(
        agent.q_network, agent.target_network, agent.optimizer, dqn.mu.amp("off", "cpu"), args, 4, "cpu"
    )
    tensors = [
        t for net in (agent.q_network, agent.target_network) for t in (*net.parameters(), *net.buffers())
    ]
    tensors += [v for state in agent.optimizer.state.values() for v in state.values()]
    held = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())
    assert dqn.networks_and_optimizer_nbytes(args) == held


def test_dqn_a_cap_too_small_for_its_networks_exits_3_before_anything_is_written(tmp_path, monkeypatch):
    # 1.26 GiB of networks and Adam's state against the 0.5 GiB a 1 GiB cap leaves the allocator
    args = dqn.with_map_defaults(dqn.Args(tower_channels=2048, fused_channels=2048, gpu_memory_gb=1.0))
    with pytest.raises(dqn.DoesNotFit) as refused:
        dqn.check_fits_under_cap(args, torch.device("cuda"))
    assert str(refused.value).startswith(
        "--gpu-memory-gb 1 is too small for this run: the Q networks and the optimizer state (1.26 GiB) do not fit"
    )
    dqn.check_fits_under_cap(dqn.Args(gpu_memory_gb=0.6), torch.device("cuda"))  # the default's fit
    # main turns it into one sentence and exit 3, the results folder left empty
    monkeypatch.setattr(dqn, "resolve_device", lambda a: torch.device("cuda"))
    code = dqn.main(dataclasses_replace(args, save_path=str(tmp_path / "results")), {})
    assert code == dqn.EXIT_OOM and not (tmp_path / "results").exists()


def dataclasses_replace(args, **changes):
    import dataclasses

    return dataclasses.replace(args, **changes)


def test_dqn_a_gpu_without_room_for_its_cuda_context_exits_3_with_a_report(tmp_path, monkeypatch, caplog):
    """The DQN incident's card at 65 MB free: making the context fails with the driver's out-of-memory error (not
    torch's OutOfMemoryError); the run says so, writes oom/ and ends with exit 3, no traceback."""

    def no_room(device=None):
        raise RuntimeError("CUDA error: out of memory")

    monkeypatch.setattr(torch.cuda, "mem_get_info", no_room)
    logger = logging.getLogger("test_dqn_no_room")
    with (
        caplog.at_level(logging.INFO, logger="test_dqn_no_room"),
        pytest.raises(dqn.RunInterrupted) as stopped,
    ):
        dqn.start_cuda(dqn.Args(), torch.device("cuda"), str(tmp_path), logger)
    assert stopped.value.exit_code == dqn.EXIT_OOM
    assert "no room for this process's CUDA context" in caplog.text
    assert (tmp_path / "oom" / "report.json").exists()
    # any other CUDA error is not taken for one
    monkeypatch.setattr(
        torch.cuda, "mem_get_info", lambda device=None: (_ for _ in ()).throw(RuntimeError("boom"))
    )
    with pytest.raises(RuntimeError, match="boom"):
        dqn.start_cuda(dqn.Args(), torch.device("cuda"), str(tmp_path), logger)


def test_dqn_on_a_cpu_logs_that_the_cap_is_ignored(tmp_path, caplog):
    logger = logging.getLogger("test_dqn_cpu_cap")
    with caplog.at_level(logging.INFO, logger="test_dqn_cpu_cap"):
        dqn.start_cuda(dqn.Args(gpu_memory_gb=6.0), torch.device("cpu"), str(tmp_path), logger)
    assert "--gpu-memory-gb 6 ignored: no CUDA device" in caplog.text
