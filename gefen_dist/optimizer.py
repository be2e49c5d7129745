"""``gefen_dist.Gefen``: a drop-in for ``torch.optim.AdamW`` with ~1 byte of state per parameter.

At the first step at which a parameter has a gradient, its block size is chosen from g0^2
(``partition``); at the first step of all, the codebook of m is learned once from a histogram of
block-normalised g0 (``codebook``). Later steps run the update ``reference`` spells out over the
parameter's segments (``segments``, ``state``), through the native kernels where they serve
(``native_cpu``, ``triton_backend``; see ``Gefen.backend``). The optimizer never needs names, shapes
beyond the tensors' own, or any setting AdamW does not have, other than ``bits``.

``step`` reads top to bottom: the kept C++ tables where they fit (``cpu_plan``), the first step
of parameters that have no state yet (``first_step``), then every segment's update: this step's
cross factors (``backends/cross``), then one call per backend. Distributed integrations hand the
optimizer each buffer's segments (``set_segments``) and reach it through ``extension`` only; the
first step merges its statistics over the process group, so every rank chooses the same blocks
and learns the same codebook.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.optim import Optimizer

from . import extension, first_step, memory_report, validation
from .backends import cross, dispatch, native_cpu, triton_backend
from .backends.cpu_plan import CpuPlan
from .backends.reference import block_update, column_update, dense_update
from .backends.work import Origin, SegmentWork, StepItem
from .distributed import collectives, sharding
from .method import portable, state
from .method.codes import midpoints
from .method.hyper import Hyper
from .method.segments import Segment, by_matrix

BACKENDS = dispatch.BACKENDS

DEFAULT_BITS = 4
"""Measured on the demo GPT (4 layers, d=256, stdlib source), 1000 steps, 3 paired seeds vs
AdamW: 4-bit +0.81 % +- 0.28 validation loss at 0.56 bytes/param, 8-bit +1.08 % +- 0.14 at 1.05
(``launch/sharing_study.py --steps 1000 --seeds 3 --extra '{"batch_size": 8}'``): the second
moment's sharing costs what there is to lose, the 4-bit learned codebook costs nothing
measurable, so the default is the half-size state."""


class Gefen(Optimizer):
    """AdamW with a block-shared second moment and a learned-codebook first moment.

    Arguments are those of ``torch.optim.AdamW`` (same defaults) plus ``bits`` (4, the default,
    or 8: the width of the stored first-moment codes; 4-bit codes are packed two per byte) and
    ``bf16_stochastic_round`` (False, the default; torchao's name): bf16 parameters are written
    rounded stochastically, unbiased between the two neighbouring bf16 values, instead of to the
    nearest, so that updates under half a bf16 spacing still move pure-bf16 weights on average
    (docs/bf16.md). The draw is a counter hash of (step, the element's index in its tensor), so
    every backend, rank layout and resumed run rounds alike. fp32 and fp16 parameters are
    written as without it. A param group setting, kept in the state dict.
    ``amsgrad``, ``capturable`` and ``differentiable`` are not supported; ``foreach`` and
    ``fused`` are accepted so that a one-line swap from AdamW works, and change nothing.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]] | Iterable[tuple[str, Any]],
        lr: float | torch.Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        bits: int = DEFAULT_BITS,
        bf16_stochastic_round: bool = False,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
    ) -> None:
        if amsgrad:
            raise ValueError("Gefen does not support amsgrad=True (it keeps no per-element max v)")
        if capturable or differentiable:
            raise ValueError("Gefen does not support capturable=True or differentiable=True")
        defaults = dict(
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            bits=bits,
            maximize=maximize,
            bf16_stochastic_round=bf16_stochastic_round,
        )
        self._segments: dict[torch.Tensor, list[Segment]] = {}
        self._codebooks: dict[int, torch.Tensor] = {}
        self._group: dist.ProcessGroup | None = None
        self._spans: dict[torch.Tensor, tuple[int, ...]] = {}  # spread params' ranks (_use_group)
        self._initialized = False
        self._display: dict[torch.Tensor, str] = {}
        self._backend = "auto"
        self._warned: set[str] = set()
        self._views: dict[torch.Tensor, _Prepared] = {}
        self._codebook_copies: dict[tuple[int, str], torch.Tensor] = {}
        self._pending_install: list[tuple[torch.Tensor, dict]] = []
        self._cross_slots: dict[str, cross.Slot] | None = None
        self._plan: CpuPlan | None = None  # the last step's C++ tables, for the next
        self._adopted: list[list[torch.Tensor]] = []  # the groups' params _adopt saw
        self._attached: dict[str, Any] = {}  # integrations' configuration (``attach``)
        super().__init__(params, defaults)
        self.register_load_state_dict_pre_hook(Gefen._stash_state)
        self.register_load_state_dict_post_hook(Gefen._install_state)
        self._adopt()
        extension.constructed(self)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        validation.check_hyper({**self.defaults, **param_group})
        super().add_param_group(param_group)
        self._initialized = False
        self._plan = None
        try:
            for p in self.param_groups[-1]["params"]:
                if p.is_complex():
                    raise TypeError(f"Gefen does not support complex parameters ({self._name(p)})")
                if sharding.is_dtensor(p):
                    sharding.check_layout(p, self._name(p))
                    self._use_group(sharding.group_of(p), p)
        except (TypeError, ValueError):
            self.param_groups.pop()  # a refused group is not half-added
            raise

    # -- what integrations and reports read --------------------------------------------------
    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The process group every rank's first step agrees over (None: one process)."""
        return self._group

    @property
    def codebooks(self) -> Mapping[int, torch.Tensor]:
        """The learned codebook of m per bit width (empty before the first step)."""
        return dict(self._codebooks)

    @property
    def initialized(self) -> bool:
        """Every parameter that trains (and every declared buffer) has its state."""
        return self._initialized

    def attach(self, name: str, config: Any) -> None:
        """Keep an integration's configuration of this optimizer (``extension``): the FSDP
        integration's layout and run id, read back with ``attached``."""
        self._attached[name] = config

    def attached(self, name: str) -> Any:
        """What ``attach`` kept under ``name``, or None."""
        return self._attached.get(name)

    def segments_of(self, p: torch.Tensor) -> list[Segment]:
        """The segments of ``p``: those an integration declared (``set_segments``), else the
        parameter's own (a DTensor's local piece of its global tensor, or the whole tensor)."""
        return self._segments_for(p)

    # -- integration hooks -------------------------------------------------------------------
    def set_segments(
        self,
        param: torch.Tensor,
        segments: list[Segment],
        group: dist.ProcessGroup | None = None,
        display_name: str | None = None,
    ) -> None:
        """Declare which original tensors' pieces lie in ``param`` (an FSDP/ZeRO flat buffer).

        Must be called before the parameter's first step; segments must tile the buffer.
        Segments with a ``name`` are pieces of a tensor spread over ``group``: their partition
        statistics are merged over it by name, so names must be the same on every rank.
        ``display_name`` is what errors and ``memory_report`` call the buffer."""
        if display_name:
            self._display[param] = display_name
        if param in self.state and self.state[param]:
            raise RuntimeError(f"{self._name(param)} already has state; set segments before step()")
        covered = sorted((s.offset, s.offset + s.numel) for s in segments)
        pos = 0
        for lo, hi in covered:
            if lo != pos:
                raise ValueError(
                    f"segments of {self._name(param)} must tile it: gap or overlap at {pos}"
                )
            pos = hi
        if pos != param.numel():
            raise ValueError(
                f"segments of {self._name(param)} cover {pos} of {param.numel()} elements"
            )
        self._segments[param] = by_matrix(sorted(segments, key=lambda s: s.offset))
        self._use_group(group, param)

    def _adopt(self) -> None:
        """Take the process group of FSDP2 (DTensor) parameters and let the integrations key
        their state per rank for DCP (``extension.sharded``), also where sharded parameters
        replaced a group's params after construction: Accelerate's prepare builds the optimizer
        on plain tensors and swaps the sharded ones in, which had left each rank learning its
        own codebook and DCP keeping one rank's state. A mesh of one rank counts too, so that
        its checkpoint refuses another world size by name. Called at construction, step, state
        dict and load: a swap may happen between any two of them. Until the state exists and
        while no integration has configured the optimizer, the integrations look for layouts
        only they know (``extension.unconfigured``: FSDP1's flat parameters)."""
        if not self._initialized and not self._attached:
            extension.unconfigured(self)
        lists = [g["params"] for g in self.param_groups]
        if len(lists) == len(self._adopted) and all(
            a is b for a, b in zip(lists, self._adopted, strict=True)
        ):
            return
        sharded = False
        for p in (p for ps in lists for p in ps):
            if sharding.is_dtensor(p):
                sharding.check_layout(p, self._name(p))
                group = sharding.group_of(p)
                self._use_group(group, p)
                sharded = sharded or group is not None
        if sharded and not self._attached:
            extension.sharded(self)
        self._adopted = lists

    def state_dict(self) -> dict[str, Any]:
        self._adopt()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._adopt()
        super().load_state_dict(state_dict)

    def _use_group(self, group: dist.ProcessGroup | None, p: torch.Tensor) -> None:
        """Take the group over which ``p`` is spread into the optimizer's. Parameters may be
        spread over different groups when one group's ranks hold every other's: under tensor
        parallelism the linear weights span the (dp, tp) mesh while norms and embeddings are
        FSDP-sharded over the dp mesh alone; under expert parallelism the experts and the dense
        weights live on different meshes of the same ranks. The optimizer agrees over the
        largest (its ``process_group``), and a parameter spread over a part of it keeps that
        part's ranks (``_spans``): the first step counts one replica of it
        (``collectives.merge_stats``). Groups of the same ranks are one group: the first seen
        serves, the same on every rank, as every rank sees the parameters in one order."""
        if group is None:
            return
        ranks = tuple(sorted(dist.get_process_group_ranks(group)))
        self._spans[p] = ranks
        if len(ranks) == 1:
            return
        if self._group is None:
            self._group = group
            return
        have = set(dist.get_process_group_ranks(self._group))
        if set(ranks) <= have:
            return
        where = f" ({sharding.layout(p)})" if sharding.is_dtensor(p) else ""
        if not have < set(ranks):
            raise ValueError(
                f"{self._name(p)} is sharded over ranks {list(ranks)}{where}, and earlier "
                f"parameters over ranks {sorted(have)}: one Gefen optimizer agrees over one "
                "group of ranks, so the groups of its parameters must nest (a dp mesh inside "
                "its (dp, tp) mesh); build one Gefen per group of ranks"
            )
        if any(self.state.values()):
            raise ValueError(
                f"{self._name(p)} is sharded over ranks {list(ranks)}{where}, more than the "
                f"ranks {sorted(have)} over which this optimizer's state was learned: add "
                "parameters over more ranks before the first step"
            )
        self._group = group

    def _span(self, p: torch.Tensor) -> tuple[int, ...] | None:
        """The ranks over which ``p`` is spread where they are a part of the optimizer's group
        (``_use_group``), else None."""
        ranks = self._spans.get(p)
        if ranks is None or self._group is None:
            return None
        return ranks if len(ranks) < dist.get_world_size(self._group) else None

    # -- step --------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        self._adopt()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # The kept C++ tables (cpu_plan) serve a step where nothing but addresses, counts and
        # hyperparameters changed. They are tried first where no rank can be waiting in the
        # first step's collectives (this one is initialised, or alone): the long way looks each
        # parameter up twice by tensor, 2 % of the demo GPT's step (step_ab_state_identity.json).
        # Under a process group with some state missing, every rank goes through the first
        # step's collective before.
        quiet = self._initialized or self._group is None
        if quiet and self._run_kept_plan():
            return loss
        self._first_step_of_new_parameters()
        if not quiet and self._run_kept_plan():
            return loss
        self._step_segments()
        return loss

    def _run_kept_plan(self) -> bool:
        """This step on the last step's C++ tables, or False where they do not fit it (then
        nothing was done)."""
        return self._plan is not None and self._plan.run(self, self._backend)

    def _first_step_of_new_parameters(self) -> None:
        """Blocks (and, the first time, the codebooks) for parameters with a gradient and no
        state yet, on every rank together: a rank with none still takes part in the collectives
        while any rank has some (ZeRO and FSDP hand ranks different parameters)."""
        pending = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise TypeError(f"Gefen does not support sparse gradients ({self._name(p)})")
                if not self.state.get(p):
                    pending.append((p, group))
        if (pending or not self._initialized) and collectives.any_rank(self._group, bool(pending)):
            self._initialize(pending)
        # wrappers (ZeRO) may show one param group per call: registered buffers count too
        known = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        self._initialized = all(self.state.get(p) for p in known + list(self._segments))

    def _step_segments(self) -> None:
        """Every segment's update: the step counts, this step's work and cross factors, then
        one call per backend (C++ for all CPU segments, Triton per device, the reference one
        segment at a time); the C++ tables are kept for the next step where they may serve it."""
        steps = [
            self.state[p]["step"]
            for g in self.param_groups
            for p in g["params"]
            if p.grad is not None
        ]
        if steps:
            torch._foreach_add_(steps, 1)  # one call, not one per tensor
        try:
            items, origins = self._items()
        except Exception:  # refused before anything moved: the counts as they were
            if steps:
                torch._foreach_sub_(steps, 1)
            raise
        factors = cross.step_factors(items, self._slots(), self._group)
        cpu_work: list[SegmentWork] = []
        cpu_items: list[int] = []
        gpu_work: dict[torch.device, list[SegmentWork]] = {}
        for i, (it, f) in enumerate(zip(items, factors.factors, strict=True)):
            work = SegmentWork(
                it.p, it.g, it.seg, it.hyper, it.levels, it.mids, it.bits, f, i in factors.v_done
            )
            if it.impl == "triton":
                gpu_work.setdefault(it.p.device, []).append(work)
            elif it.impl == "cpu":
                cpu_work.append(work)
                cpu_items.append(i)
            elif it.seg.block_size == 1:
                dense_update(it.p, it.g, it.seg, it.hyper)
            elif it.seg.block_size < 0:
                column_update(it.p, it.g, it.seg, it.hyper, it.levels, it.mids, it.bits, f)
            else:
                block_update(it.p, it.g, it.seg, it.hyper, it.levels, it.mids, it.bits, f)
        cpu_table = native_cpu.step(cpu_work)
        for work in gpu_work.values():
            triton_backend.step(work)
        self._plan = None
        if CpuPlan.eligible(self, items):
            self._plan = CpuPlan(self, self._backend, origins, cpu_table, factors, cpu_items)

    def _items(self) -> tuple[list[StepItem], list[Origin]]:
        """This step's work per segment of every parameter with a gradient, and each item's
        origin, which the kept plans rewrite from."""
        impls: dict[tuple, str] = {}
        items: list[StepItem] = []
        origins: list[Origin] = []
        for gi, group in enumerate(self.param_groups):
            hypers: dict[int, Hyper] = {}  # by step: one object, and one table row, per value
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                t = int(st["step"].item())
                h = hypers.get(t)
                if h is None:
                    h = hypers[t] = Hyper.of(group, t)
                lp = _contiguous(sharding.local(p), self._name(p))
                lg = _contiguous(sharding.local(p.grad), self._name(p))
                if st["codes"].device != lp.device:
                    raise RuntimeError(
                        f"the state of {self._name(p)} is on {st['codes'].device}, the parameter "
                        f"on {lp.device}: move the model before the optimizer's first step, or "
                        "load the optimizer's state_dict after moving it (loading puts each "
                        "state on its parameter's device)"
                    )
                prep = self._prepared(p, st)
                bits = state.bits_of(prep.levels)
                if group["maximize"]:
                    lg = -lg
                key = (lp.device, lp.dtype, lg.dtype)
                impl = impls.get(key)
                if impl is None:
                    impl = impls[key] = self._impl(lp, lg)
                views = prep.views
                whole = len(views) == 1 and views[0].seg.numel == lp.numel()
                if whole and impl == "cpu":  # the C++ kernel takes contiguous memory as it is
                    items.append(
                        StepItem(
                            impl,
                            lp,
                            lg,
                            views[0].seg,
                            h,
                            prep.levels,
                            prep.mids,
                            bits,
                            prep.spread[0],
                        )
                    )
                    origins.append(Origin(gi, p, 0))
                    continue
                flat_p, flat_g = lp.view(-1), lg.view(-1)
                for view, name in zip(views, prep.spread, strict=True):
                    if whole:
                        ps, gs = flat_p, flat_g
                    else:
                        ps = flat_p[view.offset : view.offset + view.seg.numel]
                        gs = flat_g[view.offset : view.offset + view.seg.numel]
                    items.append(
                        StepItem(impl, ps, gs, view.seg, h, prep.levels, prep.mids, bits, name)
                    )
                    origins.append(Origin(gi, p, view.offset))
        return items, origins

    @property
    def backend(self) -> str:
        """Which update runs: 'auto' (the native kernels: C++ on CPU tensors, Triton on CUDA
        ones; the reference where neither serves), 'native', 'triton' or 'reference' (the
        update in bounded memory, ``backends.reference``); ``backends.dispatch``
        has the rule. ``memory_report()['backend']`` says what actually ran. Settable, e.g.
        ``opt.backend = "reference"``."""
        return self._backend

    @backend.setter
    def backend(self, name: str) -> None:
        if name not in BACKENDS:
            raise ValueError(f"Invalid backend: {name!r} ({', '.join(BACKENDS)})")
        self._backend = name
        self._plan = None

    def backend_of(self, p: torch.Tensor) -> str:
        """The update that steps parameter ``p``, as ``memory_report`` names it ('native-cpu',
        'triton' or 'reference'). Why per parameter: the choice follows each local tensor's
        device, so where FSDP2's ``CPUOffloadPolicy`` keeps sharded parameters on the host their
        steps take the C++ kernel while a CUDA parameter of the same optimizer takes Triton."""
        local = sharding.local(p)
        g = sharding.local(p.grad) if p.grad is not None else local
        return dispatch.REPORT_NAMES[self._impl(local, g)]

    def _impl(self, p: torch.Tensor, g: torch.Tensor) -> str:
        """'cpu' (C++), 'triton' or 'reference' for a parameter and its gradient;
        only the kernels that could serve this device are loaded (a GPU run builds no C++)."""
        b, dev = self._backend, p.device.type
        if b == "reference":
            return "reference"
        cpp = dev == "cpu" and b in ("auto", "native") and native_cpu.supports(p, g)
        cpp_ok = cpp and native_cpu.available()
        tri = triton_backend.supports(p, g) and (b == "triton" or dev == "cuda")
        tri_ok = tri and triton_backend.available(p.device)
        facts = dispatch.Facts(
            device=dev,
            cpp_supports=cpp,
            cpp_available=cpp_ok,
            cpp_why=native_cpu.build_error() if cpp and not cpp_ok else None,
            triton_supports=tri,
            triton_available=tri_ok,
            triton_why=triton_backend.build_error(p.device) if tri and not tri_ok else None,
        )
        try:
            choice = dispatch.choose(b, facts)
        except RuntimeError as e:
            raise RuntimeError(f"{self._name(p)} ({dev}, {p.dtype}, grad {g.dtype}): {e}") from None
        if choice.unavailable is not None:
            self._unavailable(*choice.unavailable)
        return choice.impl

    def _unavailable(self, what: str, why: str | None) -> None:
        if what not in self._warned:
            self._warned.add(what)
            warnings.warn(
                f"Gefen: the {what} kernels are unavailable ({why}); running the slower "
                "fallback. opt.memory_report()['backend'] shows which update runs.",
                stacklevel=3,
            )

    def _prepared(self, p: torch.Tensor, st: dict) -> _Prepared:
        """Computed once per state (a load or a re-initialisation brings new tensors, hence new
        ones): the codebook, its midpoints, and the views the update steps."""
        hit = self._views.get(p)
        if hit is None or hit.codes is not st["codes"] or hit.levels is not st["codebook"]:
            levels = st["codebook"]
            segments = self._segments_for(p)
            spread = [self.spread_name(s) for s in segments]
            views = state.step_views(st, segments)
            hit = _Prepared(
                st["codes"], levels, midpoints(levels), views, [spread[v.first] for v in views]
            )
            self._views[p] = hit
        return hit

    def _slots(self) -> dict[str, cross.Slot]:
        """Each spread tensor's place in the per-step all-reduce of cross sums, agreed once
        after each initialisation or load (``cross.agree_slots``)."""
        if self._cross_slots is None:
            have = [(self._segments_for(p), st) for p, st in self.state.items() if st]
            self._cross_slots = cross.agree_slots(self._group, have, self.spread_name)
        return self._cross_slots

    def _shared_codebook(self, levels: torch.Tensor, device: torch.device) -> torch.Tensor:
        """One codebook tensor per bit width and device for every state that holds those
        levels: it never changes once learned, and a copy per tensor cost 1 KiB (8 bits) each,
        a visible share of a small model's state. A checkpoint whose tensors hold different
        levels (not written by this package) keeps each its own."""
        levels = levels.to(device=device, dtype=torch.float32)
        key = (levels.numel(), str(device))
        have = self._codebook_copies.get(key)
        if have is not None and torch.equal(have, levels):
            return have
        self._codebook_copies.setdefault(key, levels)
        return levels

    def _initialize(self, pending: list[tuple[torch.Tensor, dict]]) -> None:
        """The first step of ``pending`` (``first_step``): blocks, and codebooks for new bit
        widths; then their state."""
        items = []
        for p, group in pending:
            name = functools.partial(self._name, p)
            segs = self._segments_for(p)
            grad = first_step.flat(sharding.local(p.grad), name)
            items.append(
                first_step.Pending(
                    name, group["bits"], segs, grad, sharding.is_copy(p), self._span(p)
                )
            )
        learned = first_step.initialize(items, self._group, set(self._codebooks))
        self._codebooks.update(learned.codebooks)
        for (p, group), item, blocks in zip(pending, items, learned.blocks, strict=True):
            levels = self._shared_codebook(self._codebooks[group["bits"]], p.device)
            self.state[p] = state.allocate(item.segments, blocks, levels, p.device)
        self._cross_slots = None  # new tensors may be spread: agree on the table again

    # -- checkpoints -------------------------------------------------------------------------
    @staticmethod
    def _stash_state(opt: Gefen, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Load pre-hook: check every parameter's saved state fits before anything is touched,
        and keep it from torch's loader, which would cast every floating state tensor to the
        parameter's dtype (and the uint8 codes with them). Hooks that translate a framework's
        format into Gefen's register with ``prepend=True`` so they run before this one."""
        groups, saved_groups = opt.param_groups, state_dict["param_groups"]
        if len(groups) != len(saved_groups):
            raise ValueError(
                f"state dict has {len(saved_groups)} param groups, optimizer has {len(groups)}"
            )
        for i, saved in enumerate(saved_groups):  # torch's loader installs these settings as saved
            settings = {k: v for k, v in saved.items() if k != "params"}
            try:
                validation.check_hyper({**opt.defaults, **settings})
            except (TypeError, ValueError) as e:
                raise ValueError(f"saved param group {i}: {e}") from None
        saved_state = state_dict["state"]
        install = []
        for group, saved in zip(groups, saved_groups, strict=True):
            if len(group["params"]) != len(saved["params"]):
                raise ValueError(
                    f"a saved param group has {len(saved['params'])} parameters, "
                    f"the optimizer's has {len(group['params'])}"
                )
            bits = saved.get("bits", group["bits"])
            if bits != group["bits"]:
                raise ValueError(
                    f"a saved param group holds bits={bits} state, this optimizer's group was "
                    f"built with bits={group['bits']}: build Gefen with bits={bits} to resume "
                    "it (the width is the state's size, so a load never changes it)"
                )
            for pid, p in zip(saved["params"], group["params"], strict=True):
                if pid in saved_state:
                    segs = opt._segments_for(p)
                    saved_p = state.upgrade(saved_state[pid], segs)
                    saved_p = portable.fit(saved_p, segs, bits, opt._name(p))
                    state.check_loaded(saved_p, segs, bits, opt._name(p))
                    install.append((p, saved_p))
        opt._pending_install = install
        return {**state_dict, "state": {}}

    @staticmethod
    def _install_state(opt: Gefen) -> None:
        """Load post-hook: install the checked state as saved (dtypes kept, moved to device)."""
        opt.state.clear()
        opt._codebooks.clear()
        opt._initialized = False
        opt._cross_slots = None
        opt._plan = None
        opt._codebook_copies.clear()
        for group in opt.param_groups:  # saved before the setting existed: the optimizer's
            group.setdefault("bf16_stochastic_round", opt.defaults["bf16_stochastic_round"])
        for p, st in opt._pending_install:
            # the step count and the layout stay on the host (the kept plans read the count
            # there; the layout is read with tolist), the rest on the parameter's device
            host = ("step", "layout")
            new = {k: v.to(p.device) if k not in host else v.to("cpu") for k, v in st.items()}
            new["step"] = new["step"].to(torch.float32).clone()
            new["codebook"] = opt._shared_codebook(new["codebook"], p.device)
            opt.state[p] = {k: new[k] for k in state.STATE_KEYS}
            opt._codebooks.setdefault(state.bits_of(new["codebook"]), new["codebook"])
        opt._pending_install = []

    # -- reporting ---------------------------------------------------------------------------
    def memory_report(self) -> dict[str, Any]:
        """State bytes per parameter tensor and in total, next to what AdamW would keep
        (``gefen_dist.memory_report.memory_report`` says what each entry means)."""
        tensors = [
            memory_report.Tensor(
                name=self._name(p),
                shape=tuple(p.shape),
                numel=sharding.local(p).numel(),
                state=st,
                spread=[self.spread_name(seg) for seg in self._segments_for(p)],
                backend=self.backend_of(p),
            )
            for p, st in self.state.items()
            if st
        ]
        return memory_report.memory_report(tensors, list(self._codebooks), self._backend)

    def _segments_for(self, p: torch.Tensor) -> list[Segment]:
        if p in self._segments:
            return self._segments[p]
        if getattr(p, "_is_flat_param", False):
            raise ValueError(
                f"{self._name(p)} is an FSDP flat parameter (use_orig_params=False) whose "
                "layout Gefen was not told: Gefen reads it from the FSDP units itself once "
                "gefen_dist.integrations is loaded (import gefen_dist does), but this optimizer "
                "was configured before the parameter came (add_param_group?): call "
                "gefen_dist.integrations.fsdp.configure(model, optimizer) before the first step"
            )
        if getattr(p, "_fsdp_flattened", False):
            raise ValueError(
                f"{self._name(p)} is a piece of an FSDP1 parameter (use_orig_params=True) "
                "whose place in the original tensor Gefen was not told: Gefen reads it from "
                "the FSDP units itself once gefen_dist.integrations is loaded (import "
                "gefen_dist does), but this optimizer was configured before the parameter came "
                "(add_param_group?): call gefen_dist.integrations.fsdp.configure(model, "
                "optimizer) before the first step (without it each rank would block its 1-D "
                "piece as a tensor of its own, with several times the state)"
            )
        gi, i = self._index(p)
        return by_matrix(sharding.segments_of(p, key=f"param {gi}.{i}", name=self._name(p)))

    def _index(self, p: torch.Tensor) -> tuple[int, int]:
        for gi, group in enumerate(self.param_groups):
            for i, q in enumerate(group["params"]):
                if q is p:
                    return gi, i
        raise KeyError("parameter not in this optimizer")

    def spread_name(self, seg: Segment) -> str | None:
        """The name under which a piece's v_cross sums are all-reduced: pieces of tensors spread
        over this optimizer's process group; None for whole tensors, and for pieces declared
        without a group (there is no one to reduce with: they are factored from their own g)."""
        if self._group is not None and seg.name and seg.numel < seg.tensor_numel:
            return seg.name
        return None

    def name_of(self, p: torch.Tensor) -> str:
        """What errors and reports call ``p``: its display name (``set_segments``), its name in
        ``param_names``, or its place in the param groups."""
        return self._name(p)

    def _name(self, p: torch.Tensor) -> str:
        if p in self._display:
            return self._display[p]
        for gi, group in enumerate(self.param_groups):
            for i, q in enumerate(group["params"]):
                if q is p:
                    names = group.get("param_names")
                    if names:
                        return f"parameter {names[i]!r} {tuple(p.shape)}"
                    return f"parameter {i} of param group {gi} {tuple(p.shape)}"
        return f"parameter {tuple(p.shape)}"


class _Prepared(NamedTuple):
    """What a state gives every step until it is replaced (``Gefen._prepared``)."""

    codes: torch.Tensor
    """The state's codes when this was made: a new tensor means a new state."""
    levels: torch.Tensor
    mids: torch.Tensor
    views: list[state.StepView]
    spread: list[str | None]
    """Per view, ``Gefen.spread_name`` of its first segment."""


def _contiguous(t: torch.Tensor, name: str) -> torch.Tensor:
    if not t.is_contiguous():
        raise ValueError(f"Gefen needs contiguous parameters and gradients; {name} is not")
    return t
