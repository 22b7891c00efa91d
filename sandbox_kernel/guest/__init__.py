"""Everything that runs inside a sandbox: the runner (uploaded by the kernel) and agent/ (the
local engine's in-sandbox agent). Standard library only, and nothing of the host side: these
files are copied into sandboxes whose Python is not the host's.
"""
