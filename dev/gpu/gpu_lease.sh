#!/usr/bin/env bash
# One GPU lease: issue 40's benchmark stages on a bare device machine, every result written into $OUT as it is
# measured. Run by the device tool in the repository root, with the wheels of `.whl/` carried along:
#
#   bash dev/gpu/gpu_lease.sh [MODE] [more gpu_stages.py flags, e.g. --pong-args="--amp bf16"]
#
# One device command (ends within GPU_LEASE_BUDGET_S seconds, default 575, under the tool's 600 s per command):
#   all     (default) `gpu_stages.py --stage update pong`: the default's update against its variants in bf16, bf16
#           with the fused scan, without the heads' shared first layer, without the fused epilogues, Part 1 alone, and
#           --compile (Part 1 compiled too), region by region (at most 2 minutes), then the Atari100k Pong run on
#           the fastest with the time left (about 4.5 minutes of it training), its evaluation, the results
#   update  the update variants alone (at most 4 minutes)
#   pong    the Pong run alone (about 6.5 minutes of it training), its evaluation, the results
# Two device commands, the second issued as soon as the first returns (the machine stays warm 30 s), so that the
# Pong run outlives the first command's 10 minutes (dev/README.md, "Two calls"):
#   start       call 1 (default budget 550 s): the tests that need CUDA (at most 60 s), then the default's update
#               at 16 x 64, captured, against its variants (GPU_LEASE_UPDATE_VARIANTS, at most
#               GPU_LEASE_UPDATE_MINUTES, 2: ms, kernels and each region's time), then the Pong run on the fastest
#               (about 8 minutes before its time cap), both in one `gpu_stages.py` process started
#               detached (setsid) in GPU_LEASE_DIR (/tmp/gpu-lease), so the stages never share the GPU; waits on it
#               until its own budget is nearly spent, then copies what was measured so far into $OUT, marked "call 1,
#               still running"
#   start-pong  the same without the update variants: the Pong run alone, about 10 minutes before its time cap
#   finish      call 2 (default budget 195 s): lengthens the run to what its own budget allows (never shortens it:
#               the file gpu_stages.py --deadline-file reads), waits for it (its training, evaluation and results) to end or
#               for its own budget, then copies the files into $OUT, marked with both calls' times. Where
#               GPU_LEASE_DIR holds nothing (the machine was given back between the calls, and the run with it) it
#               says that the run is lost and exits 3.
# `all` and `start` run issue 66's incidents stage between the update stage and Pong (dev/gpu/incident_stage.py, at
# most GPU_LEASE_INCIDENTS_MINUTES, 2.5; GPU_LEASE_INCIDENTS=0 leaves it out), taking its minutes from the Pong run.
# Before the device call, `python dev/code_version.py` and carry [".whl", ".code-version.json"]: the results name the
# commit they ran (dev/README.md, "Results that name their code").
# The detached run ends by GPU_LEASE_SPAN_S seconds (default 740) after call 1 began (its --budget-minutes), so that
# call 2 started within 30 s of call 1's return still finds it ending inside its own budget.
#
# $OUT receives at most 8 files (the device tool's limit): <date>-<gpu>.json and .md (rewritten after each variant
# and every 5k env steps; the JSON holds the training log's last lines), <date>-<gpu>_pong_curve.png, up to four
# <date>-<gpu>_open_loop_step_<N>.png (5k, 10k, 20k, 30k), lease.log.
# The machine has Python 3.12 with PyTorch (CUDA), numpy, tensorboard, opencv, psutil, matplotlib, pillow and
# nvidia-ml-py, and no network: gymnasium, ale-py and tyro travel as wheels (dev/README.md says how to build
# `.whl/`); `.whl/fallback/` holds a newer typing_extensions, installed only where the machine's is older than
# typeguard needs.
#
# GPU_LEASE_CPU_CHECK=1 GPU_LEASE_PYTHON=.venv/bin/python GPU_LEASE_BUDGET_S=240 OUT=/tmp/x \
#     bash dev/gpu/gpu_lease.sh
# checks the script without a GPU: no wheels installed (the environment's own packages), `--device cpu --quick`;
# with GPU_LEASE_DIR, GPU_LEASE_SPAN_S and GPU_LEASE_PONG_MINUTES (the Pong run's own cap, default 30) the two
# calls too (tests/test_gpu_stages.py).
set -u -o pipefail

mode=${1:-all}
shift || true
extra=("$@")
case "$mode" in
    all | update | pong) default_budget_s=575 ;;
    start | start-pong) default_budget_s=550 ;;
    finish) default_budget_s=195 ;;
    *)
        echo "error: the mode must be all, update, pong, start, start-pong or finish, got '$mode'." >&2
        exit 2
        ;;
