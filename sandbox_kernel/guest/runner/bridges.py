"""What user code talks to besides its output: input() and getpass() answered by the
frontend (InputBridge), and Jupyter comms, ipywidgets' channel to the frontend (CommBridge).
"""
from __future__ import annotations

import base64
import builtins
import getpass
import importlib.machinery
import importlib.util
import sys
import threading
import types

from .. import protocol
from .output import OutputRouter, ParentRequests


class CommBridge:
    """Jupyter comms in the sandbox (ipywidgets and the like), through the `comm` package
    when it is installed: its create_comm and get_comm_manager are pointed here. What a
    comm sends becomes a `comm` event of the running cell (buffers as base64); what the
    frontend sends arrives as a run whose request has a `comm` field (Daemon._deliver_comm),
    so handlers run in the main thread, and their events have that run's parent."""

    def __init__(self, router: OutputRouter, parents: ParentRequests):
        self.manager = None
        try:
            import comm
            from comm.base_comm import BaseComm, CommManager
        except ImportError:
            return

        class EventComm(BaseComm):
            kernel = parents  # all of ipykernel's kernel that comm users ask for

            def publish_msg(self, msg_type, data=None, metadata=None, buffers=None, **keys):
                content = dict(keys, data=data if data is not None else {}, comm_id=self.comm_id)
                router.emit(protocol.COMM, msg_type=msg_type, content=content, metadata=metadata or {},
                            buffers=[base64.b64encode(bytes(buffer)).decode("ascii") for buffer in buffers or []])

        # Libraries pick widgets over text by whether ipykernel's shell module is loaded
        # (tqdm.auto does): here comms reach the frontend, so widgets are the right pick.
        # Stand-ins say so without the cost of importing ipykernel into every sandbox.
        defer_import("ipykernel", "ipykernel.zmqshell")
        self.manager = CommManager()
        comm.create_comm = EventComm
        comm.get_comm_manager = lambda: self.manager

    def deliver(self, message: dict) -> None:
        """The frontend's comm_open, comm_msg or comm_close (validated by the daemon)."""
        if self.manager is None:
            return  # no comm package in this sandbox: nothing can be listening
        msg = {"header": {"msg_type": message["msg_type"]}, "parent_header": {}, "metadata": message["metadata"],
               "content": message["content"], "buffers": [memoryview(buffer) for buffer in message["buffers"]]}
        getattr(self.manager, message["msg_type"])(None, None, msg)

    def info(self, target_name: object) -> dict:
        """comm_info_reply's comms: the open ones, of one target or all."""
        if self.manager is None:
            return {}
        return {comm_id: {"target_name": comm.target_name} for comm_id, comm in list(self.manager.comms.items())
                if target_name is None or comm.target_name == target_name}


def defer_import(package: str, module: str) -> None:
    """Put stand-ins for `package` and its `module` in sys.modules, each imported for real
    on the first use of a name it does not have (ipykernel costs ~16 MiB and ~0.1 s of
    start, in every sandbox). `name in sys.modules`, find_spec and __file__ answer as for
    the real modules; `import package.module` and `from package.module import x` work as
    usual. Nothing is done if the package is not installed or already imported."""
    if package in sys.modules or module in sys.modules:
        return
    package_spec = importlib.util.find_spec(package)  # a top-level name: imports nothing
    if package_spec is None or not package_spec.submodule_search_locations:
        return
    module_spec = importlib.machinery.PathFinder.find_spec(module, package_spec.submodule_search_locations)
    if module_spec is None:
        return

    class StandIn(types.ModuleType):
        def __getattr__(self, attribute: str) -> object:
            name = self.__name__
            if sys.modules.get(name) is self:
                del sys.modules[name]
            real = importlib.import_module(name)  # a stand-in package is imported by the machinery first
            for key, value in list(vars(self).items()):
                if isinstance(value, StandIn):  # a stand-in module stays reachable from its real package
                    vars(real).setdefault(key, value)
            self.__dict__.update(real.__dict__)
            return getattr(real, attribute)

    for spec in (package_spec, module_spec):
        stand_in = StandIn(spec.name)
        stand_in.__spec__, stand_in.__loader__, stand_in.__file__ = spec, spec.loader, spec.origin
        sys.modules[spec.name] = stand_in
    setattr(sys.modules[package], module.rpartition(".")[2], sys.modules[module])


