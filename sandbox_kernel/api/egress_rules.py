"""Egress allowlist rules: parsing, normalizing and deciding (CreateOS API §6).

Semantics
---------
* ``[DENY_ALL]`` means **deny all**: CreateOS has no denylist and reads an empty list as allow all, so the kernel
  writes "block everything" as the one rule ``192.0.2.1:9`` (the discard port of a documentation address, which
  nothing answers). The local engine treats that list as what it stands for: no connection at all, not even to
  that address.
* ``None``, ``[]`` and ``["*"]`` mean **allow all**. ``"*"`` is only valid as the whole list; mixed with other
  rules it is an error. Allow-all covers **public** destinations only: loopback, private, link-local, multicast,
  reserved, unspecified, shared (100.64.0.0/10) and other non-global addresses, including IPv4-mapped, 6to4,
  Teredo and NAT64 (64:ff9b::/96) forms of them, are refused unless a rule allows them explicitly. An IPv4-mapped
  address (``::ffff:a.b.c.d``) is judged as its IPv4 form.
* A non-empty list is **deny by default**: a connection is allowed when any rule matches it.
* Rule forms (a rule without a port matches every port):

  ==========================  =====================================================
  ``api.example.com``         that host name, any port
  ``api.example.com:443``     that host name, port 443
  ``*.example.com[:443]``     any subdomain at any depth (``a.example.com``,
                              ``a.b.example.com``) but **not** ``example.com`` itself
  ``10.1.2.3[:8080]``         that IPv4 address
  ``2001:db8::1``             that IPv6 address (any port)
  ``[2001:db8::1]:443``       IPv6 address with a port (brackets required)
  ``10.0.0.0/8[:5432]``       IPv4 CIDR, optional port
  ``2001:db8::/32``           IPv6 CIDR; with a port: ``[2001:db8::/32]:443``
  ==========================  =====================================================

* Host names are case-insensitive, a trailing dot is ignored, labels are ``[a-z0-9-]`` of 1-63 characters without
  a leading or trailing hyphen, the whole name is at most 253 characters, and the last label is not all digits (so
  ``1.2.3.999`` is not mistaken for a host). Non-ASCII names must be given in their ``xn--`` form.
* CIDRs with host bits set (``10.0.0.1/8``) are **rejected** rather than silently widened; the message suggests the
  network. ``10.1.2.3/32`` stays a CIDR in its normal form (it is not rewritten to ``10.1.2.3``).
* Host and wildcard rules match the host name the client **asked for**, never the resolved address: connecting by IP
  literal can only be allowed by an IP/CIDR rule, and a host rule cannot be bypassed by reaching the host's address
  under another name. IP and CIDR rules match the address the proxy will connect to (for an IP-literal request that
  is the literal itself); an IPv4-mapped IPv6 address also matches as its IPv4 form. Explicit rules may reach
  private and loopback destinations (note: a host rule therefore allows whatever that name resolves to).

Malformed rules raise :class:`EgressRuleError`, whose ``str()`` is one line naming the rule and the reason.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import re
import urllib.parse
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, Union

__all__ = [
    "Decision",
    "EgressRuleError",
    "Rule",
    "add",
    "DENY_ALL",
    "presets",
    "decide",
    "expand_presets",
    "is_allow_all",
    "is_deny_all",
    "missing",
    "non_public_reason",
    "normalize",
    "parse",
    "remove",
    "screen_name",
    "validate",
]

IPAddress = Union[ipaddress.IPv4Address, ipaddress.IPv6Address]
IPNetwork = Union[ipaddress.IPv4Network, ipaddress.IPv6Network]
RuleKind = Literal["host", "wildcard", "ip", "cidr"]

ALLOW_ALL = "*"
DENY_ALL = "192.0.2.1:9"
_DENY_ALL_REASON = "all egress is blocked (block-all)"
_LABEL = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
_PORT = re.compile(r"[0-9]+")
_SHARED = ipaddress.IPv4Network("100.64.0.0/10")
_NAT64 = ipaddress.IPv6Network("64:ff9b::/96")
_GENERIC = "not a host name, IP address or CIDR"



@functools.cache
def presets() -> dict[str, tuple[str, ...]]:
    """Named rule sets, for the magic's `%egress allow NAME`: a package index is more than one
    host (its pages, its file host), and a client refused one of them fails without naming the
    next, so allowing them one refusal at a time took one failed install per host.

    `pypi` is the index pip on this machine uses: the one set in PIP_INDEX_URL and
    PIP_EXTRA_INDEX_URL (a company mirror), else pip's own default index and file host, as pip
    itself names them (no host is spelled here). Without pip, there is no such preset."""
    configured = " ".join(os.environ.get(name, "") for name in ("PIP_INDEX_URL", "PIP_EXTRA_INDEX_URL")).split()
    hosts = [urllib.parse.urlsplit(url).netloc.rpartition("@")[2] for url in configured]
    if not hosts:
        try:
            from pip._internal.models.index import PyPI  # pip's default index, as pip names it
        except ImportError:
            return {}
        hosts = [PyPI.netloc, PyPI.file_storage_domain]
    return {"pypi": tuple(dict.fromkeys(host if ":" in host else f"{host}:443" for host in hosts if host))}


class EgressRuleError(ValueError):
    """A malformed egress rule. ``str()`` is one line: ``invalid egress rule '<rule>': <reason>``."""

    def __init__(self, rule: object, reason: str) -> None:
        self.rule = rule
        self.reason = reason
        super().__init__(f"invalid egress rule {rule!r}: {reason}")


@dataclass(frozen=True)
class Rule:
    """One parsed rule. ``host`` is set for host/wildcard rules (for wildcards, the suffix after ``*.``);
    ``network`` for ip/cidr rules (an ip rule is a /32 or /128 network); ``port`` is None for any port."""

    kind: RuleKind
    host: str | None = None
    network: IPNetwork | None = None
    port: int | None = None

    def __str__(self) -> str:
        if self.kind == "host":
            base = str(self.host)
        elif self.kind == "wildcard":
            base = f"*.{self.host}"
        else:
            assert self.network is not None
            base = str(self.network.network_address) if self.kind == "ip" else str(self.network)
            if self.port is not None and self.network.version == 6:
                return f"[{base}]:{self.port}"
        return base if self.port is None else f"{base}:{self.port}"

    def names(self, hostname: str | None) -> bool:
        """Whether this host or wildcard rule names ``hostname`` (normalized; None for an IP literal)."""
        if self.kind == "host":
            return hostname == self.host
        return self.kind == "wildcard" and hostname is not None and hostname.endswith("." + str(self.host))

    def matches(self, hostname: str | None, address: IPAddress, port: int) -> bool:
        """Whether this rule allows a connection (``hostname`` already normalized, None for an IP literal)."""
        if self.port is not None and self.port != port:
            return False
        if self.kind in ("host", "wildcard"):
            return self.names(hostname)
        assert self.network is not None
        mapped = address.ipv4_mapped if isinstance(address, ipaddress.IPv6Address) else None
        return any(a is not None and a.version == self.network.version and a in self.network for a in (address, mapped))


@dataclass(frozen=True)
class Decision:
    """The verdict for one connection attempt; ``rule`` is the normalized rule that allowed it, if any."""

    allowed: bool
    reason: str
    rule: str | None = None


# -- parsing ------------------------------------------------------------------------------------------------------


def _port(rule: str, text: str) -> int:
    if not _PORT.fullmatch(text) or not 1 <= int(text) <= 65535:
        raise EgressRuleError(rule, "port must be 1-65535")
    return int(text)


def _ip_rule(rule: str, text: str, port: int | None, *, v6_only: bool = False) -> Rule | None:
    """Parse ``text`` as an IP address or CIDR; None when it is neither (so it may be a host name)."""
    if "%" in text:
        raise EgressRuleError(rule, "IPv6 zone ids are not allowed")
    if "/" in text:
        addr, _, prefix = text.partition("/")
        try:
            ipaddress.ip_address(addr)
        except ValueError:
            return None
        if not prefix.isdigit() or not prefix.isascii():
            raise EgressRuleError(rule, "bad CIDR")
        try:
            net = ipaddress.ip_network(text, strict=False)
        except ValueError:
            raise EgressRuleError(rule, "bad CIDR") from None
        if net.network_address != ipaddress.ip_address(addr):
            raise EgressRuleError(rule, f"bad CIDR: host bits set, did you mean {net}")
        kind: RuleKind = "cidr"
    else:
        try:
            net = ipaddress.ip_network(text)
        except ValueError:
            return None
        kind = "ip"
    if v6_only and net.version != 6:
        raise EgressRuleError(rule, "brackets are only for IPv6 addresses")
    return Rule(kind, network=net, port=port)


def _host(rule: str, text: str) -> str:
    if not text.isascii():
        raise EgressRuleError(rule, "non-ASCII host name: use its IDNA (xn--) form")
    host = text.lower()
    if host.endswith("."):
        host = host[:-1]
    labels = host.split(".")
    if not host or not all(_LABEL.fullmatch(label) for label in labels) or labels[-1].isdigit():
        raise EgressRuleError(rule, _GENERIC)
    if len(host) > 253:
        raise EgressRuleError(rule, "host name longer than 253 characters")
    return host


def parse(rule: str) -> Rule:
    """Parse one rule (not ``"*"``, which is only meaningful as a whole list); raises :class:`EgressRuleError`."""
    if not isinstance(rule, str):
        raise EgressRuleError(rule, "rule must be a string")
    if not rule:
        raise EgressRuleError(rule, "empty rule")
    if rule != rule.strip():
        raise EgressRuleError(rule, "leading or trailing whitespace")
    if rule == ALLOW_ALL:
        raise EgressRuleError(rule, "'*' (allow all) is only valid as the whole list ['*']")
    if "://" in rule:
        raise EgressRuleError(rule, "URL scheme not allowed: give a host name")
    if "@" in rule:
        raise EgressRuleError(rule, "user info not allowed: give a host name")

    if rule.startswith("["):  # [v6] or [v6]:port or [v6/len]:port
        inner, sep, rest = rule[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise EgressRuleError(rule, "bad bracketed IPv6 address: use [addr]:port")
        port = _port(rule, rest[1:]) if rest else None
        parsed = _ip_rule(rule, inner, port, v6_only=True)
        if parsed is None:
            raise EgressRuleError(rule, "brackets are only for IPv6 addresses")
        return parsed
    if rule.count(":") > 1:  # bare IPv6 address or CIDR, never with a port
        parsed = _ip_rule(rule, rule, None)
        if parsed is None:
            raise EgressRuleError(rule, _GENERIC)
        return parsed

    text, sep, port_text = rule.partition(":")
    port = _port(rule, port_text) if sep else None
    parsed = _ip_rule(rule, text, port)
    if parsed is not None:
        return parsed
    if "/" in text:
        raise EgressRuleError(rule, "paths not allowed: give a host name")
    if text.startswith("*."):
        return Rule("wildcard", host=_host(rule, text[2:]), port=port)
    if "*" in text:
        raise EgressRuleError(rule, "wildcards must be a leading '*.' as in *.example.com")
    return Rule("host", host=_host(rule, text), port=port)


# -- list helpers -------------------------------------------------------------------------------------------------


def normalize(rule: str) -> str:
    """Canonical text of one rule: lowercase host without trailing dot, compressed IPv6, port kept."""
    return str(parse(rule))


def is_allow_all(rules: Sequence[str] | None) -> bool:
    """Whether the list means allow all (``None``, ``[]`` or ``["*"]``)."""
    return not rules or list(rules) == [ALLOW_ALL]


def is_deny_all(rules: Sequence[str | Rule] | None) -> bool:
    """Whether the list is the kernel's encoding of "block everything" (``[DENY_ALL]``)."""
    return [str(rule) for rule in rules or ()] == [DENY_ALL]


