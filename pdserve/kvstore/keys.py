"""Where the tiers' MAC key and directories come from, and the ownership rules they obey
(docs/tiers.md, "Authentication").

The key must outlive the processes that write entries, so it is not the cluster secret: it is
``kvstore.key_file`` (>= 32 bytes, owned by the worker's user, private), or else
``~/.config/pdserve/kv-tier.key``, made owner-only on first use. A store's directories are
0700 and refused when another user owns them or others may write into them.
"""

from __future__ import annotations

import os
import secrets
import stat
from pathlib import Path

KEY_BYTES = 32
DEFAULT_KEY_FILE = Path("~/.config/pdserve/kv-tier.key")


def _check_private(path: Path, st: os.stat_result, what: str) -> None:
    if st.st_uid != os.geteuid():
        raise PermissionError(f"{what} {path} is owned by uid {st.st_uid}, not by us")
    if st.st_mode & 0o077:
        mode = stat.S_IMODE(st.st_mode)
        raise PermissionError(f"{what} {path} has mode {mode:o}; it must be private (0600)")


def read_key_file(path: str | Path) -> bytes:
    """The key in an operator's key file; PermissionError or ValueError saying what is wrong."""
    path = Path(path).expanduser()
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError(f"key file {path} is not a regular file")
        _check_private(path, st, "key file")
        key = os.read(fd, 4096)
    finally:
        os.close(fd)
    if len(key) < KEY_BYTES:
        raise ValueError(f"key file {path} holds {len(key)} bytes; it needs >= {KEY_BYTES}")
    return key


def default_key(path: Path = DEFAULT_KEY_FILE) -> bytes:
    """The per-user key, made on first use. Written under a temporary name and linked into
    place, so two workers starting at once agree on one key and never read half of it."""
    path = path.expanduser()
    private_dir(path.parent)
    if not path.exists():
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.write(fd, secrets.token_bytes(KEY_BYTES))
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another worker won: use its key
        finally:
            os.unlink(tmp)
    return read_key_file(path)


def private_dir(path: str | Path) -> Path:
    """Create ``path`` owner-only (parents as usual), or accept it if it already is ours and
    no one else may write into it; PermissionError otherwise. Tightens ours to 0700."""
    path = Path(path)
    try:
        path.mkdir(mode=0o700, parents=True)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"{path} is not a directory (a symlink or a file?)")
    if st.st_uid != os.geteuid():
        raise PermissionError(f"{path} was created by uid {st.st_uid}, not by us: refused")
    if st.st_mode & 0o022:
        mode = stat.S_IMODE(st.st_mode)
        raise PermissionError(f"{path} has mode {mode:o}: others may write into it: refused")
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)
    return path
