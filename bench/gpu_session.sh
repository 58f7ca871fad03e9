#!/usr/bin/env bash
# Issue 40's GPU runs, in lanes of GPUs that run side by side, on a lent machine set up by
# bench/gpu_setup.sh (docs/gpu.md). Every step logs to /root/session/logs and writes its results
# to /root/session/results; after each step both are packed into $OUT/session.tar.gz, and the
# steps' outcomes and headline lines into $OUT/summary.txt (what comes back is limited in
# number of files, and a run call ends at 600 s: BUDGET, 550 s by default, stops new steps). The lanes share a host: their times are each lane's own, with
# the host's CPUs shared (64 cores on the 4-GPU machine).
#
#   bash bench/gpu_session.sh first     # 4 GPUs: gpu_train hybrid1 and split2, examples (lane A)
#   bash bench/gpu_session.sh second    # 4 GPUs: gpu_train fsdp2, fsdp_hybrid on 2 and 4 GPUs,
#                                       # the split example and examples (lane B)
#   bash bench/gpu_session.sh tests     # the CUDA tests of the trainer and the update's pause
#   bash bench/gpu_session.sh third     # 4 GPUs: inflight updates on the rollout benchmark, the
#                                       # CUDA tests (inflight's too), fsdp_hybrid and the demo
#   bash bench/gpu_session.sh sixth     # 1 GPU: the weight port against fe4e6f5 (in .old): 7B
#   bash bench/gpu_session.sh seventh   # push; correctness/hybrid/manager; then the CUDA tests
#   bash bench/gpu_session.sh eighth    # of the update path and the demo
#   bash bench/gpu_session.sh ninth     # 1 GPU: LoRA adapters (bench/gpu_lora.py, tests/test_lora.py)
#   bash bench/gpu_session.sh tenth     # 1 GPU: the update's CUDA tests and the inflight rollout
#   bash bench/gpu_session.sh eleventh  # 1 GPU: the 7B LoRA push and rollout, 8 revisions held
#   bash bench/gpu_session.sh twelfth   # 1 GPU: the demo with --lora-rank; tests/test_lora.py
#   bash bench/gpu_session.sh thirteenth # 1 GPU: the Qwen3-30B-A3B push; tests/test_moe.py
#   bash bench/gpu_session.sh fourteenth # 1 GPU: copies fused up to 16 MiB against 1 MiB (30B-A3B, 7B)
#   bash bench/gpu_session.sh fifteenth  # 1 GPU: packed adapters replayed into LoRA slots (7B push,
#                                        # correctness, rollout; tests/test_lora.py)
#   bash bench/gpu_session.sh sixteenth  # 1 GPU: the rollout's loop worst turn under frozen_heap()
#   bash bench/gpu_session.sh seventeenth # 1 GPU: the packed adapter push again (layouts kept,
#                                         # fills pruned); the loop's stalls, vLLM's output chunks
#   bash bench/gpu_session.sh eighteenth  # 2 GPUs: column blocks into a TP=2 engine (1.5B, 7B)
#   bash bench/gpu_session.sh nineteenth  # 2 GPUs: the 7B push (GPU 0) beside tests/test_lora.py
#                                         # (GPU 1); the loop's worst turn over rounds (GPU 0)
#   bash bench/gpu_session.sh twentieth   # 2 GPUs: the adapter push with its plan kept (GPU 0);
#                                         # the column exchange in place, A/B against rows (7B)
#   bash bench/gpu_session.sh twentyfirst # 1 GPU: the adapter push packed into its kept pack; the
#                                         # loop's slow turns with every thread sampled
#   bash bench/gpu_session.sh twentysecond # 2 GPUs: batched column exchanges against rows (1.5B, 7B)
#   bash bench/gpu_session.sh twentyfourth # 2 GPUs: the adapter push with landings beside cc9c9c2's
#   bash bench/gpu_session.sh twentysixth # 2 GPUs: the push with the pack filled as the take
#                                         # travels, staged and one-copy, beside .old; slow turns
#   bash bench/gpu_session.sh twentyseventh # 2 GPUs: LoRA rollout (0); slow turns pinned (1)
#   bash bench/gpu_session.sh twentyeighth # 2 GPUs: the push (pack checked as the take travels)
#                                         # beside .old, LoRA tests (0); slow turns pinned (1)
#   bash bench/gpu_session.sh twentyninth # 2 GPUs: the push beside .old, twice, GPUs swapped
#   bash bench/gpu_session.sh thirtieth   # 2 GPUs: landed adapter pushes, idle and under load,
#                                         # beside the step loop's (0); LoRA tests, the full
#                                         # push beside .old (1)
#   bash bench/gpu_session.sh thirtyfirst # 2 GPUs: the full push beside .old, GPUs swapped (0);
#                                         # the loop's slow turns with their queued callbacks (1)
#   bash bench/gpu_session.sh thirtythird # 2 GPUs: landed pushes under load with their timeline,
#                                         # the worker's switch interval 1 ms (0) beside 5 (1)
#   bash bench/gpu_session.sh thirtysecond # 2 GPUs: landed adapter rollout with paced admission
#                                         # (0); slow turns paced, the LoRA trainer test x3 (1)
#   bash bench/gpu_session.sh thirtyfourth # 2 GPUs: inflight updates landed first against
#                                         # received in the commit, rollout (0); the CUDA
#                                         # tests of the update path (1)
#   bash bench/gpu_session.sh thirtyfifth # 2 GPUs: the same with the commit's own gap, the 0.5B
#                                         # (0) and the 7B (1)
#   bash bench/gpu_session.sh thirtysixth # 2 GPUs: three rounds, the stall beyond a length-biased
#                                         # step (0); the landed tests, the 7B (1)
#   bash bench/gpu_session.sh thirtyseventh # 2 GPUs: a 0.5B's copies fused (0); copy tests (1)
#   bash bench/gpu_session.sh thirtyeighth # 2 GPUs: rolling updates, one engine a GPU
#   bash bench/gpu_session.sh thirtyninth # 2 GPUs: the commit gap split by step ends; small pushes
#   bash bench/gpu_session.sh fortieth    # 2 GPUs: rolling again, later groups prechecked
#   bash bench/gpu_session.sh fortyfirst  # 2 GPUs: the landed commit's RPC stamped finer, 0.5B, 7B
#   bash bench/gpu_session.sh fortysecond # 2 GPUs: the switch interval while a push lands, A/B
#   bash bench/gpu_session.sh fortythird  # 2 GPUs: the split layout (bench/gpu_split.py); the push
#   bash bench/gpu_session.sh fortyfourth # 4 GPUs: 1.5B colocated TP=4 and split, with checks
#   bash bench/gpu_session.sh fortyfifth  # 4 GPUs: 32B colocated TP=4 (vLLM ipc beside)
#   bash bench/gpu_session.sh fortysixth  # 4 GPUs: 30B-A3B colocated TP=4 (vLLM ipc beside)
#   bash bench/gpu_session.sh fortyseventh # 4 GPUs: 7B split, TP=1 one and two, TP=2, fan_in
#   bash bench/gpu_session.sh fortyeighth # 4 GPUs: the split layout again (1.5B, 7B), the 30B-A3B
#   bash bench/gpu_session.sh fortyninth  # 4 GPUs: column_blocks="auto" at 32B and 1.5B (not run)
#   bash bench/gpu_session.sh fiftieth    # 4 GPUs: expert parallelism; the 7B's auto mix (not run)
#   bash bench/gpu_session.sh fiftyfirst  # 2 GPUs: the same, one after the other
#   bash bench/gpu_session.sh fiftysecond # 2 GPUs: the one-GPU push and the broadcast, re-run
#   bash bench/gpu_session.sh fiftythird  # 2 GPUs: EP test again; the 30B-A3B's prep before/after
#   bash bench/gpu_session.sh fiftyfourth # 2 GPUs: the 30B-A3B into an EP engine; the broadcast;
#                                         # the 7B before/after (.old: the tree before, see multi2;
#                                         # session 44 ran the first two, the broadcast's push cut)
#   bash bench/gpu_session.sh fiftyfifth  # 4 GPUs: the caller's wait (call_ms) at 30B-A3B and 32B
#                                         # (not run); then the broadcast's 7B push (2 GPUs)
#   bash bench/gpu_session.sh twentyfifth # 2 GPUs: LoRA rollout with the spread control; LoRA tests
#   bash bench/gpu_session.sh twentythird # 2 GPUs: the adapter push's timeline and LoRA rollout in
#                                         # windows (0); LoRA tests, then the loop's slow turns (1)
set -uo pipefail
OUT=${OUT:-out}
W=${W:-/root/session}  # logs and results; only the tarball and a summary go to $OUT
mkdir -p "$OUT" "$W/logs" "$W/results" /tmp/models
export PYTHONPATH=/root/site2:/root/site:/root/site3:$PWD:$PWD/bench
export VLLM_WORKER_MULTIPROC_METHOD=spawn VLLM_USE_FLASHINFER_SAMPLER=0 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
GPUS=$(python3 -c 'import torch; print(torch.cuda.device_count())')
echo "== $(date +%T) $GPUS GPUs: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"

