"""What `%egress suggest` writes: the narrowest `%egress only` line, exact host:port rules,
names as asked for; and how `%egress learn` charges destinations to cells, within its cap."""

from __future__ import annotations

from typing import Any

from sandbox_kernel.api import EgressDestination, EgressDestinations, egress_rules
from sandbox_kernel.kernel.egress_learning import MAX_DESTINATIONS, EgressLearning, suggested_rules
from sandbox_kernel.kernel.magics.egress import checked
from sandbox_kernel.kernel.output import CellOutput


def test_each_destination_becomes_exactly_its_host_and_port() -> None:
    rules, unspellable = suggested_rules([("api.example.com", 443), ("10.1.2.3", 5432), ("2001:db8::1", 443),
                                          ("Files.Example.ORG", 443), ("api.example.com", 8443)])
    assert rules == ["api.example.com:443", "10.1.2.3:5432", "[2001:db8::1]:443", "files.example.org:443",
                     "api.example.com:8443"]
    assert unspellable == []
    # as narrow as a rule gets: one host or one address, one port; never a wildcard, CIDR or '*'
    for rule in map(egress_rules.parse, rules):
        assert rule.kind in ("host", "ip") and rule.port is not None
    assert checked(rules) == rules  # what %egress itself accepts, unchanged


def test_a_destination_seen_twice_is_one_rule_and_unspellable_names_are_told() -> None:
    rules, unspellable = suggested_rules([("a.example.com", 80), ("A.example.com", 80), ("under_score.example", 80)])
    assert rules == ["a.example.com:80"]
    assert unspellable == ["under_score.example:80"]


def test_a_wildcard_or_cidr_from_the_sandbox_never_becomes_a_broad_rule() -> None:
    """The names come from the sandbox: one that would read as a broad rule is left out."""
    rules, unspellable = suggested_rules([("*.example.com", 443), ("10.0.0.0/8", 22), ("*", 1)])
    assert rules == [] and len(unspellable) == 3


def seen(entries: list[tuple[str, int, int]], dropped: int = 0) -> EgressDestinations:
    return EgressDestinations(id="sb", cap=MAX_DESTINATIONS, dropped=dropped, destinations=[
        EgressDestination(host=host, port=port, allowed=allowed, refused=0) for host, port, allowed in entries])


def test_each_cell_is_charged_with_what_grew_during_it_and_the_cap_is_said_once() -> None:
    sent: list[tuple[str, dict[str, Any]]] = []
    out = CellOutput(lambda kind, content, *_, **__: sent.append((kind, content)))
    learning = EgressLearning()
    learning.take(seen([("a.example.com", 443, 2)]), 3, out)
    learning.take(seen([("a.example.com", 443, 2), ("b.example.com", 443, 1)]), 4, out)
    learning.take(seen([("a.example.com", 443, 5), ("b.example.com", 443, 1)]), 5, out)
    assert learning.rows() == [("a.example.com:443", "5", "cell 3, 5"), ("b.example.com:443", "1", "cell 4")]
    assert sent == []
    flood = [(f"d{i}.example.com", 443, 1) for i in range(MAX_DESTINATIONS + 10)]
    learning.take(seen(flood), 6, out)
    learning.take(seen(flood, dropped=5), 7, out)
    assert len(learning.table) == MAX_DESTINATIONS
    assert [content["text"] for _, content in sent] == [
        f"sandbox-kernel: %egress learn records at most {MAX_DESTINATIONS} destinations: "
        "the sandbox reached more, which are not recorded\n"]
