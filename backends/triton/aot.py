"""Ahead-of-time builds of the shared Triton kernels for GPUs this machine does not have.

Every kernel file of ``backends/triton`` appends ``AotSpec`` entries (one per
representative constexpr combination) to ``AOT_SPECS`` through ``register``;
``compile_all(target)`` imports every module of the package, then builds each spec with
``triton.compile(ASTSource(...), target=GPUTarget(...))`` (real PTX/cubin or AMDGCN/hsaco,
no GPU needed) and reports ``(kernel, target, ok, error)`` per build.

Targets: ``sm90`` / ``sm100`` (``GPUTarget("cuda", 90|100, 32)``), ``gfx942`` / ``gfx950``
(``GPUTarget("hip", ..., 64)``).  A spec lists the targets it must build for (a kernel
using an op a target lacks states so by leaving that target out).

Importing this module imports neither triton nor a kernel.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
import traceback

__all__ = ["AotSpec", "AOT_SPECS", "TARGETS", "register", "compile_all", "discover"]

TARGETS = {
    "sm90": ("cuda", 90, 32),
    "sm100": ("cuda", 100, 32),
    "gfx942": ("hip", "gfx942", 64),
    "gfx950": ("hip", "gfx950", 64),
}
ALL_TARGETS = tuple(TARGETS)


@dataclasses.dataclass
class AotSpec:
    """One kernel variant to build ahead of time.

    name:        unique label, e.g. ``"cache_kernels._quant_insert_kernel[584,ocp]"``
    kernel:      the ``@triton.jit`` function
    signature:   every parameter -> Triton type string (``"*u8"``, ``"i32"``, ``"fp32"``,
                 ``"constexpr"`` for constexpr parameters)
    constexprs:  values of the constexpr parameters
    num_warps:   launch warps the variant is built for
    targets:     target names (keys of ``TARGETS``) this variant must build for
    divisible:   parameter names given Triton's ``tt.divisibility = 16`` hint (pointers
                 and strides the JIT would specialize the same way at run time)
    maxnreg:     register cap the launch passes on NVIDIA (None: none); not applied to
                 other targets, whose launches do not pass it
    """

    name: str
    kernel: object
    signature: dict
    constexprs: dict
    num_warps: int = 4
    targets: tuple = ALL_TARGETS
    divisible: tuple = ()
    maxnreg: int | None = None


AOT_SPECS: list = []


def constexpr_params(kernel) -> set:
    """Names of a ``@triton.jit`` kernel's ``tl.constexpr`` parameters, from its Python
    signature (works for the interpreter's wrapper too; a module with postponed annotations
    has them as strings)."""
    import inspect

    return {
        name for name, prm in inspect.signature(kernel.fn).parameters.items()
        if (prm.annotation if isinstance(prm.annotation, str)
            else getattr(prm.annotation, "__name__", "")).endswith("constexpr")
    }


def register(spec: AotSpec) -> None:
    """Append ``spec`` (ignored when its kernel is an interpreter function or already listed)."""
    kernel = spec.kernel
    if type(kernel).__name__ == "InterpretedFunction":
        return
    if any(s.name == spec.name for s in AOT_SPECS):
        return
    # a constexpr the spec leaves out takes the kernel's default, as in a launch that leaves
    # it out (ASTSource itself would build it as None)
    names = constexpr_params(kernel)
    defaults = {n: p.default for n, p in inspect.signature(kernel.fn).parameters.items()
                if n in names and n not in spec.constexprs and p.default is not inspect.Parameter.empty}
    if defaults:
        spec = dataclasses.replace(spec, constexprs={**defaults, **spec.constexprs})
    AOT_SPECS.append(spec)


def discover() -> list:
    """Import every kernel module of this package so that their specs are registered."""
    pkg = importlib.import_module(__name__.rpartition(".")[0])
    errors = []
    for info in pkgutil.iter_modules(pkg.__path__):
        if info.name in ("aot", "__init__"):
            continue
        modname = f"{pkg.__name__}.{info.name}"
        try:
            importlib.import_module(modname)
        except Exception as exc:  # reported by compile_all
            errors.append((modname, repr(exc)))
    return errors


def _gpu_target(name_or_target):
    from triton.backends.compiler import GPUTarget

    if isinstance(name_or_target, GPUTarget):
        return name_or_target
    return GPUTarget(*TARGETS[name_or_target])


def _target_label(t) -> str:
    for name, tup in TARGETS.items():
        if (t.backend, t.arch, t.warp_size) == tup:
            return name
    return f"{t.backend}:{t.arch}"


def _compile(spec: AotSpec, target):
    import triton
    from triton.compiler import ASTSource

    arg_names = list(spec.kernel.arg_names)
    missing = [a for a in arg_names if a not in spec.signature]
    if missing:
        raise ValueError(f"signature of {spec.name} lacks {missing}")
    attrs = {}
    for a in spec.divisible:
        attrs[(arg_names.index(a),)] = [["tt.divisibility", 16]]
    src = ASTSource(spec.kernel, dict(spec.signature), dict(spec.constexprs), attrs=attrs)
    options = {"num_warps": spec.num_warps}
    if spec.maxnreg and target.backend == "cuda":
        options["maxnreg"] = spec.maxnreg
    return triton.compile(src, target=target, options=options)


INT_TYPES = ("i32", "i64", "u32", "u64")  # signature types of integer scalar parameters


def as_ones(spec: AotSpec, names=None) -> AotSpec:
    """``spec`` with its integer scalar parameters ``names`` (default: every one) set to 1: how
    Triton's JIT passes an integer argument equal to 1 (a constexpr, a Python int in the kernel
    body), so a body that calls a tensor method on such a parameter fails to build here, as it
    would at run time, and an instruction count is that of the build a launch runs.  Named
    ``[ints=1]`` for every parameter; the caller names a build of some of them."""
    ints = {a for a, t in spec.signature.items() if t in INT_TYPES}
    if names is not None:
        ints &= set(names)
    return dataclasses.replace(
        spec, name=spec.name + "[ints=1]",
        signature={a: ("constexpr" if a in ints else t) for a, t in spec.signature.items()},
        constexprs={**spec.constexprs, **{a: 1 for a in ints}},
        divisible=tuple(a for a in spec.divisible if a not in ints))


def _build(job):
    i, label, ones = job
    spec = as_ones(AOT_SPECS[i]) if ones else AOT_SPECS[i]
    try:
        _compile(spec, _gpu_target(label))
        return (spec.name, label, True, None)
    except Exception as exc:
        msg = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        return (spec.name, label, False, msg[-2000:])


def compile_all(target=None, names=None, jobs: int = 1, ones: bool = False) -> list:
    """Build every registered kernel variant; returns ``[(kernel, target, ok, error)]``.

    target: None (every target), a name of ``TARGETS`` (``"sm90"``, ``"sm100"``,
        ``"gfx942"``, ``"gfx950"``), a list of names, or a ``triton.backends.compiler.GPUTarget``.
    names: optional substring filter on spec names.
    ones: build each spec with its integer scalar parameters equal to 1 (``as_ones``).
    jobs: parallel build processes (fork; 1 = in this process).
    A spec is built only for the targets it lists (a ``GPUTarget`` argument builds every
    spec whose list contains that target's name).  Import failures of kernel modules are
    reported as ``(module, "import", False, error)``.
    """
    results = [(mod, "import", False, err) for mod, err in discover()]
    if target is None:
        wanted = list(ALL_TARGETS)
    elif isinstance(target, str):
        wanted = [target]
    elif isinstance(target, (list, tuple)):
        wanted = list(target)
    else:
        wanted = [target]
    todo = []
    for i, spec in enumerate(AOT_SPECS):
        if names is not None and names not in spec.name:
            continue
        for t in wanted:
            label = _target_label(_gpu_target(t))
            if label in spec.targets:
                todo.append((i, label, ones))
    if jobs > 1 and len(todo) > 1:
        import multiprocessing

        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            results += pool.map(_build, todo, chunksize=1)
    else:
        results += [_build(job) for job in todo]
    return results
