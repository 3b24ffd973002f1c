"""Run HumanEval unit tests on generated completions, each in its own locked-down child process.

    from eval.sandbox import run_check, run_checks
    run_check(problem, completion)                    # {"passed": True, "result": "passed"}
    run_checks([(problem, completion), ...], workers=2)

This process never executes generated code. Every check starts a fresh interpreter
(``sys.executable -I -c _CHILD``, a real exec, not a fork of the harness) that:

* runs in its own session / process group (``start_new_session=True``), so on timeout or after it
  exits the whole group, including anything it spawned, is SIGKILLed;
* has a fresh temporary working directory (removed afterwards), a minimal environment (no tokens,
  no paths of the harness) and stdin on /dev/null once it has read its payload;
* sets its own rlimits before touching the code: RLIMIT_AS (memory), RLIMIT_CPU, RLIMIT_FSIZE (small),
  RLIMIT_NPROC and RLIMIT_CORE=0 (CPython ignores SIGXFSZ, so an oversized write raises OSError). They are set in the child rather than in a ``preexec_fn`` because
  ``preexec_fn`` is not safe while other threads run and ``run_checks`` runs checks from a thread pool;
* disables faulthandler and nulls dangerous functions (os.system/kill/fork/exec*/remove/chdir...,
  shutil.rmtree/move, subprocess.Popen, builtins.exit/quit...) in both ``os`` and ``posix``, and
  blocks imports of ctypes, multiprocessing, resource, pty... The wrapper keeps private references
  to what it needs afterwards (os.write, os._exit). ``os._exit`` itself stays available to the
  code, as in OpenAI's guard: an early exit with status 0 is caught by the sentinel below.

How a pass is decided, and why it is hard to fake: the parent makes a random per-check token and a
dedicated result pipe. The token reaches the child only through its stdin, read before the code
runs (it is in neither argv nor the environment); the pipe's write end is passed with ``pass_fds``
and its number is removed from ``sys.argv``. After ``check(entry_point)`` *returns*, the wrapper
writes ``PASS <token>`` to that pipe and leaves with ``os._exit(0)`` (skipping atexit hooks and
threads started by the code). The parent counts a pass only if the exit status is 0 AND the pipe
holds exactly that line. So printing anything (stdout is /dev/null anyway), ``os._exit(0)``,
``sys.exit(0)`` (caught by the wrapper), spraying fake sentinels over every fd, timeouts, signals and
exceptions all score as failures; any stray write to the pipe spoils the exact match and fails too.

Limits, stated plainly: this is containment for buggy or naively misbehaving code, as in OpenAI's
human-eval, not a security boundary. Code in the same process as the wrapper can in principle find
the token (frame/gc introspection), undo the guard (e.g. by deleting the sys.modules
blocks and importing ctypes), write outside its working
directory with absolute paths, or use the network. As root, RLIMIT_NPROC is not enforced (the
nulled fork/exec functions and the process-group kill remain). Run untrusted generations in a
container/VM without network for real isolation.
"""
from __future__ import annotations

import json
import logging
import math
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Iterable

logger = logging.getLogger(__name__)

FSIZE_LIMIT_BYTES = 1 << 20  # files the code may write (and its stderr capture)
NPROC_LIMIT = 1  # no new processes or threads (ignored for root)
_REASON_CHARS = 200

