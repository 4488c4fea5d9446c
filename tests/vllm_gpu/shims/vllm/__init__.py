"""Stand-in for the ``vllm`` package (tests/vllm_gpu): only the version the plugin checks."""

__version__ = "0.33.0"
