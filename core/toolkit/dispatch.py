"""Launching a compiled Triton kernel variant without Triton's per-call dispatch.

``kernel[grid](**kwargs)`` binds every argument, specialises each one (a tensor's dtype
and 16-byte alignment, an int's equality to 1 and divisibility by 16), builds a cache
key from them and looks the compiled variant up, on every call. For a kernel of ~50
arguments that is 50-70 us of host time per launch on an H200 host: more than a
split decode takes on the GPU, so an eager forward waits on its host.

Here the arguments come in groups. Shared groups (``LaunchArgs``: a step's metadata,
a layer's cache views and scalars) are specialised once, per kernel; only the few
per-call arguments (a forward's query and output, their strides) are specialised at
each call. The variant found by Triton's own dispatch on the first call of a
specialisation is remembered under that key and launched directly after that.

The key is at least as fine as Triton's own: constexpr parameters and launch options
by value, other ints by (== 1, % 16 == 0, 32-bit range), tensors by (dtype, 16-byte
alignment), floats as fp32, host TMA descriptors by their tensor's dtype and alignment,
block shape, shared layout, padding and their shape and strides as ints. A group holding
anything else always takes Triton's dispatch.

A direct launch passes tensors as their addresses: Triton's launcher would otherwise
call each tensor's ``data_ptr()`` and ask the driver whether the address is a device
pointer (``cuPointerGetAttribute``), ~0.5 us per tensor argument, 10-20 us for a kernel
of 30 tensors. The contract's forward checks that every tensor is on the query's device
before a launch, which is what the driver's check caught. A launch's arguments are laid
out from the first group's (a step's, placed once per kernel) and the later groups'
(``_layout``, kept per combination of them); a call fills in only its own, found once
for all of a forward's launches (``CallArgs``). The triton and MLA backends pass a
layer's tensors with the call's (``layer_groups``), so that every layer of equal
scalars shares one group of the rest and a step's layers one layout (a layout per
layer and step was made anew at every layer's forward in serving).

The launch itself goes to Triton's C launcher directly where its Python wrapper would
only pass the arguments on (no scratch memory to allocate), and without the launch's
metadata and hooks while no launch hook is installed: Triton 3.5+ builds the metadata
and calls its (empty) chains of hooks at every launch. For a kernel of host TMA
descriptors, whose launcher wrapper encodes each one at every launch, the encodings
are kept by address, shape and strides (``_Descriptors``; on the H200 an MLA forward's
launches took 40.5 us instead of 51.4, docs/mla.md).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

# a value the key cannot describe: the launch takes Triton's dispatch
_OPAQUE = object()


def specialization(value: Any) -> Any:
    """What a launch's variant depends on for a non-constexpr argument (conservatively:
    never coarser than Triton's own specialisation), or ``_OPAQUE``."""
    if isinstance(value, torch.Tensor):
        return (value.dtype, value.data_ptr() % 16 == 0)
    if isinstance(value, bool):
        return ("b", value)
    if isinstance(value, int):
        return ("i", value == 1, value % 16 == 0, -(2**31) <= value < 2**31, value < 2**63)
    if isinstance(value, float):
        return "f"
    if value is None:
        return None
    if _is_tensor_descriptor(value):
        # Triton keys a host descriptor by dtype, block shape and layout; the rest is finer
        base = value.base
        return (
            "desc", type(value).__qualname__, base.dtype, base.data_ptr() % 16 == 0,
            tuple(value.block_shape), _layout_key(getattr(value, "layout", None)),
            getattr(value, "padding", None), *map(_int_spec, value.shape),
            *map(_int_spec, value.strides),
        )  # fmt: skip
    return _OPAQUE


# ints' specialisations, by value: a call's ints are its tensors' strides, the same few
# from one forward to the next (bounded: cleared when full)
_INT_SPECS: dict[int, tuple] = {}
_INT_SPECS_MAX = 4096


def _int_spec(value: int) -> tuple:
    """An int's specialisation, looked up by value."""
    spec = _INT_SPECS.get(value)
    if spec is None:
        if len(_INT_SPECS) >= _INT_SPECS_MAX:
            _INT_SPECS.clear()
        spec = _INT_SPECS[value] = specialization(int(value))
    return spec


