set -u
export PYTHONPATH=.
bash scripts/gpu_check.sh engine
CB="--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN --xla_gpu_graph_min_graph_size=1"
i=0
for f in "$CB" ""; do
  i=$((i+1))
  XLA_FLAGS="$f" timeout 140 python3 scripts/bench_engine.py --batches 64 --steps 12 --prefill-tokens 2048 --out $OUT/c_$i.json > $OUT/c_$i.log 2>&1
  echo "[${f:0:30}] rc=$?"; python3 -c "
import json; r=json.load(open('$OUT/c_$i.json'))
for d in r['decode']: print('B', d['batch'], 'step', round(d['step_ms'],3), 'ratio', round(d['ratio'],3), {k: round(v,2) for k,v in d['per_step_ms'].items()})
" 2>&1 | tail -1
done
