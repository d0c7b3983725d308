#!/usr/bin/env bash
# The time-to-accuracy races of benchmarks/RESULTS.md ("Time to accuracy"), one command
# each, in the order they were run. Learning rates were tuned first on seeds 10-12 (not the
# races' seeds 0-2): see the `tune-*` races below. Run one race: `benchmarks/race/run.sh NAME`;
# all: `make race`.
set -euo pipefail
cd "$(dirname "$0")/../.."
PLAIT=${PLAIT:-.venv/bin/plait}
OUT=${OUT:-benchmarks/race}

KFAC="spd-kfac:factor_interval=auto,inv_interval=auto"
KFAC_ACP="spd-kfac:compression=acpsgd,rank=4,factor_interval=auto,inv_interval=auto"
KFAC_ACP16="spd-kfac:compression=acpsgd,rank=16,factor_interval=auto,inv_interval=auto"
# K-FAC as tuned by tune-kfac-digits-cnn: reduce factors, a 10x looser KL clip, damping 0.01
TUNED="kl_clip=0.01,approximation=reduce,damping=0.01"

race() {  # NAME ARGS...
    local name=$1
    shift
    echo "== $name" >&2
    "$PLAIT" race --no-progress --out "$OUT/$name" "$@"
}

tune-digits-cnn() {
    race tune-digits-cnn --workload digits-cnn --target 0.97 --nodes 4 --bandwidth fast \
        --seeds 10,11,12 --max-steps 600 --eval-every 5 \
        --strategies "ssgd+sgd@0.05;ssgd+sgd@0.1;ssgd+sgd@0.2;ssgd+adamw@0.003;ssgd+adamw@0.01;ssgd+adamw@0.03;ssgd+muon@0.01;ssgd+muon@0.03;ssgd+muon@0.1;$KFAC+sgd@0.01;$KFAC+sgd@0.02;$KFAC+sgd@0.05;$KFAC_ACP+sgd@0.01;$KFAC_ACP+sgd@0.02;$KFAC_ACP+sgd@0.05"
}

tune-kfac-digits-cnn() {  # K-FAC's approximation, KL clip and damping, after tune-digits-cnn
    race tune-kfac-digits-cnn --workload digits-cnn --target 0.97 --nodes 4 --bandwidth fast \
        --seeds 10,11,12 --max-steps 400 --eval-every 5 \
        --strategies "ssgd+adamw@0.01;$KFAC+sgd@0.02;$KFAC,kl_clip=0.01+sgd@0.02;$KFAC,kl_clip=0.01,approximation=reduce+sgd@0.02;$KFAC,$TUNED+sgd@0.01;$KFAC,$TUNED+sgd@0.02;$KFAC,$TUNED+sgd@0.05;$KFAC_ACP,$TUNED+sgd@0.01;$KFAC_ACP,$TUNED+sgd@0.02"
}

optimizers-digits-cnn() {  # BANDWIDTH
    race "optimizers-digits-cnn-$1" --workload digits-cnn --target 0.97 --nodes 4 \
        --bandwidth "$1" --max-steps 600 --eval-every 5 \
        --strategies "ssgd+sgd@0.1;ssgd+adamw@0.01;ssgd+muon@0.01;$KFAC+sgd@0.02;$KFAC,$TUNED+sgd@0.02;$KFAC_ACP,$TUNED+sgd@0.01"
}

kfac-budget-digits-cnn() {  # BANDWIDTH: K-FAC's overhead budget (auto_overhead) 0.1-0.5
    race "kfac-budget-digits-cnn-$1" --workload digits-cnn --target 0.97 --nodes 4 \
        --bandwidth "$1" --max-steps 600 --eval-every 5 \
        --strategies "ssgd+adamw@0.01;$KFAC,auto_overhead=0.1+sgd@0.02;$KFAC+sgd@0.02;$KFAC,auto_overhead=0.5+sgd@0.02"
}

kfac-budget-tuned-digits-cnn() {  # BANDWIDTH: tuned K-FAC's overhead budget 0.1-0.5
    race "kfac-budget-tuned-digits-cnn-$1" --workload digits-cnn --target 0.97 --nodes 4 \
        --bandwidth "$1" --max-steps 600 --eval-every 5 \
        --strategies "ssgd+adamw@0.01;$KFAC,$TUNED,auto_overhead=0.1+sgd@0.02;$KFAC,$TUNED+sgd@0.02;$KFAC,$TUNED,auto_overhead=0.5+sgd@0.02"
}

compressors-digits-cnn() {  # BANDWIDTH
    race "compressors-digits-cnn-$1" --workload digits-cnn --target 0.97 --nodes 4 \
        --bandwidth "$1" --max-steps 600 --eval-every 5 --optimizer sgd --lr 0.1 \
        --strategies "ssgd;fp16;powersgd:rank=2;powersgd:rank=4;torch-powersgd:rank=2;torch-powersgd:rank=4;acpsgd:rank=2;acpsgd:rank=4"
}

compressors-gpt() {  # BANDWIDTH
    # rank 16: the GPT's fidelity benchmark found rank 4 2.6 points behind S-SGD after an
    # epoch and rank 16 level with it; AdamW at the workload's default rate, for every entry
    race "compressors-gpt-$1" --workload gpt --metric loss --target 2.6 --nodes 4 \
        --bandwidth "$1" --max-steps 150 --eval-every 10 --optimizer adamw --lr 0.001 \
        --strategies "ssgd;fp16;powersgd:rank=16;torch-powersgd:rank=16;acpsgd:rank=16"
}

tune-gpt() {  # the GPT's rates: one seed (10, not a race seed), 120 steps, two races
    # (run with --out under /tmp and copied here: their Command lines name those paths)
    race tune-gpt-1 --workload gpt --metric loss --target 2.6 --nodes 4 --bandwidth fast \
        --seeds 10 --max-steps 120 --eval-every 10 \
        --strategies "ssgd+adamw@0.001;ssgd+adamw@0.003;ssgd+muon@0.003;ssgd+muon@0.01;$KFAC,$TUNED+sgd@0.02;$KFAC,$TUNED+sgd@0.1"
    race tune-gpt-2 --workload gpt --metric loss --target 2.6 --nodes 4 --bandwidth fast \
        --seeds 10 --max-steps 120 --eval-every 10 \
        --strategies "ssgd+sgd@0.1;ssgd+sgd@0.3;ssgd+sgd@1.0;$KFAC,$TUNED+sgd@0.3;$KFAC_ACP16,$TUNED+sgd@0.1"
}

