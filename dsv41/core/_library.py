"""The ``torch.ops.dsv41.*`` custom ops, one per ``dsv41.core.op_specs`` declaration.

Every op has the kernel-contract signature (docs/kernel_contract.md): the public function has
already validated arguments and allocated outputs, so each op only writes into the tensors its
schema marks as written and returns nothing.  That makes the fake (meta) implementation
trivial and the ops opaque, graph-capturable boundaries for ``torch.compile``.  The body is
one registry lookup keyed by the tensors' device type, then the kernel.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import op_specs, registry

LIB = "dsv41"


def _body(name: str):
    def run(*args) -> None:
        # every tensor argument is on one device (the public function checked it)
        for a in args:
            if isinstance(a, Tensor):
                registry.kernel(name, a.device.type)(*args)
                return

    run.__name__ = run.__qualname__ = name
    return run


def _fake(*args, **kwargs) -> None:
    return None


def _define(s: op_specs.OpSpec):
    op = torch.library.custom_op(f"{LIB}::{s.name}", _body(s.name), mutates_args=s.mutated, schema=s.schema)
    op.register_fake(_fake)
    return op


OPS = {s.name: _define(s) for s in op_specs.SPECS}
