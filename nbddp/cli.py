"""``python -m nbddp``: the same runs as the notebook, from a shell.

    python -m nbddp train --data-path data/digits --model resnet34 --image-size 32 --epochs 5
    python -m nbddp train --config runs/<run>/config.json --epochs 20
    python -m nbddp run --nprocs 2 examples/linear_regression.py:train
    python -m nbddp run --nprocs 2 train.py 10 5 --batch_size 32    (a torchrun script, unchanged)
    python -m nbddp gpus
    python -m nbddp runs                  (your live runs on this server)
    python -m nbddp attach RUN_DIR        (follow one: its output, then its value)
    python -m nbddp stop RUN_DIR
    python -m nbddp export runs/<run> --onnx      (model.onnx and preprocessing.json beside the weights)

Every ``TrainConfig`` field is a flag (``--batch-size``, ``--sync-bn``/``--no-sync-bn``...);
flags override the fields of ``--config``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import typing
from typing import Any, List, Optional, Union

from .contract.config import STRATEGIES, STRATEGY_ENV, TrainConfig, read_config_file
from .contract.errors import ConfigError
from .contract.fieldspec import flag_name, specs
from .contract.gpus import IDLE


def _field_parser(value_type):
    origin = typing.get_origin(value_type)
    args = [a for a in typing.get_args(value_type) if a is not type(None)]
    if origin is typing.Union and len(args) == 1:
        return _field_parser(args[0])
    return value_type


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    """One flag per ``TrainConfig`` field, from its declaration (:mod:`nbddp.contract.fieldspec`).

    A bool gives ``--x``/``--no-x``, a choice its values, an int/float/str its type; a field of
    several types (``gpus``, ``resume``) takes words that :func:`build_config` reads.
    """
    hints = typing.get_type_hints(TrainConfig)
    for f, spec in specs(TrainConfig):
        t = _field_parser(hints[f.name])
        kw: dict = dict(default=None, help=spec.help.replace("%", "%%") or None)
        if t is bool:
            kw.update(action=argparse.BooleanOptionalAction)
        elif spec.check is not None and spec.check.kind == "choice":
            kw.update(choices=spec.check.values)
        elif t in (int, float, str):
            kw.update(type=t, metavar=spec.metavar or t.__name__.upper())
        else:
            kw.update(metavar=spec.metavar)
        p.add_argument(flag_name(f.name), **kw)


def build_config(ns: argparse.Namespace) -> TrainConfig:
    """The config file (if any) with every given flag applied on top."""
    from .contract.gpus import list_gpus

    # The file's fields are read raw and validated once the flags are on top, so a flag can
    # correct a field the file got wrong.
    base = read_config_file(ns.config) if ns.config else {}
    for f in dataclasses.fields(TrainConfig):
        v = getattr(ns, f.name, None)
        if v is not None:
            base[f.name] = v
    gpus = base.get("gpus")
    if isinstance(gpus, str):
        # "idle" stays a word here: it is resolved at the launch (never under torchrun/srun, which ignore gpus).
        base["gpus"] = [g.index for g in list_gpus()] if gpus == "all" else _gpus_word(gpus)
    elif "gpus" not in base or ns.config is None and ns.gpus is None:
        base["gpus"] = [g.index for g in list_gpus()]
    if isinstance(base.get("resume"), str) and base["resume"].lower() in ("true", "false"):
        base["resume"] = base["resume"].lower() == "true"
    if base.get("num_classes") in ("None", ""):
        base["num_classes"] = None
    try:
        return TrainConfig.from_dict(base)
    except ConfigError as exc:
        if ns.config:
            raise ConfigError(f"{exc} (config: {ns.config} with the flags given on top)") from None
        raise


def _gpus_word(text: str) -> Union[str, List[int]]:
    """``--gpus``: ``"idle"`` as it is, else the ids (:func:`parse_gpus`)."""
    return IDLE if text.strip().lower() == IDLE else parse_gpus(text)


def parse_gpus(text: str) -> List[int]:
    """``"0,2"`` -> ``[0, 2]``; ``""`` -> ``[]``.

    Raises:
        ConfigError: naming the word that is not a GPU id.
    """
    words = [w.strip() for w in text.split(",") if w.strip()]
    bad = [w for w in words if not w.isdigit()]
    if bad:
        raise ConfigError(f"--gpus {text!r}: {', '.join(map(repr, bad))} is not a GPU id; give ids as "
                          "`nvidia-smi` lists them, separated by commas (--gpus 0,1), 'all', or 'idle' (the GPUs "
                          "idle at launch)")
    return [int(w) for w in words]


#: ``run`` options that take a value (what follows them is not the target).
_RUN_VALUE_OPTIONS = ("--nprocs", "--gpus", "--kwargs", "--run-dir", "--call")


def _split_script_command(argv: List[str]) -> Optional[List[str]]:
    """Cut a script's own command line off ``run``'s arguments (in place), as python does:
    everything after ``train.py`` or ``-m MODULE`` is the script's. None for other commands and
    for function targets, whose options may come before or after them."""
    from .contract.conventions import is_script

    if not argv or argv[0] != "run":
        return None
    i = 1
    while i < len(argv):
        word = argv[i]
        if word in _RUN_VALUE_OPTIONS:
            i += 2
        elif word.startswith("-") and word != "-m":
            i += 1
        else:
            cut = i + 2 if word == "-m" else i + 1
            if word == "-m" or is_script(word):
                rest = argv[cut:]
                del argv[cut:]
                return rest
            return None
    return None


def _run_target(ns: argparse.Namespace) -> tuple:
    """``(target, args, spawn_train keywords)`` of ``python -m nbddp run``."""
    from .rank import calls

    if ns.module:
        return "-m", (ns.module,), dict(argv=list(ns.argv or ()), call="ctx", kwargs={})
    if not ns.target:
        raise ConfigError("python -m nbddp run: give a target (file.py:function, or a script train.py) or -m MODULE")
    if calls.is_script(ns.target):
        return ns.target, (), dict(argv=list(ns.argv or ()), call="ctx", kwargs={})
    return ns.target, (), dict(argv=None, call=ns.call, kwargs=parse_kwargs(ns.kwargs))


def _profile_flag(text: Optional[str]) -> Any:
    """``--profile`` alone (``True``), or its JSON object of settings; ``None`` without the flag."""
    if text is None:
        return None
    if text.strip().lower() == "true":
        return True
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"--profile {text!r} is not valid JSON ({exc}); pass it alone, or an object such as "
                          """'{"wait": 5, "active": 3}'""") from None
    return value


def parse_kwargs(text: str) -> dict:
    """The ``--kwargs`` JSON object.

    Raises:
        ConfigError: the text is not JSON, or not a JSON object, with where it fails.
    """
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ConfigError(f"--kwargs {text!r} is not valid JSON ({exc}); pass an object in single quotes, "
                          """e.g. --kwargs '{"steps": 100, "lr": 0.1}'""") from None
    if not isinstance(value, dict):
        raise ConfigError(f"--kwargs {text!r} is a JSON {type(value).__name__}; pass an object of keyword "
                          """arguments, e.g. --kwargs '{"steps": 100}'""")
    return value


def _parser() -> argparse.ArgumentParser:
    """The command line: ``train``, ``run`` and ``gpus``."""
    parser = argparse.ArgumentParser(prog="python -m nbddp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train the built-in image classifier")
    t.add_argument("--config", help="a run's config.json (or its run folder) to start from")
    t.add_argument("--run-dir", default=None,
                   help="run folder (under torchrun/srun: shared by all ranks; a restart resumes from it)")
    _add_config_flags(t)
    r = sub.add_parser("run", help="run a worker function (file.py:function) or a torchrun script unchanged",
                       description="Options come first; a script's own arguments follow it: "
                       "python -m nbddp run --nprocs 2 train.py 10 5 --batch_size 32, or "
                       "python -m nbddp run --nprocs 2 -m pkg.train --steps 3.")
    r.add_argument("-m", dest="module", default=None, metavar="MODULE", help="run a module as python -m does")
    r.add_argument("target", nargs="?", default=None,
                   help="file.py:function, package.module:function, or a script train.py; what follows a "
                   "script (or -m MODULE) is its own command line")
    r.add_argument("--call", default="ctx", choices=("ctx", "mp.spawn", "torchrun"),
                   help="how a function is called: fn(ctx, **kwargs) (default), fn(rank, **kwargs), fn(**kwargs)")
    r.add_argument("--nprocs", type=int, default=None)
    r.add_argument("--gpus", default=None, help="GPU ids, e.g. 0,1, or 'idle' (the GPUs idle at launch)")
    r.add_argument("--kwargs", default="{}", help="JSON object of keyword arguments")
    r.add_argument("--run-dir", default=None, help="run folder (default: runs/<time>-<name>)")
    r.add_argument("--strategy", default=None, choices=STRATEGIES,
                   help="ddp (default: every process holds the whole model) or fsdp (ctx.prepare shards it)")
    r.add_argument("--max-restarts", type=int, default=0,
                   help="restarts after a failure a restart heals (a rank killed, a hang; see nbddp.kernel.restarts)")
    r.add_argument("--trackers", default=None, metavar="NAMES",
                   help="also send the run's metrics, settings and weights to mlflow, wandb or mlflow,wandb")
    for p in (t, r):
        p.add_argument("--profile", nargs="?", const="true", default=None, metavar="JSON",
                       help="profile every rank (torch.profiler): alone, or a JSON object of settings, e.g. "
                       """'{"wait": 5, "active": 3}'; prints the ranks side by side at the end""")
    sub.add_parser("gpus", help="list the GPUs (without initialising CUDA)")
    sub.add_parser("runs", help="your live runs on this server (detached, or another kernel's)")
    for name, what in (("attach", "follow a run: its last lines, its live output, then its value (Ctrl-C stops "
                                  "following, not the run)"),
                       ("stop", "stop a run (as its Stop button: it may save and return) and wait for its end")):
        sub.add_parser(name, help=what).add_argument("run_dir", metavar="RUN_DIR", help="the run's folder")
    e = sub.add_parser("export", help="a run's weights for inference (and with --onnx, a checked ONNX file)",
                       description="Writes the weights of a run (model.pth, model.safetensors, class_indices.json) "
                       "into its export/ folder, or --out, where they are not there yet; with --onnx also "
                       "model.onnx and preprocessing.json, checked with ONNX Runtime on the run's held-out images.")
    e.add_argument("run_dir", metavar="RUN_DIR", help="the run folder (runs/<time>-<name>)")
    e.add_argument("--onnx", action="store_true", help="also write model.onnx and preprocessing.json (the onnx extra)")
    e.add_argument("--out", default=None, metavar="DIR", help="export folder (default: RUN_DIR/export)")
    e.add_argument("--which", default=None, choices=("best", "last"),
                   help="the checkpoint to export (default: the run's export as it is, else best)")
    e.add_argument("--opset", type=int, default=None, help="ONNX opset (default: the exporter's)")
    e.add_argument("--fixed-batch", action="store_true", help="an ONNX graph of one image at a time (default: any batch)")
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    script_argv = _split_script_command(argv)
    ns = _parser().parse_args(argv)
    ns.argv = script_argv

    from .contract.errors import NbddpError

    # Only train and run can be a rank of torchrun or srun; the other commands never import torch.
    launcher = None
    if ns.command in ("train", "run"):
        from .rank.elastic import detect

        launcher = detect()
    try:
        if launcher is not None:  # train or run, as a rank of torchrun or srun
            if getattr(ns, "strategy", None) and ns.command == "run":  # ctx.strategy of a rank of torchrun/srun
                os.environ[STRATEGY_ENV] = ns.strategy
            return _under_launcher(ns, launcher)  # a rank: the worker side only
        return {"gpus": _list_gpus, "run": _run, "train": _train, "runs": _runs, "attach": _attach,
                "stop": _stop, "export": _export}[ns.command](ns)
    except NbddpError as exc:
        print(f"nbddp: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


def _list_gpus(ns: argparse.Namespace) -> int:
    """``python -m nbddp gpus``."""
    from .contract.gpus import gpu_setup_problem, list_gpus

    gpus = list_gpus()
    print("\n".join(g.label() for g in gpus) or gpu_setup_problem()
          or "no GPU found: training runs on CPU processes")
    return 0


def _runs(ns: argparse.Namespace) -> int:
    """``python -m nbddp runs``."""
    from .kernel.follow import runs

    listed = runs()
    print(listed.table() if listed else "no live runs of yours on this server")
    return 0


def _attach(ns: argparse.Namespace) -> int:
    """``python -m nbddp attach RUN_DIR``: follow the run to its end; Ctrl-C stops following only."""
    from .kernel.follow import attach

    handle = attach(ns.run_dir)
    try:
        result = handle.wait()
    except KeyboardInterrupt:
        print(f"\nstopped following; the run goes on (python -m nbddp stop {ns.run_dir} ends it)", file=sys.stderr)
        return 130
    print(f"result: {result.value!r}" + (" (stopped)" if result.stopped else "") + f"\nrun folder: {result.run_dir}")
    return 0


def _stop(ns: argparse.Namespace) -> int:
    """``python -m nbddp stop RUN_DIR``."""
    from .kernel.follow import attach

    handle = attach(ns.run_dir, echo=False)
    handle.stop(wait=True)
    outcome = handle.outcome
    if isinstance(outcome, BaseException):
        print(f"the run ended: {type(outcome).__name__}: {outcome}")
        return 1
    print(f"stopped; result: {outcome.value!r}\nrun folder: {outcome.run_dir}")
    return 0


def _export(ns: argparse.Namespace) -> int:
    """``python -m nbddp export RUN_DIR [--onnx]``: in the shell what the notebook's export does."""
    from pathlib import Path

    from .contract import rundir
    from .kernel.export import export_onnx, export_run

    run_dir = Path(ns.run_dir)
    out = Path(ns.out) if ns.out else rundir.export_dir(run_dir)
    weights = out / rundir.EXPORT_SAFETENSORS
    if ns.which or not weights.is_file():  # the run's own export stays as the worker wrote it
        weights = export_run(run_dir, out, which=ns.which or "best")["safetensors"]
    print(f"weights: {weights}")
    if ns.onnx:
        from .tasks.classification.onnx_export import summary

        onnx_file = export_onnx(out, opset=ns.opset, dynamic_batch=not ns.fixed_batch)
        record = json.loads((onnx_file.parent / rundir.EXPORT_PREPROCESSING).read_text())
        print(f"onnx: {onnx_file}\npreprocessing: {onnx_file.parent / rundir.EXPORT_PREPROCESSING}\n{summary(record)}")
    return 0