optimizers-gpt() {  # BANDWIDTH [SGD]: SGD only where asked (it misses the target at fast);
    # at slow also K-FAC/ACP-SGD sending its factors in bf16 (half the round's bytes)
    local sgd="" bf16=""
    if [[ "${2:-}" == "sgd" ]]; then sgd="ssgd+sgd@0.1;"; fi
    if [[ "$1" == "slow" ]]; then bf16=";$KFAC_ACP16,$TUNED,comm_dtype=bf16+sgd@0.1"; fi
    race "optimizers-gpt-$1" --workload gpt --metric loss --target 2.6 --nodes 4 \
        --bandwidth "$1" --max-steps 100 --eval-every 10 \
        --strategies "${sgd}ssgd+adamw@0.001;ssgd+muon@0.01;$KFAC,$TUNED+sgd@0.1;$KFAC_ACP16,$TUNED+sgd@0.1$bf16"
}

# The compressor races again under the protocol that makes a verdict (five seeds, a
# bootstrap interval on every ratio, pinned CPU kernels; the digits CNN to a held-out loss
# instead of an accuracy decided by one or two of 360 samples), beside the 3-seed tables.
# ACP-SGD now warms up two dense steps by default: its entry without them is kept too.
compressors-digits-cnn-5seeds() {  # BANDWIDTH
    race "compressors-digits-cnn-$1-5seeds" --workload digits-cnn --metric loss --target 0.1 \
        --nodes 4 --bandwidth "$1" --max-steps 600 --eval-every 5 --optimizer sgd --lr 0.1 \
        --strategies "ssgd;fp16;powersgd:rank=2;powersgd:rank=4;torch-powersgd:rank=2;torch-powersgd:rank=4;acpsgd:rank=2,warmup=0;acpsgd:rank=4,warmup=0;acpsgd:rank=2;acpsgd:rank=4" \
        --compare "acpsgd:rank=4+sgd/torch-powersgd:rank=4+sgd;acpsgd:rank=4+sgd/powersgd:rank=4+sgd"
}

compressors-gpt-5seeds() {  # BANDWIDTH
    race "compressors-gpt-$1-5seeds" --workload gpt --metric loss --target 2.6 --nodes 4 \
        --bandwidth "$1" --max-steps 150 --eval-every 10 --optimizer adamw --lr 0.001 \
        --strategies "ssgd;fp16;powersgd:rank=16;torch-powersgd:rank=16;acpsgd:rank=16,warmup=0;acpsgd:rank=16;acpsgd:rank=32" \
        --compare "acpsgd:rank=16+adamw/torch-powersgd:rank=16+adamw;acpsgd:rank=32+adamw/torch-powersgd:rank=16+adamw;acpsgd:rank=16+adamw/acpsgd:rank=16,warmup=0+adamw"
}

# ------------------------------------------------------------------ second order
# K-FAC's eigenbasis modes (EKFAC; SOAP: Adam in the factors' eigenbasis, its moments its
# own, so plain SGD applies its step) against AdamW, torch's Muon and heavyball's SOAP
# (`pip install '.[bench]'`, its step uncompiled), on the GPT. The new entries' rates are
# tuned first on seed 10 (not a race seed), two rates each with the same step budget,
# beside Muon at its rate for reference; AdamW, Muon and K-FAC keep the rates tune-gpt-*
# chose.
EKFAC="spd-kfac:mode=ekfac,approximation=reduce,kl_clip=0.01,damping=0.01"
# The SOAP mode updates its factors every 5th step by default since 3f3b4e4; every race of
# it committed before then ran at every step: append ,factor_interval=1 to reproduce one.
SOAP="spd-kfac:mode=soap,approximation=reduce"

tune-second-order-gpt() {
    race tune-second-order-gpt --workload gpt --metric loss --target 2.6 --nodes 4 \
        --bandwidth fast --seeds 10 --max-steps 100 --eval-every 10 \
        --strategies "ssgd+muon@0.01;ssgd+heavyball-soap@0.001;ssgd+heavyball-soap@0.003;$EKFAC+sgd@0.03;$EKFAC+sgd@0.1;$SOAP+sgd-plain@0.001;$SOAP+sgd-plain@0.003"
}

# The same without torch's Muon and EKFAC, for hosts without native bf16: Muon's
# Newton-Schulz runs in bf16, which an AVX2-only CPU emulates (22 s a step here against
# 1.5 s in the committed optimizer races), and EKFAC missed the target at both tuned rates.
second-order-gpt-no-muon() {  # BANDWIDTH HB_LR SOAP_LR [SEEDS]
    local k="$KFAC,$TUNED+sgd" s="$SOAP+sgd-plain"
    race "second-order-gpt-no-muon-$1" --workload gpt --metric loss --target 2.6 --nodes 4 \
        --bandwidth "$1" --seeds "${4:-0,1,2}" --max-steps 100 --eval-every 10 \
        --strategies "ssgd+adamw@0.001;ssgd+heavyball-soap@$2;$k@0.1;$s@$3" \
        --compare "$s/ssgd+heavyball-soap;$s/ssgd+adamw;$k/ssgd+adamw"
}

second-order-gpt() {  # BANDWIDTH HB_LR EKFAC_LR SOAP_LR [SEEDS]: rates from tune-second-order-gpt
    local k="$KFAC,$TUNED+sgd" e="$EKFAC+sgd" s="$SOAP+sgd-plain"
    race "second-order-gpt-$1" --workload gpt --metric loss --target 2.6 --nodes 4 \
        --bandwidth "$1" --seeds "${5:-0,1,2}" --max-steps 100 --eval-every 10 \
        --strategies "ssgd+adamw@0.001;ssgd+muon@0.01;ssgd+heavyball-soap@$2;$k@0.1;$e@$3;$s@$4" \
        --compare "$e/ssgd+muon;$s/ssgd+muon;$e/ssgd+heavyball-soap;$s/ssgd+heavyball-soap;$k/ssgd+muon"
}

