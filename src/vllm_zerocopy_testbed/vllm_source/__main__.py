"""``python -m vllm_zerocopy_testbed.vllm_source``: build an overlay, run a command over it, or say which vLLM runs.

  prepare SPEC        build the overlay for SPEC (release, wheel, checkout); print its folder
  exec -- CMD ...     run CMD with TESTBED_VLLM's overlay first on PYTHONPATH (as is when unset)
  describe            print which vLLM this interpreter imports (JSON)
  unpack RELEASE DIR  write a release's Python sources (vllm/...) into DIR: a tree to edit and name as VLLM=DIR
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from pathlib import Path

from vllm_zerocopy_testbed.vllm_source import VLLM_ENV, VllmSourceError, from_env, prepare, running, unpack


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_zerocopy_testbed.vllm_source", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare", help="build the overlay for SPEC; print its folder")
    p.add_argument("spec")
    p.add_argument("--json", action="store_true", help="print the overlay's manifest instead")
    e = sub.add_parser("exec", help=f"run a command over {VLLM_ENV}'s overlay")
    e.add_argument("cmd", nargs=argparse.REMAINDER)
    sub.add_parser("describe", help="which vLLM this interpreter imports")
    u = sub.add_parser("unpack", help="write a release's Python sources into a folder")
    u.add_argument("release")
    u.add_argument("folder")
    args = parser.parse_args(argv)
    try:
        if args.command == "prepare":
            overlay = prepare(args.spec)
            print(overlay.describe(), file=sys.stderr)
            print(json.dumps(overlay.__dict__, indent=1) if args.json else overlay.path)
        elif args.command == "unpack":
            written = unpack(args.release, Path(args.folder))
            print(f"{written} files of vLLM {args.release} in {args.folder}/vllm")
        elif args.command == "describe":
            print(json.dumps(running(), indent=1))
        else:
            cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
            if not cmd:
                parser.error("exec: name a command after --")
            overlay = from_env()
            env = dict(os.environ)
            if overlay is not None:
                print(f"[testbed] {overlay.describe()}", file=sys.stderr)
                env = overlay.env(env)
            os.execvpe(cmd[0], cmd, env)
    except VllmSourceError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
