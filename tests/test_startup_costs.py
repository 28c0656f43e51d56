"""The fixed costs of a launch of the built-in worker, one number each, in its first epoch record
(:mod:`nbddp.tasks.classification.startup`); a relaunch does not check the images again."""

from nbddp import spawn_train
from nbddp.tasks.classification import images
from nbddp.tasks.classification.startup import NAMES, lines
from conftest import make_tree, small_cfg


def test_a_launch_records_its_fixed_costs_once_and_a_relaunch_decodes_no_image_to_check_it(tmp_path, runs_dir,
                                                                                             monkeypatch):
    tree = make_tree(tmp_path / "data")
    cfg = small_cfg(tree, runs_dir, nprocs=1, data_pipeline="tensor", name="costs")
    first = spawn_train(cfg, echo=False)
    record = first.metrics[0]
    costs = [record.get(f"startup_{name}_s") for name in NAMES]
    assert all(isinstance(c, float) and c >= 0 for c in costs), record
    assert sum(costs) <= first.seconds, "every cost lies inside the launch"
    assert not any(key.startswith("startup_") for key in first.metrics[1]), "the launch's, in its first record only"
    printed = lines(record)
    assert [line.split(":")[1].rsplit(None, 2)[0].strip() for line in printed] == [n.replace("_", " ") for n in NAMES]
    assert all(line.startswith("fixed cost: ") and line.endswith(" s") for line in printed)

    decoded = []
    check = images._decode_check
    monkeypatch.setattr(images, "_decode_check", lambda path: (decoded.append(path), check(path))[1])
    again = spawn_train(cfg, echo=False)
    assert decoded == [], "the relaunch's preflight found the same files, already checked"
    assert all(isinstance(again.metrics[0].get(f"startup_{name}_s"), float) for name in NAMES)