# Muon with its Newton-Schulz iteration in float32 (`muon-fp32`, plait.train.optim.Muon32):
# the same update as torch's Muon up to the rounding of the orthogonalised matrix, at the
# rate tune-gpt-1 chose for Muon (0.01, seed 10), so that a host without bf16 units times
# the method and not the emulation of bf16. Five seeds for a verdict.
second-order-gpt-fp32() {  # BANDWIDTH HB_LR SOAP_LR [SEEDS]
    local k="$KFAC,$TUNED+sgd" s="$SOAP+sgd-plain" m="ssgd+muon-fp32"
    race "second-order-gpt-fp32-$1" --workload gpt --metric loss --target 2.6 --nodes 4 \
        --bandwidth "$1" --seeds "${4:-0,1,2,3,4}" --max-steps 100 --eval-every 10 \
        --strategies "ssgd+adamw@0.001;$m@0.01;ssgd+heavyball-soap@$2;$k@0.1;$s@$3" \
        --compare "$s/$m;$k/$m;$s/ssgd+heavyball-soap;$s/ssgd+adamw;$m/ssgd+adamw"
}

# A third rate for each of the two leaders at `fast` (seed 10, the same budget for both):
# the SOAP mode at 0.001 reached 2.6 at step 20 on three race seeds and at 30 on two
# (held-out loss 2.59-2.60 at step 20: on the edge), Muon (float32) at 0.01 passed it with
# room (2.29-2.37). Muon keeps 0.01 unless 0.03 is faster on seed 10.
# Result (benchmarks/race/tune-second-order-gpt-3): the SOAP mode at 0.002 needed 40 steps
# on seed 10 (0.001: 30, 0.003: 70 in tune-second-order-gpt), so its rate stays 0.001 and
# the 5-seed race was not re-run; Muon at 0.03 reached at 20 steps as at 0.01.
tune-second-order-gpt-3() {
    race tune-second-order-gpt-3 --workload gpt --metric loss --target 2.6 --nodes 4 \
        --bandwidth fast --seeds 10 --max-steps 100 --eval-every 10 \
        --strategies "ssgd+muon-fp32@0.01;ssgd+muon-fp32@0.03;$SOAP+sgd-plain@0.002"
}

# The SOAP mode's own settings against Muon at `fast` (seed 10, evaluated every 5 steps to
# see the crossings): its basis refreshed every 5 or 3 steps instead of 10, and Adam's
# second-moment decay 0.99 instead of 0.95, all at the chosen rate 0.001.
# Result (benchmarks/race/tune-second-order-gpt-4): every variant reached 2.6 at step 25,
# Muon at 15 (loss at step 10: Muon 2.65, the SOAP variants 2.85-2.95); the faster
# refreshes only cost time. Settings kept.
tune-second-order-gpt-4() {
    race tune-second-order-gpt-4 --workload gpt --metric loss --target 2.6 --nodes 4 \
        --bandwidth fast --seeds 10 --max-steps 60 --eval-every 5 \
        --strategies "ssgd+muon-fp32@0.01;$SOAP+sgd-plain@0.001;$SOAP,inv_interval=5+sgd-plain@0.001;$SOAP,beta2=0.99+sgd-plain@0.001;$SOAP,inv_interval=3+sgd-plain@0.001"
}

# How often the SOAP mode updates its factors (its basis refreshed every 10 steps). On the
# tuning seeds (tune-soap-intervals-digits-cnn): every step 1.29x AdamW's time, every 2nd
# 1.33x, every 5th 0.91x, every 5th with the basis every 20th 0.99x. Then five race seeds
# (soap-intervals-digits-cnn-fast) and the GPT's tuning seed (tune-soap-intervals-gpt).
# Result: every 5th step became the mode's default (plait.kfac.config.DEFAULT_INTERVALS).
tune-soap-intervals-digits-cnn() {
    race tune-soap-intervals-digits-cnn --workload digits-cnn --target 0.97 --nodes 4 \
        --bandwidth fast --max-steps 600 --eval-every 5 --seeds 10,11,12 \
        --strategies "ssgd+adamw@0.01;$SOAP+sgd-plain@0.01;$SOAP,factor_interval=2+sgd-plain@0.01;$SOAP,factor_interval=5+sgd-plain@0.01;$SOAP,factor_interval=5,inv_interval=20+sgd-plain@0.01"
}

soap-intervals-digits-cnn-fast() {
    race soap-intervals-digits-cnn-fast --workload digits-cnn --target 0.97 --nodes 4 \
        --bandwidth fast --max-steps 600 --eval-every 5 --seeds 0,1,2,3,4 \
        --strategies "ssgd+adamw@0.01;$SOAP,factor_interval=1+sgd-plain@0.01;$SOAP,factor_interval=5+sgd-plain@0.01"
}

# The same five seeds after SOAP's Adam went to fewer operators and the norms' Adam to
# torch's multi-tensor operators (ca7fce7): the eigenbasis step against AdamW's.
# Result: 20.5 against 16.2 ms a step, 1.27x (was 1.32x); time to 97% 1.13x AdamW's.
soap-step-digits-cnn-fast() {
    race soap-step-digits-cnn-fast --workload digits-cnn --target 0.97 --nodes 4 \
        --bandwidth fast --max-steps 600 --eval-every 5 --seeds 0,1,2,3,4 \
        --strategies "ssgd+adamw@0.01;$SOAP+sgd-plain@0.01"
}

tune-soap-intervals-gpt() {
    race tune-soap-intervals-gpt --workload gpt --metric loss --target 2.6 --nodes 4 \
        --bandwidth fast --seeds 10 --max-steps 60 --eval-every 5 \
        --strategies "ssgd+adamw@0.001;$SOAP,factor_interval=1+sgd-plain@0.001;$SOAP,factor_interval=5+sgd-plain@0.001"
}

# The SOAP mode against Muon alone (float32 Newton-Schulz), for the slow link where a
# five-entry race takes about an hour here.
second-order-gpt-muon() {  # BANDWIDTH SOAP_LR [SEEDS]
    local s="$SOAP+sgd-plain" m="ssgd+muon-fp32"
    race "second-order-gpt-muon-$1" --workload gpt --metric loss --target 2.6 --nodes 4 \
        --bandwidth "$1" --seeds "${3:-0,1,2}" --max-steps 100 --eval-every 10 \
        --strategies "$m@0.01;$s@$2" --compare "$s/$m"
}

