"""``nbddp.sweep``: a hyper-parameter search whose trials are nbddp runs, every free slot busy.

Optuna decides (ask/tell: its sampler proposes, its pruner judges); nbddp runs. Each trial is an
ordinary ``spawn_train`` launch in the background, on a slot of :mod:`nbddp.kernel.slots`; one
loop, in the cell or in a thread (``block=False``), fills every free slot, hands each value the
trial logs under ``metric`` to Optuna as an intermediate value, stops a trial the pruner gives
up on (``ctx.stop_reason() == "pruned"``), and tells Optuna how each ended. Only this loop
talks to the study. The study lives in the runs folder (:mod:`nbddp.kernel.study`), so a later
call continues it.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Union

from ..contract import plans, rundir
from ..contract.errors import ConfigError, TrainingInterrupted
from . import study as st
from .handle import interrupts_held
from .slots import Slot, make_slots


#: A trial's intermediate values go to the study at most this often (each is an SQLite commit).
_REPORT_EVERY_S = 0.5


@dataclass
class BestTrial:
    """The best finished trial: its parameters, its value, its run folder and exported weights."""

    number: int
    params: Dict[str, Any]
    value: float
    run_dir: Optional[Path]
    weights_path: Optional[Path]


@dataclass
class _Running:
    trial: Any  # optuna.trial.Trial
    handle: Any  # RunHandle
    slot: Slot
    started: float
    values: List[tuple]  # (step, value) reported so far
    pruned: bool = False
    pending: Optional[tuple] = None  # the newest (step, value) not reported yet
    reported_at: float = 0.0
    logged: int = 0  # metric records so far: the step of one that names none
    steps: set = field(default_factory=set)


def sweep(target: Any, space: Callable[[Any], Any], n_trials: int = 20, *, metric: Optional[str] = None,
          direction: str = "maximize", name: Optional[str] = None, parallel: Optional[int] = None,
          gpus_per_trial: Optional[int] = None, nprocs: Optional[int] = None, sampler=None, pruner=None,
          block: bool = True, echo: bool = True, runs_dir: Union[str, Path, None] = None, retry_failed: bool = False,
          **launch_options: Any) -> "Sweep":
    """Search hyper-parameters with Optuna, each trial an nbddp run, as many at a time as slots are free.

    Args:
        target: what each trial runs, as ``spawn_train`` takes it: a ``TrainConfig`` (the built-in
            worker), a function (a file's, a module's or a cell's) or a script.
        space: ``space(trial)`` returns one trial's overrides, written with Optuna's
            ``trial.suggest_*``: a dict of ``TrainConfig`` fields for the built-in worker, of keyword
            arguments for a function; a list, the ``argv``, for a script.
        n_trials: trials of the whole study: a second call with the same ``name`` continues it, and
            finished trials are never run again. A trial stopped, or cut off by its kernel's end,
            counts for nothing.
        metric: the name the worker logs (``ctx.log``) and, for its final value, returns in a dict;
            default ``"val_accuracy"`` for the built-in worker. Each logged value is an intermediate
            value for the pruner, at the record's ``step`` (else ``epoch``).
        direction: ``"maximize"`` or ``"minimize"``.
        name: the sweep's name: its study is ``<runs_dir>/sweeps/<name>/study.db``; trial k runs in
            ``<runs_dir>/<time>-<name>-<k>``. Default: the config's or the target's name.
        parallel: trials at the same time (default: every slot the machine has).
        gpus_per_trial: GPUs per trial, idle ones leased (never one another kernel holds).
        nprocs: CPU processes per trial (instead of GPUs).
        sampler: Optuna's sampler (default TPE).
        pruner: Optuna's pruner (default median).
        block: wait for the end; ``False`` returns the :class:`Sweep` at once (``stop()``, ``wait()``).
        echo: a live table in a notebook; one line per finished trial.
        runs_dir: where run folders and the study go (default ``runs``; a config's own).
        retry_failed: run the parameters of every failed trial once more (a trial cut off by a
            killed kernel included), each in place of the one it retries.
        **launch_options: passed to every ``spawn_train`` (``timeout_s``, ``env``, ``args``, ``kwargs``...).

    Returns:
        The :class:`Sweep`: ``best``, ``trials``, ``study``.

    Raises:
        ConfigError: bad input, before any trial starts where it can be (a name ``space`` suggests
            that the target does not take; a metric no trial logs, after the first trial).
        ImportError: Optuna is missing (``pip install optuna``).

    Example:
        >>> s = nbddp.sweep(cfg, lambda t: {"lr": t.suggest_float("lr", 1e-3, 0.1, log=True)},
        ...                 n_trials=8, nprocs=1, parallel=2)
        >>> s.best.params, s.best.value, s.best.run_dir
    """
    st.import_optuna()
    _check_arguments(space, n_trials, direction, launch_options)
    s = Sweep(target, space, n_trials, metric, direction, name, sampler, pruner, echo, runs_dir, launch_options)
    s._prepare(parallel, gpus_per_trial, nprocs, retry_failed)
    if block:
        return s._run_blocking()
    s._start_background()
    return s


def _check_arguments(space, n_trials, direction, launch_options) -> None:
    if direction not in ("maximize", "minimize"):
        raise ConfigError(f"direction={direction!r}: use 'maximize' or 'minimize'")
    if isinstance(n_trials, bool) or not isinstance(n_trials, int) or n_trials < 1:
        raise ConfigError(f"n_trials={n_trials!r}: must be an integer >= 1 (the trials of the whole study)")
    if not callable(space):
        raise ConfigError("space must be a function space(trial) that returns the overrides of one trial, "
                          "e.g. lambda t: {'lr': t.suggest_float('lr', 1e-4, 1e-1, log=True)}")
    for key in ("block", "name", "runs_dir", "nprocs", "gpus", "echo", "on_event", "resume"):
        if key in launch_options:
            raise ConfigError(f"{key}=... is the sweep's to set for each trial; leave it out of the launch options")


class Sweep:
    """A running or finished sweep (``nbddp.sweep``).

    Attributes:
        name: the sweep's name.
        study: the Optuna study (optuna-dashboard and ``optuna.visualization`` read it).
        study_path: its SQLite file.
        tensorboard_dir: every trial's params and metric side by side: ``nbddp.show_tensorboard(s.tensorboard_dir)``.
    """

    def __init__(self, target, space, n_trials, metric, direction, name, sampler, pruner, echo, runs_dir, options):
        self.target, self.space, self.n_trials, self.direction = target, space, n_trials, direction
        self.builtin = plans.is_task_config(target)
        if metric is None:
            if not self.builtin:
                raise ConfigError("metric=...: name what your worker logs with ctx.log (or returns in a dict) "
                                  "for the sweep to optimise, e.g. metric='val_loss', direction='minimize'")
            metric = "val_accuracy"
        self.metric = metric
        self.runs_dir = Path(runs_dir if runs_dir is not None else (target.runs_dir if self.builtin else rundir.RUNS_DIR))
        self.name = name or (target.name if self.builtin else plans.default_name(_spec(target)))
        if rundir.name_problem(self.name):
            raise ConfigError(f"name={self.name!r}: {rundir.NAME_RULE}")
        self.echo, self.options = echo, dict(options)
        self._sampler, self._pruner = sampler, pruner
        self._running: Dict[int, _Running] = {}
        self._events: "queue.Queue" = queue.Queue()
        self._came: list = []  # Interrupts (SIGINT) seen while the cell waits
        self._stop_asked = False
        self._error: Optional[BaseException] = None
        self._done = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._later: List[Callable[[], None]] = []  # TensorBoard writes, after the slots are filled
        self._table = None
        self._rows: Dict[int, dict] = {}
        self._checked_metric = False

    # -- public ------------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return not self._done.is_set()

    def stop(self, wait: bool = True) -> None:
        """Ask no more trials, stop the running ones (each finishes its step), wait for them."""
        self._stop_asked = True
        if wait:
            self.wait(raise_error=False)

    def wait(self, timeout: Optional[float] = None, raise_error: bool = True) -> "Sweep":
        """Block until the sweep ends (an Interrupt stops it); returns it, or raises its error."""
        deadline = None if timeout is None else time.time() + timeout
        with interrupts_held() as came:
            while not self._done.wait(0.1):
                self._came[:] = came
                if deadline is not None and time.time() > deadline:
                    break
        if raise_error and self._error is not None:
            raise self._error
        return self

    @property
    def trials(self) -> List[dict]:
        """One row per trial, best first: number, params, state, value (so far), seconds, run_dir.

        Finished trials come first, by value (the first is ``best``), then the others by their value so
        far: a trial cut off mid-run may have logged more than a finished one returned."""
        rows = [dict(r) for r in list(self._rows.values())]  # the sweep's thread may add one meanwhile
        sign = -1.0 if self.direction == "maximize" else 1.0
        return sorted(rows, key=lambda r: (r["state"] != "COMPLETE", r["value"] is None, sign * (r["value"] or 0.0),
                                           r["number"]))

    @property
    def best(self) -> Optional[BestTrial]:
        """The best finished trial (None before one has finished)."""
        from optuna.trial import TrialState

        done = [t for t in self.study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if t.value is not None]
        if not done:
            return None
        pick = max if self.direction == "maximize" else min
        t = pick(done, key=lambda x: x.value)
        run_dir = st.own_run(t.user_attrs.get(st.RUN_DIR), self.runs_dir)  # never a folder outside the runs folder
        weights = rundir.export_dir(run_dir) / rundir.EXPORT_PTH if run_dir is not None else None
        return BestTrial(t.number, dict(t.params), t.value, run_dir, weights if weights and weights.is_file() else None)

    def __repr__(self) -> str:
        best = self.best
        states: Dict[str, int] = {}
        for r in list(self._rows.values()):
            states[r["state"]] = states.get(r["state"], 0) + 1
        return (f"Sweep(name={self.name!r}, trials={states}, best="
                + (f"trial {best.number} {self.metric}={best.value:.4g} {best.params}" if best else "None")
                + (", running" if self.running else "") + ")")

    # -- start ---------------------------------------------------------------------------
    def _prepare(self, parallel, gpus_per_trial, nprocs, retry) -> None:
        self._check_target()
        default_nprocs = self.target.nprocs if self.builtin else 1
        self.slots = make_slots(parallel, gpus_per_trial, nprocs, default_nprocs)
        self.study, self._file = st.open_study(self.runs_dir, self.name, self.direction, self._sampler, self._pruner)
        self.study_path = self._file.path
        self.tensorboard_dir = self.study_path.parent / rundir.TENSORBOARD
        for line in st.fail_orphans(self.study, self._file, self.runs_dir):
            self._say(line)
        if retry:
            again = st.retry_failed(self.study)
            if again:
                self._say(f"trials {again} will run again with the same parameters")
        for t in self.study.get_trials(deepcopy=False):
            self._rows[t.number] = st.row(t)
        if self.echo:
            self._table = _table_if_notebook(self)

    def _check_target(self) -> None:
        """A file or module target that does not exist is named before the study is made."""
        if isinstance(self.target, str) and not _is_script(self.target):
            from ..contract.targets import resolve_target

            resolve_target(self.target)

    def _run_blocking(self) -> "Sweep":
        with interrupts_held() as came:
            self._came = came
            self._loop()
        if self._error is not None:
            raise self._error
        return self

    def _start_background(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="nbddp-sweep", daemon=True)
        self._thread.start()

    # -- the loop ------------------------------------------------------------------------
    def _loop(self) -> None:
        interrupted, stops_sent = 0, False
        try:
            while True:
                if len(self._came) > interrupted:
                    interrupted = len(self._came)
                    self._interrupt(now=interrupted > 1)
                self._drain_events()
                self._reap()
                if self._stop_asked or self._error is not None:
                    if self._stop_asked and not stops_sent:
                        stops_sent = True  # s.stop(): each running trial finishes its step
                        for run in self._running.values():
                            run.handle.stop(wait=False)
                    if not self._running:
                        break
                elif not self._fill() and not self._running:
                    break
                for write in self._later:
                    write()
                self._later.clear()
                self._show()
                time.sleep(0.05)
        except BaseException as exc:  # noqa: BLE001 - every trial ends, whatever went wrong here
            named = self._file.error(exc) if isinstance(exc, Exception) else None
            if named is not None:
                named.__cause__ = exc
            self._error = self._error or named or exc
            self._end_all()
        finally:
            for write in self._later:
                write()
            self._later.clear()
            self._show(final=True)
            self._done.set()

    def _fill(self) -> bool:
        """Start trials on the free slots; False once the study needs no more (budget reached).

        Trials waiting in the study (a failed trial asked again, ``retry_failed=True``, or one the
        user enqueued with ``study.enqueue_trial``) run even when ``n_trials`` is reached.
        """
        while st.used(self.study) < self.n_trials or st.waiting(self.study):
            slot = self.slots.take()
            if slot is None:
                return True
            try:
                started = self._start_trial(slot)
            except BaseException:
                self.slots.give(slot)
                raise
            if not started:
                self.slots.give(slot)
        return False

    def _start_trial(self, slot: Slot) -> bool:
        """Ask Optuna for a trial and launch it on ``slot``; False when it was refused instead."""
        from optuna.trial import TrialState

        trial = self.study.ask()
        trial.set_user_attr(st.KERNEL, st.mine())
        try:
            overrides = self.space(trial)
            if self._refuse_outside(trial):
                return False
            target, args, kwargs = self._trial_launch(trial.number, overrides, slot)
            handle = self._launch(target, args, kwargs, slot, trial.number)
        except BaseException as exc:
            # An Interrupt while the trial started ended it before it ran: it counts for nothing.
            stopped = isinstance(exc, (TrainingInterrupted, KeyboardInterrupt))
            trial.set_user_attr(st.ENDED if stopped else st.ERROR,
                                st.STOPPED if stopped else f"{type(exc).__name__}: {exc}"[:2000])
            self.study.tell(trial, state=TrialState.FAIL)
            self._rows[trial.number] = st.row(self.study.get_trials(deepcopy=False)[trial.number])
            raise
        st.record_trial(handle.run_dir, self._file, trial.number)  # the run's own word, before the study's
        trial.set_user_attr(st.RUN_DIR, str(handle.run_dir))
        rundir.write_json_atomic(rundir.sweep_path(handle.run_dir), {
            "sweep": self.name, "study": str(self.study_path), "trial": trial.number, "params": dict(trial.params),
            "metric": self.metric, "direction": self.direction})
        self._running[trial.number] = _Running(trial, handle, slot, time.time(), [])
        self._rows[trial.number] = {"number": trial.number, "params": dict(trial.params), "state": "RUNNING",
                                    "value": None, "seconds": 0.0, "run_dir": str(handle.run_dir)}
        return True

    def _refuse_outside(self, trial) -> bool:
        """A trial whose fixed or enqueued parameters lie outside the space it suggests is not run:
        marked FAIL (counting for nothing), and said. True when refused."""
        from optuna.trial import TrialState

        outside = st.outside_space(trial)
        if not outside:
            return False
        trial.set_user_attr(st.ENDED, st.OUTSIDE)
        trial.set_user_attr(st.ERROR, f"outside the search space: {'; '.join(outside.values())}"[:2000])
        self._rows[trial.number] = st.row(self.study.tell(trial, state=TrialState.FAIL))
        print(f"[sweep {self.name}] trial {trial.number} not run: parameters fixed in advance (study.enqueue_trial, a "
              f"retry) lie outside the space space(trial) suggests: {'; '.join(outside.values())}. It is marked FAIL "
              f"and counts for nothing; to run such values, widen the space.", file=sys.stderr, flush=True)
        return True

    def _trial_launch(self, number: int, overrides: Any, slot: Slot):
        """What ``spawn_train`` gets for this trial: ``(target, keyword arguments)``; bad overrides refused."""
        from .trials import apply_overrides

        return apply_overrides(self, number, overrides, slot)

    def _launch(self, target, args: tuple, kwargs: dict, slot: Slot, number: int):
        from .launch import on_leased_gpus, spawn_train

        on_event = (lambda kind, payload, n=number: self._events.put((n, payload)) if kind == "metrics" else None)
        with on_leased_gpus(slot.leases):
            return spawn_train(target, *args, block=False, echo=False, on_event=on_event, **kwargs)

    def _drain_events(self) -> None:
        """Hand the values logged under ``metric`` to their trials; stop the trials the pruner gives up on.

        Each report is an SQLite commit: a trial is given at most two a second, its newest value
        (a worker that logs every step would otherwise keep this loop writing, behind the trials
        and deaf to a Stop). Per-epoch values, the built-in worker's, all get through.
        """
        while True:
            try:
                n, record = self._events.get_nowait()
            except queue.Empty:
                break
            run = self._running.get(n)
            value = st.number(record.get(self.metric)) if isinstance(record, dict) else None
            if run is None or value is None:
                continue
            step = next((record[k] for k in ("step", "epoch") if isinstance(record.get(k), int)
                         and not isinstance(record.get(k), bool)), run.logged)
            run.logged += 1
            self._rows[n]["value"] = value
            if step not in run.steps:
                run.pending = (step, value)
        now = time.time()
        for n, run in self._running.items():
            if run.pending is None or now - run.reported_at < _REPORT_EVERY_S:
                continue
            (step, value), run.pending, run.reported_at = run.pending, None, now
            run.steps.add(step)
            run.values.append((step, value))
            run.trial.report(value, step)
            if not run.pruned and not self._stop_asked and run.trial.should_prune():
                run.pruned = True
                run.handle.stop(wait=False, reason="pruned")

    def _reap(self) -> None:
        for n, run in list(self._running.items()):
            self._rows[n]["seconds"] = round(time.time() - run.started, 1)
            if run.handle.running:
                continue
            del self._running[n]
            self.slots.give(run.slot)
            self._tell(run)

    def _tell(self, run: _Running) -> None:
        from .trials import tell

        tell(self, run)

    def _interrupt(self, now: bool) -> None:
        """Jupyter's Interrupt: no more trials, every running one stopped (a second: ended at once)."""
        if not self._stop_asked:
            self._say("nbddp: stopping the sweep's trials (they finish their step); interrupt again to end them at once")
        self._stop_asked = True
        self._error = self._error or TrainingInterrupted(
            f"the sweep {self.name!r} was interrupted: its running trials were stopped and reaped; the study is "
            f"kept ({self.study_path}). Call nbddp.sweep(...) with name={self.name!r} again to continue it.")
        for run in self._running.values():
            if now:
                run.handle.end_now()
            else:
                run.handle.stop(wait=False, reason="interrupt")

    def _end_all(self) -> None:
        """Stop every running trial and wait for them (after an error of the loop itself)."""
        for run in self._running.values():
            run.handle.stop(wait=False)
        for n, run in list(self._running.items()):
            try:
                run.handle.wait()
            except BaseException:  # noqa: BLE001 - its outcome is told below
                pass
            del self._running[n]
            self.slots.give(run.slot)
            self._tell(run)

    def _stop_for(self, error: BaseException) -> None:
        """A bad input found while the sweep runs: no more trials, the running ones stopped, ``error`` raised."""
        self._error = self._error or error
        for run in self._running.values():
            run.handle.stop(wait=False)

    # -- showing -------------------------------------------------------------------------
    def _say(self, line: str) -> None:
        if self.echo:
            print(line, file=sys.stdout, flush=True)

    def _show(self, final: bool = False) -> None:
        if self._table is not None:
            self._table.update(self.trials, final=final)


def _spec(target: Any) -> str:
    from ..contract.targets import resolve_target

    if isinstance(target, str) and _is_script(target):
        return target
    try:
        return resolve_target(target) if isinstance(target, str) else f"cell:{getattr(target, '__name__', 'fn')}"
    except Exception:  # noqa: BLE001 - the launch names a bad target; a name is all this needs
        return str(target)


def _is_script(target: str) -> bool:
    from ..contract.conventions import is_script

    return target == "-m" or is_script(target)


def _table_if_notebook(s: Sweep):
    from .forkserver import in_kernel

    if not in_kernel():
        return None
    try:
        from ..ui.sweep_view import SweepTable
    except ImportError:  # no ipywidgets: the lines are enough
        return None
    table = SweepTable(s.name, s.metric, s.direction)
    table.display()
    return table
