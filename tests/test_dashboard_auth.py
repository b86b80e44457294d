"""An exposed dashboard asks who you are: the command line refuses to serve a network address with no sign-in, the
router shows nothing but the sign-in until the session shows the access token, and the token stays out of the
command line, the logs and the page.

The browser test starts a real server on 127.0.0.1 with ``TRUSTSCOPE_DASHBOARD_TOKEN`` set (a token given is
asked for on any address) and keeps a screenshot of the sign-in under ``test-artifacts/browser/auth/``.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest
from typer.testing import CliRunner

import app.launch as launch
from app import auth
from app.launch import LOGDIR_ENV
from app.pages import PAGES
from trustscope import runformat
from trustscope.cli import app as cli

ROOT = Path(__file__).resolve().parent.parent
MAIN = ROOT / "app" / "main.py"
SAMPLE_LOGS = ROOT / "sample_logs"
TOKEN = "tok-" + "x7Qp" * 8
TIMEOUT = 60
runner = CliRunner()


@pytest.fixture(scope="module")
def logdir(tmp_path_factory) -> Path:
    """sample_logs/ when it holds runs, else a small synthetic log of two runs."""
    if runformat.run_dirs(SAMPLE_LOGS):
        return SAMPLE_LOGS
    from trustscope.synthetic import SyntheticConfig, generate_logdir

    return generate_logdir(tmp_path_factory.mktemp("logs"), runs=2, config=SyntheticConfig(tokens=6_000, steps=4))


@pytest.fixture
def clean_env(monkeypatch, tmp_path):
    """No token in the environment, no Streamlit secrets in reach (a fresh home and working directory)."""
    for name in (auth.TOKEN_ENV, auth.MODE_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.fixture
def execs(monkeypatch) -> list[tuple[list[str], dict[str, str]]]:
    """The command lines and environments ``launch`` would become, instead of becoming them."""
    seen: list = []
    monkeypatch.setattr(launch.os, "execve", lambda path, argv, env: seen.append((argv, env)))
    return seen


# ---------------------------------------------------------------------------------------------------------------
# the command line


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.7"])
def test_an_exposed_dashboard_with_no_sign_in_is_refused(clean_env, execs, logdir, host):
    result = runner.invoke(cli, ["dashboard", str(logdir), "--host", host])
    assert result.exit_code == 2, result.output
    assert "--no-auth" in result.output and "--token" in result.output and auth.TOKEN_ENV in result.output
    assert "refusing" in result.output and not execs


def test_no_auth_serves_open_with_a_warning(clean_env, execs, logdir, monkeypatch):
    monkeypatch.setenv(auth.TOKEN_ENV, TOKEN)  # --no-auth drops a token from the environment too
    result = runner.invoke(cli, ["dashboard", str(logdir), "--host", "0.0.0.0", "--no-auth"])
    assert result.exit_code == 0, result.output
    assert "WARNING" in result.output and "--no-auth" in result.output
    (argv, env), = execs
    assert auth.TOKEN_ENV not in env and auth.MODE_ENV not in env and "0.0.0.0" in argv


def test_a_given_token_reaches_streamlit_through_its_environment_only(clean_env, execs, logdir):
    result = runner.invoke(cli, ["dashboard", str(logdir), "--host", "0.0.0.0", "--token", TOKEN])
    assert result.exit_code == 0, result.output
    (argv, env), = execs
    assert env[auth.TOKEN_ENV] == TOKEN
    assert not any(TOKEN in arg for arg in argv), "the token is on the command line ps shows"
    assert TOKEN not in result.output and auth.TOKEN_ENV in result.output  # says where the token comes from


def test_the_token_of_the_environment_is_asked_for_and_not_printed(clean_env, execs, logdir, monkeypatch):
    monkeypatch.setenv(auth.TOKEN_ENV, TOKEN)
    result = runner.invoke(cli, ["dashboard", str(logdir), "--host", "0.0.0.0"])
    assert result.exit_code == 0, result.output
    assert execs[0][1][auth.TOKEN_ENV] == TOKEN and TOKEN not in result.output


def test_a_short_or_empty_token(clean_env, execs, logdir):
    result = runner.invoke(cli, ["dashboard", str(logdir), "--host", "0.0.0.0", "--token", "abc"])
    assert result.exit_code == 0 and "WARNING" in result.output and "abc" not in result.output
    result = runner.invoke(cli, ["dashboard", str(logdir), "--host", "0.0.0.0", "--token", " "])
    assert result.exit_code == 2 and "empty" in result.output


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_from_a_terminal_a_token_is_generated_and_printed_with_the_url(clean_env, execs, logdir, monkeypatch):
    printed = _Terminal()
    monkeypatch.setattr(sys, "stderr", printed)
    launch.launch(logdir, host="0.0.0.0", port=8765)
    (argv, env), = execs
    token = env[auth.TOKEN_ENV]
    assert len(token) >= 40 and not any(token in arg for arg in argv)
    assert f":8765/?token={token} " in printed.getvalue()
    launch.launch(logdir, host="0.0.0.0", port=8765)
    assert execs[1][1][auth.TOKEN_ENV] != token  # a new one each start


def test_loopback_is_unchanged(clean_env, execs, logdir, monkeypatch):
    monkeypatch.setattr(sys, "stderr", _Terminal())
    for host in ("127.0.0.1", "localhost", "::1"):
        launch.launch(logdir, host=host, port=8765)
    assert all(auth.TOKEN_ENV not in env and auth.MODE_ENV not in env for _, env in execs)
    assert sys.stderr.getvalue().splitlines()[0] == f"trustscope dashboard: http://127.0.0.1:8765 over {logdir}"


def test_what_is_loopback():
    assert all(map(auth.is_loopback, ["127.0.0.1", "127.1.2.3", "::1", "[::1]", "localhost"]))
    assert not any(map(auth.is_loopback, ["0.0.0.0", "::", "", "10.0.0.1", "192.0.2.7", "no-such-host.invalid"]))


def test_an_oidc_provider_in_the_secrets_signs_people_in(clean_env, monkeypatch):
    (clean_env / ".streamlit").mkdir()
    (clean_env / ".streamlit" / "secrets.toml").write_text(
        '[auth]\nredirect_uri = "http://node:8501/oauth2callback"\ncookie_secret = "s3cr3t"\n'
        'client_id = "id"\nclient_secret = "x"\nserver_metadata_url = "https://idp/.well-known/openid-configuration"\n')
    assert auth.oidc_configured()
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "authlib" else real(name, *a))
    chosen = auth.plan("0.0.0.0")
    assert chosen.mode == "oidc" and chosen.env == {auth.MODE_ENV: "oidc", auth.TOKEN_ENV: None}
    assert auth.plan("0.0.0.0", token=TOKEN).mode == "token"  # a token given wins
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "authlib" else real(name, *a))
    with pytest.raises(auth.AuthError, match="Authlib"):
        auth.plan("0.0.0.0")


def test_the_cookie_holds_no_token():
    assert TOKEN not in auth.cookie_value(TOKEN) and auth.cookie_value(TOKEN) != auth.cookie_value(TOKEN + "1")
    assert auth.token_matches(TOKEN, TOKEN) and not auth.token_matches(TOKEN[:-1], TOKEN)
    assert not auth.token_matches(None, TOKEN) and not auth.token_matches(["x"], TOKEN)


# ---------------------------------------------------------------------------------------------------------------
# the router


def _app(monkeypatch, logdir: Path, token: str | None = TOKEN) -> AppTest:
    monkeypatch.setenv(LOGDIR_ENV, str(logdir))
    monkeypatch.delenv(auth.MODE_ENV, raising=False)
    if token is None:
        monkeypatch.delenv(auth.TOKEN_ENV, raising=False)
    else:
        monkeypatch.setenv(auth.TOKEN_ENV, token)
    return AppTest.from_file(str(MAIN), default_timeout=TIMEOUT)


def _only_sign_in(at: AppTest) -> None:
    assert not at.exception, [e.message for e in at.exception]
    assert [t.value for t in at.title] == ["Sign in"]
    assert len(at.text_input) == 1 and at.text_input[0].label == "Access token"
    assert not at.dataframe and not at.get("plotly_chart") and not at.get("arrow_vega_lite_chart")
    assert not at.metric and not at.sidebar.caption and not at.get("code")  # no log directory, no SQL
    assert not any(TOKEN in str(e.value) for e in [*at.markdown, *at.caption] if hasattr(e, "value"))


def test_without_the_token_the_router_shows_only_the_sign_in(monkeypatch, logdir):
    at = _app(monkeypatch, logdir)
    at.run()
    _only_sign_in(at)
    assert not at.error


def test_a_wrong_token_is_refused(monkeypatch, logdir):
    at = _app(monkeypatch, logdir)
    at.query_params["token"] = TOKEN[:-1] + "y"
    at.run()
    _only_sign_in(at)
    assert len(at.error) == 1 and "not the one" in at.error[0].value
    assert "token" not in at.query_params  # out of the address bar, right or wrong
    at.text_input[0].input("guess")
    at.button[0].click()
    at.run()
    _only_sign_in(at)
    assert len(at.error) == 1


def test_the_token_in_the_form_signs_in(monkeypatch, logdir):
    at = _app(monkeypatch, logdir)
    at.run()
    at.text_input[0].input(TOKEN)
    at.button[0].click()
    at.run()
    assert not at.exception and [t.value for t in at.title] == ["Runs"] and at.dataframe


def test_with_the_token_every_page_works(monkeypatch, logdir):
    at = _app(monkeypatch, logdir)
    at.query_params["token"] = TOKEN
    at.run()
    assert "token" not in at.query_params  # taken out of the address once accepted
    assert [t.value for t in at.title] == ["Runs"] and at.dataframe and at.get("plotly_chart")
    for page in PAGES:  # the session stays signed in: no token on the next runs
        at.switch_page(page.script)
        at.run()
        assert not at.exception, (page.title, [e.message for e in at.exception])
        assert [t.value for t in at.title] == [page.title]
        assert not at.text_input or all(t.label != "Access token" for t in at.text_input)


def test_with_no_token_set_the_router_is_unchanged(monkeypatch, logdir):
    at = _app(monkeypatch, logdir, token=None)
    at.run()
    assert not at.exception and [t.value for t in at.title] == ["Runs"] and at.dataframe


def test_an_oidc_dashboard_shows_the_provider_sign_in_until_signed_in(monkeypatch, logdir):
    at = _app(monkeypatch, logdir, token=None)
    monkeypatch.setenv(auth.MODE_ENV, "oidc")
    at.user = {"is_logged_in": False}
    at.secrets["auth"] = {"redirect_uri": "http://node:8501/oauth2callback", "cookie_secret": "s"}
    at.run()
    assert not at.exception and [t.value for t in at.title] == ["Sign in"]
    assert [b.label for b in at.button] == ["Sign in"] and not at.dataframe and not at.get("plotly_chart")
    at = _app(monkeypatch, logdir, token=None)
    at.user = {"is_logged_in": True, "email": "someone@example.com"}
    at.run()
    assert not at.exception and [t.value for t in at.title] == ["Runs"] and at.dataframe


# ---------------------------------------------------------------------------------------------------------------
# a real server in Chromium

CHROMIUM = Path("/usr/bin/chromium")
ARTIFACTS = ROOT / "test-artifacts" / "browser" / "auth"


@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium")
def test_in_chromium_no_run_data_without_the_token_and_the_runs_page_with_it(logdir):
    from playwright.sync_api import sync_playwright
    from test_browser import CHROMIUM_ARGS, _free_port, _settle, _wait_healthy

    shutil.rmtree(ARTIFACTS, ignore_errors=True)
    ARTIFACTS.mkdir(parents=True)
    run_ids = [p.name for p in runformat.run_dirs(logdir)]
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    exe = Path(sys.executable).with_name("trustscope")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", auth.TOKEN_ENV: TOKEN}
    proc = subprocess.Popen([str(exe), "dashboard", str(logdir), "--port", str(port)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    try:
        _wait_healthy(url, proc)
        with sync_playwright() as pw:
            chromium = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
            context = chromium.new_context(viewport={"width": 1200, "height": 800})
            page = context.new_page()
            for path in ("", "sql_console", f"?token={TOKEN[:-1]}y"):
                page.goto(f"{url}/{path}", wait_until="domcontentloaded")
                page.get_by_role("heading", name="Sign in").wait_for(timeout=60_000)
                _settle(page)
                html = page.content()
                assert page.locator(".js-plotly-plot, [data-testid='stDataFrame']").count() == 0, path
                assert not any(run in html for run in run_ids), f"/{path} shows run data"
                assert str(logdir) not in html and TOKEN not in html
            assert page.get_by_text("not the one").count() == 1 and "token=" not in page.url
            page.goto(f"{url}/", wait_until="domcontentloaded")
            page.get_by_role("heading", name="Sign in").wait_for(timeout=60_000)
            _settle(page)
            page.screenshot(path=str(ARTIFACTS / "sign_in.png"))

            page.goto(f"{url}/?token={TOKEN}", wait_until="domcontentloaded")
            page.get_by_role("heading", name="Runs").first.wait_for(timeout=60_000)
            _settle(page)
            page.wait_for_selector(".js-plotly-plot", timeout=30_000)
            deadline = time.monotonic() + 10
            while "token=" in page.url and time.monotonic() < deadline:
                page.wait_for_timeout(100)
            assert "token=" not in page.url, page.url
            assert TOKEN not in page.content() and any(run in page.content() for run in run_ids)
            assert any(c["name"] == auth.cookie_name(port) and TOKEN not in c["value"] for c in context.cookies())
            page.screenshot(path=str(ARTIFACTS / "signed_in.png"))

            page.reload(wait_until="domcontentloaded")  # a new session: the cookie keeps it signed in
            page.get_by_role("heading", name="Runs").first.wait_for(timeout=60_000)
            page.goto(f"{url}/sql_console", wait_until="domcontentloaded")
            page.get_by_role("heading", name="SQL console").first.wait_for(timeout=60_000)
            _settle(page)
            page.wait_for_selector("[data-testid='stDataFrame']", timeout=30_000)
            assert TOKEN not in page.content()

            other = chromium.new_page()  # another browser, no cookie: the sign-in again
            other.goto(f"{url}/", wait_until="domcontentloaded")
            other.get_by_role("heading", name="Sign in").wait_for(timeout=60_000)
            chromium.close()
    finally:
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
    assert TOKEN not in out, "the token is in the server's log"
    assert f"asks for the access token of --token / {auth.TOKEN_ENV}" in out
