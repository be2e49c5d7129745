"""``python -m gefen_dist.bench {compare,memory,capacity,dcp_memory} ...``.

``memory``, ``capacity`` and ``dcp_memory`` live in their own modules and are imported only
when asked for, so ``compare`` works even where their dependencies are missing.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "compare": ("gefen_dist.bench.compare", "quality suite: every optimizer on every task"),
    "memory": ("gefen_dist.bench.memory", "optimizer-state memory measurements"),
    "capacity": ("gefen_dist.bench.capacity", "largest microbatch under a memory budget"),
    "dcp_memory": ("gefen_dist.bench.dcp_memory", "host memory of a DCP resume (torchrun)"),
}


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        lines = [f"  {k:10s} {v[1]}" for k, v in COMMANDS.items()]
        print(
            "usage: python -m gefen_dist.bench {compare,memory,capacity,dcp_memory} [options]\n"
            + "\n".join(lines),
            file=sys.stderr,
        )
        raise SystemExit(0 if argv[:1] in (["-h"], ["--help"]) else 2)
    module = importlib.import_module(COMMANDS[argv[0]][0])
    module.main(argv[1:])


if __name__ == "__main__":
    main()
