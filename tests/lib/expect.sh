# The `expect` helper of the CLI test scripts (tests/cli/run_cli_tests.sh, tests/reliability/bad_input_test.sh),
# sourced by them. The script sets CLI (the triaccel binary) and the counters passed=0 and failed=0 first.
#
#   expect NAME EXIT_CODE PHRASE -- ARGS...
# runs "$CLI" ARGS... and passes when it exits with EXIT_CODE, its output (stdout and stderr) contains PHRASE, and,
# when EXIT_CODE is not 0, the error is a single line:
#   EXPECT_STRICT unset or 0: exactly one line of the output contains "triaccel: error";
#   EXPECT_STRICT=1:          the whole output is exactly one line, and it starts with "triaccel: error: ".
# Environment assignments in front of the call (VAR=x expect ...) reach the binary.

expect() {
  local name=$1 code=$2 phrase=$3
  shift 4
  local out rc
  out=$("$CLI" "$@" 2>&1)
  rc=$?
  local one_error_line=1
  if [ "$code" -ne 0 ]; then
    if [ "${EXPECT_STRICT:-0}" = 1 ]; then
      [ "$(printf '%s\n' "$out" | grep -c '^triaccel: error: ' || true)" -eq 1 ] &&
        [ "$(printf '%s\n' "$out" | grep -c . || true)" -eq 1 ] || one_error_line=0
    else
      [ "$(printf '%s\n' "$out" | grep -c 'triaccel: error' || true)" -eq 1 ] || one_error_line=0
    fi
  fi
  if [ "$rc" -eq "$code" ] && printf '%s' "$out" | grep -qF -- "$phrase" && [ "$one_error_line" -eq 1 ]; then
    passed=$((passed + 1))
  else
    failed=$((failed + 1))
    echo "FAIL $name: exit $rc (want $code), output: $out (want phrase: $phrase)"
  fi
}
