"""``TrainingPanel``: choose GPUs (or CPU processes), set the config, train, watch, stop.

Two kinds of run: the built-in classifier (a :class:`TrainConfig`: model, data, SyncBN...) and
any worker function, in a file (``"my_worker.py:train"``) or a notebook cell (a form of its
keyword arguments, read from its signature without running a file, and a chart of every scalar
it logs).

The panel composes three parts: the device picker (:mod:`.devices`), the form
(:mod:`.form` for a config, :mod:`.worker_form` for a worker) and the run view
(:mod:`.run_view`: buttons, status, progress, chart, log). It owns the one thing they share:
starting a run. The Train button's callback (and :meth:`TrainingPanel.run`) runs on the
kernel's main thread, and that is where ``spawn_train`` must be called: the workers'
parent-death signal is tied to the thread that started them, and the kernel's main thread lives
as long as the kernel. Kernel side only.
"""

from __future__ import annotations

import html
import time
from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

import ipywidgets as W

from ..contract.config import COMMON_MODELS, FREEZE_REASON, TrainConfig  # noqa: F401 - COMMON_MODELS, FREEZE_REASON: names of this module before
from ..contract.errors import ConfigError, NbddpError, TrainingInterrupted
from ..kernel.forkserver import prewarm
from ..contract.gpus import list_gpus
from ..kernel.handle import RunHandle, TrainResult
from ..kernel.launch import spawn_train
from .cluster import ClusterPicker
from .devices import DevicePicker, gpu_choice
from .form import ConfigForm
from .run_view import gpu_memory_text  # noqa: F401 - a name of this module before the split
from .run_view import RunView
from .worker_form import WorkerForm, planned


