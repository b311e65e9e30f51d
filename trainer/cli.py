"""How every command starts: `cli.run(main)` at the end of each command's file is
absl's app.run with our flag parsing (parse_flags: a wrong flag, or a float flag
that is nan or inf, is one `error:` line and exit 2; a quiet default log,
`--verbosity=1` shows all), and `define_flag` defines a command's flags. None of
it needs TensorFlow, so the launcher starts without it. The run's own flags (one
per Config field) are trainer/run_flags.py's. Flags are read here and in the
commands' mains, never by library code."""
import logging as std_logging
import os
import re
import shutil
import sys
import textwrap
from typing import Any, Callable

from absl import app, flags, logging

# Moved to data/ (data.make_tfrecords needs them and must not import trainer/);
# the commands keep calling cli.set_native_log_level.
from data.quiet import set_native_log_level, wants_all_logs  # noqa: F401
from trainer.settings import non_finite

DETERMINISTIC_FLAGS = ("--deterministic", "--deterministic=true", "--deterministic=True",
                       "--deterministic=1")


def set_deterministic_kernels(argv: list[str]) -> None:
    """Call before TensorFlow is imported. With --deterministic, TensorFlow's own CPU
    kernels instead of oneDNN's (TF_ENABLE_ONEDNN_OPTS=0): TF's op determinism does
    not reach oneDNN, whose float32 convolutions gave other weights in 1 of 3
    identical --deterministic runs of a ResNet at 224x224 here (3 of 3 equal without
    it). It costs speed: about 2x on that run."""
    if any(arg in DETERMINISTIC_FLAGS for arg in argv):
        os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")


# trainer/faults.py's status for a stop signal, and the start-up handlers (defined
# in the package's __init__, installed by its first line when a command runs).
from trainer import STOPPED_EXIT_CODE, STOP_SIGNALS, stop_at_once_on_signals  # noqa: E402,F401


_PROJECT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_PACKAGES = ("trainer", "data", "models")
_OURS = tuple(os.path.join(_PROJECT, package) + os.sep for package in _PACKAGES)


class _QuietFilter(std_logging.Filter):
    """Our own records, and other libraries' warnings and errors; not their INFO
    lines (TFDS's "Load dataset info" at every evaluation, TF's "Sharding callback
    duration" at every checkpoint)."""

    def filter(self, record: std_logging.LogRecord) -> bool:
        return record.levelno >= std_logging.WARNING or record.pathname.startswith(_OURS)


def quiet_library_logs(verbosity: int) -> None:
    """The default log: our lines and the warnings that mean something. A command's
    --verbosity=1 brings everything back."""
    if verbosity >= 1:
        return
    handler = logging.get_absl_handler()
    if not any(isinstance(f, _QuietFilter) for f in handler.filters):
        handler.addFilter(_QuietFilter())


# The flags define_flag defined, in order, each with its heading in --help (None:
# the command's own, shown first).
_HELP_TOPICS: dict[str, str | None] = {}
HELP_ARGS = ("-h", "-help", "--help", "-helpshort", "--helpshort", "-?")


def define_flag(flag_values: flags.FlagValues, definer: Callable, name: str,
                default: Any, help: str, topic: str | None = None,  # noqa: A002
                **kwargs: Any) -> bool:
    """Defines one flag unless `flag_values` has one of that name (commands share
    names such as --model_dir, and tests load several commands in one process).
    The flag belongs to the calling command (--helpshort); `topic` is its heading in
    --help (None: the command's own; given again for a defined flag, it moves the
    flag there). Returns whether it was defined."""
    if name not in _HELP_TOPICS or topic is not None:
        _HELP_TOPICS.pop(name, None)
        _HELP_TOPICS[name] = topic
    if name in flag_values:
        return False
    caller = sys._getframe(1).f_globals["__name__"]  # noqa: SLF001
    definer(name, default, help=help, flag_values=flag_values,
            module_name=sys.argv[0] if caller == "__main__" else caller, **kwargs)
    return True


def grouped_help(flag_values: flags.FlagValues, usage: str = "") -> str:
    """--help: `usage` (the command's docstring), then every flag of the project's
    code, once, under its topic (define_flag's; the command's own first), in the
    order they were defined; absl's and TensorFlow's are --helpfull's."""
    groups: dict[str, list[flags.Flag]] = {"": []}
    for name, topic in _HELP_TOPICS.items():
        if name in flag_values:
            groups.setdefault(topic or "", []).append(flag_values[name])
    for module, defined in flag_values.flags_by_module_dict().items():
        if module.startswith(_OURS) or module.split(".")[0] in _PACKAGES:
            groups[""] += [flag for flag in defined if flag.name not in _HELP_TOPICS]
    lines = [usage.strip(), ""] if usage.strip() else []
    for topic, members in groups.items():
        if members:
            lines.append(f"{topic or 'this command'}:")
            lines += [_flag_help(flag) for flag in members]
            lines.append("")
    lines.append("--helpfull: every flag, absl's and TensorFlow's too, alphabetically.")
    return "\n".join(lines)


