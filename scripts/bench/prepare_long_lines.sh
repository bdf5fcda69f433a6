#!/usr/bin/env bash
# `trainrun prepare --format text` on text without newlines (CJK prose, code
# on one line): time and peak memory against the input size. Before the
# 2026-12-03 change prepare rescanned its whole buffer every MiB looking
# for a "\n<letter>" cut point and kept the whole document in memory
# (0.84 s for 32 MB, 13.6 s for 256 MB, 55.9 s for 512 MB, 2.07 GB RSS);
# now each byte is scanned once and blocks are cut at spaces and CJK
# punctuation too, so time grows linearly and memory stays bounded (by the
# blocks in flight plus one shard of tokens, --shard-tokens: at 512 MB the
# RSS is that shard's 100M tokens, not the text).
# The tokenizer is Llama-3 style (scripts/reference/hf_tokenizer.py, vocab
# 2000, trained offline on the generated text); one encoding thread.
#   usage: scripts/bench/prepare_long_lines.sh [MB...]   (default: 32 512)
set -euo pipefail
cd "$(dirname "$0")/../.."
SIZES=("$@")
[ ${#SIZES[@]} -eq 0 ] && SIZES=(32 512)
BIN=./build/trainrun
[ -x "$BIN" ] || bash scripts/build.sh trainrun >/dev/null
PY=.venv/bin/python
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT

# CJK prose (letters and "，。" punctuation) and code, both without a newline.
$PY - "$W" "${SIZES[@]}" <<'PY'
import random, sys
w, sizes = sys.argv[1], [int(x) for x in sys.argv[2:]]
rng = random.Random(0)
han = [chr(c) for c in range(0x4E00, 0x4E00 + 3000)]
def cjk():
    return "".join(rng.choice(han) for _ in range(rng.randint(4, 20))) + rng.choice("，。，、")
words = ["def", "return", "x", "self.value", "for", "i", "in", "range(n):", "if", "y", "==", "0:", "print(x)", "+", "1"]
def code():
    return " ".join(rng.choice(words) for _ in range(rng.randint(3, 9))) + "; "
for kind, gen in (("cjk", cjk), ("code", code)):
    block = "".join(gen() for _ in range(20000)).encode()  # ~1 MB, repeated
    open(f"{w}/{kind}_sample.txt", "wb").write(block[:200000].decode("utf-8", "ignore").encode())
    for mb in sizes:
        with open(f"{w}/{kind}_{mb}.txt", "wb") as f:
            n = 0
            while n < mb * 1000000:
                f.write(block)
                n += len(block)
PY
$PY scripts/reference/hf_tokenizer.py make --dir "$W" --corpus "$W/cjk_sample.txt" "$W/code_sample.txt" --vocab 2000 >/dev/null
echo "prepare --format text --threads 1, Llama-3-style tokenizer (vocab 2000), text without newlines; $(nproc) cores"
printf "%-6s %-8s %-10s %-10s %-12s\n" text MB seconds "MB/s" "max RSS MB"
for kind in cjk code; do
  for mb in "${SIZES[@]}"; do
    f="$W/${kind}_${mb}.txt"
    /usr/bin/time -f "%e %M" -o "$W/time" "$BIN" prepare --tokenizer "$W/llama3.json" --input "$f" \
      --output "$W/out" --val-fraction 0 --threads 1 >/dev/null 2>"$W/err" || { cat "$W/err"; exit 1; }
    read -r secs rss_kb < "$W/time"
    size=$(stat -c %s "$f")
    printf "%-6s %-8s %-10s %-10s %-12s\n" "$kind" "$((size / 1000000))" "$secs" \
      "$($PY -c "print('%.1f' % ($size / 1e6 / $secs))")" "$((rss_kb / 1024))"
    rm -rf "$W/out"
  done
done
