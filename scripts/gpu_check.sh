#!/usr/bin/env bash
# GPU checks and benchmarks by stage, results under $OUT.
# Stages, run in the order given (each time-boxed, so that a few fit a 10-minute command):
#   tests   kernel (Triton, registry, SGMV) + engine Pallas-path tests  tests.log      ~5 min
#   checks  tests, swaps and tiers at once, a third of the GPU's memory each  (their logs) ~5 min
#           (compiles dominate them, and the host has 16 cores)
#   sweep   bench_kernels.py --sweep --quick (B=32 L=8k, 2k/8k)     bench_kernels.*    ~2.5 min
#   table   bench_kernels.py, the full table with kernel defaults  bench_kernels.*    ~4 min
#   engine  bench_engine.py, B = 1, 16, 64                          engine.json/log    ~2 min
#   det     bench_engine.py --deterministic, B = 1, 16, 64          engine_det.*       ~2 min
#           (engine, det: $ENGINE_STEPS timed decode steps, default 12)
#   xla     bench_engine.py decode at $XLA_BATCHES (default 1,16), 2k, under each XLA_FLAGS  xla/   ~2 min a variant
#           of $XLA_VARIANTS (name=flags;...; default: none; the scanned layers' while loop in the
#           command buffer, unrolled there or not; unrolled in HLO; no command buffers): the step
#           and its host dispatch (XLA runs a while loop's iterations from the host); $XLA_KV bytes
#           of KV (default 24e9; B=256 at 2k needs 70e9, an H200)
#   large   bench_engine.py at B = 128, 256, 1k and 2k contexts,   engine_large_*.json ~5 min
#           $LARGE_POLICIES (default prefix,forkkv), 80 GB KV
#   rebuild engines of other shapes in one process, memory defaults  rebuild.log        ~5 min
#   tiers   the host tier's copies (pinned host memory) and engine     tiers.log          ~8 min
#           outputs (compiles dominate: a warm compilation cache halves it)
#   swaps   adapter swapping: outputs with more adapters than slots    swaps.log          ~5 min
#   adapters  bench_lora.py (T 64/2k/8k x N 1-64 slots), bench_engine.py --swap and       adapters/  ~3 min
#           the engine without adapter slots (--max-loras 1: decode B=64 2k, prefill 8k)
#   active  bench_engine.py --active 0,1,8,32,64: those with K distinct adapters (65 slots)  adapters/  ~6 min
#           on the LoRA path $LORA_PATH (fused, or sgmv), into active_<path>.json
#   startup  bench_startup.py --engine: $STARTUP_MODEL (llama3.1-8b-random) from a fresh   startup_*.json  ~3-9 min
#           process, the full warm-up, on /tmp/startup_cache: the first time on a machine with
#           an empty compile cache (startup_cold), then on the cache and program store the first
#           filled (startup_restart): one start a command, alone in it
#   host    host tier copy rates (bench_host_tier.py, 2 MB to 512 MB)   host_tier.json   ~1 min
#   serving bench_serving.py offline, 1,024 requests of 128-1,024 -> 256 tokens,  serving/  ~2 min
#           `prefix`, the default batch, $SERVING_KV bytes of KV (60e9: an H200's; an    a run
#           H100 fits 40e9), with $SERVING_ADAPTERS (0,1,8)
#   online  the same at Poisson rates $SERVING_RATES (req/s, 512 requests each)   online/   ~1 min a rate
#   http    bench_serving.py ShareGPT-like offline, 1,000 requests, `prefix`,   http/    ~6 min
#           $HTTP_MODEL (llama3.1-8b-random): in process, then over HTTP (a `python -m
#           forkjax.serve` process, the client in processes of its own)
#   fanout  bench_serving.py ShareGPT-like offline in process, `forkkv`, 8 adapters,    fanout/  ~3 min a run
#           $HTTP_MODEL: runs $FANOUT_RUNS (off,on; e.g. off,on2,off2: off* without fan-out,
#           the others with it), $FANOUT_PROMPTS (1000) requests each
#   http_online  the same model over HTTP at Poisson $HTTP_RATES (16) req/s,     http/    ~2 min a rate
#           512 requests each ($HTTP_INPROC=1: in process too)
#   external  aiperf (scripts/bench_external.sh) and bench_serving --http on     external/  ~4 min
#           smollm2-135m's shape and tokenizer (random weights), 512 -> 128 tokens, 256 requests
#           at concurrency 16 (carry .bench_model: scripts/random_checkpoint.py --no-weights)
#   structured  bench_structured.py: decode at B = 64, 256 (1k context) under JSON schemas  structured.*  ~3 min
#           against unconstrained, and the outputs' validity, on smollm2-135m's shape and tokenizer
#           (random weights; carry .bench_model, as for `external`)
#   hardening  deterministic-mode and isolation tests on the Pallas  hardening.log      ~2 min
#           path (the server's tests need the openai client, not on the GPU machine)
#   mgpu    Mosaic GPU kernel tests                                 mgpu_tests.log     ~2 min
#   mgpu_bench  bench_kernels.py --mgpu                             bench_kernels.*    ~5 min
#   kvw     K/V write kernel tests (fan-out rows included)          kvw_tests.log      ~1 min
#   tp      several GPUs: the tensor-parallel tests (Pallas path), then  tp/          ~8 min
#           bench_engine.py llama3-8b-random at TP $TP_SIZES (1,2): decode B=64 at 2k, prefill 8k
#   tp70    bench_workflows.py ReAct headline on llama3.1-70b-random at TP $TP (2),  tp70/  ~10 min
#           $WF_COUNTS (16,32), $WF_POLICIES (prefix,forkkv,forkkv+fanout): one policy a command
#   react   bench_workflows.py ReAct headline (3 agents x 4 rounds, react/, react.log   ~3-5 min
#           4k context, 64 + 64 tokens a turn), policies $WF_POLICIES             a policy
#           (default: all five), workflow slots $WF_COUNTS (4,16,32), workflows in all
#           $WF_TOTAL (3x: three times the slots, a steady state)
#   agents5  bench_workflows.py ReAct, 5 agents x 3 rounds over 8k, 96 + 128 tokens a turn,  agents5/
#           0.5 s tool calls, 8 workflows (16 in all), 64 GB host tier, $WF_POLICIES      ~4 min a policy
#           (prefix,forkkv+fanout); WF_HTTP=1 over HTTP, into agents5_http/
#   mapreduce  bench_workflows.py MapReduce headline (4 mappers +   mapreduce/, ...    ~2-4 min
#           reducer, 4k document, 64 tokens), $WF_POLICIES, $WF_COUNTS (16),       a policy
#           $WF_TOTAL
#   parallel   the same with parallel rounds (3 agents x 4 rounds    parallel/, ...
#           answering the same history at once, 4k context, 64 tokens)
#           (react, mapreduce, parallel: $WF_HOST bytes of host tier, e.g. 64e9, into
#           <stage>_host/; $WF_TOOL seconds of tool latency, ReAct only, into <stage>_tool<s>/;
#           WF_DISTINCT=1: every workflow slot's own agents, into <stage>_distinct/; $WF_MAX_LORAS
#           device adapter slots, into <stage>..._slots<n>/; WF_HTTP=1: over HTTP, a `python -m
#           forkjax.serve` process per point, into <stage>..._http/)
#   old     the stages $OLD_STAGES (default: wheels,http) of an older tree, for before/after tables on one
#           card: `mkdir .old && git archive REV | tar -x -C .old` here, carry `.old`; its results
#           in $OUT/old.tgz (one file: a run brings back few files, none below $OUT/a/b/), its
#           FORKJAX_COMMIT $OLD_COMMIT; it gets a copy of .whl/
#
# Carry .whl/ (scripts/fetch_gpu_wheels.sh): the packages the GPU machine lacks (llguidance, which
# forkjax imports; the server's; aiperf) are installed from it into /tmp/site, on PYTHONPATH for
# every stage.
#
# Every results file records $FORKJAX_COMMIT (scripts/provenance.py; pass `FORKJAX_COMMIT=$(git rev-parse HEAD)` from the
# checkout: the device's copy of the tree does not carry the commit).
#   bash scripts/gpu_check.sh sweep engine      # from the repository root, on the GPU machine
set -u
: "${OUT:?set OUT to the output folder}"
export PYTHONPATH=.
if [ ! -e /tmp/site/.installed ] && compgen -G ".whl/*.whl" > /dev/null; then  # once a machine
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && touch /tmp/site/.installed
    echo "wheels: rc=$?"
