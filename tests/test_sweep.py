"""``nbddp.sweep``: Optuna's trials as nbddp runs, with real processes (CPU, gloo, one rank each).

A sweep killed mid-trial is continued by the next call (finished trials never run again, the
cut-off trial FAIL with its folder kept, asked again on request); the pruner stops a trial at its
next step (``ctx.stop_reason() == "pruned"``); GPU slots never share a GPU (a fake inventory, as
the GPU picker's tests); bad input is refused with the fix.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

optuna = pytest.importorskip("optuna")

import nbddp  # noqa: E402
from conftest import ROOT, WORKERS  # noqa: E402
from fake_gpu import H100, install_fake_nvidia_smi  # noqa: E402
from nbddp import ConfigError, TrainConfig  # noqa: E402
from nbddp.contract import leases  # noqa: E402
from nbddp.kernel.procs import live_workers  # noqa: E402

WORKER = f"{WORKERS / 'sweep_worker.py'}:train"

KILLED = """
import sys
import nbddp
nbddp.sweep({worker!r}, lambda t: {{"lr": t.suggest_float("lr", 0.1, 1.0), "slow": t.number == 1}}, n_trials=3,
            metric="score", nprocs=1, parallel=1, name="k", runs_dir={runs!r})
"""


def trials_of(runs: Path, name: str):
    return optuna.load_study(study_name=name, storage=f"sqlite:///{runs / 'sweeps' / name / 'study.db'}").trials


def wait_for(check, timeout):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.2)
    return None


def test_a_sweep_killed_mid_trial_continues_without_running_a_finished_trial_again(tmp_path, capsys):
    runs = tmp_path / "runs"
    script = tmp_path / "sweep_k.py"
    script.write_text(KILLED.format(worker=WORKER, runs=str(runs)))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path)
    try:
        def trial_one_runs():
            try:
                trials = trials_of(runs, "k")
            except Exception:  # noqa: BLE001 - the study is not made yet
                return None
            one = [t for t in trials if t.number == 1 and t.user_attrs.get("run_dir")]
            return one and (Path(one[0].user_attrs["run_dir"]) / "metrics.jsonl").is_file() and one[0]

        one = wait_for(trial_one_runs, 120)
        assert one, "trial 1 did not start"
        os.kill(proc.pid, signal.SIGKILL)  # the kernel dies mid-trial
        proc.wait(timeout=30)
    finally:
        proc.kill()
    killed_dir = Path(one.user_attrs["run_dir"])
    assert wait_for(lambda: not live_workers(killed_dir), 30) is not None or not live_workers(killed_dir)
    first_lr = trials_of(runs, "k")[0].params["lr"]

    s = nbddp.sweep(WORKER, lambda t: {"lr": t.suggest_float("lr", 0.1, 1.0)}, n_trials=3, metric="score",
                    nprocs=1, parallel=2, name="k", runs_dir=runs, retry_failed=True)
    out = capsys.readouterr().out
    assert "trial 1 was running when the kernel that ran it ended" in out and "retry_failed=True" in out
    assert "No process of" not in out  # the run's own launch state names this study's trial 1
    trials = s.study.trials
    # The cut-off trial counts for nothing; its parameters run again as trial 2, then one new trial.
    assert {t.number: t.state.name for t in trials} == {0: "COMPLETE", 1: "FAIL", 2: "COMPLETE", 3: "COMPLETE"}
    assert trials[1].user_attrs["ended"] == "kernel died"
    assert trials[2].user_attrs["retry_of"] == 1 and trials[2].params == trials[1].params
    assert killed_dir.is_dir() and not live_workers(killed_dir)
    assert len(list(runs.glob("*-k-0"))) == 1 and trials[0].params["lr"] == first_lr  # never run again
    assert [r["number"] for r in s.trials][:1] == [s.best.number]  # best first
    assert s.best.value == max(t.value for t in trials if t.value is not None)
    for t in trials:
        assert json.loads((Path(t.user_attrs["run_dir"]) / "sweep.json").read_text())["trial"] == t.number


def test_the_pruner_stops_a_trial_at_its_next_step_and_keeps_its_folder(tmp_path):
    s = nbddp.sweep(WORKER, lambda t: {"lr": t.suggest_float("lr", 0.2, 0.2), "steps": 2000}, n_trials=1,
                    metric="score", nprocs=1, parallel=1, name="p", runs_dir=tmp_path,
                    pruner=optuna.pruners.ThresholdPruner(upper=0.5), echo=False)
    (trial,) = s.study.trials
    assert trial.state.name == "PRUNED"
    run = Path(trial.user_attrs["run_dir"])
    ended = json.loads((run / "ended.json").read_text())
    assert ended["reason"] == "pruned" and ended["steps"] < 2000
    assert max(trial.intermediate_values.values()) > 0.5
    assert s.trials[0]["state"] == "PRUNED" and s.best is None
    assert not live_workers(run)


UUID = [f"GPU-{i:08d}-0000-0000-0000-000000000000" for i in range(3)]


def test_gpu_slots_never_share_a_gpu_nor_take_one_another_kernel_leases(tmp_path, monkeypatch):
    from nbddp.kernel import launch
    from nbddp.kernel.slots import GpuSlots

    install_fake_nvidia_smi(tmp_path, monkeypatch, gpus=[(H100[0], UUID[i], *H100[2:]) for i in range(3)])
    monkeypatch.setenv(leases.LEASES_ENV, str(tmp_path / "leases"))
    other = leases.try_lease(1, UUID[1], run="another-kernel")  # held as another kernel would
    try:
        with pytest.warns(UserWarning, match="only 2 slot"):
            slots = GpuSlots(parallel=3, per_trial=1)
        a, b = slots.take(), slots.take()
        assert sorted(a.gpus + b.gpus) == [0, 2] and slots.take() is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # taken over as leased: no "leased by" warning
            with launch.on_leased_gpus(a.leases):
                _, ids, held = launch._resolve_gpus("x.py:f", list(a.gpus))
        assert held is a.leases and ids == a.gpus
        slots.give(a)
        slots._next_try = 0.0
        c = slots.take()
        assert c.gpus == a.gpus and c.gpus != b.gpus
        slots.give(b), slots.give(c)
        pairs = GpuSlots(parallel=None, per_trial=2)
        assert pairs.take().gpus == [0, 2] and pairs.take() is None
    finally:
        other.release()


def test_bad_input_is_refused_with_the_fix(tmp_path):
    cfg = TrainConfig(data_path=str(ROOT / "data" / "digits"), runs_dir=str(tmp_path), nprocs=1)
    with pytest.raises(ConfigError, match=r"'lrr' \(did you mean lr.*not a TrainConfig field"):
        nbddp.sweep(cfg, lambda t: {"lrr": t.suggest_float("lrr", 0.01, 0.1)}, n_trials=1, nprocs=1, echo=False)
    with pytest.raises(ConfigError, match=r"'rate'.*not an argument of .*train"):
        nbddp.sweep(WORKER, lambda t: {"rate": t.suggest_float("rate", 0.01, 0.1)}, n_trials=1, metric="score",
                    nprocs=1, runs_dir=tmp_path, echo=False)
    with pytest.raises(ConfigError, match="metric=...: name what your worker logs"):
        nbddp.sweep(WORKER, lambda t: {}, n_trials=1, nprocs=1, runs_dir=tmp_path)
    with pytest.raises(ConfigError, match="not both"):
        nbddp.sweep(WORKER, lambda t: {}, metric="score", nprocs=1, gpus_per_trial=1, runs_dir=tmp_path)
    with pytest.warns(UserWarning, match="cores"):
        from nbddp.kernel.slots import CpuSlots

        CpuSlots(parallel=os.cpu_count() + 1, nprocs=1)


def test_a_metric_never_logged_is_named_after_the_first_trial(tmp_path):
    with pytest.raises(ConfigError, match=r"metric='acc': trial 0 finished without logging it.*it logged score"):
        nbddp.sweep(WORKER, lambda t: {"lr": t.suggest_float("lr", 0.1, 1.0), "steps": 1}, n_trials=3,
                    metric="acc", nprocs=1, parallel=1, name="m", runs_dir=tmp_path, echo=False)
    assert len(trials_of(tmp_path, "m")) == 1


def test_optuna_missing_says_how_to_install_it_and_import_nbddp_loads_neither():
    code = ("import sys\n"
            "import nbddp\n"
            "assert 'optuna' not in sys.modules and 'torch' not in sys.modules\n"
            "sys.modules['optuna'] = None\n"
            "try:\n"
            "    nbddp.sweep('x.py:f', lambda t: {}, metric='m')\n"
            "except ImportError as e:\n"
            "    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "pip install optuna" in out.stdout, out.stderr


INTERRUPTED = """
import nbddp
nbddp.sweep({worker!r}, lambda t: {{"lr": t.suggest_float("lr", 0.1, 1.0), "slow": True}}, n_trials=4,
            metric="score", nprocs=1, parallel=2, name="i", runs_dir={runs!r})
