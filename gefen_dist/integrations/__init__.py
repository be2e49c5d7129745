"""One module or package per framework, the only place that framework is imported: FSDP1/FSDP2
with DCP (``fsdp``), DeepSpeed ZeRO (``deepspeed``, whose ``patches`` holds every change made to
DeepSpeed), ``torchtitan`` (subclasses of its optimizer container and checkpoint manager, which
a job names in its config), and ``register``, which installs them. They import
the optimizer; the optimizer reaches them only through ``gefen_dist.extension``."""