# The slow link with a compressed wire on both sides: at `slow` the SOAP mode's step
# carries its factors on top of the gradient (26.2 MB a step against Muon's 19.5 MB in
# second-order-gpt-muon-slow-2), so it sends its factors in bf16 and its gradients through
# plait's compressors (ACP-SGD at rank 16, or an fp16 cast), and Muon gets what a user of
# DDP would reach for on a slow link (torch's Power-SGD hook at rank 16, or an fp16 cast).
# Each entry at the rate its uncompressed twin was tuned to, first on seed 10 at `fast`
# (the steps do not depend on the link).
SOAP_BF16="$SOAP,comm_dtype=bf16"
SOAP_ACP="$SOAP_BF16,compression=acpsgd,rank=16"
SOAP_FP16="$SOAP_BF16,compression=fp16"
tune-second-order-gpt-wire() {
    race tune-second-order-gpt-wire --workload gpt --metric loss --target 2.6 --nodes 4 \
        --bandwidth fast --seeds 10 --max-steps 60 --eval-every 10 \
        --strategies "ssgd+muon-fp32@0.01;torch-powersgd:rank=16+muon-fp32@0.01;fp16+muon-fp32@0.01;$SOAP_BF16+sgd-plain@0.001;$SOAP_ACP+sgd-plain@0.001;$SOAP_FP16+sgd-plain@0.001"
}

# Result (tune-second-order-gpt-wire): every Muon entry 20 steps on seed 10, the SOAP mode
# 20 with its factors in bf16 (with or without an fp16 gradient) and 30 with ACP-SGD's
# gradient; the rates stay. Then the race at `slow` (three seeds).
second-order-gpt-wire() {  # BANDWIDTH [SEEDS]
    local s="+sgd-plain" m="+muon-fp32"
    race "second-order-gpt-wire-$1" --workload gpt --metric loss --target 2.6 --nodes 4 \
        --bandwidth "$1" --seeds "${2:-0,1,2}" --max-steps 60 --eval-every 10 \
        --strategies "ssgd$m@0.01;fp16$m@0.01;torch-powersgd:rank=16$m@0.01;$SOAP_FP16$s@0.001;$SOAP_ACP$s@0.001" \
        --compare "$SOAP_FP16$s/ssgd$m;$SOAP_FP16$s/fp16$m;$SOAP_FP16$s/torch-powersgd:rank=16$m;$SOAP_ACP$s/torch-powersgd:rank=16$m;$SOAP_ACP$s/ssgd$m"
}

# Result (second-order-gpt-wire-slow): the SOAP mode took 30 steps on every seed, Muon 20;
# with ACP-SGD's gradient 1.10x Muon's time on S-SGD, 1.81x Muon on torch's Power-SGD hook.
# Where Muon gains is the first steps, and Muon's recipe gives the parameters it does not
# orthogonalise (norms, biases) AdamW at its own rate, ten times SOAP's: the SOAP mode's
# parameters outside the layers at 3x and 10x its rate (`rest_lr_scale`), seed 10, `fast`.
tune-soap-rest-gpt() {
    race tune-soap-rest-gpt --workload gpt --metric loss --target 2.6 --nodes 4 \
        --bandwidth fast --seeds 10 --max-steps 40 --eval-every 5 \
        --strategies "ssgd+muon-fp32@0.01;$SOAP+sgd-plain@0.001;$SOAP,rest_lr_scale=3+sgd-plain@0.001;$SOAP,rest_lr_scale=10+sgd-plain@0.001"
}

# Result (tune-soap-rest-gpt): 2.6 at step 20 with the norms at 3x or 10x (held-out loss
# 2.583, 2.529), at 25 without (2.603 at step 20); Muon at 15. Then the matrices' rate
# raised with the norms kept at Muon's rate (0.01):
tune-soap-rest-gpt-2() {
    race tune-soap-rest-gpt-2 --workload gpt --metric loss --target 2.6 --nodes 4 \
        --bandwidth fast --seeds 10 --max-steps 40 --eval-every 5 \
        --strategies "$SOAP,rest_lr_scale=10+sgd-plain@0.001;$SOAP,rest_lr_scale=6.67+sgd-plain@0.0015;$SOAP,rest_lr_scale=5+sgd-plain@0.002"
}

# Result (tune-soap-rest-gpt-2): the norms at Muon's rate with the matrices at 0.0015 took
# 20 steps (2.563), at 0.002 25: the matrices stay at 0.001, the norms at 10x.
# The races with it: at `fast` five seeds against Muon; at `slow` three seeds against Muon
# on S-SGD and on torch's Power-SGD hook and against heavyball's SOAP, the SOAP mode on
# S-SGD and on the compressed wire (ACP-SGD rank 16, factors in bf16).
SOAP_REST="$SOAP,rest_lr_scale=10"
# Result: `fast` 0.85x [0.81-1.29] Muon (20 steps on four seeds of five); `slow` 1.23x Muon,
# 0.78x heavyball's SOAP, over ACP-SGD 1.08x Muon (30 steps) and 1.84x Muon on Power-SGD.
# Eight seeds at `fast` into second-order-gpt-rest-fast-8:
# `SUFFIX=-8 run.sh second-order-gpt-rest fast 0,1,2,3,4,5,6,7`.
# Result: 0.85x [0.83-0.87] Muon, `faster` (20 steps on seven seeds of eight).
second-order-gpt-rest() {  # BANDWIDTH [SEEDS]
    local s="+sgd-plain@0.001" m="+muon-fp32@0.01" acp="$SOAP_REST,comm_dtype=bf16,compression=acpsgd,rank=16"
    local entries="ssgd$m;$SOAP_REST$s" compare="$SOAP_REST+sgd-plain/ssgd+muon-fp32"
    if [[ "$1" == "slow" ]]; then
        entries+=";torch-powersgd:rank=16$m;ssgd+heavyball-soap@0.003;$acp$s"
        compare+=";$acp+sgd-plain/ssgd+muon-fp32;$acp+sgd-plain/torch-powersgd:rank=16+muon-fp32"
        compare+=";$SOAP_REST+sgd-plain/ssgd+heavyball-soap;$acp+sgd-plain/ssgd+heavyball-soap"
    fi
    race "second-order-gpt-rest-$1${SUFFIX:-}" --workload gpt --metric loss --target 2.6 --nodes 4 \
        --bandwidth "$1" --seeds "${2:-0,1,2}" --max-steps 60 --eval-every 10 \
        --strategies "$entries" --compare "$compare"
}

