"""Tests for vcpo_jax.tasks.sandbox: every adversarial snippet is contained.

Limits are short (1 s CPU) so the whole file runs in a few seconds. Each test
also checks the side effect did not happen, not just the reported kind.
"""

import os
import signal

import hypothesis
import hypothesis.strategies as st
import pytest

from vcpo_jax.tasks import sandbox
from vcpo_jax.tasks.sandbox import KINDS, SandboxConfig, run_code, run_many

CFG = SandboxConfig(cpu_seconds=1, wall_seconds=3.0, output_bytes=4096)


def test_ok_output_and_allowed_imports():
  r = run_code(
    "import math, fractions, statistics\nprint(math.comb(10, 3), fractions.Fraction(6, 4), statistics.mean([1, 2, 6]))",
    CFG,
  )
  assert (r.kind, r.exit_code, r.stdout, r.stderr) == ("ok", 0, "120 3/2 3\n", "")


def test_exception_reports_user_line():
  r = run_code("x = 1\ny = x / 0\n", CFG)
  assert r.kind == "exception" and r.exit_code == 1
  assert "ZeroDivisionError" in r.stderr and "y = x / 0" in r.stderr
  # Sandbox internals are not shown to the model.
  assert "<string>" not in r.stderr


def test_sys_exit_status():
  assert run_code("import sys; sys.exit(0)", CFG).kind == "ok"
  r = run_code("import sys; sys.exit(3)", CFG)
  assert (r.kind, r.exit_code) == ("exception", 3)


@pytest.mark.slow
def test_infinite_loop_hits_cpu_limit():
  r = run_code("while True:\n    pass\n", CFG)
  assert r.kind == "timeout"
  assert r.exit_code in (-signal.SIGXCPU, -signal.SIGKILL)


def test_sleep_hits_wall_limit():
  r = run_code("import time\ntime.sleep(30)", SandboxConfig(cpu_seconds=1, wall_seconds=0.5))
  assert r.kind == "timeout" and "wall-clock" in r.message


def test_fork_bomb_is_refused():
  r = run_code("import os\nwhile True:\n    os.fork()\n", CFG)
  assert r.kind == "forbidden" and "os.fork" in r.stderr
  for code in ("import multiprocessing", "import threading", "import _thread\n_thread.start_new_thread(print, ())"):
    assert run_code(code, CFG).kind in ("forbidden", "exception"), code


def test_huge_output_is_cut():
  r = run_code("while True:\n    print('x' * 1000)\n", CFG)
  assert r.kind == "output_limit"
  assert len(r.stdout) == CFG.output_bytes and set(r.stdout) <= {"x", "\n"}


def test_memory_limit():
  r = run_code("x = bytearray(10**10)", CFG)
  assert r.kind == "memory" and "memory limit" in r.message


def test_os_and_subprocess_usage_refused(tmp_path):
  marker = tmp_path / "marker"
  for code in (
    f"import os\nos.system('touch {marker}')",
    f"import subprocess\nsubprocess.run(['touch', '{marker}'])",
    f"import os\nos.execv('/usr/bin/touch', ['touch', '{marker}'])",
    f"import os\nos.posix_spawn('/usr/bin/touch', ['touch', '{marker}'], {{}})",
  ):
    r = run_code(code, CFG)
    assert r.kind == "forbidden", (code, r)
  assert not marker.exists()


def test_reading_etc_passwd_refused():
  for code in (
    "print(open('/etc/passwd').read())",
    "import os\nos.chdir('/etc')",
    "print(open('../../../../../../etc/passwd').read())",
    "import os\nprint(os.listdir('/'))",
  ):
    r = run_code(code, CFG)
    assert r.kind == "forbidden", (code, r)
    assert "root:" not in r.stdout


def test_rebinding_builtins_does_not_disable_hook():
  # The hook binds its own primitives; user rebinding of globals is harmless.
  code = (
    "import builtins, os\n"
    "builtins.isinstance = lambda *a: True\n"
    "os.path.realpath = lambda p: os.getcwd()\n"
    "print(open('/etc/passwd').read())"
  )
  r = run_code(code, CFG)
  assert r.kind == "forbidden" and "root:" not in r.stdout


