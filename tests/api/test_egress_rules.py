"""Egress allowlist rules: parsing, normalizing, list editing and connection decisions (pure, no sandbox)."""

from __future__ import annotations

import ipaddress

import pytest

from sandbox_kernel.api.egress_rules import (
    DENY_ALL,
    Decision,
    EgressRuleError,
    Rule,
    add,
    decide,
    is_allow_all,
    missing,
    non_public_reason,
    normalize,
    parse,
    remove,
    screen_name,
    validate,
)


def ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return ipaddress.ip_address(text)


# -- valid rules --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("rule", "normal", "kind", "port"), [
    ("api.example.com", "api.example.com", "host", None),
    ("API.Example.COM.", "api.example.com", "host", None),
    ("api.example.com:443", "api.example.com:443", "host", 443),
    ("Example.com.:0443", "example.com:443", "host", 443),
    ("localhost", "localhost", "host", None),
    ("xn--bcher-kva.de", "xn--bcher-kva.de", "host", None),
    ("a-b.c9.io:65535", "a-b.c9.io:65535", "host", 65535),
    ("*.example.com", "*.example.com", "wildcard", None),
    ("*.Example.com.:443", "*.example.com:443", "wildcard", 443),
    ("10.1.2.3", "10.1.2.3", "ip", None),
    ("10.1.2.3:8080", "10.1.2.3:8080", "ip", 8080),
    ("2001:DB8:0:0::1", "2001:db8::1", "ip", None),
    ("[2001:db8::1]", "2001:db8::1", "ip", None),
    ("[2001:db8::1]:443", "[2001:db8::1]:443", "ip", 443),
    ("10.0.0.0/8", "10.0.0.0/8", "cidr", None),
    ("10.0.0.0/8:5432", "10.0.0.0/8:5432", "cidr", 5432),
    ("10.1.2.3/32", "10.1.2.3/32", "cidr", None),
    ("2001:DB8::/32", "2001:db8::/32", "cidr", None),
    ("[2001:db8::/32]:443", "[2001:db8::/32]:443", "cidr", 443),
])
def test_valid_rules_normalize(rule: str, normal: str, kind: str, port: int | None) -> None:
    parsed = parse(rule)
    assert (parsed.kind, parsed.port) == (kind, port)
    assert normalize(rule) == normal
    assert normalize(normal) == normal  # idempotent


def test_host_name_length_limits() -> None:
    label = "a" * 63
    name = ".".join([label] * 3 + ["b" * 61])  # 253 characters
    assert len(name) == 253 and normalize(name + ".") == name
    assert str(pytest.raises(EgressRuleError, normalize, name + "b").value) == (
        f"invalid egress rule '{name}b': host name longer than 253 characters")


# -- malformed rules ----------------------------------------------------------------------------------------------

BAD = "not a host name, IP address or CIDR"
ALONE = "'*' (allow all) is only valid as the whole list ['*']"


