"""The machinery under the public ops: each op's declaration (``op_specs``), the torch.library
ops and the eager call path (``_library``, ``_calls``), argument and index checks
(``_validate``, ``index_checks``), the platform probe and the registry that picks a backend per
op (``platform``, ``registry``, ``env``), and the record formats and number codecs every
implementation shares (``formats``, ``codecs``).  Nothing here is vLLM's API."""