fi
[ -e /tmp/site/.installed ] && export PYTHONPATH=.:/tmp/site
run() {  # run <seconds> <log name> <command...>: time-boxed, log under $OUT, one summary line
    local limit=$1 log=$2
    shift 2
    timeout "$limit" "$@" > "$OUT/$log" 2>&1
    echo "$log: rc=$? $(grep -E 'passed|failed|error' "$OUT/$log" | tail -1)"
}
for stage in "$@"; do
    case $stage in
    tests)
        run 330 tests.log python3 -m pytest -q tests/test_paged_attention_kernels.py \
            tests/test_paged_attention_mosaic_operands.py tests/test_kernel_registry.py \
            tests/test_engine_pallas.py tests/test_sgmv.py ;;
    checks)
        for s in tests swaps tiers; do XLA_PYTHON_CLIENT_MEM_FRACTION=0.3 bash "$0" $s & done
        wait ;;
    mgpu)  # a hung kernel blocks the device for later commands: run Mosaic stages last
        run 120 mgpu_tests.log python3 -m pytest -q tests/test_paged_attention_mosaic.py \
            tests/test_kv_write.py ;;
    mgpu_bench)
        timeout 330 python3 scripts/bench_kernels.py --mgpu --out "$OUT" > /dev/null 2>&1
        echo "bench_kernels --mgpu: rc=$?"
        grep -E "sweep" "$OUT/bench_kernels.log" ;;
    sweep | table)
        [ "$stage" = sweep ] && args="--sweep --quick" || args=""
        timeout 300 python3 scripts/bench_kernels.py $args --out "$OUT" > /dev/null 2>&1
        echo "bench_kernels $args: rc=$?"  # it writes bench_kernels.json and bench_kernels.log
        grep -E "sweep|^B=|^T=|configs" "$OUT/bench_kernels.log" ;;
    xla)
        mkdir -p "$OUT/xla"
        variants=${XLA_VARIANTS:-"base=;while_unrolled=--xla_gpu_enable_command_buffer=+WHILE --xla_gpu_command_buffer_unroll_loops=true;while=--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL;hlo_unroll=--xla_gpu_enable_while_loop_unrolling=WHILE_LOOP_UNROLLING_FULL_UNROLL;no_cmdbuf=--xla_gpu_enable_command_buffer="}
        IFS=';' read -ra specs <<< "$variants"
        for spec in "${specs[@]}"; do
            name=${spec%%=*}
            XLA_FLAGS="${spec#*=}" run 150 xla/$name.log python3 scripts/bench_engine.py \
                --batches ${XLA_BATCHES:-1,16} --steps ${ENGINE_STEPS:-12} --prefill-tokens 2048 \
                --kv-cache-bytes ${XLA_KV:-24e9} --out "$OUT/xla/$name.json"
            grep -E '"(batch|step_ms|ratio|dispatch)"' "$OUT/xla/$name.json" | tr -d ' \n'; echo
        done ;;
    large)
        for policy in $(echo "${LARGE_POLICIES:-prefix,forkkv}" | tr , ' '); do
            for ctx in 1024 2048; do
                name=engine_large_${policy}_$ctx
                run 300 $name.log python3 scripts/bench_engine.py --batches 128,256 --context $ctx \
                    --steps ${ENGINE_STEPS:-12} --policy $policy --kv-cache-bytes 80e9 \
                    --prefill-tokens 2048 --out "$OUT/$name.json"
                grep -E '"(batch|step_ms|ratio|roofline_ms)"' "$OUT/$name.json" | tr -d ' \n'; echo
            done
        done ;;
    serving | online)
        shape="--num-prompts 1024 --dataset uniform --input-len 576 --range-ratio 0.7778
            --output-range-ratio 0 --output-len 256 --policy prefix --kv-cache-bytes ${SERVING_KV:-60e9}"
        mkdir -p "$OUT/$stage"
        if [ "$stage" = serving ]; then
            runs=$(for a in $(echo "${SERVING_ADAPTERS:-0,1,8}" | tr , ' '); do echo "a$a:--adapters_$a"; done)
        else
            runs=$(for r in $(echo "${SERVING_RATES:-8,16,24,32}" | tr , ' '); do
                echo "r$r:--adapters_0_--num-prompts_512_--request-rate_$r"; done)
        fi
        for run_spec in $runs; do
            name=${run_spec%%:*} flags=${run_spec#*:}
            timeout 300 python3 scripts/bench_serving.py $shape ${flags//_/ } --out "$OUT/$stage/$name" \
                > "$OUT/$stage/$name.log" 2>&1
            echo "$stage $name: rc=$? $(tail -1 "$OUT/$stage/$name.log")"
        done ;;
    adapters | active)
        mkdir -p "$OUT/adapters"
        if [ "$stage" = adapters ]; then
            timeout 150 python3 scripts/bench_lora.py --tokens 64,2048,8192 --slots 1,8,32,64 \
                --out "$OUT/adapters/bench_lora.jsonl" > "$OUT/adapters/bench_lora.log" 2>&1
            echo "bench_lora: rc=$?"
            specs="noslots:--active_0_--max-loras_1 swap:--swap"
        else
            specs="active_${LORA_PATH:-fused}:--active_0,1,8,32,64_--lora-path_${LORA_PATH:-fused}"
        fi
        for spec in $specs; do
            name=${spec%%:*} flags=${spec#*:}
            run 400 adapters/$name.log python3 scripts/bench_engine.py --policy prefix --batches 64 \
                --steps ${ENGINE_STEPS:-12} ${flags//_/ } --out "$OUT/adapters/$name.json"
        done ;;
    startup)  # one start on /tmp/startup_cache: cold the first time on a machine, a restart after
        # (bench_startup.py's own limit stops its engine process; an outer timeout would leave it
        # holding the GPU)
        [ -d /tmp/startup_cache ] && name=startup_restart || name=startup_cold
        python3 scripts/bench_startup.py --engine --cache-dir /tmp/startup_cache \
            --model ${STARTUP_MODEL:-llama3.1-8b-random} --limit 560 --out "$OUT/$name.json" \
            -- --warmup=full > "$OUT/${name}_run.log" 2>&1
        echo "bench_startup $name: rc=$?"
        python3 -c 'import json, sys; r = json.load(open(sys.argv[1]))
print({f: r[f] for f in ("cache_files_before", "ready_s", "first_answer_s", "warm_s", "compile", "programs")})' \
            "$OUT/$name.json" ;;
    host)
        timeout 200 python3 scripts/bench_host_tier.py --out "$OUT/host_tier.json" > "$OUT/host_tier.log" 2>&1
        echo "bench_host_tier: rc=$?"; cat "$OUT/host_tier.log" ;;
    rebuild)
        run 420 rebuild.log python3 -m pytest -q tests/test_engine_rebuild.py tests/test_engine_memory.py ;;
    tiers)  # the engine test's Pallas path with one pool (prefix) and with residuals and fan-out;
        # the other policies differ in host bookkeeping only, tested on the CPU (cold compiles
        # dominate this stage)
        t=tests/test_engine_host_tier.py::test_agents_find_their_histories_on_the_host
        run 540 tiers.log python3 -m pytest -q tests/test_cache_host_pool.py tests/test_engine_host_tier.py \
            --deselect "$t[full_reuse]" --deselect "$t[forkkv]" --deselect "$t[lrshared]" ;;
    swaps)
        run 420 swaps.log python3 -m pytest -q tests/test_engine_adapter_swap.py ;;
    fanout)  # the default fan-out's cost on plain traffic: forkkv with and without it, in turn
        shape="--model ${HTTP_MODEL:-llama3.1-8b-random} --dataset sharegpt --policy forkkv --adapters 8
            --num-prompts ${FANOUT_PROMPTS:-1000}"
        mkdir -p "$OUT/fanout"
        for name in $(echo "${FANOUT_RUNS:-off,on}" | tr , ' '); do
            flag=--residual-fanout; [ "${name%%[0-9]*}" = off ] && flag=--no-residual-fanout
            timeout 400 python3 scripts/bench_serving.py $shape $flag --out "$OUT/fanout/$name" \
                > "$OUT/fanout/$name.log" 2>&1
            echo "fanout $name: rc=$? $(tail -1 "$OUT/fanout/$name.log")"
        done ;;
    http | http_online)
        shape="--model ${HTTP_MODEL:-llama3.1-8b-random} --dataset sharegpt --policy prefix"
        mkdir -p "$OUT/http"
        if [ "$stage" = http ]; then
            runs="offline_inproc:--num-prompts_1000 offline_http:--num-prompts_1000_--http"
        else
            runs=$(for r in $(echo "${HTTP_RATES:-16}" | tr , ' '); do
                [ -n "${HTTP_INPROC:-}" ] && echo "r${r}_inproc:--num-prompts_512_--request-rate_$r"
                echo "r${r}_http:--num-prompts_512_--request-rate_${r}_--http"; done)
        fi
        for run_spec in $runs; do
            name=${run_spec%%:*} flags=${run_spec#*:}
            timeout 400 python3 scripts/bench_serving.py $shape ${flags//_/ } --out "$OUT/http/$name" \
                > "$OUT/http/$name.log" 2>&1
            echo "$stage $name: rc=$? $(tail -1 "$OUT/http/$name.log")"
        done ;;
    external)  # smollm2-135m's shape and tokenizer, random weights (its file is too large to carry):
        # .bench_model from `scripts/random_checkpoint.py --model smollm2-135m --out .bench_model
        # --no-weights`, carried; the weights are made here
        mkdir -p "$OUT/external"
        python3 scripts/random_checkpoint.py --out .bench_model > "$OUT/external/checkpoint.log" 2>&1
        serve="--cache-policy prefix --max-model-len 2048 --warmup full"
        timeout 280 bash scripts/bench_external.sh --model .bench_model --tokenizer .bench_model \
            --isl 512 --osl 128 --concurrency 16 --requests 256 --warmup 16 --serve-args "$serve" \
            --out "$OUT/external/aiperf" > "$OUT/external/aiperf.log" 2>&1
        echo "aiperf: rc=$? $(tail -1 "$OUT/external/aiperf.log")"
        timeout 280 python3 scripts/bench_serving.py --model .bench_model --dataset fixed --input-len 512 \
            --output-len 128 --num-prompts 256 --max-concurrency 16 --policy prefix --http \
            --out "$OUT/external/bench_serving" > "$OUT/external/bench_serving.log" 2>&1
        echo "bench_serving: rc=$? $(tail -1 "$OUT/external/bench_serving.log")" ;;
    structured)
        python3 scripts/random_checkpoint.py --out .bench_model > "$OUT/structured_checkpoint.log" 2>&1
        run 500 structured.log python3 scripts/bench_structured.py --model .bench_model --batches 64,256 \
            --context 1024 --kv-cache-bytes 16e9 --out "$OUT/structured.json"
        tail -3 "$OUT/structured.log" ;;
    hardening)
        run 240 hardening.log python3 -m pytest -q tests/test_deterministic.py tests/test_isolation.py ;;
    engine | det)
        [ "$stage" = det ] && name=engine_det args=--deterministic || name=engine args=
        run 200 $name.log python3 scripts/bench_engine.py --batches 1,16,64 --steps ${ENGINE_STEPS:-12} $args \
            --out "$OUT/$name.json"
        python3 - "$OUT/$name.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
