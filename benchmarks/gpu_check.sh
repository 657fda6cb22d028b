#!/usr/bin/env bash
# The GPU path, checked on a machine with CUDA GPUs; one JSON out.
#
#   benchmarks/gpu_check.sh [--out results/bench/gpu_check.json] [--dry-run] [--full]
#
# 1. the CUDA tests (tests/test_layers.py: the kernels against the CPU reference); a
#    CUDA test that is skipped fails the check
# 2. single and graph (P=1) on one GPU: benchmarks/bench_modes.py --quick (its workers
#    run on cuda:rank with NCCL when CUDA is there)
# 3. where there are several GPUs: graph and pipeline at P = 2 (and 4 when there are 4),
#    one GPU per worker, NCCL
# then merges the test outcome and both benchmark JSONs into --out, with nvidia-smi's
# GPU list. --full: bench_modes' full sizes instead of --quick. --dry-run prints the
# commands (with the GPU count it would use) and runs nothing. --allow-cpu: run anyway
# where there is no GPU (on CPU, gloo), to exercise the script itself: it then reports
# FAILED, the CUDA tests being skipped.
# Python: $PYTHON, else .venv/bin/python, else python3; it must be a CUDA build of torch
# (requirements/cpu.lock.txt installs the CPU one): the check fails at once, with the
# reason, where torch sees no GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
out=results/bench/gpu_check.json
dry=0
allow_cpu=0
size=--quick
while [[ $# -gt 0 ]]; do
  case $1 in
    --out) out=$2; shift 2 ;;
    --dry-run) dry=1; shift ;;
    --full) size=""; shift ;;
    --allow-cpu) allow_cpu=1; shift ;;
    *) echo "gpu_check: unknown argument $1 (use --out FILE, --dry-run, --full, --allow-cpu)" >&2; exit 2 ;;
  esac
done
py=${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"

ngpu=$("$py" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)' 2>/dev/null || echo 0)
tv=$("$py" -c 'import torch; print(torch.__version__, torch.version.cuda)' 2>/dev/null || echo "no torch")
work=$(dirname "$out")/gpu_check.work
workers="1"; pworkers=""
(( ngpu >= 2 )) && { workers="1 2"; pworkers="2"; }
(( ngpu >= 4 )) && { workers="1 2 4"; pworkers="2 4"; }
cmds=("$py -m pytest -q -rs tests/test_layers.py"
      "$py benchmarks/bench_modes.py $size --modes single graph --workers $workers --single-threads 1 --out $work/modes.json --work-dir $work/modes")
[[ -n $pworkers ]] && cmds+=("$py benchmarks/bench_modes.py $size --modes pipeline --workers $pworkers --single-threads 1 --out $work/pipeline.json --work-dir $work/pipeline")

if (( dry )); then
  echo "gpu_check (dry run): python $py, torch $tv, $ngpu CUDA GPU(s) visible here"
  (( ngpu == 0 )) && echo "gpu_check (dry run): a real run would stop here: no CUDA GPU"
  (( ngpu == 1 )) && echo "gpu_check (dry run): one GPU: no pipeline run (it needs one GPU per stage)"
  printf '  %s\n' "${cmds[@]}"
  echo "  -> $out"
  exit 0
fi
if (( ngpu == 0 && ! allow_cpu )); then
  echo "gpu_check: no CUDA GPU visible to $py (torch $tv); on a GPU machine install a CUDA build of torch" \
       "(requirements/cpu.lock.txt pins the CPU one) and check nvidia-smi" >&2
  exit 1
fi
mkdir -p "$work"
echo "gpu_check: torch $tv, $ngpu GPU(s)" >&2
set +e
${cmds[0]} > "$work/tests.log" 2>&1; test_rc=$?
skipped_cuda=$(grep -c "needs CUDA" "$work/tests.log")
${cmds[1]} 2> "$work/modes.log"; modes_rc=$?
pipe_rc=0
[[ -n $pworkers ]] && { ${cmds[2]} 2> "$work/pipeline.log"; pipe_rc=$?; }
set -e
gpus=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "")
GPUS="$gpus" "$py" - "$out" "$work" "$test_rc" "$skipped_cuda" "$modes_rc" "$pipe_rc" "$ngpu" <<'EOF'
import json, os, sys, time
from pathlib import Path
from gnnpipe.io import write_json
out, work, test_rc, skipped, modes_rc, pipe_rc, ngpu = sys.argv[1:]
work = Path(work)
def load(name):
    p = work / name
    return json.loads(p.read_text()) if p.exists() else None
tests_tail = (work / "tests.log").read_text().splitlines()[-5:]
runs = [r for b in (load("modes.json"), load("pipeline.json")) if b for r in b["runs"]]
failed = [f"{r['mode']} P={r['workers']}: {r['error'][:300]}" for r in runs if "error" in r]
ok = (int(test_rc) == 0 and int(skipped) == 0 and int(modes_rc) == 0 and int(pipe_rc) == 0
      and not failed and bool(runs))
write_json(out, {"benchmark": "gpu_check", "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "ok": ok,
                 "gpus": os.environ.get("GPUS", "").splitlines(), "cuda_device_count": int(ngpu),
                 "cuda_tests": {"exit": int(test_rc), "cuda_tests_skipped": int(skipped), "tail": tests_tail},
                 "modes": load("modes.json"), "pipeline": load("pipeline.json"), "failed_runs": failed})
print(f"gpu_check: {'ok' if ok else 'FAILED'}; {len(runs)} runs, {len(failed)} failed, "
      f"CUDA tests exit {test_rc} ({skipped} skipped for want of CUDA) -> {out}", file=sys.stderr)
sys.exit(0 if ok else 1)
EOF