class TrainingPanel:
    """A widget panel that launches a run, shows it live, and stops it.

    Either the built-in classifier, set up by a :class:`TrainConfig` (model, data, SyncBN,
    freezing, weights...), or any worker function: ``"my_worker.py:train"``,
    ``"package.module:train"`` or a function object, as :func:`nbddp.spawn_train` accepts. A
    worker gets a form of its keyword arguments, from ``kwargs`` and the defaults in its
    signature: an ``int`` gives an integer field, a ``float`` a number field, a ``bool`` a
    checkbox, a ``str`` a text field, and a ``typing.Literal[...]`` annotation (or ``choices``)
    a drop-down. The signature is read from the file with ``ast``: the kernel never runs it.
    Any other value (``None``, a list, ``torch.device("cpu")``) is shown greyed out: a given
    kwarg is passed as it is, a default is left to the function. A live chart draws every
    scalar the worker reports with ``ctx.log(...)``, against ``step``, else ``epoch``.

    Args:
        target: a :class:`TrainConfig` (default: ``TrainConfig()``), or a worker target.
        kwargs: a worker's starting keyword arguments (not with a ``TrainConfig``).
        choices: ``{"opt": ["sgd", "adamw"]}``: the values a worker's argument may take.
        nprocs: a worker's starting number of CPU processes (default 2; a ``TrainConfig``
            brings its own).
        gpus: a worker's starting GPU choice (default: every GPU).
        runs_dir: where a worker's run folders go (default: ``spawn_train``'s, ``runs``).
        name: suffix of a worker's run folders (default: file and function name).
        profile: ``spawn_train``'s ``profile=`` for every run of the panel; the end of a run shows the
            ranks' profiles side by side.
        trackers: ``spawn_train``'s ``trackers=`` (a config's own ``trackers`` is in the Advanced section).

    Attributes:
        handle: the :class:`RunHandle` of the current or last run (``None`` before the first).
        result: the last :class:`TrainResult` (``None`` before a run succeeded or was stopped).
        widget: the root ``VBox``; ``display(panel)`` or a cell ending in ``panel`` shows it.
        kwargs_inputs: a worker's editable arguments, ``{name: widget}`` (empty for a config).
        fixed_inputs: a worker's greyed-out arguments, ``{name: widget}``.
        chart_keys: the logged keys the worker chart draws (after a redraw).

    The parts' widgets are the panel's attributes too: the form's (``epochs_input``,
    ``sync_bn_toggle``..., named by the fields' declarations), the device picker's
    (``gpu_checkboxes``, ``nprocs_input``) and the run view's (``train_button``, ``progress_bar``...).

    Raises:
        ConfigError: the worker cannot be launched (no such file or function), a parameter
            without a default is missing from ``kwargs``, or ``kwargs`` names an unknown one.

    Example:
        >>> panel = TrainingPanel(TrainConfig(data_path="data/digits", model="resnet18"))
        >>> panel                      # then click Train, or, in CI and scripts:
        >>> result = panel.run()       # same widgets, blocking, returns the TrainResult
        >>> TrainingPanel("my_worker.py:train", kwargs={"steps": 500, "lr": 0.01})
    """

    def __init__(self, target: Union[TrainConfig, str, Callable[..., Any], None] = None, *,
                 kwargs: Optional[dict] = None, choices: Optional[Dict[str, Sequence]] = None,
                 nprocs: Optional[int] = None, gpus: Optional[Sequence[int]] = None,
                 runs_dir: Optional[str] = None, name: Optional[str] = None,
                 profile: Union[bool, dict, None] = None, trackers: Optional[Sequence[str]] = None):
        prewarm()  # the forkserver starts while the user fills in the panel (NBDDP_PREWARM=0: off)
        self._worker: Optional[str] = None  # the worker's spec; None for the built-in classifier
        # spawn_train's profile= and trackers= (a config's own trackers field is in the form)
        self._observe = {k: v for k, v in (("profile", profile), ("trackers", trackers)) if v is not None}
        self._gpus = list_gpus()  # NVML / nvidia-smi: the kernel never initialises CUDA
        if target is None or isinstance(target, TrainConfig):
            if any(v is not None for v in (kwargs, choices, nprocs, gpus, runs_dir, name)):
                raise ConfigError("with a TrainConfig, put every setting in the config "
                                  "(cfg.replace(nprocs=2, runs_dir=...)); kwargs/choices are for worker functions")
            self._base = target if target is not None else TrainConfig()
            start_gpus, start_nprocs = gpu_choice(self._base.gpus), self._base.nprocs if target is not None else 2
            self._form: Union[ConfigForm, WorkerForm] = ConfigForm(self._base, on_gpu=bool(self._gpus))
            plan: Tuple[Optional[int], Optional[int]] = (self._base.epochs, None)
            self.kwargs_inputs: Dict[str, W.Widget] = {}
            self.fixed_inputs: Dict[str, W.Widget] = {}
        else:
            self._form = form = WorkerForm(target, kwargs, choices)
            self._worker, self._label = form.worker, form.label
            start_gpus, start_nprocs = gpu_choice(gpus), nprocs or 2
            self._runs_dir, self._name = runs_dir, name  # None: spawn_train's default
            plan = planned(form.values())
            self.kwargs_inputs, self.fixed_inputs = form.kwargs_inputs, form.fixed_inputs
        self._devices = DevicePicker(self._gpus, start_gpus, start_nprocs)
        if self._devices.refresh_button is not None:
            self._devices.refresh_button.on_click(self._refresh_gpus)
        self._cluster = ClusterPicker()  # "this server / SLURM", where sbatch is on the PATH
        self._view = RunView(self._worker is not None, lambda: self._set_busy(False), plan)
        self._view.train_button.on_click(self._on_train)
        self._view.stop_button.on_click(lambda _b: self.stop())
        # spawn_train(detach=True): a supervisor of its own owns the run (nbddp.kernel.supervisor)
        self.keep_running_checkbox = W.Checkbox(
            value=False, description="keep running if the kernel stops", indent=False,
            tooltip="the run goes on if this kernel dies or restarts; nbddp.attach(run_dir) or "
                    "TrainingPanel.attach(run_dir) follows it again, nbddp.runs() lists it")
        title = "nbddp · DistributedDataParallel training"
        if self._worker is not None:
            title += f" · <code>{html.escape(self._label)}</code>"
        self.widget = W.VBox([W.HTML(f"<b style='font-size:1.1em'>{title}</b>"), self._devices.box,
                              self._cluster.cluster_box, self.keep_running_checkbox,
                              *self._form.parts, *self._view.parts],
                             layout=W.Layout(width="100%", max_width="1000px", padding="8px",
                                             border="1px solid var(--jp-border-color2, #ddd)"))

    def __getattr__(self, name: str) -> Any:
        # The parts' widgets and state, as attributes of the panel (see the class docstring).
        for part in ("_form", "_devices", "_cluster", "_view"):
            obj = self.__dict__.get(part)
            if obj is not None and hasattr(obj, name):
                return getattr(obj, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def handle(self) -> Optional[RunHandle]:
        """The :class:`RunHandle` of the current or last run (``None`` before the first)."""
        return self._view.handle

    @handle.setter
    def handle(self, handle: Optional[RunHandle]) -> None:
        self._view.handle = handle

    @property
    def result(self) -> Optional[TrainResult]:
        """The last :class:`TrainResult` (``None`` before a run succeeded or was stopped)."""
        return self._view.result

    @property
    def chart_keys(self) -> list:
        """The logged keys the worker chart draws (after a redraw)."""
        return self._view.chart_keys

    @classmethod
    def attach(cls, run_dir: Any) -> "TrainingPanel":
        """A panel that follows a run from its folder (``nbddp.attach``): a detached run after a kernel
        restart, another kernel's, or a view the browser lost. Its Stop ends the run; ``wait()`` gives
        its result. The form shows the run's own settings where the folder says them (its config).

        Example:
            >>> TrainingPanel.attach("runs/20260101-120000-mnist")
        """
        from pathlib import Path

        from ..contract import rundir
        from ..contract.config import read_config_file
        from ..kernel.follow import attach

        handle = attach(run_dir, echo=False)
        config = None
        if (Path(run_dir) / rundir.CONFIG).is_file():
            try:
                config = TrainConfig.from_dict(read_config_file(str(Path(run_dir) / rundir.CONFIG)))
            except Exception:  # noqa: BLE001 - the form is a view of the run: the default one will do
                config = None
        panel = None
        for target in ([config] if config is not None else []) + [handle.spec.target]:
            try:
                panel = cls(target)
                break
            except Exception:  # noqa: BLE001 - a target the form cannot read (a notebook cell's function)
                continue
        panel = panel if panel is not None else cls()
        where = f"GPUs {', '.join(map(str, handle.spec.gpus))}" if handle.spec.gpus else \
            f"{handle.world_size} CPU process{'es' if handle.world_size > 1 else ''}"
        panel._view.starting(where, handle.spec.backend, checking=False)
        panel._set_busy(True)
        panel._view.follow(handle, where)
        return panel

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)

    def _refresh_gpus(self, _button=None) -> None:
        self._devices.refresh(list_gpus())

    # ------------------------------------------------------------------ the settings
    @property
    def config(self) -> TrainConfig:
        """The :class:`TrainConfig` the widgets describe (validated).

        Raises:
            ConfigError: a value is invalid; the message names the field and the fix, or the
                panel runs a worker function (its settings are :attr:`worker_kwargs`).
        """
        if self._worker is not None:
            raise ConfigError(f"this panel runs the worker {self._label}: its settings are panel.worker_kwargs")
        changes = self._form.values()
        gpus, nprocs = self._devices.chosen()
        changes.update(gpus=gpus, **({} if gpus else {"nprocs": nprocs}))
        return self._base.replace(**changes)

    @property
    def worker_kwargs(self) -> dict:
        """The keyword arguments a worker panel passes at Train: the form's values and the given fixed ones.

        A greyed-out argument that was not given is left out: the function keeps its default.
        """
        if self._worker is None:
            raise ConfigError("this panel runs the built-in classifier: its settings are panel.config")
        return self._form.values()

    # ------------------------------------------------------------------ public actions
    @property
    def running(self) -> bool:
        """True from Train until the run's end has been shown."""
        return self._view.running

    def run(self) -> TrainResult:
        """Train with the current settings and block until the end, updating the same widgets.

        Rank 0's log is also printed in the cell. This is how CI and scripts drive the notebook.

        Returns:
            The :class:`TrainResult`.

        Raises:
            ConfigError, DataError, WeightsError: invalid settings, found before any process starts.
            WorkerError: a worker failed (the message names the rank).
            TrainingInterrupted: the cell was interrupted; every worker was stopped and reaped.
        """
        self._start(echo=True)
        return self.wait()

    def wait(self, timeout: Optional[float] = None) -> TrainResult:
        """Block until the current run has ended and been shown; return its result or raise its error.

        An Interrupt (Jupyter's stop button, Ctrl-C) while waiting stops the run, waits until
        every worker is gone, and raises :class:`TrainingInterrupted`; for a run the panel follows
        (kept running if the kernel stops, or attached) it ends the wait only.

        Raises:
            TimeoutError: ``timeout`` seconds passed first (the run goes on).
        """
        handle = self.handle
        if handle is None:
            raise NbddpError("nothing to wait for: click Train or call panel.run() first")
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not self._view._ended.wait(0.1):
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"the run is still going after {timeout} s: {handle.run_dir}")
        except KeyboardInterrupt:
            if handle.followed:  # another process owns the run (detached): the wait ends, the run goes on
                from ..kernel.interrupt import StoppedWaiting

                raise StoppedWaiting(f"stopped waiting; the run in {handle.run_dir} goes on (the Stop button "
                                     "ends it)") from None
            # The monitor thread owns the processes: ask it for the staged shutdown, wait for it.
            handle.stop(wait=False, reason="interrupt")
            self._view._ended.wait()
            if isinstance(handle.outcome, BaseException):
                raise handle.outcome from None
            raise TrainingInterrupted.for_run("interrupted", handle.world_size, handle.run_dir) from None
        if isinstance(handle.outcome, BaseException):
            raise handle.outcome
        return handle.outcome

    def stop(self) -> None:
        """Ask the run to stop: workers finish their step and save; SIGTERM only if they stop beating (staged)."""
        handle = self.handle
        if handle is None or not handle.running:
            return
        handle.stop(wait=False)  # the monitor thread runs the staged shutdown and reaps
        self._view.stopping(handle)

    # ------------------------------------------------------------------ starting
    def _on_train(self, _button=None) -> None:
        try:
            self._start(echo=False)
        except Exception:  # noqa: BLE001 - already shown in the status area; never escape a callback
            pass

    def _start(self, echo: bool) -> RunHandle:
        if self.running:
            self._view._status("warn", "A run is in progress: stop it first.")
            raise NbddpError("a run is in progress: stop it first")
        try:
            target, launch, gpus, nprocs = self._launch_args()
        except ConfigError as exc:
            self._view._show_error(exc, "Invalid setting")
            raise
        where = f"GPU{'s' if len(gpus) > 1 else ''} {', '.join(map(str, gpus))}" if gpus \
            else f"{nprocs} CPU process{'es' if nprocs > 1 else ''}"
        if launch.get("cluster") is not None:
            where = launch["cluster"].describe()
        self._view.starting(where, "nccl" if gpus else "gloo", checking=self._worker is None)
        self._set_busy(True)
        try:
            handle = spawn_train(target, block=False, echo=echo, **launch)  # here, on the main thread: see module doc
        except BaseException as exc:
            self._set_busy(False)
            self._view.not_started(exc)
            raise
        self._view.follow(handle, where)
        return handle

    def _launch_args(self) -> Tuple[Any, dict, Tuple[int, ...], Optional[int]]:
        """``(target, spawn_train keywords, gpus, nprocs)`` from the widgets; sets the run's plan."""
        if self._worker is None:
            cfg = self.config
            self._view.plan = (cfg.epochs, None)
            cluster = self._cluster.cluster(len(cfg.gpus))
            if cluster is not None:  # a node's GPUs (or CPU processes) are SLURM's to give
                cfg = cfg.replace(gpus=(), nprocs=len(cfg.gpus) or cfg.nprocs)
                return cfg, dict(self._observe, cluster=cluster), (), cfg.nprocs
            return cfg, dict(self._observe, **self._detach()), tuple(cfg.gpus), cfg.nprocs
        kwargs = self.worker_kwargs
        gpus, nprocs = self._devices.chosen()
        self._view.plan = planned(kwargs)
        launch = dict(kwargs=kwargs, runs_dir=self._runs_dir, name=self._name, **self._observe)
        cluster = self._cluster.cluster(len(gpus))
        if cluster is not None:
            launch.update(cluster=cluster, nprocs=len(gpus) or nprocs)
            return self._worker, launch, (), launch["nprocs"]
        launch.update(gpus=list(gpus)) if gpus else launch.update(nprocs=nprocs)
        launch.update(self._detach())
        return self._worker, launch, gpus, nprocs

    def _detach(self) -> dict:
        return {"detach": True} if self.keep_running_checkbox.value else {}

    def _set_busy(self, busy: bool) -> None:
        """Lock (or unlock) the devices and the form while a run goes on; Train and Stop follow."""
        self.keep_running_checkbox.disabled = busy
        self._devices.set_busy(busy)
        self._cluster.set_busy(busy)
        self._form.set_busy(busy)
        self._view.set_busy(busy)


__all__ = ["TrainingPanel"]