models() {  # tiny checkpoints of the other families, and a real Qwen3 shape
  python3 - <<'EOF'
from pathlib import Path
from asyncroll.testing import make_tiny_model
from asyncroll.testing.tiny_model import make_model
for family in ("qwen3", "llama"):
    if not Path(f"/tmp/models/{family}").exists():
        make_tiny_model(f"/tmp/models/{family}", seed=0, family=family)
if not Path("/tmp/models/qwen3-0.6b").exists():
    make_model("/tmp/models/qwen3-0.6b", "qwen3-0.6b", seed=0)
EOF
}

DEADLINE=$((SECONDS + ${BUDGET:-550}))  # a run call ends at 600 s: leave time to pack up

pack() {  # lanes pack side by side: each writes its own file, then renames it into place
  local tmp="$W/session.$BASHPID.tar.gz"
  tar czf "$tmp" -C "$W" logs results 2>/dev/null && mv -f "$tmp" "$OUT/session.tar.gz"
  cp "$W/logs/summary.txt" "$OUT/summary.txt" 2>/dev/null
}

halves() {  # sets the caller's pin0 and pin1: taskset to each half of the CPUs (empty without it)
  local half=$(( $(nproc) / 2 ))
  pin0="" pin1=""
  if command -v taskset >/dev/null; then
    pin0="taskset -c 0-$((half - 1))" pin1="taskset -c $half-$(( $(nproc) - 1 ))"
  fi
}

run() {  # run NAME GPUS COMMAND...: one logged step of a lane; says how it ended
  local name=$1 gpus=$2; shift 2
  local began=$SECONDS left=$((DEADLINE - SECONDS))
  if [ "$left" -lt 20 ]; then
    echo "== $(date +%T) $name: skipped, no time left" | tee -a "$W/logs/summary.txt"; return
  fi
  CUDA_VISIBLE_DEVICES=$gpus timeout "$left" "$@" >"$W/logs/$name.log" 2>&1
  local rc=$?
  echo "== $(date +%T) $name: rc=$rc in $((SECONDS - began)) s (GPUs $gpus)" | tee -a "$W/logs/summary.txt"
  grep -E "^reward|update median|^layout|^recipe|^sync|^one_step|^fully|G .* T |error|Error|^(0\.5b|1\.5b|7b|32b|qwen3-30b-a3b)[: ]|^done in" \
    "$W/logs/$name.log" | tail -n 12 | sed 's/^/     /' | tee -a "$W/logs/summary.txt"
  pack
}

examples_lane_a() {  # on GPU $1
  run demo "$1" python3 examples/demo.py --steps 15 --plot "$W/results/demo.png"
  run demo-vllm-kv "$1" python3 examples/demo.py --steps 15 --kv-cache-gib 0
  if [ -d .old ]; then  # the tree the issue was filed on (fe4e6f5), for its update stall
    run demo-fe4e6f5 "$1" env PYTHONPATH=/root/site2:/root/site:$PWD/.old \
      python3 .old/examples/demo.py --steps 15
  fi
  run fully_async-qwen3-0.6b "$1" python3 examples/fully_async.py --model /tmp/models/qwen3-0.6b \
    --steps 8 --response-len 256 --plot "$W/results/fully_async-qwen3-0.6b.png"
  run synchronous-hybrid-llama "$1" python3 examples/synchronous.py --hybrid \
    --model /tmp/models/llama --steps 10
  run custom_agent_loop "$1" python3 examples/custom_agent_loop.py
}

examples_lane_b() {  # on GPU $1
  run one_step_off-qwen3 "$1" python3 examples/one_step_off.py --model /tmp/models/qwen3 --steps 10
  run tool_agent "$1" python3 examples/tool_agent.py --steps 20
  run gateway_agent "$1" python3 examples/gateway_agent.py --steps 10
  run bad-model "$1" python3 examples/demo.py --model /tmp/nothing-here
  run bad-device "$1" python3 examples/demo.py --device cuda:9
}

phase_first() {  # 4 GPUs: gpu_train hybrid1 (0) and split2 (1-2); examples lane A (3)
  models
  run train-hybrid1 0 python3 bench/gpu_train.py --layout hybrid1 --out "$W/results" &
  run train-split2 1,2 python3 bench/gpu_train.py --layout split2 --out "$W/results" &
  examples_lane_a 3 &
  wait
}

phase_second() {  # 4 GPUs: gpu_train fsdp2 (0-1); fsdp_hybrid 2 and examples lane B (2-3); then 4
  models
  run train-fsdp2 0,1 torchrun --nproc-per-node 2 --master-port 29511 bench/gpu_train.py \
    --layout fsdp2 --out "$W/results" &
  (
    run fsdp_hybrid-2 2,3 torchrun --nproc-per-node 2 --master-port 29512 \
      examples/fsdp_hybrid.py --steps 12 --plot "$W/results/fsdp_hybrid-2.png"
    run fully_async-split 2,3 python3 examples/fully_async.py --engine-gpu 1 --steps 10
    examples_lane_b 2
  ) &
  wait
  run fsdp_hybrid-4 0,1,2,3 torchrun --nproc-per-node 4 --master-port 29513 \
    examples/fsdp_hybrid.py --steps 12 --plot "$W/results/fsdp_hybrid-4.png"
  run fsdp_hybrid-too-many 0,1 torchrun --nproc-per-node 3 --master-port 29514 \
    examples/fsdp_hybrid.py --steps 1
}

