"""``python -m gefen_dist.checkpoint``: consolidate or inspect a checkpoint (package docstring)."""

from __future__ import annotations

import argparse
import sys

import torch

from . import consolidate, gefen_entries, read_dcp
from .zero import consolidate_zero, describe_zero, is_zero_checkpoint


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gefen_dist.checkpoint", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("consolidate", help="every rank's Gefen state into one process's")
    c.add_argument(
        "src", help="a DCP checkpoint directory, or a DeepSpeed one (engine.save_checkpoint's)"
    )
    c.add_argument("out", help="the torch.save file to write (model and optimizer, whole)")
    i = sub.add_parser("inspect", help="list the Gefen entries of a checkpoint")
    i.add_argument("src")
    a = ap.parse_args(argv)
    if is_zero_checkpoint(a.src):
        return _zero(a)
    tree = read_dcp(a.src)
    if a.cmd == "inspect":
        for where, entry in gefen_entries(tree):
            ranks = sorted(k for k in entry if k.startswith("gefen.rank"))
            ranges = sorted(k for k in entry if k.startswith("pieces."))
            if ranks:
                print(f"{where}: {len(ranks)} rank entries")
            else:
                print(f"{where}: global fields, {len(ranges)} saved ranges")
        return 0
    out, done = consolidate(tree)
    torch.save(out, a.out)
    print(f"consolidated {len(done)} Gefen parameter entries into {a.out}")
    return 0


def _zero(a: argparse.Namespace) -> int:
    """A DeepSpeed ZeRO checkpoint (``checkpoint.zero``)."""
    if a.cmd == "inspect":
        print("\n".join(describe_zero(a.src)))
        return 0
    out, done = consolidate_zero(a.src)
    torch.save(out, a.out)
    print(f"consolidated the Gefen state of {len(done)} tensors into {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
