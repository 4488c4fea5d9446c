"""Stand-in for ``vllm.utils.torch_utils``: register a function as ``torch.ops.vllm.<name>``."""

import torch

_lib = torch.library.Library("vllm", "FRAGMENT")


def direct_register_custom_op(op_name, op_func, mutates_args=None, fake_impl=None, target_lib=None,
                              dispatch_key=None, tags=()):
    lib = target_lib or _lib
    schema = torch.library.infer_schema(op_func, mutates_args=mutates_args or ())
    lib.define(op_name + schema, tags=tags)
    lib.impl(op_name, op_func, dispatch_key or "CompositeExplicitAutograd")
    if fake_impl is not None:
        lib._register_fake(op_name, fake_impl)
