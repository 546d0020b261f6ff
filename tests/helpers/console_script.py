"""Running the venv's ``lightalign`` console script from the tests: ``run(repo, *args, **env)`` ->
``subprocess.CompletedProcess`` (text ``stdout``/``stderr``, the exit status in ``returncode``).

Every call is a new process running the console script's entry point (``lightalign.cli:main``) with the given
arguments, working directory and environment: its exit status, standard output and standard error are the
process's own. What costs most in such a process is importing torch, Lightning and transformers (several seconds of
CPU each time, about half of the suite's console-script time). So the calls whose environment is the tests' standard
one (``standard_env()``) are forked from a *console server*: a process that imported those libraries once, with that
environment, and forks a child per call. The child then does what the installed script does — ``sys.argv`` is the
script's, ``sys.path[0]`` its folder, lightalign itself is imported fresh in the child — and exits through the
interpreter's own handling of ``sys.exit(main())`` (atexit handlers, the traceback and status 1 of an uncaught
exception). Whatever the libraries printed while the server imported them is written again at the start of each
child's output, so a warning a user would see is still in the output the tests check.

Calls with another environment (a variable removed or added: ``HF_HUB_OFFLINE`` and the like are read at import
time; W&B's ``WANDB_*`` are the exception, read only when a run starts) run the real script as an ordinary subprocess, as does ``run(..., real=True)``; tests/cli/test_console.py checks
that both ways give the same status and output. ``PYTHONPATH`` entries added in front of the standard ones (what
``tests_env()`` adds: tests/) are no other environment: such a call is forked too, the entries put on ``sys.path``. ``start(repo, *args)`` forks a call without waiting for it, in a
session of its own (a test that kills a run mid-way: ``os.killpg(started.pid, signal.SIGKILL)``, then
``started.wait()``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

LIGHTALIGN = Path(sys.executable).with_name("lightalign")  # the venv's console script
# Imported once by the console server: the libraries every run imports, and the model code of the shipped tiny model
# (which, with deepspeed installed as in the dev venv, imports deepspeed and mlflow through transformers).
PRELOAD = ("torch", "lightning.pytorch", "lightning.pytorch.cli", "jsonargparse", "torchmetrics", "datasets",
           "safetensors.torch", "huggingface_hub", "tokenizers", "transformers", "transformers.modeling_utils",
           "transformers.generation.utils", "transformers.models.qwen2.modeling_qwen2")
# Imported by every run that exports (transformers' save_pretrained unwraps the model through accelerate, which
# imports DeepSpeed when it is installed, as in the dev venv, and DeepSpeed imports MLflow): about 2 s of CPU per run.
# Its import prints only what the console script drops (lightalign/quiet.py: DeepSpeed's "Setting accelerator to
# CPU"), so the server imports it after the preamble was read; if it printed anything else, the server starts again
# without it (the children then import it as the script does).
QUIET_PRELOAD = ("deepspeed",)
_NOT_INHERITED = ("LIGHTALIGN_DEBUG", "PYTEST_CURRENT_TEST")  # pytest sets the second per test; the script ignores it
# The test process's environment as the tests started (tests/conftest.py imports this module first thing). Tests that
# train in-process change os.environ as they go (Lightning's seed_everything sets PL_GLOBAL_SEED, inductor its cache
# folder): a user's shell has none of that, and a drifting environment would also stop matching the console server's.
_START_ENV = dict(os.environ)


def standard_env(**extra: str) -> dict[str, str]:
    """The environment console-script tests run with: the tests' own at start, offline, minus ``LIGHTALIGN_DEBUG``."""
    env = {k: v for k, v in _START_ENV.items() if k not in _NOT_INHERITED}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.update(extra)
    return env


def run(repo: Path | str, *args: str, env: dict[str, str] | None = None, timeout: float = 900,
        real: bool = False) -> subprocess.CompletedProcess:
    """``lightalign *args`` in ``repo`` with ``env`` (default ``standard_env()``)."""
    env = standard_env() if env is None else env
    argv = [str(LIGHTALIGN), *map(str, args)]
    server = None if real or os.name != "posix" else _server_for(env)
    if server is None:
        return subprocess.run(argv, cwd=repo, env=env, capture_output=True, text=True, timeout=timeout)
    return server.run(argv, str(repo), env, timeout)


