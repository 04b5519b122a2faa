"""A GGUF file's tokenizer as a `transformers` fast tokenizer, built from the file's vocabulary,
merges, token types, special ids and chat template with the `tokenizers` library.

Byte-level BPE (`tokenizer.ggml.model = "gpt2"`: Llama-architecture files such as SmolLM2's and
Qwen2's). The pre-tokenizer follows `tokenizer.ggml.pre`: GPT-2's byte-level split, or Qwen2's
regex. Tokens the file marks as control (type 3) are special tokens, user-defined ones (type 4)
added tokens, so both stay whole, as llama.cpp and transformers treat them. (transformers can
read this too, `AutoTokenizer.from_pretrained(dir, gguf_file=...)`, but through PyTorch.)
"""

from __future__ import annotations

_BYTE_LEVEL_PRE = ("default", "gpt2", "smollm")
_SPLIT_PRE = ("qwen2",)


def gguf_tokenizer(fields: dict, source: str):
    """fields: GGUF key -> value (`tokenizer.*`). -> PreTrainedTokenizerFast."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    kind, pre = fields["tokenizer.ggml.model"], fields.get("tokenizer.ggml.pre", "default")
    if kind != "gpt2" or pre not in _BYTE_LEVEL_PRE + _SPLIT_PRE:
        raise ValueError(f"{source}: GGUF tokenizer {kind!r} (pre-tokenizer {pre!r}) is not "
                         f"supported (byte-level BPE with pre-tokenizer {_BYTE_LEVEL_PRE + _SPLIT_PRE})")
    tokens = fields["tokenizer.ggml.tokens"]
    types = fields.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())

    def spelled(token: str) -> str:  # a token outside the byte alphabet, in it
        return token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode())

    vocab = {spelled(t): i for i, t in enumerate(tokens)}
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    if pre in _SPLIT_PRE:
        from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                            for t, ty in zip(tokens, types) if ty == 3 and set(t) <= alphabet])
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, ty in zip(tokens, types) if ty == 4])
    names = {"bos": "bos_token", "eos": "eos_token", "unknown": "unk_token", "padding": "pad_token"}
    special = {hf: tokens[fields[f"tokenizer.ggml.{key}_token_id"]] for key, hf in names.items()
               if f"tokenizer.ggml.{key}_token_id" in fields}
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=fields.get("tokenizer.chat_template"),
                                   **special)
