"""The run's private state folder (``.nbddp/``) on a shared server, played by two real users of one
group (umask 002, a group-writable setgid project folder): a group member can neither answer a
rank's debugger prompt nor make the kernel signal a process, by writing, renaming or swapping
anything in the run folder.

The attack is the same in both: the attacker writes a state file into a folder of the run she
may write (``tensorboard/`` and its event files are the victim's, group-writable under umask 002),
renames ``.nbddp`` away and that folder into its place while the run runs (renaming in a
group-writable run folder needs no other right). The kernel and the ranks keep using the state
folder the launch made (pinned by descriptor), so the swap changes nothing; the next launch moves
the swapped folder aside, unread.
"""

import glob
import os
import subprocess
import sys
import textwrap

import pytest

from conftest import WORKERS, wait_for
from shared_users import shared_project  # noqa: F401  (the fixture)

from nbddp import cleanup, spawn_train
from nbddp.contract import rundir, statedir
from nbddp.contract.system import start_time

WORKER = textwrap.dedent('''
    import os, time

    def held(ctx, ready, go, breakpoint=False):
        """Log once (metrics.jsonl, tensorboard/), say where the run is, wait for the test's word."""
        ctx.log(loss=1.0)
        os.makedirs(os.path.join(ctx.run_dir, "tensorboard"), exist_ok=True)
        with open(ready + ".tmp", "w") as f:
            f.write(str(ctx.run_dir))
        os.replace(ready + ".tmp", ready)
        while not os.path.exists(go):
            time.sleep(0.05)
        if breakpoint:
            ctx.breakpoint(rank=0)
        return "done"
''')

#: The victim's cell, as a script: no one can answer a prompt (the relay continues a breakpoint itself).
LAUNCH = ("import os, sys; sys.stdin = open(os.devnull); import nbddp; "
          "r = nbddp.spawn_train('statew.py:held', {ready!r}, {go!r}, {breakpoint}, nprocs=1, runs_dir='runs', "
          "name='st', echo=False); print('RESULT', r.value)")


@pytest.fixture(scope="module")
def project(shared_project):  # noqa: F811 - the fixture imported above
    p = shared_project
    (p.root / "statew.py").write_text(WORKER)
    p.chown(p.root / "statew.py", p.victim)
    return p


def _start_run(p, tag: str, breakpoint: bool):
    """The victim's launch in the background; returns (process, its run folder) once the worker waits."""
    ready, go = str(p.root / f"ready-{tag}"), str(p.root / f"go-{tag}")
    run = p.start(p.victim, LAUNCH.format(ready=ready, go=go, breakpoint=breakpoint))
    assert wait_for(lambda: os.path.exists(ready) or run.poll() is not None, 120), "the run did not start"
    assert run.poll() is None, run.communicate()[0]
    with open(ready) as f:
        return run, f.read(), go


def _finish(run) -> str:
    out, _ = run.communicate(timeout=180)
    assert run.returncode == 0, out
    return out


def _swap_in(p, run_dir: str, folder: str) -> None:
    """As the attacker: rename ``.nbddp`` away and ``folder`` (of the run) into its place."""
    p.shell(p.attacker, f"cd {run_dir} && mv .nbddp .nbddp.moved && mv {folder} .nbddp")


def test_a_group_member_cannot_answer_a_ranks_debugger_prompt(project):
    p = project
    marker = p.root / "pdb-line-ran"
    run, run_dir, go = _start_run(p, "debugger", breakpoint=True)
    tensorboard = os.path.join(run_dir, "tensorboard")
    assert os.stat(tensorboard).st_uid == p.victim.uid and os.stat(tensorboard).st_mode & 0o020  # hers to write in
    answer = '{"seq": 1, "line": "!__import__(\\"os\\").system(\\"touch %s\\") ;; c"}' % marker
    p.shell(p.attacker, f"printf '%s' '{answer}' > {tensorboard}/debug.rank0.in")
    _swap_in(p, run_dir, "tensorboard")
    p.shell(p.attacker, f"touch {go}")
    out = _finish(run)
    assert not marker.exists(), "the attacker's pdb command ran as the victim"
    assert "RESULT done" in out, out
    # The rank stopped and was continued through the launch's own state folder, wherever it was moved.
    assert '"state": "done"' in open(os.path.join(run_dir, ".nbddp.moved", "debug.rank0.json")).read()
    # The victim is told: the kernel kept the launch's own state folder, and the next launch will not use this one.
    assert ".nbddp was replaced" in out, out

    # The next launch in that run folder moves the swapped folder aside, never reading it.
    again = p.run(p.victim, "import os, sys; sys.stdin = open(os.devnull); import nbddp; "
                  f"r = nbddp.spawn_train('statew.py:held', {str(p.root / 'ready-x')!r}, {go!r}, nprocs=1, "
                  f"resume={run_dir!r}, echo=False); print('RESULT', r.value)", timeout=180)
    assert "RESULT done" in again.stdout, again.stdout + again.stderr
    assert "moved to .nbddp.not-yours-" in again.stderr, again.stderr
    assert not marker.exists()