def checked_comm_message(request: object) -> dict | None:
    """A frontend comm message from a run request, checked, buffers decoded; None if absent."""
    if request is None:
        return None
    if not (isinstance(request, dict) and request.get("msg_type") in protocol.COMM_MESSAGES
            and isinstance(request.get("content"), dict) and isinstance(request["content"].get("comm_id"), str)):
        raise ValueError("a comm request needs msg_type (comm_open/msg/close) and content with a comm_id")
    buffers = request.get("buffers") or []
    metadata = request.get("metadata") or {}
    if not isinstance(buffers, list) or not all(isinstance(buffer, str) for buffer in buffers) \
            or not isinstance(metadata, dict):
        raise ValueError("comm buffers must be base64 strings and metadata an object")
    return {"msg_type": request["msg_type"], "content": request["content"], "metadata": metadata,
            "buffers": [base64.b64decode(buffer) for buffer in buffers]}


class InputBridge:
    """``input()`` and ``getpass.getpass()`` for user code.

    There is no stdin: asking emits an input_request event and blocks until
    the kernel answers through ``request {"op": "input"}``. An interrupt
    raises KeyboardInterrupt out of the wait like out of any blocking call.
    """

    def __init__(self, router: OutputRouter):
        self._router = router
        self._lock = threading.Lock()
        # The questions waiting for an answer, by cell (a subshell's cell may ask too).
        self._pending: dict[str, tuple[threading.Event, list[str | None]]] = {}
        self._no_stdin = _stdin_not_implemented()

    def install(self) -> None:
        builtins.input = self.input
        getpass.getpass = self.getpass

    def reset_after_fork(self) -> None:
        # A pending question belonged to a cell that did not come along.
        self._lock = threading.Lock()
        self._pending = {}

    # __tracebackhide__ keeps these frames out of IPython tracebacks: an error in
    # input() should point at the user's call, not at the runner.
    def input(self, prompt: object = "") -> str:
        __tracebackhide__ = True
        return self._ask(str(prompt), password=False)

    def getpass(self, prompt: str = "Password: ", stream: object = None) -> str:
        __tracebackhide__ = True
        return self._ask(prompt, password=True)

    def answer(self, cell_id: str, value: str | None) -> bool:
        """Deliver the answer; None means the frontend cannot answer (input() raises EOFError)."""
        with self._lock:
            question = self._pending.pop(cell_id, None)
        if question is None:
            return False
        answered, box = question
        box.append(value)
        answered.set()
        return True

    def _ask(self, prompt: str, password: bool) -> str:
        __tracebackhide__ = True
        cell = self._router.cell_here()
        if cell is None:
            raise EOFError("input is only available while a cell runs")
        if not cell.allow_stdin:  # the execute_request said so: fail at once, as ipykernel does
            raise self._no_stdin("raw_input was called, but this frontend does not support input requests.")
        answered = threading.Event()
        box: list[str | None] = []
        with self._lock:
            self._pending[cell.cell_id] = (answered, box)
        try:
            self._router.emit(protocol.INPUT_REQUEST, prompt=prompt, password=password)
            answered.wait()
        finally:
            with self._lock:
                self._pending.pop(cell.cell_id, None)
        if box[0] is None:
            raise EOFError("input() is not available: this frontend does not accept input")
        return box[0]


def _stdin_not_implemented() -> type:
    """IPython's StdinNotImplementedError (what ipykernel raises), or a stand-in without IPython."""
    try:
        from IPython.core.error import StdinNotImplementedError
    except ImportError:
        class StdinNotImplementedError(NotImplementedError):
            pass
    return StdinNotImplementedError
