set -u
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
bash tools/gpu_check.sh all > $OUT/check.log 2>&1
tail -32 $OUT/check.log
export PYTHONPATH=/tmp/site
timeout 150 python3 tools/nccl_op_cost.py > $OUT/op-cost.log 2>&1
grep "rank" $OUT/op-cost.log | cut -c1-400
