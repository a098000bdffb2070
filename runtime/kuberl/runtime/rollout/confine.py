"""Kernel-enforced confinement of the sandbox's child process (runtime/kuberl/runtime/rollout/sandbox.py).

Called in the child between fork and exec. Every layer works without a privilege the rollout pod lacks (its
containers run non-root, `allowPrivilegeEscalation: false`, all capabilities dropped), and each is applied when the
kernel has it:

- no_new_privs, and every capability dropped (the bounding set too, so that an exec as root gets none back): a
  tool run as root in a test, or in an image that runs as root, has no CAP_SYS_PTRACE or CAP_DAC_OVERRIDE to read
  other processes' memory and environment.
- Landlock (Linux 5.13+, unprivileged): the file system is read-only and limited to the interpreter, its libraries
  and the system directories (/usr, /lib, /bin); writable only in the run's own directory; nothing else at all, so
  no /proc/<pid>/environ of the agent, no mounted Secret, no service-account token, no checkpoint or work directory.
  From ABI 4, no TCP bind or connect; from ABI 6, no signal to, or abstract socket of, a process outside the sandbox.
- seccomp (no privilege with no_new_privs): socket(), ptrace(), process_vm_readv/writev, bpf, perf_event_open,
  keyrings, userfaultfd, mount, unshare, setns and io_uring fail with EPERM.

The agent process itself calls `protect_process()` at start (PR_SET_DUMPABLE 0), so that no process of the same user
(a tool run in a kernel without Landlock, say) may read its /proc files or attach to it. `probe()` says which layers
this kernel offers; the agent logs it once.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
import struct
import sys
import sysconfig

PR_SET_DUMPABLE = 4
PR_CAPBSET_DROP = 24
PR_SET_SECUREBITS = 28
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
SECBITS_NOROOT_LOCKED = 0x3 | 0xC | 0x30  # NOROOT, NO_SETUID_FIXUP, KEEP_CAPS_LOCKED (with their locks)
CAP_LAST_CAP = 63  # PR_CAPBSET_DROP of an unknown capability fails with EINVAL, ignored
LINUX_CAPABILITY_VERSION_3 = 0x20080522

# Landlock (include/uapi/linux/landlock.h); the syscall numbers are the same on x86_64 and aarch64.
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION = 1
LANDLOCK_RULE_PATH_BENEATH = 1
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
FS_ALL_V1 = (1 << 13) - 1  # EXECUTE .. MAKE_SYM
FS_REFER, FS_TRUNCATE, FS_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1
FILE_RIGHTS = FS_EXECUTE | FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE | FS_IOCTL_DEV  # the rights a rule on a file may hold
READ_ONLY = FS_EXECUTE | FS_READ_FILE | FS_READ_DIR

# seccomp: the system calls refused with EPERM, by architecture (audit arch, syscall numbers).
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO, EPERM = 0x7FFF0000, 0x00050000, 1
DENIED = ("socket", "socketpair", "ptrace", "process_vm_readv", "process_vm_writev", "bpf", "perf_event_open", "keyctl",
          "add_key", "request_key", "userfaultfd", "mount", "unshare", "setns", "kcmp", "io_uring_setup")
SYSCALLS = {
    "x86_64": (0xC000003E, {"socket": 41, "socketpair": 53, "ptrace": 101, "process_vm_readv": 310, "process_vm_writev": 311,
                            "bpf": 321, "perf_event_open": 298, "keyctl": 250, "add_key": 248, "request_key": 249,
                            "userfaultfd": 323, "mount": 165, "unshare": 272, "setns": 308, "kcmp": 312, "io_uring_setup": 425}),
    "aarch64": (0xC00000B7, {"socket": 198, "socketpair": 199, "ptrace": 117, "process_vm_readv": 270, "process_vm_writev": 271,
                             "bpf": 280, "perf_event_open": 241, "keyctl": 219, "add_key": 217, "request_key": 218,
                             "userfaultfd": 282, "mount": 40, "unshare": 97, "setns": 268, "kcmp": 272, "io_uring_setup": 425}),
}
X32_SYSCALL_BIT = 0x40000000


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def protect_process() -> bool:
    """PR_SET_DUMPABLE 0 for this process: its /proc/<pid>/environ, mem and maps become root's, and no process
    without CAP_SYS_PTRACE (a tool run, whatever its user) may read them or attach. True if set."""
    return _libc().prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) == 0


def landlock_abi() -> int:
    """The kernel's Landlock ABI version (0: none, or disabled at boot)."""
    if platform.system() != "Linux":
        return 0
    version = _libc().syscall(SYS_LANDLOCK_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(LANDLOCK_CREATE_RULESET_VERSION))
    return max(version, 0)


def probe() -> list[str]:
    """The layers this kernel and machine offer: e.g. ['capabilities', 'landlock-v7', 'seccomp']."""
    layers = ["capabilities"]
    abi = landlock_abi()
    if abi:
        layers.append(f"landlock-v{abi}")
    if platform.machine() in SYSCALLS:
        layers.append("seccomp")
    return layers


