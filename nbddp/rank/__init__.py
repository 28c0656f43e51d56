"""The rank side: what runs in each rank (a process started by ``spawn_train``, torchrun or srun).

``runtime`` is a rank's entry and ``Context``; the modules beside it call the user's code,
beat the heartbeat, set up the process group and run the loops. They import the contract
(:mod:`nbddp.contract`) and each other, never the kernel side (``tests/test_sides.py``).
"""
