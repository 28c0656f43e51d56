"""Shared test helpers, one per job: process-survival checks (they read /proc, as the reliability doc
asks), a free port, a clean launcher environment, a small learnable image tree and the small
training config every launched test starts from."""

import contextlib
import functools
import os
import queue
import re
import signal
import socket
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKERS = ROOT / "tests" / "workers"
EXAMPLES = ROOT / "examples"


@pytest.fixture(autouse=True)
def _own_gpu_leases(tmp_path_factory):
    """Each test leases its (fake) GPUs in a folder of its own, not the machine's shared one: the
    fake GPUs' UUIDs are every test's, and a launch in another test process would show as
    "leased by" in this one's listing. A test that sets ``NBDDP_GPU_LEASES`` itself overrides it.
    (A patch of its own, not the test's ``monkeypatch``: that one's undo keeps its place among the
    test's fixtures.)"""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("NBDDP_GPU_LEASES", str(tmp_path_factory.mktemp("gpu-leases")))
        yield


def pytest_configure(config):
    """The tests interrupt themselves and their launches as Jupyter does (SIGINT). A shell that starts
    them in the background (``bash dev.sh test &``) has SIGINT ignored, which every process they start
    would inherit: Python's handler is put back first, as a terminal has it."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.hookimpl(hookwrapper=True)
def pytest_collection(session):
    """pytest keeps the test modules it rewrote (their asserts) in ``tests/__pycache__`` unless bytecode
    is off: with ``PYTHONDONTWRITEBYTECODE=1`` (as on this project's servers) each test process would
    rewrite all of them again, 2.6 s of CPU at every start. So collection (where the modules are
    imported) may write; the tests, and every process they start, run with the setting as it was."""
    was = sys.dont_write_bytecode
    sys.dont_write_bytecode = False
    try:
        yield
    finally:
        sys.dont_write_bytecode = was


@pytest.fixture(autouse=True, scope="module")
def _sigint_handler_is_python_s_again():
    """A file that leaves its own SIGINT handler in the test process fails at its last teardown.

    nbddp swaps the handler while it holds an Interrupt (a checkpoint write, an import, a launch)
    and must put Python's back; a handler left behind turns a later test's Interrupt into nothing,
    far from its cause.
    """
    yield
    handler = signal.getsignal(signal.SIGINT)
    if handler is not signal.default_int_handler:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        pytest.fail(f"this file left SIGINT's handler set to {handler!r} "
                    f"({getattr(handler, '__module__', '')}.{getattr(handler, '__qualname__', '')})", pytrace=False)


def proc_state(pid: int):
    """'R', 'S', 'Z' (zombie)... or None when the pid no longer exists."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("State:"):
                return line.split()[1]
    except (FileNotFoundError, ProcessLookupError):
        return None
    return None


def children_of(pid: int):
    """Pids whose parent is ``pid`` (zombies included)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == pid:
            out.append(int(entry))
    return out


def survivors(pids):
    """The pids that still exist, live or zombie (a zombie is a survivor too)."""
    return {p: s for p in pids if (s := proc_state(p)) is not None}


def worker_children():
    """Children of this test process other than multiprocessing helpers (resource tracker)."""
    res = []
    for pid in children_of(os.getpid()):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "resource_tracker" in cmd or "forkserver" in cmd:
            continue
        res.append(pid)
    return res


def wait_for(predicate, timeout: float = 30.0, interval: float = 0.1):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False


@pytest.fixture
def runs_dir(tmp_path):
    return tmp_path / "runs"


def make_tree(root: Path, classes=("a", "b", "c"), per_class: int = 12, size: int = 16, seed: int = 0) -> Path:
    """A small learnable class-folder tree: each class has its own colour, plus noise.

    ``classes`` may also map each class name to its own number of images (``{"cat": 3, "dog": 0}``).
    """
    import random

    from PIL import Image

    counts = dict(classes) if isinstance(classes, Mapping) else dict.fromkeys(classes, per_class)
    rng = random.Random(seed)
    palette = [(220, 40, 40), (40, 200, 60), (50, 60, 220), (230, 200, 30), (200, 50, 200)]
    for ci, (name, n) in enumerate(counts.items()):
        folder = Path(root) / name
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(n):
            base = palette[ci % len(palette)]
            img = Image.new("RGB", (size, size))
            img.putdata([tuple(max(0, min(255, c + rng.randint(-40, 40))) for c in base) for _ in range(size * size)])
            img.save(folder / f"{i:03d}.png")
    return Path(root)


def small_cfg(tree, runs_dir, **overrides):
    """The small run launched tests start from: ShuffleNetV2 x0.5 at 32 px, 2 CPU ranks of batch 4, 2 epochs.

    On the default tree (3 classes x 12 images) an epoch is 3 batches a rank. ``overrides`` replace
    any field, e.g. ``epochs=1`` or ``name="fault"``. The model has what the built-in worker's paths
    need (BatchNorm for SyncBN, an ``fc`` head to freeze up to) at 0.34 M parameters: a launch's
    steps and checkpoints cost a third of ResNet18's (11 M). Tests that check a model's own names
    (its keys, its head's width) read the model from the config.
    """
    from nbddp import TrainConfig

    base = dict(data_path=str(tree), model="shufflenet_v2_x0_5", image_size=32, epochs=2, batch_size=4, lr=0.01,
                nprocs=2, runs_dir=str(runs_dir), name="t")
    return TrainConfig(**{**base, **overrides})


@pytest.fixture
def tree(tmp_path):
    return make_tree(tmp_path / "data")


@pytest.fixture(scope="session")
def small_run(tmp_path_factory):
    """``(cfg, result)`` of one ``small_cfg`` run on its own default tree, shared by the tests that
    only read what a plain run leaves (or start another run from it); none may change its files."""
    from nbddp import spawn_train

    root = tmp_path_factory.mktemp("small_run")
    cfg = small_cfg(make_tree(root / "data"), root / "runs")
    return cfg, spawn_train(cfg, echo=False)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_env(**extra) -> dict:
    """This environment without what a launcher (torchrun, SLURM, nbddp) would set, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "TORCHELASTIC_", "NBDDP_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", PYTHONPATH=str(ROOT), **extra)
    return env


def text_of(html_widget) -> str:
    """The text an HTML widget shows: tags dropped, entities decoded."""
    import html

    return html.unescape(re.sub(r"<[^>]+>", "", html_widget.value))


def kernel_pid(km) -> int:
    """The pid of a jupyter_client kernel manager's kernel process."""
    return km.provisioner.process.pid


def fault_env(spec: str) -> dict:
    """Worker environment that injects the faults ``spec`` ("<where>:<rank>:<action>", see tests/workers/faults.py)."""
    return {"NBDDP_RANK_HOOK": f"{WORKERS / 'faults.py'}:install", "NBDDP_FAULT": spec}


@pytest.fixture
def no_gpu(monkeypatch):
    """The training panel lists no GPU: its runs use CPU processes, even on a machine with GPUs."""
    monkeypatch.setattr("nbddp.ui.panel.list_gpus", lambda: [])


def one_cell_at_a_time(kc):
    """Send every cell of ``kc`` with ``stop_on_error=False``, as a client that waits for each cell does.

    With the default (True) a cell that ends in an error (an interrupted one) makes ipykernel abort
    the requests that reach it before its own "stop aborting" message does, and a cell sent right
    after the error's reply can still be one of them: it is answered ``aborted`` without running.
    These tests send a cell only after the last one ended, so none of theirs is meant to be aborted.
    """
    kc.execute = functools.partial(kc.execute, stop_on_error=False)
    return kc


@contextlib.contextmanager
def real_kernel(cwd, env=None):
    """A real Jupyter kernel of this environment (kernelspec ``python3``) in ``cwd``, shut down after."""
    pytest.importorskip("jupyter_client")
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", cwd=str(cwd), **({"env": env} if env is not None else {}))
    one_cell_at_a_time(kc)
    try:
        yield km, kc
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


@pytest.fixture
def kernel(tmp_path):
    """A real Jupyter kernel of this environment (kernelspec ``python3``), in ``tmp_path``."""
    with real_kernel(tmp_path) as pair:
        yield pair


def execute(kc, code: str, timeout: float = 120.0):
    """Run code in a real kernel as a cell; return (reply content, everything it printed, errors included)."""
    msg_id = kc.execute(code)
    out = []
    deadline = time.time() + timeout
    while True:
        try:
            msg = kc.get_iopub_msg(timeout=max(0.1, deadline - time.time()))
        except queue.Empty:
            raise TimeoutError(f"kernel did not finish within {timeout}s; output so far: {''.join(out)}")
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            out.append(content["text"])
        elif kind == "error":
            out.append("\n".join(content["traceback"]))
        elif kind == "status" and content["execution_state"] == "idle":
            break
    while True:  # skip replies to earlier (e.g. interrupted) cells
        reply = kc.get_shell_msg(timeout=10)
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply["content"], "".join(out)


#: A user id that is not the test's: the owner of what ``give_away`` plants.
OTHER_UID = 12345


@pytest.fixture
def give_away(monkeypatch):
    """``give_away(path)`` makes ``path`` (a link itself, not its target) another user's.

    As root, by ``chown``; otherwise nbddp's owner check is told so (no other user can be made).
    """
    from nbddp.contract import private

    if os.getuid() == 0:
        return lambda path: os.chown(path, OTHER_UID, OTHER_UID, follow_symlinks=False)
    planted, real = set(), private.owner
    monkeypatch.setattr(private, "owner", lambda st: OTHER_UID if (st.st_dev, st.st_ino) in planted else real(st))

    def give(path):
        st = os.lstat(path)
        planted.add((st.st_dev, st.st_ino))
    return give


#: The files that take longest (a full run, 4 test processes on 2 cores), started first: the longest
#: processing time first, so that no test process ends the suite alone on a long file (xdist hands out
#: files in this order: dev.sh turns its own reordering by size off). A hint only: a file missing here
#: starts in its usual place.
SLOW_FIRST = ("tests/test_requirements.py", "tests/test_bench.py", "tests/test_faults.py", "tests/test_orphans.py",
              "tests/test_own_code.py", "tests/test_warm.py", "tests/test_cluster.py", "tests/test_classification.py",
              "tests/test_shared_users_attacks.py", "tests/test_sweep.py", "tests/test_onnx_export.py",
              "tests/test_observe.py", "notebooks/01_quickstart.ipynb", "notebooks/04_finetune.ipynb",
              "tests/test_shared_users_checkpoints.py", "tests/test_detached.py", "tests/test_panel.py",
              "notebooks/08_sweep.ipynb")


#: Files one test process runs together, in this order (their first one's place in SLOW_FIRST): notebook
#: 04 fine-tunes the model notebook 01 exports, as a user who runs them in order does; opened alone
#: it trains 01's model first (the same training as 01's, run a second time).
TOGETHER = ("notebooks/01_quickstart.ipynb", "notebooks/04_finetune.ipynb")


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # before xdist's own, which answers for every --dist
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadfile``, with the files of :data:`TOGETHER` as one unit."""
    if config.getoption("dist", None) != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class TogetherScheduling(LoadFileScheduling):
        def _split_scope(self, nodeid):
            where = super()._split_scope(nodeid)
            return TOGETHER[0] if where in TOGETHER else where

    return TogetherScheduling(config, log)


def pytest_collection_modifyitems(config, items):
    def rank(item):
        where = item.nodeid.split("::")[0]
        return SLOW_FIRST.index(where) if where in SLOW_FIRST else len(SLOW_FIRST)

    items.sort(key=rank)  # stable: each file's tests keep their order
