"""Tasks: what a run optimizes and measures (--task). The contract is
trainer/tasks/base.py (how a trained model is served and drawn: its presenter,
trainer/tasks/presenter.py); each task is one file here, registered with
`@base.register`, and every module in this folder is imported at the first look-up
of a task (`names()`, `get()`, ...), not with the package: a new task is one new
file, and it may import any trainer module at its top.

Built in: classification (the default), distill (a student and a finished run as
its teacher), autoencoder (reconstruction, no labels), gan (two networks and
optimizers), wgan_gp (a critic and a generator, two steps on a schedule), simclr
(two views, contrastive), fixmatch (semi-supervised: two input streams).
"""
from trainer.tasks.base import (Best, Presenter, Task, all_setting_fields,  # noqa: F401
                                check_model, check_model_kind, get, make_settings,
                                has_own_step, makes_own_batches, names, num_classes,
                                owners, register,
                                setting_fields)
