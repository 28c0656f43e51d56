"""How a rank calls the user's code: as it was written, for the launcher it was written for.

==============  ===================================  ==============================================
``call=``       the rank calls                       process group
==============  ===================================  ==============================================
``"ctx"``       ``fn(ctx, *args, **kwargs)``         made by nbddp before the call (the default)
``"mp.spawn"``  ``fn(rank, *args, **kwargs)``        made by the function (its own ``setup()``)
``"torchrun"``  ``fn(*args, **kwargs)``              made by the function, ``init_method="env://"``
script          ``python train.py *argv``            made by the script, ``init_method="env://"``
``"spawns"``    ``python multigpu.py *argv``, once   made by the processes it spawns (:mod:`.spawned`)
==============  ===================================  ==============================================

A script (``"train.py"``, or ``"-m pkg.train"``) runs as ``__main__`` with ``sys.argv`` as torchrun
gives it and the kernel's working directory. Every rank gets torchrun's environment
(:func:`torchrun_environment`); under ``"torchrun"`` and scripts, ``init_process_group("env://")``
meets the kernel's TCP store on loopback, as torchrun's ranks meet its agent's store.

Worker side.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Sequence

from ..contract import targets
from ..contract.conventions import CALLS, CTX, MODULE_PREFIX, MP_SPAWN, SPAWNS, TORCHRUN, is_script, makes_own_group  # noqa: F401
from ..contract.errors import ConfigError



def torchrun_environment(rank: int, world_size: int, master_addr: str, master_port: int, run_id: str,
                         agent_store: bool, restart: int = 0, max_restarts: int = 0) -> Dict[str, str]:
    """The variables torchrun gives each worker on one machine (``torch.distributed.elastic``).

    Args:
        restart, max_restarts: which restart of the run this is, and how many it may make.
        agent_store: ``env://`` connects to a store that is already up (the kernel's), as
            torchrun's workers connect to its agent's; False lets rank 0 host one (mp.spawn).
    """
    env = {
        "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(world_size), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
        "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world_size), "ROLE_NAME": "default",
        "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RUN_ID": run_id, "TORCHELASTIC_RESTART_COUNT": str(restart), "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
    }
    if agent_store:
        env["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    return env


def run_script(spec: str, argv: Sequence[str]) -> None:
    """Run a script or module as ``__main__``, as ``python train.py *argv`` / ``python -m pkg.train`` would.

    Raises whatever the script raises; ``SystemExit`` included (the caller reads its code).
    """
    if spec.startswith(MODULE_PREFIX):
        module = spec[len(MODULE_PREFIX):]
        sys.argv = [module, *argv]  # run_module sets argv[0] to the module's file, as python -m does
        if "" not in sys.path and os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())  # python -m puts the working directory first
        targets.from_source_in_user_folders()  # the module and what it imports, as on disk now
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        return
    sys.argv = [spec, *argv]
    folder = str(Path(spec).resolve().parent)
    if sys.path[:1] != [folder]:
        sys.path.insert(0, folder)  # python train.py puts the script's folder first
    targets.from_source_in_user_folders(folder)  # the modules it imports, as on disk now
    runpy.run_path(spec, run_name="__main__")


def _short_repr(value: Any, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


@contextlib.contextmanager
def refuse_nested_spawn() -> Iterator[None]:
    """While the user's code runs in a rank, ``torch.multiprocessing.spawn``/``start_processes`` raise.

    nbddp's ranks are the processes: code that spawns its own (``if args.multiprocessing_distributed:
    mp.spawn(main_worker, ...)``) would start a set per rank and fight over its port. The error
    names the function it spawns and the launch that runs it as intended. A script whose every
    run makes such a call runs in one launcher instead, its spawns watched
    (:func:`nbddp.contract.conventions.script_spawns`, :mod:`nbddp.rank.spawned`)."""
    import torch.multiprocessing as tmp

    def refusal(spawner: str) -> Callable[..., None]:
        def refuse(fn: Any, args: tuple = (), nprocs: int = 1, *rest: Any, **kwargs: Any) -> None:
            code = getattr(fn, "__code__", None)
            name = getattr(fn, "__name__", "fn")
            where = os.path.relpath(code.co_filename) if code is not None else "<file>.py"
            where = code.co_filename if code is not None and where.startswith("..") else where
            shown = ", ".join(_short_repr(a) for a in (args or ()))
            raise ConfigError(
                f"the code called torch.multiprocessing.{spawner} on `{name}` inside an nbddp rank, but nbddp's "
                f"ranks are already the processes: each rank would start {nprocs} more. Launch the function it "
                f"spawns instead: spawn_train({where + ':' + name!r}{', ' + shown if shown else ''}, nprocs={nprocs}, "
                "call='mp.spawn') (or drop the spawn when it runs under nbddp)")
        return refuse

    saved = tmp.spawn, tmp.start_processes
    tmp.spawn, tmp.start_processes = refusal("spawn"), refusal("start_processes")
    try:
        yield
    finally:
        tmp.spawn, tmp.start_processes = saved


def call_function(fn: Callable[..., Any], call: str, ctx: Any, args: tuple, kwargs: dict) -> Any:
    """Call a worker function by its convention (see the table above)."""
    if call == MP_SPAWN:
        return fn(ctx.local_rank, *args, **kwargs)
    if call == TORCHRUN:
        return fn(*args, **kwargs)
    return fn(ctx, *args, **kwargs)


def exit_code(exc: SystemExit) -> int:
    """The status ``sys.exit(code)`` gives the shell: 0 for None, 1 for a message."""
    code = exc.code
    if code is None:
        return 0
    return code if isinstance(code, int) else 1


__all__ = ["CTX", "MP_SPAWN", "SPAWNS", "TORCHRUN", "CALLS", "MODULE_PREFIX", "torchrun_environment", "is_script",
           "run_script", "call_function", "exit_code", "makes_own_group"]