@functools.cache
def read_only_paths() -> tuple[str, ...]:
    """What the interpreter needs to start and import the standard library and installed packages: its prefixes,
    sysconfig's library paths and the system's binaries and shared libraries. Nothing of the work directory, /proc,
    /etc (beyond the loader's cache), /var or /tmp."""
    paths = {sys.base_prefix, sys.prefix, sys.exec_prefix, os.path.dirname(os.path.realpath(sys.executable)),
             "/usr", "/lib", "/lib64", "/bin", "/sbin", "/etc/ld.so.cache", "/etc/localtime"}
    paths |= {p for key in ("stdlib", "platstdlib", "purelib", "platlib") if (p := sysconfig.get_paths().get(key))}
    return tuple(sorted(p for p in paths if p and os.path.exists(p)))


def _landlock(home: str, abi: int) -> None:
    """Restrict this process to reading read_only_paths() and writing under `home`; no TCP, no signals out."""
    libc = _libc()
    fs = FS_ALL_V1 | (FS_REFER if abi >= 2 else 0) | (FS_TRUNCATE if abi >= 3 else 0) | (FS_IOCTL_DEV if abi >= 5 else 0)
    net = NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0
    scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0
    attr = struct.pack("=QQQ", fs, net, scoped) if abi >= 6 else struct.pack("=QQ", fs, net) if abi >= 4 else struct.pack("=Q", fs)
    buf = ctypes.create_string_buffer(attr, len(attr))
    ruleset = libc.syscall(SYS_LANDLOCK_CREATE_RULESET, buf, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset")
    try:
        rules = [(p, READ_ONLY) for p in read_only_paths()] + [(home, fs), ("/dev/null", FS_READ_FILE | FS_WRITE_FILE),
                                                                ("/dev/urandom", FS_READ_FILE)]
        for path, access in rules:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                allowed = access & (FILE_RIGHTS if not os.path.isdir(path) else ~0) & fs
                rule = ctypes.create_string_buffer(struct.pack("=Qi", allowed, fd), 12)
                if libc.syscall(SYS_LANDLOCK_ADD_RULE, ruleset, LANDLOCK_RULE_PATH_BENEATH, rule, ctypes.c_uint32(0)) != 0:
                    raise OSError(ctypes.get_errno(), f"landlock_add_rule {path}")
            finally:
                os.close(fd)
        if libc.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self")
    finally:
        os.close(ruleset)


def _seccomp() -> bool:
    """Install a filter refusing DENIED with EPERM (x32 system calls too); False on an architecture not in SYSCALLS."""
    arch = SYSCALLS.get(platform.machine())
    if arch is None:
        return False
    audit_arch, numbers = arch
    nrs = [numbers[name] for name in DENIED]
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
    prog = [(ld, 0, 0, 4), (jeq, 1, 0, audit_arch), (ret, 0, 0, SECCOMP_RET_ERRNO | EPERM),  # another arch: refuse
            (ld, 0, 0, 0), (jge, len(nrs) + 1, 0, X32_SYSCALL_BIT)]
    prog += [(jeq, len(nrs) - i, 0, nr) for i, nr in enumerate(nrs)]  # a match jumps to the final ERRNO
    prog += [(ret, 0, 0, SECCOMP_RET_ALLOW), (ret, 0, 0, SECCOMP_RET_ERRNO | EPERM)]
    # Each jeq at index i (of the nrs block) jumps over the rest of the block and the ALLOW to the last instruction.
    raw = b"".join(struct.pack("=HBBI", code, jt, jf, k) for code, jt, jf, k in prog)
    filters = ctypes.create_string_buffer(raw, len(raw))
    fprog = struct.pack("@HP", len(prog), ctypes.addressof(filters))  # struct sock_fprog {unsigned short; filter *}
    fbuf = ctypes.create_string_buffer(fprog, len(fprog))
    if _libc().prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, fbuf, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "seccomp")
    return True


def _drop_capabilities() -> None:
    """Empty the bounding set (needs CAP_SETPCAP: only a process that has capabilities has any to drop), lock
    root's exec-time grant off, then empty the effective, permitted and inheritable sets."""
    libc = _libc()
    for cap in range(CAP_LAST_CAP + 1):
        libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
    libc.prctl(PR_SET_SECUREBITS, SECBITS_NOROOT_LOCKED, 0, 0, 0)
    header = ctypes.create_string_buffer(struct.pack("=Ii", LINUX_CAPABILITY_VERSION_3, 0), 8)
    data = ctypes.create_string_buffer(bytes(24), 24)  # two {effective, permitted, inheritable} u32 triples, all zero
    if libc.capset(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def confine(home: str) -> list[str]:
    """In the child before exec: no new privileges, no capabilities, Landlock to `home`, the seccomp filter.
    Returns the layers applied. Raises OSError when a layer the kernel offers cannot be applied (the run must not
    go ahead less confined than probe() promised)."""
    libc = _libc()
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS")
    _drop_capabilities()
    applied = ["capabilities"]
    abi = landlock_abi()
    if abi:
        _landlock(home, abi)
        applied.append(f"landlock-v{abi}")
    if _seccomp():
        applied.append("seccomp")
    return applied
