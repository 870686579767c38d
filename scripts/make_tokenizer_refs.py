#!/usr/bin/env python3
"""Writes the reference ids the tokenizer tests compare against.

Runs Hugging Face `tokenizers` (and transformers, for chat templates) on the real tokenizer files
fetched by scripts/fetch_tokenizers.sh, over tests/data/tokenizer_corpus.json. Output:
tests/data/tokenizer_ids_<name>.json with, per corpus entry, the ids without and with the
tokenizer's special-token post-processing, and for Qwen3 a few rendered chat conversations.

usage: python3 scripts/make_tokenizer_refs.py [--cache .cache/tokenizers] [--out tests/data]
"""
import argparse
import json
import os

from tokenizers import Tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello, how can I help?"},
     {"role": "user", "content": "Tell me a joke.\nMake it short."}],
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cache", default=".cache/tokenizers")
    ap.add_argument("--out", default="tests/data")
    args = ap.parse_args()
    corpus = json.load(open(os.path.join(args.out, "tokenizer_corpus.json"), encoding="utf-8"))
    import tokenizers
    for name in ("qwen3", "deepseek_v3"):
        path = os.path.join(args.cache, name)
        tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
        entries = []
        for text in corpus:
            plain = tok.encode(text, add_special_tokens=False).ids
            with_special = tok.encode(text, add_special_tokens=True).ids
            entries.append({"text": text, "ids": plain, "ids_with_special": with_special,
                            "decoded": tok.decode(plain, skip_special_tokens=False)})
        result = {"tokenizers_version": tokenizers.__version__, "entries": entries}
        try:
            import transformers
            from transformers import AutoTokenizer
            hf = AutoTokenizer.from_pretrained(path)
            chats = []
            for conv in CONVERSATIONS:
                for gen in (False, True):
                    text = hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=gen)
                    chats.append({"messages": conv, "add_generation_prompt": gen, "text": text})
            result["chat"] = chats
            result["transformers_version"] = transformers.__version__
        except Exception as exc:  # a template transformers cannot render is recorded, not fatal
            result["chat_error"] = f"{type(exc).__name__}: {exc}"
        out = os.path.join(args.out, f"tokenizer_ids_{name}.json")
        with open(out, "w", encoding="utf-8") as f:
            json.dump(result, f, ensure_ascii=False, indent=1)
        print(f"wrote {out}: {len(entries)} entries, {len(result.get('chat', []))} chats")


if __name__ == "__main__":
    main()