@pytest.mark.parametrize(("rule", "message"), [
    ("exa mple.com", f"invalid egress rule 'exa mple.com': {BAD}"),
    ("h:99999", "invalid egress rule 'h:99999': port must be 1-65535"),
    ("h:0", "invalid egress rule 'h:0': port must be 1-65535"),
    ("h:", "invalid egress rule 'h:': port must be 1-65535"),
    ("h:+80", "invalid egress rule 'h:+80': port must be 1-65535"),
    ("h:https", "invalid egress rule 'h:https': port must be 1-65535"),
    ("h:80:81", "invalid egress rule 'h:80:81': " + BAD),
    ("10.0.0.0/33", "invalid egress rule '10.0.0.0/33': bad CIDR"),
    ("10.0.0.0/x", "invalid egress rule '10.0.0.0/x': bad CIDR"),
    ("2001:db8::/129", "invalid egress rule '2001:db8::/129': bad CIDR"),
    ("10.0.0.1/8", "invalid egress rule '10.0.0.1/8': bad CIDR: host bits set, did you mean 10.0.0.0/8"),
    ("", "invalid egress rule '': empty rule"),
    (" example.com", "invalid egress rule ' example.com': leading or trailing whitespace"),
    ("example.com\n", "invalid egress rule 'example.com\\n': leading or trailing whitespace"),
    ("https://x.com", "invalid egress rule 'https://x.com': URL scheme not allowed: give a host name"),
    ("x.com/a", "invalid egress rule 'x.com/a': paths not allowed: give a host name"),
    ("user@x.com", "invalid egress rule 'user@x.com': user info not allowed: give a host name"),
    ("*", f"invalid egress rule '*': {ALONE}"),
    ("*.", f"invalid egress rule '*.': {BAD}"),
    ("a.*.com", "invalid egress rule 'a.*.com': wildcards must be a leading '*.' as in *.example.com"),
    ("*example.com", "invalid egress rule '*example.com': wildcards must be a leading '*.' as in *.example.com"),
    ("**.example.com", "invalid egress rule '**.example.com': wildcards must be a leading '*.' as in *.example.com"),
    ("-a.com", f"invalid egress rule '-a.com': {BAD}"),
    ("a-.com", f"invalid egress rule 'a-.com': {BAD}"),
    ("a..com", f"invalid egress rule 'a..com': {BAD}"),
    ("under_score.com", f"invalid egress rule 'under_score.com': {BAD}"),
    ("a" * 64 + ".com", f"invalid egress rule '{'a' * 64}.com': {BAD}"),
    ("1.2.3.999", f"invalid egress rule '1.2.3.999': {BAD}"),
    ("bücher.de", "invalid egress rule 'bücher.de': non-ASCII host name: use its IDNA (xn--) form"),
    ("[10.0.0.1]:80", "invalid egress rule '[10.0.0.1]:80': brackets are only for IPv6 addresses"),
    ("[example.com]:80", "invalid egress rule '[example.com]:80': brackets are only for IPv6 addresses"),
    ("[2001:db8::1]443", "invalid egress rule '[2001:db8::1]443': bad bracketed IPv6 address: use [addr]:port"),
    ("[2001:db8::1", "invalid egress rule '[2001:db8::1': bad bracketed IPv6 address: use [addr]:port"),
    ("[2001:db8::1]:0", "invalid egress rule '[2001:db8::1]:0': port must be 1-65535"),
    ("fe80::1%eth0", "invalid egress rule 'fe80::1%eth0': IPv6 zone ids are not allowed"),
    ("2001:db8::zz", f"invalid egress rule '2001:db8::zz': {BAD}"),
])
def test_malformed_rules_have_one_line_messages(rule: str, message: str) -> None:
    with pytest.raises(EgressRuleError) as info:
        normalize(rule)
    assert str(info.value) == message
    assert "\n" not in str(info.value)
    assert info.value.rule == rule


def test_non_string_rule() -> None:
    assert str(pytest.raises(EgressRuleError, normalize, 443).value) == (
        "invalid egress rule 443: rule must be a string")


# -- lists --------------------------------------------------------------------------------------------------------


def test_validate_allow_all_forms_and_dedupe() -> None:
    assert validate(None) == [] and validate([]) == [] and validate(["*"]) == []
    assert is_allow_all(None) and is_allow_all([]) and is_allow_all(["*"]) and not is_allow_all(["a.com"])
    assert validate(["B.com", "a.com:443", "b.com.", "[2001:DB8::1]:443"]) == ["b.com", "a.com:443",
                                                                              "[2001:db8::1]:443"]


def test_validate_raises_on_first_bad_rule_and_star_mixed() -> None:
    assert str(pytest.raises(EgressRuleError, validate, ["ok.com", "h:0", "bad one"]).value) == (
        "invalid egress rule 'h:0': port must be 1-65535")
    assert str(pytest.raises(EgressRuleError, validate, ["*", "a.com"]).value) == (
        f"invalid egress rule '*': {ALONE}")
    with pytest.raises(EgressRuleError):
        validate("a.com")  # type: ignore[arg-type]  # a bare string is not a list


def test_add_appends_normalized_without_duplicates_in_order() -> None:
    rules = add(None, "B.com")
    assert rules == ["b.com"]  # adding to allow-all makes an allowlist
    rules = add(rules, ["a.com:443", "b.com.", "A.com:443", "10.0.0.0/8"])
    assert rules == ["b.com", "a.com:443", "10.0.0.0/8"]
    assert add(rules, "a.com") == ["b.com", "a.com:443", "10.0.0.0/8", "a.com"]  # a.com != a.com:443
    with pytest.raises(EgressRuleError):
        add(rules, "*")


def test_remove_and_missing() -> None:
    rules = ["b.com", "a.com:443", "10.0.0.0/8", "2001:db8::1"]
    assert remove(rules, ["A.COM:443", "2001:DB8:0::1", "nothere.com"]) == ["b.com", "10.0.0.0/8"]
    assert remove(rules, "a.com") == rules  # port-less a.com is a different rule
    assert missing(rules, ["nothere.com", "A.com:443", "NotHere.com.", "a.com"]) == ["nothere.com", "a.com"]
    assert missing(rules, "b.com") == []
    assert remove(["b.com"], "b.com") == []  # the caller must note that [] means allow all
    with pytest.raises(EgressRuleError):
        remove(rules, "bad rule")


