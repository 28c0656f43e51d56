"""Runs that outlive their kernel by choice (``spawn_train(..., detach=True)``), followed from others.

Real kernels (jupyter_client) killed by SIGKILL mid-run. One detached run serves the kernel-level
assertions: it goes on after its kernel's SIGKILL, a second kernel lists it, attaches, sees its
output move, stops it and gets the worker's value, and nothing of it is left. Another serves the
restart under ``max_restarts`` and then a supervisor's SIGKILL, launched from the test process
itself (the supervisor is the same whoever starts it); another local user's view is played by two real users. That the default still dies with its kernel is
``test_kernel.py::test_workers_die_with_the_kernel``.
"""

import contextlib
import json
import os
import re
import signal
import time

import pytest

from conftest import ROOT, WORKERS, execute, fault_env, kernel_pid, real_kernel, survivors, wait_for
from nbddp.contract import statedir
from shared_users import shared_project  # noqa: F401  (the fixture)
from nbddp.kernel import owners
from nbddp.kernel.procs import live_workers, marked_processes

TARGET = str(WORKERS / "detached.py") + ":until_stopped"


def _owner(run_dir):
    return json.loads(statedir.read(run_dir, owners.OWNER))


def _step(run_dir):
    progress = statedir.read_json(run_dir, "progress.json") or {}
    return progress.get("step") or 0


@pytest.fixture(scope="module")
def orphaned_run(tmp_path_factory):
    """A detached 2-rank run whose kernel was SIGKILLed: ``(run_dir, supervisor pid, rank pids, folder)``."""
    folder = tmp_path_factory.mktemp("detached")
    runs = folder / "runs"
    with real_kernel(folder) as (km, kc):
        reply, out = execute(kc, f"import sys; sys.path.insert(0, {str(ROOT)!r}); import nbddp\n"
                                 f"h = nbddp.spawn_train({TARGET!r}, nprocs=2, runs_dir={str(runs)!r}, detach=True, "
                                 "block=False, echo=False)\nprint('RUN', h.run_dir)")
        assert reply["status"] == "ok", out
        run_dir = next(runs.iterdir())
        supervisor = _owner(run_dir)["pid"]
        try:
            assert wait_for(lambda: _step(run_dir) >= 5, timeout=60), out
            pids = json.loads(statedir.read(run_dir, "launch.json"))["pids"]
            os.kill(kernel_pid(km), signal.SIGKILL)  # the OOM killer's way
        except BaseException:
            _end(supervisor)
            raise
    yield run_dir, supervisor, pids, folder
    _end(supervisor)  # a failed test leaves nothing behind either (its ranks die with it)


def _end(pid):
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def test_a_detached_run_goes_on_after_its_kernel_is_killed(orphaned_run):
    run_dir, supervisor, pids, _ = orphaned_run
    owner = _owner(run_dir)
    assert owner["detached"] and owner["pid"] == supervisor
    step = _step(run_dir)
    assert wait_for(lambda: _step(run_dir) >= step + 10, timeout=60), "the run stopped with its kernel"
    assert survivors([supervisor, *pids]).keys() == {supervisor, *pids}
    assert os.getsid(supervisor) == supervisor or os.getsid(supervisor) != os.getsid(os.getpid())


def test_another_kernel_lists_follows_stops_it_and_gets_the_value(orphaned_run):
    run_dir, supervisor, pids, folder = orphaned_run
    with real_kernel(folder) as (km, kc):
        reply, out = execute(kc, f"import sys; sys.path.insert(0, {str(ROOT)!r}); import nbddp\n"
                                 "listed = nbddp.runs()\n"
                                 "print('LISTED', [str(r.run_dir) for r in listed], listed._repr_html_()[:7])\n"
                                 f"h = nbddp.attach({str(run_dir)!r})\n"
                                 "import time; s0 = h.progress.get('step', 0); time.sleep(1.5)\n"
                                 "print('MOVED', h.progress.get('step', 0) > s0)\n"
                                 "print('STACKS', sorted(h.stacks()))")
        assert reply["status"] == "ok", out
        assert str(run_dir) in out.split("LISTED", 1)[1].splitlines()[0] and "<table>" in out, out
        assert re.search(r"\[rank0\] step \d+", out), out  # the last lines, then live output
        assert "MOVED True" in out and "STACKS [0, 1]" in out, out  # every rank answers for its stack
        assert _interrupted_wait(km, kc) == "StoppedWaiting"  # an Interrupt ends the wait, not the run
        step = _step(run_dir)
        assert wait_for(lambda: _step(run_dir) >= step + 5, timeout=30)
        reply, out = execute(kc, "h.stop(); r = h.wait(); print('VALUE', r.stopped, r.value)")
        assert reply["status"] == "ok", out
        assert "VALUE True {'steps':" in out and "'stopped': True}" in out, out
    assert wait_for(lambda: survivors([supervisor, *pids]) == {}, timeout=30), survivors([supervisor, *pids])
    assert live_workers(run_dir) == [] and marked_processes(run_dir) == {}  # nothing of the run is left
    assert all(str(run_dir) != e["run_dir"] for e in owners.registered())


