"""No network for the chapters under test: the notebook tests put this folder on PYTHONPATH, so every Python
process they start (each chapter's kernel) imports it and any connection or name lookup that would leave the
machine fails at once.  Loopback stays open: the kernel talks to papermill over 127.0.0.1."""

import ipaddress
import socket

MESSAGE = "network access refused under the sphereml tests (nothing may download at test time)"


def _is_local(host) -> bool:
    if host in (None, "", "localhost", b"localhost"):
        return True
    try:
        return ipaddress.ip_address(host.decode() if isinstance(host, bytes) else host).is_loopback
    except ValueError:
        return False


def _guard(method):
    def guarded(self, address, *args, **kwargs):
        if self.family in (socket.AF_INET, socket.AF_INET6) and not _is_local(address[0]):
            raise OSError(f"{MESSAGE}: {address!r}")
        return method(self, address, *args, **kwargs)

    return guarded


def _guard_lookup(lookup):
    def guarded(host, *args, **kwargs):
        if not _is_local(host):
            raise socket.gaierror(f"{MESSAGE}: {host!r}")
        return lookup(host, *args, **kwargs)

    return guarded


socket.socket.connect = _guard(socket.socket.connect)
socket.socket.connect_ex = _guard(socket.socket.connect_ex)
socket.getaddrinfo = _guard_lookup(socket.getaddrinfo)
socket.gethostbyname = _guard_lookup(socket.gethostbyname)
