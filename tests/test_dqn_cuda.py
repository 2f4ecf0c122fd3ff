"""The path of dqn_starcraft_split.py that a CPU cannot run: --amp fp16 (what --amp auto means on CUDA), autocast in
fp16 with an enabled loss scaler. Part 1's `update` is what trains there too. Skipped without CUDA."""

import pytest
import torch

from dqn_tiny import run_with_a_changed_update, updates_of_a_run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.slow
def test_a_change_to_part_1s_update_trains_with_fp16_on_cuda(tmp_path):
    """As tests/test_dqn_parts.py checks for --amp off and bf16: a copy whose `update` adds a Q-value penalty runs
    it in every update of a tiny run on CUDA with --amp fp16, and the logged TD loss carries it."""
    run = run_with_a_changed_update(tmp_path, "fp16")
    assert run.returncode == 0, run.stderr[-2000:]
    assert "amp fp16" in run.stdout  # the run's line: device cuda, amp fp16
    assert run.changed_updates == updates_of_a_run() + 1  # and once in the preallocation's update, undone
    assert len(run.td_losses) == updates_of_a_run() and min(run.td_losses) >= 1000.0
