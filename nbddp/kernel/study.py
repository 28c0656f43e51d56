"""A sweep's Optuna study: where it lives, what its trials count for, and what a killed kernel left.

The study is data in an SQLite file of the runs folder (``<runs_dir>/sweeps/<name>/study.db``),
so a later ``nbddp.sweep`` with the same name, in any kernel, continues it; the file is the
user's alone (:mod:`nbddp.kernel.study_file`). Each trial notes the kernel that runs it (pid and
start time); a trial still RUNNING whose kernel is gone was cut off by that kernel's end: it is
marked FAIL, its run folder kept, and it counts for nothing. Its leftover workers are ended only
when the run's own private launch state says this study's trial launched it from a kernel now
gone. A trial whose fixed or enqueued parameters are outside the space it suggests is refused.
"""

from __future__ import annotations

import json
import math
import os
import stat
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from ..contract import rundir
from ..contract.errors import ConfigError
from ..contract.system import is_same_process, start_time
from .study_file import StudyFile

#: user_attrs of a trial: its run folder, the kernel that runs it, why it ended early, its error,
#: and the failed trial it runs again (``retry_failed=True``).
RUN_DIR, KERNEL, ENDED, ERROR, RETRY_OF = "run_dir", "kernel", "ended", "error", "retry_of"
#: ``ENDED`` values: trials that never finished, so they count for nothing in ``n_trials``.
STOPPED, KERNEL_DIED, OUTSIDE = "stopped", "kernel died", "outside the search space"


def import_optuna():
    """Optuna, or an error that says how to install it (it is the optional ``sweep`` extra)."""
    try:
        import optuna
    except ImportError:
        raise ImportError("nbddp.sweep needs Optuna: pip install optuna (or pip install nbddp[sweep])") from None
    return optuna


def open_study(runs_dir: Path, name: str, direction: str, sampler, pruner):
    """The study ``name`` in its SQLite file under ``runs_dir``, made or continued; ``(study, file)``.

    Raises:
        NotPrivate: the study's folder or file is not the user's alone (see :mod:`nbddp.kernel.study_file`).
        StudyError: the file is damaged, or another process kept it locked.
    """
    optuna = import_optuna()
    file = StudyFile(runs_dir, name,
                     lambda scratch: optuna.storages.RDBStorage(f"sqlite:///{scratch}").engine.dispose())
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # one line per trial is nbddp's
    try:
        storage = _storage(optuna, file)
        study = optuna.create_study(storage=storage, study_name=name, direction=direction, sampler=sampler,
                                    pruner=pruner or optuna.pruners.MedianPruner(), load_if_exists=True)
    except Exception as exc:  # noqa: BLE001 - a damaged or locked file is named; anything else as it was
        error = file.error(exc)
        if error is None:
            raise
        raise error from exc
    had = study.direction.name.lower()
    if had != direction:
        raise ConfigError(f"the sweep {name!r} ({file.path}) was started with direction={had!r}; continue it with "
                          f"direction={had!r}, or give this search another name=")
    return study, file


def _storage(optuna, file: StudyFile, tries: int = 5):
    """Optuna's storage on the checked ``file``; a file another program is still making
    (``optuna.load_study`` on a missing file makes one) is opened again once that program has
    stamped its tables."""
    from sqlalchemy.exc import IntegrityError, OperationalError

    for attempt in range(tries):
        try:
            # Every connection is opened by the file's own check (a swapped folder is refused), and
            # waits for a busy file (another kernel writing the same study), saying so.
            storage = optuna.storages.RDBStorage(f"sqlite:///{file.path}", engine_kwargs=file.engine_kwargs())
            file.watch(storage.engine)
            return storage
        except (IntegrityError, OperationalError) as e:
            half_made = isinstance(e, IntegrityError) or "already exists" in str(e)
            if not half_made or attempt == tries - 1:
                raise
            time.sleep(0.1 * (attempt + 1))


def mine() -> List[int]:
    """This kernel, as a trial notes it: pid and start time (a pid alone can be reused)."""
    return [os.getpid(), start_time(os.getpid())]


