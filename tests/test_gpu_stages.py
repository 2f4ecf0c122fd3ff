"""`dev/gpu/gpu_stages.py --stage update pong` (issue 40's GPU benchmark), checked on the CPU at tiny sizes: the
results file a GPU session commits, the curve written while the Pong run trains, the variants table, the verdicts."""

import collections
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

import dreamer_atari as da
from benchmark import common, pong_run
from dev.gpu import gpu_stages, update_regions, update_variants

ROOT = Path(__file__).resolve().parent.parent
STAGES = ROOT / "dev" / "gpu" / "gpu_stages.py"
LEASE = ROOT / "dev" / "gpu" / "gpu_lease.sh"
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
            str(STAGES),
            "--stage",
            "update",
            "pong",
            "--device",
            "cpu",
            "--quick",
            "--pong-minutes",
            "0.25",
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
    assert json_file.name == f"{result['date']}-{common.slug(result['machine']['cpu'])}.json"
    written = json.loads(json_file.read_text())
    for key in ISSUE_KEYS:
        assert key in written, key
    assert written["gpu_name"] is None  # no GPU: the figures are the CPU check's, said so in every target row
    assert written["command"].startswith("python dev/gpu/gpu_stages.py --stage update pong --device cpu")
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
    # what the replay on disk and the checkpoints cost the Pong run's loop, noted for the card it ran on
    assert written["pong_replay_write_us_per_env_step"] > 0 and written["pong_checkpoint_write_s"] is not None
    assert "Keeping the replay on disk took" in markdown


@pytest.mark.slow
def test_every_update_variant_is_measured_or_says_why_not(staged):
    result, _, _ = staged
    variants = result["update"]["variants"]
    assert list(variants) == gpu_stages.variant_names()
    fields = {f.name for f in dataclasses.fields(da.Args)}
    for name, overrides in (*gpu_stages.TRAINING_VARIANTS, *gpu_stages.UPDATE_VARIANTS):
        entry = variants[name]
        if set(overrides) - fields:
            assert entry["skipped"].startswith("not available in this version"), name
        elif overrides.get("cudagraph") or overrides.get("fused_scan") == "on":
            assert entry["skipped"] == "needs CUDA", name
        elif overrides.get("compile"):
            assert "compiling takes minutes on a CPU" in entry["skipped"], name
        else:
            assert entry["update_ms"] > 0 and len(entry["samples_ms"]) == result["update"]["reps"], name
            assert entry["kernels_per_update"] > 100, name  # aten ops of one whole update
            assert entry["kernels_counted_as"].startswith("aten ops"), name
            # what it trained with, not only what it asked for (a path that cannot run here steps aside)
            installed = entry["installed"]
            # on the CPU `auto` leaves Part 1 (no path saves 5 % there): a variant that asks for the gathers or the
            # shared heads, which stand on the fast imagination, trains without them, and its results say so
            assert installed["observe"] == "RSSM.observe" and not installed["fast_imagine"], name
            assert not installed["fast_heads"] and not installed["imagine_gathers"], name
            assert not installed["fused_scan"] and isinstance(entry["speed_said"], list), name
    assert result["update_ms_b16_t64"] == variants["training"]["update_ms"]
    assert result["kernels_per_update"] == variants["training"]["kernels_per_update"]
    assert result["update_batch"] == "B4 x T10"  # --quick's tiny batch, named beside the figure


