"""The runner's light client: hands requests to the runner daemon and relays its answers.

    python3 -I -S client.py run|request DIR B64JSON
    python3 -I -S client.py channel DIR [BACKGROUND_AFTER]

(The kernel imports it and calls main rather than running the file, with these arguments,
so that it comes from the bytecode the daemon writes as it starts: a script is compiled at
every start, and what the compiler used would stay in the relay's heap, 0.4 MiB.)

`channel` is the relay of the kernel's duplex channel (sandbox_kernel/sandbox/channel.py): started
once as a managed process, it holds one connection to the daemon for the kernel's lifetime,
copies each stdin line (a request) to it and everything it sends (tagged events, replies)
to stdout. Stdout is flow-controlled: at most CHANNEL_WINDOW bytes are written ahead of
the kernel's acknowledgements (stdin lines `{"ack": BYTES}`, the stdout bytes it has
received), so the service's retained output window, which a slow reader would fall out
of, always holds what the kernel has not read yet. When the daemon closes the channel
(it died), the relay says so in one {"error": ...} line and exits 1.

Part of the runner's bundle, but run by path or imported under its bare name, never importing its package:
where the sandbox has no managed processes the kernel starts it through the exec API for
every cell, interrupt, input answer and completion, so its start-up is part of every
cell's latency. That is why it imports only modules compiled into the interpreter: json,
base64 and socket are .py modules whose imports (re, enum, selectors...) cost more than
starting the interpreter itself, and the daemon's modules cost their imports on every
start. Measured in a sandbox on a 2-core machine: about 30 ms per request with this file,
about 70 ms through the daemon's code.

B64JSON is base64 of the JSON request object, as the kernel encodes it (json.dumps). The
client never parses it: it appends the command as "op" (last, so it wins, as a dict
update would) and reads the daemon's NDJSON answer only to see whether it is an error or
ends with a cell's `done` event. Failures are one {"error": ...} line on stdout and exit
status 1, so the kernel always has JSON to parse. Must run on Python 3.8+.
"""

import _socket
import _thread
import posix
import sys

# Words of protocol.py and daemon.py, spelled here: this file imports built-in modules only.
SOCKET_NAME = "runner.sock"  # daemon.SOCKET_NAME
COMMANDS = ("run", "request")
USAGE = b"usage: client.py run|request DIR B64JSON | channel DIR [BACKGROUND_AFTER]\n"
# Under the local engine's 8 MiB retained window per process, with room for one whole
# chunk beyond it (a 256 KiB read) and the per-chunk cost. Each acknowledgement is an API
# call through kernel, engine and agent: a wider window makes fewer of them (a 20 MiB
# print: 6 with 7.5 MiB, 12 with 3.5 MiB, 53 with 768 KiB).
CHANNEL_WINDOW = 7680 * 1024
ACK_PREFIX = b'{"ack": '


def main(argv: list) -> int:
    if argv[:1] == ["channel"] and len(argv) in (2, 3) and (len(argv) == 2 or argv[2].isdigit()):
        return channel(argv[1], int(argv[2]) if len(argv) == 3 else None)
    if len(argv) != 3 or argv[0] not in COMMANDS:
        sys.stderr.buffer.write(USAGE)
        return 2
    command, state_dir, argument = argv
    import binascii  # here, not above: the relay (channel) lives on without it (its 28 KiB)

    try:
        request = binascii.a2b_base64(argument.encode("ascii")).strip()
    except (binascii.Error, UnicodeEncodeError):
        request = b""
    if not (request.startswith(b"{") and request.endswith(b"}")):
        sys.stderr.buffer.write(USAGE)
        return 2
    if command != "request":
        request = with_op(request, command)
    out = sys.stdout.buffer
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        sock.connect(state_dir + "/" + SOCKET_NAME)
        sock.sendall(request + b"\n")
        first, last = relay(sock, out)
    except OSError as exc:
        return error(out, "daemon unreachable: %s" % exc)
    finally:
        sock.close()
    if first.startswith(b'{"error"'):
        return 1
    if command == "run" and waits_for_done(request) and b'"type": "done"' not in last:
        # The daemon went away mid-cell (a polling run ends early on purpose); a partial
        # line may have been copied.
        out.write(b"\n")
        return error(out, "connection to the daemon was lost")
    return 0


