"""``python -m tuner.sim``: start a simulated SGLang server (command line → startup log → HTTP).

Takes ``sglang.launch_server``'s flags for the mimicked version plus ``--sim-*`` options
(:mod:`tuner.sim.args`), prints SGLang's startup lines (:mod:`tuner.sim.startup`) to stderr, and
serves SGLang's HTTP API (:mod:`tuner.sim.server`) until SIGTERM. Exit status: 2 for bad input
(argparse's status; also SGLang's server-args checks), 137 (SIGKILL, as SGLang's
``kill_process_tree``) for a startup or runtime failure, death by SIGTERM on stop.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from tuner.sim.args import PROG
from tuner.sim.errors import SimError
from tuner.sim.startup import SimLogger, StartupDelays, kill_process_tree, log_startup, plan_from_argv

if TYPE_CHECKING:
    from tuner.sim.server import SimServer

__all__ = ["main"]


async def _serve(server: SimServer, host: str, port: int, time_scale: float) -> None:
    """Bind HTTP, log uvicorn's lines, warm up, then serve until the process is killed."""
    from aiohttp import web

    log = server.log
    driver = asyncio.create_task(server.drive())
    runner = web.AppRunner(server.app, access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port, backlog=1024)
    log.raw(f"INFO:     Started server process [{os.getpid()}]")
    log.raw("INFO:     Waiting for application startup.")
    log.raw("INFO:     Application startup complete.")
    try:
        await site.start()
    except OSError as err:
        log.raw(f"ERROR:    [Errno {err.errno}] error while attempting to bind on address ({host!r}, {port}): "
                f"{err.strerror}")
        sys.stderr.flush()
        os._exit(1)
    bound = site._server.sockets[0].getsockname()[1] if site._server and site._server.sockets else port
    log.raw(f"INFO:     Uvicorn running on http://{host}:{bound} (Press CTRL+C to quit)")
    await asyncio.sleep(StartupDelays().warmup_s * time_scale)
    await server.warmup()
    await driver


def main(argv: Sequence[str] | None = None, prog: str = PROG) -> int:
    """Run the simulator.

    Args:
        argv: Arguments after the program name (default ``sys.argv[1:]``).
        prog: The program name every usage and error line names (``tuner sim serve`` passes its own).

    Returns:
        The exit status (only for bad input; a running server ends by signal).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        parsed, plan = plan_from_argv(argv, prog)
    except SimError as err:
        sys.stderr.write(f"{prog}: error: {err}\n")
        return 2
    cfg = plan.config
    # systemctl stop sends SIGTERM: die at once, as SGLang's processes do.
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    log = SimLogger(sys.stderr, cfg.tp_size)
    if not log_startup(parsed, plan, log, time_scale=parsed.sim.time_scale):
        kill_process_tree()
    from tuner.sim.answers import NumericsFault
    from tuner.sim.server import SimServer  # aiohttp and prometheus only once startup succeeded

    server = SimServer(plan, log, seed=parsed.sim.seed, scheduler=parsed.sim.scheduler,
                       skip_warmup=bool(cfg.server_args.get("skip_server_warmup")),
                       numerics_fault=NumericsFault(parsed.sim.numerics_fault) if parsed.sim.numerics_fault else None,
                       no_logprobs=parsed.sim.no_logprobs)
    try:
        asyncio.run(_serve(server, cfg.host, cfg.port, parsed.sim.time_scale))
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
