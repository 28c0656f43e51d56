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

import contextlib
import os
import textwrap

import pytest

from conftest import wait_for
from shared_users import shared_project  # noqa: F401  (the fixture)

WORKER = textwrap.dedent('''
    import os, time

    def held(ctx, ready, go, steps=0, early=False, export=False, profile=False):
        """Say where the run is (after a first record, ``early``; with an export of its weights,
        ``export``; with ``profile/`` as an older nbddp made it, ``profile``), wait for the test's
        word, then log ``steps`` steps (profiled if asked)."""
        if early:
            ctx.log(step=-1, loss=2.0)
        if profile:  # under the umask: the group's to write in
            os.makedirs(os.path.join(ctx.run_dir, "profile"), exist_ok=True)
        if export:  # as an export is written: under the umask, for the group to read
            os.makedirs(os.path.join(ctx.run_dir, "export"), exist_ok=True)
            with open(os.path.join(ctx.run_dir, "export", "model.pth"), "w") as f:
                f.write("weights")
        with open(ready + ".tmp", "w") as f:
            f.write(str(ctx.run_dir))
        os.replace(ready + ".tmp", ready)
        while not os.path.exists(go):
            time.sleep(0.05)
        for step in range(steps):
            ctx.log(step=step, loss=1.0 / (step + 1))
        return "done"
''')

# The kernel says when it has read the worker's first record (``early``): an attack "once the
# kernel reads the run's records" waits for that (``<ready>.kernel``), whatever the machine's load.
LAUNCH = ("import os, sys, time; sys.stdin = open(os.devnull); import nbddp\n"
          "h = nbddp.spawn_train('attackw.py:held', {ready!r}, {go!r}, {steps}, {early}, {export}, {profile}, "
          "nprocs=1, runs_dir='runs', name={name!r}, echo=False, block=False{extra})\n"
          "while {early} and not h.metrics and h.running:\n"
          "    time.sleep(0.05)\n"
          "open({ready!r} + '.kernel', 'w').close()\n"
          "r = h.wait(); print('RESULT', r.value); print('METRICS', r.metrics)")


@pytest.fixture(scope="module")
def project(shared_project):  # noqa: F811 - the fixture imported above
    p = shared_project
    (p.root / "attackw.py").write_text(WORKER)
    p.chown(p.root / "attackw.py", p.victim)
    return p


def _begin(p, name: str, steps: int = 0, early: bool = False, export: bool = False, profile: bool = False,
           extra: str = ""):
    """The victim's launch in the background; wait for it with :func:`_ready`."""
    ready, go = str(p.root / f"ready-{name}"), str(p.root / f"go-{name}")
    code = LAUNCH.format(ready=ready, go=go, steps=steps, early=early, export=export, profile=profile, name=name,
                         extra=extra)
    return p.start(p.victim, code), name


def _ready(p, begun):
    """(process, run folder, the file that lets it go on) once the worker waits."""
    run, name = begun
    ready, go = str(p.root / f"ready-{name}"), str(p.root / f"go-{name}")
    assert wait_for(lambda: (os.path.exists(ready) and os.path.exists(ready + ".kernel")) or run.poll() is not None,
                    180), "the run did not start"
    assert run.poll() is None, run.communicate()[0]
    with open(ready) as f:
        return run, f.read(), go


def _start(p, name: str, **how):
    return _ready(p, _begin(p, name, **how))


@contextlib.contextmanager
def _reaped(*runs):
    """The victim's launches are ended when the block leaves, whatever it found."""
    try:
        yield
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
                run.communicate()


def _finish(p, run, go: str) -> str:
    p.shell(p.attacker, f"touch {go}")
    out, _ = run.communicate(timeout=240)
    return out


def test_a_link_in_place_of_a_run_folder_never_makes_its_kernel_end_another_run(project):
    p = project
    begun = _begin(p, "other", steps=1), _begin(p, "linked", steps=1)
    other, other_dir, other_go = _ready(p, begun[0])  # the victim's run in another kernel
    run, run_dir, go = _ready(p, begun[1])
    with _reaped(run, other):
        # Renaming in the group-writable runs folder needs no other right: the name now leads to the other run.
        p.shell(p.attacker, f"mv {run_dir} {run_dir}.away && ln -s {other_dir} {run_dir}")
        out = _finish(p, run, go)
        assert "RESULT done" in out and out.count("'loss'") == 1, out
        # The kernel looked for what the first run's ranks left behind: the other run's rank is not that.
        out = _finish(p, other, other_go)
        assert "RESULT done" in out, f"the first run's kernel ended the other run's rank\n{out}"
        # Each run's records went into its own folder, and each kernel read its own run's.
        assert out.count("'loss'") == 1, f"the other run's result holds the first run's records\n{out}"
        assert len(open(os.path.join(run_dir + ".away", "metrics.jsonl")).read().splitlines()) == 1


