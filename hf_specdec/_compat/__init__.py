"""The only package that touches Transformers' internals: a module per Transformers subsystem.

  kv_cache              transformers.cache_utils: our slot caches, the cache kwarg of model forwards
  modeling              a model's config and forward: layer kinds, windows, attention, devices
  recurrent             hybrid models' recurrent and convolution layers, recorded per column
  gemma4_assistant      Gemma 4 assistants, which draft from the target's states
  generation            generate(): compile criteria, pad token, output class
  candidate_generators  Transformers' assisted loop and candidate generators
  tensor_parallel       Transformers' tensor parallelism
  hub_kernels           hub kernels (5.25: `kernels`), their context variable made per thread
  cb                    continuous batching: the seam our speculating batch processor composes on
  serving               `transformers serve`

Checked against transformers 5.24.0 and 5.25.0 (the test suite runs on both: `make test`, and
`make test-oldest` for the oldest supported release).
"""
from __future__ import annotations

import transformers

SUPPORTED_TRANSFORMERS = ">=5.24,<5.26"


def check_transformers_version(version: str) -> None:
    """Refuse a transformers release outside SUPPORTED_TRANSFORMERS, naming the range."""
    try:
        major, minor = (int(part) for part in version.split(".")[:2])
    except ValueError:
        return  # a source build with an unusual version string: let it through
    if major != 5 or not 24 <= minor < 26:
        raise ImportError(f"hf_specdec supports transformers {SUPPORTED_TRANSFORMERS}, found {version}; "
                          f"pip install 'transformers{SUPPORTED_TRANSFORMERS}'")


check_transformers_version(transformers.__version__)
