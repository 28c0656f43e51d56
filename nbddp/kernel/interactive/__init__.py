"""Interactive ranks: a group of rank processes that lives across cells, driven by ``%%ranks``.

``group`` (``start_ranks``, the :class:`~nbddp.kernel.interactive.group.Ranks` object: pull, push,
restart, stop), ``members`` (one start's processes and channel sockets, requests and their
answers), ``cell`` (a cell's live output and its outcome), ``magics`` (``%%ranks``). The ranks'
half is :mod:`nbddp.rank.interactive`; the channel between them :mod:`nbddp.contract.channel`.

Kernel side.
"""