def fail_orphans(study, file: StudyFile, runs_dir: Path) -> List[str]:
    """Mark FAIL every RUNNING trial whose kernel is gone; end its leftover workers; one line each.

    The study's word is not enough to signal anything: a run's workers are ended only when the
    run's own private launch state says that this study's trial launched it, from a kernel that
    has ended, and nothing launched it since (:func:`_why_not_ended`).
    """
    from optuna.trial import TrialState

    from .procs import cleanup

    lines = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        kernel = t.user_attrs.get(KERNEL)
        if isinstance(kernel, list) and len(kernel) == 2 and is_same_process(*kernel):
            continue  # a live kernel runs it (this study shared by two kernels)
        run_dir = t.user_attrs.get(RUN_DIR)
        left = ""
        if run_dir:
            why = _why_not_ended(run_dir, file, t.number, runs_dir)
            if why is None:
                cleanup(run_dir, grace_s=1.0)  # its workers die with their kernel; anything left is ended
            else:
                left = f" No process of {run_dir} was ended: {why}."
        study._storage.set_trial_user_attr(t._trial_id, ENDED, KERNEL_DIED)
        study.tell(t.number, state=TrialState.FAIL, skip_if_finished=True)
        lines.append(f"trial {t.number} was running when the kernel that ran it ended: marked FAIL, it counts for "
                     f"nothing in n_trials; its run folder is kept ({run_dir or 'none yet'}). To run its parameters "
                     f"{t.params} again, call nbddp.sweep(..., retry_failed=True).{left}")
    return lines


#: The private record a sweep keeps in each trial's launch state: the study and trial that launched it.
TRIAL_RECORD = "sweep-trial.json"


def record_trial(run_dir: Path, file: StudyFile, number: int) -> None:
    """Note in the run's private launch state that trial ``number`` of this study launched it, from this kernel."""
    rundir.write_json_atomic(rundir.state_path(run_dir, TRIAL_RECORD),
                             {"study": str(file.path), "trial": number, "kernel": mine()}, mode=0o600)


def _why_not_ended(run_dir: Any, file: StudyFile, number: int, runs_dir: Path) -> Optional[str]:
    """None when the workers of ``run_dir`` may be ended for trial ``number``; else why not."""
    folder = own_run(run_dir, runs_dir)
    if folder is None:
        return f"it is not a run folder of yours in {Path(runs_dir).resolve()}"
    try:
        record = json.loads(rundir.read_private(rundir.state_path(folder, TRIAL_RECORD)))
    except (OSError, ValueError) as exc:  # NotPrivate included
        return f"its launch state has no private record of this sweep's trial {number} ({type(exc).__name__})"
    record = record if isinstance(record, dict) else {}
    kernel = record.get("kernel")
    if record.get("study") != str(file.path) or record.get("trial") != number or not (
            isinstance(kernel, list) and len(kernel) == 2 and isinstance(kernel[0], int)):
        return (f"its launch state says that another study or trial launched it ({record.get('study')}, "
                f"trial {record.get('trial')})")
    if is_same_process(*kernel):
        return f"the kernel that launched it (pid {kernel[0]}) is alive"
    parent = rundir.read_launch_record(folder).get("parent_pid")
    if parent != kernel[0]:
        return f"it was launched again since, by pid {parent}"
    return None


def own_run(run_dir: Any, runs_dir: Path) -> Optional[Path]:
    """``run_dir`` as a folder of the user's directly in ``runs_dir`` (no link), else None."""
    if not isinstance(run_dir, str) or not run_dir:
        return None
    path = Path(run_dir)
    try:
        if os.path.realpath(path.parent) != os.path.realpath(runs_dir):
            return None
        st = os.lstat(path)
    except OSError:
        return None
    return path if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() else None