def with_op(request: bytes, command: str) -> bytes:
    body = request[:-1].rstrip()
    separator = b"" if body == b"{" else b", "
    return body + separator + b'"op": "' + command.encode("ascii") + b'"}'


def waits_for_done(request: bytes) -> bool:
    """Is "wait" null or absent (follow the cell to its end, rather than poll)?

    In json.dumps output a quote inside a string value is always escaped, so the bytes
    `"wait":` can only be the key itself.
    """
    key = request.find(b'"wait":')
    return key < 0 or request[key + len(b'"wait":'):].lstrip().startswith(b"null")


def relay(sock, out) -> tuple:
    """Copy everything the daemon sends to `out` as soon as it arrives; return the start
    of the first line and the last complete line."""
    first = b""
    tail = b""
    while True:
        data = sock.recv(1 << 16)
        if not data:
            break
        out.write(data)
        out.flush()
        if not first:
            first = data[:16]
        tail = (tail + data)[-1024:]
    complete_lines = tail.rsplit(b"\n", 2)
    last = complete_lines[-2] if len(complete_lines) >= 2 else b""
    return first, last


class Credit:
    """How many more bytes the relay may write before the kernel acknowledges some."""

    def __init__(self) -> None:
        self.written = 0
        self.acked = 0
        self._gate = _thread.allocate_lock()
        self._gate.acquire()  # released by each acknowledgement, to wake a waiting writer

    def wait(self) -> int:
        """Bytes that may be written now (> 0), waiting for an acknowledgement if none."""
        while True:
            room = CHANNEL_WINDOW - (self.written - self.acked)
            if room > 0:
                return room
            self._gate.acquire(True, 0.5)

    def ack(self, received: int) -> None:
        self.acked = max(self.acked, min(received, self.written))
        try:
            self._gate.release()
        except RuntimeError:  # not held: nobody is waiting
            pass


def channel(state_dir: str, background_after) -> int:
    out = sys.stdout.buffer
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    try:
        sock.connect(state_dir + "/" + SOCKET_NAME)
        sock.sendall(b'{"op": "channel"}\n' if background_after is None else
                     b'{"op": "channel", "background_after": %d}\n' % background_after)
    except OSError as exc:
        return error(out, "daemon unreachable: %s" % exc)
    credit = Credit()
    _thread.start_new_thread(forward_requests, (sock, credit))
    while True:
        try:
            data = sock.recv(1 << 18)  # as much as the agent reads at once (its READ_CHUNK)
        except OSError:
            data = b""
        if not data:
            break
        while data:
            room = credit.wait()
            out.write(data[:room])
            out.flush()
            credit.written += min(room, len(data))
            data = data[room:]
    out.write(b"\n")  # after a partial line, if the daemon died while sending one
    return error(out, "the runner daemon closed the channel")


def forward_requests(sock, credit: Credit) -> None:
    """Stdin lines to the daemon, but acknowledgements to the credit; EOF ends the relay."""
    requests = sys.stdin.buffer
    while True:
        line = requests.readline()
        if not line:
            posix._exit(0)  # the kernel is done with this channel
        if line.startswith(ACK_PREFIX):
            digits = line[len(ACK_PREFIX):].rstrip(b"}\r\n ")
            if digits.isdigit():
                credit.ack(int(digits))
            continue
        try:
            sock.sendall(line)
        except OSError:
            return  # the daemon is gone: the main thread reports it


def error(out, message: str) -> int:
    escaped = message.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")
    out.write(b'{"error": "' + escaped.encode("ascii", "replace") + b'"}\n')
    out.flush()
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
