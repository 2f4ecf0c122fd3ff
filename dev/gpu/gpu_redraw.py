"""A GPU run's Pong curve drawn again from its results JSON, with DreamerV3's own five Pong curves beside it.

    python dev/gpu/gpu_redraw.py RESULTS_JSON

For results written where the run's copy of the code lacked `benchmark/results/dreamerv3_atari100k_pong.json` (a
lease before `gpu_lease.sh` copied it too): `pong_reference` is set from that file, `pong_reference_added` says when
and why, and the curve PNG beside the JSON (`<stem>_pong_curve.png`) and the markdown are written anew from the
run's own samples (`pong_points`, `pong_episode_returns`). Nothing measured changes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmark import pong_curve, pong_run
from benchmark.common import fail, read_results
from dev.gpu import gpu_stages


def redraw(results_json: Path) -> dict:
    result = read_results(results_json)  # any age, in today's meaning of its keys
    if not result.get("pong_points"):
        fail(f"{results_json} holds no Pong curve (pong_points) to draw.")
    reference = pong_curve.reference()
    if reference is None:
        fail(f"{pong_curve.REFERENCE} is missing: DreamerV3's curves cannot be drawn.")
    if result.get("pong_reference") is None:
        result["pong_reference"] = reference["source"]
        result["pong_reference_added"] = (
            f"DreamerV3's curves drawn in afterwards ({datetime.date.today().isoformat()}, "
            f"`python dev/gpu/gpu_redraw.py RESULTS_JSON`): the run's copy of the code lacked their file"
        )
    curve = {"points": result["pong_points"], "episode_returns": result.get("pong_episode_returns") or []}
    pong_run.plot_curve(curve, results_json.with_suffix(""), result["pong_env_steps"])
    results_json.write_text(json.dumps(result, indent=1, default=str))
    results_json.with_suffix(".md").write_text(gpu_stages.staged_markdown(result))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results_json", type=Path)
    redraw(parser.parse_args().results_json)


if __name__ == "__main__":
    main()
