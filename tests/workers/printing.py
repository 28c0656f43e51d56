"""A worker that prints as people do: \\r progress bars, tqdm, a huge line, no final newline."""

import sys
import time


def bars(ctx, steps: int = 5, long_line: int = 0):
    for i in range(steps):
        print(f"step {i + 1}/{steps}", end="\r", flush=True)
        time.sleep(0.3)
    print("bar done")
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    if tqdm is not None:
        for _ in tqdm(range(3), desc="tqdm", file=sys.stderr, mininterval=0):
            time.sleep(0.2)
    if long_line:
        print("x" * long_line, flush=True)
    print("the end, no newline", end="", flush=True)
    return ctx.rank


def flood(ctx, lines: int = 40_000, width: int = 80, bars: int = 0):
    """Rank 0 prints ``lines`` lines of ``width`` characters as fast as it can (after ``bars``
    rewrites of a \\r progress bar), then ``FINAL LINE``; the other ranks print nothing."""
    if ctx.rank == 0:
        for i in range(bars):
            print(f"bar {i + 1}/{bars}", end="\r")
        row = "x" * (width - 12)
        for i in range(lines):
            print(f"line {i:06d} {row}")
        print("FINAL LINE", flush=True)
    return ctx.rank
