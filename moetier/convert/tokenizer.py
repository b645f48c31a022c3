"""The project's own tokenizer: a byte-level BPE trained (deterministically) from the plain
English text shipped in moetier/data/corpus-*.txt, with special tokens for BOS/EOS and chat roles.

Synth checkpoints ship it as tokenizer.json + tokenizer_config.json (Hugging Face layout,
with a jinja2 chat template) + generation_config.json. Trained tokenizers are cached on
disk (keyed by corpus, vocab size and tokenizers version) and in memory, so synth is fast.
"""

from __future__ import annotations

import contextlib
import json
from importlib import resources
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from moetier.weights.format import atomic_write, xxh3_hex

BOS = "<|bos|>"
EOS = "<|eos|>"
PAD = "<|pad|>"
END = "<|end|>"  # closes every chat message; generation stops on it too
SPECIAL_TOKENS = [BOS, EOS, PAD, "<|system|>", "<|user|>", "<|assistant|>", END]
BOS_ID, EOS_ID, PAD_ID, END_ID = 0, 1, 2, 6
STOP_IDS = [EOS_ID, END_ID]

# Hugging Face semantics: `messages` (role, content; assistant `tool_calls`, tool `tool_call_id`),
# `tools` (transformers' list of {"type": "function", "function": {...}}), `add_generation_prompt`,
# `bos_token`. Without tools it renders exactly as the plain role template. Tools and tool calls
# use the Hermes / Qwen3 format: the tool list in the system turn, each call as
# <tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>, tool results as user turns in
# <tool_response> tags; so the gateway parses the demo model's calls with its qwen3 format.
# The fixed instructions come before the tool list, so that requests with different tools
# share the longest prefix (the prefix cache serves it).
TOOLS_PREAMBLE = (
    "# Tools\n\nYou may call one or more functions to assist with the user query. For each function call, "
    "return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n"
    '<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>\n\n'
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_INSTRUCTION = "\n</tools>"
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if tools %}"
    "{{- '<|system|>\\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '" + TOOLS_PREAMBLE.replace("\n", "\\n") + "' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '" + TOOLS_INSTRUCTION.replace("\n", "\\n") + "<|end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and tools and loop.first %}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|user|>\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|end|>\\n' }}"
    "{%- elif message['role'] == 'assistant' and message.tool_calls is defined and message.tool_calls %}"
    "{{- '<|assistant|>\\n' + message['content'] }}"
    "{%- for call in message.tool_calls %}"
    "{%- set fn = call.function if call.function is defined else call %}"
    "{%- if message['content'] or not loop.first %}{{- '\\n' }}{%- endif %}"
    "{{- '<tool_call>\\n{\"name\": ' + (fn.name | tojson) + ', \"arguments\": ' }}"
    "{{- fn.arguments if fn.arguments is string else (fn.arguments | tojson) }}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|end|>\\n' }}"
    "{%- else %}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] + '<|end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|assistant|>\\n' }}{%- endif %}"
)

_memo: dict[int, str] = {}


def corpus_texts() -> list[str]:
    """The shipped training text, one string per file, in name order."""
    root = resources.files("moetier") / "data"
    files = sorted((p for p in root.iterdir() if p.name.startswith("corpus-") and p.name.endswith(".txt")),
                   key=lambda p: p.name)
    return [p.read_text(encoding="utf-8") for p in files]


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "moetier" / "tokenizers"


def _train(vocab_size: int, texts: list[str]) -> str:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok.to_str()


def train_tokenizer_json(vocab_size: int, texts: list[str]) -> str:
    """tokenizer.json text of the project tokenizer trained on other text (the trained demo
    model's, scripts/train_demo.py): same special tokens and pre-tokenizer, deterministic."""
    return _train(vocab_size, texts)


def tokenizer_json(vocab_size: int, cache_dir: Path | None = None) -> str:
    """tokenizer.json text of the project tokenizer with at most `vocab_size` tokens.

    The corpus may support fewer merges than asked for; the result is then smaller (the
    model's vocab may exceed the tokenizer's). Same inputs -> same bytes.
    """
    if vocab_size in _memo:
        return _memo[vocab_size]
    texts = corpus_texts()
    key = xxh3_hex(json.dumps([texts, vocab_size, SPECIAL_TOKENS, tokenizers.__version__]).encode())
    cache = (cache_dir or default_cache_dir()) / f"bpe-{vocab_size}-{key}.json"
    try:
        text = cache.read_text(encoding="utf-8")
    except OSError:
        text = _train(vocab_size, texts)
        with contextlib.suppress(OSError):  # an unwritable cache only costs a retrain
            cache.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(cache, text.encode())
    _memo[vocab_size] = text
    return text


def load_tokenizer(vocab_size: int) -> Tokenizer:
    return Tokenizer.from_str(tokenizer_json(vocab_size))


def tokenizer_size(vocab_size: int) -> int:
    return load_tokenizer(vocab_size).get_vocab_size()


def tokenizer_files(vocab_size: int, model_max_length: int, *, tokenizer_json_text: str | None = None) -> dict[str, bytes]:
    """tokenizer.json, tokenizer_config.json and generation_config.json for a synth checkpoint
    (`tokenizer_json_text`: another tokenizer.json of the same special tokens, e.g. a trained one)."""
    cfg: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    gen = {"bos_token_id": BOS_ID, "eos_token_id": STOP_IDS, "pad_token_id": PAD_ID, "do_sample": False}
    return {
        "tokenizer.json": (tokenizer_json_text or tokenizer_json(vocab_size)).encode(),
        "tokenizer_config.json": (json.dumps(cfg, indent=2) + "\n").encode(),
        "generation_config.json": (json.dumps(gen, indent=2) + "\n").encode(),
    }
