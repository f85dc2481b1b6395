"""Where a webhook may point: checked at registration and again at every delivery.

A URL must be https in production and every address its host resolves to must be
public: no loopback, private, link-local (cloud metadata lives there), multicast,
reserved or unspecified address, unless JOBS_WEBHOOK_ALLOW_PRIVATE=1 (development and
tests). The delivery connects to the address it checked (no second lookup), so a
name that resolves to a public address at the check and a private one a moment later
(DNS rebinding) is never called.
"""

from __future__ import annotations

import ipaddress
import socket
from urllib.parse import urlsplit

from jobs.conf import settings

# Addresses some clouds serve instance metadata on that are not link-local.
METADATA_ADDRESSES = frozenset({"100.100.100.200", "fd00:ec2::254"})


class UnsafeURL(ValueError):
    """The URL may not be called; the message says why."""


def allow_private() -> bool:
    return bool(settings.JOBS_WEBHOOK_ALLOW_PRIVATE)


# 6to4 (RFC 3056, deprecated by RFC 7526) embeds any IPv4 address, 127.0.0.1 and
# 169.254.169.254 included, and no receiver needs it: the whole prefix is refused.
SIX_TO_FOUR = ipaddress.ip_network("2002::/16")


def _forbidden(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        elif ip in SIX_TO_FOUR or ip.is_site_local:  # fec0::/10: deprecated, not global
            return True
    return (
        not ip.is_global
        or ip.is_multicast
        or ip.is_reserved
        or ip.is_unspecified
        or str(ip) in METADATA_ADDRESSES
    )


def split(url: str) -> tuple[str, str, int, str]:
    """(scheme, host, port, path?query) of an http(s) URL, or UnsafeURL."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise UnsafeURL(f"not a valid URL: {exc}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UnsafeURL("the URL must be http(s)://host/...")
    if parts.username or parts.password:
        raise UnsafeURL("the URL must not carry credentials")
    if settings.PRODUCTION and parts.scheme != "https":
        raise UnsafeURL("the URL must be https")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    return parts.scheme, parts.hostname, port or (443 if parts.scheme == "https" else 80), path


def resolve(host: str, port: int) -> list[str]:
    """The addresses `host` resolves to, every one of them allowed, or UnsafeURL."""
    # One refusal for a name that does not resolve and one that resolves to a forbidden
    # address, naming no address: the message is no oracle for the internal DNS.
    refusal = UnsafeURL(
        f"{host} must resolve to public addresses only (no loopback, private, link-local, "
        "metadata or unresolvable name); JOBS_WEBHOOK_ALLOW_PRIVATE=1 allows private ones"
    )
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        raise refusal from None
    addresses = list(dict.fromkeys(info[4][0] for info in infos))
    if not addresses:
        raise refusal
    if not allow_private() and any(
        _forbidden(ipaddress.ip_address(a.split("%")[0])) for a in addresses
    ):
        raise refusal
    return addresses


def check(url: str) -> list[str]:
    """Raise UnsafeURL unless `url` may be called now; returns its allowed addresses."""
    _, host, port, _ = split(url)
    return resolve(host, port)
