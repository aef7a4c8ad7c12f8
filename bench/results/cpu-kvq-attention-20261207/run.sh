cd /work/main
for i in 1 2; do for t in /tmp/old /work/main; do for kv in int8 fp8_e4m3; do
  (cd $t && PYTHONPATH=$t /work/main/.venv/bin/python bench/cpu_step_ab.py $(basename $t) none float32 $kv 2>&1 | grep RESULT)
done; done; done