def test_a_group_member_cannot_make_the_kernel_signal_a_process(project):
    p = project
    run, run_dir, go = _start_run(p, "tree", breakpoint=False)
    # An unrelated process of the victim's (a Jupyter server, another run), started while the run runs.
    decoy = p.start(p.victim, "import time; time.sleep(600)")
    try:
        assert wait_for(lambda: start_time(decoy.pid) is not None, 10)
        events = glob.glob(os.path.join(run_dir, "tensorboard", "events.out.tfevents.*"))[0]
        assert os.stat(events).st_uid == p.victim.uid and os.stat(events).st_mode & 0o020
        forged = textwrap.dedent(f'''
            pid = {decoy.pid}
            started = open(f"/proc/{{pid}}/stat").read().rsplit(")", 1)[1].split()[19]
            open({events!r}, "w").write('{{"%d": %s}}' % (pid, started))
        ''')
        p.run(p.attacker, forged)  # a TensorBoard event file is the victim's, and group-writable
        p.shell(p.attacker, f"mv {events} {run_dir}/tensorboard/tree-rank0.json")
        _swap_in(p, run_dir, "tensorboard")
        p.shell(p.attacker, f"touch {go}")
        out = _finish(run)
        assert "RESULT done" in out, out
        assert decoy.poll() is None, f"the kernel ended the victim's unrelated process {decoy.pid}\n{out}"
    finally:
        decoy.kill()
        decoy.wait()


def test_a_tree_record_never_names_a_process_older_than_its_rank(tmp_path):
    """Even a record of the user's own names no process that started before the launch's ranks:
    none of them can be a rank's descendant (here the rank forges its own record)."""
    decoy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        assert wait_for(lambda: start_time(decoy.pid) is not None, 10)
        result = spawn_train(f"{WORKERS / 'private.py'}:forge_tree", nprocs=1, runs_dir=tmp_path, echo=False,
                             kwargs={"pid": decoy.pid, "started": start_time(decoy.pid)})
        assert result.value == "forged"
        assert decoy.poll() is None, "the kernel ended a process started before the launch"
    finally:
        decoy.kill()
        decoy.wait()


def test_a_process_started_in_the_launchs_own_clock_tick_is_older_than_its_ranks():
    """A start time is a whole clock tick (10 ms): a process started milliseconds before a warm launch
    often shares the launch's tick, and counted as started at the launch it was ended with the ranks'
    tree (the test above, in a full run). The launch's tick is the next one: it divides the two."""
    from nbddp.kernel.procs import launch_ticks

    for _ in range(10):
        before = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            assert wait_for(lambda: start_time(before.pid) is not None, 10)
            not_before = launch_ticks()
            after = subprocess.Popen(["sleep", "0"])
            assert start_time(before.pid) < not_before <= (start_time(after.pid) or not_before)
            after.wait()
        finally:
            before.kill()
            before.wait()


def test_a_state_folder_moved_in_from_another_run_is_never_used(tmp_path):
    """Renamed from a run of the user's own into another's place, a private ``.nbddp`` still says which
    run folder it belongs to: its records are not this run's (pids, temp folder), nor are its files."""
    first = spawn_train(f"{WORKERS / 'private.py'}:say", nprocs=1, kwargs={"tag": "a"}, runs_dir=tmp_path,
                        name="a", echo=False)
    other = spawn_train(f"{WORKERS / 'private.py'}:say", nprocs=1, kwargs={"tag": "b"}, runs_dir=tmp_path,
                        name="b", echo=False)
    assert rundir.read_launch_record(first.run_dir)["pids"]
    os.rename(rundir.state_dir(first.run_dir), first.run_dir / ".nbddp.own")
    os.rename(rundir.state_dir(other.run_dir), rundir.state_dir(first.run_dir))
    assert rundir.read_launch_record(first.run_dir) == {}
    with pytest.warns(UserWarning, match="ends nothing and removes nothing: .*belongs to another run folder"):
        assert cleanup(first.run_dir, grace_s=0.1) == []
    with pytest.warns(UserWarning, match=r"\.nbddp belongs to another run folder .*moved to \.nbddp\.not-yours-"):
        again = spawn_train(f"{WORKERS / 'private.py'}:say", nprocs=1, kwargs={"tag": "c"}, resume=first.run_dir,
                            echo=False)
    assert again.value == "c"


def test_a_rank_refuses_a_state_folder_that_is_not_the_launchs(tmp_path):
    made = statedir.fresh(tmp_path, lambda name: False)
    identity = made.identity
    statedir.release(tmp_path)
    os.rename(tmp_path / ".nbddp", tmp_path / ".nbddp.moved")
    (tmp_path / ".nbddp").mkdir(mode=0o700)  # the user's own, private, but not the folder the launch made
    with pytest.raises(statedir.NotPrivate, match=r"\.nbddp is not the state folder the kernel made for this launch"):
        statedir.pin(tmp_path, identity)
    os.rmdir(tmp_path / ".nbddp")
    os.rename(tmp_path / ".nbddp.moved", tmp_path / ".nbddp")
    assert statedir.pin(tmp_path, identity).identity == identity
    statedir.release(tmp_path)