def start(repo: Path | str, *args: str) -> Started:
    """``lightalign *args`` in ``repo`` with ``standard_env()``, forked from the console server into a session of its
    own (``os.killpg(started.pid, ...)`` kills all of it) without waiting: ``started.poll()``, ``started.wait()``.
    The server runs nothing else until it was waited for."""
    env = standard_env()
    server = _server_for(env)
    if server is None or os.name != "posix":
        raise RuntimeError("the console server forks: POSIX systems only")
    return server.start([str(LIGHTALIGN), *map(str, args)], str(repo), env, session=True)


def run_python(script: Path | str, *args: str, cwd: Path | str | None = None, env: dict[str, str] | None = None,
               timeout: float = 900) -> subprocess.CompletedProcess:
    """``python script *args`` (a test's worker script), forked from the console server like ``run``: the child runs
    the file as ``__main__`` with ``sys.argv`` and ``sys.path[0]`` as ``python script`` sets them."""
    env = standard_env() if env is None else env
    argv = [sys.executable, str(script), *map(str, args)]
    cwd = str(cwd or os.getcwd())
    server = None if os.name != "posix" else _server_for(env)
    if server is None:
        return subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    return server.run(argv, cwd, env, timeout, script=str(script))


# The console server's program: import the libraries with stdout/stderr captured, then fork one child per request
# (a JSON line on stdin); answer {"pid"} at once and {"status"} when the child has exited (JSON lines on the
# original stdout, kept on a private descriptor).
SERVER = r"""
import json, os, sys, time
proto_in, proto_out = sys.stdin.buffer, os.fdopen(os.dup(1), "w", buffering=1)
captured = [os.open(p, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600) for p in sys.argv[1:3]]
os.dup2(captured[0], 1); os.dup2(captured[1], 2)
import importlib
for name in json.loads(sys.argv[3]):
    importlib.import_module(name)
sys.stdout.flush(); sys.stderr.flush()
preamble = []
for fd in captured:
    os.lseek(fd, 0, 0)
    preamble.append(os.read(fd, 1 << 24))
# the quiet preloads: their output must be only lines the console script drops
for fd in captured:
    os.ftruncate(fd, 0); os.lseek(fd, 0, 0)
for name in json.loads(sys.argv[4]):
    importlib.import_module(name)
sys.stdout.flush(); sys.stderr.flush()
dropped = json.loads(sys.argv[5])
for fd in captured:
    os.lseek(fd, 0, 0)
    for line in os.read(fd, 1 << 24).decode(errors="replace").splitlines():
        if line.strip() and not any(text in line for text in dropped):
            proto_out.write("printed: " + line + "\n"); os._exit(1)
    os.close(fd)
# Everything imported so far is shared with the children copy-on-write; the cyclic garbage collector of a child
# would still visit (and so copy) every one of those objects at each full collection and at the child's exit (about
# 2 s of CPU per call, two thirds of a refused run's cost). Frozen, they are outside the collector's reach: a child
# still exits through the interpreter's own shutdown, and only creates and collects its own objects.
import gc
gc.collect()
gc.freeze()
proto_out.write("ready\n")
request = None
while True:
    line = proto_in.readline()
    if not line:
        os._exit(0)
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        break
    while request["session"]:  # the pid is answered once the child leads its session: a kill of its group reaches it
        try:
            if os.getsid(pid) == pid:
                break
        except OSError:  # it died already
            break
        time.sleep(0.001)
    proto_out.write(json.dumps({"pid": pid}) + "\n")
    _, status = os.waitpid(pid, 0)
    proto_out.write(json.dumps({"status": os.waitstatus_to_exitcode(status)}) + "\n")
# The child: the console script's process from here on.
proto_out.close()
if request["session"]:
    os.setsid()  # a process group of its own, as subprocess's start_new_session: a kill takes all of it
null = os.open(os.devnull, os.O_RDONLY)
os.dup2(null, 0); os.close(null)
for fd, path, text in zip((1, 2), (request["stdout"], request["stderr"]), preamble):
    out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.write(out, text); os.dup2(out, fd); os.close(out)
os.chdir(request["cwd"])
os.environ.clear(); os.environ.update(request["env"])
script = request["script"]
sys.argv = request["argv"][1:] if script else request["argv"]
sys.path[0] = os.path.dirname(os.path.abspath(sys.argv[0]))
sys.path[1:1] = request["path"]  # PYTHONPATH entries the call puts before the server's, where the interpreter would
del json, os, importlib, gc, time, request, preamble, captured, proto_in, proto_out, dropped
if script:
    import runpy
    runpy.run_path(script, run_name="__main__")
else:
    from lightalign.cli import main
    sys.exit(main())
"""