def validate(rules: Sequence[str] | None) -> list[str]:
    """Normalize a whole list (``None`` and ``["*"]`` become ``[]``), dropping duplicates and keeping order.
    Raises :class:`EgressRuleError` on the first bad rule."""
    if rules is None or isinstance(rules, str):
        if isinstance(rules, str):
            raise EgressRuleError(rules, "rules must be a list of strings, not one string")
        return []
    if list(rules) == [ALLOW_ALL]:
        return []
    out: list[str] = []
    for rule in rules:
        if rule == ALLOW_ALL:
            raise EgressRuleError(rule, "'*' (allow all) is only valid as the whole list ['*']")
        norm = normalize(rule)
        if norm not in out:
            out.append(norm)
    return out


def expand_presets(rules: Iterable[str]) -> list[str]:
    """The rules with each preset name (:func:`presets`) replaced by its rules, in place."""
    out: list[str] = []
    for rule in rules:
        out.extend(presets().get(rule, (rule,)) if isinstance(rule, str) else (rule,))
    return out


def typed(rules: Iterable[str]) -> list[str]:
    """Rules a person typed (``%egress``, the Sandboxes panel): presets expanded, each
    validated and normalized, with a one-line EgressRuleError naming a bad one."""
    normalized = validate(expand_presets(rules))
    # CreateOS accepts a bare word as a host rule, but typed by a person it is almost always
    # prose (`%egress allow not a rule`): a single-label name must come with a port.
    words = [rule for rule in normalized if _is_bare_word(rule)]
    if words:
        raise NotARuleError(words)
    return normalized


