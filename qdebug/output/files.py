"""Writing outputs safely: atomic writes, output checks, and the output transaction of a run.

A light module (standard library only): the graph layer, the calibration cache and every command
write through it, and none of them has to import report I/O or a command to do so.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from qdebug.errors import ExitCode, QDebugError


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` atomically: a temp file in the same directory, then rename.

    An interrupted run therefore leaves either the old file or the new one,
    never half a file, and no temp file behind.
    """
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_write_text`).

    A symlink is written through, like a plain write would: the rename had replaced the user's link with
    a regular file, leaving its target stale.
    """
    path = Path(path)
    if path.is_symlink():
        path = Path(os.path.realpath(path))
    directory = path.parent if str(path.parent) else Path(".")
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as e:
        raise QDebugError(
            f"cannot write to {directory}: {e.strerror}",
            "choose an output path in a directory you can write to",
            ExitCode.OUTPUT,
        ) from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, output_mode(path))
        os.replace(tmp, path)
    except OSError as e:
        _silent_unlink(tmp)
        raise QDebugError(f"cannot write {path}: {e.strerror}", write_hint(e), ExitCode.OUTPUT) from None
    except BaseException:
        _silent_unlink(tmp)
        raise


def write_hint(e: OSError, flag: str = "-o") -> str:
    """The fix for a failed write: free space when the disk is full, another path otherwise (a missing or
    read-only directory had been told to free disk space)."""
    import errno

    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"free disk space or choose another {flag} path"
    return f"choose a writable {flag} path"


def output_mode(path: str | Path) -> int:
    """Permissions for a file written through a temp file: those of the file it replaces, else what
    ``open()`` would give a new file (0o666 less the umask). ``mkstemp`` creates 0o600 files, which would
    leave reports unreadable to the rest of a team or a CI artifact store."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return 0o666 & ~_umask()


@functools.lru_cache(maxsize=1)
def _umask() -> int:
    try:  # Linux: read it without changing it (os.umask can only be read by setting it)
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _silent_unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def check_writable(path: str | Path, flag: str = "-o") -> None:
    """Fail before long work starts if ``path`` cannot be created (directory missing/unwritable);
    ``flag`` is the option the fix names."""
    path = Path(path)
    ancestor = path.parent if str(path.parent) else Path(".")
    while not ancestor.exists() and ancestor != ancestor.parent:
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise QDebugError(
            f"cannot create {path}: {ancestor} is not a directory",
            f"choose another {flag} path",
            ExitCode.OUTPUT,
        )
    if not os.access(ancestor, os.W_OK):
        raise QDebugError(
            f"output directory {ancestor} is not writable", f"choose another {flag} path", ExitCode.OUTPUT
        )
    if path.is_dir():
        raise QDebugError(
            f"output path {path} is a directory", f"give a file name with {flag}", ExitCode.OUTPUT
        )


def check_outputs_spare_inputs(
    outputs: dict[str, str | Path | None], inputs: dict[str, str | Path | None]
) -> None:
    """Refuse an output path that is one of the inputs, or another output: the user's files are never
    modified (``-o model.onnx`` had replaced the model with the report, ``--csv`` the same as ``-o``
    the report with the CSV). Keys name the paths for the message; ``None`` entries are skipped, and
    inputs that are not files (a data folder, a ``module:function`` hook) cannot collide."""

    def where(path: str | Path) -> Path:
        return Path(os.path.realpath(path))

    taken: dict[Path, str] = {}
    for what, path in inputs.items():
        if path is not None and Path(path).is_file():
            taken.setdefault(where(path), what)
    for what, path in outputs.items():
        if path is None:
            continue
        key = where(path)
        if key in taken:
            raise QDebugError(
                f"{what} {path} would overwrite {taken[key]} (the same file)",
                "choose another output path",
                ExitCode.USAGE,
            )
        taken[key] = what


def sha256_file(path: str | Path) -> str:
    """Hex SHA-256 of a file, read in chunks (models can be large)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def artifacts_dir(report_path: Path) -> Path:
    """Where the normalized and quantized models of a report live: ``<report stem>_files/``."""
    return report_path.parent / f"{report_path.stem}_files"


@contextlib.contextmanager
def removed_on_failure(
    workdir: Path | None,
    outputs: Sequence[str | Path | None] = (),
    inputs: Sequence[str | Path | None] = (),
) -> Iterator[None]:
    """A run's outputs appear whole or not at all: ``workdir`` (a ``<stem>_files/`` directory) and
    ``outputs`` (the JSON, a chart) are removed if the block fails or is interrupted.

    Outputs of an earlier run at those paths are moved aside first and put
    back on failure, deleted on success: a failed or interrupted re-run had
    replaced ``_files/*.onnx`` under the old report, and a Ctrl-C just after
    the JSON was written left a JSON whose models were deleted. A directory
    holding one of the run's ``inputs`` is not moved (the run reads it).
    """
    files = [Path(o) for o in outputs if o]  # "" would be "." (and has no name to move aside)
    lock = _lock_outputs(files[0] if files else workdir)
    try:
        yield from _replaced_whole(workdir, files, inputs)
    finally:
        _unlock_outputs(lock)


def _lock_outputs(output: Path | None) -> tuple[int, Path] | None:
    """Take ``.<name>.qdebug-lock`` next to ``output`` for the run, or fail at once (exit 7).

    Two runs writing the same ``-o`` had mixed their files (one run's report, the other's models), and the
    second would now take the first's outputs set aside for a killed run's. An advisory ``flock``: the
    system drops it when a process dies, so a killed run never blocks the next. Where ``fcntl`` is missing
    (Windows) or the folder does not exist yet, no lock is taken.
    """
    if output is None or not output.absolute().parent.is_dir():
        return None
    try:
        import fcntl
    except ImportError:
        return None
    path = output.absolute().parent / f".{output.name}.qdebug-lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:
        return None  # a read-only folder: the writability checks name the problem
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise QDebugError(
            f"another qdebug run is writing {output} (lock {path.name})",
            "wait for it to finish, or choose another output path",
            ExitCode.OUTPUT,
        ) from None
    return fd, path


def _unlock_outputs(lock: tuple[int, Path] | None) -> None:
    if lock is None:
        return
    fd, path = lock
    with contextlib.suppress(OSError):
        path.unlink()  # no hidden file left next to the output once the run is done
    os.close(fd)


def _replaced_whole(
    workdir: Path | None, files: list[Path], inputs: Sequence[str | Path | None]
) -> Iterator[None]:
    """The body of :func:`removed_on_failure` (under the output lock)."""
    held = [Path(str(i)).resolve() for i in inputs if i and Path(str(i)).exists()]
    new_parents = []  # the directories above the outputs that the run creates, removed if left empty
    for out in ([workdir] if workdir is not None else []) + files:
        parent = out.absolute().parent
        while not parent.exists() and parent != parent.parent and parent not in new_parents:
            new_parents.append(parent)
            parent = parent.parent
    new_parents.sort(key=lambda p: -len(p.parts))  # innermost first
    targets = ([workdir] if workdir is not None else []) + files
    kept: list[Path] = []  # earlier outputs the run works over in place
    backups: list[tuple[Path, Path]] = []
    try:
        for target in targets:
            aside = target.with_name(f".{target.name}.qdebug-previous")
            if aside.exists() or aside.is_symlink():
                # only a run killed outright (SIGKILL, power) leaves an output aside: it is the last good
                # output, and what stands at the target is that run's partial work (its _files/ had been
                # kept and the earlier models deleted, so a report and another run's models got paired)
                with contextlib.suppress(OSError):
                    if target.exists() or target.is_symlink():
                        _remove(target)
                    aside.rename(target)
            if not target.exists() and not target.is_symlink():
                continue
            if target in files and target.is_dir() and not target.is_symlink():
                # a directory named as an output *file* is the user's, not an earlier run's: it stays, and
                # the writability check refuses it (bench -o DIR had moved it aside, then deleted it)
                kept.append(target)
                continue
            if _works_in_place(target, held):
                kept.append(target)
                continue
            try:
                target.rename(aside)
            except OSError:  # not movable: replaced in place, as before
                kept.append(target)
                continue
            backups.append((target, aside))
        yield
    except BaseException:
        for target in targets:
            if target not in kept:
                _remove(target)
        for target, aside in backups:
            with contextlib.suppress(OSError):
                aside.rename(target)
        for parent in new_parents:  # a directory holding anything stays
            with contextlib.suppress(OSError):
                parent.rmdir()
        raise
    for _, aside in backups:
        _remove(aside)


def _works_in_place(target: Path, held: list[Path]) -> bool:
    """An earlier output the run must not move: it is one of the run's inputs or holds one (the
    overlap check then names it), or it is a symlink (moving it would replace the user's link to
    another disk with a directory)."""
    if target.is_symlink():
        return True
    real = target.resolve()
    return any(h == real or (target.is_dir() and h.is_relative_to(real)) for h in held)


def _remove(path: Path) -> None:
    """Delete a file or directory tree if it exists."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        with contextlib.suppress(OSError):
            path.unlink()


def record_path(p: str | Path) -> str:
    """A data path as the report records it: absolute, so propose/verify find it from another directory;
    a ``file.py:function`` hook gets an absolute file part (a dotted module name is kept as given)."""
    path = Path(p)
    if path.exists():
        return str(path.resolve())
    text = str(p)
    module, sep, func = text.rpartition(":")
    if sep and module.endswith(".py") and Path(module).is_file():
        return f"{Path(module).resolve()}:{func}"
    return text
