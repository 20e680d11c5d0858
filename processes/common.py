"""What every entry point shares: arguments, logging, process title."""
from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys
import typing

from pushkv import envs
from pushkv import log_config as log_config_mod
from pushkv.config import DeploymentConfig, decode_config
from pushkv.kinds import Role


def parse(kind: str, with_rank: bool = True) -> tuple[argparse.Namespace, DeploymentConfig]:
    ap = argparse.ArgumentParser(prog=f"pushkv-{kind}", description=f"pushkv {kind} process")
    ap.add_argument("--config", required=True, help="deployment config JSON written by the supervisor")
    if with_rank:
        ap.add_argument("--role", required=True, choices=typing.get_args(Role))
        ap.add_argument("--rank", type=int, default=0)
        ap.add_argument("--instance", type=int, default=0, help="which instance of the role (0 = the first)")
    args = ap.parse_args()
    with open(args.config, "rb") as f:
        cfg = decode_config(f.read())
    name = (args.role if not args.instance else f"{args.role}{args.instance}") if with_rank else ""
    setup(f"pushkv {name}-{kind} {args.rank}" if with_rank else f"pushkv {kind}", cfg.log_level, cfg.log_config,
          cfg.deployment_id)
    return args, cfg


def process_title(title: str, deployment_id: str) -> str:
    """What ``ps`` shows: ``pushkv prefill-writer 0 <deployment id>``, as the supervisor's ``pushkv supervisor <id>``,
    so that two deployments on one host tell their processes apart (``pgrep -f 'pushkv prefill-writer 0 ID'``)."""
    return f"{title} {deployment_id}" if deployment_id else title


def setup(title: str, log_level: str, log_config: str = "", deployment_id: str = "") -> None:
    """Logging, the stack dump on SIGUSR1 and the process title, the same in every process:
    ``title`` ("pushkv <what>") names it in ``ps`` (with the deployment's id) and, without "pushkv ", on every log
    line. ``log_config``: --log-config-file's dictConfig, applied instead (pushkv/log_config.py)."""
    if log_config:
        log_config_mod.apply(log_config)
    else:
        logging.basicConfig(
            level=getattr(logging, log_level.upper(), logging.INFO), stream=sys.stderr,
            format=f"%(asctime)s %(levelname)s [{title.split(' ', 1)[1]}] %(name)s: %(message)s",
        )
    # `kill -USR1 PID` prints every thread's stack to the process's log: where a stuck process is
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    try:
        import setproctitle

        setproctitle.setproctitle(process_title(title, deployment_id))
    except ImportError:
        pass


def run_profiled(run, name: str) -> None:
    """``run()``; under cProfile when ``PUSHKV_PROFILE_DIR`` is set, the stats written to
    ``<dir>/<name>.prof`` at exit (read them with ``python -m pstats``)."""
    out = envs.PUSHKV_PROFILE_DIR
    if not out:
        run()
        return
    import cProfile

    prof = cProfile.Profile()
    try:
        prof.runcall(run)
    finally:
        os.makedirs(out, exist_ok=True)
        prof.dump_stats(os.path.join(out, f"{name}.prof"))