phase_tests() {
  run pytest-cuda 0 python3 -m pytest -q -p no:cacheprovider tests/test_trainer_device.py \
    tests/test_update_pause.py -x
}

phase_third() {  # 4 GPUs: issue 42's rollout benchmark, inflight beside the pausing policies (0),
  # alone on its GPU; fsdp_hybrid on 2 and the split example (1-2); the demo and the CUDA
  # tests, inflight's among them (3)
  models
  run rollout-inflight 0 python3 bench/gpu_e2e.py --sections rollout \
    --policies none,abort,keep,inflight --rounds 3 --out "$W/results" &
  (
    run fsdp_hybrid-2 1,2 torchrun --nproc-per-node 2 --master-port 29512 \
      examples/fsdp_hybrid.py --steps 12 --plot "$W/results/fsdp_hybrid-2.png"
    run fully_async-split 1,2 python3 examples/fully_async.py --engine-gpu 1 --steps 10
  ) &
  (
    run demo 3 python3 examples/demo.py --steps 15 --plot "$W/results/demo.png"
    run pytest-inflight-async 3 env ASYNCROLL_TEST_ENGINE_ARGS='{"async_scheduling": true}' \
      timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_inflight.py
    run pytest-cuda 3 env ASYNCROLL_TEST_ENGINE_ARGS='{"async_scheduling": false}' \
      python3 -m pytest -q -p no:cacheprovider tests/test_inflight.py \
      tests/test_trainer_device.py tests/test_update_pause.py
  ) &
  wait
}

phase_fourth() {  # 1 GPU: issue 42's inflight-recompute and rolling updates on the rollout
  # benchmark, inflight's and rolling's tests on the GPU, the 7B push
  run rollout-recompute 0 python3 bench/gpu_e2e.py --sections rollout \
    --policies none,keep,recompute,inflight,inflight-recompute --rounds 2 --out "$W/results"
  run pytest-inflight-rolling 0 env ASYNCROLL_TEST_ENGINE_ARGS='{"async_scheduling": false}' \
    python3 -m pytest -q -p no:cacheprovider tests/test_inflight.py tests/test_rolling.py
}

phase_fifth() {  # 1 GPU: two engines, updated all at once or one at a time; the 7B push
  mkdir -p "$W/results/two" "$W/results/push"
  run rollout-rolling 0 python3 bench/gpu_e2e.py --sections rollout --rollout-engines 2 \
    --policies none,keep,keep-roll,inflight,inflight-roll --rounds 2 --out "$W/results/two"
  run push-7b 0 python3 bench/gpu_e2e.py --sections push --sizes 7b --out "$W/results/push"
}

OLD_ENV="env PYTHONPATH=/root/site2:/root/site:/root/site3:$PWD/.old:$PWD/.old/bench"
# Issue 41's same-run A/B of the weight port against the tree the issue was filed on (fe4e6f5,
# unpacked in .old: git archive fe4e6f5 asyncroll bench examples), on 1 GPU, in three calls.

phase_sixth() {  # the 7B push, each tree in turn
  mkdir -p "$W/results/new" "$W/results/old"
  run push-7b-new 0 python3 bench/gpu_e2e.py --sections push --sizes 7b --out "$W/results/new"
  [ -d .old ] && run push-7b-old 0 $OLD_ENV python3 .old/bench/gpu_e2e.py --sections push \
    --sizes 7b --out "$W/results/old"
}

phase_sixth_reversed() {  # the 7B push again, the old tree first (the order's share of a gap)
  mkdir -p "$W/results/new2" "$W/results/old2"
  [ -d .old ] && run push-7b-old2 0 $OLD_ENV python3 .old/bench/gpu_e2e.py --sections push \
    --sizes 7b --out "$W/results/old2"
  run push-7b-new2 0 python3 bench/gpu_e2e.py --sections push --sizes 7b --out "$W/results/new2"
}

phase_seventh() {  # correctness, hybrid and manager, each tree in turn (ONLY=new: this tree's)
  mkdir -p "$W/results/new" "$W/results/old"
  run checks-new 0 python3 bench/gpu_e2e.py --sections correctness,hybrid,manager \
    --out "$W/results/new"
  [ -d .old ] && [ "${ONLY:-}" != new ] && run checks-old 0 $OLD_ENV python3 .old/bench/gpu_e2e.py \
    --sections correctness,hybrid,manager --out "$W/results/old"
}

phase_eighth() {  # the CUDA tests of the update path, the demo
  run pytest-cuda 0 env ASYNCROLL_TEST_ENGINE_ARGS='{"async_scheduling": false}' \
    python3 -m pytest -q -p no:cacheprovider tests/test_inflight.py tests/test_receive.py \
    tests/test_trainer_device.py tests/test_update_pause.py tests/test_weights.py
  run demo 0 python3 examples/demo.py --steps 15 --plot "$W/results/demo.png"
}

phase_ninth() {  # 1 GPU: issue 45's LoRA (correctness, the 7B rank-64 push, rollout with pushes)
  mkdir -p "$W/results/lora"
  run lora-7b 0 python3 bench/gpu_lora.py --out "$W/results/lora" --size 7b --rank 64 \
    --requests 512 --rounds 2
  run pytest-lora 0 env ASYNCROLL_TEST_ENGINE_ARGS='{"async_scheduling": false, "dtype": "bfloat16"}' \
    python3 -m pytest -q -p no:cacheprovider tests/test_lora.py
}

phase_tenth() {  # 1 GPU: issue 42's kept backup: the CUDA tests of the update, the inflight rollout
  run pytest-cuda 0 env ASYNCROLL_TEST_ENGINE_ARGS='{"async_scheduling": false}' \
    python3 -m pytest -q -p no:cacheprovider tests/test_inflight.py tests/test_receive.py \
    tests/test_weights.py
  run rollout-inflight 0 python3 bench/gpu_e2e.py --sections rollout \
    --policies none,keep,inflight --rounds 2 --out "$W/results"
}

phase_eleventh() {  # 1 GPU: the 7B rank-64 push and the rollout with pushes, 8 revisions held
  mkdir -p "$W/results/lora2"
  run lora-7b-push 0 python3 bench/gpu_lora.py --out "$W/results/lora2" --size 7b --rank 64 \
    --sections push,rollout --requests 512 --rounds 3 --revisions 8
}

phase_twelfth() {  # 1 GPU: the demo trains a LoRA adapter; tests/test_lora.py on CUDA
  run demo-lora 0 python3 examples/demo.py --lora-rank 8 --steps 30 --plot "$W/results/demo-lora.png"
  run pytest-lora 0 env ASYNCROLL_TEST_ENGINE_ARGS='{"async_scheduling": false, "dtype": "bfloat16"}' \
    python3 -m pytest -q -p no:cacheprovider tests/test_lora.py
}

