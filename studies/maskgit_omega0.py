"""How docs/archive/maskgit_tokens/*/omega0.jsonl were made: a MaskGIT pipeline sampled unguided (omega = 0) at 1,
2 and 8 steps with studies/reproduce.py's own evaluate(), 20 samples per class, sampling seed 0 (as the study's
records).

    python -m studies.maskgit_omega0 docs/archive/maskgit_tokens/t64/runs/maskgit/<run>/pipeline \
        docs/archive/maskgit_tokens/t64/omega0.jsonl
"""
import argparse
import json
import sys
from pathlib import Path

import torch

from studies.reproduce import append_records, evaluate
from vqlcmd.pipeline import VQLCMDPipeline


def main(argv=None) -> int:
    torch.set_num_threads(1)
    folder, out = (sys.argv[1:] if argv is None else argv)[:2]
    pipe = VQLCMDPipeline.from_pretrained(folder)
    args = argparse.Namespace(per_class=20, eval_batch=None)
    for steps in (1, 2, 8):
        r = evaluate(pipe, "maskgit", steps, "maskgit", 0, args, 0.0)
        r.update(pipeline=folder, sample_steps=steps, guidance=0.0)
        print(json.dumps(r), flush=True)
        append_records(Path(out), [r])  # the study's own appender: one whole line per write, flushed
    return 0


if __name__ == "__main__":
    sys.exit(main())
