"""Imports every built-in cost model module so that each registers itself."""
import importlib

for _module in ("unit", "linear", "roofline", "fitted", "vidur"):
    try:
        importlib.import_module(f"{__package__}.{_module}")
    except ModuleNotFoundError as err:  # a module not written yet
        if err.name != f"{__package__}.{_module}":
            raise
