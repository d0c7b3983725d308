#!/usr/bin/env bash
# The memory model against the meter: every plan shape the planner can choose
# (--plans candidates) on the bundled and Hugging Face workloads, 4 ranks, and the two
# GPT lists the guide quotes (with offload and longer micro-batch counts). Memory does not
# depend on the machine's load, so these may run beside other work; about 15 minutes.
set -euo pipefail
PLAIT=${PLAIT:-plait}
OUT=${OUT:-benchmarks/parallel}
mem() {  # WORKLOAD PLANS DIR
    "$PLAIT" run --nodes 4 -m -- plait.bench.membench --workload "$1" --plans "$2" --out "$3"
}
mem gpt 'dp=4;dp=4,zero=1;dp=4,zero=2;dp=4,zero=3;dp=4,zero=3,offload=true;dp=4,zero=3,ac=true;dp=2,tp=2;dp=2,tp=2,sp=true;dp=2,tp=2,zero=3;tp=2,pp=2;pp=4;pp=4,microbatches=16;pp=4,ac=true;dp=2,pp=2;dp=2,pp=2,zero=3;dp=2,pp=2,schedule=interleaved' "$OUT"
mem gpt 'dp=2,pp=2,zero=2,schedule=zero-bubble,microbatches=2;dp=2,pp=2,schedule=zero-bubble,microbatches=2;dp=2,pp=2,zero=1,schedule=zero-bubble,microbatches=2;dp=2,pp=2,zero=2,microbatches=4;dp=2,pp=2,zero=1,microbatches=4;tp=2,pp=2,sp=true,microbatches=4;dp=2,pp=2,zero=2,schedule=gpipe,microbatches=2;dp=2,pp=2,schedule=gpipe,microbatches=2;tp=2,pp=2,sp=true,schedule=gpipe,microbatches=2;pp=4,schedule=gpipe,microbatches=4' "$OUT/memory-shortlist"
for w in mlp gpt resnet18 vgg; do
    mem "$w" candidates "$OUT/memory-candidates/$w"
done
for w in gpt2 llama bert resnet18; do
    mem "examples/transformers_workloads.py:$w" candidates "$OUT/memory-candidates/hf-$w"
done
