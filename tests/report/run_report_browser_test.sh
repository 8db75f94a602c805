#!/usr/bin/env bash
# `triaccel report` in a real headless browser (Debian's chromium): the page is loaded, its scripts run, and the
# RENDERED DOM (--dump-dom) is checked by check_report_dom.py: no page or console errors, every chart drew data.
#   1. synthetic runs covering every chart kind + a broken, an empty and a missing run (write_synthetic_runs.py)
#   2. real H200 runs kept in tests/fixtures/report (Tri-Accel, fp32, BAOC), where charts without data show their note
#   3. the checker itself: the synthetic page with a drawing function that throws, and with a script syntax error,
#      must fail the check (so a broken page cannot pass)
#   4. the command's own errors: no RUN_DIR, an output folder that does not exist (exit 2, one line)
# usage: run_report_browser_test.sh path/to/triaccel
set -uo pipefail
CLI=${1:?usage: run_report_browser_test.sh path/to/triaccel}
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
CHROMIUM=${CHROMIUM:-$(command -v chromium || command -v chromium-browser || true)}
if [ -z "$CHROMIUM" ]; then
  echo "FAIL: chromium not found; install it with scripts/setup.sh (Debian package chromium)"
  exit 1
fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }

# render PAGE NAME: writes $WORK/NAME.dom (the DOM after scripts ran) and $WORK/NAME.log (chromium's log).
render() {
  timeout 120 "$CHROMIUM" --headless --no-sandbox --disable-gpu --no-first-run --no-default-browser-check \
    --disable-extensions --user-data-dir="$WORK/profile-$2" --enable-logging=stderr --v=0 \
    --virtual-time-budget=10000 --dump-dom "file://$1" >"$WORK/$2.dom" 2>"$WORK/$2.log"
  local rc=$?
  [ $rc -eq 0 ] || fail "chromium exited $rc on $1: $(grep -v dbus "$WORK/$2.log" | tail -3)"
}

ALL_CHARTS=(--expect-chart loss-epoch --expect-chart acc-epoch --expect-chart loss-time --expect-chart acc-time
            --expect-chart batch-time --expect-chart vram-time --expect-chart precision --expect-chart lambda-max
            --expect-chart plan-memory --expect-chart plan-risk --expect-chart memory-plan --expect-chart nf-blocks
            --expect-chart nf-exit)

# 1. Synthetic runs: every chart kind, and the problems of the broken ones named in the page.
python3 "$HERE/write_synthetic_runs.py" "$WORK/runs" || fail "write_synthetic_runs.py failed"
R=$WORK/runs
mkdir -p "$WORK/out"
"$CLI" report "$R/tri" "$R/baoc" "$R/nf" "$R/broken" "$R/empty" "$R/missing" -o "$WORK/out/synthetic.html" \
  --title "synthetic runs" >"$WORK/cli.out" 2>"$WORK/cli.err" || fail "report exited non-zero: $(cat "$WORK/cli.err")"
grep -q "wrote $WORK/out/synthetic.html and $WORK/out/synthetic.csv (6 runs, 3 with problems" "$WORK/cli.out" ||
  fail "unexpected report output: $(cat "$WORK/cli.out")"
head -1 "$WORK/out/synthetic.csv" | grep -qx "run,method,model,dataset,precision,epochs,test_acc_pct,epoch_s,peak_vram_gb,eff_score,source,ranks" ||
  fail "report.csv header: $(head -1 "$WORK/out/synthetic.csv")"
grep -qx "tri,tri-accel,resnet18,cifar10,adaptive,4,82,12,0.8,8.54167,summary,1" "$WORK/out/synthetic.csv" ||
  fail "report.csv row for tri: $(grep ^tri, "$WORK/out/synthetic.csv")"
if grep -Eq '(src|href)="https?:|@import|url\(' "$WORK/out/synthetic.html"; then fail "the page refers to outside resources"; fi
render "$WORK/out/synthetic.html" synthetic
python3 "$HERE/check_report_dom.py" "$WORK/synthetic.dom" "$WORK/synthetic.log" --runs 6 "${ALL_CHARTS[@]}" \
  --expect-text "Problems with 3 of 6 runs" \
  --expect-text "line 2 is not valid JSON; skipped" \
  --expect-text "the last line (6) is cut off" \
  --expect-text "line 5 is not an event" \
  --expect-text "no summary event: the run did not finish" \
  --expect-text "empty; the run wrote no events" \
  --expect-text "missing: not found; give a run folder" \
  --expect-text "micro-batch 48 × 2, data on the host (streamed)" || fail "synthetic report: rendered page check"

