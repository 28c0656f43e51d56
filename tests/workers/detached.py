"""A worker for detached runs (tests/test_detached.py): steps until it is asked to stop, then returns."""

import time


def until_stopped(ctx, pause: float = 0.05, steps: int = 100000):
    done = 0
    for step in range(steps):
        if ctx.should_stop():
            break
        time.sleep(pause)
        done = step + 1
        ctx.log(step=done, loss=1.0 / done)
        ctx.progress(step=done)
        if ctx.is_main and done % 10 == 0:
            print(f"step {done}", flush=True)
    return {"steps": done, "stopped": ctx.should_stop()}