for d in r["decode"]:
    print(f"B={d['batch']} step {d['step_ms']:.2f} ms = {d['ratio']:.2f}x roofline, host "
          f"{d['host_share'] * 100:.1f}%, dispatch {d['dispatch_share'] * 100:.0f}%")
print("prefill", r.get("prefill"), "copy GB/s", round(r["copy_bandwidth_GBps"]))
PY
        ;;
    tp)
        run 400 tp_tests.log python3 -m pytest -q tests/test_tensor_parallel.py
        mkdir -p "$OUT/tp"
        for tp in $(echo "${TP_SIZES:-1,2}" | tr , ' '); do
            run 300 tp/engine_tp$tp.log python3 scripts/bench_engine.py --model llama3-8b-random \
                --batches 64 --context 2048 --prefill-tokens 8192 --steps ${ENGINE_STEPS:-12} \
                --tensor-parallel-size $tp --out "$OUT/tp/engine_tp$tp.json"
        done ;;
    tp70)
        policies=${WF_POLICIES:-prefix,forkkv,forkkv+fanout}
        timeout 580 python3 scripts/bench_workflows.py --model llama3.1-70b-random \
            --tensor-parallel-size "${TP:-2}" --pattern react --sweep "${WF_COUNTS:-16,32}" --obs 64 \
            --context 4096 --gen 64 --total "${WF_TOTAL:-3x}" --policy "$policies" \
            --out "$OUT/tp70_tp${TP:-2}" > "$OUT/tp70_tp${TP:-2}.log" 2>&1
        echo "bench_workflows tp70: rc=$?"
        tr '\r' '\n' < "$OUT/tp70_tp${TP:-2}.log" | grep -E "^react|Error" ;;
    kvw)
        run 120 kvw_tests.log python3 -m pytest -q tests/test_kv_write.py ;;
    agents5)
        name=agents5${WF_HTTP:+_http}
        timeout 580 python3 scripts/bench_workflows.py --pattern react --agents 5 --rounds 3 \
            --context 8192 --gen 96 --obs 128 --tool-latency 0.5 --workflows 8 --total 16 \
            --host-kv-bytes 64e9 --policy "${WF_POLICIES:-prefix,forkkv+fanout}" ${WF_HTTP:+--http} \
            --out "$OUT/$name" > "$OUT/$name.log" 2>&1
        echo "bench_workflows $name: rc=$?"
        tr '\r' '\n' < "$OUT/$name.log" | grep -E "^react|Error" ;;
    react | mapreduce | parallel)
        policies=${WF_POLICIES:-prefix,full_reuse,forkkv,lrshared,forkkv+fanout}
        [ "$stage" = react ] && shape="--sweep ${WF_COUNTS:-4,16,32} --obs 64" \
            || shape="--sweep ${WF_COUNTS:-16}"
        name=$stage${WF_HOST:+_host}${WF_TOOL:+_tool$WF_TOOL}${WF_DISTINCT:+_distinct}${WF_MAX_LORAS:+_slots$WF_MAX_LORAS}${WF_HTTP:+_http}
        timeout 580 python3 scripts/bench_workflows.py --pattern "$stage" $shape --context 4096 \
            --gen 64 --total "${WF_TOTAL:-3x}" --policy "$policies" --out "$OUT/$name" \
            ${WF_HOST:+--host-kv-bytes $WF_HOST} ${WF_TOOL:+--tool-latency $WF_TOOL} ${WF_DISTINCT:+--distinct-agents} \
            ${WF_MAX_LORAS:+--max-loras $WF_MAX_LORAS} ${WF_HTTP:+--http} \
            > "$OUT/$name.log" 2>&1
        echo "bench_workflows $name: rc=$?"
        tr '\r' '\n' < "$OUT/$name.log" | grep -E "^$stage|Error" ;;
    wheels) ;;  # installed above, whenever .whl/ is carried
    old)
        mkdir -p "$OUT/old"
        [ -d .whl ] && mkdir -p .old/.whl && cp .whl/*.whl .old/.whl/
        (cd .old && OUT="$OUT/old" FORKJAX_COMMIT="${OLD_COMMIT:-old}" \
            bash scripts/gpu_check.sh $(echo "${OLD_STAGES:-wheels,http}" | tr , ' '))
        tar -czf "$OUT/old.tgz" -C "$OUT" old && rm -rf "$OUT/old" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
    esac
done
