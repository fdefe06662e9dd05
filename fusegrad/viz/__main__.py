"""`python -m fusegrad.viz FILE [--port N]`: serve a trace saved by VIZ=1 (or a Chrome trace saved by PROFILE=1) at
http://127.0.0.1:N/."""
import argparse
import sys
from fusegrad.helpers import getenv
from fusegrad.viz.server import TraceError, serve_file

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fusegrad.viz", description="Serve a VIZ or PROFILE trace on "
                                     "localhost.")
    parser.add_argument("file", help="the trace file (VIZ=1 or PROFILE=1 print where they saved it)")
    parser.add_argument("--port", type=int, default=getenv("VIZ_PORT", 8000),
                        help="the port on 127.0.0.1 (default: VIZ_PORT, else 8000; 0 picks a free one)")
    args = parser.parse_args(argv)
    try: serve_file(args.file, args.port)
    except TraceError as e:
        print(f"fusegrad.viz: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"fusegrad.viz: cannot serve on port {args.port}: {e.strerror}", file=sys.stderr)
        return 2
    return 0

if __name__ == "__main__": sys.exit(main())
