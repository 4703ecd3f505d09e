#!/usr/bin/env bash
# GPU check of the CuPy backend alone: the machine header, then kernel cache warm-up,
# tests/gpu/test_cupy_gpu.py and a short parity-gated benchmark, logs under $OUT/cupy (else
# ./gpu_check_out/cupy). The steps, limits and summary are those of `scripts/gpu_check.sh --cupy`.
exec bash "$(dirname "${BASH_SOURCE[0]}")/gpu_check.sh" --cupy "$@"
