"""Freeing an engine's device memory at shutdown.

An engine's buffers (weights, KV cache, adapter slots, the last sampled tokens) are released by
deleting them, not by dropping references: the engine's objects hold reference cycles (bound
methods, handles that point back at their runner), and a caller's variable may still name the
engine, so without a delete they live until a garbage collection. On a GPU the next engine sizes
its KV cache by the memory in use (`Worker.determine_num_available_blocks`), so a second engine
in the same process (a notebook, a sweep, a test suite) would find no room (issue 38)."""

from __future__ import annotations

import jax


def reachable_arrays(root: object) -> list[jax.Array]:
    """The jax arrays reachable from `root` through containers and jaxlm / flax objects' attributes."""
    seen: set[int] = set()
    found: list[jax.Array] = []
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, jax.Array):
            found.append(obj)
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, (list, tuple, set, frozenset)):
            stack.extend(obj)
        elif type(obj).__module__.startswith(("jaxlm.", "flax.")) and hasattr(obj, "__dict__"):
            stack.extend(vars(obj).values())
    return found


def delete_arrays(arrays: list[jax.Array]) -> int:
    """Deletes each array's device buffers (already deleted ones are skipped); the bytes freed."""
    freed = 0
    for a in arrays:
        if not a.is_deleted():
            freed += a.nbytes
            a.delete()
    return freed
