"""Which training step produced each value the host reads back: the GPU's host synchronisations, found on the CPU.

On a GPU the host queues a step's work and runs ahead; reading a tensor on the host (``.item()``,
``.tolist()``, ``bool()``, ``float()``, ``.cpu()``, ``.numpy()``) waits until the device has computed
it, and a step that reads its *own* values leaves the device idle while the host queues the next
step. On the CPU nothing waits, so :class:`ReadWatch` checks the rule by provenance instead:

- every output of a training forward (the outermost module called in training mode) is stamped
  with that forward's number, the step;
- a torch function (``TorchFunctionMode``) gives its results, and any tensor it writes in place
  (``copy_``, ``x[i] = ...``, ``add_``...), the latest stamp among its inputs;
- each host read is recorded with the stamp of the tensor read (``None``: a value the host made,
  not the step) and the step running at the time, and where in the code it happened.

Used by tests/test_readback.py and bench/host_reads.py. Gradients and parameters are not stamped
(autograd writes them outside torch functions): only what flows from the forward's outputs is.
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

import torch
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakTensorKeyDictionary

#: Tensor methods that hand a tensor's values to the host (on a GPU each one waits for the device).
READS = frozenset({"item", "tolist", "__bool__", "__float__", "__int__", "__index__", "__complex__", "cpu", "numpy",
                   "__array__", "__format__"})
_HERE = str(Path(__file__).resolve())
_TORCH = str(Path(torch.__file__).resolve().parent)


@dataclass(frozen=True)
class Read:
    """One host read: the method, the step that produced the value (``None``: the host's own), the step then running."""

    method: str
    produced: Optional[int]
    step: int
    where: str  # file:line of the first caller outside torch

    @property
    def own_step(self) -> bool:
        return self.produced is not None and self.produced >= self.step


def _caller() -> str:
    f = sys._getframe(2)
    while f is not None and (f.f_code.co_filename.startswith(_TORCH) or f.f_code.co_filename == _HERE):
        f = f.f_back
    return "?" if f is None else f"{Path(f.f_code.co_filename).name}:{f.f_lineno}"


def _is_cpu_target(args, kwargs) -> bool:
    targets = list(args[1:]) + [kwargs.get("device")]
    return any(str(t) == "cpu" for t in targets if isinstance(t, (str, torch.device)))


class ReadWatch(TorchFunctionMode):
    """Records every host read while active; ``step`` is the number of training forwards so far, minus one.

    Example:
        with ReadWatch() as watch:
            train_one_epoch(model, opt, data, torch.device("cpu"), 0)
        assert not [r for r in watch.reads if r.own_step]
    """

    def __init__(self):
        super().__init__()
        self.stamps = WeakTensorKeyDictionary()
        self.reads: List[Read] = []
        self.step = -1
        self._depth = 0
        self._hooks = []

    def __enter__(self):
        self._hooks = [register_module_forward_pre_hook(self._pre), register_module_forward_hook(self._post)]
        return super().__enter__()

    def __exit__(self, *exc):
        for h in self._hooks:
            h.remove()
        return super().__exit__(*exc)

    def _pre(self, module, args):
        if self._depth == 0 and module.training:
            self.step += 1
        self._depth += 1

    def _post(self, module, args, output):
        self._depth -= 1
        if self._depth == 0 and module.training:
            for t in tree_leaves(output):
                if isinstance(t, torch.Tensor):
                    self.stamps[t] = self.step

    def _stamp_of(self, tree) -> Optional[int]:
        found = [self.stamps.get(t) for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]
        found = [s for s in found if s is not None]
        return max(found) if found else None

    def _mark(self, t, stamp: int) -> None:
        for x in (t, getattr(t, "_base", None)):  # a write into a view writes its base
            if isinstance(x, torch.Tensor):
                self.stamps[x] = max(stamp, self.stamps.get(x, stamp))

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        stamp = self._stamp_of((args, kwargs))
        # ``.to("cpu")`` of a value the step made is a read; of the host's own batch it is the copy to the device.
        if name in READS or (name == "to" and stamp is not None and _is_cpu_target(args, kwargs)):
            self.reads.append(Read(name, stamp, self.step, _caller()))
        out = func(*args, **kwargs)
        if stamp is not None:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self._mark(t, stamp)
            if args and isinstance(args[0], torch.Tensor) and (name.endswith("_") or name == "__setitem__"):
                self._mark(args[0], stamp)
            if isinstance(kwargs.get("out"), torch.Tensor):
                self._mark(kwargs["out"], stamp)
        return out

    def counts(self, of_step_values: bool = False) -> Counter:
        """Reads by method; only reads of values a step produced with ``of_step_values``."""
        return Counter(r.method for r in self.reads if not of_step_values or r.produced is not None)
