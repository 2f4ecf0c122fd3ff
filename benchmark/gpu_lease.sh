#!/usr/bin/env bash
# One GPU lease, one command: issue 40's benchmark stages on a bare device machine, every result written into $OUT
# as it is measured. Run by the device tool in the repository root, with the wheels of `.whl/` carried along:
#
#   bash benchmark/gpu_lease.sh [all|update|pong] [more run.py flags, e.g. --pong-args="--amp bf16"]
#
#   all     (default) `run.py --gpu-only --stage update pong`, ending within GPU_LEASE_BUDGET_S seconds (default
#           575, under the tool's 600 s per command): the update variants (at most 3 minutes), then the Atari100k
#           Pong run with the time left (about 3.5 minutes of it training), its evaluation, the results
#   update  the update variants alone (at most 4 minutes)
#   pong    the Pong run alone (about 6.5 minutes of it training), its evaluation, the results
#
# $OUT receives at most 7 files: <date>-<gpu>.json and .md (rewritten after each variant and every 5k env steps),
# <date>-<gpu>_pong_curve.png, up to two <date>-<gpu>_open_loop_step_<N>.png, pong_train_log_tail.txt, lease.log.
# The machine has Python 3.12 with PyTorch (CUDA), numpy, tensorboard, opencv, psutil, matplotlib, pillow and
# nvidia-ml-py, and no network: gymnasium, ale-py and tyro travel as wheels (benchmark/README.md says how to build
# `.whl/`); `.whl/fallback/` holds a newer typing_extensions, installed only where the machine's is older than
# typeguard needs.
#
# GPU_LEASE_CPU_CHECK=1 GPU_LEASE_PYTHON=.venv/bin/python GPU_LEASE_BUDGET_S=240 OUT=/tmp/x bash benchmark/gpu_lease.sh
# checks the script without a GPU: no wheels installed (the environment's own packages), `--device cpu --quick`.
set -u -o pipefail

mode=${1:-all}
shift || true
extra=("$@")
budget_s=${GPU_LEASE_BUDGET_S:-575}
start_s=$(date +%s)
case "$mode" in
    all | update | pong) ;;
    *)
        echo "error: the mode must be all, update or pong, got '$mode'." >&2
        exit 2
        ;;
esac
if [ -z "${OUT:-}" ] || [ ! -d "$OUT" ]; then
    echo "error: OUT must name an existing folder (the device tool sets it)." >&2
    exit 2
fi
cpu_check=${GPU_LEASE_CPU_CHECK:-0}
py=${GPU_LEASE_PYTHON:-python3}
if [ "$cpu_check" != 1 ] && ! ls .whl/*.whl >/dev/null 2>&1; then
    echo "error: no wheels in .whl/ (carry it: carry [\".whl\"])." >&2
    exit 2
fi
exec > >(tee -a "$OUT/lease.log") 2>&1

seconds_left() { echo $((budget_s - ($(date +%s) - start_s))); }
say() { echo "[gpu_lease $(($(date +%s) - start_s)) s] $*"; }

export PYTHONUNBUFFERED=1
device=()
if [ "$cpu_check" = 1 ]; then
    say "CPU check: the environment's own packages, --device cpu --quick"
    device=(--device cpu --quick)
else
    site=/tmp/gpu-lease-site
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
"$py" -c 'import sys, torch, gymnasium, ale_py, tyro
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available(),
      "gymnasium", gymnasium.__version__, "ale_py", ale_py.__version__, "tyro", tyro.__version__)' || exit 1

pong_dir=$(mktemp -d /tmp/gpu-lease-pong.XXXXXX) # a new run each time (--no-pong-resumable wants an empty folder)
common=(--gpu-only --results-dir "$OUT" --pong-dir "$pong_dir" --no-pong-resumable)
minutes() { "$py" -c "print(round($1 / 60, 2))"; }
case "$mode" in
    all) stages=(--stage update pong --update-minutes 3 --pong-eval-minutes 1) ;;
    update) stages=(--stage update --update-minutes 4) ;;
    pong) stages=(--stage pong --pong-eval-minutes 1) ;;
esac
# the Pong run trains until the budget leaves just its evaluation and the results (run.py --budget-minutes)
budget=$(minutes "$(($(seconds_left) - 10))")
say "python benchmark/run.py ${common[*]} ${stages[*]} ${device[*]} --pong-minutes 30 --budget-minutes $budget ${extra[*]}"
"$py" benchmark/run.py "${common[@]}" "${stages[@]}" "${device[@]}" --pong-minutes 30 --budget-minutes "$budget" \
    "${extra[@]}"
status=$?
if [ -f "$pong_dir/train.log" ]; then
    tail -n 200 "$pong_dir/train.log" >"$OUT/pong_train_log_tail.txt"
fi
say "run.py exit $status; in \$OUT:"
ls -la "$OUT"
exit $status
