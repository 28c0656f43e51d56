"""``spawn_train(..., trackers=["mlflow", "wandb"])`` in rank 0: every logged value, off the training thread.

Only rank 0 talks to a tracker. ``ctx.log`` puts each record on a queue (microseconds); a
daemon thread imports the tracker's package, opens the run and sends what came, in batches, so
the training thread never waits for a database or a network. One run folder is one tracker run:
its id is kept in ``trackers.json``, so a restart (``max_restarts``) and a ``resume=`` of the same
folder continue the same MLflow run / W&B run, and only that one: anyone who may write the run
folder may edit that file, so an MLflow run is continued only when its tag names this folder, and
a W&B run's id is made from the folder itself. At the end the exported weights go as artifacts
and the tracker run is marked finished (or failed; a restart marks it running again).

A tracker that fails (a server away, a full disk) is reported once in rank 0's log and dropped:
the training goes on.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import queue
import shutil
import stat
import threading
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

from ..contract import rundir, statedir
from ..contract.observe import TrackerPlan, read_tracker_ids, write_tracker_ids
from ..contract.private import PRIVATE_DIR_MODE, PRIVATE_FILE_MODE, problem

_AXIS_KEYS = ("step", "epoch", "time")
#: The MLflow tag that names a tracker run's run folder: a resume continues only a run it names.
RUN_DIR_TAG = "nbddp.run_dir"
_END = object()
_FLUSH = object()


def metric_values(record: Dict[str, Any]) -> Dict[str, float]:
    """The numbers of a ``ctx.log`` record a tracker charts (axis keys and text left out)."""
    return {k: float(v) for k, v in record.items()
            if k not in _AXIS_KEYS and isinstance(v, (int, float)) and not isinstance(v, bool)}


class TrackerThread:
    """Rank 0's trackers, fed through a queue and served by one daemon thread.

    Args:
        run_dir: the run folder (``trackers.json``, the export folder).
        plan: what the kernel decided (:class:`~nbddp.contract.observe.TrackerPlan`).
    """

    def __init__(self, run_dir: os.PathLike, plan: TrackerPlan):
        self.run_dir, self.plan = Path(run_dir), plan
        self._queue: "queue.SimpleQueue" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name="nbddp-trackers", daemon=True)
        self._logged = 0
        self._sent = threading.Event()
        self.finishing = False  # the heartbeat says "writing" meanwhile: a failure's shutdown lets it end

    def start(self) -> "TrackerThread":
        self._thread.start()
        return self

    def log(self, record: Dict[str, Any]) -> None:
        """Queue a ``ctx.log`` record (rank 0's training thread: no I/O here)."""
        values = metric_values(record)
        axis = record.get("step", record.get("epoch"))
        step = axis if isinstance(axis, int) and not isinstance(axis, bool) else self._logged
        self._logged += 1
        if values:
            self._queue.put((values, step, int(record.get("time", time.time()) * 1000)))

    def flush(self, timeout_s: float = 60.0) -> None:
        """Send what is queued now and wait until it is sent (the end of a benchmark's block)."""
        self._sent.clear()
        self._queue.put((_FLUSH,))
        self._sent.wait(timeout_s)

    def finish(self, ok: bool, timeout_s: float = 300.0) -> None:
        """Send what is queued, the exported weights (``ok``) and the run's end; wait for it."""
        if not self._thread.is_alive():
            return
        self.finishing = True
        try:
            self._queue.put((_END, ok))
            self._thread.join(timeout_s)
        finally:
            self.finishing = False

    def _serve(self) -> None:
        backends = []
        for name in self.plan.names:
            try:
                backends.append(_BACKENDS[name](self.run_dir, self.plan))
            except Exception as exc:  # noqa: BLE001 - a tracker must not end the training
                _warn(name, "could not start", exc)
        while True:
            batch, end = _drain(self._queue)
            for backend in list(backends):
                try:
                    if batch:
                        backend.log(batch)
                    if end is not None:
                        with _exported(self.run_dir, end[1]) as files:
                            backend.end(end[1], files)
                except Exception as exc:  # noqa: BLE001
                    _warn(backend.name, "failed", exc)
                    backends.remove(backend)
            self._sent.set()
            if end is not None:
                return


#: Seconds the thread gathers records before it sends them: one batch then costs the training
#: thread's share of the interpreter (a tracker's client is Python: SQLAlchemy, protobuf) once per
#: interval instead of once per step.
FLUSH_S = 3.0


def _drain(q: "queue.SimpleQueue", flush_s: float = FLUSH_S) -> Tuple[List[tuple], Optional[tuple]]:
    """Wait for one item, then gather for ``flush_s`` (or until the end): ``(metric items, end item or None)``."""
    items = [q.get()]
    deadline = time.monotonic() + flush_s
    while items[-1][0] not in (_END, _FLUSH) and len(items) < 5000:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            items.append(q.get(timeout=left))
        except queue.Empty:
            break
    end = items[-1] if items[-1][0] is _END else None
    return [i for i in items if i[0] not in (_END, _FLUSH)], end


#: Where the export's files are put for the trackers, in the run's private state folder.
_STAGED = "export-sent"


@contextlib.contextmanager
def _exported(run_dir: Path, ok: bool = True) -> Iterator[List[str]]:
    """The exported weights and what describes them (``export/``), as paths only this process reaches.

    The export folder is the user's, but the group may write it (it is made under the umask): a
    link put among its files would send any file the user may read to the tracker's store, which
    the group may read (``<runs_dir>/mlartifacts``) or a server. So each file is opened without
    following a link and sent only if, on that descriptor, it is a regular file of the user's
    with one name; it is linked (else copied) by that descriptor into a private folder of the
    run's state, and the tracker reads it from there, through the state folder held open. Anything
    else is left out, with a line in the rank's log.
    """
    if not ok:
        yield []
        return
    with statedir.opened(run_dir, create=True) as state:
        _clear(state.fd, _STAGED)
        os.mkdir(_STAGED, PRIVATE_DIR_MODE, dir_fd=state.fd)
        try:
            staged = os.open(_STAGED, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=state.fd)
            try:
                names = _stage(rundir.export_dir(run_dir), staged)
            finally:
                os.close(staged)
            yield [f"/proc/self/fd/{state.fd}/{_STAGED}/{name}" for name in names]
        finally:
            _clear(state.fd, _STAGED)


def _stage(folder: Path, staged: int) -> List[str]:
    """Link (else copy) each file of ``folder`` that is the user's alone into ``staged``; their names."""
    try:
        source = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return []
    except OSError as exc:
        print(f"tracker: {folder} is not a folder ({exc}); no export is sent", flush=True)
        return []
    names = []
    try:
        found = problem(os.fstat(source), "folder", shared_ok=True)
        if found is not None:
            print(f"tracker: {folder} {found}; no export is sent", flush=True)
            return []
        for name in sorted(os.listdir(source)):
            try:
                fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=source)
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    print(f"tracker: {folder / name} is a symbolic link; it is not sent", flush=True)
                continue  # a folder (opened fine, below), or gone
            try:
                st = os.fstat(fd)
                if stat.S_ISDIR(st.st_mode):
                    continue
                found = problem(st, "file")
                # A file others may write is sent: the export is theirs to read and write (the umask).
                if found is not None and not found.startswith("may be written"):
                    print(f"tracker: {folder / name} {found}; it is not sent", flush=True)
                    continue
                try:
                    os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=staged, follow_symlinks=True)
                except OSError:  # another file system, or no hard links there: a copy
                    os.set_blocking(fd, True)
                    out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE_MODE, dir_fd=staged)
                    with os.fdopen(out, "wb") as dst, os.fdopen(os.dup(fd), "rb") as src:
                        shutil.copyfileobj(src, dst, 1 << 20)
                names.append(name)
            finally:
                os.close(fd)
    finally:
        os.close(source)
    return names


