"""A sweep's trial: logs ``score`` (lr per step) each step; ``slow`` keeps it running until stopped."""

import json
import time


def train(ctx, lr=0.1, steps=4, slow=False, sleep=0.05):
    score, step = 0.0, 0
    while step < steps or slow:
        if ctx.should_stop():
            break
        score += lr
        ctx.log(step=step, score=score)
        time.sleep(sleep)
        step += 1
        if step > 1200:  # a test that went wrong ends within a minute
            break
    if ctx.is_main:
        (ctx.run_dir / "ended.json").write_text(json.dumps({"reason": ctx.stop_reason(), "steps": step}))
    return {"score": score}
