"""The GPU results file, assembled from the raw outputs of one GPU session (nothing typed in by hand).

    python dev/gpu/gpu_report.py benchmark/results/<date>-<gpu>/   # writes <date>-<gpu>.md and .json beside it

The folder holds what each measurement wrote there, under these names (any may be missing; the report says so):
  profile.json, profile_<amp>.txt   dev/gpu/gpu_update_profile.py: eager, captured (and compiled)
                                    update, kernels, equality
  prototype_profile.json            the same, of an earlier version of the update (for the before/after)
  gpu_amp.json                      benchmark/ours_dreamer.py gpu --parts amp: eager update and peak memory per --amp
  forensics.json                    benchmark/cuda_forensics.py: snapshots, their analysis, induced OOMs
  pong_events.tfevents, pong_train.log, pong_command.txt, pong_gpu_utilization.csv, open_loop_step_<N>.gif
                                    a dreamer_atari.py run on ALE/Pong-v5 (the Atari100k recipe)
  nvidia_smi.csv                    the GPU's name, memory and driver
  gpu_loop.json or gpu_loop.log     benchmark/ours_dreamer.py gpu --parts loop (the log alone when it did not finish)
  notes.md                          how the session ran (what shared the GPU when), printed at the top
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmark import pong_curve
from benchmark.common import (
    TARGET_GPU_PEAK_MB,
    TARGET_GPU_SLOPE_MB_PER_10K,
    TARGET_PONG_RETURN,
    TARGET_PONG_WALL_MIN,
    code_version,
    fmt,
    gpu_markdown,
)

TARGET_PEAK_RESERVED_MB = float(TARGET_GPU_PEAK_MB)
TARGET_UPDATE_MS = 10.0  # one update at the seed config on that GPU
UPDATE_VARIANTS = {"graph": "captured", "compiled": "compiled", "compiled_graph": "compiled and captured"}


def load(folder: Path, name: str) -> dict | None:
    path = folder / name
    return json.loads(path.read_text()) if path.exists() else None


def pong_section(folder: Path, stem: Path) -> dict | None:
    events = folder / "pong_events.tfevents"
    if not events.exists():
        return None
    result = pong_curve.curve(pong_curve.read_events(str(events)))
    points = result["points"]
    last = points[-1]
    steady = [p for p in points if p.get("updates_per_s")][-10:]
    env_rate = sum(p["env_steps_per_s"] for p in steady) / len(steady)
    utilization = []
    if (folder / "pong_gpu_utilization.csv").exists():
        utilization = [
            int(line.split("%")[0])
            for line in (folder / "pong_gpu_utilization.csv").read_text().splitlines()
            if "%" in line
        ]
    pong_curve.plot(
        result,
        str(stem.parent / f"{stem.name}_pong_curve.png"),
        f"ALE/Pong-v5, Atari100k recipe, --cudagraph, {last['env_step']:,} env steps",
    )
    strips = [
        pong_curve.open_loop_strip(gif, stem.parent / f"{stem.name}_{gif.stem}.png")
        for gif in sorted(folder.glob("open_loop_step_*.gif"))
    ]
    command = (
        (folder / "pong_command.txt").read_text().strip() if (folder / "pong_command.txt").exists() else None
    )
    return {
        "command": command,
        "pong_curve": [
            {"env_step": p["env_step"], "mean_return_last10": p["mean_return_last10"]} for p in points
        ],
        # the training episodes' mean; `pong_final_return` is the evaluation's mean everywhere (benchmark/pong_run.py),
        # and these sessions evaluated nothing. Files written before the rename: `common.read_results`
        "pong_train_return_last_10": last["mean_return_last10"],
        "pong_env_steps": last["env_step"],
        "pong_updates": last["updates"],
        "pong_wall_s": last["wall_s"],
        "pong_peak_gpu_reserved_mb": max(p["peak_gpu_reserved_mb"] or 0 for p in points),
        "pong_peak_gpu_alloc_mb": max(p["peak_gpu_alloc_mb"] or 0 for p in points),
        "pong_peak_host_rss_mb": max(p["host_rss_mb"] or 0 for p in points),
        "steady_env_steps_per_s": env_rate,
        "steady_updates_per_s": sum(p["updates_per_s"] for p in steady) / len(steady),
        "projected_wall_min_for_100k": 100_000 / env_rate / 60,
        "gpu_utilization_percent_samples": utilization,
        "open_loop_strips": strips,
        "points": points,
        "episode_returns": result["episode_returns"],
    }


def report(folder: Path) -> tuple[dict, str]:
    stem = folder.parent / folder.name
    profile, prototype = load(folder, "profile.json"), load(folder, "prototype_profile.json")
    amp, forensics = load(folder, "gpu_amp.json"), load(folder, "forensics.json")
    loop_file = load(folder, "gpu_loop.json")
    loop = (loop_file or {}).get("loop")
    smi = (
        (folder / "nvidia_smi.csv").read_text().strip().splitlines()[-1]
        if (folder / "nvidia_smi.csv").exists()
        else None
    )
    pong = pong_section(folder, stem)
    machine = (profile or amp or {}).get("machine", {})
    result = {
        "folder": folder.name,
        "machine": machine,
        "nvidia_smi": smi,
        "profile": profile,
        "prototype_profile": prototype,
        "gpu_amp": amp,
        "forensics": forensics,
        "gpu_loop": loop,
        "pong": pong,
        # the code that assembled this file; the measurements' own code is in their files where they recorded it
        "report_code": code_version(),
    }

    lines = [
        f"# GPU results, {machine.get('gpu', 'unknown GPU')}",
        "",
        (
            f"Machine: {machine.get('gpu')} ({smi}), {machine.get('cpu')}, {machine.get('cpu_count')} CPU cores, "
            f"Python {machine.get('python')}, torch {machine.get('torch')}. Raw outputs: `{folder.name}/` (every "
            f"sample); this file is written from them by `python dev/gpu/gpu_report.py "
            f"{folder.relative_to(ROOT) if folder.is_relative_to(ROOT) else folder.name}/`."
        ),
        "",
    ]
    if (folder / "notes.md").exists():
        lines += ["## How the session ran", "", (folder / "notes.md").read_text().strip(), ""]

    lines += ["## Targets", "", "| figure | measured | target | met |", "|---|---:|---:|---|"]
    targets = {}
    if pong:
        targets["Pong return after 100k agent steps"] = (
            f"{fmt(pong['pong_train_return_last_10'])} (mean of the last 10 training episodes; no evaluation) after "
            f"{pong['pong_env_steps']:,} steps (the run stopped there)",
            f">= {TARGET_PONG_RETURN:g}",
            None,
        )
        targets["wall time of the 100k-step run"] = (
            f"{fmt(pong['projected_wall_min_for_100k'])} min projected from the measured rate",
            f"<= {TARGET_PONG_WALL_MIN:g} min",
            pong["projected_wall_min_for_100k"] <= TARGET_PONG_WALL_MIN,
        )
    if profile:
        best_ms, best_how = min(
            (f[variant]["median_ms"], f"{how}, --amp {mode}")
            for mode, f in profile["amp"].items()
            for variant, how in UPDATE_VARIANTS.items()
            if "median_ms" in f.get(variant, {})
        )
        targets[f"one update at the seed config ({profile['batch']}), median"] = (
            f"{fmt(best_ms)} ms ({best_how})",
            f"<= {TARGET_UPDATE_MS:g} ms",
            best_ms <= TARGET_UPDATE_MS,
        )
    if amp:
        for mode, fig in amp["amp"].items():
            if "peak_reserved_mb" in fig:
                met = fig["peak_reserved_mb"] < TARGET_PEAK_RESERVED_MB
                targets[f"peak GPU reserved, seed config, --amp {mode} (eager)"] = (
                    f"{fmt(fig['peak_reserved_mb'])} MB",
                    "< 2,048 MB",
                    met,
                )
    if profile:
        for mode, fig in profile["amp"].items():
            if "graph_peak_reserved_mb" in fig:
                targets[f"peak GPU reserved, seed config, --amp {mode} --cudagraph"] = (
                    f"{fmt(fig['graph_peak_reserved_mb'])} MB",
                    "< 2,048 MB",
                    fig["graph_peak_reserved_mb"] < TARGET_PEAK_RESERVED_MB,
                )
    if loop and "gpu_alloc_slope_mb_per_10k" in loop:
        slope = loop["gpu_alloc_slope_mb_per_10k"]
        targets["GPU allocated past buffer capacity (training loop)"] = (
            f"{fmt(slope)} MB per 10k env steps",
            f"flat (within {TARGET_GPU_SLOPE_MB_PER_10K:g} MB per 10k)",
            abs(slope) <= TARGET_GPU_SLOPE_MB_PER_10K,
        )
    if forensics and "analysis" in forensics:
        targets["GPU allocated past buffer capacity (forensics run, snapshots)"] = (
            forensics["analysis"]["printed"].split("slope per 1k steps |")[1].split("|")[1].strip()
            + " MB per 1k "
            "steps (active)",
            "flat",
            None,
        )
    for name, (measured, target, met) in targets.items():
        lines.append(f"| {name} | {measured} | {target} | {fmt(met)} |")
    result["targets"] = {
        name: {"measured": m, "target": t, "met": met} for name, (m, t, met) in targets.items()
    }

    if profile:
        lines += [
            "",
            "## One update, eager and captured in CUDA graphs",
            "",
            (
                f"`{profile['command']}`: the script's own update as the training loop runs it (batch copied to "
                f"the device, world model, behaviour), one real Pong batch ({profile['batch']}), median of "
                f"{len(profile['amp']['off']['eager']['samples_ms'])} after warm-up, synchronised after each."
            ),
            "",
        ]
        compiled = any("compiled" in fig for fig in profile["amp"].values())
        extra = ["compiled ms (warm-up s)", "compiled + captured ms (warm-up s)"] if compiled else []
        lines += [
            "| "
            + " | ".join(
                [
                    "--amp",
                    "eager ms",
                    "captured ms",
                    *extra,
                    "speed-up (eager / fastest)" if compiled else "speed-up",
                    "kernels per update",
                    "GPU busy share (eager)",
                ]
            )
            + " |",
            "|---|" + "---:|" * (5 + len(extra)),
        ]
        for mode, fig in profile["amp"].items():
            graph = fig.get("graph", {}).get("median_ms")
            cells = [mode, fmt(fig["eager"]["median_ms"]), fmt(graph)]
            for variant in ("compiled", "compiled_graph") if compiled else ():
                timed = fig.get(variant, {})
                cells.append(
                    f"{fmt(timed['median_ms'])} ({fmt(timed['warmup_s'])})"
                    if "median_ms" in timed
                    else "failed"
                    if "error" in timed
                    else fmt(None)
                )
            fastest = min(
                (fig[v]["median_ms"] for v in UPDATE_VARIANTS if "median_ms" in fig.get(v, {})), default=None
            )
            cells += [
                fmt(fig["eager"]["median_ms"] / fastest if fastest else None),
                f"{fig['kernels']:,}",
                fmt(fig["gpu_busy_share"]),
            ]
            lines.append("| " + " | ".join(cells) + " |")
        if prototype:
            for mode, fig in prototype["amp"].items():
                graph = prototype["variants"].get(f"graph_{mode}", {}).get("graph_replay_ms")
                lines.append(
                    f"| {mode}, before (prototype) | {fmt(fig['full']['median_ms'])} | {fmt(graph)} | "
                    + f"{fmt(None)} | " * len(extra)
                    + f"{fmt(fig['full']['median_ms'] / graph if graph else None)} | {fig['kernels']:,} | "
                    f"{fmt(fig['gpu_busy_share'])} |"
                )
        for mode, fig in profile["amp"].items():
            for variant in ("compiled", "compiled_graph"):
                if "error" in fig.get(variant, {}):
                    lines += [
                        "",
                        f"{UPDATE_VARIANTS[variant].capitalize()}, --amp {mode}, failed: "
                        f"`{fig[variant]['error']}`.",
                    ]
        for key, what in (
            ("eager_vs_graph", "Captured"),
            ("eager_vs_compiled_graph", "Compiled and captured"),
        ):
            equal = profile.get(key)
            if equal:
                worst = max(equal["max_relative_difference"].values())
                lines += [
                    "",
                    (
                        f"{what} against eager: two agents from the same weights and random state trained on "
                        f"the same {equal['updates']} batches (the captured one replays its graphs from update "
                        f"{equal['captured_from_update']}); the largest relative difference over all "
                        f"{len(equal['max_relative_difference'])} logged values of all updates: {worst:g}."
                    ),
                ]

    if pong:
        lines += [
            "",
            "## Pong, Atari100k recipe",
            "",
            (f"`{pong['command']}`" if pong["command"] else "Command not recorded.") + " (float32).",
            "",
            (
                f"Reached {pong['pong_env_steps']:,} env steps and {pong['pong_updates']:,} updates in "
                f"{fmt(pong['pong_wall_s'])} s, when the GPU time ran out. Steady rate over the last "
                f"10 log intervals: {fmt(pong['steady_env_steps_per_s'])} env steps/s, "
                f"{fmt(pong['steady_updates_per_s'])} updates/s, so 100k steps would take "
                f"{fmt(pong['projected_wall_min_for_100k'])} min. GPU utilisation (nvidia-smi, every 30 s): "
                f"{pong['gpu_utilization_percent_samples']} %. Peak GPU reserved {fmt(pong['pong_peak_gpu_reserved_mb'])}"
                f" MB, allocated {fmt(pong['pong_peak_gpu_alloc_mb'])} MB; peak host RSS "
                f"{fmt(pong['pong_peak_host_rss_mb'])} MB."
            ),
            "",
            f"![curve]({stem.name}_pong_curve.png)",
            "",
            "| env step | wall s | mean return, last 10 episodes | reward sign accuracy | image loss | KL loss | "
            "actor entropy | imagined return | updates/s | GPU alloc MB | host RSS MB |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for p in pong["points"]:
            lines.append(
                f"| {p['env_step']:,} | {fmt(p['wall_s'])} | {fmt(p['mean_return_last10'])} | "
                f"{fmt(p['reward_sign_accuracy'])} | {fmt(p.get('image_loss_per_frame', p.get('image_loss')))} | {fmt(p['kl_loss'])} | "
                f"{fmt(p['actor_entropy'])} | {fmt(p['imagined_return'])} | {fmt(p.get('updates_per_s'))} | "
                f"{fmt(p['gpu_alloc_mb'])} | {fmt(p['host_rss_mb'])} |"
            )
        if pong["open_loop_strips"]:
            lines += [
                "",
                (
                    f"Open-loop predictions (4 replayed sequences per image, each truth | model | error; the "
                    f"model sees frames 0-4 and imagines the rest from the real actions), frames "
                    f"{pong['open_loop_strips'][0]['frames']}:"
                ),
                "",
            ]
            for strip in pong["open_loop_strips"]:
                lines += [f"![{strip['png']}]({strip['png']})", ""]

    if amp or forensics or loop:
        reason = (
            "stopped by its time limit, see gpu_loop.log"
            if (folder / "gpu_loop.log").exists() and loop is None
            else "not run"
        )
        source = amp or loop_file or {}
        gpu = {
            "run": True,
            "device": source.get("device"),
            "update_batch": source.get("update_batch"),
            "amp": (amp or {}).get("amp", {}),
            "loop": loop,
            "loop_reason": reason,
        }
        section = gpu_markdown({"gpu": gpu, "forensics": forensics or {"run": False, "reason": "not run"}})
        lines += ["", section.replace("## GPU\n", "## Eager update and peak memory per --amp\n")]
    return result, "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder")
    cli = parser.parse_args()
    folder = Path(cli.folder).resolve()
    if not folder.is_dir():
        print(f"error: {cli.folder!r} is not a folder.", file=sys.stderr)
        raise SystemExit(2)
    result, markdown = report(folder)
    stem = folder.parent / folder.name
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1))
    stem.with_suffix(".md").write_text(markdown)
    print(f"wrote {stem}.md and {stem}.json")


if __name__ == "__main__":
    main()
