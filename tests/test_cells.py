"""Functions from cells travel by value; what may not cross is refused in the kernel, by name.

The GPU cases run on the CPU: ``FakeTensorMode`` makes tensors and modules that say ``cuda:0``
without a GPU, which is all the check reads.
"""

from __future__ import annotations

import itertools
import linecache
import socket
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from nbddp.contract.cells import is_cell_function, load, ship
from nbddp.contract.errors import ConfigError

_cells = itertools.count()


def in_main(source: str, name: str, **globals_):
    """Define ``name`` as a cell would: in a namespace whose ``__name__`` is ``__main__``, its
    source registered with linecache under a cell's file name, as IPython does."""
    source = textwrap.dedent(source)
    filename = f"<ipython-input-{next(_cells)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    ns = {"__name__": "__main__", **globals_}
    exec(compile(source, filename, "exec"), ns)
    return ns[name]


def test_a_cell_function_with_its_classes_and_helpers_runs_in_a_fresh_interpreter(tmp_path):
    script = tmp_path / "cells.py"
    script.write_text(textwrap.dedent("""
        import sys, torch
        import torch.nn as nn
        from torch.utils.data import DataLoader, Dataset
        from nbddp.contract.cells import ship

        SCALE = 3

        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(4, 2)

            def forward(self, x):
                return self.fc(x)

        class Squares(Dataset):
            def __len__(self):
                return 8

            def __getitem__(self, i):
                return torch.full((4,), float(i)), i % 2

        def scaled(x):
            return x * SCALE

        def train(ctx, lr=0.5):
            torch.manual_seed(0)
            out = sum(Net()(x).shape[0] for x, _ in DataLoader(Squares(), batch_size=4))
            return scaled(lr), out

        shipped = ship(train)
        sys.stdout.buffer.write(shipped.payload)
    """))
    payload = subprocess.run([sys.executable, str(script)], capture_output=True, check=True, timeout=120).stdout
    # A fresh interpreter that never saw the script's __main__ loads and runs it.
    code = "import sys; from nbddp.contract.cells import load; print(load(sys.stdin.buffer.read())(None))"
    out = subprocess.run([sys.executable, "-c", code], input=payload, capture_output=True, check=True, timeout=120)
    assert out.stdout.decode().strip() == "(1.5, 8)"


def test_the_source_kept_for_the_run_folder_defines_the_function_again(tmp_path):
    fn = in_main("""
        import math
        from collections import OrderedDict as OD
        STEPS = 4

        class Box:
            size = 2

            def area(self):
                return self.size ** 2

        def helper(x):
            return math.floor(x) * STEPS

        def train(ctx, lr=0.5):
            return helper(10 * lr) + Box.size + len(OD())
    """, "train")
    source = ship(fn).source
    assert "import math" in source and "from collections import OrderedDict as OD" in source
    assert "STEPS = 4" in source and "class Box" in source and source.rstrip().endswith("+ len(OD())")
    assert source.index("class Box") < source.index("def helper") < source.index("def train")
    ns = {"__name__": "worker_source"}
    exec(compile(source, "worker_source.py", "exec"), ns)  # the file runs as written
    assert ns["train"](None) == fn(None) == 22


def test_is_cell_function():
    assert is_cell_function(in_main("def f(ctx): pass", "f"))
    assert is_cell_function(lambda ctx: None)
    assert not is_cell_function(textwrap.dedent) and not is_cell_function("a.py:f") and not is_cell_function(len)


@pytest.mark.parametrize("kind", ["tensor", "module", "in a list"])
def test_a_gpu_tensor_or_module_is_refused_by_name(kind):
    with FakeTensorMode(allow_non_fake_inputs=True):
        value = {"tensor": lambda: torch.ones(3, device="cuda"),
                 "module": lambda: torch.nn.Linear(2, 2, device="cuda"),
                 "in a list": lambda: [1, torch.ones(1, device="cuda")]}[kind]()
    fn = in_main("def train(ctx):\n    return weights\n", "train", weights=value)
    with pytest.raises(ConfigError, match=r"`weights` \(a global that train uses\) is .*on cuda:0.*inside the function"):
        ship(fn)


def test_a_gpu_tensor_in_a_closure_is_refused_by_name():
    with FakeTensorMode(allow_non_fake_inputs=True):
        t = torch.zeros(2, device="cuda")

    def make():
        def train(ctx):
            return t.sum()
        return train

    with pytest.raises(ConfigError, match=r"`t` \(captured by .*train\) is a tensor on cuda:0"):
        ship(make())


def test_open_files_sockets_and_locks_are_refused_by_name(tmp_path):
    with open(tmp_path / "log.txt", "w") as fh, socket.socket() as sock:
        cases = [("fh", fh, "an open file"), ("sock", sock, "an open socket"),
                 ("lock", threading.Lock(), "synchronises the kernel's threads only")]
        for var, value, words in cases:
            fn = in_main(f"def train(ctx):\n    return {var}\n", "train", **{var: value})
            with pytest.raises(ConfigError, match=rf"`{var}` \(a global that train uses\) is .*{words}"):
                ship(fn)


