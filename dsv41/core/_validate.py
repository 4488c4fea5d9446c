"""Argument checks shared by the public ops.

Every failure raises ``TypeError`` (wrong kind: not a tensor, wrong dtype) or
``ValueError`` (wrong value: rank, shape, stride, device, flag) naming the op,
the argument, what was expected and what came.  Plain ``if``/``raise``, never
``assert``: the checks must also run under ``python -O``.  They read tensor
metadata only (no device sync), so they are free on the hot path and trace
under ``torch.compile``.
"""

from __future__ import annotations

import torch

INT_INDEX = (torch.int32, torch.int64)


def _dtypes(d) -> str:
    if isinstance(d, torch.dtype):
        return str(d).replace("torch.", "")
    return " or ".join(_dtypes(x) for x in d)


class Check:
    """Collects the checks of one call of ``op``; the first failure raises."""

    def __init__(self, op: str):
        self.op = op
        self.device = None
        self.device_arg = None

    def fail(self, arg: str, expected: str, got, exc=ValueError):
        raise exc(f"{self.op}: argument '{arg}' expected {expected}, got {got}")

    def tensor(self, arg, t, dtype=None, ndim=None, optional=False, same_device=True):
        if t is None:
            if optional:
                return None
            self.fail(arg, "a torch.Tensor", "None", TypeError)
        if not isinstance(t, torch.Tensor):
            self.fail(arg, "a torch.Tensor", type(t).__name__, TypeError)
        if dtype is not None:
            ok = t.dtype == dtype if isinstance(dtype, torch.dtype) else t.dtype in dtype
            if not ok:
                self.fail(arg, f"dtype {_dtypes(dtype)}", _dtypes(t.dtype), TypeError)
        if ndim is not None:
            ok = t.dim() == ndim if isinstance(ndim, int) else t.dim() in ndim
            if not ok:
                self.fail(arg, f"a {ndim}-D tensor", f"{t.dim()}-D shape {tuple(t.shape)}")
        if same_device:
            if self.device is None:
                self.device, self.device_arg = t.device, arg
            elif t.device != self.device:
                self.fail(arg, f"a tensor on {self.device} (like '{self.device_arg}')", str(t.device))
        return t

    def size(self, arg, t, dim, expected=None, at_least=None):
        n = t.shape[dim]
        if expected is not None and n != expected:
            self.fail(arg, f"size {expected} in dim {dim}", f"shape {tuple(t.shape)}")
        if at_least is not None and n < at_least:
            self.fail(arg, f"size >= {at_least} in dim {dim}", f"shape {tuple(t.shape)}")
        return n

    def stride(self, arg, t, dim, expected=None, multiple_of=None):
        s = t.stride(dim)
        if t.shape[dim] > 1 or dim == t.dim() - 1:
            if expected is not None and s != expected:
                self.fail(arg, f"stride {expected} in dim {dim}", f"strides {t.stride()}")
            if multiple_of is not None and s % multiple_of != 0:
                self.fail(arg, f"stride of dim {dim} a multiple of {multiple_of}", f"strides {t.stride()}")
        return s

    def contiguous(self, arg, t):
        if not t.is_contiguous():
            self.fail(arg, "a contiguous tensor", f"shape {tuple(t.shape)} strides {t.stride()}")

    def integer(self, arg, v, min_value=None, choices=None):
        if isinstance(v, bool) or not isinstance(v, int):
            if isinstance(v, torch.SymInt):
                return v
            self.fail(arg, "an int", type(v).__name__, TypeError)
        if choices is not None and v not in choices:
            self.fail(arg, f"one of {sorted(choices)}", v)
        if min_value is not None and v < min_value:
            self.fail(arg, f"an int >= {min_value}", v)
        return v

    def flag(self, arg, v):
        if not isinstance(v, bool):
            self.fail(arg, "a bool", type(v).__name__, TypeError)
        return v

    def choice(self, arg, v, choices):
        if not isinstance(v, str):
            self.fail(arg, f"a str, one of {list(choices)}", type(v).__name__, TypeError)
        if v not in choices:
            self.fail(arg, f"one of {list(choices)}", repr(v))
        return v

    def number(self, arg, v):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            self.fail(arg, "a Python float", type(v).__name__, TypeError)
        return float(v)

    def cos_sin(self, arg, t, rope_dim=None, dtypes=(torch.float32, torch.bfloat16)):
        self.tensor(arg, t, dtype=dtypes, ndim=2)
        # at least one row: a position outside the table has a row to be clamped to
        self.size(arg, t, 0, at_least=1)
        if rope_dim is not None:
            self.size(arg, t, 1, expected=rope_dim)
        self.stride(arg, t, 1, expected=1)
        return t

    def paged_cache(self, arg, cache, block_size, width):
        """A uint8 paged cache: [num_blocks, B, width] or a flat [num_blocks, page_bytes] view."""
        self.tensor(arg, cache, dtype=torch.uint8, ndim=(2, 3))
        if cache.dim() == 3:
            self.size(arg, cache, 1, expected=block_size)
            self.size(arg, cache, 2, expected=width)
            self.stride(arg, cache, 2, expected=1)
            self.stride(arg, cache, 1, expected=width)
        else:
            self.size(arg, cache, 1, at_least=block_size * width)
            self.stride(arg, cache, 1, expected=1)
        if cache.shape[0] > 1 and cache.stride(0) < block_size * width:
            self.fail(
                arg,
                f"page stride (stride(0)) >= block_size*{width} = {block_size * width} bytes",
                f"strides {cache.stride()}",
            )
