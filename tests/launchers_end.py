"""Launching processes ended by a signal in a phase of their launch, and what of each launch is left.

A fresh Python process (a kernel stand-in) launches 2 ranks whose PIL loaders run 2 worker
processes each, and is ended with SIGTERM, SIGKILL or SIGHUP during start-up, data loading,
training or evaluation. Every process of a launch carries a marker in its environment (inherited
from the launcher), so survivors are found wherever they went: ranks, their loader workers, the
forkserver, orphans reparented to init. A zombie counts as a survivor.

Used by tests/test_orphans.py (each phase, each signal) and bench/orphans.py (every pair).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Dict, Iterable

from conftest import ROOT, WORKERS, make_tree, wait_for

SIGNALS = {"SIGTERM": signal.SIGTERM, "SIGKILL": signal.SIGKILL, "SIGHUP": signal.SIGHUP}
PHASES = ("start-up", "loading", "training", "evaluation")

LAUNCHER = """
import sys
sys.path.insert(0, {root!r})
from nbddp import spawn_train
spawn_train({target!r}, {data!r}, nprocs=2, runs_dir={runs!r}, kwargs={kwargs!r}, echo=False)
"""


def marked(marker: str) -> dict:
    """``{pid: state}`` of every process, live or zombie, whose environment holds ``marker``."""
    found = {}
    needle = f"NBDDP_TEST_MARKER={marker}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes()
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in env.split(b"\0"):
            found[int(entry)] = state
    return found


def reached(runs: Path, phase: str) -> bool:
    if phase == "start-up":
        return any(runs.glob("*/.nbddp/launch.json"))
    for prog in runs.glob("*/.nbddp/progress.json"):
        try:
            return json.loads(prog.read_text()).get("phase") == phase
        except ValueError:
            return False
    return False


def end_launchers(tmp: Path, phase: str, signals: Iterable[str]) -> Dict[str, dict]:
    """One launcher per signal in ``signals``, side by side (the set-up cost is shared), each ended by
    its signal once its launch reached ``phase``. Returns ``{signal: {pid: state}}`` of what was left
    of each launch 10 s after its launcher ended (empty when nothing was). Raises AssertionError when
    a launch never got to ``phase`` or the processes it should have had at the signal were not there."""
    tree = make_tree(tmp / "data", per_class=8)
    launches = {}
    for name in signals:
        marker, runs = uuid.uuid4().hex, tmp / name
        code = LAUNCHER.format(root=str(ROOT), target=f"{WORKERS / 'lifecycle.py'}:phase_hold", data=str(tree),
                               runs=str(runs), kwargs={"phase": "loading" if phase == "start-up" else phase})
        proc = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "NBDDP_TEST_MARKER": marker},
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        launches[name] = (proc, marker, runs)
    # launcher, forkserver, 2 ranks and their 2 loader workers each (4 in "loading")
    expected = 0 if phase == "start-up" else 12 if phase == "loading" else 8
    try:
        before = {}
        for name, (proc, marker, runs) in launches.items():
            assert wait_for(lambda: reached(runs, phase) or proc.poll() is not None, 120), f"{name}: {phase} not reached"
            # The phase is rank 0's: rank 1 may start its loader workers a moment later.
            wait_for(lambda: len(marked(marker)) >= expected or proc.poll() is not None, 30)
            assert proc.poll() is None, f"{name}: the launcher ended early: {proc.stderr.read().decode()[-2000:]}"
            before[name] = marked(marker)
            proc.send_signal(SIGNALS[name])
        for name, (proc, marker, runs) in launches.items():
            proc.wait(timeout=30)  # the caller is the launcher's parent: it reaps the launcher itself
            assert len(before[name]) >= expected, f"{name}: {before[name]}"
        left = {}
        for name, (proc, marker, runs) in launches.items():
            wait_for(lambda: not marked(marker), 10)
            left[name] = marked(marker)
        return left
    finally:
        for proc, marker, _ in launches.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            for pid in marked(marker):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