phase_thirteenth() {  # 1 GPU: issue 44's mixture of experts: the Qwen3-30B-A3B push, the MoE tests
  mkdir -p "$W/results/moe"
  run push-30b-a3b 0 python3 bench/gpu_e2e.py --sections push --sizes qwen3-30b-a3b --repeats 3 \
    --out "$W/results/moe"
  run pytest-moe 0 env ASYNCROLL_TEST_ENGINE_ARGS='{"async_scheduling": false, "gpu_memory_utilization": 0.3}' \
    python3 -m pytest -q -p no:cacheprovider tests/test_moe.py
}

phase_fourteenth() {  # 1 GPU: small copies fused up to 16 MiB against 1 MiB (the old value),
  # same run: the 30B-A3B push (one-copy and staged), then the 7B one-copy push
  for fuse in 1048576 16777216; do
    mkdir -p "$W/results/fuse-$fuse"
    run push-30b-a3b-fuse-$fuse 0 env ASYNCROLL_FUSE_BYTES=$fuse python3 bench/gpu_e2e.py \
      --sections push --sizes qwen3-30b-a3b --repeats 3 --verify-pairs 8 --skip-baseline \
      --out "$W/results/fuse-$fuse"
  done
  for fuse in 1048576 16777216; do
    mkdir -p "$W/results/fuse-7b-$fuse"
    run push-7b-fuse-$fuse 0 env ASYNCROLL_FUSE_BYTES=$fuse python3 bench/gpu_e2e.py \
      --sections push --sizes 7b --repeats 5 --only-one-copy --out "$W/results/fuse-7b-$fuse"
  done
}

phase_fifteenth() {  # 1 GPU: issue 45's packed adapters, replayed into vLLM's LoRA slots
  mkdir -p "$W/results/lora3"
  run lora-7b-packed 0 python3 bench/gpu_lora.py --out "$W/results/lora3" --size 7b --rank 64 \
    --requests 512 --rounds 2 --revisions 8
  run pytest-lora 0 env ASYNCROLL_TEST_ENGINE_ARGS='{"async_scheduling": false, "dtype": "bfloat16"}' \
    python3 -m pytest -q -p no:cacheprovider tests/test_lora.py tests/test_adapter_packing.py
}

phase_sixteenth() {  # 1 GPU: issue 42 item 4, the loop's worst turn with asyncroll.frozen_heap()
  run rollout-heap 0 python3 bench/gpu_e2e.py --sections rollout \
    --policies none,keep,inflight --rounds 2 --out "$W/results"
}

phase_seventeenth() {  # 1 GPU: issue 45's push after its second pass; issue 42's loop stalls
  mkdir -p "$W/results/lora4" "$W/results/chunk128" "$W/results/chunk32"
  run lora-7b-push 0 python3 bench/gpu_lora.py --out "$W/results/lora4" --size 7b --rank 64 \
    --sections correctness,push --revisions 8 --repeats 20
  run rollout-stalls-128 0 python3 bench/gpu_e2e.py --sections rollout --policies none,inflight \
    --rounds 1 --slow-turns --out "$W/results/chunk128"
  run rollout-stalls-32 0 env VLLM_V1_OUTPUT_PROC_CHUNK_SIZE=32 python3 bench/gpu_e2e.py \
    --sections rollout --policies none,inflight --rounds 1 --slow-turns --out "$W/results/chunk32"
}

phase_eighteenth() {  # 2 GPUs: issue 44, the column-block exchange's first engine runs
  # (its checkpoints go to $W/multi, outside the results that every step packs)
  mkdir -p "$W/results/multi"
  for size in 1.5b 7b; do
    run multi-$size 0,1 torchrun --nproc-per-node 2 --master-port 29521 bench/gpu_multi.py \
      --out "$W/multi-$size" --sizes $size --skip-ipc
    cp "$W/multi-$size/gpu_multi.json" "$W/results/multi/gpu_multi-$size.json" 2>/dev/null
    rm -rf "$W/multi-$size"
  done
}

phase_nineteenth() {  # 2 GPUs: the 7B push after session 32's wire (GPU 0) beside the LoRA
  # tests (GPU 1); then the loop's worst turn over two rounds with vLLM's output chunk of 32
  mkdir -p "$W/results/push7b" "$W/results/rounds"
  run push-7b 0 python3 bench/gpu_e2e.py --sections push --sizes 7b --out "$W/results/push7b" &
  run pytest-lora 1 env ASYNCROLL_TEST_ENGINE_ARGS='{"async_scheduling": false, "dtype": "bfloat16"}' \
    python3 -m pytest -q -p no:cacheprovider tests/test_lora.py tests/test_adapter_packing.py &
  wait
  run rollout-rounds 0 python3 bench/gpu_e2e.py --sections rollout --policies none,keep,inflight \
    --rounds 2 --slow-turns --out "$W/results/rounds"
}

phase_twentieth() {  # 2 GPUs: issue 45's trainer side (plans kept), issue 44's column blocks
  # made in place by one all_to_all_single, against rows only, two rounds each (7B; as run at
  # 100a103 under the variant names of then: "ours,ours rows only,ours 1 GiB x2,ours rows only
  # 1 GiB x2")
  mkdir -p "$W/results/lora5" "$W/results/multi"
  run lora-7b-plans 0 python3 bench/gpu_lora.py --out "$W/results/lora5" --size 7b --rank 64 \
    --sections push --revisions 8 --repeats 20
  run multi-7b-ab 0,1 torchrun --nproc-per-node 2 --master-port 29524 bench/gpu_multi.py \
    --out "$W/multi-7b-ab" --sizes 7b --skip-ipc --rounds 2 \
    --variants "ours column blocks 512 MiB x2,ours 512 MiB x2,ours column blocks,ours"
  cp "$W/multi-7b-ab/gpu_multi.json" "$W/results/multi/gpu_multi-7b-ab.json" 2>/dev/null
  rm -rf "$W/multi-7b-ab"
}

phase_twentyfirst() {  # 1 GPU: issue 45's kept pack, then issue 42's slow turns with every
  # thread sampled (one after the other: the loop's turns are not shared with another client)
  mkdir -p "$W/results/lora6" "$W/results/turns"
  run lora-7b-kept-pack 0 python3 bench/gpu_lora.py --out "$W/results/lora6" --size 7b \
    --rank 64 --sections push --revisions 8 --repeats 20
  run rollout-turns 0 python3 bench/gpu_e2e.py --sections rollout --policies none,keep,inflight \
    --rounds 1 --slow-turns --out "$W/results/turns"
}

phase_twentythird() {  # 2 GPUs: issue 45's kept pack with the push's timeline, then the
  # LoRA rollout in fixed windows (GPU 0); the LoRA tests, then issue 42's slow turns with every
  # thread sampled (GPU 1)
  mkdir -p "$W/results/lora7" "$W/results/turns"
  run lora-7b-timeline-rollout 0 python3 bench/gpu_lora.py --out "$W/results/lora7" --size 7b \
    --rank 64 --sections push,rollout --revisions 8 --repeats 20 --window 30 --warm 8 --rounds 3 &
  (
    run pytest-lora 1 env ASYNCROLL_TEST_ENGINE_ARGS='{"async_scheduling": false, "dtype": "bfloat16"}' \
      python3 -m pytest -q -p no:cacheprovider tests/test_lora.py tests/test_adapter_packing.py
    run rollout-turns 1 python3 bench/gpu_e2e.py --sections rollout --policies none,keep,inflight \
      --rounds 1 --slow-turns --out "$W/results/turns"
  ) &
  wait
}

