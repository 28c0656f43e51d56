"""More of a group member's moves on a shared server, played by two real users of one group (umask
002, a group-writable setgid project folder): links and renames in the run folder, where anyone
of the group may rename, replace or link anything.

- the run folder's name replaced by a link to another run of the victim's: at the end of the
  first run the kernel must not end the other run's ranks (the leftovers it looks for are the
  processes marked with the run folder the launch used, not whatever its name leads to now);
- links planted where a rank writes (``metrics.jsonl``, the profiler's ``profile/`` folder): a
  rank must never write through them into a file of the victim's elsewhere (appending to it, or
  replacing it with a trace).

Each test plays the attack as it would go on the landed code, then checks that it holds.
"""

import os
import textwrap

import pytest

from conftest import wait_for
from shared_users import shared_project  # noqa: F401  (the fixture)

WORKER = textwrap.dedent('''
    import os, time

    def held(ctx, ready, go, steps=0):
        """Say where the run is, wait for the test's word, then log ``steps`` steps (profiled if asked)."""
        with open(ready + ".tmp", "w") as f:
            f.write(str(ctx.run_dir))
        os.replace(ready + ".tmp", ready)
        while not os.path.exists(go):
            time.sleep(0.05)
        for step in range(steps):
            ctx.log(step=step, loss=1.0 / (step + 1))
        return "done"
''')

LAUNCH = ("import os, sys; sys.stdin = open(os.devnull); import nbddp; "
          "r = nbddp.spawn_train('attackw.py:held', {ready!r}, {go!r}, {steps}, nprocs=1, runs_dir='runs', "
          "name={name!r}, echo=False{extra}); print('RESULT', r.value)")


@pytest.fixture(scope="module")
def project(shared_project):  # noqa: F811 - the fixture imported above
    p = shared_project
    (p.root / "attackw.py").write_text(WORKER)
    p.chown(p.root / "attackw.py", p.victim)
    return p


def _start(p, name: str, steps: int = 0, extra: str = ""):
    """The victim's launch in the background; (process, run folder, the file that lets it go on) once it waits."""
    ready, go = str(p.root / f"ready-{name}"), str(p.root / f"go-{name}")
    run = p.start(p.victim, LAUNCH.format(ready=ready, go=go, steps=steps, name=name, extra=extra))
    assert wait_for(lambda: os.path.exists(ready) or run.poll() is not None, 180), "the run did not start"
    assert run.poll() is None, run.communicate()[0]
    with open(ready) as f:
        return run, f.read(), go


def _finish(p, run, go: str) -> str:
    p.shell(p.attacker, f"touch {go}")
    out, _ = run.communicate(timeout=240)
    return out


def test_a_link_in_place_of_a_run_folder_never_makes_its_kernel_end_another_run(project):
    p = project
    other, other_dir, other_go = _start(p, "other")  # the victim's run in another kernel
    run, run_dir, go = _start(p, "linked")
    try:
        # Renaming in the group-writable runs folder needs no other right: the name now leads to the other run.
        p.shell(p.attacker, f"mv {run_dir} {run_dir}.away && ln -s {other_dir} {run_dir}")
        out = _finish(p, run, go)
        assert "RESULT done" in out, out
        # The kernel looked for what the first run's ranks left behind: the other run's rank is not that.
        out = _finish(p, other, other_go)
        assert "RESULT done" in out, f"the first run's kernel ended the other run's rank\n{out}"
    finally:
        for proc in (run, other):
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
