"""Peer-side script (llama-cpp-python venv; imports nothing of moetier): quantize a GGUF with
llama.cpp's own quantizer through the binding's llama_model_quantize.

    python gguf_quantize.py IN.gguf OUT.gguf Q4_0|Q8_0 [--threads N]

`pure`: every matrix gets the named type (llama.cpp's default mix would store output.weight as
Q6_K), so the GGUF matches moetier's container tensor for tensor; 1-D tensors and the MoE
router (ffn_gate_inp) stay F32, as llama.cpp keeps them and as moetier keeps its own.
"""

from __future__ import annotations

import argparse
import sys


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("src")
    p.add_argument("out")
    p.add_argument("type", choices=["Q4_0", "Q8_0"])
    p.add_argument("--threads", type=int, default=0)
    a = p.parse_args()
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = {"Q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0, "Q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0}[a.type]
    params.nthread = a.threads
    params.pure = True
    rc = llama_cpp.llama_model_quantize(a.src.encode(), a.out.encode(), params)
    if rc != 0:
        print(f"llama_model_quantize({a.src} -> {a.out}, {a.type}) returned {rc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
