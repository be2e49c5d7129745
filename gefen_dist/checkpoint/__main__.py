"""``python -m gefen_dist.checkpoint``: consolidate or inspect a checkpoint (package docstring)."""

from __future__ import annotations

import argparse
import sys

import torch

from . import consolidate, gefen_entries, read_dcp


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gefen_dist.checkpoint", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("consolidate", help="every rank's Gefen state into one process's")
    c.add_argument("src", help="a DCP checkpoint directory")
    c.add_argument("out", help="the torch.save file to write (model and optimizer, whole)")
    i = sub.add_parser("inspect", help="list the Gefen entries of a checkpoint")
    i.add_argument("src")
    a = ap.parse_args(argv)
    tree = read_dcp(a.src)
    if a.cmd == "inspect":
        for where, entry in gefen_entries(tree):
            ranks = sorted(k for k in entry if k.startswith("gefen.rank"))
            print(f"{where}: {len(ranks)} rank entries")
        return 0
    out, done = consolidate(tree)
    torch.save(out, a.out)
    print(f"consolidated {len(done)} Gefen parameter entries into {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
