"""Run model-written Python in a fresh, resource-limited interpreter.

The tool-use environment (``tool_env.py``) hands every ``<code>`` block to
``run_code``. The code runs in a *new* interpreter (``python -I -S`` started
with ``subprocess``; never a fork of the JAX process, whose threads and device
handles must not be duplicated) inside layers of containment:

1. Resource limits set by the child before user code runs: RLIMIT_CPU (soft
   limit -> SIGXCPU, hard limit one second later -> SIGKILL), RLIMIT_AS
   (allocation failures become ``MemoryError``), RLIMIT_FSIZE (stdout and stderr
   go to files, so this also caps output; exceeding it -> SIGXFSZ), RLIMIT_NPROC
   (no new processes or threads), RLIMIT_NOFILE and RLIMIT_CORE = 0, plus a
   wall-clock deadline enforced by the parent (``sleep`` uses no CPU).
2. A restricted Python: a ``sys.addaudithook`` hook installed before user code
   blocks imports outside a pre-imported allow-list (no ``subprocess``,
   ``socket``, ``ctypes``, ``multiprocessing``, ``resource``, ``signal``...),
   process creation (``os.system``, ``os.fork``, ``os.exec*``,
   ``os.posix_spawn``, ``subprocess.Popen``), signals to other processes, and
   any ``open``/listing/removal/rename of paths outside the scratch directory.
3. Operating-system isolation when the host allows it: a new network namespace
   (``unshare -n``: only a downed loopback, so no network even if the hook were
   bypassed) and, when running as root, dropping to uid/gid ``nobody`` before
   user code (so RLIMIT_NPROC is enforced - root ignores it - and file
   permissions apply).

The working directory is a fresh temporary directory, removed afterwards.
Audit hooks are not a security boundary on their own (CPython documents them
as such); see docs/tool_use.md for what this does and does not stop.

``run_code`` never raises on model input: every outcome is a ``SandboxResult``
whose ``kind`` is one of ``ok | timeout | memory | output_limit | forbidden |
exception``.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Sequence

KINDS = ("ok", "timeout", "memory", "output_limit", "forbidden", "exception")

# Exit statuses the child preamble uses to report how user code ended.
_EXIT_EXCEPTION = 1
_EXIT_FORBIDDEN = 86
_EXIT_MEMORY = 87
_EXIT_OUTPUT = 88
_NOBODY = 65534

# Modules user code may import. They are imported by the preamble *before* the
# audit hook is installed and before privileges are dropped (the interpreter
# may live under a directory uid nobody cannot read); any import of a module
# not already loaded is then refused.
ALLOWED_MODULES = (
  "array",
  "bisect",
  "cmath",
  "collections",
  "copy",
  "datetime",
  "decimal",
  "enum",
  "fractions",
  "functools",
  "heapq",
  "itertools",
  "json",
  "math",
  "numbers",
  "operator",
  "random",
  "re",
  "statistics",
  "string",
  "textwrap",
  "unicodedata",
)


@dataclasses.dataclass(frozen=True)
class SandboxConfig:
  """Limits for one execution.

  Attributes:
    cpu_seconds: RLIMIT_CPU soft limit (integer seconds; the hard limit, which
      SIGKILLs, is one second above).
    wall_seconds: wall-clock deadline after which the parent kills the process
      group (covers ``sleep`` and blocking reads, which use no CPU).
    memory_bytes: RLIMIT_AS (virtual address space; the interpreter itself
      needs ~30 MB).
    output_bytes: RLIMIT_FSIZE: cap on stdout, on stderr and on any file the
      code writes in its scratch directory; writing past it ends the run with
      kind ``output_limit``.
    max_code_bytes: UTF-8 size above which code is refused without running
      (kind ``forbidden``).
    max_processes: RLIMIT_NPROC (1 = the interpreter itself, no fork, no
      threads). Only enforced for non-root users, hence the uid drop.
    max_open_files: RLIMIT_NOFILE.
    network: "auto" (new network namespace when ``unshare -n`` works here,
      else audit hook only), "netns" (require it; ValueError if unavailable),
      or "audit" (audit hook only).
    drop_privileges: when the parent runs as root, switch the child to
      uid/gid 65534 (nobody) before user code.
    audit_hooks: install the restricted-Python hook. Tests set False to check
      the outer OS layers alone; never turn it off for model code.
    python: interpreter to start (default: this one).
  """

  cpu_seconds: int = 2
  wall_seconds: float = 5.0
  memory_bytes: int = 512 * 2**20
  output_bytes: int = 64 * 2**10
  max_code_bytes: int = 256 * 2**10
  max_processes: int = 1
  max_open_files: int = 64
  network: str = "auto"
  drop_privileges: bool = True
  audit_hooks: bool = True
  python: str = sys.executable

  def __post_init__(self):
    if not (isinstance(self.cpu_seconds, int) and self.cpu_seconds >= 1):
      raise ValueError(f"cpu_seconds must be an int >= 1, got {self.cpu_seconds!r}")
    if not self.wall_seconds > 0:
      raise ValueError(f"wall_seconds must be > 0, got {self.wall_seconds!r}")
    if self.memory_bytes < 64 * 2**20:
      raise ValueError(
        f"memory_bytes={self.memory_bytes} is below the ~64 MiB the interpreter needs to start; raise it"
      )
    for name in ("output_bytes", "max_code_bytes", "max_processes", "max_open_files"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
    if self.network not in ("auto", "netns", "audit"):
      raise ValueError(f"network must be 'auto', 'netns' or 'audit', got {self.network!r}")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
  """Outcome of one execution.

  Attributes:
    stdout, stderr: decoded output (UTF-8, invalid bytes replaced), each cut
      to ``output_bytes``.
    kind: one of ``KINDS``.
    exit_code: the child's status (negative = killed by that signal; None if
      the code never ran).
    wall_time: seconds from spawn to exit.
    message: one line for the model explaining a non-ok ``kind``.
  """

  stdout: str
  stderr: str
  kind: str
  exit_code: int | None
  wall_time: float
  message: str = ""

  @property
  def ok(self) -> bool:
    return self.kind == "ok"


# --------------------------------------------------------------------------
# Child preamble. Runs in the fresh interpreter; argv[1] is a JSON dict of
# settings. Order matters: read the code, import the allow-list, set limits,
# drop privileges, then install the hook (after which nothing new is imported).
_PREAMBLE = r'''
import sys, os, json, posix
cfg = json.loads(sys.argv[1])
with open(cfg["code_path"], "rb") as f:
    source = f.read().decode("utf-8", "replace")
import resource
for _m in cfg["allowed_modules"]:
    __import__(_m)
os.chdir(cfg["workdir"])
for _r, _soft, _hard in [
    (resource.RLIMIT_CPU, cfg["cpu"], cfg["cpu"] + 1),
    (resource.RLIMIT_AS, cfg["mem"], cfg["mem"]),
    (resource.RLIMIT_FSIZE, cfg["fsize"], cfg["fsize"]),
    (resource.RLIMIT_NPROC, cfg["nproc"], cfg["nproc"]),
    (resource.RLIMIT_NOFILE, cfg["nofile"], cfg["nofile"]),
    (resource.RLIMIT_CORE, 0, 0),
]:
    resource.setrlimit(_r, (_soft, _hard))
if cfg["uid"] is not None:
    os.setgroups([])
    os.setgid(cfg["uid"])
    os.setuid(cfg["uid"])


def _make_hook(work, allowed, violations, stderr_write):
    # Everything the hook uses is bound here (builtins and C functions), so user
    # code cannot disable it by rebinding module globals, os.path or builtins.
    blocked = frozenset({
        "os.system", "os.posix_spawn", "os.fork", "os.forkpty", "subprocess.Popen",
        "os.kill", "os.killpg", "os.symlink", "os.link", "os.chmod", "os.chown",
        "os.chflags", "os.lchflags", "os.putenv", "os.unsetenv", "os.setxattr",
        "os.removexattr", "sys.addaudithook", "resource.setrlimit", "resource.prlimit",
        "pty.spawn", "syslog.openlog", "webbrowser.open",
    })
    blocked_prefixes = ("socket.", "ctypes.", "os.exec", "os.spawn", "_posixshmem.",
                        "mmap.", "winreg.", "sqlite3.")
    path_events = frozenset({
        "os.listdir", "os.scandir", "os.remove", "os.rmdir", "os.mkdir", "os.rename",
        "os.truncate", "os.utime", "os.chdir", "shutil.rmtree", "shutil.copyfile",
        "shutil.copytree", "shutil.move", "shutil.chown", "glob.glob", "os.walk",
    })
    getcwd, fspath = posix.getcwd, posix.fspath
    _str, _bytes, _int, _isinstance, _repr = str, bytes, int, isinstance, repr

    def inside(p):
        # Lexical check (no symlink resolution): symlink/link creation is
        # blocked, so the scratch directory holds no links to follow.
        if p is None or _isinstance(p, _int):
            return True  # the current directory / an already-open descriptor
        try:
            p = fspath(p)
        except BaseException:
            return False
        if _isinstance(p, _bytes):
            p = p.decode("utf-8", "surrogateescape")
        if not _isinstance(p, _str) or "\x00" in p:
            return False
        if not p.startswith("/"):
            p = getcwd() + "/" + p
        parts = []
        for part in p.split("/"):
            if part == "..":
                if parts:
                    parts.pop()
            elif part and part != ".":
                parts.append(part)
        rp = "/" + "/".join(parts)
        return rp == work or rp.startswith(work + "/")

    def deny(event, args):
        violations.append(event)
        try:
            stderr_write("SandboxViolation: %s %s\n" % (event, _repr(args[:2])[:200]))
        except BaseException:
            pass
        raise RuntimeError("SandboxViolation: %s is not allowed in the sandbox" % event)

    def hook(event, args):
        if event == "import":
            if args[0].split(".")[0] not in allowed:
                deny(event, args)
        elif event in blocked or event.startswith(blocked_prefixes):
            deny(event, args)
        elif event == "open":
            if not inside(args[0]):
                deny(event, args)
        elif event in path_events:
            for a in args:
                if _isinstance(a, (_str, _bytes)) and not inside(a):
                    deny(event, args)

    return hook


def _format_exception(e, tb, lines):
    # Hand-rolled so that printing needs no file access (traceback/linecache
    # would open stdlib sources, which the hook refuses).
    out = ["Traceback (most recent call last):\n"]
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_filename != "<code>":  # library and sandbox frames: noise
            tb = tb.tb_next
            continue
        out.append('  File "%s", line %d, in %s\n' % (code.co_filename, tb.tb_lineno, code.co_name))
        if code.co_filename == "<code>" and 0 < tb.tb_lineno <= len(lines):
            out.append("    %s\n" % lines[tb.tb_lineno - 1].strip()[:200])
        tb = tb.tb_next
    try:
        msg = str(e)
    except BaseException:
        msg = "<unprintable>"
    out.append("%s: %s\n" % (type(e).__name__, msg) if msg else "%s\n" % type(e).__name__)
    return "".join(out)


def _main(source, cfg):
    violations = []
    if cfg["audit"]:
        sys.addaudithook(_make_hook(os.path.realpath(cfg["workdir"]),
                                    frozenset(cfg["allowed_modules"]), violations,
                                    sys.stderr.write))
        # Fresh path finders would have to list stdlib directories (refused).
        sys.path_importer_cache.clear()
    stdout, stderr, lines = sys.stdout, sys.stderr, source.splitlines()
    status = 0
    try:
        exec(compile(source, "<code>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
    except SystemExit as e:
        status = 0 if e.code is None else (e.code if isinstance(e.code, int) else 1)
    except MemoryError:
        status = 87
    except OSError as e:
        # Python ignores SIGXFSZ, so RLIMIT_FSIZE surfaces as EFBIG.
        status = 88 if e.errno == 27 else 1
        try:
            stderr.write(_format_exception(e, e.__traceback__.tb_next, lines))
        except BaseException:
            pass
    except BaseException as e:
        status = 1
        try:
            stderr.write(_format_exception(e, e.__traceback__.tb_next, lines))
        except BaseException:
            pass
    if status == 87:
        try:
            stderr.write("MemoryError: memory limit exceeded\n")
        except BaseException:
            pass
    if violations:
        status = 86
    for s in (stdout, stderr):
        try:
            s.flush()
        except BaseException:
            pass
    os._exit(status)


sys.stdin = None
_main(source, cfg)
'''


@functools.lru_cache(maxsize=None)
def netns_available(python: str = sys.executable) -> bool:
  """Whether ``unshare -n`` can start ``python`` here (root or user namespaces)."""
  unshare = shutil.which("unshare")
  if unshare is None:
    return False
  try:
    r = subprocess.run(
      [unshare, "-n", python, "-I", "-S", "-c", "pass"], stdin=subprocess.DEVNULL, capture_output=True, timeout=10
    )
  except (OSError, subprocess.TimeoutExpired):
    return False
  return r.returncode == 0


def _use_netns(cfg: SandboxConfig) -> bool:
  if cfg.network == "audit":
    return False
  available = netns_available(cfg.python)
  if cfg.network == "netns" and not available:
    raise ValueError(
      "SandboxConfig.network='netns' but `unshare -n` does not work on this host "
      "(needs root or unprivileged user namespaces); use network='auto' or 'audit'"
    )
  return available


def _read_capped(path: str, limit: int) -> tuple[str, bool]:
  """Reads at most ``limit`` bytes; returns (text, was_longer)."""
  with open(path, "rb") as f:
    data = f.read(limit + 1)
  # Writes stop at RLIMIT_FSIZE == limit, so a full file means output was cut.
  return data[:limit].decode("utf-8", "replace"), len(data) >= limit


def run_code(code: str, cfg: SandboxConfig = SandboxConfig()) -> SandboxResult:
  """Executes ``code`` in a fresh sandboxed interpreter and reports the outcome.

  Never raises on model input (any ``str``, including NUL bytes, lone
  surrogates or megabytes of text); raises only on host failures such as a
  missing interpreter.
  """
  if not isinstance(code, str):
    raise ValueError(f"code must be str, got {type(code).__name__}")
  payload = code.encode("utf-8", "replace")
  if len(payload) > cfg.max_code_bytes:
    return SandboxResult(
      "", "", "forbidden", None, 0.0, f"code is {len(payload)} bytes; the limit is {cfg.max_code_bytes}"
    )
  netns = _use_netns(cfg)
  as_nobody = cfg.drop_privileges and os.geteuid() == 0
  root = tempfile.mkdtemp(prefix="vcpo_sandbox_")
  try:
    workdir = os.path.join(root, "work")
    os.mkdir(workdir, 0o700)
    if as_nobody:
      # nobody must traverse root/ to reach work/ but not list it (it holds
      # the code and output files, opened by the parent / before the drop).
      os.chmod(root, 0o711)
      os.chown(workdir, _NOBODY, _NOBODY)
    code_path = os.path.join(root, "code.py")
    with open(code_path, "wb") as f:
      f.write(payload)
    settings = dict(
      code_path=code_path,
      workdir=workdir,
      cpu=cfg.cpu_seconds,
      mem=cfg.memory_bytes,
      fsize=cfg.output_bytes,
      nproc=cfg.max_processes,
      nofile=cfg.max_open_files,
      uid=_NOBODY if as_nobody else None,
      audit=cfg.audit_hooks,
      allowed_modules=list(ALLOWED_MODULES),
    )
    argv = [cfg.python, "-I", "-S", "-c", _PREAMBLE, json.dumps(settings)]
    if netns:
      argv = [shutil.which("unshare"), "-n"] + argv
    out_path, err_path = os.path.join(root, "stdout"), os.path.join(root, "stderr")
    env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8", "HOME": workdir}
    with open(out_path, "wb") as out_f, open(err_path, "wb") as err_f:
      t0 = time.monotonic()
      # start_new_session: the child leads its own process group, so one
      # killpg reaches anything it might have spawned.
      proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=out_f,
        stderr=err_f,
        cwd=workdir,
        env=env,
        start_new_session=True,
        close_fds=True,
      )
      wall_killed = False
      try:
        proc.wait(timeout=cfg.wall_seconds)
      except subprocess.TimeoutExpired:
        wall_killed = True
      _kill_group(proc.pid)
      rc = proc.wait()
      wall = time.monotonic() - t0
    stdout, out_long = _read_capped(out_path, cfg.output_bytes)
    stderr, err_long = _read_capped(err_path, cfg.output_bytes)
  finally:
    shutil.rmtree(root, ignore_errors=True)
  kind, message = _classify(rc, wall_killed, out_long or err_long, cfg)
  return SandboxResult(stdout, stderr, kind, rc, wall, message)


def _kill_group(pgid: int) -> None:
  try:
    os.killpg(pgid, signal.SIGKILL)
  except (ProcessLookupError, PermissionError):
    pass  # already gone


def _classify(rc: int, wall_killed: bool, too_long: bool, cfg: SandboxConfig) -> tuple[str, str]:
  if wall_killed:
    return "timeout", f"wall-clock limit of {cfg.wall_seconds:g} s exceeded"
  if rc in (-signal.SIGXCPU, -signal.SIGKILL):
    return "timeout", f"CPU-time limit of {cfg.cpu_seconds} s exceeded"
  if rc in (-signal.SIGXFSZ, _EXIT_OUTPUT) or too_long:
    return "output_limit", f"output limit of {cfg.output_bytes} bytes exceeded"
  if rc == _EXIT_MEMORY:
    return "memory", f"memory limit of {cfg.memory_bytes // 2**20} MiB exceeded"
  if rc == _EXIT_FORBIDDEN:
    return "forbidden", "operation not allowed in the sandbox"
  if rc == 0:
    return "ok", ""
  if rc < 0:
    try:
      name = signal.Signals(-rc).name
    except ValueError:
      name = str(-rc)
    return "exception", f"killed by signal {name}"
  return "exception", f"exited with status {rc}"


def run_many(
  codes: Sequence[str], cfg: SandboxConfig = SandboxConfig(), max_workers: int | None = None
) -> list[SandboxResult]:
  """``run_code`` over many snippets concurrently (threads only wait on children)."""
  if not codes:
    return []
  workers = max_workers or min(len(codes), os.cpu_count() or 1)
  with concurrent.futures.ThreadPoolExecutor(workers) as pool:
    return list(pool.map(lambda c: run_code(c, cfg), codes))
