"""The debugger inside the sandbox: debugpy, started on demand, driven over DAP.

Part of the runner's bundle (stdlib-only at import, Python 3.8+; debugpy is imported where
the sandbox has it). The kernel sends each DAP request of the frontend (JupyterLab's debugger
panel) as one ``debug`` op on its channel; ``Debugger.handle`` answers it with the DAP
response, in one of the channel's request threads (never the main thread: that is where
cells run and where the debuggee stops). DAP events go to ``emit_event`` (the daemon's
between-cell log), which the kernel publishes as ``debug_event``.

How it works: the first ``initialize`` makes the runner call ``debugpy.listen`` on
loopback (inside the sandbox's own network namespace), on the main thread between cells,
so the main thread is traced. debugpy starts its adapter (a subprocess) and this module
connects to the adapter's client port as the DAP client, relaying requests, responses and
events. The requests that frontends send for Jupyter kernels and debugpy does not know
(``debugInfo``, ``dumpCell``, ``inspectVariables``, ...) are answered here.

While the debugger is on, cells are compiled under the file name the frontend computes
for them (Murmur2 of the cell's code, see ``cell_file_name``), so a breakpoint set in a
dumped cell is hit when the cell runs. The runner's own files are excluded from debugging (``rules``), so stepping
never enters them.
"""
from __future__ import annotations

import ast
import importlib.util
import itertools
import json
import os
import reprlib
import socket
import sys
import tempfile
import threading

# Any 32-bit value: frontends read it from debugInfo to name cells as we do.
HASH_SEED = 0xC70F6907
CELL_SUFFIX = ".py"
START_TIMEOUT = 30.0  # seconds debugpy may take to start (it waits for the cell running now)
RESPONSE_TIMEOUT = 30.0  # seconds the adapter may take to answer a request
MAX_DAP_MESSAGE = 8 * 1024 * 1024  # bytes of one message from the adapter (it is sandbox code too)
SOURCE_LIMIT = 1024 * 1024  # bytes of a file a `source` request may return
VALUE_REPR = reprlib.Repr()
VALUE_REPR.maxstring = VALUE_REPR.maxother = 200
# Names of the user namespace that are IPython's or the kernel's, not the user's.
HIDDEN_NAMES = frozenset(("__name__", "__doc__", "__package__", "__loader__", "__spec__", "__annotations__",
                          "__builtins__", "__builtin__", "__display__", "get_ipython", "exit", "quit",
                          "In", "Out", "_oh", "_dh", "_ih", "_", "__", "___"))
# Answered without debugpy, whether or not the debugger has started.
LOCAL_COMMANDS = ("debugInfo", "inspectVariables", "richInspectVariables", "modules", "dumpCell", "source",
                  "configurationDone")
_UINT32 = 0xFFFFFFFF


class DebuggerError(Exception):
    """A request that cannot be answered: the response says why."""


def debugpy_importable() -> bool:
    return importlib.util.find_spec("debugpy") is not None


def murmur2(data: bytes, seed: int) -> int:
    """MurmurHash2, 32-bit: the hash JupyterLab's debugger names cells by ("Murmur2")."""
    multiplier = 0x5BD1E995
    hashed = (seed ^ len(data)) & _UINT32
    whole = len(data) - len(data) % 4
    for start in range(0, whole, 4):
        word = int.from_bytes(data[start:start + 4], "little")
        word = (word * multiplier) & _UINT32
        word ^= word >> 24
        word = (word * multiplier) & _UINT32
        hashed = ((hashed * multiplier) & _UINT32) ^ word
    if whole < len(data):
        hashed ^= int.from_bytes(data[whole:], "little")
        hashed = (hashed * multiplier) & _UINT32
    hashed ^= hashed >> 13
    hashed = (hashed * multiplier) & _UINT32
    return hashed ^ (hashed >> 15)


def cell_directory() -> str:
    return os.path.join(tempfile.gettempdir(), "sandbox_kernel_cells_%d" % os.getpid())


def cell_file_name(code: str) -> str:
    """Where a cell's code lives for the debugger: the name the frontend computes from
    debugInfo's tmpFilePrefix, hash and tmpFileSuffix."""
    return os.path.join(cell_directory(), "%d%s" % (murmur2(code.encode("utf-8"), HASH_SEED), CELL_SUFFIX))