def _run(ns: argparse.Namespace) -> int:
    """``python -m nbddp run``: a worker function or a script, from the kernel side."""
    from .kernel.launch import spawn_train

    gpus = _gpus_word(ns.gpus) if ns.gpus else None  # "idle" is resolved by spawn_train, in the kernel
    target, args, how = _run_target(ns)
    trackers = [w for w in (ns.trackers or "").replace(" ", ",").split(",") if w] or None
    result = spawn_train(target, *args, nprocs=ns.nprocs, gpus=gpus, max_restarts=ns.max_restarts,
                         trackers=trackers, profile=_profile_flag(ns.profile), strategy=ns.strategy, **how)
    print(f"result: {result.value!r}\nrun folder: {result.run_dir}")
    if result.profile is not None:
        print(result.profile)
    return 0


def _train(ns: argparse.Namespace) -> int:
    """``python -m nbddp train``: the built-in worker, from the kernel side."""
    from .contract.errors import NbddpError
    from .contract.gpus import resolve_gpus
    from .kernel.launch import spawn_train

    cfg = build_config(ns)
    if ns.run_dir:
        raise NbddpError("--run-dir is for torchrun/srun launches; spawn_train names its own run folder")
    if cfg.gpus == IDLE:
        cfg = cfg.replace(gpus=tuple(resolve_gpus(IDLE)))  # the GPUs idle now, named in the line below
    where = f"GPUs {list(cfg.gpus)}" if cfg.gpus else f"{cfg.nprocs} CPU process(es)"
    print(f"training {cfg.model} on {cfg.data_path} with {where}", flush=True)
    result = spawn_train(cfg, profile=_profile_flag(ns.profile))
    if result.profile is not None:
        print(result.profile)
    v = result.value
    print(f"\nbest val_accuracy {v['best_accuracy']:.4f} at epoch {v['best_epoch'] + 1}; "
          f"exported weights: {result.weights_path}\nrun folder: {result.run_dir}")
    return 0


def _under_launcher(ns: argparse.Namespace, le) -> int:
    """One rank of a torchrun/srun job: the same plan, worker and run folder layout as spawn_train."""
    from pathlib import Path

    from .rank import elastic
    from .contract import plans

    run_dir = Path(ns.run_dir) if ns.run_dir else None
    if ns.command == "run":
        target, args, how = _run_target(ns)
        elastic.refuse_script_under_launcher(le, how["call"], how["argv"])
        plan = plans.plan(target, args, kwargs=how["kwargs"], place=False)
    else:
        cfg, run_dir = elastic.continue_or_start(build_config(ns), le, run_dir)
        plan = plans.plan(cfg, place=False)  # every rank checks the same inputs, so all fail together
    elastic.run_job_rank(le, plan, run_dir)  # never returns: the rank leaves as spawned ranks do
    return 1
