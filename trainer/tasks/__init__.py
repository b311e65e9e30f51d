"""Tasks: what a run optimizes and measures (--task). The contract is
trainer/tasks/base.py; each task is one file here, registered with
`@base.register`, and every module in this folder is imported at the first look-up
of a task (`names()`, `get()`, ...), not with the package: a new task is one new
file, and it may import any trainer module at its top.

Built in: classification (the default), distill (a student and a finished run as
its teacher), autoencoder (reconstruction, no labels), gan (two networks and
optimizers), simclr (two views, contrastive).
"""
from trainer.tasks.base import (Task, all_setting_fields, get, make_settings,  # noqa: F401
                                names, owners, register, setting_fields)