# With the norms at 10x, the SOAP mode at `slow` reaches 2.6 in 20 steps on every seed but
# its factors make its step dearer than Muon's (3.84 against 3.12 s). An fp16 gradient and
# bf16 factors halve its bytes (14.8 against 26.2 MB a step in second-order-gpt-wire-slow,
# where without the norms' scale it took 30 steps); Muon beside it on S-SGD and on the
# same fp16 gradient.
# Result (five seeds at `slow`): 20 steps on every seed, 1.02x [0.92-1.03] Muon on S-SGD,
# 1.38x Muon on the fp16 gradient: its step (3.36 s) costs more than its 15.9 MB say.
second-order-gpt-rest-fp16() {  # BANDWIDTH [SEEDS]
    local s="$SOAP_REST,comm_dtype=bf16,compression=fp16+sgd-plain" m="+muon-fp32"
    race "second-order-gpt-rest-fp16-$1" --workload gpt --metric loss --target 2.6 --nodes 4 \
        --bandwidth "$1" --seeds "${2:-0,1,2}" --max-steps 60 --eval-every 10 \
        --strategies "ssgd$m@0.01;fp16$m@0.01;$s@0.001" \
        --compare "$s/ssgd$m;$s/fp16$m"
}

# Every worker its own block (distribution=hybrid, grad_workers=1): each decomposes every
# factor itself, so no eigenbasis crosses the slow link (three seeds, Muon on S-SGD beside).
# Result: worse, 1.21x Muon (24.4 MB and 4.13 s a step: every factor all-reduced to all).
second-order-gpt-rest-local() {  # BANDWIDTH [SEEDS]
    local s="$SOAP_REST,comm_dtype=bf16,compression=fp16,distribution=hybrid,grad_workers=1+sgd-plain"
    race "second-order-gpt-rest-local-$1" --workload gpt --metric loss --target 2.6 --nodes 4 \
        --bandwidth "$1" --seeds "${2:-0,1,2}" --max-steps 60 --eval-every 10 \
        --strategies "ssgd+muon-fp32@0.01;$s@0.001" --compare "$s/ssgd+muon-fp32"
}

# The eigenbases' broadcasts halved: the basis refreshed every 20th step instead of 10th
# (three seeds at `slow`, over the fp16 gradient with bf16 factors, Muon on S-SGD beside).
# Result: 20 steps on every seed at 2.67 s (12.3 MB): 0.82x [0.80-0.87] Muon on S-SGD.
second-order-gpt-rest-refresh() {  # BANDWIDTH [SEEDS]
    local s="$SOAP_REST,comm_dtype=bf16,compression=fp16,inv_interval=20+sgd-plain"
    race "second-order-gpt-rest-refresh-$1" --workload gpt --metric loss --target 2.6 \
        --nodes 4 --bandwidth "$1" --seeds "${2:-0,1,2}" --max-steps 60 --eval-every 10 \
        --strategies "ssgd+muon-fp32@0.01;$s@0.001" --compare "$s/ssgd+muon-fp32"
}

# The same basis every 20th step for a verdict (five seeds at `slow`), with Muon beside it
# on every wire its user would pick there: S-SGD, the same fp16 gradient, torch's Power-SGD.
# Result: 20 steps for every entry on every seed; 0.82x [0.80-0.85] Muon on S-SGD, `faster`;
# 1.10x Muon on the fp16 gradient and 1.32x Muon on Power-SGD, both `slower`.
second-order-gpt-refresh-wire() {  # BANDWIDTH [SEEDS]
    local s="$SOAP_REST,comm_dtype=bf16,compression=fp16,inv_interval=20+sgd-plain" m="+muon-fp32"
    race "second-order-gpt-refresh-wire-$1" --workload gpt --metric loss --target 2.6 \
        --nodes 4 --bandwidth "$1" --seeds "${2:-0,1,2,3,4}" --max-steps 60 --eval-every 10 \
        --strategies "ssgd$m@0.01;fp16$m@0.01;torch-powersgd:rank=16$m@0.01;$s@0.001" \
        --compare "$s/ssgd$m;$s/fp16$m;$s/torch-powersgd:rank=16$m"
}

# Tuned K-FAC on the digits CNN pays 40-60 ms a step in its first 25 (the "auto" rule's
# probe, factors every step) against 30 ms after it and AdamW's 23 ms: fixed intervals from
# the first step instead, on the tuning seeds.
tune-kfac-intervals-digits-cnn() {
    local k="spd-kfac:$TUNED"
    race tune-kfac-intervals-digits-cnn --workload digits-cnn --target 0.97 --nodes 4 \
        --bandwidth fast --seeds 10,11,12 --max-steps 400 --eval-every 5 \
        --strategies "ssgd+adamw@0.01;$KFAC,$TUNED+sgd@0.02;$k,factor_interval=1,inv_interval=4+sgd@0.02;$k,factor_interval=2,inv_interval=4+sgd@0.02;$k,factor_interval=4,inv_interval=4+sgd@0.02;$k,factor_interval=4,inv_interval=8+sgd@0.02"
}

# Result (tune-kfac-intervals-digits-cnn, medians of seeds 10-12 against AdamW): "auto"
# 1.17x (60 steps), every 1/4 1.04x, 2/4 0.70x (40 steps), 4/4 0.86x, 4/8 0.72x (50 steps,
# 25.6 ms a step against AdamW's 19.7). The two best on the five race seeds:
# Result: at 561e3e4 every 4th/8th 0.77x AdamW, 2nd/4th 0.79x (`faster`); after the K-FAC
# step's operator cuts (`SUFFIX=-2` at 5ee957c: 0.72x; `-3` and `-4` at d76880b) every
# 4th/8th 0.65x [0.34-0.94] and 0.66x [0.35-0.93], `faster` in both (50 steps, 24 ms).
kfac-intervals-digits-cnn() {  # BANDWIDTH [SEEDS]
    local k="spd-kfac:$TUNED" a="ssgd+adamw"
    race "kfac-intervals-digits-cnn-$1${SUFFIX:-}" --workload digits-cnn --target 0.97 --nodes 4 \
        --bandwidth "$1" --seeds "${2:-0,1,2,3,4}" --max-steps 600 --eval-every 5 \
        --strategies "$a@0.01;$KFAC,$TUNED+sgd@0.02;$k,factor_interval=2,inv_interval=4+sgd@0.02;$k,factor_interval=4,inv_interval=8+sgd@0.02" \
        --compare "$KFAC,$TUNED+sgd/$a;$k,factor_interval=2,inv_interval=4+sgd/$a;$k,factor_interval=4,inv_interval=8+sgd/$a"
}

