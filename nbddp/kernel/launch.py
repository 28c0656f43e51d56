"""``spawn_train``: start one process per GPU (or N CPU processes) from a notebook, safely.

Everything before the first process starts happens here: the target and its arguments are
checked, the GPUs leased, the run folder made, the ranks' meeting point made private to the
user (:mod:`nbddp.kernel.rendezvous`), the environment set for the children (and restored). Watching the run is :class:`nbddp.kernel.handle.RunHandle`'s job.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import socket
import threading
import warnings
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

from ..contract import debugging, plans, rundir, statedir
from ..contract.config import MIN_TIMEOUT_S, STRATEGY_ENV, TrainConfig, check_strategy
from ..contract.rundir import NAME_RULE, name_problem
from ..contract.errors import ConfigError, NbddpError, TrainingInterrupted
from .forkserver import prepare as _prepare_forkserver, server_death, server_pid
from .forkserver import start_method as _forkserver_start_method
from ..contract.gpus import IDLE, list_gpus, resolve_gpus
from .debugger import can_prompt, keep_cell_sources
from .handle import RunHandle, TrainResult, interrupts_held
from .logline import lines_in
from .ranks import Launches, RankGroup, remove_private_tmp
from .ranks import private_tmp  # noqa: F401 - the name tests and tools knew
from .ranks import ranks_env as _child_env  # noqa: F401 - the name tests and tools knew
from .restarts import RestartPolicy, check_policy as check_restart_policy
from ..contract.leases import LEASES_ENV, Leases, attempt
from .owners import Ownership
from .procs import live_workers
from ..contract.protocol import LaunchSpec
from .rendezvous import Rendezvous
from .shutdown import STOP_TIMEOUT_S
from .interrupt import raises_training_interrupted
from ..contract.system import start_time
from ..contract.plans import LaunchPlan
from ..contract.observe import check_trackers, profile_options, tracker_plan


def _check_launch_args(nprocs: Any, timeout_s: Any, name: Any) -> None:
    """Refuse counts and names that would otherwise be replaced by defaults or fail in a worker."""
    if nprocs is not None and (isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1):
        raise ConfigError(f"nprocs={nprocs!r}: must be an integer >= 1 (the number of CPU processes), "
                          "or None with gpus=[...]")
    if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                  or not timeout_s >= MIN_TIMEOUT_S):  # `not >=` also catches NaN
        raise ConfigError(f"timeout_s={timeout_s!r}: must be at least {MIN_TIMEOUT_S:g} seconds, since every "
                          "rank has to start and reach the process group within it; None takes the default")
    if name is not None and name_problem(name):
        raise ConfigError(f"name={name!r}: {NAME_RULE}")


@raises_training_interrupted
def spawn_train(
    target: Union[str, Callable[..., Any], TrainConfig],
    *args: Any,
    nprocs: Optional[int] = None,
    gpus: Optional[Sequence[int]] = None,
    kwargs: Optional[dict] = None,
    block: bool = True,
    name: Optional[str] = None,
    runs_dir: Union[str, Path, None] = None,
    timeout_s: Optional[float] = None,
    threads_per_proc: Optional[int] = None,
    grace_s: float = 3.0,
    stall_timeout_s: Optional[float] = None,
    stop_timeout_s: float = STOP_TIMEOUT_S,
    echo: bool = True,
    on_event: Optional[Callable[[str, Any], None]] = None,
    start_method: str = "forkserver",
    env: Optional[Dict[str, str]] = None,
    resume: Union[bool, str, Path, None] = None,
    all_values: bool = False,
    call: str = "ctx",
    argv: Optional[Sequence[Any]] = None,
    max_restarts: Optional[int] = None,
    oom: Optional[str] = None,
    restart_backoff_s: float = 1.0,
    debug: Union[bool, str] = False,
    profile: Union[bool, dict, None] = None,
    trackers: Optional[Sequence[str]] = None,
    strategy: Optional[str] = None,
    cluster: Any = None,
    detach: bool = False,
) -> Union[TrainResult, RunHandle]:
    """Run a DDP worker function in one process per GPU (nccl) or ``nprocs`` CPU processes (gloo).

    Args:
        target: what every rank runs, your code as you wrote it:

            - a ``TrainConfig``: the built-in classification worker;
            - a function: ``"path/to/file.py:fn"``, ``"package.module:fn"``, a function of a
              module, or one defined in a notebook cell (shipped by value with the classes and
              helpers it uses; its source is kept as ``worker_source.py`` in the run folder).
              ``call`` says how it is called;
            - a torchrun script, run unchanged as ``__main__``: ``"train.py"``, or ``"-m"``
              followed by the module (``spawn_train("-m", "pkg.train", argv=[...])``). It
              gets ``sys.argv == ["train.py", *argv]``, the kernel's working directory and
              torchrun's environment, and calls ``init_process_group`` itself (``env://``).
        *args: positional arguments for the worker function (must be picklable).
        nprocs: number of CPU processes (gloo). Defaults to 1 when ``gpus`` is not given.
        gpus: GPU ids (as in ``nvidia-smi``); rank r runs on ``gpus[r]`` with nccl. ``"idle"``
            takes the GPUs idle now (``nbddp.contract.gpus.IDLE_RULE``); a chosen GPU in use warns.
        kwargs: keyword arguments for the worker function (must be picklable).
        block: wait for the end and return a ``TrainResult``; ``False`` returns a
            ``RunHandle`` at once and keeps the notebook usable.
        name: suffix of the run folder ``runs_dir/<time>-<name>``.
        runs_dir: folder that holds the run folders (default ``runs``; a config's own ``runs_dir``).
        timeout_s: process-group timeout: a collective that waits longer fails (default 120 s
            on CPU, 600 s on GPU).
        threads_per_proc: intra-op threads per rank (default: cores divided among the ranks).
        grace_s: seconds each shutdown stage waits (stop request, then SIGTERM, then SIGKILL)
            after a failure or an interrupt.
        stop_timeout_s: after ``stop()`` (or an Interrupt), how long workers that saw the request
            and still send heartbeats may take to finish (evaluation, checkpoint, export) before
            SIGTERM; one whose heartbeat stops for ``grace_s + 2`` s is ended at once. The run then
            returns ``TrainResult(stopped=True)`` (an Interrupt raises ``TrainingInterrupted``).
        stall_timeout_s: a rank that lags behind the others without progress for this long is
            declared hung and the run is stopped, naming it (default: ``timeout_s`` on CPU,
            ``0.75 * timeout_s`` on GPUs, before NCCL's watchdog aborts the waiting ranks).
            Progress is what the worker reports through ``ctx.heartbeat``/``ctx.log``/``ctx.progress``.
            When no rank makes progress and none lags (every rank stuck at the same point, e.g. in a
            data loader), the run goes on, but once that lasts ``stall_timeout_s`` and three times
            the longest gap seen so far, the cell says where every rank is (:mod:`nbddp.kernel.stall`).
        echo: print rank 0's output live, prefixed with ``[rank0]``; while the cell waits
            (``block=True``), a worker's ``ctx.log`` values also show in one line under it,
            rewritten in place in a notebook or terminal, a plain line now and then in a log file
            (not for the built-in worker, whose epoch lines say them).
        on_event: called as ``on_event(kind, payload)`` for every ``"line"``, ``"metrics"``,
            ``"progress"`` and ``"end"`` event (see :meth:`RunHandle.subscribe`).
        start_method: ``"forkserver"`` (default, warm: workers fork from a server process
            that has torch and DDP preloaded, so relaunches reach their first step in 0.2-0.4 s
            instead of ~3 s; the server is a fresh interpreter, never the kernel, so the kernel
            may use CUDA) or ``"spawn"`` (every worker a fresh interpreter: the reference).
            Both give the same guarantees; ``bench/soak.py`` checks them over 100 cycles.
        env: extra environment variables for the workers.
        resume: continue an earlier run of a worker function in its own run folder, so that
            ``ctx.load_checkpoint()`` finds what ``ctx.save_checkpoint()`` wrote there: a run
            folder, or ``True`` for the newest run of the same ``name`` that holds a checkpoint.
            (A ``TrainConfig`` says it in the config: ``cfg.replace(resume=True)``.)
        all_values: collect every rank's return value into ``TrainResult.values`` (each rank
            pickles its value into the run folder); by default only rank 0's is kept.
        call: how each rank calls a function: ``"ctx"`` (default: ``fn(ctx, *args, **kwargs)``
            after nbddp made the process group), ``"mp.spawn"`` (``fn(rank, *args, **kwargs)``,
            as ``torch.multiprocessing.spawn`` calls it; the function makes its own group) or
            ``"torchrun"`` (``fn(*args, **kwargs)`` with torchrun's environment; the function
            makes its own group, ``env://``). A mismatch is refused before anything starts.
        argv: a script's command line, ``sys.argv[1:]`` (strings; numbers are written out).
        max_restarts: restart a run that failed in a way a restart can heal (a rank killed or
            crashed, a hang, a collective timeout, a GPU/NCCL error, ``nbddp.Retryable``) up to
            this many times, in the same run folder, from its last checkpoint (the built-in
            worker's ``last.pt``; ``ctx.load_checkpoint()`` in your own). Errors of the worker's
            code that would fail again the same way, a Stop and an Interrupt are never retried:
            the rule is :mod:`nbddp.kernel.restarts`. Default 0 (a config's own ``max_restarts``).
        oom: ``"halve"``: an out-of-memory error restarts the built-in worker with half the
            per-rank batch and twice the gradient accumulation (same global batch and schedule),
            as often as the batch can be split, whatever ``max_restarts``. ``"fail"``: it ends the run. Default: the config's own ``oom``,
            else ``"fail"``.
        restart_backoff_s: seconds before the first restart, doubled for each next one.
        debug: ``True``: ``breakpoint()`` in a rank stops it in ``pdb`` with the prompt in the
            notebook (``(Pdb) [rank 1]``, every pdb command, output in the cell), as
            ``ctx.breakpoint(rank=r)`` always does; nbddp's own process group then waits a day in
            a collective (the stall detector, paused at the prompt, still names a hung rank).
            Where no one can answer (nbmake, a script, CI) a breakpoint is skipped with a warning
            line; ``"always"`` stops there anyway (``handle.debug()`` or a terminal answers).
        profile: ``True`` or a dict: ``torch.profiler`` on every rank, with no profiler code in the
            worker. Its schedule (``wait``/``warmup``/``active`` steps, ``repeat`` windows; default
            5/2/5/1) advances on each new ``step`` the worker reports (``ctx.log(step=...)``,
            ``ctx.progress(step=...)``), and on the built-in worker's optimizer steps. Also
            ``record_shapes``, ``with_stack``, ``ranks`` (default every rank) and ``memory``
            (GPUs: the CUDA allocator's history; an out-of-memory error keeps its snapshot in
            ``profile/`` and says how to open it). Each rank writes a Chrome trace,
            ``profile/rank<r>.pt.trace.json.gz``; ``result.profile`` puts the ranks side by side:
            computation, communication, data loading, idle, top operators, the rank the others wait for.
        trackers: ``["mlflow"]``, ``["wandb"]`` or both (a config's own ``trackers``): rank 0 sends
            every value the run logs, the launch's settings (as parameters) and at the end the
            exported weights to one tracker run per run folder, which restarts and ``resume=``
            continue. MLflow: ``MLFLOW_TRACKING_URI`` if set, else ``sqlite:///<runs_dir>/mlflow.db``;
            W&B: offline unless ``WANDB_MODE``/``WANDB_API_KEY`` say otherwise. TensorBoard stays.
        strategy: how ``ctx.prepare(model)`` spreads the model over the ranks: ``"ddp"`` (default:
            every rank holds the whole model, its gradients and optimizer state) or ``"fsdp"``
            (FSDP2: each rank holds a shard of them; see :meth:`nbddp.Context.prepare`). Ranks read
            it as ``ctx.strategy``. (A ``TrainConfig`` says it in the config: ``cfg.replace(strategy="fsdp")``.)
        cluster: ``nbddp.Slurm(partition=..., nodes=..., gpus_per_node=...)``: the ranks run as one SLURM
            job (``nodes`` x ``gpus_per_node`` GPU ranks, or ``nodes`` x ``nprocs`` CPU ranks), followed
            here through the run folder as a local run is (:mod:`nbddp.kernel.slurm`). ``runs_dir`` must
            be on a file system the nodes share.
        detach: the run goes on if this kernel stops (killed, restarted, shut down): a supervisor of its
            own starts and owns the ranks, with the same staged stop, restarts, hang detection, reaping and
            leases, and this kernel follows it through the run folder (:mod:`nbddp.kernel.supervisor`). An
            Interrupt while a cell waits on it ends the wait, not the run; ``handle.stop()`` ends the run.
            ``nbddp.runs()`` lists it and ``nbddp.attach(run_dir)`` follows it again, from any kernel of
            yours. Breakpoints in its ranks are skipped (no one could answer). Without it (the default),
            a kernel that stops ends its runs within seconds, so nothing is left holding GPUs.

    Returns:
        A ``TrainResult`` (``block=True``) or a ``RunHandle`` (``block=False``).

    Raises:
        ConfigError: bad arguments, found before any process starts.
        WorkerError: a worker failed; names the root-cause rank, its traceback and log.
        TrainingInterrupted: the cell was interrupted; every worker was stopped and reaped.

    Example:
        >>> result = spawn_train("my_worker.py:train", nprocs=2, kwargs={"steps": 500})
        >>> result.value, result.run_dir
    """
    _check_launch_args(nprocs, timeout_s, name)
    if not (debug is True or debug is False or (isinstance(debug, str) and debug == "always")):
        raise ConfigError(f"debug={debug!r}: use True (breakpoint() opens pdb in the notebook), False, or 'always' "
                          "(stop at a breakpoint even where no one can answer a prompt)")
    env = _with_strategy(target, strategy, env)
    if plans.is_task_config(target):
        max_restarts = target.max_restarts if max_restarts is None else max_restarts
        oom = target.oom if oom is None else oom
    max_restarts = 0 if max_restarts is None else max_restarts
    oom = "fail" if oom is None else oom
    check_restart_policy(max_restarts, oom, restart_backoff_s)
    if trackers is None and plans.is_task_config(target):
        trackers = target.trackers
    trackers = check_trackers(trackers)  # a missing package is refused here, before anything starts
    if start_method not in ("spawn", "forkserver"):
        raise ConfigError(f"start_method={start_method!r}: use 'spawn' or 'forkserver' (fork breaks once the "
                          "kernel has used CUDA, so it is not offered)")
    start_method = _forkserver_start_method(start_method)  # spawn where the forkserver is unsafe
    if detach is not True and detach is not False:
        raise ConfigError(f"detach={detach!r}: use True (the run outlives this kernel) or False")
    if detach and cluster is not None:
        raise ConfigError("detach=True with cluster=: a SLURM job outlives the kernel already; "
                          "nbddp.attach(run_dir) follows it again")
    if cluster is not None:  # refused here, before anything is queued (nbddp.kernel.slurm)
        from .slurm import cluster_ranks

        (target, nprocs), start_method = cluster_ranks(cluster, target, nprocs, gpus, runs_dir), "spawn"
    # "idle" (here or in a config): the GPUs idle now that no other kernel leases; busy ones warn.
    # The GPUs are leased from here to the run's end, so that no other kernel's "idle" takes them.
    target, gpus, leases = _resolve_gpus(target, gpus)
    try:
        return _launch(target, gpus, leases, nprocs=nprocs, kwargs=kwargs, args=args, block=block, name=name,
                       runs_dir=runs_dir, timeout_s=timeout_s, threads_per_proc=threads_per_proc, grace_s=grace_s,
                       stall_timeout_s=stall_timeout_s, stop_timeout_s=stop_timeout_s, echo=echo,
                       on_event=on_event, start_method=start_method, env=env, resume=resume,
                       all_values=all_values, call=call, argv=argv, debug=debug,
                       restarts=dict(max_restarts=max_restarts, oom=oom, backoff_s=restart_backoff_s),
                       observe=dict(profile=profile, trackers=trackers), cluster=cluster, detach=detach)
    except BaseException:
        leases.release()  # the handle releases them at the run's end; twice is harmless
        raise


def debug_env(debug: Union[bool, str]) -> Dict[str, str]:
    """The ranks' variables for ``debug``: their breakpoints are relayed; ``breakpoint()`` too when asked."""
    env = {debugging.RELAY_ENV: "1"}
    if debug:
        env["PYTHONBREAKPOINT"] = debugging.BREAKPOINT_HOOK
    return env


def debug_mode(debug: Union[bool, str]) -> str:
    """What a breakpoint does in this launch: ``stop`` (``"always"``), ``prompt`` (someone can answer), ``skip``."""
    if debug == "always":
        return "stop"
    return "prompt" if can_prompt() else "skip"


def _with_strategy(target: Any, strategy: Optional[str], env: Optional[Dict[str, str]]) -> Dict[str, str]:
    """The workers' environment with the launch's strategy in it (``ctx.strategy``), checked before anything starts."""
    if plans.is_task_config(target):
        if strategy is not None and strategy != target.strategy:
            raise ConfigError(f"strategy={strategy!r} but the config says {target.strategy!r}: with a config, set it "
                              f"there: cfg.replace(strategy={strategy!r})")
        strategy = target.strategy
    strategy = check_strategy("ddp" if strategy is None else strategy)
    return {**(env or {}), STRATEGY_ENV: strategy}


def _launch(target: Any, gpus: Optional[List[int]], leases: Leases, *, nprocs, kwargs, args, block, name,
            runs_dir, timeout_s, threads_per_proc, grace_s, stall_timeout_s, stop_timeout_s, echo, on_event,
            start_method, env, resume, all_values, call, argv, restarts, debug, observe,
            cluster=None, detach=False) -> Union[TrainResult, RunHandle]:
    """:func:`spawn_train` once its GPUs are resolved and leased."""
    plan = plans.plan(target, args, kwargs, nprocs=nprocs, gpus=gpus, name=name, runs_dir=runs_dir,
                      timeout_s=timeout_s, resume=resume, call=call, argv=argv)
    world, backend = plan.world, plan.backend  # placed with the plan: ranks, backend, GPUs, timeout
    observed = _observe(plan, world, backend, **observe)
    run_dir = _prepare_run_dir(plan, world)
    if plan.payload is not None:
        keep_cell_sources(run_dir, target)
    leases.note(str(run_dir))
    launcher = Launches(plan, run_dir, threads_per_proc, start_method, {**debug_env(debug), **(env or {})},
                        all_values, restarts["max_restarts"], observed)
    if stall_timeout_s is None:
        # NCCL's watchdog aborts the ranks that wait longer than timeout_s, which would leave
        # only their SIGABRTs to read; nbddp names the hung rank well before that.
        stall_timeout_s = 0.75 * launcher.timeout if backend == "nccl" else launcher.timeout
    # Echo only what this launch writes: a resumed run appends to its rank logs.
    watch = dict(echo=echo, grace_s=grace_s, stall_timeout_s=stall_timeout_s, stop_timeout_s=stop_timeout_s,
                 log_starts=rundir.log_sizes(run_dir, world), debug=debug_mode(debug),
                 show_logs=plan.config is None,  # the built-in worker prints its epoch records itself
                 records_before=lines_in(rundir.metrics_path(run_dir)))
    if detach:  # a supervisor of its own starts and owns the ranks (nbddp.kernel.detach)
        from .detach import start_detached

        try:
            return start_detached(launcher, leases, restarts, watch, on_event, block)
        except BaseException:
            statedir.release(run_dir)
            raise
    spec, meet, child_env, tmp_dir = launcher.prepare(restart=0)
    try:
        if start_method == "forkserver":
            _prepare_forkserver()
        watch["restarts"] = RestartPolicy(launcher=launcher, **restarts)
        if cluster is not None:  # a SLURM job starts the ranks (nbddp.kernel.slurm_group)
            from .slurm_group import start_job

            return start_job(cluster, spec, meet, leases, launcher, tmp_dir, watch, on_event, block)
        return _start(spec, meet, leases, child_env, launcher, tmp_dir, watch, on_event, block)
    except BaseException:
        meet.close()  # the handle closes it at the run's end; twice is harmless
        statedir.release(run_dir)  # the state folder prepare_launch holds open (the handle's, once it has one)
        raise


#: GPUs the caller of this thread's next launch leased itself (:func:`on_leased_gpus`).
_held = threading.local()


@contextlib.contextmanager
def on_leased_gpus(leases: Leases):
    """The launches of this thread in the body train on GPUs the caller leased already (``nbddp.sweep``'s slots).

    A launch whose GPUs are exactly ``leases``' takes them over (it releases them at the run's
    end) instead of leasing them again, which its own leases would refuse, warning "leased by".
    """
    _held.leases = leases
    try:
        yield
    finally:
        _held.leases = None


def _take_held(ids: Any) -> Optional[Leases]:
    held = getattr(_held, "leases", None)
    if held is not None and held.indices and not isinstance(ids, str) and sorted(ids or ()) == sorted(held.indices):
        _held.leases = None
        return held
    return None


def _resolve_gpus(target: Any, gpus: Union[str, Sequence[int], None]) -> Tuple[Any, Optional[List[int]], Leases]:
    """``(target, gpus, leases)`` with ``"idle"`` resolved to the GPUs idle now (:func:`nbddp.contract.gpus.resolve_gpus`).

    A config comes back with its ``gpus`` resolved, so that its checks, its ``config.json`` and
    its workers see the GPUs it runs on. Chosen GPUs that are busy warn. The GPUs are leased.
    """
    held = _take_held(target.gpus if plans.is_task_config(target) else gpus)
    if held is not None:
        return target, (None if plans.is_task_config(target) else list(gpus)), held
    if plans.is_task_config(target):
        ids, leases = _leased(target.gpus)
        return (target.replace(gpus=tuple(ids)) if target.gpus == IDLE else target), gpus, leases
    if gpus is None:
        return target, None, Leases()
    ids, leases = _leased(gpus)
    return target, ids, leases


def _leased(value: Union[str, Sequence[int], None]) -> Tuple[List[int], Leases]:
    """The GPU ids of ``value`` and their leases (:mod:`nbddp.contract.leases`), taken without waiting.

    With ``"idle"``, a GPU another kernel leased between the listing and now is dropped (that
    kernel won it); none left is refused. A GPU chosen by hand is leased when free and warned
    about when leased (:func:`resolve_gpus`); a GPU that cannot be leased (the folder unusable) is
    used without a lease, with a warning that says why.
    """
    ids = resolve_gpus(value)
    if not ids:
        return ids, Leases()
    listed = {g.index: g for g in list_gpus()}
    tries = {i: attempt(i, listed[i].uuid) for i in ids if i in listed}
    taken = [a.lease for a in tries.values() if a.lease is not None]
    off = {i: a.off for i, a in tries.items() if a.off}
    if off:
        why = "; ".join(dict.fromkeys(off.values()))
        warnings.warn(f"GPU leases are off: {why}. Other kernels cannot see that this launch uses GPUs {sorted(off)}, "
                      f"nor this one theirs; set {LEASES_ENV} to a folder your kernels share.", stacklevel=3)
    if not isinstance(value, str):
        return ids, Leases(taken)
    lost = {i: a.held_by for i, a in tries.items() if a.held_by}
    ids = [i for i in ids if i not in lost]
    if not ids:
        raise ConfigError(f"gpus={IDLE!r}: the idle GPUs were just leased by other launches: "
                          + "; ".join(f"GPU {i} {who}" for i, who in sorted(lost.items()))
                          + ". Launch again when one is free, or choose GPUs explicitly to share one.")
    return ids, Leases(taken)


def _observe(plan: LaunchPlan, world: int, backend: str, profile: Any,
             trackers: Tuple[str, ...]) -> Optional[dict]:
    """What the ranks record beside the run (``profile=``, ``trackers=``), checked before anything starts."""
    options = profile_options(profile, world, backend)
    if options is None and not trackers:
        return None
    if plan.config is not None:
        params = {k: v for k, v in dataclasses.asdict(plan.config).items() if k not in ("resume", "trackers")}
    else:
        params = {"target": plan.target, "args": list(plan.args), **{f"kwargs.{k}": v for k, v in plan.kwargs.items()},
                  "call": plan.call, "argv": list(plan.argv)}
    params.update(world_size=world, backend=backend, gpus=list(plan.gpus))
    return {"profile": options, "by_optimizer": plan.config is not None,
            "trackers": tracker_plan(trackers, plan.name, plan.runs_dir, params)}


def _prepare_run_dir(plan: LaunchPlan, world: int) -> Path:
    """A new run folder, or the one to continue (refused while an earlier launch still runs in it)."""
    if plan.run_dir is None:
        run_dir = rundir.new_run_dir(plan.runs_dir, plan.name)
    else:
        run_dir = Path(plan.run_dir)
        if live_workers(run_dir):
            raise ConfigError(
                f"{run_dir} still has running workers from an earlier launch (pids {live_workers(run_dir)}); "
                f"they may hold its GPUs and checkpoints. End them with nbddp.cleanup({str(run_dir)!r}) "
                "and launch again.")
    rundir.prepare_launch(run_dir, world)
    if plan.source is not None:
        rundir.atomic_write_text(rundir.worker_source_path(run_dir), plan.source)
    if plan.config is not None:
        plan.config.save(rundir.config_path(run_dir))
    return run_dir


def _start(spec: LaunchSpec, meet: Rendezvous, leases: Leases, child_env: Dict[str, Optional[str]], launches: Launches,
           tmp_dir: str, watch: dict, on_event: Optional[Callable[[str, Any], None]],
           block: bool, detached: bool = False) -> Union[TrainResult, RunHandle]:
    """Start the workers and hand them to a RunHandle; wait for the end when ``block``
    (``detached``: this process is a detached run's supervisor, :mod:`nbddp.kernel.supervisor`)."""
    # From the first worker on, an Interrupt must not leave a process nobody knows of (a cold
    # start waits seconds for the forkserver): it is held back until the handle owns the
    # processes and the launch record names them, then handled like any other.
    with interrupts_held("nbddp: Interrupt: the workers are starting; they are stopped as soon as every one "
                         "is known (a few seconds)") as interrupted:
        try:
            ranks = RankGroup.start(launches, spec, meet, child_env, tmp_dir)
        except (EOFError, OSError) as exc:  # the server's connection broke: it died
            raise _start_failed(spec, launches.start_method, bool(interrupted)) from exc
        try:
            handle = RunHandle(ranks, leases=leases, **watch)
            if on_event is not None:
                handle.subscribe(on_event)
            rundir.update_launch_record(
                spec.run_dir, target=spec.target, world_size=spec.world_size, backend=spec.backend,
                gpus=list(spec.gpus), pids=handle.pids, start_times=[start_time(p) for p in handle.pids],
                parent_pid=os.getpid(), store=meet.kind, port=spec.store_port, store_path=spec.store_path,
                host=socket.gethostname(),
                started=handle.started_at, tmp_dir=tmp_dir)  # for cleanup, should the kernel die first
            # Who owns the run, for nbddp.runs() and attach() (nbddp.kernel.owners).
            handle._owner = Ownership.announce(handle, detached=detached, name=launches.plan.name)
        except BaseException:
            ranks.kill_started()
            remove_private_tmp(tmp_dir)
            raise
        if not block and not interrupted:
            handle.start_background()
    if interrupted:
        handle.end_interrupted()  # staged stop, every worker reaped; raises TrainingInterrupted
    return handle if not block else handle.wait()


def _start_failed(spec: LaunchSpec, start_method: str, interrupted: bool) -> BaseException:
    """The error for a launch whose workers could not be started (the warm server died meanwhile).

    Workers it had forked die with it (their parent-death signal). After an Interrupt that is
    the interrupt; otherwise the server's end is named, and the next launch starts a new one.
    """
    if interrupted:
        return TrainingInterrupted.for_run("interrupted", spec.world_size, spec.run_dir,
                                           how="before every worker had started")
    death = server_death(server_pid()) if start_method == "forkserver" else None
    what = f"the launch server died ({death})" if death else "starting the workers failed"
    return NbddpError(f"{what} while starting the workers of {spec.run_dir}; launch again (a new server "
                      "starts), or use start_method='spawn'.")
