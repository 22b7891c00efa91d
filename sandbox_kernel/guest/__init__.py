"""Everything that runs inside a sandbox, as one package: protocol.py (the words both sides
speak), bundle.py (what each program needs in a sandbox, and the runner bundle's hash),
runner/ (uploaded by the kernel into every sandbox) and agent/ (the local engine's
in-sandbox agent, mounted read-only). Standard library only, Python 3.8+, and nothing of
the host side: a sandbox's Python is not the host's. Its modules import each other
relatively, so the package works under the name it has in a sandbox (bundle.PACKAGE).
"""
