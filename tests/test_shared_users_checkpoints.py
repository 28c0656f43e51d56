"""Checkpoints on a shared server, played by two real users of one group (umask 002, a group-writable
setgid project folder): a group member can neither run code as you through a checkpoint nor make
you resume from one she wrote.

A sharded checkpoint (``checkpoints/<name>.dcp/``) is read by torch's ``FileSystemReader``:
``.metadata`` is a plain ``pickle.load`` and the shard files hold more pickles. The attacker
rewrites ``.metadata`` in place where she can, and where she cannot, swaps the run's
``checkpoints`` folder for one of her own (renaming in a group-writable run folder needs no
other right). The payload writes a marker file: it must never appear, and the victim's resume
must fail with an error naming the file and what to do.
"""

import pickle
import textwrap
from pathlib import Path

import pytest

from shared_users import shared_project  # noqa: F401  (the fixture)

WORKER = textwrap.dedent('''
    import torch

    def train(ctx, steps, dcp=True):
        torch.manual_seed(0)
        model = ctx.prepare(torch.nn.Linear(4, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if dcp:
            state = ctx.load_checkpoint({"model": model, "optimizer": opt})
        else:
            state = ctx.load_checkpoint()
        start = 0 if state is None else int(state["step"]) + 1
        for step in range(start, steps):
            model(torch.randn(2, 4)).sum().backward()
            opt.step()
            opt.zero_grad()
            if dcp:
                ctx.save_checkpoint({"model": model, "optimizer": opt, "step": step})
            else:
                ctx.save_checkpoint({"model": model.state_dict(), "step": step})
        return start
''')


class _Payload:
    """Unpickled, it writes ``marker`` as whoever unpickles it."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write(__import__('getpass').getuser())",))


def _launch(p, dcp: bool, resume: str = "None", steps: int = 2):
    code = (f"import nbddp; r = nbddp.spawn_train('ckw.py:train', {steps}, {dcp}, nprocs=1, runs_dir='runs', "
            f"name='ck', echo=False, resume={resume}); print('RUN', r.run_dir); print('START', r.value)")
    return p.run(p.victim, code, timeout=240, check=False)


def _run_dir(done) -> str:
    assert done.returncode == 0, done.stdout + done.stderr
    return next(line.split(" ", 1)[1] for line in done.stdout.splitlines() if line.startswith("RUN "))


@pytest.fixture(scope="module")
def project(shared_project):  # noqa: F811 - the fixture imported above
    p = shared_project
    (p.root / "ckw.py").write_text(WORKER)
    p.chown(p.root / "ckw.py", p.victim)
    return p


@pytest.fixture(scope="module")
def made(project):
    """A run of each kind (sharded, plain) as the victim, and its checkpoints' modes as nbddp made them:
    taken before any test swaps a run's ``checkpoints`` for the attacker's."""
    runs = {}
    for dcp in (True, False):
        run = _run_dir(_launch(project, dcp=dcp))
        ck = project.root / run / "checkpoints"
        runs[dcp] = run, {str(path.relative_to(ck)): (path.is_dir(), oct(path.stat().st_mode & 0o777))
                          for path in [ck, *ck.rglob("*")]}
    return runs


def _swap_checkpoints(p, run: str, inner: str, write: str) -> str:
    """As the attacker: rename the run's ``checkpoints`` aside and make her own, ``inner`` written by ``write``."""
    ck = f"{run}/checkpoints"
    p.shell(p.attacker, f"mv {ck} {ck}.hers-aside && mkdir -p {ck}/{Path(inner).parent}")
    p.run(p.attacker, write.format(path=f"{ck}/{inner}"))
    return ck


def test_a_group_member_cannot_run_code_as_you_through_a_sharded_checkpoint(project, made):
    p, (run, _) = project, made[True]
    marker = p.root / "pwned"
    payload = pickle.dumps(_Payload(str(marker)))
    write = f"open({{path!r}}, 'wb').write({payload!r})"
    # In place, where the file lets her: nbddp writes it 0600 in 0700 folders, so she cannot.
    p.run(p.attacker, write.format(path=f"{run}/checkpoints/last.dcp/.metadata"), check=False)
    assert not marker.exists()
    # A swap: the run folder is group-writable, so she renames `checkpoints` and puts her own there.
    ck = _swap_checkpoints(p, run, "last.dcp/.metadata", write)

    resumed = _launch(p, dcp=True, resume=repr(run), steps=3)
    assert not marker.exists(), f"the attacker's pickle ran as {marker.read_text()!r}"
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode != 0, out
    # Names the first folder on the way that is not the victim's, why, and what to do.
    assert f"{ck} is owned by uid {p.attacker.uid}, not by you" in out and f"Remove {ck}" in out, out


def test_a_group_member_cannot_make_you_resume_from_her_plain_checkpoint(project, made):
    p, (run, _) = project, made[False]
    # Weights-only, so no code runs; but her step (and weights) would be taken as the victim's own.
    write = "import torch; torch.save({{'model': torch.nn.Linear(4, 2).state_dict(), 'step': 41}}, {path!r})"
    ck = _swap_checkpoints(p, run, "last.pt", write)

    resumed = _launch(p, dcp=False, resume=repr(run), steps=3)
    out = resumed.stdout + resumed.stderr
    assert "START 42" not in out, "the victim resumed from the attacker's checkpoint"
    assert resumed.returncode != 0, out
    assert f"{ck} is owned by uid {p.attacker.uid}, not by you" in out and f"Remove {ck}" in out, out


def test_checkpoints_are_private_whatever_the_umask(made):
    for _, modes in made.values():
        assert len(modes) > 1, modes  # the folder and what the run wrote in it
        assert all(mode == ("0o700" if is_dir else "0o600") for is_dir, mode in modes.values()), modes
