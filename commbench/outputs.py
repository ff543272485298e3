"""Files a verb writes besides its results file (a summary, a plot, a study, a
report's figures): checked before anything is computed or written, and never
replaced without --force."""
import os

PLOT_EXTENSIONS = (".png", ".pdf", ".svg")


def check_place(path: str, flag: str):
    """ValueError where a file cannot be made at path: it is a folder, or a
    folder on its path is a file."""
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path} is a folder: give a file name")
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {path}: {parent} is a file, not a folder")


def check_new(path: str, force: bool, flag: str):
    """ValueError unless path may be written: it is not a folder, and it does not
    exist unless force."""
    if not path:
        raise ValueError(f"{flag}: give a file name, not an empty string")
    check_place(path, flag)
    if os.path.exists(path) and not force:
        raise ValueError(f"{path} exists: commbench never overwrites it (use --force or another {flag})")


def check_plot(path: str, force: bool):
    """--plot: a new .png, .pdf or .svg file (matplotlib picks the format by it)."""
    if not path.lower().endswith(PLOT_EXTENSIONS):
        raise ValueError(f"--plot {path}: give a file name ending in {', '.join(PLOT_EXTENSIONS)}")
    check_new(path, force, "--plot")
