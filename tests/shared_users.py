"""Two real users of one group on a group-writable project folder: the shared server, for real.

A team's project folder on a GPU server is group-writable and setgid, and its members work with
umask 002. The attacks nbddp must hold against are a group member's: writing, renaming and
swapping files in that folder. Playing them with a faked owner id proves little, so these tests
make two throwaway users of a throwaway group (they run as root in CI), run the victim's launches
and the attacker's moves as those users through ``setpriv``, and remove everything afterwards.

The victim needs a Python with torch and nbddp that a plain user can execute; the test's own
interpreter may live under a folder other users cannot enter (a Python under ``/root``). So the
users get a virtual environment made from a system interpreter of the same version, which loads
this environment's packages and this checkout: read in place where every user may read them,
else through hard links made in the throwaway folder (instant, no copy).

Usage::

    from shared_users import shared_project  # noqa: F401  (the fixture)

    def test_attack(shared_project):
        p = shared_project
        p.run(p.attacker, "open('runs/x', 'w').write('...')")
        cp = p.run(p.victim, "import nbddp; ...", check=False)
"""

from __future__ import annotations

import dataclasses
import os
import pwd
import secrets
import shutil
import site
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Dict, Mapping, Optional

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: Environment variables of the test run that the users' processes keep (test modes, gloo on loopback).
_PASSED_ON = ("NBDDP_", "GLOO_", "OMP_NUM_THREADS", "MKL_NUM_THREADS", "LANG", "LC_ALL", "TZ")


@dataclasses.dataclass(frozen=True)
class Member:
    name: str
    uid: int
    gid: int


def _why_not() -> Optional[str]:
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "two real users need root to be made (CI runs the tests as root)"
    for tool in ("useradd", "userdel", "groupadd", "groupdel", "setpriv"):
        if shutil.which(tool) is None:
            return f"{tool} is not on the PATH (Debian's passwd and util-linux packages)"
    if _system_python() is None:
        return f"no Python {sys.version_info.major}.{sys.version_info.minor} that every user may run"
    return None


def _everyone_may_enter(path: Path) -> bool:
    """True when every folder from / down to ``path`` lets other users through (o+x)."""
    path = path.resolve()
    for folder in [path, *path.parents]:
        try:
            if not os.stat(folder).st_mode & stat.S_IXOTH:
                return False
        except OSError:
            return False
    return True


def _system_python() -> Optional[str]:
    """An interpreter of this Python's version that other users may execute."""
    want = f"python{sys.version_info.major}.{sys.version_info.minor}"
    candidates = [sys.executable, shutil.which(want, path="/usr/local/bin:/usr/bin:/bin")]
    for exe in candidates:
        if not exe:
            continue
        real = Path(os.path.realpath(exe))
        if _everyone_may_enter(real.parent) and os.stat(real).st_mode & stat.S_IXOTH:
            return str(real)
    return None


def _retry(cmd, tries: int = 20) -> None:
    """useradd and friends lock /etc/passwd; two test processes making users at once wait their turn."""
    for i in range(tries):
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode == 0:
            return
        if "lock" not in (done.stderr + done.stdout).lower() or i == tries - 1:
            raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr.strip()}")
        time.sleep(0.25)


