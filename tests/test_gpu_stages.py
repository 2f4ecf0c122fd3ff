"""`run.py --gpu-only --stage update pong` (issue 40's GPU benchmark), checked on the CPU at tiny sizes: the results
file a GPU session commits, the curve written while the Pong run trains, the variants table, the verdicts."""

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

import dreamer_atari as da
from benchmark import gpu_stages, run, update_variants

ROOT = Path(__file__).resolve().parent.parent
RUN = ROOT / "benchmark" / "run.py"
ISSUE_KEYS = (
    "gpu_name",
    "update_ms_b16_t64",
    "kernels_per_update",
    "pong_env_steps_per_s",
    "pong_curve",
    "pong_final_return",
    "pong_env_steps",
    "pong_wall_s",
    "peak_gpu_reserved_mb_bf16",
)


@pytest.fixture(scope="module")
def staged(tmp_path_factory):
    """Both stages in one invocation, tiny, on the CPU: the JSON it printed and the results folder."""
    tmp = tmp_path_factory.mktemp("stages")
    results_dir, out = tmp / "results", tmp / "result.json"
    done = subprocess.run(
        [
            sys.executable,
            str(RUN),
            "--gpu-only",
            "--stage",
            "update",
            "pong",
            "--device",
            "cpu",
            "--quick",
            "--pong-minutes",
            "0.75",
            "--no-pong-resumable",
            "--pong-dir",
            str(tmp / "pong"),
            "--results-dir",
            str(results_dir),
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text()), results_dir, done


@pytest.mark.slow
def test_staged_run_writes_one_results_file_with_the_issue_keys_machine_command_and_samples(staged):
    result, results_dir, _ = staged
    (json_file,) = results_dir.glob("*.json")
    assert json_file.name == f"{result['date']}-{run.slug(result['machine']['cpu'])}.json"
    written = json.loads(json_file.read_text())
    for key in ISSUE_KEYS:
        assert key in written, key
    assert written["gpu_name"] is None  # no GPU: the figures are the CPU check's, said so in every target row
    assert written["command"].startswith(
        "python benchmark/run.py --gpu-only --stage update pong --device cpu"
    )
    assert "RESULTS_DIR" in written["command"] and str(results_dir) not in json_file.read_text()
    assert written["machine"]["cpu_count"] >= 1 and written["quick"] is True
    assert all(
        row["met_must"] is None and "not judged" in row["note"]
        for row in written["targets"]
        if row["measured"] is not None
    )
    markdown = (results_dir / f"{json_file.stem}.md").read_text()
    assert "## Targets (issue 40)" in markdown and "## (a) The update variants" in markdown
    assert "## (b) Pong, Atari100k recipe" in markdown
    assert (results_dir / f"{json_file.stem}_pong_curve.png").stat().st_size > 0


@pytest.mark.slow
def test_every_update_variant_is_measured_or_says_why_not(staged):
    result, _, _ = staged
    variants = result["update"]["variants"]
    assert list(variants) == ["training", *(name for name, _ in run.UPDATE_VARIANTS)]
    fields = {f.name for f in dataclasses.fields(da.Args)}
    for name, overrides in run.UPDATE_VARIANTS:
        entry = variants[name]
        if set(overrides) - fields:
            assert entry["skipped"].startswith("not available in this version"), name
        elif overrides.get("cudagraph"):
            assert entry["skipped"] == "needs CUDA", name
        elif overrides.get("compile"):
            assert "compiling takes minutes on a CPU" in entry["skipped"], name
        else:
            assert entry["update_ms"] > 0 and len(entry["samples_ms"]) == result["update"]["reps"], name
            assert entry["kernels_per_update"] > 100, name  # aten ops of one whole update
            assert entry["kernels_counted_as"].startswith("aten ops"), name
    assert result["update_ms_b16_t64"] == variants["training"]["update_ms"]
    assert result["kernels_per_update"] == variants["training"]["kernels_per_update"]
    assert result["update_batch"] == "B4 x T10"  # --quick's tiny batch, named beside the figure


@pytest.mark.slow
def test_pong_curve_is_written_while_the_run_trains_and_the_final_agent_plays_ten_episodes(staged):
    result, _, _ = staged
    writes = result["pong_curve_writes"]
    while_training = [w for w in writes if w["training_running"]]
    # a run stopped at any point leaves its curve: it was written at each 100 env steps (--quick) before the end
    assert while_training and while_training[0]["env_step"] < result["pong_env_steps"]
    assert [w["env_step"] for w in while_training] == sorted(w["env_step"] for w in while_training)
    assert writes[-1]["training_running"] is False
    assert result["pong_returncode"] == 143  # stopped by its time cap, after a checkpoint
    steps = [p["env_step"] for p in result["pong_curve"]]
    assert steps == sorted(steps) and steps[-1] == result["pong_env_steps"]
    assert {"mean_return_last_10", "updates_per_s", "host_rss_mb", "gpu_alloc_mb"} <= set(
        result["pong_curve"][0]
    )
    assert "--num-envs 1 " in result["pong_command"] and "--train-ratio" in result["pong_command"]
    evaluation = result["pong_eval"]
    assert evaluation["asked"] == 10 and len(evaluation["episodes"]) == 10
    finished = [e["return"] for e in evaluation["episodes"] if e["finished"]]
    assert finished == evaluation["returns"] and result["pong_final_return"] == pytest.approx(
        sum(finished) / len(finished)
    )
    assert all(-21 <= r <= 21 for r in finished)


def test_a_variant_that_names_a_field_this_version_lacks_is_skipped_and_the_rest_run():
    base = da.Args()
    args, why = update_variants.variant_args(base, {"no_such_fast_path": True}, on_cuda=True)
    assert (
        args is None and why == "not available in this version (dreamer_atari.Args has no no_such_fast_path)"
    )
    args, why = update_variants.variant_args(base, {"amp": "bf16"}, on_cuda=True)
    assert why == "" and args.amp == "bf16" and args.cudagraph is False and args.compile is False
    # `training` is the script's defaults plus the fast path the Pong run adds on CUDA, and nothing off
    args, _ = update_variants.variant_args(
        dataclasses.replace(base, amp="bf16"), {}, on_cuda=True, training=True
    )
    assert args.amp == "bf16" and all(
        getattr(args, k) == v
        for k, v in run.CUDA_FAST_PATH.items()
        if k in {f.name for f in dataclasses.fields(da.Args)}
    )


def test_pong_flags_follow_the_args_types_and_leave_out_fields_this_version_lacks():
    flags, missing = gpu_stages.args_flags(
        {
            "num_envs": 1,
            "save_model": True,
            "channels_last": False,
            "encoder_channels": (4, 4, 4),
            "no_such_field": 3,
        }
    )
    assert flags == [
        "--num-envs",
        "1",
        "--save-model",
        "--no-channels-last",
        "--encoder-channels",
        "4",
        "4",
        "4",
    ]
    assert missing == ["no_such_field"]


def _full_result(env_steps: int, **figures) -> dict:
    return {
        "device": "cuda",
        "quick": False,
        "pong_env_steps": env_steps,
        "update_ms_b16_t64": 5.0,
        "kernels_per_update": 3_500,
        "pong_env_steps_per_s": 210.0,
        "pong_wall_min_100k": 9.0,
        "pong_final_return": 19.0,
        **figures,
    }


def test_targets_are_judged_on_a_full_size_cuda_run_and_the_pong_ones_only_at_100k_steps():
    rows = {row["key"]: row for row in gpu_stages.targets(_full_result(100_000))}
    assert (rows["update_ms_b16_t64"]["met_must"], rows["update_ms_b16_t64"]["met_moonshot"]) == (True, False)
    assert rows["kernels_per_update"]["met_must"] is False
    assert (rows["pong_env_steps_per_s"]["met_must"], rows["pong_env_steps_per_s"]["met_moonshot"]) == (
        True,
        True,
    )
    assert (rows["pong_wall_min_100k"]["met_must"], rows["pong_wall_min_100k"]["met_moonshot"]) == (
        True,
        False,
    )
    assert rows["pong_final_return"]["met_must"] is True
    short = {row["key"]: row for row in gpu_stages.targets(_full_result(40_000))}
    assert (
        short["pong_final_return"]["met_must"] is None
        and "40,000 env steps" in short["pong_final_return"]["note"]
    )
    assert short["pong_wall_min_100k"]["met_must"] is None
    assert (
        short["update_ms_b16_t64"]["met_must"] is True
    )  # the update is judged whatever the Pong run reached
    quick = gpu_stages.targets(_full_result(100_000, quick=True))
    assert all(row["met_must"] is None for row in quick)


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv, named",
    [
        (["--stage", "update"], "--stage picks stages of --gpu-only: add --gpu-only."),
        (
            ["--gpu-only", "--stage", "pong", "--device", "cpu", "--quick", "--pong-minutes", "0"],
            "--stage pong needs --pong-minutes greater than 0, got 0.0.",
        ),
        (
            ["--gpu-only", "--stage", "update", "update", "--device", "cpu", "--quick"],
            "--stage names a stage twice: update update.",
        ),
        (
            ["--gpu-only", "--stage", "update", "--device", "cpu"],
            "--gpu-only --device cpu checks the steps at tiny sizes: add --quick.",
        ),
    ],
)
def test_bad_stage_input_is_one_sentence_with_status_2_and_nothing_written(tmp_path, argv, named):
    results_dir = tmp_path / "results"
    done = subprocess.run(
        [sys.executable, str(RUN), *argv, "--results-dir", str(results_dir)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2 and done.stderr.strip() == f"error: {named}"
    assert not results_dir.exists()


@pytest.mark.slow
def test_a_fresh_pong_run_refuses_a_pong_dir_that_already_holds_a_run(tmp_path):
    (tmp_path / "pong" / "runs" / "earlier").mkdir(parents=True)
    done = subprocess.run(
        [
            sys.executable,
            str(RUN),
            "--gpu-only",
            "--stage",
            "pong",
            "--device",
            "cpu",
            "--quick",
            "--no-pong-resumable",
            "--pong-dir",
            str(tmp_path / "pong"),
            "--results-dir",
            str(tmp_path / "results"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2 and "already holds one: give an empty --pong-dir." in done.stderr
    assert not (tmp_path / "results").exists()
