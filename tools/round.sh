export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 JAXGIN_CACHE_DIR=/tmp/jaxgin-cache
python3 -m pip install -q --no-build-isolation --no-deps -e . > $OUT/install.log 2>&1 || tail -20 $OUT/install.log
python3 tools/diag_graphs.py 2>&1 | grep -v "^W0000\|^I0000" | tail -5
ls $OUT/dump | grep -i "after_optimizations.txt" | head
f=$(ls $OUT/dump/*jit_body*after_optimizations.txt | head -1); grep -n "command_buffer\|custom_call_target" $f | head -20
rm -rf $OUT/dump/*.pb $OUT/dump/*before*
