"""A sweep's Optuna study: where it lives, what its trials count for, and what a killed kernel left.

The study is data in an SQLite file of the runs folder (``<runs_dir>/sweeps/<name>/study.db``),
so a later ``nbddp.sweep`` with the same name, in any kernel, continues it. Each trial notes
the kernel that runs it (pid and start time); a trial still RUNNING whose kernel is gone was cut
off by that kernel's end: it is marked FAIL, its run folder kept, and it counts for nothing.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from ..contract import rundir
from ..contract.errors import ConfigError
from ..contract.system import is_same_process, start_time

#: user_attrs of a trial: its run folder, the kernel that runs it, why it ended early, its error,
#: and the failed trial it runs again (``retry_failed=True``).
RUN_DIR, KERNEL, ENDED, ERROR, RETRY_OF = "run_dir", "kernel", "ended", "error", "retry_of"
#: ``ENDED`` values: trials that never finished, so they count for nothing in ``n_trials``.
STOPPED, KERNEL_DIED = "stopped", "kernel died"


def import_optuna():
    """Optuna, or an error that says how to install it (it is the optional ``sweep`` extra)."""
    try:
        import optuna
    except ImportError:
        raise ImportError("nbddp.sweep needs Optuna: pip install optuna (or pip install nbddp[sweep])") from None
    return optuna


def open_study(runs_dir: Path, name: str, direction: str, sampler, pruner):
    """The study ``name`` in its SQLite file under ``runs_dir``, made or continued; ``(study, path)``."""
    optuna = import_optuna()
    folder = rundir.sweep_dir(runs_dir, name)
    folder.mkdir(parents=True, exist_ok=True)
    path = (folder / "study.db").resolve()
    # Made whole in a file of its own first: Optuna fails when two processes make the tables of one
    # new file at once (two kernels starting one sweep, a notebook reading a sweep as it starts).
    rundir.create_once(path, lambda scratch: optuna.storages.RDBStorage(f"sqlite:///{scratch}").engine.dispose())
    storage = _storage(optuna, path)
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # one line per trial is nbddp's
    study = optuna.create_study(storage=storage, study_name=name, direction=direction, sampler=sampler,
                                pruner=pruner or optuna.pruners.MedianPruner(), load_if_exists=True)
    had = study.direction.name.lower()
    if had != direction:
        raise ConfigError(f"the sweep {name!r} ({path}) was started with direction={had!r}; continue it with "
                          f"direction={had!r}, or give this search another name=")
    return study, path


def _storage(optuna, path: Path, tries: int = 5):
    """Optuna's storage on ``path``; a file another program is still making (``optuna.load_study``
    on a missing file makes one) is opened again once that program has stamped its tables."""
    from sqlalchemy.exc import IntegrityError, OperationalError

    for attempt in range(tries):
        try:
            # A busy SQLite file (another kernel writing the same study) waits instead of failing at once.
            return optuna.storages.RDBStorage(f"sqlite:///{path}", engine_kwargs={"connect_args": {"timeout": 30}})
        except (IntegrityError, OperationalError) as e:
            half_made = isinstance(e, IntegrityError) or "already exists" in str(e)
            if not half_made or attempt == tries - 1:
                raise
            time.sleep(0.1 * (attempt + 1))


def mine() -> List[int]:
    """This kernel, as a trial notes it: pid and start time (a pid alone can be reused)."""
    return [os.getpid(), start_time(os.getpid())]


def fail_orphans(study) -> List[str]:
    """Mark FAIL every RUNNING trial whose kernel is gone; end its leftover workers; one line each."""
    from optuna.trial import TrialState

    from .procs import cleanup

    lines = []
    for t in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        kernel = t.user_attrs.get(KERNEL)
        if kernel and is_same_process(kernel[0], kernel[1]):
            continue  # a live kernel runs it (this study shared by two kernels)
        run_dir = t.user_attrs.get(RUN_DIR)
        if run_dir and Path(run_dir).is_dir():
            cleanup(run_dir, grace_s=1.0)  # its workers die with their kernel; anything left is ended
        study._storage.set_trial_user_attr(t._trial_id, ENDED, KERNEL_DIED)
        study.tell(t.number, state=TrialState.FAIL, skip_if_finished=True)
        lines.append(f"trial {t.number} was running when the kernel that ran it ended: marked FAIL, it counts for "
                     f"nothing in n_trials; its run folder is kept ({run_dir or 'none yet'}). To run its parameters "
                     f"{t.params} again, call nbddp.sweep(..., retry_failed=True).")
    return lines


def retry_failed(study) -> List[int]:
    """Ask again, once, the parameters of every FAIL trial not retried yet; the numbers retried."""
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    retried = {t.user_attrs.get(RETRY_OF) for t in trials}
    out = []
    for t in trials:
        if t.state == TrialState.FAIL and t.number not in retried and t.params:
            study.enqueue_trial(t.params, user_attrs={RETRY_OF: t.number})
            out.append(t.number)
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