esac
budget_s=${GPU_LEASE_BUDGET_S:-$default_budget_s}
started_at=$(date +%s.%N)
start_s=${started_at%.*}
if [ -z "${OUT:-}" ] || [ ! -d "$OUT" ]; then
    echo "error: OUT must name an existing folder (the device tool sets it)." >&2
    exit 2
fi
cpu_check=${GPU_LEASE_CPU_CHECK:-0}
py=${GPU_LEASE_PYTHON:-python3}
case "$py" in
    /*) ;;
    */*) py="$PWD/$py" ;; # the detached run starts in another folder
esac
lease_dir=$(realpath -m "${GPU_LEASE_DIR:-/tmp/gpu-lease}")
site=/tmp/gpu-lease-site
if [ "$mode" = finish ] && [ ! -f "$lease_dir/lease.txt" ]; then
    echo "error: nothing from call 1 on this machine ($lease_dir is missing): the machine was given back between" \
        "the two calls, and the detached Pong run went with it. That run is lost; call 1's files (its curve until" \
        "call 1 returned, marked as still running) are all that is left of it." | tee "$OUT/lease.log" >&2
    exit 3
fi
if { [ "$mode" = start ] || [ "$mode" = start-pong ]; } && [ ! -f "$lease_dir/run.rc" ] && [ -f "$lease_dir/run.pid" ] &&
    kill -0 "$(cat "$lease_dir/run.pid")" 2>/dev/null; then
    echo "error: a detached run is still going in $lease_dir (pid $(cat "$lease_dir/run.pid")): collect it with" \
        "'finish'." >&2
    exit 2
