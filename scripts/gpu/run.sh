#!/usr/bin/env bash
# GPU runs in one command each, for a machine with one Hopper GPU (the results go to $OUT,
# default /tmp/sfi_gpu):
#   bash scripts/gpu/run.sh suite      every test marked gpu, compiled (benchmarks/gpu_tests.md)
#   bash scripts/gpu/run.sh wheels     (on this side) the wheels the GPU machine lacks, into .whl
#   bash scripts/gpu/run.sh prefill    the prefill kernels against cuDNN at Qwen3-4B's heads, then
#                                      Qwen3-0.6B's (GQA 2) (benchmarks/prefill_kernel.md)
#   bash scripts/gpu/run.sh decode     Triton against the Mosaic GPU decode twins (kernels.md)
#   bash scripts/gpu/run.sh moe [batch] the MoE twin against the Triton "tokens" kernels, alone and
#                                      in qwen3-30b-a3b's decode (32K)
#   bash scripts/gpu/run.sh ttft [impl]  time to first token, qwen3-4b at 32K and 130816, the
#                                      default prefill (and --prefill-attention impl), then
#                                      the transformers + SDPA peer (benchmarks/prefill.md)
#   bash scripts/gpu/run.sh serve128 [sfi|dense] [slots] [new tokens]
#                                      a decode-heavy 128K serving load (benchmarks/serve.md)
#   bash scripts/gpu/run.sh serve32 [sfi|dense] [slots] [new tokens]
#                                      as many 32K requests as slots, sent at 4/s (throughput
#                                      at equal p99 inter-token latency: benchmarks/serve.md)
#   bash scripts/gpu/run.sh notriton [contexts] [batch] [arms]
#                                      decode with the choices "auto" makes on a jax without the
#                                      Triton lowering, beside the defaults (qwen3-4b; findings.md);
#                                      arms: defaults, no_triton, no_triton_xla (XLA matmuls),
#                                      no_triton_nopdl (no dependent launch),
#                                      no_triton_fused (the Mosaic matmul's epilogues fused),
#                                      no_triton_zf, no_triton_fused_zf (rows unpadded: TMA's
#                                      zero fill, KernelTuning.zero_fill),
#                                      triton_topk (the top-k's Triton kernel, not its twin),
#                                      no_triton_heads (the heads' Mosaic GPU twin),
#                                      no_triton_scores (the selector scores' twin),
#                                      no_triton_repack (the repack's twin),
#                                      mosaic_attention, xla_matmul, xla_small (one at a time);
#                                      mosaic_attention_ks (and the sparse read's own new-token
#                                      stores), mosaic_attention_ks_zf (and unpadded queries);
#                                      ARM@BK:STAGES:PER_SM[:r]: ARM with that Mosaic sparse
#                                      config (r: P·V from registers); MODEL=qwen3-0.6b for
#                                      another model
#   bash scripts/gpu/run.sh profile [arms]  the kernels of SFI decode steps, qwen3-4b 32K batch 1,
#                                      per arm (as notriton's; default: defaults mosaic_attention
#                                      no_triton): each kernel's us and launches a step
#   bash scripts/gpu/run.sh fused      the Mosaic matmul's fused epilogues compiled: their tests, the
#                                      kernels fused against unfused (qwen3-4b, 1 and 4 rows), then
#                                      decode at 32K batch 1 without Triton, fused and not, rows
#                                      padded and not
#                                      (benchmarks/mosaic_ab.json, skinny_matmul.md)
#   bash scripts/gpu/run.sh sparse [configs]  the sparse read, Triton against Mosaic GPU configs
#                                      (bench_kernels.py --sparse-configs), at a
#                                      qwen3-4b batch-1 fast step's shape (32K, 2308 keys) and at
#                                      batch 16 (16K, 1.56-12.5 %) (benchmarks/kernels.md)
#   bash scripts/gpu/run.sh waves      the dense read (with and without logits) and the verify kernel
#                                      at batch 1, Triton against Mosaic GPU configs of one wave
#                                      of CTAs (and P·V from registers) beside the defaults; the
#                                      sparse read at batch 32 (one split: no merge after it)
#   bash scripts/gpu/run.sh splits [batches]  the Mosaic dense and sparse reads' defaults (splits
#                                      planned by each SM's load) against Triton and the
#                                      defaults before them, at batch 1, 6, 10 and 16
#   bash scripts/gpu/run.sh verify [batches]  the same for the verify kernel (batch 1 and 6)
#   bash scripts/gpu/run.sh topk [batch] the top-k's radix search, Triton against its Mosaic GPU twin
#                                      (224 x 32K and 288 x 128K rows; the twin's copy size and
#                                      stages swept), then qwen3-0.6b decode at
#                                      32K with the twin (the default) and with Triton's kernel
#   bash scripts/gpu/run.sh scores     the selector's steps 1-4: jnp, Triton and the Mosaic GPU twin
#                                      (one refreshed row of qwen3-4b at 128K), then decode at
#                                      128K batch 1 without Triton, with and without the twin
#                                      (and the repack's twin)
#   bash scripts/gpu/run.sh cost [contexts] [batches]
#                                      the default warm-up and selection memory's decode cost
#                                      (bench_e2e with and without them; benchmarks/retrieval.md)
# An offline machine installs the wheels in ./.whl first (the serve extra's packages and the
# tests' openai client, for Python 3.12, their needs included): fetch them on a machine with
# pip's index by `bash scripts/gpu/run.sh wheels`, then carry .whl.
set -o pipefail
if [ "$1" = wheels ]; then  # (here, not on the GPU machine)
  rm -rf .whl && python3 -m pip download -q --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "fastapi>=0.110" "uvicorn>=0.29" \
    "prometheus-client>=0.20" openai && ls .whl
  exit
