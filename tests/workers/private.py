"""Workers for tests/test_private_state.py: the ranks' temp folder, a planted result, a launch's output."""

import os
import pickle
import stat
import tempfile
import time
from pathlib import Path


def tmp_info(ctx):
    """What this rank's temp folder is, and who may use it."""
    folder = os.environ["TMPDIR"]
    st = os.stat(folder)
    with tempfile.NamedTemporaryFile() as f:  # the rank's own temporary files land there too
        inside = os.path.dirname(f.name)
    return {"tmp": folder, "mode": stat.S_IMODE(st.st_mode), "uid": st.st_uid, "inside": inside,
            "compile_cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR")}


class _Planted:
    """What another user's pickle would do in the kernel: here, leave a file behind."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (Path(self.marker),))


def plant_result(ctx, marker: str, uid: int):
    """Rank 1 plays another user: once rank 0 stored its value, it puts its own pickle in its place."""
    if ctx.rank == 1:
        result = Path(ctx.run_dir) / ".nbddp" / "result.pkl"
        deadline = time.time() + 30
        while not result.exists() and time.time() < deadline:
            time.sleep(0.02)
        planted = result.with_name("planted")
        planted.write_bytes(pickle.dumps(_Planted(marker)))
        os.chown(planted, uid, -1)
        os.replace(planted, result)
        return None
    return {"rank": 0}


def say(ctx, tag: str):
    print(f"launch {tag} says hello", flush=True)
    return tag


def forge_tree(ctx, pid: int, started: int):
    """Rank 0 replaces its own record of its descendants with one naming process ``pid`` (not its child)."""
    import json

    record = Path(ctx.run_dir) / ".nbddp" / f"tree-rank{ctx.rank}.json"
    deadline = time.time() + 30
    while not record.exists() and time.time() < deadline:  # the recorder's first record (no children)
        time.sleep(0.02)
    forged = record.with_name("forged")
    forged.write_text(json.dumps({str(pid): started}))
    os.chmod(forged, 0o600)
    os.replace(forged, record)
    return "forged"
