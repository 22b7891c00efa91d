"""`papermill --engine sandbox`: papermill's own nbclient engine, with the notebook's seal
(metadata.sandbox, sealed.py) applied to the kernel it starts; a seal that cannot be applied
raises SealError (one line) before any kernel starts. Registered through the
`papermill.engine` entry point, so it is there wherever sandbox-kernel and papermill are
installed. Host variables the seal names are let in when SANDBOX_KERNEL_ALLOW_ENV lists them.
"""

from __future__ import annotations

from typing import Any

from papermill.engines import NBClientEngine

from sandbox_kernel.sandbox.sealed import allowed_env, kernel_arguments


class SandboxEngine(NBClientEngine):
    @classmethod
    def execute_managed_notebook(cls, nb_man: Any, kernel_name: str, **kwargs: Any) -> Any:
        sealed = kernel_arguments(nb_man.nb.metadata, allowed_env())
        kwargs["extra_arguments"] = [*kwargs.get("extra_arguments", []), *sealed]
        return super().execute_managed_notebook(nb_man, kernel_name, **kwargs)
