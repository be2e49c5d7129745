"""The comparison suite (``python -m gefen_dist.bench``).

The MoE LM tasks are defined in ``moe``, which imports ``tasks``; registering them here (rather
than ``tasks`` importing ``moe``) keeps the imports one way, and every process that imports the
suite (the command line, its worker subprocesses, the tests) sees them in ``tasks.TASKS``.
"""

from gefen_dist.bench import moe as _moe
from gefen_dist.bench import recurrent as _recurrent

_moe.register_tasks()
_recurrent.register_tasks()
