"""The scripts that run as root (``dev.sh test`` runs ``scripts/install_*.sh``, so CI does) trust no
name another user can make: no fixed name in a shared temporary folder, no process found by its name."""

import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = sorted((ROOT / "scripts").glob("*.sh")) + [ROOT / "dev.sh"]


def test_no_fixed_name_in_a_shared_temp_folder():
    # Where fs.protected_symlinks is 0, a link another user put at a fixed /tmp name takes root's
    # write into any file: a log goes to a name mktemp made (O_EXCL, 0600).
    fixed = re.compile(r"/(?:var/)?tmp/[\w.-]")
    found = [f"{path.name}:{i}: {line.strip()}" for path in SCRIPTS
             for i, line in enumerate(path.read_text().splitlines(), 1)
             if fixed.search(line) and not line.lstrip().startswith("#")]
    assert found == [], "fixed names in a shared temporary folder:\n" + "\n".join(found)


def _daemon_pid(pidfile: Path, owner: str = "root", name: str = "slurmctld") -> subprocess.CompletedProcess:
    """install_slurm.sh's own ``daemon_pid`` (cut from the script) run on ``pidfile``."""
    script = (ROOT / "scripts" / "install_slurm.sh").read_text()
    body = re.search(r"^daemon_pid\(\) \{.*?^\}", script, re.S | re.M).group(0)
    return subprocess.run(["bash", "-c", f'{body}\ndaemon_pid {name} "$1" {owner}', "sh", str(pidfile)],
                          capture_output=True, text=True)


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="playing another user's process needs root and setpriv (CI runs the tests as root)")
def test_a_process_merely_named_slurmctld_is_not_the_controller(tmp_path):
    # Another user's program named slurmctld, and root's own program of that name that is not
    # /usr/sbin/slurmctld: neither is the controller, whatever a pid file says.
    os.chmod(tmp_path, 0o755)
    fake = tmp_path / "slurmctld"
    shutil.copy(shutil.which("sleep"), fake)
    os.chmod(fake, 0o755)
    others = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", str(fake), "60"])
    roots = subprocess.Popen([str(fake), "60"])
    try:
        deadline = time.time() + 10
        while time.time() < deadline and not all(os.path.exists(f"/proc/{p.pid}/exe") and
                                                 os.readlink(f"/proc/{p.pid}/exe") == str(fake) for p in (others, roots)):
            time.sleep(0.02)  # setpriv execs the fake
        for proc in (others, roots):
            pidfile = tmp_path / f"{proc.pid}.pid"
            pidfile.write_text(f"{proc.pid}\n")
            assert _daemon_pid(pidfile).returncode != 0
        dead = tmp_path / "dead.pid"
        dead.write_text("999999999\n")
        assert _daemon_pid(dead).returncode != 0
        assert _daemon_pid(tmp_path / "missing.pid").returncode != 0
        real = Path("/run/slurmctld.pid")
        if real.exists() and os.path.exists("/usr/sbin/slurmctld"):  # the one-host test cluster is up
            assert _daemon_pid(real).stdout.strip() == real.read_text().strip()
    finally:
        for proc in (others, roots):
            proc.kill()
            proc.wait()
