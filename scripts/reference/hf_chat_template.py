"""Chat-template references for tests/test_chat_template.cpp, from transformers 4.44.2 itself.

  render CASES.json OUT.json
      CASES: [{"template": str, "vars": {...}}]; renders each with transformers' own Jinja
      environment (PreTrainedTokenizerBase._compile_jinja_template: sandboxed, trim_blocks,
      lstrip_blocks, its tojson and raise_exception). OUT: [str | {"error": str}].
  tokenizer DIR
      Trains a small byte-level BPE tokenizer offline with every special token the fixture
      templates use, and saves it (tokenizer.json + tokenizer_config.json) to DIR.
  apply DIR CASES.json OUT.json
      CASES: [{"chat_template": str, "messages": [...], "add_generation_prompt": bool, "assistant_mask": bool}];
      tokenizer.apply_chat_template(tokenize=True) with the tokenizer in DIR. OUT: [ids | {"ids", "mask"}
      (assistant_mask: return_assistant_tokens_mask, for {% generation %} templates) | {"error"}].

strftime_now is given to templates as transformers 4.45 added it (4.44.2 lacks it), so
Llama 3.2's date line is today's in both renderers.
"""
import datetime
import json
import sys

from transformers import PreTrainedTokenizerBase

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<|eom_id|>", "<|python_tag|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>", "<s>", "</s>",
            "[INST]", "[/INST]", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<|system|>", "<|user|>",
            "<|assistant|>", "<|end|>", "<unk>"]


def compile_template(src, tok=None):
    # lru_cache'd per (tokenizer, source): apply_chat_template then finds this one.
    t = PreTrainedTokenizerBase._compile_jinja_template(tok, src)
    t.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return t


def render(cases_path, out_path):
    out = []
    for c in json.load(open(cases_path)):
        try:
            out.append(compile_template(c["template"]).render(**c["vars"]))
        except Exception as e:  # noqa: BLE001 - the message is the result
            out.append({"error": f"{type(e).__name__}: {e}"})
    json.dump(out, open(out_path, "w"))


def make_tokenizer(d):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["Hello there! How are you today? I am fine, thank you.", "The quick brown fox jumps over the lazy dog.",
              "日本語のテキスト 東京 中文 ", "def f(x):\n    return x * 2\n", "  leading spaces and\ttabs\r\n"] * 50
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                   unk_token="<unk>")
    fast.save_pretrained(d)


def apply(d, cases_path, out_path):
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(d)
    out = []
    for c in json.load(open(cases_path)):
        try:
            compile_template(c["chat_template"], tok)  # primes the lru_cache with strftime_now
            if c.get("assistant_mask"):
                r = tok.apply_chat_template(c["messages"], chat_template=c["chat_template"], tokenize=True,
                                            return_dict=True, return_assistant_tokens_mask=True)
                out.append({"ids": r["input_ids"], "mask": r["assistant_masks"]})
            else:
                out.append(tok.apply_chat_template(c["messages"], chat_template=c["chat_template"], tokenize=True,
                                                   add_generation_prompt=c["add_generation_prompt"]))
        except Exception as e:  # noqa: BLE001
            out.append({"error": f"{type(e).__name__}: {e}"})
    json.dump(out, open(out_path, "w"))


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "render":
        render(sys.argv[2], sys.argv[3])
    elif cmd == "tokenizer":
        make_tokenizer(sys.argv[2])
    elif cmd == "apply":
        apply(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        sys.exit(f"unknown command {cmd}")
