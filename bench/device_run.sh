#!/bin/bash
# Issue 37's GPU figures still to measure, as one device call that fits its limit:
#
#   bash bench/device_run.sh SECONDS STEP...      e.g.  bash bench/device_run.sh 580 decode prefill quant_decode
#   bash bench/device_run.sh 580 goals            # every speed goal side by side, one call (issue 58)
#
# Steps run in the order given, each while time is left (a step started with
# too little time is skipped, one that runs out is stopped: its log says so).
# Wheels under .whl/ (hydra-core, omegaconf, antlr4, transformers, torchao,
# jsonschema and its needs: docs/development.md) are installed first when
# present. Where $OUT is set (the device tool) the log and a tarball of the
# results the steps wrote go there, two files whatever the steps.
set -u
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
# g++-12 whatever the image sets: packages built with its default g++ segfault when loaded
export CXX=g++-12 PYTHONUNBUFFERED=1
out=${OUT:-bench/results}
log=$out/device_run.log
marker=$(mktemp)
total=$1
shift
{ nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
  python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  python3 -c "from flashrt_build.stages import pdl; print('pdl: launcher known:', pdl.launcher_known())"; } > "$log" 2>&1
bench=(python3 bench/causal_lm.py --work /tmp/w --no-cpp)
# results named by the card (h100, h200): a run on one kind never overwrites the other's
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
tag=$(case $gpu in *H200*) echo h200 ;; *H100*) echo h100 ;; *) echo gpu ;; esac)
# goals: every speed goal of issue 58 in one call, as two steps (decode, then prefill), each stopped at what is left
steps=()
for step in "$@"; do
  case $step in goals) steps+=(goals_decode goals_prefill) ;; *) steps+=("$step") ;; esac
