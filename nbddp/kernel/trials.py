"""One trial of a sweep: its overrides made into a launch (checked first), and its end told to Optuna."""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import sys
import warnings
from typing import Any, Tuple

from ..contract import rundir
from ..contract.errors import ConfigError
from . import study as st

#: What the sweep sets for each trial: a space that suggests one of these is refused.
_SWEEP_OWNS = ("name", "runs_dir", "nprocs", "gpus", "resume")


def apply_overrides(s, number: int, overrides: Any, slot) -> Tuple[Any, tuple, dict]:
    """``(target, args, spawn_train keywords)`` of trial ``number`` of sweep ``s`` on ``slot``."""
    options = dict(s.options)
    args = tuple(options.pop("args", ()))
    run_name = f"{s.name}-{number}"[:rundir.NAME_MAX]
    place = {"nprocs": slot.nprocs} if not slot.gpus else {"gpus": list(slot.gpus)}
    if s.slots.threads is not None:
        options.setdefault("threads_per_proc", s.slots.threads)
    if s.builtin:
        fields = {f.name for f in dataclasses.fields(s.target)}
        _check_names(overrides, fields, "a TrainConfig field", "TrainConfig's fields")
        cfg = s.target.replace(**overrides, name=run_name, runs_dir=str(s.runs_dir),
                               nprocs=slot.nprocs or s.target.nprocs, gpus=tuple(slot.gpus))
        return cfg, args, options
    if isinstance(s.target, str) and _is_script(s.target):
        if not isinstance(overrides, (list, tuple)):
            raise ConfigError(f"space(trial) returned {type(overrides).__name__}: for a script it returns the "
                              "argv, a list, e.g. ['--lr', str(trial.suggest_float('lr', 1e-4, 1e-1, log=True))]")
        return s.target, args, {**options, **place, "name": run_name, "runs_dir": s.runs_dir,
                                "argv": [str(a) for a in overrides]}
    names, open_ended = _parameters(s.target)
    if not open_ended:
        _check_names(overrides, names, f"an argument of {_label(s.target)}", "its arguments")
    elif not isinstance(overrides, dict):
        _check_names(overrides, set(), "", "")
    kwargs = {**dict(options.pop("kwargs", None) or {}), **overrides}
    return s.target, args, {**options, **place, "name": run_name, "runs_dir": s.runs_dir, "kwargs": kwargs}


def _check_names(overrides: Any, names: set, what: str, which: str) -> None:
    if not isinstance(overrides, dict):
        raise ConfigError(f"space(trial) returned {type(overrides).__name__}: it returns a dict of overrides, "
                          "e.g. {'lr': trial.suggest_float('lr', 1e-4, 1e-1, log=True)}")
    owned = [k for k in overrides if k in _SWEEP_OWNS]
    if owned:
        raise ConfigError(f"space(trial) suggested {owned}: the sweep sets {', '.join(_SWEEP_OWNS)} for each trial "
                          "(gpus_per_trial= or nprocs= choose the processes)")
    bad = [k for k in overrides if k not in names]
    if bad:
        names = sorted(set(names) - set(_SWEEP_OWNS))
        near = {k: difflib.get_close_matches(k, names, n=2) for k in bad}
        hints = "; ".join(f"{k!r} (did you mean {' or '.join(v)}?)" if v else repr(k) for k, v in near.items())
        raise ConfigError(f"space(trial) suggested {hints}, which is not {what}; suggest only {which}: "
                          f"{', '.join(names)}")


def _parameters(target: Any) -> Tuple[set, bool]:
    """The keyword arguments a function takes after ``ctx``, and whether it takes ``**kwargs``."""
    if callable(target):
        try:
            params = list(inspect.signature(target).parameters.values())[1:]
        except (TypeError, ValueError):
            return set(), True
        return ({p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)},
                any(p.kind == p.VAR_KEYWORD for p in params))
    from ..contract.targets import resolve_target, worker_signature

    sig = worker_signature(resolve_target(target))
    if sig is None:
        return set(), True
    return {p.name for p in sig.params if p.keyword}, sig.var_kwargs


def _label(target: Any) -> str:
    return getattr(target, "__name__", None) or str(target)


def _is_script(target: str) -> bool:
    from ..contract.conventions import is_script

    return target == "-m" or is_script(target)  # "-m" with the module in args=, as spawn_train takes it


def tell(s, run) -> None:
    """Tell Optuna how trial ``run`` ended, print its line, queue its TensorBoard record."""
    from optuna.trial import TrialState

    from .handle import TrainResult

    outcome, trial, n = run.handle.outcome, run.trial, run.trial.number
    value = None
    if run.pruned:
        state = TrialState.PRUNED
    elif isinstance(outcome, TrainResult) and not outcome.stopped:
        value = st.final_value(outcome.value, outcome.metrics, s.metric, s.builtin)
        state = TrialState.COMPLETE if value is not None else TrialState.FAIL
        if value is None:
            trial.set_user_attr(st.ERROR, f"{s.metric!r} was never logged")
            s._stop_for(ConfigError(
                f"metric={s.metric!r}: trial {n} finished without logging it (ctx.log) or returning it in a dict; it "
                f"logged {', '.join(st.logged_names(outcome.metrics)) or 'nothing'}. Pass metric= one of those, or "
                f"log it: ctx.log({s.metric}=...). The run is in {outcome.run_dir}."))
    elif s._stop_asked and (isinstance(outcome, TrainResult) or type(outcome).__name__ == "TrainingInterrupted"):
        trial.set_user_attr(st.ENDED, st.STOPPED)
        state = TrialState.FAIL
    else:
        state = TrialState.FAIL
        trial.set_user_attr(st.ERROR, f"{type(outcome).__name__}: {outcome}"[:2000])
        if not any(t.state == TrialState.COMPLETE for t in s.study.get_trials(deepcopy=False)):
            s._say(f"trial {n} failed, and no trial of the sweep {s.name!r} has completed: the sweep stops "
                   "(fix the error below, then call nbddp.sweep again to continue it)")
            s._stop_for(outcome)
    frozen = s.study.tell(trial, value if state == TrialState.COMPLETE else None, state=state)
    row = st.row(frozen)
    row["seconds"] = round(_seconds(run, outcome), 1)
    if value is None and run.values:
        row["value"] = run.values[-1][1]
    s._rows[n] = row
    shown = f"{s.metric}={row['value']:.4g}" if row["value"] is not None else f"{s.metric}=-"
    s._say(f"[sweep {s.name}] trial {n} {row['state']} {shown} in {row['seconds']:.1f} s  {row['params']}  "
           f"{row['run_dir']}")
    s._later.append(lambda: _tensorboard(s, n, row, run.values, value))


def _seconds(run, outcome) -> float:
    import time

    return getattr(outcome, "seconds", None) or (time.time() - run.started)


def _tensorboard(s, n: int, row: dict, values, value) -> None:
    try:
        st.write_tensorboard(s.tensorboard_dir, n, row["params"], s.metric, values, value, row["state"])
    except Exception as exc:  # noqa: BLE001 - a missing TensorBoard record must not end the sweep
        warnings.warn(f"trial {n}'s TensorBoard record was not written: {exc!r}", RuntimeWarning, stacklevel=2)
        print(f"nbddp: {exc!r}", file=sys.stderr)
