"""Ahead-of-time builds of every CuTe DSL kernel of the ``cuda:cutedsl`` backend, no GPU needed.

``compile_all(arch)`` compiles each registered variant (``aot_variants()`` of every CuTe module:
``cutedsl_gather``, ``cutedsl_indexer_q``) for ``arch`` — ``"sm_90a"``, ``"sm_100a"``, a list of
them, or None for both — through ``cute.compile[cute.GPUArch(arch)]`` (host code, PTX and cubin
via ptxas, all on the CPU) and returns ``[(kernel, arch, ok, error)]``.  Built variants stay in the
modules' compile caches, so a later launch on a GPU of that arch reuses them.

Importing this module imports neither cutlass nor a kernel.
"""

import importlib
import traceback

__all__ = ["ARCHS", "MODULES", "compile_all", "variants"]

ARCHS = ("sm_90a", "sm_100a")
MODULES = ("cutedsl_gather", "cutedsl_indexer_q")


def variants() -> list:
    """[(name, builder(arch))] of every CuTe kernel variant built ahead of time."""
    pkg = __package__ or "dsv41.backends.cuda"
    out = []
    for mod in MODULES:
        m = importlib.import_module(f"{pkg}.{mod}")
        out.extend((f"{mod}.{name}", build) for name, build in m.aot_variants())
    return out


def compile_all(arch=None) -> list:
    """Compile every variant for ``arch`` (str, iterable of str, or None = ``ARCHS``).

    Returns ``[(kernel, arch, ok, error)]``; ``error`` is the formatted exception ('' when ok).
    """
    archs = ARCHS if arch is None else ((arch,) if isinstance(arch, str) else tuple(arch))
    try:
        specs = variants()
    except Exception:  # cutlass missing or a module failing to import
        err = traceback.format_exc()
        return [("<import>", a, False, err) for a in archs]
    results = []
    for a in archs:
        for name, build in specs:
            try:
                build(a)
                results.append((name, a, True, ""))
            except Exception:
                results.append((name, a, False, traceback.format_exc()))
    return results


if __name__ == "__main__":  # python -m dsv41.backends.cuda.cutedsl_aot
    import sys

    res = compile_all(sys.argv[1:] or None)
    for name, a, ok, err in res:
        print(f"{'ok  ' if ok else 'FAIL'} {a:8s} {name}")
        if not ok:
            print(err)
    sys.exit(0 if all(r[2] for r in res) else 1)
