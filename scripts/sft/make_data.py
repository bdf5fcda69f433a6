#!/usr/bin/env python3
"""Data for the SFT example (scripts/sft/run.sh), made from Debian's fortunes:

  tokenizer --corpus FILE... --vocab N --out tokenizer.json
      a Llama-3-style byte-level BPE tokenizer (Llama 3's split regex,
      ByteLevel without its regex, ignore_merges, <|begin_of_text|> BOS,
      the chat header and end-of-turn special tokens), trained with HF
      tokenizers on the corpus.
  chat --corpus FILE... --out chat.jsonl [--max N]
      OpenAI-style conversations: a user asks for a fortune about a word, the
      assistant answers with a fortune containing it.
"""
import argparse
import json
import random
import re
import sys

SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
         r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def fortunes(files):
    for path in files:
        with open(path, encoding="utf-8", errors="replace") as f:
            for block in f.read().split("\n%\n"):
                text = block.strip()
                if 20 <= len(text) <= 400:
                    yield text


def cmd_tokenizer(a):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=a.vocab, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(a.corpus, trainer)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                       special_tokens=[("<|begin_of_text|>", bos)])
    tok.save(a.out)
    print(f"tokenizer: {tok.get_vocab_size()} tokens -> {a.out}")
    return 0


def cmd_chat(a):
    rng = random.Random(1)
    n = 0
    with open(a.out, "w", encoding="utf-8") as out:
        for text in fortunes(a.corpus):
            words = [w for w in re.findall(r"[A-Za-z]{5,}", text)]
            if not words:
                continue
            topic = rng.choice(words).lower()
            ask = rng.choice(["Tell me a fortune about {}.", "Do you know a saying about {}?",
                              "Say something wise about {}.", "What do the fortunes say about {}?"])
            msg = {"messages": [{"role": "user", "content": ask.format(topic)},
                                {"role": "assistant", "content": text}]}
            out.write(json.dumps(msg, ensure_ascii=False) + "\n")
            n += 1
            if n >= a.max:
                break
    print(f"chat: {n} conversations -> {a.out}")
    return 0


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("tokenizer")
    t.add_argument("--corpus", nargs="+", required=True)
    t.add_argument("--vocab", type=int, default=2000)
    t.add_argument("--out", required=True)
    c = sub.add_parser("chat")
    c.add_argument("--corpus", nargs="+", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--max", type=int, default=20000)
    a = p.parse_args()
    return {"tokenizer": cmd_tokenizer, "chat": cmd_chat}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
