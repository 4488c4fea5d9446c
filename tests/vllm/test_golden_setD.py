"""(c) The golden set D (written by vLLM 0.33.0's kernels on an H200) replayed through vLLM's
names with the plugin on and every compatible name routed (``DSV41_VLLM_OPS=all``), so each call
runs dsv41.  Byte-identical, whole storage; the two known one-ulp cases are strict xfails."""

from __future__ import annotations

import pytest

pytest.importorskip("vllm.plugins", reason="tests/vllm needs vLLM installed (bash .ci/vllm_plugin.sh)")

from dsv41.integrations import vllm_plugin as vp  # noqa: E402
from golden import clone_value, load_set  # noqa: E402
from vllm_calls import differences, outputs, vllm_function  # noqa: E402

CASES = load_set("D")  # a missing archive fails collection: never a silent skip
# vLLM names dsv41 does not route even when told (not host functions of the same contract)
NOT_ROUTABLE = {"mxfp8_scale_offset", "can_fuse_query_quant"}


@pytest.fixture(scope="module")
def plugin_on(exact_rsqrt_exp2):
    saved = vp.os.environ.get(vp.ENV)
    vp.os.environ[vp.ENV] = "all"
    vp._unregister()
    vp.register()
    yield
    vp._unregister()
    if saved is None:
        vp.os.environ.pop(vp.ENV, None)
    else:
        vp.os.environ[vp.ENV] = saved


def _param(g):
    marks = ()
    if g.known_difference:
        marks = (pytest.mark.xfail(strict=True, reason=g.known_difference),)
    return pytest.param(g, id=g.name, marks=marks)


@pytest.mark.parametrize("golden", [_param(g) for g in CASES])
def test_set_d_through_vllm_names(golden, plugin_on):
    fn = vllm_function(golden.op)
    args = {k: clone_value(v) for k, v in golden.args.items()}
    result = fn(**args)
    problems = differences(outputs(golden.out, args, result), golden.out)
    assert getattr(fn, "__module__", "").startswith("dsv41") or golden.op in NOT_ROUTABLE, golden.op
    assert not problems, f"{golden.op}: " + "; ".join(problems)
