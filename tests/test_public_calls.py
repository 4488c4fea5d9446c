"""``dsv41.tools.public_calls``: the public call the bench times against each kernel runs that kernel
on the same arguments -- the same bytes in every tensor argument, and the outputs the public
function allocates itself equal to the kernel's."""

from __future__ import annotations

import pytest
import torch

from dsv41.tools import bench
from dsv41.core import op_specs, registry
from dsv41.tools.conformance import clone_args, written_bytes
from dsv41.core.platform import probe
from dsv41.tools.public_calls import public_call


def _returned(r) -> list:
    if r is None:
        return []
    if isinstance(r, torch.Tensor):
        return [r]
    if isinstance(r, (tuple, list)):
        return [t for x in r for t in _returned(x)]
    return [r.data, r.scale]  # QuantizedActivation


def test_every_op_has_a_public_call():
    case_ops = {v.op for v in bench.VARIANTS}
    assert case_ops == set(op_specs.OPS)


def _kernel_run(variant, args, fill: int | None) -> list:
    """The kernel on a copy of ``args``; its written tensors first set to ``fill`` bytes
    unless None."""
    args = clone_args(args)
    if fill is not None:
        for i in op_specs.spec(variant.op).writes:
            torch.empty(0, dtype=torch.uint8).set_(args[i].untyped_storage()).fill_(fill)
    registry.kernel(variant.op, "cpu")(*args)
    return args


@pytest.mark.parametrize("tokens", [1, 8])
@pytest.mark.parametrize("variant", bench.VARIANTS, ids=[v.name for v in bench.VARIANTS])
def test_public_call_runs_the_kernel_on_the_same_arguments(variant, tokens):
    case = variant.build(bench._Gen(torch.device("cpu"), 3), tokens, probe())
    public_args = clone_args(case.args)
    fn, args, kwargs = public_call(variant.op, public_args)
    got = _returned(fn(*args, **kwargs))
    writes = op_specs.spec(variant.op).writes
    if not got:  # written in place: the whole storage of every argument as the kernel leaves it
        want = _kernel_run(variant, case.args, None)
        for i, (w, p) in enumerate(zip(want, public_args)):
            if isinstance(w, torch.Tensor):
                assert torch.equal(written_bytes(w), written_bytes(p)), f"argument {i}"
        return
    # outputs the public function allocates: the bytes the kernel writes (equal after runs from
    # two different initial fills) equal in what it returns
    run_a, run_b = _kernel_run(variant, case.args, 0x00), _kernel_run(variant, case.args, 0xFF)
    outs = [(written_bytes(run_a[i]), written_bytes(run_b[i])) for i in writes if run_a[i].numel()]
    assert len(got) == len(outs), (len(got), len(outs))
    for j, (g, (wa, wb)) in enumerate(zip(got, outs)):
        wg, written = written_bytes(g), wa == wb
        assert wg.numel() == wa.numel(), f"returned value {j}: storage of {wg.numel()} bytes, kernel's {wa.numel()}"
        assert torch.equal(wg[written], wa[written]), f"returned value {j}"
    for i, (a, p) in enumerate(zip(case.args, public_args)):
        if isinstance(a, torch.Tensor) and i not in writes:
            assert torch.equal(written_bytes(a), written_bytes(p)), f"input {i} changed"
