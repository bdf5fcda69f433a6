#!/usr/bin/env bash
# BPE training time, `trainrun tokenizer train` vs HF tokenizers' BpeTrainer
# (scripts/reference/hf_bpe_train.py), on the same text, settings and
# thread count, in one run; prints a table. Inputs: the fortunes corpus
# (43 files, 2.6 MB) and the same text repeated to ~MB megabytes (one file).
# trainrun's time is the whole command (start, read, count, merge, write
# tokenizer.json); HF's is train_from_iterator alone (the text already in
# memory, fed in ~1 MB pieces cut where no pre-token changes, so its threads
# share the work; saving excluded). Best of REPEAT runs each. The last column
# says whether the two tokenizer.json files hold the same merges.
#   usage: scripts/bench/tokenizer_train_vs_hf.sh [MB] [vocab] [threads...]   (default: 20 8000 1 2)
set -euo pipefail
cd "$(dirname "$0")/../.."
MB=${1:-20}
VOCAB=${2:-8000}
shift 2 || shift $# || true
THREADS=("$@")
[ ${#THREADS[@]} -eq 0 ] && THREADS=(1 2)
REPEAT=${REPEAT:-3}
PRE=${PRE:-llama3}
BIN=${TRAINRUN_BIN:-./build/trainrun}  # TRAINRUN_BIN: another build, for before/after
[ -x "$BIN" ] || bash scripts/build.sh trainrun >/dev/null
PY=.venv/bin/python
REF=scripts/reference/hf_bpe_train.py
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT

FORT=/usr/share/games/fortunes
mapfile -t FILES < <(ls "$FORT"/* | grep -v -e '\.dat$' -e '\.u8$')
cat "${FILES[@]}" > "$W/fortunes.txt"
$PY - "$W/fortunes.txt" "$W/big.txt" "$MB" <<'PY'
import sys
src, dst, mb = sys.argv[1], sys.argv[2], int(sys.argv[3])
text = open(src, encoding="utf-8", newline="").read()
with open(dst, "w", encoding="utf-8", newline="") as f:
    n = 0
    while n < mb * 1000000:
        f.write(text)
        n += len(text.encode("utf-8"))
PY

best() {  # best of REPEAT: the minimum of the numbers the command prints
  local b="" t
  for _ in $(seq "$REPEAT"); do
    t=$("$@")
    b=$($PY -c "print(min(x for x in [$t, ${b:-$t}]))")
  done
  echo "$b"
}
ours() {  # threads input...
  local t=$1; shift
  local s e
  s=$(date +%s.%N)
  "$BIN" tokenizer train --input "$@" --vocab-size "$VOCAB" --pre-tokenizer "$PRE" \
    --special-tokens '<|endoftext|>' --threads "$t" --output "$W/ours" --quiet >/dev/null 2>&1
  e=$(date +%s.%N)
  $PY -c "print('%.3f' % ($e - $s))"
}
hf() {  # threads input...
  local t=$1; shift
  $PY "$REF" train --input "$@" --vocab "$VOCAB" --pre-tokenizer "$PRE" --special '<|endoftext|>' \
    --threads "$t" --chunk --out "$W/hf" | sed -n 's/hf_train_seconds //p'
}
same() {
  $PY -c "import json,sys; a,b=(json.load(open(p))['model'] for p in sys.argv[1:]); print('yes' if a==b else 'NO')" \
    "$W/ours/tokenizer.json" "$W/hf/tokenizer.json"
}

echo "vocab $VOCAB, pre-tokenizer $PRE, best of $REPEAT; $(nproc) cores; $(date -u +%F), $(git rev-parse --short HEAD)"
printf "%-22s %-8s %-14s %-14s %-8s %-6s\n" input threads "trainrun s" "HF s" speedup same
for input in fortunes big; do
  if [ "$input" = fortunes ]; then args=("${FILES[@]}"); label="fortunes (2.6 MB)"
  else args=("$W/big.txt"); label="fortunes x$((MB * 1000000 / $(stat -c %s "$W/fortunes.txt") + 1)) ($(( $(stat -c %s "$W/big.txt") / 1000000 )) MB)"; fi
  for t in "${THREADS[@]}"; do
    a=$(best ours "$t" "${args[@]}")
    b=$(best hf "$t" "${args[@]}")
    printf "%-22s %-8s %-14s %-14s %-8s %-6s\n" "$label" "$t" "$a" "$b" "$($PY -c "print('%.1fx' % ($b / $a))")" "$(same)"
  done
done