def name_cells_by_hash(shell, on: bool) -> None:
    """While on, compile the shell's cells under cell_file_name (IPython names them by number).
    Only while debugging: IPython shows more of a cell in a traceback when its name is a path,
    which would change saved notebooks' outputs."""
    compiler = shell.compile
    if on:
        compiler.get_code_name = lambda raw_code, transformed_code, number: cell_file_name(raw_code)
    elif "get_code_name" in vars(compiler):
        del compiler.get_code_name  # IPython's own, from its class


def response(request: dict, success: bool = True, body: dict | None = None, message: str = "") -> dict:
    reply = {"type": "response", "seq": 0, "request_seq": request.get("seq", 0), "success": success,
             "command": request.get("command", "")}
    if body is not None:
        reply["body"] = body
    if message:
        reply["message"] = message
    return reply


def visible(name: str) -> bool:
    """A variable the user made, not one of IPython's (In, Out, _i3, _7...)."""
    if name in HIDDEN_NAMES or name in ("_i", "_ii", "_iii"):
        return False
    return not (name.startswith("_i") and name[2:].isdigit()) and not (name.startswith("_") and name[1:].isdigit())


class DapConnection:
    """The DAP client's socket to debugpy's adapter: framed messages out, a reader thread in.

    Outgoing requests are renumbered (``seq``) so that the frontend's numbers and this
    module's own requests never collide; ``call`` gives back the response with the
    caller's ``request_seq``.
    """

    def __init__(self, address: tuple, on_event, on_close) -> None:
        self._socket = socket.create_connection(address, timeout=START_TIMEOUT)
        self._socket.settimeout(None)
        self._on_event = on_event
        self._on_close = on_close
        self._seqs = itertools.count(1)
        self._send_lock = threading.Lock()
        self._waiting: dict = {}  # seq -> [threading.Event, response or None]
        self._lock = threading.Lock()
        self.open = True
        threading.Thread(target=self._read_forever, name="debugpy-reader", daemon=True).start()

    def send(self, request: dict) -> int:
        """Send a request; its seq, for wait()."""
        seq = next(self._seqs)
        with self._lock:
            self._waiting[seq] = [threading.Event(), None]
        body = json.dumps(dict(request, seq=seq, type="request")).encode("utf-8")
        try:
            with self._send_lock:
                self._socket.sendall(b"Content-Length: %d\r\n\r\n" % len(body) + body)
        except OSError:
            self.close()
        return seq

    def wait(self, seq: int, request: dict, timeout: float = RESPONSE_TIMEOUT) -> dict:
        with self._lock:
            slot = self._waiting.get(seq)
        if slot is None:
            raise DebuggerError("internal error: no request %d" % seq)
        try:
            if not slot[0].wait(timeout):
                raise DebuggerError("debugpy did not answer %s in %g s" % (request.get("command"), timeout))
            if slot[1] is None:
                raise DebuggerError("the connection to debugpy closed")
            return dict(slot[1], request_seq=request.get("seq", 0))
        finally:
            with self._lock:
                self._waiting.pop(seq, None)

    def call(self, request: dict, timeout: float = RESPONSE_TIMEOUT) -> dict:
        return self.wait(self.send(request), request, timeout)

    def close(self) -> None:
        with self._lock:
            if not self.open:
                return
            self.open = False
            waiting = list(self._waiting.values())
        try:
            self._socket.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._socket.close()
        for event, _ in waiting:
            event.set()  # with no response: the waiter hears that the connection closed
        self._on_close()

    def _read_forever(self) -> None:
        reader = self._socket.makefile("rb")
        try:
            while True:
                message = self._read_message(reader)
                if message is None:
                    return
                if message.get("type") == "response":
                    with self._lock:
                        slot = self._waiting.get(message.get("request_seq"))
                    if slot is not None:
                        slot[1] = message
                        slot[0].set()
                elif message.get("type") == "event":
                    self._on_event(message)
        except (OSError, ValueError):
            return
        finally:
            self.close()

    @staticmethod
    def _read_message(reader) -> dict | None:
        length = None
        while True:
            header = reader.readline(1024)
            if not header:
                return None
            header = header.strip()
            if not header:
                break
            name, _, value = header.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        if length is None or not 0 <= length <= MAX_DAP_MESSAGE:
            raise ValueError("bad DAP message length %r" % (length,))
        message = json.loads(reader.read(length).decode("utf-8"))
        if not isinstance(message, dict):
            raise ValueError("a DAP message must be an object")
        return message


