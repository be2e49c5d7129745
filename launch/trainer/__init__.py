"""The parts of ``launch/train.py``, one job each, importable for tests and for the other scripts
in ``launch/`` (``chaos.py``, ``main_job.py``) that must read a run the way the script does.

Split the way torchtitan splits its trainer (a thin entry point, a config module, the
parallelism setup, a checkpointer, the loop), at this script's scale:

- ``config``: the run config, its defaults and every check that can run before a process group.
- ``optimizer``: the optimizer a config asks for, and the one that steps inside the wrappers.
- ``launchers``: one setup per sharding mode (DDP, FSDP1, FSDP2/HSDP, DeepSpeed, Accelerate),
  the device and process group each takes, and what each actually ran.
- ``checkpoint_dir``: the checkpoint directory on disk: names, the ``COMPLETE`` marker, the
  atomic commit, which saves are complete and which torn. No process group, no framework.
- ``checkpoint``: saving and loading through each framework's own path, including the load at
  another world size or mesh, and the checks a resume must pass.
- ``faults``: the ``GEFEN_CHAOS_KILL`` test hook that kills a rank inside a phase.
- ``loop``: the data, one training step per launcher, evaluation, the progress bar.
- ``results``: every rank's figures, the optional digest, the results JSON and summary.
- ``run``: one run from device to teardown, calling the parts above in order.

Imports between the parts form no cycle: ``checkpoint_dir`` and ``optimizer`` import no other
part, ``config`` imports those two, ``faults`` and ``launchers`` build on ``config``,
``checkpoint`` and ``results`` on those, ``loop`` on ``checkpoint``, and ``run`` on all. From
here imports go to ``gefen_dist`` only, never back: the package knows nothing of this script.
It lives under ``launch/`` rather than in ``gefen_dist`` because it is the script's own
machinery (launcher conventions, the demo GPT, a checkpoint layout of its own), which users of
the optimizer do not import. It is imported as ``trainer``, with ``launch/`` on ``sys.path`` as
a launcher puts it for ``launch/train.py``.
"""