# a Gluon shared layout's key (its repr, a dataclass's: slow), by the layout object (kept,
# so that its id stays its own; layouts are few and made once)
_LAYOUT_KEYS: dict[int, tuple[Any, str]] = {}


def _layout_key(layout: Any) -> str | None:
    if layout is None:
        return None
    hit = _LAYOUT_KEYS.get(id(layout))
    if hit is None or hit[0] is not layout:
        hit = _LAYOUT_KEYS[id(layout)] = (layout, repr(layout))
    return hit[1]


def call_entry(value: Any) -> tuple[Any, Any]:
    """(``specialization(value)``, ``launch_value(value)``) in one step: what a launch
    needs of each per-call argument (a tensor's address is read once, an int's key is
    looked up)."""
    kind = type(value)
    if kind is torch.Tensor:
        address = value.data_ptr()
        return (value.dtype, address % 16 == 0), address
    if kind is int:
        return _int_spec(value), value
    return specialization(value), launch_value(value)


def _is_tensor_descriptor(value: Any) -> bool:
    """A host-side TMA descriptor (``triton.tools.tensor_descriptor.TensorDescriptor`` or
    Gluon's): a tensor ``base`` with ``block_shape``, ``shape`` and ``strides``."""
    return all(hasattr(value, a) for a in ("base", "block_shape", "shape", "strides")) and (
        isinstance(value.base, torch.Tensor)
    )


def launch_value(value: Any) -> Any:
    """``value`` as a direct launch passes it: a tensor as its address (see above)."""
    return value.data_ptr() if isinstance(value, torch.Tensor) else value


@dataclass(frozen=True)
class _Params:
    """A JIT kernel's parameters, as its launcher takes them."""

    names: tuple[str, ...]
    index: dict[str, int]
    constexprs: frozenset[str]
    defaults: tuple[Any, ...]  # every parameter's default (None where it has none)
    # a call's argument names -> their parameter indices (``positions``)
    _positions: dict[tuple[str, ...], tuple[int, ...]] = field(
        default_factory=dict, compare=False, repr=False
    )

    # a shared group's names -> each one's (parameter index or -1, keyed by value)
    _roles: dict[tuple[str, ...], tuple[tuple[int, bool], ...]] = field(
        default_factory=dict, compare=False, repr=False
    )

    def positions(self, names: tuple[str, ...]) -> tuple[int, ...]:
        found = self._positions.get(names)
        if found is None:
            found = self._positions[names] = tuple(self.index[n] for n in names)
        return found

    def roles(self, names: tuple[str, ...]) -> tuple[tuple[int, bool], ...]:
        """Each of ``names``: its parameter index (-1: a launch option), and whether a
        variant depends on its value (a constexpr or an option) rather than on its
        specialisation."""
        found = self._roles.get(names)
        if found is None:
            found = self._roles[names] = tuple(
                (self.index.get(n, -1), n not in self.index or n in self.constexprs) for n in names
            )
        return found


_PARAMS: dict[int, tuple[Any, _Params | None]] = {}


def _params(kernel: Any) -> _Params | None:
    """``kernel``'s parameters, or None when it is not a compiled JIT kernel (Triton's
    interpreter, a plain function)."""
    hit = _PARAMS.get(id(kernel))
    if hit is not None and hit[0] is kernel:
        return hit[1]
    params = getattr(kernel, "params", None)
    signature = getattr(kernel, "signature", None)
    if params is None or signature is None or type(kernel).__name__ == "InterpretedFunction":
        found = None
    else:
        names = tuple(p.name for p in params)
        defaults = tuple(
            None if p.default is p.empty else p.default for p in signature.parameters.values()
        )
        found = _Params(
            names,
            {n: i for i, n in enumerate(names)},
            frozenset(p.name for p in params if p.is_constexpr),
            defaults,
        )
    _PARAMS[id(kernel)] = (kernel, found)  # the kernel is kept: its id stays its own
    return found


# specialisation keys of shared groups, interned to small ints (a group's key is
# computed once; a variant's key then hashes a few ints)
_KEY_IDS: dict[tuple, int] = {}


