#!/bin/bash
# issue 30: an old tree against a new one (e.g. 4b2dfd3, before issue 30, against main), bench_peers at GPT-2-small shape, stages 0-3,
# interleaved runs old/new/old/new; each run has DDP as its own baseline (ratios paired within a run)
OLD=${1:?old tree}; NEW=${2:?new tree}; PY=${PY:-$(pwd)/.venv/bin/python}
for r in 1 2; do
  for t in old new; do
    d=$OLD; [ $t = new ] && d=$NEW
    echo "### round $r tree $t ($(git -C $d log --oneline -1 | cut -c1-60)) $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
    (cd $d && PYTHONPATH=$d/src timeout 900 $PY benchmarks/bench_peers.py --sizes gpt2-small --parts gas1 --micro-batch 1 \
       --warmup 1 --steps 2 --repeat 1 --only "zerospeed stage 0" "zerospeed stage 1" "zerospeed stage 2" "zerospeed stage 3" 2>&1 | grep -v "^$")
  done
done
