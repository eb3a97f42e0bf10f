"""One rank of ``punica-hf serve --tp 2`` whose forward fails on rank 1 for a prompt holding the token ``POISON``: a
fault of this script's own (nothing in the package). Run by tests/test_tp_serve.py under ``torchrun
--nproc-per-node 2`` with serve's options, never alone: ``python tp_serve_fault_worker.py SERVE_OPTIONS...``."""

from __future__ import annotations

import os
import sys

from punica_hf.cli import main, serve

POISON = 99  # "w99" in tests/helpers.py's word-level tokenizer
FAILING_RANK = 1


def load_model_with_a_fault(*args, **kwargs):
    model, codec = load_model(*args, **kwargs)
    if int(os.environ["RANK"]) == FAILING_RANK:
        def check(_module, inputs):
            if (inputs[0] == POISON).any():
                raise ValueError("injected fault")

        model.get_input_embeddings().register_forward_pre_hook(check)
    return model, codec


load_model = serve.load_model
serve.load_model = load_model_with_a_fault
sys.exit(main(["serve", *sys.argv[1:], "--as-tp-rank"]))
