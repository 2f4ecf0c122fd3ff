"""The benchmark's `--quick` contract, and the soak method that its memory figure rests on."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "benchmark" / "run.py"
REQUIRED_KEYS = ("buffer_bytes_per_step", "buffer_bytes_limit", "sample_ms", "update_ms", "sample_to_update_ratio",
                 "soak_uss_slope_mb_per_10k", "soak_turnovers")


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One `run.py --quick` (asking for the peer too, which --quick must skip), its JSON and its output."""
    tmp = tmp_path_factory.mktemp("bench")
    out = tmp / "quick.json"
    results_dir = tmp / "results"
    done = subprocess.run(
        [sys.executable, str(RUN), "--quick", "--json", str(out), "--peer", "sheeprl", "--results-dir",
         str(results_dir)],
        capture_output=True, text=True, cwd=ROOT, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done, json.loads(out.read_text()), results_dir


@pytest.mark.slow
def test_quick_writes_every_required_figure_as_a_number(quick_run):
    _, result, _ = quick_run
    for key in REQUIRED_KEYS:
        assert isinstance(result[key], (int, float)) and not isinstance(result[key], bool), key
    assert result["quick"] is True
    # the quick update is at a smaller batch shape, and says which
    assert result["update_batch"] != "B16 x T50"
    assert result["sample_batch"] == "B16 x T50"


@pytest.mark.slow
def test_quick_figures_are_physically_plausible(quick_run):
    _, result, _ = quick_run
    # real arrays: at least one 84x84 frame plus the auxiliary fields per stored step, and far below the seed's
    # four stacked frames (28,224 B)
    assert result["buffer_bytes_limit"] >= 84 * 84
    assert result["buffer_bytes_limit"] <= result["buffer_bytes_per_step"] < 2 * 84 * 84
    assert result["buffer_stats_agree"] is True
    assert result["soak_turnovers"] >= 10
    assert result["sample_ms"] > 0 and result["update_ms"] > 0
    assert 0 < result["sample_to_update_ratio"] < 1
    assert result["dqn_updates_per_s"] > 0 and result["dqn_env_steps_per_s_MoveToBeacon"] > 0
    # targets are defined at the seed sizes: quick does not claim them
    assert set(result["targets_met"].values()) == {None}


@pytest.mark.slow
def test_quick_prints_a_table_skips_the_peer_and_writes_no_results_file(quick_run):
    done, result, results_dir = quick_run
    assert done.stdout.lstrip().startswith("| figure | ours |")
    assert "| replay bytes per stored Pong step |" in done.stdout
    assert "--quick skips the peer" in done.stderr
    assert not any(key.startswith(("peer_", "ratio_")) for key in result)
    assert not results_dir.exists()
    assert result["gpu"]["run"] is False or result["machine"]["cuda_available"]


@pytest.mark.parametrize("argv, named", [(["--threads", "0"], "--threads"), (["--peer", "nobody"], "peer")])
def test_bad_input_is_one_clear_error_with_status_2_and_nothing_written(tmp_path, argv, named):
    out = tmp_path / "never.json"
    done = subprocess.run([sys.executable, str(RUN), "--quick", "--json", str(out), *argv],
                          capture_output=True, text=True, cwd=ROOT, timeout=120, check=False)
    assert done.returncode == 2
    assert named in done.stderr
    assert "Traceback" not in done.stderr
    assert not out.exists()


def test_soak_slope_counts_only_points_after_the_replay_is_full():
    from benchmark import bench_utils

    capacity = 1_000
    steps = list(range(250, 12_001, 250))
    # filling: +10 MB per 1k steps until full; then a true leak of 0.3 MB per 1k steps
    unexplained = [s / 100 if s < capacity else 10 + 0.3 * (s - capacity) / 1_000 for s in steps]
    summary = bench_utils.soak_summary(steps, unexplained, full_at=capacity, capacity=capacity)
    assert summary["soak_uss_slope_mb_per_10k"] == pytest.approx(3.0)
    assert summary["soak_turnovers"] == pytest.approx(11.0)
    with pytest.raises(RuntimeError, match="after the buffer was full"):
        bench_utils.soak_summary(steps[:3], unexplained[:3], full_at=capacity, capacity=capacity)


@pytest.mark.slow
def test_soak_sees_a_reference_leak_in_the_real_training_loop(monkeypatch):
    """The soak runs dreamer_atari.main; a loop that keeps every sampled batch alive must show a slope far above
    the 1 MB per 10k target (undo the leak below and the slope falls back to noise around zero)."""
    import torch

    import dreamer_atari as da
    from benchmark import ours_dreamer

    kept = []
    sample = da.EpisodeReplay.sample

    def leaky_sample(self, batch_size, sequence_length):
        batch = sample(self, batch_size, sequence_length)
        kept.append(batch)  # the reference leak: every batch stays reachable
        return batch

    monkeypatch.setattr(da.EpisodeReplay, "sample", leaky_sample)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        summary = ours_dreamer.cmd_soak(capacity=150, turnovers=10, every=150)
    finally:
        torch.set_num_threads(threads)
    assert len(kept) > 10
    assert summary["soak_turnovers"] >= 10
    assert summary["soak_uss_slope_mb_per_10k"] > 10 * 1.0
