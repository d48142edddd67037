"""tensorboardX, imported without torch.

tensorboardX's writer module runs `import torch` when it is imported (to accept torch tensors,
which kiln never passes it). Where torch is installed beside kiln, that import is about 2 s of
every run's start-up and a few hundred MB of memory. kiln imports tensorboardX with torch marked
absent for that one import; torch itself stays importable afterwards, and tensorboardX imports it
lazily in the functions that take torch tensors.
"""

import sys
from types import ModuleType


def tensorboardx() -> ModuleType:
    """The tensorboardX package, imported without torch unless torch is already imported."""
    if "tensorboardX" not in sys.modules and "torch" not in sys.modules:
        sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` -> ImportError
        try:
            import tensorboardX
        finally:
            del sys.modules["torch"]
    import tensorboardX

    return tensorboardX
