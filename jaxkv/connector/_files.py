"""The file operations of a `DiskStore` (`FileOps`): plain files only, no links followed.

Anyone who may write in a shared cache folder could otherwise make every reader block on a
FIFO where a block file should be, or reach files elsewhere through a link. So every name is
used relative to its folder, opened without following a link (where the platform has the
`*at` calls), files are opened non-blocking and checked to be plain files before they are
read, and anything else under a block name is an `IrregularFileError`: damage the store
removes. Tests replace `FileOps` to inject disk faults.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator

from jaxkv.connector import _records

# Open flags a platform may lack (0 there): O_NOFOLLOW and O_DIRECTORY refuse a link at a
# path's last component, O_NONBLOCK keeps opening a FIFO or device from blocking.
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_O_DIRECTORY = getattr(os, "O_DIRECTORY", 0)
_O_FLAGS = getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
# Whether names are used relative to their folder opened without following a link (openat and
# its kin), so that no link can be swapped in between checking a folder and using it. Without
# them (Windows) each operation checks with `lstat` first, which a racing writer can defeat.
_AT = (
    bool(_O_NOFOLLOW and _O_DIRECTORY)
    and {os.open, os.stat, os.mkdir, os.rename, os.unlink, os.utime} <= os.supports_dir_fd
    and {os.stat, os.utime} <= os.supports_follow_symlinks
    and os.listdir in os.supports_fd
)


class IrregularFileError(OSError):
    """What a `DiskStore` finds under one of its names instead of what it writes there: a
    FIFO, device, socket, folder or symbolic link under a block file's name, or anything but
    a folder (or a plain file, which fails as an I/O error) under a subfolder's name.

    `filename` is that name. It was neither opened (opening a FIFO or device can block the
    reader) nor followed (a link can point at any file, another tenant's included).
    """


def _kind(mode: int) -> str:
    for test, kind in (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISREG, "a plain file"),
    ):
        if test(mode):
            return kind
    return "a special file"


def _irregular(path: str, mode: int, wanted: str) -> IrregularFileError:
    return IrregularFileError(errno.EINVAL, f"{_kind(mode)} where a {wanted} belongs", path)


def _lstat(name: str, folder: int | None) -> os.stat_result | None:
    """The status of `name` itself (a link's own), or None when it cannot be had."""
    try:
        return os.stat(name, dir_fd=folder, follow_symlinks=False)
    except OSError:
        return None


def _check_folder(path: str) -> None:
    """Raises `IrregularFileError` when `path` is neither a folder nor a plain file (a plain
    file fails on its own, as an I/O error, when used as a folder)."""
    st = _lstat(path, None)
    if st is not None and not (stat.S_ISDIR(st.st_mode) or stat.S_ISREG(st.st_mode)):
        raise _irregular(path, st.st_mode, "folder")


def _open_folder(path: str) -> int:
    """A descriptor of the folder `path`, never through a link at its last component."""
    try:
        return os.open(path, os.O_RDONLY | _O_DIRECTORY | _O_NOFOLLOW | _O_FLAGS)
    except FileNotFoundError:
        raise
    except OSError:
        _check_folder(path)  # a link or a special file: say so (a plain file: ENOTDIR)
        raise


@contextlib.contextmanager
def _in_folder(path: str) -> Iterator[tuple[int | None, str]]:
    """`(folder, name)` for `path`: its folder opened without following a link, and its name
    there; without openat, `(None, path)` once `lstat` found the folder to be no link."""
    folder, name = os.path.split(path)
    if not _AT:
        _check_folder(folder)
        yield None, path
        return
    fd = _open_folder(folder)
    try:
        yield fd, name
    except OSError as err:
        # Calls relative to the folder name the entry alone: the error names the whole path,
        # so a log line or a raised error says which folder failed.
        if err.filename == name:
            err.filename = path
        if getattr(err, "filename2", None) == name:
            err.filename2 = path
        raise
    finally:
        os.close(fd)


def _open_file(folder: int | None, name: str, path: str) -> tuple[int, os.stat_result]:
    """A descriptor reading the plain file `name` of `folder`, and its status. Never follows
    a link, never blocks opening a FIFO or device, and refuses (`IrregularFileError`) all but
    a plain file."""
    if not _O_NOFOLLOW:  # the open would follow a link: refuse one first
        st = _lstat(name, folder)
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise _irregular(path, st.st_mode, "plain file")
    try:
        fd = os.open(name, os.O_RDONLY | _O_NOFOLLOW | _O_NONBLOCK | _O_FLAGS, dir_fd=folder)
    except FileNotFoundError:
        raise
    except OSError:
        st = _lstat(name, folder)  # a link (O_NOFOLLOW refused it), a socket (ENXIO)...
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise _irregular(path, st.st_mode, "plain file") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _irregular(path, st.st_mode, "plain file")
        if _O_NONBLOCK:
            os.set_blocking(fd, True)  # it was for the open: a plain file reads as usual
    except BaseException:
        os.close(fd)
        raise
    return fd, st


class FileOps:
    """The file operations of a `DiskStore`, one method each; tests replace it to inject
    faults (a full or read-only disk, vanished files, read errors).

    Anyone who may write in the store's folder can put a FIFO, a device or a link where a
    block file or subfolder belongs. So no method follows a link inside the folder or opens
    anything but a plain file: each uses its name relative to its folder opened without
    following a link (where the platform has openat; elsewhere after an `lstat`), opens
    files with `O_NOFOLLOW` and `O_NONBLOCK` and checks `fstat` before reading, and raises
    `IrregularFileError` for what is not a plain file (or folder). A FIFO would otherwise
    block every reader; a link would serve, touch or remove a file outside the folder.
    """

    def makedirs(self, path: str) -> str:
        """Creates the store's folder `path` and its parents, if missing.

        Returns:
            Its real path (every link resolved): links on the way to the folder are the
            caller's choice; links inside it are never followed.
        """
        os.makedirs(path, exist_ok=True)
        return os.path.realpath(path)

    def mkdir(self, path: str) -> None:
        """Creates the subfolder `path` if missing. A plain file there raises
        `FileExistsError`; anything else but a folder, `IrregularFileError`."""
        with _in_folder(path) as (folder, name):
            try:
                os.mkdir(name, dir_fd=folder)
            except FileExistsError:
                st = os.stat(name, dir_fd=folder, follow_symlinks=False)
                if stat.S_ISDIR(st.st_mode):
                    return
                if not stat.S_ISREG(st.st_mode):
                    raise _irregular(path, st.st_mode, "folder") from None
                raise

    def write(self, path: str, data: bytes, fsync: bool) -> None:
        """Writes `data` to `path`, a new name: an existing file, link or FIFO there fails
        the call (`FileExistsError`) and is never written through."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW | _O_FLAGS
        with _in_folder(path) as (folder, name):
            with open(os.open(name, flags, 0o666, dir_fd=folder), "wb") as f:
                f.write(data)
                if fsync:
                    f.flush()
                    os.fsync(f.fileno())

    def replace(self, src: str, dst: str) -> None:
        """Renames `src` over `dst`, two names of one folder (whatever `dst` names is
        replaced, never followed)."""
        if os.path.dirname(src) != os.path.dirname(dst):
            raise ValueError(f"dst: expected a name in the folder of {src}, got {dst}")
        with _in_folder(src) as (folder, name):
            target = dst if folder is None else os.path.basename(dst)
            os.replace(name, target, src_dir_fd=folder, dst_dir_fd=folder)

    def read(self, path: str) -> bytes:
        """The bytes of the record file `path`, read whole only when its size is right.

        Raises:
            CorruptRecordError: the file's size is not what its header declares (torn,
                extended, not a record); only its head was read, so a huge file under a
                block's name is never read whole.
            IrregularFileError: `path` is not a plain file.
        """
        with _in_folder(path) as (folder, name):
            fd, st = _open_file(folder, name, path)
            with open(fd, "rb") as f:
                head = f.read(_records.HEAD_BYTES)
                declared = _records.expected_size(head)
                if declared != st.st_size:
                    raise _records.CorruptRecordError(
                        f"{path}: {st.st_size} bytes, its header declares {declared}"
                    )
                if len(head) == declared:
                    return head
                f.seek(0)
                data = f.read(declared + 1)  # a byte more: a file changed since its fstat
        if len(data) != declared:
            raise _records.CorruptRecordError(f"{path}: its size changed while read")
        return data

    def head(self, path: str, n: int) -> tuple[bytes, int]:
        """The first `n` bytes of the plain file `path` and its size, from one open
        (`IrregularFileError` for anything else)."""
        with _in_folder(path) as (folder, name):
            fd, st = _open_file(folder, name, path)
            with open(fd, "rb") as f:
                return f.read(n), st.st_size

    def listdir(self, path: str) -> list[str]:
        """The names in the folder `path`, never listed through a link."""
        if not _AT:
            _check_folder(path)
            return os.listdir(path)
        fd = _open_folder(path)
        try:
            return os.listdir(fd)
        finally:
            os.close(fd)

    def stat(self, path: str) -> os.stat_result:
        """The status of `path` itself: a link's own, never its target's."""
        with _in_folder(path) as (folder, name):
            return os.stat(name, dir_fd=folder, follow_symlinks=False)

    def touch(self, path: str) -> None:
        """Sets the modification time of the plain file `path` to now."""
        with _in_folder(path) as (folder, name):
            if not _AT:
                st = os.stat(name, follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode):
                    raise _irregular(path, st.st_mode, "plain file")
                os.utime(name)
                return
            os.utime(name, dir_fd=folder, follow_symlinks=False)

    def unlink(self, path: str) -> None:
        """Removes the name `path` (a link's name, never its target)."""
        with _in_folder(path) as (folder, name):
            os.unlink(name, dir_fd=folder)