def is_one_destination(target: str) -> bool:
    """Whether `target` (host:port, as a refusal names it) is one destination as a rule: a
    host or an address, never a wildcard or a network. A refusal's target comes from what
    the sandbox asked to reach, so only such a one may become a rule a user adds in one click."""
    try:
        rule = parse(target)
    except EgressRuleError:
        return False
    return rule.kind in ("host", "ip") and str(rule) == target.lower()


class NotARuleError(EgressRuleError):
    """Single words typed as rules (prose, most likely): one line naming them all."""

    def __init__(self, words: list[str]) -> None:
        self.rule, self.reason = words, "a single word is not a host rule"
        ValueError.__init__(self, f"{' '.join(repr(w) for w in words)} is not a rule: give a full host "
                                  "name (example.com), host:port, an IP address or a CIDR")


def _is_bare_word(rule: str) -> bool:
    parsed = parse(rule)
    return (parsed.kind == "host" and parsed.port is None and "." not in str(parsed.host)
            and parsed.host != "localhost")


def allowing(current: Sequence[str] | None, new: Sequence[str]) -> tuple[list[str], bool]:
    """The rules after allowing ``new`` (typed() already), and whether that narrowed what was
    allowed: from block-all, allowing these means only these; from allow-all (no rules) the
    same, which refuses every other public destination from then on."""
    current = list(current or [])
    if current and current != [DENY_ALL]:  # the server's list is normalized: [] is allow-all
        return add(current, new), False
    return list(new), not current


