"""Type aliases shared by the modules."""

from typing import Any

PyTree = Any  # a JAX pytree: nested dicts, lists, tuples, dataclasses of arrays
