"""%sandbox commands that tell about the sandbox, or about what of it reaches the page:
status, cost, seal, help, trust-output."""

from __future__ import annotations

import argparse
import dataclasses
import json

from sandbox_kernel.api import SandboxView, names
from sandbox_kernel.kernel.magics.egress import describe_rules
from sandbox_kernel.kernel.magics.family import MagicFamily
from sandbox_kernel.kernel.magics.parsing import HELP
from sandbox_kernel.kernel.magics.tables import describe_age, describe_cost, describe_seconds, table
from sandbox_kernel.sandbox import ownership
from sandbox_kernel.sandbox.cost import Cost
from sandbox_kernel.sandbox.sealed import METADATA_KEY, seal_metadata

SEAL_WHERE = (f"Paste it into the notebook's metadata as its \"{METADATA_KEY}\" key (JupyterLab: the property "
              "inspector, or Notebook > Advanced tools > Notebook metadata); headless runs then get these settings")


def status_rows(view: SandboxView, provider: str, policy: str, cost: Cost,
                egress: list[str]) -> list[tuple[str, str]]:
    return [("id", view.id), ("name", names.display_name(view)), ("state", view.status.value),
            ("provider", provider),
            ("shape", f"{view.shape or '?'} ({view.vcpu} vCPU, {view.mem_mib} MiB)"),
            ("rootfs", view.rootfs or "the provider's default"),
            # the local engine says which limits this host enforces; CreateOS is a VM of the shape
            ("limits", view.limits or "the VM's own (CreateOS)"),
            ("age", describe_age(view.created_at)), ("forked from", view.forked_from or "—"),
            ("auto-pause", f"after {describe_seconds(view.auto_pause_after_seconds)} idle"
             if view.auto_pause_after_seconds else "off"),
            ("egress", describe_rules(egress)), ("on shutdown", policy), ("cost so far", describe_cost(cost))]


class InfoMagics(MagicFamily):
    async def seal(self, _: argparse.Namespace) -> None:
        """This notebook's settings, with the live sandbox's egress rules, as its seal."""
        rules = (await self.session.get_egress()).egress or []
        self.set_next_input(seal_text(seal_metadata(dataclasses.replace(self.session.settings, egress=rules))))
        self.out.text(f"The seal is in the next input. {SEAL_WHERE}\n")

    async def help(self, _: argparse.Namespace) -> None:
        self.out.text(HELP)

    async def status(self, _: argparse.Namespace) -> None:
        view = await self.session.view()
        cost = self.session.cost_so_far(view.id)
        policy = (self.session.on_shutdown if ownership.owns(view.id)
                  else "keep (not this notebook's: it was attached or kept)")
        egress = (await self.session.get_egress()).egress or []
        rows = status_rows(view, self.session.settings.description, policy, cost, egress)
        rows.append(("output", "trusted: shown unchanged, scripts run" if self.output_filter.trusted
                     else "filtered: scripts and active HTML held back or isolated"))
        self.out.display(table(rows))

    async def cost(self, _: argparse.Namespace) -> None:
        costs = await self.session.costs()
        rows = [(c.sandbox_id + (" (this notebook)" if c.sandbox_id == self.session.sandbox_id else ""),
                 describe_cost(c)) for c in costs]
        rows.append(("total", f"${sum(c.total for c in costs):.4f}"))
        book = self.session.prices
        rows.append(("prices", f"CreateOS, {book.dated}: ${book.vcpu_hour}/vCPU-h running, "
                               f"${book.memory_gib_hour}/GiB-h memory running or paused, "
                               f"${book.storage_gb_hour}/GB-h disk"))
        if self.session.settings.provider == "local":
            rows.append(("note", "local sandboxes are free: this is what they would cost on CreateOS"))
        self.out.display(table(rows))

    async def trust_output(self, args: argparse.Namespace) -> None:
        self.output_filter.trusted = args.trust == "on"
        if self.output_filter.trusted:
            self.out.text("Warning: the sandbox's output now runs in this page with your Jupyter rights "
                          "(it can read and change your files); `%sandbox trust-output off` ends that\n",
                          name="stderr")
        else:
            self.out.text("The sandbox's output is filtered again: scripts and active HTML are held back "
                          "or shown in an isolated frame\n")


def seal_text(metadata: dict[str, object]) -> str:
    """The `metadata.sandbox` entry as JSON the property inspector takes."""
    return json.dumps({METADATA_KEY: metadata}, indent=2)