class LaunchArgs:
    """Launch arguments that many launches share (a step's metadata, a layer's cache
    views and scalars), specialised once per kernel. Launch options (num_warps, ...)
    may be among them. The values must not change after the first launch."""

    __slots__ = ("_bound", "_layouts", "_placed", "values")

    def __init__(self, values: Mapping[str, Any]) -> None:
        self.values = values
        self._bound: dict[int, tuple[int, tuple[tuple[int, Any], ...]] | None] = {}
        # every parameter of a kernel, this group's values in place, defaults elsewhere
        self._placed: dict[int, list[Any]] = {}
        # a launch's arguments laid out, by (kernel, the groups after this one): _layout
        self._layouts: dict[tuple[int, ...], tuple[tuple[LaunchArgs, ...], Any]] = {}

    def bound(self, kernel: Any, params: _Params) -> tuple[int, tuple[tuple[int, Any], ...]] | None:
        """(key id, (parameter index, value) pairs) for ``kernel``; None when a value
        cannot be keyed."""
        key = id(kernel)
        if key in self._bound:
            return self._bound[key]
        names = tuple(self.values)
        spec: list[Any] = [names]
        positions = []
        found: tuple[int, tuple[tuple[int, Any], ...]] | None = None
        for (i, by_value), value in zip(params.roles(names), self.values.values()):
            if by_value:  # an option or constexpr: by value
                try:
                    hash(value)
                except TypeError:
                    break
                spec.append((type(value), value))
                if i >= 0:
                    positions.append((i, launch_value(value)))
            else:
                s, launched = call_entry(value)
                if s is _OPAQUE:
                    break
                spec.append(s)
                positions.append((i, launched))
        else:
            found = (_KEY_IDS.setdefault(tuple(spec), len(_KEY_IDS)), tuple(positions))
        self._bound[key] = found
        return found

    def placed(self, kernel: Any, params: _Params) -> list[Any]:
        """Every parameter of ``kernel`` in order: this group's values in place, the
        defaults elsewhere (not to be changed: copied by each layout). The group must be
        keyed (``bound``)."""
        args = self._placed.get(id(kernel))
        if args is None:
            bound = self.bound(kernel, params)
            assert bound is not None
            args = self._placed[id(kernel)] = list(params.defaults)
            for i, value in bound[1]:
                args[i] = value
        return args


class CallArgs:
    """A call's own arguments (a forward's query, output and their strides) with each
    one's specialisation and launch value, found once for every launch that takes them.
    ``extended``: with arguments found once for many calls appended (a layer's cache
    views: passed per call so that every layer of a step shares one layout, ``_layout``)."""

    __slots__ = ("_fixed", "_mapping", "_source", "key", "names", "specs", "values")

    def __init__(self, mapping: Mapping[str, Any]) -> None:
        self._mapping: Mapping[str, Any] | None = mapping
        # where ``mapping`` finds the arguments when made lazily: the call an extended or
        # picked call was made from (with ``_fixed``'s, extended)
        self._source: CallArgs | None = None
        self._fixed: CallArgs | None = None
        self.names = tuple(mapping)
        self.specs, self.values = zip(*map(call_entry, mapping.values())) if mapping else ((), ())
        self.key = _call_key(self.names, self.specs)

    @property
    def mapping(self) -> Mapping[str, Any]:
        """The arguments by name (Triton's dispatch takes them so), made when first asked
        for: a forward's direct launches never need it."""
        if self._mapping is None:
            assert self._source is not None
            source = self._source.mapping
            if self._fixed is not None:
                source = {**source, **self._fixed.mapping}
            self._mapping = {n: source[n] for n in self.names}
        return self._mapping

    def extended(self, fixed: CallArgs) -> CallArgs:
        """These arguments followed by ``fixed``'s (found once for many calls), the
        combination's key kept (a forward's arguments go to kernels with and without a
        layer's tensors)."""
        key = _EXTENDED.get((self.key, fixed.key))
        if key is None:
            key = _EXTENDED[(self.key, fixed.key)] = _call_key(
                self.names + fixed.names, self.specs + fixed.specs
            )
        out = object.__new__(CallArgs)
        out._mapping, out._source, out._fixed = None, self, fixed
        out.names, out.key = self.names + fixed.names, key
        out.specs, out.values = self.specs + fixed.specs, self.values + fixed.values
        return out

    def subset(self, names: tuple[str, ...]) -> CallArgs:
        """The arguments ``names`` (in that order), without finding them again."""
        found = _SUBSETS.get((self.key, names))
        if found is None:
            index = [self.names.index(n) for n in names]
            key = _call_key(names, tuple(self.specs[i] for i in index))
            found = _SUBSETS[(self.key, names)] = (index, key)
        index, key = found
        picked = object.__new__(CallArgs)
        picked._mapping, picked._source, picked._fixed = None, self, None
        picked.names, picked.key = names, key
        picked.specs = tuple(self.specs[i] for i in index)
        picked.values = tuple(self.values[i] for i in index)
        return picked