def test_writes_confined_to_scratch_dir(tmp_path):
  outside = tmp_path / "escape.txt"
  r = run_code(f"open({str(outside)!r}, 'w').write('x')", CFG)
  assert r.kind == "forbidden" and not outside.exists()
  r = run_code("open('../escape.txt', 'w').write('x')", CFG)
  assert r.kind == "forbidden"
  # Inside the scratch directory files work, and the directory is removed after.
  r = run_code(
    "import os\nopen('a.txt', 'w').write('hi')\nprint(open('a.txt').read(), os.listdir('.'), os.getcwd())", CFG
  )
  assert r.kind == "ok" and r.stdout.startswith("hi ['a.txt'] ")
  scratch = r.stdout.split()[-1]
  assert not os.path.exists(scratch)


def test_file_size_limit_applies_to_scratch_files():
  r = run_code("open('big', 'w').write('x' * 10**6)", CFG)
  assert r.kind == "output_limit"


def test_socket_refused():
  r = run_code("import socket\ns = socket.socket()\ns.connect(('1.1.1.1', 80))", CFG)
  assert r.kind == "forbidden"


def test_very_long_input():
  code = "x = 1\n" * 200_000  # 1.2 MB
  r = run_code(code, CFG)
  assert r.kind == "forbidden" and r.exit_code is None and "limit" in r.message
  big = SandboxConfig(cpu_seconds=2, wall_seconds=10.0, max_code_bytes=2 * 2**20)
  r = run_code(code + "print(x)", big)
  assert (r.kind, r.stdout) == ("ok", "1\n")
  # Pathological nesting is a compile error, not a crash of the caller.
  r = run_code("print(" + "(" * 100_000 + ")" * 100_000 + ")", big)
  assert r.kind == "exception"


def test_run_many_keeps_order():
  rs = run_many([f"print({i} * {i})" for i in range(5)] + ["while True: pass"], CFG, max_workers=3)
  assert [r.stdout for r in rs[:5]] == [f"{i * i}\n" for i in range(5)]
  assert rs[5].kind == "timeout"
  assert run_many([], CFG) == []


@hypothesis.settings(max_examples=12, deadline=None)
@hypothesis.given(st.text(max_size=200))
@pytest.mark.slow
def test_arbitrary_text_never_raises(code):
  r = run_code(code, CFG)
  assert r.kind in KINDS


def test_config_validation():
  with pytest.raises(ValueError, match="cpu_seconds"):
    SandboxConfig(cpu_seconds=0)
  with pytest.raises(ValueError, match="network"):
    SandboxConfig(network="vpn")
  with pytest.raises(ValueError, match="memory_bytes"):
    SandboxConfig(memory_bytes=2**20)
  with pytest.raises(ValueError, match="code must be str"):
    run_code(b"print(1)", CFG)


# ---- The operating-system layers alone (hook off); need root / namespaces. ----


@pytest.mark.skipif(os.geteuid() != 0, reason="uid drop (and so RLIMIT_NPROC) needs root")
def test_nproc_limit_stops_fork_without_hook():
  raw = SandboxConfig(cpu_seconds=1, wall_seconds=3.0, audit_hooks=False)
  r = run_code("import os\nfor _ in range(100):\n    os.fork()\n", raw)
  assert r.kind == "exception" and "BlockingIOError" in r.stderr
  r = run_code("open('/etc/passwd', 'a')", raw)  # uid nobody: permission denied
  assert "PermissionError" in r.stderr


@pytest.mark.skipif(not sandbox.netns_available(), reason="`unshare -n` unavailable here")
def test_network_namespace_has_no_route_without_hook():
  # drop_privileges=False so the (root-readable) socket module can be imported.
  raw = SandboxConfig(cpu_seconds=1, wall_seconds=3.0, audit_hooks=False, drop_privileges=False, network="netns")
  r = run_code(
    "import socket\ns = socket.socket()\ns.settimeout(1)\n"
    "try:\n    s.connect(('1.1.1.1', 80))\nexcept OSError as e:\n    print(type(e).__name__, e.errno)\n",
    raw,
  )
  assert r.kind == "ok" and r.stdout.startswith("OSError 101"), r  # ENETUNREACH