fi
OUT=${OUT:-/tmp/sfi_gpu}; mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl >/dev/null 2>&1 && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
export PYTHONPATH=$PWD:$PYTHONPATH XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
git log --oneline -1 2>/dev/null || true
# the bench_e2e options of a named arm (into the array `extra`): the choices "auto" makes on a
# jax without the Triton lowering, or one of them at a time beside the defaults' others
arm_opts() {
  if [[ "$1" == *@* ]]; then  # ARM@config: ARM's options and that Mosaic sparse config
    arm_opts "${1%@*}"; extra+=(--sparse-config "mosaic:${1#*@}"); return
  fi
  local no_triton=(--opt attention=mosaic_gpu --opt selector_scores=xla
                   --opt selector_topk=radix_mosaic_gpu
                   --opt moe=mosaic_gpu --opt heads=xla --opt repack=xla
                   --opt matmul=mosaic_by_shape --opt epilogue=xla)
  case "$1" in
    defaults) extra=() ;;
    no_triton) extra=("${no_triton[@]}") ;;
    no_triton_xla) extra=("${no_triton[@]}" --opt matmul=xla) ;;  # XLA's matmuls (before 12-06)
    # without programmatic dependent launch (the Mosaic matmul's early weight fetches)
    no_triton_nopdl) extra=("${no_triton[@]}" --no-launch-dependents) ;;
    # the Mosaic kernels' rows unpadded (TMA's zero fill), with and without the fused epilogues
    no_triton_zf) extra=("${no_triton[@]}" --zero-fill) ;;
    no_triton_fused_zf) extra=("${no_triton[@]}" --opt epilogue=fused --zero-fill) ;;
    # the Mosaic matmul's residual and SiLU epilogues in its kernel
    no_triton_fused) extra=("${no_triton[@]}" --opt epilogue=fused) ;;
    # the repack's gather in its Mosaic GPU twin (one TMA copy per position) instead of XLA's
    no_triton_repack) extra=("${no_triton[@]}" --opt repack=mosaic_gpu) ;;
    # the selector's steps 1-4 in their Mosaic GPU twin instead of jnp
    no_triton_scores) extra=("${no_triton[@]}" --opt selector_scores=mosaic_gpu) ;;
    # the heads' norm + rope in one Mosaic GPU launch (heads_mgpu) instead of XLA's fusions
    no_triton_heads) extra=("${no_triton[@]}" --opt heads=mosaic_gpu) ;;
    # the top-k's radix searches in the Triton kernel (the default: its Mosaic GPU twin)
    triton_topk) extra=(--opt selector_topk=radix_kernel) ;;
    mosaic_attention) extra=(--opt attention=mosaic_gpu) ;;
    # and the sparse read's own new-token stores; and its query groups unpadded too
    mosaic_attention_ks) extra=(--opt attention=mosaic_gpu --kernel-stores) ;;
    mosaic_attention_ks_zf) extra=(--opt attention=mosaic_gpu --kernel-stores --zero-fill) ;;
    xla_matmul) extra=(--opt matmul=xla --opt epilogue=xla) ;;
    xla_small) extra=(--opt selector_scores=xla --opt selector_topk=radix --opt heads=xla
                      --opt repack=xla) ;;
    *) echo "unknown arm $1" >&2; extra=() ;;
  esac
}
case "$1" in
  suite)
    timeout 480 python -m pytest -o addopts= -n 8 -ra -m gpu -q 2>&1 | tee "$OUT/gpu_suite.log" | tail -30 ;;
  prefill)
    for heads in 32:8:128 16:8:128; do
      timeout 250 python scripts/bench/bench_prefill_kernel.py --out "$OUT/prefill_kernel_$heads.json" \
        --heads $heads --chunks 8192 16384 --contexts 32768 131072 --full 8192 \
        --configs 128:128:8:3 2>&1 | grep -v "^{" | tail -3
      python - "$OUT/prefill_kernel_$heads.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