"""


def test_an_interrupt_ends_every_running_trial_and_leaves_no_process(tmp_path):
    """Jupyter's Interrupt (SIGINT to the kernel's group) while two trials run: both stop at their next
    step, no worker is left, the study is kept and the trials count for nothing; the cell raises."""
    runs = tmp_path / "runs"
    script = tmp_path / "sweep_i.py"
    script.write_text(INTERRUPTED.format(worker=WORKER, runs=str(runs)))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def both_run():
            try:
                trials = trials_of(runs, "i")
            except Exception:  # noqa: BLE001 - the study is not made yet
                return None
            dirs = [Path(t.user_attrs["run_dir"]) for t in trials if t.user_attrs.get("run_dir")]
            return len(dirs) == 2 and all((d / "metrics.jsonl").is_file() for d in dirs) and dirs

        dirs = wait_for(both_run, 120)
        assert dirs, "the two trials did not start"
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode != 0 and "TrainingInterrupted" in out and "was interrupted" in out, out[-3000:]
    for d in dirs:
        assert not live_workers(d), d
        assert json.loads((d / "ended.json").read_text())["reason"] == "interrupt"
    trials = trials_of(runs, "i")
    assert [(t.state.name, t.user_attrs.get("ended")) for t in trials] == [("FAIL", "stopped")] * 2


def test_stop_of_a_background_sweep_ends_its_trials(tmp_path):
    s = nbddp.sweep(WORKER, lambda t: {"lr": t.suggest_float("lr", 0.1, 1.0), "slow": True}, n_trials=3,
                    metric="score", nprocs=1, parallel=1, name="b", runs_dir=tmp_path, block=False, echo=False)
    assert s.running
    assert wait_for(lambda: any(r["state"] == "RUNNING" and r["value"] is not None for r in s.trials), 120)
    s.stop()
    assert not s.running
    (t,) = s.study.trials
    assert (t.state.name, t.user_attrs["ended"]) == ("FAIL", "stopped")
    assert not live_workers(t.user_attrs["run_dir"])
    assert json.loads((Path(t.user_attrs["run_dir"]) / "ended.json").read_text())["reason"] == "stop"



OPENER = """
import sys, time
from pathlib import Path
import optuna  # imported before the start, so the openers meet at it
from nbddp.kernel.study import open_study
start = float(sys.argv[3])
time.sleep(max(0.0, start - time.time()))
open_study(Path(sys.argv[1]), sys.argv[2], "maximize", None, None)
"""

READER = """
import sys, time
import optuna
db, start = sys.argv[1] + "/sweeps/" + sys.argv[2] + "/study.db", float(sys.argv[3])
time.sleep(max(0.0, start - time.time()))
while time.time() < start + 8:
    try:
        optuna.load_study(study_name=sys.argv[2], storage="sqlite:///" + db)
        break
    except Exception:  # not made yet, or made by this very reader (Optuna makes a missing file) and racing
        time.sleep(0.01)
