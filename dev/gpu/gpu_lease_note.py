"""The device calls a detached GPU run spanned, written into a copy of its results (`gpu_lease.sh start`/`finish`).

    python dev/gpu/gpu_lease_note.py RESULTS_JSON LEASE_DIR --call 1|2

LEASE_DIR holds what the calls and the run recorded: `lease.txt` (`key=value` lines: each call's start, budget and
the moment it collected the files, in seconds since the epoch), `run.started` and `run.pid` (the run's launch),
`run.rc` once it ended (`status epoch`). RESULTS_JSON is a copy of the run's results, never the live file (the run
rewrites that one from its own memory): its `lease` entry says which calls the run spanned and in which state each
found it, and its markdown beside it is written anew. Every time is in seconds from call 1's start; the run's wall
time is its own, from its launch to its end, start-up and compile included, not the calls'.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from dev.gpu import gpu_stages


def read_facts(lease_dir: Path) -> dict:
    facts: dict = {}
    for line in (lease_dir / "lease.txt").read_text().splitlines():
        key, _, value = line.partition("=")
        facts[key] = value
    facts["run_started"] = _number(lease_dir / "run.started")
    if (lease_dir / "run.rc").is_file():
        status, ended = (lease_dir / "run.rc").read_text().split()
        facts["run_status"], facts["run_ended"] = int(status), float(ended)
    facts["run_pid"] = int(_number(lease_dir / "run.pid") or 0) or None
    return facts


def _number(path: Path) -> float | None:
    try:
        return float(path.read_text().strip())
    except (OSError, ValueError):
        return None


def alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def lease_entry(facts: dict, call: int, now: float | None = None) -> dict:
    """What `results["lease"]` says: the calls, the run's launch and end, its own wall time, and one sentence."""
    now = time.time() if now is None else now
    t0 = float(facts["call_1_started"])

    def since(key: str) -> float | None:
        value = facts.get(key)
        return None if value in (None, "") else round(float(value) - t0, 1)

    launched, ended = facts.get("run_started"), facts.get("run_ended")
    call_1_collected = float(facts.get("call_1_collected") or now)
    if ended is not None:
        state = "finished"
    elif alive(facts.get("run_pid")):
        state = "running"
    else:
        state = "gone"  # its process ended without writing its exit status: killed
    # spanned two calls: still running when call 1 returned, and collected by call 2
    calls = 2 if call == 2 and (ended is None or ended > call_1_collected) else 1
    entry: dict = {
        "device_calls": calls,
        "collected_in_call": call,
        "state": state,
        "call_1": {
            "mode": facts.get("call_1_mode"),
            "budget_s": int(facts["call_1_budget_s"]),
            "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(t0)),
            "collected_after_s": since("call_1_collected"),
        },
        "span_s": int(facts["span_s"]),
        "run": {
            "launched_after_s": None if launched is None else round(launched - t0, 1),
            "ended_after_s": None if ended is None else round(ended - t0, 1),
            "exit_status": facts.get("run_status"),
            "wall_s": None if launched is None or ended is None else round(ended - launched, 1),
            "wall_s_so_far": None if launched is None or ended is not None else round(now - launched, 1),
        },
    }
    if call == 2:
        entry["call_2"] = {
            "budget_s": int(facts["call_2_budget_s"]),
            "started_after_s": since("call_2_started"),
            "collected_after_s": since("call_2_collected"),
        }
    run = entry["run"]
    own = (
        "Its wall times (wall_s, pong_process_wall_s, pong_startup_s, pong_wall_min_100k) are the run's own, from "
        "its launch, start-up and compile included, not the calls'."
    )
    if state == "finished" and calls == 2:
        entry["summary"] = (
            f"The run spanned two device calls: started detached (setsid) in call 1, which returned "
            f"{entry['call_1']['collected_after_s'] - run['launched_after_s']:.0f} s after the run's launch while it "
            f"went on, and ended in call 2, exit {run['exit_status']}, {run['wall_s']:.0f} s after its launch. {own}"
        )
    elif state == "finished":
        entry["summary"] = (
            f"The run, started detached (setsid) in call 1, ended within call 1, exit {run['exit_status']}, "
            f"{run['wall_s']:.0f} s after its launch (call 2 found it ended). {own}"
        )
    elif call == 1 and state == "running":
        entry["summary"] = (
            f"Call 1 of two: the run was started detached (setsid) and was still running when call 1 returned, "
            f"{run['wall_s_so_far']:.0f} s after its launch; these files are what it had written by then, and call 2 "
            f"collects the final ones. {own}"
        )
    elif state == "running":
        entry["summary"] = (
            f"The run spanned two device calls and was still running when call 2 returned, {run['wall_s_so_far']:.0f}"
            f" s after its launch: these files are what it had written by then (no final evaluation). {own}"
        )
    else:
        entry["summary"] = (
            f"The run, started detached (setsid) in call 1, ended without an exit status (killed) before call {call} "
            f"collected it: these files are what it had written. {own}"
        )
    return entry


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results_json", type=Path)
    parser.add_argument("lease_dir", type=Path)
    parser.add_argument("--call", type=int, choices=(1, 2), required=True)
    args = parser.parse_args()
    result = json.loads(args.results_json.read_text())
    result["lease"] = lease_entry(read_facts(args.lease_dir), args.call)
    result["targets"] = gpu_stages.targets(result)
    args.results_json.write_text(json.dumps(result, indent=1, default=str))
    args.results_json.with_suffix(".md").write_text(gpu_stages.staged_markdown(result))
    print(f"[gpu_lease_note] call {args.call}: {result['lease']['summary']}")


if __name__ == "__main__":
    main()
