"""Tools around the ops: the benchmark (``python -m dsv41 bench``), the conformance cases every
implementation is checked against (``python -m dsv41 check``, the tests) and the mapping from
kernel arguments to public calls that both use."""
