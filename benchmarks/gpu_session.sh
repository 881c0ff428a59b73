#!/bin/bash
# One GPU session's measurements, prepared to run once on a lent H100/H200 (about 9 min):
# the estimator's ground truth (benchmarks/gpu_truth.py: plain and functp steps, allocator
# peaks), the issue-39 table eager on the five configurations, then the 187M and
# host-bound configurations compiled. Each stage has its own time limit, so a slow or
# failing stage keeps what the others measured. Results go to $OUT (default
# benchmarks/results/gpu/). Wheels for packages the machine lacks (optree; the tests'
# transformers) travel in .whl/ (see benchmarks/README.md, "On a GPU").
#
#     bash benchmarks/gpu_session.sh
#     SKIP_TRUTH=1 COMPILE_CONFIGS=h1024 EAGER_LIMIT=130 bash benchmarks/gpu_session.sh   # shorter
set -u
COMPILE_CONFIGS=${COMPILE_CONFIGS:-h1024,host}
OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers, optree; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'optree', optree.__version__, 'cpus', __import__('os').cpu_count())"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
stage() {   # stage NAME SECONDS CMD...: run with a limit, keep its log and its json
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name: exit $? after $((SECONDS - t0)) s"
    grep -v -i "warn" "$OUT/$name.log" | tail -40
}
if [ -z "${SKIP_TRUTH:-}" ]; then
    stage gpu_truth ${TRUTH_LIMIT:-150} python3 benchmarks/gpu_truth.py
    cp benchmarks/results/gpu_truth.json "$OUT/gpu_truth.json" 2>/dev/null
fi
stage gpu_step_eager ${EAGER_LIMIT:-200} python3 benchmarks/gpu_step.py --device cuda --reps 5
cp benchmarks/results/gpu_step.json "$OUT/gpu_step_eager.json" 2>/dev/null
rm -f benchmarks/results/gpu_step.json
stage gpu_step_compiled ${COMPILE_LIMIT:-170} python3 benchmarks/gpu_step.py --device cuda --reps 5 \
    --compile --configs "$COMPILE_CONFIGS"
cp benchmarks/results/gpu_step.json "$OUT/gpu_step_compiled.json" 2>/dev/null
exit 0
