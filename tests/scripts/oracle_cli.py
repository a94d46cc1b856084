"""The command line of a script tests/script_oracle.py judges: `SCRIPT OUT CASE ... [--towers K]
[--batch B] [--reference]` writes OUT/CASE.npz of `train(case, K, B)`; with --reference,
CASE.one.npz (one device fed all K*B examples), CASE.perturbed.npz (the same with its inputs
scaled by 1 + 1e-7) and CASE.towers.npz (K towers of B, as built)."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

import numpy as np
import tensorflow as tf

Train = Callable[..., dict[str, np.ndarray]]  # train(case, towers, batch, perturb=0.0)
#: The stderr line that starts each case's output (tests/script_oracle.py's lines_by_case).
CASE = "oracle_cli: case "


def main(cases: Sequence[str], train: Train) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", help="a directory for CASE.npz (--reference: CASE.one.npz, CASE.perturbed.npz, "
                                    "CASE.towers.npz)")
    parser.add_argument("cases", nargs="+", choices=cases)
    parser.add_argument("--towers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--reference", action="store_true")
    args = parser.parse_args()
    tf.compat.v1.disable_eager_execution()
    for case in args.cases:
        print(f"{CASE}{case}", file=sys.stderr, flush=True)  # what follows on stderr is this case's
        if not args.reference:
            np.savez(os.path.join(args.out, f"{case}.npz"), **train(case, args.towers, args.batch))
            continue
        whole = args.towers * args.batch
        np.savez(os.path.join(args.out, f"{case}.one.npz"), **train(case, 1, whole))
        np.savez(os.path.join(args.out, f"{case}.perturbed.npz"), **train(case, 1, whole, 1e-7))
        np.savez(os.path.join(args.out, f"{case}.towers.npz"), **train(case, args.towers, args.batch))