def _many(rules: str | Iterable[str]) -> list[str]:
    return [normalize(r) for r in ([rules] if isinstance(rules, str) else rules)]


def add(rules: Sequence[str] | None, new: str | Iterable[str]) -> list[str]:
    """Append ``new`` rule(s) not already present, keeping order. Note: adding to an empty (allow-all) list turns
    it into a deny-by-default allowlist."""
    out = validate(rules)
    for rule in _many(new):
        if rule not in out:
            out.append(rule)
    return out


def remove(rules: Sequence[str] | None, gone: str | Iterable[str]) -> list[str]:
    """Drop rule(s) equal to ``gone`` after normalizing; rules not present are ignored (see :func:`missing`).
    Note: removing the last rule leaves ``[]``, which means allow all."""
    drop = set(_many(gone))
    return [rule for rule in validate(rules) if rule not in drop]


def missing(rules: Sequence[str] | None, gone: str | Iterable[str]) -> list[str]:
    """The normalized rule(s) of ``gone`` that are not in ``rules`` (in the order given, without duplicates)."""
    present = set(validate(rules))
    out: list[str] = []
    for rule in _many(gone):
        if rule not in present and rule not in out:
            out.append(rule)
    return out


# -- decisions ----------------------------------------------------------------------------------------------------


def _embedded(address: IPAddress) -> list[tuple[str, ipaddress.IPv4Address]]:
    """IPv4 addresses embedded in an IPv6 address, labelled by how (IPv4-mapped, 6to4, Teredo client, NAT64)."""
    if not isinstance(address, ipaddress.IPv6Address):
        return []
    found: list[tuple[str, ipaddress.IPv4Address]] = []
    if address.ipv4_mapped is not None:
        found.append(("IPv4-mapped", address.ipv4_mapped))
    if address.sixtofour is not None:
        found.append(("6to4", address.sixtofour))
    if address.teredo is not None:
        found.append(("Teredo", address.teredo[1]))
    if address in _NAT64:
        found.append(("NAT64", ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)))
    return found


