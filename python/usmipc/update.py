"""The consumer's update in one call: a handoff copied into its own weights.

An inference engine keeps its own parameters (named and laid out its own
way) and, every step, copies the trainer's handoff into them::

    plan = usmipc.UpdatePlan(engine_weights)          # once
    while True:
        raw = pipe.recv()                             # the trainer's bytes
        plan.update(raw, stream=torch.cuda.current_stream())

``update`` is one call into the C library (``usmipc_bundle_update``): it
opens the bytes (warm: no driver work), orders the copies after the
producer's work on ``stream``, copies every leaf as one unit of device work
(CUDA: one kernel launch over a table kept on the device) and returns the
handoff's release ticket after the copies, on the device: no host wait, no
Python object and no attribute read per leaf.

Destinations, matched to the bundle's arrays by path once (at the first
update, and again only if the producer's tree changes):

- a tree of the same nesting as the producer's (a state dict for a state
  dict): each destination leaf takes the bundle's array at the same path;
- a dict whose keys are path tuples, ``{("layers", 3, "w"): view}``, mixed
  freely with ordinary keys;
- a list of ``(path, destination)`` pairs, a path being a tuple of dict
  keys and list indices (or one dict key as a ``str``).

The bundle may hold arrays that no destination takes (they are not
copied). A destination must have the source's dtype and shape; its strides
may differ when both sides are rows of contiguous elements with one pitch
each (a column shard of a matrix, say). Everything is checked before
anything is copied, and errors name the destination's path.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from usmipc import _usmipc

__all__ = ["UpdatePlan"]

Path = tuple[Union[str, int], ...]


def _label(path: Path) -> str:
    return "".join(f"[{p!r}]" for p in path) or "the root"


def _is_path(p: Any) -> bool:
    if isinstance(p, str):
        return True
    return isinstance(p, tuple) and all(
        isinstance(x, (str, int)) and not isinstance(x, bool) for x in p)


def _flatten(dest: Any) -> list[tuple[Path, Any]]:
    """(path, array) pairs of the destinations, in a stable order."""
    if isinstance(dest, list) and dest and all(
            isinstance(x, tuple) and len(x) == 2 and _is_path(x[0])
            for x in dest):
        return [((p,) if isinstance(p, str) else p, a) for p, a in dest]
    out: list[tuple[Path, Any]] = []

    def walk(obj: Any, path: Path, depth: int) -> None:
        if depth > 64:
            raise _usmipc.ArgumentError(
                f"UpdatePlan: the destinations are nested deeper than 64 "
                f"levels at {_label(path)}")
        if isinstance(obj, dict):
            for k, v in list(obj.items()):
                if isinstance(k, tuple) and _is_path(k):
                    out.append((k, v))
                elif isinstance(k, str):
                    walk(v, path + (k,), depth + 1)
                else:
                    raise _usmipc.ArgumentTypeError(
                        f"UpdatePlan: a key {k!r} at {_label(path)}: keys "
                        f"are str (a dict of the tree) or tuples (a path)")
        elif isinstance(obj, (list, tuple)):
            for i, v in enumerate(list(obj)):
                walk(v, path + (i,), depth + 1)
        else:
            out.append((path, obj))

    walk(dest, (), 0)
    return out


class UpdatePlan:
    """Where each array of a handoff goes in this process's own arrays.

    ``dest``: a tree like the producer's, a dict of path tuples, or a list of
    ``(path, array)`` pairs (see the module's documentation). An array is a
    torch tensor, anything with ``__cuda_array_interface__`` or
    ``__dlpack__``, or usmipc memory; the plan keeps each alive.
    ``device``: where the copies run (default: the device the producer's
    memory is mapped on). ``strict=True`` refuses a handoff whose tree
    differs from the first one instead of matching the paths again.
    """

    def __init__(self, dest: Any,
                 device: Union[_usmipc.Device, str, None] = None, *,
                 strict: bool = False) -> None:
        self._pairs = _flatten(dest)
        seen = set()
        for path, _ in self._pairs:
            if path in seen:
                raise _usmipc.ArgumentError(
                    f"UpdatePlan: two destinations for {_label(path)}")
            seen.add(path)
        self._device: Optional[_usmipc.Device] = (
            device if device is None or isinstance(device, _usmipc.Device)
            else _usmipc.Device(device))
        self._strict = bool(strict)
        self._plan: Optional[_usmipc._CopyPlan] = None
        self._paths: Optional[list[Path]] = None

    def _bind(self, data: _usmipc.BytesLike) -> _usmipc._CopyPlan:
        paths, device = _usmipc._bundle_paths(data)
        index = {p: i for i, p in enumerate(paths)}
        dests: list[tuple[int, Any, str]] = []
        for path, array in self._pairs:
            i = index.get(path)
            if i is None:
                near = ", ".join(_label(p) for p in paths[:3])
                raise _usmipc.ArgumentError(
                    f"UpdatePlan: the bundle has no array at {_label(path)} "
                    f"(it has {len(paths)} arrays"
                    + (f", such as {near}" if near else "") + "); nothing "
                    "was copied")
            dests.append((i, array, _label(path)))
        dev = self._device or device
        if dev is None:
            dev = _usmipc.Device()
        plan = _usmipc._copy_plan(dev, dests, True)
        if self._plan is not None:
            self._plan.close()
        self._plan, self._paths = plan, paths
        return plan

    def update(self, data: _usmipc.BytesLike,
               stream: Optional[_usmipc.StreamLike] = None, *,
               ordered: bool = True, release: bool = True) -> None:
        """Copies the handoff ``data`` (the producer's ``to_bytes()``) into
        the destinations.

        ``stream``: the copies are queued on it after the producer's work,
        and the host does not wait (a torch or CuPy stream, a
        ``usmipc.Queue``, an int handle); None: the host waits until they
        are done. ``ordered=False`` skips the wait for the producer's work.
        ``release``: return the handoff's ticket (if it carries one) after
        the copies, on ``stream``; False leaves it to
        ``usmipc.release_shared(data)``.
        """
        plan = self._plan
        if plan is None:
            plan = self._bind(data)
        try:
            plan.update(data, stream, ordered, release)
            return
        except _usmipc.ArgumentError:
            # The producer's tree changed (the plan is pinned to the tree it
            # was made for): match the paths again, once.
            if self._strict or _usmipc._bundle_paths(data)[0] == self._paths:
                raise
        self._bind(data).update(data, stream, ordered, release)

    def close(self) -> None:
        """Frees the plan (and the mappings of its last update); the
        destinations are no longer kept alive by it."""
        if self._plan is not None:
            self._plan.close()
            self._plan = None

    def __enter__(self) -> "UpdatePlan":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "bound" if self._plan is not None else "not bound yet"
        return f"<usmipc.UpdatePlan of {len(self._pairs)} destinations, {state}>"