# -- decisions: allow-all -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("address", ["93.184.216.34", "1.1.1.1", "2606:4700:4700::1111", "::ffff:8.8.8.8"])
@pytest.mark.parametrize("rules", [None, [], ["*"]])
def test_allow_all_allows_public(rules: list[str] | None, address: str) -> None:
    decision = decide(rules, "example.com", ip(address), 443)
    assert decision.allowed and decision.rule is None
    assert decision.reason.startswith("allow-all: example.com:443")


@pytest.mark.parametrize(("address", "why"), [
    ("127.0.0.1", "loopback"),
    ("127.8.9.10", "loopback"),
    ("::1", "loopback"),
    ("10.2.3.4", "private"),
    ("172.16.0.1", "private"),
    ("172.31.255.254", "private"),
    ("192.168.1.1", "private"),
    ("169.254.169.254", "link-local"),
    ("fe80::1", "link-local"),
    ("fc00::1", "private"),
    ("fd12:3456::1", "private"),
    ("100.64.0.1", "shared (100.64.0.0/10)"),
    ("100.127.255.254", "shared (100.64.0.0/10)"),
    ("0.0.0.0", "unspecified"),
    ("::", "unspecified"),
    ("224.0.0.1", "multicast"),
    ("ff02::1", "multicast"),
    ("::ffff:127.0.0.1", "IPv4-mapped loopback"),
    ("::ffff:10.0.0.1", "IPv4-mapped private"),
    ("2002:7f00:1::", "6to4 for 127.0.0.1 (loopback)"),
    ("64:ff9b::a00:1", "NAT64 for 10.0.0.1 (private)"),
])
def test_allow_all_denies_non_public(address: str, why: str) -> None:
    assert non_public_reason(ip(address)) == why
    decision = decide(None, None, ip(address), 80)
    assert not decision.allowed
    assert decision.reason == (
        f"allow-all covers public destinations only; {ip(address)} is {why}: add an explicit rule")


@pytest.mark.parametrize("address", ["240.0.0.1", "255.255.255.255", "192.0.2.1", "2001:db8::1"])
def test_allow_all_denies_reserved_and_documentation_ranges(address: str) -> None:
    assert not decide([], None, ip(address), 80).allowed


# -- decisions: rules ---------------------------------------------------------------------------------------------


def test_host_rule_matches_requested_name_only() -> None:
    rules = ["api.example.com"]
    ok = decide(rules, "API.example.com.", ip("93.184.216.34"), 443)
    assert ok == Decision(True, "allowed by rule 'api.example.com'", "api.example.com")
    # the same address as an IP literal, or under another name, is not allowed by a host rule
    assert decide(rules, None, ip("93.184.216.34"), 443) == Decision(False, "no rule allows 93.184.216.34:443")
    assert decide(rules, "93.184.216.34", ip("93.184.216.34"), 443).allowed is False
    assert decide(rules, "[2606:4700::1]", ip("2606:4700::1"), 443).allowed is False
    other = decide(rules, "evil.example.net", ip("93.184.216.34"), 443)
    assert other == Decision(False, "no rule allows evil.example.net:443 (93.184.216.34)")
    assert not decide(rules, "xapi.example.com", ip("93.184.216.34"), 443).allowed
    assert not decide(rules, "a.api.example.com", ip("93.184.216.34"), 443).allowed


def test_host_rule_may_reach_private_addresses() -> None:
    assert decide(["db.internal"], "db.internal", ip("10.0.0.5"), 5432).allowed


def test_wildcard_depth_and_apex() -> None:
    rules = ["*.example.com"]
    for name in ["a.example.com", "a.b.example.com", "x.y.z.EXAMPLE.com."]:
        assert decide(rules, name, ip("93.184.216.34"), 443).allowed, name
    for name in ["example.com", "badexample.com", "example.com.evil.net"]:
        assert not decide(rules, name, ip("93.184.216.34"), 443).allowed, name
    assert not decide(rules, None, ip("93.184.216.34"), 443).allowed


