"""Run in a fresh process by test_plugin.py: load vLLM's general plugins the way vLLM does and
print, as one JSON line, what the dsv41 plugin decided and where each function now lives.

PROBE_SCENARIOS (JSON list of {"env": {...}, "version": str|null}) adds further scenarios in
the same process: vLLM's functions are put back, the environment (and ``vllm.__version__``)
changed, and ``register()`` called again.  One JSON result per scenario, the first being
vLLM's own ``load_general_plugins()``."""

import importlib
import json
import logging
import os
import sys

records = []


class _Keep(logging.Handler):
    def emit(self, record):
        records.append([record.levelname, record.getMessage()])


log = logging.getLogger("dsv41.vllm")
log.addHandler(_Keep())
log.setLevel(logging.INFO)

import vllm  # noqa: E402

REAL_VERSION = vllm.__version__

import vllm.models.deepseek_v41.attention  # noqa: E402,F401  (a call site imported before the plugin)
import vllm.plugins  # noqa: E402

vllm.plugins.load_general_plugins()

import vllm.models.deepseek_v41.compressor  # noqa: E402,F401  (a call site imported after it)
from dsv41.integrations import vllm_plugin as vp  # noqa: E402



def snapshot() -> dict:
    found = vp.routed()
    first = len(records)
    if found:
        vp.register()  # a second call must change nothing
    out = {"decisions": [], "logs": records[:first], "second_call_logs": len(records) - first}
    for d in found:
        t = d.target
        dsv41_fn = getattr(importlib.import_module(t.dsv41), t.name, None)
        old_at, new_at = [], []
        for modname, mod in list(sys.modules.items()):
            if mod is None or not modname.startswith("vllm"):
                continue
            for attr, value in list(vars(mod).items()):
                if d.old is not None and value is d.old:
                    old_at.append(f"{modname}.{attr}")
                if d.new is not None and value is d.new:
                    new_at.append(f"{modname}.{attr}")
        defining = getattr(importlib.import_module(t.module), t.name, None)
        out["decisions"].append({
            "name": t.vllm_name,
            "short": t.name,
            "routed": d.routed,
            "detail": d.detail,
            "warn": d.warn,
            "line": d.line,
            "new_is_dsv41": None if d.new is None else (d.new is dsv41_fn or getattr(d.new, "__wrapped__", None) is dsv41_fn),
            "defining_is_new": d.new is not None and defining is d.new,
            "defining_is_old": d.old is not None and defining is d.old,
            "old_at": old_at,
            "new_at": new_at,
        })
    return out


results = [snapshot()]
for sc in json.loads(os.environ.get("PROBE_SCENARIOS", "[]")):
    vp._unregister()
    records.clear()
    os.environ.pop("DSV41_VLLM_OPS", None)
    os.environ.update(sc.get("env", {}))
    vllm.__version__ = sc.get("version") or REAL_VERSION
    vp.register()
    results.append(snapshot())
print("PROBE " + json.dumps(results))