@pytest.mark.slow
def test_the_update_stage_times_each_region_and_counts_its_flops(staged):
    """The region table of each variant measured: every region of update_regions.REGIONS, their operations adding up
    to the whole update's (counted apart, on another update), their wall time to the profiled update's span; and the
    FLOPs by region adding up to FlopCounterMode's count of the whole update."""
    result, results_dir, _ = staged
    data = result["update"]
    flops = data["flops"]
    assert list(flops["by_region"]) == list(update_regions.REGIONS)
    assert sum(flops["by_region"].values()) == flops["total"] == flops["flop_counter_total"] > 0
    assert "at B2 and one at B3 (x T10), extended to B4" in flops["counted_as"]
    for part in ("encoder", "decoder", "observe", "imagination", "behaviour heads and losses"):
        assert flops["by_region"][f"{part} forward"] > 0, part
    # the CPU's default is Part 1, whose `imagine` runs the actor with gradients: its backward is imagination's
    # (the shared heads, on CUDA where shown, move it to the heads' region)
    for part in ("encoder", "decoder", "observe", "imagination", "behaviour heads and losses"):
        assert flops["by_region"][f"{part} backward"] > 0, part
    assert flops["by_region"]["optimizers"] == 0  # Adam's elementwise work is no product
    measured = [name for name, v in data["variants"].items() if "update_ms" in v]
    assert "training" in measured and "training+cudnn-benchmark" in measured
    for name in measured:
        entry = data["variants"][name]
        regions = entry["regions"]
        assert list(regions) == list(update_regions.REGIONS), name
        assert sum(r["kernels"] for r in regions.values()) == entry["kernels_per_update"], name
        for part in ("encoder", "observe", "decoder", "imagination", "behaviour heads and losses"):
            assert regions[f"{part} forward"]["kernels"] > 0, name
        for part in ("encoder", "observe", "decoder", "behaviour heads and losses"):
            assert regions[f"{part} backward"]["kernels"] > 0, name
        # the actor's gradient pass (about 20 operations at these sizes): the shared heads' where installed, else
        # the fast imagination's or `imagine`'s; with the shared heads, imagination's backward holds at most the
        # backward of autocast's weight casts (4 under bf16), labelled where they were made
        shared_heads = entry["installed"]["fast_heads"]
        assert (regions["imagination backward"]["kernels"] < 10) == shared_heads, name
        assert regions["optimizers"]["kernels"] > 0
        assert sum(r["wall_ms"] for r in regions.values()) == pytest.approx(entry["regions_span_ms"])
        assert all(r["busy_ms"] <= r["wall_ms"] + 1e-6 for r in regions.values()), name  # one CPU thread
    # per observe step, the scan's forward dispatches more operations than the encoder's convolutions in all
    training = data["variants"]["training"]["regions"]
    assert training["observe forward"]["kernels"] > 10 * training["encoder forward"]["kernels"]
    markdown = next(results_dir.glob("*.md")).read_text()
    assert "### The update region by region" in markdown and "| observe backward | " in markdown
    assert "FlopCounterMode's count of the whole update" in markdown


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
    assert {
        "mean_return_last10",
        "updates_per_s",
        "host_rss_mb",
        "gpu_alloc_mb",
        "ball_f1_observed",
        "ball_f1_open_loop_5",
        "image_loss_per_frame",
        "kl_nats",
        "actor_entropy",
    } <= set(result["pong_curve"][0])
    assert result["pong_config"]["rgb"] is True and "--rgb" in result["pong_command"]
    assert "--num-envs 1 " in result["pong_command"] and "--train-ratio" in result["pong_command"]
    evaluation = result["pong_eval"]
    assert evaluation["asked"] == 10 and len(evaluation["episodes"]) == 10
    finished = [e["return"] for e in evaluation["episodes"] if e["finished"]]
    assert finished == evaluation["returns"] and result["pong_final_return"] == pytest.approx(
        sum(finished) / len(finished)
    )
    assert all(-21 <= r <= 21 for r in finished)


@pytest.mark.parametrize(
    "measured, chosen",
    [
        ({"training+compile": (20.0, [30.0])}, {"compile": True}),
        ({"training+compile": (20.0, [400.0])}, {}),
        ({"training+compile": (30.0, [1.0])}, {}),
        ({"training+compile": (20.0, [30.0]), "training+bf16": (12.0, [5.0])}, {"precision": "bf16"}),
        ({"training+bf16": None, "training+compile": (25.0, [1.0])}, {"compile": True}),
        ({"training+compile": None}, {}),
        ({"fp32": (5.0, [1.0])}, {}),
    ],
    ids=[
        "compile faster",
        "its warm-up costs more than it saves",
        "compile slower",
        "bf16 fastest",
        "a variant its checks refused is no candidate",
        "not measured",
        "a variant on every fast path off is no candidate",
    ],
)
def test_the_fastest_of_the_training_update_and_its_variants_runs_pong(measured, chosen):
    """The update stage times the default's update (captured) and its variants (TRAINING_VARIANTS); the Pong run takes
    the one whose 30k updates and warm-up take least, with the fields that variant changes, and the results say which
    and why."""
    variants = {"training": {"update_ms": 30.0, "warmup_calls_s": [1.0]}}
    for name, figures in measured.items():
        variants[name] = (
            {"update_ms": figures[0], "warmup_calls_s": figures[1]}
            if figures
            else {"error": "FastPathMismatch: the compiled draw picks other classes"}
        )
    result = {"update": {"variants": variants}}
    fields = gpu_stages.faster_path(result)
    assert fields == chosen
    assert result["pong_fast_path"].startswith(
        "the default" if not chosen else next(n for n, f in gpu_stages.TRAINING_VARIANTS if f == chosen)
    )
    args = gpu_stages.StageArgs(stage=("pong",), device="cpu", quick=True)
    assert pong_run.pong_fields(args, fields).get("compile", False) is (chosen.get("compile") is True)