def test_a_link_planted_in_the_run_folder_never_takes_a_ranks_writes_into_your_files(project):
    p = project
    home = p.base / "home" / p.victim.name
    notes, thesis = home / "notes.txt", home / "thesis.tex"
    p.shell(p.victim, f"echo precious > {notes}; echo thesis > {thesis}; chmod 600 {notes} {thesis}")
    run, run_dir, go = _start(p, "planted", steps=6, profile=True,
                              extra=", profile={'wait': 1, 'warmup': 1, 'active': 2}")
    with _reaped(run):
        # Before the rank logs or profiles: links where it writes, to files of the victim's outside the run
        # (profile/ is the victim's, made under the umask as an older nbddp made it: the group writes in it).
        p.shell(p.attacker, f"cd {run_dir} && ln -s {notes} metrics.jsonl && "
                            f"ln -s {thesis} profile/rank0.pt.trace.json.gz")
        out = _finish(p, run, go)
    assert notes.read_bytes() == b"precious\n", "the rank appended its ctx.log records to a file of the victim's"
    assert thesis.read_bytes() == b"thesis\n", "the rank replaced a file of the victim's with its profile"
    assert "RESULT done" in out, out
    # Both were moved aside, said in the rank's output, and made anew: the run's records are whole, its own.
    said = open(os.path.join(run_dir, "logs", "rank0.log")).read()
    assert f"{run_dir}/metrics.jsonl is a symbolic link" in said and "moved to metrics.jsonl.not-yours-" in said, said
    assert f"{run_dir}/profile may be written by other users" in said and "moved to profile.not-yours-" in said, said
    assert len(open(os.path.join(run_dir, "metrics.jsonl")).read().splitlines()) == 6
    assert os.stat(os.path.join(run_dir, "metrics.jsonl")).st_mode & 0o777 == 0o644  # the group may read it
    assert os.path.isfile(os.path.join(run_dir, "profile", "rank0.summary.json"))


def test_a_group_member_cannot_put_records_in_a_runs_metrics(project):
    p = project
    run, run_dir, go = _start(p, "records", steps=2, early=True)
    metrics = os.path.join(run_dir, "metrics.jsonl")
    forged = '{"step": 99, "loss": -1.0, "forged": 1}'
    with _reaped(run):
        # Written into in place, where the file lets her: it is the victim's, never writable by the group.
        p.shell(p.attacker, f"echo '{forged}' >> {metrics}", check=False)
        # Replaced by a file of hers once the kernel reads it (her record past where it read up to): it
        # goes on reading the run's own.
        p.shell(p.attacker, f"mv {metrics} {metrics}.away && head -c 4096 /dev/zero | tr '\\0' ' ' > {metrics} && "
                            f"printf '\\n%s\\n' '{forged}' >> {metrics} && chmod 666 {metrics}")
        out = _finish(p, run, go)
    assert "RESULT done" in out, out
    assert "forged" not in out, f"the attacker's record reached the victim's result\n{out}"
    assert "METRICS [{" in out and out.count("'loss'") == 3, out  # the worker's own three records


def test_a_link_planted_in_the_export_never_sends_your_files_to_the_tracker(project):
    p = project
    pytest.importorskip("mlflow")
    home = p.base / "home" / p.victim.name  # 0700: its files are the victim's alone, whatever their mode
    secret = home / "secret.txt"
    p.shell(p.victim, f"echo SECRET-NOTES > {secret}; chmod 644 {secret}")
    run, run_dir, go = _start(p, "tracked", export=True, extra=", trackers=['mlflow']")
    with _reaped(run):
        # The export folder is the victim's, and the group's to write (umask 002): a link among its files.
        p.shell(p.attacker, f"ln -s {secret} {run_dir}/export/notes.txt")
        out = _finish(p, run, go)
    assert "RESULT done" in out, out
    # MLflow's artifacts are kept in the runs folder, which the group may read.
    found = p.shell(p.attacker, "grep -r -l SECRET-NOTES runs/mlartifacts", check=False).stdout
    assert not found, f"the victim's file was sent to the tracker, where the group reads it: {found}"
    sent = sorted(str(f.relative_to(p.root / "runs" / "mlartifacts")).split("/", 2)[2]
                  for f in (p.root / "runs" / "mlartifacts").rglob("*") if f.is_file())
    assert sent == ["artifacts/export/model.pth"], sent  # the run's own export was sent
    said = open(os.path.join(run_dir, "logs", "rank0.log")).read()
    assert f"{run_dir}/export/notes.txt is a symbolic link" in said, said


