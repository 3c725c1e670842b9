#!/usr/bin/env bash
# `batchjob bench --baselines ours` on two (or more) checkouts of this repository, in alternating rounds, so
# each sees the same machine load; prints each run's total tokens/s. Compare the ratios, not the figures.
#   bash measurements/bench_ab.sh /tmp/before /path/to/after      (ROUNDS=3 by default; extra bench flags: BENCH_ARGS)
set -u
if [ "${1:-}" = "--help" ] || [ "${1:-}" = "-h" ]; then
  echo "usage: bash measurements/bench_ab.sh CHECKOUT [CHECKOUT ...]   (env: ROUNDS, BENCH_ARGS)"
  exit 0
fi
rounds=${ROUNDS:-3}
for r in $(seq "$rounds"); do
  for code in "$@"; do
    json=$(mktemp --suffix=.json)
    # That checkout's batchjob, not the installed one: an editable install's finder would win over PYTHONPATH.
    python -c 'import runpy, sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")]
sys.path.insert(0, sys.argv.pop(1))
sys.argv[0] = "batchjob"
runpy.run_module("batchjob", run_name="__main__", alter_sys=True)' "$code" \
      bench --baselines ours --device cpu ${BENCH_ARGS:-} --json "$json" > /dev/null 2>&1
    python - "$code" "$r" "$json" <<'PY'
import json, sys
res = json.load(open(sys.argv[3]))["results"][0]
if res.get("error"):  # a failed run of ours has no figure to quote
    sys.exit(f"round {sys.argv[2]}  {sys.argv[1]}: ours failed: {res['error']}")
print(f"round {sys.argv[2]}  {sys.argv[1]}: {res['total_tokens_per_s']:.1f} total tok/s, {res['wall_s']:.1f} s")
PY
  done
done