class _HelpWrapper(textwrap.TextWrapper):
    """Wraps after a '|' too: 'a|b|c' lists of choices break between choices."""

    def _split(self, text: str) -> list[str]:
        return [piece for chunk in super()._split(text)
                for piece in re.split(r"(?<=\|)", chunk) if piece]


def _flag_help(flag: flags.Flag) -> str:
    """'  --batch_size=1024: GLOBAL batch size, ...', wrapped to the terminal (at
    most 100 columns)."""
    default = flag.default_as_str or ""
    if default[1:-1] and default[0] == default[-1] == "'" and " " not in default:
        default = default[1:-1]  # (quoted only when empty or spaced)
    name = f"--[no]{flag.name}" if flag.boolean else f"--{flag.name}"
    shown = f"{name}={default}" if flag.default is not None else name
    width = min(shutil.get_terminal_size().columns, 101) - 1
    return _HelpWrapper(width, initial_indent="  ", subsequent_indent="    ").fill(
        f"{shown}: {flag.help}")


HELPFULL_ARGS = ("-helpfull", "--helpfull")
FLAGFILE_ARGS = ("-flagfile", "--flagfile")


def _flag_error(err: flags.Error, given: list[str]) -> str:
    """absl's parse error in one line; a --flagfile it cannot open said as such
    (absl's reads "ERROR:: Unable to open flagfile: [Errno 2] ...")."""
    text = " ".join(str(err).split())
    if "Unable to open flagfile" in text:
        names = [arg.split("=", 1)[1] if "=" in arg else next_arg for arg, next_arg
                 in zip(given, given[1:] + [""]) if arg.split("=")[0] in FLAGFILE_ARGS]
        cause = text.split("]", 1)[-1].split(":")[0].strip() if "]" in text else text
        return (f"--flagfile={names[-1] if names else '?'}: cannot read it ({cause}); "
                f"give the path of a file of flags, one --name=value a line")
    return text


def parse_absl_flags(flag_values: flags.FlagValues, argv: list[str]) -> list[str]:
    """absl's parsing, but an unknown, malformed or missing required flag is one
    `error: ...` line on stderr and exit status 2, like every other user error;
    library logs (e.g. TF's SavedModel writer at INFO) only from WARNING unless
    --verbosity is given, each record once (TF's own stderr handler would repeat
    what absl's prints); --help, -h and --helpshort print the command's flags by
    topic (grouped_help) and exit 0. Needs no TensorFlow (the launcher starts
    without it)."""
    given = argv[1:argv.index("--")] if "--" in argv else argv[1:]
    if any(arg in HELP_ARGS for arg in given):
        print(grouped_help(flag_values, getattr(sys.modules["__main__"], "__doc__", "")
                           or ""))
        sys.exit(0)
    if any(arg in HELPFULL_ARGS for arg in given):  # (absl's own exits 1)
        app.usage(shorthelp=False, writeto_stdout=True)
        sys.exit(0)
    try:
        argv = flag_values(argv)
    except flags.Error as err:
        print(f"error: {_flag_error(err, given)}", file=sys.stderr)
        sys.exit(2)
    if not flag_values["verbosity"].present:
        logging.set_verbosity(logging.WARNING)
    std_logging.getLogger("tensorflow").handlers.clear()
    return argv


def parse_flags(argv: list[str], flag_values: flags.FlagValues = flags.FLAGS) -> list[str]:
    """The parser every command runs with:
    - parse_absl_flags: a wrong flag is one `error: ...` line, exit 2; quiet
      library logs;
    - a float flag that is nan or inf is the same one line (no range check sees it).
    Returns the arguments left after the flags."""
    argv = parse_absl_flags(flag_values, argv)
    for name, value in flag_values.flag_values_dict().items():  # nan < 0 is False:
        problem = non_finite(name, value)  # every range check would pass it
        if problem:
            print(f"error: {problem}", file=sys.stderr)
            sys.exit(2)
    return argv


def run(main: Callable[[list[str]], None],
        flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Runs a command's `main` (absl's app.run), its flags parsed by parse_flags."""
    app.run(main, flags_parser=lambda argv: parse_flags(argv, flag_values))


def import_user_code(flag_values: flags.FlagValues, argv: list[str]) -> None:
    """First in a command's define_flags: the user's own code (trainer/user_code.py:
    the installed packages' entry points, then --import's modules), before the
    command's flags are defined (a task of theirs has its settings as flags), and
    the --import flag itself. A module that cannot be imported: one `error:` line,
    exit 2."""
    from trainer import user_code  # (no TensorFlow: the launcher needs none)
    user_code.import_for_command(argv)
    define_flag(flag_values, flags.DEFINE_string, user_code.FLAG, "",
                "Modules of your own to import first, 'MODULE[,MODULE]': they register "
                "models, tasks and callbacks (trainer/user_code.py). A run records "
                "them; commands on the run import them themselves.",
                topic="your own code")  # (config.TOPICS' heading)


def refuse_arguments(argv: list[str]) -> None:
    """A command that takes only flags: anything left after them (a typo such as
    `--lr 0.1` leaves `0.1`) is one `error:` line and exit 2."""
    if len(argv) > 1:
        print(f"error: unexpected arguments {argv[1:]}; flags look like --name=value",
              file=sys.stderr)
        sys.exit(2)
