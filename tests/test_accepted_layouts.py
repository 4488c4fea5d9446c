"""A public op runs its metadata checks once per argument layout (dsv41.core.accepted_layouts):
what a layout key holds, that a repeated layout skips the checks, and that any difference the
checks could see still reaches them."""

from __future__ import annotations

import ast
import functools
import importlib
import inspect

import pytest
import torch

import dsv41
from dsv41.core import accepted_layouts as al
from dsv41.core import platform
from dsv41.tools import bench
from dsv41.tools.public_calls import public_call

BF16, I32, U8 = torch.bfloat16, torch.int32, torch.uint8


def _key(*values):
    return al._layout(values)


def test_key_holds_dtype_shape_strides_device_and_typed_scalars():
    t = torch.zeros(4, 8, dtype=I32)
    base = _key(t, 64, False, "paged", None)
    assert base == _key(torch.ones(4, 8, dtype=I32), 64, False, "paged", None)  # values do not count
    assert base != _key(t.to(torch.int64), 64, False, "paged", None)
    assert base != _key(torch.zeros(8, 4, dtype=I32), 64, False, "paged", None)
    assert base != _key(torch.zeros(4, 16, dtype=I32)[:, ::2], 64, False, "paged", None)
    assert base != _key(t.to("meta"), 64, False, "paged", None)
    assert base != _key(t, 64, 0, "paged", None)  # False == 0, but a bool is not an int
    assert base != _key(t, 64.0, False, "paged", None)
    assert base != _key(t, 64, False, "interleaved", None)
    assert base != _key(t, 64, False, "paged", t)
    assert _key((t, t)) != _key((t, t.t()))
    assert _key((t, t)) != _key([t, t])


def test_tensor_subclasses_are_not_keyed():
    class Sub(torch.Tensor):
        pass

    sub = torch.zeros(2).as_subclass(Sub)
    assert _key(sub) is None
    acc = al.AcceptedLayouts()
    assert acc.new((sub,)) is al.UNKEYED
    assert acc.new(((sub, sub),)) is al.UNKEYED
    param = torch.nn.Parameter(torch.zeros(2))  # weights arrive as parameters
    acc.add(acc.new((param,)))
    assert acc.new((param,)) is None
    assert acc.new((torch.zeros(2),)) is not None  # a plain tensor is another layout


@pytest.mark.parametrize("compiled_guards", [True, False])
def test_a_layout_is_accepted_only_when_everything_matches(compiled_guards, monkeypatch):
    monkeypatch.setattr(al, "_make_guard", al._compiled_guards() if compiled_guards else al._python_guard)
    if compiled_guards and al._make_guard is None:
        pytest.skip("this PyTorch has no usable compiled tensor guards")
    t = torch.zeros(4, 8, dtype=I32)

    def params(**kw):
        base = {"t": t, "n": 64, "flag": False, "layout": "paged", "opt": None, "pair": None}
        base.update(kw)
        return tuple(base.values())

    acc = al.AcceptedLayouts()
    acc.add(acc.new(params()))
    assert acc.new(params()) is None
    assert acc.new(params(t=torch.ones(4, 8, dtype=I32))) is None  # values do not count
    for other in (dict(t=t.to(torch.int64)), dict(t=torch.zeros(8, 4, dtype=I32)), dict(t=t.t()),
                  dict(t=torch.zeros(4, 16, dtype=I32)[:, ::2]), dict(t=t.to("meta")), dict(flag=0),
                  dict(n=64.0), dict(n=65), dict(layout="interleaved"), dict(opt=t), dict(pair=(t, t))):
        assert acc.new(params(**other)) is not None, other
    acc.add(acc.new(params(pair=(t, t))))
    assert acc.new(params(pair=(t, t))) is None
    assert acc.new(params(pair=(t, t.t()))) is not None
    assert acc.new(params(pair=[t, t])) is not None


def test_unkeyable_calls_always_check_and_are_never_added():
    acc = al.AcceptedLayouts()
    assert acc.new(({1: 2},)) is al.UNKEYED  # unhashable
    acc.add(al.UNKEYED)
    assert acc.new(({1: 2},)) is al.UNKEYED


def test_oldest_layout_is_dropped_at_the_limit():
    acc = al.AcceptedLayouts(limit=2)
    keys = [acc.new((n,)) for n in range(3)]
    for key in keys:
        acc.add(key)
    assert acc.new((0,)) is not None  # dropped
    assert acc.new((1,)) is None and acc.new((2,)) is None


