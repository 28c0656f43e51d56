"""Every rank of every launch starts with random state of its own, drawn from the OS as a fresh
interpreter's is, and a seeded rank draws the same numbers on every launch.

A warm rank forks from a server that imported torch and numpy long before: without care every
rank (and, with the server reused, every launch) would share its generators, so unseeded
dropout, augmentation and random data would be identical across ranks and launches. The
launches are shared between the assertions: two warm (forkserver) launches and one spawn launch
of a function from this process, two launches of a torchrun script from one real kernel.
"""

import json
import math

import pytest

from conftest import ROOT, WORKERS, execute, real_kernel

DRAWS = WORKERS / "draws.py"
#: What each rank reports (``tests/workers/draws.py``); CUDA's only where the ranks see a GPU.
KEYS = ("torch", "numpy", "python", "torch_seed", "loader_worker_seed")


def keys_of(rows):
    return KEYS + tuple(k for k in ("cuda", "cuda_seed") if k in rows[0])


def assert_all_differ(rows, where):
    """Every generator gave a different number in each of ``rows`` (one per rank and launch)."""
    for key in keys_of(rows):
        values = [row[key] for row in rows]
        assert len(set(values)) == len(values), f"{where}: {key} repeats across ranks/launches: {values}"


def assert_all_equal(rows, where):
    for key in keys_of(rows):
        values = [row[key] for row in rows]
        assert all(v == values[0] for v in values) and not math.isnan(values[0]), f"{where}: {key}: {values}"


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """Each launch's per-rank draws: two warm launches from one server, then one by spawn."""
    from nbddp import spawn_train

    runs = tmp_path_factory.mktemp("runs")
    out = {}
    for label, method in (("warm1", "forkserver"), ("warm2", "forkserver"), ("spawn", "spawn")):
        result = spawn_train(f"{DRAWS}:draws", nprocs=2, all_values=True, runs_dir=runs, echo=False,
                             start_method=method)
        out[label] = result.values
    return out


def test_warm_ranks_and_launches_each_draw_their_own_numbers(launched):
    rows = [v["fresh"] for v in launched["warm1"] + launched["warm2"]]
    assert_all_differ(rows, "forkserver, 2 launches x 2 ranks")


def test_spawned_ranks_draw_their_own_numbers_too(launched):
    rows = [v["fresh"] for v in launched["spawn"] + launched["warm1"]]
    assert_all_differ(rows, "spawn and forkserver ranks")


def test_seeded_ranks_draw_the_same_numbers_on_every_launch_and_start_method(launched, tmp_path):
    rows = [v["seeded"] for label in ("warm1", "warm2", "spawn") for v in launched[label]]
    assert_all_equal(rows, "seeded ranks")
    if "cuda" in rows[0]:  # seeded before CUDA's first use too: the seed waits for CUDA, then holds
        from nbddp import spawn_train

        result = spawn_train(f"{DRAWS}:draws", nprocs=2, kwargs={"seed_first": True}, all_values=True,
                             runs_dir=tmp_path, echo=False)
        assert_all_equal(rows + [v["seeded"] for v in result.values], "seeded before CUDA started")


def test_a_torchrun_script_in_a_kernel_draws_fresh_numbers_per_rank_and_launch(tmp_path):
    """The script all-gathers its ranks' draws; run twice from one kernel (its warm server reused)."""
    with real_kernel(tmp_path) as (_, kc):
        reply, out = execute(kc, f"import sys; sys.path.insert(0, {str(ROOT)!r}); from nbddp import spawn_train")
        assert reply["status"] == "ok", out
        gathered = []
        for i in range(2):
            path = tmp_path / f"draws{i}.json"
            reply, out = execute(kc, f"spawn_train({str(DRAWS)!r}, nprocs=2, argv=[{str(path)!r}], "
                                     f"runs_dir={str(tmp_path / 'runs')!r}, echo=False)", timeout=180)
            assert reply["status"] == "ok", out
            gathered += json.loads(path.read_text())
    assert_all_differ([g["fresh"] for g in gathered], "script in a kernel, 2 launches x 2 ranks")
    assert_all_equal([g["seeded"] for g in gathered], "seeded script in a kernel")
