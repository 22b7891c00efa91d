"""The runner's light client: hands requests to the runner daemon and relays its answers.

    python3 -I -S client.py run|request DIR B64JSON
    python3 -I -S client.py channel DIR [BACKGROUND_AFTER]

(The kernel imports it and calls main rather than running the file, with these arguments,
so that it comes from bytecode: a script is compiled at every start.)

`channel` starts the relay of the kernel's duplex channel (sandbox_kernel/sandbox/channel.py),
a managed process: it connects to the daemon, passes it its stdin and stdout with the
channel request, and once the daemon has them it becomes `cat` of that connection, living
as long as the daemon's side of it. The daemon itself reads the kernel's requests from that
stdin and writes the events to that stdout, flow-controlled (runner/channel.py). A daemon
that cannot be reached or refuses is said in one {"error": ...} line, exit status 1.

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
import posix
import sys

# Words of protocol.py and daemon.py, spelled here: this file imports built-in modules only.
SOCKET_NAME = "runner.sock"  # daemon.SOCKET_NAME
COMMANDS = ("run", "request")
USAGE = b"usage: client.py run|request DIR B64JSON | channel DIR [BACKGROUND_AFTER]\n"
TAKEN = b'{"channel": "taken"}'  # the daemon's answer once it has our pipes (protocol.CHANNEL_TAKEN)
CAT = ("/bin/cat", "/usr/bin/cat")


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


def channel(state_dir: str, background_after) -> int:
    """Hand this process's stdin and stdout to the daemon, which serves the kernel's channel
    on them (runner/channel.py), then live exactly as long as the daemon's side of the
    connection: this process is the kernel's handle on the channel at the service."""
    out = sys.stdout.buffer
    sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)
    request = (b'{"op": "channel"}\n' if background_after is None else
               b'{"op": "channel", "background_after": %d}\n' % background_after)
    pipes = (0).to_bytes(4, sys.byteorder) + (1).to_bytes(4, sys.byteorder)
    try:
        sock.connect(state_dir + "/" + SOCKET_NAME)
        sock.sendmsg([request], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, pipes)])
        answer = sock.recv(4096)
    except OSError as exc:
        return error(out, "daemon unreachable: %s" % exc)
    if not answer.startswith(TAKEN):
        return error(out, "the runner daemon refused the channel: %s" % answer[:200].decode("ascii", "replace"))
    # Ours no more: the daemon alone writes the kernel's stdout now, and reads its stdin.
    # cat reads the connection, which the daemon never writes to, so it ends when the
    # daemon closes it or dies: the kernel then sees this process end without a word,
    # and a new relay finds out whether the daemon is there.
    null = posix.open("/dev/null", posix.O_WRONLY)
    posix.dup2(sock.fileno(), 0)
    posix.dup2(null, 1)
    posix.close(null)
    sock.close()
    for cat in CAT:
        try:
            posix.execv(cat, ["cat"])
        except OSError:
            pass
    while posix.read(0, 4096):  # no cat in this sandbox: wait here instead
        pass
    return 0


def error(out, message: str) -> int:
    escaped = message.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")
    out.write(b'{"error": "' + escaped.encode("ascii", "replace") + b'"}\n')
    out.flush()
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
