"""The GPU path in one go, most informative first, inside a hard deadline: what it has is on disk.

On a lent H200, from the repository root, with nothing installed (allow the command 330 s, and
carry the git-ignored ``.peers`` folder where ``--fetch-peers`` made one: docs/gpu.md):

    PYTHONPATH=. timeout -s INT 300 python3 launch/gpu_check.py --out "$OUT"

It stops itself at ``--budget-s`` (270 s by default) and ``timeout`` backs that up. With the
machine's start (1-2 minutes) one run takes at most about 7.5 of the 15 device-minutes, leaving
a rerun.

On the CPU, the same script under Triton's interpreter (``TRITON_INTERPRET=1``: the kernels run
on CPU tensors, slowly, so ``--interpret`` picks tiny sizes by itself); CI runs it this way:

    python launch/gpu_check.py --interpret --out DIR

In order, each item a result of its own:

0. the environment: here nvidia-smi, gcc, Python.h and the packages' versions (no torch); then
   in the worker torch's view of the device, its copy bandwidth and a one-line Triton kernel
   compiled and run;
1. the kernels against the reference update on awkward layouts (prime sizes, B = 1, odd block
   sizes and starts, a block of many tiles, many short blocks, column blocks whole and in
   pieces, several tensors' pieces in one flat buffer as FSDP/ZeRO hand them), 4 and 8 bits,
   fp32/bf16/fp16 parameters; the device's g0 histogram against the CPU's;
2. the whole optimizer on the device against the CPU (partition, codebook, state bytes, three
   steps, a resumed checkpoint), on the demo GPT and on the MoE LM's grouped experts (batches
   of matrices, factored per matrix);
3. one step on ~1B parameters (16 matrices of 8192 x 8192), fp32: fused AdamW, then Gefen
   4-bit, each with its construction and first step timed apart from the median ordinary step;
4. the same in bf16, then Gefen 8-bit in fp32 and bf16;
5. on a GPU, launch/train.py on one NCCL rank under DDP and under FSDP2, resumed from its own
   checkpoint (90 s each at most);
6. fused AdamW and Gefen on GPT-2 124M's 148 tensors (fp32), where per-tensor host work shows;
7. bitsandbytes AdamW8bit and torchao AdamW8bit/4bit on the 1B set, where they import.

Each item runs in a worker process (launch/gpu_items.py) that this one watches and never joins
on the device: an item gets at most its own cap and never past the deadline, and one that
overruns or kills its worker is recorded as such and the next item starts in a fresh worker.
After every result ``gpu_check.json`` and ``gpu_check.md`` in ``--out`` are rewritten (a temp
file renamed over the old) and the result is printed as one JSON line; the workers' output goes
to stderr and ``gpu_check.log``. So SIGINT or SIGTERM (the report then says ``interrupted``),
the deadline (``deadline``) or SIGKILL at any moment leave a readable report of what finished.

Exit status: 0 all ran and passed; 1 a check failed, or Gefen or fused AdamW failed to step; 2
stopped early (deadline, signal) with nothing failed. Under the interpreter the times are the
interpreter's, not a GPU's: no speed goal is judged.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import selectors
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).resolve().parent / "gpu_items.py"

GOAL_RATIO_4 = 0.6  # Gefen 4-bit's step at most this times fused AdamW's, on the 1B set
GOAL_RATIO_8 = 0.8  # Gefen 8-bit's
GOAL_COPY = 0.70  # Gefen 4-bit at least this share of the device's copy bandwidth
GOAL_FIRST = 10.0  # Gefen's first step (partition, histogram, codebook) at most this many steps
BUDGET_S = 270.0
BUDGET_INTERPRET_S = 3600.0  # the interpreter's default: its speed is the host's
STARTUP_S = 120.0  # a worker's imports before its first item, at most
LOG_CAP = 8 << 20  # gpu_check.log's most bytes: a file that comes back must stay small
INTERPRET_CAPS = 10.0
"""Under the interpreter every cap is this many times a GPU's (the deadline still holds): its
speed is the host's, and a shared CI machine's varies."""
PEERS = {"torchao": "0.17.0", "bitsandbytes": "0.50.2"}
"""The peers' versions ``--fetch-peers`` installs: torchao 0.17 is the one built against torch
2.11 (the H200's); bitsandbytes ships its CUDA 13 library."""
PEER_PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64"]
PEER_KEEP = ("libbitsandbytes_cpu.so", "libbitsandbytes_cuda13")
"""bitsandbytes' own libraries kept: it loads the one for torch's CUDA (13.0 on the H200); those
for CUDA 11/12, ROCm and XPU (115 MiB unpacked) are left out."""

LAYOUT_NAMES = ["prime", "rows", "odd_start_odd_block", "long_block", "short_blocks", "columns",
                "column_pieces", "flat_shard"]  # fmt: skip
DTYPES = ("float32", "bfloat16", "float16")


@dataclasses.dataclass(frozen=True)
class Item:
    """One thing the kit runs and reports: ``section`` is the report's list it goes to,
    ``cap_s`` the most it may take, ``args`` what the worker needs (launch/gpu_items.py)."""

    name: str
    section: str
    cap_s: float
    args: dict

    def job(self) -> dict:
        return dict(name=self.name, **self.args)


@dataclasses.dataclass(frozen=True)
class Sizes:
    """What the items step: ``tensors`` matrices of ``rows`` x ``rows``, GPT-2's tensors at
    ``gpt2`` (gpu_items.gpt2_shapes), the interpreter's layouts where ``small_layouts``."""

    rows: int
    tensors: int
    steps: int
    warmup: int
    gpt2: str
    small_layouts: bool
    copy_numel: int


def sizes(scale: float | None, steps: int | None, interpret: bool) -> Sizes:
    """16 x 8192 x 8192 = 1.07B parameters at scale 1, the default on a device; under the
    interpreter (which steps a few thousand elements a second) 16 x 16 x 16 unless ``scale``
    says otherwise."""
    if scale is None:
        scale = 4e-6 if interpret else 1.0
    if scale <= 0:
        raise SystemExit(f"--scale must be > 0, got {scale}")
    least = 16 if interpret else 64
    rows = max(least, int(8192 * scale**0.5) // least * least)
    gpt2 = "tiny" if interpret else ("124m" if scale >= 1 else "narrow")
    return Sizes(
        rows=rows,
        tensors=16,
        steps=steps or (2 if interpret else 20),
        warmup=1 if interpret else 3,
        gpt2=gpt2,
        small_layouts=interpret,
        copy_numel=min(2**28, 16 * rows * rows) if not interpret else 2**22,
    )


def items(device: str, interpret: bool) -> list[Item]:
    """Every item, most informative first (the module docstring's list)."""
    gpu = device == "cuda"
    out = [Item("probe", "probe", 90, dict(kind="probe"))]
    for i, name in enumerate(LAYOUT_NAMES):
        for j, bits in enumerate((4, 8)):
            # the interpreter takes each layout at both widths and the three dtypes in turn
            # (every dtype meets every width over the layouts); a GPU takes every combination
            for dtype in (DTYPES[(2 * i + j) % 3],) if interpret else DTYPES:
                args = dict(kind="equal", layout=name, bits=bits, dtype=dtype)
                # the first launches compile every kernel variant on a GPU
                cap = 180 if i == j == 0 and dtype == "float32" else 60
                out.append(Item(f"equal/{name}/{bits}b/{dtype}", "checks", cap, args))
    out.append(Item("histogram", "checks", 60, dict(kind="histogram")))
    out.append(Item("optimizer", "checks", 120, dict(kind="optimizer")))
    out.append(Item("optimizer/moe", "checks", 120, dict(kind="optimizer", model="moe")))

    def step(opt: str, dtype: str, kind: str = "matrices", cap: float = 120) -> Item:
        args = dict(kind="step", optimizer=opt, dtype=dtype, set=kind)
        return Item(f"step/{kind}/{dtype}/{opt}", "timings", cap, args)

    out += [step("adamw_fused", "float32"), step("gefen4", "float32")]
    out += [step("adamw_fused", "bfloat16"), step("gefen4", "bfloat16")]
    out += [step("gefen8", "float32"), step("gefen8", "bfloat16")]
    if gpu:
        for mode in ("ddp", "fsdp2"):
            args = dict(kind="train", mode=mode, timeout_s=90)
            out.append(Item(f"train/{mode}", "checks", 95, args))
    out += [step(o, "float32", "gpt2_124m", 60) for o in ("adamw_fused", "gefen4", "gefen8")]
    # under the interpreter the peers run on the CPU: their path once, not their speed
    for dtype in ("float32",) if interpret else ("float32", "bfloat16"):
        out += [step(p, dtype, cap=90) for p in PEER_NAMES]
    if interpret:
        out = [dataclasses.replace(it, cap_s=it.cap_s * INTERPRET_CAPS) for it in out]
    return out


PEER_NAMES = ("bnb_adamw8bit", "torchao_adamw8bit", "torchao_adamw4bit")


def select(all_items: list[Item], only: str | None) -> list[Item]:
    """The items whose names start with one of ``only``'s comma-separated prefixes (``probe``
    always comes first: the rest is read against it)."""
    if not only:
        return all_items
    prefixes = [p.strip() for p in only.split(",") if p.strip()]
    picked = [it for it in all_items if it.name == "probe" or it.name.startswith(tuple(prefixes))]
    if len(picked) == 1 and prefixes != ["probe"]:
        names = ", ".join(sorted({it.name.split("/")[0] for it in all_items}))
        raise SystemExit(f"--only {only!r} matches no item (they start with: {names})")
    return picked


# ------------------------------------------------------------------------ host (no torch)


def _run(cmd: list[str], timeout: float = 10) -> str:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return (r.stdout or r.stderr).strip()
    except FileNotFoundError:
        return "not found"
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def _version(name: str, paths: list[str]) -> str | None:
    for dist in importlib.metadata.distributions(path=paths):
        if (dist.metadata["Name"] or "").lower().replace("_", "-") == name:
            return dist.version
    return None


def host_probe(env_path: list[str]) -> dict:
    """What the host has, without importing torch (a probe that cannot crash the kit): the GPU
    as nvidia-smi sees it, the C compiler and Python.h Triton builds its launcher with, and the
    versions the worker's sys.path will import."""
    include = sysconfig.get_paths().get("include", "")
    paths = env_path + sys.path
    out = dict(
        python=platform.python_version(),
        executable=sys.executable,
        machine=platform.machine(),
        cpus=os.cpu_count(),
        nvidia_smi=_run(
            [
                "nvidia-smi",
                "--query-gpu=name,driver_version,memory.total,clocks.max.sm,"
                "clocks.max.mem,power.limit",
                "--format=csv,noheader",
            ]  # fmt: skip
        ),
        gcc=(_run(["gcc", "--version"]) + "\n").splitlines()[0]
        if shutil.which("gcc")
        else "not found",
        cc=shutil.which("cc") or "not found",
        python_h=str(Path(include) / "Python.h")
        if (Path(include) / "Python.h").exists()
        else f"not found in {include!r}",
        nvcc=("\n" + _run(["nvcc", "--version"])).splitlines()[-1]
        if shutil.which("nvcc")
        else "not found",
        packages={n: _version(n, paths) for n in ("torch", "triton", "numpy", *PEERS)},
        git=_run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]),
    )
    return out


