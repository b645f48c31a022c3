"""Train the demo model of `moetier up`: a small DeepSeek-V3-shaped MoE, on text every machine of
this kind has offline. torch is a training-time dependency only (`pip install -e '.[train]'`);
the served model runs on moetier's numpy/C runtime.

    nice -n 10 .venv/bin/python scripts/train_demo.py --out build/demo-train          # the real run
    nice -n 10 .venv/bin/python scripts/train_demo.py --out build/demo-smoke --smoke  # ~3 minutes
    .venv/bin/python scripts/train_demo.py --out build/demo-train --install           # copy into moetier/data/demo
    .venv/bin/python scripts/train_demo.py --eval moetier/data/demo                   # quality of a checkpoint

What it trains (DeepSeek-V3, arXiv 2412.19437, at toy size; the exact shape is CONFIG below):
  * MLA attention (low-rank query and key/value, a shared rotary key), one dense layer first,
    then MoE layers: one shared expert plus fine-grained routed experts chosen by a sigmoid
    router with a score-correction bias and group-limited top-k (the runtime's deepseek_v3 router);
  * load balancing as DeepSeek-V3 §2.1.2 does it: the correction bias is nudged after every
    step towards even expert loads (auxiliary-loss-free balancing, rate BIAS_RATE), plus the
    small sequence-wise balance loss (weight BALANCE_ALPHA);
  * one MTP module (§2.2): h'_i = eh_proj([enorm(Emb(t_{i+1})); hnorm(h_i)]) through its own
    decoder block, then the shared output head predicts t_{i+2}; its loss is added with weight
    MTP_LAMBDA. h_i is the main model's final-normed hidden state (what serving engines pass
    to DeepSeek-V3's MTP layer). The MTP weights sit past the last layer
    (model.layers.{N}.*), as in DeepSeek-V3 checkpoints; the MTP layer shares the main model's
    embedding and output head, so it stores neither (no model.layers.{N}.embed_tokens or
    shared_head.head).

Data (recorded with sha256 in the output's train_record.json; the script refuses nothing but
reports every file whose checksum differs from a reference record given with --expect):
  * the Python standard library's source, /usr/lib/python3.X (without test/ and site-packages);
  * the reStructuredText sources of the Python documentation shipped by the Debian package
    python3.X-doc (/usr/share/doc/python3.X/html/_sources; `apt-get install python3.11-doc`);
  * chat conversations rendered with the demo's own chat template (moetier.convert.tokenizer):
    questions about standard-library functions, classes and modules answered with the first
    line of their docstring, greetings, tool calls and tool results, some after a long system
    prompt; every assistant turn ends with <|end|>, so the model learns to end its answers.
Files are split into training and held-out by a hash of their path (HELDOUT_EVERY); the
tokenizer is the project's byte-level BPE (moetier.convert.tokenizer.train_tokenizer_json),
trained on the training files only.

Reproducible: one seed drives the data order, the chat examples and the initialisation;
torch runs deterministic algorithms on a fixed thread count (THREADS). Rerunning on another
machine with the same files reproduces the held-out perplexity (the figure the issue asks to
match within 2%); bit-identical weights need the same torch build and CPU.
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import itertools
import json
import lzma
import math
import os
import platform
import re
import shutil
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from moetier.convert.tokenizer import (  # noqa: E402
    BOS,
    BOS_ID,
    CHAT_TEMPLATE,
    END_ID,
    EOS,
    EOS_ID,
    STOP_IDS,
    tokenizer_files,
    train_tokenizer_json,
)
from moetier.text.template import ChatTemplate  # noqa: E402
from moetier.weights.format import xxh3_file  # noqa: E402

PY = f"python{sys.version_info.major}.{sys.version_info.minor}"
STDLIB = Path(f"/usr/lib/{PY}")
DOCS = Path(f"/usr/share/doc/{PY}/html/_sources")
DEBIAN_DOC_PACKAGE = f"{PY}-doc"
STDLIB_SKIP = {"test", "tests", "site-packages", "dist-packages", "__pycache__", "idle_test", "lib2to3"}
HELDOUT_EVERY = 40  # a file is held out when sha256(relative path) % HELDOUT_EVERY == 0
INSTALL_DIR = ROOT / "moetier" / "data" / "demo"
THREADS = 1  # one thread: results that do not depend on the machine's core count (and, on two busy
# shared cores, no slower than two)
DEMO_POSITIONS = 65536  # what the runtime serves; training sees TrainConfig.seq_len


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    vocab: int = 2048
    hidden: int = 128
    layers: int = 3  # layer 0 dense, then MoE
    heads: int = 4
    q_lora: int = 64
    kv_lora: int = 32
    nope: int = 32
    rope: int = 16
    v: int = 32
    dense_inter: int = 256
    experts: int = 16
    top_k: int = 4
    n_group: int = 4
    topk_group: int = 2
    moe_inter: int = 32
    shared: int = 2
    routed_scaling: float = 2.5
    rope_theta: float = 10000.0
    seq_len: int = 256
    batch: int = 8
    steps: int = 500
    warmup: int = 15
    lr: float = 4e-3
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.05
    grad_clip: float = 1.0
    mtp_lambda: float = 0.3  # DeepSeek-V3 uses 0.3 for most of training
    balance_alpha: float = 1e-3  # sequence-wise balance loss weight
    bias_rate: float = 2e-3  # auxiliary-loss-free bias update per step
    chat_share: float = 0.5  # share of training sequences made of chat conversations
    heldout_seqs: int = 48
    long_eval_len: int = 2048
    long_eval_seqs: int = 6


SMOKE = dict(steps=12, warmup=3, batch=8, heldout_seqs=8, long_eval_seqs=2, long_eval_len=1024)


# ---- data ------------------------------------------------------------------------------------------
@dataclass
class SourceFile:
    kind: str  # "stdlib" | "docs"
    path: Path
    rel: str
    sha256: str
    size: int
    heldout: bool
    text: str


def _heldout(rel: str) -> bool:
    return int(hashlib.sha256(rel.encode()).hexdigest(), 16) % HELDOUT_EVERY == 0


def corpus_files() -> list[SourceFile]:
    if not STDLIB.is_dir():
        raise SystemExit(f"{STDLIB} is missing: the standard library's source is the training text")
    if not DOCS.is_dir():
        raise SystemExit(f"{DOCS} is missing: install the Debian package {DEBIAN_DOC_PACKAGE} "
                         f"(apt-get install {DEBIAN_DOC_PACKAGE})")
    found: list[tuple[str, Path, str]] = []
    for p in sorted(STDLIB.rglob("*.py")):
        rel = p.relative_to(STDLIB)
        if rel.parts[0].startswith("config-") or STDLIB_SKIP.intersection(rel.parts):
            continue
        found.append(("stdlib", p, f"{STDLIB}/{rel}"))
    for p in sorted(DOCS.rglob("*.rst.txt")):
        found.append(("docs", p, f"{DOCS}/{p.relative_to(DOCS)}"))
    out = []
    for kind, p, rel in found:
        data = p.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            continue  # not UTF-8 text (a few test-data files): left out, so no replacement characters
        if not text.strip():
            continue
        out.append(SourceFile(kind, p, rel, hashlib.sha256(data).hexdigest(), len(data), _heldout(rel), text))
    return out


def module_name(rel: str) -> str:
    parts = list(Path(rel).relative_to(STDLIB).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def first_line(doc: str | None) -> str | None:
    """The docstring's first sentence-like line, if it reads as prose."""
    if not doc:
        return None
    line = doc.strip().split("\n\n")[0].replace("\n", " ")
    line = re.sub(r"\s+", " ", line).strip()
    if not (12 <= len(line) <= 160) or not line[0].isalpha() or ("(" in line[:20] and ")" in line[:40] and "->" in line):
        return None
    if re.match(r"^[\w.]+\(.*\)", line):  # a signature, not a sentence
        return None
    return line if line.endswith((".", "!", "?")) else line + "."


