"""What authentication costs per request: ``Authenticator.authenticate`` (what the middleware
runs before every endpoint) with auth off, an API key among 100 tenants, and JWT access
tokens (RS256, ES256; reused, so remembered after one check, or new on every call) verified
against a JWKS already fetched — microseconds per call, and the ratio to the auth-off
baseline measured in the same run.

    flock /tmp/kvgate-bench.lock python -m benchmarks.auth [--calls 20000]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import tempfile
import time
from pathlib import Path

from kvgate.gateway.auth.authenticator import Authenticator
from kvgate.gateway.settings import Settings
from tests.gateway.auth.issuer import ISSUER, RESOURCE, Issuer


async def per_call_us(auth: Authenticator, headers: list[list[str]], calls: int) -> float:
    """Calls cycle through ``headers`` (one header: a client reusing its credential)."""
    path = "/v1/completions"
    await auth.authenticate(path, headers[0])  # warm: the JWKS fetch
    started = time.perf_counter()
    for i in range(calls):
        await auth.authenticate(path, headers[i % len(headers)])
    return (time.perf_counter() - started) / calls * 1e6


def tokens(issuer: Issuer, kid: str, n: int) -> list[list[str]]:
    return [[f"Bearer {issuer.token(kid, jti=str(i))}"] for i in range(n)]


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
            fresh = min(calls, 2000)  # every call a token never seen: a signature check each
            cases = [
                ("auth off", off, [[]], calls),
                ("API key (100 tenants)", on, [["Bearer key-99"]], calls),
                ("JWT RS256 reused", on, [[f"Bearer {issuer.token('rsa-1')}"]], calls),
                ("JWT ES256 reused", on, [[f"Bearer {issuer.token('ec-1')}"]], calls),
                ("JWT RS256 new each", on, tokens(issuer, "rsa-1", fresh), fresh),
                ("JWT ES256 new each", on, tokens(issuer, "ec-1", fresh), fresh),
            ]
            results = [(name, await per_call_us(a, h, n)) for name, a, h, n in cases]
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
