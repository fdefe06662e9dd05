#!/usr/bin/env bash
# The CUDA device on a machine with an NVIDIA GPU and its driver (one H100: about 5 minutes, 10 at most):
#   1. the CUDA tests (test/runtime/test_cuda.py, test/renderer/test_cuda_render.py) with the real driver present;
#   2. the op tests (test/tensor/test_ops.py) with DEV=CUDA: every op's kernels compiled by NVRTC and run on the GPU,
#      against torch;
#   3. TinyJit replaying through CUDA graphs against numpy, the time of a replay with and without the graph, and with
#      two GPUs or more a copy between them (peer to peer where the driver allows it) and a sum split over both
#      (test/gpu/check_cuda_graph.py);
#   3b. tensor cores (sm_80 and later): half, bfloat16 and TF32 matmuls and a convolution through mma.sync against
#      numpy and the PYTHON device's emulation, and a 4096 half matmul's time with and without them
#      (test/gpu/check_tensor_cores.py);
#   4. examples/train_digits.py on CUDA (a few epochs: the accuracy it prints);
#   5. bench/bench_gpu.py on CUDA, where it exists.
#
#   bash test/gpu/check.sh            # from anywhere; logs also go to $OUT/ when OUT is set
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
$PY -c "from fusegrad import Device; d = Device['CUDA']; from fusegrad.runtime.ops_cuda import nvrtc_version
print(d.name, d.arch, d.memory_size >> 20, 'MiB, NVRTC', nvrtc_version())" || exit 1

status=0
step() {   # step NAME SECONDS COMMAND...: run it with a time limit, its output to the terminal and to $LOGS/NAME.log
    local name=$1 limit=$2
    shift 2
    echo "=== $name"
    local start=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee "$LOGS/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "=== $name: exit $rc after $((SECONDS - start)) s"
    [ "$rc" -eq 0 ] || status=1
}

step cuda_tests 90 $PY -m pytest -q -p no:cacheprovider test/runtime/test_cuda.py test/renderer/test_cuda_render.py
step op_tests 240 env DEV=CUDA $PY -m pytest -q -p no:cacheprovider --maxfail=30 test/tensor/test_ops.py
step cuda_graph 120 $PY test/gpu/check_cuda_graph.py
step tensor_cores 150 $PY test/gpu/check_tensor_cores.py
step train_digits 90 env DEV=CUDA $PY examples/train_digits.py --epochs 3
if [ -f bench/bench_gpu.py ]; then
    if grep -q -- "--device" bench/bench_gpu.py; then step bench_gpu 60 env DEV=CUDA $PY bench/bench_gpu.py --device CUDA
    else step bench_gpu 60 env DEV=CUDA $PY bench/bench_gpu.py; fi
else echo "=== bench_gpu: bench/bench_gpu.py isn't there"; fi
echo "=== check.sh: $([ $status -eq 0 ] && echo passed || echo FAILED)"
exit $status
