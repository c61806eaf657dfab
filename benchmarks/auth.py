"""What authentication costs per request: ``Authenticator.authenticate`` (what the middleware
runs before every endpoint) with auth off, an API key among 100 tenants, and JWT access
tokens (RS256, ES256) verified against a JWKS already fetched — microseconds per call, and the
ratio to the auth-off baseline measured in the same run.

    flock /tmp/kvgate-bench.lock python -m benchmarks.auth [--calls 20000]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import tempfile
import time
from pathlib import Path

from gateway.auth.authenticator import Authenticator
from gateway.settings import Settings
from tests.gateway.auth.issuer import ISSUER, RESOURCE, Issuer


async def per_call_us(auth: Authenticator, header: list[str], calls: int) -> float:
    path = "/v1/completions"
    for _ in range(100):  # warm: the JWKS fetch, caches
        await auth.authenticate(path, header)
    started = time.perf_counter()
    for _ in range(calls):
        await auth.authenticate(path, header)
    return (time.perf_counter() - started) / calls * 1e6


async def main(calls: int) -> None:
    issuer = Issuer()
    issuer.add_key("ec-1", "ES256")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            keys = Path(tmp) / "keys"
            keys.write_text(
                "".join(
                    f"t{i}: {hashlib.sha256(f'key-{i}'.encode()).hexdigest()}\n" for i in range(100)
                )
            )
            off = Authenticator(Settings())
            on = Authenticator(
                Settings(
                    api_keys_file=str(keys),
                    oauth_issuer=ISSUER,
                    oauth_jwks_url=issuer.jwks_url,
                    oauth_resource=RESOURCE,
                )
            )
            cases = [
                ("auth off", off, []),
                ("API key (100 tenants)", on, ["Bearer key-99"]),
                ("JWT RS256", on, [f"Bearer {issuer.token('rsa-1')}"]),
                ("JWT ES256", on, [f"Bearer {issuer.token('ec-1')}"]),
            ]
            results = [(name, await per_call_us(a, h, calls)) for name, a, h in cases]
    finally:
        issuer.close()
    base = results[0][1]
    print(f"{'case':<24}{'us/call':>10}{'x auth off':>12}")
    for name, us in results:
        print(f"{name:<24}{us:>10.1f}{us / base:>12.1f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=20000)
    asyncio.run(main(parser.parse_args().calls))
