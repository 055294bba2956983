"""Reading and writing a package's files (and a run folder's) without trusting what lies on disk.

A package is untrusted input: it may arrive as a pull request. Every file onboard reads from it or writes
into it is reached from the package folder one component at a time through directory descriptors opened
with O_NOFOLLOW, so a symlink anywhere below the package folder (a symlinked `alignment/`, a `report.json`
pointing at a user's file) is refused instead of followed; a read takes only a regular file (a FIFO or a
device would block or never end) and at most READ_LIMIT bytes. A write goes to a temporary file in the
verified folder and is renamed over the name, so a reader never sees half a file and nothing outside
the package is touched. Every refusal is a BadInput naming the path: exit 2, one line.
"""
from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path
from typing import Iterator

from onboard.errors import BadInput

# JSON and YAML package files are kilobytes to a few megabytes (a weight map of a large MoE); far more is not
# a file new-model wrote, and reading it whole would only cost memory
READ_LIMIT = 64 * 2**20
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def _parts(root: Path, path: Path) -> list[str]:
    """The components of `path` below `root`; refused when it is not below it."""
    try:
        parts = Path(os.path.normpath(path)).relative_to(os.path.normpath(root)).parts
    except ValueError:
        raise BadInput(path, None, f"outside the folder {root}: onboard reads and writes only inside it") from None
    if not parts or ".." in parts:
        raise BadInput(path, None, f"not a file inside {root}")
    return list(parts)


def _open_dir(parent_fd: int, name: str, shown: Path, create: bool) -> int:
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, dir_fd=parent_fd)
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except OSError as err:
        raise _refusal(shown, err, "a folder") from None


def _refusal(shown: Path, err: OSError, what: str) -> BadInput:
    if err.errno in (errno.ELOOP, errno.ENOTDIR, errno.EMLINK):
        return BadInput(shown, None, f"not {what} (a symlink or another kind of file): package files are never "
                                     "followed out of the package")
    if err.errno == errno.ENOENT:
        return BadInput(shown, None, "missing: the package is incomplete (rerun `onboard new-model`)")
    return BadInput(shown, None, f"unreadable: {err.strerror or err}")


@contextlib.contextmanager
def _folder(root: Path, parts: list[str], create: bool = False) -> Iterator[int]:
    """A descriptor of root/parts..., each component a real folder (no symlink), made when `create`."""
    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as err:
        raise _refusal(root, err, "a folder") from None
    try:
        shown = Path(root)
        for name in parts:
            shown = shown / name
            next_fd = _open_dir(fd, name, shown, create)
            os.close(fd)
            fd = next_fd
        yield fd
    finally:
        os.close(fd)


def read_bytes(root: Path, path: Path, limit: int = READ_LIMIT) -> bytes:
    """The bytes of the regular file `path` below `root`, reached without following a symlink."""
    root, path = Path(root), Path(path)
    *folders, name = _parts(root, path)
    with _folder(root, folders) as dir_fd:
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=dir_fd)
        except OSError as err:
            raise _refusal(path, err, "a regular file") from None
    with os.fdopen(fd, "rb") as f:
        return _read_regular(f, path, limit)


def read_text(root: Path, path: Path, limit: int = READ_LIMIT) -> str:
    try:
        return read_bytes(root, path, limit).decode("utf-8")
    except UnicodeDecodeError as err:
        raise BadInput(path, None, f"unreadable: not UTF-8 text ({err.reason} at byte {err.start})") from None


def read_outside_file(path: Path, limit: int = READ_LIMIT) -> bytes:
    """A regular file outside any package (a release's config.json): symlinks followed, as a user's release
    may link its files, but only a regular file read, so a FIFO or device cannot block or flood."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as err:
        raise _refusal(path, err, "a regular file") from None
    with os.fdopen(fd, "rb") as f:
        return _read_regular(f, path, limit)


def _read_regular(f, path: Path, limit: int) -> bytes:
    info = os.fstat(f.fileno())
    if not stat.S_ISREG(info.st_mode):
        raise BadInput(path, None, "not a regular file (a FIFO, device or socket): refused")
    if info.st_size > limit:
        raise BadInput(path, None, f"{info.st_size} bytes, over the {_size(limit)} a package file may hold")
    data = f.read(limit + 1)
    if len(data) > limit:
        raise BadInput(path, None, f"over the {_size(limit)} a package file may hold")
    return data


def _size(limit: int) -> str:
    return f"{limit >> 20} MiB" if limit >= 2**20 else f"{limit} bytes"


def write_text(root: Path, path: Path, text: str) -> None:
    """Write `path` below `root` (its missing folders made), replacing it whole; a symlink on the way, or at
    the name itself, is refused and nothing is written."""
    root, path = Path(root), Path(path)
    *folders, name = _parts(root, path)
    with _folder(root, folders, create=True) as dir_fd:
        _refuse_non_regular(dir_fd, name, path)
        tmp = f".{name}.tmp-{os.getpid()}"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp, dir_fd=dir_fd)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=dir_fd)
            raise


def _refuse_non_regular(dir_fd: int, name: str, shown: Path) -> None:
    try:
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(info.st_mode):
        raise BadInput(shown, None, "not a regular file (a symlink or another kind of file): onboard replaces "
                                    "only files it wrote, never writes through a link")


def check_folder(root: Path, path: Path) -> None:
    """Every component of `path` below `root` that exists is a real folder (not a symlink); nothing is made."""
    shown = Path(root)
    for name in _parts(Path(root), Path(path)):
        shown = shown / name
        if not os.path.lexists(shown):
            return
        if not stat.S_ISDIR(os.lstat(shown).st_mode):
            raise BadInput(shown, None, "not a folder (a symlink or another kind of file): onboard writes only "
                                        "inside the package")


def check_writable(root: Path, path: Path) -> None:
    """Refuse now what write_text would refuse later (before an hour of work whose result it could not write)."""
    root, path = Path(root), Path(path)
    *folders, name = _parts(root, path)
    with _folder(root, folders, create=True) as dir_fd:
        _refuse_non_regular(dir_fd, name, path)


def refuse_links_below(folder: Path) -> None:
    """Every entry below `folder` a regular file or a real folder (a run folder being resumed: the trainer
    appends to and replaces its files)."""
    for current, dirs, files in os.walk(folder, followlinks=False):
        for name in dirs + files:
            path = Path(current) / name
            mode = os.lstat(path).st_mode
            if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
                raise BadInput(path, None, "not a regular file or folder (a symlink or another kind of file): "
                                           "onboard writes only into files it made")
