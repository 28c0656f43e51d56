"""Workers for tests/test_interrupt.py: a fn(ctx) loop that never asks ctx.should_stop(), and one that
returns at once. Each leaves a file per rank, so a test sees what ran."""

import os
import time
from pathlib import Path


def loop_without_checking(ctx, marks: str):
    """Steps forever without asking ctx.should_stop(); its finally: says it ran."""
    Path(marks).mkdir(parents=True, exist_ok=True)
    try:
        Path(marks, f"started{ctx.rank}").write_text(str(os.getpid()))
        step = 0
        while True:
            time.sleep(0.05)  # plain code: only a KeyboardInterrupt between statements stops it
            step += 1
            ctx.heartbeat(step=step)
    finally:
        Path(marks, f"finally{ctx.rank}").write_text("ran")


def return_at_once(ctx, marks: str):
    """Returns its rank's value; says so first, so a test can interrupt just as it ends."""
    Path(marks).mkdir(parents=True, exist_ok=True)
    Path(marks, f"returning{ctx.rank}").write_text("")
    return {"rank": ctx.rank, "answer": 42}
