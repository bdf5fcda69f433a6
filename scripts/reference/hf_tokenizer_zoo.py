#!/usr/bin/env python3
"""Tokenizers of every family causal LMs ship, made offline for trainrun's tests.

  make   --dir D --corpus FILE [--vocab N]
         trains on the corpus and writes D/<name>.json for each of
           llama2    SentencePiece BPE (byte_fallback) -> transformers' LlamaConverter, legacy
                     (normalizer Prepend("▁") + Replace(" ", "▁"), no pre-tokenizer), <s> template
           mistral   the same model, legacy=False (Metaspace prepend_scheme "first", split false)
           gemma     SentencePiece BPE -> GemmaConverter (Replace normalizer, Split(" ", merged_with_previous))
           t5        SentencePiece Unigram -> T5Converter (Precompiled charsmap, Strip, Replace regex, Metaspace)
           unigram_bf  a Unigram with byte_fallback (HF tokenizers directly), Metaspace + ByteFallback decoders
           qwen2     byte-level BPE with NFC and Qwen2's regex (transformers' Qwen2Converter pipeline)
           unk_bytes byte-level BPE whose vocab lacks byte symbols, unk_token + fuse_unk
           charbpe   character BPE: NFKC + Lowercase + Strip, WhitespaceSplit/Punctuation/Digits,
                     continuing_subword_prefix, end_of_word_suffix, unk; added tokens with lstrip,
                     rstrip, single_word, normalized
           split_<behavior>[_inv]  Split(regex) with each behavior (and invert) before Metaspace
  encode --tokenizer T... --texts texts.json [--out out.json] [--ids-only]   (several T: each X.json -> X.out.json)
         {"plain": ids, special tokens as text; "special": special tokens matched;
          "with_special": add_special_tokens=True (post-processor); "decoded": decode(plain);
          "lists": random id lists, "lists_decoded": their decode; --ids-only: only "plain" and "special", for long texts}
"""
import argparse
import json
import os
import random
import sys
import tempfile

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")


def spm_train(corpus, prefix, model_type, vocab, **kw):
    import sentencepiece as spm
    spm.SentencePieceTrainer.train(input=corpus, model_prefix=prefix, model_type=model_type, vocab_size=vocab,
                                   character_coverage=0.9995, minloglevel=2, num_threads=1,
                                   train_extremely_large_corpus=False, **kw)
    return prefix + ".model"


def save_fast(fast, path):
    fast.backend_tokenizer.save(path)


def make_spm(a, tmp):
    from transformers import GemmaTokenizerFast, LlamaTokenizerFast, T5TokenizerFast
    # Llama 2 / Mistral: BPE, byte fallback, digits split, whitespace-only pieces allowed.
    llama = spm_train(a.corpus, os.path.join(tmp, "llama"), "bpe", a.vocab, byte_fallback=True, split_digits=True,
                      allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
                      normalization_rule_name="identity")
    save_fast(LlamaTokenizerFast(vocab_file=llama, legacy=True, add_prefix_space=True, from_slow=True), os.path.join(a.dir, "llama2.json"))
    save_fast(LlamaTokenizerFast(vocab_file=llama, legacy=False, add_prefix_space=True, from_slow=True), os.path.join(a.dir, "mistral.json"))
    gemma = spm_train(a.corpus, os.path.join(tmp, "gemma"), "bpe", a.vocab, byte_fallback=True, split_digits=True,
                      allow_whitespace_only_pieces=True, remove_extra_whitespaces=False,
                      normalization_rule_name="identity", pad_id=0, eos_id=1, bos_id=2, unk_id=3,
                      user_defined_symbols=["<start_of_turn>", "<end_of_turn>"])
    save_fast(GemmaTokenizerFast(vocab_file=gemma, from_slow=True), os.path.join(a.dir, "gemma.json"))
    # Unigram with SentencePiece's default nmt_nfkc rule: a real precompiled charsmap.
    t5 = spm_train(a.corpus, os.path.join(tmp, "t5"), "unigram", a.vocab, pad_id=0, eos_id=1, unk_id=2, bos_id=-1)
    save_fast(T5TokenizerFast(vocab_file=t5, extra_ids=0, from_slow=True, legacy=True), os.path.join(a.dir, "t5.json"))
    # A Unigram with byte fallback, as HF tokenizers builds it.
    bf = spm_train(a.corpus, os.path.join(tmp, "ubf"), "unigram", a.vocab, byte_fallback=True,
                   normalization_rule_name="identity", remove_extra_whitespaces=False)
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=bf)
    vocab = [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]
    tok = Tokenizer(models.Unigram(vocab, unk_id=sp.unk_id(), byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(content=" ", left=1, right=0)])
    tok.add_special_tokens([AddedToken("<s>", special=True, normalized=False),
                            AddedToken("</s>", special=True, normalized=False)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[
        ("<s>", tok.token_to_id("<s>")), ("</s>", tok.token_to_id("</s>"))])
    tok.save(os.path.join(a.dir, "unigram_bf.json"))


def make_hf(a):
    # Qwen2: NFC, its regex, byte-level BPE.
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.train([a.corpus], trainers.BpeTrainer(vocab_size=a.vocab, show_progress=False,
                                              special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(os.path.join(a.dir, "qwen2.json"))

    # Byte-level BPE without the full byte alphabet: bytes the corpus lacks
    # (controls, most of 0x80-0xFF) have no symbol and encode to <unk>.
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.train([a.corpus], trainers.BpeTrainer(vocab_size=a.vocab, show_progress=False, special_tokens=["<unk>"],
                                              limit_alphabet=60))
    tok.save(os.path.join(a.dir, "unk_bytes.json"))

    # Character BPE with every knob the BPE model and the simple components have.
    tok = Tokenizer(models.BPE(unk_token="[UNK]", fuse_unk=False, continuing_subword_prefix="##",
                               end_of_word_suffix="</w>"))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase(),
                                           normalizers.Strip(left=True, right=True),
                                           normalizers.Replace(Regex(r"\d{4,}"), "<num>")])
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(),
                                                 pre_tokenizers.Punctuation(behavior="isolated"),
                                                 pre_tokenizers.Digits(individual_digits=True)])
    tok.decoder = decoders.Sequence([decoders.Replace("</w>", " "), decoders.Replace("##", ""), decoders.Fuse(),
                                     decoders.Strip(content=" ", left=0, right=1)])
    tok.train([a.corpus], trainers.BpeTrainer(vocab_size=a.vocab, show_progress=False, special_tokens=["[UNK]", "[CLS]", "[SEP]"],
                                              continuing_subword_prefix="##", end_of_word_suffix="</w>",
                                              limit_alphabet=150))
    tok.add_special_tokens([AddedToken("<mask>", lstrip=True, rstrip=False, special=True, normalized=False),
                            AddedToken("<tool>", rstrip=True, special=True, normalized=False)])
    tok.add_tokens([AddedToken("hello", single_word=True, normalized=True),
                    AddedToken("Ünï", normalized=True), AddedToken("[RAW]", normalized=False)])
    tok.post_processor = processors.BertProcessing(("[SEP]", tok.token_to_id("[SEP]")), ("[CLS]", tok.token_to_id("[CLS]")))
    tok.save(os.path.join(a.dir, "charbpe.json"))

    # Split with each behavior (and invert), then Metaspace; a Unigram model.
    for behavior in ("removed", "isolated", "merged_with_previous", "merged_with_next", "contiguous"):
        for invert in (False, True):
            tok = Tokenizer(models.Unigram())
            tok.pre_tokenizer = pre_tokenizers.Sequence([
                pre_tokenizers.Split(Regex(r"\s+|[,.;:!?]|\d"), behavior=behavior, invert=invert),
                pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=(behavior == "isolated"))])
            tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
            tok.train([a.corpus], trainers.UnigramTrainer(vocab_size=min(a.vocab, 600), show_progress=False,
                                                          special_tokens=["<unk>"], unk_token="<unk>"))
            tok.save(os.path.join(a.dir, "split_%s%s.json" % (behavior, "_inv" if invert else "")))


