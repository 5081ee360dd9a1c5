"""Detach Ray compiled-graph outputs from channel memory (vLLM#35319).

Ray's shared-memory channels deserialize numpy arrays zero-copy and read-only,
backed by the channel buffer. While any of them is alive the writer cannot
reuse the buffer, so a scheduler that keeps the output of step N (its logprobs
in a request's state) blocks step N+1 until ``RAY_CGRAPH_get_timeout``.

Upstream's fix (PR 35736) copies the three logprobs arrays and the auxiliary
rows; it leaves ``prompt_logprobs_dict``, ``sampling_masks`` and any field added
later. Ours covers the whole ``ModelRunnerOutput`` from its annotations: once per
type it works out which fields can hold a numpy array (``plan_for``) and skips the
rest whole (``list[str]``, index dicts, torch tensors, which Ray copies on a CPU
target); arrays are copied when read-only, named tuples and dataclasses by their
fields (frozen ones replaced, the others changed in place), and values declared
``object`` or ``Any`` by what they turn out to be, so a field vLLM adds is covered
without a change here. A field whose annotation says it cannot hold an array is
trusted. Cost (``make bench``, the detach alone on one output of 2048 requests,
testbed / upstream): 1.06-1.07x on logprobs, with ``prompt_logprobs_dict`` and with
``pooler_output`` (about 0.6 us on 10 us), 0.87x on auxiliary rows (a loop generated
per class reads and writes the row attribute by name, as upstream's loop does).
"""

from __future__ import annotations

import collections.abc
import dataclasses
import itertools
import logging
import types
import typing
from typing import Any, Callable

import numpy as np
import torch

from vllm_zerocopy_testbed.config import PatchMode

logger = logging.getLogger(__name__)

_ATOMS = (type(None), bool, int, float, complex, str, bytes)
_ATOM_TYPES = frozenset(_ATOMS)


def _only_atoms(items: Any) -> bool:
    """Whether every item is exactly an atom type: one C-level pass, no per-item recursion.

    Outputs carry long lists of request ids, token ids and index dicts (2048
    requests: ~8k objects); walking them item by item cost 2.7 ms per step.
    """
    return set(map(type, items)) <= _ATOM_TYPES


def _only_lists(items: list[Any]) -> bool:
    return set(map(type, items)) == {list}


def _detached(value: Any, seen: set[int]) -> Any:
    """Return ``value`` with read-only arrays replaced by copies (same object if none)."""
    if isinstance(value, _ATOMS):
        return value
    if isinstance(value, np.ndarray):
        return value if value.flags.writeable else value.copy()
    if id(value) in seen:
        return value
    seen.add(id(value))
    if isinstance(value, list):
        if _only_atoms(value) or (_only_lists(value) and _only_atoms(itertools.chain.from_iterable(value))):
            return value
        for i, item in enumerate(value):
            new = _detached(item, seen)
            if new is not item:
                value[i] = new
        return value
    if isinstance(value, dict):
        if _only_atoms(value.values()):
            return value
        for key, item in value.items():
            new = _detached(item, seen)
            if new is not item:
                value[key] = new
        return value
    if isinstance(value, tuple):
        items = [_detached(item, seen) for item in value]
        if all(new is old for new, old in zip(items, value)):
            return value
        return type(value)._make(items) if hasattr(value, "_fields") else type(value)(items)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {}
        for field in dataclasses.fields(value):
            old = getattr(value, field.name, None)
            new = _detached(old, seen)
            if new is not old:
                changes[field.name] = new
        if not changes:
            return value
        if type(value).__dataclass_params__.frozen:  # type: ignore[attr-defined]
            return dataclasses.replace(value, **changes)
        for name, new in changes.items():
            setattr(value, name, new)
        return value
    return value


# -- typed plans: what a value declared as a type needs, worked out once per type --------------
# A plan takes a value and returns it detached (the same object when nothing changed).
Plan = Callable[[Any], Any]
_TYPE_PLANS: dict[Any, Plan | None] = {}
_RUNTIME_PLANS: dict[type, Plan | None] = {}
_BUILDING = object()
_SETS = (set, frozenset, collections.abc.Set)
_SEQUENCES = (list, collections.abc.Sequence, collections.abc.MutableSequence)
_MAPPINGS = (dict, collections.abc.Mapping, collections.abc.MutableMapping)