# A Hugging Face model from a config: transformers' GPT-2 (2 layers of 32, its Conv1D
# layers; character-level pydoc topics, examples/transformers_workloads.py). Rates tuned on
# seed 10 at `fast`, run to the budget to pick a target from the curves.
HF_GPT2=examples/transformers_workloads.py:gpt2
tune-second-order-hf-gpt2() {
    race tune-second-order-hf-gpt2 --workload "$HF_GPT2" --metric loss --target 0.1 \
        --nodes 4 --bandwidth fast --seeds 10 --max-steps 200 --eval-every 10 --full-budget \
        --strategies "ssgd+sgd@0.1;ssgd+sgd@0.3;ssgd+adamw@0.003;ssgd+adamw@0.01;ssgd+muon-fp32@0.01;ssgd+muon-fp32@0.03;ssgd+heavyball-soap@0.003;ssgd+heavyball-soap@0.01;$KFAC,$TUNED+sgd@0.02;$KFAC,$TUNED+sgd@0.1;$SOAP_REST+sgd-plain@0.001;$SOAP_REST+sgd-plain@0.003;$SOAP_REST+sgd-plain@0.01"
}

# Result (tune-second-order-hf-gpt2): every leader's rate at its grid's edge (Muon 0.03,
# heavyball 0.01, the SOAP mode 0.01, K-FAC 0.1 the largest; AdamW 0.003 the smallest);
# Muon ahead (2.49 at step 20, 2.13 at 80), the SOAP mode next (2.74, 2.28). One step
# beyond each edge:
tune-second-order-hf-gpt2-edges() {
    race tune-second-order-hf-gpt2-edges --workload "$HF_GPT2" --metric loss --target 0.1 \
        --nodes 4 --bandwidth fast --seeds 10 --max-steps 200 --eval-every 10 --full-budget \
        --strategies "ssgd+adamw@0.001;ssgd+muon-fp32@0.1;ssgd+heavyball-soap@0.03;$KFAC,$TUNED+sgd@0.3;$SOAP_REST+sgd-plain@0.03"
}

# Result (tune-second-order-hf-gpt2-edges): heavyball better at 0.03 (2.30 at step 40),
# every other rate stays (AdamW 0.003, Muon 0.03, K-FAC 0.1, the SOAP mode 0.01). The race
# on seeds 0-2 to held-out loss 2.4 (Muon about 30 steps on seed 10, the SOAP mode 60):
second-order-hf-gpt2() {  # BANDWIDTH [SEEDS]
    local s="$SOAP_REST+sgd-plain" k="$KFAC,$TUNED+sgd"
    race "second-order-hf-gpt2-$1" --workload "$HF_GPT2" --metric loss --target 2.4 \
        --nodes 4 --bandwidth "$1" --seeds "${2:-0,1,2}" --max-steps 300 --eval-every 10 \
        --strategies "ssgd+sgd@0.3;ssgd+adamw@0.003;ssgd+muon-fp32@0.03;ssgd+heavyball-soap@0.03;$k@0.1;$s@0.01" \
        --compare "$s/ssgd+muon-fp32;$s/ssgd+heavyball-soap;$s/ssgd+adamw;$k/ssgd+adamw"
}

# At `slow` the same steps (0.2 MB a step): 2.69x Muon, 1.70x heavyball, 0.83x AdamW.
# Result (second-order-hf-gpt2-fast): Muon 30 steps, heavyball's SOAP 30, the SOAP mode 70
# (2.47x Muon's time, 1.57x heavyball's, 0.82x AdamW's). Its norms' scale was tuned on
# plait's GPT; here the tied embedding and output matrix (which K-FAC leaves out) is among
# the parameters it scales. The scale, and fresher factors and bases, on seed 10:
# Result: none reaches 2.4 by step 40 (Muon 2.30 there); the norms at 3x reach it near
# step 50 (at 10x 60-70), fresher factors (every step, the basis every 5th) barely move it.
# The race was not re-run with them.
tune-soap-hf-gpt2() {
    local s="$SOAP+sgd-plain@0.01"
    race tune-soap-hf-gpt2 --workload "$HF_GPT2" --metric loss --target 0.1 \
        --nodes 4 --bandwidth fast --seeds 10 --max-steps 150 --eval-every 10 --full-budget \
        --strategies "ssgd+muon-fp32@0.03;$SOAP,rest_lr_scale=1+sgd-plain@0.01;$SOAP,rest_lr_scale=3+sgd-plain@0.01;$SOAP,rest_lr_scale=10,factor_interval=1,inv_interval=5+sgd-plain@0.01;$SOAP,rest_lr_scale=3,factor_interval=1,inv_interval=5+sgd-plain@0.01"
}

# Is the tied embedding the cause? The same GPT-2 with its output layer untied (each of
# the two matrices then a K-FAC layer), seed 10, Muon beside it on both models.
tune-soap-hf-gpt2-untied() {
    race tune-soap-hf-gpt2-untied --workload examples/transformers_workloads.py:gpt2_untied \
        --metric loss --target 0.1 --nodes 4 --bandwidth fast --seeds 10 --max-steps 100 \
        --eval-every 10 --full-budget \
        --strategies "ssgd+muon-fp32@0.03;ssgd+heavyball-soap@0.03;$SOAP_REST+sgd-plain@0.01;$SOAP,rest_lr_scale=3+sgd-plain@0.01"
}