def test_a_helper_s_captured_gpu_tensor_is_found_through_the_helper():
    with FakeTensorMode(allow_non_fake_inputs=True):
        table = torch.zeros(2, device="cuda")
    fn = in_main("""
        def lookup(i):
            return TABLE[i]

        def train(ctx):
            return lookup(0)
    """, "train", TABLE=table)
    with pytest.raises(ConfigError, match=r"`TABLE` \(a global that lookup uses\) is a tensor on cuda:0"):
        ship(fn)


def test_captured_data_over_the_limit_is_refused_with_its_size_and_the_biggest_variable():
    fn = in_main("def train(ctx):\n    return len(data) + len(small)\n", "train",
                 data=torch.zeros(300_000), small=[1, 2, 3])
    with pytest.raises(ConfigError, match=r"captures 1\.1 MiB of data, over the 1 MiB limit \(largest: `data`"):
        ship(fn, max_bytes=2**20)
    assert load(ship(fn).payload)(None) == 300_003  # under the default limit it goes


def test_a_huge_capture_is_refused_by_its_size_before_anything_is_pickled(monkeypatch):
    import numpy as np

    frames = np.zeros(2**30, dtype=np.uint8)  # 1 GiB that is never touched: calloc'd pages cost nothing
    fn = in_main("def train(ctx):\n    return len(frames) + len(cfg)\n", "train",
                 frames=frames, cfg={"name": "x", "init": torch.empty(2**24)})

    def pickled(*args, **kwargs):
        raise AssertionError("pickled: seconds and gigabytes of the kernel's memory")

    monkeypatch.setattr("cloudpickle.dumps", pickled)
    with pytest.raises(ConfigError, match=r"captures 1088\.\d MiB of data, over the 64 MiB limit \(largest: `frames` "
                                          r"\(a global that train uses\) \(1024\.0 MiB\), `cfg` \(a global that "
                                          r"train uses\) \(64\.0 MiB\)\)"):
        ship(fn)


def test_in_a_real_kernel_cell_functions_train_block_or_not_and_keep_their_source(kernel, tmp_path):
    from conftest import ROOT, execute

    km, kc = kernel
    cells = [
        f"import sys; sys.path.insert(0, {str(ROOT)!r})\nimport torch\nimport torch.nn as nn\n"
        "from torch.utils.data import DataLoader, Dataset\nfrom nbddp import spawn_train",
        "class Net(nn.Module):\n    def __init__(self):\n        super().__init__()\n        self.fc = nn.Linear(2, 1)\n\n"
        "    def forward(self, x):\n        return self.fc(x)",
        "class Pairs(Dataset):\n    def __len__(self):\n        return 16\n\n"
        "    def __getitem__(self, i):\n        return torch.tensor([float(i), 1.0]), torch.tensor([2.0 * i])",
        "def fit(model, loader, lr):\n    opt = torch.optim.SGD(model.parameters(), lr=lr)\n"
        "    for x, y in loader:\n        opt.zero_grad()\n        nn.functional.mse_loss(model(x), y).backward()\n"
        "        opt.step()\n    return model",
        "def train(ctx, lr=1e-3):\n    torch.manual_seed(0)\n    loader = DataLoader(Pairs(), batch_size=4)\n"
        "    model = fit(Net(), loader, lr)\n    print('trained on', ctx.world_size, 'ranks')\n"
        "    return round(float(model.fc.weight.sum()), 6)",
    ]
    for code in cells:
        reply, out = execute(kc, code)
        assert reply["status"] == "ok", out
    reply, out = execute(kc, f"r = spawn_train(train, nprocs=2, runs_dir={str(tmp_path / 'runs')!r}); print(r.value)")
    assert reply["status"] == "ok", out
    assert "[rank0] trained on 2 ranks" in out
    value = float(out.strip().splitlines()[-1])
    reply, out = execute(kc, "h = spawn_train(train, 5e-4, nprocs=2, block=False, echo=False, name='cells', "
                             f"runs_dir={str(tmp_path / 'runs')!r}); print(h.wait().value, h.run_dir)")
    assert reply["status"] == "ok", out
    other, run_dir = out.strip().splitlines()[-1].split()
    assert float(other) != value

    # The source kept in the run folder defines the same function: run as a file, it trains the same.
    source = (Path(run_dir) / "worker_source.py").read_text()
    assert "class Net(nn.Module)" in source and "class Pairs(Dataset)" in source and "def fit(" in source
    ns = {"__name__": "worker_source"}
    exec(compile(source, "worker_source.py", "exec"), ns)

    class Ctx:
        world_size = 1

    assert ns["train"](Ctx(), 5e-4) == float(other)
