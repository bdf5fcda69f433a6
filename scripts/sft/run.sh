#!/usr/bin/env bash
# A chat fine-tune (SFT) on the CPU in a few minutes, from nothing but
# Debian's fortunes corpus:
#   1. a Llama-3-style byte-level BPE tokenizer trained on fortunes (HF
#      tokenizers, from the test venv: scripts/install-deps.sh --test);
#   2. fortunes text prepared with it, and a small Llama pretrained on it
#      (configs/sft_pretrain.yaml);
#   3. the pretrained model exported as a Hugging Face directory, with the
#      tokenizer beside it;
#   4. chat conversations made from fortunes (a user asks for a fortune
#      about a word, the assistant answers), prepared with loss masks on the
#      assistant's replies;
#   5. the fine-tune from the export (configs/sft_chat.yaml, model.init_from);
#   6. `trainrun generate --chat` with the fine-tuned model.
#   usage: scripts/sft/run.sh [--smoke]    (--smoke: 3 steps each, for the tests)
# Everything lands in $SFT_DIR (default runs/sft_example).
set -euo pipefail
cd "$(dirname "$0")/../.."
STEPS_PRE=300 STEPS_SFT=200
[ "${1:-}" = "--smoke" ] && STEPS_PRE=3 STEPS_SFT=3
W=${SFT_DIR:-runs/sft_example}
TR=./build/trainrun
PY=.venv/bin/python
[ -x "$PY" ] || bash scripts/install-deps.sh --test
[ -x "$TR" ] || bash scripts/build.sh trainrun
CORPUS=()
for f in /usr/share/games/fortunes/*; do
  case "$f" in *.dat|*.u8) ;; *) [ -f "$f" ] && CORPUS+=("$f") ;; esac
done
[ ${#CORPUS[@]} -gt 0 ] || { echo "sft: no fortunes in /usr/share/games/fortunes (apt-get install fortunes)" >&2; exit 1; }
mkdir -p "$W"

echo "--- 1. tokenizer"
"$PY" scripts/sft/make_data.py tokenizer --corpus "${CORPUS[@]}" --vocab 2000 --out "$W/tokenizer.json"
echo "--- 2. pretraining on fortunes text"
"$TR" prepare --tokenizer "$W/tokenizer.json" --input "${CORPUS[@]}" --output "$W/text" --val-fraction 0.02
"$TR" --config configs/sft_pretrain.yaml --set train.max_steps=$STEPS_PRE \
  --set data.train="$W/text/train_*.bin" --set data.val="$W/text/val_*.bin" --set output.dir="$W/base_run"
echo "--- 3. export"
"$TR" export --checkpoint "$W/base_run" --out "$W/base"
cp "$W/tokenizer.json" "$W/base/tokenizer.json"
echo "--- 4. chat data (loss on the assistant's replies)"
"$PY" scripts/sft/make_data.py chat --corpus "${CORPUS[@]}" --out "$W/chat.jsonl"
"$TR" prepare --tokenizer "$W/tokenizer.json" --format chat --input "$W/chat.jsonl" --output "$W/chat_data" \
  --val-fraction 0.02
echo "--- 5. fine-tune"
"$TR" --config configs/sft_chat.yaml --set train.max_steps=$STEPS_SFT --set model.init_from="$W/base" \
  --set data.train="$W/chat_data/train_*.bin" --set data.val="$W/chat_data/val_*.bin" --set output.dir="$W/chat"
echo "--- 6. a reply (generate --chat: the Llama 3.1 built-in template, stops at <|eot_id|>)"
"$TR" generate --checkpoint "$W/chat" --chat --prompt "Tell me a fortune about computers." \
  --max-tokens 80 --top-k 10 --temperature 0.8 --seed 3