def _array(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value if value.flags.writeable else value.copy()
    return _by_runtime_type(value)


def _plan_of_kind(kind: type) -> Plan | None:
    """The plan for values of exactly ``kind`` (None: nothing to do), worked out once per type."""
    try:
        return _RUNTIME_PLANS[kind]
    except KeyError:
        plan = _RUNTIME_PLANS[kind] = None if kind in _ATOM_TYPES else _runtime_plan(kind)
        return plan


def _by_runtime_type(value: Any) -> Any:
    """Detach ``value`` by what it is (its declared type said nothing: ``object``, ``Any``, a union)."""
    plan = _plan_of_kind(type(value))
    return value if plan is None else plan(value)


def _runtime_plan(kind: type) -> Plan | None:
    if issubclass(kind, np.ndarray):
        return _array
    if (issubclass(kind, tuple) and hasattr(kind, "_fields")) or dataclasses.is_dataclass(kind):
        return plan_for(kind)
    if issubclass(kind, (list, dict, tuple)):
        return lambda value: _detached(value, set())  # untyped containers: walk what they hold
    return None  # torch tensors (Ray copies them) and other objects: nothing of a channel's


def _each(plan: Plan, kind: type) -> Plan:
    """Apply ``plan`` to every item of a ``kind`` (list or dict) container, in place."""
    if plan is _by_runtime_type:
        return _each_by_type(kind)
    pairs = enumerate if kind is list else dict.items

    def apply(value: Any) -> Any:
        if type(value) is not kind:
            return _by_runtime_type(value)
        for key, item in pairs(value):
            if item is not None:
                new = plan(item)
                if new is not item:
                    value[key] = new
        return value
    return apply


_ROW_LOOPS: dict[tuple[type, str], Callable[[Any], list[Any]]] = {}
_ROW_LOOP = """
def loop(items):
    others = []
    for item in items:
        if item.__class__ is cls:
            rows = item.{field}
            if rows.__class__ is ndarray:
                if not rows.flags.writeable:
                    item.{field} = rows.copy()
                continue
        others.append(item)
    return others
"""


def _row_loop(cls: type, field: str) -> Callable[[Any], list[Any]]:
    """A loop that detaches ``item.<field>`` of every ``cls`` item and returns the other items.

    Generated per class (as ``dataclasses`` generates ``__init__``) so that the attribute is
    read and written by name, which CPython specialises, instead of by ``getattr``/``setattr``:
    with thousands of items per step that is the difference to upstream's ``.rows`` loop.
    """
    key = (cls, field)
    if key not in _ROW_LOOPS:
        if not field.isidentifier():
            raise ValueError(f"not a field name: {field!r}")
        namespace: dict[str, Any] = {"cls": cls, "ndarray": np.ndarray}
        exec(_ROW_LOOP.format(field=field), namespace)  # noqa: S102 - a field name, checked above
        _ROW_LOOPS[key] = namespace["loop"]
    return _ROW_LOOPS[key]


def _each_by_type(kind: type) -> Plan:
    """Items declared as ``object`` (vLLM's auxiliary outputs, one per request), dispatched on their
    type; when the first is a dataclass with one array field, one generated loop does all of that
    type, so that this costs what upstream's loop over ``.rows`` costs."""
    def apply(value: Any) -> Any:
        if type(value) is not kind:
            return _by_runtime_type(value)
        if not value:
            return value
        items: Any = value.values() if kind is dict else value
        first = next(iter(items))
        field = getattr(_plan_of_kind(type(first)), "array_field", None)
        others = _row_loop(type(first), field)(items) if field else list(items)
        replaced: dict[int, Any] = {}
        for item in others:
            plan = _plan_of_kind(type(item))
            if plan is not None:
                new = plan(item)
                if new is not item:
                    replaced[id(item)] = new
        if replaced:  # frozen dataclasses and named tuples come back as new objects
            for key, item in (value.items() if kind is dict else enumerate(value)):
                if id(item) in replaced:
                    value[key] = replaced[id(item)]
        return value
    return apply


def _items(plan: Plan) -> Plan:
    return _each(plan, list)


def _values(plan: Plan) -> Plan:
    return _each(plan, dict)


def _hints(cls: type) -> dict[str, Any]:
    """The class's field annotations, resolved; an unresolvable one counts as ``Any``."""
    try:
        return typing.get_type_hints(cls)
    except Exception:  # forward references vLLM only imports under TYPE_CHECKING
        return {name: Any for name in getattr(cls, "__annotations__", {})}


def _named_tuple(cls: type) -> Plan | None:
    hints = _hints(cls)
    plans = [(i, plan_for(hints.get(name, Any))) for i, name in enumerate(cls._fields)]
    plans = [(i, p) for i, p in plans if p is not None]
    if not plans:
        return None

    def apply(value: Any) -> Any:
        if type(value) is not cls:
            return _by_runtime_type(value)
        items = None
        for i, plan in plans:
            item = value[i]
            if item is None:
                continue
            if plan is _array and isinstance(item, np.ndarray):  # the common case, without a call
                new = item if item.flags.writeable else item.copy()
            else:
                new = plan(item)
            if new is not item:
                items = items or list(value)
                items[i] = new
        return value if items is None else cls._make(items)
    return apply


def _dataclass(cls: type) -> Plan | None:
    hints = _hints(cls)
    plans = [(f.name, plan_for(hints.get(f.name, Any))) for f in dataclasses.fields(cls)]
    plans = [(name, p) for name, p in plans if p is not None]
    if not plans:
        return None
    if not cls.__dataclass_params__.frozen:  # type: ignore[attr-defined]
        if len(plans) == 1 and plans[0][1] is _array:
            return _one_array_field(cls, plans[0][0])

        def apply_in_place(value: Any) -> Any:
            if type(value) is not cls:
                return _by_runtime_type(value)
            for name, plan in plans:
                old = getattr(value, name, None)
                if old is not None:
                    new = plan(old)
                    if new is not old:
                        setattr(value, name, new)
            return value
        return apply_in_place

    def apply_frozen(value: Any) -> Any:
        if type(value) is not cls:
            return _by_runtime_type(value)
        changes = {}
        for name, plan in plans:
            old = getattr(value, name, None)
            if old is not None:
                new = plan(old)
                if new is not old:
                    changes[name] = new
        return dataclasses.replace(value, **changes) if changes else value
    return apply_frozen


def _one_array_field(cls: type, name: str) -> Plan:
    """A mutable dataclass whose one field to detach is an array (``AuxRequestOutput.rows``): the copy
    inline, one call per item; containers of thousands inline even that (``array_field``)."""
    def apply(value: Any) -> Any:
        if type(value) is not cls:
            return _by_runtime_type(value)
        old = getattr(value, name, None)
        if isinstance(old, np.ndarray):
            if not old.flags.writeable:
                setattr(value, name, old.copy())
        elif old is not None:
            new = _by_runtime_type(old)
            if new is not old:
                setattr(value, name, new)
        return value
    apply.array_field = name  # type: ignore[attr-defined]
    return apply


def plan_for(declared: Any) -> Plan | None:
    """Return how to detach a value declared as ``declared``; None where it cannot hold a channel array.

    From annotations, once per type: ``list[str]``, ``dict[str, int]``, torch tensors (Ray
    copies them) and unions of such are skipped whole; arrays are copied when read-only;
    named tuples and dataclasses by their fields; ``object``, ``Any`` and untyped containers
    by what the value turns out to be. A subclass of a declared class is planned as itself.
    """
    try:
        cached = _TYPE_PLANS[declared]
    except TypeError:  # an unhashable annotation
        return _by_runtime_type
    except KeyError:
        pass
    else:
        return _by_runtime_type if cached is _BUILDING else cached  # a type that holds itself
    _TYPE_PLANS[declared] = _BUILDING
    plan = _TYPE_PLANS[declared] = _build(declared)
    return plan


def _build(declared: Any) -> Plan | None:
    origin, args = typing.get_origin(declared), typing.get_args(declared)
    if declared is None or declared is type(None) or origin in (typing.Literal, typing.ClassVar):
        return None
    if origin in (typing.Union, types.UnionType):
        plans = [p for p in (plan_for(a) for a in args) if p is not None]
        # One kind that may hold arrays (``X | None``): its plan, which passes anything else on by type.
        return None if not plans else plans[0] if len(plans) == 1 else _by_runtime_type
    if origin in _SETS:
        return None  # arrays are unhashable: no set holds one
    if origin in _SEQUENCES:
        item = plan_for(args[0]) if args else _by_runtime_type
        return None if item is None else _items(item)
    if origin in _MAPPINGS:
        value = plan_for(args[1]) if len(args) == 2 else _by_runtime_type
        return None if value is None else _values(value)
    if origin is tuple:
        return _by_runtime_type if any(plan_for(a) for a in args if a is not Ellipsis) else None
    if origin is not None:
        declared = origin  # np.ndarray[Any, np.dtype[...]], npt.NDArray and other generics
    if not isinstance(declared, type) or declared is object:
        return _by_runtime_type  # Any, a TypeVar, an unresolved name
    if declared in _ATOM_TYPES or issubclass(declared, torch.Tensor):
        return None
    if issubclass(declared, np.ndarray):
        return _array
    if issubclass(declared, tuple) and hasattr(declared, "_fields"):
        return _named_tuple(declared)
    if dataclasses.is_dataclass(declared):
        return _dataclass(declared)
    if issubclass(declared, (list, dict, tuple)):
        return _by_runtime_type
    return None  # other classes: not walked (their state is theirs, not the output's fields)


def detach_output(output: Any) -> None:
    """Copy, in place, every read-only numpy array reachable from ``output``.

    Same contract as vLLM's ``detach_zero_copy_from_model_runner_output``:
    ``output`` (a ``ModelRunnerOutput`` or ``None``) is changed in place.
    """
    if output is not None:
        _by_runtime_type(output)


def _no_detach(output: Any) -> None:
    """The behaviour before upstream PR 35736: keep channel-backed arrays as they are."""


_UPSTREAM_NAME = "detach_zero_copy_from_model_runner_output"
# Modules that look the function up as a global at call time.
_CALLER_MODULES = ("vllm.v1.executor.ray_utils", "vllm.v1.executor.ray_executor")
_installed: Callable[[Any], None] | None = None


def upstream_detach() -> Callable[[Any], None] | None:
    """Return the installed vLLM's detach function, or ``None`` if it predates PR 35736."""
    try:
        from vllm.v1.executor import ray_utils
    except ImportError:
        return None
    return getattr(ray_utils, _UPSTREAM_NAME, None)


def resolve(mode: PatchMode) -> Callable[[Any], None]:
    """Return the detach function that ``mode`` stands for."""
    global _installed
    if _installed is None:
        _installed = upstream_detach() or _no_detach
    if mode is PatchMode.UPSTREAM:
        return _installed
    return detach_output if mode is PatchMode.TESTBED else _no_detach


def apply(mode: PatchMode) -> None:
    """Make vLLM's Ray executors detach outputs as ``mode`` says, in this process."""
    import importlib

    function = resolve(mode)
    for name in _CALLER_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError as exc:  # no Ray in this process's environment
            logger.debug("detach patch: %s not importable (%s)", name, exc)
            continue
        if hasattr(module, _UPSTREAM_NAME) or mode is not PatchMode.UPSTREAM:
            setattr(module, _UPSTREAM_NAME, function)


def active_mode() -> PatchMode:
    """Return the mode vLLM's ``ray_utils`` detach currently follows in this process."""
    try:
        from vllm.v1.executor import ray_utils
    except ImportError:
        return PatchMode.UPSTREAM
    function = getattr(ray_utils, _UPSTREAM_NAME, None)
    if function is detach_output:
        return PatchMode.TESTBED
    if function is _no_detach:
        return PatchMode.OFF
    return PatchMode.UPSTREAM
