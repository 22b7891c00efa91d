"""The seccomp filter every local sandbox runs under (classic BPF, built here in Python).

bwrap loads it (`--seccomp FD`) just before it starts the agent, so it holds for every
process of the sandbox and of its forks; bwrap sets no_new_privs first, as seccomp
requires. Blocked calls fail with EPERM, so a program that probes for a feature gets an
ordinary error instead of being killed.

What is blocked, and why. Most of these already fail inside a user namespace without
host capabilities; the filter keeps them shut even if a kernel bug would let one through,
and closes the ones a user namespace does not:

- kernel code and state: init_module, finit_module, delete_module, kexec_load,
  kexec_file_load, bpf, perf_event_open (a large kernel attack surface), lookup_dcookie,
  syslog (the host's kernel log), _sysctl, quotactl, acct, swapon, swapoff, reboot,
  uselib, iopl, ioperm, vhangup;
- the host clock: settimeofday, clock_settime, clock_adjtime, adjtimex;
- the kernel keyring, shared by every process of the host user: add_key, request_key, keyctl;
- userfaultfd (a classic exploit aid) and io_uring_setup/enter/register (a large
  attack surface that also bypasses syscall filtering);
- open_by_handle_at (opens files by inode handle, past the mount namespace);
- ptrace, process_vm_readv, process_vm_writev, kcmp: a fork and its source run as the
  same user in one pid namespace, so without this one could read and write the other's
  memory. Debuggers (gdb, strace, py-spy) do not work in a sandbox because of it;
- pidfd_getfd (copying another process's descriptor): a child the agent spawns holds
  the agent's descriptors until it execs, so a sandbox's code could take the agent's
  listening socket from it and answer the engine in the agent's place (the agent also
  closes its sockets in the child first, agent.py);
- what Docker's default profile also denies: name_to_handle_at (the other half of
  open_by_handle_at), move_pages, get_mempolicy and set_mempolicy (NUMA placement: libnuma
  reads EPERM as "no NUMA", nothing in a sandbox needs it), open_tree and mount_setattr
  (the new mount API's way to copy and reflag mounts) and fsconfig (configuring a new
  filesystem instance), sysfs and ustat (obsolete filesystem queries). The fork path
  (nsfork.py) uses mount(2), never these;
- ioctl TIOCSTI and TIOCLINUX (pushing keystrokes into a terminal);
- personality() other than the default and the 32-bit/uname26 variants (e.g. turning
  off address-space randomization);
- on x86_64, the x32 ABI and 32-bit (i386) calls, which would reach the same kernel
  code under other syscall numbers and slip past the list.

Not blocked, on purpose: mount, umount2, unshare, setns, pivot_root, sethostname and
clone with namespace flags. A fork (guest/nsfork.py) needs them, inside a user namespace
the sandbox owns, where they change only the sandbox's own namespaces.
"""

from __future__ import annotations

import errno
import os
import platform
import struct

# classic BPF opcodes (linux/filter.h, linux/bpf_common.h)
LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
JGE_K = 0x35  # BPF_JMP | BPF_JGE | BPF_K
RET_K = 0x06  # BPF_RET | BPF_K
RET_ALLOW = 0x7FFF0000  # SECCOMP_RET_ALLOW
RET_EPERM = 0x00050000 | errno.EPERM  # SECCOMP_RET_ERRNO | EPERM
# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6]
NR_OFFSET, ARCH_OFFSET, ARGS_OFFSET = 0, 4, 16
X32_SYSCALL_BIT = 0x40000000

TIOCSTI, TIOCLINUX = 0x5412, 0x541C
# personality values a normal program may set (or query with 0xffffffff): PER_LINUX,
# PER_LINUX_32BIT, UNAME26 and both.
PERSONALITIES = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)

BLOCKED = (
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "bpf",
    "perf_event_open", "lookup_dcookie", "syslog", "_sysctl", "quotactl", "acct", "swapon",
    "swapoff", "reboot", "uselib", "iopl", "ioperm", "vhangup",
    "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
    "add_key", "request_key", "keyctl",
    "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "open_by_handle_at", "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "name_to_handle_at", "move_pages", "get_mempolicy", "set_mempolicy", "open_tree",
    "fsconfig", "mount_setattr", "sysfs", "ustat",
)

