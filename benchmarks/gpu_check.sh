#!/usr/bin/env bash
# The GPU machine's checks for issue 20 in one command: set-up, the device report, the
# GPU tests, the benchmarks.  Each stage logs to $OUT/<stage>.log and runs under its own
# time limit, so a failure or a hang in one stage costs only that stage.
#
#   bash benchmarks/gpu_check.sh STAGE...      (stages below; default: info tests)
#
# As run on the lent H200 on 2026-11-27 (docs/PERFORMANCE.md, "GPU"), each call well
# inside the session's 15 device minutes, .whl/ carried:
#   TESTS_LIMIT=230 bash benchmarks/gpu_check.sh info bench-quick tests
#   STEPS=5 WARMUP=2 BENCH_LIMIT=190 bash benchmarks/gpu_check.sh tests bench-paper bench-mlperf
#   STEPS=4 WARMUP=1 BENCH_LIMIT=45 bash benchmarks/gpu_check.sh test-ir bench-b32-bf16 memory
# Issue 35 item 5 (conv1), a minute or two: bash benchmarks/gpu_check.sh bench-conv1
# Issue 35's device run, prepared 2026-11-29 and not yet run (no device was lent), in
# calls that each fit one 10-minute command, most telling first:
#   TESTS_LIMIT=240 bash benchmarks/gpu_check.sh info tests bench-graph
#   STEPS=5 WARMUP=3 ALGORITHMS=cudnn BENCH_LIMIT=200 bash benchmarks/gpu_check.sh \
#       bench-paper bench-mlperf
#   bash benchmarks/gpu_check.sh bench-conv1 bench-dense bench-raw bench-input memory
# On the lent machine set OUT to the device tool's $OUT, and keep the logs that come back
# under docs/perf/gpu-<device>-<date>/ (as docs/perf/gpu-h200-2026-11-27/).
# Environment: STEPS, WARMUP, INPUT (host|stored|device), AUTOTUNE (true|false: cuDNN plans),
# ALGORITHMS (cudnn gemm: the convolution rows; a "graph" row follows each cudnn one),
# TESTS_LIMIT, BENCH_LIMIT, OUT.
#
# Set-up: a machine with no package index gets its missing wheels from .whl/ (the cuDNN
# frontend, mpi4py, mpi-pytest, crc32c, the mpich wheel for mpiexec), installed outside
# the system Python; the project runs from the checkout (PYTHONPATH), its optional CPU
# extension unbuilt.  On a machine where `pip install -e ".[gpu-cuda13,test]"` works,
# none of that is needed.
set -u
OUT=${OUT:-runs/gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
# the lent machine's Python with torch, cupy and the CUDA 13 libraries
[ -x /opt/torch/.venv/bin/python3 ] && export PATH="/opt/torch/.venv/bin:$PATH"
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site $(ls .whl/*.whl | grep -v mpich) >"$OUT/setup.log" 2>&1 \
        || { cat "$OUT/setup.log"; exit 1; }
    export PYTHONPATH=/tmp/site
    if ls .whl/mpich-*.whl >/dev/null 2>&1; then
        # pip --target drops the wheel's lib/; unpacked, bin/ and lib/ stay together
        python3 -m zipfile -e .whl/mpich-*.whl /tmp/mpich
        MPICH=$(ls -d /tmp/mpich/mpich-*.data/data)
        chmod +x "$MPICH"/bin/*
        export PATH="$MPICH/bin:$PATH" LD_LIBRARY_PATH="$MPICH/lib:${LD_LIBRARY_PATH:-}"
    fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export MPIR_CVAR_ENABLE_HEAVY_YIELD=1

stage() {  # stage NAME SECONDS COMMAND...: run with a limit, log, report the exit code
    local name=$1 limit=$2
    shift 2
    local started=$SECONDS
    timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: exit $rc in $((SECONDS - started)) s" | tee -a "$OUT/summary.txt"
    tail -n "${TAIL:-25}" "$OUT/$name.log"
}

bench_w128() {  # bench_w128 MODEL BATCH...: the table for one network
    local model=$1
    shift
    python3 benchmarks/bench_step.py --width 128 --batch "$@" --steps "${STEPS:-10}" --warmup "${WARMUP:-3}" \
        --input "${INPUT:-host}" --set device.cudnn_autotune="${AUTOTUNE:-false}" \
        --algorithms ${ALGORITHMS:-cudnn gemm} \
        --set model.name="$model" --out "$OUT/step_${model}_w128_$(date +%H%M%S).json"
}

run_stage() {
    case $1 in
    info)
        stage info 120 bash -c 'nvidia-smi; python3 -m cosmotrain info;
            python3 -c "import cupy, cudnn; print(cupy.__version__, cudnn.backend_version())"
            mpiexec --version | head -3' ;;
    tests)
        stage tests "${TESTS_LIMIT:-300}" python3 -m pytest -p no:cacheprovider -q -rfEs \
            --timeout=150 tests/test_gpu_engine.py tests/test_gpu_conv.py \
            tests/test_gpu_raw_kernels.py tests/test_gpu_dense_device.py \
            tests/test_gpu_graph_device.py tests/test_cuda_batchnorm_host.py ;;
    bench-quick)
        stage bench-quick 120 python3 benchmarks/bench_step.py --width 128 --batch 8 \
            --precisions fp32 bf16 --steps 5 --warmup 2 --out "$OUT/step_quick.json" ;;
    bench-input)  # issue 35 item 1: a float32 batch from pageable memory against int16
        # counts staged through pinned buffers and transformed on the device
        stage bench-input 150 bash -c 'for input in host stored; do
            python3 benchmarks/bench_step.py --width 128 --batch 8 --precisions bf16 \
                --algorithms cudnn --steps 5 --warmup 2 --no-torch --input $input \
                --out "$OUT/step_input_${input}_w128_b8.json"; done' ;;
    bench-paper)
        stage bench-paper "${BENCH_LIMIT:-240}" bash -c "bench_w128 cosmoflow 1 8 32" ;;
    bench-mlperf)
        stage bench-mlperf "${BENCH_LIMIT:-240}" bash -c "bench_w128 cosmoflow-mlperf 1 8 32" ;;
    bench-b32-bf16)
        stage bench-b32-bf16 "${BENCH_LIMIT:-240}" bash -c \
            "bench_w128 cosmoflow 32 --precisions bf16" ;;
    test-ir)
        stage test-ir 60 python3 -m pytest -p no:cacheprovider -q -rfEs \
            tests/test_gpu_conv.py::test_describe_graph_matches_the_frontend_ir ;;
    profile)  # where a step's time goes, layer by layer (device synchronised around each)
        stage profile 150 python3 benchmarks/bench_step.py --width 128 --batch 8 \
            --precisions fp32 bf16 --algorithms cudnn --steps 5 --warmup 2 --input device \
            --layers --torch-layouts ncdhw --set device.cudnn_autotune="${AUTOTUNE:-false}" \
            --out "$OUT/profile_w128_b8.json" ;;
    bench-graph)  # issue 35 item 4: the step with and without its CUDA graph, where
        # launches weigh most (batch 1) and at batch 8, both networks, bf16, no torch
        stage bench-graph 150 bash -c 'for model in cosmoflow cosmoflow-mlperf; do
            python3 benchmarks/bench_step.py --width 128 --batch 1 8 --precisions bf16 \
                --algorithms cudnn --graph off on --steps 5 --warmup 3 --no-torch \
                --set model.name=$model --out "$OUT/step_graph_${model}_w128.json"; done' ;;
    bench-raw)  # our own CUDA kernels (kernels/cuda/src): ms and GB/s against the peak
        stage bench-raw 90 python3 benchmarks/bench_raw_kernels.py --width 128 --batch 8 \
            --out "$OUT/raw_kernels_w128_b8.json" ;;
    bench-dense)  # issue 35: the dense head on our kernels (linear.cu, what a CUDA graph
        # can capture) against cuBLAS, both heads, W = 128, batch 1 8 32, fp32 and bf16
        stage bench-dense 90 python3 benchmarks/bench_dense.py --width 128 --batch 1 8 32 \
            --out "$OUT/dense_w128.json" ;;
    bench-conv1)  # issue 35 item 5: conv1 under cuDNN (4 channels, padded to 8), our direct
        # kernel (conv_direct.cu) and PyTorch eager, forward and weight gradient, W = 128
        stage bench-conv1 180 python3 benchmarks/bench_conv1.py --width 128 --batch 1 8 \
            --precisions fp32 tf32 bf16 --repeats 10 --out "$OUT/conv1_w128.json" ;;
    bench-bn)  # issue 35 item 3: batch norm on batchnorm.cu against the cupy path it
        # replaced, the 3D ResNet's four stages at W = 128, batch 8, fp32 and bf16
        stage bench-bn 90 python3 benchmarks/bench_batchnorm.py --width 128 --batch 8 \
            --repeats 10 --out "$OUT/batchnorm_w128_b8.json" ;;
    bench-layers)
        stage bench-layers 180 python3 benchmarks/bench_gpu.py --width 128 --batch 8 \
            --precisions bf16 --out "$OUT/layers_w128.json" ;;
    memory)
        stage memory-w256 150 mpiexec -n 4 python3 benchmarks/bench_step.py --width 256 \
            --batch 1 --precisions bf16 --algorithms cudnn --graph off --steps 3 --warmup 1 \
            --set parallel.depth=2 --set parallel.height=2 --set parallel.sample=1 \
            --out "$OUT/step_w256_d2h2.json"
        stage memory-w512 200 mpiexec -n 8 python3 benchmarks/bench_step.py --width 512 \
            --batch 1 --precisions bf16 --algorithms cudnn --graph off --steps 3 --warmup 1 \
            --set parallel.depth=2 --set parallel.height=2 --set parallel.width=2 \
            --set parallel.sample=1 --out "$OUT/step_w512_d2h2w2.json" ;;
    *)
        echo "unknown stage $1" >&2; return 2 ;;
    esac
}

export -f bench_w128
export OUT
for name in "${@:-info tests}"; do
    for one in $name; do run_stage "$one"; done
done
