"""The two ways a public function reaches its kernel (dsv41/core/_calls.py): eager calls go straight
to the registry's kernel, traced / fake / functionalized calls through ``torch.ops.dsv41``.
Both must write the same bytes, and each must be taken exactly when it should be."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import dsv41
from dsv41.core import _calls, registry
from dsv41.tools.conformance import CASES, clone_args, written_bytes


@pytest.fixture
def eager_default(monkeypatch):
    monkeypatch.setattr(_calls, "_eager", True)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_both_paths_write_the_same_bytes(case, eager_default):
    args = case.build("cpu")
    direct, traced = clone_args(args), clone_args(args)
    assert not _calls.takes_op_path(direct)
    getattr(_calls.ops, case.op)(*direct)
    getattr(torch.ops.dsv41, case.op)(*traced)
    for i in case.writes:
        assert torch.equal(written_bytes(direct[i]), written_bytes(traced[i])), f"argument {i}"


def _insert_args():
    k = torch.randn(3, 512).to(torch.bfloat16)
    cache = torch.zeros(2, 64, 528, dtype=torch.uint8)
    return k, cache, torch.tensor([0, -1, 70])


def test_eager_call_skips_the_custom_op(eager_default, monkeypatch):
    """An eager public call never enters torch.ops.dsv41 (its dispatch is what it saves)."""
    call = _calls.ops.quantize_and_insert_k_cache

    def refuse(*args):
        raise AssertionError("the eager call went through the custom op")

    monkeypatch.setattr(call, "op", refuse)
    k, cache, slots = _insert_args()
    dsv41.quantize_and_insert_k_cache(k, cache, slots, 64, bytes_per_token=528)
    assert cache.any()


def test_eager_call_follows_the_registry(eager_default, monkeypatch):
    """The call object keeps the resolved kernel per device, but a substituted
    ``registry.kernel`` and ``registry.reset()`` are seen at the next call."""
    k, cache, slots = _insert_args()
    dsv41.quantize_and_insert_k_cache(k, cache, slots, 64, bytes_per_token=528)  # resolved, kept
    seen, real = [], registry.kernel
    monkeypatch.setattr(registry, "kernel", lambda op, device_type: lambda *a: seen.append((op, device_type)))
    dsv41.quantize_and_insert_k_cache(k, cache, slots, 64, bytes_per_token=528)
    assert seen == [("quantize_and_insert_k_cache", "cpu")]
    monkeypatch.setattr(registry, "kernel", real)
    call = _calls.ops.quantize_and_insert_k_cache
    dsv41.quantize_and_insert_k_cache(k, cache, slots, 64, bytes_per_token=528)
    assert call.kernels and len(seen) == 1  # the real kernel again
    registry.reset()
    assert not call.kernels
    cache.zero_()
    dsv41.quantize_and_insert_k_cache(k, cache, slots, 64, bytes_per_token=528)
    assert cache.any() and call.kernels


def test_forced_op_path(monkeypatch):
    """DSV41_EAGER_OPS=0: every call goes through the custom op."""
    monkeypatch.setattr(_calls, "_eager", None)
    monkeypatch.setenv("DSV41_EAGER_OPS", "0")
    seen = []
    call = _calls.ops.quantize_and_insert_k_cache
    real = call.op
    monkeypatch.setattr(call, "op", lambda *a: (seen.append(1), real(*a))[1])
    k, cache, slots = _insert_args()
    dsv41.quantize_and_insert_k_cache(k, cache, slots, 64, bytes_per_token=528)
    assert seen == [1]


def test_fake_tensors_take_the_op_path(eager_default):
    """Under FakeTensorMode (torch.compile's tracer, opcheck) the op's fake implementation runs:
    no kernel touches a fake tensor."""
    with FakeTensorMode():
        k, cache, slots = _insert_args()
        assert _calls.takes_op_path((k, cache, slots))
        dsv41.quantize_and_insert_k_cache(k, cache, slots, 64, bytes_per_token=528)


def test_compiled_call_matches_eager(eager_default):
    """torch.compile(fullgraph=True) traces the op (opaque in the graph) and gives the eager bytes."""
    k, cache, slots = _insert_args()
    want = cache.clone()
    dsv41.quantize_and_insert_k_cache(k, want, slots, 64, bytes_per_token=528)

    @torch.compile(fullgraph=True, backend="eager")
    def f(k, cache, slots):
        dsv41.quantize_and_insert_k_cache(k, cache, slots, 64, bytes_per_token=528)

    f(k, cache, slots)
    assert torch.equal(cache, want)


def test_subclass_arguments_take_the_op_path(eager_default):
    class Tagged(torch.Tensor):
        pass

    k, cache, slots = _insert_args()
    assert _calls.takes_op_path((k.as_subclass(Tagged), cache, slots))
    assert not _calls.takes_op_path((k, cache, slots))


def test_parameters_take_the_eager_path(eager_default):
    # weights arrive as nn.Parameter: a plain tensor to the dispatcher
    k, cache, slots = _insert_args()
    assert not _calls.takes_op_path((torch.nn.Parameter(k, requires_grad=False), cache, slots, 64, None, 1.0))
    assert not _calls.takes_op_path((k, cache, slots, torch.float32, "paged", True))


@pytest.mark.parametrize("op", registry.OPS)
def test_first_kernel_argument_names_the_device(op):
    # the eager path picks the kernel by the device of the first kernel argument
    first = getattr(torch.ops.dsv41, op).default._schema.arguments[0]
    assert str(first.type) == "Tensor", f"{op}: first kernel argument {first.name} is {first.type}"