# The child program. Kept self-contained: it must not import anything from this repository.
_CHILD = r'''
import builtins, faulthandler, json, os, resource, sys

def _limits(memory_bytes, cpu_s, fsize_bytes, nproc):
    for name, value in (("RLIMIT_AS", memory_bytes), ("RLIMIT_DATA", memory_bytes),
                        ("RLIMIT_CPU", cpu_s), ("RLIMIT_FSIZE", fsize_bytes),
                        ("RLIMIT_NPROC", nproc), ("RLIMIT_CORE", 0)):
        limit = getattr(resource, name, None)
        if limit is None or value is None:
            continue
        try:  # soft == hard, so the code cannot raise them again (unless root)
            resource.setrlimit(limit, (value, value))
        except (ValueError, OSError):
            pass  # e.g. a hard limit already lower than ours

_DISABLE_OS = (
    "kill", "killpg", "system", "putenv", "unsetenv", "remove", "removedirs", "rmdir", "unlink",
    "rename", "renames", "replace", "truncate", "ftruncate", "fork", "forkpty", "vfork", "setsid",
    "setpgid", "setpgrp", "setuid", "seteuid", "setgid", "chdir", "fchdir", "chroot", "getcwd",
    "chmod", "fchmod", "lchmod", "chown", "fchown", "lchown", "lchflags", "chflags", "link",
    "symlink", "mkfifo", "mknod", "popen", "posix_spawn", "posix_spawnp", "register_at_fork",
    "execl", "execle", "execlp", "execlpe", "execv", "execve", "execvp", "execvpe",
    "spawnl", "spawnle", "spawnlp", "spawnlpe", "spawnv", "spawnve", "spawnvp", "spawnvpe",
    "startfile", "abort", "plock",
)

def _guard():
    faulthandler.disable()
    os.environ["OMP_NUM_THREADS"] = "1"
    import posix, shutil, subprocess
    for mod in (os, posix):  # os.fork is posix.fork: null both names
        for name in _DISABLE_OS:
            if hasattr(mod, name):
                setattr(mod, name, None)
    for name in ("rmtree", "move", "chown"):
        setattr(shutil, name, None)
    for name in ("Popen", "run", "call", "check_call", "check_output", "getoutput", "getstatusoutput"):
        setattr(subprocess, name, None)
    builtins.exit = builtins.quit = builtins.help = None
    for name in ("ipdb", "joblib", "resource", "psutil", "tkinter", "multiprocessing", "pty",
                 "_posixsubprocess", "ctypes", "_ctypes"):
        sys.modules[name] = None  # makes `import name` raise ImportError

def _reason(exc):
    try:
        text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    except BaseException:  # a hostile __str__, or no memory left to format
        text = "exception"
    return " ".join(text.split())[:200]

def _stdin_to_devnull():
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)

def _main():
    write, exit_ = os.write, os._exit  # private references: the code may rebind os.*
    fd = int(sys.argv.pop(1))  # the result pipe; its number is not left in sys.argv
    os.set_inheritable(fd, False)
    payload = json.loads(sys.stdin.buffer.read())
    _stdin_to_devnull()  # input() in the code gets EOF instead of blocking
    pass_line = ("PASS " + payload.pop("token") + "\n").encode()
    program = payload.pop("program")
    _limits(**payload)
    _guard()
    try:
        code = compile(program, "<humaneval>", "exec")
        del program
        exec(code, {"__name__": "__main__"})
    except BaseException as exc:  # incl. SystemExit from sys.exit() and MemoryError
        try:
            write(fd, ("FAIL " + _reason(exc) + "\n").encode())
        finally:
            exit_(1)
    # Reached only when the program ran to the end, i.e. check(entry_point) returned.
    write(fd, pass_line)
    exit_(0)

_main()
'''


def build_program(problem: dict, completion: str) -> str:
    """The text the child executes: prompt + completion, the tests, and the call to check()."""
    return problem["prompt"] + completion + "\n" + problem["test"] + f"\ncheck({problem['entry_point']})"


def run_check(problem: dict, completion: str, timeout: float = 3.0, memory_mb: int = 512) -> dict:
    """Execute one completion against its problem's tests in a sandboxed child process.

    timeout: wall-clock seconds for the whole child (interpreter start included);
    memory_mb: its address-space limit. Returns {"passed": bool, "result": short reason}.
    """
    token = secrets.token_hex(16)
    payload = json.dumps({
        "token": token,
        "program": build_program(problem, completion),
        "memory_bytes": int(memory_mb) << 20,
        "cpu_s": math.ceil(timeout) + 1,  # backstop only; the wall clock below is the real limit
        "fsize_bytes": FSIZE_LIMIT_BYTES,
        "nproc": NPROC_LIMIT,
    }).encode()
    workdir = tempfile.mkdtemp(prefix="humaneval_")
    try:
        outcome = _run_child(payload, workdir, timeout)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    verdict = _verdict(token, *outcome)
    logger.debug("%s: %s", problem.get("task_id", "?"), verdict["result"])
    return verdict


