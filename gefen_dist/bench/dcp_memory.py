"""Host memory and bytes read of a DCP resume of Gefen (FSDP2, gloo, CPU) at another world size.

Issue 44 item 3. The demo GPT at GPT-2 124M's shapes (12 layers, 12 heads, width 768,
vocabulary 50304, tied head; ``--block-size`` 64) is sharded per block and at the root
(``fully_shard``), stepped by Gefen 4-bit and checkpointed with ``get_state_dict`` +
``dcp.save`` on one world size, then loaded afresh at others, each launch its own process
group:

- ``save CK WORK``: 2 training steps on a tiny random batch, then the save. Records
  ``memory_report()``'s state bytes summed over ranks, and the optimizer's bytes in the
  checkpoint: the metadata's ``optim.*`` tensor sizes, the storage records (on disk, with
  ``torch.save``'s framing) of those tensors, and the ``.distcp`` files (model + optimizer).
- ``load CK WORK PATH``: the model and Gefen built afresh at this world size, then the load, in
  phases, on every rank: PATH ``dcp`` is the plain loop (``get_state_dict``, ``dcp.load`` with
  no planner, ``set_state_dict``; gefen_dist fits DCP's default planner to Gefen's template);
  PATH ``old`` is what users did before it: the model by ``dcp.load``, the optimizer by
  ``checkpoint.read_dcp`` + ``consolidate`` + ``load_optimizer``. Then ``malloc_trim`` and one
  training step, for scale.

Per rank and phase: VmRSS before and after, and VmHWM, the peak RSS, reset to the current RSS
before each phase (``/proc/self/clear_refs`` <- 5; where the kernel refuses, the record says so
and a phase's peak is reported only where it beats every earlier one). Also the live Gefen state
(``memory_report``), the bytes read into the optimizer's template (the tensors DCP filled, a
DTensor's local piece), the model shard's bytes, and the largest stored item a read of this rank
loads whole (DCP's ``FileSystemReader`` ``torch.load``s each saved chunk that a read meets and
then narrows it). Every load runs twice: under glibc's default malloc (what users get; freed
heap stays in RSS) and with ``MALLOC_MMAP_THRESHOLD_`` fixed at 128 KiB (RSS follows the
memory in use). The report (``report``) sets each phase against the bound of
``BOUND_TEXT``.

Run everything (the launches one after another, then the report; about 12 minutes on 2
cores)::

    OMP_NUM_THREADS=1 python -m gefen_dist.bench.dcp_memory run --ck /tmp/dcp_memory_ck

or a launch by hand::

    OMP_NUM_THREADS=1 torchrun --nproc_per_node=4 -m gefen_dist.bench.dcp_memory \\
        load /tmp/dcp_memory_ck /tmp/dcp_memory_ck-work dcp

``report WORK [OUT]`` writes ``OUT/dcp_memory.{json,md}`` (default ``results/checkpoints``) from
the launches' records. ``--shape 2,2,64,256`` makes a smoke test of a minute or two.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

from gefen_dist.bench import store

MiB = 2**20
SAVE_WORLD = 2
LOAD_WORLDS = (1, 4)
STEPS = 2
BATCH = 2
"""Sequences per rank per step."""


# -- measuring -----------------------------------------------------------------------------------
def _status() -> dict[str, int]:
    """VmRSS and VmHWM of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) * 1024
    return out


