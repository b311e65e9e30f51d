"""Tasks: what a run optimizes and measures (--task). The contract is
trainer/tasks/base.py; each task is one file here, registered with
`@base.register`, and every module in this folder is imported with the package:
a new task is one new file.

Built in: classification (the default), distill (a student and a finished run as
its teacher), autoencoder (reconstruction, no labels).
"""
import importlib
import pkgutil

from trainer.tasks.base import (Task, all_setting_fields, get, make_settings,  # noqa: F401
                                names, owners, register, setting_fields)

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "base":
        importlib.import_module(f"{__name__}.{_module.name}")
