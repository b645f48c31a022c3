"""Peer-side script (llama-cpp-python venv; imports nothing of moetier): llama.cpp's tokenizer
on texts, so the benchmark can check that both systems see the same prompt tokens.

    python gguf_tokenize.py MODEL.gguf < texts.json     (a JSON list of strings)

prints a JSON list of token id lists (no BOS added unless the GGUF asks for it, as a
completion request tokenizes).
"""

from __future__ import annotations

import json
import sys


def main() -> int:
    import llama_cpp

    texts = json.load(sys.stdin)
    model = llama_cpp.Llama(model_path=sys.argv[1], vocab_only=True, verbose=False)
    print(json.dumps([model.tokenize(t.encode("utf-8"), add_bos=True, special=True) for t in texts]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
