#!/usr/bin/env bash
# One device session's runs, in calls of at most 10 minutes (the device tool's limit), each
# writing its tables and logs under $OUT. Usage: bash bench/device_session.sh PHASE (see the case below)
# Every step has its own time limit so a slow one cannot take the rest of the call with it.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
step() {  # step LIMIT_S NAME CMD...: run, tee its log, note its exit code and seconds
  local limit=$1 name=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
  echo "== $name rc=${PIPESTATUS[0]} ${SECONDS}s-${t0}s" | tee -a "$OUT/steps.txt"
}
side_by_side() {  # this tree's engine stages and fused engine step against the copy in $OLD_KERNELS
  # (an earlier commit's kernels/, bench/ and trainer/: its scripts put that copy first on sys.path)
  local old=${OLD_KERNELS:-.device/ab_old}
  step 140 stages_new python3 bench/lora_op.py --engine-stages --out "$OUT/engine_stages_new_h100.md"
  PYTHONPATH=$PWD step 130 stages_old python3 "$old/bench/lora_op.py" --engine-stages --out "$OUT/engine_stages_old_h100.md"
  step 120 engine_new python3 bench/engine_step.py --jobs 8 --skip-peft --skip-torch --forms fused \
    --out "$OUT/engine_step_new_h100.md"
  PYTHONPATH=$PWD step 110 engine_old python3 "$old/bench/engine_step.py" --jobs 8 --skip-peft --skip-torch \
    --forms fused --out "$OUT/engine_step_old_h100.md"
}
search_rest() {  # search (a) in what is left of the call (if 150 s are), the cubins counted before and after
  local shipped
  shipped=$(shipped_cubins)
  [ $((585 - SECONDS)) -ge 150 ] && search_a $((585 - SECONDS)) $((575 - SECONDS))
  echo "cubins shipped: $shipped, after search (a): $(cubins)" | tee -a "$OUT/steps.txt"
  rm -f "$OUT"/search_a.md "$OUT"/host_memory.txt
}
gpu_tests() {  # gpu_tests DIR: every GPU test on a Triton cache of its own (DIR_tests), the call's cache DIR/triton
  export TRITON_CACHE_DIR=$1/triton
  rm -rf "$1" "$1_tests"
  TRITON_CACHE_DIR=$1_tests/triton step 430 gpu_tests python3 -m pytest -q -p no:cacheprovider tests/gpu
}
ahead_tasks() {  # ahead_tasks LIMIT200 LIMIT60 [FLAGS...]: the 200-step task with the capture ahead on, then the
  # 60-step task (a second process, --reuse) off and on; FLAGS go to every run (e.g. --sync-probe)
  local l200=$1 l60=$2; shift 2
  LORAPLEX_CAPTURE_AHEAD=1 step "$l200" task200_ahead1 python3 bench/executor_task.py --layers 32 --steps 200 \
    --runs cold "$@" --out "$OUT/executor_task200_ahead1.md" --json "$OUT/executor_task200_ahead1.json"
  for v in 0 1; do
    LORAPLEX_CAPTURE_AHEAD=$v step "$l60" "task60_ahead$v" python3 bench/executor_task.py --layers 32 --steps 60 \
      --runs cold --reuse "$@" --out "$OUT/executor_task60_ahead$v.md" --json "$OUT/executor_task60_ahead$v.json"
  done
}
search_a() {  # search_a LIMIT DEADLINE: the user's search (a) at 32 layers, 48 configurations, its quality
  # phase in the same call, the host's memory and disk logged every 5 s. Its executor folder (a
  # checkpoint of ~40-50 GB: every started job's adapter and AdamW moments) does not fit the device's
  # disk beside the 16 GB model: on a card of over 100 GB the folder goes to tmpfs; on an 80 GB card
  # (more states parked in pinned host memory, up to 78 GB: session 24's H100 run on tmpfs was killed)
  # the model and the bench's small files go to tmpfs and the folder stays on the disk
  local runs="" work=""
  if [ "$(gpu_mib)" -gt 100000 ]; then
    [ "$(df --output=avail -B1G /dev/shm | tail -1)" -ge 45 ] && runs=/dev/shm/search_a
  else
    work=/dev/shm/search_work; runs=/tmp/search_a
  fi
  echo "runs dir: ${runs:-under --work (disk)}; work: ${work:-default}" | tee -a "$OUT/steps.txt"
  df -h /tmp /dev/shm | tee -a "$OUT/steps.txt"
  (while sleep 5; do echo "$SECONDS $(free -m | awk '/Mem:/{print "used",$3,"shared",$5,"cache",$6,"avail",$7}') \
    $(df --output=used -BM /tmp | tail -1)"; done > "$OUT/host_memory.txt") & local sampler=$!
  local name=${SEARCH_A_NAME:-search_a}  # another name: a second search (a) in the same call
  step "$1" "$name" python3 bench/task_e2e_baselines.py --layers 32 --arms a --quality-arms a --deadline-s "$2" \
    ${runs:+--runs-dir "$runs"} ${work:+--work "$work"} --json "$OUT/$name.json" --out "$OUT/$name.md" \
    ${SEARCH_A_EXTRA:-}
  kill "$sampler"; dmesg 2>/dev/null | grep -i -E "killed process|out of memory" | tail -3 | tee -a "$OUT/steps.txt"
  rm -rf /dev/shm/search_a /dev/shm/search_work /tmp/search_a
}
task60() {  # task60 LIMIT: the 60-step, 8-job task at 32 layers in a fresh process (issue 41's table)
  step "$1" task60 python3 bench/executor_task.py --layers 32 --steps 60 --runs cold \
    --out "$OUT/executor_task60.md" --json "$OUT/executor_task60.json"
}
warm_spare() {  # the shared host with a spare (issue 41's join, issue 44's samples); pydantic from .whl (carried)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
  PYTHONPATH=/tmp/site step 220 warm_spare python3 bench/warm_host.py --spare --layers 32 --n-train 120 \
    --deadline-s 200 --out "$OUT/warm_host_spare.md" --json "$OUT/warm_host_spare.json"
}
search_then_task() {  # search_then_task DIR LIMIT DEADLINE: search (a), then the 60-step task, on a fresh Triton cache
  # in DIR seeded from the shipped archive as a node seeds it; the cubins counted after each (one added is a compile
  # inside a task) and the cache brought back where it grew
  export TRITON_CACHE_DIR=$1/triton
  rm -rf "$1"
  local shipped after_search after
  shipped=$(shipped_cubins)
  search_a "$2" "$3"
  after_search=$(cubins)
  task60 100
  after=$(cubins)
  echo "cubins shipped: $shipped, after search (a): $after_search, after the 60-step task: $after" | tee -a "$OUT/steps.txt"
  if [ "$after" -gt "$shipped" ]; then tar -C "$1" -czf "$OUT/triton_cache_sm90.tar.gz" triton; fi
}
tasks_then_search() {  # the 200-step task, the 60-step task, then search (a) in what the call has left; cubins counted
  step 100 task200 python3 bench/executor_task.py --layers 32 --steps 200 --runs cold \
    --out "$OUT/executor_task200.md" --json "$OUT/executor_task200.json"
  task60 80
  search_a $((575 - SECONDS)) $((565 - SECONDS))
  echo "cubins shipped: $(shipped_cubins), after: $(cubins)" | tee -a "$OUT/steps.txt"
  rm -f "$OUT"/executor_task*.md "$OUT"/search_a.md "$OUT"/host_memory.txt
  pack_logs
}
cubins() { find "$TRITON_CACHE_DIR" -name '*.cubin' | wc -l; }  # compiled kernels in this call's Triton cache
# the kernels' C launchers (one per signature; a missing one is a gcc compile the cubin count does not show)
launchers() { find "$TRITON_CACHE_DIR" -name '__triton_launcher*.so' | wc -l; }
shipped_launchers() { tar tzf kernels/triton_cache/sm90-triton3.6.0.tar.gz | grep -c '__triton_launcher.*\.so$'; }
shipped_cubins() { tar tzf kernels/triton_cache/sm90-triton3.6.0.tar.gz | grep -c '\.cubin$'; }
hp() {  # hp NAME TOKENS [LIMIT]: host_profile's 2-job step at 32 layers, replayed as graphs
  step "${3:-75}" "$1" python3 bench/host_profile.py --layers 32 --tokens "$2" --recompute 0 --modes graphs --warmup 12 \
    --iters 10 --out "$OUT/$1.md"
}
baselines_c2c3() {  # baselines_c2c3 DIR LIMIT DEADLINE RESERVE: every (batch size, rank) pair of (c2) at 32 layers
  # trained whole, (c3) from them with its own quality phase's decisions; Liger from .whl (carry it)
  export TRITON_CACHE_DIR=$1/triton
  rm -rf "$1" /dev/shm/tb
  step "$2" baselines_c2c3 python3 bench/task_e2e_baselines.py --layers 32 --arms c2,c3 --quality-arms c3 \
    --deadline-s "$3" --reserve-s "$4" --work /dev/shm/tb --json "$OUT/baselines_c2c3_32l.json" \
    --out "$OUT/baselines_c2c3_32l.md"
  rm -rf /dev/shm/tb
  pack_logs
}
gpu_mib() { nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1; }
configs_then_task200() {  # configs_then_task200 DIR: the small-step configurations' and the side-stream dA's GPU
  # tests (on a Triton cache of their own), then the 200-step task on DIR/triton seeded from the archive, with the
  # cubins counted before (`shipped`, read again by the phase) and after
  export TRITON_CACHE_DIR=$1/triton
  rm -rf "$1" "$1_tests"
  shipped=$(shipped_cubins)
  TRITON_CACHE_DIR=$1_tests/triton step 75 gpu_configs python3 -m pytest -q -p no:cacheprovider \
    tests/gpu/test_kernels_gpu.py -k "small_step or side_stream"
  step 95 task200 python3 bench/executor_task.py --layers 32 --steps 200 --runs cold \
    --out "$OUT/executor_task200.md" --json "$OUT/executor_task200.json"
  echo "cubins shipped: $shipped, after the 200-step task: $(cubins)" | tee -a "$OUT/steps.txt"
}
graph_tests_then_thread_abab() {  # DIR: the step graphs' GPU tests (a Triton cache of their own), then the 200-step
  # task with $LORAPLEX_CAPTURE_THREAD on, off, on, off (the first builds the model, the others reuse it; session 59)
  export TRITON_CACHE_DIR=$1/triton
  rm -rf "$1" "$1_tests"
  TRITON_CACHE_DIR=$1_tests/triton step 150 graph_tests python3 -m pytest -q -p no:cacheprovider \
    tests/gpu/test_step_graphs_gpu.py
  task200_abab LORAPLEX_CAPTURE_THREAD th
}
search_a_thread() {  # DIR V END: search (a) whole with $LORAPLEX_CAPTURE_THREAD=V on a Triton cache in DIR, until END s
  # into the call (its deadline 15 s before), the cubins counted after, then the logs packed (session 59)
  export TRITON_CACHE_DIR=$1/triton
  rm -rf "$1"
  LORAPLEX_CAPTURE_THREAD=$2 SEARCH_A_NAME=search_a_th$2 search_a $(($3 - SECONDS)) $(($3 - 15 - SECONDS))
  echo "cubins shipped: $(shipped_cubins), after: $(cubins)" | tee -a "$OUT/steps.txt"
  rm -f "$OUT"/search_a_th"$2".md "$OUT"/host_memory.txt
  pack_logs
}
task200_abab() {  # VAR NAME [DEADLINE LEFT]: the 200-step task with $VAR=1, 0, 1, 0 (the first builds the model, the
  # others reuse it), each while the call has LEFT s (70) before DEADLINE (585); runs task200_NAME{1,0}_i (sessions 58, 59)
  task200_runs "${3:-585}" "${4:-70}" "$2"1_1 "$1=1" "$2"0_2 "$1=0" "$2"1_3 "$1=1" "$2"0_4 "$1=0"
}
task200_runs() {  # DEADLINE LEFT NAME "VAR=V ..." [NAME "VAR=V ..."]...: the 200-step task once per NAME with its
  # environment, each while the call has LEFT s before DEADLINE; the first builds the model, the others reuse it;
  # $TASK_FLAGS go to every run
  local deadline=$1 left=$2 first=1 name envs; shift 2
  while [ $# -ge 2 ]; do
    name=$1 envs=$2; shift 2
    [ $((deadline - SECONDS)) -ge "$left" ] || continue
    (export $envs; step 100 "task200_$name" python3 bench/executor_task.py --layers 32 --steps 200 --runs cold \
      $([ $first = 0 ] && echo --reuse) ${TASK_FLAGS:-} --out "$OUT/executor_task200_$name.md" \
      --json "$OUT/executor_task200_$name.json")
    first=0
  done
}
task200_ab() {  # DIR DEADLINE LEFT NAME "VAR=V ..." ...: task200_runs on a Triton cache of its own (DIR/triton), then the
  # runs' JSON files in tasks.tar.gz and the logs in logs.tar.gz (s72_b, s73_a on)
  export TRITON_CACHE_DIR=$1/triton
  rm -rf "$1"
  shift
  task200_runs "$@"
  (cd "$OUT" && tar -czf tasks.tar.gz executor_task200_*.json && rm -f executor_task*.json executor_task*.md)
  pack_logs
  rm -f "$OUT"/gpu.txt
}
grow_archive() {  # DIR LIMIT DEADLINE: search (a) (its LIMIT and DEADLINE), then the 200-step task, on DIR/triton seeded
  # from the shipped archive; the cubins counted before and after, and the cache back where it grew (s49_a)
  export TRITON_CACHE_DIR=$1/triton
  rm -rf "$1"
  local shipped
  shipped=$(shipped_cubins)
  search_a "$2" "$3"
  step 100 task200 python3 bench/executor_task.py --layers 32 --steps 200 --runs cold \
    --out "$OUT/executor_task200.md" --json "$OUT/executor_task200.json"
  echo "cubins shipped: $shipped, after: $(cubins)" | tee -a "$OUT/steps.txt"
  if [ "$(cubins)" -gt "$shipped" ]; then tar -C "$1" -czf "$OUT/triton_cache_sm90.tar.gz" triton; fi
  rm -f "$OUT"/executor_task*.md "$OUT"/search_a.md "$OUT"/host_memory.txt
  pack_logs
}
S67_NEW="LORAPLEX_ZERO_SLAB=1 LORAPLEX_PIN_QUIET_S=0.5 LORAPLEX_CAPTURE_SYNC=room"  # session 67's forms, on
S67_OLD="LORAPLEX_ZERO_SLAB=0 LORAPLEX_PIN_QUIET_S=0 LORAPLEX_CAPTURE_SYNC=always"  # ... and off (session 66's code)
S67B_NEW="LORAPLEX_PIN_QUIET_S=0.5 LORAPLEX_FIRST_CALLS=1"  # what lands after call 1 (the slab and the sync out)
S67B_OLD="LORAPLEX_PIN_QUIET_S=0 LORAPLEX_FIRST_CALLS=0"
pack_logs() { (cd "$OUT" && tar -czf logs.tar.gz ./*.log ./*.txt && rm -f ./*.log); }
on_off() {  # on_off ON OFF "VAR=V ..." "VAR=V ...": a form (ON's environment) against another (OFF's), side by side: the
  # graphed 2-job step ON / OFF / ON (host_profile's replays back to back), then, where the call has the time, the
  # 200-step task ON (a fresh model), then OFF (--reuse); files hp_NAME_SECONDS.md and executor_task200_NAME.json
  local on=$1 off=$2 env_on=$3 env_off=$4 name
  for name in "$on" "$off" "$on"; do
    # shellcheck disable=SC2046,SC2086
    [ $((585 - SECONDS)) -ge 60 ] && (export $([ "$name" = "$on" ] && echo "$env_on" || echo "$env_off")
      step 55 "hp_$name" python3 bench/host_profile.py --layers 32 --tokens 290 --recompute 0 --modes graphs \
        --warmup 12 --iters 10 --out "$OUT/hp_${name}_$SECONDS.md")
  done
  if [ $((585 - SECONDS)) -ge 180 ]; then
    # shellcheck disable=SC2086
    (export $env_on; step 100 "task200_$on" python3 bench/executor_task.py --layers 32 --steps 200 --runs cold \
      --out "$OUT/executor_task200_$on.md" --json "$OUT/executor_task200_$on.json")
    # shellcheck disable=SC2086
    [ $((585 - SECONDS)) -ge 70 ] && (export $env_off; step $((580 - SECONDS)) "task200_$off" python3 \
      bench/executor_task.py --layers 32 --steps 200 --runs cold --reuse --out "$OUT/executor_task200_$off.md" \
      --json "$OUT/executor_task200_$off.json")
  fi
  rm -f "$OUT"/executor_task*.md
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers, peft; print(torch.__version__, triton.__version__, transformers.__version__, peft.__version__)" | tee -a "$OUT/gpu.txt"
case "${1:-}" in
  kernels)  # issue 20 (+ the GPU tests of every issue)
    step 170 gpu_tests python3 -m pytest -q -p no:cacheprovider tests/gpu \
      tests/unit/test_packing.py::test_flash_varlen_attention_equals_causal_attention_per_sequence
    step 230 lora_op python3 bench/lora_op.py --budget-s 190 --out "$OUT/lora_op_fused_h100.md" --timings "$OUT/lora_forms.json"
    [ -s "$OUT/lora_forms.json" ] && cp "$OUT/lora_forms.json" kernels/lora_forms.json
    step 170 engine_step python3 bench/engine_step.py --jobs 8 --forms compose,fused,auto --out "$OUT/engine_step_fused_h100.md"
    ;;
  e2e)  # issue 15: the whole task, rows attention (the default)
    step 530 task_e2e python3 bench/task_e2e.py --layers 4 --deadline-s 455 --work /tmp/task_e2e \
      --json "$OUT/task_e2e_h100.json" --profile-out "$OUT/task_e2e_h100_profile.txt" --out "$OUT/task_e2e_h100_table.md"
    ;;
  more)  # issue 15 varlen attention (speed only) and issue 19 co-location
    step 210 task_e2e_varlen python3 bench/task_e2e.py --layers 4 --speed-only --attention varlen --deadline-s 170 \
      --work /tmp/task_e2e --json "$OUT/task_e2e_h100_varlen.json"
    step 290 colocate python3 bench/colocate.py --tasks 6 --steps 60 --out "$OUT/colocate_h100.md"
    ;;
  next)  # what the 2026-11-23 lease left: writes off the loop (side by side), (a) with varlen,
         # the TMA form's speed, every GPU test in one go
    step 150 task_e2e_async python3 bench/task_e2e.py --layers 4 --speed-only --attention varlen --deadline-s 120 \
      --work /tmp/task_e2e_async --json "$OUT/task_e2e_h100_varlen_async.json"
    step 150 task_e2e_sync python3 bench/task_e2e.py --layers 4 --speed-only --attention varlen --sync-writes \
      --deadline-s 120 --work /tmp/task_e2e_sync --json "$OUT/task_e2e_h100_varlen_sync.json"
    LORAPLEX_FUSED_TMA=1 step 200 lora_op_tma python3 bench/lora_op.py --quick --out "$OUT/lora_op_tma_h100.md"
    ;;
  next2)  # the whole study with the defaults (varlen, writes off the loop), then every GPU test
    step 450 task_e2e python3 bench/task_e2e.py --layers 4 --attention varlen --deadline-s 400 --work /tmp/task_e2e \
      --json "$OUT/task_e2e_h100.json" --out "$OUT/task_e2e_h100_table.md"
    step 120 gpu_tests python3 -m pytest -q -p no:cacheprovider tests/gpu
    ;;
  variants)  # issue 20: every fused GEMM variant side by side. Each variant first compiles and runs
             # once in its own process at a small shape (in parallel: a compiler crash costs only
             # that variant, and the compile cache is warm for the timed run)
    ok=""
    for v in ptr ptr+pf tma tma+pf persist persist+pf; do
      ( timeout 240 python3 -c "
import sys, torch
from kernels.fused_lora import multilora_linear_fused
from kernels.testing import make_case, oracle_fp64, rel_errors, run_op
c = make_case([300, 0, 212], [16, 64, 24], 512, 768, dtype=torch.bfloat16, device='cuda')
e = max(rel_errors(run_op(c, multilora_linear_fused, gemm=sys.argv[1]), oracle_fp64(c, device='cuda')).values())
print(sys.argv[1], 'max rel err', e)
assert e < 1.5e-2
" "$v" > "$OUT/probe_$v.log" 2>&1; echo "$v rc=$?" >> "$OUT/probe.txt" ) &
    done
    wait
    cat "$OUT/probe.txt"
    ok=$(grep "rc=0" "$OUT/probe.txt" | cut -d' ' -f1 | paste -sd, -)
    step 420 lora_variants python3 bench/lora_op.py --variants --only "$ok" --budget-s 300 \
      --out "$OUT/lora_op_variants_h100.md"
    ;;
  engine)  # issue 20: the engine step (32 layers, 8 jobs) on compose and the fused GEMM variants
    step 560 engine_step python3 bench/engine_step.py --jobs 8 --skip-peft --forms compose,fused:ptr,fused:persist \
      --out "$OUT/engine_step_variants_h100.md"
    ;;
  tests)  # every GPU test, then each variant's host time per eager call (one shape)
    step 330 gpu_tests python3 -m pytest -q -p no:cacheprovider tests/gpu
    step 200 lora_host python3 bench/lora_op.py --variants --only ptr,tma,persist,persist+pf --budget-s 1 \
      --out "$OUT/lora_op_host_h100.md"
    ;;
  hostprof)  # where an eager fused/compose fwd+bwd spends its host time (cProfile), the engine GPU tests
    step 200 hostprof python3 -c "
import cProfile, pstats, torch
from kernels import multilora_linear
from kernels.fused_lora import multilora_linear_fused
from kernels.testing import make_case
c = make_case([1024] * 8, [16] * 8, 4096, 4096, dtype=torch.bfloat16, device='cuda', bias=False, nan_padding=False)
x, a, b = (t.detach().clone().requires_grad_() for t in (c.x, c.lora_a, c.lora_b))
for name, op in (('compose', lambda: multilora_linear(x, c.weight, None, a, b, c.scales, c.ranks, c.offsets,
                                                       backend='triton', form='compose')),
                 ('persist', lambda: multilora_linear_fused(x, c.weight, None, a, b, c.scales, c.ranks, c.offsets,
                                                           gemm='persist'))):
    for _ in range(3):
        op().backward(c.dy)
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    with torch.autograd.set_multithreading_enabled(False):  # backward in this thread: cProfile sees it
        pr.enable()
        for _ in range(30):
            op().backward(c.dy)
        pr.disable()
    torch.cuda.synchronize()
    print('=====', name)
    pstats.Stats(pr).sort_stats('tottime').print_stats(25)
"
    step 300 gpu_engine python3 -m pytest -x -rA --tb=short -p no:cacheprovider tests/gpu/test_engine_gpu.py
    ;;
  final)  # the defaults after the variants study (fused form, persistent GEMMs on Hopper) against
          # compose in one run, then the GPU tests those defaults touch
    step 200 engine_step python3 bench/engine_step.py --jobs 8 --skip-peft --forms compose,fused \
      --out "$OUT/engine_step_default_h100.md"
    step 360 gpu_tests python3 -m pytest -rA --tb=short -p no:cacheprovider tests/gpu/test_engine_gpu.py \
      tests/gpu/test_kernels_gpu.py -k "engine or fused_arena or variants or no_host_sync"
    ;;
  profile)  # issue 20, session 5: where the engine step's time over the backbone goes (kernel time
            # by category and GPU idle, per form), then the GPU tests not yet run on a device
    step 300 engine_profile python3 bench/engine_step.py --jobs 8 --skip-peft --forms compose,fused \
      --out "$OUT/engine_step_profiled_h100.md" --profile "$OUT/engine_step_profile_h100.md"
    step 270 gpu_tests python3 -m pytest -rA --tb=short -p no:cacheprovider tests/gpu/test_kernels_gpu.py \
      -k "variants or fused_matches"
    ;;
  tiles)  # issue 20, session 5: tuned rank tiles (BLOCK_R 16/32/64) against the earlier lists (16 only),
          # each kernel apart at the engine's shapes, then the engine step (profiled) on both
    step 170 stages_tuned python3 bench/lora_op.py --engine-stages --out "$OUT/engine_stages_tuned_h100.md"
    LORAPLEX_FUSED_RANK_TILES=narrow step 130 engine_narrow python3 bench/engine_step.py --jobs 8 --skip-peft \
      --skip-torch --forms fused --out "$OUT/engine_step_narrow_h100.md" --profile "$OUT/engine_profile_narrow_h100.md"
    step 130 engine_tuned python3 bench/engine_step.py --jobs 8 --skip-peft --skip-torch --forms fused \
      --out "$OUT/engine_step_tuned_h100.md" --profile "$OUT/engine_profile_tuned_h100.md"
    LORAPLEX_FUSED_RANK_TILES=narrow step 120 stages_narrow python3 bench/lora_op.py --engine-stages \
      --out "$OUT/engine_stages_narrow_h100.md"
    ;;
  tiles2)  # the same after the tuning fix (trials no longer clone the whole gradient arena), with the
           # tuner's choices printed; then the GPU tests of the arena path and the engine
    LORAPLEX_FUSED_RANK_TILES=narrow step 130 engine_narrow python3 bench/engine_step.py --jobs 8 --skip-peft \
      --skip-torch --forms fused --out "$OUT/engine_step_narrow_h100.md" --profile "$OUT/engine_profile_narrow_h100.md"
    step 130 engine_tuned python3 bench/engine_step.py --jobs 8 --skip-peft --skip-torch --forms fused \
      --out "$OUT/engine_step_tuned_h100.md" --profile "$OUT/engine_profile_tuned_h100.md"
    step 300 gpu_tests python3 -m pytest -rA --tb=short -p no:cacheprovider tests/gpu/test_engine_gpu.py \
      tests/gpu/test_kernels_gpu.py -k "engine or fused_arena or no_host_sync"
    ;;
  split)  # the shrink's column splits (SPLIT_C) and wide rank tiles against the earlier lists, on the
          # engine's arena layout, then the engine step with the tuner's choices; the arena GPU tests
    step 150 stages_tuned python3 bench/lora_op.py --engine-stages --out "$OUT/engine_stages_tuned_h100.md"
    step 130 engine_tuned python3 bench/engine_step.py --jobs 8 --skip-peft --skip-torch --forms fused \
      --out "$OUT/engine_step_tuned_h100.md" --profile "$OUT/engine_profile_tuned_h100.md"
    LORAPLEX_FUSED_RANK_TILES=narrow step 110 stages_narrow python3 bench/lora_op.py --engine-stages \
      --out "$OUT/engine_stages_narrow_h100.md"
    step 170 gpu_tests python3 -m pytest -rA --tb=short -p no:cacheprovider tests/gpu/test_kernels_gpu.py \
      -k "fused_arena or no_host_sync"
    ;;
  final2)  # this session's defaults (split shrink, tuned rank tiles) against compose and the backbone in
           # one run, then the stacked fused GPU tests (every tuned shrink config at real shapes)
    step 200 engine_step python3 bench/engine_step.py --jobs 8 --skip-peft --skip-torch --forms compose,fused \
      --out "$OUT/engine_step_final_h100.md"
    step 330 gpu_tests python3 -m pytest -rA --tb=short -p no:cacheprovider tests/gpu/test_kernels_gpu.py \
      -k "fused_matches"
    ;;
  compose)  # the composition's arena backward on the new tuning path: its GPU tests, then the engine step
    step 200 gpu_tests python3 -m pytest -rA --tb=short -p no:cacheprovider tests/gpu/test_kernels_gpu.py \
      -k "triton_arena or arena_no_host_sync"
    step 150 engine_step python3 bench/engine_step.py --jobs 8 --skip-peft --skip-torch --forms compose,fused \
      --out "$OUT/engine_step_compose_h100.md"
    ;;
  meta)  # session 6: the fused GEMMs' epilogue with the adapters' metadata in registers (one load per
         # program, no chain of dependent loads per tile) and a 4-stage 128x256 tile, against the
         # previous kernels (a copy of the last commit's kernels/ and bench/ in
         # $OLD_KERNELS: its scripts put that copy first on sys.path), side by side
    side_by_side
    ;;
  pf)  # session 6: the epilogue's first LoRA operands loaded before the main loop (+pf), now that the
       # adapters' metadata sits in registers (no dependent load to wait for), against persist alone;
       # the GEMM tuning keys now name B's layout
    LORAPLEX_FUSED_GEMM=persist step 120 stages_persist python3 bench/lora_op.py --engine-stages \
      --out "$OUT/engine_stages_persist_h100.md"
    LORAPLEX_FUSED_GEMM=persist+pf step 120 stages_pf python3 bench/lora_op.py --engine-stages \
      --out "$OUT/engine_stages_pf_h100.md"
    step 300 engine python3 bench/engine_step.py --jobs 8 --skip-peft --skip-torch \
      --forms fused:persist,fused:persist+pf --out "$OUT/engine_step_pf_h100.md"
    ;;
  ncu)  # session 6: where the fused GEMM's LoRA epilogue spends its time (Nsight Compute, with and
        # without adapters, same binary), then the GPU tests the last call's time limit cut
    step 200 ncu ncu --profile-from-start off --set full -o "$OUT/epilogue" python3 bench/ncu_epilogue.py 4096 14336
    ncu --import "$OUT/epilogue.ncu-rep" --page details > "$OUT/epilogue_details.txt" 2>&1
    ncu --import "$OUT/epilogue.ncu-rep" --page source --csv --print-source sass > "$OUT/epilogue_sass.csv" 2>&1
    pids=()
    t=tests/gpu/test_kernels_gpu.py
    groups=("$t::test_fused_matches_fp64[4-True] $t::test_fused_matches_fp64[4-False] $t::test_fused_matches_fp64[5-True] $t::test_fused_matches_fp64[5-False]"
            "$t::test_triton_matches_fp64[4] $t::test_no_host_sync_after_warmup $t::test_arena_no_host_sync_after_warmup[compose] $t::test_arena_no_host_sync_after_warmup[fused]"
            "$t::test_triton_arena_matches_fp64[4] $t::test_fused_arena_matches_fp64[0] $t::test_fused_arena_matches_fp64[1] $t::test_fused_arena_matches_fp64[2]"
            "$t::test_fused_arena_matches_fp64[3] $t::test_fused_arena_matches_fp64[4] $t::test_fused_arena_matches_fp64[5]")
    for g in 0 1 2 3; do
      # shellcheck disable=SC2086
      ( set -f; step 360 "gpu_group$g" python3 -m pytest -rA --tb=short -p no:cacheprovider ${groups[$g]} ) &
      pids+=($!)
    done
    wait "${pids[@]}"
    grep -h -E "^(PASSED|FAILED|ERROR)|[0-9]+ (passed|failed)" "$OUT"/gpu_*.log
    ;;
  aligned)  # session 6: the arena kernels with 16-element-aligned offsets (vector loads of the adapters'
            # rows) against the previous commit's kernels, bench and trainer ($OLD_KERNELS), side by side
    side_by_side
    ;;
  gpufinal)  # session 6: the GPU tests of the kernels changed this session, in three processes
    t=tests/gpu/test_kernels_gpu.py
    pids=()
    ( step 560 gpu_fused_matches python3 -m pytest -rA --tb=short -p no:cacheprovider $t -k fused_matches ) &
    pids+=($!)
    ( step 560 gpu_fused_arena python3 -m pytest -rA --tb=short -p no:cacheprovider $t -k fused_arena ) &
    pids+=($!)
    ( set -f; step 560 gpu_rest python3 -m pytest -rA --tb=short -p no:cacheprovider tests/gpu/test_engine_gpu.py \
        $t -k "engine or variants or no_host_sync or triton_matches_fp64[4] or triton_arena_matches_fp64[4]" ) &
    pids+=($!)
    wait "${pids[@]}"
    ;;
  tables)  # session 6: the lora_op table with this session's kernels (timings for form="auto"), then the
           # engine step on compose, fused and auto side by side
    step 330 lora_op python3 bench/lora_op.py --budget-s 260 --out "$OUT/lora_op_fused_h100.md" --timings "$OUT/lora_forms.json"
    [ -s "$OUT/lora_forms.json" ] && cp "$OUT/lora_forms.json" kernels/lora_forms.json
    step 200 engine_step python3 bench/engine_step.py --jobs 8 --skip-peft --skip-torch --forms compose,fused,auto \
      --out "$OUT/engine_step_final_h100.md"
    ;;
  verify)  # session 6: form=auto on the GPU-time table against fused in the engine, then the task e2e GPU test
           # on the aligned arena path
    step 170 engine_step python3 bench/engine_step.py --jobs 8 --skip-peft --skip-torch --forms fused,auto \
      --out "$OUT/engine_step_auto_h100.md"
    step 330 gpu_e2e python3 -m pytest -rA --tb=short -p no:cacheprovider tests/gpu/test_task_e2e_gpu.py
    ;;
  gputests)  # every GPU test, in parallel processes (each test's time is mostly Triton compiling its
             # autotune configs on the CPU; one GPU is plenty for correctness checks)
    pids=()
    for sel in "variants" "fused_matches" "fused_arena or triton_arena" "triton_matches or no_host_sync"; do
      name=$(echo "$sel" | tr -c 'a-z0-9\n' '_')
      ( step 540 "gpu_$name" python3 -m pytest -rA --tb=short -p no:cacheprovider tests/gpu/test_kernels_gpu.py \
          -k "$sel" ) &
      pids+=($!)
    done
    ( step 540 gpu_engine python3 -m pytest -rA --tb=short -p no:cacheprovider tests/gpu/test_engine_gpu.py ) &
    pids+=($!)
    ( step 540 gpu_e2e python3 -m pytest -rA --tb=short -p no:cacheprovider tests/gpu/test_task_e2e_gpu.py ) &
    pids+=($!)
    wait "${pids[@]}"
    grep -h -E "^(PASSED|FAILED|ERROR|SKIPPED)|passed|failed" "$OUT"/gpu_*.log | sort | uniq -c | tail -60
    ;;
  pace)  # issue 40: the graphed step's GPU test, then the host profile at 32 layers (eager launches
         # against CUDA graphs, recompute on and off, one process)
    step 240 gpu_graphs python3 -m pytest -rA --tb=short -p no:cacheprovider tests/gpu/test_step_graphs_gpu.py
    step 330 host_profile python3 bench/host_profile.py --layers 32 --out "$OUT/host_profile_graphs_h100.md"
    ;;
  pace_search)  # issue 40: the GPU tests of the graphed step and evaluation, then the user's search (a) at
                # 32 layers, 48 configurations, its quality phase in the same call
    step 100 gpu_graphs python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_step_graphs_gpu.py
    step 470 search_a python3 bench/task_e2e_baselines.py --layers 32 --arms a --quality-arms a --deadline-s 440 \
      --json "$OUT/search_a_h100.json" --out "$OUT/search_a_h100.md"
    ;;
  pace_final)  # issue 40, last call of session 18: the GPU tests of the graphed step, evaluation and pooled
               # park; the search (a) at 32 layers with its quality phase; the executor task (graphed, cold)
    step 90 gpu_tests python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_step_graphs_gpu.py \
      tests/gpu/test_park_gpu.py
    step 330 search_a python3 bench/task_e2e_baselines.py --layers 32 --arms a --quality-arms a --deadline-s 310 \
      --json "$OUT/search_a_h100.json" --out "$OUT/search_a_h100.md"
    step 200 executor_task python3 bench/executor_task.py --layers 32 --steps 200 --runs cold \
      --out "$OUT/executor_task_graphs_h100.md" --json "$OUT/executor_task_graphs_h100.json"
    ;;
  pace_task)  # issues 40/41: the real executor at 32 layers, 200 steps: graphed (cold: no stored profile)
              # against every step launched eagerly (the profile the cold run stored), one process; then
              # the host profile (shorter)
    step 330 executor_task python3 bench/executor_task.py --layers 32 --steps 200 --runs cold,eager \
      --out "$OUT/executor_task_graphs_h100.md" --json "$OUT/executor_task_graphs_h100.json"
    step 200 host_profile python3 bench/host_profile.py --layers 32 --warmup 16 --iters 20 \
      --out "$OUT/host_profile_graphs_h100.md"
    ;;
  s19_search)  # session 19, call 1 (issues 40, 41): the GPU tests of what changed (graphs with covers, the
               # pooled park, the analytic memory model stored and reused), then the search (a) at 32 layers
               # with its quality phase (fresh process: analytic model, parallel load, pool after step 1)
    step 60 gpu_tests python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_task_e2e_gpu.py
    step 400 search_a python3 bench/task_e2e_baselines.py --layers 32 --arms a --quality-arms a --deadline-s 380 \
      --json "$OUT/search_a_h100.json" --out "$OUT/search_a_h100.md"
    ;;
  s19_task)  # session 19, call 2 (issues 40, 41, 44): the 8-job executor task at 32 layers, 200 steps, each
             # run a fresh process as a node makes them: the node's first (no stored model), then a second
             # process (the model the first stored, Triton cache on disk); end-of-task samples in both
    export TRITON_CACHE_DIR=/tmp/executor_task_cache/triton
    step 300 task_cold python3 bench/executor_task.py --layers 32 --steps 200 --runs cold \
      --out "$OUT/executor_task_cold_h100.md" --json "$OUT/executor_task_cold_h100.json"
    step 200 task_second python3 bench/executor_task.py --layers 32 --steps 200 --runs second --reuse \
      --out "$OUT/executor_task_second_h100.md" --json "$OUT/executor_task_second_h100.json"
    # the kernels those runs compiled (this image's Triton, sm_90): a node's cache can start from them
    tar -C /tmp/executor_task_cache -czf "$OUT/triton_cache_sm90.tar.gz" triton && ls -la "$OUT/triton_cache_sm90.tar.gz"
    ;;
  s19_final)  # session 19, last call: the GPU tests of what changed (graphs, park, the stored memory
              # model, DPO/ORPO losses without a host sync), then the 8-job executor task at 32 layers in a
              # fresh process (no stored model; end-of-task samples through the decoding form)
    step 150 gpu_tests python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_task_e2e_gpu.py \
      tests/gpu/test_step_graphs_gpu.py tests/gpu/test_park_gpu.py tests/gpu/test_pair_objectives_gpu.py
    export TRITON_CACHE_DIR=/tmp/executor_task_cache/triton
    step 280 task_cold python3 bench/executor_task.py --layers 32 --steps 200 --runs cold \
      --out "$OUT/executor_task_cold_h100.md" --json "$OUT/executor_task_cold_h100.json"
    ;;
  s20)  # next session, call 1: every GPU test, then where the end-of-task samples' time goes
    step 330 gpu_tests python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu
    step 200 samples python3 bench/samples_decode.py --layers 32 --new 128 --out "$OUT/samples_decode_h100.md"
    ;;
  s20_task)  # next session, call 2: the 8-job executor task (fresh process; recompute per step's tokens)
    export TRITON_CACHE_DIR=/tmp/executor_task_cache/triton
    step 280 task_cold python3 bench/executor_task.py --layers 32 --steps 200 --runs cold \
      --out "$OUT/executor_task_cold_h100.md" --json "$OUT/executor_task_cold_h100.json"
    step 200 task_second python3 bench/executor_task.py --layers 32 --steps 200 --runs second --reuse \
      --out "$OUT/executor_task_second_h100.md" --json "$OUT/executor_task_second_h100.json"
    # the Triton cache this image built (to ship for sm_90), and the logs as one file each: the
    # device tool brings back at most 8 files
    tar -C /tmp/executor_task_cache -czf "$OUT/triton_cache_sm90.tar.gz" triton
    (cd "$OUT" && tar -czf logs.tar.gz ./*.log ./*.txt && rm -f ./*.log ./*.txt)
    ;;
  s20_warm)  # session 20, call 3 (issues 41, 44, 42): the pair objectives' GPU test (varlen), the 60-step
             # task of issue 41 in a fresh process with the shipped Triton cache (kernels compiled in the
             # task counted), then a task joining a warm worker.host and samples on demand there (the
             # node's side needs pydantic: carried as wheels in .whl)
    step 90 gpu_pairs python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_pair_objectives_gpu.py
    export TRITON_CACHE_DIR=/tmp/s20_triton
    rm -rf "$TRITON_CACHE_DIR"
    step 200 task60 python3 bench/executor_task.py --layers 32 --steps 60 --runs cold \
      --out "$OUT/executor_task60_h100.md" --json "$OUT/executor_task60_h100.json"
    echo "cubins in the Triton cache after the task: $(cubins)," \
      "shipped: $(shipped_cubins)" | tee -a "$OUT/steps.txt"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site step 230 warm_host python3 bench/warm_host.py --layers 32 --n-train 120 \
      --work /tmp/executor_task --reuse --deadline-s 210 --out "$OUT/warm_host_h100.md" --json "$OUT/warm_host_h100.json"
    pack_logs
    ;;
  s20_final)  # session 20, last call: every GPU test on the code that lands (the executor's components,
              # the staged load, the graphed decode), the warm host again (cold start with the staged
              # load, end-of-task and on-demand samples graphed), a fresh process's load twice, the decode
    step 280 gpu_tests python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu
    export TRITON_CACHE_DIR=/tmp/s20f_triton
    rm -rf "$TRITON_CACHE_DIR"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site step 200 warm_host python3 bench/warm_host.py --layers 32 --n-train 120 --deadline-s 180 \
      --out "$OUT/warm_host_h100.md" --json "$OUT/warm_host_h100.json"
    for i in 1 2; do
      step 40 "fast_load$i" python3 bench/fast_load.py /tmp/warm_host/model --json "$OUT/fast_load_h100.jsonl"
    done
    rm -rf /tmp/warm_host
    step 120 samples python3 bench/samples_decode.py --layers 32 --new 128 --out "$OUT/samples_decode_h100.md" \
      --json "$OUT/samples_decode_h100.json"
    pack_logs
    ;;
  s20_load)  # session 20: the backbone read by pread into pinned buffers (not mapped pages): the warm host's
             # cold start, then a fresh process's load three times (8, 8, 16 readers)
    export TRITON_CACHE_DIR=/tmp/s20l_triton
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site step 200 warm_host python3 bench/warm_host.py --layers 32 --n-train 120 --deadline-s 180 \
      --out "$OUT/warm_host_load_h100.md" --json "$OUT/warm_host_load_h100.json"
    for t in 8 8 16; do
      step 40 "fast_load$t" python3 bench/fast_load.py /tmp/warm_host/model --threads "$t" --json "$OUT/fast_load_pread.jsonl"
    done
    step 60 gpu_load python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_fast_load_gpu.py
    pack_logs
    ;;
  s21_a)  # session 21 (next device session), call 1 (issues 42, 41): every GPU test on the code that lands
          # (the engine's arena and evaluation as components, the writer on BackgroundWorker, the
          # repeatable decode), then a task of a model the node never ran, attached to a warmed-up spare
    step 280 gpu_tests python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu
    export TRITON_CACHE_DIR=/tmp/s21_triton
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site step 220 warm_spare python3 bench/warm_host.py --spare --layers 32 --n-train 120 \
      --deadline-s 200 --out "$OUT/warm_host_spare_h100.md" --json "$OUT/warm_host_spare_h100.json"
    pack_logs
    ;;
  s21_b)  # session 21, call 2 (issue 44): the decode at 32 layers with cuBLAS's fixed workspaces and
          # deterministic algorithms (as a node runs it) and without, each in a fresh process; what the
          # variable costs a training step (the engine's step, 8 jobs, each in a fresh process)
    step 150 samples_rep python3 bench/samples_decode.py --layers 32 --new 128 --out "$OUT/samples_repeatable.md" \
      --json "$OUT/samples_repeatable.json"
    step 150 samples_free python3 bench/samples_decode.py --layers 32 --new 128 --no-repeatable \
      --out "$OUT/samples_free.md" --json "$OUT/samples_free.json"
    CUBLAS_WORKSPACE_CONFIG=:4096:8 step 120 step_ws python3 bench/engine_step.py --jobs 8 --skip-peft --skip-torch \
      --forms fused --out "$OUT/engine_step_ws.md"
    step 120 step_free python3 bench/engine_step.py --jobs 8 --skip-peft --skip-torch --forms fused \
      --out "$OUT/engine_step_free.md"
    pack_logs
    ;;
  s21_search)  # session 21, call 3 (issue 40): the user's search (a) at 32 layers, 48 configurations, its
               # quality phase in the same call; the executor's folder (its ~38 GB first checkpoint) on
               # tmpfs when it has the room (the device's disk does not, beside the 16 GB model)
    df -h /tmp /dev/shm | tee -a "$OUT/steps.txt"
    search_a 560 530
    pack_logs
    ;;
  s22_a)  # session 22, call 1 (issues 40, 41): the memory model's correction (offset for small steps, the
          # envelope once settled): the user's search (a) at 32 layers (its memory trace in the JSON),
          # then the shared host with a spare (its trace too)
    search_a 330 300
    export TRITON_CACHE_DIR=/tmp/s22_triton
    warm_spare
    pack_logs
    ;;
  s22_b)  # session 22, call 2 (issues 40, 41): search (a) with every step's and evaluation's time and graph
          # event in its JSON (where training and evaluation go) and the writer's direct safetensors
          # writes, then the repeatable decode (issue 44) with the shrink unsplit under deterministic mode
    search_a 330 300
    step 150 samples_rep python3 bench/samples_decode.py --layers 32 --new 128 --out "$OUT/samples_repeatable.md" \
      --json "$OUT/samples_repeatable.json"
    pack_logs
    ;;
  s22_c)  # session 22, call 3 (issues 40, 41): search (a) with steps over 16k tokens never captured (the
          # graphs' pool no longer squeezes admission and evaluation) and the writer's direct
          # safetensors writes; then every GPU test on the code that lands
    search_a 300 280
    step 285 gpu_tests python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu
    pack_logs
    ;;
  s22_d)  # session 22, call 4 (issue 41): the 60-step 8-job task in a fresh process (the memory model's
          # correction, steps over 16k tokens eager), then the spare host again, on the code that lands
    export TRITON_CACHE_DIR=/tmp/s22d_triton
    task60 200
    warm_spare
    pack_logs
    ;;
  s22_e)  # session 22, call 5 (issue 40): where an evaluation's time goes at 32 layers (the search's first
          # evaluation: 12 jobs x 64 samples, 16 a forward, 205 sequences; its third: 24 jobs, 11, 132)
    step 200 eval12 python3 bench/eval_profile.py --layers 32 --jobs 12 --chunk 16 --cap 205 \
      --out "$OUT/eval_profile_12.md" --json "$OUT/eval_profile_12.json"
    step 200 eval24 python3 bench/eval_profile.py --layers 32 --jobs 24 --chunk 11 --cap 132 \
      --out "$OUT/eval_profile_24.md" --json "$OUT/eval_profile_24.json"
    pack_logs
    ;;
  s22_f)  # session 22, call 6 (issue 44): which module of the decode's prefill differs from run to run
    step 150 probe python3 bench/decode_probe.py --layers 32 --json "$OUT/decode_probe.json"
    ;;
  s23_a)  # session 23, call 1 (issue 44): the first module whose output differs between two identical eager
          # decodes (prefill and 3 token steps), whether its inputs were equal, and whether it repeats alone
    step 200 probe python3 bench/decode_probe.py --layers 32 --new 4 --json "$OUT/decode_probe.json"
    ;;
  s23_b)  # session 23, call 2 (issue 44): the probe with the decode's attention on the math backend, the
          # default's kernels, then the decode bench (speed, repeats) with math attention
    step 100 probe_math python3 bench/decode_probe.py --layers 32 --new 4 --sdpa math --json "$OUT/probe_math.json"
    step 100 probe_kernels python3 bench/decode_probe.py --layers 32 --new 4 --kernels --json "$OUT/probe_kernels.json"
    LORAPLEX_DECODE_SDPA=math step 170 samples_math python3 bench/samples_decode.py --layers 32 --new 128 \
      --out "$OUT/samples_math.md" --json "$OUT/samples_math.json"
    pack_logs
    ;;
  s23_c)  # session 23, call 3 (issues 40, 44): search (a) with the steps one pass could run only with
          # recompute split into passes without (engine.split_for; its step trace names each pass's
          # cells), then the GPU tests of the repeatable decode and of the split step
    search_a 300 280
    step 170 gpu_tests python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_samples_gpu.py \
      tests/gpu/test_engine_gpu.py
    pack_logs
    ;;
  s23_d)  # session 23, call 4 (issues 41, 44): the 60-step task in a fresh process (the end's writes overlap
          # its samples; the decode's math attention), then the shared host with a spare (the join, the
          # end-of-task and on-demand samples)
    export TRITON_CACHE_DIR=/tmp/s23d_triton
    task60 200
    warm_spare
    pack_logs
    ;;
  s23_e)  # session 23, call 5 (issue 40): search (a)'s timing alone with the split steps, every slow step
          # and evaluation logged as it comes, then the GPU test of the split step
    LORAPLEX_SPLIT_STEPS=1 step 260 search_timing python3 bench/task_e2e_baselines.py --layers 32 --arms a --phase timing \
      --deadline-s 240 --runs-dir /dev/shm/search_a --json "$OUT/search_timing.json" --out "$OUT/search_timing.md"
    rm -rf /dev/shm/search_a
    step 100 gpu_split python3 -m pytest -q --tb=short -p no:cacheprovider \
      tests/gpu/test_engine_gpu.py::test_a_step_run_as_passes_matches_one_pass_through_the_kernels
    pack_logs
    ;;
  s23_f)  # session 23, call 6 (issue 40): search (a) with the split steps on, killed at 250 s: its log
          # names each slow step (the first ones: all 48 configurations at once) with its passes' cells
    export LORAPLEX_SPLIT_STEPS=1
    search_a 250 240
    pack_logs
    ;;
  s23_g)  # session 23, call 7 (issues 41, 44): the 60-step task as a node runs it (cuBLAS's fixed
          # workspaces, so the end-of-task samples decode repeatably: math attention)
    task60 170
    ;;
  s24_a)  # session 24, call 1 (issue 40): search (a) with the split steps on, every pass launched with the
          # step's whole job layout (its N_P2, R_MAX: no specialization per pass), its Triton cache packed
          # after (the shipped archive's refresh); then the GPU test of the split step
    export LORAPLEX_SPLIT_STEPS=1 TRITON_CACHE_DIR=/tmp/s24_triton
    search_a 430 400
    echo "triton cache entries: $(ls /tmp/s24_triton | wc -l)" | tee -a "$OUT/steps.txt"
    (cd /tmp/s24_triton && tar -czf "$OUT/triton_cache_s24a.tar.gz" .)
    step 100 gpu_split python3 -m pytest -q --tb=short -p no:cacheprovider \
      tests/gpu/test_engine_gpu.py::test_a_step_run_as_passes_matches_one_pass_through_the_kernels
    pack_logs
    ;;
  s24_b)  # session 24, call 2 (issue 40): where passes without recompute beat one pass with it (the
          # pass size; bench/split_step.py), then search (a) with the split on, the host's memory logged
    step 200 split_step python3 bench/split_step.py --layers 32 --jobs 16 --batch 4 --passes 1r,1,2,4,8,16 \
      --out "$OUT/split_step.md"
    export LORAPLEX_SPLIT_STEPS=1 TRITON_CACHE_DIR=/tmp/s24_triton
    search_a 360 330
    pack_logs
    ;;
  s24_c)  # session 24, call 3 (issue 40): search (a) on an 80 GB card with the split steps on (the model on
          # tmpfs, the checkpoints on the disk)
    export LORAPLEX_SPLIT_STEPS=1 TRITON_CACHE_DIR=/tmp/s24_triton
    search_a 560 530
    pack_logs
    ;;
  s24_d)  # session 24, call 4 (issue 40): the same with the split off (recompute where one pass needs it)
    export TRITON_CACHE_DIR=/tmp/s24_triton
    search_a 560 530
    pack_logs
    ;;
  s24_e)  # session 24, call 5 (issues 40, 41): search (a) on the 80 GB card with half its memory kept
          # free of parked states (LORAPLEX_PARK_RESERVE=0.5: its evaluations ran 8 sequences a forward
          # beside ~50 GB resident at 0.15), then the 60-step task (the linked final exports, the
          # overlapped end)
    export TRITON_CACHE_DIR=/tmp/s24_triton
    LORAPLEX_PARK_RESERVE=0.5 search_a 330 300
    task60 200
    pack_logs
    ;;
  s24_f)  # session 24, call 6 (issue 40): search (a) on the 80 GB card with evaluation forwards sized by a
          # no-grad forward's bytes per token (MemoryPlan.eval_max_batch: 0.45 of a recompute step's)
    export TRITON_CACHE_DIR=/tmp/s24_triton
    search_a 330 300
    pack_logs
    ;;
  s24_g)  # session 24, call 8 (issues 40, 41, 44): every GPU test on the code that lands
    step 420 gpu_tests python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu
    pack_logs
    ;;
  s24_h)  # session 24, call 10 (issue 40): search (a) on the 80 GB card with the pinned pool sized for
          # every state (device-parked ones too) and states moved out of the device one at a time
    export TRITON_CACHE_DIR=/tmp/s24_triton
    search_a 330 300
    pack_logs
    ;;
  s25_a)  # session 25, call 1 (issue 40): search (a) on the 80 GB card with evaluation forwards sized by a
          # no-grad forward's room in tokens (MemoryPlan.eval_tokens) on a copy of its jobs' adapters
          # alone, run eagerly (calls 1-2); the background pinning yielding the driver half the time
          # (PinnedPool.yield_ratio, call 3: reverted); no pause of the pinning and no emptied cache
          # around evaluations (call 4); copies per forward group (call 5); the cache emptied after an
          # evaluation again and steps over 8k tokens never captured (call 6)
    export TRITON_CACHE_DIR=/tmp/s25_triton
    search_a 560 530
    pack_logs
    ;;
  s25_b)  # session 25, call 2 (issues 40, 41): the 60-step task, then every GPU test on the code that lands
    export TRITON_CACHE_DIR=/tmp/s25_triton
    task60 170
    step 380 gpu_tests python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu
    pack_logs
    ;;
  s25_c)  # session 25, call 8 (issue 40): the graph tests again (evaluation graphs with bf16 adapters), then
          # search (a) once more on the code that lands (calls vary by up to ~25 s)
    export TRITON_CACHE_DIR=/tmp/s25_triton
    step 120 gpu_graph_tests python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_step_graphs_gpu.py
    search_a 420 400
    pack_logs
    ;;
  s25_d)  # session 25, call 9 (issue 40): pinning in the background by method, against a launch-bound loop
    step 200 pin_probe python3 bench/pin_probe.py --gb 8 --json "$OUT/pin_probe.json"
    step 120 pin_probe_64 python3 bench/pin_probe.py --gb 4 --chunk-mb 64 --json "$OUT/pin_probe_64.json"
    ;;
  s25_e)  # session 25, call 10 (issue 40): the park pool's chunks pinned by registering memory the pinner
          # faulted in (huge pages), not cudaHostAlloc: its GPU test, then search (a)
    export TRITON_CACHE_DIR=/tmp/s25_triton
    step 120 gpu_park_tests python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_park_gpu.py
    search_a 420 400
    pack_logs
    ;;
  s26_a)  # session 26, calls 1-2 (issues 40, 41): the fused norms and MLP gate (trainer.fused_blocks): their
          # GPU test, the side-by-side bench at 32 layers, then the 60-step task in a fresh process whose
          # Triton cache starts as the shipped archive (what compiles in the task are the new kernels);
          # that cache comes back as the next archive
    export TRITON_CACHE_DIR=/tmp/s26_pre
    step 150 gpu_norm_act python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_norm_act_gpu.py
    step 200 fused_blocks python3 bench/fused_blocks.py --layers 32 --out "$OUT/fused_blocks.md" --json "$OUT/fused_blocks.json"
    export TRITON_CACHE_DIR=/tmp/s26/triton
    rm -rf /tmp/s26
    task60 170
    echo "cubins after: $(cubins)," \
      "shipped: $(shipped_cubins)" | tee -a "$OUT/steps.txt"
    tar -C /tmp/s26 -czf "$OUT/triton_cache_sm90.tar.gz" triton
    pack_logs
    ;;
  s26_b)  # session 26, call 3 (issues 40, 41): with the archive that call 2 brought back (the fused kernels
          # shipped): the 60-step task in a fresh process (nothing should compile in it), then search (a)
    export TRITON_CACHE_DIR=/tmp/s26b/triton
    rm -rf /tmp/s26b
    task60 150
    echo "cubins after: $(cubins)," \
      "shipped: $(shipped_cubins)" | tee -a "$OUT/steps.txt"
    search_a 380 360
    pack_logs
    ;;
  s26_c)  # session 26, call 4 (issues 40, 41): the 60-step task in fresh processes, modules' own forwards
          # (LORAPLEX_FUSED_BLOCKS=0) against the fused ones, side by side on one machine; then every GPU test
    export TRITON_CACHE_DIR=/tmp/s26c/triton
    rm -rf /tmp/s26c
    step 150 task60_plain env LORAPLEX_FUSED_BLOCKS=0 python3 bench/executor_task.py --layers 32 --steps 60 --runs cold \
      --out "$OUT/executor_task60_plain.md" --json "$OUT/executor_task60_plain.json"
    task60 150
    step 280 gpu_tests python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu
    pack_logs
    ;;
  s26_d)  # session 26, call 5 (issue 40): search (a) with the modules' own forwards, then with the fused ones,
          # after a short warm-up process (call 4: a fresh machine's first process ran the 60-step task's
          # training 1.7x slower than the next one did)
    export TRITON_CACHE_DIR=/tmp/s26d/triton
    rm -rf /tmp/s26d
    step 90 warmup python3 bench/executor_task.py --layers 2 --steps 10 --runs cold --work /tmp/s26d/warm \
      --out "$OUT/warmup.md"
    export LORAPLEX_FUSED_BLOCKS=0
    search_a 280 260
    unset LORAPLEX_FUSED_BLOCKS
    mv "$OUT/search_a.json" "$OUT/search_a_plain.json"; mv "$OUT/search_a.md" "$OUT/search_a_plain.md"
    mv "$OUT/host_memory.txt" "$OUT/host_memory_plain.txt"
    search_a 280 260
    pack_logs
    ;;
  s26_e)  # session 26, call 6 (issues 40, 41): after a warm-up process, the 60-step task with the modules'
          # own forwards and with the fused ones, then search (a) with the pinned pool growing on a miss
          # (by registration, not cudaHostAlloc) and its counters in the timings
    export TRITON_CACHE_DIR=/tmp/s26e/triton
    rm -rf /tmp/s26e
    step 90 warmup python3 bench/executor_task.py --layers 2 --steps 10 --runs cold --work /tmp/s26e/warm \
      --out "$OUT/warmup.md"
    step 130 task60_plain env LORAPLEX_FUSED_BLOCKS=0 python3 bench/executor_task.py --layers 32 --steps 60 --runs cold \
      --out "$OUT/executor_task60_plain.md" --json "$OUT/executor_task60_plain.json"
    task60 130
    search_a 300 280
    rm -f "$OUT/warmup.md"
    pack_logs
    ;;
  s26_f)  # session 26, call 7 (issue 40): the park and fused-kernel GPU tests, then search (a) with the pool
          # growing up to half the host's memory (call 6: 25 parks missed it at a quarter)
    export TRITON_CACHE_DIR=/tmp/s26f/triton
    rm -rf /tmp/s26f
    step 120 gpu_park_norm python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_park_gpu.py \
      tests/gpu/test_norm_act_gpu.py
    search_a 320 300
    pack_logs
    ;;
  s26_g)  # session 26, call 9 (issue 40), run on branch rope-fused (RoPE on a fused kernel): the fused kernels'
          # GPU test (its RoPE test failed: 1-ulp differences; the RoPE probe rejected the kernel), the
          # side-by-side bench, search (a). On main this phase runs the same steps without RoPE
    export TRITON_CACHE_DIR=/tmp/s26g/triton
    rm -rf /tmp/s26g
    step 90 gpu_norm_act python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_norm_act_gpu.py
    step 160 fused_blocks python3 bench/fused_blocks.py --layers 32 --json "$OUT/fused_blocks.json"
    search_a 280 260
    tar -C /tmp/s26g -czf "$OUT/triton_cache_sm90.tar.gz" triton
    pack_logs
    rm -f "$OUT"/*.txt "$OUT/search_a.md"
    ;;
  s27_a)  # session 27, call 1 (issues 40, 41): where the end's samples go (the decode per LoRA form and
          # attention backend, kernels profiled), then the 60-step task and search (a) with the allocator's
          # retries, the pool's pinning seconds and the writer's backlog per step and evaluation (the slow
          # 11-job evaluation of session 26)
    export TRITON_CACHE_DIR=/tmp/s27a/triton
    rm -rf /tmp/s27a
    step 150 samples_decode python3 bench/samples_decode.py --layers 32 --new 128 --work /dev/shm/sd \
      --variants compose:math,fused:efficient,compose:efficient --json "$OUT/samples_decode.json" --out "$OUT/samples_decode.md"
    rm -rf /dev/shm/sd
    task60 120
    search_a 290 270
    pack_logs
    ;;
  s27_b)  # session 27, call 2 (issues 40, 41): call 1 found Triton compiling inside search (a) (its cache
          # grew 82 -> 100 entries during the timed arm; the 11-job evaluation that took 13.9 s compiled 12
          # kernels). Search (a) and the 60-step task from the shipped archive only; the cache they leave
          # comes back as the next archive
    export TRITON_CACHE_DIR=/tmp/s27b/triton
    rm -rf /tmp/s27b
    search_a 300 280
    echo "cache entries after search (a): $(ls "$TRITON_CACHE_DIR" | wc -l)" | tee -a "$OUT/steps.txt"
    task60 130
    echo "cache entries after the 60-step task: $(ls "$TRITON_CACHE_DIR" | wc -l)," \
      "cubins $(cubins)," \
      "shipped: $(shipped_cubins)" | tee -a "$OUT/steps.txt"
    tar -C /tmp/s27b -czf "$OUT/triton_cache_sm90.tar.gz" triton
    pack_logs
    rm -f "$OUT/search_a.md" "$OUT/executor_task60.md" "$OUT/host_memory.txt"  # at most 8 files come back
    ;;
  s27_c)  # session 27, call 5 (issues 40, 41): the archive that call 4 brought back (87 cubins: what search (a)
          # and the 60-step task compiled) shipped; the same two runs from it, counting what still compiles
    export TRITON_CACHE_DIR=/tmp/s27c/triton
    rm -rf /tmp/s27c
    search_a 300 280
    echo "cache entries after search (a): $(ls "$TRITON_CACHE_DIR" | wc -l)" | tee -a "$OUT/steps.txt"
    task60 130
    echo "cache entries after the 60-step task: $(ls "$TRITON_CACHE_DIR" | wc -l)," \
      "shipped: $(shipped_cubins) cubins" | tee -a "$OUT/steps.txt"
    pack_logs
    rm -f "$OUT/search_a.md" "$OUT/executor_task60.md" "$OUT/host_memory.txt"
    ;;
  s27_d)  # session 27, call 6 (issue 40): search (a) with its third evaluation (11 jobs at one job a forward,
          # 12.6-13.9 s against ~5 s for 10 jobs later; nothing compiles in it since call 5) under torch.profiler
    export TRITON_CACHE_DIR=/tmp/s27d/triton
    rm -rf /tmp/s27d
    LORAPLEX_BENCH_PROFILE_EVAL=2 search_a 300 280
    pack_logs
    rm -f "$OUT/search_a.md" "$OUT/host_memory.txt"
    ;;
  s27_e)  # session 27, call 7 (issue 40): call 6 found the third evaluation host-bound (kernels 4.9 s of
          # 22 s profiled; FusedArenaFn 3.4 ms of host time a call, 2,464 calls): its Python functions, by cProfile
    export TRITON_CACHE_DIR=/tmp/s27e/triton
    rm -rf /tmp/s27e
    LORAPLEX_BENCH_CPROFILE_EVAL=2 search_a 300 280
    pack_logs
    rm -f "$OUT/search_a.md" "$OUT/host_memory.txt"
    ;;
  s27_f)  # session 27, call 8 (issues 40, 41): call 7's cProfile found the third evaluation compiling 10 kernels
          # (ptxas, LLVM: ~6 s) although the shipped archive holds them: their group files named the device's
          # cache directory, so Triton took every shipped entry for a miss. With the seed rewriting them:
          # search (a) (that evaluation cProfiled again) and the 60-step task
    export TRITON_CACHE_DIR=/tmp/s27f/triton
    rm -rf /tmp/s27f
    LORAPLEX_BENCH_CPROFILE_EVAL=2 search_a 300 280
    task60 130
    pack_logs
    rm -f "$OUT/search_a.md" "$OUT/executor_task60.md" "$OUT/host_memory.txt"
    ;;
  s28_a)  # session 28, call 1 (issues 41, 40): a fresh node's first process (the warm host: process start ->
          # A's first step, with the kernels found since session 27's seed fix; B joining it; samples on
          # demand), the 60-step task in the next process, then the decode with its token steps over the
          # cache's own key/value heads (trainer.decode_attention) against transformers' SDPA function
    export TRITON_CACHE_DIR=/tmp/s28a/triton
    rm -rf /tmp/s28a
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site step 230 warm_host python3 bench/warm_host.py --layers 32 --n-train 120 \
      --work /tmp/executor_task --deadline-s 210 --out "$OUT/warm_host.md" --json "$OUT/warm_host.json"
    step 130 task60 python3 bench/executor_task.py --layers 32 --steps 60 --runs cold --work /tmp/executor_task \
      --reuse --out "$OUT/executor_task60.md" --json "$OUT/executor_task60.json"
    step 150 samples_decode python3 bench/samples_decode.py --layers 32 --new 128 --model /tmp/executor_task/model \
      --skip-eager --variants fused:math:nogqa --json "$OUT/samples_decode.json" --out "$OUT/samples_decode.md"
    pack_logs
    rm -f "$OUT/warm_host.md" "$OUT/executor_task60.md" "$OUT/samples_decode.md"
    ;;
  s28_b)  # session 28, call 2 (issues 41, 40): call 1's loads took 13.7 s (the warm host's first process) and
          # 15.1 s (the 60-step task after it) against 2-3 s in earlier calls: the 60-step task as a fresh
          # machine's first process with the load's parts logged, the load alone in parts twice (the build on
          # the device, the file reads, load_to_device), then search (a) (small steps covering larger captures;
          # its loop time outside the phases by part)
    export TRITON_CACHE_DIR=/tmp/s28b/triton
    rm -rf /tmp/s28b
    (free -g; grep -i -E "^(dirty|writeback|cached)" /proc/meminfo) | tee -a "$OUT/steps.txt"
    task60 150
    (free -g; grep -i -E "^(dirty|writeback|cached)" /proc/meminfo) | tee -a "$OUT/steps.txt"
    for i in 1 2; do
      step 60 "fast_load$i" python3 bench/fast_load.py /tmp/executor_task/model --parts --json "$OUT/fast_load.jsonl"
    done
    rm -rf /tmp/executor_task
    search_a 300 270
    pack_logs
    rm -f "$OUT/search_a.md" "$OUT/executor_task60.md" "$OUT/host_memory.txt"
    ;;
  s28_c)  # session 28, call 3 (issues 41, 40): the host process's imports (-X importtime), the warm host as a
          # fresh machine's first process (the load by part, the data tokenised in batches), then search (a)
          # with split steps on (LORAPLEX_SPLIT_STEPS=1: a step that would recompute runs as passes without;
          # off since session 23 because each new pass shape compiled kernels, which the seed fix may have
          # ended): the Triton cache counted before and after, and brought back if it grew
    export TRITON_CACHE_DIR=/tmp/s28c/triton
    rm -rf /tmp/s28c
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:$PWD python3 -X importtime -c "import worker.host" 2> "$OUT/importtime.txt" >/dev/null
    sort -t'|' -k2 -n -r "$OUT/importtime.txt" | head -40 > "$OUT/importtime_top.txt"; rm -f "$OUT/importtime.txt"
    PYTHONPATH=/tmp/site step 220 warm_host python3 bench/warm_host.py --layers 32 --n-train 120 \
      --work /tmp/executor_task --deadline-s 200 --out "$OUT/warm_host.md" --json "$OUT/warm_host.json"
    rm -rf /tmp/executor_task
    before=$(cubins)
    LORAPLEX_SPLIT_STEPS=1 search_a 300 270
    after=$(cubins)
    echo "cubins before search (a): $before, after: $after" | tee -a "$OUT/steps.txt"
    [ "$after" -gt "$before" ] && tar -C /tmp/s28c -czf "$OUT/triton_cache_sm90.tar.gz" triton
    pack_logs
    rm -f "$OUT/search_a.md" "$OUT/warm_host.md" "$OUT/host_memory.txt"
    ;;
  s28_d)  # session 28, call 4 (issues 41, 40): call 3's warm host spent 13.7 s in its load phase of which the
          # load's parts timed 3.5 s: the import chain of a fresh process stage by stage, the GPU tests of the
          # decode, the step graphs and the kernel cache, then the warm host again as a fresh machine's first
          # process (the load's parts now with transformers' first import and the process's age at the load)
    export TRITON_CACHE_DIR=/tmp/s28d/triton
    rm -rf /tmp/s28d
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site:$PWD python3 -c "
import time; t = [time.perf_counter()]
import worker.host; t.append(time.perf_counter())
import trainer.executor; t.append(time.perf_counter())
from transformers import AutoTokenizer; t.append(time.perf_counter())
from transformers import AutoModelForCausalLM; import transformers.models.llama.modeling_llama; t.append(time.perf_counter())
import torch; torch.cuda.init(); torch.empty(1, device='cuda'); t.append(time.perf_counter())
names = ['worker.host', 'trainer.executor', 'transformers AutoTokenizer', 'llama modeling', 'CUDA ready']
print('import chain s:', {n: round(b - a, 2) for n, a, b in zip(names, t, t[1:])})
" 2>&1 | tee -a "$OUT/steps.txt"
    step 240 gpu_tests python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_samples_gpu.py \
      tests/gpu/test_step_graphs_gpu.py tests/gpu/test_kernel_cache_gpu.py
    PYTHONPATH=/tmp/site step 220 warm_host python3 bench/warm_host.py --layers 32 --n-train 120 \
      --work /tmp/executor_task --deadline-s 200 --out "$OUT/warm_host.md" --json "$OUT/warm_host.json"
    pack_logs
    rm -f "$OUT/warm_host.md"
    ;;
  s28_imports)  # session 28, call 5 (issue 41): call 4's cold host spent 7.2 s in transformers' first import
                # (`from transformers import AutoTokenizer`) of its 14.5 s to the first step: which modules, and
                # whether a second process pays it again (files read once, bytecode compiled once)
    for i in 1 2; do
      python3 -X importtime -c "import torch, trainer.executor; from transformers import AutoTokenizer" 2> "$OUT/imp$i.txt"
      echo "run $i: $(grep -E '\| transformers$' "$OUT/imp$i.txt")" | tee -a "$OUT/steps.txt"
      sort -t'|' -k2 -n -r "$OUT/imp$i.txt" | head -60 > "$OUT/importtime_top$i.txt"; rm -f "$OUT/imp$i.txt"
    done
    python3 -c "import importlib.metadata as m; print(len(list(m.distributions())), 'distributions')" | tee -a "$OUT/steps.txt"
    ;;
  s28_e)  # session 28, call 6 (issues 41, 40), the code that lands: a fresh machine's spare host (imports and
          # CUDA ahead of any placement, the product's default) given task A, B joining, samples on demand;
          # the 60-step task in the next process; search (a) (split steps off, the refreshed archive)
    export TRITON_CACHE_DIR=/tmp/s28e/triton
    rm -rf /tmp/s28e
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site step 180 warm_spare python3 bench/warm_host.py --spare --layers 32 --n-train 120 \
      --work /tmp/executor_task --deadline-s 170 --out "$OUT/warm_spare.md" --json "$OUT/warm_spare.json"
    step 100 task60 python3 bench/executor_task.py --layers 32 --steps 60 --runs cold --work /tmp/executor_task \
      --reuse --out "$OUT/executor_task60.md" --json "$OUT/executor_task60.json"
    rm -rf /tmp/executor_task
    search_a 300 260
    pack_logs
    rm -f "$OUT/search_a.md" "$OUT/warm_spare.md" "$OUT/executor_task60.md" "$OUT/host_memory.txt"
    ;;
  s28_f)  # session 28, call 7: every GPU test on the code that lands
    step 420 gpu_tests python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu
    ;;
  s29_a)  # session 29, call 1 (issue 41): a fresh process against a process forked by the node's zygote
          # (worker.zygote: the executor's imports done before the placement, CUDA untouched). The GPU
          # test of a forked child, then the warm host twice, each with its own empty Triton cache
          # (the shipped archive) and no stored memory model: a new interpreter, then forked
    export TRITON_CACHE_DIR=/tmp/s29a/triton0
    rm -rf /tmp/s29a
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site step 150 gpu_test_zygote python3 -m pytest -q --tb=short -p no:cacheprovider \
      tests/gpu/test_zygote_gpu.py
    TRITON_CACHE_DIR=/tmp/s29a/triton1 LORAPLEX_PROFILE_CACHE=/tmp/s29a/profiles1.json PYTHONPATH=/tmp/site \
      step 200 warm_host_exec python3 bench/warm_host.py --layers 32 --n-train 120 --work /tmp/executor_task \
      --deadline-s 190 --json "$OUT/warm_host_exec.json"
    TRITON_CACHE_DIR=/tmp/s29a/triton2 LORAPLEX_PROFILE_CACHE=/tmp/s29a/profiles2.json PYTHONPATH=/tmp/site \
      step 200 warm_host_zygote python3 bench/warm_host.py --layers 32 --n-train 120 --work /tmp/executor_task \
      --reuse --zygote --deadline-s 190 --json "$OUT/warm_host_zygote.json"
    pack_logs
    ;;
  s29_b)  # session 29, call 2 (issues 41, 40): the end of a task without waiting for the writer (the samples
          # read a best adapter still being written from its write's snapshot; the last checkpoint does not
          # wait for the one in flight): the 60-step task in a fresh process, then search (a)
    export TRITON_CACHE_DIR=/tmp/s29b/triton
    rm -rf /tmp/s29b
    task60 150
    rm -rf /tmp/executor_task
    search_a 300 270
    pack_logs
    rm -f "$OUT/search_a.md" "$OUT/executor_task60.md" "$OUT/host_memory.txt"
    ;;
  s29_c)  # session 29, call 3 (issues 41, 40), the code that lands: every GPU test, then a spare forked by the
          # node's zygote (its warm-up is then the CUDA context alone) given task A of a model it never ran
    export TRITON_CACHE_DIR=/tmp/s29c/triton
    rm -rf /tmp/s29c
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site step 330 gpu_tests python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu
    LORAPLEX_PROFILE_CACHE=/tmp/s29c/profiles.json PYTHONPATH=/tmp/site step 200 warm_spare_zygote \
      python3 bench/warm_host.py --layers 32 --n-train 120 --work /tmp/executor_task --zygote --spare \
      --deadline-s 190 --json "$OUT/warm_spare_zygote.json"
    pack_logs
    ;;
  s29_d)  # session 29, call 5 (issues 41, 40): call 2 again on a fresh machine (the code that lands, whose
          # trainer and worker are call 2's): the 60-step task in a fresh process, then search (a)
    export TRITON_CACHE_DIR=/tmp/s29d/triton
    rm -rf /tmp/s29d
    task60 150
    rm -rf /tmp/executor_task
    search_a 300 270
    pack_logs
    rm -f "$OUT/search_a.md" "$OUT/executor_task60.md" "$OUT/host_memory.txt"
    ;;
  s30_a)  # session 30, call 1 (issues 40, 41): a graphed step decides recompute from the row it runs (no
          # padding allowance; off where a capture without recompute replays it): the zygote's and the
          # graphs' GPU tests, the 60-step task in a fresh process, then search (a)
    export TRITON_CACHE_DIR=/tmp/s30a/triton
    rm -rf /tmp/s30a
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site step 120 gpu_tests_graphs python3 -m pytest -q --tb=short -p no:cacheprovider \
      tests/gpu/test_zygote_gpu.py tests/gpu/test_step_graphs_gpu.py
    task60 150
    rm -rf /tmp/executor_task
    search_a 300 270
    pack_logs
    rm -f "$OUT/search_a.md" "$OUT/executor_task60.md" "$OUT/host_memory.txt"
    ;;
  s30_b)  # session 30, call 2 (issues 40, 41): the decode's capture checks its own thread alone (call 1's
          # 60-step task failed: the writer thread's event wait during the samples' capture): every GPU
          # test, then the 60-step task in a fresh process
    export TRITON_CACHE_DIR=/tmp/s30b/triton
    rm -rf /tmp/s30b
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site step 420 gpu_tests python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu
    task60 150
    pack_logs
    rm -f "$OUT/executor_task60.md"
    ;;
  s30_c)  # session 30, call 3 (issues 40, 41): a capture without recompute decides with the policy's
          # allowance (call 2's task captured a 7,168-token key without it: 40 GB of pool); where a
          # chunk's pinning goes (fault, register); the 60-step task in a fresh process; search (a)
    export TRITON_CACHE_DIR=/tmp/s30c/triton
    rm -rf /tmp/s30c
    step 60 pin_split python3 bench/pin_probe.py --split 12 --methods huge --gb 4 --json "$OUT/pin_split.json"
    task60 150
    rm -rf /tmp/executor_task
    search_a 300 270
    pack_logs
    rm -f "$OUT/search_a.md" "$OUT/executor_task60.md" "$OUT/host_memory.txt"
    ;;
  s30_d)  # session 30, call 4 (issues 40, 41), the code that lands: the park pool's background target up
          # to the pool's own limit (half the host; a quarter left search (a) 30 chunks short in every
          # call, pinned on its loop): search (a), then every GPU test in the call's remaining time
    export TRITON_CACHE_DIR=/tmp/s30d/triton
    rm -rf /tmp/s30d
    search_a 300 270
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site step $((590 - SECONDS)) gpu_tests python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu
    pack_logs
    rm -f "$OUT/search_a.md" "$OUT/host_memory.txt"
    ;;
  s30_e)  # session 30, call 5 (issues 40, 41), the code that lands: the pinner's chunks hold the largest
          # tensor a park takes (call 4 still grew the pool by 30 chunks on the loop: rank-64 states of
          # 671 MB a tensor against 256 MB chunks): search (a), then the GPU tests call 4 did not reach
          # and the parks' own
    export TRITON_CACHE_DIR=/tmp/s30e/triton
    rm -rf /tmp/s30e
    search_a 300 270
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site step $((440 - SECONDS)) gpu_tests_rest python3 -m pytest -q --tb=short -p no:cacheprovider \
      tests/gpu/test_park_gpu.py tests/gpu/test_step_graphs_gpu.py tests/gpu/test_task_e2e_gpu.py \
      tests/gpu/test_varlen_gpu.py tests/gpu/test_zygote_gpu.py
    pack_logs
    rm -f "$OUT/search_a.md" "$OUT/host_memory.txt"
    ;;
  s31_a)  # the next session, call 1 (issue 40): the park pool's background target at a quarter of the host
          # against half (LORAPLEX_PIN_SHARE), both with chunks that hold a park's largest tensor. Session
          # 30's call 5 (half): park+resume 0.11 s, but its pinner ran 11.7 s beside the steps (6.5 s at a
          # quarter) and training took 55.0 s against 51.9-52.4 s. Search (a) twice on one machine
    export TRITON_CACHE_DIR=/tmp/s31a/triton
    rm -rf /tmp/s31a
    export LORAPLEX_PIN_SHARE=0.25
    search_a 280 250
    mv "$OUT/search_a.json" "$OUT/search_a_share025.json"; mv "$OUT/search_a.log" "$OUT/search_a_share025.log"
    unset LORAPLEX_PIN_SHARE
    search_a 280 250
    # session 30 reshaped this file's setup (one helper) after its last GPU run
    step $((590 - SECONDS)) gpu_tests_samples python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_samples_gpu.py
    pack_logs
    rm -f "$OUT/search_a.md" "$OUT/host_memory.txt"
    ;;
  s31_b)  # session 31, call 2 (issue 40): the rotary embedding on one kernel each way (kernels.rope). The
          # three arms on one engine at 32 layers (plain, norms+MLP fused, + rotary), its GPU tests, then
          # search (a) with it; the Triton cache it leaves (the shipped one + the rotary kernels) comes back
    export TRITON_CACHE_DIR=/tmp/s31b/triton
    rm -rf /tmp/s31b
    search_a 280 250
    step 170 fused_blocks python3 bench/fused_blocks.py --layers 32 --warmup 2 --iters 5 \
      --out "$OUT/fused_blocks_rope_h100.md" --json "$OUT/fused_blocks_rope_h100.json"
    step $((590 - SECONDS)) gpu_tests_norm python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_norm_act_gpu.py
    (cd /tmp/s31b && tar -czf "$OUT/triton_cache_sm90.tar.gz" triton)
    pack_logs
    rm -f "$OUT/search_a.md" "$OUT/host_memory.txt"
    ;;
  s31_c)  # session 31, call 5 (issue 40): s31_b again after call 2 found the rotary probe refusing its own kernel
          # on the GPU (the kernel's roundings differ from the ops' there: it now computes in float32 and
          # rounds once, and the probe's tolerance scales with the products): its GPU tests, the three arms,
          # then search (a) with the rotary kernel; the Triton cache it leaves comes back
    export TRITON_CACHE_DIR=/tmp/s31c/triton
    rm -rf /tmp/s31c
    step 100 gpu_tests_norm python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_norm_act_gpu.py
    step 170 fused_blocks python3 bench/fused_blocks.py --layers 32 --warmup 2 --iters 5 \
      --out "$OUT/fused_blocks_rope_h100.md" --json "$OUT/fused_blocks_rope_h100.json"
    search_a $((590 - SECONDS)) $((560 - SECONDS))
    (cd /tmp/s31c && tar -czf "$OUT/triton_cache_sm90.tar.gz" triton)
    pack_logs
    rm -f "$OUT/search_a.md" "$OUT/host_memory.txt"
    ;;
  s31_d)  # session 31, call 6 (issues 40, 41): from the refreshed archive (the rotary kernels shipped): search (a)
          # with an 8 GB write buffer (call 5, 4 GB: the loop's exports 4.5 s, the writer busy 40 s), the
          # 60-step task in a fresh process, and the kernel cache's GPU tests (nothing compiles)
    export TRITON_CACHE_DIR=/tmp/s31d/triton
    rm -rf /tmp/s31d
    SEARCH_A_EXTRA="--write-buffer-gb 8" search_a 280 250
    task60 130
    step $((590 - SECONDS)) gpu_tests_cache python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_kernel_cache_gpu.py
    pack_logs
    rm -f "$OUT/search_a.md" "$OUT/executor_task60.md" "$OUT/host_memory.txt"
    ;;
  s31_e)  # session 31, call 7 (issue 40): every GPU test with the code that lands (the rotary swap reaches every
          # Llama-style model the tests build)
    export TRITON_CACHE_DIR=/tmp/s31e/triton
    rm -rf /tmp/s31e
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site step $((590 - SECONDS)) gpu_tests python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu
    pack_logs
    ;;
  s31_f)  # session 31, call 8 (issues 40, 41), the code that lands with its defaults: search (a) from the shipped
          # archive (rotary kernels included, 4 GB write buffer), then the 60-step task in a fresh process
    export TRITON_CACHE_DIR=/tmp/s31f/triton
    rm -rf /tmp/s31f
    search_a 300 270
    task60 $((590 - SECONDS))
    pack_logs
    rm -f "$OUT/search_a.md" "$OUT/executor_task60.md" "$OUT/host_memory.txt"
    ;;
  s31_g)  # session 31, call 10 (issue 40): the quality phase alone on seeds 1 and 2, with the rotary kernel and
          # without it (LORAPLEX_FUSED_ROPE=0): does the kernel's rounding move the best validation loss?
    export TRITON_CACHE_DIR=/tmp/s31g/triton
    rm -rf /tmp/s31g
    step 105 quality_rope python3 bench/task_e2e_baselines.py --phase quality --arms a --quality-arms a --seed 1,2 \
      --deadline-s 100 --json "$OUT/quality_rope.json" --out "$OUT/quality_rope.md"
    step 105 quality_norope env LORAPLEX_FUSED_ROPE=0 python3 bench/task_e2e_baselines.py --phase quality --arms a \
      --quality-arms a --seed 1,2 --deadline-s 100 --json "$OUT/quality_norope.json" --out "$OUT/quality_norope.md"
    pack_logs
    ;;
  s32_b)  # session 32, call 2 (issues 40, 41): the static decode without deterministic algorithms and its token
          # steps' attention on two GEMMs from the bf16 cache (trainer.decode_attention): its GPU tests, the
          # samples' decode at 32 layers against the previous commit's (.device/ab_old, carried), then search
          # (a) with checkpoints by time alone (the node's new default) and the 60-step task
    export TRITON_CACHE_DIR=/tmp/s32b/triton
    rm -rf /tmp/s32b
    step 90 gpu_tests_samples python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu/test_samples_gpu.py
    step 150 samples_new python3 bench/samples_decode.py --layers 32 --new 128 --work /dev/shm/sd --skip-eager \
      --json "$OUT/samples_decode_new.json" --out "$OUT/samples_decode_new.md"
    PYTHONPATH=$PWD step 110 samples_old python3 .device/ab_old/bench/samples_decode.py --layers 32 --new 128 \
      --model /dev/shm/sd/model --skip-eager --json "$OUT/samples_decode_old.json" --out "$OUT/samples_decode_old.md"
    rm -rf /dev/shm/sd
    search_a 260 235
    task60 $((590 - SECONDS))
    pack_logs
    rm -f "$OUT/search_a.md" "$OUT/executor_task60.md" "$OUT/host_memory.txt"
    ;;
  s32_c)  # session 32, call 3 (issues 40, 41): every GPU test with the code that lands, then search (a) again
          # (checkpoints by time alone; call 2: 86.5 s, one configuration's decision unlike the small model's)
    export TRITON_CACHE_DIR=/tmp/s32c/triton
    rm -rf /tmp/s32c
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl
    PYTHONPATH=/tmp/site step 400 gpu_tests python3 -m pytest -q --tb=short -p no:cacheprovider tests/gpu
    search_a $((592 - SECONDS)) $((565 - SECONDS))
    pack_logs
    rm -f "$OUT/search_a.md" "$OUT/host_memory.txt"
    ;;
  s32_d)  # session 32, call 4 (issues 40, 41): the code that lands with its defaults: the 60-step task in a
          # fresh process, then search (a) once more (the budget's last ~400 s)
    export TRITON_CACHE_DIR=/tmp/s32d/triton
    rm -rf /tmp/s32d
    task60 110
    search_a $((380 - SECONDS)) $((355 - SECONDS))
    pack_logs
    rm -f "$OUT/search_a.md" "$OUT/executor_task60.md" "$OUT/host_memory.txt"
    ;;
  s33_a)  # the next session, call 1 (issue 40): every (batch size, rank) pair of (c2) at 32 layers, none
          # extrapolated (12 configurations trained whole: ~270 s), and (c3) from them with its own quality
          # phase (its successive-halving decisions) in the same call; (a) comes from search_a (s33_b) on the
          # same device kind. Liger from .whl (carry it: liger_kernel-0.8.5 was downloaded there in session 32)
    baselines_c2c3 /tmp/s33a 590 570 50
    ;;
  s33_b)  # the next session, call 2 (issue 40): search (a) (its steps now record what the device holds at their
          # start: allocated, states parked on the device, the step graphs' pool; session 32 found 27 steps of
          # 7 jobs, ~3.5k tokens, recomputing at 0.37-0.41 s with 53 GB allocated).
          # Then search (a) again with LORAPLEX_SPLIT_STEPS=1 (a step that one pass runs only with recompute
          # runs as passes without it: 1.29x at 4k-token passes in session 24's bench/split_step.py, off
          # since its first-use costs; the Triton kernels now ship ready): its 15 eager recompute steps of
          # 6-41k tokens took 23.4 s of session 32's 48.6 s of training
    export TRITON_CACHE_DIR=/tmp/s33b/triton
    rm -rf /tmp/s33b
    search_a 250 225
    mv "$OUT/search_a.json" "$OUT/search_a_default.json"; mv "$OUT/search_a.log" "$OUT/search_a_default.log"
    LORAPLEX_SPLIT_STEPS=1 search_a $((590 - SECONDS)) $((565 - SECONDS))
    mv "$OUT/search_a.json" "$OUT/search_a_split.json"; mv "$OUT/search_a.log" "$OUT/search_a_split.log"
    pack_logs
    rm -f "$OUT/search_a.md" "$OUT/host_memory.txt"
    ;;
  s33_c)  # the next session (issue 40; session 32 had too little budget left to start a machine for it): where
          # a small replayed step's GPU time goes (2 jobs, ~150-token samples, no recompute, graphs: 65-85 ms a
          # step in search (a) whatever its tokens; ~60-90 s)
    export TRITON_CACHE_DIR=/tmp/s33c/triton
    step 115 host_profile python3 bench/host_profile.py --layers 32 --tokens 150 --recompute 0 --modes graphs \
      --warmup 12 --iters 10 --out "$OUT/host_profile_small_step.md"
    pack_logs
    ;;
  s33_d)  # session 33, call 1 (issue 40): search (a) with each step's memory context (allocated, states parked
          # on the device, the step graphs' pool), then its timing phase with LORAPLEX_SPLIT_STEPS=1, then
          # where a small replayed step's GPU time goes (s33_c's profile)
    export TRITON_CACHE_DIR=/tmp/s33d/triton
    rm -rf /tmp/s33d
    search_a 250 225
    mv "$OUT/search_a.json" "$OUT/search_a_default.json"; mv "$OUT/search_a.log" "$OUT/search_a_default.log"
    LORAPLEX_SPLIT_STEPS=1 SEARCH_A_EXTRA="--phase timing" search_a $((480 - SECONDS)) $((455 - SECONDS))
    mv "$OUT/search_a.json" "$OUT/search_a_split.json"; mv "$OUT/search_a.log" "$OUT/search_a_split.log"
    step $((590 - SECONDS)) host_profile python3 bench/host_profile.py --layers 32 --tokens 150 --recompute 0 \
      --modes graphs --warmup 12 --iters 10 --out "$OUT/host_profile_small_step.md"
    pack_logs
    rm -f "$OUT/search_a.md" "$OUT/host_memory.txt"
    ;;
  s33_e)  # session 33, call 2 (issues 40, 41): search (a) with LORAPLEX_SPLIT_STEPS=1 (quality phase and all:
          # (a)'s timing replays it), against s33_d's default; then the 60-step task with and without split steps
    export TRITON_CACHE_DIR=/tmp/s33e/triton
    rm -rf /tmp/s33e
    LORAPLEX_SPLIT_STEPS=1 search_a 250 225
    mv "$OUT/search_a.json" "$OUT/search_a_split.json"; mv "$OUT/search_a.log" "$OUT/search_a_split.log"
    LORAPLEX_SPLIT_STEPS=1 task60 110
    mv "$OUT/executor_task60.json" "$OUT/executor_task60_split.json"; mv "$OUT/task60.log" "$OUT/task60_split.log"
    task60 $((590 - SECONDS))
    pack_logs
    rm -f "$OUT/search_a.md" "$OUT/host_memory.txt" "$OUT/executor_task60.md"
    ;;
  s33_f)  # session 33, call 3 (issue 40): search (a) with the arenas packed once the warmup ranking evicted (11 GB
          # held for no job pushed its 3.5k-token steps into recompute and kept its 10-20k-token steps from
          # splitting), with split steps off then on; the GPU tests of the packing and the step graphs
    export TRITON_CACHE_DIR=/tmp/s33f/triton
    rm -rf /tmp/s33f
    step 100 gpu_tests python3 -m pytest -q -p no:cacheprovider tests/gpu/test_task_e2e_gpu.py tests/gpu/test_step_graphs_gpu.py
    search_a 230 205
    mv "$OUT/search_a.json" "$OUT/search_a_packed.json"; mv "$OUT/search_a.log" "$OUT/search_a_packed.log"
    LORAPLEX_SPLIT_STEPS=1 search_a $((590 - SECONDS)) $((565 - SECONDS))
    mv "$OUT/search_a.json" "$OUT/search_a_packed_split.json"; mv "$OUT/search_a.log" "$OUT/search_a_packed_split.log"
    pack_logs
    rm -f "$OUT/search_a.md" "$OUT/host_memory.txt"
    ;;
  s33_g)  # session 33, the last call (issues 40, 41): search (a) with the code that lands (arenas packed after a step
          # short of memory, the model's slope floored, ends held for the warmup ranking; split steps off), then
          # every GPU test
    export TRITON_CACHE_DIR=/tmp/s33g/triton
    rm -rf /tmp/s33g
    search_a 190 175
    step $((590 - SECONDS)) gpu_tests python3 -m pytest -q -p no:cacheprovider tests/gpu
    pack_logs
    rm -f "$OUT/search_a.md" "$OUT/host_memory.txt"
    ;;
  s33_h)  # session 33 (issues 40, 41): the 60-step task with split steps, without, with again (each step's synced
          # seconds now recorded; call 2's split run came first, on a cold Triton cache), then search (a) with the
          # code that lands and split steps on
    export TRITON_CACHE_DIR=/tmp/s33h/triton
    rm -rf /tmp/s33h
    LORAPLEX_SPLIT_STEPS=1 task60 100
    mv "$OUT/executor_task60.json" "$OUT/executor_task60_split1.json"; mv "$OUT/task60.log" "$OUT/task60_split1.log"
    task60 100
    mv "$OUT/executor_task60.json" "$OUT/executor_task60_default.json"; mv "$OUT/task60.log" "$OUT/task60_default.log"
    LORAPLEX_SPLIT_STEPS=1 task60 100
    mv "$OUT/executor_task60.json" "$OUT/executor_task60_split2.json"; mv "$OUT/task60.log" "$OUT/task60_split2.log"
    LORAPLEX_SPLIT_STEPS=1 search_a $((590 - SECONDS)) $((570 - SECONDS))
    pack_logs
    rm -f "$OUT/search_a.md" "$OUT/host_memory.txt" "$OUT/executor_task60.md"
    ;;
  s33_i)  # session 33's last call (issue 40, 41): search (a) with the code that lands (the arenas' copy counted
          # as the step's fixed part)
    export TRITON_CACHE_DIR=/tmp/s33i/triton
    rm -rf /tmp/s33i
    search_a 185 170
    pack_logs
    rm -f "$OUT/search_a.md" "$OUT/host_memory.txt"
    ;;
  s34_a)  # session 34, call 1 (issues 40, 41): split steps on by default, the arenas' copy counted as the step's
          # fixed part with evaluation's room kept (states parked on the device go to the host before an
          # evaluation short of room): search (a), then the 60-step task, on one fresh Triton cache seeded from
          # the shipped archive; the cubins they add come back; then the GPU tests of the task
    search_then_task /tmp/s34a 250 230
    step $((590 - SECONDS)) gpu_tests python3 -m pytest -q -p no:cacheprovider tests/gpu/test_task_e2e_gpu.py
    pack_logs
    rm -f "$OUT/search_a.md" "$OUT/host_memory.txt" "$OUT/executor_task60.md"
    ;;
  s34_b)  # session 34, call 2 (issues 40, 41): call 1's arenas' copy counted resident is reverted again (its steps of
          # 11-12 jobs recomputed instead of splitting, the graphs' pool reached 27 GB); states parked on the device
          # leave for a step that then fits without recompute; the refreshed archive (call 1's cache, 139 cubins):
          # search (a), then the 60-step task, on one fresh cache seeded from it; a cubin added means a compile
    search_then_task /tmp/s34b 250 230
    pack_logs
    rm -f "$OUT/search_a.md" "$OUT/host_memory.txt" "$OUT/executor_task60.md"
    ;;
  s34_c)  # session 34, call 3 (issues 40, 41): the archive with call 2's cache merged (143 cubins; call 2's 60-step task
          # compiled 4 fused-GEMM specialisations, 3.3 s of one step): the 60-step task on a fresh cache seeded from it,
          # then every GPU test with the code that lands; the cubins counted after each
    export TRITON_CACHE_DIR=/tmp/s34c/triton
    rm -rf /tmp/s34c
    shipped=$(shipped_cubins)
    task60 100
    after_task=$(cubins)
    step $((590 - SECONDS)) gpu_tests python3 -m pytest -q -p no:cacheprovider tests/gpu
    after=$(cubins)
    echo "cubins shipped: $shipped, after the 60-step task: $after_task, after the GPU tests: $after" | tee -a "$OUT/steps.txt"
    [ "$after_task" -gt "$shipped" ] && tar -C /tmp/s34c -czf "$OUT/triton_cache_sm90.tar.gz" triton
    pack_logs
    rm -f "$OUT/executor_task60.md"
    ;;
  s34_d)  # session 34, call 4 (issues 40, 41): the fused kernels no longer specialised on the token and adapter counts
          # nor on the alignment of their metadata pointers (kernels.fused_lora._VARYING): search (a), then the 60-step
          # task, on a fresh cache seeded from the archive (whose fused-kernel entries these launches mostly miss);
          # that cache comes back (the archive's refresh); then every GPU test
    search_then_task /tmp/s34d 230 210
    step $((590 - SECONDS)) gpu_tests python3 -m pytest -q -p no:cacheprovider tests/gpu
    pack_logs
    rm -f "$OUT/search_a.md" "$OUT/host_memory.txt" "$OUT/executor_task60.md"
    ;;
  s34_e)  # session 34, call 5 (issues 40, 41): the archive refreshed from call 4 (the fused kernels' entries are now
          # those its unspecialised launches compiled, the stale ones dropped: 74 cubins) and the jobs' AdamW as torch's
          # fused kernel per job (clipping as its gradient scale): search (a), then the 60-step task, on a fresh cache
          # seeded from the archive (a cubin added is a compile inside a task), then every GPU test
    search_then_task /tmp/s34e 230 210
    step $((590 - SECONDS)) gpu_tests python3 -m pytest -q -p no:cacheprovider tests/gpu
    pack_logs
    rm -f "$OUT/search_a.md" "$OUT/host_memory.txt" "$OUT/executor_task60.md"
    ;;
  s34_f)  # session 34, call 6 (issue 40): the fused AdamW's GPU test (call 5: the foreach path and the fused kernel
          # apart by more than rtol 1e-5; now bounded by float32 rounding and the update's size, the differences shown)
    step 120 gpu_test_adamw python3 -m pytest -q -p no:cacheprovider tests/gpu/test_fused_adamw_gpu.py tests/gpu/test_engine_gpu.py
    pack_logs
    ;;
  s34_g)  # session 34, call 7 (issue 40): with the fused AdamW and the unspecialised fused kernels, the small replayed
          # step's kernels by GPU time (session 33: AdamW's foreach kernels ~8% of 78.7 ms), then the issue's
          # 200-step, 8-job executor task (its target: 14k training tok/s)
    export TRITON_CACHE_DIR=/tmp/s34g/triton
    rm -rf /tmp/s34g
    step 150 host_profile python3 bench/host_profile.py --layers 32 --tokens 150 --recompute 0 --modes graphs \
      --warmup 12 --iters 10 --out "$OUT/host_profile_small_step_s34_h100.md"
    step $((560 - SECONDS)) executor_task python3 bench/executor_task.py --layers 32 --steps 200 --runs cold \
      --out "$OUT/executor_task200_s34_h100.md" --json "$OUT/executor_task200_s34_h100.json"
    pack_logs
    ;;
  s34_h)  # session 34, call 8 (issues 40, 41): a step that fits without recompute only once a mostly stale graphs'
          # pool is gone drops the captures first (trainer.device_room; call 7's 200-step task recomputed 126 of its
          # 200 steps beside its first steps' captures): the 200-step task, search (a), then the GPU tests of the graphs
    export TRITON_CACHE_DIR=/tmp/s34h/triton
    rm -rf /tmp/s34h
    step 150 executor_task python3 bench/executor_task.py --layers 32 --steps 200 --runs cold \
      --out "$OUT/executor_task200_s34h_h100.md" --json "$OUT/executor_task200_s34h_h100.json"
    search_a 220 200
    step $((590 - SECONDS)) gpu_tests python3 -m pytest -q -p no:cacheprovider tests/gpu/test_step_graphs_gpu.py \
      tests/gpu/test_task_e2e_gpu.py tests/gpu/test_fused_adamw_gpu.py
    pack_logs
    rm -f "$OUT/search_a.md" "$OUT/host_memory.txt"
    ;;
  s35_a)  # session 35, call 1 (issues 40, 41): a capture the device lacks the free memory for now waits (session
          # 34's call 8: three captures failed with 0.2 GB free, their keys eager for good: 21 eager steps), and
          # passes fit once the device's parked states leave (its warmup steps recomputed beside them): search (a)
          # and the 60-step task on a fresh seeded cache; then search (a) again with the allocator's expandable
          # segments (whether the free memory the captures lacked was blocks split by live tensors)
    search_then_task /tmp/s35a 230 210
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True SEARCH_A_NAME=search_a_expandable search_a $((585 - SECONDS)) 190
    pack_logs
    rm -f "$OUT/search_a.md" "$OUT/search_a_expandable.md" "$OUT/host_memory.txt" "$OUT/executor_task60.md"
    ;;
  s35_b)  # session 35, call 2 (issues 40, 41): the code that lands (call 1's passes once the parked states leave are
          # reverted: they compiled 8 kernels and ran no faster; expandable segments recomputed more): search (a) and the
          # 60-step task on a fresh seeded cache, then the 200-step, 8-job task
    search_then_task /tmp/s35b 230 210
    step $((590 - SECONDS)) executor_task python3 bench/executor_task.py --layers 32 --steps 200 --runs cold \
      --out "$OUT/executor_task200_s35_h100.md" --json "$OUT/executor_task200_s35_h100.json"
    pack_logs
    rm -f "$OUT/search_a.md" "$OUT/host_memory.txt" "$OUT/executor_task60.md"
    ;;
  s35_c)  # session 35, call 3 (issue 40): every GPU test on the code that lands
    step 590 gpu_tests python3 -m pytest -q -p no:cacheprovider tests/gpu
    pack_logs
    ;;
  s35_d)  # session 35, call 4 (issue 41): what a capture step of at most 7 jobs holds at its peak (the memory model's
          # worst step in call 2 was a 2-job capture, 30.3 GB against 26.3 predicted; 26.4 and 34.3 GB in other runs)
    export TRITON_CACHE_DIR=/tmp/s35d/triton
    rm -rf /tmp/s35d
    LORAPLEX_BENCH_CAPTURE_PEAKS=7 search_a 300 280
    grep -A13 "^capture step" "$OUT/search_a.log" > "$OUT/capture_peaks.txt"
    pack_logs
    rm -f "$OUT/search_a.md" "$OUT/host_memory.txt"
    ;;
  s35_e)  # session 35, call 5 (issue 41): call 4 again twice, the history recorded around the 2-job steps alone (the
          # tail, where call 2's worst step was): two more chances to catch a tail capture peaking over the model
    export TRITON_CACHE_DIR=/tmp/s35e/triton
    rm -rf /tmp/s35e
    LORAPLEX_BENCH_CAPTURE_PEAKS=2 search_a 280 260
    grep -A13 "^capture step" "$OUT/search_a.log" > "$OUT/capture_peaks_1.txt"
    LORAPLEX_BENCH_CAPTURE_PEAKS=2 SEARCH_A_NAME=search_a_2 search_a $((590 - SECONDS)) 260
    grep -A13 "^capture step" "$OUT/search_a_2.log" > "$OUT/capture_peaks_2.txt"
    pack_logs
    rm -f "$OUT/search_a.md" "$OUT/search_a_2.md" "$OUT/host_memory.txt"
    ;;
  s35_f)  # session 35, call 6 (issue 40): with under 16 steps left and no job queued, a key a capture can replay padded
          # is not captured (call 2's tail captured 3 keys in its last 18 steps, ~0.7 s over their replays): search (a)
          # and the 60-step task on a fresh seeded cache, then the 200-step task
    search_then_task /tmp/s35f 230 210
    step $((590 - SECONDS)) executor_task python3 bench/executor_task.py --layers 32 --steps 200 --runs cold \
      --out "$OUT/executor_task200_s35f_h100.md" --json "$OUT/executor_task200_s35f_h100.json"
    pack_logs
    rm -f "$OUT/search_a.md" "$OUT/host_memory.txt" "$OUT/executor_task60.md"
    ;;
  s35_g)  # session 35, call 7 (issue 40): every GPU test on the code that lands (the horizon rule after call 3's run)
    step 590 gpu_tests python3 -m pytest -q -p no:cacheprovider tests/gpu
    pack_logs
    ;;
  s36_a)  # session 36, call 1 (issue 40): the small steps' LoRA kernels. The shrink/wgrad entries tuned again with
          # 8-16 column splits and 256-row chunks among the candidates (--retune); a replayed 2-job step of 734 tokens
          # with the table before and after (same call, same cache); then one 16-job step of 16k tokens profiled
          # (recompute: the warmup's big steps) beside the backbone alone
    mkdir -p /tmp/old_cfg /tmp/new_cfg && cp kernels/configs/*.json /tmp/old_cfg/
    LORAPLEX_KERNEL_CONFIGS=/tmp/old_cfg step 300 tune python3 bench/tune_kernels.py --retune shrink,shrink_wgrad,wgrad \
      --max-configs 4 --out /tmp/new_cfg/NVIDIA_H100_80GB_HBM3.json
    cp /tmp/new_cfg/*.json "$OUT/"
    for t in old new; do
      LORAPLEX_KERNEL_CONFIGS=/tmp/${t}_cfg step 75 "hostprof_$t" python3 bench/host_profile.py --layers 32 --tokens 150 \
        --recompute 0 --modes graphs --warmup 12 --iters 10 --out "$OUT/host_profile_small_s36_$t.md"
    done
    LORAPLEX_KERNEL_CONFIGS=/tmp/new_cfg step $((590 - SECONDS)) engine16 python3 bench/engine_step.py --jobs 16 \
      --skip-peft --skip-torch --forms fused --warmup 1 --iters 3 --profile "$OUT/engine16_profile_s36.md" \
      --out "$OUT/engine16_s36.md"
    pack_logs
    ;;
  s36_b)  # session 36, call 2 (issue 40): search (a)'s big steps. Its split steps (10-12 jobs, 15-21k tokens, 3-4
          # eager passes without recompute) ran at ~13k tok/s, its 22-24-job steps of 6-9k tokens recomputed at
          # ~9k: each arm of both shapes timed and profiled once (GPU busy share of the wall, kernels)
    step 200 split12 python3 bench/split_step.py --layers 32 --jobs 12 --batch 4 --seq 384 --passes 1r,2,3,4 \
      --warmup 1 --iters 3 --out "$OUT/split12_s36.md" --profile "$OUT/split12_profile_s36.md"
    step $((590 - SECONDS)) split24 python3 bench/split_step.py --layers 32 --jobs 24 --batch 1 --seq 384 \
      --passes 1r,1,2 --warmup 1 --iters 3 --out "$OUT/split24_s36.md" --profile "$OUT/split24_profile_s36.md"
    pack_logs
    ;;
  s36_c)  # session 36, call 3 (issue 40): search (a)'s first evaluation took 4.9-5.0 s in four runs with 3.2-3.5 s of
          # background pinning beside it (a registration holds the driver's lock; the eager forwards' launches wait):
          # search (a) without the hold (LORAPLEX_PIN_HOLD_EVAL=0), then with it (the default), one fresh seeded cache
    export TRITON_CACHE_DIR=/tmp/s36c/triton
    rm -rf /tmp/s36c
    LORAPLEX_PIN_HOLD_EVAL=0 SEARCH_A_NAME=search_a_nohold search_a 240 220
    SEARCH_A_NAME=search_a_hold search_a $((590 - SECONDS)) 220
    pack_logs
    rm -f "$OUT/host_memory.txt"
    ;;
  s36_d)  # session 36, call 4 (issues 40, 41): the code that lands (an evaluation holds the background pinning): search
          # (a) and the 60-step task on a fresh seeded cache (cubins counted), then the 200-step, 8-job task
    search_then_task /tmp/s36d 240 220
    step $((590 - SECONDS)) executor_task python3 bench/executor_task.py --layers 32 --steps 200 --runs cold \
      --out "$OUT/executor_task200_s36_h100.md" --json "$OUT/executor_task200_s36_h100.json"
    pack_logs
    rm -f "$OUT/host_memory.txt" "$OUT/executor_task60.md"
    ;;
  s36_e)  # session 36, call 5 (issue 40): every GPU test on the code that lands
    step 590 gpu_tests python3 -m pytest -q -p no:cacheprovider tests/gpu
    pack_logs
    ;;
  s36_f)  # session 36, call 5 (issues 40, 41): call 3's A/B again without its confound (the shrink candidates added in
          # kernels/fused_lora.py moved every kernel's first line, so Triton's cache keys missed the archive: 39
          # kernels compiled in the first run of a cache; now reverted): search (a) with the hold, then without, on one
          # fresh seeded cache (cubins counted)
    export TRITON_CACHE_DIR=/tmp/s36f/triton
    rm -rf /tmp/s36f
    SEARCH_A_NAME=search_a_hold search_a 240 220
    echo "cubins shipped: $(shipped_cubins), after: $(cubins)" | tee -a "$OUT/steps.txt"
    LORAPLEX_PIN_HOLD_EVAL=0 SEARCH_A_NAME=search_a_nohold search_a $((590 - SECONDS)) 220
    pack_logs
    rm -f "$OUT/host_memory.txt"
    ;;
  s37_a)  # next session (issues 40, 41): the fused MLP's down input rebuilt in the backward (LORAPLEX_MLP_REBUILD=1:
          # a fifth of a step's activations without recompute). Its GPU test; the 60-step task first (it also warms
          # the machine: in session 36 the first search of each call was ~3 s slower in its first eager steps,
          # whatever it ran), then search (a) with the rebuild and without, one fresh seeded cache
    step 120 gpu_rebuild python3 -m pytest -q -p no:cacheprovider tests/gpu/test_mlp_rebuild_gpu.py
    export TRITON_CACHE_DIR=/tmp/s37a/triton
    rm -rf /tmp/s37a
    LORAPLEX_MLP_REBUILD=1 task60 100
    LORAPLEX_MLP_REBUILD=1 SEARCH_A_NAME=search_a_rebuild search_a 200 190
    LORAPLEX_MLP_REBUILD=0 SEARCH_A_NAME=search_a_kept search_a $((590 - SECONDS)) 190
    echo "cubins shipped: $(shipped_cubins), after: $(cubins)" | tee -a "$OUT/steps.txt"
    pack_logs
    rm -f "$OUT/host_memory.txt" "$OUT/executor_task60.md"
    ;;
  s37_b)  # issues 40, 41: the MLP rebuild on by default, the arena's step copy counted per element by the
          # memory model's correction. Its GPU test; search (a) then the 60-step task on a fresh cache seeded from
          # the shipped archive (the rebuild's split passes compile new fused-kernel keys: s37_a compiled 8; the
          # grown cache comes back for the archive); then search (a) again on that cache (the clean measurement)
    step 90 gpu_rebuild python3 -m pytest -q -p no:cacheprovider tests/gpu/test_mlp_rebuild_gpu.py
    search_then_task /tmp/s37b 200 190
    SEARCH_A_NAME=search_a_again search_a $((590 - SECONDS)) 190
    echo "cubins after the second search: $(cubins)" | tee -a "$OUT/steps.txt"
    pack_logs
    rm -f "$OUT/host_memory.txt"
    ;;
  s37_c)  # issues 40, 41: tests/gpu on the code that lands (the refreshed archive), then search (a) on a fresh
          # cache seeded from it: nothing compiles inside
    step 360 gpu_tests python3 -m pytest -q -p no:cacheprovider tests/gpu
    export TRITON_CACHE_DIR=/tmp/s37c/triton
    rm -rf /tmp/s37c
    search_a $((590 - SECONDS)) 190
    echo "cubins shipped: $(shipped_cubins), after: $(cubins)" | tee -a "$OUT/steps.txt"
    pack_logs
    rm -f "$OUT/host_memory.txt"
    ;;
  s37_d)  # issues 40, 41: search (a) on the code that lands (the copy counted per element reverted: with the rebuild
          # off it raised the worst step's error 5% -> 9%), a fresh cache seeded from the shipped archive
    export TRITON_CACHE_DIR=/tmp/s37d/triton
    rm -rf /tmp/s37d
    search_a 200 190
    echo "cubins shipped: $(shipped_cubins), after: $(cubins)" | tee -a "$OUT/steps.txt"
    pack_logs
    rm -f "$OUT/host_memory.txt"
    ;;
  s38_a)  # next session (issue 40's evaluation, 31 s of search (a)'s 77-80 s): every evaluation of search (a) runs
          # ~6.5 ms a sequence (~31k tok/s, ~48% MFU forward only) whatever its job count; the training steps'
          # GEMM runs ~660 TFLOP/s. Where an evaluation's time goes against the backbone's own forward over the
          # same tokens: search (a)'s [12 jobs, 64 examples, 64 a forward, 192 sequences] evaluation and a
          # one-job one, then search (a) with its 4th evaluation under torch.profiler (top kernels in its log)
    step 200 eval_profile_12 python3 bench/eval_profile.py --layers 32 --jobs 12 --chunk 64 --cap 192 --iters 3 \
      --out "$OUT/eval_profile_12_h100.md"
    step 120 eval_profile_1 python3 bench/eval_profile.py --layers 32 --jobs 1 --chunk 64 --cap 64 --iters 3 \
      --out "$OUT/eval_profile_1_h100.md"
    export TRITON_CACHE_DIR=/tmp/s38a/triton
    rm -rf /tmp/s38a
    LORAPLEX_BENCH_PROFILE_EVAL=3 search_a $((590 - SECONDS)) 190
    pack_logs
    rm -f "$OUT/host_memory.txt"
    ;;
  s38_b)  # session 38 (issues 40, 41): grouped-query key/value heads straight to the flash kernel (no expansion), the
          # head's cross-entropy in one kernel (kernels.cross_entropy: new kernels; the grown cache comes back for the
          # archive). The GPU tests they touch; search (a) then the 60-step task on a fresh cache seeded from the
          # shipped archive; search (a) again on that cache (the clean measurement). Tables go in the logs' tarball
          # ($OUT brings back ~8 files)
    step 150 gpu_head python3 -m pytest -q -p no:cacheprovider tests/gpu/test_varlen_gpu.py \
      tests/gpu/test_cross_entropy_gpu.py tests/gpu/test_families_gpu.py
    search_then_task /tmp/s38b 200 190
    SEARCH_A_NAME=search_a_again search_a $((590 - SECONDS)) 190
    echo "cubins after the second search: $(cubins)" | tee -a "$OUT/steps.txt"
    rm -f "$OUT/host_memory.txt"
    (cd "$OUT" && tar -czf logs.tar.gz ./*.log ./*.txt ./*.md && rm -f ./*.log ./*.md)
    ;;
  s38_c)  # session 38 (issues 40, 41): the code that lands (the memory model's head and key/value terms refitted to
          # s38_b's peaks, the archive refreshed with the cross-entropy kernels): every GPU test, then search (a) and
          # the 60-step task on a fresh cache seeded from the shipped archive (nothing compiles inside)
    step 320 gpu_tests python3 -m pytest -q -p no:cacheprovider tests/gpu
    search_then_task /tmp/s38c 175 190
    rm -f "$OUT/host_memory.txt" "$OUT/triton_cache_sm90.tar.gz"
    (cd "$OUT" && tar -czf logs.tar.gz ./*.log ./*.txt ./*.md && rm -f ./*.log ./*.md)
    ;;
  s38_d)  # session 38 (issues 40, 41): a second sample of the code that lands (s38_c's order reversed: the 60-step task
          # first, then search (a)), one fresh cache seeded from the shipped archive; within the call's last ~280 s
    export TRITON_CACHE_DIR=/tmp/s38d/triton
    rm -rf /tmp/s38d
    task60 90
    search_a $((275 - SECONDS)) 190
    echo "cubins shipped: $(shipped_cubins), after: $(cubins)" | tee -a "$OUT/steps.txt"
    rm -f "$OUT/host_memory.txt"
    (cd "$OUT" && tar -czf logs.tar.gz ./*.log ./*.txt ./*.md && rm -f ./*.log ./*.md)
    ;;
  s39_a)  # next session (issues 40, 41): does the memory model's lower head count steer search (a)'s warmup into slower
          # steps? Session 38: with FUSED_HEAD_BYTES 8 (the code that lands) the warmup packed 36 jobs into 7 recomputed
          # 20k-cell steps and trained in 44.0 / 45.6 s; with the head counted at 16 (5a85b48) 40.5 / 43.1 s. The
          # 60-step task first (it warms the machine), then search (a) with the head counted at 16 and at 8, one fresh
          # cache seeded from the shipped archive
    export TRITON_CACHE_DIR=/tmp/s39a/triton
    rm -rf /tmp/s39a
    task60 90
    LORAPLEX_FUSED_HEAD_BYTES=16 SEARCH_A_NAME=search_a_head16 search_a 200 190
    SEARCH_A_NAME=search_a_head8 search_a 200 190
    echo "cubins shipped: $(shipped_cubins), after: $(cubins)" | tee -a "$OUT/steps.txt"
    [ $SECONDS -lt 500 ] && step $((590 - SECONDS)) executor_task200 python3 bench/executor_task.py --layers 32 \
      --steps 200 --runs cold --out "$OUT/executor_task200.md" --json "$OUT/executor_task200.json"
    rm -f "$OUT/host_memory.txt"
    (cd "$OUT" && tar -czf logs.tar.gz ./*.log ./*.txt ./*.md && rm -f ./*.log ./*.md)
    ;;
  s39_b)  # session 39, call 2 (issues 40, 41; H200): the memory model with the step's arena copy counted and the
          # settled line of least relative over-prediction (call 1: 42-60% over on small steps); search (a) then the
          # 60-step task on a fresh seeded cache, the cache brought back where it grew (call 1: 76 -> 84 cubins)
    search_then_task /tmp/s39b 200 190
    [ $SECONDS -lt 480 ] && step $((590 - SECONDS)) executor_task200 python3 bench/executor_task.py --layers 32 \
      --steps 200 --runs cold --out "$OUT/executor_task200.md" --json "$OUT/executor_task200.json"
    rm -f "$OUT/host_memory.txt"
    (cd "$OUT" && tar -czf logs.tar.gz ./*.log ./*.txt ./*.md && rm -f ./*.log ./*.md)
    ;;
  s39_c)  # session 39, call 3 (issues 40, 41; H200): the code that lands: search (a) and the 60-step task on a fresh cache
          # seeded from the archive with call 2's 5 kernels added (81 cubins: none should compile), then every GPU test
    search_then_task /tmp/s39c 200 190
    step $((590 - SECONDS)) gpu_tests python3 -m pytest -q -p no:cacheprovider tests/gpu
    rm -f "$OUT/host_memory.txt"
    (cd "$OUT" && tar -czf logs.tar.gz ./*.log ./*.txt ./*.md && rm -f ./*.log ./*.md)
    ;;
  s39_d)  # session 39, call 4 (issue 41's join, issue 40's small steps; H200): a task joining the warm shared host on the
          # code that lands (admission now counts the step's arena copy), then a small step's kernels by GPU time (the
          # tail phases of search (a) run 1-3 jobs of ~200-1000 tokens at 3-9k tok/s: where their ~60 ms a step goes)
    export TRITON_CACHE_DIR=/tmp/s39d/triton
    rm -rf /tmp/s39d
    warm_spare
    [ $SECONDS -lt 330 ] && step $((400 - SECONDS)) host_profile_small python3 bench/host_profile.py --layers 32 --tokens 100 \
      --recompute 0 --modes graphs --warmup 12 --iters 10 --out "$OUT/host_profile_small_s39_h200.md"
    pack_logs
    ;;
  s39_e)  # session 39, call 5 (issues 40, 41; H200): the code that lands after a review (a capture asks for the step's
          # arena copy too; the envelope's ties take the steeper slope): search (a) on a fresh seeded cache
    export TRITON_CACHE_DIR=/tmp/s39e/triton
    rm -rf /tmp/s39e
    search_a 175 160
    echo "cubins shipped: $(shipped_cubins), after: $(cubins)" | tee -a "$OUT/steps.txt"
    rm -f "$OUT/host_memory.txt"
    (cd "$OUT" && tar -czf logs.tar.gz ./*.log ./*.txt ./*.md && rm -f ./*.log ./*.md)
    ;;
  s40_a)  # session 40, call 1 (issue 40's small steps; H200): a 419-token and a ~1.9k-token step of 2 jobs (graphs) on the
          # shipped table; the fused kernels tuned on this device at 128-2048 rows with the small-step candidates (the
          # larger keys kept from the H100 table), cuBLAS beside them; the same steps on that table, and in the compose form
    export TRITON_CACHE_DIR=/tmp/s40a/triton
    rm -rf /tmp/s40a && mkdir -p /tmp/s40a/cfg && cp kernels/configs/NVIDIA_H100_80GB_HBM3.json /tmp/s40a/cfg/
    hp hp_small_shipped 100
    hp hp_mid_shipped 400
    LORAPLEX_KERNEL_CONFIGS=/tmp/s40a/cfg step 280 tune python3 bench/tune_kernels.py --shapes llama8b \
      --tokens 128,256,512,1024,2048 --ranks 16,64 --fresh-below 2048 --max-configs 0 --cublas
    cp /tmp/s40a/cfg/NVIDIA_H200*.json "$OUT/" 2>/dev/null
    LORAPLEX_KERNEL_CONFIGS=/tmp/s40a/cfg hp hp_small_tuned 100
    LORAPLEX_KERNEL_CONFIGS=/tmp/s40a/cfg hp hp_mid_tuned 400
    [ $SECONDS -lt 500 ] && LORAPLEX_LORA_FORM=compose hp hp_small_compose 100
    (cd "$OUT" && tar -czf logs.tar.gz ./*.log ./*.txt && rm -f ./*.log)
    ;;
  s40_b)  # session 40, call 2 (issue 40's small steps; H200): the H200's own kernel table (call 1's small-row tuning, the
          # H100's entries above 2048 rows) on a fresh cache seeded from the shipped archive: search (a), the 60-step and
          # the 200-step tasks, the 2-job steps of call 1; the cubins counted after each, the cache brought back if it grew
    export TRITON_CACHE_DIR=/tmp/s40b/triton
    rm -rf /tmp/s40b
    echo "cubins shipped: $(shipped_cubins)" | tee -a "$OUT/steps.txt"
    search_a 200 190
    echo "cubins after search (a): $(cubins)" | tee -a "$OUT/steps.txt"
    task60 100
    echo "cubins after the 60-step task: $(cubins)" | tee -a "$OUT/steps.txt"
    [ $SECONDS -lt 430 ] && step $((520 - SECONDS)) executor_task200 python3 bench/executor_task.py --layers 32 \
      --steps 200 --runs cold --out "$OUT/executor_task200.md" --json "$OUT/executor_task200.json"
    echo "cubins after the 200-step task: $(cubins)" | tee -a "$OUT/steps.txt"
    for t in 100 400; do
      [ $SECONDS -lt 530 ] && hp "hp_$t" $t 40
    done
    echo "cubins at the end: $(cubins)" | tee -a "$OUT/steps.txt"
    tar -C /tmp/s40b -czf "$OUT/triton_cache_sm90.tar.gz" triton
    rm -f "$OUT/host_memory.txt"
    (cd "$OUT" && tar -czf logs.tar.gz ./*.log ./*.txt ./*.md && rm -f ./*.log ./*.md)
    ;;
  s40_c)  # session 40, call 3 (issues 40, 41; H200): the code that lands (the H200's table, the archive with call 2's 9
          # kernels: 90 cubins, none should compile): search (a) and the 60-step task on a fresh seeded cache, every GPU test
    search_then_task /tmp/s40c 200 190
    step $((590 - SECONDS)) gpu_tests python3 -m pytest -q -p no:cacheprovider tests/gpu
    rm -f "$OUT/host_memory.txt"
    (cd "$OUT" && tar -czf logs.tar.gz ./*.log ./*.txt ./*.md && rm -f ./*.log ./*.md)
    ;;
  s40_d)  # session 40, call 4 (issue 40's ratios on an H200): every (batch size, rank) pair of (c2) at 32 layers trained
          # whole, (c3) from them with its own quality phase's decisions (s33_a's recipe; (a) from s40_c, the same kind).
          # Liger from .whl (carried: liger_kernel-0.8.5)
    baselines_c2c3 /tmp/s40d 470 450 40
    ;;
  s41_a)  # session 41, call 1 (issue 40: where search (a)'s training steps go; H200): search (a) twice on a seeded cache,
          # torch.profiler over 3 of its 48-job warmup steps (3-5), then over 3 of its 6-job steps (14-16)
    export TRITON_CACHE_DIR=/tmp/s41a/triton
    rm -rf /tmp/s41a
    LORAPLEX_BENCH_PROFILE_A="3:$OUT/profile_a_48jobs.txt" search_a 230 200
    SEARCH_A_NAME=search_a_2 LORAPLEX_BENCH_PROFILE_A="14:$OUT/profile_a_6jobs.txt" search_a $((585 - SECONDS)) 200
    rm -f "$OUT/host_memory.txt"
    pack_logs
    ;;
  s41_b)  # session 41, call 2 (issue 40: the persistent fused GEMM at large steps; H200): one program an SM (the table)
          # against two (tiles that fit twice), forward and dX at the llama8b projections
    export TRITON_CACHE_DIR=/tmp/s41b/triton
    rm -rf /tmp/s41b
    step 400 persist_occupancy python3 bench/persist_occupancy.py --tokens 8192,32768 \
      --out "$OUT/persist_occupancy.md" --json "$OUT/persist_occupancy.json"
    pack_logs
    ;;
  s41_c)  # session 41, call 3 (issues 40, 41; H200): the tasks' data read while the backbone loads (7e5eebc; slower, reverted
          # in 613e9bb): search (a) and the 60-step task on a fresh seeded cache, then every GPU test
    search_then_task /tmp/s41c 200 190
    step $((590 - SECONDS)) gpu_tests python3 -m pytest -q -p no:cacheprovider tests/gpu
    rm -f "$OUT/host_memory.txt"
    (cd "$OUT" && tar -czf logs.tar.gz ./*.log ./*.txt ./*.md && rm -f ./*.log ./*.md)
    ;;
  s41_d)  # session 41, call 4 (issue 40: a 48-job training step's kernels with no evaluation in the window; H200):
          # search (a) with torch.profiler over its steps 5-7 (0-based 4-6: the evaluations of steps 4 and 7 fall outside)
    export TRITON_CACHE_DIR=/tmp/s41d/triton
    rm -rf /tmp/s41d
    LORAPLEX_BENCH_PROFILE_A="4:$OUT/profile_a_48jobs_train.txt" search_a 300 270
    rm -f "$OUT/host_memory.txt"
    pack_logs
    ;;
  s42_a)  # session 42, call 1 (issues 40, 41; H200): jobs waiting for the warmup ranking park (the new default) against
          # training on (--train-while-waiting, the old one), search (a) each on one seeded cache; then the 60-step task
    export TRITON_CACHE_DIR=/tmp/s42a/triton
    rm -rf /tmp/s42a
    search_a 215 200
    SEARCH_A_NAME=search_a_train_on SEARCH_A_EXTRA=--train-while-waiting search_a 215 200
    task60 $((590 - SECONDS))
    echo "cubins shipped: $(shipped_cubins), after: $(cubins)" | tee -a "$OUT/steps.txt"
    rm -f "$OUT/host_memory.txt"
    pack_logs
    ;;
  s42_b)  # session 42, call 2 (issues 40, 41; H200): after call 1, a step under MIN_PASS_TOKENS recomputes rather than
          # spill the waiting jobs' parked states to the host: search (a) (parked) and the 60-step task on a fresh seeded
          # cache, then every GPU test
    search_then_task /tmp/s42b 200 190
    step $((590 - SECONDS)) gpu_tests python3 -m pytest -q -p no:cacheprovider tests/gpu
    rm -f "$OUT/host_memory.txt"
    pack_logs
    ;;
  s42_c)  # session 42, call 3 (issues 40, 41; H200): the shipped archive with call 2's 2 kernels (92 cubins): search (a)
          # and the 60-step task on a fresh seeded cache (nothing may compile), then the 200-step task
    search_then_task /tmp/s42c 200 190
    step $((585 - SECONDS)) task200 python3 bench/executor_task.py --layers 32 --steps 200 --runs cold \
      --out "$OUT/executor_task200.md" --json "$OUT/executor_task200.json"
    rm -f "$OUT/host_memory.txt"
    pack_logs
    ;;
  s42_d)  # session 42, call 4 (issue 40; H200): the code that lands, side by side in one call: search (a) with waiting
          # jobs parked (the default) and training on (--train-while-waiting), one seeded cache
    export TRITON_CACHE_DIR=/tmp/s42d/triton
    rm -rf /tmp/s42d
    search_a 215 200
    SEARCH_A_NAME=search_a_train_on SEARCH_A_EXTRA=--train-while-waiting search_a $((575 - SECONDS)) 200
    echo "cubins shipped: $(shipped_cubins), after: $(cubins)" | tee -a "$OUT/steps.txt"
    rm -f "$OUT/host_memory.txt"
    pack_logs
    ;;
  s43_a)  # session 43, call 1 (issues 40, 41; H200): the staged warmup ranking (a lead quarter of the subset first, the
          # clearly beaten evicted on it) against one stage (--one-stage-ranking), search (a) each on one seeded cache;
          # then the 60-step task
    export TRITON_CACHE_DIR=/tmp/s43a/triton
    rm -rf /tmp/s43a
    search_a 215 200
    SEARCH_A_NAME=search_a_one_stage SEARCH_A_EXTRA=--one-stage-ranking search_a 215 200
    task60 $((585 - SECONDS))
    echo "cubins shipped: $(shipped_cubins), after: $(cubins)" | tee -a "$OUT/steps.txt"
    rm -f "$OUT/host_memory.txt"
    pack_logs
    ;;
  s43_b)  # session 43, call 2 (issues 40, 41; H200): the code that lands (the staged ranking, and no capture of a
          # large key at its job set's last step): search (a) on a fresh seeded cache, every GPU test, then search (a)
          # capturing such keys too (--capture-transient) where the time is left
    export TRITON_CACHE_DIR=/tmp/s43b/triton
    rm -rf /tmp/s43b
    search_a 215 200
    step 300 gpu_tests python3 -m pytest -q -p no:cacheprovider tests/gpu
    if [ $((585 - SECONDS)) -ge 150 ]; then
      SEARCH_A_NAME=search_a_capture_transient SEARCH_A_EXTRA=--capture-transient search_a $((585 - SECONDS)) 200
    fi
    echo "cubins shipped: $(shipped_cubins), after: $(cubins)" | tee -a "$OUT/steps.txt"
    rm -f "$OUT/host_memory.txt"
    pack_logs
    ;;
  s43_c)  # session 43, call 3 (issues 40, 41; H200): the code that lands: search (a) and the 60-step task on a fresh
          # seeded cache (nothing may compile), the 200-step task, then search (a) again where the time is left
    search_then_task /tmp/s43c 200 190
    step 120 task200 python3 bench/executor_task.py --layers 32 --steps 200 --runs cold \
      --out "$OUT/executor_task200.md" --json "$OUT/executor_task200.json"
    if [ $((585 - SECONDS)) -ge 150 ]; then
      SEARCH_A_NAME=search_a_again search_a $((585 - SECONDS)) 200
    fi
    rm -f "$OUT/host_memory.txt"
    pack_logs
    ;;
  s43_d)  # session 43, call 4 (issue 40; H200): the code that lands: search (a) twice more on one seeded cache (the
          # session's last device seconds)
    export TRITON_CACHE_DIR=/tmp/s43d/triton
    rm -rf /tmp/s43d
    search_a 170 160
    if [ $((335 - SECONDS)) -ge 140 ]; then
      SEARCH_A_NAME=search_a_again search_a $((335 - SECONDS)) 160
    fi
    rm -f "$OUT/host_memory.txt"
    pack_logs
    ;;
  s44_a)  # session 44, call 1 (issues 40, 41; H200): the 60-step task with the samples' split (samples_part_*), then
          # where a step graph's capture spends its time (bench/capture_anatomy.py) on the cache the task seeded
    export TRITON_CACHE_DIR=/tmp/s44a/triton
    rm -rf /tmp/s44a
    task60 100
    step 240 capture_anatomy python3 bench/capture_anatomy.py --layers 32 --tokens 400 --steps 30 \
      --out "$OUT/capture_anatomy.md" --json "$OUT/capture_anatomy.json"
    echo "cubins shipped: $(shipped_cubins), after: $(cubins)" | tee -a "$OUT/steps.txt"
    pack_logs
    ;;
  s44_b)  # session 44, call 2 (issues 40, 41; H200): captures that keep the cached blocks (make_room) and the decode's
          # LoRA term in the second matmul: search (a), the 60-step task with and without (LORAPLEX_CAPTURE_ROOM=inf:
          # every capture empties the caches, as before), then the task under cProfile (where a fresh process's load goes)
    export TRITON_CACHE_DIR=/tmp/s44b/triton
    rm -rf /tmp/s44b
    search_a 200 190
    task60 100
    mv "$OUT/executor_task60.json" "$OUT/executor_task60_room.json"; mv "$OUT/executor_task60.md" "$OUT/executor_task60_room.md"
    LORAPLEX_CAPTURE_ROOM=inf task60 100
    mv "$OUT/executor_task60.json" "$OUT/executor_task60_empty.json"; mv "$OUT/executor_task60.md" "$OUT/executor_task60_empty.md"
    if [ $((560 - SECONDS)) -ge 100 ]; then
      step $((560 - SECONDS)) task60_prof python3 -m cProfile -o "$OUT/task60.prof" bench/executor_task.py --layers 32 \
        --steps 60 --runs cold --out "$OUT/executor_task60_prof.md" --json "$OUT/executor_task60_prof.json"
    fi
    echo "cubins shipped: $(shipped_cubins), after: $(cubins)" | tee -a "$OUT/steps.txt"
    rm -f "$OUT/host_memory.txt"
    pack_logs
    ;;
  s44_c)  # session 44, call 3 (issues 40, 41; H200): search (a) with the samples' split (allocator, gc, prefill tokens),
          # the 60-step task (its data read beside the weights) and the 200-step task; at most 8 files come back
    export TRITON_CACHE_DIR=/tmp/s44c/triton
    rm -rf /tmp/s44c
    search_a 200 190
    task60 100
    step 120 task200 python3 bench/executor_task.py --layers 32 --steps 200 --runs cold \
      --out "$OUT/executor_task200.md" --json "$OUT/executor_task200.json"
    echo "cubins shipped: $(shipped_cubins), after: $(cubins)" | tee -a "$OUT/steps.txt"
    rm -f "$OUT/host_memory.txt" "$OUT"/executor_task*.md
    pack_logs
    ;;
  s44_d)  # session 44, call 4 (issues 40, 41; H200): the code that lands: search (a) in a node's process environment,
          # every GPU test, then search (a) with CUBLAS_WORKSPACE_CONFIG unset (--bare-env, as before) where the time is left
    export TRITON_CACHE_DIR=/tmp/s44d/triton
    rm -rf /tmp/s44d
    search_a 200 190
    step 300 gpu_tests python3 -m pytest -q -p no:cacheprovider tests/gpu
    if [ $((585 - SECONDS)) -ge 140 ]; then
      SEARCH_A_NAME=search_a_bare_env SEARCH_A_EXTRA=--bare-env search_a $((585 - SECONDS)) 190
    fi
    echo "cubins shipped: $(shipped_cubins), after: $(cubins)" | tee -a "$OUT/steps.txt"
    rm -f "$OUT/host_memory.txt"
    pack_logs
    ;;
  s44_e)  # session 44, call 5 (issues 40, 41; H200): the code that lands: search (a) again and the 60-step task
    export TRITON_CACHE_DIR=/tmp/s44e/triton
    rm -rf /tmp/s44e
    SEARCH_A_NAME=search_a_again search_a 200 190
    task60 100
    echo "cubins shipped: $(shipped_cubins), after: $(cubins)" | tee -a "$OUT/steps.txt"
    rm -f "$OUT/host_memory.txt" "$OUT"/executor_task*.md
    pack_logs
    ;;
  s44_f)  # session 44, call 5 (issues 40, 41; H200): the code that lands (a capture is torch.cuda.graph's again, its
          # emptying skipped where the device has room): every GPU test, search (a), then the 60-step task where time is left
    export TRITON_CACHE_DIR=/tmp/s44f/triton
    rm -rf /tmp/s44f
    step 260 gpu_tests python3 -m pytest -q -p no:cacheprovider tests/gpu
    search_a 180 170
    if [ $((585 - SECONDS)) -ge 75 ]; then task60 $((585 - SECONDS)); fi
    echo "cubins shipped: $(shipped_cubins), after: $(cubins)" | tee -a "$OUT/steps.txt"
    rm -f "$OUT/host_memory.txt" "$OUT"/executor_task*.md
    pack_logs
    ;;
  s45_a)  # session 45, call 1 (issues 40, 41; H200): captures that keep the cached blocks again (graph_parts.capturing, a
          # class that restores the stream; the positions' host read fails a capture at once; a failed capture empties the
          # cache for its eager step): the 60-step task, stablelm's and nemotron's varlen tests under checkpoint debug, every
          # GPU test, then a 2-job step's kernels (~1.4k tokens, replayed) where time is left
    export TRITON_CACHE_DIR=/tmp/s45a/triton
    rm -rf /tmp/s45a
    task60 100
    step 90 gpu_pair python3 -c "import sys, pytest, torch.utils.checkpoint as c
with c.set_checkpoint_debug_enabled(True):
    sys.exit(pytest.main(['-q', '-rA', '--tb=long', '-p', 'no:cacheprovider', 'tests/gpu/test_families_gpu.py',
                          '-k', 'varlen_on_cuda and (stablelm or nemotron)']))"
    step 330 gpu_tests python3 -m pytest -q -p no:cacheprovider tests/gpu
    if [ $((585 - SECONDS)) -ge 60 ]; then hp hp_1k 290 $((585 - SECONDS)); fi
    echo "cubins shipped: $(shipped_cubins), after: $(cubins)" | tee -a "$OUT/steps.txt"
    rm -f "$OUT"/executor_task*.md
    pack_logs
    ;;
  s45_b)  # session 45, call 2 (issues 40, 41; H200): the code that lands (captures keep the cached blocks): search (a) in a
          # node's environment, the 200-step task, then where a replayed 2-job step leaves the device idle (bench/step_gaps.py)
    export TRITON_CACHE_DIR=/tmp/s45b/triton
    rm -rf /tmp/s45b
    search_a 200 190
    step 120 task200 python3 bench/executor_task.py --layers 32 --steps 200 --runs cold \
      --out "$OUT/executor_task200.md" --json "$OUT/executor_task200.json"
    step 100 step_gaps python3 bench/step_gaps.py --layers 32 --tokens 290 --steps 5 --out "$OUT/step_gaps.md"
    echo "cubins shipped: $(shipped_cubins), after: $(cubins)" | tee -a "$OUT/steps.txt"
    rm -f "$OUT/host_memory.txt" "$OUT"/executor_task*.md
    pack_logs
    ;;
  s45_c)  # session 45, call 3 (issues 40, 41; H200): captures that keep the cached blocks against every capture emptying them
          # (LORAPLEX_CAPTURE_ROOM=inf, as torch.cuda.graph does): the 60-step task ABAB, then search (a) with every capture emptying
    export TRITON_CACHE_DIR=/tmp/s45c/triton
    rm -rf /tmp/s45c
    for run in keep1 empty1 keep2 empty2; do
      case $run in empty*) export LORAPLEX_CAPTURE_ROOM=inf ;; *) unset LORAPLEX_CAPTURE_ROOM ;; esac
      task60 100
      mv "$OUT/executor_task60.json" "$OUT/task60_$run.json"
    done
    unset LORAPLEX_CAPTURE_ROOM
    if [ $((585 - SECONDS)) -ge 150 ]; then
      LORAPLEX_CAPTURE_ROOM=inf SEARCH_A_NAME=search_a_empty search_a $((585 - SECONDS)) 190
    fi
    echo "cubins shipped: $(shipped_cubins), after: $(cubins)" | tee -a "$OUT/steps.txt"
    rm -f "$OUT/host_memory.txt" "$OUT"/executor_task*.md "$OUT"/search_a_empty.md
    pack_logs
    ;;
  s45_d)  # session 45, call 4 (issues 40, 41; H200): which of the three changes lets StableLM's and Nemotron's failed
          # captures run eagerly (bench/capture_failure_variants.py: none, each alone), then the code that lands: search (a)
          # in a node's environment and the 200-step task where time is left
    export TRITON_CACHE_DIR=/tmp/s45d/triton
    rm -rf /tmp/s45d
    for on in none guard restore empty; do
      step 80 "variant_$on" python3 bench/capture_failure_variants.py --on "${on/none/}"
    done
    SEARCH_A_NAME=search_a_again search_a 200 190
    if [ $((585 - SECONDS)) -ge 90 ]; then
      step $((585 - SECONDS)) task200 python3 bench/executor_task.py --layers 32 --steps 200 --runs cold \
        --out "$OUT/executor_task200.md" --json "$OUT/executor_task200.json"
    fi
    echo "cubins shipped: $(shipped_cubins), after: $(cubins)" | tee -a "$OUT/steps.txt"
    rm -f "$OUT/host_memory.txt" "$OUT"/executor_task*.md "$OUT"/search_a_again.md
    pack_logs
    ;;
  s45_e)  # session 45, call 5 (issues 40, 41; H200): diagnostics for the next session: a graphed decode token step's kernels
          # (bench/decode_kernels.py) and where a replayed 2-job step leaves the device idle (bench/step_gaps.py, busy fixed)
    export TRITON_CACHE_DIR=/tmp/s45e/triton
    rm -rf /tmp/s45e
    step 100 decode_kernels python3 bench/decode_kernels.py --layers 32 --new 48 --out "$OUT/decode_kernels.md"
    step 90 step_gaps python3 bench/step_gaps.py --layers 32 --tokens 290 --steps 5 --out "$OUT/step_gaps.md"
    pack_logs
    ;;
  s46_a)  # session 46, call 1 (issue 40; H200, ~180 s of device time left): what a graphed 2-job step's padding costs
          # (bench/pad_cost.py: one batch, the row forced to lengths from its real tokens to twice its bucket)
    export TRITON_CACHE_DIR=/tmp/s46a/triton
    rm -rf /tmp/s46a
    step 110 pad_cost python3 bench/pad_cost.py --layers 32 --tokens 290 --iters 8 --out "$OUT/pad_cost.md"
    echo "cubins shipped: $(shipped_cubins), after: $(cubins)" | tee -a "$OUT/steps.txt"
    ;;
  pad_free)  # (LORAPLEX_FUSED_GEMM=live: session 46's name of what "persist" is since session 47) prepared in session 46 for the next session's first call (issue 40; H200): the padding tail owned by no
          # job (LORAPLEX_FREE_PADDING=1) and the fused GEMM that skips its row tiles (LORAPLEX_FUSED_GEMM=live, not in
          # the shipped archive: it compiles here, first in the GPU tests), against today's: the GPU tests of both, what
          # padding costs a 2-job step either way (bench/pad_cost.py)
    export TRITON_CACHE_DIR=/tmp/padfree/triton
    rm -rf /tmp/padfree
    step 150 gpu_pad python3 -m pytest -q -x tests/gpu/test_kernels_gpu.py -k rows_past
    LORAPLEX_FREE_PADDING=1 LORAPLEX_FUSED_GEMM=live step 120 gpu_graphs_free python3 -m pytest -q -x \
      tests/gpu/test_step_graphs_gpu.py
    step 100 pad_cost python3 bench/pad_cost.py --layers 32 --tokens 290 --iters 8 --out "$OUT/pad_cost.md"
    LORAPLEX_FREE_PADDING=1 LORAPLEX_FUSED_GEMM=live step 120 pad_cost_free python3 bench/pad_cost.py --layers 32 \
      --tokens 290 --iters 8 --out "$OUT/pad_cost_free.md"
    echo "cubins shipped: $(shipped_cubins), after: $(cubins)" | tee -a "$OUT/steps.txt"
    tar -C /tmp/padfree -czf "$OUT/triton_cache_padfree.tar.gz" triton  # the live kernels, for pad_free_tasks
    pack_logs
    ;;
  pad_free_tasks)  # the next call: the 200-step task today, with the padding free, and free with 2 row lengths per
          # doubling instead of 4 (fewer captures, more padding); the live kernels from pad_free's cache where carried
          # (its returned triton_cache_padfree.tar.gz copied to .device/ of the tree the call runs in, e.g.
          # .device/snap/.device/), else they compile in the first free run
    export TRITON_CACHE_DIR=/tmp/padfree2/triton
    rm -rf /tmp/padfree2 && mkdir -p /tmp/padfree2
    [ -f .device/triton_cache_padfree.tar.gz ] && tar -C /tmp/padfree2 -xzf .device/triton_cache_padfree.tar.gz
    step 110 task200 python3 bench/executor_task.py --layers 32 --steps 200 --runs cold \
      --out "$OUT/executor_task200.md" --json "$OUT/executor_task200.json"
    LORAPLEX_FREE_PADDING=1 LORAPLEX_FUSED_GEMM=live step 130 task200_free python3 bench/executor_task.py --layers 32 \
      --steps 200 --runs cold --out "$OUT/executor_task200_free.md" --json "$OUT/executor_task200_free.json"
    LORAPLEX_FREE_PADDING=1 LORAPLEX_FUSED_GEMM=live LORAPLEX_GRAPH_BUCKETS=2 step 110 task200_free2 python3 \
      bench/executor_task.py --layers 32 --steps 200 --runs cold --out "$OUT/executor_task200_free2.md" \
      --json "$OUT/executor_task200_free2.json"
    LORAPLEX_FREE_PADDING=1 LORAPLEX_FUSED_GEMM=live step 130 task60_free python3 bench/executor_task.py --layers 32 \
      --steps 60 --runs cold --out "$OUT/executor_task60_free.md" --json "$OUT/executor_task60_free.json"
    echo "cubins shipped: $(shipped_cubins), after: $(cubins)" | tee -a "$OUT/steps.txt"
    rm -f "$OUT"/executor_task*.md
    pack_logs
    ;;
  s47_a)  # session 47, call 3 (issues 40, 41; H200): the padding owned by no job and the persistent GEMM over the
          # live row tiles, both now the default (the persistent kernel changed: its shipped entries miss): search (a)
          # and the 60-step task on a cache seeded from the shipped archive, the grown cache brought back for the new
          # archive; then every GPU test on a cache of its own (its shapes stay out of the archive)
    search_then_task /tmp/s47a 230 220
    TRITON_CACHE_DIR=/tmp/s47tests/triton step $((585 - SECONDS)) gpu_tests python3 -m pytest -q -p no:cacheprovider \
      tests/gpu
    rm -f "$OUT"/executor_task*.md "$OUT"/search_a.md
    pack_logs
    ;;
  s47_b)  # session 47, call 4 (issues 40, 41; H200): the refreshed archive (the persistent GEMM's 23 new entries, its 26
          # stale ones dropped): the 200-step and 60-step tasks and search (a) on a cache seeded from it as a node seeds it
          # (a cubin added is a compile inside a task: the cache comes back where it grew), the GPU tests that failed in
          # s47_a for their own reasons (the old variant names, a collection inside a measured step), then the 200-step
          # task with 2 row lengths per doubling where time is left
    export TRITON_CACHE_DIR=/tmp/s47b/triton
    rm -rf /tmp/s47b
    local_shipped=$(shipped_cubins)
    step 110 task200 python3 bench/executor_task.py --layers 32 --steps 200 --runs cold \
      --out "$OUT/executor_task200.md" --json "$OUT/executor_task200.json"
    echo "cubins shipped: $local_shipped, after the 200-step task: $(cubins)" | tee -a "$OUT/steps.txt"
    task60 100
    echo "cubins after the 60-step task: $(cubins)" | tee -a "$OUT/steps.txt"
    search_a 200 190
    echo "cubins after search (a): $(cubins)" | tee -a "$OUT/steps.txt"
    if [ "$(cubins)" -gt "$local_shipped" ]; then tar -C /tmp/s47b -czf "$OUT/triton_cache_sm90.tar.gz" triton; fi
    TRITON_CACHE_DIR=/tmp/s47btests/triton step 120 gpu_fix python3 -m pytest -q -p no:cacheprovider \
      tests/gpu/test_kernels_gpu.py -k rows_past tests/gpu/test_mlp_rebuild_gpu.py
    if [ $((585 - SECONDS)) -ge 90 ]; then
      LORAPLEX_GRAPH_BUCKETS=2 step $((585 - SECONDS)) task200_b2 python3 bench/executor_task.py --layers 32 \
        --steps 200 --runs cold --out "$OUT/executor_task200_b2.md" --json "$OUT/executor_task200_b2.json"
    fi
    rm -f "$OUT"/executor_task*.md "$OUT"/search_a.md "$OUT"/host_memory.txt
    pack_logs
    ;;
  s47_c)  # session 47, call 5 (issues 40, 41; H200): s47_b's tasks and search (a) again (a second sample of each)
    export TRITON_CACHE_DIR=/tmp/s47c/triton
    rm -rf /tmp/s47c
    tasks_then_search
    ;;
  s48_a)  # prepared in session 47 for the next session's first call (issue 40's 14k tok/s; H200): a ~1.45k-row step's 128 x 256
          # tiles cover a 4096-wide output in 192 tiles (1.45 waves of 132 SMs); its calls now key the tables at 1536 rows
          # (kernels.tuned.row_bucket), which no table has yet: tune them (and 768, 3072) for llama8b into a copy of the
          # H200 table (every new key's best kept: --max-configs 0), cuBLAS beside them; the 2-job step of ~1.45k rows
          # before and after. Then: commit the returned table, refresh the archive (s47_a's way), measure the tasks
    export TRITON_CACHE_DIR=/tmp/s48a/triton
    rm -rf /tmp/s48a && mkdir -p /tmp/s48a/cfg && cp kernels/configs/NVIDIA_H200.json /tmp/s48a/cfg/
    hp hp_1k_shipped 290 90
    LORAPLEX_KERNEL_CONFIGS=/tmp/s48a/cfg step 280 tune python3 bench/tune_kernels.py --shapes llama8b \
      --tokens 1536,3072,768 --ranks 16,64 --max-configs 0 --cublas
    cp /tmp/s48a/cfg/NVIDIA_H200.json "$OUT/NVIDIA_H200_tuned.json"
    [ $((585 - SECONDS)) -ge 60 ] && LORAPLEX_KERNEL_CONFIGS=/tmp/s48a/cfg hp hp_1k_tuned 290 $((585 - SECONDS))
    pack_logs
    ;;
  s48_c)  # prepared in session 47, not run (its s48_b was superseded by s49_a): the tasks and search (a)
    export TRITON_CACHE_DIR=/tmp/s48c/triton
    rm -rf /tmp/s48c
    tasks_then_search
    ;;
  s48_cublas)  # session 48 (issue 40's 14k tok/s): the 2-job step's fused GEMMs ran 104 us (4096 x 4096) and 300 us
               # (gate/up/down) in the graph where cuBLAS takes 69 and 240-243 (s48_a's table): the "cublas" GEMM variant
               # (cuBLAS beta = 1 over an epilogue-only LoRA pass) against the default, alternating, traced; its GPU tests;
               # the 200-step task both ways
    export TRITON_CACHE_DIR=/tmp/s48c/triton
    rm -rf /tmp/s48c && mkdir -p /tmp/s48c
    for round in 1 2; do
      for v in persist cublas; do
        # (as run, each also wrote a chrome trace read by a script since dropped for bench/step_gaps.py, its twin)
        LORAPLEX_FUSED_GEMM=$v step 90 "hp_${v}_$round" python3 bench/host_profile.py --layers 32 --tokens 290 \
          --recompute 0 --modes graphs --warmup 12 --iters 10 --out "$OUT/hp_${v}_$round.md"
      done
    done
    step 150 gpu_variants python3 -m pytest -q -x tests/gpu/test_kernels_gpu.py -k "variants or rows_past" -p no:cacheprovider
    LORAPLEX_FUSED_GEMM=cublas step 110 task200_cublas python3 bench/executor_task.py --layers 32 --steps 200 \
      --runs cold --out "$OUT/executor_task200_cublas.md" --json "$OUT/executor_task200_cublas.json"
    [ $((585 - SECONDS)) -ge 90 ] && step $((585 - SECONDS)) task200_persist python3 bench/executor_task.py --layers 32 \
      --steps 200 --runs cold --out "$OUT/executor_task200_persist.md" --json "$OUT/executor_task200_persist.json"
    rm -f "$OUT"/executor_task*.md
    pack_logs
    ;;
  s48_replay)  # session 48: the 2-job step's wall against its graphs replayed back to back (the host's share of a
               # step), the shipped table and s48_a's 1,536-row table (carried as .device/cfg48), each traced
    export TRITON_CACHE_DIR=/tmp/s48r/triton
    rm -rf /tmp/s48r && mkdir -p /tmp/s48r
    for round in 1 2; do
      for t in shipped tuned; do
        cfg=""; [ $t = tuned ] && cfg=$PWD/.device/cfg48
        LORAPLEX_KERNEL_CONFIGS=${cfg:-$PWD/kernels/configs} step 90 "hp_${t}_$round" python3 bench/host_profile.py \
          --layers 32 --tokens 290 --recompute 0 --modes graphs --warmup 12 --iters 10 --out "$OUT/hp_${t}_$round.md"
      done
    done
    pack_logs
    ;;
  s48_store)  # session 48: the "cublas" variant's LoRA store pass cost 7.3 ms of a 2-job step (16 us a call, ~3x its
              # bytes' time) and ate the 8 ms cuBLAS saved: its tile (BLOCK_M, BLOCK_N, warps) against the default GEMM,
              # each graph's replays back to back (1,536-2,048 rows) and the step's kernels
    export TRITON_CACHE_DIR=/tmp/s48s/triton
    rm -rf /tmp/s48s
    for v in persist 64,128,4 128,256,8 128,128,8 64,256,4 persist; do
      gemm=cublas; [ $v = persist ] && gemm=persist
      n=$(echo "$v" | tr ',' 'x')
      LORAPLEX_FUSED_GEMM=$gemm LORAPLEX_LORA_STORE_TILE=${v/persist/64,128,4} step 80 "hp_$n" python3 \
        bench/host_profile.py --layers 32 --tokens 290 --recompute 0 --modes graphs --warmup 12 --iters 10 \
        --out "$OUT/hp_$n.md"
      mv "$OUT/hp_$n.md" "$OUT/hp_${n}_$SECONDS.md"
    done
    pack_logs
    ;;
  s48_auto)  # session 48 (issue 40): the "auto" GEMM (Hopper's default now: cuBLAS over the LoRA store where the
             # persistent tiles fill under 75% of their last round) against "persist", each graph's replays back to back;
             # then search (a), the 200- and 60-step tasks on a cache seeded from the archive (cubins counted; the grown
             # cache back for python -m kernels.shipped_cache --merge)
    export TRITON_CACHE_DIR=/tmp/s48a2/triton
    rm -rf /tmp/s48a2
    shipped=$(shipped_cubins)
    for v in persist auto; do
      LORAPLEX_FUSED_GEMM=$v step 60 "hp_$v" python3 bench/host_profile.py --layers 32 --tokens 290 --recompute 0 \
        --modes graphs --warmup 12 --iters 10 --out "$OUT/hp_$v.md"
    done
    rm -rf /tmp/s48a2 && shipped=$(shipped_cubins)  # the tasks on a cache seeded afresh from the archive
    search_a 200 190
    after_search=$(cubins)
    step 100 task200 python3 bench/executor_task.py --layers 32 --steps 200 --runs cold \
      --out "$OUT/executor_task200.md" --json "$OUT/executor_task200.json"
    task60 90
    echo "cubins shipped: $shipped, after search (a): $after_search, after the tasks: $(cubins)" | tee -a "$OUT/steps.txt"
    if [ "$(cubins)" -gt "$shipped" ]; then tar -C /tmp/s48a2 -czf "$OUT/triton_cache_sm90.tar.gz" triton; fi
    rm -f "$OUT"/executor_task*.md "$OUT"/search_a.md "$OUT"/host_memory.txt
    pack_logs
    ;;
  s48_seed)  # session 48: s48_auto's grown cache did not come back (a ninth file under $OUT is left out): search (a)
             # again on a cache seeded afresh from the archive (it compiled every kernel the tasks added: 89 -> 98), its
             # cache back for the archive
    export TRITON_CACHE_DIR=/tmp/s48s2/triton
    rm -rf /tmp/s48s2
    shipped=$(shipped_cubins)
    search_a 170 160
    echo "cubins shipped: $shipped, after search (a): $(cubins)" | tee -a "$OUT/steps.txt"
    if [ "$(cubins)" -gt "$shipped" ]; then tar -C /tmp/s48s2 -czf "$OUT/triton_cache_sm90.tar.gz" triton; fi
    rm -f "$OUT"/search_a.md "$OUT"/host_memory.txt
    pack_logs
    ;;
  s49_a)  # prepared in session 48 (issue 40): the "auto" GEMM's store-pass kernels into the sm90 archive. Search (a)
          # and the 200-step task with LORAPLEX_FUSED_GEMM=auto on a cache seeded from the archive (session 48: 89 -> 98
          # cubins, all in search (a)); at most 8 files come back, the grown cache among them. Then, here:
          # python -m kernels.shipped_cache --merge triton_cache_sm90.tar.gz; kernels.fused_lora.AUTO_READY = True;
          # run s49_b (nothing compiling, the default now "auto") and tests/gpu
    export LORAPLEX_FUSED_GEMM=auto
    grow_archive /tmp/s49a 200 190
    ;;
  s49_b)  # the call after s49_a's cache is merged and AUTO_READY set: the tasks and search (a), nothing compiling
    export TRITON_CACHE_DIR=/tmp/s49b/triton
    rm -rf /tmp/s49b
    tasks_then_search
    ;;
  s49_c)  # session 49 (issue 40/41): the step graphs' capture rules (a large key of a job set of under 16 steps
          # runs eagerly; a key beyond the cover window replays a timed capture of up to 2x its tokens until its
          # padding paid a capture) against the rules before them (the tree at 40124fd, carried as
          # .device/ab_old), alternating, each task a fresh process; search (a) with the new rules; the
          # step-graph GPU tests
    export TRITON_CACHE_DIR=/tmp/s49c/triton
    rm -rf /tmp/s49c
    old=.device/ab_old
    step 80 task60_old python3 $old/bench/executor_task.py --layers 32 --steps 60 --runs cold \
      --out "$OUT/executor_task60_old.md" --json "$OUT/executor_task60_old.json"
    step 80 task60_new python3 bench/executor_task.py --layers 32 --steps 60 --runs cold \
      --out "$OUT/executor_task60_new.md" --json "$OUT/executor_task60_new.json"
    step 100 task200_new python3 bench/executor_task.py --layers 32 --steps 200 --runs cold \
      --out "$OUT/executor_task200_new.md" --json "$OUT/executor_task200_new.json"
    step 100 task200_old python3 $old/bench/executor_task.py --layers 32 --steps 200 --runs cold \
      --out "$OUT/executor_task200_old.md" --json "$OUT/executor_task200_old.json"
    step 90 gpu_graphs python3 -m pytest -q -p no:cacheprovider tests/gpu/test_step_graphs_gpu.py
    [ $((580 - SECONDS)) -ge 140 ] && search_a $((580 - SECONDS)) $((570 - SECONDS))
    echo "cubins shipped: $(shipped_cubins), after: $(cubins)" | tee -a "$OUT/steps.txt"
    rm -f "$OUT"/executor_task*.md "$OUT"/search_a.md "$OUT"/host_memory.txt
    pack_logs
    ;;
  s49_d)  # the landed rules (s49_c's loose covers dropped: they padded the 200-step task's 2-job steps, 22.74 s
          # against 21.54 s for its fast steps, and captured as many keys): the 200-step and 60-step tasks
    export TRITON_CACHE_DIR=/tmp/s49d/triton
    rm -rf /tmp/s49d
    step 100 task200 python3 bench/executor_task.py --layers 32 --steps 200 --runs cold \
      --out "$OUT/executor_task200.md" --json "$OUT/executor_task200.json"
    [ $((585 - SECONDS)) -ge 70 ] && task60 $((585 - SECONDS))
    echo "cubins shipped: $(shipped_cubins), after: $(cubins)" | tee -a "$OUT/steps.txt"
    rm -f "$OUT"/executor_task*.md
    pack_logs
    ;;
  s50_a)  # session 50 (issues 40, 41): where a fresh process's first steps go (bench/executor_task.py's KernelLoads:
          # Triton's JIT and module loads, the allocator's new segments, per step); cuBLAS under the LoRA term where the
          # persistent tiles fill under 90% of their last round (LORAPLEX_CUBLAS_BELOW=0.9: the 14336-wide GEMMs of
          # 1,024-1,536-row steps, 0.85) against 75%, the 200-step task and a 2-job step's graph replays side by side
    export TRITON_CACHE_DIR=/tmp/s50a/triton
    rm -rf /tmp/s50a
    step 120 task200 python3 bench/executor_task.py --layers 32 --steps 200 --runs cold \
      --out "$OUT/executor_task200.md" --json "$OUT/executor_task200.json"
    LORAPLEX_CUBLAS_BELOW=0.9 step 100 task200_c90 python3 bench/executor_task.py --layers 32 --steps 200 --runs cold \
      --reuse --out "$OUT/executor_task200_c90.md" --json "$OUT/executor_task200_c90.json"
    step 80 task60 python3 bench/executor_task.py --layers 32 --steps 60 --runs cold --reuse \
      --out "$OUT/executor_task60.md" --json "$OUT/executor_task60.json"
    for v in 0.9 0.75; do
      [ $((585 - SECONDS)) -ge 75 ] && LORAPLEX_CUBLAS_BELOW=$v hp "hp_c$v" 290 70
    done
    echo "cubins shipped: $(shipped_cubins), after: $(cubins)" | tee -a "$OUT/steps.txt"
    rm -f "$OUT"/executor_task*.md
    pack_logs
    ;;
  s50_b)  # session 50 (issue 40): the lean launch path (kernels.lean_launch) on and off: its GPU tests and those of
          # the kernels it launches; an eager 2-job step at 32 layers small enough to be bound by the host (the host's
          # pass that a capture also pays); the 200-step task side by side (captures, eager steps); the 60-step task
    export TRITON_CACHE_DIR=/tmp/s50b/triton
    rm -rf /tmp/s50b /tmp/s50b_tests
    TRITON_CACHE_DIR=/tmp/s50b_tests/triton step 150 gpu_lean python3 -m pytest -q -p no:cacheprovider \
      tests/gpu/test_lean_launch_gpu.py tests/gpu/test_norm_act_gpu.py tests/gpu/test_cross_entropy_gpu.py
    for v in 1 0; do
      LORAPLEX_LEAN_LAUNCH=$v step 80 "hp_eager_lean$v" python3 bench/host_profile.py --layers 32 --tokens 60 \
        --recompute 0 --modes eager --warmup 4 --iters 8 --out "$OUT/hp_eager_lean$v.md"
    done
    step 110 task200 python3 bench/executor_task.py --layers 32 --steps 200 --runs cold \
      --out "$OUT/executor_task200.md" --json "$OUT/executor_task200.json"
    LORAPLEX_LEAN_LAUNCH=0 step 100 task200_off python3 bench/executor_task.py --layers 32 --steps 200 --runs cold \
      --reuse --out "$OUT/executor_task200_off.md" --json "$OUT/executor_task200_off.json"
    [ $((585 - SECONDS)) -ge 60 ] && step $((585 - SECONDS)) task60 python3 bench/executor_task.py --layers 32 \
      --steps 60 --runs cold --reuse --out "$OUT/executor_task60.md" --json "$OUT/executor_task60.json"
    echo "cubins shipped: $(shipped_cubins), after: $(cubins)" | tee -a "$OUT/steps.txt"
    rm -f "$OUT"/executor_task*.md
    pack_logs
    ;;
  s50_c)  # session 50: the code that lands (the lean launch path on): every GPU test, then search (a)
    gpu_tests /tmp/s50c
    search_rest
    pack_logs
    ;;
  s50_d)  # session 50: the lean launch path's host time, order balanced (off, on, on, off): an eager 2-job step at
          # 32 layers small enough to be bound by the host
    export TRITON_CACHE_DIR=/tmp/s50d/triton
    rm -rf /tmp/s50d
    i=0
    for v in 0 1 1 0; do
      i=$((i + 1))
      LORAPLEX_LEAN_LAUNCH=$v step 60 "hp_eager_${i}_lean$v" python3 bench/host_profile.py --layers 32 --tokens 60 \
        --recompute 0 --modes eager --warmup 4 --iters 8 --out "$OUT/hp_eager_${i}_lean$v.md"
    done
    rm -f "$OUT"/*.log
    ;;
  s51_a)  # prepared in session 50 for the next: which kernels are made ready after the training steps (s50's tasks
          # spent ~1 s in CompiledKernel._init_handles outside their steps: evaluation or samples; the run's JSON now
          # names every kernel made ready in 20 ms or more), the launchers counted beside the cubins
    export TRITON_CACHE_DIR=/tmp/s51a/triton
    rm -rf /tmp/s51a /tmp/s51a_tests
    # session 50's post-review lean-path tests (a float16 case, widths 16 does not divide, rows of one, after warm)
    TRITON_CACHE_DIR=/tmp/s51a_tests/triton step 120 gpu_lean python3 -m pytest -q -p no:cacheprovider \
      tests/gpu/test_lean_launch_gpu.py
    step 120 task200 python3 bench/executor_task.py --layers 32 --steps 200 --runs cold \
      --out "$OUT/executor_task200.md" --json "$OUT/executor_task200.json"
    step 80 task60 python3 bench/executor_task.py --layers 32 --steps 60 --runs cold --reuse \
      --out "$OUT/executor_task60.md" --json "$OUT/executor_task60.json"
    echo "cubins shipped: $(shipped_cubins), after: $(cubins); launchers shipped: $(shipped_launchers), after: $(launchers)" \
      | tee -a "$OUT/steps.txt"
    rm -f "$OUT"/executor_task*.md
    pack_logs
    ;;
  s51_b)  # prepared in session 50: each job's skip and clip decided on the device, its update launched before the
          # step's sync (LORAPLEX_DEVICE_UPDATE=1, trainer/step_update.py) against the host's decisions after it: its
          # GPU test, a 2-job step's wall with its graphs replayed, the 200-step task side by side (0, 1, 0)
    export TRITON_CACHE_DIR=/tmp/s51b/triton
    rm -rf /tmp/s51b /tmp/s51b_tests
    TRITON_CACHE_DIR=/tmp/s51b_tests/triton step 90 gpu_update python3 -m pytest -q -p no:cacheprovider \
      tests/gpu/test_step_update_gpu.py
    for v in 0 1; do LORAPLEX_DEVICE_UPDATE=$v hp "hp_update$v" 290 70; done
    step 120 task200_update0 python3 bench/executor_task.py --layers 32 --steps 200 --runs cold \
      --out "$OUT/executor_task200_update0.md" --json "$OUT/executor_task200_update0.json"
    LORAPLEX_DEVICE_UPDATE=1 step 95 task200_update1 python3 bench/executor_task.py --layers 32 --steps 200 \
      --runs cold --reuse --out "$OUT/executor_task200_update1.md" --json "$OUT/executor_task200_update1.json"
    [ $((585 - SECONDS)) -ge 90 ] && step 90 task200_update0b python3 bench/executor_task.py --layers 32 --steps 200 \
      --runs cold --reuse --out "$OUT/executor_task200_update0b.md" --json "$OUT/executor_task200_update0b.json"
    rm -f "$OUT"/executor_task*.md
    pack_logs
    ;;
  s51_c)  # session 51: the pinned staging of a key's inputs (trainer.graph_parts.Static.load) against a fresh
          # pinned copy per step (hp ABBA), where a replayed step leaves the device idle now (bench/step_gaps.py),
          # the worker spool's fsync on this disk (bench/spool_fsync.py), and the tasks with Triton's key computed
          # ahead (kernels.triton_warm: the first kernel's JIT in their kernel loads)
    export TRITON_CACHE_DIR=/tmp/s51c/triton
    rm -rf /tmp/s51c /tmp/s51c_tests
    TRITON_CACHE_DIR=/tmp/s51c_tests/triton step 100 gpu_graphs python3 -m pytest -q -p no:cacheprovider \
      tests/gpu/test_step_graphs_gpu.py
    step 40 spool python3 bench/spool_fsync.py --dir /tmp --dir "$PWD" --records 400 --out "$OUT/spool_fsync.md"
    for v in 1 0 0 1; do LORAPLEX_PINNED_STAGING=$v hp "hp_staging${v}_$SECONDS" 290 60; done
    (cd "$OUT" && tar -czf hp.tar.gz hp_staging*.md && rm -f hp_staging*.md)  # 8 files come back
    step 110 task200 python3 bench/executor_task.py --layers 32 --steps 200 --runs cold \
      --out "$OUT/executor_task200.md" --json "$OUT/executor_task200.json"
    step 70 task60 python3 bench/executor_task.py --layers 32 --steps 60 --runs cold --reuse \
      --out "$OUT/executor_task60.md" --json "$OUT/executor_task60.json"
    [ $((585 - SECONDS)) -ge 60 ] && step $((585 - SECONDS)) step_gaps python3 bench/step_gaps.py --layers 32 \
      --tokens 290 --steps 5 --out "$OUT/step_gaps.md"
    rm -f "$OUT"/executor_task*.md
    pack_logs
    ;;
  s51_d)  # session 51: the code that lands (Triton's key computed ahead, the pinned staging): every GPU test, then
          # search (a)
    gpu_tests /tmp/s51d
    search_rest
    pack_logs
    ;;
  s51_e)  # session 51: which aten ops own an eager 2-job step's small kernels, by caller (host_profile --stacks),
          # and where a process's first Triton kernels spend their host time, first and second process on one
          # freshly seeded cache (bench/first_kernels.py)
    export TRITON_CACHE_DIR=/tmp/s51e/triton
    rm -rf /tmp/s51e
    step 60 first_kernels_1 python3 bench/first_kernels.py --out "$OUT/first_kernels_1.md"
    step 60 first_kernels_2 python3 bench/first_kernels.py --out "$OUT/first_kernels_2.md"
    step 150 hp_ops python3 bench/host_profile.py --layers 32 --tokens 290 --recompute 0 --modes eager --warmup 4 \
      --iters 4 --stacks 4 --out "$OUT/hp_ops.md"
    pack_logs
    ;;
  s51_f)  # session 51: the modules the first Triton kernel of a process imports (bench/first_kernels.py, 2 processes)
    export TRITON_CACHE_DIR=/tmp/s51f/triton
    rm -rf /tmp/s51f
    step 60 first_kernels_1 python3 bench/first_kernels.py --out "$OUT/first_kernels_1.md"
    step 60 first_kernels_2 python3 bench/first_kernels.py --out "$OUT/first_kernels_2.md"
    pack_logs
    ;;
  s52_a)  # prepared in session 51 for the next: the code that lands first (the varlen layout: 6 copies and 3 fills of
          # a query's size a layer less in the backward; the code generator imported with Triton's key), every GPU
          # test, a 2-job step replayed (call 3 of session 51: 114.3-117.7 ms), the tasks (their first step, steps)
    gpu_tests /tmp/s52a
    hp hp_graphs 290 60
    [ $((585 - SECONDS)) -ge 90 ] && step 85 task200 python3 bench/executor_task.py --layers 32 --steps 200 \
      --runs cold --out "$OUT/executor_task200.md" --json "$OUT/executor_task200.json"
    [ $((585 - SECONDS)) -ge 50 ] && step $((585 - SECONDS)) task60 python3 bench/executor_task.py --layers 32 \
      --steps 60 --runs cold --reuse --out "$OUT/executor_task60.md" --json "$OUT/executor_task60.json"
    echo "cubins shipped: $(shipped_cubins), after: $(cubins)" | tee -a "$OUT/steps.txt"
    rm -f "$OUT"/executor_task*.md
    pack_logs
    ;;
  s52_b)  # prepared in session 51: search (a) on the code that lands, and an eager 2-job step's ops by caller again
    export TRITON_CACHE_DIR=/tmp/s52b/triton
    rm -rf /tmp/s52b
    step 150 hp_ops python3 bench/host_profile.py --layers 32 --tokens 290 --recompute 0 --modes eager --warmup 4 \
      --iters 4 --stacks 4 --out "$OUT/hp_ops.md"
    search_rest
    pack_logs
    ;;
  s52_c)  # session 52: the code that lands without the GPU tests (the varlen layout's ~2 ms a 2-job step, the
          # capture's parts), then every candidate configuration of the LoRA passes at that step's layout
          # (bench/lora_sweep.py: the table's choice against the best, one pass against two, the bytes floor)
    export TRITON_CACHE_DIR=/tmp/s52c/triton
    rm -rf /tmp/s52c
    hp hp_graphs 290 60
    step 95 task200 python3 bench/executor_task.py --layers 32 --steps 200 --runs cold \
      --out "$OUT/executor_task200.md" --json "$OUT/executor_task200.json"
    step 60 task60 python3 bench/executor_task.py --layers 32 --steps 60 --runs cold --reuse \
      --out "$OUT/executor_task60.md" --json "$OUT/executor_task60.json"
    echo "cubins shipped: $(shipped_cubins), after the tasks: $(cubins)" | tee -a "$OUT/steps.txt"
    [ $((585 - SECONDS)) -ge 60 ] && step $((585 - SECONDS)) lora_sweep python3 bench/lora_sweep.py \
      --budget-s $((540 - SECONDS)) --out "$OUT/lora_sweep.md"
    rm -f "$OUT"/executor_task*.md
    pack_logs
    ;;
  s52_d)  # session 52: where a capture's host pass goes now (~314 ms a capture in call 1's 200-step task, against
          # ~176 ms for an eager step's launches on the lean path): bench/capture_anatomy.py on the current code
    export TRITON_CACHE_DIR=/tmp/s52d/triton
    rm -rf /tmp/s52d
    step 230 capture_anatomy python3 bench/capture_anatomy.py --layers 32 --tokens 290 --steps 16 --profiled 4 \
      --out "$OUT/capture_anatomy.md" --json "$OUT/capture_anatomy.json"
    pack_logs
    ;;
  s52_e)  # session 52: the code that lands (the varlen layout, the code generator's import with Triton's key): every
          # GPU test, then search (a)
    gpu_tests /tmp/s52e
    search_rest
    pack_logs
    ;;
  s52_f)  # session 52: what programmatic dependent launch would save a graph's small kernels (bench/pdl_probe.py),
          # an eager 2-job step's host-bound wall beside the captures' host passes (same machine), and the eager
          # step's ops by caller after the varlen change (host_profile --stacks)
    export TRITON_CACHE_DIR=/tmp/s52f/triton
    rm -rf /tmp/s52f
    step 90 pdl_probe python3 bench/pdl_probe.py --kernels 400 --out "$OUT/pdl_probe.md"
    step 150 hp_both python3 bench/host_profile.py --layers 32 --tokens 290 --recompute 0 --modes eager,graphs \
      --warmup 12 --iters 10 --out "$OUT/hp_both.md"
    [ $((585 - SECONDS)) -ge 120 ] && step $((585 - SECONDS)) hp_ops python3 bench/host_profile.py --layers 32 \
      --tokens 290 --recompute 0 --modes eager --warmup 4 --iters 4 --stacks 4 --out "$OUT/hp_ops.md"
    pack_logs
    ;;
  s52_g)  # session 52: the LoRA passes' sweep again with configurations no table offers yet (bench/lora_sweep.py
          # --extra: taller row tiles for the one-pass dB, longer column splits, short row chunks with deep pipelines)
    export TRITON_CACHE_DIR=/tmp/s52g/triton
    rm -rf /tmp/s52g
    step 500 lora_sweep_extra python3 bench/lora_sweep.py --extra --budget-s 440 --out "$OUT/lora_sweep_extra.md"
    pack_logs
    ;;
  s52_h)  # session 52: session 52's small-step LoRA configurations (the H200 table's 1,536-row, rank-64 keys): their
          # GPU test, the 200-step task and search (a) on a cache seeded from the archive; the grown cache comes back
          # for python -m kernels.shipped_cache --merge (the new configurations' kernels into the sm90 archive)
    configs_then_task200 /tmp/s52h
    search_a 165 155
    echo "cubins shipped: $shipped, after search (a): $(cubins)" | tee -a "$OUT/steps.txt"
    if [ "$(cubins)" -gt "$shipped" ]; then tar -C /tmp/s52h -czf "$OUT/triton_cache_sm90.tar.gz" triton; fi
    rm -f "$OUT"/executor_task*.md "$OUT"/search_a.md "$OUT"/host_memory.txt
    pack_logs
    ;;
  s53_a)  # prepared in session 52 for the next: the merged sm90 archive (103 cubins: session 52's five small-step LoRA
          # kernels) under the tasks, where nothing may compile; the side-stream dA's GPU tests (LORAPLEX_DA_SIDE_STREAM=1:
          # dA beside the dX GEMM, eager and captured) and a 2-job step replayed with it off / on / on / off
    export TRITON_CACHE_DIR=/tmp/s53a/triton
    rm -rf /tmp/s53a /tmp/s53a_tests
    shipped=$(shipped_cubins)
    step 95 task200 python3 bench/executor_task.py --layers 32 --steps 200 --runs cold \
      --out "$OUT/executor_task200.md" --json "$OUT/executor_task200.json"
    step 60 task60 python3 bench/executor_task.py --layers 32 --steps 60 --runs cold --reuse \
      --out "$OUT/executor_task60.md" --json "$OUT/executor_task60.json"
    echo "cubins shipped: $shipped, after the tasks: $(cubins)" | tee -a "$OUT/steps.txt"
    TRITON_CACHE_DIR=/tmp/s53a_tests/triton step 90 gpu_configs python3 -m pytest -q -p no:cacheprovider \
      tests/gpu/test_kernels_gpu.py -k "small_step or side_stream"
    for v in 0 1 1 0; do LORAPLEX_DA_SIDE_STREAM=$v hp "hp_da_side${v}_$SECONDS" 290 60; done
    (cd "$OUT" && tar -czf hp.tar.gz hp_da_side*.md && rm -f hp_da_side*.md)
    rm -f "$OUT"/executor_task*.md
    pack_logs
    ;;
  s53_d)  # session 53: the 200-step task with the side-stream dA off / on, then session 52's sweep at the 2,048- and
          # 1,024-row keys (the 2-job task's second and third most used table keys after 1,536)
    export TRITON_CACHE_DIR=/tmp/s53d/triton
    rm -rf /tmp/s53d
    LORAPLEX_DA_SIDE_STREAM=0 step 95 task200_side0 python3 bench/executor_task.py --layers 32 --steps 200 --runs cold \
      --out "$OUT/executor_task200_side0.md" --json "$OUT/executor_task200_side0.json"
    LORAPLEX_DA_SIDE_STREAM=1 step 95 task200_side1 python3 bench/executor_task.py --layers 32 --steps 200 \
      --runs cold --out "$OUT/executor_task200_side1.md" --json "$OUT/executor_task200_side1.json"
    for lay in 360x16,1440x64:2048 200x16,800x64:1024; do
      [ $((585 - SECONDS)) -ge 100 ] && step $((585 - SECONDS)) "sweep_${lay##*:}" python3 bench/lora_sweep.py --extra \
        --engine-passes --layout "${lay%%:*}" --pad-to "${lay##*:}" --budget-s 150 --out "$OUT/lora_sweep_${lay##*:}.md"
    done
    rm -f "$OUT"/executor_task*.md
    pack_logs
    ;;
  s53_e)  # session 53: the sweep's winners at the 1,024- and 2,048-row rank-64 keys (H200 table) and the side-stream
          # dA on by default: the configurations' GPU tests, the 200-step task on a cache seeded from the archive,
          # the same sweep at an 8-job layout of 2,048 rows (do the new rows hold beside 8 adapters?), search (a);
          # a grown cache comes back for python -m kernels.shipped_cache --merge
    configs_then_task200 /tmp/s53e
    step 110 sweep_8jobs python3 bench/lora_sweep.py --engine-passes \
      --layout 128x16,256x16,128x32,256x32,256x64,256x64,384x64,256x64 --pad-to 2048 --budget-s 80 \
      --out "$OUT/lora_sweep_2048_8jobs.md"
    search_a $((585 - SECONDS)) $((575 - SECONDS))
    echo "cubins shipped: $shipped, after search (a): $(cubins)" | tee -a "$OUT/steps.txt"
    if [ "$(cubins)" -gt "$shipped" ]; then tar -C /tmp/s53e -czf "$OUT/triton_cache_sm90.tar.gz" triton; fi
    rm -f "$OUT"/executor_task*.md "$OUT"/search_a.md "$OUT"/host_memory.txt
    pack_logs
    ;;
  s53_f)  # session 53: tests/gpu on the code that lands, then the 200-step and 60-step tasks on the (merged) archive
    gpu_tests /tmp/s53f
    shipped=$(shipped_cubins)
    [ $((585 - SECONDS)) -ge 90 ] && step $((585 - SECONDS)) task200 python3 bench/executor_task.py --layers 32 \
      --steps 200 --runs cold --out "$OUT/executor_task200.md" --json "$OUT/executor_task200.json"
    [ $((585 - SECONDS)) -ge 50 ] && step $((585 - SECONDS)) task60 python3 bench/executor_task.py --layers 32 \
      --steps 60 --runs cold --reuse --out "$OUT/executor_task60.md" --json "$OUT/executor_task60.json"
    echo "cubins shipped: $shipped, after the tasks: $(cubins)" | tee -a "$OUT/steps.txt"
    rm -f "$OUT"/executor_task*.md
    pack_logs
    ;;
  s54_a)  # prepared in session 53 for the next: search (a) on the code that landed (the side-stream dA on, session 52's
          # table: session 53's search ran with rows since backed out, after a sweep had grown the same cache), then
          # host_profile's 2-job step replayed as graphs with and without recompute (issue 40's 90% busy target)
    export TRITON_CACHE_DIR=/tmp/s54a/triton
    rm -rf /tmp/s54a
    shipped=$(shipped_cubins)
    search_a 240 230
    echo "cubins shipped: $shipped, after search (a): $(cubins)" | tee -a "$OUT/steps.txt"
    [ $((585 - SECONDS)) -ge 120 ] && step $((585 - SECONDS)) hp_graphs python3 bench/host_profile.py --layers 32 \
      --tokens 290 --recompute 1,0 --modes graphs --warmup 12 --iters 10 --out "$OUT/hp_graphs.md"
    rm -f "$OUT"/search_a.md "$OUT"/host_memory.txt
    pack_logs
    ;;
  s54_b)  # prepared in session 53: every GPU test on the code that landed (the capture-ahead commits refactored the
          # step graphs' key building and added a GPU test: not yet run on a GPU), then the 200-step task with step
          # graphs captured ahead of the ranking's decision off / on (LORAPLEX_CAPTURE_AHEAD, trainer.graph_ahead)
    gpu_tests /tmp/s54b
    for v in 0 1; do
      [ $((585 - SECONDS)) -ge 90 ] && LORAPLEX_CAPTURE_AHEAD=$v step $((585 - SECONDS)) "task200_ahead$v" python3 \
        bench/executor_task.py --layers 32 --steps 200 --runs cold --out "$OUT/executor_task200_ahead$v.md" \
        --json "$OUT/executor_task200_ahead$v.json"
    done
    rm -f "$OUT"/executor_task*.md
    pack_logs
    ;;
  s54_c)  # prepared in session 53: the 200-step and 60-step tasks with the capture ahead off, then on (their
          # graphs.ahead, the captures after the ranking), in one call
    export TRITON_CACHE_DIR=/tmp/s54c/triton
    rm -rf /tmp/s54c
    for v in 0 1; do  # the 200-step task first: the 60-step runs reuse the memory model it stores (--reuse)
      LORAPLEX_CAPTURE_AHEAD=$v step 95 "task200_ahead$v" python3 bench/executor_task.py --layers 32 --steps 200 \
        --runs cold --out "$OUT/executor_task200_ahead$v.md" --json "$OUT/executor_task200_ahead$v.json"
      LORAPLEX_CAPTURE_AHEAD=$v step 60 "task60_ahead$v" python3 bench/executor_task.py --layers 32 --steps 60 \
        --runs cold --reuse --out "$OUT/executor_task60_ahead$v.md" --json "$OUT/executor_task60_ahead$v.json"
    done
    rm -f "$OUT"/executor_task*.md
    pack_logs
    ;;
  s54_d)  # session 54, call 2: call 1's 200-step task captured nothing ahead (graphs.ahead 0). The capture ahead now
          # counts why it leaves keys (graphs.ahead_*) and tries keys whose class differs from a warm one only in
          # the rank tile and the alignment (graph_ahead.near_warm). The 200-step task on, the 60-step task off / on,
          # then the step graphs' GPU tests alone, timed to their exit (call 1's full run was cut at 385 s after 100%)
    export TRITON_CACHE_DIR=/tmp/s54d/triton
    rm -rf /tmp/s54d
    ahead_tasks 95 70
    TRITON_CACHE_DIR=/tmp/s54d_tests/triton step 150 graphs_tests python3 -X faulthandler -m pytest -q -p no:cacheprovider \
      --durations=8 tests/gpu/test_step_graphs_gpu.py
    rm -f "$OUT"/executor_task*.md
    pack_logs
    ;;
  s54_e)  # session 54, call 3: call 2's capture ahead ran once, late (the forwards were done after its keys took
          # ~0.8 s of host); now the keys come from lengths (no packing) and each job's stream is copied once, and
          # the ranking's stage 2 hooks too. The 200-step task on, then the 60-step task off / on
    export TRITON_CACHE_DIR=/tmp/s54e/triton
    rm -rf /tmp/s54e
    ahead_tasks 95 70
    rm -f "$OUT"/executor_task*.md
    pack_logs
    ;;
  s54_f)  # session 54, call 4: call 3's captures ahead found the device idle at both hooks (the ranking's two
          # evaluations): the 60-step task with --sync-probe (each evaluation group's host syncs, module loads,
          # host time, and whether the device still ran its forwards at the hook), then every GPU test
    export TRITON_CACHE_DIR=/tmp/s54f/triton
    rm -rf /tmp/s54f
    LORAPLEX_CAPTURE_AHEAD=1 step 100 task60_probe python3 bench/executor_task.py --layers 32 --steps 60 \
      --runs cold --sync-probe --out "$OUT/executor_task60_probe.md" --json "$OUT/executor_task60_probe.json"
    TRITON_CACHE_DIR=/tmp/s54f_tests/triton step $((588 - SECONDS)) gpu_tests python3 -m pytest -q -p no:cacheprovider tests/gpu
    rm -f "$OUT"/executor_task*.md
    pack_logs
    ;;
  s54_g)  # session 54, call 5: call 4's probe found the first evaluation's host held 1.1 s by the first load of
          # the hits variant of _ce_rows (a module load waits for the queued forwards). The engine now loads it at
          # its construction (trainer.head.load_hits_kernel). Its GPU test, the 200-step task with the capture
          # ahead on, then the 60-step task off / on (probed)
    export TRITON_CACHE_DIR=/tmp/s54g/triton
    rm -rf /tmp/s54g
    TRITON_CACHE_DIR=/tmp/s54g_tests/triton step 60 ce_tests python3 -m pytest -q -p no:cacheprovider \
      tests/gpu/test_cross_entropy_gpu.py
    ahead_tasks 95 60 --sync-probe  # (call 5 ran the 200-step task without the probe)
    rm -f "$OUT"/executor_task*.md
    pack_logs
    ;;
  s55_a)  # prepared in session 54 for the next: the capture ahead is now offered at every point of an evaluation
          # (after each forward's backbone is queued, after each group) and runs at the first where the device is
          # still busy (Evaluation.offer_ahead; session 54's hooks after the groups found it idle: the host had
          # waited out the forwards with no sync torch saw: the probe now counts the allocator's mallocs and syncs
          # and marks the host's time at each decoder layer: where it stalls).
          # The step graphs' GPU tests (the ahead test), the 200-step task on (probed), the 60-step task off / on
          # (probed), and the 60-step task on with CUDA_MODULE_LOADING=EAGER (does a lazy kernel load hold the host?)
    export TRITON_CACHE_DIR=/tmp/s55a/triton
    rm -rf /tmp/s55a
    TRITON_CACHE_DIR=/tmp/s55a_tests/triton step 80 graphs_tests python3 -m pytest -q -p no:cacheprovider \
      tests/gpu/test_step_graphs_gpu.py
    ahead_tasks 100 60 --sync-probe
    CUDA_MODULE_LOADING=EAGER LORAPLEX_CAPTURE_AHEAD=1 step 80 task60_eager_loading python3 bench/executor_task.py \
      --layers 32 --steps 60 --runs cold --reuse --sync-probe --out "$OUT/executor_task60_eagerload.md" \
      --json "$OUT/executor_task60_eagerload.json"
    rm -f "$OUT"/executor_task*.md
    pack_logs
    ;;
  s55_b)  # every GPU test on the code that lands (292 s in session 54's call 4, 358 s in session 55's call
          # 3), then search (a) where 150 s are left (search_rest; else s55_c)
    gpu_tests "/tmp/$1"
    export TRITON_CACHE_DIR="/tmp/$1/triton"
    search_rest
    pack_logs
    ;;
  s56_c)  # session 56, call 3: every GPU test on the code that lands, then the graphed 2-job step's wall beyond
          # its graph with the kernels' own time on the same steps (bench/replay_wall.py: issue 40's 90% busy)
    gpu_tests "/tmp/$1"
    export TRITON_CACHE_DIR="/tmp/$1/triton"
    [ $((585 - SECONDS)) -ge 60 ] && step $((585 - SECONDS)) step_gap python3 bench/replay_wall.py --layers 32 \
      --tokens 290 --recompute 0,1 --out "$OUT/step_gap.md"
    pack_logs
    ;;
  s55_c)  # prepared in session 54: search (a) on the code that lands, then the graphed 2-job step with and
          # without recompute (issue 40's 90% busy target on the H200)
    export TRITON_CACHE_DIR=/tmp/s55c/triton
    rm -rf /tmp/s55c
    search_a 240 230
    [ $((585 - SECONDS)) -ge 120 ] && step $((585 - SECONDS)) hp_graphs python3 bench/host_profile.py --layers 32 \
      --tokens 290 --recompute 1,0 --modes graphs --warmup 12 --iters 10 --out "$OUT/hp_graphs.md"
    rm -f "$OUT"/search_a.md "$OUT"/host_memory.txt
    pack_logs
    ;;
  s55_d)  # session 55, call 2: call 1 found every key a capture ahead counted of a class no step ran: the
          # evaluation's held-out sequences had grown the training steps' longest length (engine.seq_cap);
          # an evaluation now grows its own (eval_cap). The step graphs' GPU tests, the 200-step task with the
          # capture ahead on and off, the 60-step task off / on (all probed)
    export TRITON_CACHE_DIR=/tmp/s55d/triton
    rm -rf /tmp/s55d
    TRITON_CACHE_DIR=/tmp/s55d_tests/triton step 80 graphs_tests python3 -m pytest -q -p no:cacheprovider \
      tests/gpu/test_step_graphs_gpu.py
    ahead_tasks 100 60 --sync-probe
    LORAPLEX_CAPTURE_AHEAD=0 step 95 task200_ahead0 python3 bench/executor_task.py --layers 32 --steps 200 \
      --runs cold --sync-probe --out "$OUT/executor_task200_ahead0.md" --json "$OUT/executor_task200_ahead0.json"
    rm -f "$OUT"/executor_task*.md
    pack_logs
    ;;
  s55_e)  # session 55, call 4: engine.eval_cap side by side with the tree before it (c26463c, in $OLD_TREE: its
          # scripts put their own root first on sys.path): the 200-step and 60-step tasks, capture ahead off (the
          # default), order new, old, old, new; then host_profile's graphed 2-job step with and without recompute
          # (issue 40's 90%-busy target)
    old=${OLD_TREE:-.device/old}
    export TRITON_CACHE_DIR=/tmp/s55e/triton
    rm -rf /tmp/s55e
    step 100 task200_new python3 bench/executor_task.py --layers 32 --steps 200 --runs cold \
      --out "$OUT/executor_task200_new.md" --json "$OUT/executor_task200_new.json"
    step 95 task200_old python3 "$old/bench/executor_task.py" --layers 32 --steps 200 --runs cold --reuse \
      --out "$OUT/executor_task200_old.md" --json "$OUT/executor_task200_old.json"
    step 60 task60_old python3 "$old/bench/executor_task.py" --layers 32 --steps 60 --runs cold --reuse \
      --out "$OUT/executor_task60_old.md" --json "$OUT/executor_task60_old.json"
    step 60 task60_new python3 bench/executor_task.py --layers 32 --steps 60 --runs cold --reuse \
      --out "$OUT/executor_task60_new.md" --json "$OUT/executor_task60_new.json"
    [ $((585 - SECONDS)) -ge 100 ] && step $((585 - SECONDS)) hp_graphs python3 bench/host_profile.py --layers 32 \
      --tokens 290 --recompute 1,0 --modes graphs --warmup 12 --iters 10 --out "$OUT/hp_graphs.md"
    rm -f "$OUT"/executor_task*.md
    pack_logs
    ;;
  s55_f)  # session 55, call 5: s55_e's side by side in the other order (old first), within what is left (~300 s)
    old=${OLD_TREE:-.device/old}
    export TRITON_CACHE_DIR=/tmp/s55f/triton
    rm -rf /tmp/s55f
    step 100 task200_old python3 "$old/bench/executor_task.py" --layers 32 --steps 200 --runs cold \
      --out "$OUT/executor_task200_old.md" --json "$OUT/executor_task200_old.json"
    step 95 task200_new python3 bench/executor_task.py --layers 32 --steps 200 --runs cold --reuse \
      --out "$OUT/executor_task200_new.md" --json "$OUT/executor_task200_new.json"
    [ $SECONDS -le 205 ] && step 55 task60_new python3 bench/executor_task.py --layers 32 --steps 60 --runs cold \
      --reuse --out "$OUT/executor_task60_new.md" --json "$OUT/executor_task60_new.json"
    rm -f "$OUT"/executor_task*.md
    pack_logs
    ;;
  s56_a)  # prepared in session 55 for the next: LORAPLEX_CAPTURE_NEXT (trainer.graph_ahead.capture_next: a step's
          # new key captured during the step before it, between its queued backward and its sync; off by default).
          # The step graphs' GPU tests (its test: no sync, the captures serve their steps), then the 200-step and
          # 60-step tasks with it off and on, order off, on, on, off (session 55: the machine's first process is
          # faster by 0.5-1.2 s whichever code it runs). Expected: the 200-step task's 6 captures after step 10 and
          # the 60-step task's 4 after step 3 overlap their previous step (~0.1 s each)
    export TRITON_CACHE_DIR=/tmp/s56a/triton
    rm -rf /tmp/s56a
    TRITON_CACHE_DIR=/tmp/s56a_tests/triton step 90 graphs_tests python3 -m pytest -q -p no:cacheprovider \
      tests/gpu/test_step_graphs_gpu.py
    LORAPLEX_CAPTURE_NEXT=0 step 100 task200_next0 python3 bench/executor_task.py --layers 32 --steps 200 --runs cold \
      --out "$OUT/executor_task200_next0.md" --json "$OUT/executor_task200_next0.json"
    LORAPLEX_CAPTURE_NEXT=1 step 95 task200_next1 python3 bench/executor_task.py --layers 32 --steps 200 --runs cold \
      --reuse --out "$OUT/executor_task200_next1.md" --json "$OUT/executor_task200_next1.json"
    for v in 1 0; do
      LORAPLEX_CAPTURE_NEXT=$v step 60 "task60_next$v" python3 bench/executor_task.py --layers 32 --steps 60 \
        --runs cold --reuse --out "$OUT/executor_task60_next$v.md" --json "$OUT/executor_task60_next$v.json"
    done
    rm -f "$OUT"/executor_task*.md
    pack_logs
    ;;
  s56_b)  # session 56, call 2: call 1 ran the tasks off, on, on, off (the next step's capture gained 1.0 s and
          # 0.12 s against the first process's lead). The step graphs' GPU tests (capture_next's test: 14 steps),
          # the graphed 2-job step's wall beyond its graph (bench/replay_wall.py), the 200-step task on first, search
          # (a) with it on, then the 200-step task off (the other order of call 1)
    export TRITON_CACHE_DIR=/tmp/s56b/triton
    rm -rf /tmp/s56b
    TRITON_CACHE_DIR=/tmp/s56b_tests/triton step 70 graphs_tests python3 -m pytest -q -p no:cacheprovider \
      tests/gpu/test_step_graphs_gpu.py
    step 110 step_gap python3 bench/replay_wall.py --layers 32 --tokens 290 --recompute 0,1 --out "$OUT/step_gap.md"
    LORAPLEX_CAPTURE_NEXT=1 step 100 task200_next1 python3 bench/executor_task.py --layers 32 --steps 200 --runs cold \
      --out "$OUT/executor_task200_next1.md" --json "$OUT/executor_task200_next1.json"
    LORAPLEX_CAPTURE_NEXT=1 SEARCH_A_NAME=search_a_next1 search_a 240 230
    [ $((585 - SECONDS)) -ge 80 ] && LORAPLEX_CAPTURE_NEXT=0 step $((585 - SECONDS)) task200_next0 python3 \
      bench/executor_task.py --layers 32 --steps 200 --runs cold --reuse --out "$OUT/executor_task200_next0.md" \
      --json "$OUT/executor_task200_next0.json"
    rm -f "$OUT"/executor_task*.md "$OUT"/search_a*.md "$OUT"/host_memory.txt
    pack_logs
    ;;
  s56_d)  # session 56, call 4: call 3 found a replayed 2-job step busy in kernels 82-86% of its wall while its
          # graph spans 97-98%: the gaps between its kernels (bench/step_trace.py, without and with recompute, the
          # device's work traces kept), then the 200-step task with the next step's capture off, then on (call 2's
          # order reversed: the machine's first process leads)
    export TRITON_CACHE_DIR=/tmp/s56d/triton
    rm -rf /tmp/s56d
    for rc in 0 1; do
      step 80 "step_trace$rc" python3 bench/step_trace.py --layers 32 --tokens 290 --recompute $rc \
        --out "$OUT/step_trace$rc.md" --trace "$OUT/step_trace$rc.json.gz"
    done
    LORAPLEX_CAPTURE_NEXT=0 step 100 task200_next0 python3 bench/executor_task.py --layers 32 --steps 200 --runs cold \
      --out "$OUT/executor_task200_next0.md" --json "$OUT/executor_task200_next0.json"
    [ $((585 - SECONDS)) -ge 80 ] && LORAPLEX_CAPTURE_NEXT=1 step $((585 - SECONDS)) task200_next1 python3 \
      bench/executor_task.py --layers 32 --steps 200 --runs cold --reuse --out "$OUT/executor_task200_next1.md" \
      --json "$OUT/executor_task200_next1.json"
    rm -f "$OUT"/executor_task*.md
    pack_logs
    ;;
  s56_e)  # session 56, call 5: host_profile's graphed 2-job step with and without recompute, its busy now also
          # measured on the same steps as their wall (the device's work traced; issue 40's 90% busy target)
    export TRITON_CACHE_DIR=/tmp/s56e/triton
    rm -rf /tmp/s56e
    step 200 hp_graphs python3 bench/host_profile.py --layers 32 --tokens 290 --recompute 1,0 --modes graphs \
      --warmup 12 --iters 10 --out "$OUT/hp_graphs.md"
    pack_logs
    ;;
  s57_a)  # prepared in session 56 for the next: every GPU test on the code that lands (session 56's review changed
          # capture_next's stream peek and its unmade count after call 3's 135 passed), then host_profile's graphed
          # step with its traced steps retried until they replayed, and step_trace with the steps' wall
    gpu_tests "/tmp/$1"
    export TRITON_CACHE_DIR="/tmp/$1/triton"
    [ $((585 - SECONDS)) -ge 100 ] && step $((585 - SECONDS)) hp_graphs python3 bench/host_profile.py --layers 32 \
      --tokens 290 --recompute 1,0 --modes graphs --warmup 12 --iters 10 --out "$OUT/hp_graphs.md"
    [ $((585 - SECONDS)) -ge 45 ] && step $((585 - SECONDS)) step_trace0 python3 bench/step_trace.py --layers 32 \
      --tokens 290 --recompute 0 --out "$OUT/step_trace0.md"
    pack_logs
    ;;
  s57_b)  # session 57, call 2: the "cublas" variant's store pass (the LoRA term written for cuBLAS to add onto: 12 a
          # layer, 14-21 us each against a ~3 us bytes floor, ~7 ms of a 2-job step in session 56's trace). Its tiles
          # timed apart and checked (bench/lora_sweep.py --store), then the best one against the default in the
          # graphed 2-job step (host_profile's replays back to back: best, default, best) and the 200-step task
          # (best first, then the default: the later run of a call tends to be faster)
    export TRITON_CACHE_DIR=/tmp/s57b/triton
    rm -rf /tmp/s57b
    step 170 store_sweep python3 bench/lora_sweep.py --store --layout 290x16,1160x64 --pad-to 1536 \
      --out "$OUT/store_sweep.md" --best-out "$OUT/store_best.txt"
    best=$(cat "$OUT/store_best.txt" 2>/dev/null || echo 64,256,4)
    echo "store tile: $best" | tee -a "$OUT/steps.txt"
    if [ "$best" != "64,256,4" ]; then
      for v in "$best" 64,256,4 "$best"; do
        LORAPLEX_LORA_STORE_TILE=$v step 55 "hp_${v//,/x}" python3 bench/host_profile.py --layers 32 --tokens 290 \
          --recompute 0 --modes graphs --warmup 12 --iters 10 --out "$OUT/hp_${v//,/x}_$SECONDS.md"
      done
      LORAPLEX_LORA_STORE_TILE=$best step 100 task200_best python3 bench/executor_task.py --layers 32 --steps 200 \
        --runs cold --out "$OUT/executor_task200_best.md" --json "$OUT/executor_task200_best.json"
      [ $((585 - SECONDS)) -ge 70 ] && step $((585 - SECONDS)) task200_default python3 bench/executor_task.py \
        --layers 32 --steps 200 --runs cold --reuse --out "$OUT/executor_task200_default.md" \
        --json "$OUT/executor_task200_default.json"
    fi
    rm -f "$OUT"/executor_task*.md
    pack_logs
    ;;
  s57_c)  # session 57, call 3: the code that lands (05ffa15's trainer, measured on a GPU only by call 1's tests): the
          # 200-step and 60-step tasks and search (a) on a Triton cache seeded from the shipped archive, cubins counted
    export TRITON_CACHE_DIR=/tmp/s57c/triton
    rm -rf /tmp/s57c
    tasks_then_search
    ;;
  s57_d)  # session 57, call 4: "auto" GEMMs by width ($LORAPLEX_CUBLAS_WIDTH: cuBLAS over the LoRA store for every
          # output of at most that many columns). Session 56's 1,792-row trace ran the persistent kernel's 4096-wide
          # GEMMs at ~500 TFLOP/s and its 1024-wide ones at 300-375, cuBLAS the 1,536-row step's at 650-725. The
          # graphed 2-job step's replays back to back at 1,536 / 1,792 / 2,048 rows (widths 4096, 0, 1024, 4096),
          # then the 200-step task at 4096 first, 0 second (the later run of a call tends to be faster)
    export TRITON_CACHE_DIR=/tmp/s57d/triton
    rm -rf /tmp/s57d
    for w in 4096 0 1024 4096; do
      LORAPLEX_CUBLAS_WIDTH=$w step 60 "hp_w$w" python3 bench/host_profile.py --layers 32 --tokens 290 \
        --recompute 0 --modes graphs --warmup 12 --iters 10 --out "$OUT/hp_w${w}_$SECONDS.md"
    done
    LORAPLEX_CUBLAS_WIDTH=4096 step 100 task200_w4096 python3 bench/executor_task.py --layers 32 --steps 200 \
      --runs cold --out "$OUT/executor_task200_w4096.md" --json "$OUT/executor_task200_w4096.json"
    [ $((585 - SECONDS)) -ge 70 ] && LORAPLEX_CUBLAS_WIDTH=0 step $((585 - SECONDS)) task200_w0 python3 \
      bench/executor_task.py --layers 32 --steps 200 --runs cold --reuse --out "$OUT/executor_task200_w0.md" \
      --json "$OUT/executor_task200_w0.json"
    echo "cubins shipped: $(shipped_cubins), after: $(cubins)" | tee -a "$OUT/steps.txt"
    rm -f "$OUT"/executor_task*.md
    pack_logs
    ;;
  s57_e)  # session 57, call 5: every GPU test on the code that lands (the store pass's launch moved into store_launch,
          # "auto"'s rule into auto_takes_cublas after call 1's 135 passed)
    gpu_tests "/tmp/$1"
    pack_logs
    ;;
  s58_a)  # session 58, call 1 (code at b4224bc's parent dfa38a0; the stream-K code was not kept: `git show
          # b4224bc:kernels/fused_lora.py`, `git show b4224bc:bench/gemm_tail.py`, bench/results/session58_h200.md):
          # the persistent GEMM's short last round shared out by main-loop steps
          # ($LORAPLEX_STREAM_K=1, kernels.fused_lora._streamk_tail): its GPU tests, every GEMM of a 2-job step at
          # 4 graph keys in its six forms with outputs checked (bench/gemm_tail.py), the graphed 2-job step with
          # and without, then the 200-step task with, and without (the later run of a call tends to be faster)
    export TRITON_CACHE_DIR=/tmp/s58a/triton
    rm -rf /tmp/s58a
    step 90 sk_tests python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_gpu.py -k "stream_k or variants"
    step 170 gemm_tail python3 bench/gemm_tail.py --layouts 1024:960,1536:1200,1536:1450,2048:1800 \
      --out "$OUT/gemm_tail.md" --json "$OUT/gemm_tail.json"
    for v in 1 0; do
      LORAPLEX_STREAM_K=$v hp "hp_sk$v" 290 60
    done
    [ $((585 - SECONDS)) -ge 90 ] && LORAPLEX_STREAM_K=1 step 100 task200_sk1 python3 bench/executor_task.py \
      --layers 32 --steps 200 --runs cold --out "$OUT/executor_task200_sk1.md" --json "$OUT/executor_task200_sk1.json"
    [ $((585 - SECONDS)) -ge 75 ] && LORAPLEX_STREAM_K=0 step $((585 - SECONDS)) task200_sk0 python3 \
      bench/executor_task.py --layers 32 --steps 200 --runs cold --reuse --out "$OUT/executor_task200_sk0.md" \
      --json "$OUT/executor_task200_sk0.json"
    rm -f "$OUT"/executor_task*.md
    pack_logs
    ;;
  s58_b)  # session 58, call 2 (code at b4224bc, not kept; see s58_a): stream-K only where the tail is at most a quarter of a tile's steps, "auto"'s cuBLAS
          # rule first, every program launched for a shared-out tail (call 1's 48-tile GEMMs launched 48 and read
          # unwritten partials). Its GPU tests, the GEMMs at a 1,280- and a 1,536-row key, the graphed 2-job step
          # with and without, then the 200-step task with and without on the same call's cache
    export TRITON_CACHE_DIR=/tmp/s58b/triton
    rm -rf /tmp/s58b
    step 80 sk_tests python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_gpu.py -k "stream_k"
    step 110 gemm_tail python3 bench/gemm_tail.py --layouts 1280:1200,1536:1450 \
      --out "$OUT/gemm_tail.md" --json "$OUT/gemm_tail.json"
    for v in 1 0; do
      LORAPLEX_STREAM_K=$v hp "hp_sk$v" 290 60
    done
    for v in 1 0; do
      [ $((585 - SECONDS)) -ge 75 ] && LORAPLEX_STREAM_K=$v step $((v ? 90 : 585 - SECONDS)) "task200_sk$v" \
        python3 bench/executor_task.py --layers 32 --steps 200 --runs cold --reuse \
        --out "$OUT/executor_task200_sk$v.md" --json "$OUT/executor_task200_sk$v.json"
    done
    rm -f "$OUT"/executor_task*.md
    pack_logs
    ;;
  s58_c)  # session 58, call 3 (code at a2b06c0, not kept: `git show a2b06c0:trainer/fused_blocks.py`,
          # bench/results/session58_h200.md): gate_proj on a side stream beside up_proj ($LORAPLEX_MLP_STREAMS=1, trainer.fused_blocks;
          # their backwards follow): the graphs', fused blocks' and engine GPU tests with it, the graphed 2-job step
          # with and without, the 200-step task with and without (on the shipped archive: no kernel changed)
    export TRITON_CACHE_DIR=/tmp/s58c/triton
    rm -rf /tmp/s58c
    LORAPLEX_MLP_STREAMS=1 step 170 ms_tests python3 -m pytest -q -p no:cacheprovider tests/gpu/test_step_graphs_gpu.py \
      tests/gpu/test_norm_act_gpu.py tests/gpu/test_mlp_rebuild_gpu.py tests/gpu/test_engine_gpu.py
    for v in 1 0; do
      LORAPLEX_MLP_STREAMS=$v hp "hp_ms$v" 290 60
    done
    for v in 1 0; do
      [ $((585 - SECONDS)) -ge 75 ] && LORAPLEX_MLP_STREAMS=$v step $((v ? 90 : 585 - SECONDS)) "task200_ms$v" \
        python3 bench/executor_task.py --layers 32 --steps 200 --runs cold --out "$OUT/executor_task200_ms$v.md" \
        --json "$OUT/executor_task200_ms$v.json"
    done
    echo "cubins shipped: $(shipped_cubins), after: $(cubins)" | tee -a "$OUT/steps.txt"
    rm -f "$OUT"/executor_task*.md
    pack_logs
    ;;
  s58_d)  # session 58, call 4 (code at bc0dc47, the MLP streams not kept: see s58_c): $LORAPLEX_MLP_STREAMS side by side in one process kind: the 200-step task four times,
          # on, off, on, off (the first builds the model, the others reuse it), then the graphed 2-job step off, on
    export TRITON_CACHE_DIR=/tmp/s58d/triton
    rm -rf /tmp/s58d
    task200_abab LORAPLEX_MLP_STREAMS ms
    for v in 0 1; do
      [ $((585 - SECONDS)) -ge 40 ] && LORAPLEX_MLP_STREAMS=$v hp "hp_ms${v}_2" 290 40
    done
    echo "cubins shipped: $(shipped_cubins), after: $(cubins)" | tee -a "$OUT/steps.txt"
    rm -f "$OUT"/executor_task*.md
    pack_logs
    ;;
  s58_e)  # session 58, call 5 (code at 2b8a57c; the streams not kept, see s58_c): is the last round's idle time the persistent kernel's static tile order? The graphed
          # 2-job step with gate/up on two streams ($LORAPLEX_MLP_STREAMS, a2b06c0's) under the one-program-a-tile
          # TMA GEMM ("tma": the hardware deals tiles to SMs as they free up) against the default ("auto"), each
          # with and without the streams
    export TRITON_CACHE_DIR=/tmp/s58e/triton
    rm -rf /tmp/s58e
    for combo in auto:0 tma:1 tma:0 auto:1 tma:1; do
      [ $((585 - SECONDS)) -ge 40 ] && LORAPLEX_FUSED_GEMM=${combo%:*} LORAPLEX_MLP_STREAMS=${combo#*:} \
        hp "hp_${combo%:*}_ms${combo#*:}_$SECONDS" 290 90
    done
    pack_logs
    ;;
  s59_a)  # session 59, call 1: the step graphs' GPU tests (the capture on a thread's among them, capturing's entry
          # without a sync for capture_next's), then $LORAPLEX_CAPTURE_THREAD side by side in one process kind: the
          # 200-step task four times, on, off, on, off (the first builds the model, the others reuse it)
    graph_tests_then_thread_abab /tmp/s59a
    echo "cubins shipped: $(shipped_cubins), after: $(cubins)" | tee -a "$OUT/steps.txt"
    rm -f "$OUT"/executor_task*.md
    pack_logs
    ;;
  s59_b)  # session 59, call 2 (s59_a's runs with the capture on a thread failed at the bench's per-step device sync,
          # "operation not permitted when stream is capturing"): the same, with the bench's step timing on the current
          # stream's sync and torch.cuda.synchronize / empty_cache waiting for a capture under way
    graph_tests_then_thread_abab /tmp/s59b
    [ $((585 - SECONDS)) -ge 60 ] && LORAPLEX_CAPTURE_THREAD=1 step 80 task60_th1 python3 bench/executor_task.py \
      --layers 32 --steps 60 --runs cold --reuse --out "$OUT/executor_task60_th1.md" --json "$OUT/executor_task60_th1.json"
    echo "cubins shipped: $(shipped_cubins), after: $(cubins)" | tee -a "$OUT/steps.txt"
    rm -f "$OUT"/executor_task*.md
    pack_logs
    ;;
  s59_c)  # session 59, call 3: s59_b's runs again with the step's sync on an event before its numbers' copy (is a
          # synchronous copy's wait what held the capture thread back: 0.8 s a capture on the thread against 0.3 s inline?)
    graph_tests_then_thread_abab /tmp/s59c
    echo "cubins shipped: $(shipped_cubins), after: $(cubins)" | tee -a "$OUT/steps.txt"
    rm -f "$OUT"/executor_task*.md
    pack_logs
    ;;
  s59_d)  # session 59, call 4: search (a)'s timing phase with the capture on a thread ($LORAPLEX_CAPTURE_THREAD) on, then off
    export TRITON_CACHE_DIR=/tmp/s59d/triton
    rm -rf /tmp/s59d
    n=2
    for v in 1 0; do
      lim=$(( (585 - SECONDS) / n )); n=$((n - 1))
      [ "$lim" -ge 120 ] && LORAPLEX_CAPTURE_THREAD=$v SEARCH_A_NAME=search_a_th$v SEARCH_A_EXTRA="--phase timing" \
        search_a "$lim" $((lim - 15))
    done
    echo "cubins shipped: $(shipped_cubins), after: $(cubins)" | tee -a "$OUT/steps.txt"
    rm -f "$OUT"/search_a_th*.md "$OUT"/host_memory.txt
    pack_logs
    ;;
  s59_e)  # session 59, call 5: every GPU test on the code that lands (the capture on a thread's test among them)
    gpu_tests /tmp/s59e
    pack_logs
    ;;
  s59_f)  # session 59, call 6: search (a) whole (its quality phase replays), with the capture on a thread on
    search_a_thread /tmp/s59f 1 440
    ;;
  s59_g)  # session 59, call 7: s59_f's search (a) with the capture on a thread off (the same machine, right after)
    search_a_thread /tmp/s59g 0 300
    ;;
  s59_h)  # session 59, call 8: the GPU tests nearest the step graphs with the capture on a thread on for every step
    export TRITON_CACHE_DIR=/tmp/s59h/triton
    rm -rf /tmp/s59h
    LORAPLEX_CAPTURE_THREAD=1 step 160 gpu_tests_th1 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_step_graphs_gpu.py \
      tests/gpu/test_engine_gpu.py tests/gpu/test_samples_gpu.py tests/gpu/test_park_gpu.py tests/gpu/test_step_update_gpu.py \
      tests/gpu/test_task_e2e_gpu.py
    pack_logs
    ;;
  s60_a)  # session 60, call 1: every GPU test with the capture on a thread on by default (session 59's s59_h tests among
          # them), then the 200-step task with $LORAPLEX_CAPTURE_THREAD on, off, on, off while the call has room
    gpu_tests /tmp/s60a
    task200_abab LORAPLEX_CAPTURE_THREAD th
    echo "cubins shipped: $(shipped_cubins), after: $(cubins)" | tee -a "$OUT/steps.txt"
    rm -f "$OUT"/executor_task*.md
    pack_logs
    ;;
  s60_b)  # session 60, call 2 (s60_a: every begin on the thread failed, "cannot assign to field 'release'", the
          # frozen recompute policy; fixed): the GPU tests nearest the step graphs and the executor, the capture on a
          # thread on (the default), then the 200-step task with it on, off, on, off
    export TRITON_CACHE_DIR=/tmp/s60b/triton
    rm -rf /tmp/s60b /tmp/s60b_tests
    TRITON_CACHE_DIR=/tmp/s60b_tests/triton step 170 gpu_tests_th python3 -m pytest -q -p no:cacheprovider \
      tests/gpu/test_step_graphs_gpu.py tests/gpu/test_engine_gpu.py tests/gpu/test_samples_gpu.py \
      tests/gpu/test_park_gpu.py tests/gpu/test_step_update_gpu.py tests/gpu/test_task_e2e_gpu.py
    task200_abab LORAPLEX_CAPTURE_THREAD th
    echo "cubins shipped: $(shipped_cubins), after: $(cubins)" | tee -a "$OUT/steps.txt"
    rm -f "$OUT"/executor_task*.md
    pack_logs
    ;;
  s60_c)  # session 60, call 3: every GPU test on the code that lands (the capture on a thread on by default, its
          # begin fixed in s60_b)
    gpu_tests /tmp/s60c
    pack_logs
    ;;
  s60_d)  # session 60, call 4: search (a) whole (its quality phase replays) on the default, the capture on a thread on
    search_a_thread /tmp/s60d 1 440
    ;;
  s60_e)  # session 60, call 5: s60_d's search (a) with the capture on a thread off (the same machine, right after)
    search_a_thread /tmp/s60e 0 300
    ;;
  s61_a)  # prepared in session 60 for the next: sibling groups ($LORAPLEX_LORA_GROUPS=1, kernels.fused_groups: one
          # forward shrink and one dA pass for q/k/v and for gate/up) on a device: their GPU tests and the step graphs'
          # with them on, then the graphed 2-job step off / on / off / on (the first "on" compiles the two group
          # kernels, which the shipped archive lacks), then the 200-step task with them on, off, on, off (compare
          # runs 3 and 4: run 1 may compile)
    export TRITON_CACHE_DIR=/tmp/s61a/triton
    rm -rf /tmp/s61a /tmp/s61a_tests
    LORAPLEX_LORA_GROUPS=1 TRITON_CACHE_DIR=/tmp/s61a_tests/triton step 150 groups_tests python3 -m pytest -q \
      -p no:cacheprovider tests/gpu/test_lora_groups_gpu.py tests/gpu/test_step_graphs_gpu.py
    for v in 0 1 0 1; do
      [ $((585 - SECONDS)) -ge 300 ] && LORAPLEX_LORA_GROUPS=$v hp "hp_g${v}_$SECONDS" 290 60
    done
    task200_abab LORAPLEX_LORA_GROUPS g
    echo "cubins shipped: $(shipped_cubins), after: $(cubins)" | tee -a "$OUT/steps.txt"
    rm -f "$OUT"/executor_task*.md
    pack_logs
    ;;
  s61_c)  # session 61, call 2 (the groups taken out after s61_a): what the step's flash varlen attention costs under
          # its graph's launch bounds; the 60-step task in a fresh process (issue 41's wall / training); every GPU test
          # on the code that lands
    step 90 attention python3 bench/attention_varlen.py --out "$OUT/attention_varlen.md"
    step 90 task60 python3 bench/executor_task.py --layers 32 --steps 60 --runs cold \
      --out "$OUT/executor_task60.md" --json "$OUT/executor_task60.json"
    gpu_tests /tmp/s61c
    rm -f "$OUT"/executor_task60.md
    pack_logs
    ;;
  s61_d)  # session 61, call 3: s61_c's attention bench again (its capture fixed: fresh leaves, warmup on a side stream)
    step 120 attention python3 bench/attention_varlen.py --out "$OUT/attention_varlen.md"
    pack_logs
    ;;
  s61_e)  # session 61, calls 4 to 6: bench/lora_concat.py, every LoRA pass as cuBLAS GEMMs on factors kept beside the frozen
          # weight, against today's fused operator: one layer's seven linears as a graph, a 2-job step's rows and an
          # 8-job step's
    step 200 concat2 python3 bench/lora_concat.py --out "$OUT/lora_concat_2jobs.md"
    step 150 concat8 python3 bench/lora_concat.py --tokens 5800 --ranks 16,32,64,16,32,64,16,32 \
      --share 0.125,0.125,0.125,0.125,0.125,0.125,0.125,0.125 --out "$OUT/lora_concat_8jobs.md"
    pack_logs
    ;;
  s61_f)  # session 61, call 7: staged LoRA (trainer.lora_stage, LORAPLEX_LORA_STAGE=1: a small step's LoRA passes as
          # cuBLAS GEMMs over stacked factors): its GPU tests, the graphed 2-job step off / on / off / on, then the
          # 200-step task on and off. It ran with no step staged: a graph key's job slots (8 at least) made 512
          # stacked rows, over the cap; the keys now carry their own staged slots (GraphKey.stage): phase s62_a
    step 100 stage_tests python3 -m pytest -q -p no:cacheprovider tests/gpu/test_lora_stage_gpu.py
    for v in 0 1 0 1; do
      [ $((320 - SECONDS)) -ge 60 ] && LORAPLEX_LORA_STAGE=$v hp "hp_stage${v}_$SECONDS" 290 55
    done
    for v in 1 0; do
      [ $((320 - SECONDS)) -ge 75 ] && LORAPLEX_LORA_STAGE=$v step 90 "task200_stage$v" python3 bench/executor_task.py \
        --layers 32 --steps 200 --runs cold --out "$OUT/executor_task200_stage$v.md" --json "$OUT/executor_task200_stage$v.json"
    done
    rm -f "$OUT"/executor_task*.md
    pack_logs
    ;;
  s62_a)  # prepared in session 61 for the next: staged LoRA with the keys' own staged slots. Its GPU tests; the
          # graphed 2-job step off / on / off / on (its kernel table shows whether the step staged: no _shrink_jit
          # in the LoRA linears' place); the 200-step task on, off, on, off (compare runs 3 and 4). Not the other
          # GPU tests with it on: their isolation and capture-count tests fail with it on by design (docs/architecture.md)
    rm -rf /tmp/s62a
    TRITON_CACHE_DIR=/tmp/s62a/triton step 100 stage_tests python3 -m pytest -q -p no:cacheprovider \
      tests/gpu/test_lora_stage_gpu.py
    for v in 0 1 0 1; do
      [ $((585 - SECONDS)) -ge 300 ] && LORAPLEX_LORA_STAGE=$v hp "hp_stage${v}_$SECONDS" 290 60
    done
    task200_abab LORAPLEX_LORA_STAGE stage
    rm -f "$OUT"/executor_task*.md
    pack_logs
    ;;
  s62_b)  # staged LoRA taken out (s62_a: no gain in the task): where an evaluation and a decode token step spend the
          # device today (the evaluations are 42% of search (a), the samples ~2.3 s of a task), then the 60-step task
    export TRITON_CACHE_DIR=/tmp/s62b/triton
    rm -rf /tmp/s62b
    step 150 eval_profile_12 python3 bench/eval_profile.py --layers 32 --jobs 12 --out "$OUT/eval_profile_12.md"
    step 130 eval_profile_8 python3 bench/eval_profile.py --layers 32 --jobs 8 --chunk 16 --cap 128 --tokens 365 \
      --out "$OUT/eval_profile_8.md"
    step 100 decode_kernels python3 bench/decode_kernels.py --layers 32 --new 48 --out "$OUT/decode_kernels.md"
    [ $((585 - SECONDS)) -ge 80 ] && step 90 task60 python3 bench/executor_task.py --layers 32 --steps 60 --runs cold \
      --out "$OUT/executor_task60.md" --json "$OUT/executor_task60.json"
    rm -f "$OUT"/executor_task*.md
    pack_logs
    ;;
  s62_c)  # every GPU test on the code that lands (staged LoRA out), then the 200-step task in what the call has left
    gpu_tests /tmp/s62c
    [ $((585 - SECONDS)) -ge 75 ] && step 90 task200 python3 bench/executor_task.py --layers 32 --steps 200 --runs cold \
      --out "$OUT/executor_task200.md" --json "$OUT/executor_task200.json"
    rm -f "$OUT"/executor_task*.md
    pack_logs
    ;;
  s62_d)  # does the node's fixed cuBLAS workspace (CUBLAS_WORKSPACE_CONFIG=:4096:8, worker.processes: the repeatable
          # decode) slow training against a 32 MiB one (torch's default on sm90)? The graphed 2-job step, then the
          # 200-step task, 4 MiB / 32 MiB alternating (the call's lease left ~480 s)
    i=0
    for v in :4096:8 :32768:8; do
      CUBLAS_WORKSPACE_CONFIG=$v hp "hp_ws${v//:/_}" 290 60
    done
    for v in :4096:8 :32768:8 :4096:8 :32768:8; do
      i=$((i + 1))
      [ $((420 - SECONDS)) -ge 60 ] && CUBLAS_WORKSPACE_CONFIG=$v step 90 "task200_ws${v//:/_}_$i" python3 \
        bench/executor_task.py --layers 32 --steps 200 --runs cold $([ $i -gt 1 ] && echo --reuse) \
        --out "$OUT/executor_task200_ws_$i.md" --json "$OUT/executor_task200_ws_$i.json"
    done
    rm -f "$OUT"/executor_task*.md
    pack_logs
    rm -f "$OUT"/gpu.txt  # in the logs' archive: the call returns 8 files
    ;;
  s63_a)  # before building it: the LoRA term folded into cuBLAS's base GEMMs along K (bench/kconcat_step.py) against the
          # product's form and the backbone alone, in the real graphed 2-job step (ABAB), the node's 4 MiB cuBLAS
          # workspace; then the same with 32 MiB where the call has the time
    export TRITON_CACHE_DIR=/tmp/s63a/triton
    rm -rf /tmp/s63a
    CUBLAS_WORKSPACE_CONFIG=:4096:8 step 300 kconcat_ws4 python3 bench/kconcat_step.py --layers 32 --tokens 290 \
      --forms product,kconcat,base,product,kconcat --out "$OUT/kconcat_ws4.md"
    [ $((585 - SECONDS)) -ge 170 ] && CUBLAS_WORKSPACE_CONFIG=:32768:8 step $((575 - SECONDS)) kconcat_ws32 python3 \
      bench/kconcat_step.py --layers 32 --tokens 290 --forms kconcat,product,kconcat --out "$OUT/kconcat_ws32.md"
    pack_logs
    ;;
  s63_b)  # the 200-step task were the LoRA term free (bench/executor_task.py --lora-form base: every LoRA linear its
          # backbone GEMM alone) against the product, alternating: is 14k tok/s within the backbone's own pace?
    export TRITON_CACHE_DIR=/tmp/s63b/triton
    rm -rf /tmp/s63b
    i=0
    for f in product base product base; do
      i=$((i + 1))
      [ $((585 - SECONDS)) -ge 80 ] && step 100 "task200_${f}_$i" python3 bench/executor_task.py --layers 32 --steps 200 \
        --runs cold $([ $i -gt 1 ] && echo --reuse) --lora-form "$f" --out "$OUT/executor_task200_${f}_$i.md" \
        --json "$OUT/executor_task200_${f}_$i.json"
    done
    rm -f "$OUT"/executor_task*.md
    pack_logs
    ;;
  s64_a)  # session 64, call 1: the store pass as a column loop (kernels/store_loop.py: one row tile a program, its P
          # held in registers over a pipelined loop of column tiles) against the tile form (6.78 ms a 2-job step at
          # 3.5x its bytes, session 57). Its GPU test; every loop candidate and the tile form timed apart and checked
          # against float64 (bench/lora_sweep.py --store); the best loop against the tile form in the graphed 2-job
          # step (loop, tile, loop) and, where the call has the time, the 200-step task (loop, then tile)
    export TRITON_CACHE_DIR=/tmp/s64a/triton
    rm -rf /tmp/s64a
    step 90 store_loop_gpu python3 -m pytest -q -p no:cacheprovider tests/gpu/test_store_loop_gpu.py
    step 240 store_sweep python3 bench/lora_sweep.py --store --layout 290x16,1160x64 --pad-to 1536 \
      --tiles "64,256,4;64,128,4" --out "$OUT/store_sweep.md" --best-loop-out "$OUT/store_loop_best.txt"
    best=$(cat "$OUT/store_loop_best.txt" 2>/dev/null)
    rm -f "$OUT/store_loop_best.txt"
    echo "store loop: ${best:-none}" | tee -a "$OUT/steps.txt"
    [ -n "$best" ] && on_off loop tile "LORAPLEX_LORA_STORE_FORM=loop LORAPLEX_LORA_STORE_LOOP=$best" \
      LORAPLEX_LORA_STORE_FORM=tile
    pack_logs
    ;;
  s64_b)  # session 64, call 2: Nsight Compute on a small step's LoRA passes (bench/ncu_passes.py: forward shrink, one-pass
          # dS + dB, dA, the store pass forward and backward, at 4096x4096, 4096x14336, 14336x4096; the 2-job layout):
          # occupancy, registers, warp stall reasons, achieved bandwidth
    export TRITON_CACHE_DIR=/tmp/s64b/triton
    rm -rf /tmp/s64b
    if command -v ncu >/dev/null; then
      step 240 ncu_passes ncu --profile-from-start off --set full --nvtx -o "$OUT/passes" python3 bench/ncu_passes.py
      ncu --import "$OUT/passes.ncu-rep" --page details --print-nvtx-rename kernel > "$OUT/ncu_details.txt" 2>&1 \
        || ncu --import "$OUT/passes.ncu-rep" --page details > "$OUT/ncu_details.txt" 2>&1
      ncu --import "$OUT/passes.ncu-rep" --page raw --csv 2>&1 | gzip > "$OUT/ncu_raw.csv.gz"
      rm -f "$OUT/passes.ncu-rep"
    else
      echo "no ncu on this machine" | tee -a "$OUT/steps.txt"
    fi
    pack_logs
    ;;
  s64_c)  # session 64, call 3: the store pass with a TMA store (kernels/lora_store.py: 128 registers a thread against the
          # tile form's 242-255, ~40% fewer instructions; Nsight Compute found the tile form bound by its instructions,
          # call 2). Its GPU test; every TMA tile and the tile form timed apart and checked against float64
          # (bench/lora_sweep.py --store); the best TMA tile against the tile form in the graphed 2-job step (tma,
          # tile, tma) and the 200-step task (tma, then tile)
    export TRITON_CACHE_DIR=/tmp/s64c/triton
    rm -rf /tmp/s64c
    step 90 lora_store_gpu python3 -m pytest -q -p no:cacheprovider tests/gpu/test_lora_store_gpu.py
    step 200 store_sweep python3 bench/lora_sweep.py --store --layout 290x16,1160x64 --pad-to 1536 \
      --tiles "64,256,4" --out "$OUT/store_sweep.md" --best-tma-out "$OUT/store_tma_best.txt"
    best=$(cat "$OUT/store_tma_best.txt" 2>/dev/null)
    rm -f "$OUT/store_tma_best.txt"
    echo "store tma: ${best:-none}" | tee -a "$OUT/steps.txt"
    [ -n "$best" ] && on_off tma tile "LORAPLEX_LORA_STORE_FORM=tma LORAPLEX_LORA_STORE_TMA=$best" \
      LORAPLEX_LORA_STORE_FORM=tile
    pack_logs
    ;;
  s64_d)  # session 64, call 4: the LoRA pass beside cuBLAS's GEMM (LORAPLEX_LORA_OVERLAP=1: where "auto" gives a GEMM to
          # cuBLAS, the forward shrink / the backward's dS + dB run on the side stream beside its beta = 0 GEMM, and
          # kernels/lora_add.py adds the LoRA term after, instead of the store pass before a beta = 1 GEMM). Its GPU
          # test (the graph capture included); the graphed 2-job step on / off / on; the 200-step task on, then off
    export TRITON_CACHE_DIR=/tmp/s64d/triton
    rm -rf /tmp/s64d
    step 120 lora_overlap_gpu python3 -m pytest -q -p no:cacheprovider tests/gpu/test_lora_overlap_gpu.py
    on_off overlap1 overlap0 LORAPLEX_LORA_OVERLAP=1 LORAPLEX_LORA_OVERLAP=0
    pack_logs
    ;;
  s64_e)  # session 64, call 5: where a replayed 2-job step's wall goes beyond its graph (bench/step_gap.py: steps back to
          # back as the executor runs them, each cut at its calls), the updates decided on the host, then on the device,
          # then on the host again
    export TRITON_CACHE_DIR=/tmp/s64e/triton
    rm -rf /tmp/s64e
    step 100 gap_host1 python3 bench/step_gap.py --layers 32 --tokens 290 --steps 40 --out "$OUT/step_gap_host1.md"
    step 100 gap_device python3 bench/step_gap.py --layers 32 --tokens 290 --steps 40 --device-update \
      --out "$OUT/step_gap_device.md"
    [ $((585 - SECONDS)) -ge 90 ] && step 90 gap_host2 python3 bench/step_gap.py --layers 32 --tokens 290 --steps 40 \
      --out "$OUT/step_gap_host2.md"
    pack_logs
    ;;
  s65_a)  # next session, call 1: the 200-step task as the product runs its steps (no sync of the script's own, the new
          # default of bench/executor_task.py) against --step-sync (a sync before and after every step and the
          # allocator's statistics: sessions 19-64's tables), alternating, and once with the updates decided on the
          # device; bench/step_gap.py's bare engine beside it (files: 5 JSON + step_gap + steps + logs = 8)
    export TRITON_CACHE_DIR=/tmp/s65a/triton
    rm -rf /tmp/s65a
    # "device": light, with the updates decided on the device (LORAPLEX_DEVICE_UPDATE=1: launched before the step's
    # sync; session 51 found no gain in the task, measured with the script's per-step syncs, which wait for them)
    i=0
    for mode in light synced device light synced; do
      i=$((i + 1))
      [ $((585 - SECONDS)) -ge 80 ] && LORAPLEX_DEVICE_UPDATE=$([ "$mode" = device ] && echo 1 || echo 0) \
        step 100 "task200_${mode}_$i" python3 bench/executor_task.py --layers 32 \
        --steps 200 --runs cold $([ $i -gt 1 ] && echo --reuse) $([ "$mode" = synced ] && echo --step-sync) \
        --out "$OUT/executor_task200_${mode}_$i.md" --json "$OUT/executor_task200_${mode}_$i.json"
    done
    [ $((585 - SECONDS)) -ge 70 ] && step 70 step_gap python3 bench/step_gap.py --layers 32 --tokens 290 --steps 40 \
      --out "$OUT/step_gap.md"
    rm -f "$OUT"/executor_task*.md
    pack_logs
    rm -f "$OUT"/gpu.txt  # in the logs' archive: the call returns 8 files
    ;;
  s65_b)  # session 65, call 2: every GPU test on the code with trainer.step_pipeline (the next graphed step launched
          # before this one's sync; on by default), then the 200-step task with it on / off / on / off while the call
          # has the time (files: 4 JSON + steps + logs)
    gpu_tests /tmp/s65b
    task200_abab LORAPLEX_STEP_AHEAD ahead
    rm -f "$OUT"/executor_task*.md
    pack_logs
    ;;
  s65_c)  # session 65, call 3 (the session's last 626 s of device time): the step pipeline's GPU tests (rewritten after
          # s65_b: tolerances of two runs of the same graphs, and stream order measured), then the 200-step task with it
          # on / off / on / off while 75 s are left before 350 s (files: up to 4 JSON + steps + logs)
    export TRITON_CACHE_DIR=/tmp/s65c/triton
    rm -rf /tmp/s65c
    step 120 pipeline_gpu python3 -m pytest -q -p no:cacheprovider tests/gpu/test_step_pipeline_gpu.py
    task200_abab LORAPLEX_STEP_AHEAD ahead 350 75
    rm -f "$OUT"/executor_task*.md
    pack_logs
    rm -f "$OUT"/gpu.txt
    ;;
  s66_a)  # session 66, call 1: the step graphs' and the pipeline's GPU tests on this code; the 200-step task with a
          # covered key captured on the thread at once (LORAPLEX_EARLY_CAPTURE, graph_thread.early) on / off, and on
          # with 16 and with 8 graph sizes an octave, twice, while the call has 60 s before 530; then
          # bench/alloc_growth.py (files: the runs' JSON in one archive, steps, logs). The early capture was taken out
          # after this call (its code: c8ed99a); on later trees LORAPLEX_EARLY_CAPTURE does nothing
    export TRITON_CACHE_DIR=/tmp/s66a/triton
    rm -rf /tmp/s66a
    step 150 graphs_gpu python3 -m pytest -q -p no:cacheprovider tests/gpu/test_step_graphs_gpu.py \
      tests/gpu/test_step_pipeline_gpu.py
    task200_runs 530 60 early1_1 "LORAPLEX_EARLY_CAPTURE=1" early0_2 "LORAPLEX_EARLY_CAPTURE=0" \
      early1b16_3 "LORAPLEX_EARLY_CAPTURE=1 LORAPLEX_GRAPH_BUCKETS=16" \
      early1b8_4 "LORAPLEX_EARLY_CAPTURE=1 LORAPLEX_GRAPH_BUCKETS=8" early1_5 "LORAPLEX_EARLY_CAPTURE=1" \
      early0_6 "LORAPLEX_EARLY_CAPTURE=0" early1b16_7 "LORAPLEX_EARLY_CAPTURE=1 LORAPLEX_GRAPH_BUCKETS=16" \
      early1b8_8 "LORAPLEX_EARLY_CAPTURE=1 LORAPLEX_GRAPH_BUCKETS=8"
    step 40 alloc_growth python3 bench/alloc_growth.py --out "$OUT/alloc_growth.md"
    (cd "$OUT" && tar -czf tasks.tar.gz executor_task200_*.json && rm -f executor_task*.json executor_task*.md)
    pack_logs
    ;;
  s66_b)  # session 66, call 2: the 200-step task (the code that lands) with its first three steps, the two after the
          # ranking (each a capture at its start) and a replay under torch.profiler (bench/step_profile.py), in a fresh
          # process and in a second one; then every GPU test while the call has the time (files: one archive of the
          # runs' JSON and profiles, steps, logs, gpu tests)
    export TRITON_CACHE_DIR=/tmp/s66b/triton
    rm -rf /tmp/s66b
    TASK_FLAGS="--profile-steps 0,1,2,10,11,12" task200_runs 585 60 prof_1 "LORAPLEX_STEP_AHEAD=0" \
      prof_2 "LORAPLEX_STEP_AHEAD=0"
    (cd "$OUT" && tar -czf tasks.tar.gz executor_task200_*.json executor_task200_*_step*.txt \
      && rm -f executor_task*.json executor_task*.md executor_task200_*_step*.txt)
    TRITON_CACHE_DIR=/tmp/s66b_tests/triton step $((585 - SECONDS)) gpu_tests python3 -m pytest -q -p no:cacheprovider \
      tests/gpu
    pack_logs
    rm -f "$OUT"/gpu.txt
    ;;
  s66_c)  # prepared in session 66 (its last 222 s could not start a machine), ~1 min for the next session's first call:
          # the first calls of a fresh process's ops (bench/first_calls.py), lazily loaded modules (the default), then
          # CUDA_MODULE_LOADING=EAGER
    step 25 first_calls python3 bench/first_calls.py --out "$OUT/first_calls.md"
    CUDA_MODULE_LOADING=EAGER step 25 first_calls_eager python3 bench/first_calls.py --out "$OUT/first_calls_eager.md"
    ;;
  s67_a)  # session 67, call 1: the zeroed slab's, step graphs' and kernels' GPU tests; the 200-step task new / old,
          # alternating while the call has 70 s before 520 (new: the shrinks on a step's zeroed slab, the pinner's
          # registrations in the loop's device waits, captures at a step's start without a sync where room is plenty;
          # old: each off, as session 66's code ran); then bench/first_calls.py (s66_c) in what is left
    export TRITON_CACHE_DIR=/tmp/s67a/triton
    rm -rf /tmp/s67a
    TRITON_CACHE_DIR=/tmp/s67a_tests/triton step 200 gpu_some python3 -m pytest -q -p no:cacheprovider \
      tests/gpu/test_zero_slab_gpu.py tests/gpu/test_step_graphs_gpu.py tests/gpu/test_kernels_gpu.py
    task200_runs 520 70 new_1 "$S67_NEW" old_2 "$S67_OLD" new_3 "$S67_NEW" old_4 "$S67_OLD" new_5 "$S67_NEW" \
      old_6 "$S67_OLD"
    (cd "$OUT" && tar -czf tasks.tar.gz executor_task200_*.json && rm -f executor_task*.json executor_task*.md)
    [ $((585 - SECONDS)) -ge 55 ] && step 25 first_calls python3 bench/first_calls.py --out "$OUT/first_calls.md"
    [ $((585 - SECONDS)) -ge 28 ] && CUDA_MODULE_LOADING=EAGER step 25 first_calls_eager python3 bench/first_calls.py \
      --out "$OUT/first_calls_eager.md"
    pack_logs
    ;;
  s67_b)  # session 67, call 2: every GPU test on the code that lands (the slab and the capture's sync taken out after
          # call 1; the first calls made on the load's worker); then the 200-step task new / old while the call has 60 s
          # before 585 (new: the pinner in the loop's device waits and the first calls ahead; old: neither)
    export TRITON_CACHE_DIR=/tmp/s67b/triton
    rm -rf /tmp/s67b
    TRITON_CACHE_DIR=/tmp/s67b_tests/triton step 400 gpu_tests python3 -m pytest -q -p no:cacheprovider tests/gpu
    task200_runs 585 60 new_1 "$S67B_NEW" old_2 "$S67B_OLD" new_3 "$S67B_NEW" old_4 "$S67B_OLD"
    (cd "$OUT" && tar -czf tasks.tar.gz executor_task200_*.json && rm -f executor_task*.json executor_task*.md)
    pack_logs
    rm -f "$OUT"/gpu.txt
    ;;
  s67_c)  # session 67, call 3 (where the budget allows): the 200-step task new / old / new / old / new / old (s67_b's)
    export TRITON_CACHE_DIR=/tmp/s67c/triton
    rm -rf /tmp/s67c
    task200_runs 585 60 new_1 "$S67B_NEW" old_2 "$S67B_OLD" new_3 "$S67B_NEW" old_4 "$S67B_OLD" new_5 "$S67B_NEW" \
      old_6 "$S67B_OLD" new_7 "$S67B_NEW" old_8 "$S67B_OLD"
    (cd "$OUT" && tar -czf tasks.tar.gz executor_task200_*.json && rm -f executor_task*.json executor_task*.md)
    pack_logs
    ;;
  s68_a)  # prepared in session 67 for the next session's first call: every GPU test on the code that landed (b582e2c's
          # leaner LoRA-op host path had not run on a device), then the 200-step task while the call has 60 s before 585
    export TRITON_CACHE_DIR=/tmp/s68a/triton
    rm -rf /tmp/s68a
    TRITON_CACHE_DIR=/tmp/s68a_tests/triton step 400 gpu_tests python3 -m pytest -q -p no:cacheprovider tests/gpu
    task200_runs 585 60 land_1 "LORAPLEX_FIRST_CALLS=1" land_2 "LORAPLEX_FIRST_CALLS=1" land_3 "LORAPLEX_FIRST_CALLS=1"
    (cd "$OUT" && tar -czf tasks.tar.gz executor_task200_*.json && rm -f executor_task*.json executor_task*.md)
    pack_logs
    rm -f "$OUT"/gpu.txt
    ;;
  s68_b)  # session 68's second call: the 200-step task with more GEMMs on cuBLAS (over the LoRA store pass), side by side:
          # the default ("auto": cuBLAS where the persistent tiles fill under 0.75 of their last round), every GEMM on
          # cuBLAS (CUBLAS_BELOW 1.01) and every output of at most 4096 columns on cuBLAS (CUBLAS_WIDTH 4096), in turn
    export TRITON_CACHE_DIR=/tmp/s68b/triton
    rm -rf /tmp/s68b
    task200_runs 585 60 base_1 "LORAPLEX_CUBLAS_BELOW=0.75" below_1 "LORAPLEX_CUBLAS_BELOW=1.01" \
      width_1 "LORAPLEX_CUBLAS_WIDTH=4096" base_2 "LORAPLEX_CUBLAS_BELOW=0.75" below_2 "LORAPLEX_CUBLAS_BELOW=1.01" \
      width_2 "LORAPLEX_CUBLAS_WIDTH=4096" base_3 "LORAPLEX_CUBLAS_BELOW=0.75" below_3 "LORAPLEX_CUBLAS_BELOW=1.01" \
      width_3 "LORAPLEX_CUBLAS_WIDTH=4096"
    (cd "$OUT" && tar -czf tasks.tar.gz executor_task200_*.json && rm -f executor_task*.json executor_task*.md)
    pack_logs
    rm -f "$OUT"/gpu.txt
    ;;
  s68_c)  # session 68's third call: the step graphs' GPU tests on the code with graph_ahead.widen (a set's first capture
          # takes the next step's key), then the 200-step task with it on (the default) and off, in turn, to 500 s
    export TRITON_CACHE_DIR=/tmp/s68c/triton
    rm -rf /tmp/s68c
    TRITON_CACHE_DIR=/tmp/s68c_tests/triton step 130 gpu_tests python3 -m pytest -q -p no:cacheprovider \
      tests/gpu/test_step_graphs_gpu.py
    task200_runs 500 50 on_1 "LORAPLEX_WIDEN_START=1" off_1 "LORAPLEX_WIDEN_START=0" on_2 "LORAPLEX_WIDEN_START=1" \
      off_2 "LORAPLEX_WIDEN_START=0" on_3 "LORAPLEX_WIDEN_START=1" off_3 "LORAPLEX_WIDEN_START=0" \
      on_4 "LORAPLEX_WIDEN_START=1" off_4 "LORAPLEX_WIDEN_START=0"
    (cd "$OUT" && tar -czf tasks.tar.gz executor_task200_*.json && rm -f executor_task*.json executor_task*.md)
    pack_logs
    rm -f "$OUT"/gpu.txt
    ;;
  s69_a)  # session 69's first call: the warp-specialised Gluon GEMM (kernels/ws_gemm.py, no LoRA term) side by side with
          # cuBLAS and the product's fused GEMMs at the 2-job step's graph keys, each variant in its own process
    export TRITON_CACHE_DIR=/tmp/s69a/triton
    rm -rf /tmp/s69a
    step 200 ws_coop python3 bench/ws_gemm_bench.py --variants coop --json "$OUT/ws_gemm_coop.json"
    step 120 ws_pingpong python3 bench/ws_gemm_bench.py --variants pingpong --no-product --json "$OUT/ws_gemm_pingpong.json"
    step 120 ws_pingpong_n256 python3 bench/ws_gemm_bench.py --variants pingpong_n256 --no-product \
      --json "$OUT/ws_gemm_pingpong_n256.json"
    pack_logs
    rm -f "$OUT"/gpu.txt
    ;;
  s69_b)  # session 69's second call: the Gluon GEMM's GPU tests, then every variant with the LoRA term beside the
          # product's fused GEMMs and cuBLAS
    export TRITON_CACHE_DIR=/tmp/s69b/triton
    rm -rf /tmp/s69b
    step 150 gpu_tests_ws python3 -m pytest -q -p no:cacheprovider tests/gpu/test_ws_gemm_gpu.py
    step 330 ws_lora python3 bench/ws_gemm_bench.py --variants pingpong,pingpong_s5,pingpong_n256,coop --lora \
      --layouts 1024:960,1536:1450,2048:1800,2560:2400 --json "$OUT/ws_gemm_lora.json"
    pack_logs
    rm -f "$OUT"/gpu.txt
    ;;
  s69_c)  # session 69's third call: the 200-step task with the 14336-wide GEMMs (LORAPLEX_WS_MIN_WIDTH's default) on the
          # Gluon GEMM (LORAPLEX_WS_GEMM=$WS_VARIANT, default pingpong) against today's forms, alternating to 480 s;
          # ws_1 compiles the Gluon kernels (not in the shipped cache): compare the later runs
    export TRITON_CACHE_DIR=/tmp/s69c/triton
    rm -rf /tmp/s69c
    V=${WS_VARIANT:-pingpong}
    task200_runs 480 55 base_1 "LORAPLEX_WS_GEMM=0" ws_1 "LORAPLEX_WS_GEMM=$V" base_2 "LORAPLEX_WS_GEMM=0" \
      ws_2 "LORAPLEX_WS_GEMM=$V" base_3 "LORAPLEX_WS_GEMM=0" ws_3 "LORAPLEX_WS_GEMM=$V" base_4 "LORAPLEX_WS_GEMM=0" \
      ws_4 "LORAPLEX_WS_GEMM=$V" base_5 "LORAPLEX_WS_GEMM=0" ws_5 "LORAPLEX_WS_GEMM=$V"
    (cd "$OUT" && tar -czf tasks.tar.gz executor_task200_*.json && rm -f executor_task*.json executor_task*.md)
    pack_logs
    rm -f "$OUT"/gpu.txt
    ;;
  s70_a)  # prepared in session 69 for the next session's first call: the Gluon GEMM's GPU tests (with pingpong_pf, whose
          # consumers prefetch the tile's first LoRA block before the main loop, and the epilogue refactored into
          # _lora_block: neither has run on a device), the GEMMs with the LoRA term beside "auto", then the 200-step
          # task with the 14336-wide GEMMs on pingpong_pf (all, or only those dA does not run beside) against the
          # default, alternating, while 50 s are left of 585
    export TRITON_CACHE_DIR=/tmp/s70a/triton
    rm -rf /tmp/s70a
    step 150 gpu_tests_ws python3 -m pytest -q -p no:cacheprovider tests/gpu/test_ws_gemm_gpu.py
    step 150 ws_lora python3 bench/ws_gemm_bench.py --variants pingpong,pingpong_pf --lora --layouts 1536:1450,2560:2400 \
      --json "$OUT/ws_gemm_lora.json"
    # pffwd: the Gluon GEMM on the 14336-wide GEMMs that dA does not run beside (gate/up forward; session 70)
    task200_runs 585 50 base_1 "LORAPLEX_WS_GEMM=0" pf_1 "LORAPLEX_WS_GEMM=pingpong_pf" \
      pffwd_1 "LORAPLEX_WS_GEMM=pingpong_pf LORAPLEX_WS_BESIDE_DA=0" base_2 "LORAPLEX_WS_GEMM=0" \
      pffwd_2 "LORAPLEX_WS_GEMM=pingpong_pf LORAPLEX_WS_BESIDE_DA=0" pf_2 "LORAPLEX_WS_GEMM=pingpong_pf" \
      base_3 "LORAPLEX_WS_GEMM=0" pffwd_3 "LORAPLEX_WS_GEMM=pingpong_pf LORAPLEX_WS_BESIDE_DA=0"
    (cd "$OUT" && tar -czf tasks.tar.gz executor_task200_*.json && rm -f executor_task*.json executor_task*.md)
    pack_logs
    rm -f "$OUT"/gpu.txt
    ;;
  s74_a)  # session 74: the norm kernels no longer specialise on their row count; compiled for every width (bench/norm_cache.py,
          # an empty cache), merged into this call's copy of the archive, then search (a) and the 60-step task on a fresh
          # cache seeded from it, cubins counted (none may be added). Bring back norm_cache_sm90.tar.gz and merge it here.
    export TRITON_CACHE_DIR=/tmp/s74n/triton
    rm -rf /tmp/s74n
    step 150 norm_cache python3 bench/norm_cache.py
    tar -C /tmp/s74n -czf "$OUT/norm_cache_sm90.tar.gz" triton
    step 60 merge python3 -m kernels.shipped_cache --merge "$OUT/norm_cache_sm90.tar.gz"
    echo "cubins in the merged archive: $(shipped_cubins)" | tee -a "$OUT/steps.txt"
    search_then_task /tmp/s74a 240 230
    rm -f "$OUT"/executor_task60.md
    pack_logs
    rm -f "$OUT"/host_memory.txt "$OUT"/gpu.txt
    ;;
  s74_d)  # session 74, the lease's last ~400 s: bench/head_rows.py (the LM head over target rows only: its bound, and the
          # persistent fused GEMM skipping the rows past the targets, tuned for the head's shapes)
    export TRITON_CACHE_DIR=/tmp/s74d/triton
    rm -rf /tmp/s74d
    LORAPLEX_TUNE=1 step 280 head_rows python3 bench/head_rows.py --out "$OUT/head_rows.md"
    pack_logs
    ;;
  s74_c)  # session 74: call 2's 200-step task ran 2-5% slower replays than session 73's in every token bucket. Is it the norm
          # kernels' lost row specialisation (bench/norm_spec.py, side by side), or the machine (the task x3 more)?
    TRITON_CACHE_DIR=/tmp/s74c_spec/triton step 90 norm_spec python3 bench/norm_spec.py --out "$OUT/norm_spec.md"
    task200_ab /tmp/s74c 330 70 run_1 "LORAPLEX_UNUSED=1" run_2 "LORAPLEX_UNUSED=1" run_3 "LORAPLEX_UNUSED=1"
    ;;
  s74_b)  # session 74: every GPU test on the landing code (its own cache), then the 200-step task on a fresh cache seeded
          # from the refreshed archive, cubins counted
    gpu_tests /tmp/s74b
    shipped=$(shipped_cubins)
    step 110 task200 python3 bench/executor_task.py --layers 32 --steps 200 --runs cold \
      --out "$OUT/executor_task200.md" --json "$OUT/executor_task200.json"
    echo "cubins shipped: $shipped, after the 200-step task: $(cubins)" | tee -a "$OUT/steps.txt"
    pack_logs
    rm -f "$OUT"/gpu.txt
    ;;
  s72_d)  # session 72, the last ~290 s of its device time: bench/fused_proj.py (q/k/v and gate/up as one GEMM each,
          # the backbone's part, against one GEMM per projection)
    step 110 fused_proj python3 bench/fused_proj.py --out "$OUT/fused_proj.md"
    ;;
  s73_d)  # session 73: search (a)'s quality phase alone (the small model and its step-0 check, where call 3 compiled
          # _rms_bwd at 256 wide) on a fresh Triton cache seeded from the refreshed archive, cubins counted
    export TRITON_CACHE_DIR=/tmp/s73d/triton
    rm -rf /tmp/s73d
    step 100 quality python3 bench/task_e2e_baselines.py --phase quality --layers 32 --arms a --quality-arms a \
      --json "$OUT/quality.json" --out "$OUT/quality.md"
    shipped=$(shipped_cubins) after=$(cubins)
    echo "cubins shipped: $shipped, after the quality phase: $after" | tee -a "$OUT/steps.txt"
    if [ "$after" -gt "$shipped" ]; then tar -C /tmp/s73d -czf "$OUT/triton_cache_sm90.tar.gz" triton; fi
    pack_logs
    ;;
  s73_c)  # session 73: the landing code's search (a) (last run in session 60; defaults changed in sessions 66-68 since),
          # then the 60-step task, on a fresh Triton cache seeded from the shipped archive, cubins counted
    search_then_task /tmp/s73c 240 230
    rm -f "$OUT"/executor_task60.md
    pack_logs
    ;;
  s73_b)  # session 73: the step pipeline alone (LORAPLEX_STEP_AHEAD=1) against the default, ABBA x2 (s73_a ran it with the
          # capture ahead, whose evaluations took 0.8 s longer; session 65 ran it alone x3, 0.8% apart)
    task200_ab /tmp/s73b 560 58 on_1 "LORAPLEX_STEP_AHEAD=1" off_1 "LORAPLEX_STEP_AHEAD=0" off_2 "LORAPLEX_STEP_AHEAD=0" \
      on_2 "LORAPLEX_STEP_AHEAD=1" on_3 "LORAPLEX_STEP_AHEAD=1" off_3 "LORAPLEX_STEP_AHEAD=0" \
      off_4 "LORAPLEX_STEP_AHEAD=0" on_4 "LORAPLEX_STEP_AHEAD=1"
    ;;
  s73_a)  # session 73: the two host-side levers that each measured even alone, together: the next step launched
          # before the step's sync (LORAPLEX_STEP_AHEAD=1, its updates decided on the device) and the capture ahead
          # during the ranking's evaluation (LORAPLEX_CAPTURE_AHEAD=1), against the default, alternating x4
    task200_ab /tmp/s73a 560 58 base_1 "LORAPLEX_STEP_AHEAD=0" both_1 "LORAPLEX_STEP_AHEAD=1 LORAPLEX_CAPTURE_AHEAD=1" \
      base_2 "LORAPLEX_STEP_AHEAD=0" both_2 "LORAPLEX_STEP_AHEAD=1 LORAPLEX_CAPTURE_AHEAD=1" \
      both_3 "LORAPLEX_STEP_AHEAD=1 LORAPLEX_CAPTURE_AHEAD=1" base_3 "LORAPLEX_STEP_AHEAD=0" \
      both_4 "LORAPLEX_STEP_AHEAD=1 LORAPLEX_CAPTURE_AHEAD=1" base_4 "LORAPLEX_STEP_AHEAD=0"
    ;;
  s72_c)  # session 72: every GPU test on the landing code (its own Triton cache)
    gpu_tests /tmp/s72c
    pack_logs
    ;;
  s72_b)  # session 72: the 200-step task with the capture ahead (LORAPLEX_CAPTURE_AHEAD=1: the ranking's evaluation
          # captures the kept sets' next keys) against the default, alternating; last measured in session 55, before
          # the next step's capture, the capture thread, the first calls ahead and the widened first capture
    task200_ab /tmp/s72b 400 70 base_1 "LORAPLEX_CAPTURE_AHEAD=0" ahead_1 "LORAPLEX_CAPTURE_AHEAD=1" \
      base_2 "LORAPLEX_CAPTURE_AHEAD=0" ahead_2 "LORAPLEX_CAPTURE_AHEAD=1"
    ;;
  s72_a)  # session 72: bench/attention_forms.py (torch's flash varlen kernel against cuDNN's fused attention on a
          # step's ragged rows, forward and backward, float64-checked in the same run)
    export TRITON_CACHE_DIR=/tmp/s72a/triton
    rm -rf /tmp/s72a
    step 300 attention_forms python3 bench/attention_forms.py --out "$OUT/attention_forms.md"
    ;;
  s71_d)  # session 71, the last ~270 s of its device time: bench/silu_lora_probe.py (the MLP's 14336-wide LoRA terms
          # folded into the SiLU-gate kernels against today's store + cuBLAS, float64-checked in the same run)
    export TRITON_CACHE_DIR=/tmp/s71d/triton
    rm -rf /tmp/s71d
    step 130 silu_probe python3 bench/silu_lora_probe.py --out "$OUT/silu_lora_probe.md"
    ;;
  s71_c)  # session 71: the column-sweep store's own GPU test first, then every GPU test on the landing code (its own
          # Triton cache), inside one call. Ran on 985b8f7; the sweep store was then taken out (measured even in the
          # task), so this phase and s71_b need that tree (their test file and `lora_sweep.py --sweep` are gone)
    export TRITON_CACHE_DIR=/tmp/s71c/triton
    rm -rf /tmp/s71c
    step 90 store_tests python3 -m pytest -rA --tb=short -p no:cacheprovider tests/gpu/test_lora_store_gpu.py
    step $((545 - SECONDS)) gpu_tests python3 -m pytest -q -p no:cacheprovider tests/gpu
    pack_logs
    ;;
  s71_b)  # session 71: the store pass as a column sweep (kernels/lora_store.py, LORAPLEX_LORA_STORE=sweep): its
          # candidates against the tile form at the 2-job layout (each checked against float64), then the 200-step
          # task with the best of them against the default, alternating; packed inside the call
    export TRITON_CACHE_DIR=/tmp/s71b/triton
    rm -rf /tmp/s71b
    step 200 store_sweep python3 bench/lora_sweep.py --store --sweep --out "$OUT/store_sweep.md"
    tile=$(grep -o "best sweep tile: [0-9,]*" "$OUT/store_sweep.md" | head -1 | sed 's/best sweep tile: //')
    echo "sweep tile: ${tile:-none}" | tee -a "$OUT/steps.txt"
    SW="LORAPLEX_LORA_STORE=sweep LORAPLEX_LORA_STORE_SWEEP=${tile:-32,128,4,4,3}"
    task200_runs 480 60 base_1 "LORAPLEX_LORA_STORE=tile" sw_1 "$SW" base_2 "LORAPLEX_LORA_STORE=tile" sw_2 "$SW" \
      base_3 "LORAPLEX_LORA_STORE=tile" sw_3 "$SW"
    (cd "$OUT" && tar -czf tasks.tar.gz executor_task200_*.json && rm -f executor_task*.json executor_task*.md)
    pack_logs
    rm -f "$OUT"/gpu.txt
    ;;
  s71_a)  # prepared in session 70: the 200-step task with the Gluon GEMM only where dA does not run beside it (gate/up
          # forward: LORAPLEX_WS_BESIDE_DA=0) against the default, alternating; the runs stop 90 s before 480 so the
          # packing runs inside a 560 s call (session 70 lost files to a phase that ran past its limit: 8 files a call)
    export TRITON_CACHE_DIR=/tmp/s71a/triton
    rm -rf /tmp/s71a
    task200_runs 480 90 base_1 "LORAPLEX_WS_GEMM=0" fwd_1 "LORAPLEX_WS_GEMM=pingpong_pf LORAPLEX_WS_BESIDE_DA=0" \
      base_2 "LORAPLEX_WS_GEMM=0" fwd_2 "LORAPLEX_WS_GEMM=pingpong_pf LORAPLEX_WS_BESIDE_DA=0" \
      base_3 "LORAPLEX_WS_GEMM=0" fwd_3 "LORAPLEX_WS_GEMM=pingpong_pf LORAPLEX_WS_BESIDE_DA=0"
    (cd "$OUT" && tar -czf tasks.tar.gz executor_task200_*.json && rm -f executor_task*.json executor_task*.md)
    pack_logs
    rm -f "$OUT"/gpu.txt
    ;;
  *) echo "usage: $0 pace|pace_task|kernels|e2e|more|next|next2|variants|tests|hostprof|final|profile|tiles|tiles2|split|final2|compose|meta|pf|ncu|aligned|gpufinal|tables|verify|gputests|s21_a|s21_b|s21_search|s22_a|s22_b|s22_c|s22_d|s22_e|s22_f|s23_a|s23_b|s23_c|s23_d|s23_e|s23_f|s23_g|s24_a|s24_b|s24_c|s24_d|s24_e|s24_f|s24_g|s24_h|s25_a|s25_b|s25_c|s25_d|s25_e|s26_a|s26_b|s26_c|s26_d|s26_e|s26_f|s26_g|s27_a|s27_b|s27_c|s27_d|s27_e|s27_f|s28_a|s28_b|s28_c|s28_d|s28_imports|s28_e|s28_f|s29_a|s29_b|s29_c|s29_d|s30_a|s30_b|s30_c|s30_d|s30_e|s31_a|s31_b|s31_c|s31_d|s31_e|s31_f|s31_g|s32_b|s32_c|s32_d|s33_a|s33_b|s33_c|s33_d|s33_e|s33_f|s33_g|s33_h|s33_i|s34_a|s34_b|s34_c|s34_d|s34_e|s34_f|s34_g|s34_h|s35_a|s35_b|s35_c|s35_d|s35_e|s35_f|s35_g|s36_a|s36_b|s36_c|s36_d|s36_e|s36_f|s37_a|s37_b|s37_c|s37_d|s38_a|s38_b|s38_c|s38_d|s39_a|s39_b|s39_c|s39_d|s39_e|s40_a|s40_b|s40_c|s40_d|s41_a|s41_b|s41_c|s41_d|s42_a|s42_b|s42_c|s42_d|s43_a|s43_b|s43_c|s43_d|s44_a|s44_b|s44_c|s44_d|s44_e|s44_f|s45_a|s45_b|s45_c|s45_d|s45_e|s46_a|pad_free|pad_free_tasks|s47_a|s47_b|s47_c|s48_a|s48_c|s48_cublas|s48_replay|s48_store|s48_auto|s48_seed|s49_a|s49_b|s49_c|s49_d|s50_a|s50_b|s50_c|s50_d|s51_a|s51_b|s51_c|s51_d|s51_e|s51_f|s52_a|s52_b|s52_c|s52_d|s52_e|s52_f|s52_g|s52_h|s53_a|s53_d|s53_e|s53_f|s54_a|s54_b|s54_c|s54_d|s54_e|s54_f|s54_g|s55_a|s55_b|s55_c|s55_d|s55_e|s55_f|s56_a|s56_b|s56_c|s56_d|s56_e|s57_a|s57_b|s57_c|s57_d|s57_e|s58_a|s58_b|s58_c|s58_d|s58_e|s59_a|s59_b|s59_c|s59_d|s59_e|s59_f|s59_g|s59_h|s60_a|s60_b|s60_c|s60_d|s60_e|s61_a|s61_c|s61_d|s61_e|s61_f|s62_a|s62_b|s62_c|s62_d|s63_a|s63_b|s64_a|s64_b|s64_c|s64_d|s64_e|s65_a|s65_b|s65_c|s66_a|s66_b|s66_c|s67_a|s67_b|s67_c|s68_a|s68_b|s68_c|s69_a|s69_b|s69_c|s70_a|s71_a" >&2; exit 2 ;;
esac
