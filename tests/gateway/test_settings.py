from kvgate.gateway.cli import build_parser, settings_from_args
from kvgate.gateway.settings import Settings


def test_defaults_bind_loopback() -> None:
    settings = Settings.from_env({})
    assert (settings.host, settings.port, settings.model, settings.allowed_origins) == (
        "127.0.0.1",
        8000,
        None,
        (),
    )


def test_environment_then_overrides() -> None:
    env = {
        "KVGATE_PORT": "9000",
        "KVGATE_REPLICAS": "2",
        "KVGATE_KEEPALIVE_S": "0.5",
        "KVGATE_ALLOWED_ORIGINS": "https://a.example, https://b.example/",
        "KVGATE_REDIS_URL": "redis://127.0.0.1:6379/0",
    }
    settings = Settings.from_env(env, port=9100, model=None)
    assert settings.port == 9100  # a flag beats the environment
    assert settings.replicas == 2 and settings.keepalive_s == 0.5
    assert settings.allowed_origins == ("https://a.example", "https://b.example")
    assert settings.redis_url == "redis://127.0.0.1:6379/0"


def test_serve_flags(monkeypatch) -> None:
    monkeypatch.setenv("KVGATE_MAX_BODY_BYTES", "123")
    monkeypatch.setenv("KVGATE_HOST", "0.0.0.0")
    args = build_parser().parse_args(
        [
            "serve",
            "--port",
            "8123",
            "--replicas",
            "3",
            "--kv-cache-dtype",
            "fp8",
            "--kv-cache-memory",
            "64MiB",
            "--allowed-origins",
            "https://x.example",
        ]
    )
    settings = settings_from_args(args)
    assert (settings.host, settings.port, settings.replicas) == ("0.0.0.0", 8123, 3)
    assert (settings.kv_cache_dtype, settings.kv_cache_memory) == ("fp8", "64MiB")
    assert settings.allowed_origins == ("https://x.example",)
    assert settings.max_body_bytes == 123
