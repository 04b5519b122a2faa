"""Write SmolLM2-135M-Instruct's tokenizer, exactly as `python -m forkjax.serve --model smollm2-135m`
builds it from the GGUF file (forkjax/models/gguf_tokenizer.py), as a transformers tokenizer
directory, so lm_eval's `tokenizer=DIR,tokenizer_backend=huggingface` can count tokens without a
model hub (lm_eval's `remote` backend needs GET /tokenizer_info, which forkjax does not serve).

    .venv/bin/python scripts/lm_eval/export_tokenizer.py OUT_DIR
"""

import sys

from forkjax.models.gguf import GGUFCheckpoint, packaged_path


def main(out_dir: str):
    tok = GGUFCheckpoint(packaged_path("smollm2-135m")).tokenizer().tok
    tok.save_pretrained(out_dir)
    ids = tok.encode("The capital of France is Paris", add_special_tokens=True)
    print(f"saved to {out_dir}: bos={tok.bos_token!r} eos={tok.eos_token!r} "
          f"'The capital of France is Paris' -> {ids}")


if __name__ == "__main__":
    main(sys.argv[1])
