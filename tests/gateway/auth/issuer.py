"""A real authorization server's key half for tests: a JWKS over HTTP on loopback, and the
private keys to sign access tokens with (RS256 and ES256, generated per test session)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import jwt
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from jwt.algorithms import ECAlgorithm, RSAAlgorithm

ISSUER = "https://auth.example.test"
RESOURCE = "https://gateway.example.test/mcp"


class Issuer:
    """Serves ``/jwks.json`` with the public halves of ``published`` keys; counts fetches."""

    def __init__(self) -> None:
        self.private: dict[str, Any] = {}
        self.published: list[str] = []
        self.fetches = 0
        self.add_key("rsa-1", "RS256")
        issuer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                issuer.fetches += 1
                body = json.dumps({"keys": [issuer.jwk(kid) for kid in issuer.published]})
                self.send_response(200 if self.path == "/jwks.json" else 404)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.jwks_url = f"http://127.0.0.1:{self._server.server_port}/jwks.json"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def add_key(self, kid: str, alg: str, publish: bool = True) -> None:
        if alg.startswith("RS"):
            self.private[kid] = (
                rsa.generate_private_key(public_exponent=65537, key_size=2048),
                alg,
            )
        else:
            self.private[kid] = (ec.generate_private_key(ec.SECP256R1()), alg)
        if publish:
            self.published.append(kid)

    def jwk(self, kid: str) -> dict[str, Any]:
        key, alg = self.private[kid]
        tool = RSAAlgorithm if alg.startswith("RS") else ECAlgorithm
        data = json.loads(tool.to_jwk(key.public_key()))
        return {**data, "kid": kid, "alg": alg, "use": "sig"}

    def token(self, kid: str = "rsa-1", **claims: Any) -> str:
        now = int(time.time())
        body = {
            "iss": ISSUER,
            "aud": RESOURCE,
            "sub": "alice",
            "iat": now,
            "exp": now + 300,
            "scope": "kvgate:infer",
            **claims,
        }
        body = {k: v for k, v in body.items() if v is not None}
        key, alg = self.private[kid]
        return jwt.encode(body, key, algorithm=alg, headers={"kid": kid})

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