class Debugger:
    """Answers the kernel's ``debug`` ops (see the module docstring).

    ``run_on_main(fn)`` runs fn on the daemon's main thread (between cells) and returns
    a concurrent.futures.Future of its result; ``emit_event(message)`` passes a DAP event on to the kernel;
    ``shell`` is the IPython shell cells run in; ``excluded`` are paths never debugged;
    debugpy's own log lines go to ``log_path`` (not to the user's stderr).
    """

    def __init__(self, run_on_main, emit_event, shell, excluded: list, log_path: str) -> None:
        self._log_path = log_path
        self._run_on_main = run_on_main
        self._emit_event = emit_event
        self._shell = shell
        self._excluded = excluded
        self._adapter: tuple | None = None  # debugpy's client address, once listening
        self._listening = None  # the future of debugpy.listen on the main thread, once asked for
        self._connection: DapConnection | None = None
        self._initialized = threading.Event()  # the adapter's `initialized` event
        self._lifecycle = threading.Lock()  # initialize, attach and disconnect, one at a time
        self._state = threading.Lock()
        self.breakpoints: dict = {}  # source path -> [{"line": n}], as debugpy set them
        self.stopped_threads: set = set()
        self._removed_transforms: list = []
        self._interrupted_while_stopped = False

    @property
    def started(self) -> bool:
        return self._connection is not None and self._connection.open

    def handle(self, request: object) -> dict:
        """The DAP response to one request; never raises."""
        if not isinstance(request, dict) or not isinstance(request.get("command"), str):
            return response({}, False, message="not a DAP request")
        command = request["command"]
        try:
            if command in LOCAL_COMMANDS:
                return getattr(self, "_" + command)(request)
            if command == "initialize":
                return self._initialize(request)
            if not self.started:
                return response(request, False, message="the debugger has not started (initialize first)")
            if command == "attach":
                return self._attach(request)
            if command == "disconnect":
                return self._disconnect(request)
            if command == "copyToGlobals":
                return self._copy_to_globals(request)
            if command == "setBreakpoints":
                return self._set_breakpoints(request)
            reply = self._forward(request)
            if command == "variables" and reply.get("success"):
                self._hide_internal_variables(reply)
            return reply
        except DebuggerError as exc:
            return response(request, False, message=str(exc))
        except Exception as exc:  # a malformed request, or a bug: the frontend hears why
            return response(request, False, message="%s: %s" % (type(exc).__name__, exc))

    def interrupting(self) -> None:
        """An interrupt is about to be signalled to the main thread (any thread may call this)."""
        with self._state:
            self._interrupted_while_stopped = self._interrupted_while_stopped or bool(self.stopped_threads)

    def before_cell(self) -> None:
        """On the main thread, before each cell. An interrupt that ended a cell stopped at a
        breakpoint raised KeyboardInterrupt inside the debugger's wait for the frontend:
        debugpy still holds the thread as suspended, and Python stopped tracing it. Mark
        it running and trace it again, or no later breakpoint would stop a cell."""
        with self._state:
            interrupted, self._interrupted_while_stopped = self._interrupted_while_stopped, False
        if not interrupted or self._adapter is None:
            return
        import debugpy
        from _pydevd_bundle.pydevd_additional_thread_info import set_additional_thread_info
        from _pydevd_bundle.pydevd_thread_lifecycle import internal_run_thread

        internal_run_thread(threading.current_thread(), set_additional_thread_info)
        debugpy.trace_this_thread(True)

    def close(self) -> None:
        if self._connection is not None:
            self._connection.close()

    # -- lifecycle ----------------------------------------------------------------------

    def _forward(self, request: dict, timeout: float = RESPONSE_TIMEOUT) -> dict:
        connection = self._connection
        if connection is None or not connection.open:
            raise DebuggerError("the debugger is not connected")
        return connection.call(request, timeout)

    def _initialize(self, request: dict) -> dict:
        with self._lifecycle:
            if not self.started:
                if self._adapter is None:
                    self._adapter = self._await_listening()
                self._initialized.clear()
                self._connection = DapConnection(self._adapter, self._on_event, self._on_disconnected)
                self._keep_leading_empty_lines()
                name_cells_by_hash(self._shell, True)
            return self._forward(request)

    def _await_listening(self) -> tuple:
        """debugpy's address, once listening. It starts on the main thread, so after the cell
        that runs now; a request that stops waiting leaves it starting for the next one."""
        import concurrent.futures

        if self._listening is None:
            self._listening = self._run_on_main(self._listen)
        try:
            return self._listening.result(START_TIMEOUT)
        except concurrent.futures.TimeoutError:
            raise DebuggerError("the debugger starts when the running cell has finished: "
                                "try again then") from None

    def _listen(self) -> tuple:
        # debugpy logs to stderr, which is the cell's: output the user did not ask for. Its
        # warning about frozen standard modules (breakpoints cannot be set in them, which
        # just-my-code never does anyway) is not even worth the log.
        os.environ["PYDEVD_DEBUG_FILE"] = self._log_path
        os.environ["PYDEVD_DISABLE_FILE_VALIDATION"] = "1"
        import debugpy

        # Debug this process only: debugpy would otherwise patch os.fork and subprocess
        # creation to debug children too (every `!python ...`, and the runner's own fork for
        # `%sandbox fork`, whose child leaves this sandbox's network).
        debugpy.configure(subProcess=False)
        return tuple(debugpy.listen(("127.0.0.1", 0)))

    def _attach(self, request: dict) -> dict:
        """Attach to this process; the adapter asks for its configuration (`initialized`),
        which is done here, so the frontend's configurationDone is answered locally."""
        arguments = dict(request.get("arguments") or {})
        host, port = self._adapter
        arguments["connect"] = {"host": host, "port": port}
        arguments["rules"] = [{"path": path, "include": False} for path in self._excluded]
        arguments["redirectOutput"] = False  # the runner captures output already
        with self._lifecycle:
            connection = self._connection
            seq = connection.send(dict(request, arguments=arguments))
            if not self._initialized.wait(RESPONSE_TIMEOUT):
                raise DebuggerError("debugpy did not get ready to attach")
            done = connection.call({"command": "configurationDone"})
            if not done.get("success"):
                raise DebuggerError("debugpy refused its configuration: %s" % done.get("message"))
            return connection.wait(seq, request)

    def _disconnect(self, request: dict) -> dict:
        arguments = dict(request.get("arguments") or {}, terminateDebuggee=False)  # the runner lives on
        with self._lifecycle:
            try:
                return self._forward(dict(request, arguments=arguments))
            finally:
                self.close()

    def _on_disconnected(self) -> None:
        with self._state:
            self.breakpoints = {}
            self.stopped_threads = set()
        self._restore_leading_empty_lines()
        name_cells_by_hash(self._shell, False)

    def _on_event(self, message: dict) -> None:
        event, body = message.get("event"), message.get("body") or {}
        if event == "initialized":
            self._initialized.set()
        with self._state:
            if event == "stopped" and "threadId" in body:
                self.stopped_threads.add(body["threadId"])
            elif event == "continued":
                if body.get("allThreadsContinued", True):
                    self.stopped_threads = set()
                else:
                    self.stopped_threads.discard(body.get("threadId"))
        self._emit_event(message)

    def _keep_leading_empty_lines(self) -> None:
        """IPython drops a cell's leading empty lines, which would shift every breakpoint of
        a cell that has them: keep them while debugging."""
        from IPython.core.inputtransformer2 import leading_empty_lines

        transforms = self._shell.input_transformer_manager.cleanup_transforms
        if leading_empty_lines in transforms:
            self._removed_transforms.append((transforms.index(leading_empty_lines), leading_empty_lines))
            transforms.remove(leading_empty_lines)

    def _restore_leading_empty_lines(self) -> None:
        transforms = self._shell.input_transformer_manager.cleanup_transforms
        while self._removed_transforms:
            index, transform = self._removed_transforms.pop()
            transforms.insert(index, transform)

    # -- requests debugpy does not know ---------------------------------------------------

    def _debugInfo(self, request: dict) -> dict:
        with self._state:
            breakpoints = [{"source": path, "breakpoints": lines} for path, lines in self.breakpoints.items()]
            stopped = sorted(self.stopped_threads)
        return response(request, body={
            "isStarted": self.started, "hashMethod": "Murmur2", "hashSeed": HASH_SEED,
            "tmpFilePrefix": cell_directory() + os.sep, "tmpFileSuffix": CELL_SUFFIX,
            "breakpoints": breakpoints, "stoppedThreads": stopped, "richRendering": True,
            "exceptionPaths": ["Python Exceptions"], "copyToGlobals": True})

    def _dumpCell(self, request: dict) -> dict:
        code = str(request["arguments"]["code"])
        path = cell_file_name(code)
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        with open(path, "w", encoding="utf-8") as file:
            file.write(code)
        return response(request, body={"sourcePath": path})

    def _source(self, request: dict) -> dict:
        path = str(request["arguments"]["source"]["path"])
        try:
            with open(path, "rb") as file:
                content = file.read(SOURCE_LIMIT + 1)
        except OSError as exc:
            return response(request, False, body={}, message="source unavailable: %s" % exc.strerror)
        if len(content) > SOURCE_LIMIT:
            return response(request, False, body={}, message="source larger than %d bytes" % SOURCE_LIMIT)
        return response(request, body={"content": content.decode("utf-8", "replace")})

    def _configurationDone(self, request: dict) -> dict:
        return response(request)  # sent to debugpy during attach

    def _set_breakpoints(self, request: dict) -> dict:
        reply = self._forward(request)
        if reply.get("success"):
            # debugpy may move a breakpoint to another line: remember where it put them.
            lines = [{"line": point["line"]} for point in reply.get("body", {}).get("breakpoints", [])
                     if isinstance(point, dict) and "line" in point]
            with self._state:
                self.breakpoints[str(request["arguments"]["source"]["path"])] = lines
        return reply

    def _inspectVariables(self, request: dict) -> dict:
        """The user's globals, for the variables panel while no cell is stopped."""
        namespace = self._shell.user_ns
        variables = []
        for name in list(namespace):
            if not visible(name):
                continue
            value = namespace.get(name)
            variables.append({"name": name, "value": self._repr(value), "type": type(value).__name__,
                              "evaluateName": name, "variablesReference": 0})
        return response(request, body={"variables": variables})

    @staticmethod
    def _repr(value: object) -> str:
        try:
            return VALUE_REPR.repr(value)
        except Exception as exc:  # a user's __repr__ that raises
            return "<repr failed: %s>" % type(exc).__name__

    def _richInspectVariables(self, request: dict) -> dict:
        arguments = request["arguments"]
        name = str(arguments["variableName"])
        if not name.isidentifier():  # a group row of the panel ("special variables")
            return response(request, name in ("special variables", "function variables"),
                            body={"data": {}, "metadata": {}})
        data, metadata = {}, {}
        if self.started and self.stopped_threads and "frameId" in arguments:
            # Formatted in the stopped frame, where the name has its value there.
            reply = self._forward({"command": "evaluate", "arguments": {
                "expression": "get_ipython().display_formatter.format(%s)" % name,
                "frameId": arguments["frameId"], "context": "clipboard"}})
            if reply.get("success"):
                data, metadata = ast.literal_eval(reply["body"]["result"])
        else:
            result = self._shell.user_expressions({name: name})[name]
            if result.get("status") == "ok":
                data, metadata = result.get("data", {}), result.get("metadata", {})
        return response(request, body={"data": data,
                                       "metadata": {key: value for key, value in metadata.items() if key in data}})

    def _copy_to_globals(self, request: dict) -> dict:
        arguments = request["arguments"]
        target, source = str(arguments["dstVariableName"]), str(arguments["srcVariableName"])
        if not (target.isidentifier() and source.isidentifier()):
            return response(request, False, message="dstVariableName and srcVariableName must be identifiers")
        return self._forward({"command": "setExpression", "arguments": {
            "expression": "globals()[%r]" % target, "value": source, "frameId": arguments["srcFrameId"]}})

    def _modules(self, request: dict) -> dict:
        arguments = request.get("arguments") or {}
        modules = list(sys.modules.values())
        start = int(arguments.get("startModule") or 0)
        count = int(arguments.get("moduleCount") or len(modules))
        found = []
        for index, module in enumerate(modules[start:start + count], start):
            path = getattr(getattr(module, "__spec__", None), "origin", None)
            if isinstance(path, str) and path.endswith(".py"):
                found.append({"id": index, "name": module.__name__, "path": path})
        return response(request, body={"modules": found, "totalModules": len(modules)})

    def _hide_internal_variables(self, reply: dict) -> None:
        variables = reply.get("body", {}).get("variables")
        if isinstance(variables, list):
            reply["body"]["variables"] = [variable for variable in variables
                                          if not isinstance(variable, dict) or visible(str(variable.get("name")))]