def _interrupted_wait(km, kc) -> str:
    """Run ``h.wait()`` in a cell, interrupt it once it waits; the error's name."""
    msg_id = kc.execute("print('WAITING', flush=True); h.wait()")
    while True:
        msg = kc.get_iopub_msg(timeout=60)
        if msg["parent_header"].get("msg_id") == msg_id and "WAITING" in msg["content"].get("text", ""):
            break
    time.sleep(0.3)
    km.interrupt_kernel()
    while True:
        reply = kc.get_shell_msg(timeout=60)
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply["content"].get("ename")


def test_a_rank_killed_restarts_under_max_restarts_and_a_killed_supervisor_takes_its_ranks(tmp_path):
    """One detached run: rank 1 is SIGKILLed, the supervisor restarts the run (``max_restarts=1``);
    then the supervisor itself is SIGKILLed, and its ranks go with it. The panel follows it too."""
    import nbddp
    from nbddp.contract.errors import RunAbandoned

    notices = []
    handle = nbddp.spawn_train(TARGET, nprocs=2, runs_dir=tmp_path, detach=True, block=False, echo=False,
                               max_restarts=1, restart_backoff_s=0.1, env=fault_env("run:1:sigkill"),
                               on_event=lambda kind, payload: notices.append(payload) if kind == "notice" else None)
    run_dir = handle.run_dir
    supervisor = _owner(run_dir)["pid"]
    try:
        panel = nbddp.TrainingPanel.attach(run_dir)  # the panel follows it too, beside the handle
        restarted = lambda: json.loads(statedir.read(run_dir, "launch.json")).get("restarts")  # noqa: E731
        assert wait_for(lambda: restarted() and _step(run_dir) >= 3, timeout=120), statedir.read(run_dir, "launch.json")
        cause = restarted()[0]["cause"]
        assert len(restarted()) == 1 and "rank 1" in cause and "SIGKILL" in cause, cause
        assert panel.handle.running and panel.handle.progress.get("step", 0) >= 1
        assert wait_for(lambda: any("restarted (1): rank 1" in n for n in notices), timeout=10), notices
        pids = json.loads(statedir.read(run_dir, "launch.json"))["pids"]
        assert survivors(pids).keys() == set(pids)
    except BaseException:
        _end(supervisor)
        raise
    os.kill(supervisor, signal.SIGKILL)
    assert wait_for(lambda: survivors([supervisor, *pids]) == {}, timeout=30), survivors([supervisor, *pids])
    with pytest.raises(RunAbandoned, match="ended without saying how the run ended"):
        handle.wait(timeout=30)
    with pytest.raises(RunAbandoned):
        panel.wait(timeout=30)
    assert all(str(run_dir) != e["run_dir"] for e in owners.registered())


