"""The host side of one notebook's sandbox: create or attach, the runner in it, its transports,
pause/resume/fork, the warm pool, who owns which sandbox, transfers and cost.

It talks to the sandbox only through api/ (the CreateOS REST API or the local engine's copy).
"""
