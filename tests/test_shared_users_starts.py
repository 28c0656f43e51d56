"""A module a group member plants in the notebook's folder never runs in a process nbddp starts,
played by two real users of one group (umask 002, a group-writable setgid project folder).

``python -c`` and ``python -m`` put the folder they start in first on ``sys.path``. The victim's
"kernel" here has the notebook's folder where Jupyter puts it, after the standard library; the
warm server and a SLURM task must not put it back in front: a ``json.py`` the
attacker copies into the project folder stays hers (no marker from it), and a module of the
victim's own in that folder is still found by a rank (``helper.py``, imported by the worker).
"""

import os
import stat
import subprocess
import textwrap

import pytest

from shared_users import shared_project  # noqa: F401  (the fixture)

WORKER = textwrap.dedent('''
    def fn(ctx):
        import json, helper  # the standard library's json; the notebook folder's own helper
        return json.dumps(helper.VALUE)
''')

# What the attacker plants: it leaves a marker (as whoever imports it) where she can see it.
PLANTED = textwrap.dedent('''
    import os
    open(os.path.join({root!r}, "planted-%d-%d" % (os.getuid(), os.getpid())), "w").close()
''')

# The victim's kernel: the notebook's folder after the standard library, as IPython puts it.
KERNEL = ("import sys; sys.path.remove(''); "
          "sys.path.insert(next(i for i, p in enumerate(sys.path) if p.endswith(('site-packages', 'dist-packages'))), '')\n"
          "import os; sys.stdin = open(os.devnull); import nbddp\n")

LAUNCH = KERNEL + ("r = nbddp.spawn_train('startw.py:fn', nprocs=1, runs_dir={runs!r}, name={name!r}, echo=False, "
                   "start_method={method!r}{extra})\n"
                   "print('RESULT', r.value)")


def _slurm_answers() -> bool:
    try:
        return subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, timeout=20).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="module")
def project(shared_project):  # noqa: F811 - the fixture imported above
    p = shared_project
    (p.root / "startw.py").write_text(WORKER)
    (p.root / "helper.py").write_text("VALUE = 'helped'\n")
    p.chown(p.root / "startw.py", p.victim)
    p.chown(p.root / "helper.py", p.victim)
    p.shell(p.attacker, f"cat > json.py <<'EOF'\n{PLANTED.format(root=str(p.root))}\nEOF")
    return p


def _planted(p) -> list:
    return sorted(name for name in os.listdir(p.root) if name.startswith("planted-"))


def test_a_module_planted_in_the_notebook_folder_never_runs_in_a_local_launch(project):
    p = project  # the warm server imports torch (and json) before any rank forks from it
    done = p.run(p.victim, LAUNCH.format(runs="runs", name="local", method="forkserver", extra=""), check=False, timeout=300)
    assert "RESULT \"helped\"" in done.stdout, done.stdout + done.stderr
    assert _planted(p) == [], "the planted json.py ran in the warm server or a rank"
    # The compile caches' home, made by the launch: the victim's alone, whatever the umask (002 here).
    cache = p.base / "home" / p.victim.name / ".cache"
    assert stat.S_IMODE(os.stat(cache).st_mode) == 0o700 and "not kept between runs" not in done.stderr, done.stderr


def test_another_users_closed_sweep_folder_is_refused_naming_its_owner(project):
    p = project
    p.shell(p.attacker, "mkdir -p runs/sweeps/theirs && chmod 700 runs/sweeps/theirs")
    done = p.run(p.victim, KERNEL + "from nbddp.kernel.study_file import StudyFile; StudyFile('runs', 'theirs', print)",
                 check=False)  # as from the victim's kernel: the planted json.py stays unimported
    assert f"is owned by uid {p.attacker.uid}, not by you" in done.stderr and "NotPrivate" in done.stderr, done.stderr
    assert "PermissionError: [Errno" not in done.stderr, done.stderr


@pytest.mark.skipif(not _slurm_answers(), reason="no SLURM cluster here; scripts/install_slurm.sh makes a one-host one")
def test_a_module_planted_in_the_notebook_folder_never_runs_in_a_slurm_task(project):
    p = project
    # A % in the runs folder's path: SLURM reads it as a pattern in a file name it is given (%j: the job id).
    done = p.run(p.victim, LAUNCH.format(runs="runs%j", name="slurm", method="forkserver",
                                         extra=", cluster=nbddp.Slurm()"),
                 check=False, timeout=300)
    assert "RESULT \"helped\"" in done.stdout, done.stdout + done.stderr
    assert _planted(p) == [], "the planted json.py ran in a SLURM task"


def test_nbddp_starts_python_without_its_start_folder_ahead_of_the_standard_library(tmp_path):
    # The same rule without a second user: the command lines nbddp builds, run in a folder holding a json.py.
    import sys

    from nbddp.contract.safe_path import module_argv, python_argv, safe_argv

    (tmp_path / "json.py").write_text("raise SystemExit('the planted json.py ran')\n")
    (tmp_path / "mine.py").write_text("import json, sys; print(json.__file__ != __file__, sys.argv[1:])\n")
    code = "import json, sys; sys.path.append(''); import mine"
    for argv in (python_argv(code, "a"), module_argv("mine", "a"),
                 safe_argv([sys.executable, "-B", "-c", code, "a"])):
        if "mine" in argv[2] and "runpy" in argv[2]:
            argv = argv[:2] + ["import sys; sys.path.append(''); " + argv[2]] + argv[3:]  # mine.py is found last
        done = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "True ['a']" in done.stdout, (argv, done.stdout, done.stderr)