phase_twentyfourth() {  # 2 GPUs: issue 45's push with landings (this tree, GPU 0) beside
  # cc9c9c2's (in .old, GPU 1), at the same time
  mkdir -p "$W/results/lora8" "$W/results/lora8-old"
  run lora-7b-push-cc9c9c2 1 $OLD_ENV python3 .old/bench/gpu_lora.py --out "$W/results/lora8-old" \
    --size 7b --rank 64 --sections push --revisions 8 --repeats 20 &
  run lora-7b-push 0 python3 bench/gpu_lora.py --out "$W/results/lora8" --size 7b --rank 64 \
    --sections push --revisions 8 --repeats 20 &
  wait
}

phase_twentysixth() {  # 2 GPUs: issue 45's push with the pack written while the take travels,
  # staged and one-copy, then the LoRA tests (this tree, GPU 0); beside it the tree before
  # (.old, GPU 1), then issue 42's slow turns with the scheduler's account and native stacks
  mkdir -p "$W/results/lora10" "$W/results/lora10-old" "$W/results/turns2"
  (
    run lora-7b-push-fill 0 python3 bench/gpu_lora.py --out "$W/results/lora10" --size 7b \
      --rank 64 --sections push,push-one-copy --revisions 8 --repeats 20
    run pytest-lora 0 env ASYNCROLL_TEST_ENGINE_ARGS='{"async_scheduling": false, "dtype": "bfloat16"}' \
      python3 -m pytest -q -p no:cacheprovider tests/test_lora.py tests/test_adapter_packing.py
  ) &
  (
    run lora-7b-push-old 1 $OLD_ENV python3 .old/bench/gpu_lora.py --out "$W/results/lora10-old" \
      --size 7b --rank 64 --sections push --revisions 8 --repeats 20
    run rollout-turns-sched 1 env ASYNCROLL_NATIVE_DUMPS=3 PY_SPY=/root/site2/bin/py-spy \
      python3 bench/gpu_e2e.py --sections rollout --policies none,keep,inflight --rounds 1 \
      --slow-turns --out "$W/results/turns2"
  ) &
  wait
}

phase_twentyseventh() {  # 2 GPUs: issue 45's LoRA rollout with the spread control, this tree
  # (GPU 0, the first half of the CPUs); issue 42's slow turns (GPU 1, the other half)
  mkdir -p "$W/results/lora11" "$W/results/turns3"
  local pin0 pin1
  halves
  run lora-7b-rollout-fill 0 $pin0 python3 bench/gpu_lora.py --out "$W/results/lora11" \
    --size 7b --rank 64 --sections push,rollout --revisions 8 --repeats 4 --window 20 --warm 5 \
    --rounds 3 --spread 6 &
  run rollout-turns-pinned 1 $pin1 env ASYNCROLL_NATIVE_DUMPS=3 \
    PY_SPY=/root/site2/bin/py-spy python3 bench/gpu_e2e.py --sections rollout \
    --policies none,keep,inflight --rounds 1 --slow-turns --out "$W/results/turns3" &
  wait
}

phase_twentyeighth() {  # 2 GPUs: issue 45's push with the pack written and checked while the
  # take travels, then the LoRA tests but the TP=2 one (this tree, GPU 0, the first half of the
  # CPUs); the tree before (.old), then issue 42's slow turns (GPU 1, the other half)
  mkdir -p "$W/results/lora12" "$W/results/lora12-old" "$W/results/turns4"
  local pin0 pin1
  halves
  (
    run lora-7b-push-fill2 0 $pin0 python3 bench/gpu_lora.py --out "$W/results/lora12" --size 7b \
      --rank 64 --sections push --revisions 8 --repeats 20
    run pytest-lora 0 $pin0 env ASYNCROLL_TEST_ENGINE_ARGS='{"async_scheduling": false, "dtype": "bfloat16"}' \
      python3 -m pytest -q -p no:cacheprovider tests/test_lora.py tests/test_adapter_packing.py \
      -k "not tensor_parallel"
  ) &
  (
    run lora-7b-push-old2 1 $pin1 $OLD_ENV python3 .old/bench/gpu_lora.py \
      --out "$W/results/lora12-old" --size 7b --rank 64 --sections push --revisions 8 --repeats 20
    run rollout-turns-pinned2 1 $pin1 python3 bench/gpu_e2e.py --sections rollout \
      --policies none,keep,inflight --rounds 1 --slow-turns --out "$W/results/turns4"
  ) &
  wait
}

phase_twentyninth() {  # 2 GPUs: issue 45's push with its prints taken after the signal (this
  # tree) beside the tree in .old, twice, the GPUs swapped between the runs
  local pin0 pin1
  halves
  for round in 1 2; do
    local new=0 old=1 pnew=$pin0 pold=$pin1
    [ "$round" = 2 ] && new=1 old=0 pnew=$pin1 pold=$pin0
    mkdir -p "$W/results/lora13-$round" "$W/results/lora13-old-$round"
    run lora-7b-push-prints-$round $new $pnew python3 bench/gpu_lora.py \
      --out "$W/results/lora13-$round" --size 7b --rank 64 --sections push --revisions 8 \
      --repeats 20 &
    run lora-7b-push-old-$round $old $pold $OLD_ENV python3 .old/bench/gpu_lora.py \
      --out "$W/results/lora13-old-$round" --size 7b --rank 64 --sections push --revisions 8 \
      --repeats 20 &
    wait
  done
}

phase_thirtieth() {  # 2 GPUs: issue 45's landed adapter pushes, idle and with 256 calls
  # running, each round beside the step loop's way (GPU 0, the first half of the CPUs); the
  # LoRA and transport tests but the TP=2 one, then the full-weight push of this tree and of
  # .old (GPU 1, the other half)
  mkdir -p "$W/results/lora14" "$W/results/push-new" "$W/results/push-old"
  local pin0 pin1
  halves
  run lora-7b-landed 0 $pin0 python3 bench/gpu_lora.py --out "$W/results/lora14" --size 7b \
    --rank 64 --sections push,rollout --revisions 8 --repeats 10 --window 15 --warm 5 \
    --rounds 3 &
  (
    run pytest-lora 1 $pin1 env ASYNCROLL_TEST_ENGINE_ARGS='{"async_scheduling": false, "dtype": "bfloat16"}' \
      python3 -m pytest -q -p no:cacheprovider tests/test_lora.py tests/test_transport.py \
      -k "not tensor_parallel"
    run push-7b-new 1 $pin1 python3 bench/gpu_e2e.py --sections push --sizes 7b \
      --out "$W/results/push-new"
    run push-7b-old 1 $pin1 $OLD_ENV python3 .old/bench/gpu_e2e.py --sections push --sizes 7b \
      --out "$W/results/push-old"
  ) &
  wait
}