print(d["meta"]["shapes"])
print(f"{'kind':34s} {'T':>6s} {'offset':>7s} {'ms':>8s} {'TFLOP/s':>8s}")
for r in d["rows"]:
    if "ms" in r:
        name = r["kind"] + ("" if "config" not in r else "/" + "/".join(map(str, r["config"].values())))
        print(f"{name:34s} {r['t']:6d} {r['offset']:7d} {r['ms']:8.2f} {r['tflops']:8.0f}")
PY
    done ;;
  decode)
    timeout 300 python scripts/bench/bench_kernels.py --ab-mosaic --out "$OUT" 2>&1 | tail -8
    timeout 200 python scripts/bench/bench_multi_query_kernel.py --mosaic --out "$OUT/mq_ab.json" 2>&1 \
      | grep "mosaic/triton" ;;
  moe)
    timeout 150 python scripts/diag/diag_moe_kernel.py --tokens 1,16 --configs 128x64x4x3 \
      --mosaic 128x64x4,64x64x4,128x128x2 --out "$OUT/moe_ab.json" 2>&1 | tail -12
    for moe in tokens mosaic_gpu; do
      timeout 200 python scripts/bench/bench_e2e.py --models qwen3-30b-a3b --contexts 32768 \
        --batch "${2:-1}" --new-tokens 64 --no-check --opt moe=$moe --out "$OUT/moe_e2e_$moe" \
        2>&1 | grep "^| qwen" | tail -1
    done ;;
  ttft)
    for impl in auto ${2:-}; do
      timeout 250 python scripts/bench/bench_prefill.py --models qwen3-4b --contexts 32768,130816 \
        --batches 1 --parts warm --prefill-attention "$impl" --out "$OUT/ttft_$impl" 2>&1 | tail -4
    done
    timeout 250 python scripts/bench/bench_prefill.py --models "" --parts hf --request-models qwen3-4b \
      --request-contexts 32768,130816 --new-tokens 1 --out "$OUT/ttft_hf" 2>&1 | tail -4 ;;
  serve128)
    E=${2:-sfi}; S=${3:-6}; N=${4:-8192}
    timeout 580 python scripts/bench/bench_serve.py --model qwen3-4b --engines "$E" --rates 8 \
      --requests "$S" --prompt-lens 114688 --output-lens "$N" --max-seconds 450 \
      --start-timeout 240 --server-arg=--max-slots="$S" --server-arg=--max-len=131072 \
      --server-arg=--memory-fraction=0.95 --out "$OUT/serve128_$E" 2>&1 | tail -5 ;;
  serve32)
    E=${2:-sfi}; S=${3:-16}; N=${4:-8192}
    timeout 580 python scripts/bench/bench_serve.py --model qwen3-4b --engines "$E" --rates 4 \
      --requests "$S" --prompt-lens 32768 --output-lens "$N" --token-range 100:150000 \
      --max-seconds 400 --start-timeout 240 --server-arg=--max-slots="$S" \
      --server-arg=--max-len=$((32768 + N)) --server-arg=--memory-fraction=0.95 \
      --out "$OUT/serve32_${E}_$S" 2>&1 | tail -5 ;;
  cost)
    for ctx in ${2:-32768 131072}; do for b in ${3:-1 16}; do
      for arm in defaults bare; do
        extra=(); [ "$arm" = bare ] && extra=(--sfi warmup_steps=0 --sfi selection_memory=none)
        timeout 200 python scripts/bench/bench_e2e.py --models qwen3-4b --contexts "$ctx" \
          --batch "$b" --new-tokens 128 --no-check "${extra[@]}" --out "$OUT/cost_${ctx}_${b}_$arm" \
          2>&1 | grep "^| qwen" | tail -2
      done
    done; done ;;
  fused)
    timeout 170 python -m pytest -o addopts= -p no:xdist -q -ra -m gpu \
      tests/kernels/test_skinny_matmul_mgpu.py tests/kernels/test_kernels.py::test_mosaic_zero_fill_matches_reference \
      tests/runtime/test_gpu_engine.py::test_mosaic_gpu_matmuls_in_generate 2>&1 \
      | tee "$OUT/fused_tests.log" | tail -15
    timeout 150 python scripts/diag/diag_mgpu_matmul.py --epilogues --models qwen3-4b --rows 1,4 \
      --reps 20 --out "$OUT/fused_ab.json" 2>&1 | tail -20
    bash "$0" notriton 32768 1 "no_triton_fused no_triton no_triton_zf no_triton_fused_zf" ;;
  scores)
    timeout 300 python scripts/bench/bench_selector_kernels.py --mosaic --out "$OUT/scores" 2>&1 \
      | tail -24
    bash "$0" notriton 131072 1 "no_triton no_triton_scores no_triton_repack" ;;
  sparse)
    cfgs=${2:-64:3:264,64:3:264:r,64:2:264:r,64:2:132:r,64:3:132:r,64:1:528:r}
    timeout 200 python scripts/bench/bench_kernels.py --ab-mosaic --sparse-only --batch 1 \
      --sparse-kv 32768 --retention 7.04 --sparse-configs $cfgs --out "$OUT/sparse_b1" 2>&1 \
      | grep -v "^check"
    timeout 250 python scripts/bench/bench_kernels.py --ab-mosaic --sparse-only --batch 16 \
      --retention 1.5625 6.25 12.5 --sparse-configs $cfgs --out "$OUT/sparse_b16" 2>&1 \
      | grep -v "^check" ;;
  waves)
    timeout 150 python scripts/bench/bench_kernels.py --ab-mosaic --dense-only --batch 1 \
      --kv 32768 131072 --dense-configs 128:2:132,128:2:132:r,64:2:264:r,64:2:132:r,64:3:132:r \
      --out "$OUT/dense_b1" 2>&1 | grep -v "^check" | tail -16
    # one split a row and head (batch 32): the kernel writes the output, no merge after it
    timeout 100 python scripts/bench/bench_kernels.py --ab-mosaic --sparse-only --batch 32 \
      --retention 1.5625 6.25 --sparse-configs 64:2:132:r,64:2:264:r --out "$OUT/sparse_b32" \
      2>&1 | grep "ratio"
    timeout 120 python scripts/bench/bench_multi_query_kernel.py --mosaic --batches 1 \
      --contexts 32768 --queries 1 4 8 --mosaic-configs 128:2:132 64:2:264:r 64:2:132:r \
      64:3:132:r --out "$OUT/mq_b1.json" 2>&1 | grep "mosaic" ;;
  splits)
    # the defaults (splits planned by each SM's load) against Triton and the defaults before
    # them (dense 128:2:264, with logits 64:3:264; sparse 64:2:132:r), mid batches included
    for b in ${2:-1 6 10 16}; do
      timeout 150 python scripts/bench/bench_kernels.py --ab-mosaic --dense-only --batch $b \
        --kv 32768 131072 --dense-configs 128:2:264,64:3:264 --out "$OUT/dense_plan_b$b" 2>&1 \
        | grep -v "^check" | tail -3
      timeout 100 python scripts/bench/bench_kernels.py --ab-mosaic --sparse-only --batch $b \
        --retention 1.5625 6.25 --sparse-configs 64:2:132:r --out "$OUT/sparse_plan_b$b" \
        2>&1 | grep "ratio"
    done ;;
  verify)  # the verify kernel's defaults against Triton and the defaults before them
    timeout 400 python scripts/bench/bench_multi_query_kernel.py --mosaic --batches ${2:-1 6} \
      --contexts 32768 131072 --queries 1 4 8 --mosaic-configs 128:2:264 64:3:264 \
      --out "$OUT/mq_plan.json" 2>&1 | grep "mosaic" ;;
  topk)
    timeout 240 python scripts/bench/bench_selector.py --cases 224x32768,288x131072 --no-select \
      --impls lax,radix/4,radix_kernel/2,radix_mosaic_gpu/2 \
      --kth-configs 0:3,8192:3,8192:4,16384:2 --json "$OUT/topk_ab.json" 2>&1 | tail -20
    MODEL=qwen3-0.6b bash "$0" notriton 32768 "${2:-16}" "defaults triton_topk" ;;
  notriton)
    for ctx in ${2:-32768 131072}; do
      for arm in ${4:-defaults no_triton}; do
        arm_opts "$arm"; dir="$OUT/notriton_${MODEL:-qwen3-4b}_${ctx}_${3:-1}_${arm//[@:]/_}"
        timeout 200 python scripts/bench/bench_e2e.py --models "${MODEL:-qwen3-4b}" --contexts "$ctx" \
          --batch "${3:-1}" --new-tokens 128 --no-check "${extra[@]}" \
          --out "$dir" 2>&1 | grep "^| qwen" | tail -2
        rm -f "$dir"/e2e.{md,png}  # (a call returns a few files: JSON only)
      done
    done ;;
  profile)
    for arm in ${2:-defaults mosaic_attention no_triton}; do
      arm_opts "$arm"; dir="$OUT/profile_${arm//[@:]/_}"
      timeout 200 python scripts/bench/bench_e2e.py --models qwen3-4b --contexts 32768 --batch 1 \
        --new-tokens 64 --no-check --profile "${extra[@]}" --out "$dir" 2>&1 \
        | grep "^| qwen" | tail -1
      rm -f "$dir"/e2e.{md,png}  # (a call returns a few files: JSON only)
      python - "$dir/e2e.json" "$arm" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    p = r.get("sfi_profile") or {}
    print(f"== {sys.argv[2]}: busy {p.get('busy_ms_per_step', 0):.3f} ms/step, "
          f"{p.get('kernels_per_step', 0):.1f} kernels/step")
    src = p.get("sources", {})
    for name, us, n in p.get("top_us_per_step", []):
        where = (src.get(name) or {}).get("sources") or [""]
        print(f"{us:8.1f} us {n:6.2f}x  {name:34s} {where[0][-60:]}")
PY
    done ;;
  *) echo "usage: bash scripts/gpu/run.sh wheels|suite|prefill|decode|sparse|waves|splits|verify|moe|ttft|serve128|serve32|fused|topk|scores|notriton|profile|cost" >&2; exit 2 ;;
esac