# ------------------------------------------------------------------------------- the parent


class Kit:
    """Runs the items in workers inside the deadline and keeps the report on disk."""

    def __init__(self, a: argparse.Namespace, chosen: list[Item], sz: Sizes) -> None:
        self.a = a
        self.items = chosen
        self.sizes = sz
        self.t0 = time.monotonic()
        self.deadline = self.t0 + a.budget_s
        self.stop: str | None = None
        self.out: Path = a.out
        self.log = open(self.out / "gpu_check.log", "wb", buffering=0)  # noqa: SIM115
        peers = a.peers / "site" if a.peers else None
        self.peers = peers if peers and peers.is_dir() else None
        self.report: dict = dict(
            kit=2,
            command=" ".join([Path(sys.executable).name, *sys.argv]),
            started=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            status="running",
            budget_s=a.budget_s,
            device=a.device_kind,
            interpret=a.interpret,
            sizes=dataclasses.asdict(sz),
            peers_dir=str(self.peers) if self.peers else None,
            host={},
            probe={},
            checks=[],
            timings=[],
            not_run=[],
            workers=[],
        )

    # -- report

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def write(self) -> None:
        r = self.report
        r["elapsed_s"] = round(time.monotonic() - self.t0, 3)
        checks = r["checks"] + ([r["probe"]] if r["probe"] else [])
        r["checks_ok"] = all(c.get("ok") for c in checks if not _cut(c))
        r["timings_ok"] = not any("error" in t for t in r["timings"])
        r["kernels"] = kernels(r)
        r["goals"] = goals(r)
        _atomic(self.out / "gpu_check.json", json.dumps(r, indent=1, default=str) + "\n")
        _atomic(self.out / "gpu_check.md", markdown(r))

    def record(self, item: Item, result: dict, took: float) -> None:
        result = dict(item=item.name, **result, s=round(took, 3))
        result["at_s"] = round(time.monotonic() - self.t0, 3)
        if item.section == "probe":
            self.report["probe"] = result
        else:
            self.report[item.section].append(result)
        self.write()
        print(json.dumps(result, default=str), flush=True)

    # -- workers

    def _spawn(self, todo: list[Item]) -> tuple[subprocess.Popen, int]:
        read, write = os.pipe()
        env = dict(os.environ)
        path = [str(ROOT), *([str(self.peers)] if self.peers else [])]
        env["PYTHONPATH"] = os.pathsep.join([*path, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        env["PYTHONUNBUFFERED"] = "1"
        if self.a.interpret:
            env["TRITON_INTERPRET"] = "1"
        else:
            env.pop("TRITON_INTERPRET", None)
        if self.peers:  # torchao's C++ ops are for another build of torch than most: not needed
            env.setdefault("TORCHAO_FORCE_SKIP_LOADING_SO_FILES", "1")
        cmd = [sys.executable, str(WORKER), "--fd", str(write), "--parent", str(os.getpid())]
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            pass_fds=(write,),
            env=env,
            cwd=ROOT,
            start_new_session=True,  # its own group: the parent alone decides when it stops
        )
        os.close(write)
        job = dict(config=self.config(), items=[it.job() for it in todo])
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(job).encode())
        proc.stdin.close()
        self.report["workers"].append(dict(pid=proc.pid, first=todo[0].name))
        self.write()
        return proc, read

    def config(self) -> dict:
        sz = self.sizes
        return dict(
            device=self.a.device_kind,
            small=sz.small_layouts,
            rows=sz.rows,
            tensors=sz.tensors,
            steps=sz.steps,
            warmup=sz.warmup,
            gpt2=sz.gpt2,
            copy_numel=sz.copy_numel,
        )

    def _kill(self, proc: subprocess.Popen) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()

    def run(self) -> None:
        self.report["host"] = host_probe([str(self.peers)] if self.peers else [])
        self.write()
        todo = list(self.items)
        fatal = None
        while todo and self.stop is None and self.left() > 1 and fatal is None:
            todo, fatal = self._one_worker(todo)
        if not todo:
            status = "complete"
        elif self.stop or fatal:
            status = self.stop or fatal
        else:
            status = "deadline"
        self.report["status"] = why = status
        self.report["not_run"] = [dict(item=it.name, why=why) for it in todo]
        self.write()
        self.log.close()

    def _one_worker(self, todo: list[Item]) -> tuple[list[Item], str | None]:
        """Run ``todo`` in one worker until it finishes, dies, overruns an item or the deadline
        or a signal comes: the items still to run, and why no other worker should start where
        this one never started an item."""
        proc, fd = self._spawn(todo)
        byname = {it.name: it for it in todo}
        sel = selectors.DefaultSelector()
        assert proc.stdout is not None
        sel.register(fd, selectors.EVENT_READ, "events")
        sel.register(proc.stdout, selectors.EVENT_READ, "output")
        buf = b""
        current: Item | None = None
        began = time.monotonic()
        startup = STARTUP_S * (INTERPRET_CAPS if self.a.interpret else 1)
        limit = min(startup, max(0.0, self.left()))
        ended = "finished"
        started = False
        fatal = None
        open_fds = 2
        while open_fds:
            for key, _ in sel.select(timeout=0.2):
                data = os.read(key.fd, 1 << 16)
                if not data:
                    sel.unregister(key.fileobj)
                    open_fds -= 1
                    continue
                if key.data == "output":
                    sys.stderr.buffer.write(data)
                    sys.stderr.flush()
                    if self.log.tell() < LOG_CAP:
                        self.log.write(data[: LOG_CAP - self.log.tell()])
                    continue
                buf += data
                while b"\n" in buf:
                    line, buf = buf.split(b"\n", 1)
                    ev = json.loads(line)
                    item = byname[ev["item"]]
                    if ev["event"] == "start":
                        current, began, started = item, time.monotonic(), True
                        limit = min(item.cap_s, max(0.0, self.left()))
                        self.report["current"] = item.name
                        self.write()
                    else:
                        self.record(item, ev["result"], time.monotonic() - began)
                        todo = todo[todo.index(item) + 1 :]
                        current, began = None, time.monotonic()
                        limit = min(startup, max(0.0, self.left()))
                        self.report.pop("current", None)
                        if item.section == "probe" and "error" in ev["result"]:
                            fatal = "stopped: the probe raised (no usable device: probe.error)"
            if fatal or self.stop or time.monotonic() - began > limit:
                if fatal:
                    ended = fatal
                elif self.stop:
                    ended = self.stop
                elif current is None:
                    ended = "deadline" if self.left() <= 1 else "no item started in time"
                else:
                    ended = "deadline" if self.left() <= 1 else f"over its cap of {current.cap_s} s"
                self._kill(proc)
                break
        rc = proc.wait()
        for key in list(sel.get_map().values()):
            sel.unregister(key.fileobj)
        os.close(fd)
        proc.stdout.close()
        self.report["workers"][-1].update(rc=rc, ended=ended)
        if current is not None:  # it started and never reported: it cost the worker
            took = time.monotonic() - began
            self.report.pop("current", None)
            if _cut(dict(stopped=ended)):  # not the item's fault: it ran out of time
                self.record(current, dict(stopped=ended), took)
            else:
                why = (
                    f"the worker died (exit status {rc}) during it: see gpu_check.log"
                    if ended == "finished"
                    else f"stopped after {took:.0f} s: {ended}"
                )
                self.record(current, dict(ok=False, error=why, stopped=ended), took)
            todo = todo[todo.index(current) + 1 :]
        elif not started and ended in ("finished", "no item started in time"):
            why = f"a worker started no item ({ended}, exit status {rc}): see gpu_check.log"
            self.report["workers"][-1]["error"] = why
            self.write()
            return todo, why
        return todo, fatal


