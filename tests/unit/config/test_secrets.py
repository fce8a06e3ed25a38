"""Secrets of a config become fingerprints in what trainbook writes (config/secrets.py)."""

from __future__ import annotations

from trainbook.config import Config, dump_toml, redact_tree, scrub, secret_values
from trainbook.config.secrets import fingerprint, is_redacted


def _cfg(**alerts_and_monitor) -> Config:
    return Config.model_validate({"alerts": alerts_and_monitor.get("alerts", {}),
                                  "monitor": alerts_and_monitor.get("monitor", {})})


def test_two_secrets_have_two_fingerprints_and_none_shows_the_value():
    a, b = "https://hooks.example.com/T0/B1/abc", "https://hooks.example.com/T0/B1/abd"
    assert fingerprint(a) != fingerprint(b) and is_redacted(fingerprint(a))
    assert a not in fingerprint(a) and "abc" not in fingerprint(a)


def test_the_resolved_dump_holds_the_fingerprint_and_loads_again():
    url = "https://hooks.example.com/services/XYZ"
    text = dump_toml(_cfg(alerts={"webhook_url": url}))
    assert url not in text and fingerprint(url) in text
    import tomllib
    again = Config.model_validate(tomllib.loads(text))  # an archived config is still a valid one
    assert again.alerts.webhook_url == fingerprint(url)
    assert redact_tree(again.model_dump(mode="json"))["alerts"]["webhook_url"] == fingerprint(url)  # not twice


def test_a_tracking_uri_is_a_secret_only_with_credentials():
    plain = _cfg(monitor={"mlflow_tracking_uri": "http://127.0.0.1:5000"}).model_dump(mode="json")
    assert secret_values(plain) == [] and redact_tree(plain) == plain
    creds = "https://user:tok3n@mlflow.example.com"
    tree = _cfg(monitor={"mlflow_tracking_uri": creds}).model_dump(mode="json")
    assert secret_values(tree) == [creds]
    assert redact_tree(tree)["monitor"]["mlflow_tracking_uri"] == fingerprint(creds)


def test_scrub_replaces_every_occurrence_in_recipes_and_arguments():
    url = "https://hooks.example.com/s/1"
    recipe = f'[alerts]\nwebhook_url = "{url}"  # {url}\n'
    assert url not in scrub(recipe, [url]) and scrub(recipe, [url]).count(fingerprint(url)) == 2
    assert scrub(f"alerts.webhook_url={url}", [url]) == f"alerts.webhook_url={fingerprint(url)}"