def test_traced_calls_always_check(monkeypatch):
    acc = al.AcceptedLayouts()
    acc.add(acc.new((1,)))
    assert acc.new((1,)) is None
    monkeypatch.setattr(al, "_is_compiling", lambda: True)
    assert acc.new((1,)) is al.UNKEYED


def _gather_args(**overrides):
    args = dict(
        out=torch.zeros(1, 4, 512, dtype=BF16), k_cache=torch.zeros(2, 16, 528, dtype=U8),
        seq_lens=torch.ones(1, dtype=I32), gather_lens=None, block_table=torch.zeros(1, 2, dtype=I32),
        block_size=16, offset=0, use_fnuz=False,
    )
    args.update(overrides)
    return args


def test_differences_after_an_accepted_layout_still_fail():
    dsv41.dequantize_and_gather_k_cache(**_gather_args())
    with pytest.raises(TypeError, match="'use_fnuz'"):
        dsv41.dequantize_and_gather_k_cache(**_gather_args(use_fnuz=0))
    with pytest.raises(ValueError, match="'block_table'.*stride 1"):
        dsv41.dequantize_and_gather_k_cache(**_gather_args(block_table=torch.zeros(1, 4, dtype=I32)[:, ::2]))
    with pytest.raises(TypeError, match="'out'.*bfloat16"):
        dsv41.dequantize_and_gather_k_cache(**_gather_args(out=torch.zeros(1, 4, 512)))
    with pytest.raises(ValueError, match="'offset'"):
        dsv41.dequantize_and_gather_k_cache(**_gather_args(offset=-1))
    dsv41.dequantize_and_gather_k_cache(**_gather_args())  # and the good layout still runs


def _new_calls():
    """(module, function, the names passed to ``new``) for every ``<accepted>.new(...)`` call in a
    public module's function."""
    for name in ("cache_utils", "fused_compress_quant_cache", "indexer_k_store", "indexer_q", "inv_rope",
                 "q_layout", "query_quant", "transcode"):
        module = importlib.import_module(f"dsv41.{name}")
        for fn in ast.walk(ast.parse(inspect.getsource(module))):
            if not isinstance(fn, ast.FunctionDef):
                continue
            for node in ast.walk(fn):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr == "new" and "accepted" in ast.unparse(node.func.value)):
                    passed = node.args[0] if len(node.args) == 1 and not node.keywords else None
                    names = ([e.id if isinstance(e, ast.Name) else ast.unparse(e) for e in passed.elts]
                             if isinstance(passed, ast.Tuple) else None)
                    yield name, fn, names


def test_every_public_function_passes_all_its_parameters_in_order():
    """A parameter left out of the layout would let a call skip the checks of a value never seen."""
    seen = 0
    for module, fn, names in _new_calls():
        a = fn.args
        params = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
        assert a.vararg is None and a.kwarg is None, f"{module}.{fn.name}"
        assert names == params, f"{module}.{fn.name}: new() gets {names}, the parameters are {params}"
        first = fn.body[1] if isinstance(fn.body[0], ast.Expr) else fn.body[0]  # after the docstring
        assert "new(" in ast.unparse(first), f"{module}.{fn.name}: new() is not the first statement"
        seen += 1
    assert seen >= 14


class _CountingCheck:
    """Stands in for ``_validate.Check`` in one module: counts the calls that ran their checks."""

    def __init__(self, real):
        self.real, self.calls = real, 0

    def __call__(self, op):
        self.calls += 1
        return self.real(op)


@pytest.mark.parametrize("variant", bench.VARIANTS, ids=lambda v: v.name)
def test_every_op_checks_a_layout_once(variant, monkeypatch):
    case = variant.build(bench._Gen("cpu", 0), 8, platform.probe())
    fn, args, kwargs = public_call(variant.op, case.args)
    module = importlib.import_module(fn.__module__)
    counter = _CountingCheck(module.Check)
    monkeypatch.setattr(module, "Check", counter)
    for acc in module._accepted.values() if isinstance(module._accepted, dict) else [module._accepted]:
        acc.clear()
    call = functools.partial(fn, *args, **kwargs)
    call()
    assert counter.calls == 1
    call()
    call()
    assert counter.calls == 1, "a repeated layout ran its checks again"