# (AUDIT_ARCH_*, syscall numbers); calls an architecture does not have are simply absent.
ARCHITECTURES: dict[str, tuple[int, dict[str, int]]] = {
    "x86_64": (0xC000003E, {
        "ioctl": 16, "ptrace": 101, "syslog": 103, "uselib": 134, "personality": 135,
        "vhangup": 153, "_sysctl": 156, "adjtimex": 159, "acct": 163, "settimeofday": 164,
        "swapon": 167, "swapoff": 168, "reboot": 169, "iopl": 172, "ioperm": 173,
        "init_module": 175, "delete_module": 176, "quotactl": 179, "lookup_dcookie": 212,
        "clock_settime": 227, "kexec_load": 246, "add_key": 248, "request_key": 249,
        "keyctl": 250, "perf_event_open": 298, "open_by_handle_at": 304, "clock_adjtime": 305,
        "process_vm_readv": 310, "process_vm_writev": 311, "kcmp": 312, "finit_module": 313,
        "kexec_file_load": 320, "bpf": 321, "userfaultfd": 323, "io_uring_setup": 425,
        "io_uring_enter": 426, "io_uring_register": 427,
        "ustat": 136, "sysfs": 139, "set_mempolicy": 238, "get_mempolicy": 239,
        "move_pages": 279, "name_to_handle_at": 303, "open_tree": 428, "fsconfig": 431,
        "mount_setattr": 442, "pidfd_getfd": 438}),
    "aarch64": (0xC00000B7, {
        "lookup_dcookie": 18, "ioctl": 29, "vhangup": 58, "quotactl": 60, "acct": 89,
        "personality": 92, "kexec_load": 104, "init_module": 105, "delete_module": 106,
        "clock_settime": 112, "syslog": 116, "ptrace": 117, "reboot": 142,
        "settimeofday": 170, "adjtimex": 171, "add_key": 217, "request_key": 218,
        "keyctl": 219, "swapon": 224, "swapoff": 225, "perf_event_open": 241,
        "open_by_handle_at": 265, "clock_adjtime": 266, "process_vm_readv": 270,
        "process_vm_writev": 271, "kcmp": 272, "finit_module": 273, "bpf": 280,
        "userfaultfd": 282, "kexec_file_load": 294, "io_uring_setup": 425,
        "io_uring_enter": 426, "io_uring_register": 427,
        "get_mempolicy": 236, "set_mempolicy": 237, "move_pages": 239, "name_to_handle_at": 264,
        "open_tree": 428, "fsconfig": 431, "mount_setattr": 442, "pidfd_getfd": 438}),  # no sysfs, ustat here
}


class SeccompUnsupported(RuntimeError):
    pass


class _Program:
    """A tiny assembler: instructions with jumps to labels, resolved at the end."""

    def __init__(self) -> None:
        self.code: list[tuple[int, object, object, int]] = []
        self.labels: dict[str, int] = {}

    def load(self, offset: int) -> None:
        self.code.append((LD_W_ABS, 0, 0, offset))

    def jump(self, opcode: int, value: int, if_true: str | int = 0, if_false: str | int = 0) -> None:
        """Compare the loaded word with value; a label, or 0 for the next instruction."""
        self.code.append((opcode, if_true, if_false, value))

    def ret(self, value: int) -> None:
        self.code.append((RET_K, 0, 0, value))

    def label(self, name: str) -> None:
        self.labels[name] = len(self.code)

    def assemble(self) -> bytes:
        out = b""
        for index, (opcode, if_true, if_false, value) in enumerate(self.code):
            offsets = [self.labels[t] - index - 1 if isinstance(t, str) else int(t)
                       for t in (if_true, if_false)]
            if not all(0 <= o <= 255 for o in offsets):
                raise ValueError("seccomp program: jump out of range")
            out += struct.pack("=HBBI", opcode, offsets[0], offsets[1], value)
        return out


def program(machine: str | None = None) -> bytes:
    """The filter for this (or the named) architecture, as struct sock_filter[]."""
    machine = machine or platform.machine()
    if machine not in ARCHITECTURES:
        raise SeccompUnsupported(f"no seccomp filter for {machine}")
    audit_arch, numbers = ARCHITECTURES[machine]
    bpf = _Program()
    bpf.load(ARCH_OFFSET)
    bpf.jump(JEQ_K, audit_arch, if_false="deny")  # another ABI's numbers mean other calls
    bpf.load(NR_OFFSET)
    if machine == "x86_64":
        bpf.jump(JGE_K, X32_SYSCALL_BIT, if_true="deny")
    for name in BLOCKED:
        if name in numbers:
            bpf.jump(JEQ_K, numbers[name], if_true="deny")
    bpf.jump(JEQ_K, numbers["ioctl"], if_true="ioctl")
    bpf.jump(JEQ_K, numbers["personality"], if_true="personality")
    bpf.ret(RET_ALLOW)

    bpf.label("ioctl")  # ioctl(fd, request): the request's low 32 bits are what counts
    bpf.load(ARGS_OFFSET + 8)
    bpf.jump(JEQ_K, TIOCSTI, if_true="deny")
    bpf.jump(JEQ_K, TIOCLINUX, if_true="deny")
    bpf.ret(RET_ALLOW)

    bpf.label("personality")
    bpf.load(ARGS_OFFSET)
    for allowed in PERSONALITIES:
        bpf.jump(JEQ_K, allowed, if_true="allow")
    bpf.label("deny")
    bpf.ret(RET_EPERM)
    bpf.label("allow")
    bpf.ret(RET_ALLOW)
    return bpf.assemble()


def program_fd() -> int:
    """A readable fd holding the program (for bwrap --seccomp; the caller closes it)."""
    code = program()
    read, write = os.pipe()  # a few hundred bytes: fits the pipe buffer
    with os.fdopen(write, "wb") as pipe:
        pipe.write(code)
    return read
