#!/usr/bin/env bash
# Issue 58: where Tri-Accel with FP8 loses to non-adaptive amp-fp8 on the 85 M GPT (1.216x against 1.300x amp-bf16).
# Each arm of ARMS ("name|flags") trains the GPT of bench/run_fp8.sh for EPOCHS epochs, one after the other on the
# machine to itself; the arms that switch one of Tri-Accel's parts off separate what each costs. PROFILE ("name ...")
# arms run again with a timeline of steps 200-209, and the first two are compared kernel by kernel
# (bench/trace_summary.py --compare). BINS ("triaccel_base triaccel"): every arm under each binary of .device/bin, its
# runs named BIN/arm and compared with that binary's amp-bf16 (an A/B in one call; the timelines: the last binary's).
# Usage (device machine, carry [".device"]): bash dev/probe_ta_fp8.sh; writes $OUT/ta_fp8.json, the timelines'
# comparison and a table (s/epoch over epochs 2..EPOCHS, speed against amp-bf16).
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR=${OUT:-out}
WORK=/tmp/ta_fp8_out
rm -rf "$WORK"
mkdir -p "$WORK" "$OUTDIR"
source bench/device_env.sh
device_binaries "$WORK"
shakespeare_text
EPOCHS=${EPOCHS:-4}
TA="--method tri-accel --precision amp-fp8 --ctrl-every 10"
ARMS=${ARMS:-"amp-bf16|--precision amp-bf16
amp-fp8|--precision amp-fp8
ta-fp8|$TA
ta-fp8-nocurv|$TA --ta-curvature false
ta-fp8-nopromote|$TA --tau-curv 1e9
ta-fp8-noprec|$TA --ta-precision false"}
PROFILE=${PROFILE:-"amp-fp8 ta-fp8"}
COMMON=(--model gpt-char --dataset tinyshakespeare --data /tmp/shakespeare --gpt-layers 12 --gpt-heads 12
        --gpt-embed 768 --block-size 256 --batch-size 64 --epochs "$EPOCHS" --warmup-epochs 1 --optimizer adamw
        --lr 6e-4 --weight-decay 0.1 --progress lines --log-every 100000 --seed 0)
BINS=${BINS:-triaccel}
run() {  # bin name flags [extra...]
  local bin=$1 name=$2 flags=$3
  shift 3
  [ "$BINS" != triaccel ] && name="${bin}__$name"
  # shellcheck disable=SC2086  # flags is a list
  timeout 240 "$BIN/$bin" train "${COMMON[@]}" $flags "$@" --out "$WORK/$name" >"$WORK/$name.log" 2>&1 ||
    { echo "$name: exit $?"; tail -3 "$WORK/$name.log"; }
  echo "== $name: $bin train ${COMMON[*]} $flags $*" >>"$OUTDIR/commands.txt"
}
for bin in $BINS; do
  while IFS='|' read -r name flags; do
    [ -n "$name" ] && run "$bin" "$name" "$flags"
  done <<<"$ARMS"
done
last_bin=${BINS##* }
for name in $PROFILE; do
  flags=$(grep "^$name|" <<<"$ARMS" | cut -d'|' -f2-)
  run "$last_bin" "prof_$name" "$flags" --profile-steps 200:210
done
set -- $PROFILE
pre=""
[ "$BINS" != triaccel ] && pre="${last_bin}__"
a="$WORK/${pre}prof_$1/profile.json"
b="$WORK/${pre}prof_${2:-}/profile.json"
if [ $# -ge 2 ] && [ -f "$a" ] && [ -f "$b" ]; then
  python3 bench/trace_summary.py "$a" "$b" >"$OUTDIR/trace_rows.jsonl" 2>"$OUTDIR/trace_rows.txt"
  python3 bench/trace_summary.py --compare "$a" "$b" >"$OUTDIR/trace_compare.txt" 2>&1
  python3 bench/trace_summary.py --kernels "$b" >"$OUTDIR/trace_kernels_$2.txt" 2>&1
  cat "$OUTDIR/trace_rows.txt"; head -40 "$OUTDIR/trace_compare.txt"
fi
for d in "$WORK"/*/; do cp "$d/events.jsonl" "$OUTDIR/$(basename "$d").events.jsonl" 2>/dev/null; done
python3 - "$WORK" "$OUTDIR/ta_fp8.json" <<'EOF'
import glob, json, os, sys
work, dest = sys.argv[1:3]
rows = {}
for f in sorted(glob.glob(os.path.join(work, "*/events.jsonl"))):
    name = os.path.basename(os.path.dirname(f))
    ev = [json.loads(l) for l in open(f) if l.strip()]
    epochs = [e for e in ev if e["event"] == "epoch"]
    summ = [e for e in ev if e["event"] == "summary"]
    prec = [e["precision"] for e in ev if e["event"] == "precision"]
    if not epochs or not summ:
        continue
    steady = [e["epoch_s"] for e in epochs[1:]] or [epochs[0]["epoch_s"]]
    rows[name] = {"epoch_s": sum(steady) / len(steady), "val_loss": summ[-1].get("test_loss"),
                  "peak_gb": summ[-1].get("peak_vram_gb"), "fp8_layers": summ[-1].get("fp8_layers"),
                  "probe_s": epochs[-1].get("probe_s_total"), "units": prec[-1] if prec else None}
for n, r in rows.items():  # against the same binary's amp-bf16 ("BIN__arm" names under BINS)
    base = rows.get(n.split("__")[0] + "__amp-bf16" if "__" in n else "amp-bf16", {}).get("epoch_s")
    r["speed_vs_bf16"] = base / r["epoch_s"] if base else None
json.dump(rows, open(dest, "w"), indent=1)
print(f"{'arm':36} {'s/epoch':>8} {'x bf16':>7} {'val loss':>9} {'peak GB':>8} {'fp8 lin':>7} {'probe s':>7}  units")
for n, r in rows.items():
    units = " ".join(u[:4] for u in r["units"]) if r["units"] else "-"
    sp = f"{r['speed_vs_bf16']:.3f}" if r["speed_vs_bf16"] else "-"
    print(f"{n:36} {r['epoch_s']:8.3f} {sp:>7} {r['val_loss'] or 0:9.4f} {r['peak_gb'] or 0:8.3f} "
          f"{str(r['fp8_layers']):>7} {r['probe_s'] or 0:7.2f}  {units}")
EOF
