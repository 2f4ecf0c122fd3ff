"""`dev/gpu/gpu_stages.py --stage incidents` (dev/gpu/incident_stage.py, issue 66) checked on the CPU at tiny sizes:
the stage's results inside the lease's results file, the DQN's update recorded as each precision trains, and the
verdicts. The parts that need a second process filling a GPU are skipped here and said so."""

import json
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

import dqn_starcraft_split as dqn
from dev.gpu import incident_stage

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("incidents")
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "dev" / "gpu" / "gpu_stages.py"),
            "--stage",
            "incidents",
            "--device",
            "cpu",
            "--quick",
            "--results-dir",
            str(tmp),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (path,) = tmp.glob("*.json")
    return json.loads(path.read_text()), path.with_suffix(".md").read_text()


def test_the_stage_runs_dreamer_under_the_cap_and_the_dqn_in_each_precision_into_the_results(staged):
    result, markdown = staged
    assert result["stages"] == ["incidents"] and result["incidents_returncode"] == 0
    assert result["code"]["commit"] and result["incidents"]["code"]["commit"] == result["code"]["commit"]
    dreamer = result["incidents"]["dreamer_6gb"]
    assert dreamer["returncode"] == 0 and dreamer["updates"] > 0 and not dreamer["traceback"]
    assert dreamer["command"].startswith("python dreamer_atari.py --gpu-memory-gb 6")
    assert result["dreamer_6gb_no_oom"] is True
    precisions = result["incidents"]["dqn_precisions"]
    assert precisions["fp16"] == {"skipped": "fp16 needs CUDA"}
    for amp in ("bf16", "off"):
        run = precisions[amp]
        assert run["returncode"] == 0 and run["updates"] > 0 and run["losses_finite"] is True
        before, after = run["first_step_optimizer_state_bytes"]
        assert before == after > 0  # the preallocated state: the first step made none
    assert result["dqn_losses_finite"] == {"fp16": None, "bf16": True, "off": True}
    assert result["incidents"]["dqn_incident"]["skipped"].startswith("needs CUDA")
    assert "## The incidents' GPUs (issue 66)" in markdown and "| off | " in markdown


def test_the_first_optimizer_step_is_seen_to_make_no_state_only_when_it_was_preallocated():
    """The recorder's check, broken on purpose: without the preallocation Adam's first step makes its moments."""
    args = dqn.with_map_defaults(dqn.Args(res=8))
    amp = dqn.mu.amp("off", "cpu")
    batch = dqn.dummy_batch(4, 8, args.n_step, "cpu")
    for preallocated in (True, False):
        agent = dqn.build_agent(args, seed=0, device="cpu")
        if preallocated:
            dqn.preallocate(agent.q_network, agent.target_network, agent.optimizer, amp, args, 4, "cpu")
        recorder = incident_stage.UpdateRecorder(agent.amp)
        networks = (agent.q_network, agent.target_network, agent.optimizer)
        for _ in range(2):
            recorder.record(dqn.update, *networks, batch, args, agent.amp)
        before, after = recorder.figures()["first_step_optimizer_state_bytes"]
        assert (before == after) is preallocated and after > 0
        assert recorder.figures()["updates"] == 2 and recorder.figures()["losses_finite"] is True


def test_skipped_steps_are_the_loss_scalers_backoffs():
    fake_amp = types.SimpleNamespace(scaler=types.SimpleNamespace(is_enabled=lambda: True))
    recorder = incident_stage.UpdateRecorder(fake_amp)
    recorder.scales = [torch.tensor(s) for s in (65536.0, 32768.0, 32768.0, 16384.0, 32768.0)]
    recorder.losses, recorder.ms = [torch.tensor(1.0)], [2.0]
    figures = recorder.figures()
    assert figures["skipped_steps"] == 2 and figures["scale_first_last"] == [65536.0, 32768.0]
    recorder.losses.append(torch.tensor(float("nan")))
    assert recorder.figures()["losses_finite"] is False


def test_a_wait_holds_no_context_when_nvml_lists_no_new_process():
    before = [(10, 500.0)]
    assert incident_stage.new_processes(before, [(10, 500.0)]) == []
    assert incident_stage.new_processes(before, [(10, 500.0), (42, 300.0)]) == [42]
    assert incident_stage.new_processes(None, before) is None


def test_the_verdicts_of_a_replay_that_went_wrong_say_so():
    incidents = {
        "dreamer_6gb": {"returncode": 3, "out_of_memory": True, "nvml_peak_process_mb": 6500.0},
        "dqn_incident": {
            "first_step_oom": {"exit_3": True, "checkpoint": True, "report": True, "traceback": True},
            "wait": {"no_context_while_waiting": False, "started_within_one_poll": True},
        },
    }
    verdicts = incident_stage.incident_verdicts(incidents)
    assert verdicts["dreamer_6gb_no_oom"] is False and verdicts["dreamer_6gb_within_6_gib"] is False
    assert verdicts["dqn_first_step_oom_exit_3_with_checkpoint"] is False  # a traceback is not a clean end
    assert verdicts["dqn_wait_without_context"] is False and verdicts["dqn_fallback_started"] is None
