#!/usr/bin/env bash
# Re-measure on the GPU what the last CPU-only changes have not been through (one device call
# per phase: each stays under the device tool's 10-minute limit).
#
#   bash scripts/gpu_verify.sh decode    OUT   # decode check (bf16/fp16 vs float64, graphs) + full decode suite
#   bash scripts/gpu_verify.sh mlp       OUT   # fused FFN check + stress + full mlp suite (auto's crossover rule,
#                                              # the decode kernel's stagger / PDL cast through fused_mlp)
#   bash scripts/gpu_verify.sh crossover OUT   # split-K vs persistent for M = 8..128, all three FFNs
#   bash scripts/gpu_verify.sh ncu       OUT   # DRAM bytes per FFN policy (then, on the CPU:
#                                              # python scripts/mlp_ncu_model.py OUT/mlp-*.json)
#   bash scripts/gpu_verify.sh decode-pdl OUT  # decode launched programmatically dependent, and the wide
#                                              # split merge: their correctness cases, then steps and a layer
#                                              # timed: off / pdl / wide / wide+pdl
#   bash scripts/gpu_verify.sh decode-splits OUT  # batch-1 splits x tiles again, paged after its fix: is
#                                              # 128-token tiles / 8 splits (best at 1x16k in the last sweep,
#                                              # +3% over the shipped 64 / 16) also right for paged caches?
#                                              # MERGE=wide: the same sweep with the wide split merge
#   bash scripts/gpu_verify.sh ffn-group OUT   # decode FFN with 2-8 slices' partials summed on chip
#                                              # (fewer fp32 adds: M = 16's cost over M = 1) vs the default
#   bash scripts/gpu_verify.sh mlp-small OUT   # few row-blocks (M = 64..256): the non-gated 128x128 tiles now
#                                              # shipped against the 128x256 ones, and 64-row / 64-wide tiles
#
# Outputs (JSON) go to OUT; copy them to bench/results/ and re-render the tables with
# `python scripts/results_md.py --write docs/results.md`.
set -euo pipefail
phase=${1:?phase: decode | decode-pdl | decode-splits | ffn-group | mlp | crossover | ncu | mlp-small}
out=${2:?output directory}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,power.draw --format=csv
case "$phase" in
  decode)
    timeout 200 python scripts/gpu_decode_check.py --json "$out/gpu-decode-check-h100.json" | tail -15
    timeout 380 python -m flashflow.cli bench --suite decode --out "$out" 2>/dev/null | tail -80
    ;;
  decode-pdl)
    timeout 120 python scripts/gpu_decode_check.py --cases pdl --json "$out/gpu-decode-check-pdl-h100.json" | tail -10 || echo "PDL / wide-merge check FAILED"
    timeout 450 python scripts/tune_decode_pdl.py --json "$out/tune-decode-pdl-h100.json" | tail -30
    ;;
  decode-splits)
    timeout 570 python scripts/tune_decode_splits.py --set small --merge "${MERGE:-rows}" \
        --json "$out/tune-decode-small-h100-${MERGE:-rows}-merge.json" | tail -8
    ;;
  ffn-group)
    timeout 570 python scripts/tune_ffn.py --variants default,g2,g4n32,g4n64,g8n16 --rounds 3 \
        --json "$out/tune-ffn-decode-group-h100.json" | grep -v '^PASS' | tail -40
    ;;
  mlp)
    timeout 560 python scripts/gpu_mlp.py --phases check,stress,bench --out "$out" | grep -v '^PASS' | tail -70
    ;;
  crossover)
    timeout 560 python scripts/tune_mlp_crossover.py --out "$out/tune-mlp-crossover-h100.json"
    ;;
  ncu)
    timeout 560 python scripts/gpu_mlp.py --phases ncu --out "$out" | tail -25
    ;;
  mlp-small)
    v=gelu/auto,gelu/tma3b256:halfrow,gelu/tma3b256:seqsplit:8,gelu/tma4:halfrow,gelu/tma4:seqsplit:8
    v=$v,gelu/tma4n64:seqsplit:8,gelu/tma5m64:halfrow,gelu/tma5m64:seqsplit:8,gelu/tma5m64n64:seqsplit:8
    v=$v,gelu/tma4m64w4:seqsplit:8,gelu/tma4m64n64w4:seqsplit:8
    v=$v,auto,tma4:seqsplit:8,tma5m64:seqsplit:8,tma5m64n64:seqsplit:8
    timeout 560 python scripts/tune_mlp_prefill.py --variants "$v" --tokens 64,128,256 --rounds 3 \
        --no-stress --out "$out" | tail -60
    ;;
  *)
    echo "unknown phase $phase (decode | decode-pdl | decode-splits | ffn-group | mlp | crossover | ncu | mlp-small)" >&2
    exit 2
    ;;
esac
