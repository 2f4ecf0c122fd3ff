"""dev/gpu/gpu_report.py: the GPU results file assembled from the raw outputs of one GPU session."""

import json
from pathlib import Path

import pytest

from dev.gpu import gpu_report


def session_folder(tmp_path):
    """An empty folder named like a GPU session's raw outputs."""
    folder = tmp_path / "2026-01-01-gpu"
    folder.mkdir()
    return folder


def test_gpu_report_renders_a_session_that_measured_only_the_training_loop(tmp_path):
    # a session's folder may hold gpu_loop.json alone: its slope is a target row and the loop is described
    folder = session_folder(tmp_path)
    loop = {
        "capacity_steps": 1000,
        "cudagraph": True,
        "amp": "off",
        "env_steps": 4000,
        "batch": "B16 x T50",
        "updates": 4482,
        "env_steps_per_s": 25.7,
        "gpu_alloc_slope_mb_per_10k": 0.0,
        "gpu_alloc_mb_first_last": [347.5, 347.5],
    }
    shape = {
        "run": True,
        "device": "Some GPU",
        "update_batch": "B16 x T50",
        "amp": {},
        "loop": loop,
        "machine": {"gpu": "Some GPU"},
    }
    (folder / "gpu_loop.json").write_text(json.dumps(shape))
    result, text = gpu_report.report(folder)
    assert result["gpu_loop"] == loop
    assert "| GPU allocated past buffer capacity (training loop) | 0 MB per 10k env steps |" in text
    assert text.split("(training loop) |")[1].splitlines()[0].endswith("| yes |")
    assert "4,482 updates): 25.7 env steps/s" in text and "per --amp: not measured" in text
    loop["gpu_alloc_slope_mb_per_10k"] = 5.0  # growing past capacity: the target is not met
    (folder / "gpu_loop.json").write_text(json.dumps(shape))
    _, text = gpu_report.report(folder)
    assert text.split("(training loop) |")[1].splitlines()[0].endswith("| no |")


def test_gpu_report_renders_compiled_update_variants_and_judges_the_fastest(tmp_path):
    # gpu_update_profile.py --compile adds compiled and compiled + captured timings: they are columns, the update
    # target is judged on the fastest variant of any precision, and their equality with eager is reported
    folder = session_folder(tmp_path)

    def timing(ms, warmup_s=None):
        return {"median_ms": ms, "samples_ms": [ms] * 3, **({"warmup_s": warmup_s} if warmup_s else {})}

    off = {
        "eager": timing(200.0),
        "kernels": 6948,
        "gpu_busy_share": 0.11,
        "graph": timing(33.5),
        "compiled": timing(90.0, 70.0),
        "compiled_graph": timing(12.0, 75.0),
    }
    bf16 = {
        "eager": timing(296.0),
        "kernels": 7838,
        "gpu_busy_share": 0.05,
        "graph": timing(28.0),
        "compiled": timing(95.0, 71.0),
        "compiled_graph": timing(9.5, 76.0),
    }
    equal = {"updates": 8, "captured_from_update": 4, "max_relative_difference": {"losses/image": 2e-4}}
    profile = {
        "machine": {"gpu": "Some GPU"},
        "batch": "B16 x T50",
        "command": "python profile",
        "amp": {"off": off, "bf16": bf16},
        "eager_vs_graph": {**equal, "max_relative_difference": {"x": 0.0}},
        "eager_vs_compiled_graph": equal,
    }
    (folder / "profile.json").write_text(json.dumps(profile))
    _, text = gpu_report.report(folder)
    assert "| bf16 | 296 | 28 | 95 (71) | 9.5 (76) | 31.2 | 7,838 | 0.05 |" in text
    target = text.split("(B16 x T50), median |")[1].splitlines()[0]
    assert "9.5 ms (compiled and captured, --amp bf16)" in target and target.endswith("| yes |")
    assert "Compiled and captured against eager" in text and "all updates: 0.0002." in text
    for fig in (
        off,
        bf16,
    ):  # compiled and captured slower than captured alone: the best is no longer compiled
        fig["compiled_graph"] = timing(40.0, 76.0)
    (folder / "profile.json").write_text(json.dumps(profile))
    _, text = gpu_report.report(folder)
    target = text.split("(B16 x T50), median |")[1].splitlines()[0]
    assert "28 ms (captured, --amp bf16)" in target and target.endswith("| no |")
    bf16["compiled_graph"] = {"error": "RuntimeError: capture failed"}  # a variant that failed says so
    (folder / "profile.json").write_text(json.dumps(profile))
    _, text = gpu_report.report(folder)
    assert "| bf16 | 296 | 28 | 95 (71) | failed | 10.6 |" in text
    assert "Compiled and captured, --amp bf16, failed: `RuntimeError: capture failed`." in text


def test_redraw_adds_dreamerv3s_curves_to_a_committed_lease_and_says_so(tmp_path):
    """A lease whose copy of the code lacked DreamerV3's curves: the redraw reads them from the repository, draws the
    run's own samples beside them and says in the JSON and the markdown that they were added afterwards."""
    from dev.gpu import gpu_redraw

    committed = json.loads(Path("benchmark/results/2026-11-27-nvidia-h200.json").read_text())
    committed.pop("pong_reference_added")
    committed["pong_reference"] = None
    results = tmp_path / "lease.json"
    results.write_text(json.dumps(committed))
    redrawn = gpu_redraw.redraw(results)
    assert redrawn["pong_reference"]["repository"] == "danijar/dreamerv3"
    assert redrawn["pong_points"] == committed["pong_points"]  # nothing measured changes
    assert (tmp_path / "lease_pong_curve.png").stat().st_size > 10_000
    markdown = (tmp_path / "lease.md").read_text()
    assert "Grey lines on the return plot" in markdown and "drawn in afterwards" in markdown


def test_redraw_of_results_without_a_pong_curve_is_one_sentence_with_status_2(tmp_path, capsys):
    from dev.gpu import gpu_redraw

    results = tmp_path / "update_only.json"
    results.write_text(json.dumps({"stages": ["update"]}))
    with pytest.raises(SystemExit) as exit_info:
        gpu_redraw.redraw(results)
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().endswith("holds no Pong curve (pong_points) to draw.")
    assert json.loads(results.read_text()) == {"stages": ["update"]}  # nothing written
    assert not (tmp_path / "update_only.md").exists()
