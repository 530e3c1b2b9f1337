"""GPU check of the NIXL adapter: the two-process test of ``tests/test_transfer_engines.py`` with both
pools in GPU memory (``ops`` torch pools, registered as VRAM).

Not run in CI (no GPU there). Run on a CUDA machine with NIXL installed:

    python -m hybridkv.transfer.gpu_check [--device-src cuda:0] [--device-dst cuda:1] [--timeout 60]

UCX picks its transports (``cuda_copy``, ``cuda_ipc``, ``rc``...) unless ``UCX_TLS`` is set. Prints
one JSON line per side and exits 0 when every transfer matched: SHA-256 equal on both sides, other
destination bytes untouched, notifications received, integrity held and nothing leaked.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys

from hybridkv.transfer.testing import happy_worker


def _verdict(src: dict, dst: dict) -> list[str]:
    problems = [f"{side}: {out['error']}" for side, out in (("src", src), ("dst", dst)) if "error" in out]
    # one dict per transfer on each side; a side that failed before transferring reports only "error"
    transfers = sorted(k for k in set(src) & set(dst) if isinstance(src[k], dict) and isinstance(dst[k], dict))
    if not problems and not transfers:
        problems.append("no transfer was reported by either side")
    for key in transfers:
        s, d = src[key], dst[key]
        checks = {
            "sha256 equal": s["sha256"] == d["sha256"],
            "other ids": s["ids"] != d["ids"],
            "others untouched": d["others_untouched"],
            "notified": (s if key.endswith("read") else d).get("notified", False),
            "integrity": s["integrity"] == d["integrity"] == "ok",
            "no leak": not s["leaked"] and not d["leaked"],
        }
        problems += [f"{key}: {name} failed" for name, ok in checks.items() if not ok]
    return problems


def _missing_device(*devices: str) -> str | None:
    """Why the check cannot run here (torch without CUDA, a device index the machine lacks), or None."""
    try:
        import torch
    except ImportError:
        return "needs torch with CUDA (pip install torch) and NIXL (see hybridkv's pyproject 'transfer' extra)"
    if not torch.cuda.is_available():
        return "needs a CUDA device: torch.cuda.is_available() is False on this machine"
    for dev in devices:
        index = torch.device(dev).index or 0
        if torch.device(dev).type != "cuda" or index >= torch.cuda.device_count():
            return f"device {dev!r} is not one of this machine's {torch.cuda.device_count()} CUDA devices"
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device-src", default="cuda:0")
    ap.add_argument("--device-dst", default="cuda:0")
    ap.add_argument("--timeout", type=float, default=60.0)
    ap.add_argument("--tokens", type=int, default=39)
    args = ap.parse_args(argv)
    missing = _missing_device(args.device_src, args.device_dst)
    if missing:
        print(f"hybridkv.transfer.gpu_check: {missing}", file=sys.stderr)
        return 2
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    (src_in, src_out), (dst_in, dst_out) = ctx.Pipe(duplex=False), ctx.Pipe(duplex=False)
    procs = [
        ctx.Process(target=happy_worker, args=("src", a, src_out, "nixl", args.tokens, args.timeout, args.device_src)),
        ctx.Process(target=happy_worker, args=("dst", b, dst_out, "nixl", args.tokens, args.timeout, args.device_dst)),
    ]
    for p in procs:
        p.start()
    results = []
    for conn in (src_in, dst_in):
        if not conn.poll(args.timeout * 8):
            print(json.dumps({"error": "no result from a worker"}))
            for p in procs:
                p.kill()
            return 1
        results.append(conn.recv())
    for p in procs:
        p.join(timeout=30)
    for side, out in zip(("src", "dst"), results, strict=True):
        print(json.dumps({"side": side, **out}))
    problems = _verdict(*results)
    print(json.dumps({"ok": not problems, "problems": problems}))
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
