#!/usr/bin/env python3
"""Reference tokenizers for trainrun's tests, made offline with HF `tokenizers`.

  make   --dir D --corpus FILE... [--vocab N]
         trains byte-level BPE tokenizers on the corpus and writes
           D/gpt2.json         ByteLevel(use_regex) pre-tokenizer, <|endoftext|>  (GPT-2 style)
           D/gpt2_prefix.json  the same with add_prefix_space
           D/llama3.json       Split(Llama 3 regex, Isolated) + ByteLevel(use_regex=false),
                               ignore_merges, Llama 3's special tokens, a BOS template
           D/llama3_holes.json llama3.json less some merges (ignore_merges decides)
         and D/<name>_pairs.json: the same tokenizer with merges as ["a", "b"]
         pairs (the format tokenizers >= 0.20 writes; 0.19 writes "a b").
  encode --tokenizer T --texts texts.json --out out.json
         texts.json is a list of strings; out.json gets
           {"plain": ids with special tokens encoded as text,
            "special": ids with special tokens matched (HF's default),
            "decoded": decode(plain ids)}
  bench  --tokenizer T --input FILE --threads N
         encode_batch over the file in ~64 KB line-aligned documents; prints "hf_encode_batch MB/s <x> tokens <n>".
"""
import argparse
import json
import os
import sys
import time

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def train(style, files, vocab):
    if style == "llama3":
        tok = Tokenizer(models.BPE(ignore_merges=True))
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
        special = LLAMA3_SPECIAL
    else:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=(style == "gpt2_prefix"), use_regex=True)
        special = ["<|endoftext|>"]
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=special, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(files, trainer)
    # A non-special added token: HF matches it in any text, so trainrun must too.
    tok.add_tokens([AddedToken("[TOOL]", special=False, normalized=False)])
    if style == "llama3":
        bos = tok.token_to_id("<|begin_of_text|>")
        tok.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                                           special_tokens=[("<|begin_of_text|>", bos)])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def cmd_make(a):
    os.makedirs(a.dir, exist_ok=True)
    for style in ("gpt2", "gpt2_prefix", "llama3"):
        tok = train(style, a.corpus, a.vocab)
        path = os.path.join(a.dir, style + ".json")
        tok.save(path)
        with open(path) as f:
            j = json.load(f)
        merges = j["model"]["merges"]
        if merges and isinstance(merges[0], str):
            j["model"]["merges"] = [m.split(" ") for m in merges]
        with open(os.path.join(a.dir, style + "_pairs.json"), "w") as f:
            json.dump(j, f, ensure_ascii=False)
        if style == "llama3":
            # Every 5th merge of a longer token removed: those tokens (and the
            # ones built on them) are then reachable only through
            # ignore_merges, which is what Llama 3's converted vocab relies on.
            with open(path) as f:
                j = json.load(f)
            j["model"]["merges"] = [m for i, m in enumerate(j["model"]["merges"])
                                    if not (i % 5 == 0 and len(m.replace(" ", "")) >= 4)]
            with open(os.path.join(a.dir, "llama3_holes.json"), "w") as f:
                json.dump(j, f, ensure_ascii=False)
            j["model"]["merges"] = [m.split(" ") for m in j["model"]["merges"]]
            with open(os.path.join(a.dir, "llama3_holes_pairs.json"), "w") as f:
                json.dump(j, f, ensure_ascii=False)
        print(style, tok.get_vocab_size(), "tokens,", len(merges), "merges")


def cmd_encode(a):
    tok = Tokenizer.from_file(a.tokenizer)
    with open(a.texts, encoding="utf-8") as f:
        texts = json.load(f)
    out = {}
    tok.encode_special_tokens = True
    out["plain"] = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    tok.encode_special_tokens = False
    out["special"] = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    out["decoded"] = [tok.decode(ids, skip_special_tokens=False) for ids in out["plain"]]
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False)


def cmd_bench(a):
    os.environ["RAYON_NUM_THREADS"] = str(a.threads)  # must precede the first parallel call
    tok = Tokenizer.from_file(a.tokenizer)
    tok.encode_special_tokens = True  # text is data, as trainrun prepare's default
    with open(a.input, encoding="utf-8") as f:
        text = f.read()
    # Documents of ~64 KB cut at line ends: long enough that the per-call
    # cost of Python and Encoding objects does not dominate, many enough
    # for every thread.
    docs, start = [], 0
    while start < len(text):
        end = text.find("\n", start + 65536)
        end = len(text) if end < 0 else end + 1
        docs.append(text[start:end])
        start = end
    nbytes = len(text.encode("utf-8"))
    t0 = time.perf_counter()
    n = sum(len(e.ids) for e in tok.encode_batch(docs, add_special_tokens=False))
    dt = time.perf_counter() - t0
    print(f"hf_encode_batch MB/s {nbytes / dt / 1e6:.2f} tokens {n} seconds {dt:.3f} docs {len(docs)}")


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--dir", required=True)
    m.add_argument("--corpus", nargs="+", required=True)
    m.add_argument("--vocab", type=int, default=2000)
    e = sub.add_parser("encode")
    e.add_argument("--tokenizer", required=True)
    e.add_argument("--texts", required=True)
    e.add_argument("--out", required=True)
    b = sub.add_parser("bench")
    b.add_argument("--tokenizer", required=True)
    b.add_argument("--input", required=True)
    b.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    {"make": cmd_make, "encode": cmd_encode, "bench": cmd_bench}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
