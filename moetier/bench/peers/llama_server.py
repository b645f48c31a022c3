"""Peer-side script (run by the llama-cpp-python venv's interpreter; imports nothing of moetier):
llama_cpp.server with its own command line, plus one flag of ours.

--no-repack: load the model with `use_extra_bufts = false`, llama.cpp's switch for its CPU
weight repack (`--no-repack` of llama.cpp's own tools). The repack copies every weight it
can use (Q4_0 among them) into anonymous memory at load; without it the weights stay in
the mmapped file, as they must under a memory cap smaller than the model. llama_cpp's
server does not expose the switch, so the binding's default model parameters are wrapped.
"""

from __future__ import annotations

import sys


def main() -> None:
    argv = sys.argv[1:]
    if "--no-repack" in argv:
        argv.remove("--no-repack")
        import llama_cpp.llama_cpp as binding

        default = binding.llama_model_default_params

        def no_repack() -> object:
            params = default()
            params.use_extra_bufts = False
            return params

        binding.llama_model_default_params = no_repack
    sys.argv = [sys.argv[0], *argv]
    from llama_cpp.server.__main__ import main as serve

    serve()


if __name__ == "__main__":
    main()