def _trim() -> bool:
    """Hand the C heap's free memory back to the system (glibc ``malloc_trim``), so that the RSS
    after it is the memory still in use; False where there is no glibc."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        return True
    except (OSError, AttributeError):
        return False


def allocator() -> str:
    """The glibc malloc setting of this launch: 'default', or its fixed mmap threshold."""
    t = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    return f"MALLOC_MMAP_THRESHOLD_={t}" if t else "default"


def _reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where the kernel refuses."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class Phases:
    """RSS before and after, and the peak RSS of each phase of a load, on this rank."""

    def __init__(self) -> None:
        gc.collect()
        self.rows: list[dict[str, Any]] = []
        self.reset = _reset_peak()
        self.before = _status()["VmRSS"]
        self._start = self.before
        self._t = time.perf_counter()

    def mark(self, name: str, **extra: Any) -> None:
        st = _status()
        self.rows.append(
            dict(
                phase=name,
                rss_before=self._start,
                rss_after=st["VmRSS"],
                peak=st["VmHWM"],
                seconds=round(time.perf_counter() - self._t, 2),
                **extra,
            )
        )
        gc.collect()
        self.reset = _reset_peak() and self.reset
        self._start = _status()["VmRSS"]
        self._t = time.perf_counter()


def tensor_bytes(tree: Any) -> int:
    """Bytes of the tensors in ``tree`` that this rank holds (a DTensor's local piece)."""
    if isinstance(tree, dict):
        return sum(tensor_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(tensor_bytes(v) for v in tree)
    if isinstance(tree, torch.Tensor):
        t = tree.to_local() if hasattr(tree, "to_local") else tree
        return t.numel() * t.element_size()
    if isinstance(tree, (bytes, bytearray)):
        return len(tree)
    return 0


def _elem(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def checkpoint_bytes(ck: str | Path) -> dict[str, Any]:
    """The checkpoint's bytes: tensor sizes from the metadata, storage records (what
    ``torch.save`` wrote for each saved chunk, framing included) and files, optimizer and model
    apart; the optimizer's tensors by field as well; and the largest stored chunk."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    ck = Path(ck)
    md = FileSystemReader(str(ck)).read_metadata()
    tensors = {"optim": 0, "model": 0}
    fields: dict[str, int] = {}
    for key, m in md.state_dict_metadata.items():
        if not isinstance(m, TensorStorageMetadata):
            continue
        n = m.size.numel() * _elem(m.properties.dtype)
        part = key.split(".", 1)[0]
        tensors[part] = tensors.get(part, 0) + n
        if part == "optim":
            field = key.rsplit(".", 1)[-1] if key.count(".") else key
            for name in ("codes", "exp_avg_sq", "exp_avg", "step", "codebook", "block"):
                if key.endswith("." + name):
                    field = name
                    break
            else:
                for name in ("pieces", "v", "absmax"):
                    if f".{name}." in key:
                        field = name
                        break
            fields[field] = fields.get(field, 0) + n
    stored = {"optim": 0, "model": 0}
    largest = {"optim": 0, "model": 0}
    for index, info in (md.storage_data or {}).items():
        part = index.fqn.split(".", 1)[0]
        stored[part] = stored.get(part, 0) + info.length
        largest[part] = max(largest.get(part, 0), info.length)
    files = sorted(ck.glob("*.distcp"))
    return dict(
        tensor_bytes=tensors,
        optim_fields=fields,
        stored_bytes=stored,
        largest_stored_item=largest,
        distcp_files=len(files),
        distcp_bytes=sum(f.stat().st_size for f in files),
    )


# -- the model -----------------------------------------------------------------------------------
SHAPE = "12,12,768,50304"
"""Layers, heads, width, vocabulary: GPT-2 124M's (``--shape`` smaller for a smoke test)."""


def config(block_size: int, shape: str = SHAPE):
    from gefen_dist.demo.model import GPTConfig

    n_layer, n_head, n_embd, vocab = (int(x) for x in shape.split(","))
    return GPTConfig(
        vocab_size=vocab, block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd
    )


def built(block_size: int, bits: int, shape: str):
    """The GPT (seed 0) sharded per block and at the root over this world, and Gefen."""
    from torch.distributed.fsdp import fully_shard

    from gefen_dist import Gefen
    from gefen_dist.demo.model import GPT

    torch.manual_seed(0)
    model = GPT(config(block_size, shape))
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    opt = Gefen(list(model.named_parameters()), bits=bits, lr=3e-3, weight_decay=0.1)
    gc.collect()
    return model, opt


def train_step(model, opt, step: int, block_size: int) -> None:
    """One step on BATCH random sequences a rank (seeded by step and rank)."""
    import torch.distributed as dist

    g = torch.Generator().manual_seed(1000 + step * dist.get_world_size() + dist.get_rank())
    x = torch.randint(0, model.config.vocab_size, (BATCH, block_size), generator=g)
    opt.zero_grad()
    model(x, torch.roll(x, -1, dims=1))[1].backward()
    opt.step()
    opt.zero_grad()


def shard_bytes(model) -> int:
    return sum(tensor_bytes(p) for p in model.parameters())


def state_bytes(opt) -> int:
    return int(opt.memory_report()["state_bytes"])


def _gather(row: dict) -> list[dict] | None:
    import torch.distributed as dist

    rows = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(row, rows, dst=0)
    return rows


def _write(work: str, name: str, record: dict) -> None:
    record = {**record, "revision": store.revision()["code"]}
    Path(work).mkdir(parents=True, exist_ok=True)
    (Path(work) / f"{name}.json").write_text(json.dumps(record, indent=1))


# -- launches ------------------------------------------------------------------------------------
def save(ck: str, work: str, block_size: int, bits: int, shape: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rank, world = dist.get_rank(), dist.get_world_size()
    model, opt = built(block_size, bits, shape)
    params = sum(p.numel() for p in model.parameters())
    t0 = time.perf_counter()
    for step in range(STEPS):
        train_step(model, opt, step, block_size)
    train_s = time.perf_counter() - t0
    report = opt.memory_report()
    ph = Phases()
    msd, osd = get_state_dict(model, opt)
    ph.mark("get_state_dict")
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=ck)
    ph.mark("dcp.save")
    row = dict(
        rank=rank,
        state_bytes=int(report["state_bytes"]),
        local_params=int(report["params"]),
        model_shard_bytes=shard_bytes(model),
        phases=ph.rows,
        peak_reset=ph.reset,
        train_seconds=round(train_s, 1),
    )
    rows = _gather(row)
    if rank == 0:
        blocks = sorted({b for t in report["tensors"] for b in t["block_sizes"]})
        _write(
            work,
            "save",
            dict(
                world=world, params=params, bits=bits, block_size=block_size, shape=shape,
                steps=STEPS, batch_per_rank=BATCH, gefen_blocks=blocks,
                checkpoint=checkpoint_bytes(ck), ranks=rows,
            ),
        )  # fmt: skip


def _largest_read(ck: str, rows_of_rank) -> int:
    """The largest stored chunk a read of this rank loads whole: DCP's reader ``torch.load``s
    each saved chunk that one of its reads meets (``rows_of_rank``: tensor key -> this rank's
    (offsets, sizes), or None for a whole tensor)."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(ck).read_metadata()
    best = 0
    for index, info in (md.storage_data or {}).items():
        if index.fqn not in rows_of_rank:
            continue
        want = rows_of_rank[index.fqn]
        meta = md.state_dict_metadata[index.fqn]
        chunk = next(
            (c for c in getattr(meta, "chunks", []) if tuple(c.offsets) == tuple(index.offset)),
            None,
        )
        if want is not None and chunk is not None:
            (off, size) = want
            meets = all(
                a < b + m and b < a + n
                for a, n, b, m in zip(chunk.offsets, chunk.sizes, off, size, strict=True)
            )
            if not meets:
                continue
        best = max(best, info.length)
    return best


def _targets(tree: Any, prefix: str) -> dict[str, Any]:
    """Flattened DCP keys of ``tree`` -> this rank's (offsets, sizes) of a DTensor, or None."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    flat, _ = flatten_state_dict({prefix: tree})
    out = {}
    for k, v in flat.items():
        if hasattr(v, "device_mesh"):
            sizes, offs = compute_local_shape_and_global_offset(
                v.shape, v.device_mesh, v.placements
            )
            out[k] = (tuple(offs), tuple(sizes))
        elif isinstance(v, torch.Tensor):
            out[k] = None
    return out


def load(ck: str, work: str, path: str, block_size: int, bits: int, shape: str) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    from gefen_dist import checkpoint

    rank, world = dist.get_rank(), dist.get_world_size()
    base = _status()["VmRSS"]
    model, opt = built(block_size, bits, shape)
    built_rss = _status()
    shard = shard_bytes(model)
    largest_local = max(sharding_local_numel(p) for p in model.parameters())
    ph = Phases()
    if path == "dcp":
        msd, osd = get_state_dict(model, opt)
        ph.mark("get_state_dict", state_bytes=state_bytes(opt))
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=ck)
        template = tensor_bytes(osd["state"])
        largest = _largest_read(ck, {**_targets(msd, "model"), **_targets(osd, "optim")})
        ph.mark("dcp.load", optim_read_bytes=template)
        set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd)
        ph.mark("set_state_dict", state_bytes=state_bytes(opt))
        del msd, osd
    elif path == "old":
        msd = get_model_state_dict(model)
        dcp.load({"model": msd}, checkpoint_id=ck)
        set_model_state_dict(model, msd)
        largest = _largest_read(ck, _targets(msd, "model"))
        ph.mark("model: dcp.load")
        del msd
        tree = checkpoint.read_dcp(ck, prefix="optim.")
        template = tensor_bytes(tree["optim"]["state"])
        ph.mark("optim: read_dcp", optim_read_bytes=template)
        tree, _ = checkpoint.consolidate(tree)
        ph.mark("consolidate", consolidated_bytes=tensor_bytes(tree["optim"]["state"]))
        checkpoint.load_optimizer(opt, model, tree["optim"])
        ph.mark("load_optimizer", state_bytes=state_bytes(opt))
        del tree
    else:
        raise ValueError(f"load path: dcp or old, got {path!r}")
    ph.mark("freed", state_bytes=state_bytes(opt))
    loading = list(ph.rows)
    trimmed = _trim()
    ph.mark("malloc_trim")
    train_step(model, opt, STEPS, block_size)
    ph.mark("one training step", state_bytes=state_bytes(opt))
    row = dict(
        rank=rank,
        rss_at_start=base,
        rss_built=built_rss["VmRSS"],
        hwm_built=built_rss["VmHWM"],
        rss_before_load=ph.before,
        model_shard_bytes=shard,
        optim_read_bytes=template,
        largest_stored_read=largest,
        state_bytes=state_bytes(opt),
        phases=ph.rows,
        peak_reset=ph.reset,
        peak_during_load=max(r["peak"] for r in loading),
        rss_after_trim=ph.rows[-2]["rss_after"] if trimmed else None,
        largest_local_numel=largest_local,
    )
    rows = _gather(row)
    if rank == 0:
        alloc = allocator()
        name = f"load-{path}-w{world}" + ("" if alloc == "default" else "-mmap")
        _write(work, name, dict(world=world, path=path, malloc=alloc, ranks=rows))


def sharding_local_numel(p: torch.Tensor) -> int:
    return (p.to_local() if hasattr(p, "to_local") else p).numel()


def _launch(argv: list[str]) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    try:
        mode, ck, work, *rest = argv
        ap = argparse.ArgumentParser()
        ap.add_argument("path", nargs="?")
        ap.add_argument("--block-size", type=int, default=64)
        ap.add_argument("--bits", type=int, default=4)
        ap.add_argument("--shape", default=SHAPE)
        a = ap.parse_args(rest)
        if mode == "save":
            save(ck, work, a.block_size, a.bits, a.shape)
        else:
            load(ck, work, a.path, a.block_size, a.bits, a.shape)
        gc.collect()
        dist.barrier()
    finally:
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()


# -- driver and report ---------------------------------------------------------------------------
RESTORE_SCRATCH = 6 * 8 * (1 << 20)
"""``portable.restore``'s scratch for one chunk of ``portable.CHUNK`` = 2^20 elements: its
loops hold at most six temporaries of 8 bytes an element at once (element and block indices,
int64; v and counts, float64), an estimate read from the code, not measured."""

MMAP = "131072"
"""The fixed glibc mmap threshold of the second set of loads: every allocation of 128 KiB or
more gets its own mapping, returned to the system when freed, so that RSS follows the memory in
use (glibc's default threshold rises to 32 MiB after the first large free, and smaller tensors
freed inside the heap stay in RSS)."""


def _commands(
    ck: str, work: str, worlds: tuple[int, ...], shape: str
) -> list[tuple[dict[str, str], list[str]]]:
    mod = ["-m", "gefen_dist.bench.dcp_memory"]
    run = ["torchrun", "--standalone"]
    opts = [] if shape == SHAPE else ["--shape", shape]
    cmds = [({}, [*run, f"--nproc_per_node={SAVE_WORLD}", *mod, "save", ck, work, *opts])]
    for env in ({}, {"MALLOC_MMAP_THRESHOLD_": MMAP}):
        for path in ("dcp", "old"):
            for w in worlds:
                cmds.append(
                    (env, [*run, f"--nproc_per_node={w}", *mod, "load", ck, work, path, *opts])
                )
    return cmds


def drive(a: argparse.Namespace) -> None:
    import shutil

    ck, work = a.ck, a.work or f"{a.ck}-work"
    worlds = tuple(int(w) for w in a.worlds.split(","))
    log = Path(work) / "commands.json"
    for i, (extra, cmd) in enumerate(_commands(ck, work, worlds, a.shape)):
        if i == 0:
            if a.skip_save and (Path(work) / "save.json").exists():
                continue
            shutil.rmtree(ck, ignore_errors=True)
            shutil.rmtree(work, ignore_errors=True)
        line = " ".join(f"{k}={v}" for k, v in {"OMP_NUM_THREADS": "1", **extra}.items())
        line += " " + shlex.join(cmd)
        print(line, flush=True)
        t = time.perf_counter()
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1", **extra})
        done = json.loads(log.read_text()) if log.exists() else []
        done = [d for d in done if d["command"] != line]
        done.append(dict(command=line, seconds=round(time.perf_counter() - t, 1)))
        log.write_text(json.dumps(done, indent=1))
    report(work, a.out)


def _mib(b: float | None) -> str:
    return "" if b is None else f"{b / MiB:,.1f}"


def _phase(r: dict, name: str) -> dict | None:
    return next((p for p in r["phases"] if p["phase"] == name), None)


def _grow(p: dict | None) -> float | None:
    return None if p is None else p["peak"] - p["rss_before"]


def report(work: str, out: str) -> None:
    work_p, out_p = Path(work), Path(out)
    saved = json.loads((work_p / "save.json").read_text())
    loads = [json.loads(p.read_text()) for p in sorted(work_p.glob("load-*.json"))]
    loads.sort(
        key=lambda r: (r.get("malloc", "default") != "default", r["path"] != "dcp", r["world"])
    )
    log = work_p / "commands.json"
    rev = store.revision()
    with open("/proc/meminfo") as f:
        mem = next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("MemTotal"))
    ran = sorted({r.get("revision", "?") for r in [saved, *loads]})
    meta = dict(
        commands=json.loads(log.read_text()) if log.exists() else [],
        launches_revision=ran,
        revision=rev["code"],
        head=rev["head"],
        machine=f"{platform.machine()}, {store.cpu_model()}, {os.cpu_count()} cores, "
        f"{mem / 2**30:.1f} GiB",
        torch=torch.__version__,
    )
    params = saved["params"]
    layers, heads, width, vocab = saved["shape"].split(",")
    ck = saved["checkpoint"]
    live = sum(r["state_bytes"] for r in saved["ranks"])
    lines = [
        "# Host memory of a DCP resume of Gefen at another world size (issue 44 item 3)",
        "",
        "Written by `gefen_dist/bench/dcp_memory.py` (its docstring says what is measured "
        "and how).  ",
        f"Launches ran at (last commit touching `gefen_dist/` or `csrc/`): "
        f"{', '.join(f'`{r}`' for r in ran)}; report written at `{meta['revision']}`, HEAD "
        f"`{meta['head']}`  ",
        f"Machine: {meta['machine']}, torch {meta['torch']}; gloo, CPU, one thread a rank "
        "(the 4-rank launches share the 2 cores)  ",
        "Commands (each a launch of its own; seconds of wall time):",
        "",
        *[f"    {c['command']}   # {c['seconds']} s" for c in meta["commands"]],
        "",
        f"Model: demo GPT, {layers} layers, {heads} heads, width {width}, vocabulary {vocab} "
        f"(tied head), block {saved['block_size']}: {params:,} parameters; FSDP2 `fully_shard` "
        f"per block + root; Gefen {saved['bits']}-bit (block sizes {saved['gefen_blocks']}); "
        f"{saved['steps']} steps on {saved['batch_per_rank']} random sequences a rank, saved "
        f"on {saved['world']} ranks by `get_state_dict` + `dcp.save`.",
        "",
        "## The saved optimizer state against the live one",
        "",
        "| what | bytes | MiB | bytes/param |",
        "|---|---:|---:|---:|",
    ]
    rows = [
        (f"live Gefen state, `memory_report()` summed over {saved['world']} ranks", live),
        ("checkpoint `optim.*` tensors (metadata sizes)", ck["tensor_bytes"]["optim"]),
        *[
            (f"&nbsp;&nbsp;of which `{k}`", v)
            for k, v in sorted(ck["optim_fields"].items(), key=lambda kv: -kv[1])
        ],
        ("checkpoint `optim.*` storage records on disk", ck["stored_bytes"]["optim"]),
        ("checkpoint `model.*` tensors (fp32)", ck["tensor_bytes"]["model"]),
        (f"all {ck['distcp_files']} `.distcp` files (model + optimizer)", ck["distcp_bytes"]),
    ]
    lines += [f"| {w} | {b:,} | {_mib(b)} | {b / params:.3f} |" for w, b in rows]
    lines += [
        "",
        "The saved optimizer state is about twice the live one: the live state packs two 4-bit "
        "codes a byte, the checkpoint keeps one code a byte so that any new row boundary cuts "
        "no byte (`integrations/dcp.py`).",
        "",
        "## Loading at another world size, per rank (MiB)",
        "",
        "RSS before: after building the sharded model and Gefen, before `get_state_dict` (plain "
        "loop) or the model's `dcp.load` (old path). Peak: VmHWM, reset to the current RSS at the "
        "start of each phase (`/proc/self/clear_refs`), the highest over the load's phases; "
        "growth = peak - RSS before. After trim: RSS after the load, its objects freed and "
        "`malloc_trim(0)`. Read: optimizer tensor bytes DCP (or `read_dcp`) filled on this rank. "
        "Chunk: the largest stored item one of the rank's reads `torch.load`s whole. Step: "
        "growth of the peak over the RSS before, in one training step after the load.",
        "",
        "| malloc | path | world | rank | RSS before | peak | growth | peak's phase | after "
        "trim | read (optim) | live state | model shard | chunk | step's growth |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for rec in loads:
        alloc = "default" if rec.get("malloc", "default") == "default" else "mmap 128K"
        for r in rec["ranks"]:
            growth = r["peak_during_load"] - r["rss_before_load"]
            top = max(
                (p for p in r["phases"] if p["phase"] not in ("malloc_trim", "one training step")),
                key=lambda p: p["peak"],
            )
            step = _phase(r, "one training step")
            r["growth"] = growth
            lines.append(
                f"| {alloc} | {rec['path']} | {rec['world']} | {r['rank']} | "
                f"{_mib(r['rss_before_load'])} | {_mib(r['peak_during_load'])} | "
                f"{_mib(growth)} | {top['phase']} | {_mib(r.get('rss_after_trim'))} | "
                f"{_mib(r['optim_read_bytes'])} | {_mib(r['state_bytes'])} | "
                f"{_mib(r['model_shard_bytes'])} | {_mib(r['largest_stored_read'])} | "
                f"{_mib(_grow(step))} |"
            )
    lines += [
        "",
        "## The plain loop's phases against the bound (rank 0 of each launch, MiB)",
        "",
        "Each phase's growth is its peak over the RSS at its start. Bounds (next section): "
        "`get_state_dict`: zero gradients (model shard) + the state of its zero step + that "
        "step's scratch (not bounded here: a training step's); `dcp.load`: read + chunk; "
        "`set_state_dict`: live state + 5 B x the largest local tensor (`portable.restore`'s "
        "per-element absmax and codes copies) + `restore`'s scratch for one chunk "
        f"({_mib(RESTORE_SCRATCH)}). Read + restore: the higher peak of `dcp.load` and "
        "`set_state_dict` over the RSS before the load, against the zero step's state + read + "
        "max(chunk, the `set_state_dict` bound). Under glibc's default malloc the heap the zero "
        "step freed stays in RSS (the per-rank table's \"after trim\"), so the phases' "
        "growths mean the memory in use in the fixed mmap threshold's rows.",
        "",
        "| malloc | world | get_state_dict | bound w/o scratch | dcp.load | bound | "
        "set_state_dict | bound | read + restore | bound |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for rec in loads:
        if rec["path"] != "dcp":
            continue
        alloc = "default" if rec.get("malloc", "default") == "default" else "mmap 128K"
        r = rec["ranks"][0]
        g, d, s_ = (_phase(r, n) for n in ("get_state_dict", "dcp.load", "set_state_dict"))
        zero_state = g.get("state_bytes", 0)
        b_get = r["model_shard_bytes"] + zero_state
        b_load = r["optim_read_bytes"] + r["largest_stored_read"]
        b_set = r["state_bytes"] + 5 * r["largest_local_numel"] + RESTORE_SCRATCH
        both = max(d["peak"], s_["peak"]) - r["rss_before_load"]
        b_both = zero_state + r["optim_read_bytes"] + max(r["largest_stored_read"], b_set)
        lines.append(
            f"| {alloc} | {rec['world']} | {_mib(_grow(g))} | {_mib(b_get)} | {_mib(_grow(d))} | "
            f"{_mib(b_load)} | {_mib(_grow(s_))} | {_mib(b_set)} | {_mib(both)} | "
            f"{_mib(b_both)} |"
        )
    lines += ["", "Every phase (rank 0 of each launch; MiB):", ""]
    lines += [
        "| malloc | path | world | phase | RSS before | RSS after | peak | growth | s |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for rec in loads:
        alloc = "default" if rec.get("malloc", "default") == "default" else "mmap 128K"
        for p in rec["ranks"][0]["phases"]:
            lines.append(
                f"| {alloc} | {rec['path']} | {rec['world']} | {p['phase']} | "
                f"{_mib(p['rss_before'])} | {_mib(p['rss_after'])} | {_mib(p['peak'])} | "
                f"{_mib(p['peak'] - p['rss_before'])} | {p['seconds']} |"
            )
    lines += ["", BOUND_TEXT]
    out_p.mkdir(parents=True, exist_ok=True)
    (out_p / "dcp_memory.md").write_text("\n".join(lines) + "\n")
    (out_p / "dcp_memory.json").write_text(
        json.dumps(dict(meta=meta, save=saved, loads=loads), indent=1)
    )
    print("\n".join(lines))


BOUND_TEXT = """## The bound

What a rank of the plain loop holds beyond its model shard and live state, phase by phase:

- `get_state_dict` initialises the fresh optimizer by a zero-gradient step (torch's
  `_init_optim_state`): zero gradients of the model shard's size for the step's duration,
  Gefen's state from that step, and the step's own scratch, as in any training step. This
  phase, not the read, sets the load's peak; it stays below or near one training step's peak
  (the per-rank table's last column).
- `dcp.load`: the new shard's template, which `fit_template` sizes from the checkpoint's
  metadata: per parameter, the per-element fields at this rank's layout (`codes` unpacked, 1
  byte an element, or `exp_avg` and `exp_avg_sq` where B = 1), the saved block values (`v`,
  `absmax`, `pieces`) of the saving ranks' ranges its rows meet, and the small shared fields
  (`step`, `codebook`, `block`, `v_cross`): the "read (optim)" column, about 1 byte a local
  element. DCP's `FileSystemReader` adds one stored item in flight: it `torch.load`s each saved
  chunk a read meets whole, then narrows it ("chunk": here a saving rank's piece of the fp32
  embedding, 4 B x 50304 x 768 / 2, which the model's read brings).
- `set_state_dict`: the live state built from the template while the template is held, and per
  tensor, while that tensor is restored, `portable.restore`'s per-element fp32 copy of the saved
  absmax and uint8 copy of the codes (5 B x the tensor's local elements), plus its scratch for
  one chunk of 2^20 elements; the zero step's state is then replaced.

So, over what it held before, a rank's growth during the load is at most

    zero step's state + max(model shard + step scratch,
                            read + max(chunk, live state + 5 B x largest local tensor + scratch))

all of them sizes of this rank's new shard (and one saved chunk): none grows with the
parameters other ranks hold. The old path (`read_dcp` + `consolidate` + `load_optimizer`)
reads every saving rank's state into every rank and consolidates the whole model's state there
before each rank cuts its piece: its growth is the whole checkpoint's optimizer state plus the
whole consolidated state (and `restore`'s 5 B x the largest whole tensor), the same on every
rank at every world size.
"""


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["save"], ["load"]):
        _launch(argv)
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("run", help="every launch in turn, then the report")
    r.add_argument("--ck", default="/tmp/dcp_memory_ck")
    r.add_argument("--work", default=None, help="launch records (default CK-work)")
    r.add_argument("--out", default="results/checkpoints")
    r.add_argument("--worlds", default=",".join(str(w) for w in LOAD_WORLDS))
    r.add_argument("--skip-save", action="store_true", help="reuse WORK/save.json and CK")
    r.add_argument("--shape", default=SHAPE, help="layers,heads,width,vocab (a smoke test)")
    p = sub.add_parser("report", help="the report from the launches' records")
    p.add_argument("work")
    p.add_argument("out", nargs="?", default="results/checkpoints")
    a = ap.parse_args(argv)
    if a.mode == "run":
        drive(a)
    else:
        report(a.work, a.out)


if __name__ == "__main__":
    main()