# 2. Real runs (H200): Tri-Accel with precision/curvature, fp32 backprop, BAOC with plan events; no NeuroFlux.
H200=$ROOT/tests/fixtures/report
"$CLI" report "$H200/r18_tri_s0.events.jsonl" "$H200/r18_fp32_s0.events.jsonl" \
  "$H200/r18_baoc_25.events.jsonl" -o "$WORK/out/real.html" >/dev/null 2>"$WORK/real.err" ||
  fail "report on real runs: $(cat "$WORK/real.err")"
[ ! -s "$WORK/real.err" ] || fail "warnings on complete real runs: $(cat "$WORK/real.err")"
render "$WORK/out/real.html" real
python3 "$HERE/check_report_dom.py" "$WORK/real.dom" "$WORK/real.log" --runs 3 \
  --expect-chart loss-epoch --expect-chart acc-time --expect-chart vram-time --expect-chart precision \
  --expect-chart lambda-max --expect-chart plan-memory --expect-nodata nf-blocks --expect-nodata nf-exit \
  --expect-nodata memory-plan \
  --expect-text "no NeuroFlux block events in these runs" --expect-text "r18_tri_s0" || fail "real report: rendered page check"

# 3. The check must catch a page whose drawing throws, and one whose script does not parse.
sed 's/function lineChart(spec) {/function lineChart(spec) { throw new Error("injected drawing failure");/' \
  "$WORK/out/synthetic.html" >"$WORK/out/throws.html"
grep -q "injected drawing failure" "$WORK/out/throws.html" || fail "could not inject the drawing failure (lineChart renamed?)"
render "$WORK/out/throws.html" throws
if python3 "$HERE/check_report_dom.py" "$WORK/throws.dom" "$WORK/throws.log" "${ALL_CHARTS[@]}" >"$WORK/throws.check"; then
  fail "the check passed a page whose lineChart throws"
fi
grep -q "#page-errors is not empty: console.error: chart loss-epoch" "$WORK/throws.check" ||
  fail "the check did not name the page error: $(cat "$WORK/throws.check")"
sed 's/const report = JSON.parse/const report = = JSON.parse/' "$WORK/out/synthetic.html" >"$WORK/out/syntax.html"
render "$WORK/out/syntax.html" syntax
if python3 "$HERE/check_report_dom.py" "$WORK/syntax.dom" "$WORK/syntax.log" >"$WORK/syntax.check"; then
  fail "the check passed a page whose script does not parse"
fi
grep -q "#page-errors is not empty: error: Uncaught SyntaxError" "$WORK/syntax.check" ||
  fail "the check did not name the syntax error: $(cat "$WORK/syntax.check")"

# 4. The command's own errors: one line, exit 2.
expect_error() {  # expect_error NAME MESSAGE -- ARGS...
  local name=$1 msg=$2; shift 3
  "$CLI" "$@" >"$WORK/$name.out" 2>"$WORK/$name.err"
  local rc=$?
  [ $rc -eq 2 ] || fail "$name: exit $rc, expected 2"
  [ "$(wc -l <"$WORK/$name.err")" -eq 1 ] || fail "$name: expected one line on stderr, got: $(cat "$WORK/$name.err")"
  grep -qF -- "$msg" "$WORK/$name.err" || fail "$name: stderr lacks '$msg': $(cat "$WORK/$name.err")"
}
expect_error no_runs "triaccel: error: report needs at least one RUN_DIR" -- report -o "$WORK/out/x.html"
expect_error no_folder "does not exist; create it or choose another -o" -- report "$R/tri" -o "$WORK/nowhere/x.html"
expect_error same_file "is the same file as -o" -- report "$R/tri" -o "$WORK/out/x.html" --csv "$WORK/out/x.html"

if [ $fails -gt 0 ]; then
  echo "report_browser: $fails failure(s)"
  exit 1
fi
echo "report_browser: all checks passed"
