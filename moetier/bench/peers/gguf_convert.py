"""Peer-side script (llama-cpp-python venv; imports nothing of moetier): the llama.cpp
converter bundled in the sdist, convert_hf_to_gguf.py, with a pre-tokenizer fallback.

    python gguf_convert.py LLAMA_CPP_DIR HF_DIR --outfile OUT.gguf --outtype bf16

The converter identifies a BPE tokenizer's pre-tokenizer by hashing how it tokenizes a fixed
text, and refuses ("BPE pre-tokenizer was not recognized") a tokenizer it has never seen.
Upstream's remedy is to register the model in convert_hf_to_gguf_update.py, which downloads
it from the Hub. The synth checkpoints' tokenizer is the project's own BPE: unseen by the
converter, but its pre-tokenizer is exactly GPT-2's (tokenizers' ByteLevel with the GPT-2
split regex, no prefix space, no other step), which llama.cpp knows as "gpt-2". So where the
hash is unknown *and* tokenizer.json's pre_tokenizer is that, this names "gpt-2"; anything
else is left to fail as it would. The benchmark then checks that llama.cpp tokenizes its
prompts exactly as moetier does.
"""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

GPT2_BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}


def is_gpt2_pre_tokenizer(tokenizer_json: Path) -> bool:
    pre = json.loads(tokenizer_json.read_text(encoding="utf-8")).get("pre_tokenizer") or {}
    return all(pre.get(k) == v for k, v in GPT2_BYTE_LEVEL.items())


def main() -> None:
    llama_cpp_dir = Path(sys.argv[1])
    sys.argv = [str(llama_cpp_dir / "convert_hf_to_gguf.py"), *sys.argv[2:]]
    sys.path[:0] = [str(llama_cpp_dir), str(llama_cpp_dir / "gguf-py")]
    import convert_hf_to_gguf
    from conversion.base import TextModel

    original = TextModel.get_vocab_base_pre

    def with_fallback(self: TextModel, tokenizer: object) -> str:
        try:
            return original(self, tokenizer)
        except NotImplementedError:
            if not is_gpt2_pre_tokenizer(Path(self.dir_model) / "tokenizer.json"):
                raise
            logging.getLogger("gguf_convert").warning(
                "unknown BPE tokenizer with GPT-2's byte-level pre-tokenizer: writing tokenizer.ggml.pre = gpt-2")
            return "gpt-2"

    TextModel.get_vocab_base_pre = with_fallback
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
