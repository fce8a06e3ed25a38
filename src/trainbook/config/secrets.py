"""Secrets in a config: what they are, and their fingerprints in everything trainbook writes.

A webhook URL is usually a bearer secret (whoever has it may post to the channel), and a tracking
URI may carry credentials (`https://user:token@host`). trainbook never writes either: the resolved
config, checkpoint manifests, env.json's command line, baselines and the archived recipe hold
`redacted:sha256:<8 hex>` instead, so `compare` and a resume still see that the value changed
without learning it. Give the value with `alerts.webhook_url_env` (the name of an environment
variable) to keep it out of recipes and shell history as well.
"""

from __future__ import annotations

import hashlib
import urllib.parse

REDACTED = "redacted:sha256:"

SECRET_KEYS = (("alerts", "webhook_url"), ("monitor", "mlflow_tracking_uri"))
"""(section, key) of every config value that may be a secret."""


def fingerprint(value: str) -> str:
    """What is written instead of the secret `value`: enough to tell two values apart."""
    return REDACTED + hashlib.sha256(value.encode("utf-8")).hexdigest()[:8]


def is_redacted(value: str | None) -> bool:
    return isinstance(value, str) and value.startswith(REDACTED)


def _is_secret(section: str, key: str, value: str) -> bool:
    if key == "mlflow_tracking_uri":  # a local path or a plain server URL is no secret
        parts = urllib.parse.urlsplit(value)
        return bool(parts.username or parts.password or parts.query)
    return True


def secret_values(tree: dict) -> list[str]:
    """The secrets a config tree (`Config.model_dump(mode="json")`) holds, longest first."""
    found = [value for section, key in SECRET_KEYS
             if isinstance(value := (tree.get(section) or {}).get(key), str)
             and not is_redacted(value) and _is_secret(section, key, value)]
    return sorted(found, key=len, reverse=True)


def redact_tree(tree: dict) -> dict:
    """A copy of a config tree with every secret replaced by its fingerprint."""
    out = dict(tree)
    for section, key in SECRET_KEYS:
        value = (tree.get(section) or {}).get(key)
        if isinstance(value, str) and not is_redacted(value) and _is_secret(section, key, value):
            out[section] = {**out[section], key: fingerprint(value)}
    return out


def scrub(text: str, secrets: list[str]) -> str:
    """`text` (a recipe, a command-line argument) with every occurrence of each secret replaced by
    its fingerprint."""
    for secret in secrets:
        text = text.replace(secret, fingerprint(secret))
    return text