phase_thirtyfirst() {  # 2 GPUs: the full-weight push of .old, then this tree (GPU 0); the
  # loop's slow turns, with the callbacks queued at each (GPU 1)
  mkdir -p "$W/results/push-old2" "$W/results/push-new2" "$W/results/turns5"
  local pin0 pin1
  halves
  (
    run push-7b-old2 0 $pin0 $OLD_ENV python3 .old/bench/gpu_e2e.py --sections push --sizes 7b \
      --out "$W/results/push-old2"
    run push-7b-new2 0 $pin0 python3 bench/gpu_e2e.py --sections push --sizes 7b \
      --out "$W/results/push-new2"
  ) &
  run rollout-turns5 1 $pin1 python3 bench/gpu_e2e.py --sections rollout \
    --policies none,keep,inflight --rounds 1 --slow-turns --out "$W/results/turns5" &
  wait
}

phase_thirtysecond() {  # 2 GPUs: issue 45's landed pushes again, admissions now paced (GPU 0);
  # issue 42's slow turns with paced admissions, then the LoRA trainer test three times (GPU 1)
  mkdir -p "$W/results/lora15" "$W/results/turns6"
  local pin0 pin1
  halves
  run lora-7b-landed2 0 $pin0 python3 bench/gpu_lora.py --out "$W/results/lora15" --size 7b \
    --rank 64 --sections push,rollout --revisions 8 --repeats 10 --window 15 --warm 5 \
    --rounds 3 &
  (
    run rollout-turns6 1 $pin1 python3 bench/gpu_e2e.py --sections rollout \
      --policies none,keep,inflight --rounds 1 --slow-turns --out "$W/results/turns6"
    for i in 1 2 3; do
      run pytest-lora-trainer-$i 1 $pin1 env ASYNCROLL_TEST_ENGINE_ARGS='{"async_scheduling": false, "dtype": "bfloat16"}' \
        python3 -m pytest -q -p no:cacheprovider tests/test_lora.py -k "reference_trainers"
    done
  ) &
  wait
}

phase_thirtythird() {  # 2 GPUs: issue 45's landed pushes, idle and under load with each push's
  # timeline, the registration sent eagerly; the workers' switch interval 1 ms (GPU 0, this
  # tree's default) beside Python's 5 ms (GPU 1), at the same time, one round each
  mkdir -p "$W/results/lora16-1ms" "$W/results/lora16-5ms"
  local pin0 pin1
  halves
  run lora-7b-switch-1ms 0 $pin0 python3 bench/gpu_lora.py --out "$W/results/lora16-1ms" \
    --size 7b --rank 64 --sections push,rollout --revisions 8 --repeats 10 --window 15 \
    --warm 5 --rounds 1 &
  run lora-7b-switch-5ms 1 $pin1 env ASYNCROLL_LANDING_SWITCH_MS=0 python3 bench/gpu_lora.py \
    --out "$W/results/lora16-5ms" --size 7b --rank 64 --sections push,rollout --revisions 8 \
    --repeats 10 --window 15 --warm 5 --rounds 1 &
  wait
}

phase_twentyfifth() {  # 2 GPUs: the LoRA rollout in windows with the spread control (GPU 0);
  # the LoRA tests (GPU 1)
  mkdir -p "$W/results/lora9"
  run lora-7b-rollout-spread 0 python3 bench/gpu_lora.py --out "$W/results/lora9" --size 7b \
    --rank 64 --sections push,rollout --revisions 8 --repeats 4 --window 20 --warm 5 --rounds 3 \
    --spread 6 &
  run pytest-lora 1 env ASYNCROLL_TEST_ENGINE_ARGS='{"async_scheduling": false, "dtype": "bfloat16"}' \
    python3 -m pytest -q -p no:cacheprovider tests/test_lora.py tests/test_adapter_packing.py &
  wait
}

phase_twentysecond() {  # 2 GPUs: issue 44's batched column exchanges, A/B against rows
  mkdir -p "$W/results/multi"
  for size in 1.5b 7b; do
    run multi-$size-batched 0,1 torchrun --nproc-per-node 2 --master-port 29525 \
      bench/gpu_multi.py --out "$W/multi-$size" --sizes $size --skip-ipc --rounds 2 \
      --variants "ours,ours column blocks,ours 512 MiB x2,ours column blocks 512 MiB x2"
    cp "$W/multi-$size/gpu_multi.json" "$W/results/multi/gpu_multi-$size-batched.json" 2>/dev/null
    rm -rf "$W/multi-$size"
  done
}

phase_thirtyfourth() {  # 2 GPUs: issue 42's inflight updates landed first (land=True,
  # staged and one copy) against received in the commit's RPC, with the loop's slow turns,
  # two rounds (GPU 0); the CUDA tests of the update path, the landing's among them (GPU 1)
  mkdir -p "$W/results/landed"
  local pin0 pin1
  halves
  run rollout-landed 0 $pin0 python3 bench/gpu_e2e.py --sections rollout \
    --policies none,inflight,inflight-land,inflight-land-1copy --rounds 2 --slow-turns \
    --out "$W/results/landed" &
  run pytest-update-path 1 $pin1 env ASYNCROLL_TEST_ENGINE_ARGS='{"async_scheduling": false}' \
    python3 -m pytest -q -p no:cacheprovider tests/test_inflight.py tests/test_landing.py \
    tests/test_receive.py tests/test_weights.py tests/test_update_pause.py &
  wait
}

phase_thirtyfifth() {  # 2 GPUs: issue 42's landed inflight updates with the commit's own gap
  # and its RPC by phase: the 0.5B rollout, then the landed tests again (GPU 0); the 7B
  # rollout, one copy landed and not (GPU 1)
  mkdir -p "$W/results/landed2" "$W/results/landed-7b"
  local pin0 pin1
  halves
  (
    run rollout-landed2 0 $pin0 python3 bench/gpu_e2e.py --sections rollout \
      --policies none,inflight,inflight-land,inflight-1copy,inflight-land-1copy --rounds 2 \
      --slow-turns --out "$W/results/landed2"
    run pytest-landed 0 $pin0 env ASYNCROLL_TEST_ENGINE_ARGS='{"async_scheduling": false}' \
      python3 -m pytest -q -p no:cacheprovider tests/test_inflight.py -k "landed or arrives"
  ) &
  run rollout-landed-7b 1 $pin1 python3 bench/gpu_e2e.py --sections rollout --rollout-size 7b \
    --policies none,inflight-1copy,inflight-land-1copy --rounds 1 --out "$W/results/landed-7b" &
  wait
}

phase_thirtysixth() {  # 2 GPUs: issue 42's landed inflight updates, three rounds, with the
  # commit's stall beyond a length-biased step and the load plan's statistics (GPU 0); the
  # 7B again and the landed tests (GPU 1)
  mkdir -p "$W/results/landed3" "$W/results/landed-7b2"
  local pin0 pin1
  halves
  run rollout-landed3 0 $pin0 python3 bench/gpu_e2e.py --sections rollout \
    --policies none,inflight,inflight-land,inflight-1copy,inflight-land-1copy --rounds 3 \
    --out "$W/results/landed3" &
  (
    run pytest-landed2 1 $pin1 env ASYNCROLL_TEST_ENGINE_ARGS='{"async_scheduling": false}' \
      python3 -m pytest -q -p no:cacheprovider tests/test_inflight.py tests/test_landing.py
    run rollout-landed-7b2 1 $pin1 python3 bench/gpu_e2e.py --sections rollout \
      --rollout-size 7b --policies none,inflight-1copy,inflight-land-1copy --rounds 1 \
      --out "$W/results/landed-7b2"
  ) &
  wait
}

