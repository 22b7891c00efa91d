"""The Sandboxes panel of JupyterLab: a Jupyter Server extension (REST handlers under the
server's own authentication; the engine's token or the CreateOS key never reaches the
browser) and the prebuilt JupyterLab extension (labextension/, built from the repository's
labextension/ folder when the package is built) that shows it.

`pip install sandbox-kernel` enables both: the JupyterLab extension is a prebuilt one in
share/jupyter/labextensions/, and the server extension is switched on by a file in
etc/jupyter/jupyter_server_config.d/ (see setup.py).
"""

from __future__ import annotations

from typing import Any

LABEXTENSION = "sandbox-kernel-panel"  # labextension/package.json's name


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    return [{"src": "labextension", "dest": LABEXTENSION}]


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "sandbox_kernel.jupyter_panel"}]


def _load_jupyter_server_extension(serverapp: Any) -> None:
    from sandbox_kernel.jupyter_panel.handlers import install

    install(serverapp)