def _cut(result: dict) -> bool:
    """Stopped by the deadline or a signal: neither passed nor failed."""
    why = result.get("stopped") or ""
    return why == "deadline" or why.startswith("interrupted")


def _atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


# ------------------------------------------------------------------------- judging, markdown


def _timing(r: dict, opt: str, dtype: str, kind: str = "matrices") -> dict | None:
    for t in r["timings"]:
        if t["item"] == f"step/{kind}/{dtype}/{opt}" and "median_ms" in t:
            return t
    return None


def kernels(r: dict) -> dict:
    """Which of the kernels' compiled variants the items launched (under the interpreter:
    ran), against every variant the launchers use."""
    every = r["probe"].get("variants") or []
    ran = sorted({v for c in r["checks"] + r["timings"] for v in c.get("variants_run", [])})
    return dict(ran=len(ran), of=len(every), missing=[v for v in every if v not in ran])


def goals(r: dict) -> dict:
    """The issue's goals for Gefen on the 1B set, per dtype (speed: only on a device), and
    what must hold anywhere it ran: the state's bytes as on the CPU, training and resuming
    under DDP and FSDP2. A goal whose items did not run says so."""
    out: dict = {}
    copy = r["probe"].get("copy_bytes_per_s")
    for dtype in ("float32", "bfloat16"):
        base = _timing(r, "adamw_fused", dtype)
        for bits, limit in ((4, GOAL_RATIO_4), (8, GOAL_RATIO_8)):
            g = _timing(r, f"gefen{bits}", dtype)
            key = f"gefen{bits}_{dtype}_x_adamw"
            if base and g:
                x = g["median_ms"] / base["median_ms"]
                out[key] = dict(value=x, limit=limit, met=x <= limit)
            else:
                out[key] = dict(met=None, why="gefen or fused AdamW did not step")
        g = _timing(r, "gefen4", dtype)
        key = f"gefen4_{dtype}_copy_share"
        if g and copy:
            share = g["bytes_per_s"] / copy
            out[key] = dict(value=share, limit=GOAL_COPY, met=share >= GOAL_COPY)
        else:
            out[key] = dict(met=None, why="gefen4 did not step or no copy bandwidth")
        key = f"gefen4_{dtype}_first_step_x"
        if g:
            x = g["first_step_x"]
            out[key] = dict(value=x, limit=GOAL_FIRST, met=x <= GOAL_FIRST)
        else:
            out[key] = dict(met=None, why="gefen4 did not step")
    if r["interpret"]:
        for v in out.values():
            v.update(met=None, why="Triton interpreter on the CPU: not a GPU's times")
    opt = next((c for c in r["checks"] if c["item"] == "optimizer"), None)
    out["state_bytes_as_cpu"] = (
        dict(value=opt.get("state_bytes_per_param"), met=opt.get("state_bytes_equal"))
        if opt and "state_bytes_equal" in opt
        else dict(met=None, why="the optimizer check did not finish")
    )
    for mode in ("ddp", "fsdp2"):
        t = next((c for c in r["checks"] if c["item"] == f"train/{mode}"), None)
        if t is None:
            why = "runs on a GPU only" if r["device"] != "cuda" else "did not run"
            out[f"train_{mode}_resumes"] = dict(met=None, why=why)
        else:
            out[f"train_{mode}_resumes"] = dict(
                met=bool(t.get("ok")),
                resumed_equal=t.get("resumed_equal"),
                max_val_loss_diff=t.get("max_val_loss_diff"),
            )
    return out