def test_the_leases_update_variants_are_known_and_the_stage_refuses_an_unknown_one(capsys):
    text = LEASE.read_text()
    (line,) = [line for line in text.splitlines() if line.startswith("default_variants=")]
    names = line.split("=", 1)[1].strip('"').split()
    assert names[0] == "training" and names[-1] == "training+compile"  # compile last: the others come first
    assert set(names) <= set(gpu_stages.variant_names())
    with pytest.raises(SystemExit) as stopped:
        gpu_stages.check_staged_args(
            gpu_stages.StageArgs(
                stage=("update",), device="cpu", quick=True, update_variants=("tf32+compile",)
            )
        )
    assert stopped.value.code == 2
    assert capsys.readouterr().err.startswith(
        "error: --update-variants names no variant tf32+compile; known: "
    )


def test_a_variant_that_names_a_field_this_version_lacks_is_skipped_and_the_rest_run():
    base = da.Args()
    args, why = update_variants.variant_args(base, {"no_such_fast_path": True}, on_cuda=True)
    assert (
        args is None and why == "not available in this version (dreamer_atari.Args has no no_such_fast_path)"
    )
    args, why = update_variants.variant_args(base, {"precision": "bf16"}, on_cuda=True)
    assert why == "" and args.precision == "bf16" and args.cudagraph is False and args.compile is False
    # `training` is the script's defaults plus the fast path the Pong run adds on CUDA, and nothing off
    args, _ = update_variants.variant_args(
        dataclasses.replace(base, precision="bf16"), {}, on_cuda=True, training=True
    )
    assert args.precision == "bf16" and all(
        getattr(args, k) == v
        for k, v in common.CUDA_FAST_PATH.items()
        if k in {f.name for f in dataclasses.fields(da.Args)}
    )


