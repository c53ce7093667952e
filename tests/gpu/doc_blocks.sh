#!/usr/bin/env bash
# Every code block of README.md and docs/, GPU blocks included (the fences
# marked gpu-cuda: docs/cuda.md, events.md, pools.md, bundles.md), on the
# device machine:
#
#   bash tests/gpu/doc_blocks.sh
#
# Builds the library into build-gpu (as tests/gpu/run.sh; USMIPC_BUILD_DIR
# names another), installs the package into python3, then runs
# tests/python/test_doc_blocks.py with USMIPC_DOC_GPU=1. Needs torch (the
# device image has it) and no network. Each block runs in fresh processes.
set -eu
cd "$(dirname "$0")/../.."
export USMIPC_BUILD_DIR=${USMIPC_BUILD_DIR:-build-gpu}
# Never use NVLink multicast on the shared machines (device README).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
cmake -S . -B "$USMIPC_BUILD_DIR" -DUSMIPC_WERROR=ON > /dev/null
cmake --build "$USMIPC_BUILD_DIR" -j "$(nproc)" > /dev/null
python3 -m pip install -q --no-build-isolation --no-index --no-deps .
USMIPC_DOC_GPU=1 python3 -m pytest -v -rs tests/python/test_doc_blocks.py
