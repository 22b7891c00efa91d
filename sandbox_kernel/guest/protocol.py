"""The words the sandbox's programs and the host speak: request ops, event types, channel
fields, and how a process follows a fork.

One module for both sides: the kernel imports it as sandbox_kernel.guest.protocol; in a
sandbox it is part of the runner's bundle (see bundle.py) and of the local engine's agent
files (stdlib-only, Python 3.8+, no imports). runner/client.py, which must start in a bare
interpreter with built-in modules only, spells the few words it needs itself (its tests
check that they match).

A request is one JSON object ``{"op": ..., ...}``. Over a channel (runner/client.py
channel) every event line carries ``CELL`` (the cell's id, or null between cells) and its
``SEQ`` (numbered per cell, and per channel for the between-cell ones); a one-shot
request that carries ``ID`` is answered by one line with ``REPLY`` set to it. A request
the runner refuses is answered by ``{"error": ...}`` with its ``ID`` or ``CELL_ID``.
Every line is json.dumps' output, ASCII only; a ``STREAM`` event's ``text`` is its last
field (the kernel publishes that field's JSON as written: sandbox_kernel/sandbox/event_lines.py).
"""

# Request ops
RUN = "run"  # a cell: code (or code_file), cell_id, silent, store_history, execution_count, output
# limits, allow_stdin, user_expressions, or comm (a frontend's comm message to deliver instead of code),
# parent_msg_id (the frontend request it answers: ipywidgets' Output widget captures by it), subshell_id
# (the kernel subshell whose thread runs it; absent: the main thread); a run of a cell already submitted
# only follows it, from `after` (the exec-per-cell transport's reconnect)
INTERRUPT = "interrupt"
INPUT = "input"  # the answer to an input_request: cell_id, value, eof
COMPLETE = "complete"
INSPECT = "inspect"
INFO = "info"
SHUTDOWN = "shutdown"
FORK = "fork"  # the local agent's, not the kernel's: see "Following a fork" below
USAGE = "usage"  # the sandbox's CPU and memory, for usage_reply
COMM_INFO = "comm_info"  # the comms open in the sandbox: target_name (optional)
DEBUG = "debug"  # a frontend's DAP request (request) for the debugger; answered {"response": ...}
SUBSHELL = "subshell"  # action create|delete, subshell_id: a kernel subshell's thread in the runner
# First line of a relay's connection, sent with the relay's stdin and stdout (SCM_RIGHTS):
# the daemon answers CHANNEL_TAKEN, then reads the kernel's requests from that stdin and
# writes the channel's events to that stdout itself (runner/channel.py).
CHANNEL = "channel"
CHANNEL_TAKEN = "taken"  # {"channel": "taken"}: the daemon has the relay's pipes
# How far the daemon writes a channel's stdout ahead of the kernel's acknowledgements
# ({"ack": BYTES received} lines on its stdin). Under the local engine's 8 MiB retained
# window per process, with room for one whole chunk beyond it (a 256 KiB read) and the
# per-chunk cost. Each acknowledgement is an API call through kernel, engine and agent: a
# wider window makes fewer of them (a 20 MiB print: 6 with 7.5 MiB, 12 with 3.5 MiB, 53
# with 768 KiB).
CHANNEL_WINDOW = 7680 * 1024
# Handled at once on a channel, never queued behind a completion (they need no answer).
IMMEDIATE_OPS = (INTERRUPT, INPUT, SHUTDOWN)

# Fields
OP = "op"
ID = "id"
REPLY = "reply"
CELL = "cell"
CELL_ID = "cell_id"
SEQ = "seq"
TYPE = "type"
ERROR = "error"
AFTER = "after"
BACKGROUND_AFTER = "background_after"
SUBSHELL_ID = "subshell_id"
# On an output event: the msg_id of the request it answers, when not its cell's (a thread that
# chose its parent with set_thread_parent, a task an earlier cell started)
PARENT = "parent"

# Event types (Jupyter's message types where there is one)
STREAM = "stream"
DISPLAY_DATA = "display_data"
UPDATE_DISPLAY_DATA = "update_display_data"
CLEAR_OUTPUT = "clear_output"
EXECUTE_RESULT = "execute_result"
ERROR_EVENT = "error"
INPUT_REQUEST = "input_request"
ASK_EXIT = "ask_exit"
COMM = "comm"  # a comm message the sandbox sends: msg_type, content, metadata, buffers (base64)
DEBUG_EVENT = "debug_event"  # a DAP event of the debugger (content), between cells ("cell": null)
DONE = "done"  # the last event of a cell: status ok, error or unknown

# Jupyter's comm messages, the only msg_type a comm message may have either way: a frontend's
# delivered to the sandbox (RUN's comm), and the sandbox's COMM events to the frontend
COMM_MESSAGES = ("comm_open", "comm_msg", "comm_close")

# Following a fork (the local engine): a process that can fork along with its sandbox (the
# runner daemon) registers in the directory FORKABLE_DIR_ENV names, as <pid>.json holding
# {REGISTERED_PID, REGISTERED_SOCKET}. The agent forking the sandbox sends each one
# {OP: FORK, JOIN_PID, FORK_ENV} (or FORK_DIR, a directory to serve at, instead of
# JOIN_PID) on that socket; it answers {"ok": true, CHILD_PID} once its copy serves in
# the new sandbox, and the agent answers the engine {"ok": true, "pid": ..., FOLLOWERS}.
FORKABLE_DIR_ENV = "SANDBOX_FORKABLE_DIR"
REGISTERED_PID = "pid"
REGISTERED_SOCKET = "socket"
JOIN_PID = "join_pid"  # the new sandbox's agent, whose namespaces the fork joins
FORK_DIR = "dir"
FORK_ENV = "env"  # environment variables of the new sandbox
CHILD_PID = "child_pid"
FOLLOWERS = "followers"  # the pids of the processes that followed
