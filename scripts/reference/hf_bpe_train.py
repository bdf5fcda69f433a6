#!/usr/bin/env python3
"""HF tokenizers' BpeTrainer as the peer of `trainrun tokenizer train` (tests and bench).

  train  --input FILE... --out DIR --vocab N [--format text|jsonl] [--text-field F]
         [--pre-tokenizer llama3|gpt2] [--special TOK ...] [--min-frequency K] [--threads N] [--chunk]
         trains byte-level BPE exactly as trainrun configures it (ByteLevel alphabet,
         the same pre-tokenizer, special tokens first) on the same documents (text:
         one per file; jsonl: one per line) and writes DIR/tokenizer.json; prints
         "hf_train_seconds <s>" (training only, the files already read).
         --chunk feeds each text document in ~1 MB pieces cut before a line that
         starts with an ASCII letter after a printable ASCII character (where
         neither regex's pre-tokens change), so HF's threads have work to share.
  encode --tokenizer T --texts texts.json --out out.json [--transformers]
         out.json: {"ids": [...per text...], "decoded": [...]} with special tokens as text;
         with --transformers also what AutoTokenizer.from_pretrained(dirname(T)) gives:
         "transformers_ids", "eos_token", and "chat" (apply_chat_template of a short
         conversation, as text) when tokenizer_config.json has a template.
"""
import argparse
import json
import os
import re
import sys
import time

LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                  r"|\s*[\r\n]+|\s+(?!\S)|\s+")

CUT = re.compile(r"(?<=[\x21-\x7e]\n)(?=[A-Za-z])")


def chunks(text, size=1 << 20):
    start = 0
    while start < len(text):
        if len(text) - start <= size:
            yield text[start:]
            return
        m = CUT.search(text, start + size)
        end = m.start() if m else len(text)
        yield text[start:end]
        start = end


def documents(a):
    for path in a.input:
        with open(path, encoding="utf-8", newline="") as f:
            if a.format == "text":
                text = f.read()
                if a.chunk:
                    yield from chunks(text)
                else:
                    yield text
            else:
                for line in f:
                    if line.strip():
                        yield json.loads(line)[a.text_field]


def cmd_train(a):
    os.environ["RAYON_NUM_THREADS"] = str(a.threads)  # before tokenizers starts its pool
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    if a.pre_tokenizer == "llama3":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=a.vocab, special_tokens=a.special or [], show_progress=False,
                                  min_frequency=a.min_frequency, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    docs = list(documents(a))
    t0 = time.perf_counter()
    tok.train_from_iterator(docs, trainer)
    dt = time.perf_counter() - t0
    os.makedirs(a.out, exist_ok=True)
    tok.save(os.path.join(a.out, "tokenizer.json"))
    print("hf_train_seconds %.4f" % dt)


def cmd_encode(a):
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(a.tokenizer)
    tok.encode_special_tokens = True  # text is data, as trainrun's default
    with open(a.texts, encoding="utf-8") as f:
        texts = json.load(f)
    ids = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    out = {"ids": ids, "decoded": [tok.decode(i, skip_special_tokens=False) for i in ids]}
    if a.transformers:
        from transformers import AutoTokenizer
        at = AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(a.tokenizer)))
        out["transformers_ids"] = [at(t, add_special_tokens=False)["input_ids"] for t in texts]
        out["eos_token"] = at.eos_token
        if at.chat_template:
            msgs = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]
            out["chat"] = at.apply_chat_template(msgs, tokenize=False)
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False)


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("train")
    t.add_argument("--input", nargs="+", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--vocab", type=int, required=True)
    t.add_argument("--format", default="text", choices=["text", "jsonl"])
    t.add_argument("--text-field", default="text")
    t.add_argument("--pre-tokenizer", default="llama3", choices=["llama3", "gpt2"])
    t.add_argument("--special", nargs="*")
    t.add_argument("--min-frequency", type=int, default=0)
    t.add_argument("--threads", type=int, default=1)
    t.add_argument("--chunk", action="store_true")
    e = sub.add_parser("encode")
    e.add_argument("--tokenizer", required=True)
    e.add_argument("--texts", required=True)
    e.add_argument("--out", required=True)
    e.add_argument("--transformers", action="store_true")
    a = p.parse_args()
    {"train": cmd_train, "encode": cmd_encode}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
