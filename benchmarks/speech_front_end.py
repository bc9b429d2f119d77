"""The speech recipe's training front end: one DataLoader worker's time per batch of 96.

What a worker does per training batch (read the clips, augment the waveforms, log-mel, trim,
crop, SpecAugment, collate), timed in this process on one torch thread, as a worker runs it,
on the default set (built on first use). Every clip is decoded once before timing, as a
worker has after its first epoch. On 2 cores the workers' time is taken from the JAX step's,
so it bounds the recipe's steps per second as much as the step itself does.

    .venv/bin/python benchmarks/speech_front_end.py --batches 20 --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=96)
    args = parser.parse_args()

    from torchshell.app.config import compose_config
    from torchshell.data.spoken_digits import SpokenDigitsDataModule

    torch.set_num_threads(1)  # as in a DataLoader worker
    data = dict(compose_config([]).data)
    keep = ("root", "takes", "buckets", "train_frames", "n_mels", "min_test_clips")
    dm = SpokenDigitsDataModule(
        **{k: data[k] for k in keep if k in data}, batch_size=args.batch_size, num_workers=0
    )
    dm.prepare_data()
    dm.setup("fit")
    train = dm.datasets["train"]
    for i in range(len(train)):
        train.wave(i)
    rng = np.random.default_rng(0)
    rounds = []
    for _ in range(args.rounds):
        batches = [
            rng.permutation(len(train))[: args.batch_size].tolist() for _ in range(args.batches)
        ]
        start = time.perf_counter()
        for indices in batches:
            dm.collate(train.__getitems__(indices))
        rounds.append((time.perf_counter() - start) / args.batches * 1e3)
    load = Path("/proc/loadavg").read_text().split()[0]
    print(
        f"training front end, batch {args.batch_size}, 1 thread: "
        f"{statistics.median(rounds):.1f} ms/batch [{min(rounds):.1f}-{max(rounds):.1f}] "
        f"over {args.rounds} rounds of {args.batches} (load {load})"
    )


if __name__ == "__main__":
    main()
