"""The magics the kernel handles on the host (%sandbox, %egress, %upload, %download): they
drive the sandbox through the session's API and are never sent into it.

parsing.py splits a cell into magic lines and code and holds the %sandbox parser and help;
dispatch.py reads a magic line and hands it to its family: lifecycle.py (pause, resume, fork,
attach, list, keep, on-shutdown), egress.py (%egress), files.py (%upload, %download) and
info.py (status, cost, help, trust-output). tables.py shows their answers.
"""
