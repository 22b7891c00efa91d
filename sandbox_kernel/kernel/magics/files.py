"""%upload and %download: files between this machine and the sandbox, through the files API
(sandbox/transfer.py), with a progress line."""

from __future__ import annotations

import posixpath
from pathlib import Path

from sandbox_kernel.kernel import magic_words
from sandbox_kernel.kernel.magic_words import Word
from sandbox_kernel.kernel.magics.family import MagicFamily
from sandbox_kernel.kernel.magics.parsing import UPLOAD, MagicError
from sandbox_kernel.sandbox.transfer import (
    CHUNK,
    MAX_FILE,
    WORKSPACE,
    TransferError,
    describe_size,
    host_path,
    sandbox_path,
)

TRANSFER_HELP = f"""\
%upload, %download — copy files between this machine and the sandbox (files API)

  %upload LOCAL [REMOTE]          a file or a directory from this machine into the sandbox
  %download REMOTE [LOCAL]        a file or a directory from the sandbox to this machine

A relative LOCAL is in the notebook's directory, a relative REMOTE under {WORKSPACE}; REMOTE
defaults to {WORKSPACE}/<name>, LOCAL to ./<name>. Existing files are overwritten. Files up
to {describe_size(MAX_FILE)} each; large ones move in {describe_size(CHUNK)} pieces, with a progress line.
"""


class FileMagics(MagicFamily):
    async def transfer(self, prog: str, words: list[Word]) -> None:
        upload = prog == UPLOAD
        if not words or words[0].text in ("help", "-h", "--help"):
            self.out.text(TRANSFER_HELP)
            return
        if len(words) > 2 or words[0].is_option():
            raise MagicError(f"{prog}: expected {'LOCAL [REMOTE]' if upload else 'REMOTE [LOCAL]'} "
                             f"(see {prog} help)")
        source, target = words[0], words[1] if len(words) == 2 else None
        name = posixpath.basename(source.text.rstrip("/")) or source.text
        # The host side: LOCAL as given, or (downloading) the remote's name, which a value
        # of the sandbox may have chosen too.
        local = source if upload else target or Word(name, source.from_sandbox)
        try:
            magic_words.check_host_path(local, Path.cwd())
        except magic_words.MagicLineError as exc:
            raise MagicError(f"{prog}: {exc}") from None
        source_text, target_text = source.text, target.text if target else None
        await self._running()
        line_out = self.out.progress(f"{'Uploading' if upload else 'Downloading'} {source_text}…")
        work = self.session.transfer(line_out)
        try:
            if upload:
                done = await work.upload(host_path(source_text), sandbox_path(target_text or name))
            else:
                done = await work.download(sandbox_path(source_text), host_path(target_text) if target_text else None)
        except TransferError as exc:
            line_out.update(f"{prog} {source_text}: failed")
            raise MagicError(f"{prog}: {exc}") from None
        except OSError as exc:  # this machine's side: permissions, a full disk...
            line_out.update(f"{prog} {source_text}: failed")
            raise MagicError(f"{prog}: {exc.strerror or exc}: {exc.filename or source_text}") from None
        line_out.update(done)

    async def _running(self) -> None:
        """The files API wants a running sandbox: resume a paused one, saying so."""
        view = await self.session.view()
        if view.status.is_pause_like:
            await self.transition("Resuming", self.session.resume, "running again")
