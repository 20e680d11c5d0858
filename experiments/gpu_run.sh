#!/usr/bin/env bash
# One call on the GPU machine (docs/gpu.md), from the checkout's root: bash experiments/gpu_run.sh STEP...
# Installs the carried wheels (.whl: nixl-cu13, pyzmq, msgspec, setproctitle; the image has torch,
# aiohttp, prometheus-client, tokenizers, safetensors) into the interpreter's environment (its venv, or
# the user's site-packages), then runs each step from the checkout: `python3 -m` finds pushkv,
# processes and tools in the working directory, and the processes it starts run from there too.
set -uo pipefail
cd "$(dirname "$0")/.."
if python3 -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)'; then WHERE=(); else WHERE=(--user); fi
PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  "${WHERE[@]}" .whl/*.whl || exit 1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PUSHKV_THREADS=${PUSHKV_THREADS:-4}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, nixl._api, zmq, msgspec, aiohttp; print('torch', torch.__version__, 'gpus', torch.cuda.device_count())" || exit 1
OUT=${OUT:?set OUT to the folder the results go to}; mkdir -p "$OUT"
for step in "$@"; do
  echo "=== $step"
  case "$step" in
    demo) timeout 240 python3 -m tools.demo --device cuda --model small --num-blocks 4096 \
            --prompt-len 16 1024 4096 2>&1 | tee "$OUT/demo.txt" ;;
    transfer) timeout 200 python3 -m tools.transfer_report ${XFER_DEV:---device cuda} --model "${MODEL:-medium}" \
            --lengths 64 1024 4096 16384 --out "$OUT/transfer_gpu.json" 2>&1 | tail -9 | tee "$OUT/transfer.txt"
            timeout 150 python3 -m tools.transfer_report --writers-only --post-cost ${XFER_DEV:---device cuda} \
            --sizes-mib 1 4 16 64 256 1024 --out "$OUT/transfer_writers.json" 2>&1 | tail -25 | tee -a "$OUT/transfer.txt" ;;
    sweep) timeout 480 python3 -m tools.sweep --result-dir "$OUT/sweep" --up-args "--device cuda --model medium --num-blocks 8192" \
            ${SWEEP_ARGS:-} > "$OUT/sweep.log" 2>&1; tail -3 "$OUT/sweep.log"
           python3 -m tools.stages "$OUT/sweep" | tee "$OUT/stages.txt"
           python3 -m tools.plot "$OUT/sweep" --out "$OUT/gpu_sweep.png" 2>&1 | tee "$OUT/table.txt"
           mkdir -p "$OUT/json" && cp "$OUT"/sweep/*.json "$OUT/json/" && (cd "$OUT" && tar czf sweep_json.tgz json) && rm -rf "$OUT/json" "$OUT/sweep" ;;
    ucxinfo) for mode in pull push; do
            UCX_PROTO_INFO=y timeout 120 python3 -c "
from tools.launch import launched
import sys
with launched('--mode', '$mode', '--device', 'cuda', '--model', 'medium', '--num-blocks', '4096', log_path='$OUT/ucx_$mode.log') as d:
    for n in (1024, 4096):
        d.complete([i % 250 for i in range(n)], 2)
"
            echo "-- $mode"; grep -A7 -E "(read by ucp_get|write by ucp_put).* cuda/dev.* to cuda" "$OUT/ucx_$mode.log" | grep -v self | cut -c30- | head -40; done ;;
    demo2) timeout 150 python3 -m tools.demo --device cuda:0 --decode-device cuda:1 --model small \
            --num-blocks 4096 --prompt-len 16 1024 4096 2>&1 | tail -8 | tee "$OUT/demo2.txt" ;;
    transfer2) timeout 150 python3 -m tools.transfer_report --device cuda:0 --decode-device cuda:1 \
            --model medium --lengths 4096 16384 --reps 3 --out "$OUT/transfer2.json" 2>&1 | tail -5 | tee "$OUT/transfer2.txt" ;;
    gputests) timeout 900 python3 -m pytest -q -p no:cacheprovider -x tests/model/test_batched.py tests/e2e/test_gpu_e2e.py \
            2>&1 | tee "$OUT/gputests.txt" | tail -15 ;;
    preemptgpu) # preemption by recompute on the batched engine: completes, frees, and how far tokens agree
            timeout 400 python3 -m pytest -q -s -p no:cacheprovider tests/e2e/test_gpu_preempt.py 2>&1 | tail -15 \
              | tee "$OUT/preempt.txt" ;;
    models) timeout 560 python3 -m experiments.models_gpu --out "$OUT" ${MODELS_ARGS:-} 2>&1 | grep -v "Writing model\|Loading weights" \
            | tee "$OUT/models_gpu.txt" ;;
    roofline) timeout 600 python3 -m tools.roofline --model "${MODEL:-qwen3-8b}" ${ROOFLINE_ARGS:-} \
            --out "$OUT/roofline.json" 2>&1 | tee "$OUT/roofline.txt" ;;
    sweep8b) # P and D share GPU 0 on a one-GPU machine (say so in the results); SWEEP_MODES picks modes
           timeout 560 python3 -m tools.sweep --result-dir "$OUT/sweep8b" --modes ${SWEEP_MODES:-push pull-inline} \
             --inputs ${SWEEP_INPUTS:-4096 8192 16384} --qps ${SWEEP_QPS:-1 2 4} --num-prompts ${SWEEP_N:-12} \
             --output-len 256 --warmup 1 --health-timeout 240 \
             --up-args "--model qwen3-8b ${SWEEP_DEV:---device cuda} --num-blocks ${SWEEP_BLOCKS:-12000} --max-num-seqs 64 --max-batch-tokens 16384 ${SWEEP_UP:-}" \
             > "$OUT/sweep8b.log" 2>&1; tail -3 "$OUT/sweep8b.log"
           python3 -m tools.stages "$OUT/sweep8b" | tee "$OUT/stages8b.txt"
           python3 -m tools.plot "$OUT/sweep8b" --out "$OUT/sweep8b.png" 2>&1 | tee "$OUT/table8b.txt"
           (cd "$OUT" && tar czf sweep8b_json.tgz sweep8b) ;;
    layergpu) # layer-streamed push on the GPU: the end-to-end test, the link each UCX_TLS gives between two
           # pools on one GPU, then lone TTFT per mode on the device path (LAYER_MODES, LAYER_LENGTHS, LAYER_UP)
           timeout 300 python3 -m pytest -q -p no:cacheprovider -x tests/e2e/test_gpu_e2e.py -k layer 2>&1 | tail -4 \
             | tee "$OUT/layer_test.txt"
           for v in "" UCX_TLS=sm,cuda_copy UCX_TLS=tcp,cuda_copy; do echo "-- WRITE ${v:-device path}" | tee -a "$OUT/links.txt"
             env $v timeout 60 python3 -m experiments.nixl_probe --device cuda:0 --peer-device cuda:0 --op WRITE --ways adhoc \
               --sizes-mib 64 256 --reps 3 2>&1 | grep -E "MiB|copy" | tee -a "$OUT/links.txt"; done ;;
    readprobe) # READ against WRITE between two processes on one GPU: UCX's default for cuda_ipc GET
           # (auto: off without active NVLink) against pushkv's (on), then which protocol UCX picks
           for v in UCX_CUDA_IPC_ENABLE_GET_ZCOPY=auto ""; do
             for op in WRITE READ; do echo "-- $op ${v:-pushkv default}"
               env $v timeout 90 python3 -m experiments.nixl_probe --device cuda:0 --peer-device cuda:0 --op $op --ways adhoc \
                 --sizes-mib 64 256 --reps 3 2>&1 | grep -E "MiB|copy|arrived" | tee -a "$OUT/readprobe.txt"; done; done
           for v in UCX_CUDA_IPC_ENABLE_GET_ZCOPY=auto ""; do env $v UCX_PROTO_INFO=y timeout 90 python3 -m experiments.nixl_probe \
               --device cuda:0 --peer-device cuda:0 --op READ --ways adhoc --sizes-mib 64 --reps 1 2>&1 \
             | grep -A6 -E "read by ucp_get.* cuda.* from cuda" | cut -c34- | grep -E "ucp_get|\| *[0-9]" | sort -u \
             | tee -a "$OUT/readproto.txt"; echo "-- above: ${v:-pushkv default}" | tee -a "$OUT/readproto.txt"; done ;;
    streamgpu) # lone requests, push against push-chunk (and the others), one GPU shared by P and D
           timeout 560 python3 -m tools.stream_bench --modes ${STREAM_MODES:-push push-chunk pull-inline local} \
             --lengths ${STREAM_LENGTHS:-2048 8192 16384} --reps ${STREAM_REPS:-2} --vocab 150000 \
             --up-args "--model qwen3-8b --device cuda:0 --num-blocks 8192 --max-batch-tokens 16384 --prefill-chunk ${STREAM_CHUNK:-2048} ${STREAM_UP:-}" \
             --title "qwen3-8b, one H200 (P and D share it) ${UCX_TLS:+UCX_TLS=$UCX_TLS}" --out "$OUT/${STREAM_NAME:-stream}" \
             2>&1 | grep -v "^20" | tee "$OUT/${STREAM_NAME:-stream}.txt" | tail -20
           rm -f "$OUT/${STREAM_NAME:-stream}"/*.log ;;
    probe) # raw NIXL WRITE below the writer (experiments/nixl_probe.py), then UCX variants
           timeout 120 python3 -m experiments.nixl_probe ${PROBE_DEV:---device cuda:0 --peer-device cuda:1} \
             --out "$OUT/probe.json" 2>&1 | grep -v "NIXL INFO" | tee "$OUT/probe.txt"
           UCX_PROTO_INFO=y timeout 100 python3 -m experiments.nixl_probe ${PROBE_DEV:---device cuda:0 --peer-device cuda:1} \
             --sizes-mib 1 64 --reps 3 > "$OUT/probe_protoinfo.txt" 2>&1
           grep -E "cuda|rndv|put|copy" "$OUT/probe_protoinfo.txt" | grep -v "NIXL INFO" | cut -c1-200 | sort | uniq -c | sort -rn | head -30
           for v in ${PROBE_VARIANTS:-UCX_PROTO_ENABLE=n UCX_RNDV_THRESH=inf UCX_TLS=cuda_ipc,cuda_copy,tcp,self}; do
             echo "-- $v"; env "$v" timeout 100 python3 -m experiments.nixl_probe ${PROBE_DEV:---device cuda:0 --peer-device cuda:1} \
               --sizes-mib 1 16 64 256 --reps 5 2>&1 | grep -v "NIXL INFO" | tee -a "$OUT/probe_variants.txt"; done ;;
    sampling) # with OLD_TREE (an untracked copy of an older commit's pushkv/): its sampler first, for an A/B in one run
           if [ -n "${OLD_TREE:-}" ]; then mkdir -p "$OLD_TREE/tools" && cp tools/__init__.py tools/sampling_bench.py "$OLD_TREE/tools/"
             echo "-- sampler of $OLD_TREE" | tee -a "$OUT/sampling_gpu.txt"
             (cd "$OLD_TREE" && timeout 200 python3 -m tools.sampling_bench --device cuda --batch 1 8 64 256 --vocab 151936 \
               2>&1 | tee -a "$OUT/sampling_gpu.txt"); echo "-- sampler of this tree" | tee -a "$OUT/sampling_gpu.txt"; fi
           timeout 200 python3 -m tools.sampling_bench --device cuda --batch 1 8 64 256 --vocab 151936 \
             2>&1 | tee -a "$OUT/sampling_gpu.txt" ;;
    xferab) # before/after in one run: writers of the tree in $OLD_TREE (untracked copy of an older commit) vs this one
           for i in 1 2; do for tree in "$OLD_TREE" "$PWD"; do echo "-- writers of $tree"
             PUSHKV_WRITERS_ROOT=$tree timeout 100 python3 -m tools.transfer_report --writers-only ${XFER_DEV:---device cuda} \
               --sizes-mib 0.25 1 16 64 256 --reps 11 --out "$OUT/xferab_${i}_$(basename $tree).json" 2>&1 | grep -A12 "^writers only" \
               | tee -a "$OUT/xferab.txt"; done; done ;;
    probegap) for gap in ${GAPS:-0 2 10}; do echo "-- ${gap} ms between transfers ${GAP_ARGS:-idle}"
             timeout 100 python3 -m experiments.nixl_probe ${PROBE_DEV:---device cuda:0 --peer-device cuda:1} --sizes-mib 0.25 1 64 \
               --reps 9 --gap-ms $gap ${GAP_ARGS:-} 2>&1 | grep -E "notif|copy" | tee -a "$OUT/probegap.txt"; done ;;
    xferprof) # P's and D's writers under cProfile for many one-block pushes: where the fixed cost goes
           PUSHKV_PROFILE_DIR="$OUT/prof" timeout 150 python3 -m tools.transfer_report --writers-only ${XFER_DEV:---device cuda} \
             --sizes-mib 0.25 --reps 200 2>&1 | grep -A4 "^ blocks" | tee "$OUT/xferprof.txt"
           for w in prefill decode; do python3 -c "
import pstats; s = pstats.Stats('$OUT/prof/$w-writer-0.prof'); s.sort_stats('tottime').print_stats(22)
s.print_callees('_post_write|_prefill_done|on_ExpectKV|_poll_notifs')" 2>&1 | grep -v "^$" | cut -c1-180 | tee -a "$OUT/xferprof.txt" | head -90; done ;;
    xferwarm) # the warm path (writers spin while a transfer is expected): warm off/on x gap 0/20 ms x GPUs idle/busy,
           # one writer pair per configuration, one line each (tools/transfer_writers.py warm_matrix)
           timeout 280 python3 -m tools.transfer_report --writers-only --warm-matrix ${XFER_DEV:---device cuda:0 --decode-device cuda:1} \
             --sizes-mib 0.25 1 16 64 256 --reps 7 --gap-ms 20 --out "$OUT/xferwarm.json" 2>&1 \
             | grep -E "^warm|^\(devices|Error|error:" | tee "$OUT/xferwarm.txt" ;;
    loragpu) # LoRA adapters on the GPU: float32 tokens against PEFT's (fused engine, graphs, GEMVs), bf16 push = local
            timeout 400 python3 -m pytest -q -p no:cacheprovider tests/model/test_lora_gpu.py tests/model/test_lora_kernel.py -rfE 2>&1 \
              | tee "$OUT/lora_gpu.txt" | tail -6 ;;
    lorabench) # what a LoRA adapter costs a decode step and a prefill (experiments/lora_bench.py)
            timeout 300 python3 -m experiments.lora_bench --model ${LORA_MODEL:-qwen3-8b} --rank ${LORA_RANK:-16} \
              --out "$OUT" ${LORA_ARGS:-} 2>&1 | grep -v "^20" | tee "$OUT/lora_bench.txt" | tail -70 ;;
    gpue2e) timeout 400 python3 -m pytest -q -p no:cacheprovider tests/e2e/test_gpu_e2e.py 2>&1 | tee "$OUT/gpue2e.txt" | tail -5 ;;
    moetests) # the MoE decode path's GPU tests (the router in the norm, the GEMVs, the kernels, graphs): 250-340 s
            timeout 420 python3 -m pytest -q -p no:cacheprovider tests/model/test_add_rms_router_kernel.py \
              tests/model/test_gemv_kernel.py tests/model/test_moe_kernel.py tests/model/test_moe_slot_sum.py \
              tests/model/test_gpu_graphs.py tests/model/test_batched.py -k "gpu or add_rms_router or moe or gemv" \
              -rfE 2>&1 | tee "$OUT/moe_decode_tests.txt" | tail -4 ;;
    moedecode) # experiments/moe_decode_probe.py: chained launches, the router in the norm and the GEMVs, each on
            # and off (~90 s); its tables set kernels.chain.ON, batched.ROUTER_IN_NORM_TOKENS and batched.GEMV_TOKENS
            timeout 540 python3 -m experiments.moe_decode_probe --out "$OUT" 2>&1 | tail -40 ;;
    moeaheadtests) # one launch and the L2 prefetches (the MoE down weights, the dense weights ahead; all off until
            # timed): their GPU tests (the bits of the two launches, replayed 50 times; float32 tokens against
            # transformers with each on; the L2 set-aside read back)
            timeout 500 python3 -m pytest -q -p no:cacheprovider tests/model/test_moe_kernel.py \
              tests/model/test_gpu_graphs.py tests/supervisor/test_kv_sizing.py \
              -k "one_launch or prefetch or gpu_decode_kernels or gpu_kernels_equal or l2_set_aside or enforce_eager" \
              -rfE 2>&1 | tee "$OUT/moe_ahead_tests.txt" | tail -4 ;;
    moeahead) # the probe's variants of them against the shipped step at batches 1 and 8
            timeout 540 python3 -m experiments.moe_decode_probe --out "$OUT" --batches ${AHEAD_BATCHES:-1,8} --reps ${REPS:-30} \
              --variants ${AHEAD_VARIANTS:-gemv1_2,prefetch_down,prefetch_down_l2,ungrouped1,one_launch,one_launch_prefetch,ahead_o,ahead_o_route,ahead_o_sum,ahead_all,own,own_down,own_all,own_all_l2,one_launch_own,one_launch_all,one_launch_all_l2,ahead_kv,own_all_kv} \
              2>&1 | tail -40 ;;
    moesmall) # the one-token step's small kernels: the probe's variants against the shipped step, then their GPU tests
            # (bits against the shipped kernels; Qwen3-MoE's and Mixtral's float32 tokens with them on)
            timeout 420 python3 -m experiments.moe_decode_probe --out "$OUT" --batches ${SMALL_BATCHES:-1,8} --reps ${REPS:-30} \
              --variants ${SMALL_VARIANTS:-gemv1_2,router_late} 2>&1 | tail -30
            timeout 170 python3 -m pytest -q -p no:cacheprovider tests/model/test_decode_small_kernels.py \
              -k gpu_early -rfE 2>&1 | tee "$OUT/small_tests.txt" | tail -4 ;;
    moeearly) # each kernel letting the next be scheduled before it waits (chain.EARLY_NEXT, off until timed): the
            # probe's early_* variants against the shipped step, then the float32 tokens with every kernel so
            timeout 400 python3 -m experiments.moe_decode_probe --out "$OUT" --batches ${EARLY_BATCHES:-1,8} --reps ${REPS:-30} \
              --variants ${EARLY_VARIANTS:-gemv1_2,early_o,early_qkv,early_o_qkv,early_small,early_small_gemv,early_all} \
              2>&1 | tail -30
            timeout 180 python3 -m pytest -q -p no:cacheprovider tests/model/test_gpu_graphs.py -k early_next -rfE 2>&1 \
              | tee "$OUT/early_tests.txt" | tail -4 ;;
    moeprobe) # the probe alone, on the variants PROBE_VARIANTS names (three or more: the batch-1 profiles too, with
            # what each kernel adds to the step)
            timeout 400 python3 -m experiments.moe_decode_probe --out "$OUT" --batches ${PROBE_BATCHES:-1,8} \
              --reps ${REPS:-30} --variants ${PROBE_VARIANTS:-gemv1_2,early_none,early_all} 2>&1 | tail -40 ;;
    moeprefill) # the prefill probe (experiments/moe_prefill_probe.py): attention's configs, the grouped kernels' tiles
            # swept at SWEEP_TOKENS (4096; SWEEP_TOKENS= none), one MoE layer and the whole model's prefill at 4k with
            # its profile, each also with the down launch's row blocks first (before triton_moe.DOWN_COLS_FIRST_SLOTS), and
            # that launch's GPU test (the same bits)
            timeout 420 python3 -m experiments.moe_prefill_probe --out "$OUT/prefill" --tokens 4096 \
              --sweep-tokens "${SWEEP_TOKENS-4096}" --model-tokens 4096 2>&1 | grep -v "failed:" | tail -60
            timeout 120 python3 -m pytest -q -p no:cacheprovider tests/model/test_moe_kernel.py -k column_tiles -rfE 2>&1 \
              | tee "$OUT/prefill/cols_first_tests.txt" | tail -3 ;;
    tmatests) # the grouped MoE kernels' weights through tensor descriptors (triton_moe.TMA_SLOTS): the same bits
            timeout 200 python3 -m pytest -q -p no:cacheprovider tests/model/test_moe_kernel.py -k "descriptors or column_tiles" -rfE 2>&1 \
              | tee "$OUT/tma_tests.txt" | tail -4 ;;
    prefillab) # a triton_moe switch A/B over the whole MoE prefill in one process (experiments/prefill_ab.py): AB_SWITCH
            # (default the down launch order), AB_VALUES, AB_TOKENS, AB_SET (settings held throughout), AB_TAG (the file name's tail)
            timeout 400 python3 -m experiments.prefill_ab --switch "${AB_SWITCH:-DOWN_COLS_FIRST_SLOTS}" \
              --values ${AB_VALUES:-0 1 shipped} --tokens ${AB_TOKENS:-1024 4096 16384} --set ${AB_SET:-} 2>&1 \
              | tee "$OUT/prefill_ab_${AB_SWITCH:-DOWN_COLS_FIRST_SLOTS}${AB_TAG:+_$AB_TAG}.txt" | tail -16 ;;
    attnsdpa) # a fresh prefill's attention: the paged Triton kernel against torch's fused backends (cuDNN, flash,
            # efficient; GQA given or keys repeated) on the same keys (experiments/attn_sdpa_probe.py)
            timeout 200 python3 -m experiments.attn_sdpa_probe --tokens ${SDPA_TOKENS:-1024 4096 16384} \
              --out "$OUT/attn_sdpa.json" 2>&1 | tee "$OUT/attn_sdpa.txt" | tail -24 ;;
    freshab) # whole prompts through the fused attention (batched.SDPA_PROMPT_TOKENS): its tests on the GPU, the whole
            # MoE prefill off / on at FRESH_BOUND (default 2048), then the attention alone (experiments/attn_sdpa_probe.py)
            timeout 150 python3 -m pytest -q -p no:cacheprovider tests/model/test_fresh_attention.py -rfE 2>&1 \
              | tee "$OUT/fresh_tests.txt" | tail -3
            timeout 300 python3 -m experiments.prefill_ab --switch batched.SDPA_PROMPT_TOKENS --values 0 "${FRESH_BOUND:-2048}" \
              --tokens ${AB_TOKENS:-2048 4000 4096 16384} 2>&1 | grep -v "UserWarning\|o = F" | tee "$OUT/fresh_ab.txt" | tail -16
            timeout 200 python3 -m experiments.attn_sdpa_probe --tokens ${SDPA_TOKENS:-2048 4096 16384} \
              --out "$OUT/attn_sdpa.json" 2>&1 | grep -v "UserWarning\|o = F" | tee "$OUT/attn_sdpa.txt" | tail -24 ;;
    graphtests) # the decode graphs' GPU tests and the float32 tokens of every architecture through graphs
            timeout 200 python3 -m pytest -q -p no:cacheprovider tests/model/test_decode_graphs.py \
              tests/model/test_gpu_graphs.py -k "graphs_equal_transformers_and_eager or one_copy" -rfE 2>&1 \
              | tee "$OUT/graph_tests.txt" | tail -4 ;;
    moetiles) # the grouped MoE kernels' decode tiles swept on this card (experiments/moe_decode_probe.py --sweep-tokens)
            timeout 560 python3 -m experiments.moe_decode_probe --out "$OUT" --batches 1 --reps ${REPS:-20} \
              --sweep-tokens ${SWEEP_TOKENS:-1} --then-time 2>&1 | grep -v "failed:" | tail -40 ;;
    moerows) # a step's experts as whole-row GEMVs (triton_moe.ROWS_ONE_TOKEN, DOWN_ROWS_ONE_TOKEN, up to ROWS_TOKENS):
            # the probe with a batch's profiles (PROFILE_BATCH, 1), then the GPU tests (each product against the grouped
            # kernels', float32 tokens); two tokens': PROBE_BATCHES=1,2,4 PROFILE_BATCH=2
            # PROBE_VARIANTS=gemv1_2,grouped,rows_few_1,rows_few_2_up,rows_few_4
            timeout ${PROBE_TIMEOUT:-300} python3 -m experiments.moe_decode_probe --out "$OUT" --batches ${PROBE_BATCHES:-1,8} \
              --reps ${REPS:-30} --variants ${PROBE_VARIANTS:-gemv1_2,rows_up,rows_down,rows_both,rows_both_4} \
              --profile-batch ${PROFILE_BATCH:-1} 2>&1 \
              | tail -34
            timeout 200 python3 -m pytest -q -p no:cacheprovider tests/model/test_moe_kernel.py tests/model/test_gpu_graphs.py \
              -k "whole_row or (graphs_equal_transformers and (moe or mixtral))" -rfE 2>&1 \
              | tee "$OUT/rows_tests.txt" | tail -4 ;;
    routeone) # a one-token step's routing in registers (triton_moe.ROUTE_ONE_TOKEN, on since 2026-12-06): the probe with
            # the batch-1 profiles (what each kernel adds), then its GPU tests (the tables to the bit, float32 tokens)
            timeout 330 python3 -m experiments.moe_decode_probe --out "$OUT" --batches ${PROBE_BATCHES:-1,8} \
              --reps ${REPS:-30} --variants ${PROBE_VARIANTS:-gemv1_2,route_general,early_none} 2>&1 | tail -30
            timeout 200 python3 -m pytest -q -p no:cacheprovider tests/model/test_moe_kernel.py \
              tests/model/test_gpu_graphs.py -k "routing_in_registers or route_one" -rfE 2>&1 \
              | tee "$OUT/route_one_tests.txt" | tail -4 ;;
    layerfloor) # a mock of Qwen3-30B-A3B's batch-1 step (its bytes and dependent phases) chained and as persistent
            # kernels with grid barriers (experiments/layer_floor.py), then the shipped step in the same run
            timeout 420 python3 -m experiments.layer_floor --out "$OUT/layer_floor" ${FLOOR_ARGS:-} 2>&1 | tail -30
            timeout 300 python3 -m experiments.moe_decode_probe --out "$OUT/shipped" --batches 1 --reps 30 \
              --variants gemv1_2 2>&1 | tail -8 ;;
    moetoken) # a one-token step's MoE MLP in one persistent launch (triton_moe.PERSISTENT_ONE_TOKEN, off until timed):
            # its GPU tests, the float32 tokens with it on, then the probe against the shipped step
            timeout 400 python3 -m pytest -q -p no:cacheprovider tests/model/test_moe_token_kernel.py \
              tests/model/test_gpu_graphs.py -k "token or persistent" -rfE 2>&1 | tee "$OUT/moe_token_tests.txt" | tail -4
            timeout 400 python3 -m experiments.moe_decode_probe --out "$OUT/moe_token" --batches ${TOKEN_BATCHES:-1,2} \
              --reps ${REPS:-30} --variants gemv1_2,persistent,persistent_1,persistent_2,persistent_4 2>&1 | tail -25 ;;
    denseahead) # the dense weights asked of L2 ahead (batched.AHEAD) on a dense model: qwen3-8b's o is 33 MB
            timeout 540 python3 -m experiments.moe_decode_probe --model qwen3-8b --out "$OUT/dense" --batches 1,8 \
              --reps ${REPS:-30} --variants gemv1_2,ahead_o,ahead_o_sum,ahead_kv 2>&1 | tail -25 ;;
    deepseektests) # DeepSeek-V2/V3 checkpoints' float32 tokens against transformers on the GPU (both engines), and
            # the grouped kernels for DeepSeek's routing against the torch reference
            timeout 400 python3 -m pytest -q -p no:cacheprovider tests/model/test_deepseek.py \
              tests/model/test_moe_kernel.py -k "gpu and (float32 or routing_already)" -rfE 2>&1 \
              | tee "$OUT/deepseek_tests.txt" | tail -4 ;;
    scoregpu) # prompt logprobs scored on CUDA by the batched engine, against the dense reference on the CPU
            timeout 200 python3 -m pytest -q -p no:cacheprovider tests/model/test_prompt_logprobs.py -k gpu -rfE 2>&1 \
              | tee "$OUT/prompt_logprobs_tests.txt" | tail -4 ;;
    mlagpu) # one MLA decode row's attention on the GPU: expanded (the per-sequence engine) against absorbed (batched)
            timeout 200 python3 -m experiments.mla_decode_bench --device cuda --contexts 512 4096 16384 \
              --out "$OUT/mla_decode_gpu.json" 2>&1 | tee "$OUT/mla_decode_gpu.txt" | tail -6 ;;
    mlagraphs) # MLA's decode steps in CUDA graphs (batched.MLA_GRAPHS, off until this passes): DeepSeek's float32
            # tokens against transformers replayed from graphs, the latent store kernel, the graph bookkeeping
            timeout 400 python3 -c "import sys, pytest; import pushkv.model.batched as b; b.MLA_GRAPHS = True; \
sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-rfE', 'tests/model/test_deepseek.py', \
'tests/model/test_paged_attention_kernel.py', 'tests/model/test_decode_graphs.py', '-k', 'gpu_float32 or latent or graph']))" \
              2>&1 | tee "$OUT/mla_graphs_tests.txt" | tail -4 ;;
    mlatriton) # MLA's decode attention as one Triton kernel (batched.MLA_TRITON, off until this passes and is faster):
            # the kernel against the torch ops (bf16 and float32, V2-Lite's and V3's heads), DeepSeek's float32 tokens
            # against transformers with it on, then its time against the torch ops' at batches 1-32, contexts to 16k
            timeout 400 python3 -c "import sys, pytest; import pushkv.model.batched as b; b.MLA_TRITON = True; \
sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '-rfE', 'tests/model/test_mla_decode_kernel.py', \
'tests/model/test_deepseek.py', '-k', 'gpu']))" 2>&1 | tee "$OUT/mla_triton_tests.txt" | tail -4
            timeout 300 python3 -m experiments.mla_kernel_bench --out "$OUT/mla_kernel.json" 2>&1 \
              | tee "$OUT/mla_kernel.txt" | tail -10
            python3 -m experiments.mla_kernel_bench --plot "$OUT/mla_kernel.json" --out "$OUT/mla_kernel.png" || true ;;
    samplegpu) # the sampler's edits on CUDA (allowed ids, repetition penalty, a structured-output mask, suppression)
            # and the Triton sampler against the torch path at Qwen3's vocabulary
            timeout 300 python3 -m pytest -q -p no:cacheprovider -rfE tests/model/test_sampling.py \
              tests/model/test_sampling_kernel.py 2>&1 | tee "$OUT/sample_gpu.txt" | tail -4 ;;
    attntune) timeout 300 python3 -m experiments.attn_tune 2>&1 | tee "$OUT/attn_tune.txt" ;;
    kvverifyfaults) # the fault cases end to end with the pools in GPU memory (push-layer and pull, tiny models)
              timeout 500 python3 -m pytest -q -p no:cacheprovider -rs tests/e2e/test_kv_verify.py -k cuda \
              2>&1 | tail -4 | tee "$OUT/kv_verify_faults.txt" ;;
    kvverify) timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kv/test_kv_checksum_kernel.py tests/kv/test_kv_checksum.py \
              2>&1 | tail -3 | tee "$OUT/kv_verify.txt"
              timeout 540 python3 -m experiments.kv_verify_bench --device cuda --model qwen3-8b --length 8192 ${KV_VERIFY_BENCH:---ttft} \
              --up-args "--model qwen3-8b --device cuda:0 --num-blocks 8192 --max-batch-tokens 16384" \
              --out "$OUT/kv_verify.json" 2>&1 | tail -12 | tee -a "$OUT/kv_verify.txt" ;;
    freshplans) # the fused attention's start-up plans up to FRESH_MAX tokens under today's padding and a geometric
            # one, whether torch's cache keeps them, and the attention at lengths padded each way
            timeout 500 python3 -m experiments.fresh_plans_probe --max-tokens ${FRESH_MAX:-65536} \
              --out "$OUT/fresh_plans.json" 2>&1 | grep -v "UserWarning\|o = F" | tee "$OUT/fresh_plans.txt" | tail -20 ;;
    *) echo "unknown step $step" ;;
  esac
done
