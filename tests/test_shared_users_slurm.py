"""A group member's moves on a SLURM submission, played by two real users of one group (umask 002, a
group-writable setgid project folder) on the one-host cluster of ``scripts/install_slurm.sh``.

The job waits in the queue (``--hold``) while the attacker renames the run's ``.nbddp`` away and puts
her own folder in its place, with ``slurm/job.sbatch`` (a FIFO: whoever reads it gets her lines) and
``slurm/job.out`` (a link to a private file of the victim's) in it; then the job is let go. The job
must use nothing of hers: the script went to ``sbatch`` on its standard input, the job refuses the
folder that is not the one the kernel made, never appends through her link, and the kernel says why
the run failed instead of blaming the memory.
"""

import os
import subprocess
import textwrap

import pytest

from conftest import wait_for
from shared_users import shared_project  # noqa: F401  (the fixture)


def _slurm_answers() -> bool:
    try:
        return subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


pytestmark = pytest.mark.skipif(not _slurm_answers(),
                                reason="no SLURM cluster here; scripts/install_slurm.sh makes a one-host one")

WORKER = "def fn(ctx):\n    return 'ran'\n"

HELD = textwrap.dedent('''
    import os, sys; sys.stdin = open(os.devnull); import nbddp
    h = nbddp.spawn_train('slurmw.py:fn', nprocs=1, runs_dir='runs', name='held', echo=False, block=False,
                          cluster=nbddp.Slurm(extra=('--hold',)))
    print('RUN', h.run_dir, flush=True)
    try:
        print('RESULT', h.wait().value, flush=True)
    except Exception as exc:
        print('ERROR', exc, flush=True)
''')


@pytest.fixture(scope="module")
def project(shared_project):  # noqa: F811 - the fixture imported above
    p = shared_project
    (p.root / "slurmw.py").write_text(WORKER)
    p.chown(p.root / "slurmw.py", p.victim)
    return p


def _job_of(p) -> str:
    out = subprocess.run(["squeue", "-h", "-u", p.victim.name, "-o", "%i"], capture_output=True, text=True).stdout
    return out.split()[0] if out.split() else ""


def test_a_swapped_state_folder_is_refused_by_the_job_and_nothing_of_hers_is_used(project):
    p = project
    secret = p.base / "home" / p.victim.name / "notes"
    p.shell(p.victim, f"echo mine > {secret} && chmod 600 {secret}")
    run = p.start(p.victim, HELD)
    try:
        line = run.stdout.readline()
        assert line.startswith("RUN "), line + run.communicate(timeout=60)[0]
        run_dir = line.split(" ", 1)[1].strip()
        assert wait_for(lambda: _job_of(p), 30), "the job is not in the queue"
        job = _job_of(p)
        p.shell(p.attacker, f"cd {run_dir} && mv .nbddp .nbddp.away && mkdir -p .nbddp/slurm && "
                            f"mkfifo .nbddp/slurm/job.sbatch && ln -s {secret} .nbddp/slurm/job.out && "
                            f"chmod -R g+rwx .nbddp")
        subprocess.run(["scontrol", "release", job], check=True, capture_output=True)
        out, _ = run.communicate(timeout=240)
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
        subprocess.run(["scancel", "-u", p.victim.name], capture_output=True)
    assert "RESULT" not in out, out
    assert "ERROR" in out and ".nbddp" in out and "replaced" in out, out
    assert "out of memory" not in out, out
    assert secret.read_text() == "mine\n"  # her link at job.out took nothing of the job's
    # sbatch had the script on its standard input: the job folder the kernel made holds no script
    assert "job.sbatch" not in os.listdir(os.path.join(run_dir, ".nbddp.away", "slurm"))