def test_another_user_lists_none_of_your_runs_and_cannot_follow_them(shared_project):  # noqa: F811
    """Two real users of one group on a group-writable project folder: the victim's detached run is in
    her own list, not the attacker's; the attacker can neither attach nor stop it, and a run folder she
    plants in the shared runs folder is listed to no one. The victim's ``python -m nbddp stop`` ends it."""
    p = shared_project
    worker = str(p.source / "tests" / "workers" / "detached.py") + ":until_stopped"
    started = p.run(p.victim, "import nbddp; h = nbddp.spawn_train(" + repr(worker) + ", nprocs=1, runs_dir='runs', "
                    "detach=True, block=False, echo=False); print('RUN', h.run_dir)", timeout=300)
    run_dir = started.stdout.split("RUN ", 1)[1].split()[0]
    supervisor = None
    try:
        listing = "import nbddp; print('LISTED', [str(r.run_dir) for r in nbddp.runs()])"
        planted = "import json, os; os.makedirs('runs/planted/.nbddp'); " \
                  "json.dump({'pid': os.getppid(), 'detached': True}, open('runs/planted/.nbddp/owner.json', 'w'))"
        p.run(p.attacker, planted)
        mine = p.run(p.victim, listing + f"; print('OWNER', open({run_dir + '/.nbddp/owner.json'!r}).read()); "
                     "from nbddp.cli import main; main(['runs'])").stdout
        supervisor = json.loads(mine.split("OWNER ", 1)[1].splitlines()[0])["pid"]
        assert f"LISTED [{run_dir!r}]" in mine, mine
        table = mine.split("OWNER ", 1)[1]
        assert run_dir in table and "running (detached)" in table, table
        assert "LISTED []" in p.run(p.attacker, listing).stdout
        for command in ("attach", "stop"):
            refused = p.run(p.attacker, f"import sys; from nbddp.cli import main; sys.exit(main([{command!r}, "
                                        f"{run_dir!r}]))", check=False)
            assert refused.returncode != 0 and "Permission" in refused.stderr + refused.stdout, refused
        assert survivors([supervisor]).keys() == {supervisor}
        stopped = p.run(p.victim, f"import sys; from nbddp.cli import main; sys.exit(main(['stop', {run_dir!r}]))")
        assert "stopped; result: {'steps':" in stopped.stdout, stopped.stdout
        assert wait_for(lambda: survivors([supervisor]) == {}, timeout=30)
    finally:
        if supervisor is not None:
            _end(supervisor)


def test_a_gpu_lease_handed_to_the_supervisor_names_it_and_ends_with_it(tmp_path, monkeypatch):
    """The kernel's lease is taken over by the supervisor (same claim, same ticket): held while it
    lives, whatever happens to the kernel; free once it is gone, however it ends."""
    import subprocess
    import sys
    from types import SimpleNamespace

    from nbddp.contract import leases

    monkeypatch.setenv(leases.LEASES_ENV, str(tmp_path / "leases"))
    gpu = SimpleNamespace(index=0, uuid="GPU-detached-test")
    lease = leases.try_lease(gpu.index, gpu.uuid, run="runs/r")
    code = ("import json, sys, time; from nbddp.contract.leases import adopt; "
            "print('ADOPTED', adopt(json.loads(sys.argv[1])) is not None, flush=True); time.sleep(120)")
    child = subprocess.Popen([sys.executable, "-c", code, json.dumps(lease.handoff())], stdout=subprocess.PIPE,
                             text=True)
    try:
        assert child.stdout.readline().strip() == "ADOPTED True"
        lease.forget()  # the kernel lets go without removing the claim
        assert f"pid {child.pid}" in leases.holders([gpu])[0]
        assert leases.try_lease(gpu.index, gpu.uuid) is None  # still held for another launch
    finally:
        child.kill()
        child.wait()
    assert leases.holders([gpu]) == {}


def test_the_panel_s_box_launches_detached(no_gpu):
    """"keep running if the kernel stops" adds ``detach=True`` to the panel's launch, for a worker and a config."""
    import nbddp

    panel = nbddp.TrainingPanel(TARGET, nprocs=1)
    assert "detach" not in panel._launch_args()[1]
    panel.keep_running_checkbox.value = True
    assert panel._launch_args()[1]["detach"] is True
    config = nbddp.TrainingPanel(nbddp.TrainConfig(data_path=str(ROOT / "data" / "digits"), nprocs=1))
    config.keep_running_checkbox.value = True
    assert config._launch_args()[1]["detach"] is True


def test_attach_of_a_local_run_refuses_a_link_at_its_name_and_follows_the_folder_itself(tmp_path):
    """A run folder is followed by its own name: a link (anyone who may write the runs folder can point
    one at another run) is refused before any record is read; the folder itself is followed."""
    import nbddp
    from nbddp.contract.private import NotPrivate

    handle = nbddp.spawn_train(f"{WORKERS / 'detached.py'}:until_stopped", nprocs=1, block=False, echo=False,
                               runs_dir=str(tmp_path / "runs"), name="linked")
    try:
        assert wait_for(lambda: handle.progress, 60), "the run never reported a step"
        link = tmp_path / "runs" / "looks-like-a-run"
        link.symlink_to(handle.run_dir, target_is_directory=True)
        with pytest.raises(NotPrivate, match="symbolic link"):
            nbddp.attach(link, echo=False)
        followed = nbddp.attach(handle.run_dir, echo=False)  # this kernel's own run: its pin kept
        assert followed.run_dir == handle.run_dir or str(followed.run_dir) == str(handle.run_dir)
    finally:
        handle.stop(wait=True)
    assert handle.outcome.value["stopped"] and not survivors(handle.pids)