EXPORT = ("import warnings, torch; warnings.simplefilter('always'); "
          "from nbddp.contract.checkpoint import export_weights; "
          "export_weights({{'w': torch.full((2,), {value})}}, {where!r}, ['a', 'b'])")


def test_a_link_in_place_of_a_runs_export_never_replaces_an_export_of_yours_elsewhere(project):
    p = project
    home = p.base / "home" / p.victim.name
    deployed, run_dir = home / "deployed", p.root / "runs" / "exported"
    # The victim's export in use elsewhere, and a run folder of hers (the group's to write, umask 002).
    p.run(p.victim, EXPORT.format(value=1.0, where=str(deployed)) + f"; import os; os.makedirs({str(run_dir)!r})")
    before = {f.name: f.read_bytes() for f in deployed.iterdir()}
    # The run's export folder's name, a link to it: the built-in worker's export at the run's end goes there.
    p.shell(p.attacker, f"ln -s {deployed} {run_dir}/export")
    done = p.run(p.victim, EXPORT.format(value=2.0, where=str(run_dir / "export")), check=False)
    assert {f.name: f.read_bytes() for f in deployed.iterdir()} == before, "the run's export replaced the victim's"
    assert done.returncode == 0, done.stderr
    assert f"{run_dir}/export is a symbolic link" in done.stderr and "moved to export.not-yours-" in done.stderr
    assert (run_dir / "export").is_dir() and not (run_dir / "export").is_symlink()


def test_a_folder_renamed_in_as_an_exports_leftover_is_never_removed(project):
    p = project
    data, run_dir = p.root / "data" / "photos", p.root / "runs" / "leftover"
    # The victim's images: the folder the group's to write (umask 002), a class folder only hers (as tar makes it).
    p.shell(p.victim, f"mkdir -p {data}/roses {run_dir} && echo jpeg > {data}/roses/0001.jpg && chmod 755 {data}/roses")
    assert p.shell(p.attacker, f"rm -rf {data}/roses", check=False).returncode != 0  # not hers to remove
    # Renamed into the run folder as the temp folder of an export that died (a pid no process has).
    p.shell(p.attacker, f"mv {data} {run_dir}/.export{'.tmp-'}999999999-abcd")
    done = p.run(p.victim, EXPORT.format(value=1.0, where=str(run_dir / "export")), check=False)
    assert done.returncode == 0, done.stderr
    assert (run_dir / ".export.tmp-999999999-abcd" / "roses" / "0001.jpg").read_text() == "jpeg\n", \
        "the export removed the victim's images as its leftover"


def test_a_file_of_yours_moved_in_as_a_runs_metrics_is_neither_read_nor_written(project):
    p = project
    # Another run's records of the victim's: hers alone to write (0644), in a folder the group may rename in.
    older = p.root / "runs" / "older"
    p.shell(p.victim, f"mkdir -p {older} && echo '{{\"step\": 7, \"loss\": 9.0, \"older\": 1}}' > {older}/metrics.jsonl "
                      f"&& chmod 644 {older}/metrics.jsonl")
    run, run_dir, go = _start(p, "movedin", steps=2)
    with _reaped(run):
        # Before the run's first record: the other run's file at its name, the victim's own and private.
        p.shell(p.attacker, f"mv {older}/metrics.jsonl {run_dir}/metrics.jsonl")
        out = _finish(p, run, go)
    assert "RESULT done" in out, out
    assert "older" not in out and out.count("'loss'") == 2, f"the other run's records reached this run's result\n{out}"
    aside = [n for n in os.listdir(run_dir) if n.startswith("metrics.jsonl.not-yours-")]
    assert len(aside) == 1, os.listdir(run_dir)
    with open(os.path.join(run_dir, aside[0])) as f:
        assert f.read().count("\n") == 1, "the rank appended this run's records to the other run's file"
