"""The kernel side: what runs in the notebook's kernel (or a script) and never in a rank.

``launch`` starts a run, ``handle`` watches, stops and reports it, and the modules beside them
do one part each (processes, output, stalls, stacks, restarts, the staged stop, the
rendezvous, the warm server, the error report, export and prediction). They may import the
contract (:mod:`nbddp.contract`) and the built-in tasks' shared code, never :mod:`nbddp.rank`;
a rank never imports anything here (``tests/test_sides.py``).
"""