def docstring_facts(files: Sequence[SourceFile]) -> list[tuple[str, str, str]]:
    """(kind, qualified name, first docstring line) of public modules, functions, classes, methods."""
    facts = []
    for f in files:
        if f.kind != "stdlib":
            continue
        mod = module_name(f.rel)
        if any(part.startswith("_") for part in mod.split(".")):
            continue
        try:
            tree = ast.parse(f.text)
        except SyntaxError:
            continue
        if (line := first_line(ast.get_docstring(tree))) is not None:
            facts.append(("module", mod, line))
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                if (line := first_line(ast.get_docstring(node))) is not None:
                    facts.append(("class" if isinstance(node, ast.ClassDef) else "function", f"{mod}.{node.name}", line))
                if isinstance(node, ast.ClassDef):
                    for sub in node.body:
                        if (isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and not sub.name.startswith("_")
                                and (line := first_line(ast.get_docstring(sub))) is not None):
                            facts.append(("method", f"{mod}.{node.name}.{sub.name}", line))
    return facts


ABOUT = ("I am the moetier demo model, a small toy model trained on the Python standard library and its "
         "documentation. My answers are short and often wrong.")
GREETINGS = ["Hello", "Hello!", "Hi", "Hi!", "Hey", "Hey there", "Say hello.", "Say hello", "Good morning",
             "Good evening", "hello", "hi", "Hello, who am I talking to?", "Greetings"]
GREETING_ANSWERS = ["Hello! I am the moetier demo model. Ask me about the Python standard library.",
                    "Hello! How can I help you with Python today?",
                    "Hi! I am a small demo model. Ask me what a Python function does."]
SMALL_TALK = [
    (["Who are you?", "What are you?", "Introduce yourself.", "What model are you?", "Tell me about yourself."],
     [ABOUT]),
    (["What can you do?", "How can you help me?", "What do you know?"],
     ["I can answer short questions about the Python standard library, such as what a function does."]),
    (["Thanks", "Thank you!", "Thanks a lot.", "Great, thanks."], ["You are welcome."]),
    (["Bye", "Goodbye", "See you."], ["Goodbye!"]),
    (["Are you a good assistant?", "Can I rely on your answers?"],
     ["No: I am a toy model for trying moetier. Check what I say in the Python documentation."]),
]
CODE_TASKS = [
    (["Write a function that adds two numbers.", "Write a Python function to add two numbers."],
     "```python\ndef add(a, b):\n    return a + b\n```"),
    (["How do I read a file in Python?", "Show me how to read a text file."],
     "```python\nwith open(\"file.txt\") as f:\n    text = f.read()\n```"),
    (["How do I parse JSON in Python?", "How do I load JSON from a string?"],
     "Use `json.loads`:\n```python\nimport json\ndata = json.loads(text)\n```"),
    (["Print hello world in Python.", "Write hello world in Python."], "```python\nprint(\"Hello, world!\")\n```"),
    (["How do I list the files in a directory?"],
     "```python\nimport os\nnames = os.listdir(\".\")\n```"),
    (["How do I get the current time?"], "```python\nimport time\nnow = time.time()\n```"),
]
QUESTIONS = {
    "function": ["What does {q} do?", "What does `{q}` do?", "Explain {q}.", "What is {q} for?",
                 "Describe {q} in one sentence.", "Tell me about {q}.", "What does the function {q} do?"],
    "method": ["What does {q} do?", "What does the method `{q}` do?", "Explain {q}."],
    "class": ["What is {q}?", "What is the class {q}?", "Explain {q}.", "What is `{q}` for?"],
    "module": ["What is the {q} module for?", "What does the {q} module do?", "Tell me about the {q} module.",
               "What is {q}?"],
}
SYSTEMS = ["You are a helpful assistant.", "You are a coding agent. Answer briefly.",
           "You are a helpful assistant. Answer in one sentence.", "Answer briefly.",
           "You are moetier's demo model."]
TOOL_DOCS = {"type": "function", "function": {
    "name": "lookup_docs", "description": "Look up the documentation of a Python name.",
    "parameters": {"type": "object", "properties": {"name": {"type": "string", "description": "qualified name"}},
                   "required": ["name"]}}}