class SharedProject:
    """A group-writable setgid project folder, a victim and an attacker of its group."""

    def __init__(self) -> None:
        token = secrets.token_hex(3)
        self.group = f"nbg{token}"
        self.base = Path(tempfile.mkdtemp(prefix="nbddp-users-", dir="/tmp"))
        os.chmod(self.base, 0o755)
        self._users = []
        _retry(["groupadd", self.group])
        gid = _group_id(self.group)
        self.victim = self._user(f"nbv{token}", gid)
        self.attacker = self._user(f"nba{token}", gid)
        self.root = self.base / "project"
        self.root.mkdir()
        os.chown(self.root, 0, gid)
        os.chmod(self.root, 0o2775)
        self.python = self._environment()

    def _user(self, name: str, gid: int) -> Member:
        home = self.base / "home" / name
        _retry(["useradd", "-M", "-N", "-g", self.group, "-d", str(home), "-s", "/bin/sh", name])
        self._users.append(name)
        uid = pwd.getpwnam(name).pw_uid
        home.mkdir(parents=True)
        os.chown(home, uid, gid)
        os.chmod(home, 0o700)
        return Member(name, uid, gid)

    def _environment(self) -> str:
        """A venv every user may run that imports this environment's packages and this checkout."""
        env_dir = self.base / "env"
        subprocess.run([_system_python(), "-m", "venv", "--without-pip", str(env_dir)], check=True)
        sites = [Path(p) for p in site.getsitepackages() if Path(p).is_dir()]
        source = ROOT
        if not all(_everyone_may_enter(p) for p in [*sites, ROOT]):
            # Hard links keep one inode (and its 0644 mode) under a folder every user may enter.
            linked = []
            for i, p in enumerate(sites):
                dst = self.base / "site" / str(i)
                dst.parent.mkdir(exist_ok=True)
                subprocess.run(["cp", "-al", str(p), str(dst)], check=True)
                linked.append(dst)
            sites = linked
            source = self.base / "src"
            source.mkdir()
            for part in ("nbddp", "tests", "examples", "data"):
                if (ROOT / part).exists():
                    subprocess.run(["cp", "-a", str(ROOT / part), str(source / part)], check=True)
        purelib = Path(sysconfig.get_path("purelib", vars={"base": str(env_dir), "platbase": str(env_dir)}))
        purelib.mkdir(parents=True, exist_ok=True)
        # A .pth line that starts with "import" runs: addsitedir also reads the .pth files there.
        lines = [str(source)] + [f"import site; site.addsitedir({str(p)!r})" for p in sites]
        (purelib / "_nbddp_shared_users.pth").write_text("\n".join(lines) + "\n")
        self.source = source
        for dirpath, dirnames, filenames in os.walk(self.base / "env"):
            os.chmod(dirpath, 0o755)
        return str(env_dir / "bin" / "python")

    # -- running as a member ------------------------------------------------------------------

    def environ(self, who: Member, env: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
        out = {k: v for k, v in os.environ.items() if k.startswith(_PASSED_ON)}
        home = str(self.base / "home" / who.name)
        out.update(HOME=home, USER=who.name, LOGNAME=who.name, PYTHONDONTWRITEBYTECODE="1",
                   PATH=f"{Path(self.python).parent}:/usr/local/bin:/usr/bin:/bin", TMPDIR=home)
        out.update(env or {})
        return out

    def _argv(self, who: Member, argv) -> list:
        return ["setpriv", f"--reuid={who.uid}", f"--regid={who.gid}", "--init-groups",
                "sh", "-c", 'umask 002; exec "$@"', "sh", *argv]

    def run(self, who: Member, code: str, timeout: float = 120, env=None, check: bool = True):
        """``python -c code`` as ``who`` (umask 002, in the project folder); its CompletedProcess."""
        done = subprocess.run(self._argv(who, [self.python, "-c", code]), cwd=self.root, text=True,
                              capture_output=True, timeout=timeout, env=self.environ(who, env))
        if check and done.returncode != 0:
            raise AssertionError(f"as {who.name}: exit {done.returncode}\n{done.stdout}\n{done.stderr}")
        return done

    def start(self, who: Member, code: str, env=None) -> subprocess.Popen:
        """``python -c code`` as ``who`` in the background (stdout and stderr together, text)."""
        return subprocess.Popen(self._argv(who, [self.python, "-c", code]), cwd=self.root, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=self.environ(who, env))

    def shell(self, who: Member, line: str, timeout: float = 60, check: bool = True):
        """A shell line as ``who`` (umask 002, in the project folder)."""
        done = subprocess.run(self._argv(who, ["sh", "-c", line]), cwd=self.root, text=True,
                              capture_output=True, timeout=timeout, env=self.environ(who))
        if check and done.returncode != 0:
            raise AssertionError(f"as {who.name}: exit {done.returncode}\n{done.stdout}\n{done.stderr}")
        return done

    def chown(self, path, who: Member) -> None:
        """Give a path the test made (as root) to a member, folders and files below it too."""
        for dirpath, dirnames, filenames in os.walk(path):
            for name in [dirpath, *(os.path.join(dirpath, f) for f in filenames)]:
                os.lchown(name, who.uid, who.gid)
        if not os.path.isdir(path):
            os.lchown(path, who.uid, who.gid)

    def close(self) -> None:
        for name in self._users:
            subprocess.run(["pkill", "-KILL", "-u", name], capture_output=True)
        deadline = time.time() + 10
        for name in self._users:
            while time.time() < deadline and subprocess.run(["pgrep", "-u", name], capture_output=True).returncode == 0:
                time.sleep(0.1)
            _retry(["userdel", name])
        _retry(["groupdel", self.group])
        shutil.rmtree(self.base, ignore_errors=True)


def _group_id(name: str) -> int:
    import grp
    return grp.getgrnam(name).gr_gid


@pytest.fixture(scope="module")
def shared_project():
    why = _why_not()
    if why:
        pytest.skip(why)
    project = SharedProject()
    try:
        yield project
    finally:
        project.close()