def retry_failed(study) -> List[int]:
    """Ask again, once, the parameters of every FAIL trial not retried yet; the numbers retried.

    A trial refused for parameters outside the search space is not asked again."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    retried = {t.user_attrs.get(RETRY_OF) for t in trials}
    out = []
    for t in trials:
        if t.state == TrialState.FAIL and t.number not in retried and t.params and \
                t.user_attrs.get(ENDED) != OUTSIDE:
            study.enqueue_trial(t.params, user_attrs={RETRY_OF: t.number})
            out.append(t.number)
    return out


def outside_space(trial) -> Dict[str, str]:
    """The parameters of ``trial`` that its own distributions do not hold, each with its range.

    Optuna runs a fixed or enqueued value outside the space the trial suggests (``lr=123456.0``
    for ``suggest_float("lr", 1e-3, 0.1)``) with a warning only; nbddp refuses such a trial.
    """
    out = {}
    for name, value in trial.params.items():
        dist = trial.distributions.get(name)
        if dist is None:
            continue
        try:
            inside = dist._contains(dist.to_internal_repr(value))
        except (ValueError, TypeError):
            inside = False
        if not inside:
            out[name] = f"{name}={value!r} (the space: {dist})"
    return out


def used(study) -> int:
    """Trials that count in ``n_trials``: finished, running or failed on their own (a failure
    retried counts as its retry; a trial stopped or cut off by its kernel's end counts for nothing)."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    retried = {t.user_attrs.get(RETRY_OF) for t in trials}
    count = 0
    for t in trials:
        if t.state in (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING):
            count += 1
        elif t.state == TrialState.FAIL and t.user_attrs.get(ENDED) is None and t.number not in retried:
            count += 1
    return count


def waiting(study) -> int:
    """Trials asked for in advance (``enqueue_trial``) that have not started."""
    from optuna.trial import TrialState

    return len(study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))


def number(value: Any) -> Optional[float]:
    """``value`` as a finite float, else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def final_value(value: Any, metrics: List[dict], metric: str, builtin: bool) -> Optional[float]:
    """A finished trial's objective: what the worker returned under ``metric``; for the built-in
    worker, the value at the epoch it exported (its best); else the last value it logged."""
    if isinstance(value, dict):
        if number(value.get(metric)) is not None:
            return number(value[metric])
        if builtin and isinstance(value.get("metrics"), list) and isinstance(value.get("best_epoch"), int):
            at_best = [r for r in value["metrics"] if r.get("epoch") == value["best_epoch"]]
            if at_best and number(at_best[-1].get(metric)) is not None:
                return number(at_best[-1][metric])
    logged = [number(r.get(metric)) for r in metrics if metric in r]
    logged = [v for v in logged if v is not None]
    return logged[-1] if logged else None


def logged_names(metrics: List[dict]) -> List[str]:
    """The names a run logged (its records' keys, the axes left out)."""
    return sorted({k for r in metrics for k in r if k not in ("step", "epoch", "time")})


def row(t) -> dict:
    """A study's trial as a row of the table."""
    seconds = (t.datetime_complete - t.datetime_start).total_seconds() if t.datetime_complete and t.datetime_start \
        else None
    value = t.value if t.state.name == "COMPLETE" else (
        t.intermediate_values[max(t.intermediate_values)] if t.intermediate_values else None)
    state = t.state.name + (f" ({t.user_attrs[ENDED]})" if t.user_attrs.get(ENDED) else "")
    return {"number": t.number, "params": dict(t.params), "state": state, "value": value,
            "seconds": round(seconds, 1) if seconds is not None else None, "run_dir": t.user_attrs.get(RUN_DIR)}


def write_tensorboard(folder: Path, number_: int, params: Dict[str, Any], metric: str,
                      values: List[Tuple[int, float]], final: Optional[float], state: str) -> None:
    """One trial in the sweep's TensorBoard folder: its params and ``metric`` for the HParams tab,
    the metric's curve beside the other trials'."""
    from torch.utils.tensorboard import SummaryWriter
    from torch.utils.tensorboard.summary import hparams

    hp = {k: (v if isinstance(v, (int, float, str, bool)) else str(v)) for k, v in params.items()}
    writer = SummaryWriter(log_dir=str(folder / f"trial-{number_:04d}"))
    try:
        for summary in hparams(hp, {f"hparams/{metric}": final if final is not None else float("nan")},
                               hparam_domain_discrete=None):
            writer.file_writer.add_summary(summary)
        if final is not None:
            writer.add_scalar(f"hparams/{metric}", final, 0)
        for step, value in values:
            writer.add_scalar(metric, value, step)
        writer.add_text("state", state, 0)
    finally:
        writer.close()