done
for step in "${steps[@]}"; do
  case $step in
    goals_decode)  # the shipped bf16 step (passes=llm) against transformers + reduce-overhead, int8_wo and int4_wo beside it
      cmd=("${bench[@]}" --only decode --passes llm --jobs 3 --out-name causal_lm_goals_decode_$tag
           --variant "int8:passes=llm quant=int8_wo quant.max_rel_error=1"
           --variant "int4:passes=llm quant=int4_wo quant.max_rel_error=1") ;;
    goals_prefill)  # int8_wo prefill 512 against bf16's (both passes=llm)
      cmd=("${bench[@]}" --only prefill --passes llm --no-baseline --jobs 2 --out-name causal_lm_goals_prefill_$tag
           --variant "int8:passes=llm quant=int8_wo quant.max_rel_error=1") ;;
    decode)  # the decode goal: passes none and llm (the GEMV, the attention kernel and decode's combo kernels on), llm without the GEMV, without combo kernels
      cmd=("${bench[@]}" --only decode --passes none,llm --variant "no_gemv:passes=llm passes.gemv=false"
           --variant "no_combo:passes=llm passes.combo_kernels=false"
           --no-baseline --jobs 4 --out-name causal_lm_decode_passes_$tag) ;;
    decode_baseline)  # the shipped llm package against transformers + reduce-overhead (after decode: its build reused)
      cmd=("${bench[@]}" --only decode --passes llm --jobs 1 --out-name causal_lm_decode_baseline_$tag) ;;
    prefill)  # prefill 512 with and without the passes
      cmd=("${bench[@]}" --only prefill --passes none,llm --no-baseline --jobs 2 --out-name causal_lm_prefill_passes_$tag) ;;
    quant_decode)  # int8 and int4 weight-only against bf16 (random weights: the verification bound raised)
      cmd=("${bench[@]}" --only decode --passes llm --no-baseline --jobs 3 --out-name causal_lm_quant_decode_$tag
           --variant "int8:passes=llm quant=int8_wo quant.max_rel_error=1"
           --variant "int4:passes=llm quant=int4_wo quant.max_rel_error=1") ;;
    int8_decode)  # int8 weight-only against bf16 (quant_decode without int4), and with the lm_head int8 too (int8_wo
      # keeps it bf16: a third of the int8 step's bytes, which keep it above 0.61x bf16's by bytes alone)
      cmd=("${bench[@]}" --only decode --passes llm --no-baseline --jobs 3 --out-name causal_lm_int8_decode_$tag
           --variant "int8:passes=llm quant=int8_wo quant.max_rel_error=1"
           --variant "int8_head:passes=llm quant=int8_wo quant.max_rel_error=1 quant.rules=[{pattern:'*',config:Int8WeightOnlyConfig}]") ;;
    quant_prefill)  # int8 prefill: weight-only against int8_dq_prefill, against bf16 (dq: random weights carry the flips
      # of its activations' int8 rounding through every layer, 0.10 from the quantized module on an H100: held to it at 0.2)
      cmd=("${bench[@]}" --only prefill --passes llm --no-baseline --jobs 3 --out-name causal_lm_quant_prefill_$tag
           --variant "int8:passes=llm quant=int8_wo quant.max_rel_error=1"
           --variant "dq:passes=llm quant=int8_dq_prefill quant.max_rel_error=1 verify.rtol=0.2 verify.atol=1") ;;
    quant_prefill_tuned)  # int8_wo prefill with Triton's GEMM templates for prefill, whose prologue can take the int8 -> bf16 convert (no bf16 copy of each weight), against int8_wo and bf16
      cmd=("${bench[@]}" --only prefill --passes llm --no-baseline --jobs 3 --out-name causal_lm_quant_prefill_tuned_$tag
           --variant "int8:passes=llm quant=int8_wo quant.max_rel_error=1"
           --variant "int8_tuned:passes=llm quant=int8_wo quant.max_rel_error=1 +inductor.methods.prefill.max_autotune_gemm=true +inductor.methods.prefill.max_autotune_gemm_backends=TRITON") ;;
    attention_probe)  # the decode attention kernel alone, split + merge against one kernel (its last program of a KV head merges), compiled into packages
      cmd=(python3 bench/decode_attention_probe.py) ;;
    gemv)  # cuBLAS against a Triton GEMV at the decode step's shapes
      cmd=(python3 bench/gemv_probe.py --block-n 2,4,8,16 --block-k 256,512,1024 --split-k 1,2,4 --warps 4,8) ;;
    words)  # a plain bf16 GEMV widening its weights by element (as the shipped kernel does) against as 32-bit words
      cmd=(python3 bench/gemv_words_probe.py) ;;
    dot)  # bf16, int8 and int4 GEMVs on tensor cores, loads pipelined through shared memory, against the shipped kernel and tinygemm
      cmd=(python3 bench/gemv_dot_probe.py) ;;
    int8_launches)  # the int8 GEMV chain at launches of one or two 16-byte loads a row a thread, the lm_head at bf16's
      # launch (as a package launches it), and the bf16 and int8 layers without the lm_head
      cmd=(python3 bench/gemv_fusion_probe.py --int8-launches) ;;
    fusion)  # the GEMV's configurations on this GPU, and its neighbours (norm, SiLU, residual add) fused in
      cmd=(python3 bench/gemv_fusion_probe.py) ;;
    code)  # the decode step's generated code (2 layers at Llama-3.2-1B's width, passes=llm): which kernels, from what
      cmd=(bash -c "python3 -c 'import sys, torch; from pathlib import Path; sys.path.insert(0, \"bench\"); \
from causal_lm import save_model; save_model(Path(\"/tmp/w2/model\"), \"layers=2,hidden=2048,heads=32,kv_heads=8,mlp=8192,vocab=128256\", torch.bfloat16)' \
&& TORCH_LOGS=output_code python3 -m flashrt_build +module=causal_lm module.pretrained=/tmp/w2/model module.max_cache_len=1024 \
module.max_prompt=512 target=cuda weights=external '~module.methods.prefill' passes=llm output_root=/tmp/w2/out 2> $out/decode_code.log") ;;
    dq_small)  # int8_dq_prefill on a 2-layer model at Llama-3.2-1B's width: does its prefill package run (it refused a prompt of 8 once)
      cmd=(bash -c "python3 -c 'import sys, torch; from pathlib import Path; sys.path.insert(0, \"bench\"); \
from causal_lm import save_model; save_model(Path(\"/tmp/w3/model\"), \"layers=2,hidden=2048,heads=32,kv_heads=8,mlp=8192,vocab=128256\", torch.bfloat16)' \
&& python3 -m flashrt_build +module=causal_lm module.pretrained=/tmp/w3/model module.max_cache_len=1024 \
module.max_prompt=512 target=cuda weights=external '~module.methods.decode' passes=llm quant=int8_dq_prefill quant.max_rel_error=1 \
output_root=/tmp/w3/out hydra.verbose=flashrt_build.stages.verify") ;;
    fused_configs)  # the fused GEMVs (norm, gate, residual in the kernel) at more rows a program: each program reads all of x
      cmd=(python3 bench/gemv_fusion_probe.py --fused-only --block-n 2,4,8,16 --block-k 512,1024 --warps 4,8 --stages 1) ;;
    pdl_probe)  # a decode step's GEMV chain with and without programmatic dependent launch (the pdl pass's)
      cmd=(python3 bench/gemv_fusion_probe.py --pdl-only) ;;
    decode_fusion)  # passes=llm with and without gemv_fusion (the norms, SiLU gates and residual adds in the GEMVs)
      cmd=("${bench[@]}" --only decode --passes llm --variant "no_fusion:passes=llm passes.gemv_fusion=false"
           --no-baseline --jobs 2 --out-name causal_lm_decode_fusion_$tag) ;;
    decode_pdl)  # passes=llm against it without pdl (its kernels launched as programmatic dependents)
      cmd=("${bench[@]}" --only decode --passes llm --variant "no_pdl:passes=llm passes.pdl=false"
           --no-baseline --jobs 2 --out-name causal_lm_decode_pdl_$tag) ;;
    decode_rotary)  # passes=llm with rotary_fusion (q's rotary in the attention kernel; off in llm) against it
      cmd=("${bench[@]}" --only decode --passes llm --variant "rotary:passes=llm passes.rotary_fusion=true"
           --no-baseline --jobs 2 --out-name causal_lm_decode_rotary_$tag) ;;
    decode_levers)  # passes=llm against it without pdl, with rotary_fusion, and both of those
      cmd=("${bench[@]}" --only decode --passes llm --variant "no_pdl:passes=llm passes.pdl=false"
           --variant "rotary:passes=llm passes.rotary_fusion=true"
           --variant "rotary_no_pdl:passes=llm passes.rotary_fusion=true passes.pdl=false"
           --no-baseline --jobs 4 --out-name causal_lm_decode_levers_$tag) ;;
    decode_one_kernel)  # passes=llm against it with one_kernel_attention (the attention one kernel a layer, not split + merge: 114 kernels a step -> 98)
      cmd=("${bench[@]}" --only decode --passes llm --variant "one_kernel:passes=llm passes.one_kernel_attention=true"
           --no-baseline --jobs 2 --out-name causal_lm_decode_one_kernel_$tag) ;;
    decode_goal)  # the decode goal in one call: passes=llm, it with one_kernel_attention, and transformers + reduce-overhead
      cmd=("${bench[@]}" --only decode --passes llm --variant "one_kernel:passes=llm passes.one_kernel_attention=true"
           --jobs 2 --out-name causal_lm_decode_goal_$tag) ;;
    decode_quick)  # the decode goal's package alone (passes=llm, one build, no transformers): for a short call
      cmd=("${bench[@]}" --only decode --passes llm --no-baseline --out-name causal_lm_decode_quick_$tag) ;;
    decode_attention)  # passes=llm with and without its attention kernel
      cmd=("${bench[@]}" --only decode --passes llm --variant "no_attn:passes=llm passes.decode_attention=false"
           --no-baseline --jobs 2 --out-name causal_lm_decode_attention_$tag) ;;
    pytest)  # the GPU suite, or the tests PYTEST_ARGS names
      cmd=(python3 -m pytest -q -p no:cacheprovider -m gpu ${PYTEST_ARGS:-tests/}) ;;
    *) echo "== unknown step $step" >> "$log"; continue ;;
  esac
  left=$((total - SECONDS - 10))
  if [ "$left" -lt 60 ]; then echo "== $step skipped: $left s left" >> "$log"; continue; fi
  echo "== $step (${left} s left): ${cmd[*]}" >> "$log"
  timeout "$left" "${cmd[@]}" >> "$log" 2>&1
  echo "== $step rc=$?" >> "$log"
  if [ -n "${OUT:-}" ]; then
    find bench/results -newer "$marker" -type f -print0 | tar -cf "$OUT/results.tar" --null -T -
  fi
done
grep "^== " "$log"