def cmd_make(a):
    os.makedirs(a.dir, exist_ok=True)
    if a.only in (None, "spm"):
        with tempfile.TemporaryDirectory() as tmp:
            make_spm(a, tmp)
    if a.only in (None, "hf"):
        make_hf(a)


def decode_or_none(tok, ids):
    # HF's Strip decoder panics on some token lists (an empty token with
    # stop > 0); those lists have no reference (None), the rest must match.
    try:
        return tok.decode(ids, skip_special_tokens=False)
    except BaseException:  # pyo3's PanicException derives from BaseException
        return None


def cmd_encode(a):
    with open(a.texts, encoding="utf-8") as f:
        texts = json.load(f)
    for path in a.tokenizer:
        encode_one(path, texts, a.out if len(a.tokenizer) == 1 else path[:-len(".json")] + ".out.json", a.ids_only)


def encode_one(path, texts, out_path, ids_only=False):
    tok = Tokenizer.from_file(path)
    out = {}
    tok.encode_special_tokens = True
    out["plain"] = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    tok.encode_special_tokens = False
    out["special"] = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    if ids_only:
        with open(out_path, "w", encoding="utf-8") as f:
            json.dump(out, f)
        return
    out["with_special"] = [tok.encode(t, add_special_tokens=True).ids for t in texts]
    out["decoded"] = [decode_or_none(tok, ids) for ids in out["plain"]]
    rng = random.Random(1234)
    n = tok.get_vocab_size(with_added_tokens=True)
    out["lists"] = [[rng.randrange(n) for _ in range(rng.randrange(1, 12))] for _ in range(200)]
    out["lists_decoded"] = [decode_or_none(tok, ids) for ids in out["lists"]]
    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(out, f, ensure_ascii=False)


def main():
    p = argparse.ArgumentParser()
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make")
    m.add_argument("--dir", required=True)
    m.add_argument("--corpus", required=True)
    m.add_argument("--vocab", type=int, default=1000)
    m.add_argument("--only", choices=["spm", "hf"], help="only the SentencePiece conversions, or only the tokenizers-built ones")
    e = sub.add_parser("encode")
    e.add_argument("--tokenizer", required=True, nargs="+", help="several: each X.json gets X.out.json")
    e.add_argument("--texts", required=True)
    e.add_argument("--out")
    e.add_argument("--ids-only", action="store_true", help='only the "plain" and "special" ids')
    a = p.parse_args()
    {"make": cmd_make, "encode": cmd_encode}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
