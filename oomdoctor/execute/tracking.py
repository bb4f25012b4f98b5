"""Live tensor-byte accounting with a ``TorchDispatchMode``: the meter under ``--engine simulate``, the fake GPU cap of
``train --gpu-mem`` on CPU, and the tune benchmark.

One job, over 600 lines: the meter :class:`LiveBytes` (storage records, categories, phases, regions, timeline, cap,
FSDP2's storage resizes) and :func:`capped_memory`, the cap as a context manager.

:class:`LiveBytes` sees every ATen op while it is active. Each output tensor's *storage* is tracked once (views share
storage, in-place ops allocate nothing) with a weak reference whose callback subtracts the bytes when the storage dies,
so ``current`` is the bytes of all live tracked storages and ``peak`` its maximum. It works the same on real tensors
(CPU) and on ``FakeTensorMode`` tensors (no data).

Rounding: with ``round_to=512`` (default) a storage of n > 0 bytes counts ``ceil(n / 512) * 512``, as the CUDA caching
allocator rounds every request (c10/cuda/CUDACachingAllocator.cpp ``round_size``: ``kMinBlockSize = 512``; size 0
allocates no block). Known limit: the allocator may hand a large request a whole cached block up to 1 MiB bigger
(``should_split``), which ``max_memory_allocated`` then counts; we do not model block reuse.

Categories (the tensor components of :class:`oomdoctor.memory.breakdown.MemoryBreakdown`): ``parameters``,
``master_weights``, ``gradients``, ``optimizer_states``, ``activations``, ``logits``, ``temporaries``. How a storage is
classified, first rule that applies:

1. explicitly, with :meth:`LiveBytes.track_existing` / :meth:`LiveBytes.classify` / :meth:`LiveBytes.track_module`
   (parameters and buffers, ``.grad`` of every parameter via a post-accumulate-grad hook, optimizer state via
   :meth:`LiveBytes.track_optimizer`);
2. by an open :meth:`LiveBytes.region` (e.g. ``logits`` from the LM head to the loss, ``activations`` while a
   checkpointed layer is recomputed in backward, ``master_weights`` for AMP weight casts);
3. by the phase it was born in: in ``forward`` a storage still alive when the forward ends is an ``activation``
   (saved for backward), one that died inside the forward a ``temporary``; anything born in ``backward`` /
   ``optimizer-step`` (or outside a phase) is a ``temporary``.

Rule 3 needs the future (does the storage outlive the forward?), so per-category numbers are computed after the fact
from the storages' lifetimes (:meth:`LiveBytes.categories_at`, :meth:`LiveBytes.peak_categories`,
:meth:`LiveBytes.timeline`); ``current``/``peak``/the cap are online.

History: dead storages' lifetimes are kept (for per-category numbers at past moments and timelines) unless
``history=False``; a tracker built with ``cap_bytes`` and no timeline keeps none by default (long real runs).

Cap: with ``cap_bytes`` set, an op whose new storages would push ``current`` past the cap raises
``torch.OutOfMemoryError`` with the CUDA allocator's message format (``Tried to allocate X ... of which Y is free``),
frees nothing that existed before, and does not count the refused outputs.

Sharded models (FSDP2): FSDP frees and refills its gathered (unsharded) parameter buffers with
``torch.UntypedStorage.resize_``, which is not an ATen op on CPU, so no dispatch mode sees it. While the tracker is
active it wraps ``UntypedStorage.resize_`` (as torch's ``MemTracker._track_resize`` does; restored on exit): a
resize of a tracked storage ends its record and starts a new one of the new size (the same explicit category), a
storage growing from 0 bytes is counted from then on, and a resize that would pass ``cap_bytes`` raises the same
``OutOfMemoryError`` before it happens. DTensors (sharded parameters, gradients, optimizer state) count their local
shard (``_local_tensor``); meta tensors own no memory and are skipped. Measured: without the resize patch FSDP2
peaks read +19 % (shared/research/multi-gpu.md §1 "Meter").
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from oomdoctor.memory.breakdown import TENSOR_COMPONENTS
from oomdoctor.memory.runtime import ALLOC_BLOCK
from oomdoctor.units import format_bytes

#: The tensor categories are the tensor components of a MemoryBreakdown.
CATEGORIES: tuple[str, ...] = TENSOR_COMPONENTS
_ALIASES = {
    "optimizer_state": "optimizer_states",
    "params": "parameters",
    "grads": "gradients",
    "activation": "activations",
}

_LIFT_FRESH = torch.ops.aten.lift_fresh.default

PHASES: tuple[str, ...] = ("forward", "backward", "optimizer-step")


def round_bytes(n: int, granularity: int = ALLOC_BLOCK) -> int:
    """Bytes the CUDA caching allocator books for an ``n``-byte request (0 stays 0)."""
    if n <= 0 or granularity <= 1:
        return max(n, 0)
    return -(-n // granularity) * granularity


def _local(t):
    """A DTensor's local shard (FSDP2 parameters, gradients, optimizer state); any other tensor itself."""
    lt = getattr(t, "_local_tensor", None)
    return lt if lt is not None else t


