"""The local engine's in-sandbox agent (agent.py, started by path, see bundle.agent_path), mounted
read-only at /opt/sandbox-kernel with the guest package's top-level modules (bundle.agent_files)."""
