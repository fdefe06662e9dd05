#!/usr/bin/env bash
# The CUDA device on a machine with an NVIDIA GPU and its driver (one H100 or H200: 8 minutes at most):
#   1. the CUDA tests (test/runtime/test_cuda.py, test/renderer/test_cuda_render.py) with the real driver present;
#   2. the op tests (test/tensor/test_ops.py) with DEV=CUDA: every op's kernels compiled by NVRTC and run on the GPU,
#      against torch;
#   3. TinyJit replaying through CUDA graphs against numpy, the time of a replay with and without the graph, and with
#      two GPUs or more a copy between them (peer to peer where the driver allows it) and a sum split over both
#      (test/gpu/check_cuda_graph.py);
#   3b. tensor cores (sm_80 and later): half, bfloat16 and TF32 matmuls and a convolution through mma.sync against
#      numpy and the PYTHON device's emulation, kernels with their operands staged through shared memory against
#      numpy and the same kernels unstaged, and a 4096 half matmul's time staged, unstaged and without tensor cores
#      (test/gpu/check_tensor_cores.py);
#   4. examples/train_digits.py on CUDA (a few epochs: the accuracy it prints), and BEAM=2 on a matmul, a half matmul
#      and a softmax against numpy (test/gpu/check_beam.py);
#   4b. half and bfloat16 convolutions as im2col and read in place, with their gradients, against torch on the GPU,
#      and a large 16-bit copy of several outputs per work-item against numpy (test/gpu/check_convolutions.py);
#   4c. on a Hopper GPU, bench/wgmma_probe.py: which shared-memory layout wgmma's descriptor reads (it informs, it
#      doesn't fail the check);
#   5. bench/bench_gpu.py: fusegrad on CUDA against PyTorch on the same GPU (alone, after the others, which run side
#      by side).
#
#   bash test/gpu/check.sh            # from anywhere; each step's log goes to $OUT/ (when OUT is set) or a temporary
#                                     # folder, and a summary with each log's end to the terminal
#
# Offline: the machine needs python3 (3.11 or later) with numpy, pytest, torch, hypothesis and scikit-learn, and
# NVRTC: the `cuda` extra's wheel (nvidia-cuda-nvrtc-cu12), another NVIDIA NVRTC wheel or a CUDA toolkit's
# libnvrtc. What is missing can travel as wheels in the ignored folder .wheels/ of the checkout, downloaded where
# pip reaches PyPI (for the target's Python and platform), e.g.
#   echo /.wheels/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux2014_x86_64 -d .wheels nvidia-cuda-nvrtc-cu12
# This script installs .wheels/*.whl into a folder of its own (no index, no network) and puts it on PYTHONPATH;
# fusegrad itself runs from the checkout.
set -uo pipefail
cd "$(dirname "$0")/../.."
LOGS=${OUT:-$(mktemp -d)}
PY=python3
export PYTHONUNBUFFERED=1 CACHELEVEL=0
if compgen -G ".wheels/*.whl" > /dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/fg-wheels \
        .wheels/*.whl || exit 1
    export PYTHONPATH=/tmp/fg-wheels
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi -L 2>/dev/null || echo "(no nvidia-smi)"
$PY -c "from fusegrad import Device; from fusegrad.runtime.ops_cuda import _nvrtc_paths, nvrtc, nvrtc_version
print('NVRTC', nvrtc_version(), 'from', nvrtc()._name, 'of', _nvrtc_paths())
d = Device['CUDA']; print(d.name, d.arch, d.memory_size >> 20, 'MiB; the default device:', Device.DEFAULT)" || exit 1

status=0
start_all=$SECONDS
# step NAME SECONDS COMMAND...: run it with a time limit, its output to $LOGS/NAME.log, its exit status to NAME.rc
step() {
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
    local rc=$?
    echo "$rc $((SECONDS - start))" > "$LOGS/$name.rc"
}
report() {   # report NAME LINES: its exit status, time and the last lines of its log
    local name=$1 lines=$2 rc=124 secs=?
    [ -f "$LOGS/$name.rc" ] && read -r rc secs < "$LOGS/$name.rc"
    echo "=== $name: exit $rc after $secs s"
    grep -E "^(FAILED|ERROR|FAIL) " "$LOGS/$name.log" | head -40
    tail -n "$lines" "$LOGS/$name.log"
    [ "$rc" -eq 0 ] || status=1
    rm -f "$LOGS/$name.rc"
}

# the checks of correctness run side by side (the machine has many cores; each is a process of its own), the
# benchmark alone after them
step cuda_tests 150 $PY -m pytest -q -rf -p no:cacheprovider test/runtime/test_cuda.py test/renderer/test_cuda_render.py &
step op_tests 240 env DEV=CUDA $PY -m pytest -q -rf --tb=short -p no:cacheprovider -n 8 --maxfail=60 \
    test/tensor/test_ops.py &
step cuda_graph 120 $PY test/gpu/check_cuda_graph.py &
step tensor_cores 180 $PY test/gpu/check_tensor_cores.py &
step train_digits 120 env DEV=CUDA $PY examples/train_digits.py --epochs 3 &
step beam 150 $PY test/gpu/check_beam.py &
step convolutions 150 $PY test/gpu/check_convolutions.py &
step wgmma_probe 90 $PY bench/wgmma_probe.py &
wait
for name in cuda_tests op_tests cuda_graph tensor_cores train_digits beam convolutions; do report $name 12; done
# (a probe of wgmma's operand layouts on Hopper GPUs: what it finds informs, it doesn't fail the check)
kept=$status; report wgmma_probe 10; status=$kept
echo "=== correctness checks took $((SECONDS - start_all)) s"
step bench_gpu ${BENCH_LIMIT:-240} env DEV=CUDA $PY bench/bench_gpu.py --device CUDA
report bench_gpu 40
echo "=== check.sh: $([ $status -eq 0 ] && echo passed || echo FAILED) after $((SECONDS - start_all)) s"
exit $status