# Result (tune-soap-hf-gpt2-untied): no; untied, the SOAP mode still takes 40-50 steps to
# 2.4 (norms at 3x; 60 at 10x) where Muon takes 30. Next suspect: K-FAC-reduce, which sums
# each sequence's positions into one row; the expand approximation keeps every position.
# Result: no; with every position a row, 2.44 at step 40 and 2.35 at 50, as with reduce.
tune-soap-hf-gpt2-expand() {
    local e="spd-kfac:mode=soap,approximation=expand,rest_lr_scale=3+sgd-plain"
    race tune-soap-hf-gpt2-expand --workload "$HF_GPT2" --metric loss --target 0.1 \
        --nodes 4 --bandwidth fast --seeds 10 --max-steps 100 --eval-every 10 --full-budget \
        --strategies "ssgd+muon-fp32@0.03;$e@0.01;$e@0.003"
}

# The same on the digits CNN: the new entries' rates tuned on seeds 10-12 (the seeds
# tune-digits-cnn used), three rates each; SGD, AdamW, Muon and tuned K-FAC keep theirs.
tune-second-order-digits-cnn() {
    race tune-second-order-digits-cnn --workload digits-cnn --target 0.97 --nodes 4 \
        --bandwidth fast --seeds 10,11,12 --max-steps 400 --eval-every 5 \
        --strategies "ssgd+adamw@0.01;ssgd+heavyball-soap@0.001;ssgd+heavyball-soap@0.003;ssgd+heavyball-soap@0.01;$EKFAC+sgd@0.01;$EKFAC+sgd@0.02;$EKFAC+sgd@0.05;$SOAP+sgd-plain@0.001;$SOAP+sgd-plain@0.003;$SOAP+sgd-plain@0.01"
}

# The rates the first tuning race chose sat at its grid's edges (0.01 for heavyball and
# SOAP, the largest; 0.01 for EKFAC, the smallest): one step further on each side.
tune-second-order-digits-cnn-edges() {
    race tune-second-order-digits-cnn-edges --workload digits-cnn --target 0.97 --nodes 4 \
        --bandwidth fast --seeds 10,11,12 --max-steps 400 --eval-every 5 \
        --strategies "ssgd+adamw@0.01;ssgd+heavyball-soap@0.01;ssgd+heavyball-soap@0.03;$EKFAC+sgd@0.005;$EKFAC+sgd@0.01;$SOAP+sgd-plain@0.01;$SOAP+sgd-plain@0.03"
}

second-order-digits-cnn() {  # BANDWIDTH HB_LR EKFAC_LR SOAP_LR: rates from the tuning races
    local k="$KFAC,$TUNED+sgd" e="$EKFAC+sgd" s="$SOAP+sgd-plain"
    race "second-order-digits-cnn-$1" --workload digits-cnn --target 0.97 --nodes 4 \
        --bandwidth "$1" --max-steps 600 --eval-every 5 \
        --strategies "ssgd+sgd@0.1;ssgd+adamw@0.01;ssgd+muon@0.01;ssgd+heavyball-soap@$2;$k@0.02;$e@$3;$s@$4" \
        --compare "$k/ssgd+adamw;$e/ssgd+adamw;$s/ssgd+adamw;$s/ssgd+heavyball-soap;$e/ssgd+muon"
}

# ------------------------------------------------------------------ slow links
# The communication-bound race: the GPT at 2 sequences per worker (benchmarks/race/
# workloads.py:gpt_link), 87% of S-SGD's step on the wire at `slow`. Every entry trains
# with AdamW; its learning rate is tuned first (tune-link: seed 10, the same budget for
# every entry, two rates each, judged by the held-out loss after 300 steps; unshaped,
# since steps do not depend on the link), then raced at `slow`. torchft's DiLoCo takes
# plain diloco's rate: it is the same algorithm (equal to the bit on two ranks).
LINK=benchmarks/race/workloads.py:gpt_link
LINK_ENTRIES=(
    "ssgd"
    "torch-powersgd:rank=16"
    "powersgd:rank=16"
    "acpsgd:rank=16"
    "acpsgd:rank=32"
    "diloco:inner_steps=10"
    "diloco:inner_steps=10,fragments=2,delay=2"
    "diloco:inner_steps=10,fragments=2,delay=2,compression=int4"
)

tune-link() {
    local entries=""
    for e in "${LINK_ENTRIES[@]}"; do
        for lr in 1e-3 2e-3; do entries+="$e+adamw@$lr;"; done
    done
    race tune-link --workload "$LINK" --metric loss --target 2.0 --nodes 4 \
        --seeds 10 --max-steps 300 --eval-every 25 --full-budget --strategies "$entries"
}

# Every entry at AdamW lr 1e-3, the better of the two rates for each in tune-link (ACP-SGD
# at rank 32 is left out for time). Target: held-out loss 2.55, which S-SGD reached after
# 200 steps in tune-link (seed 10).
slow-link() {  # SEEDS
    local entries="" e
    for e in "${LINK_ENTRIES[@]}" "torchft-diloco:sync_every=10"; do
        [[ $e == "acpsgd:rank=32" ]] || entries+="$e+adamw@1e-3;"
    done
    race "slow-link-gpt" --workload "$LINK" --metric loss --target 2.55 --nodes 4 \
        --bandwidth slow --seeds "${1:-0,1,2}" --max-steps 300 --eval-every 10 \
        --strategies "$entries" \
        --compare "powersgd:rank=16+adamw/torch-powersgd:rank=16+adamw;acpsgd:rank=16+adamw/torch-powersgd:rank=16+adamw;diloco:inner_steps=10,fragments=2,delay=2,compression=int4+adamw/torch-powersgd:rank=16+adamw;diloco:inner_steps=10,fragments=2,delay=2,compression=int4+adamw/torchft-diloco:sync_every=10+adamw;diloco:inner_steps=10+adamw/torchft-diloco:sync_every=10+adamw"
}

# ------------------------------------------------------------- a WAN-class link
# The same GPT and rates at 25 Mbit/s, where even a compressed exchange costs several
# compute steps: at 100 Mbit rank-16 Power-SGD's exchange is about one compute step
# (0.25 s of its 0.50 s step), far from the papers' GPU clusters on 1 GbE, where a step's
# compute is short beside any exchange. The target is deeper (2.50: S-SGD reached it after
# 225 steps on the tuning seed 10 in tune-link) so that methods are judged past their
# start-up. torchft's DiLoCo is left out for time: its trajectory does not depend on the
# link, and it missed 2.55 in 300 steps on every seed at `slow` (slow-link).
WAN_ENTRIES="torch-powersgd:rank=16+adamw@1e-3;acpsgd:rank=16+adamw@1e-3;diloco:inner_steps=10,fragments=2,delay=2,compression=int4+adamw@1e-3"
wan-link() {  # SEEDS
    race "wan-link-gpt" --workload "$LINK" --metric loss --target 2.50 --nodes 4 \
        --bandwidth 25mbit --seeds "${1:-0,1,2,3,4}" --max-steps 400 --eval-every 20 \
        --strategies "$WAN_ENTRIES" \
        --compare "acpsgd:rank=16+adamw/torch-powersgd:rank=16+adamw;diloco:inner_steps=10,fragments=2,delay=2,compression=int4+adamw/torch-powersgd:rank=16+adamw"
}

