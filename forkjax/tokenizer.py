"""Tokenizers: a byte-level one for the built-in models, HF's for checkpoint directories."""

from __future__ import annotations

import os


class ByteTokenizer:
    """UTF-8 bytes are ids 0..255; then BOS and EOS. No files, no download."""

    def __init__(self):
        self.bos_token_id = 256
        self.eos_token_id = 257
        self.vocab_size = 258

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return ([self.bos_token_id] if add_bos else []) + list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """`transformers.AutoTokenizer` over the checkpoint directory (local files only), or a
    transformers tokenizer object already built (a GGUF file's)."""

    def __init__(self, path_or_tokenizer):
        if isinstance(path_or_tokenizer, str):
            from transformers import AutoTokenizer
            path_or_tokenizer = AutoTokenizer.from_pretrained(path_or_tokenizer, local_files_only=True)
        self.tok = path_or_tokenizer
        self.bos_token_id = self.tok.bos_token_id
        self.eos_token_id = self.tok.eos_token_id
        self.vocab_size = len(self.tok)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_bos)

    def decode(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(model_dir: str):
    """The checkpoint's tokenizer, or None when the directory ships none."""
    names = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")
    if not any(os.path.exists(os.path.join(model_dir, n)) for n in names):
        return None
    return HFTokenizer(model_dir)
