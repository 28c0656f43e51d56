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
