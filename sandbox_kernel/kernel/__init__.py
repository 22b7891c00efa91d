"""The Jupyter side of the kernel (host): message handlers, magics, output to the frontend.

It reaches the sandbox only through sandbox/ (one notebook's sandbox, on the host side).
"""