# groups of equal values, one object each (``shared_group``)
_SHARED_GROUPS: dict[tuple, LaunchArgs] = {}
_SHARED_GROUPS_MAX = 256


def shared_group(values: Mapping[str, Any]) -> LaunchArgs:
    """One ``LaunchArgs`` for every caller whose ``values`` are equal (by type and value;
    hashable values only: a layer's scalars, flags and strides). A launch is laid out
    once for its first group and the groups after it (``_layout``), so the layers of a
    model, which share these, share the layout of a step's launches."""
    key = tuple((name, type(value), value) for name, value in values.items())  # True != 1
    group = _SHARED_GROUPS.get(key)
    if group is None:
        if len(_SHARED_GROUPS) >= _SHARED_GROUPS_MAX:
            _SHARED_GROUPS.clear()
        group = _SHARED_GROUPS[key] = LaunchArgs(values)
    return group


def layer_groups(values: Mapping[str, Any], own: Sequence[str]) -> tuple[LaunchArgs, CallArgs]:
    """A layer's launch arguments as (a group shared by every layer of equal values, the
    layer's ``own`` ones, its tensors and descriptors, as fixed call arguments): each
    forward passes those with its own (``CallArgs.extended``), found once here."""
    return (
        shared_group({k: v for k, v in values.items() if k not in own}),
        CallArgs({k: values[k] for k in own if k in values}),
    )


# calls' (names, specialisations), interned to small ints like the shared groups' keys
# (a forward's launches then look their variants up by a few ints)
_CALL_KEYS: dict[tuple, int] = {}
# a subset's argument positions and key, by (the call's key, the subset's names)
_SUBSETS: dict[tuple, tuple[list[int], int]] = {}
# an extended call's key, by (the call's key, the appended arguments' key)
_EXTENDED: dict[tuple[int, int], int] = {}


def _call_key(names: tuple[str, ...], specs: tuple[Any, ...]) -> int:
    return _CALL_KEYS.setdefault((names, specs), len(_CALL_KEYS))


# compiled variants (``CompiledLaunch``) by (the shared groups' key, the call's key)
_VARIANTS: dict[tuple, Any] = {}


def launch(
    kernel: Any,
    grid: Sequence[int],
    shared: Sequence[LaunchArgs],
    call: Mapping[str, Any] | CallArgs,
    stream: torch.cuda.Stream | None = None,
) -> Any:
    """``kernel[grid](**shared..., **call)``: through Triton's dispatch the first time a
    specialisation is seen, directly after that. ``call`` holds the non-constexpr
    arguments that change from call to call (a ``CallArgs`` when several launches take
    them). ``stream``: launch there instead of on the current stream (without making it
    current: a direct launch takes its handle). Returns Triton's handle on a dispatched
    call, None on a direct one."""
    if not isinstance(call, CallArgs):
        call = CallArgs(call)
    layout = _layout(kernel, shared)
    if layout is None:  # not a compiled kernel, or a shared value that cannot be keyed
        return _dispatch(kernel, grid, shared, call.mapping, stream)
    prefix, template, params = layout
    names = call.names
    key = (prefix, call.key)
    variant = _VARIANTS.get(key)
    if variant is None:
        if any(s is _OPAQUE for s in call.specs) or any(n in params.constexprs for n in names):
            return _dispatch(kernel, grid, shared, call.mapping, stream)
        found = _dispatch(kernel, grid, shared, call.mapping, stream)
        if all(hasattr(found, a) for a in ("run", "function", "packed_metadata")):
            _VARIANTS[key] = CompiledLaunch(found)
        return found
    args = template.copy()
    for i, value in zip(params.positions(names), call.values):
        args[i] = value
    variant.launch(grid, args, current_stream() if stream is None else stream.cuda_stream)
    return None


