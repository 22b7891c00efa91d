"""The runner's light client: hands one request to the runner daemon and relays its answer.

    python3 -I -S runner_client.py run|attach|request DIR B64JSON

The kernel uploads this file next to runner.py and starts it through the sandbox's exec
API for every cell, interrupt, input answer and completion, so its start-up is part of
every cell's latency. That is why it imports only modules compiled into the interpreter:
json, base64 and socket are .py modules whose imports (re, enum, selectors...) cost more
than starting the interpreter itself, and runner.py, at 1,500 lines, costs its compile
time on every start (a script gets no .pyc). Measured in a sandbox on a 2-core machine:
about 30 ms per request with this file, about 70 ms through runner.py.

B64JSON is base64 of the JSON request object, as the kernel encodes it (json.dumps). The
client never parses it: it appends the command as "op" (last, so it wins, as a dict
update would) and reads the daemon's NDJSON answer only to see whether it is an error or
ends with a cell's `done` event. Failures are one {"error": ...} line on stdout and exit
status 1, so the kernel always has JSON to parse. Must run on Python 3.8+.
"""

import _socket
import binascii
import sys

SOCKET_NAME = "runner.sock"  # as in runner.py
COMMANDS = ("run", "attach", "request")
USAGE = b"usage: runner_client.py run|attach|request DIR B64JSON\n"


def main(argv: list) -> int:
    if len(argv) != 3 or argv[0] not in COMMANDS:
        sys.stderr.buffer.write(USAGE)
        return 2
    command, state_dir, argument = argv
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


def error(out, message: str) -> int:
    escaped = message.replace("\\", "\\\\").replace('"', '\\"').replace("\n", " ")
    out.write(b'{"error": "' + escaped.encode("ascii", "replace") + b'"}\n')
    out.flush()
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
