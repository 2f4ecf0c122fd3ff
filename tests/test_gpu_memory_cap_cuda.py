"""--gpu-memory-gb and the shared graph pool where they need CUDA: the allocator really capped, the headroom the
`auto` frames read, two captured functions in one pool, and tiny runs of both scripts under a cap. Skipped without
CUDA; the GPU lease runs them (`dev/gpu/gpu_lease.sh start`, with pytest among the carried wheels)."""

import contextlib
import io

import pytest
import torch

import dqn_starcraft_split as dqn
import dreamer_atari as da
import memory_utils as mu
from dqn_tiny import TINY_FLAGS as DQN_TINY_FLAGS
from dreamer_tiny import tiny_args

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
GIB = 2**30


@pytest.fixture
def uncapped_afterwards():
    """The cap is process-wide: each test leaves the allocator as it found it."""
    yield
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(1.0)


def test_cuda_the_cap_stops_the_allocator_and_the_headroom_follows_it(uncapped_afterwards):
    cap = mu.GpuCap(2.0)
    fraction = mu.apply_gpu_cap(cap, "cuda")
    assert fraction == pytest.approx(cap.allocator_bytes / torch.cuda.mem_get_info()[1])
    before = mu.gpu_headroom_bytes("cuda", cap)
    assert 0 < before <= cap.allocator_bytes
    block = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    assert mu.gpu_headroom_bytes("cuda", cap) <= before - block.numel()
    with pytest.raises(torch.OutOfMemoryError) as oom:
        torch.empty(2 * GIB, dtype=torch.uint8, device="cuda")
    assert "allowed" in str(oom.value)  # the per-process cap, which diagnose_oom explains


def test_cuda_two_captured_functions_in_one_pool_compute_what_they_did_alone_in_less_memory():
    """Each function makes 64 MiB of temporaries; replayed alternately, as the updates are, both give the eager
    results, and one pool for both reserves less than a pool each."""

    def first(inputs):
        x = inputs["x"]
        temporary = x.repeat(64)  # 64 MiB
        return ((temporary * 2).sum() + x.sum(),)

    def second(inputs):
        y = inputs["y"]
        temporary = y.repeat(64)
        return ((temporary - 1).mean() * y.mean(),)

    def reserved_after(pool):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        start = torch.cuda.memory_reserved()
        one, two = da.CudaGraphed(first, pool=pool), da.CudaGraphed(second, pool=pool)
        for i in range(6):  # 3 eager calls each, the captures, then replays
            x = torch.full((2**18,), float(i), device="cuda")
            (a,) = one({"x": x})
            (b,) = two({"y": a.expand(2**18).contiguous()})
            expected_a = first({"x": x})[0]
            torch.testing.assert_close(a, expected_a)
            torch.testing.assert_close(b, second({"y": expected_a.expand(2**18).contiguous()})[0])
        torch.cuda.synchronize()
        return torch.cuda.memory_reserved() - start  # the graphs, and their pools, still alive here

    separate = reserved_after(None)
    shared = reserved_after(torch.cuda.graph_pool_handle())
    assert shared <= separate - 48 * 2**20, (shared, separate)


def test_cuda_the_update_steps_share_one_pool():
    args = tiny_args()
    agent = da.build_agent(args, (1, 3, 64, 64), 6, "cuda")
    world_model_step, behavior_step = da.make_update_steps(agent, args)
    assert world_model_step.pool is not None and world_model_step.pool == behavior_step.pool


def test_cuda_a_tiny_dreamer_run_trains_under_a_cap_and_says_its_budget(
    tmp_path, monkeypatch, uncapped_afterwards
):
    monkeypatch.chdir(tmp_path)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = da.main(
            tiny_args(
                total_timesteps=200, learning_starts=100, train_ratio=8.0, gpu_memory_gb=1.5, video_every=150
            )
        )
    assert result["updates"] > 10
    printed = out.getvalue()
    assert "gpu: at most 1.5 GiB" in printed and "gpu: under --gpu-memory-gb 1.5: held" in printed
    assert torch.cuda.max_memory_reserved() <= mu.GpuCap(1.5).allocator_bytes


def test_cuda_a_dreamer_whose_update_does_not_fit_the_cap_exits_3_before_training(
    tmp_path, monkeypatch, capsys, uncapped_afterwards
):
    """The default model at a batch of 64 x 64 needs several GiB for one update: under 1.5 GiB it is refused at the
    preflight (its OOM, or the check after it), exit 3, nothing trained."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        da.main(da.Args(batch_size=64, gpu_memory_gb=1.5, total_timesteps=2000))
    assert stop.value.code == da.EXIT_OOM
    err = capsys.readouterr().err
    assert "update" in err and "--gpu-memory-gb 1.5" in err and "Traceback" not in err


def test_cuda_a_tiny_dqn_run_trains_under_a_cap(tmp_path, uncapped_afterwards):
    args, sources = dqn.parse_args(
        [*DQN_TINY_FLAGS, "--num-episodes", "3", "--gpu-memory-gb", "1", "--save-path", str(tmp_path / "r")],
        environ={},
    )
    args = __import__("dataclasses").replace(args, log_dir=str(tmp_path / "runs"))
    assert dqn.main(args, sources) == 0
    log = next((tmp_path / "r").glob("*/train.log")).read_text()
    assert "gpu: at most 1 GiB (--gpu-memory-gb)" in log