def _layout(
    kernel: Any, shared: Sequence[LaunchArgs]
) -> tuple[tuple[int, ...], list[Any], _Params] | None:
    """(the shared groups' key, every parameter of ``kernel`` in order with the groups'
    values in place and the defaults elsewhere, its parameters), or None when the groups
    cannot be keyed. The first group (a step's, which lives as long as the step) places
    its values once per kernel and keeps a layout per combination of the groups after
    it (a layer's): a model's layers of equal scalars share theirs (``layer_groups``),
    so its layers find one layout, and alternating kinds of layer (a sliding window
    every other layer) one each."""
    first, rest = shared[0], tuple(shared[1:])
    layout_key = (id(kernel), *map(id, rest))
    hit = first._layouts.get(layout_key)
    if hit is not None:
        for kept, given in zip(hit[0], rest):
            if kept is not given:  # an id reused by a new group
                break
        else:
            return hit[1]
    params = _params(kernel)
    bound = [g.bound(kernel, params) for g in shared] if params is not None else [None]
    layout = None
    if params is not None and None not in bound:
        args = first.placed(kernel, params).copy()
        for b in bound[1:]:
            for i, value in b[1]:
                args[i] = value
        layout = ((id(kernel), *(b[0] for b in bound)), args, params)
    first._layouts[layout_key] = (rest, layout)
    return layout


def _dispatch(
    kernel: Any,
    grid: Sequence[int],
    shared: Sequence[LaunchArgs],
    call: Mapping[str, Any],
    stream: torch.cuda.Stream | None = None,
) -> Any:
    kwargs: dict[str, Any] = {}
    for g in shared:
        kwargs.update(g.values)
    kwargs.update(call)
    if stream is None:
        return kernel[tuple(grid)](**kwargs)
    with torch.cuda.stream(stream):  # Triton's dispatch launches on the current stream
        return kernel[tuple(grid)](**kwargs)


@functools.cache
def _runtime_knobs() -> Any:
    """Triton's runtime knobs (the launch hooks), read at each launch."""
    from triton import knobs

    return knobs.runtime


def _active(hook: Any) -> bool:
    """Whether a launch hook would call anything: Triton 3.5+ passes a chain of hooks
    (``HookChain``) to its launcher even when the chain is empty, and builds the
    launch's metadata for it."""
    return hook is not None and bool(getattr(hook, "calls", True))


@functools.cache
def _stream_getters() -> tuple[Any, Any]:
    from triton.runtime.driver import driver

    return driver.active.get_current_stream, driver.active.get_current_device


def current_stream() -> int:
    """The stream Triton's dispatch launches on: the current device's current stream."""
    get_stream, get_device = _stream_getters()
    return get_stream(get_device())


class CompiledLaunch:
    """A compiled variant and how it is launched directly (``launch(grid, args,
    stream)``, ``args`` every parameter in order, constexprs included, tensors as
    addresses): what Triton's dispatch ends with (the variant's ``run``), or, where that
    is Triton's CUDA launcher with no scratch memory to allocate per launch, the
    launcher's ``launch`` with its fixed arguments bound (``CudaLauncher.__call__``
    would only pass them on): the C entry point; for a kernel of TMA descriptors the C
    entry point behind Triton's wrapper, each descriptor's encoding kept
    (``_Descriptors``), or the wrapper itself where it cannot be unwrapped. Without
    launch hooks the launch's metadata (made only for a hook) is not built."""

    __slots__ = ("c_launch", "compiled", "descriptors", "fixed")

    def __init__(self, compiled: Any) -> None:
        self.compiled = compiled
        self.c_launch = None
        self.descriptors: _Descriptors | None = None
        self.fixed: tuple[Any, ...] = ()
        run = compiled.run
        if (
            type(run).__name__ == "CudaLauncher"
            and callable(getattr(run, "launch", None))
            and getattr(run, "global_scratch_size", 1) == 0
            and getattr(run, "profile_scratch_size", 1) == 0
            and hasattr(run, "launch_cooperative_grid")
            and hasattr(run, "launch_pdl")
        ):
            self.c_launch = run.launch
            self.descriptors = _Descriptors.unwrap(run.launch)
            if self.descriptors is not None:  # the wrapper's C launcher, encoding kept
                self.c_launch = self.descriptors.c_launch
            # after the grid and stream: the function, cooperative grid, PDL, the global
            # and profile scratch (none), the packed metadata, launch metadata and hooks
            self.fixed = (
                compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None,
                compiled.packed_metadata, None, None, None,
            )  # fmt: skip

    def launch(self, grid: Sequence[int], args: list[Any], stream: int) -> None:
        g = (*grid, 1, 1)[:3]
        hooks = _runtime_knobs()
        enter, exit_ = hooks.launch_enter_hook, hooks.launch_exit_hook
        hooked = _active(enter) or _active(exit_)
        if self.c_launch is not None and not hooked:
            if self.descriptors is not None:
                args = self.descriptors.expand(args)
            self.c_launch(g[0], g[1], g[2], stream, *self.fixed, *args)
            return
        compiled = self.compiled
        # the launch's metadata is only for a hook (Triton's own returns None without one)
        metadata = compiled.launch_metadata(g, stream, *args) if hooked else None
        if not hooked:
            enter = exit_ = None
        compiled.run(
            g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata, metadata,
            enter, exit_, *args,
        )  # fmt: skip


