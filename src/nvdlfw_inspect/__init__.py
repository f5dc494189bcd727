"""nvdlfw_inspect: a debug framework that inspects and steers tensors of a training run from a YAML config.

Import the user-facing API as ``import nvdlfw_inspect.api as debug_api``.
"""

__version__ = "0.3.0"