def _own_reason(a: IPAddress) -> str | None:
    checks = [
        (a.is_unspecified, "unspecified"),
        (a.is_loopback, "loopback"),
        (a.is_link_local, "link-local"),
        (a.is_multicast, "multicast"),
        (isinstance(a, ipaddress.IPv4Address) and a in _SHARED, "shared (100.64.0.0/10)"),
        (a.is_private, "private"),
        (a.is_reserved, "reserved"),
        (not a.is_global, "not globally routable"),
    ]
    return next((why for hit, why in checks if hit), None)


def non_public_reason(address: IPAddress) -> str | None:
    """Why ``address`` is not a public destination (e.g. ``"loopback"``, ``"IPv4-mapped loopback"``), or None.
    An IPv4-mapped address is judged by its IPv4 form; other embedded IPv4 forms are checked as well."""
    for how, embedded in _embedded(address):
        why = _own_reason(embedded)
        if why is not None:
            return f"{how} {why}" if how == "IPv4-mapped" else f"{how} for {embedded} ({why})"
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return None
    return _own_reason(address)


def _requested(hostname: str | None) -> str | None:
    """Normalize the requested name; an IP literal (or nothing) gives None, so host rules cannot match it."""
    if not hostname:
        return None
    name = hostname.strip("[]").lower().rstrip(".")
    try:
        ipaddress.ip_address(name.split("%")[0])
    except ValueError:
        return name
    return None


def decide(
    rules: Sequence[str | Rule] | None, hostname: str | None, address: IPAddress, port: int
) -> Decision:
    """Decide a connection to ``address:port`` that the client requested as ``hostname`` (None for an IP literal).
    Rules may be raw or normalized strings, or :class:`Rule` objects. Raises :class:`EgressRuleError` if a rule
    is malformed (including ``"*"`` mixed with other rules)."""
    items = list(rules or [])
    if is_deny_all(items):
        return Decision(False, _DENY_ALL_REASON)
    name = _requested(hostname)
    shown = f"[{address}]" if address.version == 6 else str(address)
    target = f"{shown}:{port}" if name is None else f"{name}:{port} ({address})"
    if items == [ALLOW_ALL] or not items:
        why = non_public_reason(address)
        if why is None:
            return Decision(True, f"allow-all: {target} is public")
        return Decision(False, f"allow-all covers public destinations only; {address} is {why}: add an explicit rule")
    for rule in (r if isinstance(r, Rule) else parse(r) for r in items):
        if rule.matches(name, address, port):
            return Decision(True, f"allowed by rule '{rule}'", str(rule))
    return Decision(False, f"no rule allows {target}")


def screen_name(rules: Sequence[str | Rule] | None, hostname: str, port: int) -> Decision | None:
    """A refusal of ``hostname:port`` decided *before* resolving the name, or None when only its addresses can
    decide. Resolving a name no rule could allow would let a sandbox under ``block-all`` still send data out in
    DNS queries (and receive answers). The order: deny-all refuses everything; allow-all needs the addresses
    (public or not); a host or wildcard rule naming it with a matching port needs them to connect; an IP or CIDR
    rule with a matching port needs them to match; anything else is refused unresolved."""
    items = list(rules or [])
    if is_deny_all(items):
        return Decision(False, _DENY_ALL_REASON)
    if not items or items == [ALLOW_ALL]:
        return None
    name = _requested(hostname)
    for rule in (r if isinstance(r, Rule) else parse(r) for r in items):
        if rule.port is not None and rule.port != port:
            continue
        if rule.kind in ("ip", "cidr") or rule.names(name):
            return None
    return Decision(False, f"no rule allows {name}:{port}")
