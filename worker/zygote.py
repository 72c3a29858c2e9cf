"""A node's zygote: one process that has imported what an executor imports (torch, Triton,
transformers' model-building modules, the engine: `worker.host.warm_imports`) and never touched
CUDA, and that forks each new executor process of the node from there. On this image those imports
are ~11 s of a fresh interpreter (session 28); a forked executor starts with them done, then sets its
own GPUs, environment, folder and log, and runs its module as ``python -m`` would.

    python -m worker.zygote            # started by the daemon (worker.processes.Zygote)

The daemon talks to it through its stdin and stdout, one JSON line each way:
  ready   {"ready": true, "pid": ..., "imports_s": ...} once the imports are done
  request {"module": ..., "args": [...], "env": {...}, "cwd": ..., "log": ...}
  reply   {"pid": ...}
A child leads its own session (a signal reaches its children). The zygote reaps each child and
writes its exit status to ``<cwd>/.exit-<pid>.json`` (a negative code: the signal that ended it), and
the zygote notes the child in ``<cwd>/.process.json`` ({"pid", "start"}), which is how a restarted
daemon recognises it (worker.processes.alive: the child's command line is the zygote's). At the end
of its stdin (the daemon gone), the zygote takes no more requests, reaps the children it has left,
then exits.

A child is exactly what ``python -m module`` would start or it is not made: a request whose
environment differs from the zygote's in anything but the per-process keys (PER_PROCESS: read at
CUDA's first use, never at import) is refused, and the daemon execs the process as before.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import runpy
import select
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path

from worker.host import write_json

log = logging.getLogger("loraplex.worker.zygote")

# what a request may set differently from the zygote's own environment
PER_PROCESS = frozenset({"CUDA_VISIBLE_DEVICES", "LORAPLEX_SLOTS"})
MARKER_NAME = ".process.json"


def exit_file(cwd: Path, pid: int) -> Path:
    return cwd / f".exit-{pid}.json"


def stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat's fields after the command's name (the state first), None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()


def start_ticks(fields: list[str]) -> int:
    """A process's start time in clock ticks since boot (stat field 22) from `stat_fields`: with
    the pid, it names one process (a recycled pid starts later)."""
    return int(fields[19])


def _exit_code(code: object) -> int:
    """SystemExit's code as the interpreter's exit status (None: 0, a message: printed, 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _run_child(req: dict, reply_fd: int) -> int:
    """In the forked child: the process a ``python -m module args`` under req's env, cwd and log
    would be, up to its first line of its own code."""
    os.close(reply_fd)
    os.setsid()
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    log_fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null_fd = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null_fd, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    os.close(null_fd)
    if sys.path and sys.path[0] == os.getcwd():  # python -m's first entry: the process's folder
        sys.path[0] = req["cwd"]
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    sys.argv = [req["module"], *req["args"]]
    code = 0
    try:
        runpy.run_module(req["module"], run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = _exit_code(exc.code)
    except BaseException:  # noqa: BLE001 - as the interpreter would: the traceback, then status 1
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()  # what a normal interpreter exit runs (os._exit below does not)
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
    return code


class Server:
    """The zygote's loop: requests in, children forked, children reaped."""

    def __init__(self, reply_fd: int) -> None:
        self.children: dict[int, Path] = {}  # pid -> its cwd
        self.buffer = b""
        self.reply_fd = reply_fd

    def fork(self, req: dict) -> int:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _run_child(req, self.reply_fd)
            finally:
                os._exit(code)
        self.children[pid] = Path(req["cwd"])
        # noted before the reply: the daemon recognises the child from its first look
        fields = stat_fields(pid)  # the child exists until this zygote reaps it
        write_json(Path(req["cwd"]) / MARKER_NAME,
                    {"pid": pid, "start": None if fields is None else start_ticks(fields)})
        return pid

    def reap(self) -> None:
        """Note each ended child's status in its folder, then reap it: a zombie still shows in
        /proc until then, so whoever looks finds the child running, ended and noted, never gone
        with nothing noted."""
        while self.children:
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                self.children.clear()
                return
            if info is None or info.si_pid == 0:
                return
            pid = info.si_pid
            code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
            cwd = self.children.pop(pid, None)
            if cwd is not None:
                try:
                    write_json(exit_file(cwd, pid), {"pid": pid, "code": code})
                except OSError:  # its folder is gone: nobody is left to ask
                    pass
            os.waitpid(pid, 0)

    def requests(self) -> list[dict] | None:
        """The whole request lines waiting on stdin (None: its end, the daemon is gone)."""
        ready, _, _ = select.select([0], [], [], 0.2)
        if not ready:
            return []
        chunk = os.read(0, 1 << 16)
        if not chunk:
            return None
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        return [json.loads(line) for line in lines if line.strip()]

    def reply(self, data: dict) -> None:
        os.write(self.reply_fd, (json.dumps(data) + "\n").encode())

    def serve(self) -> int:
        while True:
            self.reap()
            batch = self.requests()
            if batch is None:
                break
            for req in batch:
                try:
                    pid = self.fork(req)
                    self.reply({"pid": pid})
                except (OSError, KeyError, TypeError) as exc:
                    self.reply({"error": f"{type(exc).__name__}: {exc}"})
        while self.children:  # the daemon is gone: its children's exit codes still go on file
            self.reap()
            time.sleep(0.2)
        return 0



# -- the daemon's side ---------------------------------------------------------------------------
def read_exit(cwd: Path, pid: int) -> int | None:
    """The exit status the zygote noted for its child pid in cwd, if it has."""
    try:
        return int(json.loads(exit_file(cwd, pid).read_text())["code"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


class Zygote:
    """The daemon's handle on its zygote process (``python -m worker.zygote``), started with env:
    `spawn` forks a child there once the zygote has done its imports and answers its pid, or
    answers None (not ready yet, gone, or a request it must not serve), and the caller execs the
    process instead (worker.processes.spawn, whose ForkedProcess holds the child)."""

    def __init__(self, env: Mapping[str, str], cwd: Path, log_path: Path,
                 preload: Sequence[str] | None = None) -> None:
        self.env = dict(env)
        self.info: dict | None = None  # its ready line
        self._buffer = b""
        extra = [] if preload is None else ["--preload", ",".join(preload)]
        with open(log_path, "ab") as out:
            self.proc = subprocess.Popen([sys.executable, "-m", "worker.zygote", *extra], env=self.env, cwd=cwd,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=out,
                                         start_new_session=True)
        self.started = time.monotonic()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def ready(self, timeout: float = 0.0) -> bool:
        if self.info is None and self.alive():
            line = self._line(timeout)
            if line is not None and line.get("ready"):
                self.info = line
                log.info("zygote ready pid=%d imports_s=%.2f", self.proc.pid, line.get("imports_s", 0.0))
        return self.info is not None and self.alive()

    def serves(self, env: Mapping[str, str]) -> bool:
        """Whether a child with env is what an exec would start: the same environment but the
        per-process keys."""
        keys = (set(env) | set(self.env)) - PER_PROCESS
        return all(env.get(k) == self.env.get(k) for k in keys)

    def spawn(self, module: str, args: Sequence[str], env: Mapping[str, str], cwd: Path,
              log_path: Path) -> int | None:
        if not self.ready() or not self.serves(env):
            return None
        req = {"module": module, "args": [str(a) for a in args], "env": dict(env),
               "cwd": str(cwd), "log": str(log_path)}
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write((json.dumps(req) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:
            return None
        reply = self._line(10.0)
        if reply is None or "pid" not in reply:
            log.warning("zygote did not fork module=%s reply=%s", module, reply)
            if reply is None:  # a reply late or lost would pair with the next request: stop using it
                self.close()
            return None
        return int(reply["pid"])

    def _line(self, timeout: float) -> dict | None:
        out = self.proc.stdout
        assert out is not None
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            ready, _, _ = select.select([out], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            chunk = os.read(out.fileno(), 1 << 16)
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        try:
            return json.loads(line)
        except ValueError:
            return None

    def close(self) -> None:
        """The end of its stdin: it takes no more requests, and exits once its children have."""
        self.info = None
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except OSError:
                pass


def main(argv: Sequence[str] | None = None) -> int:
    """argv: ``--preload MOD,MOD`` imports those modules instead of the executor's
    (`worker.host.warm_imports`); an empty list imports nothing more."""
    import importlib

    started = time.perf_counter()
    reply_fd = os.dup(1)  # the replies' own descriptor: what an import prints goes to the log
    os.dup2(2, 1)
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--preload"] and len(argv) == 2:
        for name in filter(None, argv[1].split(",")):
            importlib.import_module(name)
    else:
        from worker.host import warm_imports

        warm_imports()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        print("zygote: CUDA was initialised by an import; a forked child could not use it",
              file=sys.stderr)
        return 3
    server = Server(reply_fd)
    server.reply({"ready": True, "pid": os.getpid(), "imports_s": time.perf_counter() - started})
    return server.serve()


if __name__ == "__main__":
    sys.exit(main())
