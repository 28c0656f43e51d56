"""Built-in tasks, one folder each: a task's plan (run in the kernel), its worker (run in each
rank) and the data and model code both use. A config type selects its task
(:data:`nbddp.contract.plans._TASKS`).

A task may import the contract and the rank side, never the kernel side; the kernel imports a
task's shared code (models, image loading) and its plan, never its worker.
"""

_MOVED = {"LaunchPlan", "plan", "is_task_config", "check_picklable", "run_to_resume", "default_name",
          "DEFAULT_TIMEOUT_S"}


def __getattr__(name):
    # nbddp.tasks held the launch plans before they moved to nbddp.contract.plans.
    if name in _MOVED:
        import importlib
        import warnings

        warnings.warn(f"nbddp.tasks.{name} moved to nbddp.contract.plans.{name}", DeprecationWarning, stacklevel=2)
        return getattr(importlib.import_module("nbddp.contract.plans"), name)
    raise AttributeError(f"module 'nbddp.tasks' has no attribute {name!r}")