def run_checks(items: Iterable[tuple[dict, str]], workers: int = 2, timeout: float = 3.0,
               memory_mb: int = 512, progress: bool = True) -> list[dict]:
    """run_check over (problem, completion) pairs in parallel; results in input order.

    Threads only wait on child processes, so a thread pool suffices (no GIL contention).
    """
    items = list(items)
    results: list[dict | None] = [None] * len(items)
    from tqdm.auto import tqdm

    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool, \
            tqdm(total=len(items), desc="executing", unit="sample", disable=not progress) as bar:
        futures = {pool.submit(run_check, p, c, timeout, memory_mb): i for i, (p, c) in enumerate(items)}
        for fut in as_completed(futures):
            results[futures[fut]] = fut.result()
            bar.update()
    return results


def _child_env(workdir: str) -> dict:
    """A minimal environment: nothing of the harness's (tokens, paths) leaks into the child."""
    return {"PATH": os.defpath, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8", "OMP_NUM_THREADS": "1"}


def _run_child(payload: bytes, workdir: str, timeout: float) -> tuple[int, bool, bytes, str]:
    """Start the child, feed it the payload, enforce the wall clock; (returncode, timed_out, report, stderr)."""
    read_fd, write_fd = os.pipe()
    try:
        # stderr goes to an unnamed file, not a pipe, so a chatty child cannot fill our memory:
        # its writes there count against its RLIMIT_FSIZE.
        with tempfile.TemporaryFile() as err:
            try:
                proc = subprocess.Popen(
                    [sys.executable, "-I", "-c", _CHILD, str(write_fd)],
                    stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=err,
                    pass_fds=(write_fd,), cwd=workdir, env=_child_env(workdir),
                    start_new_session=True, close_fds=True)
            finally:
                os.close(write_fd)  # only the child holds the write end: EOF once its group is gone
            timed_out = False
            try:
                proc.communicate(payload, timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(proc.pid)  # on timeout, and to reap anything the code left behind
                proc.wait()
            report = _read_report(read_fd)
            err.seek(0)
            stderr = err.read(64 << 10).decode(errors="replace")
    finally:
        os.close(read_fd)
    return proc.returncode, timed_out, report, stderr


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # the group is already empty


def _read_report(fd: int, limit: int = 4096) -> bytes:
    """What the child wrote to the result pipe, without ever blocking on it."""
    os.set_blocking(fd, False)
    data = b""
    while len(data) < limit:
        try:
            chunk = os.read(fd, limit - len(data))
        except BlockingIOError:
            break
        if not chunk:
            break
        data += chunk
    return data


_SIGNAL_HINTS = {
    signal.SIGKILL: "killed (SIGKILL)",
    signal.SIGXCPU: "CPU time limit exceeded (SIGXCPU)",
    signal.SIGXFSZ: "file size limit exceeded (SIGXFSZ)",
}


def _verdict(token: str, returncode: int, timed_out: bool, report: bytes, stderr: str) -> dict:
    """Pass iff exit status 0 AND the result pipe holds exactly the wrapper's PASS line."""
    if timed_out:
        return _fail("timed out")
    if returncode == 0 and report == f"PASS {token}\n".encode():
        return {"passed": True, "result": "passed"}
    text = report.decode(errors="replace")
    if text.startswith("FAIL ") and returncode == 1:
        return _fail("failed: " + text[5:].splitlines()[0] if text[5:].strip() else "failed")
    if report:
        return _fail(f"invalid result report (exit code {returncode})")
    if returncode < 0:
        sig = -returncode
        return _fail(_SIGNAL_HINTS.get(sig) or f"died with signal {_signal_name(sig)}")
    if returncode == 0:
        return _fail("exited before check() completed (exit code 0)")
    tail = stderr.strip().splitlines()[-1:] or [""]
    return _fail(f"exit code {returncode}" + (f": {tail[0]}" if tail[0] else ""))


def _signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return str(sig)


def _fail(reason: str) -> dict:
    return {"passed": False, "result": reason[:_REASON_CHARS]}