class ConsoleServer:
    def __init__(self, env: dict[str, str]) -> None:
        from lightalign.quiet import DROPPED_RECORDS

        self.env = env
        self.dir = tempfile.mkdtemp(prefix="lightalign-console-")
        self.lock = threading.Lock()
        quiet = [m for m in QUIET_PRELOAD if importlib.util.find_spec(m) is not None]
        while True:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", SERVER, f"{self.dir}/import.out", f"{self.dir}/import.err", json.dumps(PRELOAD),
                 json.dumps(quiet), json.dumps([text for _, text in DROPPED_RECORDS])],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=self.env, cwd=self.dir, text=True, bufsize=1)
            answer = self._line(600)
            if answer is not None and answer.startswith("printed:") and quiet:
                # a quiet preload printed more than the console script drops (another DeepSpeed version): the
                # children import it themselves, as the script does
                self.proc.wait(30)
                quiet = []
                continue
            break
        if answer != "ready":
            raise RuntimeError(f"the console server did not start ({answer}): "
                               f"{Path(self.dir, 'import.err').read_text()[-3000:]}")
        self.quiet_preloaded = quiet
        self.calls = 0

    def _line(self, timeout: float) -> str | None:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        return self.proc.stdout.readline().strip() if ready else None

    def run(self, argv: list[str], cwd: str, env: dict[str, str], timeout: float,
            script: str | None = None) -> subprocess.CompletedProcess:
        return self.start(argv, cwd, env, script).wait(timeout)

    def start(self, argv: list[str], cwd: str, env: dict[str, str], script: str | None = None,
              session: bool = False) -> "Started":
        """Fork the child and return at once; the server serves no other call until it was waited for."""
        self.lock.acquire()
        try:
            self.calls += 1
            out, err = f"{self.dir}/{self.calls}.out", f"{self.dir}/{self.calls}.err"
            request = {"argv": argv, "script": script, "cwd": cwd, "env": env, "stdout": out, "stderr": err,
                       "session": session, "path": _path_prefix(env) or []}
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            return Started(self, argv, json.loads(self._line(60))["pid"], out, err)
        except BaseException:
            self.lock.release()
            raise


class Started:
    """A console-script process forked from the console server and not yet waited for: ``pid``, ``poll()`` (None
    while it runs, else its exit status) and ``wait(timeout)`` (its ``CompletedProcess``; kills it at the timeout).
    As a context manager, a process not waited for by the end of the block (a failed assertion) is killed and
    waited for, so the server serves the next call."""

    def __init__(self, server: ConsoleServer, argv: list[str], pid: int, out: str, err: str) -> None:
        self.server, self.argv, self.pid, self.paths, self.returncode = server, argv, pid, (out, err), None
        self.waited = False

    def __enter__(self) -> "Started":
        return self

    def __exit__(self, *exc) -> None:
        if not self.waited:
            if self.poll() is None:
                os.killpg(self.pid, signal.SIGKILL)
            self.wait(60)

    def poll(self) -> int | None:
        if self.returncode is None:
            answer = self.server._line(0)
            if answer is not None:
                self.returncode = json.loads(answer)["status"]
        return self.returncode

    def wait(self, timeout: float = 900) -> subprocess.CompletedProcess:
        assert not self.waited, "waited for already"
        self.waited = True
        try:
            if self.returncode is None:
                answer = self.server._line(timeout)
                if answer is None:
                    os.kill(self.pid, signal.SIGKILL)
                    self.server._line(60)
                    raise subprocess.TimeoutExpired(self.argv, timeout)
                self.returncode = json.loads(answer)["status"]
            texts = []
            for path in self.paths:
                if not os.path.exists(path):  # killed before it opened its output
                    texts.append("")
                    continue
                with open(path, encoding="utf-8", errors="replace", newline=None) as f:
                    texts.append(f.read())
                os.unlink(path)
            return subprocess.CompletedProcess(self.argv, self.returncode, *texts)
        finally:
            self.server.lock.release()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)


