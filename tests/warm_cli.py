"""A warm `trainbook` for the tests: the command runs in a process forked from one that has
already imported it.

Every `trainbook` a test starts used to be a fresh interpreter spending ~6 s of CPU importing
torch, DCP, dynamo and the commands before doing anything; a suite runs a few hundred of them. A
server (one per pytest worker, `python -m tests.warm_cli`) imports all that once and forks a
child per command. The child is a real process running the CLI's own `main()` with the test's
arguments, working directory and environment, its stdout and stderr in files, its exit status
(a signal's included) what the test sees: nothing of the command is stood in for. What it skips
is the interpreter's start-up and the imports, which a command cannot observe except through
what is read at import time: the environment variables torch and the runtime read then (threads,
allocator, `PYTHON*`, ...). A command whose environment differs from the server's in any of
those, or one started while the server is busy, runs in a fresh interpreter as before, and so
does every command when `TRAINBOOK_TEST_FRESH_CLI=1`. Workers `torchrun` starts are always
fresh interpreters.

Protocol: one JSON line per request on the server's stdin ({"args", "cwd", "env", "timeout",
"stdout", "stderr"}), one JSON line back ({"returncode"} or {"timeout": true}).
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

PRELOAD = (
    "trainbook.cli", "trainbook.commands.run", "trainbook.train.build", "trainbook.train.trainer",
    "torch._dynamo", "torch.distributed.checkpoint", "torch.distributed.fsdp",
)
IMPORT_TIME = ("OMP_", "MKL_", "KMP_", "OPENBLAS_", "PYTHON", "TORCH", "LD_", "CUDA", "NCCL", "GLOO", "MALLOC")
"""Environment variables read when the interpreter and torch start: a command whose value of any
of these differs from the server's runs fresh."""
FRESH_ENV = "TRAINBOOK_TEST_FRESH_CLI"


def _import_time(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME)}


# ---- the server ------------------------------------------------------------------------------

def serve() -> None:
    requests = os.fdopen(os.dup(0), "r")
    replies = os.fdopen(os.dup(1), "w")
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0), os.dup2(null, 1)  # nothing the imports print reaches the protocol
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    replies.write(json.dumps({"ready": True}) + "\n")
    replies.flush()
    for line in requests:
        replies.write(json.dumps(_run(json.loads(line), requests, replies)) + "\n")
        replies.flush()


def _run(req: dict, *keep) -> dict:
    pid = os.fork()
    if pid == 0:
        _child(req, keep)
    deadline = time.monotonic() + req["timeout"]
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return {"returncode": os.waitstatus_to_exitcode(status)}
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return {"timeout": True}
        time.sleep(0.005)


def _child(req: dict, keep) -> None:
    code = 1
    try:
        for f in keep:
            f.close()
        null = os.open(os.devnull, os.O_RDONLY)
        out = os.open(req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        err = os.open(req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(null, 0), os.dup2(out, 1), os.dup2(err, 2)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        import trainbook
        from trainbook.cli import main

        sys.argv = [str(Path(trainbook.__file__).with_name("__main__.py")), *req["args"]]  # as `python -m trainbook`

        main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    finally:
        try:  # what the interpreter does on its way out: join threads, run atexit, collect, flush
            import atexit
            import gc

            threading._shutdown()
            atexit._run_exitfuncs()
            gc.collect()
            sys.stdout.flush(), sys.stderr.flush()
        finally:
            os._exit(code)


# ---- the client (run_cli) ---------------------------------------------------------------------

class WarmCli:
    """The server of this pytest worker, started on first use; `run` returns None when the
    command must run fresh (the module docstring says when)."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.env: dict[str, str] = {}
        self.lock = threading.Lock()
        self.broken = False

    def _start(self, env: dict[str, str]) -> bool:
        root = Path(__file__).resolve().parents[1]
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.warm_cli"], cwd=root, env=env, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.env = _import_time(env)
        ready, _, _ = select.select([self.proc.stdout], [], [], 120)
        if not ready or not self.proc.stdout.readline():
            self.proc.kill()
            self.broken = True
        return not self.broken

    def run(self, args: list[str], cwd: Path | None, env: dict[str, str], timeout: float, tmp: Path):
        if self.broken or env.get(FRESH_ENV) == "1" or not self.lock.acquire(blocking=False):
            return None
        try:
            if self.proc is None and not self._start({**os.environ, "PYTHONUNBUFFERED": "1"}):
                return None
            if _import_time(env) != self.env or self.proc.poll() is not None:
                return None
            out, err = tmp / "stdout", tmp / "stderr"
            req = {"args": list(args), "cwd": str(cwd or os.getcwd()), "env": env, "timeout": timeout,
                   "stdout": str(out), "stderr": str(err)}
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
            reply = json.loads(self.proc.stdout.readline())
            stdout, stderr = (p.read_text(errors="replace") for p in (out, err))
            cmd = [sys.executable, "-m", "trainbook", *args]
            if reply.get("timeout"):
                raise subprocess.TimeoutExpired(cmd, timeout, stdout, stderr)
            return subprocess.CompletedProcess(cmd, reply["returncode"], stdout, stderr)
        finally:
            self.lock.release()


if __name__ == "__main__":
    serve()
