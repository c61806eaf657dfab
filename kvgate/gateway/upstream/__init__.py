"""Fleet mode: kvgate as the gateway for engine servers on other machines (``fleet.Fleet``,
the backend; ``call``, ``wire``, ``routing``, ``health``, ``members``, ``scrape``: its parts)."""
