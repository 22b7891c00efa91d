"""A short smoke test of the vendor's TypeScript SDK (`@nodeops-createos/sandbox`, as
published, unchanged) against the local engine: the vendor quick start with its
`devbox:1`, a stream, files, pause/resume, a token, and one refusal.

It needs node (20+) and npm, and installs the SDK with npm into a temporary directory;
it is skipped, saying why, where either is missing or the install fails.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from sandbox_kernel.local.service import EngineEndpoint

pytestmark = pytest.mark.slow
PACKAGE = "@nodeops-createos/sandbox"

SMOKE = r"""
import { CreateosSandboxClient } from "@nodeops-createos/sandbox";

const client = new CreateosSandboxClient({ baseUrl: process.env.BASE_URL, apiKey: process.env.API_KEY });
const report = {};
const sandbox = await client.createSandbox({ shape: "s-1vcpu-512mb", rootfs: "devbox:1" });
try {
  report.rootfs = (await client.listRootfs()).rootfs.includes("devbox:1");
  report.run = (await sandbox.runCommand("bash", ["-lc", "echo hi from $SHELL"])).result;
  report.stream = [];
  for await (const event of sandbox.streamCommand("bash", ["-c", "echo one; echo two >&2; exit 3"])) {
    if (event.type !== "heartbeat") report.stream.push(event);
  }
  await sandbox.files.upload("/workspace/ts.txt", "from typescript");
  report.file = new TextDecoder().decode(await sandbox.files.download("/workspace/ts.txt"));
  await sandbox.pause();
  await sandbox.waitUntilPaused();
  await sandbox.resume();
  await sandbox.waitUntilRunning();
  report.resumed = sandbox.status;
  try {
    await sandbox.resize(20480);
  } catch (error) {
    report.resize = { status: error.statusCode, message: error.message };
  }
} finally {
  await sandbox.destroy();
}
console.log(JSON.stringify(report));
"""


@pytest.fixture(scope="module")
def sdk_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not (shutil.which("node") and shutil.which("npm")):
        pytest.skip("node and npm are needed for the TypeScript SDK smoke test")
    directory = Path(tmp_path_factory.mktemp("ts-sdk"))
    (directory / "package.json").write_text('{"private": true, "type": "module"}\n')
    try:
        install = subprocess.run(["npm", "install", "--no-audit", "--no-fund", PACKAGE], cwd=directory,
                                 capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        pytest.skip(f"npm could not install {PACKAGE} within 5 minutes")
    if install.returncode != 0:
        pytest.skip(f"npm could not install {PACKAGE}: {install.stderr.strip()[-300:]}")
    return directory


def test_the_typescript_quick_start_runs_on_the_local_engine(sdk_dir: Path, engine: EngineEndpoint) -> None:
    script = sdk_dir / "smoke.mjs"
    script.write_text(SMOKE)
    done = subprocess.run(["node", str(script)], cwd=sdk_dir, capture_output=True, text=True, timeout=180,
                          env={"PATH": os.environ["PATH"], "BASE_URL": engine.url, "API_KEY": engine.token})
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["rootfs"] is True
    assert report["run"] == {"stdout": "hi from /bin/bash\n", "stderr": "", "exit_code": 0}
    *output, exit_event = report["stream"]  # stdout and stderr are separate pipes: any order
    assert sorted(output, key=lambda e: e["type"]) == [{"type": "stderr", "data": "two\n"},
                                                       {"type": "stdout", "data": "one\n"}]
    assert exit_event == {"type": "exit", "exitCode": 3}
    assert report["file"] == "from typescript"
    assert report["resumed"] == "running"
    assert report["resize"]["status"] == 501 and "not supported by the local engine" in report["resize"]["message"]