"""


def test_a_new_study_opened_by_kernels_at_once_is_never_seen_half_made_nor_fails_them(tmp_path):
    """Optuna fails when two processes make one new SQLite study at once ("UNIQUE constraint failed:
    alembic_version.version_num"). Two kernels open study ``a`` at once while the test watches for
    its file; two more open study ``b`` while a notebook polls it with ``optuna.load_study``, which
    makes the file itself when it is missing."""
    runs = tmp_path / "runs"
    start = time.time() + 6.0  # every process has imported optuna by then
    openers = [subprocess.Popen([sys.executable, "-c", OPENER, str(runs), name, str(start)],
                                stderr=subprocess.PIPE, text=True) for name in "aabb"]
    reader = subprocess.Popen([sys.executable, "-c", READER, str(runs), "b", str(start)])
    db = runs / "sweeps" / "a" / "study.db"
    first_sight = None
    while first_sight is None and time.time() < start + 30:
        if db.exists():  # the moment the file appears, it already holds Optuna's stamped tables
            with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as con:
                try:
                    first_sight = con.execute("SELECT count(*) FROM alembic_version").fetchone()
                except sqlite3.OperationalError as e:  # no such table: the file is half made
                    first_sight = str(e)
        time.sleep(0.002)
    errors = [p.communicate(timeout=60)[1] for p in openers]
    reader.wait(timeout=60)
    assert [p.returncode for p in openers] == [0, 0, 0, 0], "\n".join(errors)
    assert first_sight == (1,), "the study file was seen before its tables were made"
    for name in "ab":
        folder = runs / "sweeps" / name
        assert [s.study_name for s in optuna.get_all_study_summaries(f"sqlite:///{folder / 'study.db'}")] == [name]
        assert sorted(p.name for p in folder.iterdir()) == ["study.db"]  # no scratch file left


# ---------------------------------------------------------------------------- what a study may make nbddp do
LIVE = """
import sys
import nbddp
nbddp.spawn_train({worker!r}, nprocs=1, runs_dir={runs!r}, name="live", echo=False,
                  kwargs={{"slow": True, "sleep": 0.5}})
"""


def start_live_run(tmp_path, runs):
    """A run of another kernel (a process of the user's), training until ended; ``(process, run folder)``."""
    script = tmp_path / "live.py"
    script.write_text(LIVE.format(worker=WORKER, runs=str(runs)))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path)
    found = wait_for(lambda: [p for p in runs.glob("*-live") if (p / "metrics.jsonl").is_file() and live_workers(p)],
                     120)
    assert found, "the live run did not start"
    return proc, found[0]


def test_a_study_naming_a_live_run_of_another_kernel_never_ends_it_nor_runs_what_is_outside_its_space(tmp_path,
                                                                                                     capsys):
    """The study says a trial of a dead kernel runs in a folder that is a live run of another kernel
    (whoever wrote that): the run's own launch state says this study never launched it, so none of
    its processes is touched. A trial enqueued outside the space (lr=123456.0) is refused and said,
    not run; and ``best`` never names a folder outside the runs folder."""
    runs = tmp_path / "runs"
    proc, live = start_live_run(tmp_path, runs)
    try:
        workers = live_workers(live)
        from nbddp.kernel.study import open_study

        study, _ = open_study(runs, "s", "maximize", None, None)
        orphan = study.ask()
        orphan.set_user_attr("run_dir", str(live))
        orphan.set_user_attr("kernel", [os.getpid(), 0])  # a kernel that is gone (no process started at 0)
        study.enqueue_trial({"lr": 123456.0})
        elsewhere = tmp_path / "elsewhere"
        (elsewhere / "export").mkdir(parents=True)
        (elsewhere / "export" / "model.pth").write_bytes(b"weights of someone else")
        study.add_trial(optuna.trial.create_trial(params={"lr": 0.5}, value=1e9, user_attrs={"run_dir": str(elsewhere)},
                                                  distributions={"lr": optuna.distributions.FloatDistribution(0.1, 1)}))

        s = nbddp.sweep(WORKER, lambda t: {"lr": t.suggest_float("lr", 0.1, 1.0)}, n_trials=2, metric="score",
                        nprocs=1, parallel=1, name="s", runs_dir=runs)
        out, err = capsys.readouterr()
        assert f"No process of {live} was ended: its launch state has no private record of this sweep's trial 0" in out
        assert live_workers(live) == workers and proc.poll() is None  # the live run trains on
        trials = {t.number: t for t in s.study.trials}
        assert trials[0].state.name == "FAIL" and trials[0].user_attrs["ended"] == "kernel died"
        assert trials[1].state.name == "FAIL" and trials[1].user_attrs["ended"] == "outside the search space"
        assert "run_dir" not in trials[1].user_attrs and "trial 1 not run" in err and "lr=123456.0" in err
        assert [t.state.name for t in trials.values()].count("COMPLETE") == 2  # the added one and one that ran
        assert s.best.value == 1e9 and s.best.run_dir is None and s.best.weights_path is None
        assert not [p for p in runs.iterdir() if p.name.endswith("-s-1")]  # trial 1 never got a run folder
    finally:
        proc.kill()
        proc.wait(timeout=30)
        nbddp.cleanup(live)


def test_a_study_others_could_write_a_linked_study_and_a_swapped_folder_are_refused_naming_them(tmp_path):
    runs = tmp_path / "runs"
    space = lambda t: {"lr": t.suggest_float("lr", 0.1, 1.0)}  # noqa: E731
    options = dict(n_trials=1, metric="score", nprocs=1, runs_dir=runs, echo=False)
    from nbddp.contract.private import NotPrivate
    from nbddp.kernel.study import open_study

    study, _ = open_study(runs, "g", "maximize", None, None)
    folder = runs / "sweeps" / "g"
    assert (folder.stat().st_mode & 0o777, (folder / "study.db").stat().st_mode & 0o777) == (0o700, 0o600)
    folder.chmod(0o2775)  # as an older nbddp made it in a group-writable project folder
    with pytest.raises(NotPrivate, match=rf"{folder} may be written by other users \(mode 2775\).*chmod 700 {folder}"):
        nbddp.sweep(WORKER, space, name="g", **options)
    folder.chmod(0o700)
    os.link(folder / "study.db", tmp_path / "another-name.db")
    with pytest.raises(NotPrivate, match=rf"{folder / 'study.db'} has other names \(hard links\)"):
        nbddp.sweep(WORKER, space, name="g", **options)
    (tmp_path / "another-name.db").unlink()
    (folder / "study.db").rename(tmp_path / "elsewhere.db")
    (folder / "study.db").symlink_to(tmp_path / "elsewhere.db")
    with pytest.raises(NotPrivate, match=rf"{folder / 'study.db'} is a symbolic link"):
        nbddp.sweep(WORKER, space, name="g", **options)
    (folder / "study.db").unlink()
    (tmp_path / "elsewhere.db").rename(folder / "study.db")

    # In use, the folder renamed away and a copy put in its place: the copy is never read.
    study, _ = open_study(runs, "g", "maximize", None, None)
    assert study.get_trials() == []
    folder.rename(runs / "sweeps" / "g-away")
    folder.mkdir(mode=0o700)
    (folder / "study.db").write_bytes((runs / "sweeps" / "g-away" / "study.db").read_bytes())
    (folder / "study.db").chmod(0o600)
    with pytest.raises(NotPrivate, match=rf"{folder} was removed or replaced while the sweep used it"):
        study.get_trials()


def test_a_damaged_study_is_named_with_what_to_do(tmp_path):
    from nbddp.contract.errors import NbddpError

    folder = tmp_path / "sweeps" / "d"
    folder.mkdir(parents=True, mode=0o700)
    (folder / "study.db").write_bytes(b"not an SQLite file " * 200)
    (folder / "study.db").chmod(0o600)
    with pytest.raises(NbddpError, match=rf"(?s){folder / 'study.db'} is not a readable Optuna study .*damaged.*"
                                          rf"mv {folder / 'study.db'} {folder / 'study.db'}.damaged"):
        nbddp.sweep(WORKER, lambda t: {"lr": t.suggest_float("lr", 0.1, 1.0)}, n_trials=1, metric="score", nprocs=1,
                    name="d", runs_dir=tmp_path, echo=False)


LOCKED = """
import nbddp
s = nbddp.sweep({worker!r}, lambda t: {{"lr": t.suggest_float("lr", 0.1, 1.0)}}, n_trials=1, metric="score",
                nprocs=1, name="l", runs_dir={runs!r})
print("done", len(s.study.trials), flush=True)
"""


def test_a_study_locked_by_another_process_waits_with_a_line_naming_it_and_the_holder(tmp_path):
    """optuna-dashboard or a notebook in the middle of a read holds a lock on the study: the sweep
    waits for it, and says so (which file, which process) instead of waiting in silence."""
    from nbddp.kernel.study import open_study

    runs = tmp_path / "runs"
    open_study(runs, "l", "maximize", None, None)
    db = runs / "sweeps" / "l" / "study.db"
    holder = sqlite3.connect(db, isolation_level=None)
    holder.execute("BEGIN")
    holder.execute("SELECT count(*) FROM trials").fetchone()  # a read lock, held until the line is seen
    script = tmp_path / "locked.py"
    script.write_text(LOCKED.format(worker=WORKER, runs=str(runs)))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("nbddp: waiting for"):
                break
        holder.execute("ROLLBACK")
        holder.close()
        rest, _ = proc.communicate(timeout=120)
    finally:
        proc.kill()
    said = [line for line in lines if line.startswith("nbddp: waiting for")]
    assert said, "".join(lines)[-3000:]
    assert str(db) in said[0] and f"pid {os.getpid()} of " in said[0] and "up to 30 s" in said[0]
    assert proc.returncode == 0 and "done 1" in rest, rest[-3000:]


def test_a_trial_whose_run_was_launched_by_a_live_kernel_is_never_ended_whatever_the_study_says(tmp_path, capsys):
    """Two kernels share a study; the study's record of the kernel running trial 1 says it is gone
    (whoever wrote that): the run's own launch state names the kernel that launched it, alive, so
    nothing of the run is touched."""
    runs = tmp_path / "runs"
    script = tmp_path / "sweep_k.py"
    script.write_text(KILLED.format(worker=WORKER, runs=str(runs)))
    proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path)
    try:
        def trial_one_runs():
            try:
                trials = trials_of(runs, "k")
            except Exception:  # noqa: BLE001 - the study is not made yet
                return None
            one = [t for t in trials if t.number == 1 and t.user_attrs.get("run_dir")]
            return one and live_workers(one[0].user_attrs["run_dir"]) and one[0]

        one = wait_for(trial_one_runs, 120)
        assert one, "trial 1 did not start"
        run, workers = Path(one.user_attrs["run_dir"]), live_workers(one.user_attrs["run_dir"])
        storage = optuna.storages.RDBStorage(f"sqlite:///{runs / 'sweeps' / 'k' / 'study.db'}")
        storage.set_trial_user_attr(one._trial_id, "kernel", [os.getpid(), 0])  # "its kernel is gone"
        storage.engine.dispose()
        nbddp.sweep(WORKER, lambda t: {"lr": t.suggest_float("lr", 0.1, 1.0)}, n_trials=1, metric="score", nprocs=1,
                    name="k", runs_dir=runs)
        out = capsys.readouterr().out
        assert f"No process of {run} was ended: the kernel that launched it (pid {proc.pid}) is alive" in out
        assert live_workers(run) == workers
    finally:
        proc.kill()
        proc.wait(timeout=30)