fi
if [ "$cpu_check" != 1 ] && ! ls .whl/*.whl >/dev/null 2>&1 && ! { [ "$mode" = finish ] && [ -d "$site" ]; }; then
    echo "error: no wheels in .whl/ (carry it: carry [\".whl\"])." >&2
    exit 2
fi
exec > >(tee -a "$OUT/lease.log") 2>&1
# the code the results name: git's answer, written before the device call (dev/code_version.py) and carried here
if [ ! -d .git ] && [ ! -f .git ] && [ ! -f .code-version.json ]; then
    echo "[gpu_lease] no .code-version.json: the results will say their code is unknown (run python dev/code_version.py" \
        "before the device call and carry the file)"
fi

seconds_left() { echo $((budget_s - ($(date +%s) - start_s))); }
say() { echo "[gpu_lease $mode $(($(date +%s) - start_s)) s] $*"; }

export PYTHONUNBUFFERED=1
device=()
poll_s=${GPU_LEASE_POLL_S:-5}
if [ "$cpu_check" = 1 ]; then
    say "CPU check: the environment's own packages, --device cpu --quick"
    device=(--device cpu --quick)
    poll_s=${GPU_LEASE_POLL_S:-1}
elif [ "$mode" = finish ] && [ -d "$site" ]; then
    say "the wheels call 1 installed in $site"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
else
    say "installing $(ls .whl/*.whl | wc -l) wheels into $site"
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl ||
        exit 1
    if ! "$py" -c 'import importlib.metadata as m, sys
sys.exit(tuple(int(x) for x in m.version("typing_extensions").split(".")[:2]) < (4, 14))'; then
        say "typing_extensions older than 4.14: installing the carried one"
        "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
            .whl/fallback/*.whl || exit 1
    fi
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv,noheader
fi
if [ "$mode" != finish ]; then
    "$py" -c 'import sys, torch, gymnasium, ale_py, tyro
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available(),
      "gymnasium", gymnasium.__version__, "ale_py", ale_py.__version__, "tyro", tyro.__version__)' || exit 1
fi
minutes() { "$py" -c "print(round($1 / 60, 2))"; }
# the update stage's variants: the default's update (captured) and the same in bf16, in bf16 with the fused scan,
# without the heads' shared first layer and without the fused epilogues (what each saves), Part 1 alone (every kernels
# path off), and with --compile, Part 1's loops compiled whole too (last: the stage measures in
# gpu_stages.TRAINING_VARIANTS' order, and a compile cut short by the stage's cap leaves the others measured); the
# fastest runs Pong. A variant whose flag this version lacks is skipped. (The CPU check: the default's alone unless
# named, since compiling takes minutes on a CPU.)
default_variants="training training+fused-scan training+gathers training+gathers+fast-heads training+all-opt-in training+all-opt-in+bf16 training+bf16 part1 part1+compile training+compile"
[ "$cpu_check" = 1 ] && default_variants=training
read -r -a variants <<<"${GPU_LEASE_UPDATE_VARIANTS:-$default_variants}"
# issue 66's stage between the update stage and Pong (dev/gpu/incident_stage.py, at most GPU_LEASE_INCIDENTS_MINUTES,
# 2.5): on by default on a GPU; the CPU check runs it only with GPU_LEASE_INCIDENTS=1 (a minute or two of CPU)
incidents=()
if [ "${GPU_LEASE_INCIDENTS:-$([ "$cpu_check" = 1 ] && echo 0 || echo 1)}" = 1 ]; then
    incidents=(incidents --incidents-minutes "${GPU_LEASE_INCIDENTS_MINUTES:-2.5}")
fi

# ---------------------------------------------------------------------------------------------------------------
# One call: gpu_stages.py in the foreground, its files straight into $OUT
# ---------------------------------------------------------------------------------------------------------------
if [ "$mode" = all ] || [ "$mode" = update ] || [ "$mode" = pong ]; then
    pong_dir=$(mktemp -d /tmp/gpu-lease-pong.XXXXXX) # a new run each time (--no-pong-resumable wants an empty folder)
    common=(--results-dir "$OUT" --pong-dir "$pong_dir" --no-pong-resumable)
    case "$mode" in
        all) stages=(--stage update "${incidents[@]:0:1}" pong --update-minutes 2 --update-variants "${variants[@]}"
            "${incidents[@]:1}" --pong-eval-minutes 1) ;;
        update) stages=(--stage update --update-minutes 4 --update-variants "${variants[@]}") ;;
        pong) stages=(--stage pong --pong-eval-minutes 1) ;;
    esac
    # the Pong run trains until the budget leaves just its evaluation and the results (--budget-minutes)
    budget=$(minutes "$(($(seconds_left) - 10))")
    say "python dev/gpu/gpu_stages.py ${common[*]} ${stages[*]} ${device[*]} --pong-minutes 30 --budget-minutes $budget" \
        "${extra[*]}"
    "$py" dev/gpu/gpu_stages.py "${common[@]}" "${stages[@]}" "${device[@]}" --pong-minutes 30 --budget-minutes "$budget" \
        "${extra[@]}"
    status=$?
    say "gpu_stages.py exit $status; in \$OUT:"
    ls -la "$OUT"
    exit $status
fi

# ---------------------------------------------------------------------------------------------------------------
# Two calls: the run detached in $lease_dir (run.pid, run.started, run.log; run.rc once it ended: "status epoch"),
# each call's times in lease.txt; each call copies what is there into $OUT and marks the copy with both
# (gpu_lease_note.py), never the live files, which the run rewrites
# ---------------------------------------------------------------------------------------------------------------
record() { echo "$1=$2" >>"$lease_dir/lease.txt"; }
run_alive() { [ -f "$lease_dir/run.pid" ] && kill -0 "$(cat "$lease_dir/run.pid")" 2>/dev/null; }
log_lines_shown=0
show_run_log() { # the run's new log lines, into this call's output
    local total
    total=$(wc -l <"$lease_dir/run.log" 2>/dev/null || echo 0)
    if [ "$total" -gt "$log_lines_shown" ]; then
        sed -n "$((log_lines_shown + 1)),${total}p" "$lease_dir/run.log"
        log_lines_shown=$total
    fi
}
collect() { # $1: this call's number
    local results
    show_run_log
    record "call_$1_collected" "$(date +%s.%N)"
    results=$(ls "$lease_dir"/results/*.json 2>/dev/null | head -n 1)
    if [ -z "$results" ]; then
        say "no results file yet in $lease_dir/results: the run wrote nothing (its log above says why)"
        return 1
    fi
    # the JSON is replaced whole on each save, so a copy is never half a file; the markdown is written anew from it
    cp "$results" "${results%.json}"_*.png "$OUT"/ 2>/dev/null
    if ! "$py" dev/gpu/gpu_lease_note.py "$OUT/$(basename "$results")" "$lease_dir" --call "$1"; then
        say "the calls were not written into the results: their markdown as the run left it"
        cp "${results%.json}.md" "$OUT/"
    fi
}
wait_for_run() { # until the run ended or this call has $1 seconds left
    while [ ! -f "$lease_dir/run.rc" ] && run_alive && [ "$(seconds_left)" -gt "$1" ]; do
        show_run_log
        sleep "$poll_s"
    done
}
margin_s=$((poll_s + 10)) # the copy and the note

if [ "$mode" = start ] || [ "$mode" = start-pong ]; then
    rm -rf "$lease_dir"
    mkdir -p "$lease_dir/results" "$lease_dir/code/benchmark" "$lease_dir/code/dev/gpu"
    # the run reads its code from its own copy: call 2's fresh working tree never changes it under the run
    cp dreamer_atari.py memory_utils.py memory_analysis.py "$lease_dir/code/"
    cp benchmark/*.py "$lease_dir/code/benchmark/"
    mkdir -p "$lease_dir/code/benchmark/results"  # DreamerV3's own Pong curves, drawn beside the run's
    cp benchmark/results/dreamerv3_atari100k_pong.json "$lease_dir/code/benchmark/results/"
    cp dev/__init__.py "$lease_dir/code/dev/"
    cp .code-version.json "$lease_dir/code/" 2>/dev/null # the commit the results name (dev/code_version.py)
    cp dev/gpu/*.py "$lease_dir/code/dev/gpu/"
    # the tests that need CUDA, first and alone on the GPU (pytest travels among the wheels), into lease.log: the
    # lease's last minutes then all go to the run
    if "$py" -c "import pytest" 2>/dev/null; then
        say "the tests that need CUDA (tests/test_dreamer_cuda.py, tests/test_dqn_cuda.py, and the CUDA tests of the frame"
        say "store, the memory cap, the fused scan and the fused epilogues)"
        timeout 60 "$py" -m pytest -q -o addopts= -p no:cacheprovider tests/test_dreamer_cuda.py tests/test_dqn_cuda.py \
            tests/test_dreamer_frame_store.py tests/test_gpu_memory_cap_cuda.py tests/test_dreamer_fused_scan.py \
            tests/test_dreamer_fused_epilogues.py -k cuda
        say "CUDA tests: exit $?"
    fi
    span_s=${GPU_LEASE_SPAN_S:-740}
    record call_1_mode "$mode"
    record call_1_started "$started_at"
    record call_1_budget_s "$budget_s"
    record span_s "$span_s"
    case "$mode" in
        start) stages=(--stage update "${incidents[@]:0:1}" pong --update-minutes "${GPU_LEASE_UPDATE_MINUTES:-2}"
            --update-variants "${variants[@]}" "${incidents[@]:1}" --pong-inductor-cache update-stage) ;;
        start-pong) stages=(--stage pong) ;;
    esac
    budget=$(minutes "$((span_s - ($(date +%s) - start_s)))")
    cmd=("$py" dev/gpu/gpu_stages.py --results-dir "$lease_dir/results" --pong-dir "$lease_dir/pong"
        --no-pong-resumable --deadline-file "$lease_dir/deadline" "${stages[@]}" --pong-eval-minutes 0.5 "${device[@]}"
        --pong-minutes "${GPU_LEASE_PONG_MINUTES:-30}" --budget-minutes "$budget" "${extra[@]}")
    say "detached, in $lease_dir/code: ${cmd[*]}"
    # a new session (setsid): the device tool ends what a command leaves running, except a new session's processes.
    # Every inherited descriptor above 2 closed (this call's output pipes among them), so that none stays open on
    # the run's account after the call returns.
    # shellcheck disable=SC2016
    setsid nohup bash -c 'd=$1; shift; cd "$d/code" || exit
        for fd in /proc/$$/fd/*; do fd=${fd##*/}; [ "$fd" -gt 2 ] && eval "exec $fd>&-"; done
        date +%s.%N >"$d/run.started"; echo $$ >"$d/run.pid.tmp"; mv "$d/run.pid.tmp" "$d/run.pid"
        "$@"; echo "$? $(date +%s.%N)" >"$d/run.rc.tmp"; mv "$d/run.rc.tmp" "$d/run.rc"' \
        _ "$lease_dir" "${cmd[@]}" >"$lease_dir/run.log" 2>&1 </dev/null &
    for _ in $(seq 100); do
        [ -f "$lease_dir/run.pid" ] && break
        sleep 0.1
    done
    say "run started, pid $(cat "$lease_dir/run.pid" 2>/dev/null || echo '?'); waiting on it until $margin_s s are left"
    wait_for_run "$margin_s"
    call=1