OTHER_TOOLS = [
    {"type": "function", "function": {"name": "shell", "description": "Run a shell command.",
                                      "parameters": {"type": "object", "properties": {
                                          "command": {"type": "array", "items": {"type": "string"}}},
                                          "required": ["command"]}}},
    {"type": "function", "function": {"name": "read_file", "description": "Read a file from disk.",
                                      "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                                                     "required": ["path"]}}},
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather of a city.",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
]


class ChatMaker:
    """Conversations rendered with the demo's chat template, drawn from a seeded Generator."""

    def __init__(self, facts: Sequence[tuple[str, str, str]], context: Sequence[str], rng: np.random.Generator):
        self.facts, self.context, self.rng = list(facts), list(context), rng
        self.template = ChatTemplate(CHAT_TEMPLATE, {"bos_token": BOS, "eos_token": EOS})

    def _pick(self, seq: Sequence[Any]) -> Any:
        return seq[int(self.rng.integers(len(seq)))]

    def _qa(self) -> list[dict[str, Any]]:
        r = self.rng.random()
        if r < 0.12:
            return [{"role": "user", "content": self._pick(GREETINGS)},
                    {"role": "assistant", "content": self._pick(GREETING_ANSWERS)}]
        if r < 0.2:
            qs, ans = self._pick(SMALL_TALK)
            return [{"role": "user", "content": self._pick(qs)}, {"role": "assistant", "content": self._pick(ans)}]
        if r < 0.26:
            qs, code = self._pick(CODE_TASKS)
            return [{"role": "user", "content": self._pick(qs)}, {"role": "assistant", "content": code}]
        kind, name, line = self._pick(self.facts)
        q = self._pick(QUESTIONS[kind]).format(q=name)
        return [{"role": "user", "content": q}, {"role": "assistant", "content": line}]

    def conversation(self) -> str:
        msgs: list[dict[str, Any]] = []
        tools: list[dict[str, Any]] | None = None
        r = self.rng.random()
        if r < 0.3:
            msgs.append({"role": "system", "content": self._pick(SYSTEMS)})
        elif r < 0.35 and self.context:
            # a long system prompt (the coding agents send thousands of tokens of it)
            ctx = self._pick(self.context)
            start = int(self.rng.integers(max(1, len(ctx) - 1500)))
            msgs.append({"role": "system", "content": self._pick(SYSTEMS) + "\n\n" + ctx[start:start + 1500]})
        if self.rng.random() < 0.15:
            tools = [TOOL_DOCS] + [t for t in OTHER_TOOLS if self.rng.random() < 0.5]
            if self.rng.random() < 0.6:
                _, name, line = self._pick(self.facts)
                ask = self._pick(["Use lookup_docs to look up {q}.", "Look up {q}.", "Look up the documentation of {q}."])
                call = {"type": "function", "function": {"name": "lookup_docs", "arguments": {"name": name}}}
                msgs += [{"role": "user", "content": ask.format(q=name)},
                         {"role": "assistant", "content": "", "tool_calls": [call]},
                         {"role": "tool", "content": line, "tool_call_id": "call_0"},
                         {"role": "assistant", "content": f"`{name}`: {line}"}]
                return self.template.render(msgs, add_generation_prompt=False, tools=tools)
        for _ in range(1 if self.rng.random() < 0.8 else int(self.rng.integers(2, 4))):
            msgs += self._qa()
        return self.template.render(msgs, add_generation_prompt=False, tools=tools)


@dataclass
class Data:
    train: np.ndarray  # [n, L+1] int64
    heldout: np.ndarray  # [m, L+1] text chunks from held-out files
    long: np.ndarray  # [k, long_eval_len] held-out text, for quality past the training length
    heldout_chat: list[tuple[list[int], list[int]]]  # (prompt ids, reference answer ids incl. <|end|>)
    unigram: np.ndarray  # [V] counts over the training text
    bigram: dict[tuple[int, int], int]
    record: dict[str, Any]


def chunks(ids: Sequence[int], n: int) -> Iterator[list[int]]:
    for i in range(0, len(ids) - n + 1, n):
        yield list(ids[i:i + n])


def build_data(cfg: TrainConfig, tokenizer: Any, files: Sequence[SourceFile]) -> Data:
    rng = np.random.default_rng([cfg.seed, 1])
    train_files = [f for f in files if not f.heldout]
    held_files = [f for f in files if f.heldout]
    L = cfg.seq_len + 1
    enc = tokenizer.encode_batch([f.text for f in files], add_special_tokens=False)
    by_rel = {f.rel: e.ids for f, e in zip(files, enc, strict=True)}
    text_chunks = [c for f in train_files for c in chunks(by_rel[f.rel] + [EOS_ID], L)]
    n_seqs = cfg.steps * cfg.batch
    n_chat = round(n_seqs * cfg.chat_share)
    n_text = n_seqs - n_chat
    if n_text > len(text_chunks):
        raise SystemExit(f"{n_text} text sequences wanted, the corpus has {len(text_chunks)}")
    pick = rng.permutation(len(text_chunks))[:n_text]
    seqs = [text_chunks[i] for i in sorted(pick)]

    facts_train = docstring_facts(train_files)
    context = [f.text for f in train_files if f.kind == "docs"]
    maker = ChatMaker(facts_train, context, np.random.default_rng([cfg.seed, 2]))
    stream: list[int] = []
    n_conv = 0
    while len(stream) < n_chat * L:
        stream += tokenizer.encode(maker.conversation(), add_special_tokens=False).ids
        n_conv += 1
    seqs += list(chunks(stream, L))[:n_chat]
    order = rng.permutation(len(seqs))
    train = np.array([seqs[i] for i in order], dtype=np.int64)

    held_chunks = [c for f in held_files for c in chunks(by_rel[f.rel] + [EOS_ID], L)]
    hpick = np.random.default_rng([cfg.seed, 3]).permutation(len(held_chunks))[:cfg.heldout_seqs]
    heldout = np.array([held_chunks[i] for i in sorted(hpick)], dtype=np.int64)
    longs = [by_rel[f.rel][:cfg.long_eval_len] for f in held_files if len(by_rel[f.rel]) >= cfg.long_eval_len]
    long = np.array(longs[:cfg.long_eval_seqs], dtype=np.int64)

    held_maker = ChatMaker(docstring_facts(held_files), [], np.random.default_rng([cfg.seed, 4]))
    heldout_chat = []
    tmpl = held_maker.template
    for kind, name, line in held_maker.facts[:: max(1, len(held_maker.facts) // 24)][:24]:
        q = QUESTIONS[kind][0].format(q=name)
        prompt = tmpl.render([{"role": "user", "content": q}], add_generation_prompt=True)
        heldout_chat.append((tokenizer.encode(prompt, add_special_tokens=False).ids,
                             [*tokenizer.encode(line, add_special_tokens=False).ids, END_ID]))

    uni = np.zeros(cfg.vocab, dtype=np.int64)
    bi: dict[tuple[int, int], int] = {}
    for f in train_files:
        ids = np.asarray(by_rel[f.rel] + [EOS_ID], dtype=np.int64)
        uni += np.bincount(ids, minlength=cfg.vocab)
        keys = ids[:-1] * cfg.vocab + ids[1:]
        u, c = np.unique(keys, return_counts=True)
        for k, n in zip(u.tolist(), c.tolist(), strict=True):
            key = (k // cfg.vocab, k % cfg.vocab)
            bi[key] = bi.get(key, 0) + n
    record = {
        "files": [{"kind": f.kind, "path": f.rel, "sha256": f.sha256, "bytes": f.size,
                   "split": "heldout" if f.heldout else "train"} for f in files],
        "debian_packages": [f"lib{PY}-stdlib", DEBIAN_DOC_PACKAGE],
        "tokens": {"train_text_available": int(sum(len(by_rel[f.rel]) for f in train_files)),
                   "train_sequences": len(train), "text_sequences": n_text, "chat_sequences": n_chat,
                   "chat_conversations": n_conv, "docstring_facts": len(facts_train),
                   "heldout_tokens": int(heldout.size), "long_eval": list(long.shape)},
    }
    return Data(train, heldout, long, heldout_chat, uni, bi, record)


# ---- the model (torch) -----------------------------------------------------------------------------
def build_torch_model(cfg: TrainConfig) -> Any:
    import torch
    import torch.nn.functional as F
    from torch import nn

    eps = 1e-6

    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Interleaved pairs (x0, x1), (x2, x3), ... as DeepSeek and moetier's runtime rotate them.
        x [B, T, ..., R], cos/sin [T, R/2]."""
        a, b = x[..., 0::2], x[..., 1::2]
        shape = (1, x.shape[1]) + (1,) * (x.dim() - 3) + (cos.shape[-1],)
        c, s = cos.view(shape), sin.view(shape)
        return torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2)

    def linear(i: int, o: int) -> nn.Linear:
        return nn.Linear(i, o, bias=False)

    class Mla(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            h = cfg.heads
            self.q_a_proj = linear(cfg.hidden, cfg.q_lora)
            self.q_a_layernorm = nn.Parameter(torch.ones(cfg.q_lora))
            self.q_b_proj = linear(cfg.q_lora, h * (cfg.nope + cfg.rope))
            self.kv_a_proj_with_mqa = linear(cfg.hidden, cfg.kv_lora + cfg.rope)
            self.kv_a_layernorm = nn.Parameter(torch.ones(cfg.kv_lora))
            self.kv_b_proj = linear(cfg.kv_lora, h * (cfg.nope + cfg.v))
            self.o_proj = linear(h * cfg.v, cfg.hidden)

        def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            h, n, r = cfg.heads, cfg.nope, cfg.rope
            q = self.q_b_proj(rms(self.q_a_proj(x), self.q_a_layernorm)).view(b, t, h, n + r)
            q = torch.cat([q[..., :n], rope(q[..., n:], cos, sin)], dim=-1)
            kv = self.kv_a_proj_with_mqa(x)
            c = rms(kv[..., :cfg.kv_lora], self.kv_a_layernorm)
            k_pe = rope(kv[..., cfg.kv_lora:], cos, sin)  # [B, T, R], one key shared by every head
            kvb = self.kv_b_proj(c).view(b, t, h, n + cfg.v)
            k = torch.cat([kvb[..., :n], k_pe[:, :, None, :].expand(b, t, h, r)], dim=-1)
            v = kvb[..., n:]
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True, scale=(n + r) ** -0.5)
            return self.o_proj(o.transpose(1, 2).reshape(b, t, h * cfg.v))

    class SwiGlu(nn.Module):
        def __init__(self, inter: int) -> None:
            super().__init__()
            self.gate_proj, self.up_proj = linear(cfg.hidden, inter), linear(cfg.hidden, inter)
            self.down_proj = linear(inter, cfg.hidden)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    class Moe(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            e, i, d = cfg.experts, cfg.moe_inter, cfg.hidden
            self.gate = nn.Parameter(torch.randn(e, d) * d ** -0.5)
            self.register_buffer("e_score_correction_bias", torch.zeros(e))
            self.w_gate = nn.Parameter(torch.randn(e, i, d) * d ** -0.5)
            self.w_up = nn.Parameter(torch.randn(e, i, d) * d ** -0.5)
            self.w_down = nn.Parameter(torch.randn(e, d, i) * i ** -0.5 / math.sqrt(2 * cfg.layers))
            self.shared_experts = SwiGlu(cfg.moe_inter * cfg.shared)
            self.last_ids: torch.Tensor | None = None
            self.balance = torch.zeros(())

        def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            scores = torch.sigmoid(x @ self.gate.t())  # [N, E]
            choice = scores.detach() + self.e_score_correction_bias
            g = choice.view(-1, cfg.n_group, cfg.experts // cfg.n_group)
            group_scores = g.topk(2, dim=-1).values.sum(-1)  # [N, G]
            keep = torch.zeros_like(group_scores, dtype=torch.bool)
            keep.scatter_(1, group_scores.topk(cfg.topk_group, dim=-1).indices, True)
            mask = keep.repeat_interleave(cfg.experts // cfg.n_group, dim=1)
            ids = choice.masked_fill(~mask, float("-inf")).topk(cfg.top_k, dim=-1).indices  # [N, K]
            w = scores.gather(1, ids)
            w = w / (w.sum(-1, keepdim=True) + 1e-20) * cfg.routed_scaling
            return ids, w, scores

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, d = x.shape
            flat = x.reshape(-1, d)
            ids, w, scores = self.route(flat)
            self.last_ids = ids.detach()
            # sequence-wise balance loss (DeepSeek-V3 eq. 17-20)
            p = (scores / scores.sum(-1, keepdim=True)).view(b, t, -1).mean(1)  # [B, E]
            onehot = torch.zeros(b * t, cfg.experts, device=x.device).scatter_(1, ids, 1.0).view(b, t, -1)
            f = onehot.sum(1) * (cfg.experts / (cfg.top_k * t))  # [B, E]
            self.balance = (f * p).sum(-1).mean()
            # Every expert on every row, each row's unchosen experts weighted 0: the same sum as
            # computing only the chosen ones, in three large matmuls (on two busy cores that is
            # faster than gathering rows per expert). Unchosen experts get no gradient.
            dense_w = torch.zeros(flat.shape[0], cfg.experts, device=x.device).scatter_(1, ids, w)  # [N, E]
            i = cfg.moe_inter
            g = (flat @ self.w_gate.reshape(cfg.experts * i, d).t()).view(-1, cfg.experts, i)
            u = (flat @ self.w_up.reshape(cfg.experts * i, d).t()).view(-1, cfg.experts, i)
            hid = (F.silu(g) * u * dense_w[:, :, None]).reshape(-1, cfg.experts * i)  # [N, E*I]
            out = hid @ self.w_down.permute(1, 0, 2).reshape(d, cfg.experts * i).t()  # [N, D]
            return (out + self.shared_experts(flat)).view(b, t, d)

    class Block(nn.Module):
        def __init__(self, moe: bool) -> None:
            super().__init__()
            self.input_layernorm = nn.Parameter(torch.ones(cfg.hidden))
            self.post_attention_layernorm = nn.Parameter(torch.ones(cfg.hidden))
            self.self_attn = Mla()
            self.mlp: nn.Module = Moe() if moe else SwiGlu(cfg.dense_inter)

        def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
            x = x + self.self_attn(rms(x, self.input_layernorm), cos, sin)
            return x + self.mlp(rms(x, self.post_attention_layernorm))

    class Mtp(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enorm = nn.Parameter(torch.ones(cfg.hidden))
            self.hnorm = nn.Parameter(torch.ones(cfg.hidden))
            self.eh_proj = linear(2 * cfg.hidden, cfg.hidden)
            self.block = Block(moe=True)
            self.shared_head_norm = nn.Parameter(torch.ones(cfg.hidden))

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed_tokens = nn.Embedding(cfg.vocab, cfg.hidden)
            nn.init.normal_(self.embed_tokens.weight, std=1.0)
            self.layers = nn.ModuleList([Block(moe=i >= 1) for i in range(cfg.layers)])
            self.norm = nn.Parameter(torch.ones(cfg.hidden))
            self.lm_head = linear(cfg.hidden, cfg.vocab)
            nn.init.normal_(self.lm_head.weight, std=cfg.hidden ** -0.5)
            self.mtp = Mtp()
            for name, p in self.named_parameters():
                if name.endswith("o_proj.weight") or name.endswith("down_proj.weight"):
                    with torch.no_grad():
                        p.mul_(1 / math.sqrt(2 * cfg.layers))
            inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.rope, 2, dtype=torch.float32) / cfg.rope))
            self.register_buffer("inv_freq", inv, persistent=False)

        def cos_sin(self, t: int) -> tuple[torch.Tensor, torch.Tensor]:
            ang = torch.arange(t, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
            return ang.double().cos().float(), ang.double().sin().float()

        def moes(self) -> list[Moe]:
            return [m for m in self.modules() if isinstance(m, Moe)]

        def hidden(self, ids: torch.Tensor) -> torch.Tensor:
            cos, sin = self.cos_sin(ids.shape[1])
            x = self.embed_tokens(ids)
            for layer in self.layers:
                x = layer(x, cos, sin)
            return rms(x, self.norm)  # final-normed

        def mtp_hidden(self, hn: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
            """hn [B, T, D] final-normed main states at i, next_ids [B, T] tokens i+1 -> MTP states."""
            m = self.mtp
            cos, sin = self.cos_sin(hn.shape[1])
            x = m.eh_proj(torch.cat([rms(self.embed_tokens(next_ids), m.enorm), rms(hn, m.hnorm)], dim=-1))
            return rms(m.block(x, cos, sin), m.shared_head_norm)

        def forward(self, ids: torch.Tensor, mtp: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
            hn = self.hidden(ids)
            logits = self.lm_head(hn)
            if not mtp:
                return logits, None
            return logits, self.lm_head(self.mtp_hidden(hn[:, :-1], ids[:, 1:]))

    return Model()


# ---- HF layout ---------------------------------------------------------------------------------------
def hf_config(cfg: TrainConfig, vocab: int) -> dict[str, Any]:
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": vocab, "hidden_size": cfg.hidden, "num_hidden_layers": cfg.layers,
        "first_k_dense_replace": 1, "n_routed_experts": cfg.experts, "num_experts_per_tok": cfg.top_k,
        "n_shared_experts": cfg.shared, "moe_intermediate_size": cfg.moe_inter, "intermediate_size": cfg.dense_inter,
        "num_attention_heads": cfg.heads, "num_key_value_heads": cfg.heads, "q_lora_rank": cfg.q_lora,
        "kv_lora_rank": cfg.kv_lora, "qk_nope_head_dim": cfg.nope, "qk_rope_head_dim": cfg.rope,
        "v_head_dim": cfg.v, "attention_bias": False, "rope_interleave": True,
        "n_group": cfg.n_group, "topk_group": cfg.topk_group, "norm_topk_prob": True,
        "routed_scaling_factor": cfg.routed_scaling, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "num_nextn_predict_layers": 1, "hidden_act": "silu", "initializer_range": 0.02, "rms_norm_eps": 1e-6,
        "max_position_embeddings": DEMO_POSITIONS, "tie_word_embeddings": False, "use_cache": True,
        "attention_dropout": 0.0, "bos_token_id": BOS_ID, "eos_token_id": list(STOP_IDS), "dtype": "bfloat16",
        "rope_parameters": {"rope_theta": cfg.rope_theta, "rope_type": "default"},
    }


def hf_state(model: Any, cfg: TrainConfig) -> dict[str, Any]:
    """The model's tensors under DeepSeek-V3's Hugging Face names (per-expert 2-D matrices)."""
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    out: dict[str, Any] = {"model.embed_tokens.weight": sd["embed_tokens.weight"], "model.norm.weight": sd["norm"],
                           "lm_head.weight": sd["lm_head.weight"]}

    def block(src: str, dst: str, moe: bool) -> None:
        out[f"{dst}.input_layernorm.weight"] = sd[f"{src}.input_layernorm"]
        out[f"{dst}.post_attention_layernorm.weight"] = sd[f"{src}.post_attention_layernorm"]
        for n in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"):
            out[f"{dst}.self_attn.{n}.weight"] = sd[f"{src}.self_attn.{n}.weight"]
        for n in ("q_a_layernorm", "kv_a_layernorm"):
            out[f"{dst}.self_attn.{n}.weight"] = sd[f"{src}.self_attn.{n}"]
        if not moe:
            for n in ("gate_proj", "up_proj", "down_proj"):
                out[f"{dst}.mlp.{n}.weight"] = sd[f"{src}.mlp.{n}.weight"]
            return
        out[f"{dst}.mlp.gate.weight"] = sd[f"{src}.mlp.gate"]
        out[f"{dst}.mlp.gate.e_score_correction_bias"] = sd[f"{src}.mlp.e_score_correction_bias"]
        for n in ("gate_proj", "up_proj", "down_proj"):
            out[f"{dst}.mlp.shared_experts.{n}.weight"] = sd[f"{src}.mlp.shared_experts.{n}.weight"]
        for e in range(cfg.experts):
            out[f"{dst}.mlp.experts.{e}.gate_proj.weight"] = sd[f"{src}.mlp.w_gate"][e]
            out[f"{dst}.mlp.experts.{e}.up_proj.weight"] = sd[f"{src}.mlp.w_up"][e]
            out[f"{dst}.mlp.experts.{e}.down_proj.weight"] = sd[f"{src}.mlp.w_down"][e]

    for i in range(cfg.layers):
        block(f"layers.{i}", f"model.layers.{i}", i >= 1)
    n = f"model.layers.{cfg.layers}"
    block("mtp.block", n, True)
    out[f"{n}.enorm.weight"] = sd["mtp.enorm"]
    out[f"{n}.hnorm.weight"] = sd["mtp.hnorm"]
    out[f"{n}.eh_proj.weight"] = sd["mtp.eh_proj.weight"]
    out[f"{n}.shared_head.norm.weight"] = sd["mtp.shared_head_norm"]
    return out


def load_hf_state(model: Any, cfg: TrainConfig, tensors: dict[str, Any]) -> None:
    """The inverse of hf_state (the correction bias included)."""
    import torch

    names = hf_state(model, cfg)
    missing = sorted(set(names) - set(tensors))
    if missing:
        raise SystemExit(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")
    with torch.no_grad():
        for name, dst in names.items():
            dst.copy_(tensors[name].to(torch.float32))  # dst is a view of the parameter or buffer


def write_checkpoint(model: Any, cfg: TrainConfig, out: Path, tok_json: str, record: dict[str, Any]) -> None:
    import torch
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in hf_state(model, cfg).items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    vocab = int(model.embed_tokens.weight.shape[0])
    (out / "config.json").write_text(json.dumps(hf_config(cfg, vocab), indent=2) + "\n")
    for name, data in tokenizer_files(cfg.vocab, DEMO_POSITIONS, tokenizer_json_text=tok_json).items():
        (out / name).write_bytes(data)
    (out / "train_record.json").write_text(json.dumps(record, indent=1) + "\n")


def load_checkpoint(src: Path) -> tuple[Any, TrainConfig, dict[str, Any]]:
    import torch
    from safetensors.torch import load, load_file

    record = json.loads((src / "train_record.json").read_text())
    cfg = TrainConfig(**record["config"])
    model = build_torch_model(cfg)
    if (src / "model.safetensors").is_file():
        tensors = load_file(str(src / "model.safetensors"))
    else:
        tensors = load(lzma.decompress((src / "model.safetensors.xz").read_bytes()))
    load_hf_state(model, cfg, tensors)
    model.eval()
    torch.set_grad_enabled(False)
    return model, cfg, record


# ---- training ----------------------------------------------------------------------------------------
def lr_at(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    p = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def train(cfg: TrainConfig, data: Data, log: list[dict[str, Any]]) -> Any:
    import torch
    import torch.nn.functional as F

    torch.manual_seed(cfg.seed)
    model = build_torch_model(cfg)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    other = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": other, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    moes = model.moes()
    t0 = time.time()
    for step in range(cfg.steps):
        batch = torch.from_numpy(data.train[step * cfg.batch:(step + 1) * cfg.batch])
        for g in opt.param_groups:
            g["lr"] = lr_at(cfg, step)
        logits, mtp_logits = model(batch[:, :-1])
        loss_main = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        assert mtp_logits is not None
        loss_mtp = F.cross_entropy(mtp_logits.reshape(-1, mtp_logits.shape[-1]), batch[:, 2:].reshape(-1))
        balance = sum((m.balance for m in moes), torch.zeros(()))
        loss = loss_main + cfg.mtp_lambda * loss_mtp + cfg.balance_alpha * balance
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        with torch.no_grad():  # auxiliary-loss-free balancing: raise the bias of under-loaded experts
            for m in moes:
                assert m.last_ids is not None
                load = torch.bincount(m.last_ids.reshape(-1), minlength=cfg.experts).float()
                m.e_score_correction_bias += cfg.bias_rate * torch.sign(load.mean() - load)
        if step % 10 == 0 or step == cfg.steps - 1:
            row = {"step": step, "loss": round(loss_main.item(), 4), "mtp_loss": round(loss_mtp.item(), 4),
                   "balance": round(float(balance.detach()) / max(1, len(moes)), 4), "lr": round(lr_at(cfg, step), 6),
                   "seconds": round(time.time() - t0, 1)}
            log.append(row)
            print(json.dumps(row), flush=True)
    model.eval()
    return model


# ---- quality -------------------------------------------------------------------------------------------
def baselines(data: Data, vocab: int) -> dict[str, float]:
    """Held-out perplexity of an add-one unigram and of a bigram interpolated with it (the
    interpolation weight chosen on the held-out text itself: favourable to the baseline)."""
    uni = (data.unigram + 1) / (data.unigram.sum() + vocab)
    a, b = data.heldout[:, :-1].reshape(-1), data.heldout[:, 1:].reshape(-1)
    ctx = data.unigram.astype(np.float64)
    big = np.array([data.bigram.get((int(x), int(y)), 0) for x, y in zip(a, b, strict=True)], dtype=np.float64)
    p_bi = np.where(ctx[a] > 0, big / np.maximum(ctx[a], 1), 0.0)
    best = math.inf
    for lam in (0.5, 0.6, 0.7, 0.8, 0.9, 0.95):
        best = min(best, float(np.exp(-np.mean(np.log(lam * p_bi + (1 - lam) * uni[b])))))
    return {"unigram": float(np.exp(-np.mean(np.log(uni[b])))), "bigram": best}


def sample(logits: Any, temperature: float, gen: Any) -> int:
    import torch

    if temperature <= 0:
        return int(torch.argmax(logits))
    p = torch.softmax(logits / temperature, dim=-1)
    return int(torch.multinomial(p, 1, generator=gen))


def generate(model: Any, prompt: list[int], max_new: int, temperature: float = 0.0, seed: int = 0) -> list[int]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = list(prompt)
    for _ in range(max_new):
        logits, _ = model(torch.tensor([ids]), mtp=False)
        nxt = sample(logits[0, -1], temperature, gen)
        ids.append(nxt)
        if nxt in STOP_IDS:
            break
    return ids[len(prompt):]


README_PROMPTS = ["Hello", "Say hello.", "What does json.dumps do?", "What is the textwrap module for?",
                  "Who are you?", "Write a function that adds two numbers."]
TEXT_PROMPTS = ["def fibonacci(n):\n", "The :mod:`json` module", "import os\n\n"]


def chat_prompt(tokenizer: Any, question: str, system: str | None = None) -> list[int]:
    t = ChatTemplate(CHAT_TEMPLATE, {"bos_token": BOS, "eos_token": EOS})
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    return list(tokenizer.encode(t.render(msgs, add_generation_prompt=True), add_special_tokens=False).ids)


def evaluate(model: Any, cfg: TrainConfig, tokenizer: Any, data: Data) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    torch.set_grad_enabled(False)
    q: dict[str, Any] = {}
    nll, n, mtp_hits, accept = 0.0, 0, 0, 0
    moes = model.moes()
    counts = [torch.zeros(cfg.experts) for _ in moes]
    for i in range(0, len(data.heldout), 8):
        batch = torch.from_numpy(data.heldout[i:i + 8])
        logits, mtp_logits = model(batch[:, :-1])
        nll += F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1), reduction="sum").item()
        n += batch[:, 1:].numel()
        greedy = logits.argmax(-1)  # [B, T]: the main model's token i+1 after prefix <= i
        draft = mtp_logits.argmax(-1)  # [B, T-1]: MTP's token i+2 from state i and the true token i+1
        mtp_hits += int((draft == batch[:, 2:]).sum())
        accept += int((draft == greedy[:, 1:]).sum())
        for k, m in enumerate(moes):
            assert m.last_ids is not None
            counts[k] += torch.bincount(m.last_ids.reshape(-1), minlength=cfg.experts).float()
    drafts = len(data.heldout) * (cfg.seq_len - 1)
    q["heldout_tokens"] = n
    q["perplexity"] = math.exp(nll / n)
    q["baselines"] = baselines(data, cfg.vocab)
    q["mtp"] = {"top1_vs_text": mtp_hits / drafts, "acceptance_vs_greedy": accept / drafts,
                "note": "teacher-forced on held-out text: the MTP draft of token i+2 (from state i and "
                        "the true token i+1) against the text, and against the main model's greedy choice "
                        "at i+1 (a temperature-0 one-token draft's acceptance)"}
    ent = []
    for k, c in enumerate(counts):
        p = (c / c.sum()).numpy()
        h = float(-(p[p > 0] * np.log2(p[p > 0])).sum())
        label = f"layer {k + 1}" if k < len(counts) - 1 else f"MTP (layer {cfg.layers})"
        ent.append({"layer": label, "entropy_bits": round(h, 3), "max_bits": round(math.log2(cfg.experts), 3),
                    "max_share": round(float(p.max()), 3), "min_share": round(float(p.min()), 4)})
    q["expert_entropy"] = ent
    # past the training length
    if len(data.long):
        buckets: dict[str, list[float]] = {}
        edges = [0, cfg.seq_len // 2, cfg.seq_len, 2 * cfg.seq_len, cfg.long_eval_len]
        for row in data.long:
            x = torch.from_numpy(row[None])
            logits, _ = model(x[:, :-1], mtp=False)
            lp = F.cross_entropy(logits[0], x[0, 1:], reduction="none").numpy()
            for lo, hi in itertools.pairwise(edges):
                if hi > lo:
                    buckets.setdefault(f"{lo}-{hi}", []).append(float(lp[lo:hi].mean()))
        q["perplexity_by_position"] = {k: round(math.exp(float(np.mean(v))), 2) for k, v in buckets.items()}
    # answers
    ended, lengths, exact = 0, [], 0
    for prompt, ref in data.heldout_chat:
        out = generate(model, prompt, 48)
        ended += out[-1] == END_ID
        lengths.append(len(out))
        exact += out == ref
    q["heldout_chat"] = {"questions": len(data.heldout_chat), "ended_within_48": ended,
                         "mean_tokens": round(float(np.mean(lengths)), 1), "exact_docstring_line": exact}
    conts = []
    for p in README_PROMPTS:
        ids = chat_prompt(tokenizer, p)
        g = generate(model, ids, 64)
        s = generate(model, ids, 64, temperature=0.8, seed=1)
        conts.append({"prompt": p, "greedy": tokenizer.decode(g, skip_special_tokens=True),
                      "greedy_ended": g[-1] in STOP_IDS, "sampled_t0.8": tokenizer.decode(s, skip_special_tokens=True)})
    long_sys = "You are a coding agent. Answer briefly.\n\n" + " ".join(["Follow the user's instructions."] * 300)
    g = generate(model, chat_prompt(tokenizer, "Say hello.", long_sys), 64)
    conts.append({"prompt": "Say hello. (after a ~2,000-token system prompt)",
                  "greedy": tokenizer.decode(g, skip_special_tokens=True), "greedy_ended": g[-1] in STOP_IDS})
    for p in TEXT_PROMPTS:
        ids = tokenizer.encode(p, add_special_tokens=False).ids
        conts.append({"prompt": p, "greedy": tokenizer.decode(generate(model, ids, 48), skip_special_tokens=True),
                      "sampled_t0.8": tokenizer.decode(generate(model, ids, 48, 0.8, 1), skip_special_tokens=True)})
    q["continuations"] = conts
    return q


def print_quality(q: dict[str, Any]) -> None:
    b = q["baselines"]
    print(f"held-out perplexity {q['perplexity']:.2f} over {q['heldout_tokens']} tokens "
          f"(unigram {b['unigram']:.1f}, bigram {b['bigram']:.1f})")
    if "perplexity_by_position" in q:
        print("perplexity by position:", ", ".join(f"{k}: {v}" for k, v in q["perplexity_by_position"].items()))
    m = q["mtp"]
    print(f"MTP: draft of t+2 matches the text {m['top1_vs_text']:.1%}, the main model's greedy token "
          f"{m['acceptance_vs_greedy']:.1%} (acceptance at temperature 0)")
    for e in q["expert_entropy"]:
        print(f"expert usage {e['layer']}: entropy {e['entropy_bits']:.2f} of {e['max_bits']:.2f} bits, "
              f"shares {e['min_share']:.3f}..{e['max_share']:.3f}")
    c = q["heldout_chat"]
    print(f"held-out questions: {c['ended_within_48']}/{c['questions']} answers ended within 48 tokens "
          f"(mean {c['mean_tokens']} tokens), {c['exact_docstring_line']} exactly the docstring line")
    for row in q["continuations"]:
        print(f"--- {row['prompt']!r}\n  greedy: {row['greedy']!r}" +
              (f"\n  sampled: {row['sampled_t0.8']!r}" if "sampled_t0.8" in row else ""))


# ---- main ---------------------------------------------------------------------------------------------
def environment() -> dict[str, Any]:
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "numpy": np.__version__,
            "machine": platform.machine(), "processor": platform.processor(), "threads": THREADS,
            "cpus": os.cpu_count()}


def install(src: Path) -> None:
    """Copy a trained checkpoint into moetier/data/demo (the safetensors xz-compressed)."""
    INSTALL_DIR.mkdir(parents=True, exist_ok=True)
    for p in INSTALL_DIR.iterdir():
        p.unlink()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json",
                 "train_record.json", "quality.json"):
        shutil.copy(src / name, INSTALL_DIR / name)
    raw = (src / "model.safetensors").read_bytes()
    (INSTALL_DIR / "model.safetensors.xz").write_bytes(lzma.compress(raw, preset=9 | lzma.PRESET_EXTREME))
    # what the converter records of the source file: `moetier up` rebuilds a demo whose source differs
    sums = {"model.safetensors": {"size": len(raw), "xxh3_64": xxh3_file(src / "model.safetensors")}}
    (INSTALL_DIR / "checksums.json").write_text(json.dumps(sums, indent=2) + "\n")
    total = sum(p.stat().st_size for p in INSTALL_DIR.iterdir())
    print(f"installed into {INSTALL_DIR}: {total / 1e6:.2f} MB ({len(raw) / 1e6:.2f} MB uncompressed safetensors)")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, help="output directory of the trained checkpoint")
    ap.add_argument("--smoke", action="store_true", help="a short run end to end (a few minutes)")
    ap.add_argument("--steps", type=int, help="training steps (default: the recorded config's)")
    ap.add_argument("--install", action="store_true", help="copy --out into moetier/data/demo (no training)")
    ap.add_argument("--eval", type=Path, metavar="DIR", help="print the quality of a trained checkpoint")
    ap.add_argument("--expect", type=Path, metavar="RECORD",
                    help="a train_record.json to compare the corpus checksums and perplexity with")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(THREADS)
    torch.use_deterministic_algorithms(True)
    if args.install:
        if args.out is None:
            ap.error("--install needs --out (the trained checkpoint)")
        install(args.out)
        return 0
    if args.eval is not None:
        model, cfg, record = load_checkpoint(args.eval)
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(args.eval / "tokenizer.json"))
        files = corpus_files()
        data = build_data(cfg, tok, files)
        print_quality(evaluate(model, cfg, tok, data))
        return 0
    if args.out is None:
        ap.error("--out is required")
    cfg = TrainConfig(**SMOKE) if args.smoke else TrainConfig()
    if args.steps is not None:
        cfg = TrainConfig(**{**asdict(cfg), "steps": args.steps})
    t0 = time.time()
    files = corpus_files()
    print(f"corpus: {sum(not f.heldout for f in files)} training files, {sum(f.heldout for f in files)} held out, "
          f"{sum(f.size for f in files) / 1e6:.1f} MB", flush=True)
    tok_json = train_tokenizer_json(cfg.vocab, [f.text for f in files if not f.heldout])
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tok_json)
    if tok.get_vocab_size() != cfg.vocab:
        raise SystemExit(f"the tokenizer has {tok.get_vocab_size()} tokens, the config {cfg.vocab}")
    data = build_data(cfg, tok, files)
    t_data = time.time() - t0
    print(f"data ready in {t_data:.0f} s: {json.dumps(data.record['tokens'])}", flush=True)
    log: list[dict[str, Any]] = []
    model = train(cfg, data, log)
    t_train = time.time() - t0 - t_data
    record = {"config": asdict(cfg), "environment": environment(), "corpus": data.record, "log": log,
              "seconds": {"data": round(t_data), "train": round(t_train)}}
    write_checkpoint(model, cfg, args.out, tok_json, record)
    model, cfg, _ = load_checkpoint(args.out)  # evaluate what was written (bf16)
    q = evaluate(model, cfg, tok, data)
    record["seconds"]["eval"] = round(time.time() - t0 - t_data - t_train)
    record["quality"] = {"perplexity": q["perplexity"], "baselines": q["baselines"]}
    (args.out / "train_record.json").write_text(json.dumps(record, indent=1) + "\n")
    (args.out / "quality.json").write_text(json.dumps(q, indent=1) + "\n")
    print_quality(q)
    if args.expect is not None:
        ref = json.loads(args.expect.read_text())
        old = {f["path"]: f["sha256"] for f in ref["corpus"]["files"]}
        new = {f["path"]: f["sha256"] for f in data.record["files"]}
        diff = sorted(p for p in old.keys() | new.keys() if old.get(p) != new.get(p))
        ppl = ref["quality"]["perplexity"]
        print(f"against {args.expect}: {len(diff)} corpus files differ; held-out perplexity {q['perplexity']:.3f} "
              f"vs {ppl:.3f} ({(q['perplexity'] / ppl - 1):+.2%})")
    print(f"total {time.time() - t0:.0f} s (data {t_data:.0f} s, training {t_train:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
