"""`sandbox-kernel install | run | sweep | serve | ls | rm | gc | doctor`."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from pathlib import Path

from sandbox_kernel.api import SandboxAPIError
from sandbox_kernel.config import ENV_VARS, ConfigError, Settings, open_client
from sandbox_kernel.paths import state_dir


def cmd_serve(args: argparse.Namespace) -> int:
    from sandbox_kernel.local.service import engine_dir, serve, stop_engine

    # Without --state-dir: the engine of this Python environment, as a kernel from it uses.
    where = args.state_dir or engine_dir(state_dir())
    if args.stop:
        print("local engine stopped; its sandboxes keep running for the next one"
              if stop_engine(where) else f"no local engine running for {where}")
        return 0

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        asyncio.run(serve(where, host=args.host, port=args.port, idle_timeout=args.idle_timeout))
    except KeyboardInterrupt:
        pass
    return 0


def cmd_install(args: argparse.Namespace) -> int:
    from sandbox_kernel.cli.kernelspec import install

    options = {name: getattr(args, name) for name in
               ("provider", "shape", "rootfs", "egress", "auto_pause", "on_shutdown", "warm_pool")}
    # Refuse bad values now, naming the flag (the key is the kernel's business, later).
    Settings.from_env({"CREATEOS_SANDBOX_API_KEY": "checked-later"}, kernel_args=options,
                      argument_name=lambda name: "--" + name.replace("_", "-"))
    if args.shape and args.provider != "createos":  # CreateOS may know shapes we do not
        from sandbox_kernel.api.shapes import SHAPES

        if args.shape not in (known := [shape.id for shape in SHAPES]):
            raise ConfigError(f"--shape: no shape {args.shape!r} (known: {', '.join(known)}; "
                              "--provider createos takes any)")
    env = {ENV_VARS[name]: value for name, value in options.items() if value}
    name = args.name or ("sandbox-createos" if args.provider == "createos" else "sandbox")
    display = "Python (CreateOS sandbox)" if args.provider == "createos" else "Python (sandbox)"
    if args.shape:
        display = display[:-1] + f", {args.shape})"
    where = install(name=name, sys_prefix=args.sys_prefix, prefix=args.prefix, env=env, display_name=display)
    print(f"Installed kernelspec {name!r} ({display!r}) in {where}")
    if args.provider == "createos":
        print("The kernel reads CREATEOS_SANDBOX_API_KEY from its environment (never from the kernelspec).")
    return 0


async def _list(settings: Settings) -> int:
    from sandbox_kernel.sandbox.listing import describe_age, listing

    async with await open_client(settings) as client:
        sandboxes = await client.list_sandboxes()
    if not sandboxes:
        print(f"no sandboxes on {settings.description}")
    for row in listing(sandboxes):
        sb = row.view
        print(f"{sb.id}  {row.name:<24} {sb.status.value:<10} {sb.shape or '-':<14} "
              f"{describe_age(sb.created_at):<10} ${row.cost.total:<8.4f} owner: {row.owner_text}")
    if settings.provider == "local":  # each Python environment has an engine of its own (service.py)
        from sandbox_kernel.local.service import other_engines

        for environment, sandboxes in other_engines(state_dir()):
            if sandboxes:
                print(f"{len(sandboxes)} more sandbox(es) run on the engine of another Python environment, "
                      f"{environment.prefix}: {environment.python} -m sandbox_kernel ls")
    return 0


async def _remove(settings: Settings, refs: list[str]) -> int:
    from sandbox_kernel.api import names
    from sandbox_kernel.sandbox import ownership

    async with await open_client(settings) as client:
        views = await client.list_sandboxes()
        for ref in refs:
            found = names.lookup(views, ref)
            if len(found) > 1:
                raise RuntimeError(f"several sandboxes are called {ref!r}: "
                                   f"{', '.join(view.id for view in found)}; use an id")
            # Neither an id nor a name listed: the provider's own answer (not found) says it best.
            sandbox_id = found[0].id if found else ref
            result = await client.delete_sandbox(sandbox_id)
            ownership.forget(sandbox_id)
            print(f"{result.id}: {result.status.value}")
    return 0


async def _collect(settings: Settings, dry_run: bool) -> int:
    from sandbox_kernel.api import names
    from sandbox_kernel.sandbox import ownership, pool

    async with await open_client(settings) as client:
        listed_at = time.time()
        views = names.live(await client.list_sandboxes())
        live = {sb.id: sb.name for sb in views}
        # The records of sandboxes on the engines of other Python environments stay (service.py).
        known = dict(live)
        if settings.provider == "local":
            from sandbox_kernel.local.service import other_engines

            for _, sandboxes in other_engines(state_dir()):
                known.update(sandboxes)
        # Warm pool members belong to no kernel: only those unclaimed for too long go.
        doomed = ([(sandbox_id, "orphaned", " (its kernel is gone)") for sandbox_id in ownership.orphaned(live)]
                  + [(sandbox_id, "stale warm pool member", "")
                     for sandbox_id in pool.stale_members(list(known), listed_at) if sandbox_id in live])
        for sandbox_id, what, why in doomed:
            if dry_run:
                print(f"{sandbox_id}: {what}{why}; would destroy")
                continue
            result = await client.delete_sandbox(sandbox_id)
            ownership.forget(sandbox_id, live[sandbox_id])
            pool.forget(sandbox_id)
            print(f"{sandbox_id}: {what}, {result.status.value}")
        if not dry_run:
            ownership.tidy(known)
    if not doomed:
        print(f"no orphaned sandboxes on {settings.description}")
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from sandbox_kernel.cli.headless import run_notebook

    return run_notebook(args.notebook, args.kernel, args.output, args.timeout, args.allow_errors,
                        args.allow_env)


def cmd_doctor(args: argparse.Namespace) -> int:
    from sandbox_kernel.cli.doctor import report

    ok, lines = report()
    print("\n".join(lines))
    return 0 if ok else 1


def add_allow_env(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--allow-env", action="append", default=[], metavar="NAME",
                        help="let this host environment variable into the sandbox when the notebook's "
                             "metadata.sandbox.env asks for it (repeatable; also SANDBOX_KERNEL_ALLOW_ENV)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sandbox-kernel", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    install = sub.add_parser("install", help="install the 'Python (sandbox)' kernelspec")
    where = install.add_mutually_exclusive_group()
    where.add_argument("--user", action="store_true", help="for this user (the default)")
    where.add_argument("--sys-prefix", action="store_true", help="into this Python environment")
    where.add_argument("--prefix", help="under this prefix")
    install.add_argument("--name", help="kernelspec name (default: sandbox, or sandbox-createos)")
    install.add_argument("--provider", choices=("local", "createos"),
                         help="pin the provider (default: CreateOS when a key is set, else local)")
    install.add_argument("--shape", help="sandbox shape, e.g. s-2vcpu-4gb")
    install.add_argument("--rootfs", help="root filesystem of new sandboxes, e.g. devbox:1")
    install.add_argument("--egress", help="egress rules for new sandboxes, comma-separated")
    install.add_argument("--auto-pause", help="seconds idle before a sandbox pauses (60-86400, or off)")
    install.add_argument("--on-shutdown", choices=("destroy", "pause", "keep"))
    install.add_argument("--warm-pool", help="keep this many ready sandboxes so kernels start faster (0-32)")
    install.set_defaults(run=cmd_install)

    run = sub.add_parser("run", help="execute a notebook headless in a sandbox and print its outputs")
    run.add_argument("notebook", type=Path)
    run.add_argument("--kernel", default="sandbox", help="kernelspec name (default: sandbox)")
    run.add_argument("--output", type=Path, help="also save the executed notebook here")
    run.add_argument("--timeout", type=float, default=600, help="seconds per cell (default: 600)")
    run.add_argument("--allow-errors", action="store_true",
                     help="run every cell even after one fails (the exit status is still 1)")
    add_allow_env(run)
    run.set_defaults(run=cmd_run)

    from sandbox_kernel.cli.sweep import add_parser as add_sweep

    add_sweep(sub, add_allow_env)

    serve = sub.add_parser("serve", help="run the local engine (CreateOS-compatible API)")
    serve.add_argument("--host", default="127.0.0.1", help="loopback address to listen on")
    serve.add_argument("--port", type=int, default=0, help="TCP port (default: any free port)")
    serve.add_argument("--state-dir", type=Path, help="state directory (token, socket, sandboxes)")
    serve.add_argument("--idle-timeout", type=float, default=0.0,
                       help="exit after this many seconds with no sandboxes (0: never)")
    serve.add_argument("--stop", action="store_true",
                       help="stop the running engine of the state dir; its sandboxes keep running "
                            "(the next engine, started on demand, takes them over)")
    serve.set_defaults(run=cmd_serve)

    ls = sub.add_parser("ls", help="list sandboxes: name, state, shape, age, cost so far (CreateOS "
                                   "prices), owning kernel")
    ls.set_defaults(run=lambda a: asyncio.run(_list(Settings.from_env())))

    rm = sub.add_parser("rm", help="destroy sandboxes, by id or name")
    rm.add_argument("ids", nargs="+", metavar="ID|NAME")
    rm.set_defaults(run=lambda a: asyncio.run(_remove(Settings.from_env(), a.ids)))

    gc = sub.add_parser("gc", help="destroy sandboxes whose owning kernel on this machine is gone "
                                   "(forks included; kept ones stay)")
    gc.add_argument("--dry-run", action="store_true", help="only say what would be destroyed")
    gc.set_defaults(run=lambda a: asyncio.run(_collect(Settings.from_env(), a.dry_run)))

    doctor = sub.add_parser("doctor", help="say what isolation this host gives, and why")
    doctor.set_defaults(run=cmd_doctor)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (ConfigError, SandboxAPIError, RuntimeError) as exc:
        message = exc.user_message() if isinstance(exc, SandboxAPIError) else str(exc)
        print(f"sandbox-kernel: {message}", file=sys.stderr)
        return 1