phase_thirtyseventh() {  # 2 GPUs: issue 42's inflight commits with a 0.5B's copies fused
  # (bound by their launches), one round (GPU 0); the CUDA tests of the copies (GPU 1)
  mkdir -p "$W/results/landed4"
  local pin0 pin1
  halves
  run rollout-landed4 0 $pin0 python3 bench/gpu_e2e.py --sections rollout \
    --policies none,inflight,inflight-land,inflight-land-1copy --rounds 1 \
    --out "$W/results/landed4" &
  run pytest-copies 1 $pin1 env ASYNCROLL_TEST_ENGINE_ARGS='{"async_scheduling": false}' \
    python3 -m pytest -q -p no:cacheprovider tests/test_transport_plan.py \
    tests/test_load_plan.py tests/test_receive.py &
  wait
}

phase_thirtyeighth() {  # 2 GPUs: issue 42's rolling updates with each engine on a GPU of its
  # own (engine 0 beside the trainer's tensors on GPU 0, pushed through CUDA IPC; engine 1 on
  # GPU 1, through NCCL), two rounds
  mkdir -p "$W/results/rolling-2gpu"
  run rollout-rolling-2gpu 0,1 python3 bench/gpu_e2e.py --sections rollout \
    --rollout-engines 2 --rollout-gpus 2 \
    --policies none,keep-roll,inflight-roll,inflight-land-roll --rounds 2 \
    --out "$W/results/rolling-2gpu"
}

phase_thirtyninth() {  # 2 GPUs: issue 42's inflight commits with each step's end stamped (the
  # commit's gap split), two rounds (GPU 0); the paused push of the 0.5B and 1.5B after the
  # receiver's fuse rule, then the step spans' test (GPU 1)
  mkdir -p "$W/results/spans" "$W/results/push-small"
  local pin0 pin1
  halves
  run rollout-spans 0 $pin0 python3 bench/gpu_e2e.py --sections rollout \
    --policies none,inflight,inflight-land,inflight-land-1copy --rounds 2 \
    --out "$W/results/spans" &
  (
    run push-small 1 $pin1 python3 bench/gpu_e2e.py --sections push --sizes 0.5b,1.5b \
      --out "$W/results/push-small"
    run pytest-spans 1 $pin1 env ASYNCROLL_TEST_ENGINE_ARGS='{"async_scheduling": false}' \
      python3 -m pytest -q -p no:cacheprovider tests/test_inflight.py -k "spans or landed"
  ) &
  wait
}

phase_fortieth() {  # 2 GPUs: issue 42's rolling updates, one engine a GPU, again: the later
  # groups no longer read the tensors for NaN and inf; each group's whole call timed
  mkdir -p "$W/results/rolling-2gpu-b"
  run rollout-rolling-2gpu-b 0,1 python3 bench/gpu_e2e.py --sections rollout \
    --rollout-engines 2 --rollout-gpus 2 \
    --policies none,keep-roll,inflight-roll,inflight-land-roll --rounds 2 \
    --out "$W/results/rolling-2gpu-b"
}

phase_fortyfirst() {  # 2 GPUs: the landed commit's RPC stamped finer (its start, its first and
  # last batch), with the gap split (GPU 0, 0.5B); the same for the 7B one copy (GPU 1)
  mkdir -p "$W/results/spans-b" "$W/results/spans-7b"
  local pin0 pin1
  halves
  run rollout-spans-b 0 $pin0 python3 bench/gpu_e2e.py --sections rollout \
    --policies none,inflight,inflight-land,inflight-land-1copy --rounds 1 \
    --out "$W/results/spans-b" &
  run rollout-spans-7b 1 $pin1 python3 bench/gpu_e2e.py --sections rollout --rollout-size 7b \
    --policies none,inflight-1copy,inflight-land-1copy --rounds 1 --out "$W/results/spans-7b" &
  wait
}

switch_lane() {  # switch_lane GPU PIN INTERVAL...: the landed rollout once per interval, in order
  local gpu=$1 pin=$2 v; shift 2
  for v in "$@"; do
    run rollout-switch-$v-gpu$gpu $gpu $pin env ASYNCROLL_LANDING_SWITCH_SECONDS=$v \
      python3 bench/gpu_e2e.py --sections rollout --policies none,inflight-land --rounds 1 \
      --out "$W/results/switch/gpu$gpu-$v"
  done
}

phase_fortysecond() {  # 2 GPUs: issue 42's landed commit with the interpreter's switch
  # interval short while a push lands, against Python's 5 ms (ASYNCROLL_LANDING_SWITCH_SECONDS),
  # one round each, in opposite orders on the two GPUs
  mkdir -p "$W/results/switch"
  local pin0 pin1
  halves
  switch_lane 0 "$pin0" 0.005 0.0005 &
  switch_lane 1 "$pin1" 0.0005 0.005 &
  wait
}

phase_fortythird() {  # 2 GPUs: issue 44's split layout (trainer ranks on GPUs 0-1, engines
  # fed by each rank's own push group), 1.5B then 7B; then the 7B push after d526246 (GPU 0)
  mkdir -p "$W/results/split" "$W/results/push"
  run split 0,1 python3 -m torch.distributed.run --nproc-per-node 2 bench/gpu_split.py \
    --out "$W/results/split" --sizes 1.5b,7b
  run push 0 python3 bench/gpu_e2e.py --sections push --sizes 0.5b,7b --out "$W/results/push"
}

multi4() {  # multi4 SIZE ARGS...: a 4-rank trainer into a TP=4 engine on GPUs 0-3
  # (gpu_multi.py's work folder is outside the results that every step packs)
  local size=$1; shift
  mkdir -p "$W/results/multi4"
  run multi4-$size 0,1,2,3 python3 -m torch.distributed.run --nproc-per-node 4 \
    --master-port 29531 bench/gpu_multi.py --out "$W/multi4-$size" --sizes $size --skip-single "$@"
  cp "$W/multi4-$size/gpu_multi.json" "$W/results/multi4/gpu_multi-4gpu-$size.json" 2>/dev/null
  rm -rf "$W/multi4-$size"
  pack
}

split4() {  # split4 SIZE ARGS...: a 2-rank trainer on GPUs 0-1, engines on GPUs 2-3
  local size=$1; shift
  mkdir -p "$W/results/split4"
  run split4-$size 0,1,2,3 python3 -m torch.distributed.run --nproc-per-node 2 \
    --master-port 29532 bench/gpu_split.py --out "$W/split4-$size" --sizes $size \
    --engine-gpus 2,3 --layouts tp1,tp2 "$@"
  cp "$W/split4-$size/gpu_split.json" "$W/results/split4/gpu_split-4gpu-$size.json" 2>/dev/null
  rm -rf "$W/split4-$size"
  pack
}

phase_fortyfourth() {  # 4 GPUs: issue 44, the 1.5B with its checks: colocated TP=4, then the
  # split layout (trainer on 0-1, engines on 2-3; TP=1 one and two, TP=2; fan_in or not)
  multi4 1.5b --variants "ours column blocks,ours" --skip-ipc
  split4 1.5b
}