def test_pong_flags_follow_the_args_types_and_leave_out_fields_this_version_lacks():
    flags, missing = pong_run.args_flags(
        {
            "num_envs": 1,
            "save_model": True,
            "cudagraph": False,
            "channels_last": "off",
            "encoder_channels": (4, 4, 4),
            "no_such_field": 3,
        }
    )
    assert flags == [
        "--num-envs",
        "1",
        "--save-model",
        "--no-cudagraph",
        "--channels-last",
        "off",
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
        "pong_wall_min_100k": 11.0,
        "pong_final_return": 19.0,
        "outside_update_ms_per_env_step": 1.0,
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
    assert (
        rows["outside_update_ms_per_env_step"]["met_must"],
        rows["outside_update_ms_per_env_step"]["met_moonshot"],
    ) == (True, False)
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
    # a compiled run whose compile came from the update stage's cache: its start-up is not a new user's
    warm = {
        **_full_result(100_000),
        "pong_inductor_cache": "another stage's (warm)",
        "pong_config": {"compile": True},
    }
    rows = {row["key"]: row for row in gpu_stages.targets(warm)}
    assert (
        rows["pong_wall_min_100k"]["met_must"] is None and "not judged" in rows["pong_wall_min_100k"]["note"]
    )
    assert rows["pong_final_return"]["met_must"] is True


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv, named",
    [
        (
            ["--device", "cpu", "--quick"],
            "--stage names the stages to run: update, incidents, pong, or some of them in that order.",
        ),
        (
            ["--stage", "pong", "--device", "cpu", "--quick", "--pong-minutes", "0"],
            "--stage pong needs --pong-minutes greater than 0, got 0.0.",
        ),
        (
            ["--stage", "update", "update", "--device", "cpu", "--quick"],
            "--stage names a stage twice: update update.",
        ),
        (
            ["--stage", "update", "--device", "cpu"],
            "gpu_stages.py --device cpu checks the steps at tiny sizes: add --quick.",
        ),
    ],
)
def test_bad_stage_input_is_one_sentence_with_status_2_and_nothing_written(tmp_path, argv, named):
    results_dir = tmp_path / "results"
    done = subprocess.run(
        [sys.executable, str(STAGES), *argv, "--results-dir", str(results_dir)],
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
            str(STAGES),
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


# ---------------------------------------------------------------------------------------------------------
# One lease in two device calls (`gpu_lease.sh start`, then `finish`), checked on the CPU at tiny sizes
# ---------------------------------------------------------------------------------------------------------
def _lease_call(
    mode: str, lease_dir: Path, out: Path, budget_s: int, args: tuple[str, ...] = (), **env: str
) -> tuple[int, str, float]:
    """One call of gpu_lease.sh as the device tool makes it: its own session, $OUT an empty folder, and whatever
    the command leaves running in that session killed when it returns. Returns the exit status, the output and
    the seconds the call took."""
    out.mkdir()
    environ = {
        **os.environ,
        "GPU_LEASE_CPU_CHECK": "1",
        "GPU_LEASE_PYTHON": sys.executable,
        "GPU_LEASE_DIR": str(lease_dir),
        "GPU_LEASE_BUDGET_S": str(budget_s),
        "OUT": str(out),
        **env,
    }
    started = time.monotonic()
    process = subprocess.Popen(
        ["bash", str(LEASE), mode, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        env=environ,
        start_new_session=True,
    )
    output, _ = process.communicate(timeout=budget_s + 60)  # until its output closes, as the tool reads it
    took = time.monotonic() - started
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return process.returncode, output, took


def _results(out: Path) -> dict:
    (json_file,) = out.glob("*.json")
    return json.loads(json_file.read_text())


@pytest.mark.slow
def test_a_lease_in_two_calls_call_1_returns_while_the_run_goes_on_detached_and_call_2_collects_its_end(
    tmp_path,
):
    lease_dir = tmp_path / "lease"
    try:
        # call 1: the update stage (capped at 6 s), then the Pong run, stopped by its time cap of 24 s: the run
        # lasts at least 24 s after its launch, and call 1 returns 35 s - its 11 s margin after it began
        status, output, took = _lease_call(
            "start",
            lease_dir,
            tmp_path / "out1",
            35,
            GPU_LEASE_SPAN_S="300",
            GPU_LEASE_UPDATE_MINUTES="0.1",
            GPU_LEASE_PONG_MINUTES="0.4",
        )
        assert status == 0, output[-3000:]
        assert took < 45, output[-3000:]
        pid = int((lease_dir / "run.pid").read_text())
        assert not (lease_dir / "run.rc").exists(), "the run ended within call 1: nothing was left for call 2"
        # the run outlived its call's session (the device tool kills that): it runs in a session of its own
        os.kill(pid, 0)
        assert os.getsid(pid) == pid
        first = _results(tmp_path / "out1")
        assert first["stages"] == ["update", "pong"] and "pong_eval" not in first
        assert first["lease"]["collected_in_call"] == 1 and first["lease"]["state"] == "running"
        assert "still running when call 1 returned" in first["lease"]["summary"]
        assert "## Device calls: 1" in next((tmp_path / "out1").glob("*.md")).read_text()

        # call 2, at once: waits for the run's end, its evaluation and results
        status, output, _ = _lease_call("finish", lease_dir, tmp_path / "out2", 150)
        assert status == 0, output[-3000:]
        final = _results(tmp_path / "out2")
        lease = final["lease"]
        assert lease["device_calls"] == 2 and lease["collected_in_call"] == 2 and lease["state"] == "finished"
        assert lease["run"]["exit_status"] == 0
        # the run went on after call 1 had collected its files: the update stage, then the whole Pong run
        assert lease["run"]["ended_after_s"] > lease["call_1"]["collected_after_s"]
        call_1_after_launch = lease["call_1"]["collected_after_s"] - lease["run"]["launched_after_s"]
        assert final["update_wall_s"] > 0 and final["update"]["variants"]
        # it went on training after call 1 had returned: its curve was written while training then
        # (s_since_launch counts from the Pong process's launch, which came after the update stage)
        last_write = max(w["s_since_launch"] for w in final["pong_curve_writes"] if w["training_running"])
        assert last_write + final["update_wall_s"] > call_1_after_launch
        assert final["pong_env_steps"] > (first.get("pong_env_steps") or 0)
        assert final["pong_returncode"] == 143  # stopped by its time cap, after a checkpoint
        # the final agent's evaluation and the run's own wall time, not the calls'
        assert final["pong_eval"]["asked"] == 10 and len(final["pong_eval"]["episodes"]) == 10
        assert final["pong_final_return"] is not None
        assert final["pong_inductor_cache"] == "another stage's (warm)"  # the update stage's compile cache
        # the run's copy of the code carries DreamerV3's own curves, which its plot draws beside its own
        assert final["pong_reference"]["repository"] == "danijar/dreamerv3"
        assert final["wall_s"] <= lease["run"]["wall_s"] < lease["call_2"]["collected_after_s"]
        markdown = next((tmp_path / "out2").glob("*.md")).read_text()
        assert "## Device calls: 2" in markdown and "spanned two device calls" in markdown
        # call 1 ran the tests that need CUDA before the run (here they are collected and skipped)
        assert "CUDA tests: exit 0" in (tmp_path / "out1" / "lease.log").read_text()
        # what the device tool brings back: at most 8 files
        assert len(list((tmp_path / "out2").iterdir())) <= 8
    finally:
        if (lease_dir / "run.pid").exists() and not (lease_dir / "run.rc").exists():
            try:
                os.killpg(int((lease_dir / "run.pid").read_text()), signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_call_2_on_a_machine_given_back_says_the_run_is_lost_with_status_3(tmp_path):
    status, output, _ = _lease_call("finish", tmp_path / "lease", tmp_path / "out", 30)
    assert status == 3
    assert "the machine was given back between the two calls" in output and "That run is lost" in output
    assert "That run is lost" in (tmp_path / "out" / "lease.log").read_text()


def test_call_1_never_starts_a_second_run_over_one_still_going(tmp_path):
    lease_dir = tmp_path / "lease"
    lease_dir.mkdir()
    (lease_dir / "run.pid").write_text(str(os.getpid()))  # a live process, no exit status yet
    status, output, _ = _lease_call("start", lease_dir, tmp_path / "out", 30)
    assert status == 2 and "a detached run is still going" in output and "collect it with 'finish'" in output
    assert (lease_dir / "run.pid").exists()


def test_the_deadline_file_only_lengthens_the_budget(tmp_path):
    """A later device call may give the run more time (`gpu_lease.sh finish` writes the file), never less: an earlier
    time, a missing or unreadable file leave --budget-minutes' end; a later one moves it there at the next read."""
    path = tmp_path / "deadline"
    deadline = gpu_stages.Deadline(1000.0, 2.0, str(path))
    assert deadline() == 1120.0  # no file yet
    path.write_text("1100\n")
    assert deadline() == 1120.0  # earlier: never shortens
    path.write_text("not a time")
    assert deadline() == 1120.0
    path.write_text("1300.5\n")
    assert deadline() == 1300.5
    assert gpu_stages.Deadline(1000.0, None, str(path))() is None  # no budget: only the stages' own caps
    assert gpu_stages.Deadline(1000.0, 2.0, None)() == 1120.0


def test_kernel_times_split_an_updates_gpu_time_by_kind_and_name():
    """The profile of one update, as the next speed work needs it: how much of the update the GPU is busy, in which
    kind of work (cuDNN's convolutions are not counted as the GEMMs they are built on), and the longest kernels."""
    kernels = [
        ("sm90_xmma_fprop_implicit_gemm_tf32f32", 40.0),
        ("sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n", 10.0),
        ("sm90_xmma_gemm_f32f32_tf32f32_f32_tn_n", 12.0),
        ("void at::native::vectorized_elementwise_kernel<4, AddFunctor>", 2.0),
        ("triton_per_fused_native_layer_norm_silu_0", 3.0),
        ("Memcpy HtoD (Pinned -> Device)", 1.0),
        ("some_custom_kernel", 0.5),
    ]
    times = update_variants.kernel_times(kernels, top=2)
    assert times["busy_ms"] == 0.0685
    assert times["by_kind"]["convolution"] == {"kernels": 1, "ms": 0.04}
    assert times["by_kind"]["matmul"] == {"kernels": 2, "ms": 0.022}
    assert times["by_kind"]["other"] == {"kernels": 1, "ms": 0.0005}
    assert next(iter(times["by_kind"])) == "convolution"  # longest first
    assert [t["name"] for t in times["top"]] == [kernels[0][0], kernels[1][0]]
    assert times["top"][1] == {"name": kernels[1][0], "kernels": 2, "ms": 0.022}


# ---------------------------------------------------------------------------------------------------------
# The update region by region (dev/gpu/update_regions.py, update_variants.py), at the tiny sizes
# ---------------------------------------------------------------------------------------------------------
def _tiny_region_args(**overrides) -> da.Args:
    return da.Args(
        **{**update_regions.TINY, "model": "dreamerv3", "precision": "float32", "num_envs": 1, **overrides}
    )


def test_flops_by_region_are_affine_in_the_batch_and_add_up_to_the_flop_counters_count():
    """The update stage counts FLOPs at two small batches and extends them to 16: exact only if every region's FLOPs lie
    on a straight line in the batch (linear, plus the learned initial state's one row per update, which the batch
    does not change). And the regions' FLOPs add up to FlopCounterMode's count of the whole update (nothing counted
    twice, nothing lost)."""
    counts = [update_regions.count_update(_tiny_region_args(batch_size=b), warmup=0) for b in (1, 2, 3)]
    for part in ("world_model", "behavior"):
        one, two, three = (c["flops"][part] for c in counts)
        assert {r: three[r] - two[r] for r in three} == {r: two[r] - one[r] for r in two}, part
        # nor do the operations (from batch 2: at batch 1 some copies to contiguous memory have nothing to do)
        assert counts[1][part] == counts[2][part], part
    for c in counts:
        assert (
            sum(c["flops"]["world_model"].values()) + sum(c["flops"]["behavior"].values())
            == c["flop_counter_total"]
        )
    assert counts[1]["flops"]["world_model"]["observe backward"] > 0
    assert counts[1]["flops"]["behavior"]["imagination forward"] > 0
    extended = update_regions.flops_at(_tiny_region_args(batch_size=1), 3, warmup=0)
    assert extended["by_region"] == {
        r: counts[2]["flops"]["world_model"][r] + counts[2]["flops"]["behavior"][r]
        for r in update_regions.REGIONS
    }
    assert extended["flop_counter_total"] == counts[2]["flop_counter_total"] == extended["total"]


def test_a_profile_puts_each_operation_in_the_same_region_as_the_operation_counter():
    """The profile's regions (labelled ranges forward, autograd nodes' sequence numbers backward; what the GPU's
    kernels are attributed by) agree with the dispatch counter's (the CPU's counts) on the convolutions: the encoder's
    and decoder's, forward and backward, each in its own region."""
    args = _tiny_region_args()
    shape = update_regions.model_obs_shape(args)
    torch.manual_seed(0)
    agent = da.build_agent(args, shape, update_regions.NUM_ACTIONS, "cpu")
    da.speed_up_agent(agent, args)
    raw = da.batch_tensors(update_regions.random_batch(args, shape), "cpu")
    regions = update_regions.Regions()
    device = torch.device("cpu")
    with update_regions.labelled(agent, regions):
        world_model_step, behavior_step = da.make_update_steps(agent, args)

        def update():
            _, _, start = world_model_step(raw)
            behavior_step(start)

        update()
        counter = update_regions.RegionCounter(regions)
        with regions.recording(), counter:
            update()
        items, unlinked = update_variants.profile_update(update, device, regions)
    assert unlinked == 0
    dispatched = collections.Counter()
    for (region, name), count in counter.ops.items():
        if name in ("aten.convolution", "aten.convolution_backward"):
            dispatched[region] += count
    profiled = collections.Counter(
        region
        for name, _, _, region in items
        if name in ("aten::conv2d", "aten::conv_transpose2d", "aten::convolution_backward")
    )
    assert profiled == dispatched
    assert set(profiled) == {"encoder forward", "encoder backward", "decoder forward", "decoder backward"}
    # every region that runs shows in the profile; and the labels are gone again afterwards
    assert {region for *_, region in items} >= {"observe forward", "observe backward", "optimizers"}
    assert agent.observe == agent.world_model.rssm.observe and not isinstance(
        agent.world_model.encoder, update_regions.LabelledModule
    )


def test_a_graph_replays_kernels_take_the_regions_of_the_eager_call_they_were_captured_from():
    """A replay runs no Python: its kernels are matched by name and order to the call before capture, where the
    replay has kernels of its own (copies into the graph's inputs) or lacks some."""
    eager = ["memcpy", "conv", "gemm", "add", "add", "gemm", "norm", "gemm", "adam", "adam"]
    replay = [
        "copy",
        "copy",
        "memcpy",
        "conv",
        "gemm",
        "add",
        "add",
        "gemm",
        "norm",
        "gemm",
        "copy",
        "adam",
        "adam",
    ]
    assert update_variants.align(eager, replay) == [None, None, 0, 1, 2, 3, 4, 5, 6, 7, None, 8, 9]
    assert update_variants.align(eager, eager[:4] + eager[5:]) == [0, 1, 2, 3, 5, 6, 7, 8, 9]
    assert update_variants.align(eager, ["fill"] + eager[1:]) == [None, *range(1, 10)]


def _event(name, device_type, id=0, start=0.0, end=1.0, parent=None, **fields):
    """A profiler event as torch.profiler's `events()` gives it (FunctionEvent's fields this code reads)."""
    defaults = {"scope": 0, "sequence_nr": -1, "linked_correlation_id": 0, "is_user_annotation": False}
    return types.SimpleNamespace(
        name=name,
        device_type=device_type,
        id=id,
        time_range=types.SimpleNamespace(start=start, end=end),
        cpu_parent=parent,
        **{**defaults, **fields},
    )


@pytest.mark.parametrize(
    "with_activity", [True, False], ids=["activities named", "an older profiler's events"]
)
def test_cuda_work_takes_the_region_of_the_launch_that_started_it(with_activity):
    """A CUDA profile, written out: kernels launched inside a labelled range, by an autograd node in backward, from
    Triton code (no aten operation around its launch), one the profiler linked only to its operation, one it linked
    to nothing, and a range's copy on the device's timeline, which is no work."""
    from torch.autograd import DeviceType

    cpu, cuda = DeviceType.CPU, DeviceType.CUDA

    def activity(kind):
        return {"activity_type": kind} if with_activity else {}

    regions = update_regions.Regions()
    regions.spans = [(10, 20, "observe"), (20, 40, "decoder")]
    encoder = _event("region: encoder", cpu, id=1, is_user_annotation=True, **activity("user_annotation"))
    conv = _event("aten::conv2d", cpu, id=2, parent=encoder, **activity("cpu_op"))
    node = _event(
        "ObserveBackwardThroughTimeBackward", cpu, id=3, scope=1, sequence_nr=15, **activity("cpu_op")
    )
    mm = _event("aten::mm", cpu, id=4, parent=node, **activity("cpu_op"))
    compiled = _event("CompiledFunctionBackward", cpu, id=5, scope=1, sequence_nr=33, **activity("cpu_op"))
    adam = _event("aten::_fused_adam_", cpu, id=6, **activity("cpu_op"))
    launches = [
        _event(
            "cudaLaunchKernel", cpu, id=101, parent=conv, linked_correlation_id=2, **activity("cuda_runtime")
        ),
        _event(
            "cudaLaunchKernel", cpu, id=102, parent=mm, linked_correlation_id=4, **activity("cuda_runtime")
        ),
        _event("cuLaunchKernel", cpu, id=103, parent=compiled, **activity("cuda_driver")),
    ]
    device = [
        _event("sm90_xmma_fprop_implicit_gemm", cuda, id=101, start=0, end=5, **activity("kernel")),
        _event("region: encoder", cuda, id=1, start=0, end=6, **activity("gpu_user_annotation")),
        _event("sm90_xmma_gemm_f32f32", cuda, id=102, start=6, end=8, **activity("kernel")),
        _event("triton_per_fused_0", cuda, id=103, start=9, end=10, **activity("kernel")),
        _event(
            "multi_tensor_apply_kernel",
            cuda,
            id=104,
            start=11,
            end=12,
            linked_correlation_id=6,
            **activity("kernel"),
        ),
        _event("Memset (Device)", cuda, id=105, start=13, end=14, **activity("gpu_memset")),
    ]
    items, unlinked = update_variants.device_work(
        [encoder, conv, node, mm, compiled, adam, *launches, *device], regions
    )
    assert [(name, region) for name, _, _, region in items] == [
        ("sm90_xmma_fprop_implicit_gemm", "encoder forward"),
        ("sm90_xmma_gemm_f32f32", "observe backward"),
        ("triton_per_fused_0", "decoder backward"),
        (
            "multi_tensor_apply_kernel",
            "rest forward",
        ),  # linked to Adam's operation, outside every labelled call
        ("Memset (Device)", "rest forward"),
    ]
    assert unlinked == 1  # the memset


def test_the_timeline_charges_idle_time_to_the_kernel_that_ends_it():
    items = [  # (name, start us, end us, region)
        ("a", 0.0, 10.0, "encoder forward"),
        ("b", 15.0, 20.0, "observe forward"),  # 5 us idle before it: observe's
        ("c", 18.0, 30.0, "observe forward"),  # overlaps b: only what lies past 20 counts
        ("d", 22.0, 25.0, "optimizers"),  # inside c: busy, no wall time
        ("e", 40.0, 41.0, "rest forward"),
    ]
    by_region, span_ms = update_variants.timeline(items)
    assert span_ms == pytest.approx(0.041)
    assert by_region["encoder forward"] == {"kernels": 1, "busy_ms": 0.01, "wall_ms": 0.01}
    assert by_region["observe forward"]["kernels"] == 2
    assert by_region["observe forward"]["busy_ms"] == pytest.approx(0.017)
    assert by_region["observe forward"]["wall_ms"] == pytest.approx(0.020)
    assert by_region["optimizers"]["wall_ms"] == 0 and by_region["optimizers"]["busy_ms"] == pytest.approx(
        0.003
    )
    assert by_region["rest forward"]["wall_ms"] == pytest.approx(0.011)
    assert sum(r["wall_ms"] for r in by_region.values()) == pytest.approx(span_ms)


def test_compile_never_adds_inductors_cuda_graphs_inside_ours(monkeypatch):
    """--compile with --cudagraph: our graph captures the compiled update, so Inductor must not capture graphs of its
    own inside it (its "reduce-overhead" mode, or TORCHINDUCTOR_CUDAGRAPHS=1): every compile turns them off."""
    import torch._inductor.config

    monkeypatch.setattr(
        torch._inductor.config.triton, "cudagraphs", True
    )  # as TORCHINDUCTOR_CUDAGRAPHS=1 would
    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kwargs: calls.append(kwargs) or fn)
    args = _tiny_region_args(fast_observe="on", fast_imagine="on")  # their steps are compiled too
    agent = da.build_agent(args, update_regions.model_obs_shape(args), update_regions.NUM_ACTIONS, "cpu")
    da.speed_up_agent(agent, args)
    da.compile_agent(agent)
    assert len(calls) >= 10  # the steps, the losses, the targets and the modules
    for kwargs in calls:
        assert kwargs.get("mode") in (None, "default") and kwargs["options"] == {"triton.cudagraphs": False}


@pytest.mark.parametrize(
    "deterministic, device, benchmark",
    [(True, "cuda", False), (False, "cuda", True), (False, "cpu", False)],
    ids=["deterministic: off", "--no-torch-deterministic on CUDA: on", "CPU: off"],
)
def test_cudnn_benchmarks_its_algorithms_only_where_runs_need_not_repeat_bit_for_bit(
    deterministic, device, benchmark
):
    saved = (
        torch.backends.cudnn.benchmark,
        torch.backends.cudnn.deterministic,
        torch.get_float32_matmul_precision(),
    )
    try:
        da.seed_everything(da.Args(torch_deterministic=deterministic), torch.device(device))
        assert torch.backends.cudnn.benchmark is benchmark
        assert torch.backends.cudnn.deterministic is deterministic
    finally:
        torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = saved[:2]
        torch.set_float32_matmul_precision(saved[2])


def test_a_stage_process_is_killed_at_its_cap_and_read_back_while_it_runs(tmp_path):
    """`common.run_with_cap`, which runs the update and incidents stages: a process past its cap is killed and said
    to be stopped; one that ends in time gives its exit status; both are read back while they run."""
    polls = []
    sleeper = [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"]
    returncode, stopped, started = common.run_with_cap(
        sleeper, tmp_path / "a.log", 0.5, 0.1, lambda: polls.append("a")
    )
    assert stopped and returncode == -signal.SIGKILL and time.time() - started < 30
    assert polls and (tmp_path / "a.log").read_text() == "started\n"
    quick = [sys.executable, "-c", "import sys, time; time.sleep(0.5); sys.exit(3)"]
    returncode, stopped, _ = common.run_with_cap(
        quick, tmp_path / "b.log", 30, 0.1, lambda: polls.append("b")
    )
    assert (returncode, stopped) == (3, False) and "b" in polls


@pytest.mark.slow
def test_the_part_1_variants_record_that_no_kernels_path_trained_and_which_loops_ran_compiled(staged):
    """`part1` and `part1+compile` turn every path of dreamer_kernels.py off: the results say that none was installed,
    so that no start-up check had anything to pass, and, with --compile, that Part 1's observe and imagination loops
    ran compiled (what --compile installs, read without compiling: Dynamo's `eager` backend, which compiles nothing
    until a call; --quick leaves compiled variants out on a CPU)."""
    part1 = staged[0]["update"]["variants"]["part1"]
    assert part1["update_ms"] > 0 and part1["args"]["cudagraph"] is True
    assert part1["kernel_paths_installed"] == [] and part1["checks"].startswith("none to pass")
    assert not part1["installed"]["observe_compiled"] and not part1["installed"]["imagine_compiled"]
    # on the CPU `auto` leaves every path off: `training+compile` leaves Part 1's loops as they are, without
    # --compile-loops
    for name, compiled in (("part1", False), ("part1+compile", True), ("training+compile", False)):
        args = _tiny_region_args(**dict(gpu_stages.TRAINING_VARIANTS).get(name, {}))
        agent = da.build_agent(args, update_regions.model_obs_shape(args), update_regions.NUM_ACTIONS, "cpu")
        da.speed_up_agent(agent, dataclasses.replace(args, compile=False))
        if args.compile:
            da.compile_agent(agent, backend="eager", loops=args.compile_loops)
        installed = update_variants.installed_paths(agent)
        assert installed["observe_compiled"] is installed["imagine_compiled"] is compiled, name
        assert update_variants.kernel_paths_installed(installed) == [], name
    args = _tiny_region_args(fast_observe="on", fast_imagine="on", compile=True)
    agent = da.build_agent(args, update_regions.model_obs_shape(args), update_regions.NUM_ACTIONS, "cpu")
    da.speed_up_agent(agent, dataclasses.replace(args, compile=False))
    da.compile_agent(agent, backend="eager")  # the fast paths' steps compiled, not Part 1's loops
    installed = update_variants.installed_paths(agent)
    assert installed["observe_compiled"] and installed["imagine_compiled"]
    assert update_variants.kernel_paths_installed(installed) == ["fast_observe", "fast_imagine"]
    assert update_variants.start_up_checks(installed).startswith(
        "passed: the start-up checks of fast_observe"
    )
