"""Model implementations, looked up by the Hugging Face architecture name
(``kvgate.engine.models.registry``).

The names below load their modules on first use (``kvgate.engine._lazy``): importing one of the
package's modules does not import the others; inside the engine, import from the modules.
"""

import typing

import kvgate.engine._lazy as _lazy

if typing.TYPE_CHECKING:
    from kvgate.engine.models.registry import MODEL_CLASSES, model_class

__all__ = ["MODEL_CLASSES", "model_class"]

__getattr__, __dir__ = _lazy.exports(
    __name__, {"kvgate.engine.models.registry": ("MODEL_CLASSES", "model_class")}
)