def test_port_matching() -> None:
    rules = ["api.example.com:443", "*.cdn.net:8443", "any.example.com"]
    assert decide(rules, "api.example.com", ip("1.2.3.4"), 443).allowed
    assert decide(rules, "api.example.com", ip("1.2.3.4"), 80) == Decision(
        False, "no rule allows api.example.com:80 (1.2.3.4)")
    assert decide(rules, "a.cdn.net", ip("1.2.3.4"), 8443).allowed
    assert not decide(rules, "a.cdn.net", ip("1.2.3.4"), 443).allowed
    assert decide(rules, "any.example.com", ip("1.2.3.4"), 22).allowed
    assert decide(rules, "any.example.com", ip("1.2.3.4"), 65535).allowed


def test_ip_rules() -> None:
    rules = ["10.1.2.3:8080", "2001:db8::1"]
    assert decide(rules, None, ip("10.1.2.3"), 8080).rule == "10.1.2.3:8080"
    assert not decide(rules, None, ip("10.1.2.3"), 8081).allowed
    assert decide(rules, None, ip("2001:db8::1"), 22).allowed
    assert decide(rules, None, ip("::ffff:10.1.2.3"), 8080).allowed  # IPv4-mapped matches its IPv4 rule
    # an ip rule matches the resolved address whatever name was asked for
    assert decide(rules, "peer.local", ip("10.1.2.3"), 8080).allowed


def test_cidr_rules_v4_and_v6() -> None:
    rules = ["10.0.0.0/8:5432", "2001:db8::/32", "[2001:db8:1::/48]:443", "192.168.0.0/16"]
    assert decide(rules, None, ip("10.255.0.1"), 5432).reason == "allowed by rule '10.0.0.0/8:5432'"
    assert not decide(rules, None, ip("10.255.0.1"), 5433).allowed
    assert not decide(rules, None, ip("11.0.0.1"), 5432).allowed
    assert decide(rules, None, ip("2001:db8:ffff::1"), 80).allowed
    assert not decide(rules, None, ip("2001:db9::1"), 80).allowed
    assert decide(rules, "h.lan", ip("192.168.3.4"), 80).allowed
    assert not decide(["10.0.0.0/8"], None, ip("::a00:1"), 80).allowed  # IPv6 never matches an IPv4 rule unmapped


def test_explicit_loopback_rule_allows_only_its_port() -> None:
    rules = ["127.0.0.1:8888"]
    assert decide(rules, None, ip("127.0.0.1"), 8888) == Decision(True, "allowed by rule '127.0.0.1:8888'",
                                                                   "127.0.0.1:8888")
    assert decide(rules, None, ip("127.0.0.1"), 9999) == Decision(False, "no rule allows 127.0.0.1:9999")
    assert decide(rules, "localhost", ip("127.0.0.1"), 8888).allowed
    assert not decide(rules, None, ip("::1"), 8888).allowed


def test_decide_with_rule_objects_and_bad_rules() -> None:
    assert decide([parse("*.example.com")], "a.example.com", ip("1.2.3.4"), 1).allowed
    assert isinstance(parse("x.com"), Rule)
    with pytest.raises(EgressRuleError):
        decide(["ok.com", "bad rule"], "x.com", ip("1.2.3.4"), 443)
    with pytest.raises(EgressRuleError):
        decide(["*", "ok.com"], "x.com", ip("1.2.3.4"), 443)


# -- deciding a name before resolving it ---------------------------------------------------------------------------


@pytest.mark.parametrize(("rules", "name", "port", "refused"), [
    ([DENY_ALL], "example.com", 443, "all egress is blocked (block-all)"),
    ([], "example.com", 443, None),  # allow-all: the addresses say whether it is public
    (["example.com"], "example.com", 443, None),
    (["example.com:80"], "example.com", 443, "no rule allows example.com:443"),
    (["*.example.com"], "a.b.example.com", 443, None),
    (["*.example.com"], "example.com", 443, "no rule allows example.com:443"),
    (["other.com", "10.0.0.0/8"], "example.com", 443, None),  # a CIDR rule needs the addresses
    (["other.com", "10.0.0.0/8:22"], "example.com", 443, "no rule allows example.com:443"),
    (["Other.COM."], "other.com", 1, None),
])
def test_screen_name(rules: list[str], name: str, port: int, refused: str | None) -> None:
    decision = screen_name(validate(rules), name, port)
    assert (decision.reason if decision else None) == refused
    assert decision is None or not decision.allowed


def test_deny_all_allows_nothing_not_even_its_own_address() -> None:
    for address in ("192.0.2.1", "127.0.0.1", "8.8.8.8"):
        assert decide([DENY_ALL], None, ip(address), 9) == Decision(False, "all egress is blocked (block-all)")
    assert decide([DENY_ALL, "example.com"], "example.com", ip("8.8.8.8"), 9).allowed
