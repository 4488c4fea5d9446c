"""Launch sizes shared by the Triton launchers: where decode shapes begin, and the lookup of
a measured shape (``python -m dsv41.backends.triton.sweep`` chose them; docs/performance.md)."""

from __future__ import annotations

# Launches of at most this many tokens (rows for the index builders) take the shapes measured
# for latency (CUDA-graph replay at 64 tokens); larger ones those measured for bandwidth.
DECODE_T = 64


def measured(table: dict, key: str, tokens: int | None):
    """``table[key + ":decode"]`` for a decode-sized launch if present, else ``table[key]``,
    else None (the launcher's own heuristics)."""
    if tokens is not None and tokens <= DECODE_T:
        hit = table.get(key + ":decode")
        if hit is not None:
            return hit
    return table.get(key)