class _Descriptors:
    """A kernel's host TMA descriptor arguments as Triton's launcher wrapper passes them
    to its C launcher (each a ``CUtensorMap``, then the shape and strides), encoded once
    per (address, shape, strides) instead of at every launch (``cuTensorMapEncodeTiled``
    and the wrapper's Python, ~5 us a descriptor on an H200 host): a layer's cache
    descriptors are the same at every forward, a forward's query descriptors whenever
    its buffer is (the caching allocator reuses them). The encoding is a value of those
    and of the variant's own descriptor metadata: no tensor is kept."""

    __slots__ = ("c_launch", "encode", "indices", "memos", "metadata")
    MAX_ENCODINGS = 64  # per descriptor argument (cleared when full)

    def __init__(self, c_launch: Any, indices: Sequence[int], metadata: Sequence[Any],
                 encode: Any) -> None:  # fmt: skip
        self.c_launch = c_launch
        self.indices = tuple(sorted(indices))
        self.metadata = tuple(metadata)
        self.encode = encode
        self.memos: tuple[dict[tuple, list[Any]], ...] = tuple({} for _ in self.indices)

    @classmethod
    def unwrap(cls, launch: Any) -> _Descriptors | None:
        """The descriptors of Triton's wrapper ``launch`` (``wrap_handle_tensordesc``'s
        ``inner``: its C launcher, the descriptors' argument indices and metadata in its
        closure, the encoder in its module), or None: not that wrapper, or descriptors
        the wrapper passes as tensors (no metadata: nothing to encode)."""
        code, closure = getattr(launch, "__code__", None), getattr(launch, "__closure__", None)
        if code is None or closure is None:
            return None
        cells = dict(zip(code.co_freevars, (c.cell_contents for c in closure), strict=True))
        encode = getattr(launch, "__globals__", {}).get("make_tensordesc_arg")
        if set(cells) != {"launcher", "tensordesc_indices", "tensordesc_meta"} or encode is None:
            return None
        indices, metadata = cells["tensordesc_indices"], cells["tensordesc_meta"]
        if not metadata or len(metadata) != len(indices) or any(m is None for m in metadata):
            return None
        return cls(cells["launcher"], indices, metadata, encode)

    def expand(self, args: list[Any]) -> list[Any]:
        """``args`` (every parameter) with each descriptor replaced by its encoding."""
        out: list[Any] = []
        start = 0
        for slot, i in enumerate(self.indices):
            out += args[start:i]
            desc = args[i]
            key = (desc.base.data_ptr(), *desc.shape, *desc.strides, getattr(desc, "padding", None))
            memo = self.memos[slot]
            encoded = memo.get(key)
            if encoded is None:
                if len(memo) >= self.MAX_ENCODINGS:
                    memo.clear()
                encoded = memo[key] = self.encode(desc, self.metadata[slot])
            out += encoded
            start = i + 1
        out += args[start:]
        return out