phase_fortyfifth() {  # 4 GPUs: issue 44, the Qwen2.5-32B shape colocated TP=4, vLLM ipc beside
  multi4 32b --variants "ours column blocks,ours" --ipc-variants "vLLM ipc packed 2 GiB"
}

phase_fortysixth() {  # 4 GPUs: issue 44, the Qwen3-30B-A3B shape colocated TP=4, vLLM ipc beside
  multi4 qwen3-30b-a3b --variants "ours column blocks,ours" --ipc-variants "vLLM ipc packed 2 GiB"
}

phase_fortyseventh() {  # 4 GPUs: issue 44, the split layout at 7B
  split4 7b
}

phase_fortyninth() {  # 4 GPUs: issue 44 after column_blocks="auto" became the default ("ours"):
  # the 32B and 1.5B against rows only and column blocks everywhere
  multi4 32b --variants "ours,ours rows only,ours column blocks" --skip-ipc
  multi4 1.5b --variants "ours,ours rows only,ours column blocks" --skip-ipc
}

phase_fiftieth() {  # 4 GPUs: issue 44's expert parallelism (tests/test_moe.py, TP=2 with EP) on
  # GPUs 0-1, beside the 7B on two GPUs with column_blocks="auto" (down exchanged, o gathered)
  # against rows only and column blocks everywhere, on GPUs 2-3
  mkdir -p "$W/results/multi2"
  run pytest-moe-ep 0,1 env ASYNCROLL_TEST_ENGINE_ARGS='{"async_scheduling": false, "dtype": "bfloat16"}' \
    python3 -m pytest -q -p no:cacheprovider tests/test_moe.py -k expert_parallel &
  run multi2-7b 2,3 python3 -m torch.distributed.run --nproc-per-node 2 --master-port 29533 \
    bench/gpu_multi.py --out "$W/multi2-7b" --sizes 7b --skip-ipc --rounds 2 \
    --variants "ours,ours rows only,ours column blocks" &
  wait
  cp "$W/multi2-7b/gpu_multi.json" "$W/results/multi2/gpu_multi-7b-auto.json" 2>/dev/null
  rm -rf "$W/multi2-7b"
}

phase_fiftyfirst() {  # 2 GPUs: issue 44's expert parallelism (tests/test_moe.py, TP=2 with
  # EP), then the 7B on two GPUs with column_blocks="auto" against rows only and column blocks
  # everywhere, and the same shape on one GPU
  mkdir -p "$W/results/multi2"
  run pytest-moe-ep 0,1 env ASYNCROLL_TEST_ENGINE_ARGS='{"async_scheduling": false, "dtype": "bfloat16"}' \
    python3 -m pytest -q -p no:cacheprovider --tb=long tests/test_moe.py -k expert_parallel
  run multi2-7b 0,1 python3 -m torch.distributed.run --nproc-per-node 2 --master-port 29533 \
    bench/gpu_multi.py --out "$W/multi2-7b" --sizes 7b --skip-ipc --rounds 2 \
    --variants "ours,ours rows only,ours column blocks"
  cp "$W/multi2-7b/gpu_multi.json" "$W/results/multi2/gpu_multi-7b-auto.json" 2>/dev/null
  rm -rf "$W/multi2-7b"
}

phase_fiftysecond() {  # 2 GPUs: what session 41's receiver change owes: the one-GPU push
  # (gpu_e2e) and the broadcast into a local engine on GPU 1, vLLM's nccl path beside it
  run push-7b 0 python3 bench/gpu_e2e.py --sections push --sizes 7b --out "$W/results/push7b"
  mkdir -p "$W/results/broadcast"
  run broadcast-7b 0,1 python3 bench/gpu_broadcast.py --sections correctness,push --sizes 7b \
    --engine local --out "$W/results/broadcast"
}

multi2() {  # multi2 NAME TREE SIZE ARGS...: a 2-rank trainer into a TP=2 engine on GPUs 0-1, with
  # asyncroll from TREE ("new": this checkout; "old": .old, the package as it was before a change,
  # under this checkout's benches)
  local name=$1 tree=$2 size=$3; shift 3
  local path=$PYTHONPATH
  [ "$tree" = old ] && path=$PWD/.old:$PYTHONPATH
  mkdir -p "$W/results/multi2"
  run multi2-$name 0,1 env PYTHONPATH="$path" python3 -m torch.distributed.run --nproc-per-node 2 \
    --master-port 29534 bench/gpu_multi.py --out "$W/multi2-$name" --sizes $size "$@"
  cp "$W/multi2-$name/gpu_multi.json" "$W/results/multi2/gpu_multi-$name.json" 2>/dev/null
  rm -rf "$W/multi2-$name"
  pack
}

phase_fiftythird() {  # 2 GPUs: the EP test, which now checks each worker holds half the experts;
  # the 30B-A3B on two GPUs with the sharded update's preparation as it was (old) and now (new)
  run pytest-moe-ep 0,1 env ASYNCROLL_TEST_ENGINE_ARGS='{"async_scheduling": false, "dtype": "bfloat16"}' \
    python3 -m pytest -q -p no:cacheprovider --tb=long tests/test_moe.py -k expert_parallel
  multi2 30b-a3b-old old qwen3-30b-a3b --variants ours --skip-ipc --skip-single
  multi2 30b-a3b-new new qwen3-30b-a3b --variants ours --skip-ipc --skip-single
}

phase_fiftyfourth() {  # 2 GPUs: the 30B-A3B into an expert-parallel engine; the broadcast (its
  # check after a failed push fixed); the 7B before and after the preparation change
  multi2 30b-a3b-ep new qwen3-30b-a3b --variants ours --skip-ipc --skip-single --expert-parallel
  mkdir -p "$W/results/broadcast"
  run broadcast-7b 0,1 python3 bench/gpu_broadcast.py --sections correctness,push --sizes 7b \
    --engine local --out "$W/results/broadcast"
  multi2 7b-new new 7b --variants ours --skip-ipc --skip-single
  multi2 7b-old old 7b --variants ours --skip-ipc --skip-single
}

phase_fiftyfifth() {  # 4 GPUs: what the trainer waits for (call_ms) beside the stall at the
  # 30B-A3B and the 32B, TP=4, after session 44's preparation change; then the broadcast's 7B
  # push, which session 44's device time cut
  multi4 qwen3-30b-a3b --variants ours --skip-ipc
  multi4 32b --variants ours --skip-ipc
  mkdir -p "$W/results/broadcast"
  run broadcast-7b 0,1 python3 bench/gpu_broadcast.py --sections push --sizes 7b \
    --engine local --out "$W/results/broadcast"
}

phase_fortyeighth() {  # 4 GPUs: issue 44 after the fan_in routing fix: the split layout at 1.5B
  # (checks) and 7B; the 30B-A3B colocated TP=4 with its served-experts check (no vLLM ipc:
  # fortysixth measured it)
  split4 1.5b
  split4 7b
  multi4 qwen3-30b-a3b --variants "ours,ours column blocks" --skip-ipc
}

for phase in "$@"; do
  echo "== $(date +%T) phase $phase"
  "phase_$phase"
done
pack
echo "== $(date +%T) done: $(du -h "$OUT/session.tar.gz" | cut -f1)"
