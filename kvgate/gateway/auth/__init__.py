"""Who is calling: API keys and OAuth 2.1 access tokens, tenants, and per-tenant budgets.

``middleware.AuthMiddleware`` authenticates every HTTP request before any endpoint runs and
leaves an ``Identity`` (or None when authentication is off) in ``scope["state"]`` and in
``identity.CURRENT``; endpoints and the generation path only read it.
"""