else
    record call_2_started "$started_at"
    record call_2_budget_s "$budget_s"
    # the run may go on training as long as this call's budget allows (never less than call 1 gave it): its
    # evaluation and results, and this call's copy, still fit (gpu_stages.py --deadline-file)
    end_s=$((start_s + budget_s - margin_s))
    echo "$end_s" >"$lease_dir/deadline.tmp" && mv "$lease_dir/deadline.tmp" "$lease_dir/deadline"
    record call_2_run_may_end "$end_s"
    say "the run may go on until $((end_s - start_s)) s into this call where call 1 gave it less (its evaluation and results within)"
    say "the detached run of call 1, pid $(cat "$lease_dir/run.pid" 2>/dev/null || echo '?'); waiting on it"
    log_lines_shown=$(wc -l <"$lease_dir/run.log" 2>/dev/null || echo 0) # call 1 showed those
    wait_for_run "$margin_s"
    call=2
fi
if [ -f "$lease_dir/run.rc" ]; then
    read -r status _ <"$lease_dir/run.rc"
    say "the run ended, exit $status"
elif run_alive; then
    status=0
    say "the run is still going: copying what it measured so far"
else
    status=1
    say "the run's process is gone without an exit status (killed?)"
fi
collect "$call" || status=1
say "in \$OUT:"
ls -la "$OUT"
exit "$status"
