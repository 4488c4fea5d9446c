"""(c) The golden set D (written by vLLM 0.33.0's kernels on an H200) replayed through vLLM's
names with the plugin on: routed names run dsv41, kept ones vLLM's own Triton kernels (in the
interpreter here).  Byte-identical, whole storage."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.plugins", reason="tests/vllm needs vLLM installed (bash .ci/vllm_plugin.sh)")

from dsv41.integrations import vllm_plugin as vp  # noqa: E402
from golden import clone_value, load_set  # noqa: E402
from vllm_calls import differences, outputs, vllm_function  # noqa: E402

CASES = load_set("D")  # a missing archive fails collection: never a silent skip


@pytest.fixture(scope="module")
def plugin_on(exact_rsqrt_exp2):
    saved = vp.os.environ.pop(vp.ENV, None)
    vp._unregister()
    vp.register()
    yield
    vp._unregister()
    if saved is not None:
        vp.os.environ[vp.ENV] = saved


def _param(g):
    marks = ()
    if g.known_difference:
        marks = (pytest.mark.xfail(strict=False, reason=g.known_difference),)
    return pytest.param(g, id=g.name, marks=marks)


@pytest.mark.parametrize("golden", [_param(g) for g in CASES])
def test_set_d_through_vllm_names(golden, plugin_on):
    fn = vllm_function(golden.op)
    args = {k: clone_value(v) for k, v in golden.args.items()}
    result = fn(**args)
    problems = differences(outputs(golden.out, args, result), golden.out)
    who = "dsv41" if getattr(fn, "__module__", "").startswith("dsv41") else "vLLM's kernel (kept)"
    assert not problems, f"{golden.op} via {who}: " + "; ".join(problems)
