"""The contract both sides read: records, the run folder, configs, checkpoints, errors, targets.

The kernel writes what a rank reads and reads what a rank writes through these modules only.
They import each other and nothing of :mod:`nbddp.kernel`, :mod:`nbddp.rank` or the tasks
(``tests/test_sides.py``); no module here imports torch at import time unless it must
(``checkpoint``).
"""