# S-SGD's steps to the WAN race's target and its final loss (steps do not depend on the
# link; its time at 25 Mbit is its step there, `plait bench`, times these steps).
wan-link-ssgd() {  # SEEDS
    race "wan-link-gpt-ssgd" --workload "$LINK" --metric loss --target 2.50 --nodes 4 \
        --seeds "${1:-0,1,2,3,4}" --max-steps 400 --eval-every 20 --strategies "ssgd+adamw@1e-3"
}

# The same budget for two more entries (seed 10, unshaped, 300 steps, AdamW 1e-3 and 2e-3):
# Streaming DiLoCo at H = 5 (a fragment every 2-3 steps: its int4 exchanges, 0.5 MB a step,
# still fit under the inner steps' compute at 25 Mbit). ACP-SGD with 2 MB buckets needs no
# tuning: buckets group the same per-matrix compression, so its steps are those of
# acpsgd:rank=16 (one bucket of 13 MB) and only the overlap with backward changes.
tune-wan() {
    race tune-wan --workload "$LINK" --metric loss --target 2.0 --nodes 4 \
        --seeds 10 --max-steps 300 --eval-every 25 --full-budget \
        --strategies "diloco:inner_steps=5,fragments=2,delay=2,compression=int4+adamw@1e-3;diloco:inner_steps=5,fragments=2,delay=2,compression=int4+adamw@2e-3"
}

# The WAN race's second round: what the methods allow at 25 Mbit. ACP-SGD in 2 MB buckets
# (DDP's bucket_cap_mb), so that buckets all-reduce while backward goes on (ACP-SGD's
# design: one all-reduce per bucket, issued from the hook); Streaming DiLoCo at H = 5
# (rate from tune-wan). (torch's hook runs in one bucket whatever
# bucket_cap_mb says, so the committed round's `torch-powersgd:rank=16,bucket_cap_mb=2`
# entry measured the one-bucket hook a second time; that spec is now refused, and left out.)
WAN2_ENTRIES="torch-powersgd:rank=16+adamw@1e-3;acpsgd:rank=16,bucket_cap_mb=2+adamw@1e-3;diloco:inner_steps=5,fragments=2,delay=2,compression=int4+adamw@${WAN_H5_LR:-1e-3}"
wan-link-2() {  # SEEDS
    local p="torch-powersgd:rank=16+adamw"
    race "wan-link-gpt-2" --workload "$LINK" --metric loss --target 2.50 --nodes 4 \
        --bandwidth 25mbit --seeds "${1:-0,1,2,3,4}" --max-steps 400 --eval-every 20 \
        --strategies "$WAN2_ENTRIES" \
        --compare "acpsgd:rank=16,bucket_cap_mb=2+adamw/$p;diloco:inner_steps=5,fragments=2,delay=2,compression=int4+adamw/$p"
}

# The WAN race past start-up: a deeper target, held-out loss 2.45, which S-SGD had not
# reached after 300 steps on the tuning seed 10 (2.451 at step 300 in tune-link), so that
# S-SGD needs at least 200 steps on the race seeds (at 2.50 it needed 160). The second
# round's entries at their rates: torch's hook (one bucket), ACP-SGD in 2 MB buckets,
# Streaming DiLoCo at H = 10 with int4 fragments; 600 steps at most.
WAN_DEEP_ENTRIES="torch-powersgd:rank=16+adamw@1e-3;acpsgd:rank=16,bucket_cap_mb=2+adamw@1e-3;diloco:inner_steps=10,fragments=2,delay=2,compression=int4+adamw@1e-3"
wan-link-deep() {  # SEEDS
    local p="torch-powersgd:rank=16+adamw"
    race "wan-link-gpt-deep" --workload "$LINK" --metric loss --target 2.45 --nodes 4 \
        --bandwidth 25mbit --seeds "${1:-0,1,2,3,4}" --max-steps 600 --eval-every 20 \
        --strategies "$WAN_DEEP_ENTRIES" \
        --compare "acpsgd:rank=16,bucket_cap_mb=2+adamw/$p;diloco:inner_steps=10,fragments=2,delay=2,compression=int4+adamw/$p"
}

# torchft's DiLoCo step at 25 Mbit beside plait's streaming entry (20 steps: two of its
# synchronisations of the whole model). Its trajectory does not depend on the link, and
# at `slow` it missed 2.55 in 300 steps on every seed (slow-link), so its time to the
# deeper 2.45 is at least 300 of these steps; the race leaves it out for time.
wan-link-torchft-step() {
    "$PLAIT" bench --workload "$LINK" --nodes 4 --bandwidth 25mbit --steps 20 --warmup 2 \
        --out "$OUT/wan-link-gpt-steps-torchft" \
        --strategies "torchft-diloco:sync_every=10;diloco:inner_steps=10,fragments=2,delay=2,compression=int4"
}

# S-SGD's steps to the deeper target (unshaped: its steps do not depend on the link).
wan-link-deep-ssgd() {  # SEEDS
    race "wan-link-gpt-deep-ssgd" --workload "$LINK" --metric loss --target 2.45 --nodes 4 \
        --seeds "${1:-0,1,2,3,4}" --max-steps 600 --eval-every 20 --strategies "ssgd+adamw@1e-3"
}

all() {
    tune-digits-cnn
    tune-kfac-digits-cnn
    for bw in fast slow; do optimizers-digits-cnn "$bw"; done
    kfac-budget-tuned-digits-cnn fast
    for bw in slow fast; do compressors-digits-cnn "$bw"; done
    for bw in slow fast; do compressors-gpt "$bw"; done
    tune-gpt
    optimizers-gpt fast sgd
    optimizers-gpt slow
}

"${@:-all}"
