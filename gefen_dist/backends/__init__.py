"""The update's implementations, each tested against ``reference`` and it against
``method.spec``: the reference in bounded memory, the C++ CPU kernel (``native_cpu`` with its
tables ``segment_table``, ``cpu_plan``, ``kept_plan``), the Triton GPU kernels
(``triton_backend``, ``triton_kernels``), and the choice among them (``dispatch``)."""
