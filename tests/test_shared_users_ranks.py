"""An interactive group's command channel is its user's alone: another local user cannot send it code.

Two real users (``tests/shared_users.py``): the victim starts a group (``nbddp.start_ranks``) with
its temporary folder in the shared ``/tmp``; while the kernel waits for its ranks (one of them is
held back by a start-up hook), the attacker finds the channel's socket as anyone can, in
``/proc/net/unix``, and tries to connect to it. It must be refused; the group then works.
"""

import textwrap

from shared_users import shared_project  # noqa: F401  (the fixture)

HOOK = textwrap.dedent('''
    import time

    def setup(rank):
        if rank == 1:  # the kernel's socket listens meanwhile: the attacker's window
            time.sleep(3)
''')

VICTIM = ("import nbddp\n"
          "r = nbddp.start_ranks(nprocs=2, runs_dir='runs', env={'NBDDP_RANK_HOOK': 'slowhook.py:setup'})\n"
          "r.run('print(\"alive\", rank)')\n"
          "r.stop()\n"
          "print('VICTIM DONE')")

ATTACKER = textwrap.dedent('''
    import socket, time
    deadline, tried = time.time() + 60, set()
    while time.time() < deadline and not tried:
        for line in open("/proc/net/unix").read().splitlines()[1:]:
            path = line.split()[-1] if len(line.split()) >= 8 else ""
            if "/nbddp-" in path and path.endswith("/channel") and path not in tried:
                tried.add(path)
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    s.connect(path)
                    s.sendall(b"\\0" * 8)
                    print("CONNECTED", path)
                except OSError as exc:
                    print("REFUSED", path, type(exc).__name__)
        time.sleep(0.02)
    print("TRIED", len(tried))
''')


def test_another_user_cannot_reach_the_channel(shared_project):  # noqa: F811 - the fixture imported above
    p = shared_project
    (p.root / "slowhook.py").write_text(HOOK)
    p.chown(p.root / "slowhook.py", p.victim)
    victim = p.start(p.victim, VICTIM, env={"TMPDIR": "/tmp"})  # the shared temp folder, as on a server
    try:
        attack = p.run(p.attacker, ATTACKER, timeout=90)
        out, _ = victim.communicate(timeout=120)
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()
    assert "TRIED 1" in attack.stdout, attack.stdout + attack.stderr
    assert "CONNECTED" not in attack.stdout and "REFUSED" in attack.stdout
    assert "PermissionError" in attack.stdout  # the folder (0700) keeps the attacker out
    assert "[rank0] alive 0" in out and "[rank1] alive 1" in out and "VICTIM DONE" in out, out