def _fmt(x, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def markdown(r: dict) -> str:
    p, h = r["probe"], r["host"]
    smi = h.get("nvidia_smi") or ""
    gpu = smi.split(",")[0] if smi and "not found" not in smi and ":" not in smi else None
    lines = [f"# launch/gpu_check.py on {p.get('device') or gpu or r['device']}"]
    lines += ["", f"`{r['command']}`", ""]
    lines.append(
        f"Status: **{r['status']}** after {r.get('elapsed_s', 0):.0f} s of a {r['budget_s']:.0f} s"
        f" budget; started {r['started']}."
    )
    if r["interpret"]:
        lines.append("Under Triton's interpreter on the CPU: the times are not a GPU's.")
    pk = h.get("packages", {})
    lines += [
        "",
        f"Python {h.get('python')}, torch {pk.get('torch')} (CUDA {p.get('torch_cuda')}), "
        f"triton {pk.get('triton')}, numpy {pk.get('numpy')}; gcc: {h.get('gcc')}; Python.h: "
        f"{h.get('python_h')}; nvidia-smi: {h.get('nvidia_smi')}",
    ]
    if p.get("error") or p.get("stopped"):
        why = (p.get("error") or p.get("stopped") or "").strip().splitlines()[-1:]
        lines.append(f"The probe did not finish: {' '.join(why)}")
    elif p:
        lines.append(
            f"Copy bandwidth {_fmt((p.get('copy_bytes_per_s') or 0) / 1e9, '.0f')} GB/s; a "
            f"one-line Triton kernel {'ran' if p.get('smoke_ok') else 'FAILED'} in "
            f"{_fmt(p.get('smoke_s'))} s; backend: {p.get('backend_error') or 'triton'}."
        )
    have = {n: p.get(n, pk.get(n)) for n in PEERS}
    have = {n: v for n, v in have.items() if v and not str(v).startswith("not importable")}
    parts = [f"{n} {v}" for n, v in have.items()]
    if have:
        parts[-1] += f" (from {r['peers_dir'] or 'the environment'})"
    parts += [f"{n} not importable, its timings skipped" for n in PEERS if n not in have]
    if not r["peers_dir"] and len(have) < len(PEERS):
        parts[-1] += " (no .peers folder was carried: docs/gpu.md)"
    lines.append("Peers: " + "; ".join(parts) + ".")
    checks = r["checks"]
    cut = [c for c in [p, *checks, *r["timings"]] if c and _cut(c)]
    bad = [c for c in checks if not c.get("ok") and not _cut(c)]
    k = r.get("kernels", {})
    lines += ["", f"Checks: {len(checks) - len(bad) - len(cut)}/{len(checks)} ok"]
    if k.get("ran"):
        lines[-1] += f"; kernel variants launched {k['ran']}/{k['of']}" + (
            f" (not: {', '.join(k['missing'])})" if k.get("missing") else ""
        )
    for c in bad:
        lines.append(f"- FAILED {c['item']}: {json.dumps(c, default=str)[:600]}")
    for c in cut:
        lines.append(f"- {c['item']}: {c['stopped']} after {c['s']:.0f} s")
    for c in checks:
        if c["item"] == "optimizer" and c.get("ok"):
            lines.append(
                f"- optimizer: layouts, codebooks and state bytes "
                f"({_fmt(c.get('state_bytes_per_param'), '.3f')}/param) equal to the CPU's; "
                f"resumed equal; parameters off {c['p_off_frac']:.1e}"
            )
        if c["item"].startswith("train/") and c.get("ok"):
            lines.append(
                f"- {c['item']}: val loss {_fmt(c.get('val_loss'), '.4f')} after a resume from "
                f"step {c.get('resumed_from_step')}; bit for bit as uninterrupted: "
                f"{c.get('resumed_equal')}"
            )
    if r["timings"]:
        lines += [
            "",
            "| set | dtype | optimizer | median step | x fused AdamW | first step | first / "
            "step | build | host | device ops | GB/s | % of copy |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        copy = p.get("copy_bytes_per_s")
        for t in r["timings"]:
            _, kind, dtype, opt = t["item"].split("/")
            head = f"| {kind} | {dtype} | {opt} {t.get('backend', '')}"
            if "median_ms" not in t:
                why = t.get("skipped") or t.get("error") or t.get("stopped") or "?"
                what = "ERROR" if "error" in t else "not finished" if _cut(t) else "skipped"
                lines.append(f"{head} | {what}: {str(why)[:80]} |" + " |" * 10)
                continue
            base = _timing(r, "adamw_fused", dtype, kind)
            ratio = f"{t['median_ms'] / base['median_ms']:.2f}x" if base else "-"
            share = f"{100 * t['bytes_per_s'] / copy:.0f} %" if copy else "-"
            lines.append(
                f"{head} | {t['median_ms']:.2f} ms | {ratio} | {t['first_step_s']:.2f} s | "
                f"{t['first_step_x']:.1f} | {t['build_s']:.2f} s | {t['host_ms']:.2f} ms | "
                f"{_fmt(t.get('device_ops'), 'd')} | {t['bytes_per_s'] / 1e9:.0f} | {share} |"
            )
    g = r.get("goals", {})
    if g:
        lines += ["", "Goals:"]
        for key, v in g.items():
            if v.get("met") is None:
                lines.append(f"- {key}: not judged ({v.get('why')})")
            else:
                val = f"{v['value']:.3g}" if isinstance(v.get("value"), float) else v.get("value")
                lim = f" (limit {v['limit']})" if "limit" in v else ""
                lines.append(f"- {key}: {'met' if v['met'] else 'MISSED'}, {val}{lim}")
    if r["not_run"]:
        lines += ["", f"Not run ({r['not_run'][0]['why']}): " + ", ".join(
            n["item"] for n in r["not_run"])]  # fmt: skip
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------- peers


def fetch_peers(dest: Path) -> None:
    """Install the peers for the H200 (Python 3.12, x86-64, CUDA 13) into ``dest``/site with
    pip, on a machine with the network, for ``run`` to carry (the device has none)."""
    site = dest / "site"
    if site.exists():
        shutil.rmtree(site)
    plat = [f"--platform={p}" for p in PEER_PLATFORMS]
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile",
           "--only-binary=:all:", "--implementation=cp", "--python-version=3.12", *plat,
           "--target", str(site), *(f"{n}=={v}" for n, v in PEERS.items())]  # fmt: skip
    subprocess.run(cmd, check=True)
    dropped = 0
    for lib in (site / "bitsandbytes").glob("libbitsandbytes_*"):
        if not lib.name.startswith(PEER_KEEP):
            dropped += lib.stat().st_size
            lib.unlink()
    size = sum(f.stat().st_size for f in site.rglob("*") if f.is_file())
    print(f"{site}: {size / 2**20:.1f} MiB ({dropped / 2**20:.1f} MiB of libraries left out)")


# ------------------------------------------------------------------------------------ main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="the folder for gpu_check.json/.md/.log")
    ap.add_argument("--device", default="cuda", help="cuda (or cpu with --interpret)")
    ap.add_argument(
        "--scale",
        type=float,
        help="fraction of the 1B-parameter set (default: 1; "
        "under --interpret 16 matrices of 16 x 16)",
    )
    ap.add_argument("--steps", type=int, help="timed steps (default 20; --interpret: 2)")
    ap.add_argument(
        "--budget-s",
        type=float,
        help=f"hard deadline in seconds from the start: nothing runs past it (default "
        f"{BUDGET_S:.0f}; --interpret: {BUDGET_INTERPRET_S:.0f})",
    )
    ap.add_argument("--only", help="comma-separated item prefixes, e.g. equal,optimizer")
    ap.add_argument("--checks-only", action="store_true", help="the probe and the checks")
    ap.add_argument(
        "--interpret",
        action="store_true",
        help="the Triton kernels under Triton's interpreter on CPU tensors",
    )
    ap.add_argument(
        "--peers",
        type=Path,
        default=ROOT / ".peers",
        help="where --fetch-peers puts them and the kit looks (default .peers)",
    )
    ap.add_argument(
        "--fetch-peers",
        action="store_true",
        help="install bitsandbytes and torchao for the H200 into --peers, then exit",
    )
    a = ap.parse_args()
    if a.fetch_peers:
        fetch_peers(a.peers)
        return
    if a.out is None:
        ap.error("--out is required")
    if a.budget_s is None:
        a.budget_s = BUDGET_INTERPRET_S if a.interpret else BUDGET_S
    if a.budget_s <= 0:
        ap.error(f"--budget-s must be > 0, got {a.budget_s}")
    if a.steps is not None and a.steps < 1:
        ap.error(f"--steps must be >= 1, got {a.steps}")
    a.device_kind = "cpu" if a.interpret else a.device
    if a.device_kind not in ("cuda", "cpu"):
        ap.error(f"--device must be cuda or cpu, got {a.device!r}")
    if a.device_kind == "cpu" and not a.interpret:
        ap.error("--device cpu runs the kernels only under --interpret")
    sz = sizes(a.scale, a.steps, a.interpret)
    chosen = items(a.device_kind, a.interpret)
    chosen = select(chosen, "equal,histogram,optimizer,train" if a.checks_only else a.only)
    a.out.mkdir(parents=True, exist_ok=True)
    kit = Kit(a, chosen, sz)

    def on_signal(signum, _frame) -> None:
        kit.stop = f"interrupted: {signal.Signals(signum).name}"

    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, on_signal)
    kit.run()
    r = kit.report
    print(markdown(r), flush=True)
    failed = not r["checks_ok"] or not r["timings_ok"]
    sys.exit(1 if failed else 0 if r["status"] == "complete" else 2)


if __name__ == "__main__":
    main()
