"""A sweep's study on a shared server, played by two real users of one group (umask 002, a
group-writable setgid project folder): a study a group member planted makes the victim's sweep
neither end a process nor run a trial.

The attack: the victim trains a run in one process (another kernel) and has a sweep ``y``. The
attacker makes an Optuna study of her own holding a RUNNING trial of a dead kernel whose run
folder is the victim's live run, and a trial enqueued far outside the space (``lr=123456.0``),
and puts it, group-writable, where the victim's sweep reads its study: (a) the sweep's folder renamed away and a
folder of hers in its place (``runs/sweeps/`` is group-writable), (b) only ``study.db`` replaced,
in a sweep folder an older nbddp left group-writable (mode 2775). Before, the victim's next
``nbddp.sweep(name="y")`` marked the trial failed and ended the live run's workers ("rank 0 was
killed by SIGTERM"), then trained ``lr=123456.0``. Now the study is refused, naming it and the
fix; the live run trains on and nothing runs.
"""

import json
import textwrap

import pytest

from conftest import wait_for
from shared_users import shared_project  # noqa: F401  (the fixture)

from nbddp.contract.system import is_same_process, start_time

pytest.importorskip("optuna")

SPACE = 'lambda t: {"lr": t.suggest_float("lr", 0.1, 1.0)}'

LIVE = textwrap.dedent('''
    import nbddp
    nbddp.spawn_train({worker!r}, nprocs=1, runs_dir="runs", name="live", echo=False,
                      kwargs={{"slow": True, "sleep": 0.5}})
''')

SWEEP = textwrap.dedent('''
    import nbddp
    s = nbddp.sweep({worker!r}, {space}, n_trials=1, metric="score", nprocs=1, name="y", runs_dir="runs")
    print("TRIALS", [(t.number, t.state.name, t.params) for t in s.study.trials])
''')

#: The attacker's study: made in her home, as Optuna makes any study.
PLANTED = textwrap.dedent('''
    import optuna
    study = optuna.create_study(storage="sqlite:///planted.db", study_name="y", direction="maximize")
    t = study.ask()
    t.suggest_float("lr", 0.1, 1.0)
    t.set_user_attr("run_dir", {live!r})
    t.set_user_attr("kernel", [999999999, 0])  # a kernel that is gone
    study.enqueue_trial({{"lr": 123456.0}})
''')


def _alive(pids):
    return all(is_same_process(pid, started) for pid, started in pids.items())


def _ran_planted(runs):
    """Run folders of a trial with the planted parameters (read as root: sweep.json is the umask's)."""
    found = []
    for record in runs.glob("*/sweep.json"):
        if json.loads(record.read_text()).get("params", {}).get("lr") == 123456.0:
            found.append(record.parent)
    return found


def test_a_planted_study_never_ends_a_live_run_nor_runs_its_trial(shared_project):  # noqa: F811
    p = shared_project
    worker = f"{p.source / 'tests' / 'workers' / 'sweep_worker.py'}:train"
    runs = p.root / "runs"
    live_proc = p.start(p.victim, LIVE.format(worker=worker))
    try:
        def started():
            return [r for r in runs.glob("*-live") if (r / "metrics.jsonl").is_file()]

        assert wait_for(started, timeout=180, interval=0.5), \
            live_proc.stdout.read() if live_proc.poll() is not None else "the live run did not start"
        live = started()[0]
        listed = p.run(p.victim, f"from nbddp.kernel.procs import live_workers; print(live_workers({str(live)!r}))")
        pids = {pid: start_time(pid) for pid in json.loads(listed.stdout.strip().splitlines()[-1])}
        assert pids and _alive(pids)
        p.run(p.victim, SWEEP.format(worker=worker, space=SPACE), timeout=300)  # the victim's sweep y, one trial
        p.run(p.attacker, f"import os; os.chdir(os.path.expanduser('~')); exec({PLANTED.format(live=str(live))!r})")
        planted = p.base / "home" / p.attacker.name / "planted.db"
        folder = runs / "sweeps" / "y"

        # (a) the sweep's folder renamed away, a folder of the attacker's in its place
        p.shell(p.attacker, f"mv runs/sweeps/y runs/sweeps/y.away && mkdir runs/sweeps/y && "
                            f"cp {planted} runs/sweeps/y/study.db && chmod 664 runs/sweeps/y/study.db")
        done = p.run(p.victim, SWEEP.format(worker=worker, space=SPACE), timeout=300, check=False)
        said = done.stdout + done.stderr
        assert done.returncode != 0 and "NotPrivate" in said, said[-3000:]
        assert f"{folder} is owned by uid {p.attacker.uid}, not by you" in said, said[-3000:]
        assert _alive(pids) and live_proc.poll() is None, "the victim's live run was ended"
        assert not _ran_planted(runs)

        # (b) an older nbddp's group-writable sweep folder of the victim's: only study.db replaced
        p.shell(p.attacker, "rm -rf runs/sweeps/y")
        p.shell(p.victim, "mv runs/sweeps/y.away runs/sweeps/y && chmod 2775 runs/sweeps/y")
        p.shell(p.attacker, f"mv runs/sweeps/y/study.db runs/sweeps/y/study.db.away && "
                            f"cp {planted} runs/sweeps/y/study.db && chmod 664 runs/sweeps/y/study.db")
        done = p.run(p.victim, SWEEP.format(worker=worker, space=SPACE), timeout=300, check=False)
        said = done.stdout + done.stderr
        assert done.returncode != 0 and f"{folder} may be written by other users (mode 2775)" in said, said[-3000:]
        assert f"chmod 700 {folder}" in said
        assert _alive(pids) and live_proc.poll() is None, "the victim's live run was ended"
        assert not _ran_planted(runs)
    finally:
        live_proc.kill()
        live_proc.wait(timeout=30)