def _clear(state_fd: int, name: str) -> None:
    """Remove the folder ``name`` of the state folder and its files (one level: what :func:`_stage` made)."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=state_fd)
    except OSError:
        return
    try:
        for entry in os.listdir(fd):
            with contextlib.suppress(OSError):
                os.unlink(entry, dir_fd=fd)
    finally:
        os.close(fd)
    with contextlib.suppress(OSError):
        os.rmdir(name, dir_fd=state_fd)


def _warn(name: str, what: str, exc: BaseException) -> None:
    print(f"tracker {name} {what}: {type(exc).__name__}: {exc}; training goes on without it", flush=True)


def _remember(run_dir: Path, name: str, ids: Dict[str, Any]) -> None:
    known = read_tracker_ids(run_dir)
    known[name] = ids
    write_tracker_ids(run_dir, known)


class _MLflow:
    """One MLflow run per run folder, through ``MlflowClient`` (no global active run)."""

    name = "mlflow"

    def __init__(self, run_dir: Path, plan: TrackerPlan):
        import logging

        from mlflow.tracking import MlflowClient

        logging.getLogger("mlflow").setLevel(logging.WARNING)  # its database set-up would fill the cell

        _make_sqlite_store(plan)
        self.client = MlflowClient(tracking_uri=plan.mlflow_uri)
        known = self._own_run(run_dir, plan)
        if known:
            self.run_id = known
            self.client.update_run(self.run_id, status="RUNNING")  # a restart or resume continues it
            return
        experiment = self._experiment(plan)
        run = self.client.create_run(experiment, run_name=run_dir.name, tags={RUN_DIR_TAG: str(run_dir)})
        self.run_id = run.info.run_id
        _remember(run_dir, self.name, {"run_id": self.run_id, "uri": plan.mlflow_uri, "experiment_id": experiment})
        from mlflow.entities import Param

        params = [Param(k, v) for k, v in plan.params.items()]
        for i in range(0, len(params), 100):
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def _own_run(self, run_dir: Path, plan: TrackerPlan) -> Optional[str]:
        """The MLflow run ``trackers.json`` names, if its tag names this very run folder, else None.

        Anyone who may write the run folder may edit ``trackers.json``: an id is never taken on its word."""
        known = read_tracker_ids(run_dir).get(self.name)
        run_id = known.get("run_id") if isinstance(known, dict) else None
        if not isinstance(run_id, str) or not run_id or known.get("uri") != plan.mlflow_uri:
            return None
        try:
            tagged = self.client.get_run(run_id).data.tags.get(RUN_DIR_TAG)
        except Exception:  # noqa: BLE001 - no such run in this store
            tagged = None
        if tagged and os.path.realpath(tagged) == os.path.realpath(run_dir):
            return run_id
        print(f"tracker {self.name}: trackers.json names MLflow run {run_id}, which is not this run folder's (its "
              f"tag {RUN_DIR_TAG} is {tagged!r}): a new MLflow run is made for {run_dir}", flush=True)
        return None

    def _experiment(self, plan: TrackerPlan) -> str:
        found = self.client.get_experiment_by_name(plan.experiment)
        if found is not None:
            return found.experiment_id
        where = (Path(plan.artifact_root) / plan.experiment).as_uri() if plan.artifact_root else None
        try:
            return self.client.create_experiment(plan.experiment, artifact_location=where)
        except Exception:  # another launch created it meanwhile
            found = self.client.get_experiment_by_name(plan.experiment)
            if found is None:
                raise
            return found.experiment_id

    def log(self, batch: List[tuple]) -> None:
        from mlflow.entities import Metric

        metrics = [Metric(k, v, ts, step) for values, step, ts in batch for k, v in values.items()]
        for i in range(0, len(metrics), 1000):  # MLflow's limit per batch
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def end(self, ok: bool, files: List[str]) -> None:
        for path in files:
            self.client.log_artifact(self.run_id, str(path), artifact_path=rundir.EXPORT)
        self.client.set_terminated(self.run_id, "FINISHED" if ok else "FAILED")


def sqlite_file(uri: Optional[str]):
    """``(file, url)`` of an SQLite tracking URI, read as SQLAlchemy reads it (``%`` escapes,
    relative or absolute); None for anything else (a server, ``:memory:``, a ``file:`` URI)."""
    if not uri or not uri.startswith("sqlite:"):
        return None
    try:
        from sqlalchemy.engine import make_url

        url = make_url(uri)
    except Exception:  # noqa: BLE001 - no SQLAlchemy, or a URI MLflow will explain itself
        return None
    if not url.database or url.database == ":memory:" or "uri" in url.query:
        return None
    return Path(url.database).absolute(), url


def _make_sqlite_store(plan: TrackerPlan) -> None:
    """Make a missing MLflow SQLite store whole before anyone opens it.

    MLflow makes its tables and runs its migrations when it first opens a file; two processes
    doing that at once (a sweep's trials side by side, two kernels) fail, and the file is left
    mid-migration, refusing every later run ("table _alembic_tmp_... already exists"). A file
    another program is making at that moment (``mlflow ui`` started just then) is not covered.
    """
    found = sqlite_file(plan.mlflow_uri)
    if found is None or found[0].exists():
        return
    path, url = found
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    def make(scratch: Path) -> None:
        store = SqlAlchemyStore(url.set(database=str(scratch)).render_as_string(hide_password=False),
                                plan.artifact_root or str(path.parent / "mlartifacts"))
        store.engine.dispose()

    rundir.create_once(path, make)


def wandb_id(run_dir: Path) -> str:
    """The W&B run id of a run folder: made from the folder itself (the user, its real path, its
    inode), so every launch of it continues one W&B run and no file in it can point elsewhere."""
    st = os.stat(run_dir)
    key = f"{os.getuid()}:{os.path.realpath(run_dir)}:{st.st_dev}:{st.st_ino}"
    return hashlib.sha256(key.encode()).hexdigest()[:12]


class _WandB:
    """One W&B run per run folder: its id the folder's own (:func:`wandb_id`), ``resume="allow"`` on every launch."""

    name = "wandb"

    def __init__(self, run_dir: Path, plan: TrackerPlan):
        import wandb

        run_id = wandb_id(run_dir)
        if (read_tracker_ids(run_dir).get(self.name) or {}).get("id") != run_id:
            _remember(run_dir, self.name, {"id": run_id, "project": plan.experiment, "mode": plan.wandb_mode})
        self.wandb = wandb
        self.run = wandb.init(project=plan.experiment, id=run_id, name=run_dir.name, resume="allow",
                              mode=plan.wandb_mode, dir=str(run_dir), config=dict(plan.params),
                              settings=wandb.Settings(console="off", silent=True))

    def log(self, batch: List[tuple]) -> None:
        for values, step, _ in batch:
            self.run.log({**values, "step": step})

    def end(self, ok: bool, files: List[str]) -> None:
        if files:
            artifact = self.wandb.Artifact(f"{self.run.id}-export", type="model")
            for path in files:
                artifact.add_file(str(path))
            self.run.log_artifact(artifact)
        self.run.finish(exit_code=0 if ok else 1)
        teardown = getattr(self.wandb, "teardown", None)
        if teardown is not None:
            teardown()  # its service process ends with the run, not with the rank's os._exit


_BACKENDS = {"mlflow": _MLflow, "wandb": _WandB}


def start_trackers(run_dir: os.PathLike, rank: int, plan: Optional[TrackerPlan]) -> Optional[TrackerThread]:
    """Rank 0's tracker thread, started; ``None`` on other ranks or without trackers."""
    if plan is None or rank != 0:
        return None
    return TrackerThread(run_dir, plan).start()


__all__ = ["TrackerThread", "start_trackers", "metric_values"]
