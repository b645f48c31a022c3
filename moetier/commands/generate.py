"""`moetier generate`: generate text in this process from a container (no services).

Tokenizes with the container's tokenizer (optionally through its chat template), streams
the text as it is generated, stops at the model's eos ids (generation_config.json) and
prints a one-line summary to stderr. Without --model it uses the demo model, building it
once under data_dir/models/demo.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from moetier.errors import InvalidArgument
from moetier.model.sampling import SamplingParams
from moetier.settings import apply_kernel_settings, load_settings


def _prompt_ids(engine: Any, args: argparse.Namespace) -> list[int]:
    from moetier.engine import parse_ids

    if args.prompt_ids is not None:
        return parse_ids(args.prompt_ids)
    if args.prompt is None:
        raise InvalidArgument("give --prompt TEXT or --prompt-ids 1,2,3")
    tok = engine.tokenizer
    if args.chat:
        if tok.chat_template is None:
            raise InvalidArgument(f"{engine.path} has no chat template; drop --chat")
        text = tok.chat_template.render([{"role": "user", "content": args.prompt}], add_generation_prompt=True)
        return list(tok.encode(text, add_special_tokens=False))
    return list(tok.encode(args.prompt))


def _run(args: argparse.Namespace) -> int:
    from moetier.engine import Engine, expert_cache_spec, model_dir, summarize
    from moetier.text import IncrementalDetokenizer

    settings = load_settings(args.config)
    apply_kernel_settings(settings)
    path = model_dir(settings, args.model)
    with Engine.open(path, budget=expert_cache_spec(settings, args.budget), threads=args.threads) as engine:
        ids = _prompt_ids(engine, args)
        stops = () if args.ignore_eos else engine.eos_token_ids()
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                                max_tokens=args.max_tokens, seed=args.seed, stop_token_ids=tuple(stops),
                                ignore_eos=True)  # the eos ids are in stop_token_ids (or deliberately not)
        detok = None if args.show_ids else IncrementalDetokenizer(engine.tokenizer.decode)
        out = sys.stdout
        generated: list[int] = []
        start = time.perf_counter()
        for g in engine.generate(ids, params, chunk_size=settings.inference.prefill_chunk):
            generated.append(g.token)
            if detok is not None:
                out.write(detok.add([g.token]))
                out.flush()
        seconds = time.perf_counter() - start
        if detok is not None:
            out.write(detok.flush() + "\n")
        else:
            out.write(",".join(str(t) for t in generated) + "\n")
        out.flush()
        print(summarize(len(ids), len(generated), seconds, engine.expert_hit_rate()), file=sys.stderr)
    return 0


def register(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser("generate", help="generate text in-process from a container")
    p.add_argument("--config", type=Path, help="YAML config file")
    p.add_argument("--model", type=Path, help="container directory (default: settings model.path, else the demo "
                   "model, built once under data_dir/models/demo)")
    p.add_argument("--prompt", help="prompt text")
    p.add_argument("--prompt-ids", help="prompt as token ids, e.g. 1,2,3 (instead of --prompt)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template as a user turn")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, help="seed of the sampling (default: fresh entropy)")
    p.add_argument("--ignore-eos", action="store_true", help="do not stop at the model's eos ids")
    p.add_argument("--show-ids", action="store_true", help="print the generated token ids instead of text")
    p.add_argument("--budget", help="expert RAM tier: bytes (2GiB) or a share of the expert bytes (25%%); "
                   "default: settings model.expert_cache")
    p.add_argument("--threads", type=int, help="kernel threads (default: every CPU)")
    p.set_defaults(func=_run)