_SERVER: ConsoleServer | None = None


# Variables no preloaded library reads: W&B's are read by wandb (never imported by the server) and by Lightning's
# WandbLogger when it is built, so a call that adds them can still be forked (the child gets the call's environment).
_READ_AFTER_IMPORT = ("WANDB_",)


def _path_prefix(env: dict[str, str]) -> list[str] | None:
    """The entries ``env``'s ``PYTHONPATH`` puts before the standard environment's (``tests_env``: tests/), or None
    when it is not the standard one with entries in front. No preloaded library reads ``PYTHONPATH``: a child forked
    for such a call puts the entries on ``sys.path`` after the script's folder, as the interpreter does at start."""
    base, value = standard_env().get("PYTHONPATH", ""), env.get("PYTHONPATH", "")
    entries, tail = value.split(os.pathsep), base.split(os.pathsep) if base else []
    if not value or value == base or entries[len(entries) - len(tail):] != tail:
        return None
    prefix = entries[:len(entries) - len(tail)]
    return prefix if all(prefix) else None


def _as_imported(env: dict[str, str]) -> dict[str, str]:
    """``env`` as the preloaded libraries see it at import: without the variables only read later, and with the
    standard ``PYTHONPATH`` where ``env``'s only adds entries in front of it (``_path_prefix``)."""
    seen = {k: v for k, v in env.items() if not k.startswith(_READ_AFTER_IMPORT)}
    if _path_prefix(env):
        seen.pop("PYTHONPATH")
        if "PYTHONPATH" in standard_env():
            seen["PYTHONPATH"] = standard_env()["PYTHONPATH"]
    return seen


def _server_for(env: dict[str, str]) -> ConsoleServer | None:
    """The console server for calls with ``env`` (started on first use), or None when ``env`` is not the one it
    imported the libraries with (up to variables they read only later)."""
    global _SERVER
    if _SERVER is None or _SERVER.proc.poll() is not None:
        if _as_imported(env) != standard_env():
            return None
        _SERVER = ConsoleServer(standard_env())
    return _SERVER if _as_imported(env) == _SERVER.env else None


def expect(repo, *args: str, status: int = 0, **extra_env: str) -> str:
    """Run the console script and check its exit status; its stdout and stderr together."""
    proc = run(repo, *args, env=standard_env(**extra_env))
    out = proc.stdout + proc.stderr
    assert proc.returncode == status, f"exit {proc.returncode} (expected {status})\n{out[-6000:]}"
    return out


def tests_env() -> dict[str, str]:
    """``standard_env()`` with tests/ importable: a run that loads a test callback (tests/helpers/) by import path."""
    tests = str(Path(__file__).resolve().parents[1])
    return standard_env(PYTHONPATH=os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")])))


def error_line(out: str) -> str:
    """The one-line error the console script printed (the first line starting ``lightalign: error:``)."""
    lines = [line for line in out.splitlines() if line.startswith("lightalign: error:")]
    assert lines, out[-4000:]
    return lines[0]


def data_refusal(repo, *args: str) -> str:
    """The one error line of a run refused before it tokenized anything (exit 1, one ``lightalign: error:`` line,
    no traceback)."""
    out = expect(repo, *args, status=1)
    lines = [line for line in out.splitlines() if line.startswith("lightalign: error:")]
    assert len(lines) == 1 and "Traceback" not in out and "Tokenizing" not in out, out[-4000:]
    return lines[0]
