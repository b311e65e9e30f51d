"""My research, outside tfloop: importing the package registers its models, its
task and its callback (--import=my_research, or the entry point once installed)."""
from my_research import callbacks, models, tasks  # noqa: F401