def _tensors(tree) -> list:
    """The tensors in an ATen op's arguments or outputs: a tensor, or lists, tuples (named ones too) and dicts of
    them, at any depth (what op schemas allow; ``tree_flatten``'s general pytree walk cost a third of the tracker's
    time). Anything else is a leaf that holds no tensor."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, dict):
        tree = tuple(tree.values())
    elif not isinstance(tree, (list, tuple)):
        return []
    found = []
    for x in tree:
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, (list, tuple, dict)):
            found.extend(_tensors(x))
    return found


def _canon(category: str) -> str:
    c = _ALIASES.get(category, category)
    if c not in CATEGORIES:
        raise ValueError(f"unknown category {category!r}; use one of {', '.join(CATEGORIES)}")
    return c


@dataclass
class StorageRecord:
    """One tracked storage and its lifetime in event indices."""

    nbytes: int
    """Counted bytes (rounded when the tracker rounds)."""
    birth: int
    """Event index at which it was first seen (-1: registered as existing)."""
    phase: str | None
    """Phase it was born in (None: outside any phase / pre-existing)."""
    region: str | None = None
    """Category of the region open at birth (rule 2), if any."""
    category: str | None = None
    """Explicit category (rule 1), if any."""
    death: int | None = None
    """Event index at which it was freed (None: alive)."""
    phase_serial: int = -1
    """Serial number of the phase instance it was born in (to know when *that* forward ended)."""


@dataclass
class _PhaseSpan:
    name: str
    start: int
    end: int | None = None
    peak: int = 0
    peak_event: int = -1


@dataclass
class TimelineSample:
    """(event index, phase, {category: bytes}) — one point of the memory-over-time plot."""

    event: int
    phase: str
    categories: dict[str, int] = field(default_factory=dict)

    def as_tuple(self) -> tuple[int, str, dict[str, int]]:
        return (self.event, self.phase, dict(self.categories))


class LiveBytes(TorchDispatchMode):
    """Counts live tensor storage bytes while active (``with LiveBytes() as lb: ...``).

    ``current``: bytes of live tracked storages; ``peak``: their maximum since the last :meth:`reset_peak`;
    ``phase_peaks``: peak per phase name; ``peak_event``/``peak_phase``: where the peak happened.
    """

    def __init__(
        self,
        *,
        round_to: int = ALLOC_BLOCK,
        cap_bytes: int | None = None,
        record_timeline: bool = False,
        device_name: str = "GPU 0",  # used in the OOM message
        param_copy_category: str | None = None,
        device_type: str | None = None,
        history: bool | None = None,
    ):
        super().__init__()
        self.device_type = device_type
        # history: keep dead storages' lifetimes (per-category numbers at past moments, timelines). Off by default
        # when used as a memory cap over a long real run (train --gpu-mem), where it would grow without bound.
        self.history = (cap_bytes is None or record_timeline) if history is None else history
        self.param_copy_category = _canon(param_copy_category) if param_copy_category else None
        self.round_to = round_to
        self.cap_bytes = cap_bytes
        self.record_timeline = record_timeline
        self.device_name = device_name
        self.current = 0
        self.peak = 0
        self.peak_event = -1
        self.peak_phase: str | None = None
        self.events = 0
        self.records: dict[int, StorageRecord] = {}
        self._all: list[StorageRecord] = []
        self._refs: dict[int, weakref.ref] = {}
        self._phase: str | None = None
        self._phase_serial = -1
        self._spans: list[_PhaseSpan] = []
        self._regions: list[str] = []
        self._hooks: list = []
        self._samples_events: list[tuple[int, str]] = []
        self.oom_count = 0
        self.external: dict[str, int] = {}
        self._paused = 0
        self._ignored: set[int] = set()
        self._resize_depth = 0  # nesting of `with self`: UntypedStorage.resize_ is patched at depth 1
        self._orig_resize = None
        self._phase_region: str | None = None

    # ------------------------------------------------------------------ dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self._paused or func is _LIFT_FRESH:
            # lift_fresh: a tensor built from Python data (torch.tensor(...)); real runs do not dispatch it, so it
            # is not counted in either (keeps fake-tensor replays and real runs identical)
            return out
        self.events += 1
        new: list[tuple[int, object, int]] = []
        resized: list[tuple[int, StorageRecord, int]] = []
        grow = 0
        seen: set[int] = set()
        input_keys: set[int] | None = None
        for t in _tensors(out):
            t = _local(t)
            if t.device.type == "meta" or (self.device_type is not None and t.device.type != self.device_type):
                continue
            try:
                st = t.untyped_storage()
            except (RuntimeError, NotImplementedError):  # e.g. sparse or storage-less subclasses
                continue
            key = st._cdata
            if key in seen:
                continue
            seen.add(key)
            nb = self._count(st.nbytes())
            rec = self.records.get(key)
            if rec is None:
                if input_keys is None:
                    input_keys = self._storage_keys((args, kwargs))
                if key in input_keys:  # a view / in-place result of an untracked pre-existing tensor: not new
                    continue
                new.append((key, st, nb))
                grow += nb
            elif nb != rec.nbytes:  # resize_ / set_ grew or shrank a tracked storage
                resized.append((key, rec, nb))
                grow += nb - rec.nbytes
        if grow > 0 and self.cap_bytes is not None and self.current + grow > self.cap_bytes:
            self.oom_count += 1
            # drop every reference to the refused outputs before raising (the traceback keeps this frame alive)
            out = new = resized = seen = t = st = rec = None
            raise torch.OutOfMemoryError(self.oom_message(grow))
        if new or grow:
            for key, rec, nb in resized:
                self._resized(key, rec, nb)
            region = None
            if self.param_copy_category and func is torch.ops.aten._to_copy.default and args:
                src = args[0]
                if isinstance(src, torch.Tensor) and src.device.type != "meta":
                    srec = self.records.get(_local(src).untyped_storage()._cdata)
                    if srec is not None and srec.category == "parameters":
                        region = self.param_copy_category
            for key, st, nb in new:
                rec = self._add(key, st, nb, birth=self.events)
                if region is not None:
                    rec.region = region
            self._after_change()
        return out

    # ------------------------------------------------------------------ bookkeeping
    @staticmethod
    def _storage_keys(tree) -> set[int]:
        keys: set[int] = set()
        for t in _tensors(tree):
            try:
                keys.add(_local(t).untyped_storage()._cdata)
            except (RuntimeError, NotImplementedError):
                pass
        return keys

    def _count(self, n: int) -> int:
        return round_bytes(n, self.round_to)

    def _add(self, key: int, st, nb: int, *, birth: int, category: str | None = None) -> StorageRecord:
        rec = StorageRecord(
            nbytes=nb,
            birth=birth,
            phase=self._phase,
            region=self._regions[-1] if self._regions else self._phase_region,
            category=category,
            phase_serial=self._phase_serial,
        )
        self.records[key] = rec
        if self.history:
            self._all.append(rec)
        self.current += nb

        def _freed(ref, key=key, self_ref=weakref.ref(self)):
            me = self_ref()
            if me is None or me._refs.get(key) is not ref:  # untracked meanwhile (or a new storage at this key)
                return
            del me._refs[key]
            rec = me.records.pop(key)  # the storage's latest record (resize_ starts a new one)
            me.current -= rec.nbytes
            rec.death = me.events + 1  # not alive after the next event
            if me.record_timeline:
                me._samples_events.append((me.events, me._phase or "-"))

        self._refs[key] = weakref.ref(st, _freed)
        return rec

    def _resized(self, key: int, rec: StorageRecord, nb: int) -> None:
        """A tracked storage now holds ``nb`` counted bytes: its record ends at this event and a new one of the new
        size starts (same explicit category), so per-category numbers at past moments stay right."""
        rec.death = self.events
        new = StorageRecord(
            nbytes=nb,
            birth=self.events,
            phase=self._phase,
            region=self._regions[-1] if self._regions else self._phase_region,
            category=rec.category,
            phase_serial=self._phase_serial,
        )
        self.records[key] = new
        if self.history:
            self._all.append(new)
        self.current += nb - rec.nbytes

    # ------------------------------------------------------------------ UntypedStorage.resize_ (FSDP)
    def _storage_resize(self, orig, st, size):
        """The patched ``UntypedStorage.resize_`` (see the module docstring): checks the cap, resizes, counts."""
        key = st._cdata
        if self._paused or key in self._ignored:
            return orig(st, size)
        rec = self.records.get(key)
        if rec is None and (
            st.nbytes() != 0 or (self.device_type is not None and st.device.type not in (self.device_type, "meta"))
        ):
            return orig(st, size)  # a pre-existing storage this tracker never counted (or another device)
        nb = self._count(int(size))  # an UntypedStorage's size is in bytes
        grow = nb - (rec.nbytes if rec is not None else 0)
        if grow > 0 and self.cap_bytes is not None and self.current + grow > self.cap_bytes:
            self.oom_count += 1
            raise torch.OutOfMemoryError(self.oom_message(grow))
        out = orig(st, size)
        if grow == 0 and rec is not None:
            return out
        self.events += 1
        if rec is None:
            self._add(key, st, nb, birth=self.events)
        else:
            self._resized(key, rec, nb)
        self._after_change()
        return out

    def __enter__(self):
        out = super().__enter__()
        self._resize_depth += 1
        if self._resize_depth == 1:
            orig = self._orig_resize = torch.UntypedStorage.resize_
            me = self

            def resize_(st, size):
                return me._storage_resize(orig, st, size)

            torch.UntypedStorage.resize_ = resize_
        return out

    def _after_change(self) -> None:
        if self.current > self.peak:
            self.peak = self.current
            self.peak_event = self.events
            self.peak_phase = self._phase
        if self._spans and self._spans[-1].end is None:
            sp = self._spans[-1]
            if self.current > sp.peak:
                sp.peak = self.current
                sp.peak_event = self.events
        if self.record_timeline:
            self._samples_events.append((self.events, self._phase or "-"))

    def oom_message(self, request: int) -> str:
        """The CUDA caching allocator's OOM message (torch 2.x wording) for a request of ``request`` bytes."""
        cap = self.cap_bytes or 0
        free = max(cap - self.current, 0)
        return (
            f"CUDA out of memory. Tried to allocate {format_bytes(request)}. {self.device_name} has a total capacity of "
            f"{format_bytes(cap)} of which {format_bytes(free)} is free. Of the allocated memory "
            f"{format_bytes(self.current)} is allocated by PyTorch, and 0 bytes is reserved by PyTorch but unallocated. "
            "(oomdoctor simulated memory cap)"
        )

    # ------------------------------------------------------------------ registration of existing tensors
    def _storage_of(self, t):
        if isinstance(t, torch.Tensor):
            return _local(t).untyped_storage()
        return t  # already a storage

    def track_existing(self, tensors: Iterable, category: str = "parameters") -> int:
        """Count tensors (or storages) that existed before entering, as ``category``; returns bytes added.
        Already tracked storages are re-classified instead (no double count)."""
        cat = _canon(category)
        added = 0
        for t in tensors:
            if t is None:
                continue
            if isinstance(t, torch.Tensor) and (
                getattr(t, "is_paged", False)
                or t.device.type == "meta"
                or (self.device_type is not None and t.device.type != self.device_type)
            ):
                continue  # bnb paged (unified) memory / no memory / another device: not this allocator's bytes
            st = self._storage_of(t)
            key = st._cdata
            if key in self._ignored:
                continue
            rec = self.records.get(key)
            if rec is not None:
                rec.category = cat
                continue
            nb = self._count(st.nbytes())
            self._add(key, st, nb, birth=self.events, category=cat)
            added += nb
        if added:
            self._after_change()
        return added

    def classify(self, tensor, category: str) -> None:
        """Give a tracked tensor's storage an explicit category (tracks it if unknown)."""
        self.track_existing([tensor], category)

    def track_module(self, model: torch.nn.Module, optimizer=None, *, grad_hooks: bool = True) -> None:
        """Track a model's parameters and buffers as ``parameters``, existing ``.grad`` as ``gradients`` (and from now
        on every new ``.grad`` via a post-accumulate-grad hook), and the optimizer's state if given."""
        self.track_existing(list(model.parameters()) + list(model.buffers()), "parameters")
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        self.track_existing(grads, "gradients")
        if grad_hooks:
            for p in model.parameters():
                if p.requires_grad and hasattr(p, "register_post_accumulate_grad_hook"):
                    self._hooks.append(p.register_post_accumulate_grad_hook(self._grad_hook))
        if optimizer is not None:
            self.track_optimizer(optimizer)

    def _grad_hook(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            self.track_existing([p.grad], "gradients")

    def track_optimizer(self, optimizer) -> int:
        """Classify every tensor in ``optimizer.state`` as ``optimizer_states`` (call after the first step, when the
        state exists). Returns the bytes of newly tracked storages."""
        tensors = []
        for st in getattr(optimizer, "state", {}).values():
            if isinstance(st, dict):
                for v in st.values():
                    if isinstance(v, torch.Tensor):
                        tensors.append(v)
        return self.track_existing(tensors, "optimizer_states")

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    # ------------------------------------------------------------------ phases and regions
    @contextmanager
    def phase(self, name: str) -> Iterator["LiveBytes"]:
        """Open a phase (``forward``, ``backward``, ``optimizer-step`` or any name) for per-phase peaks."""
        prev, prev_serial = self._phase, self._phase_serial
        self._phase = name
        self._phase_serial = len(self._spans)
        span = _PhaseSpan(name=name, start=self.events, peak=self.current, peak_event=self.events)
        self._spans.append(span)
        try:
            yield self
        finally:
            span.end = self.events
            self._phase, self._phase_serial = prev, prev_serial

    @contextmanager
    def region(self, category: str) -> Iterator["LiveBytes"]:
        """Storages born inside are classified as ``category`` (unless explicitly classified later)."""
        self._regions.append(_canon(category))
        try:
            yield self
        finally:
            self._regions.pop()

    def push_region(self, category: str) -> None:
        """Non-context form of :meth:`region` (for module hooks); pair with :meth:`pop_region`."""
        self._regions.append(_canon(category))

    def pop_region(self) -> None:
        if self._regions:
            self._regions.pop()

    def pop_region_all(self) -> None:
        """Close every open region (e.g. at the end of a forward whose hooks pushed some)."""
        self._regions.clear()

    def set_backward_region(self, category: str | None) -> None:
        """Category for storages born while no :meth:`region` is open (None: phase default); used to call what the
        loss backward allocates ``logits`` until the head's output gradient exists."""
        self._phase_region = _canon(category) if category else None

    @property
    def current_phase(self) -> str | None:
        return self._phase

    @contextmanager
    def paused(self) -> Iterator["LiveBytes"]:
        """Ops inside are not tracked (memory that is not on the simulated device)."""
        self._paused += 1
        try:
            yield self
        finally:
            self._paused -= 1

    def ignore(self, t, external: str | None = None) -> None:
        """Never count ``t``'s storage (memory outside the allocator); with ``external``, add its raw bytes to
        ``self.external[external]``. Use with :meth:`paused` around its creation."""
        st = self._storage_of(t)
        if st._cdata in self._ignored:
            return
        self._ignored.add(st._cdata)
        if external:
            self.external[external] = self.external.get(external, 0) + st.nbytes()

    def counted_bytes(self, t) -> int:
        """Bytes this tracker counts for ``t``'s storage (rounded as configured)."""
        return self._count(self._storage_of(t).nbytes())

    def untrack(self, t, external: str | None = None) -> int:
        """Stop counting ``t``'s storage from now on (it moved off the device); with ``external``, add its bytes to
        ``self.external[external]`` (e.g. ``paged_optimizer``, ``cpu_offloaded``). Returns the bytes."""
        st = self._storage_of(t)
        key = st._cdata
        rec = self.records.pop(key, None)
        if rec is None:
            return 0
        self._refs.pop(key, None)
        self.current -= rec.nbytes
        rec.death = self.events + 1
        if external:
            self.external[external] = self.external.get(external, 0) + rec.nbytes
        if self.record_timeline:
            self._samples_events.append((self.events, self._phase or "-"))
        return rec.nbytes

    def reset_peak(self) -> None:
        """Start a new peak window at the current bytes (like ``torch.cuda.reset_peak_memory_stats``)."""
        self.peak = self.current
        self.peak_event = self.events
        self.peak_phase = self._phase

    # ------------------------------------------------------------------ results
    @property
    def phase_peaks(self) -> dict[str, int]:
        """Peak live bytes per phase name (max over repeated phases)."""
        out: dict[str, int] = {}
        for sp in self._spans:
            out[sp.name] = max(out.get(sp.name, 0), sp.peak)
        return out

    def phase_peak_events(self) -> dict[str, int]:
        """Event index of each phase's peak (the last repetition wins ties: steady state)."""
        best: dict[str, tuple[int, int]] = {}
        for sp in self._spans:
            if sp.name not in best or sp.peak >= best[sp.name][0]:
                best[sp.name] = (sp.peak, sp.peak_event)
        return {k: v[1] for k, v in best.items()}

    def spans(self) -> list[tuple[str, int, int | None, int]]:
        """(phase, start event, end event, peak bytes) of every phase instance, in order."""
        return [(s.name, s.start, s.end, s.peak) for s in self._spans]

    def _category_of(self, rec: StorageRecord) -> str:
        if rec.category is not None:
            return rec.category
        if rec.region is not None:
            return rec.region
        if rec.phase == "forward" and 0 <= rec.phase_serial < len(self._spans):
            end = self._spans[rec.phase_serial].end
            # a death recorded as end + 1 happened before the phase closed (deaths are "not alive after event d-1")
            if end is None or rec.death is None or rec.death > end + 1:
                return "activations"
            return "temporaries"
        if rec.phase is None and rec.birth < 0:
            return "parameters"
        return "temporaries"

    def categories_at(self, event: int) -> dict[str, int]:
        """Live bytes per category right after event ``event`` (sum == live bytes then)."""
        out = dict.fromkeys(CATEGORIES, 0)
        for rec in self._all if self.history else self.records.values():
            if rec.birth <= event and (rec.death is None or rec.death > event):
                out[self._category_of(rec)] += rec.nbytes
        return out

    def category_of(self, t) -> str | None:
        """Category of the storage of tensor ``t`` now (None when it is not counted)."""
        try:
            rec = self.records.get(_local(t).untyped_storage()._cdata)
        except (RuntimeError, NotImplementedError):
            return None
        return None if rec is None else self._category_of(rec)

    def current_categories(self) -> dict[str, int]:
        """Live bytes per category now (forward-born storages still alive count as activations)."""
        out = dict.fromkeys(CATEGORIES, 0)
        for rec in self.records.values():
            out[self._category_of(rec)] += rec.nbytes
        return out

    def peak_categories(self) -> dict[str, int]:
        """Per-category bytes at the moment of :attr:`peak` (sums to ``peak``)."""
        return self.categories_at(self.peak_event)

    def timeline(self, max_points: int = 2000) -> list[tuple[int, str, dict[str, int]]]:
        """(event index, phase, {category: bytes}) samples (needs ``record_timeline=True``), thinned to about
        ``max_points`` while always keeping the global peak sample."""
        if not self._samples_events:
            return []
        # one sample per distinct event index, the last state of that event
        uniq: dict[int, str] = {}
        for ev, ph in self._samples_events:
            uniq[ev] = ph
        evs = sorted(uniq)
        step = max(1, len(evs) // max_points)
        keep = set(evs[::step]) | {evs[-1]}
        if self.peak_event in uniq:
            keep.add(self.peak_event)
        keep_sorted = sorted(keep)
        # sweep lifetimes once: O(records log records + samples * categories)
        births = sorted(self._all, key=lambda r: r.birth)
        deaths = sorted((r for r in self._all if r.death is not None), key=lambda r: r.death)
        cur = dict.fromkeys(CATEGORIES, 0)
        bi = di = 0
        out = []
        for ev in keep_sorted:
            while bi < len(births) and births[bi].birth <= ev:
                r = births[bi]
                cur[self._category_of(r)] += r.nbytes
                bi += 1
            while di < len(deaths) and deaths[di].death <= ev:
                r = deaths[di]
                cur[self._category_of(r)] -= r.nbytes
                di += 1
            out.append((ev, uniq[ev], dict(cur)))
        return out

    def summary(self) -> dict:
        """JSON-friendly summary: peak, current, per-phase peaks, categories at the peak."""
        return {
            "peak_bytes": self.peak,
            "current_bytes": self.current,
            "peak_phase": self.peak_phase,
            "phases": self.phase_peaks,
            "peak_categories": self.peak_categories(),
        }

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._resize_depth -= 1
            if self._resize_depth == 0:
                torch.UntypedStorage.resize_ = self._orig_resize
            self.remove_hooks()


@contextmanager
def capped_memory(cap_bytes: int, model: torch.nn.Module | None = None, optimizer=None, **kw) -> Iterator[LiveBytes]:
    """Simulate a device of ``cap_bytes`` with real tensors: counts the model (and optimizer state) already present,
    then raises ``torch.OutOfMemoryError`` when live tensor bytes would pass the cap."""
    lb = LiveBytes(cap_bytes=cap_bytes, **kw)
    if model is not None:
        lb.track_module(model, optimizer)
    with lb:
        yield lb


__all__ = ["LiveBytes", "CATEGORIES", "PHASES", "round_bytes", "capped_memory", "StorageRecord"]
